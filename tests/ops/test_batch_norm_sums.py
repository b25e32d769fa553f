"""BatchNormStats and BatchNormGradSums: the CPU kernels against the numpy references (float64)
on ONNX Runtime's CPU provider, float16 and float32 inputs mixed, channels-first ([N, C, H*W]) and
channels-last ([N*H*W, C, 1]) blocks; bad calls as one error naming the node. The CUDA kernels
are checked against these under tests/gpu/test_batch_norm_cuda.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo.errors import CampoError
from onnxcampo.ops import batch_norm
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session, run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}
BLOCKS = {"nchw": (6, 5, 49), "nhwc": (6 * 49, 5, 1), "one row": (1, 3, 300), "one value": (4, 7, 1)}


def _model(node: onnx.NodeProto, inputs: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                                          list(v.shape)) for n, v in inputs.items()],
                              [helper.make_tensor_value_info(o, F32, None) for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    op_nodes.import_domain(model)
    return model


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("dtype", [F32, F16])
def test_stats_sum_and_centered_squares_match_numpy(library, block, dtype):
    """Values with a large common offset (mean 40, spread 1): the centered sum is the two-pass one,
    not a difference of two large sums."""
    p, q, r = BLOCKS[block]
    x = (40.0 + np.random.default_rng(p + q).standard_normal((p, q, r))).astype(NUMPY[dtype])
    node = op_nodes.batch_norm_stats("x", outputs=["sum", "centered"], sizes=[p, q, r], output_shape=[1, q, 1, 1],
                                     name="stats")
    got = run(make_session(_model(node, {"x": x})), {"x": x})
    want = batch_norm.stats(x, [p, q, r], [1, q, 1, 1])
    assert got["sum"].shape == (1, q, 1, 1) and got["sum"].dtype == np.float32
    _close(got["sum"], want[0], 1e-5)
    _close(got["centered"], want[1], 1e-4)


@pytest.mark.parametrize("block", list(BLOCKS))
@pytest.mark.parametrize("types", [(F32, F32), (F16, F16), (F16, F32), (F32, F16)])
def test_grad_sums_match_numpy(library, block, types):
    p, q, r = BLOCKS[block]
    rng = np.random.default_rng(p * q)
    dy = rng.standard_normal((p, q, r)).astype(NUMPY[types[0]])
    c = rng.standard_normal((p, q, r)).astype(NUMPY[types[1]])
    invstd = (np.abs(rng.standard_normal(q)) + 0.5).astype(np.float32)
    node = op_nodes.batch_norm_grad_sums("dy", "c", "invstd", outputs=["db", "dscale"], sizes=[p, q, r], name="sums")
    feeds = {"dy": dy, "c": c, "invstd": invstd}
    got = run(make_session(_model(node, feeds)), feeds)
    want = batch_norm.grad_sums(dy, c, invstd, [p, q, r])
    assert got["db"].shape == (q,)
    _close(got["db"], want[0], 1e-5)
    _close(got["dscale"], want[1], 1e-5)


def test_a_wrong_call_is_one_error_naming_the_node(library):
    x = np.zeros((2, 3, 4), np.float32)
    node = op_nodes.batch_norm_stats("x", outputs=["s", "c"], sizes=[2, 3, 5], name="stats_node")
    with pytest.raises(CampoError, match=r"BatchNormStats node 'stats_node'.*x \[2, 3, 4\] must hold 30 elements"):
        run(make_session(_model(node, {"x": x})), {"x": x})
    feeds = {"dy": x, "c": x, "invstd": np.ones(3, np.float16)}
    node = op_nodes.batch_norm_grad_sums("dy", "c", "invstd", outputs=["a", "b"], sizes=[2, 3, 4], name="sums_node")
    with pytest.raises(Exception, match=r"invstd|float"):
        run(make_session(_model(node, feeds)), feeds)
    with pytest.raises(ValueError, match="output_shape \\[2\\] must hold Q = 3 elements"):
        op_nodes.batch_norm_stats("x", outputs=["s", "c"], sizes=[2, 3, 4], output_shape=[2], name="bad")
