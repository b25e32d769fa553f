"""``allow_by_cost``: allow-list ops go fp16 only where the cost model says it pays.

The fake cost model: every node takes 10 us in fp32 and 5 us in fp16 (2x), every Cast costs
``cast_us`` (chosen per test); constants are converted offline and never cost a Cast.
"""

from __future__ import annotations

import pytest
from helpers import FakeCost, W_INIT, build_context, decide, parse, precisions, reasons, run_passes

from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.classify import Classify


# x (graph input) -> MatMul(w constant) -> y (graph output): fp16 needs a Cast of x to fp16 and
# a Cast of y back to fp32 (I/O types are kept): 2 Casts.
SINGLE = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
  [mm] y = MatMul(x, w)
}}
"""


def allow(text, *, greedy=False, pre=None, **cost):
    ctx = build_context(parse(text), cost=FakeCost(**cost))
    run_passes(ctx, Classify())
    if pre:
        decide(ctx, **pre)
    run_passes(ctx, AllowByCost(greedy=greedy))
    return ctx


def test_pays_goes_fp16_with_numbers():
    """Rule 3: 5 us (fp16) + 2 Casts x 1 us < 10 us (fp32): fp16, ALLOW_PAYS, with the numbers
    behind it recorded in the plan."""
    ctx = allow(SINGLE, cast_us=1.0)
    decision = ctx.plan.get("mm")
    assert (decision.precision.value, decision.reason.name) == ("fp16", "ALLOW_PAYS")
    assert decision.numbers == {"fp32_us": 10.0, "fp16_us": 5.0, "cast_us": 2.0, "gain_us": 3.0}


def test_does_not_pay_stays_fp32():
    """Rule 3: 5 us + 2 Casts x 3 us = 11 us >= 10 us: fp32, ALLOW_DOES_NOT_PAY."""
    ctx = allow(SINGLE, cast_us=3.0)
    decision = ctx.plan.get("mm")
    assert (decision.precision.value, decision.reason.name) == ("fp32", "ALLOW_DOES_NOT_PAY")
    assert decision.numbers["gain_us"] == pytest.approx(-1.0)


def test_break_even_stays_fp32():
    """Rule 3 is strict: 5 us + 2 x 2.5 us == 10 us does not pay."""
    assert precisions(allow(SINGLE, cast_us=2.5)) == {"mm": "fp32"}


def test_speedup_too_small_stays_fp32_even_with_free_casts():
    """Rule 3: casts cost nothing but fp16 is no faster (speedup 1): no gain, fp32."""
    assert precisions(allow(SINGLE, cast_us=0.0, speedup=1.0)) == {"mm": "fp32"}


def test_greedy_goes_fp16_whatever_the_cost():
    """Rule 1 (amp): the allow-list MatMul goes fp16 (ALLOW_GREEDY) although Casts of 100 us
    make it a loss."""
    ctx = allow(SINGLE, greedy=True, cast_us=100.0)
    assert reasons(ctx) == {"mm": "ALLOW_GREEDY"} and precisions(ctx) == {"mm": "fp16"}


def test_unknown_shapes_stay_fp32():
    """Rule 2: with a dynamic batch not pinned, the MatMul's cost cannot be predicted: fp32
    (UNKNOWN_SHAPE), even though casts are free and fp16 is 2x faster."""
    text = f"""
    g (float[N,8] x) => (float[N,8] y) <{W_INIT}> {{
      [mm] y = MatMul(x, w)
    }}
    """
    ctx = allow(text, cast_us=0.0)
    assert reasons(ctx) == {"mm": "UNKNOWN_SHAPE"} and precisions(ctx) == {"mm": "fp32"}


def test_unknown_shapes_pinned_then_costed():
    """Rule 2 / 3: the same model with ``N`` pinned through ``dim_values`` is costed: fp16."""
    text = f"""
    g (float[N,8] x) => (float[N,8] y) <{W_INIT}> {{
      [mm] y = MatMul(x, w)
    }}
    """
    ctx = build_context(parse(text), cost=FakeCost(cast_us=0.0), dim_values={"N": 4})
    run_passes(ctx, Classify(), AllowByCost())
    assert reasons(ctx) == {"mm": "ALLOW_PAYS"}


def test_greedy_ignores_unknown_shapes():
    """Rule 1 comes before rule 2: amp converts the MatMul even with unknown shapes."""
    text = f"""
    g (float[N,8] x) => (float[N,8] y) <{W_INIT}> {{
      [mm] y = MatMul(x, w)
    }}
    """
    assert reasons(allow(text, greedy=True)) == {"mm": "ALLOW_GREEDY"}


CHAIN = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
  [mm1] a = MatMul(x, w)
  [mm2] y = MatMul(a, w)
}}
"""


def test_chain_in_topological_order_later_node_sees_earlier_decision():
    """Rule 3, topological order, 2 us Casts. mm1 first, mm2 undecided (counted fp32): Casts of
    x and of a: 5 + 2 x 2 = 9 < 10: fp16. mm2 then sees mm1 fp16: its Cast of ``a`` disappears
    and the Cast of y appears: cast change 0, gain 5: fp16."""
    ctx = allow(CHAIN, cast_us=2.0)
    assert precisions(ctx) == {"mm1": "fp16", "mm2": "fp16"}
    assert ctx.plan.get("mm1").numbers["cast_us"] == 4.0
    assert ctx.plan.get("mm2").numbers["cast_us"] == 0.0


def test_decided_fp16_neighbour_makes_the_cast_free():
    """Rule 3: casts are counted against decided neighbours. With 3 us Casts a lone MatMul does
    not pay (5 + 6 > 10); after a Relu decided fp16 upstream, its input Cast is saved and only
    the output Cast remains: 5 + 3 - 3 = 5 < 10: fp16."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [relu] r = Relu(x)
      [mm] y = MatMul(r, w)
    }}
    """
    alone = allow(text, cast_us=3.0)
    assert precisions(alone) == {"mm": "fp32"}
    after_fp16 = allow(text, cast_us=3.0, pre={"relu": "fp16"})
    assert precisions(after_fp16) == {"relu": "fp16", "mm": "fp16"}
    assert after_fp16.plan.get("mm").numbers["cast_us"] == 0.0


def test_only_undecided_allow_list_nodes_are_decided():
    """allow_by_cost touches only undecided allow-list nodes: the Relu (infer list) and Exp (deny list)
    stay open; a MatMul excluded by the user keeps its classify decision."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [keep] a = MatMul(x, w)
      [relu] b = Relu(a)
      [exp] c = Exp(b)
      [mm] y = MatMul(c, w)
    }}
    """
    ctx = build_context(parse(text), cost=FakeCost(cast_us=0.0), exclude_nodes=("^keep$",))
    run_passes(ctx, Classify(), AllowByCost())
    assert reasons(ctx) == {"keep": "USER_EXCLUDED", "mm": "ALLOW_PAYS"}


def test_pass_names():
    assert AllowByCost().name == "allow_by_cost"
    assert AllowByCost(greedy=True).name == "allow_greedy"
