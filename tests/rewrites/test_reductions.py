"""--fuse-reductions: which ReduceSums (with their Reshapes and Casts) become BlockReduceSum nodes,
and that the fused graph computes the unfused one's values.

Values come from onnx's reference evaluator with the op's numpy reference (float64 sums rounded
once), so these tests need no custom-op library; inputs are small integers, whose sums every
order of additions gives exactly. tests/ops/test_fuse_reductions.py runs the same kind of graphs
on ONNX Runtime's CPU provider with the library's kernel.
"""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from helpers import add_ints as _ints, float16_sum_read_as_float32, fused_outputs, named_model, ops as _ops

from onnxcampo.ops import reduce as block_reduce
from onnxcampo.rewrites.reductions import fuse_reductions

OP = block_reduce.OP_TYPE


def _model(text, *, opset=17, **ints):
    """An ONNX-text model (``named_model``) with an int64 initializer (axes, shapes) for each of ``ints``."""
    model = named_model(text, opset=opset)
    for name, values in ints.items():
        _ints(model, name, values)
    return model


def _feeds(model, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        feeds[value.name] = rng.integers(-8, 9, size=dims).astype(dtype)
    return feeds


def _fuse(model, *, exact=True):
    """The fused copy of ``model``, its result, and a check of its values against the unfused."""
    fused, result, want, got = fused_outputs(model, fuse_reductions, _feeds(model), [block_reduce.reference_op()])
    for value, expected, actual in zip(model.graph.output, want, got):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, value.name
        if exact:
            np.testing.assert_array_equal(actual, expected, err_msg=value.name)
    return fused, result


def _node(model):
    (node,) = [n for n in model.graph.node if n.op_type == OP]
    return node, {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_a_bias_gradient_is_one_node_over_the_rows():
    model = _model("""
    g (float[32,16,8] dy) => (float[8] db) {
      db = ReduceSum <keepdims = 0> (dy, axes)
    }""", axes=[0, 1])
    fused, result = _fuse(model)
    node, attrs = _node(fused)
    assert _ops(fused) == [OP] and list(node.input) == ["dy"] and list(node.output) == ["db"]
    assert attrs["sizes"] == [512, 8, 1] and attrs["output_type"] == TensorProto.FLOAT and attrs["output_shape"] == [8]
    assert not fused.graph.initializer  # the axes went with the ReduceSum
    assert result.to_json() == {"fused_nodes": 1, "reduce_sums_replaced": 1, "casts_folded": 0, "reshapes_folded": 0, "sums_shared": 0,
                                "kinds": {"column_sums": 1}}


def test_keepdims_and_the_axes_attribute_of_older_opsets_keep_the_output_shape():
    model = _model("""
    g (float[4,1,6] x, float[5,7] z) => (float[1,1,6] y, float[5,1] w) {
      y = ReduceSum <axes = [0, 1], keepdims = 1> (x)
      w = ReduceSum <axes = [-1]> (z)
    }""", opset=11)
    fused, result = _fuse(model)
    sizes = sorted(helper.get_attribute_value(a) for n in fused.graph.node for a in n.attribute if a.name == "sizes")
    shapes = sorted(helper.get_attribute_value(a) for n in fused.graph.node for a in n.attribute if a.name == "output_shape")
    assert _ops(fused) == [OP, OP] and sizes == [[1, 5, 7], [4, 6, 1]] and shapes == [[1, 1, 6], [5, 1]]
    assert result.kinds == {"column_sums": 1, "row_sums": 1}


def test_a_conv_bias_gradient_sums_the_batch_and_the_pixels():
    model = _model("""
    g (float[2,3,4,5] dy) => (float[3] db) {
      db = ReduceSum <keepdims = 0> (dy, axes)
    }""", axes=[0, 2, 3])
    fused, result = _fuse(model)
    assert _node(fused)[1]["sizes"] == [2, 3, 20] and result.kinds == {"blocks": 1}


def test_simplify_rule_7s_reduce_sum_pair_with_its_reshapes_is_one_node():
    from onnxcampo.training.simplify import simplify_backward

    model = _model("""
    g (float[2,3,4,5,1] dy) => (float[3] db) {
      r = ReduceSum <keepdims = 0> (dy, axes)
      db = Identity(r)
    }""", axes=[0, 2, 3, 4])
    simplify_backward(model, rules=["ReduceSum as matrix reductions", "Reshape chain"])
    assert _ops(model).count("ReduceSum") == 2 and "Reshape" in _ops(model)
    fused, result = _fuse(model)
    node, attrs = _node(fused)
    assert list(node.input) == ["dy"] and attrs["sizes"] == [2, 3, 20]
    assert result.reductions == 2 and result.reshapes >= 2 and "Reshape" not in _ops(fused)
    assert "ReduceSum" not in _ops(fused)


@pytest.mark.parametrize("text, ops, reads, output_type, casts", [
    pytest.param("""
    g (float16[64,8] dy) => (float[8] db) {
      d32 = Cast <to = 1> (dy)
      db = ReduceSum <keepdims = 0> (d32, axes)
    }""", [OP], "dy", TensorProto.FLOAT, 1, id="to_float32_read_only_by_the_reduction_is_folded"),
    pytest.param("""
    g (float[64,8] x) => (float16[8] y) {
      h = Cast <to = 10> (x)
      y = ReduceSum <keepdims = 0> (h, axes)
    }""", ["Cast", OP], "h", TensorProto.FLOAT16, 0, id="to_float16_before_the_reduction_stays_it_rounds"),
])
def test_a_cast_before_the_reduction(text, ops, reads, output_type, casts):
    model = _model(text, axes=[0])
    fused, result = _fuse(model)
    node, attrs = _node(fused)
    assert _ops(fused) == ops and list(node.input) == [reads] and attrs["output_type"] == output_type
    assert result.casts == casts


def test_a_cast_read_elsewhere_too_stays_and_the_node_reads_its_input():
    """Rule 3b: the widening Cast is read through (the node reads the float16 dy, half the
    bytes); it stays for the Neg."""
    model = _model("""
    g (float16[64,8] dy) => (float[8] db, float[64,8] n) {
      d32 = Cast <to = 1> (dy)
      db = ReduceSum <keepdims = 0> (d32, axes)
      n = Neg(d32)
    }""", axes=[0])
    fused, result = _fuse(model)
    assert sorted(_ops(fused)) == sorted([OP, "Cast", "Neg"]) and list(_node(fused)[0].input) == ["dy"]
    assert result.casts == 0


def _bias_gradients_of_a_residual(first: str, second: str, readers: str = "") -> onnx.ModelProto:
    """Two sums, named ``first`` and ``second``, of one float32 Cast of a float16 gradient dy, each
    through a Reshape (the graph outputs a and b: the sums, or what ``readers`` compute from them)."""
    return _model(f"""
    g (float16[64,8,5] dy) => (float[8] a, float[8] b) {{
      d32 = Cast <to = 1> (dy)
      r1 = Reshape(d32, shape)
      {first} = ReduceSum <keepdims = 0> (r1, axes)
      r2 = Reshape(d32, shape)
      {second} = ReduceSum <keepdims = 0> (r2, axes){readers}
    }}""", axes=[0, 2], shape=[64, 8, 5])


def test_a_cast_read_only_by_two_reductions_goes():
    """A residual gradient's two bias gradients (a ResNet stage's first block: the conv3 and the
    downsample bias) each sum the same float32 Cast of a float16 tensor: both read the float16
    tensor and the Cast goes."""
    fused, result = _fuse(_bias_gradients_of_a_residual("a", "b"))
    assert _ops(fused) == [OP, OP] and all(list(n.input) == ["dy"] for n in fused.graph.node)
    assert result.casts == 1 and result.fused == 2


def test_two_sums_of_one_tensor_are_one_node_and_its_output_is_read_twice():
    """Rule 6: the conv3 and downsample bias gradients of a ResNet stage's first block sum the
    same residual gradient; one node sums it, both readers read its output."""
    fused, result = _fuse(_bias_gradients_of_a_residual("s1", "s2", readers="""
      a = Neg(s1)
      b = Abs(s2)"""))
    assert _ops(fused) == [OP, "Neg", "Abs"] and list(fused.graph.node[0].input) == ["dy"]
    (out,) = fused.graph.node[0].output
    assert [n.input[0] for n in fused.graph.node[1:]] == [out, out]
    assert result.fused == 1 and result.shared == 1 and result.reductions == 2
    assert result.to_json()["sums_shared"] == 1
    assert {v.name for v in fused.graph.value_info} >= {out} and "s2" not in {v.name for v in fused.graph.value_info}


def test_sums_of_one_tensor_over_other_axes_or_to_other_types_stay_two_nodes():
    model = _model("""
    g (float16[64,8] dy) => (float[8] a, float16[8] b, float[64] c) {
      d32 = Cast <to = 1> (dy)
      s1 = ReduceSum <keepdims = 0> (d32, axes0)
      s2 = ReduceSum <keepdims = 0> (dy, axes0)
      s3 = ReduceSum <keepdims = 0> (d32, axes1)
      a = Neg(s1)
      b = Neg(s2)
      c = Neg(s3)
    }""", axes0=[0], axes1=[1])
    fused, result = _fuse(model)
    assert _ops(fused).count(OP) == 3 and result.shared == 0


def test_casts_after_the_reduction_are_folded_into_its_output_type():
    model = _model("""
    g (float[64,8] x, float16[16,4] h) => (float16[8] y, float[4] z) {
      s = ReduceSum <keepdims = 0> (x, axes)
      y = Cast <to = 10> (s)
      t = ReduceSum <keepdims = 0> (h, axes)
      z = Cast <to = 1> (t)
    }""", axes=[0])
    fused, result = _fuse(model)
    outputs = {n.output[0]: helper.get_attribute_value(next(a for a in n.attribute if a.name == "output_type"))
               for n in fused.graph.node}
    assert _ops(fused) == [OP, OP] and outputs == {"y": TensorProto.FLOAT16, "z": TensorProto.FLOAT}
    assert result.casts == 2


def test_a_float16_reduction_cast_to_float32_keeps_the_float32_sum():
    # the unfused graph rounds the sum to float16 first; the fused node writes the float32 sum
    model = float16_sum_read_as_float32(3, 2)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    fuse_reductions(fused)
    h = np.array([[2048, 1], [1, 0], [0, 0]], np.float16)  # 2049 is no float16
    (unfused,) = ReferenceEvaluator(model).run(None, {"h": h})
    (got,) = ReferenceEvaluator(fused, new_ops=[block_reduce.reference_op()]).run(None, {"h": h})
    assert unfused[0] == 2048 and got[0] == 2049 and got.dtype == np.float32


def test_a_reduction_whose_output_is_a_graph_output_keeps_its_name_and_its_readers():
    model = _model("""
    g (float[16,4] x) => (float[4] s, float16[4] y) {
      s = ReduceSum <keepdims = 0> (x, axes)
      y = Cast <to = 10> (s)
    }""", axes=[0])
    fused, _ = _fuse(model)
    node, _ = _node(fused)
    assert _ops(fused) == [OP, "Cast"] and list(node.output) == ["s"]


def test_the_output_gets_a_value_info_and_the_intermediates_lose_theirs():
    model = _model("""
    g (float16[64,8] dy) => (float[8] out) {
      d32 = Cast <to = 1> (dy)
      db = ReduceSum <keepdims = 0> (d32, axes)
      out = Neg(db)
    }""", axes=[0])
    model = onnx.shape_inference.infer_shapes(model)
    assert {v.name for v in model.graph.value_info} == {"d32", "db"}
    fused, _ = _fuse(model)
    (info,) = fused.graph.value_info
    assert info.name == "db" and info.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in info.type.tensor_type.shape.dim] == [8]


def test_shared_axes_constants_stay_for_the_nodes_that_still_read_them():
    model = _model("""
    g (float[16,4] x, float[4,5,6] z) => (float[4] s, float[4,6] m) {
      s = ReduceSum <keepdims = 0> (x, axes)
      m = ReduceSum <keepdims = 0> (z, one)
    }""", axes=[0], one=[1])
    fused, _ = _fuse(model)
    assert sorted(_ops(fused)) == sorted([OP, "ReduceSum"]) and [t.name for t in fused.graph.initializer] == ["one"]


@pytest.mark.parametrize("text, axes", [
    ("g (float[4,5,6] x) => (float[4,6] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [1]),  # kept on both sides
    ("g (float[4,5] x) => (float y) { y = ReduceSum <keepdims = 0> (x, axes) }", [0, 1]),  # everything: Q == 1
    ("g (float[4,1,6] x) => (float[4,6] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [1]),  # adds nothing up
    ("g (float[N,8] x) => (float[8] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [0]),  # dynamic shape
    ("g (int64[4,8] x) => (int64[8] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [0]),  # not a float
    ("g (double[4,8] x) => (double[8] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [0]),
    ("g (float[4,8] x, int64[1] a) => (float[8] y) { y = ReduceSum <keepdims = 0> (x, a) }", None),  # axes unknown
    ("g (float[4,8] x) => (float y) { y = ReduceSum <keepdims = 0> (x) }", None),  # no axes: all of them
    ("g (float[0,8] x) => (float[8] y) { y = ReduceSum <keepdims = 0> (x, axes) }", [0]),  # empty
])
def test_other_reductions_are_left_alone(text, axes):
    model = _model(text)
    if axes is not None:
        _ints(model, "axes", axes)
    result = fuse_reductions(model)
    assert result.fused == 0 and OP not in _ops(model)


def test_a_chain_stops_where_a_value_between_is_read_twice():
    model = _model("""
    g (float[4,6,5] x) => (float[6] y, float[4,6] m) {
      m = ReduceSum <keepdims = 0> (x, two)
      y = ReduceSum <keepdims = 0> (m, zero)
    }""", two=[2], zero=[0])
    fused, result = _fuse(model)
    assert _ops(fused) == [OP, OP] and result.reductions == 2  # two nodes: m is a graph output


def test_the_option_without_the_custom_op_library_is_one_clear_error(monkeypatch):
    from onnxcampo import ops, optimize
    from onnxcampo.config import OptimizeConfig
    from onnxcampo.errors import ConfigError

    model = _model("g (float[4,3] x) => (float[3] y) { y = ReduceSum <keepdims = 0> (x, axes) }", axes=[0])
    monkeypatch.setattr(ops, "available", lambda: False)
    with pytest.raises(ConfigError, match="^fuse_reductions .* custom-op library is not available"):
        optimize(model, config=OptimizeConfig(fuse_reductions=True))


def test_casts_and_reshapes_on_both_sides_of_a_reduction_pair_are_folded():
    # what a mixed plan leaves around rule 7's pair: a Cast to float32 before, a Cast to float16 after
    model = _model("""
    g (float16[2,3,4,5] dy) => (float16[3] db) {
      d32 = Cast <to = 1> (dy)
      v = Reshape(d32, shape)
      rows = ReduceSum <keepdims = 0> (v, two)
      total = ReduceSum <keepdims = 0> (rows, zero)
      r = Reshape(total, out)
      db = Cast <to = 10> (r)
    }""", shape=[2, 3, 20], two=[2], zero=[0], out=[3])
    fused, result = _fuse(model)
    node, attrs = _node(fused)
    assert _ops(fused) == [OP] and list(node.input) == ["dy"] and list(node.output) == ["db"]
    assert attrs["sizes"] == [2, 3, 20] and attrs["output_type"] == TensorProto.FLOAT16
    assert (result.reductions, result.casts, result.reshapes) == (2, 2, 2) and not fused.graph.initializer


def test_squeeze_unsqueeze_and_flatten_around_a_reduction_are_views_and_fold():
    model = _model("""
    g (float[8,1,6] x) => (float[6,1] y) {
      s = Squeeze(x, one)
      t = ReduceSum <keepdims = 1> (s, zero)
      f = Flatten <axis = 0> (t)
      y = Reshape(f, shape)
    }""", one=[1], zero=[0], shape=[6, 1])
    fused, result = _fuse(model)
    node, attrs = _node(fused)
    assert _ops(fused) == [OP] and list(node.input) == ["x"] and attrs["output_shape"] == [6, 1]
    assert result.reshapes == 3 and not fused.graph.initializer


def test_a_block_mean_is_a_float32_sum_times_one_over_its_count():
    """Rule 8: a BatchNorm's batch mean over N, H, W (keepdims) becomes one BlockReduceSum writing
    the float32 sum and a Mul by 1 / (N * H * W); its value is the mean's (exactly, on these small
    integers: the sum is exact and 1/512 a power of two)."""
    model = _model("""
    g (float[8,4,8,8] x) => (float[1,4,1,1] mean) {
      mean = ReduceMean <axes = [0, 2, 3], keepdims = 1> (x)
    }""")
    fused, result = _fuse(model)
    assert _ops(fused) == [OP, "Mul"]
    node, attrs = _node(fused)
    assert attrs["sizes"] == [8, 4, 64] and attrs["output_type"] == TensorProto.FLOAT
    mul = fused.graph.node[1]
    assert mul.input[0] == node.output[0] and mul.output[0] == "mean"
    scale = next(t for t in fused.graph.initializer if t.name == mul.input[1])
    assert onnx.numpy_helper.to_array(scale) == np.float32(1 / 512)
    assert result.to_json()["reduce_sums_replaced"] == 1 and result.to_json()["kinds"] == {"blocks": 1}


def test_a_float16_mean_whose_float16_sum_would_overflow_stays_finite():
    """A float16 mean of 800 values near 100: the sum (80,000) exceeds float16's 65,504, the mean
    does not. The BlockReduceSum writes the sum in float32; the mean is cast to float16 after
    the division, as ReduceMean rounds it."""
    model = _model("""
    g (float16[8,4,100] x) => (float16[1,4,1] mean) {
      mean = ReduceMean <axes = [0, 2], keepdims = 1> (x)
    }""")
    fused = onnx.ModelProto.FromString(model.SerializeToString())
    fuse_reductions(fused)
    assert _ops(fused) == [OP, "Mul", "Cast"]
    x = np.full((8, 4, 100), 100.0, np.float16)
    (got,) = ReferenceEvaluator(fused, new_ops=[block_reduce.reference_op()]).run(None, {"x": x})
    assert got.dtype == np.float16 and np.all(got == np.float16(100.0))


def test_a_mean_is_not_continued_into_a_sum_and_is_not_shared_with_one():
    """A ReduceMean is a chain of its own (never merged with the ReduceSum after it, rule 2), and a
    mean and a sum of the same tensor over the same blocks stay two nodes (rule 6 keys on it)."""
    model = _model("""
    g (float[8,4,16] x) => (float[4] s, float[1,4,1] m, float[4] t) {
      s = ReduceSum <keepdims = 0> (x, axes)
      m = ReduceMean <axes = [0, 2], keepdims = 1> (x)
      r = ReduceMean <axes = [2], keepdims = 0> (x)
      t = ReduceSum <keepdims = 0> (r, first)
    }""", axes=[0, 2], first=[0])
    fused, result = _fuse(model)
    # s; m's sum; r's sum, then t over r's mean (not one sum of x over [8, 4, 16]: that is s)
    assert [n.op_type for n in fused.graph.node].count(OP) == 4
    assert result.to_json()["sums_shared"] == 0
