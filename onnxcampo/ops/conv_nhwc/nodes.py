"""The ONNX nodes of the conv_nhwc unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops.im2col.nodes import check_im2col


def conv_nhwc(x: str, w: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
              dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), group: int = 1,
              name: str) -> onnx.NodeProto:
    """``y = ConvNhwc(x, w)``: a 2-D convolution in channels-last layout (ONNX Conv attributes, no
    bias; pads ``[top, left, bottom, right]``): x [N, H, W, Cin] and w [Cout, kh, kw, Cin / group]
    (cuDNN's KRSC filter), both float32 or both float16 -> y [N, Ho, Wo, Cout], sums in float32
    (``onnxcampo.ops.conv_nhwc`` has the numpy reference). ``group`` (dividing Cin and Cout; Cin
    for a depthwise convolution) is written only when not 1. On CUDA cuDNN (pads must give
    cuDNN's symmetric-padding output size), on the CPU a direct loop."""
    if int(group) < 1:
        raise ValueError(f"ConvNhwc: group must be a positive int, got {group}")
    node = _conv_nhwc_node("ConvNhwc", [x, w], output, kernel_shape, strides, dilations, pads, name)
    if int(group) != 1:
        node.attribute.append(helper.make_attribute("group", int(group)))
    return node


def conv_nhwc_data_grad(dy: str, w: str, *, output: str, input_spatial: Sequence[int], kernel_shape: Sequence[int],
                        strides: Sequence[int] = (1, 1), dilations: Sequence[int] = (1, 1),
                        pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``dx = ConvNhwcDataGrad(dy, w)``: the input gradient of :func:`conv_nhwc` (its adjoint in
    x, what ONNX ConvTranspose computes for a Conv's input): dy [N, Ho, Wo, Cout], w [Cout, kh, kw,
    Cin] -> dx [N, H, W, Cin] with ``input_spatial = (H, W)``."""
    if len(input_spatial) != 2 or any(int(v) < 1 for v in input_spatial):
        raise ValueError(f"ConvNhwcDataGrad: input_spatial must be 2 positive ints, got {list(input_spatial)}")
    node = _conv_nhwc_node("ConvNhwcDataGrad", [dy, w], output, kernel_shape, strides, dilations, pads, name)
    node.attribute.append(helper.make_attribute("input_spatial", [int(v) for v in input_spatial]))
    return node


def conv_nhwc_weight_grad(x: str, dy: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                          dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                          name: str) -> onnx.NodeProto:
    """``dw = ConvNhwcWeightGrad(x, dy)``: the filter gradient of :func:`conv_nhwc`: x [N, H, W,
    Cin], dy [N, Ho, Wo, Cout] -> dw [Cout, kh, kw, Cin] (KRSC), sums in float32."""
    return _conv_nhwc_node("ConvNhwcWeightGrad", [x, dy], output, kernel_shape, strides, dilations, pads, name)


def _conv_nhwc_node(op, inputs, output, kernel_shape, strides, dilations, pads, name) -> onnx.NodeProto:
    check_im2col(kernel_shape, strides, dilations, pads, op=op)
    return helper.make_node(op, list(inputs), [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])
