"""Activation ranges on calibration inputs: which tensors fp16 would hold too coarsely.

fp16 keeps 11 significant bits: between 512 and 1024 its values are 0.5 apart, between 2048 and
4096 2 apart. A convolution whose outputs reach thousands (silero VAD's first one: -3293 on the
benchmark's input; PP-OCR's detector: 7689 on random inputs) loses there what fp32 keeps,
however little its op is sensitive otherwise. ModelOpt AutoCast's
answer, which users of it expect, is a calibration run: nodes whose inputs or outputs leave
``[-data_max, data_max]`` (512 by default) on the calibration data stay fp32. ``optimize(...,
activation_limit=512)`` does the same: :func:`activation_ranges` runs the fp32 model once on
ONNX Runtime's CPU provider with every float32 tensor of the graph as an output (graph
optimizations off, so every tensor exists as the model names it) and returns the largest finite
|value| of each (below 1e30: larger finite values are "infinity" sentinels, e.g. an
attention mask's float32 minimum, which the Casts clamp to the fp16 range, as ``classify``'s
rule 7 allows); ``classify`` (``passes/classify.py``, rule 7a) keeps a node fp32 when a float
tensor it reads or writes goes beyond the limit.

One run holds every intermediate tensor at once: memory grows with the model's activations for
the calibration batch (use a small batch; ranges rarely depend on it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx

from onnxcampo import ir
from onnxcampo.ir import TensorInfo
from onnxcampo.passes.classify import INFINITY_SENTINEL  # larger finite values stand for infinity

log = logging.getLogger(__name__)


def activation_ranges(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *,
                      info: Mapping[str, TensorInfo] | None = None) -> dict[str, float]:
    """Largest finite |value| below the infinity sentinel (1e30) of every float32 tensor a node
    writes (and of the float32 graph inputs) on ``feeds``; a tensor with no such value maps to 0
    and is logged. ``info``: the model's tensor types if known (``optimize`` has them), else one
    shape-inference run finds them. The model is not modified."""
    from onnxcampo.runtime import make_session, run

    if info is None:
        info, _ = ir.infer_tensor_info(model)
    declared = {o.name for o in model.graph.output}
    wanted = []
    for node in model.graph.node:
        if node.op_type == "Constant" and any(a.name in ("value", "sparse_value") for a in node.attribute):
            continue  # a tensor constant: converted offline, its range is classify's rule 7 (|x| > 65504)
        for name in node.output:
            if name and name not in declared and name in info and info[name].dtype == onnx.TensorProto.FLOAT:
                wanted.append(name)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in wanted)
    session = make_session(probe, provider="cpu", optimization_level="disable")
    del probe
    ranges, empty = {}, []
    for name, value in (*run(session, feeds).items(), *feeds.items()):
        if not isinstance(value, np.ndarray) or value.dtype != np.float32:
            continue
        magnitude = np.abs(value[np.isfinite(value)])
        magnitude = magnitude[magnitude < INFINITY_SENTINEL]
        ranges[name] = float(magnitude.max()) if magnitude.size else 0.0
        if value.size and not magnitude.size:
            empty.append(name)
    if empty:
        log.warning("calibration: %d tensors have no finite value on the calibration inputs (not protected): %s",
                    len(empty), ", ".join(sorted(empty)[:5]) + (" ..." if len(empty) > 5 else ""))
    log.info("calibration: ranges of %d float32 tensors", len(ranges))
    return ranges
