"""The ONNX nodes of the norm unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops.common.nodes import check_output_type


def layer_norm_grad(dy: str, xhat: str, invstd: str, gamma: str, acc: str | None = None, *, output: str,
                    output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                    name: str) -> onnx.NodeProto:
    """``dx = LayerNormGrad(dy, xhat, invstd, gamma[, acc])``: a layer normalization's input
    gradient row by row (``onnxcampo.ops.norm.layer_norm``), ``acc`` added when given."""
    attributes = {"output_type": check_output_type(name, output_type)}
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    inputs = [dy, xhat, invstd, gamma] + ([acc] if acc else [])
    return helper.make_node("LayerNormGrad", inputs, [output], name=name, domain=DOMAIN, **attributes)


def softmax_grad(dy: str, y: str, *, output: str, cols: int, scale: float = 1.0,
                 output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                 name: str) -> onnx.NodeProto:
    """``dx = SoftmaxGrad(dy, y)``: ``scale * y * (dy - sum(dy * y))`` over rows of ``cols``
    (``onnxcampo.ops.norm.softmax``), ``y`` the softmax's output."""
    if int(cols) < 1:
        raise ValueError(f"{name}: cols must be >= 1, got {cols}")
    attributes = {"cols": int(cols), "output_type": check_output_type(name, output_type)}
    if float(scale) != 1.0:
        attributes["scale"] = float(scale)
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    return helper.make_node("SoftmaxGrad", [dy, y], [output], name=name, domain=DOMAIN, **attributes)
