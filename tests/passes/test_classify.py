"""``classify``: the nodes the four passes must not touch, each with its reason.

Every test runs Classify alone on a fresh plan and states which nodes it decides (and how) and
which it leaves open for the four passes.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from helpers import (
    FLOAT,
    FLOAT16,
    build_context,
    cast_to,
    consumers,
    elem_types,
    export,
    node,
    ops,
    parse,
    precisions,
    producer,
    reasons,
    reference_run,
    run_passes,
)

from onnxcampo import OptimizeConfig, optimize
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.insert_casts import InsertCasts
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, Reason

W8_INIT = "float[8,8] w = {" + ",".join(["0.125"] * 64) + "}"
W8 = f"<{W8_INIT}>"


def classify(model, **options):
    ctx = build_context(model, **options)
    run_passes(ctx, Classify())
    return ctx


# --- rule 1: control flow -----------------------------------------------------------------
IF_MODEL = f"""
g (float[4,8] x, bool c) => (float[4,8] y) {W8} {{
  [mm] mm = MatMul(x, w)
  [branch] y = If(c) <
    then_branch = t () => (float[4,8] o) {{ [inner_relu] o = Relu(mm) }},
    else_branch = e () => (float[4,8] o2) {{ [inner_sigmoid] o2 = Sigmoid(mm) }}
  >
}}
"""


def test_if_node_and_its_body_nodes_are_fp32_with_reasons():
    """Rule 1: an If node runs fp32 (CONTROL_FLOW) and so does every node of both bodies
    (IN_SUBGRAPH, keyed ``parent:attr/child``); the MatMul outside is left to the passes."""
    ctx = classify(parse(IF_MODEL))
    assert reasons(ctx) == {
        "branch": "CONTROL_FLOW",
        "branch:then_branch/inner_relu": "IN_SUBGRAPH",
        "branch:else_branch/inner_sigmoid": "IN_SUBGRAPH",
    }
    assert set(precisions(ctx).values()) == {"fp32"}
    assert not ctx.plan.is_decided("mm")


def test_tensor_read_implicitly_by_if_body_keeps_fp32_when_producer_goes_fp16():
    """Rule 1 with insert_casts rule 2: ``mm`` is read by the If bodies from the outer scope.
    When its producer runs fp16 the producer writes ``mm/fp16`` and a Cast gives back ``mm``
    in fp32, so the bodies (fp32) read what they read before."""
    ctx = classify(parse(IF_MODEL))
    run_passes(ctx, UniformPrecision(Precision.FP16, Reason.POLICY_FP16), InsertCasts())
    model = export(ctx)
    assert ops(model) == ["Cast", "MatMul", "Cast", "If"]
    matmul, back = node(model, "mm"), model.graph.node[2]
    assert matmul.output[0] == "mm/fp16"
    assert list(back.input) == ["mm/fp16"] and list(back.output) == ["mm"] and cast_to(back) == FLOAT
    types = elem_types(model)
    assert types["mm/fp16"] == FLOAT16 and types["mm"] == FLOAT and types["w"] == FLOAT16
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    (relu,) = reference_run(model, {"x": x, "c": np.array(True)})
    np.testing.assert_allclose(relu, np.maximum(x @ np.full((8, 8), 0.125, np.float32), 0), rtol=1e-3, atol=1e-3)


def test_loop_body_nodes_fp32():
    """Rule 1 for Loop: the Loop and its body's Add are fp32."""
    model = parse("""
    g (float[4] x) => (float[4] y) <int64 n = {3}> {
      [loop] y = Loop(n, , x) <
        body = b (int64 i, bool cond, float[4] acc) => (bool cond_out, float[4] acc_out) {
          [inc] acc_out = Add(acc, acc)
          [keep] cond_out = Identity(cond)
        }
      >
    }
    """)
    ctx = classify(model)
    assert reasons(ctx) == {"loop": "CONTROL_FLOW", "loop:body/inc": "IN_SUBGRAPH", "loop:body/keep": "IN_SUBGRAPH"}


# --- rule 2: no float -----------------------------------------------------------------------
def test_nodes_without_float_or_only_neutral_float_are_fp32_no_float():
    """Rule 2: an int64 Add has no float tensor; Shape reads a float tensor but only through a
    precision-neutral slot. Both are fp32 with NO_FLOAT; the Relu is left open."""
    model = parse("""
    g (float[4,8] x, int64[2] i) => (int64[2] s2, float[4,8] y) {
      [shape] s = Shape(x)
      [iadd] s2 = Add(s, i)
      [relu] y = Relu(x)
    }
    """)
    ctx = classify(model)
    assert reasons(ctx) == {"shape": "NO_FLOAT", "iadd": "NO_FLOAT"}
    assert precisions(ctx) == {"shape": "fp32", "iadd": "fp32"}


def test_cast_to_float_is_left_to_the_passes():
    """Rule 2 does not apply to ``Cast(to=FLOAT)``: its float output follows the plan (its
    ``to`` can change), so Classify leaves it open."""
    model = parse("""
    g (int64[4] i) => (float[4] y) {
      [cast] f = Cast<to=1>(i)
      [relu] y = Relu(f)
    }
    """)
    ctx = classify(model)
    assert not ctx.plan.is_decided("cast") and not ctx.plan.is_decided("relu")


# --- rule 3: already fp16 -------------------------------------------------------------------
def test_already_fp16_nodes_stay_fp16():
    """Rule 3: a Relu and a MatMul whose float tensors are all fp16 stay fp16 (ALREADY_FP16),
    even when excluded by the user (rule 3 comes before rule 5). The Cast(to=FLOAT) making the
    fp32 graph output is not "already fp16": its output is fp32."""
    model = parse("""
    g (float16[4,8] x, float16[8,8] w) => (float16[4,8] y, float[4,8] z) {
      [relu] r = Relu(x)
      [mm] y = MatMul(r, w)
      [up] z = Cast<to=1>(y)
    }
    """)
    ctx = classify(model, exclude_ops=frozenset({"Relu"}))
    assert {n: reasons(ctx)[n] for n in ("relu", "mm")} == {"relu": "ALREADY_FP16", "mm": "ALREADY_FP16"}
    assert {n: precisions(ctx)[n] for n in ("relu", "mm")} == {"relu": "fp16", "mm": "fp16"}
    assert precisions(ctx).get("up") != "fp16"


def test_cast_with_pinned_output_stays_as_it_is():
    """Rule 3, second part: a Cast(to=FLOAT) whose output is a graph output (``f``) or is read
    by an If body (``g``) stays fp32 (PINNED_CAST): retargeting it to fp16 would need a Cast
    back. A Cast whose output nothing pins (``h``) is left open."""
    model = parse(f"""
    g (float[4,8] x, bool c) => (float[4,8] f, float[4,8] y, float[4,8] z) {W8} {{
      [to_f] f = Cast<to=1>(x)
      [to_g] g = Cast<to=1>(x)
      [to_h] h = Cast<to=1>(x)
      [mm] z = MatMul(h, w)
      [branch] y = If(c) <
        then_branch = t () => (float[4,8] o) {{ [inner] o = Relu(g) }},
        else_branch = e () => (float[4,8] o2) {{ [inner2] o2 = Neg(g) }}
      >
    }}
    """)
    ctx = classify(model)
    assert {n: reasons(ctx).get(n) for n in ("to_f", "to_g", "to_h")} == {
        "to_f": "PINNED_CAST", "to_g": "PINNED_CAST", "to_h": None}
    assert precisions(ctx)["to_f"] == precisions(ctx)["to_g"] == "fp32"


MS_HEADER = '<ir_version: 10, opset_import: ["" : 17, "com.microsoft" : 1]>'
ACCUMULATOR_MODEL = f"""
g (float[4,8] x, float[8,8] acc, bool reset) => (bool updated) {W8} {{
  [mm] h = MatMul(x, w)
  [tr] xt = Transpose(x)
  [grad_mm] dw = MatMul(xt, h)
  [accumulate] updated = com.microsoft.InPlaceAccumulatorV2(acc, dw, reset)
}}
"""


@pytest.mark.parametrize("options", [{}, {"include_ops": frozenset({"InPlaceAccumulatorV2"})}])
def test_in_place_training_state_op_is_fp32_training_state(options):
    """Rule 3, third part: ORT's gradient accumulator writes its buffer input in place; it stays
    fp32 (TRAINING_STATE) even when the user includes it. The MatMuls are left open."""
    ctx = classify(parse(ACCUMULATOR_MODEL, header=MS_HEADER), **options)
    assert reasons(ctx) == {"accumulate": "TRAINING_STATE"} and precisions(ctx) == {"accumulate": "fp32"}


def test_accumulator_reads_its_buffer_uncast_under_policy_fp16():
    """Rule 3 under policy fp16: every other node goes fp16; the accumulator still reads the
    graph input ``acc`` itself (a Cast in between would make it update a copy) and gets the
    fp16 gradient through one Cast back to fp32."""
    result = optimize(parse(ACCUMULATOR_MODEL, header=MS_HEADER), policy="fp16")
    assert {n: d["reason"] for n, d in result.report["plan"].items()} == {
        "accumulate": "training_state", "mm": "policy_fp16", "tr": "policy_fp16", "grad_mm": "policy_fp16"}
    accumulate = node(result.model, "accumulate")
    assert accumulate.input[0] == "acc"
    back = producer(result.model, accumulate.input[1])
    assert back.op_type == "Cast" and cast_to(back) == FLOAT


def test_pool_gradient_is_fp32_declared_output_shape():
    """Rule 3, fourth part: ORT's MaxPoolGrad (default domain, no ONNX schema) reads the shape
    declared for its output, which a CPU fallback from fp16 loses: fp32 (DECLARED_OUTPUT_SHAPE)
    under policy fp16 and with an inclusion. The ReluGrad after it is left open."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MaxPoolGrad", ["dy", "indices"], ["dx"], name="pool_grad"),
         helper.make_node("ReluGrad", ["dx", "x"], ["dr"], name="relu_grad", domain="com.microsoft")],
        "g",
        [helper.make_tensor_value_info("dy", FLOAT, [1, 2, 2, 2]),
         helper.make_tensor_value_info("indices", 7, [1, 2, 2, 2]),
         helper.make_tensor_value_info("x", FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("dr", FLOAT, [1, 2, 4, 4])],
        value_info=[helper.make_tensor_value_info("dx", FLOAT, [1, 2, 4, 4])],
    ), opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    for options in ({}, {"include_ops": frozenset({"MaxPoolGrad"})}):
        assert reasons(classify(model, **options)) == {"pool_grad": "DECLARED_OUTPUT_SHAPE"}
    plan = optimize(model, policy="fp16").report["plan"]
    assert plan["pool_grad"] == {"precision": "fp32", "reason": "declared_output_shape"}
    assert plan["relu_grad"]["precision"] == "fp16"


# --- rule 4: quantization ------------------------------------------------------------------
QDQ_MODEL = """
g (float[1,4,4,4] x) => (float[1,4,4,4] y)
  <float s = {0.1}, uint8 zp = {128}, int8[4,4,1,1] wq = {1,0,0,0, 0,1,0,0, 0,0,1,0, 0,0,0,1},
   float ws = {0.5}, int8 wzp = {0}> {
  [q_in] q = QuantizeLinear(x, s, zp)
  [dq_in] dq = DequantizeLinear(q, s, zp)
  [dq_w] w = DequantizeLinear(wq, ws, wzp)
  [conv] c = Conv(dq, w)
  [q_out] q2 = QuantizeLinear(c, s, zp)
  [dq_out] y = DequantizeLinear(q2, s, zp)
}
"""


def test_qdq_pattern_stays_fp32():
    """Rule 4: Q/DQ ops, and the Conv reading a DequantizeLinear and feeding a QuantizeLinear,
    are fp32 with QUANTIZED."""
    ctx = classify(parse(QDQ_MODEL))
    assert reasons(ctx) == {name: "QUANTIZED" for name in ("q_in", "dq_in", "dq_w", "conv", "q_out", "dq_out")}
    assert set(precisions(ctx).values()) == {"fp32"}


@pytest.mark.parametrize("policy", ["campo", "amp", "fp16"])
def test_qdq_pattern_left_intact_no_cast(policy):
    """Rule 4 end to end: DequantizeLinear -> Conv -> QuantizeLinear is written unchanged, no
    Cast inserted, whatever the policy (ORT only fuses the pattern in fp32)."""
    model = parse(QDQ_MODEL)
    result = optimize(model, config=OptimizeConfig(policy=policy), experimental={"check_invariants": True})
    assert ops(result.model) == ["QuantizeLinear", "DequantizeLinear", "DequantizeLinear", "Conv",
                                 "QuantizeLinear", "DequantizeLinear"]
    assert result.report["casts_inserted"] == 0
    assert all(t.data_type != FLOAT16 for t in result.model.graph.initializer)


def test_float_op_feeding_quantize_is_quantized_but_unrelated_op_is_not():
    """Rule 4: an Add whose output feeds a QuantizeLinear is QUANTIZED; a Relu beside it,
    reading the same graph input but not in the pattern, is left open."""
    model = parse("""
    g (float[4] x) => (uint8[4] q, float[4] y) <float s = {0.1}, uint8 zp = {128}> {
      [add] a = Add(x, x)
      [quant] q = QuantizeLinear(a, s, zp)
      [relu] y = Relu(x)
    }
    """)
    ctx = classify(model)
    assert reasons(ctx) == {"add": "QUANTIZED", "quant": "QUANTIZED"}


# --- rule 5: user exclusions ----------------------------------------------------------------
MLP = f"""
g (float[4,8] x) => (float[4,8] y) {W8} {{
  [up_proj] a = MatMul(x, w)
  [act] b = Relu(a)
  [down_proj] y = MatMul(b, w)
}}
"""


def test_exclude_op():
    """Rule 5: ``exclude_ops={"MatMul"}`` makes both MatMuls fp32 (USER_EXCLUDED)."""
    ctx = classify(parse(MLP), exclude_ops=frozenset({"MatMul"}))
    assert reasons(ctx) == {"up_proj": "USER_EXCLUDED", "down_proj": "USER_EXCLUDED"}
    assert set(precisions(ctx).values()) == {"fp32"}


def test_exclude_node_regex():
    """Rule 5: ``exclude_nodes=("^down",)`` is a regular expression searched in node names:
    only ``down_proj`` is excluded."""
    ctx = classify(parse(MLP), exclude_nodes=("^down",))
    assert reasons(ctx) == {"down_proj": "USER_EXCLUDED"}


def test_exclude_wins_over_include():
    """Rule 5 comes before rule 7: a node both excluded and included is fp32."""
    ctx = classify(parse(MLP), exclude_nodes=("proj$",), include_ops=frozenset({"MatMul", "Relu"}))
    assert reasons(ctx) == {"up_proj": "USER_EXCLUDED", "down_proj": "USER_EXCLUDED", "act": "USER_INCLUDED"}
    assert precisions(ctx)["act"] == "fp16"


# --- rule 6: custom domain, unknown op, no fp16 schema ---------------------------------------
def test_custom_domain_op_is_fp32():
    """Rule 6: an op of a custom domain is fp32 (CUSTOM_DOMAIN), even when included."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [custom] y = com.example.MyOp(x)
    }
    """, header='<ir_version: 10, opset_import: ["" : 17, "com.example": 1]>')
    assert reasons(classify(model)) == {"custom": "CUSTOM_DOMAIN"}
    assert reasons(classify(model, include_ops=frozenset({"MyOp"}))) == {"custom": "CUSTOM_DOMAIN"}


def test_custom_domain_op_between_fp16_ops_gets_casts():
    """Rule 6 end to end: with every open node fp16, the MatMuls around a custom op run fp16
    and the custom op reads and writes fp32 through Casts."""
    model = parse(f"""
    g (float[4,8] x) => (float[4,8] y) {W8} {{
      [mm1] a = MatMul(x, w)
      [custom] b = com.example.MyOp(a)
      [mm2] y = MatMul(b, w)
    }}
    """, header='<ir_version: 10, opset_import: ["" : 17, "com.example": 1]>')
    model.graph.value_info.append(helper.make_tensor_value_info("b", FLOAT, [4, 8]))
    ctx = classify(model)
    assert reasons(ctx) == {"custom": "CUSTOM_DOMAIN"}
    run_passes(ctx, UniformPrecision(Precision.FP16, Reason.POLICY_FP16), InsertCasts())
    out = export(ctx)
    assert ops(out) == ["Cast", "MatMul", "Cast", "MyOp", "Cast", "MatMul", "Cast"]
    custom = node(out, "custom")
    into, out_of = producer(out, custom.input[0]), consumers(out, custom.output[0])
    assert into.op_type == "Cast" and cast_to(into) == FLOAT and list(into.input) == ["a"]
    assert [(c.op_type, cast_to(c)) for c in out_of] == [("Cast", FLOAT16)]


def test_unknown_op_is_fp32():
    """Rule 6: Hardmax is in no list (no known fp16 behaviour): fp32, UNKNOWN_OP."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [hm] y = Hardmax(x)
    }
    """)
    ctx = classify(model)
    assert reasons(ctx) == {"hm": "UNKNOWN_OP"} and precisions(ctx) == {"hm": "fp32"}


def test_op_without_fp16_schema_is_fp32_even_when_included():
    """Rule 6: Celu-12 only types ``tensor(float)``: fp32 with NO_FP16_SCHEMA, and an
    inclusion does not change that (an included op still needs an fp16 schema)."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [celu] y = Celu(x)
    }
    """)
    assert reasons(classify(model)) == {"celu": "NO_FP16_SCHEMA"}
    assert reasons(classify(model, include_ops=frozenset({"Celu"}))) == {"celu": "NO_FP16_SCHEMA"}


# --- rule 7: user inclusions ----------------------------------------------------------------
def test_include_op_and_node_regex_go_fp16():
    """Rule 7: ``include_ops={"Softmax"}`` sends a deny-list Softmax to fp16 whatever the lists
    say; ``include_nodes=("^act$",)`` does the same for the Relu named ``act``; the MatMuls
    are left open."""
    model = parse(f"""
    g (float[4,8] x) => (float[4,8] y) {W8} {{
      [up_proj] a = MatMul(x, w)
      [act] b = Relu(a)
      [sm] y = Softmax(b)
    }}
    """)
    ctx = classify(model, include_ops=frozenset({"Softmax"}), include_nodes=("^act$",))
    assert reasons(ctx) == {"act": "USER_INCLUDED", "sm": "USER_INCLUDED"}
    assert precisions(ctx) == {"act": "fp16", "sm": "fp16"}


def test_include_unknown_op_goes_fp16():
    """Rule 7 (per OptimizeConfig: "allowed in fp16 whatever the lists say"): an included op in
    no list that has an fp16 schema goes fp16."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [hm] y = Hardmax(x)
    }
    """)
    ctx = classify(model, include_ops=frozenset({"Hardmax"}))
    assert reasons(ctx) == {"hm": "USER_INCLUDED"} and precisions(ctx) == {"hm": "fp16"}


def test_ordinary_list_ops_are_left_open():
    """Everything else is left to the four passes: MatMul, Relu, Exp, Reshape are undecided."""
    model = parse(f"""
    g (float[4,8] x) => (float[32] y) <{W8_INIT}, int64[1] shp = {{32}}> {{
      [mm] a = MatMul(x, w)
      [relu] b = Relu(a)
      [exp] c = Exp(b)
      [reshape] y = Reshape(c, shp)
    }}
    """)
    ctx = classify(model)
    assert len(ctx.plan) == 0


# --- rule 2: constant sources ------------------------------------------------------------------
def test_constant_node_is_a_constant_source():
    """Rule 2: a Constant node producing a float tensor is not converted as a node (CONSTANT,
    fp32): Cast insertion converts its value offline where fp16 consumers need it."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [k] k = Constant<value=float[8] {1,2,3,4,5,6,7,8}>()
      [add] y = Add(x, k)
    }
    """)
    ctx = classify(model)
    assert reasons(ctx) == {"k": "CONSTANT"} and precisions(ctx) == {"k": "fp32"}


# --- rule 7: constants beyond the fp16 range ------------------------------------------------------
def test_node_reading_constant_beyond_fp16_range_stays_fp32():
    """Rule 7: a BatchNormalization whose variance holds 1e8 (finite, > 65504) would compute a
    different model in fp16: fp32 with CONSTANT_OUT_OF_RANGE, even when included (rule 7 comes
    before rule 8). An Add reading 7e4 from a Constant node is fp32 too."""
    model = parse("""
    g (float[1,2,4,4] x) => (float[1,2,4,4] y, float[1,2,4,4] z)
      <float[2] scale = {1, 1}, float[2] bias = {0, 0}, float[2] mean = {0, 0}, float[2] var = {1e8, 1}> {
      [bn] y = BatchNormalization(x, scale, bias, mean, var)
      [k] big = Constant<value=float[1] {70000}>()
      [add] z = Add(x, big)
    }
    """)
    assert reasons(classify(model))["bn"] == "CONSTANT_OUT_OF_RANGE"
    assert reasons(classify(model))["add"] == "CONSTANT_OUT_OF_RANGE"
    included = classify(model, include_ops=frozenset({"BatchNormalization"}))
    assert reasons(included)["bn"] == "CONSTANT_OUT_OF_RANGE" and precisions(included)["bn"] == "fp32"


def test_infinity_sentinels_and_infinities_do_not_keep_fp32():
    """Rule 7 exceptions: a -3.4e38 attention mask (|x| >= 1e30, an "infinity" sentinel), a
    real -inf, and 65504 itself leave the Add open (Cast insertion clamps sentinels)."""
    model = parse("""
    g (float[2,4] x) => (float[2,4] y, float[2,4] z, float[2,4] w)
      <float[4] mask = {0, -3.4e38, 0, 0}, float[4] minf = {0, -inf, inf, 0}, float[4] top = {65504, -65504, 0, 0}> {
      [add_mask] y = Add(x, mask)
      [add_inf] z = Add(x, minf)
      [add_top] w = Add(x, top)
    }
    """)
    assert len(classify(model).plan) == 0


def test_constant_beyond_range_read_through_fixed_slot_is_ignored():
    """Rule 7 looks at precision-following inputs only: Resize ``scales`` of 1e5 never become
    fp16, so they do not keep the Resize fp32."""
    model = parse("""
    g (float[1,1,1,1] x) => (float[1,1,1,100000] y) <float[4] sc = {1, 1, 1, 100000}> {
      [rz] y = Resize(x, , sc)
    }
    """)
    assert len(classify(model).plan) == 0


@pytest.mark.parametrize("reduction, fixed", [("add", True), ("none", False)])
def test_scatter_with_a_reduction_stays_fp32(reduction, fixed):
    """onnx-ad's Gather/MaxPool backward sums gradients with ScatterElements(reduction=add): in
    fp16 it would accumulate in fp16. A plain scatter moves data and is left to the passes."""
    model = parse(f"""
    g (float[8, 8] x, int64[2, 8] idx, float[2, 8] upd) => (float[8, 8] y) {{
        y = ScatterElements<reduction = "{reduction}">(x, idx, upd)
    }}""")
    ctx = classify(model)
    name = ctx.nodes[0].name
    if fixed:
        assert precisions(ctx)[name] == "fp32" and reasons(ctx)[name] == "ACCUMULATING_SCATTER"
    else:
        assert name not in precisions(ctx)


# --- rule 3, fifth part: a pattern ONNX Runtime's CPU EP crashes on in fp16 ----------------
def _transpose_matmul(perm, weight_shape, *, weight_first=False):
    dims = [2, 3, 4] if len(perm) == 3 else [2, 3, 6, 4]
    moved = [dims[p] for p in perm]
    if weight_first:
        weight_shape = (5, moved[-2])
    weight = "float[{}] w = {{{}}}".format(",".join(map(str, weight_shape)),
                                            ",".join(["0.5"] * int(np.prod(weight_shape))))
    product = "MatMul(w, t)" if weight_first else "MatMul(t, w)"
    pair = (np.zeros(weight_shape), np.zeros(moved)) if weight_first else (np.zeros(moved), np.zeros(weight_shape))
    out = ",".join(map(str, np.matmul(*pair).shape))
    return parse(f"""
    g (float[{",".join(map(str, dims))}] x) => (float[{out}] y) <{weight}> {{
      [tr] t = Transpose<perm = [{",".join(map(str, perm))}]>(x)
      [mm] y = {product}
    }}""")


@pytest.mark.parametrize("perm, weight_shape, weight_first", [
    ([1, 0, 2], (4, 5), False), ([1, 2, 0], (2, 5), False), ([1, 0, 2], None, True),
    ([1, 2, 0, 3], (4, 5), False), ([1, 2, 3, 0], (2, 5), False), ([1, 0, 2], (4,), False)])
def test_transpose_moving_a_batch_axis_into_a_matmul_with_a_2d_operand_stays_fp32(perm, weight_shape, weight_first):
    """Rule 3, fifth part: ORT 1.32's CPU EP segfaults creating a session of an fp16 Transpose
    that moves the batch axis (``[1, 0, 2]``, ``[1, 2, 0]``, rank 4 alike) into a MatMul with a
    1-D/2-D operand, on either side: the Transpose stays fp32 (ORT_CPU_CRASH), even when included;
    the MatMul is left to the passes."""
    model = _transpose_matmul(perm, weight_shape, weight_first=weight_first)
    for options in ({}, {"include_ops": frozenset({"Transpose"})}):
        assert reasons(classify(model, **options)) == {"tr": "ORT_CPU_CRASH"}


@pytest.mark.parametrize("perm, weight_shape", [([0, 2, 1], (3, 5)), ([2, 1, 0], (2, 5)), ([1, 0, 2], (3, 4, 5)),
                                                ([1, 0, 2, 3], (4, 5))])
def test_other_transposes_into_a_matmul_are_left_to_the_passes(perm, weight_shape):
    """Perms that do not move the batch axis next to the matrix axes, or a 3-D operand: ORT loads
    them in fp16, and classify leaves them open."""
    assert reasons(classify(_transpose_matmul(perm, weight_shape))) == {}


@pytest.mark.parametrize("policy", ["fp16", "amp", "campo"])
def test_written_model_with_the_crashing_pattern_loads_on_ort_cpu(policy, tmp_path):
    """End to end: every policy writes the Transpose fp32, a Cast before the fp16 MatMul, and ONNX
    Runtime's CPU EP creates a session of the written model (in a child process: the pattern
    itself would kill this one)."""
    import subprocess
    import sys

    result = optimize(_transpose_matmul([1, 0, 2], (4, 5)), policy=policy, input_shapes={})
    assert result.report["plan"]["tr"]["reason"] == "ort_cpu_crash"
    path = tmp_path / "out.onnx"
    result.save(path)
    code = ("import onnxruntime as ort, sys; o = ort.SessionOptions(); "
            "o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL; "
            "ort.InferenceSession(sys.argv[1], o, providers=['CPUExecutionProvider'])")
    assert subprocess.run([sys.executable, "-c", code, str(path)]).returncode == 0
