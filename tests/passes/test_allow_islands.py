"""``allow_islands``: allow-list ops that only pay together go fp16 together.

Fake cost model: every node takes 10 us in fp32 and 5 us in fp16; a Cast costs ``cast_us``.
A lone MatMul between fp32 neighbours needs two Casts, so with 3 us Casts it does not pay
(5 + 6 > 10); a chain pays when the Casts at its two ends cost less than what all its nodes save.
"""

from __future__ import annotations

from helpers import EXP_BETWEEN_MATMULS, FakeCost, MM_ADD_RELU_MM, W_INIT, build_context, parse, precisions, reasons, run_passes

from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.allow_islands import AllowIslands
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear




def islands(text, *, cast_us, fill=False, **options):
    ctx = build_context(parse(text), cost=FakeCost(cast_us=cast_us), **options)
    passes = [Classify(), AllowByCost(), DenyPropagation(), AllowIslands()]
    if fill:
        passes.append(FillInferClear())
    results = run_passes(ctx, *passes)
    return ctx, results


def test_chain_that_pays_only_as_a_whole_goes_fp16():
    """Rules 1-3: alone, each MatMul loses (5 + 2 x 3 > 10: ALLOW_DOES_NOT_PAY). Together with
    the Add and Relu between them, 4 nodes save 20 us and need 2 Casts (6 us): both MatMuls
    switch to fp16 (ALLOW_ISLAND_PAYS); the Add and Relu are left for fill_infer_clear, which
    fills them."""
    ctx, results = islands(MM_ADD_RELU_MM, cast_us=3.0)
    assert reasons(ctx) == {"mm1": "ALLOW_ISLAND_PAYS", "mm2": "ALLOW_ISLAND_PAYS"}
    assert ctx.plan.get("mm1").numbers == {"fp32_us": 40.0, "fp16_us": 20.0, "cast_us": 6.0, "gain_us": 14.0}
    assert results[-1].counts == {"islands": 1, "fp16": 2}
    ctx, _ = islands(MM_ADD_RELU_MM, cast_us=3.0, fill=True)
    assert precisions(ctx) == {"mm1": "fp16", "mm2": "fp16", "add": "fp16", "relu": "fp16"}


def test_chain_that_does_not_pay_is_left_alone():
    """Rule 3: with 12 us Casts the island saves 20 us but costs 24: nothing changes."""
    ctx, results = islands(MM_ADD_RELU_MM, cast_us=12.0)
    assert reasons(ctx) == {"mm1": "ALLOW_DOES_NOT_PAY", "mm2": "ALLOW_DOES_NOT_PAY"}
    assert results[-1].counts == {"islands": 1, "fp16": 0}


def test_single_allow_node_pays_with_its_tail():
    """Rule 5: a lone MatMul (no other allow-list node reachable) is priced with its tail, the
    open infer/clear nodes downstream: alone 5 + 2 x 3 > 10, with the Relu 2 x 5 + 2 x 3 < 20
    (its output Cast moves past the Relu); with 6 us Casts the pair does not pay either."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [relu] y = Relu(a)
    }}
    """
    ctx, results = islands(text, cast_us=3.0)
    assert reasons(ctx) == {"mm": "ALLOW_ISLAND_PAYS"}
    assert ctx.plan.get("mm").numbers == {"fp32_us": 20.0, "fp16_us": 10.0, "cast_us": 6.0, "gain_us": 4.0}
    assert results[-1].counts == {"islands": 1, "fp16": 1}
    ctx, results = islands(text, cast_us=6.0)
    assert reasons(ctx) == {"mm": "ALLOW_DOES_NOT_PAY"}
    assert results[-1].counts == {"islands": 0, "fp16": 0}


def test_a_tail_stops_at_decided_nodes():
    """Rule 5: the tail runs through open nodes only; a deny-list op (Exp) and what follows it
    stay out, so the MatMul is priced with the Relu alone."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [relu] b = Relu(a)
      [exp] c = Exp(b)
      [neg] y = Neg(c)
    }}
    """
    ctx, _ = islands(text, cast_us=3.0)
    assert reasons(ctx)["mm"] == "ALLOW_ISLAND_PAYS"
    assert ctx.plan.get("mm").numbers["fp32_us"] == 20.0  # MatMul and Relu, not Neg


def test_island_through_clear_ops():
    """Rules 1-2: the path may run through clear-list ops (Transpose twice)."""
    text = f"""
    g (float[8,8] x) => (float[8,8] y) <{W_INIT}> {{
      [mm1] a = MatMul(x, w)
      [t1] b = Transpose<perm=[1,0]>(a)
      [t2] c = Transpose<perm=[1,0]>(b)
      [mm2] y = MatMul(c, w)
    }}
    """
    ctx, _ = islands(text, cast_us=3.0)
    assert reasons(ctx) == {"mm1": "ALLOW_ISLAND_PAYS", "mm2": "ALLOW_ISLAND_PAYS"}


def test_deny_downstream_cuts_the_island():
    """Rules run after deny_propagation: an Add downstream of an Exp is fp32 (DENY_DOWNSTREAM) and is no
    passage, so the two MatMuls it connects form no island and stay fp32."""
    text = EXP_BETWEEN_MATMULS
    ctx, _ = islands(text, cast_us=3.0)
    assert reasons(ctx)["add"] == "DENY_DOWNSTREAM"
    assert reasons(ctx)["mm1"] == reasons(ctx)["mm2"] == "ALLOW_DOES_NOT_PAY"


def test_only_allow_by_cost_decisions_join_an_island():
    """Rule 1: an allow node fixed by classify (user exclusion) is no member: the other MatMul is
    alone and priced with its tail only (rule 5: itself, the Add and the Relu, 30 us in fp32;
    not the excluded MatMul)."""
    ctx, _ = islands(MM_ADD_RELU_MM, cast_us=3.0, exclude_nodes=("^mm2$",))
    assert reasons(ctx) == {"mm2": "USER_EXCLUDED", "mm1": "ALLOW_ISLAND_PAYS"}
    assert ctx.plan.get("mm1").numbers["fp32_us"] == 30.0


def test_side_branch_is_not_between():
    """Rule 2: a Sigmoid fed by the chain but feeding only a graph output is not between two
    allow nodes: it is not priced with the island (the numbers count 4 nodes, not 5)."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) <{W_INIT}, float[8] b = {{1,2,3,4,5,6,7,8}}> {{
      [mm1] a = MatMul(x, w)
      [add] s = Add(a, b)
      [relu] r = Relu(s)
      [sig] z = Sigmoid(r)
      [mm2] y = MatMul(r, w)
    }}
    """
    ctx, _ = islands(text, cast_us=3.0)
    assert reasons(ctx) == {"mm1": "ALLOW_ISLAND_PAYS", "mm2": "ALLOW_ISLAND_PAYS"}
    assert ctx.plan.get("mm1").numbers["fp32_us"] == 40.0


def test_island_that_does_not_pay_whole_still_switches_a_pair_that_does():
    """Rule 4. mm1 -> relu -> mm2 -> relu -> mm3, 4 us Casts, 10 us MatMuls twice as fast in
    fp16 except the unaligned mm3 (4x slower in fp16). Alone, mm1 or mm2 gain 5 us and pay 8 us
    of Casts; the whole island loses (mm3); the pair mm1+mm2 gains 10.5 us for 8 us of Casts:
    it goes fp16 and mm3 stays fp32."""
    text = f"""
    g (float[4,8] x) => (float[4,5] y) <{W_INIT}, float[8,5] w5 = {{{",".join(["0.5"] * 40)}}}> {{
      [mm1] a = MatMul(x, w)
      [relu1] r1 = Relu(a)
      [mm2] b = MatMul(r1, w)
      [relu2] r2 = Relu(b)
      [mm3] y = MatMul(r2, w5)
    }}
    """
    cost = FakeCost(cast_us=4.0, op_us={"Relu": 1.0}, unaligned_speedup=0.25)
    ctx = build_context(parse(text), cost=cost)
    run_passes(ctx, Classify(), AllowByCost(), DenyPropagation(), AllowIslands(), FillInferClear())
    assert precisions(ctx) == {"mm1": "fp16", "relu1": "fp16", "mm2": "fp16", "mm3": "fp32"}
    assert reasons(ctx)["mm1"] == "ALLOW_ISLAND_PAYS" and reasons(ctx)["mm3"] == "ALLOW_DOES_NOT_PAY"


def test_rule_4_looks_only_at_near_partners_in_a_residual_stream(monkeypatch):
    """A residual stream joins every MatMul to every other through open Adds: rule 4 prices each
    rejected MatMul with its nearest MAX_PARTNERS partners only, so the work grows with the graph,
    not with its square (the pairs priced are counted, not timed)."""
    from onnxcampo.benchmarks.tool import generated_model

    from onnxcampo.passes import allow_islands

    calls = []
    original = AllowIslands._between
    monkeypatch.setattr(AllowIslands, "_between", lambda self, ctx, ends: calls.append(1) or original(self, ctx, ends))
    # fp16 no faster than fp32: nothing pays alone, the stream as a whole neither, so rule 4 runs
    ctx = build_context(generated_model(300), cost=FakeCost(cast_us=30.0, speedup=1.0))
    run_passes(ctx, Classify(), AllowByCost(), DenyPropagation(), AllowIslands())
    matmuls = sum(node.op == "MatMul" for node in ctx.nodes)
    assert 0 < len(calls) <= matmuls * allow_islands.MAX_PARTNERS
