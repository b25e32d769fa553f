"""patterns.py: the tanh-GELU's Pow and the Gaussian exp(-u*u) of the erf-GELU's derivative are not
deny-list ops (they saturate), other Pows and Exps are."""

from __future__ import annotations

import numpy as np
from onnx.reference import ReferenceEvaluator

import onnxcampo
from helpers import parse

GELU = """
g (float[4,8] a) => (float[4,8] y) <float three = {3.0}, float c1 = {0.044715}, float c2 = {0.7978845608},
                                    float one = {1.0}, float half = {0.5},
                                    float[8,8] w1 = {1,0,0,0,0,0,0,0, 0,1,0,0,0,0,0,0, 0,0,1,0,0,0,0,0, 0,0,0,1,0,0,0,0,
                                                     0,0,0,0,1,0,0,0, 0,0,0,0,0,1,0,0, 0,0,0,0,0,0,1,0, 0,0,0,0,0,0,0,1}> {
  [mm1] x = MatMul(a, w1)
  [pow] cube = Pow(x, three)
  [mul1] scaled = Mul(cube, c1)
  [add] inner = Add(x, scaled)
  [mul2] arg = Mul(inner, c2)
  [tanh] t = Tanh(arg)
  [add1] t1 = Add(t, one)
  [mulx] xt = Mul(x, t1)
  [mulh] g = Mul(xt, half)
  [mm2] y = MatMul(g, w1)
}
"""


def _extreme_and_moderate(big: float) -> np.ndarray:
    """Rows of +big and -big (they overflow fp16 inside the patterns), then moderate values."""
    x = np.zeros((4, 8), np.float32)
    x[0, :], x[1, :] = big, -big
    x[2, :], x[3, :] = np.linspace(-3, 3, 8), np.linspace(-0.1, 0.1, 8)
    return x


def _fp16_under_amp(text: str, nodes, big: float):
    """``text`` optimized with policy amp, each of ``nodes`` planned fp16; the input
    :func:`_extreme_and_moderate` and the output for it (reference evaluator), all finite."""
    result = onnxcampo.optimize(parse(text), policy="amp")
    plan = result.report["plan"]
    assert all(plan[name]["precision"] == "fp16" for name in nodes), plan
    x = _extreme_and_moderate(big)
    (got,) = ReferenceEvaluator(result.model).run(None, {"a": x})  # w1 is the identity
    assert np.isfinite(got).all()
    return x, got


def test_tanh_gelu_runs_fp16_and_saturates_correctly():
    """Before: Pow would deny the whole GELU. After: every node fp16 under amp (no deny left),
    and in fp16 the result for |x| = 100 (x^3 overflows) is still x or 0, as GELU gives."""
    x, got = _fp16_under_amp(GELU, ("pow", "tanh"), 100.0)
    np.testing.assert_allclose(got[0], 100.0, rtol=1e-3)
    np.testing.assert_allclose(got[1], 0.0, atol=1e-3)
    exact = 0.5 * x[2] * (1 + np.tanh(0.7978845608 * (x[2] + 0.044715 * x[2] ** 3)))
    np.testing.assert_allclose(got[2], exact, atol=5e-3)


def test_pow_read_elsewhere_stays_denied():
    """If x^3 is also read outside the pattern, its overflow could leak: Pow stays deny-list."""
    text = GELU.replace("(float[4,8] y)", "(float[4,8] y, float[4,8] cube)")
    plan = onnxcampo.optimize(parse(text), policy="amp").report["plan"]
    assert plan["pow"] == {"precision": "fp32", "reason": "deny_list"}


def test_square_is_not_the_pattern():
    """x ** 2 is no tanh-GELU cube: the Pow stays deny-list, and under amp the infer-list ops it
    feeds (the Tanh among them) are denied by TensorFlow's rule (DENY_TOWARD_INFER: deny follows
    paths of infer-list ops), as they were by the stricter rule before it."""
    text = GELU.replace("three = {3.0}", "three = {2.0}")
    plan = onnxcampo.optimize(parse(text), policy="amp").report["plan"]
    assert plan["pow"]["reason"] == "deny_list"
    assert plan["tanh"]["reason"] == "deny_toward_infer"


def test_out_of_range_constant_through_a_reshape_keeps_its_reader_fp32():
    """classify rule 7 through data movement: 1e8 reshaped and added must not be cast to fp16
    (it would become inf): the Add and the Reshape stay fp32 and the output is finite."""
    text = """
    g (float[4,8] a) => (float[4,8] y) <float[32] big = {""" + ",".join(["1e8"] * 32) + """},
                                        int64[2] shape = {4, 8}, float[8,8] w1 = {""" + ",".join(["0.5"] * 64) + """}> {
      [mm] x = MatMul(a, w1)
      [reshape] r = Reshape(big, shape)
      [add] y = Add(x, r)
    }
    """
    result = onnxcampo.optimize(parse(text), policy="fp16")
    plan = result.report["plan"]
    assert plan["add"]["reason"] == "constant_out_of_range"
    assert plan["reshape"]["reason"] == "constant_out_of_range"
    assert plan["mm"]["precision"] == "fp16"
    x = np.full((4, 8), 0.01, np.float32)
    (got,) = ReferenceEvaluator(result.model).run(None, {"a": x})
    assert np.isfinite(got).all()


IDENTITY8 = ",".join("1" if i == j else "0" for i in range(8) for j in range(8))

GAUSSIAN = """
g (float[4,8] a) => (float[4,8] y) <float c = {0.70710678}, float two = {2.0},
                                    float[8,8] w1 = {""" + IDENTITY8 + """}> {
  [mm1] x = MatMul(a, w1)
  [scale] u = Mul(x, c)
  [square] sq = Mul(u, u)
  [neg] n = Neg(sq)
  [exp] e = Exp(n)
  [mulx] g = Mul(e, x)
  [mm2] y = MatMul(g, w1)
}
"""


def test_gaussian_exp_runs_fp16_and_saturates_correctly():
    """exp(-u*u), the erf-GELU derivative's Gaussian (onnx-ad writes one per BERT layer into the
    backward pass), lies in (0, 1]: under amp the Exp is fp16 like its neighbours; in fp16 u*u
    overflows for |u| > 256 and exp(-inf) = 0, the limit, and moderate values keep fp16's precision."""
    x, got = _fp16_under_amp(GAUSSIAN, ("exp", "mulx"), 1000.0)
    np.testing.assert_array_equal(got[:2], 0.0)
    exact = np.exp(-(x[2:] * 0.70710678) ** 2) * x[2:]
    np.testing.assert_allclose(got[2:], exact, rtol=2e-3, atol=1e-3)


def test_gaussian_of_a_power_matches_and_other_exps_stay_denied():
    """Neg(Pow(u, 2)) is the same Gaussian; exp(-u*v) (no square: may be exp of a positive number)
    and an Exp whose argument is also read elsewhere stay on the deny list."""
    power = GAUSSIAN.replace("[square] sq = Mul(u, u)", "[square] sq = Pow(u, two)")
    assert onnxcampo.optimize(parse(power), policy="amp").report["plan"]["exp"]["precision"] == "fp16"
    product = GAUSSIAN.replace("[square] sq = Mul(u, u)", "[square] sq = Mul(u, x)")
    assert onnxcampo.optimize(parse(product), policy="amp").report["plan"]["exp"]["reason"] == "deny_list"
    shared = GAUSSIAN.replace("(float[4,8] y)", "(float[4,8] y, float[4,8] n)")
    assert onnxcampo.optimize(parse(shared), policy="amp").report["plan"]["exp"]["reason"] == "deny_list"


SOFTMAX_GRADIENT = """
g (float[4,8] a, float[4,8] b) => (float[4,8] y) <int64[3] seeded = {4, 8, 1}, int64[2] flat = {4, 8},
                                                  int64[1] axes = {1},
                                                  float[8,8] w1 = {""" + IDENTITY8 + """}> {
  [mm1] x = MatMul(a, w1)
  [softmax] p = Softmax <axis = -1> (x)
  [reshape_p] r = Reshape(p, seeded)
  [mm2] dy0 = MatMul(b, w1)
  [reshape_dy] dy = Reshape(dy0, seeded)
  [mul] m = Mul(r, dy)
  [sum] s = ReduceSum <keepdims = 1> (m, axes)
  [sub] d = Sub(dy, s)
  [mul2] g = Mul(r, d)
  [reshape_g] g2 = Reshape(g, flat)
  [mm3] y = MatMul(g2, w1)
}
"""


def test_softmax_gradient_sum_runs_fp16():
    """sum(y * dy) over the softmax axis is a weighted mean of dy (y >= 0, sum 1): under amp the
    ReduceSum of a Softmax's backward pass runs fp16 with its neighbours, and the gradient keeps
    fp16's precision even for dy in the thousands."""
    result = onnxcampo.optimize(parse(SOFTMAX_GRADIENT), policy="amp")
    plan = result.report["plan"]
    assert plan["sum"]["precision"] == "fp16" and plan["sub"]["precision"] == "fp16"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 8)).astype(np.float32) * 3
    b = (rng.standard_normal((4, 8)) * 4000).astype(np.float32)
    (got,) = ReferenceEvaluator(result.model).run(None, {"a": a, "b": b})
    p = np.exp(a - a.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    exact = p * (b - (p * b).sum(axis=1, keepdims=True))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, exact, atol=2e-3 * np.abs(exact).max())


def test_sums_over_another_axis_stay_denied():
    """A sum of y * dy over an axis that is not the softmax's (here the batch rows) is no mean."""
    other = SOFTMAX_GRADIENT.replace("int64[1] axes = {1}", "int64[1] axes = {0}")
    plan = onnxcampo.optimize(parse(other), policy="amp").report["plan"]
    assert plan["sum"]["reason"] == "deny_list"
    no_softmax = SOFTMAX_GRADIENT.replace("[softmax] p = Softmax <axis = -1> (x)", "[softmax] p = Relu(x)")
    assert onnxcampo.optimize(parse(no_softmax), policy="amp").report["plan"]["sum"]["reason"] == "deny_list"
