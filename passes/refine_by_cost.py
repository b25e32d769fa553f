"""refine_by_cost (our extension of Campo): fp32 regions the four passes left are priced as a whole.

The four passes decide group by group, each against the precisions decided before it. A chain
that only pays in fp16 as one piece can fall between them: ``allow_by_cost`` rejects its GEMM
alone (its Casts), ``allow_islands`` finds no other allow op to pair it with, and the clear and
infer ops around it touch no fp16 node, so ``clear_by_cost`` never prices them and they end fp32
by default. ResNet-50's stem backward is one: the MaxPool's scatter-add (fp32: it sums in its
output dtype) -> Sum -> the ReLU mask -> the stem's weight gradient and its BatchNorm
reductions. Run fp16 together it needs one Cast (fused into the mask's kernel) and every node in
it runs on half the bytes.

Rules, after the default (every node decided):
1. a node is open to refinement when it is fp32 by a cost decision or by default
   (``allow by cost`` rejected, ``clear``/``edge by cost`` rejected, ``left fp32``), never for
   a reason of accuracy or support (deny list and its propagation, the training rules, ...);
2. a region is a set of open nodes connected to each other through float edges;
3. a region goes fp16 as a whole when the cost model predicts a gain (node times, fusions they
   join or leave, every Cast that appears or disappears, as the other passes price a group);
4. rounds repeat while some region switched (a switch changes its neighbours' Casts), at most
   ``MAX_ROUNDS``.
"""

from __future__ import annotations

from onnxcampo import estimate
from onnxcampo.context import GraphContext
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.clear_by_cost import connected_group
from onnxcampo.passes.manager import PassBase, PassResult

OPEN = (Reason.ALLOW_DOES_NOT_PAY, Reason.CLEAR_DOES_NOT_PAY, Reason.EDGE_DOES_NOT_PAY, Reason.DEFAULT_FP32)
MAX_ROUNDS = 4


class RefineByCost(PassBase):
    name = "refine_by_cost"

    def run(self, ctx: GraphContext) -> PassResult:
        switched = regions = rounds = 0
        for rounds in range(1, MAX_ROUNDS + 1):
            changed = 0
            for region in self._regions(ctx):
                regions += 1
                numbers = estimate.delta(ctx, ctx.plan, region)
                if numbers["gain_us"] <= 0:
                    continue
                for member in region:
                    ctx.plan.override(member.name, Precision.FP16, Reason.REGION_PAYS, **numbers)
                changed += len(region)
            switched += changed
            if not changed:
                break
        return PassResult(self.name, False, {"regions": regions, "fp16": switched, "rounds": rounds})

    @staticmethod
    def _regions(ctx: GraphContext) -> list[list]:
        def is_open(name: str) -> bool:
            decision = ctx.plan.get(name)
            return decision is not None and decision.precision is Precision.FP32 and decision.reason in OPEN

        open_nodes = {n.name: n for n in ctx.nodes if is_open(n.name)}
        seen: set[str] = set()
        regions = []
        for name, node in open_nodes.items():
            if name not in seen:
                regions.append(connected_group(ctx, node, open_nodes))
                seen.update(n.name for n in regions[-1])
        return regions
