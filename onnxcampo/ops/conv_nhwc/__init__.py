"""``ai.onnxcampo::ConvNhwc``, ``ConvNhwcDataGrad`` and ``ConvNhwcWeightGrad``: a 2-D convolution
and its two adjoints in channels-last layout, what a channels-last graph runs
(``onnxcampo.rewrites.layout``, ``docs/ops.md``). float64 numpy references for the tests and the CUDA check.

Shapes: x [N, H, W, Cin], y / dy [N, Ho, Wo, Cout], the filter w / dw [Cout, kh, kw, Cin / group]
(KRSC); attributes as ONNX Conv's (``kernel_shape``, ``strides``, ``dilations``, ``pads`` [top,
left, bottom, right], ``group`` on ``ConvNhwc`` only: the gradients are of group-1 convolutions);
``ConvNhwcDataGrad`` also ``input_spatial`` (H, W).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

OPS = ("ConvNhwc", "ConvNhwcDataGrad", "ConvNhwcWeightGrad", "NchwToNhwc")

# How the CUDA kernels call cuDNN (onnxcampo/ops/conv_grad/conv_grad.cu, CudnnGraphApiAsked): the
# environment variable, read when a session makes the kernels, and the default where it is unset
# (kGraphByDefault there: the two must agree).
CUDNN_API_VAR = "ONNXCAMPO_CUDNN_API"
GRAPH_API_BY_DEFAULT = False


def cudnn_api() -> str:
    """``"graph"`` where sessions made now call cuDNN's graph API, else ``"legacy"``."""
    value = os.environ.get(CUDNN_API_VAR, "")
    graph = GRAPH_API_BY_DEFAULT if not value else value == "graph"
    return "graph" if graph else "legacy"


def host_class() -> str:
    """The cost database's name for an NHWC convolution call's host time under :func:`cudnn_api`:
    ``conv_nhwc`` (the legacy calls) or ``conv_nhwc_graph``."""
    return "conv_nhwc_graph" if cudnn_api() == "graph" else "conv_nhwc"


def output_hw(h: int, w: int, kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
              pads: Sequence[int]) -> tuple[int, int]:
    """(Ho, Wo) of the convolution, as ONNX Conv computes them."""
    ho = (h + pads[0] + pads[2] - dilations[0] * (kernel[0] - 1) - 1) // strides[0] + 1
    wo = (w + pads[1] + pads[3] - dilations[1] * (kernel[1] - 1) - 1) // strides[1] + 1
    return ho, wo


def _windows(x: np.ndarray, kernel, strides, dilations, pads, ho: int, wo: int) -> np.ndarray:
    """[N, Ho, Wo, kh, kw, C]: the input element each (output position, tap) reads (0 in the padding)."""
    n, h, w, c = x.shape
    padded = np.zeros((n, h + pads[0] + pads[2] + strides[0] * ho + dilations[0] * kernel[0],
                       w + pads[1] + pads[3] + strides[1] * wo + dilations[1] * kernel[1], c), x.dtype)
    padded[:, pads[0]:pads[0] + h, pads[1]:pads[1] + w] = x
    out = np.empty((n, ho, wo, kernel[0], kernel[1], c), x.dtype)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            rows = padded[:, i * dilations[0]: i * dilations[0] + strides[0] * ho: strides[0]]
            out[:, :, :, i, j] = rows[:, :, j * dilations[1]: j * dilations[1] + strides[1] * wo: strides[1]][:, :ho, :wo]
    return out


def conv_nhwc(x: np.ndarray, w: np.ndarray, *, strides=(1, 1), dilations=(1, 1), pads=(0, 0, 0, 0),
              group: int = 1) -> np.ndarray:
    """y [N, Ho, Wo, Cout] in float64; ``group`` splits the channels of x and y into that many
    groups, output group g reading input group g (w: [Cout, kh, kw, Cin / group])."""
    kernel = w.shape[1:3]
    ho, wo = output_hw(x.shape[1], x.shape[2], kernel, strides, dilations, pads)
    cols = _windows(x.astype(np.float64), kernel, strides, dilations, pads, ho, wo)
    n, cin, cout = x.shape[0], x.shape[3], w.shape[0]
    if cin % group or cout % group or w.shape[3] * group != cin:
        raise ValueError(f"group {group}: x has {cin} channels, w is {list(w.shape)}")
    cols = cols.reshape(n, ho, wo, *kernel, group, cin // group)
    filters = w.astype(np.float64).reshape(group, cout // group, *kernel, cin // group)
    return np.einsum("nhwijgc,gkijc->nhwgk", cols, filters).reshape(n, ho, wo, cout)


def conv_nhwc_weight_grad(x: np.ndarray, dy: np.ndarray, kernel: Sequence[int], *, strides=(1, 1),
                          dilations=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """dw [Cout, kh, kw, Cin] in float64."""
    cols = _windows(x.astype(np.float64), kernel, strides, dilations, pads, dy.shape[1], dy.shape[2])
    return np.einsum("nhwijc,nhwk->kijc", cols, dy.astype(np.float64))


def conv_nhwc_data_grad(dy: np.ndarray, w: np.ndarray, input_spatial: Sequence[int], *, strides=(1, 1),
                        dilations=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """dx [N, H, W, Cin] in float64: each output position's gradient spread over the taps it read."""
    n, ho, wo, _ = dy.shape
    kh, kw, cin = w.shape[1:]
    h, wd = input_spatial
    taps = np.einsum("nhwk,kijc->nhwijc", dy.astype(np.float64), w.astype(np.float64))
    padded = np.zeros((n, h + pads[0] + pads[2] + strides[0] * ho + dilations[0] * kh,
                       wd + pads[1] + pads[3] + strides[1] * wo + dilations[1] * kw, cin))
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dilations[0], j * dilations[1]
            padded[:, r0: r0 + strides[0] * ho: strides[0], c0: c0 + strides[1] * wo: strides[1]] += taps[:, :, :, i, j]
    return padded[:, pads[0]:pads[0] + h, pads[1]:pads[1] + wd]


__all__ = ["OPS", "conv_nhwc", "conv_nhwc_data_grad", "conv_nhwc_weight_grad", "output_hw"]
