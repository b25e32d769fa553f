"""The ONNX nodes of the max_pool unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def max_pool_nhwc(x: str, *, output: str, argmax: str | None = None, kernel_shape: Sequence[int],
                  strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``y[, argmax] = MaxPoolNhwc(x)``: a 2-D max pooling in channels-last layout (ONNX MaxPool's
    ``kernel_shape``, ``strides``, ``pads`` ``[top, left, bottom, right]``; no dilations, Ho, Wo
    rounded down; each pad below the kernel size along its axis, ``kh * kw <= 255``): x [N, H, W,
    C] (float32 or float16) -> y [N, Ho, Wo, C] of x's type and, when ``argmax`` names an output,
    the uint8 tap ``i*kw + j`` of each window's first maximum (``onnxcampo.ops.max_pool`` has the
    numpy reference), which :func:`max_pool_nhwc_grad` reads."""
    _check_max_pool("MaxPoolNhwc", kernel_shape, strides, pads)
    return helper.make_node("MaxPoolNhwc", [x], [output] + ([argmax] if argmax else []), name=name, domain=DOMAIN,
                            **_max_pool_attributes(kernel_shape, strides, pads))


def max_pool_nhwc_grad(dy: str, argmax: str, *, output: str, input_spatial: Sequence[int], kernel_shape: Sequence[int],
                       strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                       name: str) -> onnx.NodeProto:
    """``dx = MaxPoolNhwcGrad(dy, argmax)``: the input gradient of :func:`max_pool_nhwc`: dy [N,
    Ho, Wo, C] (float32 or float16) and its argmax -> dx [N, H, W, C] of dy's type with
    ``input_spatial = (H, W)``; each dy added to the element its argmax names, the sums in
    float32 in a fixed order (no scatter, deterministic)."""
    _check_max_pool("MaxPoolNhwcGrad", kernel_shape, strides, pads)
    if len(input_spatial) != 2 or any(int(v) < 1 for v in input_spatial):
        raise ValueError(f"MaxPoolNhwcGrad: input_spatial must be 2 positive ints, got {list(input_spatial)}")
    return helper.make_node("MaxPoolNhwcGrad", [dy, argmax], [output], name=name, domain=DOMAIN,
                            input_spatial=[int(v) for v in input_spatial],
                            **_max_pool_attributes(kernel_shape, strides, pads))


def _max_pool_attributes(kernel_shape, strides, pads) -> dict:
    return {"kernel_shape": [int(k) for k in kernel_shape], "strides": [int(s) for s in strides],
            "pads": [int(p) for p in pads]}


def _check_max_pool(op: str, kernel_shape, strides, pads) -> None:
    from onnxcampo.ops.max_pool import MAX_TAPS

    for label, values, count, low in (("kernel_shape", kernel_shape, 2, 1), ("strides", strides, 2, 1),
                                      ("pads", pads, 4, 0)):
        if len(values) != count or any(int(v) < low for v in values):
            kind = "positive" if low else "non-negative"
            raise ValueError(f"{op}: {label} must be {count} {kind} ints, got {list(values)}")
    kh, kw = (int(k) for k in kernel_shape)
    if kh * kw > MAX_TAPS:
        raise ValueError(f"{op}: kernel_shape {[kh, kw]} has {kh * kw} taps; at most {MAX_TAPS} (argmax is one byte)")
    top, left, bottom, right = (int(p) for p in pads)
    if max(top, bottom) >= kh or max(left, right) >= kw:
        raise ValueError(f"{op}: pads {[top, left, bottom, right]} must each be below the kernel size along their axis "
                         f"(kernel_shape {[kh, kw]})")
