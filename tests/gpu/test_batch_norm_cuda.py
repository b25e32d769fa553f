"""``ai.onnxcampo::BatchNormStats`` and ``BatchNormGradSums`` on CUDA against the numpy references
(float64) and the library's CPU kernels, and timed against the BlockReduceSum pairs they replace
(tests/gpu/conftest.py: skipped without a GPU).

Checks, for float16 and float32 inputs, on the blocks of ResNet-50 b64's BatchNorms, channels-first
(``[N, C, H*W]``: the row kernel) and channels-last (``[N*H*W, C, 1]``: the column kernel), and odd
ones (one row, one value a row, a split that leaves a short last chunk, empty tensors):

- the sums within float32 rounding of the float64 sums (``rtol 1e-4``), the squared deviations of
  values with a large common offset too (Welford's merge, not a difference of large sums);
- two runs equal bit for bit (no atomics), and the node replayed as a CUDA graph (its workspace
  from ORT's arena during the capture) gives the plain run's bits.

Timing, per ResNet-50 block (float16 input): BatchNormStats against BlockReduceSum(x) plus
Mul(c, c) and BlockReduceSum of the squares (the forward it replaces), BatchNormGradSums against
Mul(dy, c * invstd) plus two BlockReduceSums (the backward), each replayed as a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.ops import batch_norm
from onnxcampo.ops import nodes

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {FLOAT: np.float32, FLOAT16: np.float16}
BLOCKS = {  # label: (P, Q, R)
    "r50-64x112x112": (64, 64, 112 * 112), "r50-256x56x56": (64, 256, 3136), "r50-2048x7x7": (64, 2048, 49),
    "r50-nhwc-256x56x56": (64 * 3136, 256, 1), "r50-nhwc-2048x7x7": (64 * 49, 2048, 1),
    "one-row": (1, 7, 5000), "one-value-a-row": (3, 9, 1), "short-last-chunk": (1001, 33, 3), "odd-columns": (4097, 70, 1),
    "empty": (0, 4, 3),
}
TIMED = ["r50-64x112x112", "r50-256x56x56", "r50-2048x7x7", "r50-nhwc-256x56x56", "r50-nhwc-2048x7x7"]


def _model(graph_nodes, feeds: dict[str, np.ndarray], outputs: list[str], initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(graph_nodes, "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                                               list(v.shape)) for n, v in feeds.items()],
                              [helper.make_tensor_value_info(o, FLOAT, None) for o in outputs], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _stats(sizes, dtype):
    p, q, r = sizes
    x = (40.0 + np.random.default_rng(q).standard_normal((p, q, r))).astype(NP[dtype])
    node = nodes.batch_norm_stats("x", outputs=["sum", "centered"], sizes=sizes, name="stats")
    return _model([node], {"x": x}, ["sum", "centered"]), {"x": x}, batch_norm.stats(x, sizes)


def _grad(sizes, dtype):
    p, q, r = sizes
    rng = np.random.default_rng(q + 1)
    feeds = {"dy": rng.standard_normal((p, q, r)).astype(NP[dtype]), "c": rng.standard_normal((p, q, r)).astype(NP[dtype]),
             "invstd": (np.abs(rng.standard_normal(q)) + 0.5).astype(np.float32)}
    node = nodes.batch_norm_grad_sums("dy", "c", "invstd", outputs=["sum", "centered"], sizes=sizes, name="sums")
    return _model([node], feeds, ["sum", "centered"]), feeds, batch_norm.grad_sums(feeds["dy"], feeds["c"], feeds["invstd"], sizes)


def _labels(labels):
    """ResNet-50's blocks are ``slow`` (the CPU stand-in of tests/test_gpu_tests.py leaves them)."""
    return [pytest.param(label, marks=pytest.mark.slow) if np.prod(BLOCKS[label]) > 1 << 20 else label
            for label in labels]


@pytest.mark.parametrize("dtype", [FLOAT16, FLOAT], ids=["f16", "f32"])
@pytest.mark.parametrize("label", _labels(BLOCKS))
@pytest.mark.parametrize("op", ["stats", "grad"])
def test_the_sums_match_numpy_are_reproducible_and_replay(device, results, op, label, dtype):
    model, feeds, want = (_stats if op == "stats" else _grad)(BLOCKS[label], dtype)
    got = device.run(model, feeds)
    again = device.run(model, feeds)
    replayed = device.run(model, feeds, cuda_graph=True)
    worst = 0.0
    for name, expected in zip(("sum", "centered"), want):
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(got[name].astype(np.float64), expected.astype(np.float64), rtol=1e-4, atol=1e-4 * scale)
        assert np.array_equal(got[name], again[name]) and np.array_equal(got[name], replayed[name]), name
        worst = max(worst, float(np.abs(got[name] - expected).max()) / scale)
    results.record(worst_scaled_error=worst)


def _pairs(label: str):
    """(fused model, unfused model, feeds) of the forward and the backward at ResNet-50's block."""
    p, q, r = sizes = BLOCKS[label]
    rng = np.random.default_rng(q)
    x = rng.standard_normal((p, q, r)).astype(np.float16)
    mean = numpy_helper.from_array(np.zeros((1, q, 1), np.float16), "mean")
    forward = _model([nodes.batch_norm_stats("x", outputs=["sum", "centered"], sizes=sizes, name="stats")], {"x": x},
                     ["sum", "centered"])
    unfused_forward = _model([
        nodes.block_reduce_sum("x", output="sum", sizes=sizes, name="s1"),
        helper.make_node("Sub", ["x", "mean"], ["c"]), helper.make_node("Mul", ["c", "c"], ["sq"]),
        nodes.block_reduce_sum("sq", output="centered", sizes=sizes, name="s2")], {"x": x}, ["sum", "centered"], [mean])
    invstd = numpy_helper.from_array(np.ones((1, q, 1), np.float16), "invstd")
    feeds = {"x": x, "dy": rng.standard_normal((p, q, r)).astype(np.float16)}
    backward = _model([nodes.batch_norm_grad_sums("dy", "x", "invstd32", outputs=["sum", "dot"], sizes=sizes, name="g")],
                      feeds, ["sum", "dot"], [numpy_helper.from_array(np.ones(q, np.float32), "invstd32")])
    unfused_backward = _model([
        helper.make_node("Mul", ["x", "invstd"], ["xhat"]), helper.make_node("Mul", ["dy", "xhat"], ["p"]),
        nodes.block_reduce_sum("dy", output="sum", sizes=sizes, name="s3"),
        nodes.block_reduce_sum("p", output="dot", sizes=sizes, name="s4")], feeds, ["sum", "dot"], [invstd])
    return (forward, unfused_forward, {"x": x}), (backward, unfused_backward, feeds)


@pytest.mark.slow
@pytest.mark.parametrize("label", TIMED)
def test_one_pass_against_the_block_sums_it_replaces(device, results, label):
    figures = {}
    for part, (fused, unfused, feeds) in zip(("forward", "backward"), _pairs(label)):
        runs = {"fused": device.bound(fused, feeds, cuda_graph=device.cuda),
                "block_sums": device.bound(unfused, feeds, cuda_graph=device.cuda)}
        figures[part] = device.time(runs)
        runs["fused"]()
        runs["block_sums"]()
        got, want = runs["fused"].outputs(), runs["block_sums"].outputs()
        for name in want:  # the same sums (the forward's squares about 0: the fused deviations are about the mean)
            if part == "backward" or name == "sum":
                scale = max(1.0, float(np.abs(want[name]).max()))
                np.testing.assert_allclose(got[name], want[name], rtol=2e-3, atol=2e-3 * scale)
    results.record(block=BLOCKS[label], **figures)
