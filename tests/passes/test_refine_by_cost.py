"""``refine_by_cost``: fp32 regions the four passes left are priced as a whole.

Fake cost model: every node takes 10 us in fp32 and 5 us in fp16; a Cast costs ``cast_us``.
The graph's chain ``Add -> Relu -> MatMul`` touches no fp16 node: ``allow_by_cost`` rejects the
MatMul alone (5 + 2 Casts > 10 with 3 us Casts), ``allow_islands`` finds no partner and no tail
(the MatMul writes the graph's output), and the clear/infer passes never price the Add and Relu
(nothing fp16 next to them): the default leaves all three fp32. Together they save 15 us for two
Casts (the input's and the output's).
"""

from __future__ import annotations

import pytest
from helpers import FakeCost, W_INIT, build_context, parse, precisions, reasons, run_passes

from onnxcampo import estimate
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.allow_islands import AllowIslands
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.clear_by_cost import ClearByCost
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear
from onnxcampo.passes.refine_by_cost import RefineByCost
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, Reason

CHAIN = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
  [add] a = Add(x, x)
  [relu] b = Relu(a)
  [mm] y = MatMul(b, w)
}}
"""


def campo(text, *, cast_us, refine=True):
    ctx = build_context(parse(text), cost=FakeCost(cast_us=cast_us))
    passes = [Classify(), AllowByCost(), DenyPropagation(), AllowIslands(), FillInferClear(), ClearByCost(),
              ClearByCost(infer=True), UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32)]
    results = run_passes(ctx, *passes)
    before = estimate.plan_time(ctx, ctx.plan).total_us
    if refine:
        results = run_passes(ctx, RefineByCost())
    return ctx, results, before


def test_region_left_by_the_four_passes_goes_fp16_when_it_pays_as_a_whole():
    """Rules 1-3: without refinement the chain is fp32 (the MatMul rejected, the others left);
    the region {Add, Relu, MatMul} saves 15 us for 6 us of Casts, so it goes fp16, and the
    whole plan's predicted time falls by what the decision recorded."""
    ctx, _, _ = campo(CHAIN, cast_us=3.0, refine=False)
    assert reasons(ctx) == {"add": "DEFAULT_FP32", "relu": "DEFAULT_FP32", "mm": "ALLOW_DOES_NOT_PAY"}
    ctx, results, before = campo(CHAIN, cast_us=3.0)
    assert precisions(ctx) == {"add": "fp16", "relu": "fp16", "mm": "fp16"}
    assert set(reasons(ctx).values()) == {"REGION_PAYS"}
    numbers = ctx.plan.get("mm").numbers
    assert numbers == {"fp32_us": 30.0, "fp16_us": 15.0, "cast_us": 6.0, "gain_us": 9.0}
    assert estimate.plan_time(ctx, ctx.plan).total_us == pytest.approx(before - numbers["gain_us"])
    assert results[-1].counts == {"regions": 1, "fp16": 3, "rounds": 2}


def test_region_that_does_not_pay_stays_fp32():
    """Rule 3: with 8 us Casts the region saves 15 us but costs 16: nothing changes."""
    ctx, results, _ = campo(CHAIN, cast_us=8.0)
    assert precisions(ctx) == {"add": "fp32", "relu": "fp32", "mm": "fp32"}
    assert results[-1].counts == {"regions": 1, "fp16": 0, "rounds": 1}


def test_deny_list_ops_and_their_propagation_are_never_reopened():
    """Rule 1: an Exp (deny list) in front of the chain is fp32 for accuracy, and so is what runs
    downstream of it before the MatMul: only the MatMul is open, and alone it does not pay."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [exp] a = Exp(x)
      [relu] b = Relu(a)
      [mm] y = MatMul(b, w)
    }}
    """
    ctx, results, _ = campo(text, cast_us=3.0)
    assert reasons(ctx)["exp"] == "DENY_LIST" and reasons(ctx)["relu"] == "DENY_DOWNSTREAM"
    assert precisions(ctx) == {"exp": "fp32", "relu": "fp32", "mm": "fp32"}
    assert results[-1].counts["fp16"] == 0


def test_the_campo_pipeline_refines_after_the_default():
    """The campo policy runs the pass last, once every node is decided (its regions are read from
    the decisions); amp (TensorFlow's passes, the baseline) does not run it."""
    from onnxcampo.pipeline import ANALYSIS

    names = [p.name for p in ANALYSIS["campo"]]
    assert names[-2:] == ["remaining_fp32", "refine_by_cost"]
    assert "refine_by_cost" not in [p.name for p in ANALYSIS["amp"]]
