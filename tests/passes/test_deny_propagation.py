"""``deny_propagation``: deny-list ops, and the infer/clear ops they feed, stay fp32."""

from __future__ import annotations

from helpers import EXP_BETWEEN_MATMULS, FakeCost, W_INIT, build_context, decide, parse, precisions, reasons, run_passes

from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear


EXP_CHAIN = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
  [exp] e = Exp(x)
  [add] a = Add(e, x)
  [mul] m = Mul(a, a)
  [mm] y = MatMul(m, w)
}}
"""


def analyse(text, *passes, pre=None, cost=None, **options):
    ctx = build_context(parse(text), cost=cost or FakeCost(cast_us=0.5), **options)
    run_passes(ctx, Classify())
    if pre:
        decide(ctx, **pre)
    run_passes(ctx, *passes)
    return ctx


def test_exp_add_mul_matmul():
    """Rules 1 and 2: Exp -> Add -> Mul -> MatMul. Exp is deny-list fp32; Add and Mul are
    downstream of it through infer-list ops: fp32 (DENY_DOWNSTREAM). The MatMul was decided by
    allow_by_cost (it pays: 5 + 2 x 0.5 < 10) and the walk stops there."""
    ctx = analyse(EXP_CHAIN, AllowByCost(), DenyPropagation())
    assert reasons(ctx) == {"mm": "ALLOW_PAYS", "exp": "DENY_LIST", "add": "DENY_DOWNSTREAM", "mul": "DENY_DOWNSTREAM"}
    assert precisions(ctx) == {"mm": "fp16", "exp": "fp32", "add": "fp32", "mul": "fp32"}


def test_exp_chain_matmul_not_paying_keeps_allow_by_cost_decision():
    """The MatMul keeps allow_by_cost's decision (fp32, ALLOW_DOES_NOT_PAY with 10 us Casts):
    deny_propagation never marks allow-list nodes."""
    ctx = analyse(EXP_CHAIN, AllowByCost(), DenyPropagation(), cost=FakeCost(cast_us=10.0))
    assert reasons(ctx)["mm"] == "ALLOW_DOES_NOT_PAY"


def test_walk_stops_at_allow_list_nodes():
    """Rule 2: the walk stops at an allow-list node even when it is undecided: the Relu after
    the MatMul is not downstream of the Exp."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
      [exp] e = Exp(x)
      [mm] m = MatMul(e, w)
      [relu] y = Relu(m)
    }}
    """
    ctx = analyse(text, DenyPropagation())
    assert reasons(ctx) == {"exp": "DENY_LIST"}


def test_walk_goes_through_clear_ops_and_branches():
    """Rule 2: downstream through clear-list (Transpose, Reshape) and infer-list (Sigmoid) ops
    on every branch; the Relu reading only the graph input is not reached."""
    text = """
    g (float[4,8] x) => (float[32] y, float[8,4] z, float[4,8] r) <int64[1] shp = {32}> {
      [exp] e = Exp(x)
      [tr] t = Transpose<perm=[1,0]>(e)
      [sig] z = Sigmoid(t)
      [rs] y = Reshape(e, shp)
      [relu] r = Relu(x)
    }
    """
    ctx = analyse(text, DenyPropagation())
    assert reasons(ctx) == {"exp": "DENY_LIST", "tr": "DENY_DOWNSTREAM", "sig": "DENY_DOWNSTREAM", "rs": "DENY_DOWNSTREAM"}


def test_walk_follows_only_precision_following_slots():
    """Rule 2: the Exp's output reaches the Resize only through ``scales``, a fixed
    ``tensor(float)`` slot (it never follows the node's precision): the Resize is not
    downstream. The Add reading the Exp through a following slot is."""
    text = """
    g (float[1,1,4,4] x, float[4] s) => (float[1,1,8,8] y, float[4] a) {
      [exp] e = Exp(s)
      [resize] y = Resize(x, , e)
      [add] a = Add(e, s)
    }
    """
    ctx = analyse(text, DenyPropagation(), input_shapes={})
    assert reasons(ctx) == {"exp": "DENY_LIST", "add": "DENY_DOWNSTREAM"}


def test_walk_stops_at_decided_nodes():
    """Rule 2: a node decided before (here fp16 by a previous pass) is not reopened, and the
    walk does not go through it."""
    ctx = analyse(EXP_CHAIN, DenyPropagation(), pre={"add": "fp16"})
    assert precisions(ctx) == {"add": "fp16", "exp": "fp32"}
    assert not ctx.plan.is_decided("mul")


def test_deny_node_already_fp16_does_not_propagate():
    """Rule 1 only decides undecided deny nodes: a Softmax the user included stays fp16, and
    nothing downstream of it is forced fp32."""
    text = """
    g (float[4,8] x) => (float[4,8] y) {
      [sm] s = Softmax(x)
      [add] y = Add(s, s)
    }
    """
    ctx = analyse(text, DenyPropagation(), include_ops=frozenset({"Softmax"}))
    assert reasons(ctx) == {"sm": "USER_INCLUDED"}


def test_excluded_deny_node_still_propagates():
    """A deny node already fp32 (user exclusion) still feeds the walk."""
    text = """
    g (float[4,8] x) => (float[4,8] y) {
      [lg] l = Log(x)
      [neg] y = Neg(l)
    }
    """
    ctx = analyse(text, DenyPropagation(), exclude_ops=frozenset({"Log"}))
    assert reasons(ctx) == {"lg": "USER_EXCLUDED", "neg": "DENY_DOWNSTREAM"}


def test_deny_downstream_is_not_reopened_between_fp16_ops():
    """deny_propagation runs before fill_infer_clear: an Add after an Exp and between two fp16 MatMuls stays fp32
    (an fp16 Add after an Exp would overflow just the same)."""
    text = EXP_BETWEEN_MATMULS
    ctx = analyse(text, DenyPropagation(), FillInferClear(), pre={"mm1": "fp16", "mm2": "fp16"})
    assert reasons(ctx)["add"] == "DENY_DOWNSTREAM" and precisions(ctx)["add"] == "fp32"


MEAN_CHAIN = """
g (float[64,8,4,4] x, float[64,8,4,4] dy) => (float[64,8,4,4] y) <int64[3] axes = {{0, 2, 3}}, float k = {{{k}}}> {{
  [sum] s = ReduceSum <keepdims = 1> (dy, axes)
  [view] v = Reshape(s, shape)
  [scale] m = Mul(v, k)
  [sub] c = Sub(dy, m)
  [mul] y = Mul(c, x)
}}
"""


def _mean_chain(k: float) -> str:
    text = MEAN_CHAIN.format(k=repr(k))
    return text.replace("float k =", "int64[4] shape = {1, 8, 1, 1}, float k =")


def test_a_mean_of_a_sum_ends_the_walk_under_means_end_deny():
    """Rule 3: ReduceSum -> Reshape -> Mul by 1/1024 (each output sums 1,024 values: a mean) ->
    Sub -> Mul. Under ``experimental.means_end_deny`` the scaling Mul stays fp32 and the walk
    ends there: the Sub and the Mul are left to the cost passes. Without it, or with a constant
    that does not make a mean (2/1024), they stay fp32."""
    from onnxcampo.config import OptimizeConfig

    means = OptimizeConfig().with_experimental(means_end_deny=True)
    ctx = analyse(_mean_chain(1 / 1024), DenyPropagation(), config=means)
    assert reasons(ctx) == {"sum": "DENY_LIST", "view": "DENY_DOWNSTREAM", "scale": "DENY_DOWNSTREAM"}
    plain = analyse(_mean_chain(1 / 1024), DenyPropagation())
    assert reasons(plain)["sub"] == "DENY_DOWNSTREAM" and reasons(plain)["mul"] == "DENY_DOWNSTREAM"
    larger = analyse(_mean_chain(2 / 1024), DenyPropagation(), config=means)
    assert reasons(larger)["sub"] == "DENY_DOWNSTREAM" and reasons(larger)["mul"] == "DENY_DOWNSTREAM"
