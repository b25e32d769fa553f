"""ai.onnxcampo::ConvWeightGrad on the CPU against a float64 numpy reference (the im2col matrix
times dy; tests/gpu/test_im2col_cuda.py checks cuDNN's kernel the same way on a GPU): float32
and float16, strides, dilation, asymmetric pads, 1x1, 7x7, an empty batch; the type and shape
ORT infers for an undeclared output; the same bits for any thread count; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from cases.im2col import SMALL_CASES, close, dy_shape, reference_weight_grad, resnet_cout, weight_grad_model
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session

pytestmark = pytest.mark.usefixtures("library")  # fails (never skips) without the built library
RNG = np.random.default_rng(0)


def _feeds(shape, kernel, stride, dilation, pads, cout, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    return {"x": x, "dy": RNG.standard_normal(dy_shape(shape, kernel, stride, dilation, pads, cout)).astype(dtype)}


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kernel, stride, dilation, pads", SMALL_CASES)
def test_matches_numpy(shape, kernel, stride, dilation, pads, dtype, rtol):
    cout = 5
    feeds = _feeds(shape, kernel, stride, dilation, pads, cout, dtype)
    model = weight_grad_model(shape, kernel, stride, dilation, pads, cout, TensorProto.FLOAT16 if dtype == np.float16 else 1)
    got = make_session(model).run(None, feeds)[0]
    assert got.dtype == dtype and got.shape == (cout, shape[1], *kernel)
    want = reference_weight_grad(feeds["x"], feeds["dy"], kernel, stride, dilation, pads)
    if shape[0] == 0:
        assert np.all(got == 0)
    else:
        assert close(got, want, rtol)["ok"], close(got, want, rtol)


def test_same_bits_for_any_thread_count():
    shape, kernel, stride, dilation, pads = (4, 33, 31, 29), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)
    feeds = _feeds(shape, kernel, stride, dilation, pads, 7, np.float32)
    model = weight_grad_model(shape, kernel, stride, dilation, pads, 7, TensorProto.FLOAT)
    runs = [make_session(model, intra_op_threads=t).run(None, feeds)[0] for t in (1, 2, 4)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)


def test_undeclared_output_gets_type_and_shape_from_the_op():
    node = nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=(3, 3), pads=(1, 1, 1, 1), name="g")
    after = helper.make_node("Identity", ["dw"], ["out"])
    graph = helper.make_graph([node, after], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3, 5, 5]),
                                                   helper.make_tensor_value_info("dy", TensorProto.FLOAT16, [2, 4, 5, 5])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    session = make_session(model)
    feeds = {"x": RNG.standard_normal((2, 3, 5, 5)).astype(np.float16),
             "dy": RNG.standard_normal((2, 4, 5, 5)).astype(np.float16)}
    out = session.run(None, feeds)[0]
    assert out.dtype == np.float16 and out.shape == (4, 3, 3, 3)


@pytest.mark.parametrize("dy, x_type, dy_type, message", [
    ((2, 4, 4, 5), TensorProto.FLOAT, TensorProto.FLOAT, "dy has shape [2, 4, 4, 5]"),
    ((2, 4, 5, 5), TensorProto.FLOAT, TensorProto.FLOAT16, "must both be float32 or both float16"),
])
def test_bad_inputs_fail_clearly(dy, x_type, dy_type, message):
    node = nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=(3, 3), pads=(1, 1, 1, 1), name="g")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, [2, 3, 5, 5]),
                                            helper.make_tensor_value_info("dy", dy_type, list(dy))],
                              [helper.make_tensor_value_info("dw", x_type, [4, 3, 3, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    feeds = {"x": np.zeros((2, 3, 5, 5), np.float32 if x_type == 1 else np.float16),
             "dy": np.zeros(dy, np.float32 if dy_type == 1 else np.float16)}
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_session(model).run(None, feeds)


def test_builder_refuses_bad_attributes():
    with pytest.raises(ValueError, match="ConvWeightGrad: strides must be 2 positive ints"):
        nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=(3, 3), strides=(0, 1), name="g")


def test_the_gpu_script_times_resnet50_channels():
    assert resnet_cout((64, 3, 224, 224), (7, 7), (2, 2)) == 64
    assert resnet_cout((64, 256, 56, 56), (1, 1), (1, 1)) == 64      # a bottleneck's reduction
    assert resnet_cout((64, 64, 56, 56), (1, 1), (1, 1)) == 256      # its expansion
    assert resnet_cout((64, 512, 28, 28), (1, 1), (2, 2)) == 1024    # the downsample
