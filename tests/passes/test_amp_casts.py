"""``amp_casts``: under amp an existing Cast goes fp16 only when every reader runs fp16.

Policy under test: ``amp`` (TensorFlow's ``MakeCastsAllowIfAllOutputsAllow``: its lists hold no
Cast, so the earlier amp passes leave existing Casts alone).
"""

from __future__ import annotations

from helpers import W_INIT, FakeCost, build_context, cast_to, casts, decide, parse, reasons, run_passes
from onnx import TensorProto

import onnxcampo
from onnxcampo.passes.amp_casts import AmpCasts
from onnxcampo.passes.classify import Classify

# Integer ids cast to float, read by a MatMul and (on the second graph) by an Exp too.
CAST_TO_MATMUL = f"""
g (int64[8,8] ids) => (float[8,8] y) <{W_INIT}> {{
  [to_float] f = Cast<to=1>(ids)
  [mm] y = MatMul(f, w)
}}
"""
CAST_TO_MATMUL_AND_EXP = f"""
g (int64[8,8] ids) => (float[8,8] y, float[8,8] e) <{W_INIT}> {{
  [to_float] f = Cast<to=1>(ids)
  [mm] y = MatMul(f, w)
  [exp] e = Exp(f)
}}
"""


def plan(text, **pre):
    ctx = build_context(parse(text), cost=FakeCost())
    run_passes(ctx, Classify())
    decide(ctx, **pre)
    run_passes(ctx, AmpCasts())
    return ctx


def test_a_cast_read_only_by_fp16_nodes_goes_fp16():
    """The rule: the Cast's one reader (the MatMul) runs fp16, so the Cast does
    (CAST_FOLLOWS_CONSUMERS)."""
    assert reasons(plan(CAST_TO_MATMUL, mm="fp16"))["to_float"] == "CAST_FOLLOWS_CONSUMERS"


def test_a_cast_with_an_fp32_reader_is_left_open():
    """The rule: the Exp reading the Cast runs fp32: the Cast is left for the default (fp32)."""
    assert "to_float" not in reasons(plan(CAST_TO_MATMUL_AND_EXP, mm="fp16", exp="fp32"))


def test_amp_retargets_a_cast_feeding_a_matmul_and_adds_one_before_it_when_an_exp_reads_it_too():
    """The whole amp policy: with only the MatMul reading it, the Cast's ``to`` becomes float16
    and no Cast is added before the MatMul; with an Exp (deny list, fp32) reading it too, it stays
    a Cast to float and one Cast to fp16 is added for the MatMul."""
    alone = onnxcampo.optimize(parse(CAST_TO_MATMUL), policy="amp", experimental={"check_invariants": True})
    assert alone.report["plan"]["to_float"]["reason"] == "cast_follows_consumers"
    to_fp16 = [c for c in casts(alone.model) if cast_to(c) == TensorProto.FLOAT16]
    assert [c.name for c in to_fp16] == ["to_float"]
    shared = onnxcampo.optimize(parse(CAST_TO_MATMUL_AND_EXP), policy="amp", experimental={"check_invariants": True})
    assert shared.report["plan"]["to_float"] == {"precision": "fp32", "reason": "default_fp32"}
    to_fp16 = [c for c in casts(shared.model) if cast_to(c) == TensorProto.FLOAT16]
    assert len(to_fp16) == 1 and to_fp16[0].input == ["f"]
