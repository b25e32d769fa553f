"""Shapes that ONNX shape inference leaves unknown, from ONNX Runtime's symbolic shape inference.

ONNX's inference has no schemas for ONNX Runtime's com.microsoft ops (SkipLayerNormalization,
FastGelu, Attention, ...), so what they produce and everything after them has no shape, and its
data propagation stops at some shape arithmetic (the head size, hidden // heads, that an attention
Reshape is built from). The cost model cannot price such nodes. ORT's symbolic shape inference,
what ORT's transformers optimizer runs, knows the contrib ops and computes shapes as expressions.

Rules (:func:`fill_unknown_shapes`, called by ``graph.infer_tensor_info`` after ONNX inference):
1. it runs only when a top-level float tensor has no static shape;
2. it reads the copy whose input dims are already pinned; the input model is never touched;
3. it fills only what ONNX left unknown: a shape or dim that ONNX knew is never overridden, nor a
   dtype; a tensor whose rank disagrees with ONNX's keeps ONNX's shape;
4. a symbolic dim stays unknown unless it names a pinned dim: a dynamic input dim left unpinned
   stays dynamic, and ``unresolved_dims`` still lists it; a rank alone is not taken;
5. it fails soft: when symbolic inference raises (or cannot be imported), one info line is logged
   and ONNX's result stands.
"""

from __future__ import annotations

import logging

import onnx

from onnxcampo.graph import TensorInfo, _value_info_to_info, skeleton

log = logging.getLogger(__name__)


def fill_unknown_shapes(pinned: onnx.ModelProto, info: dict[str, TensorInfo], symbols: dict[str, int]) -> int:
    """Complete in ``info`` the float tensors without a static shape; returns how many changed."""
    missing = {
        name for node in pinned.graph.node for name in node.output
        if name in info and info[name].is_float and info[name].numel is None
    }
    if not missing:
        return 0
    try:
        inferred = _symbolic_value_info(pinned)
    except Exception as exc:  # noqa: BLE001 - a fallback: whatever goes wrong, ONNX's shapes stand
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.info("ORT symbolic shape inference failed (%s); keeping ONNX's shapes", message)
        return 0
    filled = 0
    for name in sorted(missing):
        found = inferred.get(name)
        entry = _value_info_to_info(found, symbols) if found is not None else None
        merged = _merge(info[name], entry) if entry is not None else None
        if merged is not None:
            info[name] = merged
            filled += 1
    log.debug("ORT symbolic shape inference: %d of %d float tensors without a static shape completed",
              filled, len(missing))
    return filled


def _merge(known: TensorInfo, found: TensorInfo) -> TensorInfo | None:
    """``known`` with its unknown dims taken from ``found``; None when nothing changes."""
    if found.shape is None:
        return None
    if known.shape is None:
        shape = found.shape
    elif len(known.shape) != len(found.shape):
        return None
    else:
        shape = tuple(k if k is not None else f for k, f in zip(known.shape, found.shape))
    if shape == known.shape or (shape and all(d is None for d in shape)):
        return None  # nothing new, or a rank alone (ORT guesses the rank of ops it does not know)
    return TensorInfo(known.dtype, shape)


def _symbolic_value_info(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Value info of every tensor ORT's symbolic inference typed, from one run on ``model``."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True), less its
    # end: when some shape stays incomplete it writes sym_shape_infer_temp.onnx into the working
    # directory and raises, dropping every shape it did find.
    engine = SymbolicShapeInference(2**31 - 1, True, True, 0)
    # ORT's symbolic inference reads initializer values: the skeleton's data-less weights go in as
    # graph inputs (it fails on an empty initializer: "cannot reshape array of size 0")
    engine._preprocess(skeleton(model, weights_as_inputs=True))
    while engine.run_:
        engine._infer_impl()
    engine._update_output_from_vi()
    graph = engine.out_mp_.graph
    return {vi.name: vi for vi in (*graph.value_info, *graph.output)}
