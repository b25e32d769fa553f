"""The ONNX nodes of the conv_grad unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops.im2col.nodes import check_im2col


def conv_weight_grad(x: str, dy: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                     dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                     name: str) -> onnx.NodeProto:
    """``dw = ConvWeightGrad(x, dy)``: the weight gradient of a 2-D convolution (ONNX Conv
    attributes, group 1; pads ``[top, left, bottom, right]``): x [N, Cin, H, W] and dy [N, Cout,
    Ho, Wo], both float32 or both float16 -> dw [Cout, Cin, kh, kw] of their type, ``dw[co, ci, i,
    j] = sum over n, oh, ow of dy[n, co, oh, ow] * x[n, ci, oh*sh + i*dh - top, ow*sw + j*dw -
    left]`` (sums in float32). On CUDA cuDNN's backward-filter convolution (pads must give cuDNN's
    symmetric-padding output size), on the CPU a direct loop."""
    check_im2col(kernel_shape, strides, dilations, pads, op="ConvWeightGrad")
    return helper.make_node("ConvWeightGrad", [x, dy], [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])
