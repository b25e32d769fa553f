"""The experimental ``yield_to_ort_fusions`` with the custom-op library: the elementwise fusion leaves
to ONNX Runtime the nodes its own graph optimizations fuse (read from ORT's optimized graph on
the CPU provider; the written models load on it: a wiring check)."""

from __future__ import annotations

from helpers import named_model as _model, ops as _ops
from rewrites.test_elementwise import scaled_chain


def test_yield_to_ort_fusions_leaves_a_matmuls_scale_to_onnx_runtime(library):
    """experimental yield_to_ort_fusions: the Mul by a constant scalar after a MatMul, which
    ORT's MatMulScaleFusion folds into FusedMatMul (read from ORT's optimized graph), is not
    fused; without it the Mul joins the chain. The report counts the nodes left to ORT."""
    import onnxcampo

    text = scaled_chain(64, ", ".join(["0.01"] * 64 * 64))
    kept = onnxcampo.optimize(_model(text), policy="fp32", fuse_elementwise=True, fuse="none")
    left = onnxcampo.optimize(_model(text), policy="fp32", fuse_elementwise=True, fuse="none",
                              experimental={"yield_to_ort_fusions": True})
    assert kept.report["fuse_elementwise"]["nodes_replaced"] == 4 and kept.report["fuse_elementwise"]["left_to_ort"] == 0
    assert left.report["fuse_elementwise"]["left_to_ort"] >= 1 and "Mul" in _ops(left.model)
    assert left.report["fuse_elementwise"]["nodes_replaced"] == 3
