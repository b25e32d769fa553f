"""``ai.onnxcampo::SoftmaxGrad``: a softmax's input gradient over the last axis, one pass over the
rows (``docs/ops.md``).

``SoftmaxGrad(dy, y) -> dx``: ``dx = scale * y * (dy - sum(dy * y))`` over each row of ``cols``
elements (attribute, required), ``y`` the softmax's output; ``dy`` and ``y`` float32 or float16
with the same element count (any shapes). ``dx`` is of ``output_type`` (1 float32, 10 float16),
shaped ``output_shape`` (default dy's shape); ``scale`` (default 1) a constant factor after the
gradient (the attention's 1/sqrt(head size)). Arithmetic in float32, dx rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OP_TYPE = "SoftmaxGrad"
FLOAT, FLOAT16 = 1, 10
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def reference(dy, y, *, cols: int, scale: float = 1.0, output_type: int = FLOAT,
              output_shape: Sequence[int] | None = None) -> np.ndarray:
    """The op in numpy (float64, rounded once; the kernels compute in float32)."""
    cols = int(cols)
    if cols < 1 or np.size(dy) != np.size(y) or np.size(dy) % cols:
        raise ValueError(f"dy {np.shape(dy)} and y {np.shape(y)} are not the same rows of {cols} elements")
    d = np.asarray(dy, np.float64).reshape(-1, cols)
    s = np.asarray(y, np.float64).reshape(-1, cols)
    dx = float(scale) * s * (d - (d * s).sum(axis=1, keepdims=True))
    shape = np.shape(dy) if output_shape is None else [int(v) for v in output_shape]
    return dx.astype(NUMPY[int(output_type)]).reshape(shape)


def reference_op():
    """``SoftmaxGrad`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class SoftmaxGrad(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, dy, y, cols=None, scale=None, output_type=None, output_shape=None):
            return (reference(dy, y, cols=cols, scale=1.0 if scale is None else scale,
                              output_type=FLOAT if output_type is None else int(output_type),
                              output_shape=None if output_shape is None else list(output_shape)),)

    return SoftmaxGrad


__all__ = ["OP_TYPE", "reference", "reference_op"]
