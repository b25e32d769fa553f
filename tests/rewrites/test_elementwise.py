"""--fuse-elementwise: which chains become FusedElementwise nodes, and that the fused model computes
the unfused one's values (reference evaluator: fp16 rounding seen)."""

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from helpers import BIAS_GELU_CHAIN, fused_first_output_on_ort, fused_outputs, named_model as _model, ops as _ops

from onnxcampo import ir
from onnxcampo.rewrites.elementwise import fuse_elementwise
from onnxcampo.ops import elementwise as ew


def _same_values(model, feeds, exact=True):
    fused_model, result, unfused, got = fused_outputs(model, fuse_elementwise, feeds, [ew.reference_op()])
    for want, have in zip(unfused, got):
        assert want.dtype == have.dtype and want.shape == have.shape
        if exact:
            np.testing.assert_array_equal(have, want)
        else:
            np.testing.assert_allclose(have.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
    return fused_model, result


def _mask_model(text):
    """An ONNX-text model whose ReLU masks compare with ``zero``, a float32 scalar initializer."""
    model = _model(text)
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    return model


def test_a_bias_gelu_chain_with_its_casts_becomes_one_node_with_the_same_fp16_values():
    model = _model("""
    g (float[4,8] x, float16[8] bias) => (float[4,8] y) {""" + BIAS_GELU_CHAIN + """
    }
    """)
    for name, value in (("s", 0.70710678), ("one", 1.0), ("half", 0.5)):  # scalars as a campo plan leaves them
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.float16), name))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "bias": rng.standard_normal(8).astype(np.float16)}
    fused, result = _same_values(model, feeds, exact=False)  # Erf: scipy's float32 erf vs onnx's float16 one
    assert _ops(fused) == [ew.OP_TYPE] and result.nodes == 8
    node = fused.graph.node[0]
    assert list(node.input) == ["x", "bias"] and list(node.output) == ["y"]
    assert sorted(ir.attribute(node, "constants")) == pytest.approx([0.5, 0.70710678, 1.0], rel=1e-3)


def test_arithmetic_in_fp16_is_rounded_where_the_graph_rounds():
    model = _model("""
    g (float[64] x) => (float[64] y) {
      h = Cast <to = 10> (x)
      m = Mul(h, h)
      a = Add(m, h)
      y = Cast <to = 1> (a)
    }
    """)
    feeds = {"x": np.linspace(-4, 4, 64, dtype=np.float32) + np.float32(1e-3)}
    fused, _ = _same_values(model, feeds, exact=True)
    assert _ops(fused) == [ew.OP_TYPE]


def test_an_intermediate_read_outside_the_chain_is_an_output_of_the_fused_node():
    model = _model("""
    g (float[2,3] x) => (float[2,3] y, float[3,2] t) {
      a = Relu(x)
      b = Neg(a)
      y = Exp(b)
      t = Transpose(a)
    }
    """)
    fused, _ = _same_values(model, {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 3}, exact=False)
    node = next(n for n in fused.graph.node if n.op_type == ew.OP_TYPE)
    assert set(node.output) == {"a", "y"}


def test_a_node_reached_from_the_chain_through_an_outside_node_does_not_join_it():
    # a -> Transpose -> p; c = Add(a, p) would put the Transpose inside a cycle
    model = _model("""
    g (float[3,3] x) => (float[3,3] y) {
      a = Relu(x)
      b = Neg(a)
      p = Transpose(b)
      c = Add(b, p)
      y = Exp(c)
    }
    """)
    fused, result = _same_values(model, {"x": np.arange(9, dtype=np.float32).reshape(3, 3) - 4}, exact=False)
    assert result.groups == 2 and _ops(fused).count("Transpose") == 1


def test_broadcast_inputs_join_but_a_smaller_result_starts_its_own_group():
    model = _model("""
    g (float[4,8] x, float[4,1] s, float[8] b) => (float[4,8] y, float[4,1] z) {
      z0 = Neg(s)
      z = Exp(z0)
      a = Add(x, b)
      y = Mul(a, z)
    }
    """)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "s": rng.standard_normal((4, 1)).astype(np.float32),
             "b": rng.standard_normal(8).astype(np.float32)}
    fused, result = _same_values(model, feeds, exact=False)
    assert result.groups == 2 and sorted(result.by_size.items()) == [(2, 2)]


def test_a_long_chain_is_cut_within_the_kernels_limits():
    lines = ["h0 = Relu(x)"] + [f"h{i} = {'Neg' if i % 2 else 'Abs'}(h{i - 1})" for i in range(1, 60)] + ["y = Identity(h59)"]
    model = _model("g (float[16] x) => (float[16] y) {\n" + "\n".join(lines) + "\n}")
    fused, result = _same_values(model, {"x": np.linspace(-1, 1, 16, dtype=np.float32)})
    assert result.groups >= 3 and result.nodes == 61 and set(_ops(fused)) == {ew.OP_TYPE}


def test_dynamic_shapes_and_other_types_are_left_alone():
    model = _model("""
    g (float[N,8] x, int64[8] i) => (float[N,8] y, int64[8] j) {
      a = Relu(x)
      y = Neg(a)
      k = Neg(i)
      j = Abs(k)
    }
    """)
    result = fuse_elementwise(model)
    assert result.groups == 0 and ew.OP_TYPE not in _ops(model)


@pytest.mark.parametrize("width", [8, 40])
def test_many_escaping_values_are_cut_to_the_output_limit(width):
    # every Relu result is read outside (a graph output): more than MAX_OUTPUTS cannot be one node
    outs = ", ".join(f"float[4] y{i}" for i in range(width))
    body = "\n".join(f"y{i} = Relu(x)" if i == 0 else f"y{i} = Neg(y{i - 1})" for i in range(width))
    model = _model(f"g (float[4] x) => ({outs}) {{\n{body}\n}}")
    fused, result = _same_values(model, {"x": np.array([-1, 0, 1, 2], np.float32)})
    assert all(len(n.output) <= ew.MAX_OUTPUTS for n in fused.graph.node)


def test_the_option_without_the_custom_op_library_is_one_clear_error(monkeypatch, tmp_path):
    from onnxcampo import ops, optimize
    from onnxcampo.config import OptimizeConfig
    from onnxcampo.errors import ConfigError

    model = _model("g (float[4] x) => (float[4] y) {\n a = Relu(x)\n y = Neg(a)\n}")
    monkeypatch.setattr(ops, "available", lambda: False)
    with pytest.raises(ConfigError, match="^fuse_elementwise .* custom-op library is not available"):
        optimize(model, config=OptimizeConfig(fuse_elementwise=True))


def test_a_bias_cast_read_only_by_the_chain_is_computed_in_it():
    # the Cast of an fp32 bias [8] (a launch of its own) joins the Add that broadcasts it
    model = _model("""
    g (float16[4,8] x, float[8] b) => (float16[4,8] y) {
      b16 = Cast <to = 10> (b)
      y = Add(x, b16)
    }
    """)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float16), "b": rng.standard_normal(8).astype(np.float32)}
    fused, result = _same_values(model, feeds)
    assert _ops(fused) == [ew.OP_TYPE] and list(fused.graph.node[0].input) == ["x", "b"]


def test_a_cast_read_outside_the_chain_too_stays_a_node_of_its_own():
    model = _model("""
    g (float16[4,8] x, float[8] b) => (float16[4,8] y, float16[8] b16) {
      b16 = Cast <to = 10> (b)
      y = Add(x, b16)
    }
    """)
    result = fuse_elementwise(model)
    assert result.groups == 0 and _ops(model) == ["Cast", "Add"]


def test_a_sum_of_several_terms_is_a_chain_of_additions_rounded_as_in_fp16():
    model = _model("""
    g (float16[16] a, float16[16] b, float16[16] c) => (float[16] y) {
      s = Sum(a, b, c)
      y = Cast <to = 1> (s)
    }
    """)
    rng = np.random.default_rng(4)
    feeds = {k: (rng.standard_normal(16) * 100).astype(np.float16) for k in "abc"}
    fused, _ = _same_values(model, feeds)
    assert _ops(fused) == [ew.OP_TYPE]


@pytest.mark.skipif("not __import__('onnxcampo').ops.available()", reason="custom-op library not built")
def test_an_fp16_chain_between_ops_ort_cpu_runs_in_fp32_loads_and_runs_there():
    """ORT's CPU provider runs an fp16 node whose neighbours have no fp16 kernels in fp32 (it
    casts around it); the fused node, told its input types, writes its fp16 outputs as fp32 then.
    A wiring check on ORT CPU (which hides fp16 rounding): the values match the unfused model's."""
    model = _model("""
    g (float16[4,8] x, float16[4,8] mask) => (float16[4,8] y) {
      s = Softmax <axis = -1> (x)
      c = Constant <value = float[1] {0.125}> ()
      h = Cast <to = 10> (c)
      m = Mul(s, h)
      a = Add(m, mask)
      y = Softmax <axis = -1> (a)
    }
    """)
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float16), "mask": rng.standard_normal((4, 8)).astype(np.float16)}
    result, want, got = fused_first_output_on_ort(model, fuse_elementwise, feeds)
    assert result.groups == 1
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3)


def test_a_relu_backward_mask_fuses_with_its_cast_and_product():
    """``Cast(Greater(x, 0)) * dy`` (onnx-ad's ReLU adjoint, fp16 as a campo plan runs it): one node
    whose program compares (1.0 / 0.0 in a register); NaN and -0.0 compare as ONNX's Greater does."""
    model = _model("""
    g (float16[6,8] x, float16[6,8] dy) => (float16[6,8] y) {
      m = Greater(x, zero)
      f = Cast <to = 10> (m)
      y = Mul(f, dy)
    }
    """)
    model.graph.initializer.append(numpy_helper.from_array(np.array([0.0], np.float16), "zero"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 8)).astype(np.float16)
    x.flat[:4] = [np.nan, -0.0, 0.0, np.inf]
    feeds = {"x": x, "dy": rng.standard_normal((6, 8)).astype(np.float16)}
    fused, result = _same_values(model, feeds, exact=True)
    assert _ops(fused) == [ew.OP_TYPE] and result.nodes == 3
    program = ir.attribute(fused.graph.node[0], "program")
    assert ew.Op.GREATER in program[::4] and list(fused.graph.node[0].input) == ["x", "dy"]


@pytest.mark.parametrize("op, code", [("Less", ew.Op.LESS), ("GreaterOrEqual", ew.Op.GREATER_EQUAL),
                                      ("LessOrEqual", ew.Op.LESS_EQUAL), ("Equal", ew.Op.EQUAL)])
def test_every_comparison_fuses_into_float_casts(op, code):
    model = _model(f"""
    g (float[16] a, float[16] b) => (float[16] y) {{
      m = {op}(a, b)
      f = Cast <to = 1> (m)
      y = Add(f, a)
    }}
    """)
    a = np.arange(16, dtype=np.float32) - 8
    b = np.where(np.arange(16) % 3 == 0, a, -a).astype(np.float32)
    fused, _ = _same_values(model, {"a": a, "b": b}, exact=True)
    assert _ops(fused) == [ew.OP_TYPE] and code in ir.attribute(fused.graph.node[0], "program")[::4]


def test_a_mask_read_as_bool_elsewhere_stays_unfused():
    """The bool is never an output of the kernel: a comparison whose bool another op reads (Not,
    Where, a graph output) stays as it is, and so does its Cast."""
    model = _model("""
    g (float[16] a, float[16] dy, float[16] other) => (float[16] y, float[16] z) {
      m = Greater(a, dy)
      f = Cast <to = 1> (m)
      y = Mul(f, dy)
      z = Where(m, a, other)
    }
    """)
    a = np.linspace(-2, 2, 16, dtype=np.float32)
    fused, result = _same_values(model, {"a": a, "dy": a[::-1].copy(), "other": a * 2}, exact=True)
    assert "Greater" in _ops(fused) and "Cast" in _ops(fused) and result.groups == 0


def scaled_chain(n: int, weight: str | None = None) -> str:
    """MatMul -> Mul by a constant 0.125 (ORT's MatMulScaleFusion folds it) -> Add -> Relu -> Exp
    on [n, n]; the weight an input, or ``weight`` (ONNX text) a Constant."""
    head = f"float[{n},{n}] x, float[{n},{n}] bias" + ("" if weight else f", float[{n},{n}] w")
    const = f"w = Constant <value = float[{n},{n}] {{{weight}}}> ()" if weight else ""
    return f"""
    g ({head}) => (float[{n},{n}] y) {{
      {const}
      m = MatMul(x, w)
      s = Constant <value = float {{0.125}}> ()
      a = Mul(m, s)
      b = Add(a, bias)
      c = Relu(b)
      y = Exp(c)
    }}
    """


def test_nodes_left_to_onnx_runtime_are_not_fused():
    """leave: those nodes stay as they are (ORT fuses them itself); the chain around them fuses
    in the parts it still has, with the same values."""
    text = scaled_chain(8)
    model = _model(text)
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    assert fuse_elementwise(plain).nodes == 4  # Mul, Add, Relu, Exp
    mul = next(n.name for n in model.graph.node if n.op_type == "Mul")
    result = fuse_elementwise(model, leave={mul})
    assert result.groups == 1 and result.nodes == 3 and "Mul" in _ops(model)
    feeds = {"x": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "w": np.eye(8, dtype=np.float32),
             "bias": np.full((8, 8), 0.25, np.float32)}
    want = ReferenceEvaluator(_model(text)).run(None, feeds)[0]
    got = ReferenceEvaluator(model, new_ops=[ew.reference_op()]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)



CONV_RELU = """
g (float16[2,3,6,6] x, float16[4,3,3,3] w, float16[4] b) => (float16[2,4,6,6] y, float16[2,4,3,3] p) {{
  c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
  r = Relu(c)
  y = Add(r, r)
  p = {reader}(c)
}}
"""


def _conv_feeds():
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((2, 3, 6, 6)).astype(np.float16),
            "w": (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float16),
            "b": rng.standard_normal(4).astype(np.float16)}


def test_a_conv_bias_moves_into_the_group_that_reads_the_conv():
    """Conv(x, W, b) -> Relu: the bias Add joins the Relu's group (cuDNN's separate bias pass
    gone); same values in fp16 (the reference rounds the convolution before the bias, as cuDNN)."""
    model = _model(CONV_RELU.format(reader="Neg").replace("float16[2,4,3,3] p", "float16[2,4,6,6] p"))
    fused, result = _same_values(model, _conv_feeds(), exact=False)
    conv = next(n for n in fused.graph.node if n.op_type == "Conv")
    assert list(conv.input) == ["x", "w"] and result.biases == 1
    group = next(n for n in fused.graph.node if n.op_type == ew.OP_TYPE)
    assert "b" not in group.input and any("conv_bias" in name for name in group.input)
    assert _ops(fused).count(ew.OP_TYPE) == 1 and "Add" not in _ops(fused)


def test_a_conv_bias_stays_when_a_reader_cannot_be_fused_or_when_asked():
    model = _model(CONV_RELU.format(reader="MaxPool <kernel_shape = [2, 2], strides = [2, 2]>"))
    fused, result = _same_values(model, _conv_feeds(), exact=False)
    assert result.biases == 0 and len(next(n for n in fused.graph.node if n.op_type == "Conv").input) == 3
    model = _model(CONV_RELU.format(reader="Neg").replace("float16[2,4,3,3] p", "float16[2,4,6,6] p"))
    assert fuse_elementwise(model, split_biases=False).biases == 0
    assert len(next(n for n in model.graph.node if n.op_type == "Conv").input) == 3


def test_a_gemm_bias_moves_into_the_group_also_through_a_reshape_that_keeps_the_last_axis():
    """Gemm(a, B, c) -> Reshape -> Add(residual) as a torch Linear exports: the bias Add joins the
    residual's group after the Reshape; fp16 values within one rounding of the unfused graph."""
    model = _model("""
    g (float16[6,8] a, float16[8,4] w, float16[4] c, float16[2,3,4] r) => (float16[2,3,4] y) {
      m = Gemm(a, w, c)
      v = Reshape(m, shape)
      y = Add(v, r)
    }
    """)
    model.graph.initializer.append(numpy_helper.from_array(np.array([2, 3, 4], np.int64), "shape"))
    rng = np.random.default_rng(5)
    feeds = {"a": rng.standard_normal((6, 8)).astype(np.float16), "w": rng.standard_normal((8, 4)).astype(np.float16),
             "c": rng.standard_normal(4).astype(np.float16), "r": rng.standard_normal((2, 3, 4)).astype(np.float16)}
    fused, result = _same_values(model, feeds, exact=False)
    assert result.biases == 1 and _ops(fused) == ["Gemm", "Reshape", ew.OP_TYPE]
    assert list(next(n for n in fused.graph.node if n.op_type == "Gemm").input) == ["a", "w"]
    assert "c" in next(n for n in fused.graph.node if n.op_type == ew.OP_TYPE).input


def test_a_backward_chain_reading_a_forward_value_is_not_pulled_into_the_forward_group():
    """Rule 2c: y = Relu(x + b) in the forward, dh = MatMul(MatMul(y, w), w) standing for the
    gradient that reaches the ReLU, and the backward mask Cast(Greater(y, 0)) * dh. The mask's
    chain would join the forward group (its producer), which would then write the mask for the
    product (dh depends on the forward group through the MatMuls: the product cannot join it).
    Instead the chain and the product form one group that reads y: the forward group writes y
    alone. Same values."""
    model = _mask_model("""
    g (float[4,8] x, float[8] b, float[8,8] w) => (float[4,8] h, float[4,8] dx) {
      a = Add(x, b)
      y = Relu(a)
      h = MatMul(y, w)
      dh = MatMul(h, w)
      yf = Identity(y)
      m = Greater(yf, zero)
      mf = Cast <to = 1> (m)
      dx = Mul(dh, mf)
    }
    """)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32),
             "w": rng.standard_normal((8, 8)).astype(np.float32)}
    fused, result = _same_values(model, feeds)
    groups = [n for n in fused.graph.node if n.op_type == ew.OP_TYPE]
    forward = next(n for n in groups if "x" in n.input)
    backward = next(n for n in groups if "dx" in n.output)
    assert list(forward.output) == ["y"]  # the mask is not written
    assert "y" in backward.input and "Mul" not in _ops(fused) and len(groups) == 2


def test_a_mask_group_read_only_by_the_product_joins_its_group():
    """Rule 2b for a group of two: a ReLU's mask computed on a Reshape of the forward value (the
    seed axis of the gradient it gates, simplify's rule 9b) starts a group of its own, the
    comparison and its Cast; the product joins the gradient's group (its first input's). The
    mask group, read by nothing else, then joins the product's group: one backward kernel, no
    mask written. Same values."""
    model = _mask_model("""
    g (float[4,8] y, float[4,8,1] a, float[4,8,1] b) => (float[4,8,1] dx) {
      seed = Constant <value = int64[3] {4, 8, 1}> ()
      yr = Reshape(y, seed)
      m = Greater(yr, zero)
      mf = Cast <to = 1> (m)
      dy = Add(a, b)
      dx = Mul(dy, mf)
    }
    """)
    rng = np.random.default_rng(5)
    feeds = {"y": np.maximum(rng.standard_normal((4, 8)), 0).astype(np.float32),
             "a": rng.standard_normal((4, 8, 1)).astype(np.float32), "b": rng.standard_normal((4, 8, 1)).astype(np.float32)}
    fused, result = _same_values(model, feeds)
    groups = [n for n in fused.graph.node if n.op_type == ew.OP_TYPE]
    assert len(groups) == 1 and list(groups[0].output) == ["dx"] and result.nodes == 4


def test_a_widening_cast_before_a_reshape_moves_after_it_and_joins_the_readers():
    """Rule 0: the float16 activation y, cast to float32 for a float32 mask that reads it
    reshaped (the plan keeps the comparison float32): Reshape(Cast(y)) becomes Cast(Reshape(y)),
    so y's group does not write a float32 copy of y and the Cast joins the mask's kernel. A Cast
    whose Reshape feeds a non-fusable op (the MatMul) stays where it is. Same values."""
    model = _mask_model("""
    g (float16[4,8] x, float[4,8,1] dy, float[8,8] w) => (float[4,8,1] dx, float16[4,8] y2, float[4,8] z) {
      y = Relu(x)
      y2 = Neg(y)
      seed = Constant <value = int64[3] {4, 8, 1}> ()
      flat = Constant <value = int64[2] {4, 8}> ()
      y32 = Cast <to = 1> (y)
      yr = Reshape(y32, seed)
      m = Greater(yr, zero)
      mf = Cast <to = 1> (m)
      dx = Mul(dy, mf)
      n32 = Cast <to = 1> (y2)
      nr = Reshape(n32, flat)
      z = MatMul(nr, w)
    }
    """)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float16), "dy": rng.standard_normal((4, 8, 1)).astype(np.float32),
             "w": rng.standard_normal((8, 8)).astype(np.float32)}
    fused, result = _same_values(model, feeds)
    assert result.casts_moved == 1
    written = {o for n in fused.graph.node if n.op_type == ew.OP_TYPE for o in n.output}
    assert "y32" not in written  # no float32 copy of y leaves a kernel
    reshapes = {n.output[0]: n.input[0] for n in fused.graph.node if n.op_type == "Reshape"}
    assert reshapes["y32"] == "y" and reshapes["nr"] == "n32"  # the first reshapes float16 y now


# ---- rule 4: column sums -------------------------------------------------------------------

BIAS_GRADIENT = """
g (float16[4,6,8] x, float16[4,6,8] dy, float16[8,5] w) => (float16[24,5] dx, float[8] db) {
  m = Greater(x, zero)
  f = Cast <to = 10> (m)
  g = Mul(f, dy)
  flat = Reshape(g, rows)
  dx = MatMul(flat, w)
  wide = Cast <to = 1> (flat)
  db = ReduceSum <keepdims = 0> (wide, axes)
}
"""


def _bias_gradient_model():
    model = _model(BIAS_GRADIENT)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0.0], np.float16), "zero"),
                                    numpy_helper.from_array(np.array([24, 8], np.int64), "rows"),
                                    numpy_helper.from_array(np.array([0], np.int64), "axes")])
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 6, 8)).astype(np.float16),
             "dy": rng.integers(-8, 9, (4, 6, 8)).astype(np.float16),  # integers: every order sums them exactly
             "w": rng.integers(-2, 3, (8, 5)).astype(np.float16)}
    return model, feeds


def _both_fusions(model, feeds, **options):
    """fuse_reductions then fuse_elementwise (the pipeline's order) on a copy; the values checked
    against the unfused model's (exactly: integer data)."""
    from onnxcampo.ops import reduce as block_reduce
    from onnxcampo.rewrites.reductions import fuse_reductions

    def fuse(copy):
        fuse_reductions(copy)
        return fuse_elementwise(copy, **options)

    fused, result, want, got = fused_outputs(model, fuse, feeds, [ew.reference_op(), block_reduce.reference_op()])
    for expected, actual in zip(want, got):
        assert expected.dtype == actual.dtype and expected.shape == actual.shape
        np.testing.assert_array_equal(actual, expected)
    return fused, result


def test_a_bias_gradient_sum_of_a_fused_output_becomes_its_column_sums():
    """The sum reads the chain's output through a Reshape (and a Cast that fuse_reductions folds):
    the fused node writes the sums as one more output, under the sum's name; the Reshape stays
    (the MatMul reads it), the BlockReduceSum goes."""
    model, feeds = _bias_gradient_model()
    fused, result = _both_fusions(model, feeds)
    assert sorted(_ops(fused)) == ["FusedElementwise", "MatMul", "Reshape"] and result.column_sums == 1
    node = next(n for n in fused.graph.node if n.op_type == ew.OP_TYPE)
    assert ir.attribute(node, "column_sums") == [0, 8] and ir.attribute(node, "column_sums_type") == 1
    assert list(node.output)[-1] == "db" and result.to_json()["column_sums"] == 1


def test_column_sums_off_keeps_the_block_reduce_sum():
    model, feeds = _bias_gradient_model()
    fused, result = _both_fusions(model, feeds, column_sums=False)
    assert "BlockReduceSum" in _ops(fused) and result.column_sums == 0
    assert all(ir.attribute(n, "column_sums") is None for n in fused.graph.node)


def test_a_view_only_the_sum_reads_goes_with_it_and_a_float16_sum_keeps_its_type():
    model = _model("""
    g (float16[4,6,8] x, float16[4,6,8] dy) => (float16[4,6,8] gr, float16[1,8] db) {
      m = Greater(x, zero)
      f = Cast <to = 10> (m)
      gr = Mul(f, dy)
      flat = Reshape(gr, rows)
      db = ReduceSum <keepdims = 1> (flat, axes)
    }
    """)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0.0], np.float16), "zero"),
                                    numpy_helper.from_array(np.array([24, 8], np.int64), "rows"),
                                    numpy_helper.from_array(np.array([0], np.int64), "axes")])
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 6, 8)).astype(np.float16),
             "dy": rng.integers(-8, 9, (4, 6, 8)).astype(np.float16)}
    fused, result = _both_fusions(model, feeds)
    assert _ops(fused) == [ew.OP_TYPE] and result.column_sums == 1
    node = fused.graph.node[0]
    assert ir.attribute(node, "column_sums_type") == 10 and ir.attribute(node, "column_sums_shape") == [1, 8]
    assert not any(t.name == "rows" for t in fused.graph.initializer)  # the Reshape's shape went with it


def test_row_sums_and_a_second_sum_of_one_node_stay_block_reduce_sums():
    """A sum over trailing axes (R > 1) is no column sum; a node gets one column sum, the first."""
    model = _model("""
    g (float16[4,6,8] x, float16[4,6,8] dy) => (float[8] a, float[8] b, float[4] c) {
      m = Greater(x, zero)
      f = Cast <to = 10> (m)
      gr = Mul(f, dy)
      neg = Neg(gr)
      h = Mul(gr, two)
      wide = Cast <to = 1> (gr)
      a = ReduceSum <keepdims = 0> (wide, axes01)
      wide2 = Cast <to = 1> (h)
      b = ReduceSum <keepdims = 0> (wide2, axes01)
      wide3 = Cast <to = 1> (neg)
      c = ReduceSum <keepdims = 0> (wide3, axes12)
    }
    """)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0.0], np.float16), "zero"),
                                    numpy_helper.from_array(np.array([2.0], np.float16), "two"),
                                    numpy_helper.from_array(np.array([0, 1], np.int64), "axes01"),
                                    numpy_helper.from_array(np.array([1, 2], np.int64), "axes12")])
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((4, 6, 8)).astype(np.float16),
             "dy": rng.integers(-8, 9, (4, 6, 8)).astype(np.float16)}
    fused, result = _both_fusions(model, feeds)
    assert result.column_sums == 1 and _ops(fused).count("BlockReduceSum") == 2
    (node,) = [n for n in fused.graph.node if n.op_type == ew.OP_TYPE]
    assert list(node.output)[-1] == "a"
