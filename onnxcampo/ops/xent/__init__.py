"""``ai.onnxcampo::SoftmaxCrossEntropy`` and ``SoftmaxCrossEntropyGrad``: the cross-entropy loss over
the last axis and its gradient, one pass over the logits each (``docs/ops.md``).

``SoftmaxCrossEntropy(x, labels) -> (picked, lse)``: ``lse[r] = log(sum_j exp(x[r, j]))`` over the
first ``classes`` columns of row ``r`` (float32), ``picked[r] = x[r, l_r] - lse[r]`` (the log
softmax at the label; 0 where the label is out of range), of ``output_type`` (1 float32, 10
float16), both shaped like ``labels``.

``SoftmaxCrossEntropyGrad(x, lse, labels, scale) -> dx``: ``dx[r, j] = s_r [j == l_r] -
exp(x[r, j] - lse[r]) (s_r if l_r is valid else 0)``, ``scale`` one value or one per row, of
``output_type``, shaped ``output_shape`` (default: x's shape, last dimension ``output_columns``);
``output_columns`` (default ``classes``) >= ``classes`` pads each row of ``dx`` with zeros, the
layout of a GEMM whose K or N ``onnxcampo.padding`` padded (loss fusion rule 5: no Cast and Pad
after the op).

``x`` is float32 or float16 with rows of ``width >= classes`` elements (``classes`` defaults to the
width: a padded GEMM output is read in place). ``labels`` are int64, one per row; a negative label
counts from the end (``l + classes``), as ONNX OneHot does, and a label outside ``[0, classes)``
after that is invalid. Arithmetic in float32; results rounded once to the output type.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FORWARD = "SoftmaxCrossEntropy"
GRAD = "SoftmaxCrossEntropyGrad"
FLOAT, FLOAT16 = 1, 10
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def _rows(x: np.ndarray, classes: int | None) -> tuple[np.ndarray, int]:
    width = x.shape[-1]
    classes = width if classes is None else int(classes)
    if not 1 <= classes <= width:
        raise ValueError(f"classes {classes} must lie in [1, {width}] (x's last dimension)")
    return np.asarray(x, np.float64).reshape(-1, width)[:, :classes], classes


def _columns(labels: np.ndarray, classes: int) -> np.ndarray:
    """Each row's label as a column, -1 where invalid."""
    flat = np.asarray(labels, np.int64).reshape(-1)
    column = np.where(flat < 0, flat + classes, flat)
    return np.where((column >= 0) & (column < classes), column, -1)


def forward(x: np.ndarray, labels: np.ndarray, *, classes: int | None = None,
            output_type: int = FLOAT) -> tuple[np.ndarray, np.ndarray]:
    """The forward op in numpy (float64, rounded once; the kernels compute in float32)."""
    rows, classes = _rows(x, classes)
    column = _columns(labels, classes)
    if column.size != rows.shape[0]:
        raise ValueError(f"labels hold {column.size} values, x has {rows.shape[0]} rows")
    top = rows.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))[:, 0]
    at = rows[np.arange(rows.shape[0]), np.maximum(column, 0)]
    picked = np.where(column >= 0, at - lse, 0.0)
    shape = np.shape(labels)
    return picked.astype(NUMPY[int(output_type)]).reshape(shape), lse.astype(np.float32).reshape(shape)


def grad(x: np.ndarray, lse: np.ndarray, labels: np.ndarray, scale: np.ndarray, *, classes: int | None = None,
         output_type: int = FLOAT, output_shape: Sequence[int] | None = None,
         output_columns: int | None = None) -> np.ndarray:
    """The gradient op in numpy (float64, rounded to float32 and then to ``output_type``, as the
    kernels round their float32 result)."""
    rows, classes = _rows(x, classes)
    column = _columns(labels, classes)
    s = np.asarray(scale, np.float64).reshape(-1)
    if s.size not in (1, rows.shape[0]):
        raise ValueError(f"scale holds {s.size} values: 1 or one per row ({rows.shape[0]})")
    s = np.broadcast_to(s, (rows.shape[0],))[:, None]
    total = np.where(column >= 0, s[:, 0], 0.0)[:, None]
    g = np.where(np.arange(classes)[None, :] == column[:, None], s, 0.0)
    dx = g - np.exp(rows - np.asarray(lse, np.float64).reshape(-1, 1)) * total
    columns = classes if output_columns is None else int(output_columns)
    if columns < classes:
        raise ValueError(f"output_columns ({columns}) must be >= classes ({classes})")
    dx = np.pad(dx, ((0, 0), (0, columns - classes)))
    shape = list(np.shape(x)[:-1]) + [columns] if output_shape is None else [int(d) for d in output_shape]
    return dx.astype(np.float32).astype(NUMPY[int(output_type)]).reshape(shape)


def reference_ops() -> list:
    """The two ops for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class SoftmaxCrossEntropy(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, x, labels, classes=None, output_type=None):
            return forward(x, labels, classes=classes, output_type=FLOAT if output_type is None else int(output_type))

    class SoftmaxCrossEntropyGrad(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, x, lse, labels, scale, classes=None, output_type=None, output_shape=None, output_columns=None):
            return (grad(x, lse, labels, scale, classes=classes,
                         output_type=FLOAT if output_type is None else int(output_type),
                         output_shape=None if output_shape is None else list(output_shape),
                         output_columns=output_columns),)

    return [SoftmaxCrossEntropy, SoftmaxCrossEntropyGrad]


__all__ = ["FORWARD", "GRAD", "forward", "grad", "reference_ops"]
