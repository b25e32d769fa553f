"""MultiTensorCast: a training step's float32 -> float16 weight Casts as one node.

The CPU kernel against numpy's float16 conversion bit for bit (round to nearest even, overflow to
inf, subnormals, NaN), on ONNX Runtime's CPU provider with the library; the rewrite in
``fuse_elementwise`` with the ONNX reference evaluator (which computes float16 ops in float16),
and the op's shape inference (a node after the cast weights needs their rank)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxcampo import ir
from onnxcampo.rewrites.elementwise import fuse_elementwise
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session, run



def _cast_model(shapes):
    names = [f"x{k}" for k in range(len(shapes))]
    node = op_nodes.multi_tensor_cast(names, [f"y{k}" for k in range(len(shapes))], name="casts")
    graph = helper.make_graph(
        [node], "casts", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
        [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT16, s) for k, s in enumerate(shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    op_nodes.import_domain(model)
    return model


def test_the_cpu_kernel_rounds_as_numpy_bit_for_bit(library):
    """Every float16 rounding case: ties to even, the largest float16 and beyond (inf at 65520),
    subnormals and their underflow, signed zeros, inf and NaN; tensors of 1 to 200,000 elements
    (the kernel's chunks cut across tensors)."""
    specials = np.array([0.0, -0.0, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 65504.0, 65519.99, 65520.0, -7e4,
                         2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30, np.inf, -np.inf, np.nan], np.float32)
    rng = np.random.default_rng(0)
    values = [specials, rng.standard_normal((3, 5)).astype(np.float32) * 1e3, np.float32([1.5]),
              (rng.standard_normal(200_000) * 30).astype(np.float32).reshape(400, 500)]
    session = make_session(_cast_model([list(v.shape) for v in values]))
    got = run(session, {f"x{k}": v for k, v in enumerate(values)})
    for k, value in enumerate(values):
        out = got[f"y{k}"]
        with np.errstate(over="ignore"):
            want = value.astype(np.float16)
        assert out.dtype == np.float16 and out.shape == value.shape
        np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))


def _step_like():
    """Two weights and the input cast to float16 for a MatMul chain (the MatMuls need the cast
    tensors' rank on ORT), and a float16 -> float32 Cast that the rewrite must leave alone."""
    model = onnx.parser.parse_model('''<ir_version: 8, opset_import: ["" : 17]>
    g (float[4,8] x, float[8,8] w1, float[8,3] w2) => (float[4,3] y, float[4,8] h32) {
      x16 = Cast <to = 10> (x)
      a = Cast <to = 10> (w1)
      b = Cast <to = 10> (w2)
      h = MatMul(x16, a)
      h32 = Cast <to = 1> (h)
      o = MatMul(h, b)
      y = Cast <to = 1> (o)
    }''')
    ir.name_nodes(model)
    return model


def test_the_weight_casts_become_one_node_with_the_same_values(library):
    model = _step_like()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "w1": rng.standard_normal((8, 8)).astype(np.float32),
             "w2": rng.standard_normal((8, 3)).astype(np.float32)}
    want = ReferenceEvaluator(model).run(None, feeds)
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    result = fuse_elementwise(fused)
    onnx.checker.check_model(fused)
    first = fused.graph.node[0]
    assert result.weight_casts == 3 and first.op_type == op_nodes.MULTI_TENSOR_CAST
    assert list(first.input) == ["x", "w1", "w2"] and list(first.output) == ["x16", "a", "b"]
    assert [n.op_type for n in fused.graph.node].count("Cast") == 2  # the fp16 -> fp32 Casts stay
    got = ReferenceEvaluator(fused, new_ops=[op_nodes.multi_tensor_cast_reference_op(), ew.reference_op()]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    on_ort = run(make_session(fused), feeds)  # loads: the MatMuls see the casts' shapes
    assert on_ort["y"].shape == (4, 3) and on_ort["h32"].shape == (4, 8)


def test_one_cast_or_the_option_off_leaves_the_casts(library):
    one = onnx.parser.parse_model('''<ir_version: 8, opset_import: ["" : 17]>
    g (float[4,8] x, float[8,3] w) => (float[4,3] y) {
      x16 = Cast <to = 10> (x)
      w16 = Cast <to = 10> (w)
      o = MatMul(x16, w16)
      y = Cast <to = 1> (o)
    }''')
    ir.name_nodes(one)
    assert fuse_elementwise(one, group_weight_casts=False).weight_casts == 0
    assert op_nodes.MULTI_TENSOR_CAST not in [n.op_type for n in one.graph.node]
    model = _step_like()
    assert fuse_elementwise(model, group_weight_casts=False).weight_casts == 0
    assert [n.op_type for n in model.graph.node].count("Cast") == 5
