"""Fusable chains: found in graphs, and priced by their measured factor when unbroken."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import FakeCost, build_context, parse, weight
from onnxcampo import estimate
from onnxcampo.costdb.chains import PATTERNS, ChainCase, build_chain, chain_cases, chain_graph, fit_chains
from onnxcampo.plan import Precision, PrecisionPlan, Reason

TRANSFORMER = """
block (float[64, 32] x, float[64, 32] skip, float[32, 48] w1, float[48] b1, float[48, 32] w2, float[32] b2,
        float[32] gamma, float[32] beta) => (float[64, 32] y) <float div = {1.4142}, float one = {1.0},
        float half = {0.5}> {
    h = MatMul(x, w1)
    hb = Add(h, b1)
    d = Div(hb, div)
    e = Erf(d)
    e1 = Add(e, one)
    p = Mul(hb, e1)
    g = Mul(p, half)
    o = MatMul(g, w2)
    ob = Add(o, b2)
    r = Add(ob, skip)
    y = LayerNormalization(r, gamma, beta)
}
"""

CONV = """
net (float[2, 8, 10, 10] x, float[2, 8, 10, 10] res, float[8, 8, 3, 3] w, float[8] b, float[8, 8, 3, 3] w2)
        => (float[2, 8, 10, 10] y, float[2, 8, 10, 10] z) {
    c = Conv<pads = [1, 1, 1, 1]>(x, w, b)
    s = Add(c, res)
    y = Relu(s)
    c2 = Conv<pads = [1, 1, 1, 1]>(y, w2)
    z = Relu(c2)
}
"""


def model(text: str):
    """The graph with its inputs after the first activations turned into random weights."""
    proto = parse(text)
    graph = proto.graph
    activations = {"x", "skip", "res"}
    for value in [i for i in graph.input if i.name not in activations]:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        graph.initializer.append(weight(value.name, shape))
        graph.input.remove(value)
    return proto


class ChainCost(FakeCost):
    def __init__(self, factors: dict[tuple[str, str], float], **kw) -> None:
        super().__init__(**kw)
        self.factors = factors

    def chain_factor(self, pattern: str, precision: str) -> float:
        return self.factors.get((pattern, precision), 1.0)


def _by_op(ctx):
    return {n.name: n.op for n in ctx.nodes}


def test_transformer_chains_are_found():
    ctx = build_context(model(TRANSFORMER))
    found = {pattern: tuple(ctx.graph.nodes[[n.name for n in ctx.graph.nodes].index(m)].op for m in members)
             for pattern, members in set(ctx.chains.values())}
    # the first bias Add belongs to the GELU chain, so its MatMul is in no chain
    assert found == {"bias_gelu": ("Add", "Div", "Erf", "Add", "Mul", "Mul"),
                     "matmul_bias": ("MatMul", "Add"), "add_layernorm": ("Add", "LayerNormalization")}
    assert sum(1 for m in ctx.chains if _by_op(ctx)[m] == "MatMul") == 1


def test_conv_chains_are_found():
    ctx = build_context(model(CONV))
    patterns = sorted({c[0] for c in ctx.chains.values()})
    assert patterns == ["conv_add_relu", "conv_relu"]
    assert len(ctx.chains) == 5


def test_a_cast_between_members_costs_the_fusion():
    """With a chain factor of 0.5, the chain's nodes cost half when they share a precision; the
    plan that splits the chain pays their full time."""
    cost = ChainCost({("add_layernorm", "fp32"): 0.5, ("add_layernorm", "fp16"): 0.5}, default_us=10.0)
    ctx = build_context(model(TRANSFORMER), cost=cost)
    members = next(m for p, m in ctx.chains.values() if p == "add_layernorm")
    together, split = PrecisionPlan(), PrecisionPlan()
    for node in ctx.nodes:
        together.decide(node.name, Precision.FP32, Reason.POLICY_FP32)
        precision = Precision.FP16 if node.name == members[0] else Precision.FP32
        split.decide(node.name, precision, Reason.POLICY_FP32)
    whole = estimate.plan_time(ctx, together)
    broken = estimate.plan_time(ctx, split)
    # together: two members at 10 us x 0.5; split: the Add at fp16 (5 us) + the norm at 10 us
    assert broken.nodes_us - whole.nodes_us == pytest.approx((5 + 10) - (5 + 5))


def test_delta_counts_a_decided_partner_losing_its_fusion():
    cost = ChainCost({("matmul_bias", "fp32"): 0.5, ("matmul_bias", "fp16"): 0.5}, default_us=10.0, cast_us=0.0)
    ctx = build_context(model(TRANSFORMER), cost=cost)
    matmul, add = next(m for p, m in ctx.chains.values() if p == "matmul_bias")
    plan = PrecisionPlan()
    plan.decide(add, Precision.FP32, Reason.DENY_LIST)
    node = next(n for n in ctx.nodes if n.name == matmul)
    numbers = estimate.delta(ctx, plan, [node])
    # fp32: both fused (5 + 5); fp16: MatMul 10/2 alone, the Add loses its fusion (10)
    assert numbers["fp32_us"] == pytest.approx(10.0)
    assert numbers["fp16_us"] == pytest.approx(15.0)
    undecided = estimate.delta(ctx, PrecisionPlan(), [node])  # an undecided Add follows the MatMul
    assert undecided["fp16_us"] == pytest.approx(2.5)


def test_fit_chains_takes_the_median_ratio():
    rows = [{"chain": "conv_relu", "precision": "fp16", "time_us": t, "parts_us": [8.0, 2.0]} for t in (5.0, 6.0, 9.0)]
    rows.append({"chain": "conv_relu", "precision": "fp32", "time_us": 10.0, "parts_us": []})  # no parts: skipped
    fitted = fit_chains(rows)
    assert fitted == {"conv_relu": {"fp16": 0.6, "samples": 3, "range": {"fp16": [0.5, 0.9]}}}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_builds_valid_chain_and_part_models(pattern):
    """Each chain model and each of its single-node parts run at the shapes they are timed at."""
    from onnx.reference import ReferenceEvaluator

    case = next(c for c in chain_cases() if c.pattern == pattern)
    small = ChainCase(pattern, tuple(min(d, 16) if i else 2 for i, d in enumerate(case.dims)) if pattern.startswith("conv")
                      else tuple(min(d, 24) for d in case.dims))
    rng = np.random.default_rng(0)

    def values(shape, dtype):
        return (rng.random(shape) * 0.1 + 0.05).astype(dtype)

    (whole, feeds), parts = build_chain(small, "fp32", values)
    assert [op for op, _, _ in parts] == [n.op_type for n in chain_graph(small).nodes]
    out = ReferenceEvaluator(whole).run(None, feeds)[0]
    assert np.isfinite(out).all()
    assert out.shape == tuple(d.dim_value for d in whole.graph.output[0].type.tensor_type.shape.dim)
    for _, part, part_feeds in parts:  # every part is a valid model of the shapes it is timed at
        result = ReferenceEvaluator(part).run(None, part_feeds)[0]
        assert result.shape == tuple(d.dim_value for d in part.graph.output[0].type.tensor_type.shape.dim)
