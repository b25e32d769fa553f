"""``ai.onnxcampo::BatchNormStats`` and ``BatchNormGradSums``: the per-channel sums of a training
BatchNorm, one pass over the inputs each (``docs/ops.md``; the arithmetic in ``batch_norm.h``).

Nodes: ``BatchNormStats(x) -> (sum, centered)`` and ``BatchNormGradSums(dy, c, invstd) ->
(sum_dy, sum_dy_xhat)``; ``x``, ``dy``, ``c`` float32 or float16, ``P*Q*R`` elements each (any
shape) read as contiguous ``[P, Q, R]`` arrays (attribute ``sizes``; Q channels), ``invstd`` Q
float32 values; both outputs Q float32 values shaped ``output_shape`` (default ``[Q]``).
``sum = sum(x)``, ``centered = sum((x - sum / n)^2)`` with ``n = P * R``; ``sum_dy = sum(dy)``,
``sum_dy_xhat = invstd * sum(dy * c)``; sums over axes 0 and 2 in float32. The numpy references
below sum in float64 (the kernels' float32 sums differ from them by float32 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

STATS, GRAD_SUMS = "BatchNormStats", "BatchNormGradSums"


def _blocks(value: np.ndarray, sizes: Sequence[int], name: str) -> np.ndarray:
    p, q, r = (int(s) for s in sizes)
    if value.size != p * q * r:
        raise ValueError(f"{name} holds {value.size} elements, sizes {list(sizes)} {p * q * r}")
    return np.asarray(value, np.float64).reshape(p, q, r)


def _shaped(values: np.ndarray, q: int, output_shape: Sequence[int] | None) -> np.ndarray:
    shape = [q] if output_shape is None else [int(d) for d in output_shape]
    if math.prod(shape) != q:
        raise ValueError(f"output_shape {shape} must hold Q = {q} elements")
    return values.astype(np.float32).reshape(shape)


def stats(x: np.ndarray, sizes: Sequence[int], output_shape: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``BatchNormStats`` in numpy: (sum, sum of squared deviations from the mean), float32."""
    blocks = _blocks(x, sizes, "x")
    total = blocks.sum(axis=(0, 2))
    n = blocks.shape[0] * blocks.shape[2]
    mean = total / n if n else total
    centered = ((blocks - mean[None, :, None]) ** 2).sum(axis=(0, 2))
    return _shaped(total, blocks.shape[1], output_shape), _shaped(centered, blocks.shape[1], output_shape)


def grad_sums(dy: np.ndarray, c: np.ndarray, invstd: np.ndarray, sizes: Sequence[int],
              output_shape: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``BatchNormGradSums`` in numpy: (sum of dy, invstd * sum of dy * c), float32."""
    g, centered = _blocks(dy, sizes, "dy"), _blocks(c, sizes, "c")
    q = g.shape[1]
    scale = np.asarray(invstd, np.float64).reshape(-1)
    if scale.size != q:
        raise ValueError(f"invstd holds {scale.size} values, Q is {q}")
    return (_shaped(g.sum(axis=(0, 2)), q, output_shape),
            _shaped(scale * (g * centered).sum(axis=(0, 2)), q, output_shape))


def reference_ops() -> list:
    """Both ops for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class BatchNormStats(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, x, sizes=None, output_shape=None):
            return stats(x, list(sizes), None if output_shape is None else list(output_shape))

    class BatchNormGradSums(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, dy, c, invstd, sizes=None, output_shape=None):
            return grad_sums(dy, c, invstd, list(sizes), None if output_shape is None else list(output_shape))

    return [BatchNormStats, BatchNormGradSums]


__all__ = ["GRAD_SUMS", "STATS", "grad_sums", "reference_ops", "stats"]
