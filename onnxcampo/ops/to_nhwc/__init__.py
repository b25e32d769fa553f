"""``ai.onnxcampo::NchwToNhwc``: a channels-first tensor channels-last, cast and its channels
zero-padded, in one pass (the image a channels-last stem reads; ``docs/ops.md``). The numpy
reference for the tests and the CUDA check.
"""

from __future__ import annotations

import numpy as np


def nchw_to_nhwc(x: np.ndarray, to: int, channels: int | None = None) -> np.ndarray:
    """``NchwToNhwc``: x [N, C, S...] channels-last in ``to``'s type (1 float32, 10 float16), zero
    channels appended up to ``channels``."""
    y = np.moveaxis(x, 1, -1).astype({1: np.float32, 10: np.float16}[int(to)])
    c = x.shape[1] if channels is None else int(channels)
    if c < x.shape[1]:
        raise ValueError(f"channels ({c}) below x's {x.shape[1]}")
    return np.ascontiguousarray(np.pad(y, [(0, 0)] * (y.ndim - 1) + [(0, c - x.shape[1])]))


def reference_ops() -> list:
    """``NchwToNhwc`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class NchwToNhwc(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, x, to=None, channels=None):
            return (nchw_to_nhwc(x, to, channels),)

    return [NchwToNhwc]


__all__ = ["nchw_to_nhwc", "reference_ops"]
