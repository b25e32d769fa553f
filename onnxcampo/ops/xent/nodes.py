"""The ONNX nodes of the xent unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops.common.nodes import check_output_type


def softmax_cross_entropy(x: str, labels: str, *, picked: str, lse: str, classes: int | None = None,
                          output_type: int = onnx.TensorProto.FLOAT, name: str) -> onnx.NodeProto:
    """``(picked, lse) = SoftmaxCrossEntropy(x, labels)``: the log softmax of each row of ``x`` (its
    first ``classes`` columns) at the row's label, and the row's log-sum-exp (float32); both
    shaped like ``labels`` (``onnxcampo.ops.xent``)."""
    attributes = {"output_type": check_output_type(name, output_type)}
    if classes is not None:
        attributes["classes"] = int(classes)
    return helper.make_node("SoftmaxCrossEntropy", [x, labels], [picked, lse], name=name, domain=DOMAIN, **attributes)


def softmax_cross_entropy_grad(x: str, lse: str, labels: str, scale: str, *, output: str, classes: int | None = None,
                               output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                               output_columns: int | None = None, name: str) -> onnx.NodeProto:
    """``dx = SoftmaxCrossEntropyGrad(x, lse, labels, scale)``: ``scale * (OneHot(labels) -
    softmax(x))`` row by row, ``scale`` one value or one per row; shaped ``output_shape`` (default
    x's shape with the last dimension ``output_columns``); ``output_columns`` (default
    ``classes``) pads each row with zeros."""
    attributes = {"output_type": check_output_type(name, output_type)}
    if classes is not None:
        attributes["classes"] = int(classes)
    if output_columns is not None:
        attributes["output_columns"] = int(output_columns)
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    return helper.make_node("SoftmaxCrossEntropyGrad", [x, lse, labels, scale], [output], name=name, domain=DOMAIN,
                            **attributes)
