"""deny_propagation: deny-list ops, and what they feed through infer/clear ops, stay fp32.

Rules:
1. every undecided deny-list node goes fp32;
2. from every deny-list node, walk downstream along precision-following float edges through
   undecided infer-list and clear-list nodes; each one reached goes fp32 (an fp16 Add after an
   Exp would overflow just the same). The walk stops at allow-list nodes and decided nodes.
"""

from __future__ import annotations

from collections import deque

from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult

_PASS_THROUGH = (Category.INFER, Category.CLEAR)


class DenyPropagation(PassBase):
    name = "deny_propagation"

    def run(self, ctx: GraphContext) -> PassResult:
        queue, denied = deny_sources(ctx)
        downstream = self._walk(ctx, queue)
        return PassResult(self.name, False, {"deny": denied, "downstream": downstream})

    def _walk(self, ctx: GraphContext, queue: deque) -> int:
        """Rule 2, from the deny-list nodes planned fp32 in ``queue``; how many nodes went fp32.
        ``amp_deny_propagation`` overrides this walk and keeps rule 1 and the result."""
        downstream = 0
        while queue:
            for consumer in ctx.downstream(queue.popleft()):
                if ctx.plan.is_decided(consumer.name) or ctx.categories[consumer.name] not in _PASS_THROUGH:
                    continue
                ctx.plan.decide(consumer.name, Precision.FP32, Reason.DENY_DOWNSTREAM)
                downstream += 1
                queue.append(consumer)
        return downstream


def deny_sources(ctx: GraphContext) -> tuple[deque, int]:
    """Rule 1 (``amp_deny_propagation`` keeps it): every undecided deny-list node goes fp32;
    returns the deny-list nodes planned fp32 (the walks start there) and how many were decided."""
    queue, denied = deque(), 0
    for node in ctx.nodes:
        if ctx.categories[node.name] is Category.DENY:
            if not ctx.plan.is_decided(node.name):
                ctx.plan.decide(node.name, Precision.FP32, Reason.DENY_LIST)
                denied += 1
            if ctx.plan.precision(node.name) is Precision.FP32:
                queue.append(node)
    return queue, denied
