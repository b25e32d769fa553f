"""``amp_deny_propagation``: TensorFlow AMP's deny paint, forward only toward infer/deny ops.

Policy under test: ``amp`` (greedy allow list, TensorFlow's ``PropagateDenyFwdThroughClearAndInfer``,
then the infer/clear ops between fp16 ops, then clear ops next to fp16 ops).
"""

from __future__ import annotations

from helpers import W_INIT, FakeCost, build_context, decide, casts, cast_to, elem_types, parse, precisions, producer, reasons, run_passes
from onnx import TensorProto

import onnxcampo
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.amp_deny_propagation import AmpDenyPropagation
from onnxcampo.passes.classify import Classify

# Exp -> Transpose -> Transpose -> MatMul (issue 16): the Transposes lead only to an allow-list op.
EXP_TRANSPOSES_MATMUL = f"""
g (float[8,8] x) => (float[8,8] y) <{W_INIT}> {{
  [exp] e = Exp(x)
  [tr1] t1 = Transpose<perm=[1,0]>(e)
  [tr2] t2 = Transpose<perm=[1,0]>(t1)
  [mm] y = MatMul(t2, w)
}}
"""

# Exp -> Transpose -> Add -> Reshape -> MatMul: the Transpose leads to an infer-list op (Add).
EXP_TRANSPOSE_ADD_RESHAPE_MATMUL = f"""
g (float[8,8] x) => (float[8,8] y) <{W_INIT}, int64[2] shp = {{8, 8}}> {{
  [exp] e = Exp(x)
  [tr] t = Transpose<perm=[1,0]>(e)
  [add] a = Add(t, x)
  [rs] r = Reshape(a, shp)
  [mm] y = MatMul(r, w)
}}
"""


def analyse(text):
    ctx = build_context(parse(text), cost=FakeCost(cast_us=0.5))
    run_passes(ctx, Classify(), AllowByCost(greedy=True), AmpDenyPropagation())
    return ctx


def fp16_nodes(model) -> set[str]:
    types = elem_types(model)
    return {n.name for n in model.graph.node if n.op_type != "Cast" and types.get(n.output[0]) == TensorProto.FLOAT16}


def to_fp16(model):
    return [c for c in casts(model) if cast_to(c) == TensorProto.FLOAT16]


def test_clear_ops_leading_only_to_allow_ops_are_not_denied():
    """Rules 2 and 3: neither Transpose can reach an infer/deny op through clear ops, so the walk
    from the Exp stops at once: only the Exp is decided (DENY_LIST)."""
    ctx = analyse(EXP_TRANSPOSES_MATMUL)
    assert reasons(ctx) == {"exp": "DENY_LIST", "mm": "ALLOW_GREEDY"}


def test_amp_paints_the_transposes_after_an_exp_fp16_with_one_cast():
    """The whole amp policy on Exp -> Transpose -> Transpose -> MatMul, as TensorFlow paints it:
    Exp fp32, both Transposes fp16 (allow propagates through clear ops to the MatMul), MatMul fp16,
    and one Cast, fp32 -> fp16, right after the Exp (plus the Cast back to fp32 that keeps the graph
    output's dtype). (The rule before this one denied both Transposes and put the Cast before the
    MatMul.)"""
    result = onnxcampo.optimize(parse(EXP_TRANSPOSES_MATMUL), policy="amp", experimental={"check_invariants": True})
    model = result.model
    assert fp16_nodes(model) == {"tr1", "tr2", "mm"}
    [cast] = to_fp16(model)
    assert producer(model, cast.input[0]).name == "exp"
    plan = result.report["plan"]
    assert plan["tr1"]["reason"] == plan["tr2"]["reason"] == "clear_greedy"


def test_a_clear_op_between_a_deny_op_and_an_infer_op_is_denied():
    """Rules 2 and 3, where TensorFlow does paint deny: the Transpose feeds the Add (infer list), so
    Transpose and Add are denied (DENY_TOWARD_INFER). The Reshape after the Add leads only to the
    MatMul: it is left open, and amp then paints it fp16 with the MatMul, the one Cast to fp16
    after the Add."""
    ctx = analyse(EXP_TRANSPOSE_ADD_RESHAPE_MATMUL)
    assert reasons(ctx) == {"exp": "DENY_LIST", "tr": "DENY_TOWARD_INFER", "add": "DENY_TOWARD_INFER",
                            "mm": "ALLOW_GREEDY"}
    model = onnxcampo.optimize(parse(EXP_TRANSPOSE_ADD_RESHAPE_MATMUL), policy="amp",
                               experimental={"check_invariants": True}).model
    assert fp16_nodes(model) == {"rs", "mm"}
    [cast] = to_fp16(model)
    assert producer(model, cast.input[0]).name == "add"


def test_deny_crosses_chains_of_infer_ops_and_branches():
    """Rule 3: Exp -> Add -> Mul (infer after infer) is denied all the way; on the other branch
    the Relu (clear) feeds only a graph output: it is not denied."""
    text = """
    g (float[4,8] x) => (float[4,8] y, float[4,8] r) {
      [exp] e = Exp(x)
      [add] a = Add(e, x)
      [mul] y = Mul(a, a)
      [relu] r = Relu(e)
    }
    """
    ctx = analyse(text)
    assert reasons(ctx) == {"exp": "DENY_LIST", "add": "DENY_TOWARD_INFER", "mul": "DENY_TOWARD_INFER"}


def test_fp32_nodes_pass_the_walk_on_and_fp16_nodes_stop_it():
    """Rule 3: a Transpose already decided fp32 passes the deny walk on to the Sigmoid; one decided
    fp16 (already runs in fp16 would do the same) stops it."""
    text = """
    g (float[4,8] x) => (float[8,4] y, float[8,4] z) {
      [exp] e = Exp(x)
      [tr1] t1 = Transpose<perm=[1,0]>(e)
      [sig1] y = Sigmoid(t1)
      [tr2] t2 = Transpose<perm=[1,0]>(e)
      [sig2] z = Sigmoid(t2)
    }
    """
    ctx = build_context(parse(text), cost=FakeCost())
    run_passes(ctx, Classify())
    decide(ctx, tr1="fp32", tr2="fp16")
    run_passes(ctx, AmpDenyPropagation())
    assert reasons(ctx) == {"exp": "DENY_LIST", "tr1": "POLICY_FP32", "tr2": "POLICY_FP16", "sig1": "DENY_TOWARD_INFER"}
    assert precisions(ctx)["sig1"] == "fp32"
