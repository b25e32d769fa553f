"""The ``amp`` baseline's deny propagation, as TensorFlow's ``auto_mixed_precision`` paints it.

TensorFlow's grappler (``AutoMixedPrecisionImpl::PropagateDenyFwdThroughClearAndInfer``) does not
paint everything downstream of a deny-list op: deny travels forward only along paths that end at
an infer-list or deny-list op, because only those ops would compute on the dangerous values in
fp16. A clear-list op (data movement) that leads only to allow-list ops is left to the later
passes, which paint it fp16 next to them (``PropagateAllowThroughClear``: one Cast after the
deny-list op instead of one before the allow-list op).

Rules:
1. every undecided deny-list node goes fp32;
2. the *infer-bound* nodes are the infer-list and deny-list nodes, and every clear-list node from
   which one of them can be reached going downstream through clear-list nodes only (by op lists,
   whatever was decided for them; an existing Cast is in no TensorFlow list, never infer-bound);
3. from every deny-list node planned fp32, walk downstream along precision-following float edges
   through infer-bound nodes; each undecided one reached goes fp32. Nodes already planned fp32
   pass the walk on; nodes planned fp16, allow-list nodes and clear-list nodes that lead to no
   infer/deny node stop it.

So under amp ``Exp -> Transpose -> Transpose -> MatMul`` keeps only Exp fp32 (the Transposes feed
no infer/deny op), while ``Exp -> Transpose -> Add`` keeps all three fp32. Campo keeps its
stricter rule (``deny_propagation``).

Where the ONNX graph differs from TensorFlow's, the mapping is: TensorFlow's later passes are
``fill_infer_clear`` (``AddClearAndInferToAllowIfBetweenAllow``) and ``clear_by_cost`` with
``greedy`` (``PropagateAllowThroughClear``), both with existing Casts left out, then
``amp_casts`` (``MakeCastsAllowIfAllOutputsAllow``); ``AddInferToAllowIfFollowAllow`` runs only
in TensorFlow's bf16 (oneDNN) mode, not for fp16 on the GPU. Ops without an fp16 kernel or schema
were fixed fp32 by ``classify`` (``RemoveAllowsetWithFp32``). If/Loop/Scan bodies stay fp32 (where
TensorFlow paints while-loop bodies and matches the colours of their recurrent edges); ONNX
sequence ops are in no list, so they all stay fp32 (one colour, as TensorFlow's tensor-list
clusters must have).
"""

from __future__ import annotations

from collections import deque

from onnxcampo import oplists
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.deny_propagation import DenyPropagation

_BOUND_ENDS = (Category.INFER, Category.DENY)


class AmpDenyPropagation(DenyPropagation):
    """Rule 1 and the result as ``deny_propagation``'s; rules 2 and 3 walk instead."""

    name = "amp_deny_propagation"

    def _walk(self, ctx: GraphContext, queue: deque) -> int:
        downstream = 0
        bound = self._infer_bound(ctx)
        walked = {n.name for n in queue}
        while queue:
            for consumer in ctx.downstream(queue.popleft()):
                if consumer.name in walked or consumer.name not in bound:
                    continue
                if ctx.plan.is_fp16(consumer.name):
                    continue
                walked.add(consumer.name)
                if not ctx.plan.is_decided(consumer.name):
                    ctx.plan.decide(consumer.name, Precision.FP32, Reason.DENY_TOWARD_INFER)
                    downstream += 1
                queue.append(consumer)
        return downstream

    @staticmethod
    def _infer_bound(ctx: GraphContext) -> set[str]:
        ends = [n for n in ctx.nodes if ctx.categories[n.name] in _BOUND_ENDS]
        bound = {n.name for n in ends}
        queue = deque(ends)
        while queue:
            for producer in ctx.upstream(queue.popleft()):
                if producer.name in bound or ctx.categories[producer.name] is not Category.CLEAR:
                    continue
                if producer.op == oplists.CAST:
                    continue  # in no TensorFlow list: left to amp_casts
                bound.add(producer.name)
                queue.append(producer)
        return bound
