"""allow_by_cost: allow-list ops go fp16 only where it pays.

Rules, per undecided allow-list node in topological order:
1. with ``greedy`` (the ``amp`` policy), it goes fp16 (TensorFlow AMP's allow list);
2. if its shapes are unknown, its cost cannot be predicted: it stays fp32;
3. it goes fp16 when ``fp16_time + cast_time < fp32_time``, the Casts counted against the
   precision of its already-decided neighbours (undecided ones count as fp32); otherwise fp32.
The numbers behind each decision are kept in the plan.
"""

from __future__ import annotations

from onnxcampo import estimate
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult


class AllowByCost(PassBase):
    name = "allow_by_cost"

    def __init__(self, *, greedy: bool = False) -> None:
        self.greedy = greedy
        if greedy:
            self.name = "allow_greedy"

    def run(self, ctx: GraphContext) -> PassResult:
        fp16 = fp32 = 0
        for node in ctx.nodes:
            if ctx.plan.is_decided(node.name) or ctx.categories[node.name] is not Category.ALLOW:
                continue
            if self.greedy:
                ctx.plan.decide(node.name, Precision.FP16, Reason.ALLOW_GREEDY)
                fp16 += 1
                continue
            if not ctx.features[node.name].known:
                ctx.plan.decide(node.name, Precision.FP32, Reason.UNKNOWN_SHAPE)
                fp32 += 1
                continue
            numbers = estimate.delta(ctx, ctx.plan, [node])
            if numbers["gain_us"] > 0:
                ctx.plan.decide(node.name, Precision.FP16, Reason.ALLOW_PAYS, **numbers)
                fp16 += 1
            else:
                ctx.plan.decide(node.name, Precision.FP32, Reason.ALLOW_DOES_NOT_PAY, **numbers)
                fp32 += 1
        return PassResult(self.name, False, {"fp16": fp16, "fp32": fp32})
