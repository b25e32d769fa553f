"""``UniformPrecision``: the fp16 / fp32 policies, and the default closing every pipeline."""

from __future__ import annotations

from helpers import FakeCost, build_context, parse, precisions, reasons, run_passes

from onnxcampo.passes.classify import Classify
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, Reason

MODEL = """
g (float[4,8] x) => (float[4,8] y, int64[2] s) <float[8,8] w = {%s}> {
  [mm] a = MatMul(x, w)
  [exp] e = Exp(a)
  [hm] y = Hardmax(e)
  [shape] s = Shape(x)
}
""" % ",".join(["0.125"] * 64)


def test_fp16_policy_sends_every_open_node_to_fp16():
    """Rule 1: after classify, every undecided node (MatMul, and the deny-list Exp) goes fp16
    (POLICY_FP16); classify's decisions (Hardmax unknown, Shape no float) stay."""
    ctx = build_context(parse(MODEL), cost=FakeCost())
    run_passes(ctx, Classify(), UniformPrecision(Precision.FP16, Reason.POLICY_FP16))
    assert reasons(ctx) == {"mm": "POLICY_FP16", "exp": "POLICY_FP16", "hm": "UNKNOWN_OP", "shape": "NO_FLOAT"}
    assert precisions(ctx) == {"mm": "fp16", "exp": "fp16", "hm": "fp32", "shape": "fp32"}


def test_fp32_default_closes_the_plan():
    """Rule 2: every undecided node goes fp32 with the given reason; decided ones keep theirs."""
    ctx = build_context(parse(MODEL), cost=FakeCost())
    run_passes(ctx, Classify())
    ctx.plan.decide("mm", Precision.FP16, Reason.ALLOW_PAYS)
    results = run_passes(ctx, UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32))
    assert reasons(ctx) == {"mm": "ALLOW_PAYS", "exp": "DEFAULT_FP32", "hm": "UNKNOWN_OP", "shape": "NO_FLOAT"}
    assert results[-1].counts == {"fp32": 1} and results[-1].name == "remaining_fp32"
