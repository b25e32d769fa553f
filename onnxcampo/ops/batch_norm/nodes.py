"""The ONNX nodes of the batch_norm unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def _attributes(name: str, sizes: Sequence[int], output_shape: Sequence[int] | None) -> dict:
    sizes = [int(s) for s in sizes]
    if len(sizes) != 3 or min(sizes) < 0:
        raise ValueError(f"{name}: sizes must be three ints [P, Q, R] >= 0, got {sizes}")
    attributes = {"sizes": sizes}
    if output_shape is not None:
        shape = [int(d) for d in output_shape]
        if min(shape, default=0) < 0 or math.prod(shape) != sizes[1]:
            raise ValueError(f"{name}: output_shape {shape} must hold Q = {sizes[1]} elements")
        attributes["output_shape"] = shape
    return attributes


def batch_norm_stats(x: str, *, outputs: Sequence[str], sizes: Sequence[int], output_shape: Sequence[int] | None = None,
                     name: str) -> onnx.NodeProto:
    """``sum, centered = BatchNormStats(x)``: ``x`` (float32 or float16, ``P*Q*R`` elements) read as
    a contiguous ``[P, Q, R]`` array; per channel q the float32 sum and the sum of squared
    deviations from its mean (``onnxcampo.ops.batch_norm``), shaped ``output_shape`` (default ``[Q]``)."""
    return helper.make_node("BatchNormStats", [x], list(outputs), name=name, domain=DOMAIN,
                            **_attributes(name, sizes, output_shape))


def batch_norm_grad_sums(dy: str, c: str, invstd: str, *, outputs: Sequence[str], sizes: Sequence[int],
                         output_shape: Sequence[int] | None = None, name: str) -> onnx.NodeProto:
    """``sum_dy, sum_dy_xhat = BatchNormGradSums(dy, c, invstd)``: per channel the float32 sum of
    ``dy`` and ``invstd`` times the sum of ``dy * c`` (``c`` the centered input), over ``[P, Q, R]``
    arrays as :func:`batch_norm_stats` reads them; ``invstd`` Q float32 values."""
    return helper.make_node("BatchNormGradSums", [dy, c, invstd], list(outputs), name=name, domain=DOMAIN,
                            **_attributes(name, sizes, output_shape))
