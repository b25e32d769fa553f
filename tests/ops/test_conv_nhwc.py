"""ai.onnxcampo::ConvNhwc, ConvNhwcDataGrad and ConvNhwcWeightGrad on the CPU (ORT's CPU provider
runs the library's reference kernels; tests/gpu/test_conv_nhwc_cuda.py checks cuDNN's the same way):
against float64 numpy (onnxcampo.ops.conv_nhwc) in float32 and float16 (the kernel's own float16
arithmetic: the op's inputs stay float16 on the CPU provider), against ORT's own NCHW Conv and
ConvTranspose, the same bits for any thread count, inferred output shapes, clear errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo.ops import conv_nhwc as ref
from onnxcampo.ops import to_nhwc as to_nhwc_ref
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session

pytestmark = pytest.mark.usefixtures("library")  # fails (never skips) without the built library
RNG = np.random.default_rng(0)
# (N, H, W, Cin), kernel, strides, dilations, pads, Cout
CASES = [
    ((2, 5, 6, 3), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 4),
    ((2, 8, 8, 4), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 5),  # ResNet's strided 3x3
    ((1, 8, 7, 3), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 6),  # a strided 1x1 shortcut
    ((2, 9, 9, 2), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3), 3),  # the stem
    ((1, 7, 8, 3), (3, 2), (1, 2), (2, 1), (2, 0, 1, 1), 2),  # dilation, asymmetric pads
    ((0, 4, 4, 3), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 2),  # an empty batch
]
IDS = ["3x3", "3x3-s2", "1x1-s2", "7x7-s2", "dilated-asym", "empty"]
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _model(node, inputs, out_shape, dtype):
    graph = helper.make_graph([node], "conv_nhwc", [helper.make_tensor_value_info(k, TYPES[dtype], list(v.shape))
                                                    for k, v in inputs.items()],
                              [helper.make_tensor_value_info(node.output[0], TYPES[dtype], list(out_shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _case(shape, kernel, strides, dilations, pads, cout, dtype, rng):
    ho, wo = ref.output_hw(shape[1], shape[2], kernel, strides, dilations, pads)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((cout, *kernel, shape[3])).astype(dtype)
    dy = rng.standard_normal((shape[0], ho, wo, cout)).astype(dtype)
    return x, w, dy


def _run_all(shape, kernel, strides, dilations, pads, cout, dtype, threads=1, seed=0):
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads}
    x, w, dy = _case(shape, kernel, strides, dilations, pads, cout, dtype, np.random.default_rng(seed))
    out = {}
    out["y"] = make_session(_model(nodes.conv_nhwc("x", "w", output="y", name="f", **attrs), {"x": x, "w": w},
                                   dy.shape, dtype), intra_op_threads=threads).run(None, {"x": x, "w": w})[0]
    out["dx"] = make_session(_model(nodes.conv_nhwc_data_grad("dy", "w", output="dx", input_spatial=shape[1:3],
                                                              name="d", **attrs),
                                    {"dy": dy, "w": w}, x.shape, dtype), intra_op_threads=threads).run(None, {"dy": dy, "w": w})[0]
    out["dw"] = make_session(_model(nodes.conv_nhwc_weight_grad("x", "dy", output="dw", name="g", **attrs),
                                    {"x": x, "dy": dy}, w.shape, dtype), intra_op_threads=threads).run(None, {"x": x, "dy": dy})[0]
    return (x, w, dy), out


def _close(got, want, rtol):
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    return got.shape == want.shape and float(np.abs(got.astype(np.float64) - want).max(initial=0.0)) <= rtol * scale


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kernel, strides, dilations, pads, cout", CASES, ids=IDS)
def test_matches_numpy(shape, kernel, strides, dilations, pads, cout, dtype, rtol):
    (x, w, dy), out = _run_all(shape, kernel, strides, dilations, pads, cout, dtype)
    attrs = {"strides": strides, "dilations": dilations, "pads": pads}
    assert all(v.dtype == dtype for v in out.values())
    assert _close(out["y"], ref.conv_nhwc(x, w, **attrs), rtol)
    assert _close(out["dx"], ref.conv_nhwc_data_grad(dy, w, shape[1:3], **attrs), rtol)
    assert _close(out["dw"], ref.conv_nhwc_weight_grad(x, dy, kernel, **attrs), rtol)


@pytest.mark.parametrize("shape, kernel, strides, dilations, pads, cout", CASES[:4], ids=IDS[:4])
def test_matches_onnx_runtime_conv_and_conv_transpose(shape, kernel, strides, dilations, pads, cout):
    """The NCHW ops a step graph had: ONNX Conv and the ConvTranspose onnx-ad writes for its input
    gradient (output_shape given, the Conv's pads), on ORT's own CPU kernels."""
    (x, w, dy), out = _run_all(shape, kernel, strides, dilations, pads, cout, np.float32)
    nchw = {"x": x.transpose(0, 3, 1, 2), "w": w.transpose(0, 3, 1, 2), "dy": dy.transpose(0, 3, 1, 2)}
    conv = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=list(kernel), strides=list(strides),
                            dilations=list(dilations), pads=list(pads))
    transpose = helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], strides=list(strides), dilations=list(dilations),
                                 pads=list(pads), output_shape=list(shape[1:3]))
    graph = helper.make_graph([conv, transpose], "nchw", [helper.make_tensor_value_info(k, 1, list(v.shape))
                                                          for k, v in nchw.items()],
                              [helper.make_tensor_value_info("y", 1, None), helper.make_tensor_value_info("dx", 1, None)])
    y, dx = make_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)).run(
        None, nchw)
    np.testing.assert_allclose(out["y"], y.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["dx"], dx.transpose(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


# (N, H, W, Cin), kernel, strides, dilations, pads, Cout, group: depthwise (group = Cin = Cout, as
# MobileNet's and PP-OCR's), a depthwise multiplier (Cout = 2 Cin), and grouped (4 groups)
GROUPED = [
    ((2, 7, 9, 8), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 8, 8),
    ((1, 9, 8, 16), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 16, 16),  # a strided depthwise 3x3
    ((1, 10, 11, 8), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), 8, 8),  # PP-OCR's 5x5
    ((2, 8, 7, 8), (3, 3), (1, 1), (2, 2), (2, 1, 2, 1), 8, 8),  # dilated, asymmetric pads
    ((1, 6, 7, 4), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 8, 4),  # 2 output channels per input channel
    ((2, 6, 6, 16), (3, 3), (1, 2), (1, 1), (1, 1, 1, 1), 32, 4),
    ((1, 5, 5, 12), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 6, 3),
]
GROUPED_IDS = ["dw3x3", "dw3x3-s2", "dw5x5", "dw-dilated-asym", "dw-multiplier", "g4-s12", "g3-1x1"]


def _grouped(shape, kernel, strides, dilations, pads, cout, group, dtype, bias: bool, seed=0):
    """ConvNhwc[group] (+ the bias Add over the last axis the layout pass writes) on the CPU
    provider: (x, w, b, y)."""
    rng = np.random.default_rng(seed)
    ho, wo = ref.output_hw(shape[1], shape[2], kernel, strides, dilations, pads)
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal((cout, *kernel, shape[3] // group)).astype(dtype)
    b = rng.standard_normal(cout).astype(dtype)
    made = [nodes.conv_nhwc("x", "w", output="c" if bias else "y", kernel_shape=kernel, strides=strides,
                            dilations=dilations, pads=pads, group=group, name="f")]
    feeds = {"x": x, "w": w}
    if bias:
        made.append(helper.make_node("Add", ["c", "b"], ["y"]))
        feeds["b"] = b
    graph = helper.make_graph(made, "grouped", [helper.make_tensor_value_info(k, TYPES[dtype], list(v.shape))
                                                for k, v in feeds.items()],
                              [helper.make_tensor_value_info("y", TYPES[dtype], [shape[0], ho, wo, cout])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return x, w, b, make_session(model).run(None, feeds)[0]


def _onnx_conv(x_nhwc, w_krsc, b, *, kernel, strides, dilations, pads, group):
    """ORT's own NCHW Conv (CPU, float32) of the same numbers, its output back to NHWC."""
    inputs = {"x": x_nhwc.transpose(0, 3, 1, 2).astype(np.float32), "w": w_krsc.transpose(0, 3, 1, 2).astype(np.float32)}
    if b is not None:
        inputs["b"] = b.astype(np.float32)
    conv = helper.make_node("Conv", list(inputs), ["y"], kernel_shape=list(kernel), strides=list(strides),
                            dilations=list(dilations), pads=list(pads), group=group)
    graph = helper.make_graph([conv], "nchw", [helper.make_tensor_value_info(k, 1, list(v.shape)) for k, v in inputs.items()],
                              [helper.make_tensor_value_info("y", 1, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    return make_session(model).run(None, inputs)[0].transpose(0, 2, 3, 1)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias-add"])
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 1e-5), (np.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kernel, strides, dilations, pads, cout, group", GROUPED, ids=GROUPED_IDS)
def test_grouped_matches_onnx_runtime_conv(shape, kernel, strides, dilations, pads, cout, group, dtype, rtol, bias):
    """ConvNhwc with ``group`` (and the bias as the layout pass writes it: an Add over the last
    axis) against ORT's NCHW Conv with ``group`` and its bias on the same numbers (transposed; the
    float16 ones widened to float32, so the float16 op differs by its one rounding), and against
    the float64 numpy reference."""
    attrs = {"strides": strides, "dilations": dilations, "pads": pads}
    x, w, b, y = _grouped(shape, kernel, strides, dilations, pads, cout, group, dtype, bias)
    assert y.dtype == dtype
    want = _onnx_conv(x, w, b if bias else None, kernel=kernel, group=group, **attrs)
    assert _close(y, want.astype(np.float64), rtol)
    numpy = ref.conv_nhwc(x, w, group=group, **attrs) + (b.astype(np.float64) if bias else 0.0)
    assert _close(y, numpy, rtol)


def test_grouped_reference_is_a_block_diagonal_conv():
    """The numpy reference's grouping (the tests' yardstick): a grouped convolution is the group-1
    convolution with a block-diagonal filter (zeros between the groups)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 5, 6, 12))
    w = rng.standard_normal((6, 3, 3, 4))
    dense = np.zeros((6, 3, 3, 12))
    for g in range(3):
        dense[2 * g:2 * g + 2, :, :, 4 * g:4 * g + 4] = w[2 * g:2 * g + 2]
    np.testing.assert_allclose(ref.conv_nhwc(x, w, pads=(1, 1, 1, 1), group=3), ref.conv_nhwc(x, dense, pads=(1, 1, 1, 1)))


def test_grouped_filter_and_gradient_groups_fail_clearly():
    node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=(3, 3), pads=(1, 1, 1, 1), group=4, name="f")
    x, w = np.zeros((1, 5, 5, 8), np.float32), np.zeros((8, 3, 3, 4), np.float32)  # wants [8, 3, 3, 2]
    with pytest.raises(Exception, match=r"w has shape \[8, 3, 3, 4\]; .* need \[Cout, 3, 3, 2\]"):
        make_session(_model(node, {"x": x, "w": w}, (1, 5, 5, 8), np.float32)).run(None, {"x": x, "w": w})
    x = np.zeros((1, 5, 5, 6), np.float32)
    with pytest.raises(Exception, match="group 4 must divide the input channels \\(6\\)"):
        make_session(_model(node, {"x": x, "w": w}, (1, 5, 5, 8), np.float32)).run(None, {"x": x, "w": w})
    grad = nodes.conv_nhwc_weight_grad("x", "dy", output="dw", kernel_shape=(3, 3), pads=(1, 1, 1, 1), name="g")
    grad.attribute.append(helper.make_attribute("group", 2))
    feeds = {"x": np.zeros((1, 5, 5, 8), np.float32), "dy": np.zeros((1, 5, 5, 8), np.float32)}
    with pytest.raises(Exception, match="group must be 1: the gradient ops"):
        make_session(_model(grad, feeds, (8, 3, 3, 8), np.float32)).run(None, feeds)
    with pytest.raises(ValueError, match="group must be a positive int"):
        nodes.conv_nhwc("x", "w", output="y", kernel_shape=(3, 3), group=0, name="f")


def test_same_bits_for_any_thread_count():
    case = ((3, 11, 10, 5), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 6)
    runs = [_run_all(*case, np.float32, threads=t)[1] for t in (1, 2, 4)]
    for key in ("y", "dx", "dw"):
        assert all(np.array_equal(r[key].view(np.uint32), runs[0][key].view(np.uint32)) for r in runs)


def test_undeclared_outputs_get_type_and_shape_from_the_ops():
    attrs = {"kernel_shape": (3, 3), "strides": (2, 2), "pads": (1, 1, 1, 1)}
    graph_nodes = [nodes.conv_nhwc("x", "w", output="y", name="f", **attrs),
                   nodes.conv_nhwc_data_grad("y", "w", output="dx", input_spatial=(8, 7), name="d", **attrs),
                   nodes.conv_nhwc_weight_grad("x", "y", output="dw", name="g", **attrs)]
    graph_nodes += [helper.make_node("Identity", [t], [t + "_out"]) for t in ("y", "dx", "dw")]
    graph = helper.make_graph(graph_nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8, 7, 3]),
                                                 helper.make_tensor_value_info("w", TensorProto.FLOAT16, [3, 3, 3, 3])],
                              [helper.make_tensor_value_info(t + "_out", TensorProto.FLOAT16, None) for t in ("y", "dx", "dw")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    feeds = {"x": RNG.standard_normal((2, 8, 7, 3)).astype(np.float16),
             "w": RNG.standard_normal((3, 3, 3, 3)).astype(np.float16)}
    y, dx, dw = make_session(model).run(None, feeds)
    assert (y.shape, dx.shape, dw.shape) == ((2, 4, 4, 3), (2, 8, 7, 3), (3, 3, 3, 3))
    assert y.dtype == dx.dtype == dw.dtype == np.float16


@pytest.mark.parametrize("w_shape, message", [((4, 3, 3, 2), "w has shape [4, 3, 3, 2]"),
                                              ((4, 2, 3, 3), "w has shape [4, 2, 3, 3]")])
def test_bad_filter_fails_clearly(w_shape, message):
    node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=(3, 3), pads=(1, 1, 1, 1), name="f")
    x, w = np.zeros((1, 5, 5, 3), np.float32), np.zeros(w_shape, np.float32)
    model = _model(node, {"x": x, "w": w}, (1, 5, 5, 4), np.float32)
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_session(model).run(None, {"x": x, "w": w})


def test_builders_refuse_bad_attributes():
    with pytest.raises(ValueError, match="ConvNhwc: strides must be 2 positive ints"):
        nodes.conv_nhwc("x", "w", output="y", kernel_shape=(3, 3), strides=(0, 1), name="f")
    with pytest.raises(ValueError, match="input_spatial must be 2 positive ints"):
        nodes.conv_nhwc_data_grad("dy", "w", output="dx", input_spatial=(4,), kernel_shape=(3, 3), name="d")


# ---- NchwToNhwc -----------------------------------------------------------------------------


def _to_nhwc_session(x_dtype, shape, to, channels=None, declare=True, threads=1):
    node = nodes.nchw_to_nhwc("x", output="y", to=to, channels=channels, name="t")
    out_shape = [shape[0], *shape[2:], channels or shape[1]]
    outputs = [helper.make_tensor_value_info("y", to, out_shape) if declare else onnx.ValueInfoProto(name="y")]
    graph = helper.make_graph([node], "to_nhwc", [helper.make_tensor_value_info("x", TYPES[x_dtype], list(shape))], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return make_session(model, intra_op_threads=threads)


@pytest.mark.parametrize("x_dtype, to, shape, channels", [
    (np.float32, TensorProto.FLOAT16, (2, 3, 5, 7), 4),   # the stem's image: cast, padded to 4
    (np.float32, TensorProto.FLOAT16, (2, 3, 4, 4), 8),
    (np.float32, TensorProto.FLOAT, (1, 3, 6, 2), None),  # a transpose alone
    (np.float16, TensorProto.FLOAT16, (4, 3, 7, 7), 4),   # a float16 filter [Cout, Cin, kh, kw] as KRSC
    (np.float16, TensorProto.FLOAT, (2, 2, 3, 2, 2), 3),  # rank 5: spatial dims in order
    (np.float32, TensorProto.FLOAT16, (0, 3, 4, 4), 4),   # an empty batch
])
def test_nchw_to_nhwc_matches_numpy_bit_for_bit(x_dtype, to, shape, channels):
    x = RNG.standard_normal(shape).astype(x_dtype) * 300
    if x.size:
        x.flat[:5] = [np.nan, np.inf, -0.0, 1e-7, 70000.0]  # NaN, inf, a signed zero, a subnormal, overflow
    for declare in (True, False):  # the output's type and shape inferred when not declared
        got = _to_nhwc_session(x_dtype, shape, to, channels, declare).run(None, {"x": x})[0]
        want = to_nhwc_ref.nchw_to_nhwc(x, to, channels)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_nchw_to_nhwc_same_bits_for_any_thread_count():
    x = RNG.standard_normal((3, 3, 64, 70)).astype(np.float32)
    runs = [_to_nhwc_session(np.float32, x.shape, TensorProto.FLOAT16, 4, threads=t).run(None, {"x": x})[0]
            for t in (1, 4)]
    np.testing.assert_array_equal(runs[0].view(np.uint16), runs[1].view(np.uint16))


def test_nchw_to_nhwc_refuses_bad_attributes_and_inputs():
    with pytest.raises(ValueError, match="to must be 1"):
        nodes.nchw_to_nhwc("x", output="y", to=7, name="t")
    with pytest.raises(ValueError, match="channels must be >= 1"):
        nodes.nchw_to_nhwc("x", output="y", to=10, channels=0, name="t")
    session = _to_nhwc_session(np.float32, (1, 5, 2, 2), TensorProto.FLOAT16, 4, declare=False)
    with pytest.raises(Exception, match="below x's 5 channels"):
        session.run(None, {"x": np.zeros((1, 5, 2, 2), np.float32)})


def test_the_python_side_knows_the_cuda_kernels_default_cudnn_api(monkeypatch):
    """``onnxcampo.ops.conv_nhwc.cudnn_api`` (what a plan prices) and conv_grad.cu's
    ``kGraphByDefault`` (what the kernels run) agree on the default; the variable overrides it."""
    import re
    from pathlib import Path

    from onnxcampo.ops import conv_nhwc

    source = (Path(conv_nhwc.__file__).resolve().parents[1] / "conv_grad" / "conv_grad.cu").read_text()
    (default,) = re.findall(r"constexpr bool kGraphByDefault = (true|false);", source)
    assert conv_nhwc.GRAPH_API_BY_DEFAULT is (default == "true")
    monkeypatch.delenv(conv_nhwc.CUDNN_API_VAR, raising=False)
    assert conv_nhwc.cudnn_api() == ("graph" if default == "true" else "legacy")
    for value in ("graph", "legacy"):
        monkeypatch.setenv(conv_nhwc.CUDNN_API_VAR, value)
        assert conv_nhwc.cudnn_api() == value
