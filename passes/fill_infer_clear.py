"""fill_infer_clear: infer/clear ops between fp16 ops go fp16 (their Casts would be pure overhead).

Rule: an undecided infer-list or clear-list node goes fp16 when it can be reached from an fp16
node going downstream through undecided infer/clear nodes, *and* an fp16 node can be reached
from it the same way. Such a node sits on an fp16 path: running it fp32 would need a Cast on
each side. (Deny-downstream nodes were decided by ``deny_propagation``, so this never reopens them.)
With ``casts=False`` (the ``amp`` policy, as TensorFlow AMP, whose lists hold no Cast) existing
Casts are neither filled nor walked through; ``amp_casts`` decides them.
"""

from __future__ import annotations

from collections import deque

from onnxcampo import oplists
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult

_FILLABLE = (Category.INFER, Category.CLEAR)


class FillInferClear(PassBase):
    name = "fill_infer_clear"

    def __init__(self, *, casts: bool = True) -> None:
        self.casts = casts

    def run(self, ctx: GraphContext) -> PassResult:
        fp16_nodes = [n for n in ctx.nodes if ctx.plan.is_fp16(n.name)]
        below = self._reach(ctx, fp16_nodes, ctx.downstream)
        above = self._reach(ctx, fp16_nodes, ctx.upstream)
        filled = 0
        for node in ctx.nodes:
            if node.name in below and node.name in above:
                ctx.plan.decide(node.name, Precision.FP16, Reason.BETWEEN_FP16)
                filled += 1
        return PassResult(self.name, False, {"fp16": filled})

    def _reach(self, ctx: GraphContext, sources, step) -> set[str]:
        reached: set[str] = set()
        queue = deque(sources)
        while queue:
            for neighbour in step(queue.popleft()):
                if neighbour.name in reached or ctx.plan.is_decided(neighbour.name):
                    continue
                if ctx.categories[neighbour.name] not in _FILLABLE:
                    continue
                if not self.casts and neighbour.op == oplists.CAST:
                    continue
                reached.add(neighbour.name)
                queue.append(neighbour)
        return reached
