"""``clear_by_cost``: clear-list groups next to fp16 ops go fp16 when the Casts saved
pay for the change of their own time.

In the fake cost model of these tests the data-movement ops (Reshape, Transpose, Concat) take
1 us in fp32 and ``1 / clear_speedup`` us in fp16, but Reshape costs nothing (ONNX Runtime aliases
its output: ``oplists.ALIASED``); a Cast costs ``cast_us``.
"""

from __future__ import annotations

import pytest
from helpers import FakeCost, W_INIT, build_context, decide, parse, precisions, reasons, run_passes

from onnxcampo.passes.classify import Classify
from onnxcampo.passes.clear_by_cost import ClearByCost

CLEAR_OPS = ("Reshape", "Transpose", "Concat")

# Two fp16 MatMuls feed a Reshape -> Transpose -> Concat group whose result is a graph output.
# Group fp32: Casts of a1 and a2 back to fp32 (2). Group fp16: one Cast of the graph output y
# back to fp32 (1). Going fp16 saves one Cast.
MERGE = f"""
g (float[4,8] x) => (float[8,8] y) <{W_INIT}, int64[2] shp = {{8,4}}> {{
  [mm1] a1 = MatMul(x, w)
  [mm2] a2 = MatMul(x, w)
  [rs] r = Reshape(a1, shp)
  [tr] t = Transpose<perm=[1,0]>(r)
  [cat] y = Concat<axis=0>(t, a2)
}}
"""


def clear(text, pre, *, greedy=False, cast_us=1.0, clear_speedup=1.0, **options):
    cost = FakeCost(cast_us=cast_us, op_us={op: 1.0 for op in CLEAR_OPS},
                    op_speedup={op: clear_speedup for op in CLEAR_OPS})
    ctx = build_context(parse(text), cost=cost, **options)
    run_passes(ctx, Classify())
    decide(ctx, **pre)
    run_passes(ctx, ClearByCost(greedy=greedy))
    return ctx


def test_group_saving_a_cast_goes_fp16():
    """Rule 2: Reshape, Transpose and Concat form one group touching fp16 MatMuls; as fast in
    fp16 as in fp32, it saves one 1 us Cast: the whole group goes fp16 (CLEAR_PAYS), every
    member with the group's numbers (the aliased Reshape costs nothing)."""
    ctx = clear(MERGE, {"mm1": "fp16", "mm2": "fp16"})
    assert {n: reasons(ctx)[n] for n in ("rs", "tr", "cat")} == dict.fromkeys(("rs", "tr", "cat"), "CLEAR_PAYS")
    numbers = ctx.plan.get("rs").numbers
    assert numbers == {"fp32_us": 2.0, "fp16_us": 2.0, "cast_us": -1.0, "gain_us": 1.0}
    assert ctx.plan.get("tr").numbers == ctx.plan.get("cat").numbers == numbers


@pytest.mark.parametrize("cast_us, expected", [(3.0, "fp16"), (1.5, "fp32"), (2.0, "fp32")])
def test_group_goes_fp16_iff_saved_casts_pay(cast_us, expected):
    """Rule 2: the group is 2 us slower in fp16 (Transpose and Concat 1 -> 2 us each; the
    aliased Reshape costs nothing) and saves one Cast: fp16 iff the Cast costs more than 2 us
    (strictly)."""
    ctx = clear(MERGE, {"mm1": "fp16", "mm2": "fp16"}, cast_us=cast_us, clear_speedup=0.5)
    assert {precisions(ctx)[n] for n in ("rs", "tr", "cat")} == {expected}
    reason = "CLEAR_PAYS" if expected == "fp16" else "CLEAR_DOES_NOT_PAY"
    assert {reasons(ctx)[n] for n in ("rs", "tr", "cat")} == {reason}


def test_group_adding_casts_stays_fp32():
    """Rule 2: a Concat of two graph inputs feeding an fp16 MatMul. fp32: one Cast (c to
    fp16); fp16: two Casts (x1 and x2 to fp16). No faster in fp16, so it does not pay."""
    text = f"""
    g (float[2,8] x1, float[2,8] x2) => (float[4,8] y) <{W_INIT}> {{
      [cat] c = Concat<axis=0>(x1, x2)
      [mm] y = MatMul(c, w)
    }}
    """
    ctx = clear(text, {"mm": "fp16"})
    decision = ctx.plan.get("cat")
    assert (decision.precision.value, decision.reason.name) == ("fp32", "CLEAR_DOES_NOT_PAY")
    assert decision.numbers["cast_us"] == 1.0


def test_group_adding_casts_goes_fp16_when_much_faster():
    """Rule 2: the same Concat goes fp16 when fp16 saves more (10x faster: 0.9 us) than the
    extra Cast costs (0.5 us)."""
    text = f"""
    g (float[2,8] x1, float[2,8] x2) => (float[4,8] y) <{W_INIT}> {{
      [cat] c = Concat<axis=0>(x1, x2)
      [mm] y = MatMul(c, w)
    }}
    """
    ctx = clear(text, {"mm": "fp16"}, cast_us=0.5, clear_speedup=10.0)
    assert reasons(ctx)["cat"] == "CLEAR_PAYS"


def test_group_not_touching_fp16_is_left_open():
    """Rule 3: with both MatMuls fp32 the group touches no fp16 node: left undecided (the
    final default makes it fp32), even though fp16 would be faster."""
    ctx = clear(MERGE, {"mm1": "fp32", "mm2": "fp32"}, clear_speedup=10.0, cast_us=0.0)
    assert not any(ctx.plan.is_decided(n) for n in ("rs", "tr", "cat"))


def test_greedy_group_goes_fp16_without_asking():
    """Rule 2 with ``greedy`` (amp): a group touching an fp16 node goes fp16 even when the cost
    model says it loses (fp16 2x slower, Casts free)."""
    ctx = clear(MERGE, {"mm1": "fp16", "mm2": "fp32"}, greedy=True, cast_us=0.0, clear_speedup=0.5)
    assert {reasons(ctx)[n] for n in ("rs", "tr", "cat")} == {"CLEAR_GREEDY"}
    assert {precisions(ctx)[n] for n in ("rs", "tr", "cat")} == {"fp16"}


def test_greedy_group_not_touching_fp16_is_left_open():
    ctx = clear(MERGE, {"mm1": "fp32", "mm2": "fp32"}, greedy=True)
    assert not any(ctx.plan.is_decided(n) for n in ("rs", "tr", "cat"))


def test_groups_are_split_by_decided_and_non_clear_nodes():
    """Rule 1: groups are connected through undecided clear nodes only. Transpose t1 touches
    the fp16 MatMul; an fp32 Sigmoid separates it from Transpose t2, which touches no fp16
    node. t1 moves the Cast from ``a`` to ``b`` (no change) and is 0.5 us faster in fp16: it
    goes fp16; t2 stays open."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [t1] b = Transpose<perm=[1,0]>(a)
      [sig] c = Sigmoid(b)
      [t2] y = Transpose<perm=[1,0]>(c)
    }}
    """
    ctx = clear(text, {"mm": "fp16", "sig": "fp32"}, clear_speedup=2.0)
    assert reasons(ctx)["t1"] == "CLEAR_PAYS"
    assert ctx.plan.get("t1").numbers == {"fp32_us": 1.0, "fp16_us": 0.5, "cast_us": 0.0, "gain_us": 0.5}
    assert not ctx.plan.is_decided("t2")


def test_only_clear_nodes_are_decided():
    """``clear_by_cost`` leaves undecided infer-list and allow-list nodes alone."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [sig] b = Sigmoid(a)
      [mm2] y = MatMul(b, w)
    }}
    """
    ctx = clear(text, {"mm": "fp16"})
    assert set(precisions(ctx)) == {"mm"}


def test_pass_names():
    assert ClearByCost().name == "clear_by_cost"
    assert ClearByCost(greedy=True).name == "clear_greedy"


# ``edge_by_cost`` (``ClearByCost(infer=True)``): an fp16 MatMul feeds a bias Add and a Tanh that end at
# an Exp (deny list, fp32). Tail fp32: a Cast of the MatMul's output. Tail fp16: a Cast of the
# Tanh's output instead (same size): no Cast saved, but the two infer ops run at fp16 speed.
TAIL = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}, float[8] b = {{1,2,3,4,5,6,7,8}}> {{
  [mm] a = MatMul(x, w)
  [add] s = Add(a, b)
  [tanh] t = Tanh(s)
  [exp] y = Exp(t)
}}
"""


def edge(text, pre, *, cast_us=1.0, speedup=2.0):
    ctx = build_context(parse(text), cost=FakeCost(cast_us=cast_us, speedup=speedup))
    run_passes(ctx, Classify())
    decide(ctx, **pre)
    run_passes(ctx, ClearByCost(), ClearByCost(infer=True))
    return ctx


def test_infer_tail_of_an_fp16_gemm_goes_fp16_when_it_pays():
    """edge_by_cost: the Add and Tanh (10 us each fp32, 5 us fp16) move the MatMul's Cast to the
    Tanh's output: 10 us saved, Casts unchanged. (The numbers also count the fp16 MatMul, 5 us
    either way: MatMul + Add is a fusable chain, so its time depends on the Add's precision.)"""
    ctx = edge(TAIL, {"mm": "fp16", "exp": "fp32"})
    assert {n: reasons(ctx)[n] for n in ("add", "tanh")} == dict.fromkeys(("add", "tanh"), "EDGE_PAYS")
    assert ctx.plan.get("add").numbers == {"fp32_us": 25.0, "fp16_us": 15.0, "cast_us": 0.0, "gain_us": 10.0}


def test_infer_tail_stays_fp32_when_fp16_is_no_faster_and_plain_clear_by_cost_leaves_it():
    """edge_by_cost: with no fp16 speed-up nothing is gained: EDGE_DOES_NOT_PAY; clear_by_cost
    alone (clear ops only) never looks at infer ops."""
    ctx = edge(TAIL, {"mm": "fp16", "exp": "fp32"}, speedup=1.0)
    assert {n: reasons(ctx)[n] for n in ("add", "tanh")} == dict.fromkeys(("add", "tanh"), "EDGE_DOES_NOT_PAY")
    ctx = build_context(parse(TAIL), cost=FakeCost(cast_us=1.0))
    run_passes(ctx, Classify())
    decide(ctx, mm="fp16", exp="fp32")
    run_passes(ctx, ClearByCost())
    assert not ctx.plan.is_decided("add") and not ctx.plan.is_decided("tanh")
