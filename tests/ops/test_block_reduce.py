"""BlockReduceSum's CPU kernel against numpy float64 sums, and the CUDA kernels' launch plan.

Integer-valued inputs (|x| <= 8, at most 2^20 elements per output) have exact float32 sums
whatever the order of the additions: the kernel must give the float64 sum exactly (float32
output) or rounded once to float16. Random normal inputs check the float32 accumulation against
a bound; several thread counts must give the same bits. The CUDA launch plan (pure host
arithmetic, read through ``OnnxcampoBlockReducePlan``) is checked for every shape: its tiles
cover every element exactly once, as the kernels walk them (emulated here in numpy);
``tests/gpu/test_block_reduce_cuda.py`` runs the kernels themselves on a GPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from onnx import TensorProto

import reference as ref
from onnxcampo.ops import nodes
from onnxcampo.ops import reduce as block_reduce
from onnxcampo.runtime import make_session

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {FLOAT: np.float32, FLOAT16: np.float16}

SHAPES = [  # (P, Q, R)
    (1, 1, 1), (5, 3, 1), (4096, 768, 1), (33, 70, 1), (7, 13, 1), (3, 100003, 1),  # column sums (R == 1)
    (1, 5, 9), (1, 768, 4096), (1, 64, 77),                                          # row sums (P == 1)
    (4, 16, 49), (3, 7, 12544), (2, 9, 196), (6, 5, 3), (2, 70001, 2),               # blocks
    (0, 4, 3), (3, 0, 5), (2, 3, 0), (0, 0, 0),                                      # empty
]


def reduce_node(sizes, output_type, output_shape=None):
    return nodes.block_reduce_sum("x", output="y", sizes=sizes, output_type=output_type, output_shape=output_shape,
                                  name="reduce")


def block_reduce_sum(x, sizes, output_type, output_shape=None, threads=None):
    shape = [sizes[1]] if output_shape is None else list(output_shape)
    out = ref.run_node(reduce_node(sizes, output_type, output_shape), {"x": x}, {"y": (output_type, shape)},
                       intra_op_threads=threads)
    return out["y"]


def integers(rng, count, dtype):
    return rng.integers(-8, 9, size=count).astype(dtype)


@pytest.mark.parametrize("sizes", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("x_type", [np.float32, np.float16], ids=["x32", "x16"])
@pytest.mark.parametrize("y_type", [FLOAT, FLOAT16], ids=["y32", "y16"])
def test_integer_sums_are_exact(library, sizes, x_type, y_type):
    p, q, r = sizes
    x = integers(np.random.default_rng(p * 7919 + q * 31 + r), p * q * r, x_type)
    y = block_reduce_sum(x, sizes, y_type)
    want = x.astype(np.float64).reshape(p, q, r).sum(axis=(0, 2))
    assert y.dtype == NP[y_type] and y.shape == (q,)
    np.testing.assert_array_equal(y, want.astype(NP[y_type]))


@pytest.mark.parametrize("x_type", [np.float32, np.float16], ids=["x32", "x16"])
@pytest.mark.parametrize("sizes", [(4096, 768, 1), (64, 33, 49), (1, 12, 50000)], ids=lambda s: "x".join(map(str, s)))
def test_random_sums_are_float32_accurate_and_the_same_for_any_thread_count(library, x_type, sizes):
    p, q, r = sizes
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(p * q * r) * 3).astype(x_type)
    results = [block_reduce_sum(x, sizes, FLOAT, threads=t) for t in (1, 2, 4)]
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    exact = x.astype(np.float64).reshape(p, q, r)
    # a float32 sum of n terms is within n * 2^-24 * sum |x| of the exact one
    bound = p * r * 2.0 ** -24 * np.abs(exact).sum(axis=(0, 2))
    assert np.all(np.abs(results[0] - exact.sum(axis=(0, 2))) <= bound)
    # and, the terms being random, much closer than that
    np.testing.assert_allclose(results[0], exact.sum(axis=(0, 2)), rtol=1e-4, atol=1e-3 * np.sqrt(p * r))


def test_output_shape_and_float16_rounding_inf_and_nan(library):
    x = np.full((2, 3, 4), 4096.0, np.float32)  # each sum is 8 * 4096 = 32768: a float16
    x[1, 1, 2] = np.nan
    x[:, 2, :] = 30000.0  # 240000: beyond float16's range
    y = block_reduce_sum(x, [2, 3, 4], FLOAT16, output_shape=[1, 3, 1])
    assert y.dtype == np.float16 and y.shape == (1, 3, 1)
    assert y[0, 0, 0] == 32768 and np.isnan(y[0, 1, 0]) and np.isposinf(y[0, 2, 0])
    y32 = block_reduce_sum(x, [2, 3, 4], FLOAT)
    assert y32[0] == 32768 and np.isnan(y32[1]) and y32[2] == 240000


def test_float16_output_rounds_once_to_nearest_even(library):
    # sums that fall between float16 neighbours: ties to even, below the smallest normal too
    values = np.array([2049.0, 2051.0, 2050.0, 65519.0, 65520.0, 3 * 2.0 ** -25, 2.0 ** -25, -1e-8], np.float32)
    y = block_reduce_sum(values, [1, values.size, 1], FLOAT16)
    with np.errstate(over="ignore"):  # 65520 rounds to inf
        want = values.astype(np.float16)
    assert np.isposinf(want[4])
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))


def test_the_reference_agrees_with_the_kernel(library):
    rng = np.random.default_rng(2)
    x = integers(rng, 4 * 6 * 5, np.float16).reshape(4, 6, 5)
    got = block_reduce_sum(x, [4, 6, 5], FLOAT, output_shape=[2, 3])
    np.testing.assert_array_equal(got, block_reduce.reference(x, [4, 6, 5], FLOAT, [2, 3]))


@pytest.mark.parametrize("attributes, message", [
    ({"sizes": [2, 3]}, "'sizes' must hold 3 ints"),
    ({"sizes": [2, 3, 1], "output_type": 7}, "'output_type' must be 1"),
    ({"sizes": [2, 3, 1], "output_shape": [2, 2]}, "holds 4 elements, Q is 3"),
])
def test_bad_attributes_fail_when_the_session_is_made(library, attributes, message):
    from onnx import helper

    node = helper.make_node("BlockReduceSum", ["x"], ["y"], domain="ai.onnxcampo", **attributes)
    model = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info("x", FLOAT, [6])],
                                                [helper.make_tensor_value_info("y", FLOAT, None)]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnxcampo", 1)],
                              ir_version=10)
    with pytest.raises(Exception, match=message):
        make_session(model, provider="cpu")


def test_an_input_of_another_size_fails_when_run(library):
    with pytest.raises(Exception, match=r"holds 6 elements, sizes \[2, 3, 2\] 12"):
        block_reduce_sum(np.ones(6, np.float32), [2, 3, 2], FLOAT)


def test_the_node_builder_checks_its_arguments():
    with pytest.raises(ValueError, match="three ints"):
        nodes.block_reduce_sum("x", output="y", sizes=[1, 2], name="n")
    with pytest.raises(ValueError, match="must hold Q = 3"):
        nodes.block_reduce_sum("x", output="y", sizes=[1, 3, 1], output_shape=[2], name="n")
    with pytest.raises(ValueError, match="output_type"):
        nodes.block_reduce_sum("x", output="y", sizes=[1, 3, 1], output_type=TensorProto.DOUBLE, name="n")


# ---- the CUDA launch plan ------------------------------------------------------------------------

PLAN_FIELDS = ("kind", "vec", "tx", "ty", "blocks_x", "chunks", "rows", "lanes", "items", "p_chunks", "p_len",
               "r_chunks", "r_len", "blocks", "partials", "workspace_bytes")
NOTHING, ZEROS, COLUMNS, ROWS = range(4)


def plan(library, p, q, r, half, align=256, sms=132, workspace=True) -> dict[str, int]:
    lib = ctypes.CDLL(library)
    fn = lib.OnnxcampoBlockReducePlan
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 16)()
    assert fn(p, q, r, int(half), min(align, 16), sms, int(workspace), out) == 16
    return dict(zip(PLAN_FIELDS, out))


def covered(plan_, p, q, r) -> np.ndarray:
    """How often the kernels' loops (as reduce.cu writes them) visit each element of [P, Q, R],
    and that each visit lands in the partial sum of its column."""
    count = np.zeros((p, q, r), np.int64)
    if plan_["kind"] == COLUMNS:
        tx, ty, vec, rows = plan_["tx"], plan_["ty"], plan_["vec"], plan_["rows"]
        for bx in range(plan_["blocks_x"]):
            for c in range(plan_["chunks"]):
                p0, p1 = c * rows, min(p, c * rows + rows)
                for i in range(tx):
                    column = (bx * tx + i) * vec
                    if column >= q:
                        continue
                    for j in range(ty):
                        for row in range(p0 + j, p1, ty):
                            count[row, column:column + vec, 0] += 1
    else:
        lanes, vec = plan_["lanes"], plan_["vec"]
        per_block = 256 // lanes
        for item in range(plan_["blocks"] * per_block):
            if item >= plan_["items"]:
                continue
            column, k = item % q, item // q
            rc, pc = k % plan_["r_chunks"], k // plan_["r_chunks"]
            p0, p1 = pc * plan_["p_len"], min(p, pc * plan_["p_len"] + plan_["p_len"])
            end = min(r, rc * plan_["r_len"] + plan_["r_len"])
            grouped = p0 + (p1 - p0) // 4 * 4  # four rows at a time, then one by one
            for lane in range(lanes):
                for first in range(p0, grouped, 4):
                    for start in range(rc * plan_["r_len"] + lane * vec, end, lanes * vec):
                        count[first:first + 4, column, start:start + vec] += 1
                for row in range(grouped, p1):
                    for start in range(rc * plan_["r_len"] + lane * vec, end, lanes * vec):
                        count[row, column, start:start + vec] += 1
    return count


PLAN_SHAPES = [(4096, 768, 1), (2048, 3072, 1), (64, 256, 3136), (64, 2048, 49), (64, 64, 12544), (1, 768, 4096),
               (4, 7, 1), (1, 1, 1), (100000, 3, 1), (3, 5, 7), (1, 2, 1000000), (5, 1, 9), (130, 6, 8)]


@pytest.mark.parametrize("sizes", PLAN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("half", [True, False], ids=["x16", "x32"])
def test_the_cuda_plan_is_well_formed(library, sizes, half):
    p, q, r = sizes
    for align, sms, workspace in ((256, 132, True), (256, 108, True), (4, 132, True), (2 if half else 4, 1, True),
                                  (256, 132, False)):
        got = plan(library, p, q, r, half, align, sms, workspace)
        vec, element = got["vec"], 2 if half else 4
        assert vec in (1, 2, 4, 8) and vec * element <= 16 and min(align, 16) % (vec * element) == 0
        if r == 1:
            assert got["kind"] == COLUMNS and q % vec == 0
            assert got["tx"] * got["ty"] == 256 and got["tx"] <= 32
            assert (got["blocks_x"] - 1) * got["tx"] * vec < q <= got["blocks_x"] * got["tx"] * vec
            assert (got["chunks"] - 1) * got["rows"] < p <= got["chunks"] * got["rows"] and got["chunks"] <= 65535
            assert got["partials"] == got["chunks"]
        else:
            assert got["kind"] == ROWS and r % vec == 0 and got["lanes"] in (1, 2, 4, 8, 16, 32)
            assert got["r_chunks"] == 1 or got["r_len"] % (got["lanes"] * vec) == 0
            assert (got["r_chunks"] - 1) * got["r_len"] < r <= got["r_chunks"] * got["r_len"]
            assert (got["p_chunks"] - 1) * got["p_len"] < p <= got["p_chunks"] * got["p_len"]
            assert got["items"] == q * got["p_chunks"] * got["r_chunks"]
            assert got["blocks"] * (256 // got["lanes"]) >= got["items"] > (got["blocks"] - 1) * (256 // got["lanes"])
            assert got["partials"] == got["p_chunks"] * got["r_chunks"]
        if not workspace:
            assert got["partials"] == 1
        assert got["workspace_bytes"] == (got["partials"] * q * 4 if got["partials"] > 1 else 0)


def test_the_plan_splits_large_reductions_and_leaves_small_ones_whole(library):
    bert = plan(library, 4096, 768, 1, True)
    assert bert["vec"] == 8 and bert["tx"] == 32 and 32 <= bert["chunks"] <= 512
    resnet = plan(library, 64, 2048, 49, True)
    assert resnet["vec"] == 1 and resnet["lanes"] == 32 and resnet["p_chunks"] > 1
    assert plan(library, 64, 64, 12544, True)["r_chunks"] > 1  # few, long rows: the rows are cut too
    assert plan(library, 4, 7, 1, False)["partials"] == 1
    assert plan(library, 3, 5, 7, True)["partials"] == 1
    assert plan(library, 0, 5, 7, True)["kind"] == ZEROS and plan(library, 3, 0, 7, True)["kind"] == NOTHING


@pytest.mark.parametrize("sizes", [(37, 70, 1), (300, 16, 1), (1, 3, 1), (5, 9, 49), (3, 4, 2048), (1, 3, 5000),
                                   (9, 5, 196), (2, 3, 7)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("half", [True, False], ids=["x16", "x32"])
def test_the_cuda_kernels_loops_visit_every_element_once(library, sizes, half):
    p, q, r = sizes
    for sms in (132, 2):
        count = covered(plan(library, p, q, r, half, sms=sms), p, q, r)
        assert count.min() == 1 and count.max() == 1, (sizes, sms)
