"""The ONNX nodes of the scatter unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def scatter_nd_add(data: str, indices: str, updates: str, *, output: str, name: str) -> onnx.NodeProto:
    """``output = ScatterNDAdd(data, indices, updates)``: ONNX ScatterND with ``reduction="add"``
    (data and updates float32 or float16, indices int64; duplicates accumulate, negative indices
    count from the end; ``docs/ops.md`` says what the kernels do with indices out of range)."""
    return helper.make_node("ScatterNDAdd", [data, indices, updates], [output], name=name, domain=DOMAIN)
