"""clear_by_cost: clear-list ops next to fp16 ops go fp16 when the Casts saved outweigh the cost.

Rules:
1. undecided clear-list nodes form groups: connected through precision-following float edges
   to each other;
2. a group touching at least one fp16 node goes fp16 as a whole when the cost model predicts a
   gain (node time change plus Cast time change, over all tensors the group touches); with
   ``greedy`` (the ``amp`` policy) it goes fp16 without asking, as TensorFlow AMP does (whose
   clear list holds no Cast: with ``greedy`` existing Casts are left to ``amp_casts``);
3. other groups are left for the final default (fp32).
"""

from __future__ import annotations

from onnxcampo import estimate, oplists
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult


class ClearByCost(PassBase):
    name = "clear_by_cost"

    def __init__(self, *, greedy: bool = False, infer: bool = False) -> None:
        self.greedy = greedy
        self.categories = (Category.CLEAR, Category.INFER) if infer else (Category.CLEAR,)
        self.reasons = ((Reason.EDGE_PAYS, Reason.EDGE_DOES_NOT_PAY) if infer
                        else (Reason.CLEAR_PAYS, Reason.CLEAR_DOES_NOT_PAY))
        if greedy:
            self.name = "clear_greedy"
        elif infer:
            self.name = "edge_by_cost"

    def run(self, ctx: GraphContext) -> PassResult:
        open_nodes = {
            n.name: n
            for n in ctx.nodes
            if not ctx.plan.is_decided(n.name) and ctx.categories[n.name] in self.categories
            and not (self.greedy and n.op == oplists.CAST)
        }
        fp16 = fp32 = 0
        seen: set[str] = set()
        for name, node in open_nodes.items():
            if name in seen:
                continue
            group = connected_group(ctx, node, open_nodes)
            seen.update(n.name for n in group)
            neighbours = {m.name for n in group for m in (*ctx.upstream(n), *ctx.downstream(n))}
            if not any(ctx.plan.is_fp16(m) for m in neighbours):
                continue
            if self.greedy:
                for member in group:
                    ctx.plan.decide(member.name, Precision.FP16, Reason.CLEAR_GREEDY)
                fp16 += len(group)
                continue
            numbers = estimate.delta(ctx, ctx.plan, group)
            pays = numbers["gain_us"] > 0
            yes, no = self.reasons
            for member in group:
                if pays:
                    ctx.plan.decide(member.name, Precision.FP16, yes, **numbers)
                else:
                    ctx.plan.decide(member.name, Precision.FP32, no, **numbers)
            fp16 += len(group) if pays else 0
            fp32 += 0 if pays else len(group)
        return PassResult(self.name, False, {"fp16": fp16, "fp32": fp32})


def connected_group(ctx: GraphContext, start, open_nodes: dict) -> list:
    """``start`` and every node of ``open_nodes`` (name -> node) connected to it through float
    edges and other such nodes, ``start`` first."""
    group, stack, members = [], [start], {start.name}
    while stack:
        node = stack.pop()
        group.append(node)
        for neighbour in (*ctx.upstream(node), *ctx.downstream(node)):
            if neighbour.name in open_nodes and neighbour.name not in members:
                members.add(neighbour.name)
                stack.append(neighbour)
    return group
