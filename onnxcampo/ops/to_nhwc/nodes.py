"""The ONNX nodes of the to_nhwc unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def nchw_to_nhwc(x: str, *, output: str, to: int, channels: int | None = None, name: str) -> onnx.NodeProto:
    """``y = NchwToNhwc(x)``: x [N, C, S...] (float32 or float16) channels-last, as ``to`` (1
    float32, 10 float16: rounded to nearest even), with zero channels appended up to ``channels``
    (default C): ``Pad(Cast(Transpose(x, [0, 2, ..., 1])))`` in one pass (``onnxcampo.ops.conv_nhwc``
    has the numpy reference)."""
    if to not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: to must be 1 (float32) or 10 (float16), got {to}")
    attributes = {"to": int(to)}
    if channels is not None:
        if int(channels) < 1:
            raise ValueError(f"{name}: channels must be >= 1, got {channels}")
        attributes["channels"] = int(channels)
    return helper.make_node("NchwToNhwc", [x], [output], name=name, domain=DOMAIN, **attributes)
