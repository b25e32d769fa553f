"""ScatterNDAdd's CPU kernel against numpy (np.add.at in index order, reference.py) bit for bit:
float32 and float16, duplicate and negative indices, index tuples of 1, 2 and 3 entries and of
none, empty tensors; the float16 rounding of every sum; and the errors a user sees."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import reference as ref
from cases.scatter import random_case
from onnxcampo.errors import CampoError
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session, run

TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


@pytest.fixture(scope="module")
def sessions():
    """One session per element type (shapes unknown to ORT: every case runs on it)."""
    return {}


def scatter(sessions, data, indices, updates):
    dtype = np.dtype(data.dtype).type
    if dtype not in sessions:
        sessions[dtype] = make_session(ref.scatter_nd_add_model(TYPES[dtype]))
    return run(sessions[dtype], {"data": data, "indices": indices, "updates": updates})["output"]


def case(rng, dtype, data_shape, k, lead):
    """Random data, indices (many duplicates, 40 % negative) and updates."""
    return random_case(rng, dtype, data_shape, k, lead, negative=0.4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("data_shape, k, lead", [
    ((6, 5), 1, (40,)),            # rows of 5, 40 tuples into 6 rows: every row several times
    ((30, 16, 3), 1, (4, 8)),      # 2-D indices, rank-2 slices (an embedding gradient with a seed axis)
    ((5, 4, 3), 2, (25,)),         # pairs: slices of 3
    ((3, 4, 2), 3, (2, 30)),       # full index tuples: scalar slices
    ((4, 3), 0, (3,)),             # empty tuples: every update is added to all of data
    ((7,), 1, (50,)),              # 1-D data, scalar slices
])
def test_cpu_kernel_equals_numpy_add_at(library, sessions, dtype, data_shape, k, lead):
    rng = np.random.default_rng(hash((data_shape, k, lead, dtype.__name__)) % 2**32)
    data, indices, updates = case(rng, dtype, data_shape, k, lead)
    out = scatter(sessions, data, indices, updates)
    assert out.dtype == dtype and out.shape == data.shape
    np.testing.assert_array_equal(out, ref.scatter_nd_add(data, indices, updates))


def test_duplicates_accumulate_in_index_order(library, sessions):
    """float32 sums are not associative: 1e8 + 1 + 1 ... in tuple order stays 1e8, as np.add.at."""
    data = np.zeros((2, 1), np.float32)
    indices = np.array([[1]] * 5 + [[-1]] * 5)
    updates = np.array([[1e8], [1.0], [1.0], [1.0], [-1e8], [1.0], [1.0], [1.0], [1.0], [1.0]], np.float32)
    out = scatter(sessions, data, indices, updates)
    assert out[1, 0] == np.float32(5.0) and out[0, 0] == 0.0  # (1e8 + 1 + 1 + 1 - 1e8) + 5 * 1
    np.testing.assert_array_equal(out, ref.scatter_nd_add(data, indices, updates))


def test_float16_sums_round_to_nearest_even_like_numpy(library, sessions):
    """Every pair of float16 values (subnormals, the largest finite ones, inf) summed once: the
    kernel's float32 sum rounded to float16 is numpy's float16 sum, bit for bit."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 0x7c00, size=200_000, dtype=np.uint16) | (rng.integers(0, 2, 200_000, dtype=np.uint16) << 15)
    bits[:8] = [0x0001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x7c00, 0x8000, 0x0000]
    other = rng.integers(0, 0x7c00, size=bits.size, dtype=np.uint16) | (rng.integers(0, 2, bits.size, dtype=np.uint16) << 15)
    other[:8] = [0x0001, 0x0001, 0x8001, 0x7bff, 0xfbff, 0xfc00, 0x0000, 0x8000]
    data = bits.view(np.float16)
    indices = np.arange(data.size, dtype=np.int64)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        out = scatter(sessions, data, indices, other.view(np.float16))
        expected = data + other.view(np.float16)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))


def test_float16_nan_stays_nan(library, sessions):
    data = np.array([np.nan, 1.0, np.inf], np.float16)
    out = scatter(sessions, data, np.array([[0], [1], [2], [2]]), np.array([1.0, np.nan, -np.inf, 1.0], np.float16))
    assert np.isnan(out).all()


@pytest.mark.parametrize("data_shape, index_shape, update_shape", [
    ((4, 3), (0, 1), (0, 3)),      # no index tuples: output = data
    ((0, 3), (0, 1), (0, 3)),      # empty data
    ((4, 0), (2, 1), (2, 0)),      # empty slices
    ((4, 3), (2, 0, 1), (2, 0, 3)),
])
def test_empty_tensors(library, sessions, data_shape, index_shape, update_shape):
    data = np.arange(np.prod(data_shape), dtype=np.float32).reshape(data_shape)
    indices = np.ones(index_shape, np.int64)
    out = scatter(sessions, data, indices, np.ones(update_shape, np.float32))
    assert out.shape == data.shape
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("bad", [4, -5, 100, -(2**62)])
def test_an_index_out_of_range_is_an_error_naming_it(library, sessions, bad):
    data = np.zeros((4, 2), np.float32)
    indices = np.array([[1], [bad]])
    with pytest.raises(CampoError, match=rf"ScatterNDAdd node 'scatter': index {bad} \(index tuple 1, entry 0\) is out of "
                                         r"range for data dimension 0 of size 4 \(allowed: -4 \.\. 3\)"):
        scatter(sessions, data, indices, np.ones((2, 2), np.float32))


def test_the_second_entry_of_a_pair_is_checked_against_the_second_dimension(library, sessions):
    with pytest.raises(CampoError, match=r"index 3 \(index tuple 0, entry 1\) is out of range for data dimension 1 of size 3"):
        scatter(sessions, np.zeros((5, 3), np.float32), np.array([[4, 3]]), np.ones(1, np.float32))
    out = scatter(sessions, np.zeros((5, 3), np.float32), np.array([[4, -3]]), np.ones(1, np.float32))
    assert out[4, 0] == 1.0 and out.sum() == 1.0


@pytest.mark.parametrize("index_shape, update_shape, message", [
    ((2, 1), (2, 4), r"updates must have shape indices.shape\[:-1\] \+ data.shape\[k:\] = \[2, 3\], not \[2, 4\] "
                     r"\(data \[4, 3\], indices \[2, 1\]\)"),
    ((2, 3), (2,), r"indices' last dimension \(3\) exceeds data's rank \(2\)"),
    ((), (), r"indices must have rank >= 1"),
])
def test_shapes_that_do_not_fit_are_errors(library, sessions, index_shape, update_shape, message):
    with pytest.raises(CampoError, match=message):
        scatter(sessions, np.zeros((4, 3), np.float32), np.zeros(index_shape, np.int64), np.zeros(update_shape, np.float32))


def test_another_reduction_is_refused_when_the_session_is_made(library):
    with pytest.raises(CampoError, match=r"ScatterNDAdd node 'scatter': attribute reduction='mul': the op always adds"):
        make_session(ref.scatter_nd_add_model(TensorProto.FLOAT, reduction="mul"))
    make_session(ref.scatter_nd_add_model(TensorProto.FLOAT, reduction="add"))  # allowed, and changes nothing


def test_updates_of_another_type_than_data_are_refused(library):
    model = ref.scatter_nd_add_model(TensorProto.FLOAT)
    model.graph.input[2].type.tensor_type.elem_type = TensorProto.FLOAT16
    with pytest.raises(CampoError):
        make_session(model)


def test_an_equal_float32_scatternd_of_onnx_runtime(library, sessions):
    """ORT's own ScatterND (reduction add, CPU) gives the same bits on the same inputs, on one
    thread: with more, onnxruntime 1.32 spreads the index tuples over them and races on duplicate
    indices (wrong sums in about a third of the runs on large enough calls)."""
    rng = np.random.default_rng(3)
    data, indices, updates = case(rng, np.float32, (9, 4, 2), 1, (5, 6))
    standard = make_session(ref.scatter_nd_add_model(TensorProto.FLOAT, op="ScatterND"), intra_op_threads=1)
    expected = run(standard, {"data": data, "indices": indices, "updates": updates})["output"]
    np.testing.assert_array_equal(scatter(sessions, data, indices, updates), expected)


def test_a_computed_data_tensor_is_copied_not_changed(library):
    """data = x + 0, read by the scatter only, and also by a second output (which must stay x):
    the output is numpy's result, run after run."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    indices = rng.integers(-6, 6, size=(9, 1))
    updates = rng.standard_normal((9, 4)).astype(np.float32)
    expected = ref.scatter_nd_add(x, indices, updates)
    for keep_data in (False, True):
        outputs = ["output", "data"] if keep_data else ["output"]
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "zero"], ["data"], name="data"),
             nodes.scatter_nd_add("data", "indices", "updates", output="output", name="scatter")],
            "reuse",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4]),
             helper.make_tensor_value_info("indices", TensorProto.INT64, [9, 1]),
             helper.make_tensor_value_info("updates", TensorProto.FLOAT, [9, 4])],
            [helper.make_tensor_value_info(name, TensorProto.FLOAT, [6, 4]) for name in outputs],
            [onnx.numpy_helper.from_array(np.zeros(1, np.float32), "zero")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
        nodes.import_domain(model)
        session = make_session(model)
        for _ in range(3):
            out = run(session, {"x": x, "indices": indices, "updates": updates})
            np.testing.assert_array_equal(out["output"], expected)
            if keep_data:
                np.testing.assert_array_equal(out["data"], x)


def test_the_bound_of_a_sum_in_any_order_catches_a_misplaced_update():
    """tests/cases/scatter.py's comparison, which the CUDA test (atomics: no fixed order) relies on."""
    from cases.scatter import compare

    data = np.zeros((3, 2), np.float32)
    tuples = np.array([[0], [2]])
    updates = np.ones((2, 2), np.float32)
    right = np.array([[1, 1], [0, 0], [1, 1]], np.float32)
    assert compare(right, data, tuples, updates)["ok"]
    assert not compare(right[[0, 2, 1]], data, tuples, updates)["ok"]  # row 2's update in row 1
    touched_wrongly = right.copy()
    touched_wrongly[1, 0] = 1e-30  # an element no update reaches must keep data's bits
    report = compare(touched_wrongly, data, tuples, updates)
    assert not report["ok"] and not report["untouched_equal_data"]
