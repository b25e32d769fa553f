"""ORT's symbolic shape inference completes the float shapes ONNX inference leaves unknown
(``onnxcampo.ir.shapes``, run by ``infer_tensor_info``)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
from helpers import MM_ADD_RELU_MM, FakeCost, build_context, parse, reasons, run_passes

from onnxcampo import ir
from onnxcampo import optimize
from onnxcampo.ir import shapes
from onnxcampo.ir.shapes import TensorInfo
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.classify import Classify

MS = "com.microsoft"
FLOAT = TensorProto.FLOAT


def _skip_ln_matmul(batch=2, *, ir_version=10) -> onnx.ModelProto:
    """SkipLayerNormalization (com.microsoft: ONNX has no schema for it) -> MatMul -> Relu."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["ln"], name="sln",
                         domain=MS, epsilon=1e-5),
        helper.make_node("MatMul", ["ln", "w"], ["mm"], name="mm"),
        helper.make_node("Relu", ["mm"], ["y"], name="relu"),
    ]
    initializers = [numpy_helper.from_array(np.ones(64, np.float32), "gamma"),
                    numpy_helper.from_array(np.zeros(64, np.float32), "beta"),
                    numpy_helper.from_array((rng.standard_normal((64, 256)) * 0.1).astype(np.float32), "w")]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(name, FLOAT, [batch, 8, 64]) for name in ("x", "skip")],
        [helper.make_tensor_value_info("y", FLOAT, [batch, 8, 256])], initializers,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=ir_version)


# The attention reshape: the head size is hidden // heads, a Div ONNX's data propagation stops at.
COMPUTED_RESHAPE = """
g (float[2,8,64] x) => (float[2,8,4,16] y) <int64[1] i0 = {0}, int64[1] i1 = {1}, int64[1] i2 = {2},
                                             int64[1] heads = {4}> {
  [shape] s = Shape(x)
  [batch] b = Gather(s, i0)
  [seq] q = Gather(s, i1)
  [hidden] h = Gather(s, i2)
  [head_size] d = Div(h, heads)
  [dims] shp = Concat<axis=0>(b, q, heads, d)
  [reshape] r = Reshape(x, shp)
  [relu] y = Relu(r)
}
"""


@pytest.fixture
def without_symbolic(monkeypatch):
    """ORT's symbolic inference failing: what ONNX inference alone gives."""
    def fail(*args, **kwargs):
        raise RuntimeError("symbolic inference unavailable")

    monkeypatch.setattr(SymbolicShapeInference, "_infer_impl", fail)


def _shapes(model, **options):
    info, unresolved = ir.infer_tensor_info(model, **options)
    return {name: entry.shape for name, entry in info.items()}, unresolved


def test_onnx_leaves_what_follows_a_contrib_op_unknown(without_symbolic):
    """Before: ONNX has no schema for SkipLayerNormalization, so neither its output nor the
    MatMul's has a shape; campo cannot cost the MatMul and keeps it fp32 (UNKNOWN_SHAPE)."""
    found, _ = _shapes(_skip_ln_matmul())
    assert found["ln"] is None and found["mm"] is None
    ctx = build_context(_skip_ln_matmul(), cost=FakeCost(cast_us=0.0))
    run_passes(ctx, Classify(), AllowByCost())
    assert reasons(ctx)["mm"] == "UNKNOWN_SHAPE"


def test_symbolic_inference_resolves_the_contrib_op_and_the_matmul_is_costed():
    """After: the symbolic fallback gives ln [2, 8, 64] and mm [2, 8, 256]; with free Casts and
    fp16 twice as fast the MatMul pays in fp16 (ALLOW_PAYS)."""
    found, unresolved = _shapes(_skip_ln_matmul())
    assert found["ln"] == (2, 8, 64) and found["mm"] == (2, 8, 256) and unresolved == []
    ctx = build_context(_skip_ln_matmul(), cost=FakeCost(cast_us=0.0))
    run_passes(ctx, Classify(), AllowByCost())
    assert reasons(ctx)["mm"] == "ALLOW_PAYS"
    assert ctx.features["mm"].gemm == (1, 16, 64, 256)  # [2, 8, 64] x [64, 256]: one GEMM of M = 16


def test_a_dim_lost_through_a_computed_reshape_is_resolved_and_known_dims_are_kept(without_symbolic, monkeypatch):
    """Shape -> Gather -> Div -> Concat -> Reshape: ONNX knows [2, 8, 4, ?] (its data propagation
    stops at the Div); symbolic inference fills the head size, 16."""
    before, _ = _shapes(parse(COMPUTED_RESHAPE))
    assert before["r"] == (2, 8, 4, None)
    monkeypatch.undo()
    after, _ = _shapes(parse(COMPUTED_RESHAPE))
    assert after["r"] == (2, 8, 4, 16)
    assert {k: v for k, v in after.items() if k != "r"} == {k: v for k, v in before.items() if k != "r"}


def test_a_shape_onnx_knew_is_never_overridden():
    """Only unknown dims are filled: a dim ONNX gave (here a deliberately odd 999) stays; a
    tensor whose rank disagrees keeps what ONNX gave."""
    model = _skip_ln_matmul()
    info = {"ln": TensorInfo(FLOAT, (2, None, 999)), "mm": TensorInfo(FLOAT, (None, None)),
            "y": TensorInfo(FLOAT, (2, 8, 256))}
    assert shapes.fill_unknown_shapes(model, info, {}) == 1
    assert info == {"ln": TensorInfo(FLOAT, (2, 8, 999)), "mm": TensorInfo(FLOAT, (None, None)),
                    "y": TensorInfo(FLOAT, (2, 8, 256))}


def test_symbolic_inference_runs_only_when_a_float_shape_is_unknown(monkeypatch):
    calls = []
    monkeypatch.setattr(shapes, "_symbolic_value_info", lambda model: calls.append(model) or {})
    _shapes(parse(MM_ADD_RELU_MM))  # ONNX knows every shape
    assert calls == []
    _shapes(_skip_ln_matmul())
    assert len(calls) == 1


def test_a_failing_symbolic_inference_logs_one_line_and_keeps_onnx_shapes(without_symbolic, caplog):
    with caplog.at_level(logging.DEBUG, logger="onnxcampo.ir.shapes"):
        found, _ = _shapes(_skip_ln_matmul())
    assert found["mm"] is None and found["w"] == (64, 256)
    records = [r for r in caplog.records if r.name == "onnxcampo.ir.shapes"]
    assert len(records) == 1 and "symbolic shape inference failed" in records[0].getMessage()


def test_input_model_and_ir_version_are_untouched(tmp_path, monkeypatch):
    """The input model is not modified, the written one keeps IR 8, and ORT's inference leaves
    no file behind in the working directory."""
    monkeypatch.chdir(tmp_path)
    model = _skip_ln_matmul(ir_version=8)
    before = model.SerializeToString()
    result = optimize(model, policy="amp")
    assert model.SerializeToString() == before
    assert result.model.ir_version == 8
    assert list(tmp_path.iterdir()) == []


def test_dynamic_input_dims_stay_unresolved():
    """A batch dim left unpinned (policy amp needs no sizes) stays dynamic: the dims symbolic
    inference derives from it stay unknown, the others are filled, and the report still lists it."""
    model = _skip_ln_matmul(batch="batch")
    found, unresolved = _shapes(model)
    assert unresolved == ["x[0]=batch", "skip[0]=batch"]
    assert found["ln"] == (None, 8, 64) and found["mm"] == (None, 8, 256)
    assert optimize(model, policy="amp").report["unresolved_dims"] == unresolved
    pinned, unresolved = _shapes(model, dim_values={"batch": 4})
    assert pinned["mm"] == (4, 8, 256) and unresolved == []
