"""Where a plan needs Casts: the dtype a node produces, the dtype each use needs, which tensors
are pinned to their dtype, and how many Casts a tensor gets.

These are the rules Cast insertion (``passes/insert_casts.py``) applies and the estimate
(``onnxcampo/estimate.py``) counts; both read them here so that the predicted Casts are the
inserted ones (one per (tensor, dtype) whatever the number of consumers; constants are
converted offline, so they cost no Cast; graph inputs and outputs keep their dtype when
``keep_io_types``).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo.context import GraphContext, Use
from onnxcampo.plan import Precision
from onnxcampo.signature import Slot

PrecisionOf = Callable[[str], Precision]


def produced_dtype(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> int | None:
    """dtype the tensor has under the plan; None when it may take any (constants, and graph
    inputs when I/O types may change)."""
    original = ctx.original_dtype(tensor)
    if ctx.is_constant(tensor):
        return None
    producer = ctx.producer(tensor)
    if producer is None:
        return original if ctx.config.keep_io_types else None
    sig = ctx.signatures.get(producer.name)
    index = next(i for i, out in enumerate(producer.outputs) if out is tensor)
    if sig is not None and sig.outputs[index] is Slot.FOLLOW and precision_of(producer.name) is Precision.FP16:
        return TensorProto.FLOAT16
    return original


def use_dtype(ctx: GraphContext, tensor: gs.Tensor, use: Use, precision_of: PrecisionOf) -> int | None:
    """dtype one consumer slot needs under the plan; None when it takes any float."""
    if use.slot is Slot.ANY:
        return None
    if use.slot is Slot.FOLLOW and precision_of(use.node.name) is Precision.FP16:
        return TensorProto.FLOAT16
    return ctx.original_dtype(tensor)


def pinned_dtype(ctx: GraphContext, tensor: gs.Tensor) -> int | None:
    """The dtype a tensor's *name* must keep: graph outputs (with ``keep_io_types``) and names
    read implicitly by If/Loop/Scan bodies."""
    if (tensor.name in ctx.graph_outputs and ctx.config.keep_io_types) or tensor.name in ctx.implicit_names:
        return ctx.original_dtype(tensor)
    return None


def required_dtypes(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> set[int]:
    """The dtypes the tensor must exist in under the plan: one per use that needs a dtype, and
    the pinned one."""
    needed = {use_dtype(ctx, tensor, use, precision_of) for use in ctx.uses(tensor)}
    needed.add(pinned_dtype(ctx, tensor))
    needed.discard(None)
    return needed


def tensor_casts(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> int:
    """Casts the tensor gets under the plan: one per required dtype it is not produced in."""
    if not ctx.is_float(tensor):
        return 0
    produced = produced_dtype(ctx, tensor, precision_of)
    if produced is None and ctx.is_constant(tensor):
        return 0  # converted offline
    needed = required_dtypes(ctx, tensor, precision_of)
    if produced is None:
        # A graph input whose type may change: it becomes fp16 only if every reader wants fp16
        # (Cast insertion rule 5); otherwise it stays as it is and fp16 readers get a Cast.
        if needed == {TensorProto.FLOAT16}:
            return 0
        produced = ctx.original_dtype(tensor)
    return len(needed - {produced})
