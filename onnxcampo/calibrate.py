"""Activation ranges on calibration inputs: which tensors fp16 would hold too coarsely.

fp16 keeps 11 significant bits: between 512 and 1024 its values are 0.5 apart, between 2048 and
4096 2 apart. A convolution whose outputs reach thousands (PP-OCR's detector: -3293 on one input)
loses there what fp32 keeps, however little its op is sensitive otherwise. ModelOpt AutoCast's
answer, which users of it expect, is a calibration run: nodes whose inputs or outputs leave
``[-data_max, data_max]`` (512 by default) on the calibration data stay fp32. ``optimize(...,
activation_limit=512)`` does the same: :func:`activation_ranges` runs the fp32 model once on
ONNX Runtime's CPU provider with every float32 tensor of the graph as an output (graph
optimizations off, so every tensor exists as the model names it) and returns the largest finite
|value| of each; pass 0 (``passes/classify.py``, rule 7a) keeps a node fp32 when a float tensor it
reads or writes goes beyond the limit.

One run holds every intermediate tensor at once: memory grows with the model's activations for
the calibration batch (use a small batch; ranges rarely depend on it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx

from onnxcampo import graph as graph_io

log = logging.getLogger(__name__)


def activation_ranges(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], *,
                      input_shapes: Mapping[str, tuple[int, ...]] | None = None,
                      dim_values: Mapping[str, int] | None = None) -> dict[str, float]:
    """Largest finite |value| of every float32 tensor a node writes (and of the float32 graph
    inputs) on ``feeds``; a tensor with no finite value maps to 0. The model is not modified."""
    from onnxcampo.runtime import make_session, run

    info, _ = graph_io.infer_tensor_info(model, input_shapes=dict(input_shapes or {}),
                                         dim_values=dict(dim_values or {}))
    declared = {o.name for o in model.graph.output}
    wanted = []
    for node in model.graph.node:
        if node.op_type == "Constant":  # weights: their range is pass 0's rule 7 (|x| > 65504)
            continue
        for name in node.output:
            if name and name not in declared and name in info and info[name].dtype == onnx.TensorProto.FLOAT:
                wanted.append(name)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in wanted)
    session = make_session(probe, provider="cpu", optimization_level="disable")
    del probe
    outputs = run(session, feeds)
    ranges = {name: _max_abs(value) for name, value in outputs.items()
              if isinstance(value, np.ndarray) and value.dtype == np.float32}
    for name, value in feeds.items():
        if isinstance(value, np.ndarray) and value.dtype == np.float32:
            ranges[name] = _max_abs(value)
    log.info("calibration: ranges of %d float32 tensors", len(ranges))
    return ranges


def _max_abs(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(np.abs(finite).max()) if finite.size else 0.0
