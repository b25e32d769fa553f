"""The ONNX nodes of the im2col unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def im2col_shape(x_shape: Sequence[int], *, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                 dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0)) -> tuple[int, int]:
    """``[C*kh*kw, N*Ho*Wo]``, the shape of ``Im2Col(x)`` for ``x`` of ``x_shape`` [N, C, H, W]
    (ONNX Conv arithmetic: ``Ho = (H + top + bottom - ((kh - 1)*dh + 1)) // sh + 1``). Raises
    ValueError for attributes the op refuses or a kernel larger than the padded image."""
    check_im2col(kernel_shape, strides, dilations, pads)
    if len(x_shape) != 4:
        raise ValueError(f"Im2Col: x must be 4-D [N, C, H, W], got shape {list(x_shape)}")
    n, c, h, w = (int(d) for d in x_shape)
    (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right) = kernel_shape, strides, dilations, pads
    extent_h, extent_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if extent_h > h + top + bottom or extent_w > w + left + right:
        raise ValueError(f"Im2Col: the kernel's extent {extent_h} x {extent_w} exceeds the padded input "
                         f"{h + top + bottom} x {w + left + right}")
    ho, wo = (h + top + bottom - extent_h) // sh + 1, (w + left + right - extent_w) // sw + 1
    return c * kh * kw, n * ho * wo


def im2col(x: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
           dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``columns = Im2Col(x)``: the column matrix of a 2-D convolution (ONNX Conv attributes; pads
    ``[top, left, bottom, right]``). x [N, C, H, W] (float32 or float16) -> [C*kh*kw, N*Ho*Wo] of
    x's type: ``columns[(c*kh + i)*kw + j, (n*Ho + oh)*Wo + ow] = x[n, c, oh*sh + i*dh - top,
    ow*sw + j*dw - left]``, 0 in the padding."""
    check_im2col(kernel_shape, strides, dilations, pads)
    return helper.make_node("Im2Col", [x], [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])


def check_im2col(kernel_shape, strides, dilations, pads, op: str = "Im2Col") -> None:
    for label, values, count, low in (("kernel_shape", kernel_shape, 2, 1), ("strides", strides, 2, 1),
                                      ("dilations", dilations, 2, 1), ("pads", pads, 4, 0)):
        if len(values) != count or any(int(v) < low for v in values):
            kind = "positive" if low else "non-negative"
            raise ValueError(f"{op}: {label} must be {count} {kind} ints, got {list(values)}")
