"""``ai.onnxcampo::BlockReduceSum``: ``x`` read as a contiguous ``[P, Q, R]`` array, summed over
axes 0 and 2 (``docs/ops.md``).

Node: input ``x`` (float32 or float16, any shape of ``P*Q*R`` elements); output ``y``, ``Q``
elements of type ``output_type`` (1 float32, the default; 10 float16) shaped ``output_shape``
(default ``[Q]``); attribute ``sizes = [P, Q, R]``. The sum is float32, rounded once to the
output type; the order of the additions is the kernel's (fixed: results are reproducible), so
values agree with a float64 sum rounded to float32 up to float32 rounding of the partial sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

OP_TYPE = "BlockReduceSum"
FLOAT, FLOAT16 = 1, 10
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def reference(x: np.ndarray, sizes: Sequence[int], output_type: int = FLOAT,
              output_shape: Sequence[int] | None = None) -> np.ndarray:
    """The op in numpy: the sum in float64, rounded once to the output type (the kernels add in
    float32, so they differ from this by float32 rounding)."""
    p, q, r = (int(s) for s in sizes)
    if x.size != p * q * r:
        raise ValueError(f"x holds {x.size} elements, sizes {list(sizes)} {p * q * r}")
    shape = [q] if output_shape is None else [int(d) for d in output_shape]
    if math.prod(shape) != q:
        raise ValueError(f"output_shape {shape} must hold Q = {q} elements")
    total = np.asarray(x, np.float64).reshape(p, q, r).sum(axis=(0, 2))
    return total.astype(NUMPY[int(output_type)]).reshape(shape)


def reference_op():
    """``BlockReduceSum`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    class BlockReduceSum(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, x, sizes=None, output_type=None, output_shape=None, input_type=None):
            return (reference(x, list(sizes), FLOAT if output_type is None else int(output_type),
                              None if output_shape is None else list(output_shape)),)

    return BlockReduceSum


__all__ = ["OP_TYPE", "reference", "reference_op"]
