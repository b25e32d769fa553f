"""Give every undecided node one precision: the ``fp16`` / ``fp32`` policies, and the default
that closes every pipeline (nodes the four passes left open run fp32).

Rules:
1. ``fp16``: every undecided node goes fp16 (only nodes ``classify`` left open get here: they
   have an fp16 schema and a known list);
2. ``fp32`` / default: every undecided node goes fp32.
"""

from __future__ import annotations

from onnxcampo.context import GraphContext
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult


class UniformPrecision(PassBase):
    def __init__(self, precision: Precision, reason: Reason) -> None:
        self.precision = precision
        self.reason = reason
        self.name = f"remaining_{precision.value}"

    def run(self, ctx: GraphContext) -> PassResult:
        count = 0
        for node in ctx.nodes:
            if not ctx.plan.is_decided(node.name):
                ctx.plan.decide(node.name, self.precision, self.reason)
                count += 1
        return PassResult(self.name, False, {self.precision.value: count})
