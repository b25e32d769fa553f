"""``ai.onnxcampo::LayerNormGrad``: a layer normalization's input gradient over the last axis, one
pass over the rows (``docs/ops.md``).

``LayerNormGrad(dy, xhat, invstd, gamma[, acc]) -> dx``: with ``g = dy * gamma`` row by row,
``dx = invstd * ((g - mean(g)) - xhat * mean(g * xhat)) [+ acc]``. ``dy``, ``xhat`` and ``acc``
hold ``rows x cols`` elements (any shapes of that many), ``gamma`` ``cols`` (its element count
sets ``cols``), ``invstd`` ``rows``; each float32 or float16. ``dx`` is of ``output_type`` (1
float32, 10 float16), shaped ``output_shape`` (default dy's shape). Arithmetic in float32, dx
rounded once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OP_TYPE = "LayerNormGrad"
FLOAT, FLOAT16 = 1, 10
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def reference(dy, xhat, invstd, gamma, acc=None, *, output_type: int = FLOAT,
              output_shape: Sequence[int] | None = None) -> np.ndarray:
    """The op in numpy (float64, rounded once; the kernels compute in float32)."""
    cols = int(np.size(gamma))
    rows = int(np.size(dy)) // max(cols, 1)
    if cols == 0 or rows * cols != np.size(dy) or np.size(xhat) != np.size(dy) or np.size(invstd) != rows:
        raise ValueError(f"dy {np.shape(dy)}, xhat {np.shape(xhat)}, invstd {np.shape(invstd)} are not rows of "
                         f"gamma's {cols} elements")
    g = np.asarray(dy, np.float64).reshape(rows, cols) * np.asarray(gamma, np.float64).reshape(1, cols)
    x = np.asarray(xhat, np.float64).reshape(rows, cols)
    dx = np.asarray(invstd, np.float64).reshape(rows, 1) * (
        (g - g.mean(axis=1, keepdims=True)) - x * (g * x).mean(axis=1, keepdims=True))
    if acc is not None:
        dx = dx + np.asarray(acc, np.float64).reshape(rows, cols)
    shape = np.shape(dy) if output_shape is None else [int(d) for d in output_shape]
    return dx.astype(NUMPY[int(output_type)]).reshape(shape)


def reference_op():
    """``LayerNormGrad`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class LayerNormGrad(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, dy, xhat, invstd, gamma, acc=None, output_type=None, output_shape=None):
            return (reference(dy, xhat, invstd, gamma, acc, output_type=FLOAT if output_type is None else int(output_type),
                              output_shape=None if output_shape is None else list(output_shape)),)

    return LayerNormGrad


__all__ = ["OP_TYPE", "reference", "reference_op"]
