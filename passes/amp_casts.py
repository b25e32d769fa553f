"""The ``amp`` baseline's existing Casts, as TensorFlow's ``MakeCastsAllowIfAllOutputsAllow`` paints them.

TensorFlow AMP's lists hold no Cast: an existing Cast to float is painted only at the end, fp16
when every op reading it runs fp16, so that its ``to`` becomes float16 instead of a second Cast
being added after it.

Rule: an undecided Cast whose output is float, is no graph output, is read at least once, and
is read only through precision-following slots of nodes planned fp16, goes fp16. Every other
Cast is left to the final default (fp32).
"""

from __future__ import annotations

from onnxcampo import oplists
from onnxcampo.context import GraphContext
from onnxcampo.plan import Precision, Reason
from onnxcampo.signature import Slot

from onnxcampo.passes.manager import PassBase, PassResult


class AmpCasts(PassBase):
    name = "amp_casts"

    def run(self, ctx: GraphContext) -> PassResult:
        fp16 = 0
        for node in ctx.nodes:
            if node.op != oplists.CAST or ctx.plan.is_decided(node.name):
                continue
            outputs = ctx.follow_outputs(node)
            if not outputs or any(t.name in ctx.graph_outputs for t in outputs):
                continue
            uses = [use for t in outputs for use in ctx.uses(t)]
            if uses and all(use.slot is Slot.FOLLOW and ctx.plan.is_fp16(use.node.name) for use in uses):
                ctx.plan.decide(node.name, Precision.FP16, Reason.CAST_FOLLOWS_CONSUMERS)
                fp16 += 1
        return PassResult(self.name, False, {"fp16": fp16})
