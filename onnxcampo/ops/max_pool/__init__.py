"""``ai.onnxcampo::MaxPoolNhwc`` and ``MaxPoolNhwcGrad``: a 2-D max pooling and its gradient in
channels-last layout, what a channels-last step graph runs for ResNet's stem pool
(``docs/ops.md``). numpy references for the tests and the CUDA check.

Shapes: x / dx [N, H, W, C], y / dy / argmax [N, Ho, Wo, C]; attributes ``kernel_shape``
(kh * kw <= 255), ``strides``, ``pads`` [top, left, bottom, right], each pad below the kernel
size along its axis, no dilations, Ho, Wo rounded down; ``MaxPoolNhwcGrad`` also
``input_spatial`` (H, W). ``argmax`` (uint8) is the tap ``i*kw + j`` of the first maximum of each
window in row-major tap order (taps in the padding skipped; a later tap wins only when strictly
greater, a NaN wins and stays); the gradient adds each dy to the input element its argmax names.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OPS = ("MaxPoolNhwc", "MaxPoolNhwcGrad")
MAX_TAPS = 255  # argmax is one byte


def pool_output_hw(h: int, w: int, kernel: Sequence[int], strides: Sequence[int] = (1, 1),
                   pads: Sequence[int] = (0, 0, 0, 0)) -> tuple[int, int]:
    """(Ho, Wo) of the pooling, rounded down as ONNX MaxPool with ``ceil_mode=0``."""
    return ((h + pads[0] + pads[2] - kernel[0]) // strides[0] + 1,
            (w + pads[1] + pads[3] - kernel[1]) // strides[1] + 1)


def _taps(shape, kernel, strides, pads, ho: int, wo: int):
    """Per tap t = i*kw + j in row-major order: the input rows [Ho] and columns [Wo] it reads
    and the masks of those inside the input."""
    h, w = shape
    rows = np.arange(ho)[:, None] * strides[0] - pads[0] + np.arange(kernel[0])[None, :]  # [Ho, kh]
    cols = np.arange(wo)[:, None] * strides[1] - pads[1] + np.arange(kernel[1])[None, :]  # [Wo, kw]
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            r, c = rows[:, i], cols[:, j]
            yield i * kernel[1] + j, r, c, ((r >= 0) & (r < h))[:, None] & ((c >= 0) & (c < w))[None, :]


def max_pool_nhwc(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int] = (1, 1),
                  pads: Sequence[int] = (0, 0, 0, 0)) -> tuple[np.ndarray, np.ndarray]:
    """(y [N, Ho, Wo, C] in x's dtype, argmax [N, Ho, Wo, C] uint8); compared in float64, which
    holds float16 and float32 values exactly."""
    n, h, w, c = x.shape
    ho, wo = pool_output_hw(h, w, kernel, strides, pads)
    values = x.astype(np.float64)
    best = np.zeros((n, ho, wo, c))
    arg = np.zeros((n, ho, wo, c), np.uint8)
    seen = np.zeros((ho, wo), bool)
    for tap, r, col, inside in _taps((h, w), kernel, strides, pads, ho, wo):
        v = values[:, np.clip(r, 0, h - 1)][:, :, np.clip(col, 0, w - 1)]  # [N, Ho, Wo, C]
        better = (v > best) | (np.isnan(v) & ~np.isnan(best))
        take = inside[None, :, :, None] & (~seen[None, :, :, None] | (better & ~np.isnan(best)))
        best = np.where(take, v, best)
        arg = np.where(take, np.uint8(tap), arg)
        seen |= inside
    return best.astype(x.dtype), arg


def max_pool_nhwc_grad(dy: np.ndarray, argmax: np.ndarray, input_spatial: Sequence[int], kernel: Sequence[int],
                       strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0)) -> np.ndarray:
    """dx [N, H, W, C] in float64: each dy added to the input element its argmax names."""
    return _scatter(dy, argmax, input_spatial, kernel, strides, pads, np.float64)


def max_pool_nhwc_grad_float32(dy: np.ndarray, argmax: np.ndarray, input_spatial: Sequence[int],
                               kernel: Sequence[int], strides: Sequence[int] = (1, 1),
                               pads: Sequence[int] = (0, 0, 0, 0)) -> np.ndarray:
    """dx as the kernels compute it, bit for bit: float32 sums, oh ascending then ow, rounded
    once to dy's type (``np.add.at`` applies the updates in index order, n, oh, ow, c)."""
    return _scatter(dy, argmax, input_spatial, kernel, strides, pads, np.float32).astype(dy.dtype)


def _scatter(dy, argmax, input_spatial, kernel, strides, pads, dtype) -> np.ndarray:
    n, ho, wo, c = dy.shape
    h, w = input_spatial
    if pool_output_hw(h, w, kernel, strides, pads) != (ho, wo) or argmax.shape != dy.shape:
        raise ValueError(f"dy {list(dy.shape)} and argmax {list(argmax.shape)} do not match input_spatial "
                         f"{list(input_spatial)} and the attributes")
    tap = argmax.astype(np.int64)
    rows = np.arange(ho)[None, :, None, None] * strides[0] - pads[0] + tap // kernel[1]
    cols = np.arange(wo)[None, None, :, None] * strides[1] - pads[1] + tap % kernel[1]
    if ((rows < 0) | (rows >= h) | (cols < 0) | (cols >= w)).any():
        raise ValueError("argmax names a tap in the padding: not what MaxPoolNhwc writes")
    batch = np.broadcast_to(np.arange(n)[:, None, None, None], dy.shape)
    channel = np.broadcast_to(np.arange(c)[None, None, None, :], dy.shape)
    dx = np.zeros((n, h, w, c), dtype)
    np.add.at(dx, (batch, rows, cols, channel), dy.astype(dtype))
    return dx


__all__ = ["MAX_TAPS", "OPS", "max_pool_nhwc", "max_pool_nhwc_grad", "max_pool_nhwc_grad_float32", "pool_output_hw"]
