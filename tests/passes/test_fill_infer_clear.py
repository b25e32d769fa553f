"""``fill_infer_clear``: infer/clear ops on a path between fp16 ops go fp16."""

from __future__ import annotations

from helpers import FakeCost, MM_ADD_RELU_MM, W_INIT, build_context, decide, parse, precisions, reasons, run_passes

from onnxcampo.passes.classify import Classify
from onnxcampo.passes.fill_infer_clear import FillInferClear



def fill(text, pre, **options):
    ctx = build_context(parse(text), cost=FakeCost(), **options)
    run_passes(ctx, Classify())
    decide(ctx, **pre)
    run_passes(ctx, FillInferClear())
    return ctx




def test_matmul_add_relu_matmul():
    """MatMul(fp16) -> Add -> Relu -> MatMul(fp16): Add (infer) and Relu (clear) sit on an
    fp16 path: fp16 with BETWEEN_FP16."""
    ctx = fill(MM_ADD_RELU_MM, {"mm1": "fp16", "mm2": "fp16"})
    assert reasons(ctx)["add"] == reasons(ctx)["relu"] == "BETWEEN_FP16"
    assert precisions(ctx) == {"mm1": "fp16", "mm2": "fp16", "add": "fp16", "relu": "fp16"}


def test_only_one_fp16_side_is_not_filled():
    """Below an fp16 node but not above one: the Add and Relu stay open (mm2 fp32)."""
    ctx = fill(MM_ADD_RELU_MM, {"mm1": "fp16", "mm2": "fp32"})
    assert not ctx.plan.is_decided("add") and not ctx.plan.is_decided("relu")
    ctx = fill(MM_ADD_RELU_MM, {"mm1": "fp32", "mm2": "fp16"})
    assert not ctx.plan.is_decided("add") and not ctx.plan.is_decided("relu")


def test_path_through_a_decided_fp32_node_is_cut():
    """Reachability goes only through undecided infer/clear nodes: an fp32-decided Add in the
    middle cuts the path, so the Relu after it is not between fp16 nodes."""
    ctx = fill(MM_ADD_RELU_MM, {"mm1": "fp16", "mm2": "fp16", "add": "fp32"})
    assert not ctx.plan.is_decided("relu")


def test_path_through_an_unknown_op_is_cut():
    """Only infer/clear nodes are walked: a Hardmax (in no list, fp32 from classify) between the
    Add and the Relu leaves both open."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [mm1] a = MatMul(x, w)
      [add] s = Add(a, a)
      [hm] h = Hardmax(s)
      [relu] r = Relu(h)
      [mm2] y = MatMul(r, w)
    }}
    """
    ctx = fill(text, {"mm1": "fp16", "mm2": "fp16"})
    assert reasons(ctx)["hm"] == "UNKNOWN_OP"
    assert not ctx.plan.is_decided("add") and not ctx.plan.is_decided("relu")


def test_side_branch_off_the_path_stays_open():
    """A Sigmoid fed by the fp16 path but feeding only the graph output is below an fp16 node
    and above none: open. The Tanh feeding mm2 from the graph input is above an fp16 node
    and below none: open."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) <{W_INIT}> {{
      [mm1] a = MatMul(x, w)
      [relu] r = Relu(a)
      [sig] z = Sigmoid(r)
      [tanh] t = Tanh(x)
      [add] s = Add(r, t)
      [mm2] y = MatMul(s, w)
    }}
    """
    ctx = fill(text, {"mm1": "fp16", "mm2": "fp16"})
    assert reasons(ctx) == {"mm1": "POLICY_FP16", "mm2": "POLICY_FP16", "relu": "BETWEEN_FP16", "add": "BETWEEN_FP16"}


def test_user_included_nodes_seed_the_fill():
    """Seeds are any fp16 nodes, not only allow_by_cost's: MatMuls the user included (fp16
    from classify) fill the Add and Relu between them with no allow_by_cost at all."""
    ctx = build_context(parse(MM_ADD_RELU_MM), cost=FakeCost(), include_nodes=("^mm",))
    run_passes(ctx, Classify(), FillInferClear())
    assert reasons(ctx) == {"mm1": "USER_INCLUDED", "mm2": "USER_INCLUDED", "add": "BETWEEN_FP16", "relu": "BETWEEN_FP16"}

