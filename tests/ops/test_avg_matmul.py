"""AvgMatMulInteger (and ExactMatMulInteger): the kernels against the numpy reference bit for bit,
the error against the exact sum within the bound of docs/avg-matmul.md (reached by adversarial
inputs), the seed's relative RMSE on N(128, sigma) inputs, and the errors a user sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxcampo import ops
from onnxcampo.errors import CampoError
from onnxcampo.runtime import make_session, run

from reference import avg_matmul_integer, error_bound, matmul_u8_model, subtree_sizes

OPS = ("AvgMatMulInteger", "ExactMatMulInteger")
# K = 1, primes, powers of two and their neighbours, M or N = 1, empty M and N, K = 0.
SHAPES = [(1, 1, 1), (3, 2, 5), (4, 7, 9), (2, 8, 33), (5, 13, 1), (1, 131, 40), (6, 64, 32), (9, 255, 17),
          (3, 256, 65), (2, 257, 31), (1, 1024, 3), (0, 5, 3), (4, 5, 0), (3, 0, 4), (2, 1009, 70)]
ZERO_POINTS = ["none", "scalar", "per_row_column", "a_only", "b_only"]


def _sessions():
    return {op: {zp: make_session(_model(op, zp)) for zp in ZERO_POINTS} for op in OPS}


def _model(op, zero_points):
    present = {"none": (False, False), "scalar": (True, True), "per_row_column": (True, True),
               "a_only": (True, False), "b_only": (False, True)}[zero_points]
    shapes = ((["M"], ["N"]) if zero_points == "per_row_column" else ((), ()))
    return matmul_u8_model(op, zero_points=present, zp_shapes=shapes)


def _feeds(rng, m, k, n, zero_points):
    feeds = {"A": rng.integers(0, 256, (m, k), dtype=np.uint8), "B": rng.integers(0, 256, (k, n), dtype=np.uint8)}
    if zero_points in ("scalar", "a_only"):
        feeds["a_zero_point"] = np.array(rng.integers(0, 256), np.uint8)
    if zero_points in ("scalar", "b_only"):
        feeds["b_zero_point"] = np.array(rng.integers(0, 256), np.uint8)
    if zero_points == "per_row_column":
        feeds["a_zero_point"] = rng.integers(0, 256, m, dtype=np.uint8)
        feeds["b_zero_point"] = rng.integers(0, 256, n, dtype=np.uint8)
    return feeds


def _reference(op, feeds):
    return avg_matmul_integer(feeds["A"], feeds["B"], feeds.get("a_zero_point"), feeds.get("b_zero_point"),
                              exact=op == "ExactMatMulInteger")


@pytest.fixture(scope="module")
def sessions():
    """One session per op and zero-point form (the ``library`` fixture reports a missing library)."""
    try:
        ops.check()
    except CampoError as exc:
        pytest.fail(f"{exc} (the README's set-up runs it)", pytrace=False)
    return _sessions()


def _run(session, feeds):
    return run(session, feeds)["Y"]


def test_the_library_names_its_kernel(library):
    assert ops.build_info()["matmul_u8"] in ("avx2", "neon", "scalar")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
def test_kernel_equals_reference_bit_for_bit(library, sessions, op, zero_points):
    rng = np.random.default_rng(7)
    for m, k, n in SHAPES:
        feeds = _feeds(rng, m, k, n, zero_points)
        y = _run(sessions[op][zero_points], feeds)
        assert y.dtype == np.float32 and y.shape == (m, n)
        np.testing.assert_array_equal(y, _reference(op, feeds), err_msg=f"{op} {m}x{k}x{n} zero points {zero_points}")


@pytest.mark.parametrize("values", ["extremes", "all_max"])
def test_kernel_equals_reference_on_extreme_values(library, sessions, values):
    """255 * 255 = 65025 products: the 16-bit leaves are full, a + b of two of them needs 17 bits."""
    rng = np.random.default_rng(3)
    for m, k, n in [(3, 100, 40), (2, 1024, 33)]:
        if values == "all_max":
            a, b = np.full((m, k), 255, np.uint8), np.full((k, n), 255, np.uint8)
        else:
            a = rng.choice(np.array([0, 1, 254, 255], np.uint8), (m, k))
            b = rng.choice(np.array([0, 1, 254, 255], np.uint8), (k, n))
        y = _run(sessions["AvgMatMulInteger"]["none"], {"A": a, "B": b})
        np.testing.assert_array_equal(y, avg_matmul_integer(a, b))
    if values == "all_max":  # every sum is even: the tree is exact
        np.testing.assert_array_equal(y, np.float32(k * 65025))


def test_exact_op_equals_onnxruntime_matmulinteger(library, sessions):
    u8 = TensorProto.UINT8
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["A", "B", "a_zero_point", "b_zero_point"], ["I"]),
         helper.make_node("Cast", ["I"], ["Y"], to=TensorProto.FLOAT)], "g",
        [helper.make_tensor_value_info("A", u8, ["M", "K"]), helper.make_tensor_value_info("B", u8, ["K", "N"]),
         helper.make_tensor_value_info("a_zero_point", u8, []), helper.make_tensor_value_info("b_zero_point", u8, [])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", "N"])])
    standard = make_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8))
    rng = np.random.default_rng(11)
    for m, k, n in [(5, 300, 70), (1, 7, 1), (33, 64, 9)]:
        feeds = _feeds(rng, m, k, n, "scalar")
        np.testing.assert_array_equal(_run(sessions["ExactMatMulInteger"]["scalar"], feeds), _run(standard, feeds))


@pytest.mark.slow
def test_scalar_fallback_equals_reference(library, tmp_path):
    """$ONNXCAMPO_AVG_MATMUL_SCALAR=1 picks the portable kernel; it gives the same bits."""
    script = tmp_path / "scalar.py"
    script.write_text(
        "import json, numpy as np\n"
        "from onnxcampo import ops\n"
        "from onnxcampo.runtime import make_session, run\n"
        "from reference import matmul_u8_model\n"
        "rng = np.random.default_rng(5)\n"
        "out = {'isa': ops.build_info()['matmul_u8'], 'cases': []}\n"
        "for op in ('AvgMatMulInteger', 'ExactMatMulInteger'):\n"
        "    s = make_session(matmul_u8_model(op, zero_points=(True, True)))\n"
        "    for m, k, n in [(3, 13, 40), (2, 64, 1), (5, 1000, 33)]:\n"
        "        f = {'A': rng.integers(0, 256, (m, k), dtype=np.uint8), 'B': rng.integers(0, 256, (k, n), dtype=np.uint8),\n"
        "             'a_zero_point': np.array(3, np.uint8), 'b_zero_point': np.array(200, np.uint8)}\n"
        "        out['cases'].append([op, {k: v.tolist() for k, v in f.items()}, run(s, f)['Y'].tolist()])\n"
        "print(json.dumps(out))\n")
    # the child imports reference.py from this folder through PYTHONPATH (no empty entry: that is the cwd)
    path = [str(Path(__file__).parent), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, ONNXCAMPO_AVG_MATMUL_SCALAR="1", PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=True)
    out = json.loads(result.stdout)
    assert out["isa"] == "scalar"
    for op, feeds, y in out["cases"]:
        feeds = {k: np.array(v, np.uint8) for k, v in feeds.items()}
        np.testing.assert_array_equal(np.array(y, np.float32), _reference(op, feeds))


# ---- the error bound (docs/avg-matmul.md) ---------------------------------------------------------


def test_error_bound_values():
    assert [error_bound(k) for k in (1, 2, 3, 4, 8, 1024)] == [0, 1, 1, 4, 12, 5120]
    assert subtree_sizes(13) == [8, 4, 1] and error_bound(13) == 12 + 4 + 0


@pytest.mark.parametrize("k", [1, 2, 3, 7, 8, 64, 100, 131, 256, 1000, 1024, 4096])
def test_error_is_within_the_bound_on_random_inputs(library, sessions, k):
    rng = np.random.default_rng(k)
    a = rng.integers(0, 256, (8, k), dtype=np.uint8)
    b = rng.integers(0, 256, (k, 40), dtype=np.uint8)
    approx = _run(sessions["AvgMatMulInteger"]["none"], {"A": a, "B": b}).astype(np.float64)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    error = exact - approx
    # float32 rounding of the result adds at most half an ulp of values up to 2^24 * 2^n
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64) / 2
    assert (error >= -ulp).all(), "the tree only rounds down: the approximation never exceeds the sum"
    assert (error <= error_bound(k) + ulp).all()


def _adversarial_leaves(value: int, depth: int) -> list[int]:
    """2^depth leaves whose tree root is ``value`` while every node's pair sum is odd: each
    node loses exactly 1/2, the error bound is reached."""
    if depth == 0:
        return [value]
    return _adversarial_leaves(value, depth - 1) + _adversarial_leaves(value + 1, depth - 1)


@pytest.mark.parametrize("k", [2, 4, 8, 13, 64, 131, 256, 1000, 1024])
def test_adversarial_inputs_reach_the_bound(library, sessions, k):
    """Products a*1 = a laid out so that every pair sum in every subtree is odd."""
    row = [leaf for size in subtree_sizes(k) for leaf in _adversarial_leaves(100, size.bit_length() - 1)]
    a = np.array([row, row[::-1]], np.uint8)  # reversed: another layout, also checked against the reference
    b = np.ones((k, 3), np.uint8)
    b[:, 1] = 2  # products 2a: even leaves, odd sums start one level up
    b[:, 2] = 0
    y = _run(sessions["AvgMatMulInteger"]["none"], {"A": a, "B": b})
    np.testing.assert_array_equal(y, avg_matmul_integer(a, b))
    exact = a.astype(np.int64) @ b.astype(np.int64)
    assert exact[0, 0] - int(y[0, 0]) == error_bound(k)
    assert (exact - y.astype(np.int64) <= error_bound(k)).all() and (exact - y.astype(np.int64) >= 0).all()
    assert y[0, 2] == 0


@pytest.mark.parametrize("sigma", [5, 10, 20])
@pytest.mark.parametrize("k", [64, 256, 1024, 4096])
def test_relative_rmse_on_seed_inputs_is_below_0_05_percent(library, sessions, k, sigma):
    """The seed's table: inputs from N(128, sigma) (clipped to uint8), RMSE / mean of the exact
    product, no zero points."""
    rng = np.random.default_rng(k + sigma)
    a = np.clip(np.rint(rng.normal(128, sigma, (32, k))), 0, 255).astype(np.uint8)
    b = np.clip(np.rint(rng.normal(128, sigma, (k, 64))), 0, 255).astype(np.uint8)
    approx = _run(sessions["AvgMatMulInteger"]["none"], {"A": a, "B": b}).astype(np.float64)
    exact = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.float64)
    relative_rmse = np.sqrt(np.mean((approx - exact) ** 2)) / np.mean(exact)
    assert relative_rmse < 5e-4


# ---- errors -------------------------------------------------------------------------------------


def test_bad_inputs_fail_with_one_clear_message(library, sessions):
    session = sessions["AvgMatMulInteger"]["none"]
    with pytest.raises(CampoError, match=r"AvgMatMulInteger: A is 2 x 3 but B is 4 x 5"):
        _run(session, {"A": np.zeros((2, 3), np.uint8), "B": np.zeros((4, 5), np.uint8)})
    per_column = sessions["AvgMatMulInteger"]["per_row_column"]
    with pytest.raises(CampoError, match=r"b_zero_point must be a uint8 scalar or a 1-D tensor of 1 or 5 values"):
        _run(per_column, {"A": np.zeros((2, 3), np.uint8), "B": np.zeros((3, 5), np.uint8),
                          "a_zero_point": np.zeros(2, np.uint8), "b_zero_point": np.zeros(4, np.uint8)})


def test_non_uint8_inputs_are_refused(library):
    model = matmul_u8_model()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT8
    with pytest.raises(CampoError):
        make_session(model)


def test_exact_op_refuses_k_that_may_overflow_int32(library, sessions):
    with pytest.raises(CampoError, match="exceeds 33025"):
        _run(sessions["ExactMatMulInteger"]["none"], {"A": np.zeros((1, 33026), np.uint8),
                                                      "B": np.zeros((33026, 1), np.uint8)})
