"""deny_propagation: deny-list ops, and what they feed through infer/clear ops, stay fp32.

Rules:
1. every undecided deny-list node goes fp32;
2. from every deny-list node, walk downstream along precision-following float edges through
   undecided infer-list and clear-list nodes; each one reached goes fp32 (an fp16 Add after an
   Exp would overflow just the same). The walk stops at allow-list nodes and decided nodes.
3. with ``experimental.means_end_deny``: a ReduceSum's ``Mul`` by a constant no larger in
   magnitude than one over the values each output sums (a mean, or less: a training
   BatchNorm's backward takes two, ``Mul(ReduceSum(dy), 1/n)``) goes fp32 and ends the walk:
   no larger than the values summed, it cannot overflow where they did not, so what it feeds is
   left to the cost passes.
"""

from __future__ import annotations

from collections import deque

import onnx_graphsurgeon as gs

from onnxcampo import oplists
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
        means = ctx.config.experimental.means_end_deny
        while queue:
            for consumer in ctx.downstream(queue.popleft()):
                if ctx.plan.is_decided(consumer.name) or ctx.categories[consumer.name] not in _PASS_THROUGH:
                    continue
                ctx.plan.decide(consumer.name, Precision.FP32, Reason.DENY_DOWNSTREAM)
                downstream += 1
                if not (means and is_mean(ctx, consumer)):
                    queue.append(consumer)  # rule 3: a mean ends the walk
        return downstream


def is_mean(ctx: GraphContext, consumer: gs.Node) -> bool:
    """Rule 3: ``consumer`` multiplies a sum by a scalar constant ``c`` with ``0 < |c| <= 1 / k``,
    ``k`` the values each output sums: the sum is a ReduceSum, or ReduceSums and shape-only views
    of one another (a reduction the exporter or the simplifier split), read from the first one's
    input to the product's."""
    if consumer.op not in oplists.MEAN_SCALES or len(consumer.inputs) != 2:
        return False
    constants = [t for t in consumer.inputs if ctx.is_constant(t)]
    if len(constants) != 1:
        return False
    summed = next(t for t in consumer.inputs if t is not constants[0])
    base, tensor = None, summed
    for _ in range(8):  # up through the sums and their views
        producer = ctx.producer(tensor)
        if producer is None or not (producer.op in oplists.MEAN_SUMS or producer.op in oplists.SHAPE_ONLY):
            break
        if producer.op in oplists.MEAN_SUMS:
            base = producer.inputs[0]
        tensor = producer.inputs[0]
    values = ctx.constant_array(constants[0])
    if base is None or values.size != 1:
        return False
    inputs, outputs = ctx.numel(base), ctx.numel(summed)
    c = abs(float(values.reshape(-1)[0]))
    return bool(inputs and outputs) and 0.0 < c <= outputs / inputs * (1 + 1e-6)


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
