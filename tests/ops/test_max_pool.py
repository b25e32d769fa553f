"""ai.onnxcampo::MaxPoolNhwc and MaxPoolNhwcGrad on the CPU (ORT's CPU provider runs the library's
reference kernels; tests/gpu/test_conv_nhwc_cuda.py checks the CUDA kernels the same way): y and
argmax exactly as the numpy reference (onnxcampo.ops.max_pool) in float32 and float16, ties and
NaNs included; dx as the float32 sum in the op's order, within rounding of the float64 reference;
against ORT's own NCHW MaxPool (y, and Indices + a scatter-add for the gradient); the same bits
for any thread count; output types and shapes when the model loads; clear errors."""

from __future__ import annotations

import re

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxcampo.ops import max_pool as ref
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session

pytestmark = pytest.mark.usefixtures("library")  # fails (never skips) without the built library
# (N, H, W, C), kernel, strides, pads
CASES = [
    ((2, 9, 11, 8), (3, 3), (2, 2), (1, 1, 1, 1)),  # ResNet's stem pool
    ((2, 8, 10, 8), (2, 2), (2, 2), (0, 0, 0, 0)),
    ((1, 7, 6, 8), (3, 3), (1, 1), (1, 1, 1, 1)),  # overlapping windows: up to 9 dy per dx
    ((2, 7, 9, 8), (3, 2), (2, 1), (2, 0, 1, 1)),  # asymmetric pads and strides
    ((2, 9, 11, 3), (3, 3), (2, 2), (1, 1, 1, 1)),  # C not a multiple of 8
    ((0, 5, 5, 8), (3, 3), (2, 2), (1, 1, 1, 1)),  # an empty batch
]
IDS = ["stem", "2x2-s2", "3x3-s1", "asym", "c3", "empty"]
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _attrs(kernel, strides, pads) -> dict:
    return {"kernel_shape": kernel, "strides": strides, "pads": pads}


def _model(graph_nodes, inputs: dict, outputs: dict):
    """inputs / outputs: name -> (ONNX type, shape or None)."""
    graph = helper.make_graph(graph_nodes, "max_pool",
                              [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                              [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _pool(x, kernel, strides, pads, threads=1):
    """(y, argmax) of one MaxPoolNhwc node on ORT's CPU provider."""
    node = nodes.max_pool_nhwc("x", output="y", argmax="argmax", name="pool", **_attrs(kernel, strides, pads))
    model = _model([node], {"x": (TYPES[x.dtype.type], list(x.shape))},
                   {"y": (TYPES[x.dtype.type], None), "argmax": (TensorProto.UINT8, None)})
    return tuple(make_session(model, intra_op_threads=threads).run(None, {"x": x}))


def _pool_grad(dy, argmax, spatial, kernel, strides, pads, threads=1):
    node = nodes.max_pool_nhwc_grad("dy", "argmax", output="dx", input_spatial=spatial, name="grad",
                                    **_attrs(kernel, strides, pads))
    model = _model([node], {"dy": (TYPES[dy.dtype.type], list(dy.shape)), "argmax": (TensorProto.UINT8, list(argmax.shape))},
                   {"dx": (TYPES[dy.dtype.type], None)})
    return make_session(model, intra_op_threads=threads).run(None, {"dy": dy, "argmax": argmax})[0]


def _gradient_seed(shape, dtype, rng):
    """float32: normal. float16: multiples of 2^-6 in [-16, 16), so that every sum of up to 9 of
    them is exact in float32 (and float64): the op's one rounding is then the reference's."""
    if dtype == np.float16:
        return (rng.integers(-1024, 1024, shape) / 64).astype(np.float16)
    return rng.standard_normal(shape).astype(dtype)


def _bits(a):
    return a.view(np.uint16 if a.dtype == np.float16 else np.uint32)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kernel, strides, pads", CASES, ids=IDS)
def test_matches_numpy(shape, kernel, strides, pads, dtype):
    """y and argmax exact; dx the op's float32 sums bit for bit (max_pool_nhwc_grad_float32), and
    within float32 rounding of the float64 reference (float16: the reference rounded once, exactly)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    y, argmax = _pool(x, kernel, strides, pads)
    want_y, want_argmax = ref.max_pool_nhwc(x, kernel, strides, pads)
    assert y.dtype == dtype and argmax.dtype == np.uint8
    assert np.array_equal(_bits(y), _bits(want_y)) and np.array_equal(argmax, want_argmax)

    dy = _gradient_seed(y.shape, dtype, rng)
    dx = _pool_grad(dy, argmax, shape[1:3], kernel, strides, pads)
    assert dx.dtype == dtype and dx.shape == shape
    assert np.array_equal(_bits(dx), _bits(ref.max_pool_nhwc_grad_float32(dy, argmax, shape[1:3], kernel, strides,
                                                                           pads)))
    want = ref.max_pool_nhwc_grad(dy, argmax, shape[1:3], kernel, strides, pads)
    if dtype == np.float16:
        assert np.array_equal(dx, want.astype(np.float16))
    else:  # at most 9 terms: 8 roundings of float32 sums
        np.testing.assert_allclose(dx, want, rtol=0, atol=9 * 8 * 2.0 ** -24 * np.abs(dy).max(initial=0.0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_ties_pick_the_first_maximum(dtype):
    """After a ReLU most windows hold several zeros (and small integers tie everywhere): argmax is
    the first of the equal taps in row-major order, and dx gets each dy once."""
    rng = np.random.default_rng(1)
    kernel, strides, pads = (3, 3), (2, 2), (1, 1, 1, 1)
    for x in (np.maximum(rng.standard_normal((2, 9, 11, 8)), 0).astype(dtype),
              rng.integers(0, 2, (2, 9, 11, 8)).astype(dtype), np.zeros((1, 5, 5, 8), dtype)):
        y, argmax = _pool(x, kernel, strides, pads)
        want_y, want_argmax = ref.max_pool_nhwc(x, kernel, strides, pads)
        assert np.array_equal(y, want_y) and np.array_equal(argmax, want_argmax)
        dy = _gradient_seed(y.shape, dtype, rng)
        dx = _pool_grad(dy, argmax, x.shape[1:3], kernel, strides, pads)
        want = ref.max_pool_nhwc_grad_float32(dy, argmax, x.shape[1:3], kernel, strides, pads)
        assert np.array_equal(_bits(dx), _bits(want))
    zeros = np.zeros((1, 5, 5, 8), dtype)  # every tap ties: the first one inside the input
    _, argmax = _pool(zeros, kernel, strides, pads)
    assert argmax[0, 0, 0, 0] == 4 and argmax[0, 1, 1, 0] == 0  # corner window: (1, 1); inner: (0, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_nan_and_infinities(dtype):
    """A NaN wins its window (the first NaN tap) and stays; -inf windows pick their first tap."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 9, 11, 8)).astype(dtype)
    x[0, 2, 3, :3] = np.nan
    x[0, 2, 4, :2] = np.nan
    x[1, :4, :4, 5] = -np.inf
    x[1, 5, 5, 6] = np.inf
    y, argmax = _pool(x, (3, 3), (2, 2), (1, 1, 1, 1))
    want_y, want_argmax = ref.max_pool_nhwc(x, (3, 3), (2, 2), (1, 1, 1, 1))
    assert np.array_equal(y, want_y, equal_nan=True) and np.array_equal(argmax, want_argmax)
    # (2, 3) is tap (1, 2) of window (1, 1); (2, 3) and (2, 4) are taps (1, 0) and (1, 1) of window (1, 2)
    assert np.isnan(y[0, 1, 1:3, :3]).all() and argmax[0, 1, 1, 0] == 5 and (argmax[0, 1, 2, :3] == 3).all()
    assert np.isneginf(y[1, :2, :2, 5]).all() and argmax[1, 0, 0, 5] == 4 and argmax[1, 1, 1, 5] == 0
    assert np.isposinf(y[1, 2:4, 2:4, 6]).all() and argmax[1, 2, 2, 6] == 8 and argmax[1, 3, 3, 6] == 0


@pytest.mark.parametrize("shape, kernel, strides, pads", CASES[:4], ids=IDS[:4])
def test_matches_onnx_runtime_max_pool(shape, kernel, strides, pads):
    """ORT's own NCHW MaxPool on the transposed input: the same y, and its Indices scatter-added
    (what onnx-ad's MaxPool adjoint computes) give the same dx (distinct values: no ties)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    y, argmax = _pool(x, kernel, strides, pads)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = _pool_grad(dy, argmax, shape[1:3], kernel, strides, pads)

    pool = helper.make_node("MaxPool", ["x"], ["y", "indices"], kernel_shape=list(kernel), strides=list(strides),
                            pads=list(pads))
    nchw = x.transpose(0, 3, 1, 2).copy()
    model = _model([pool], {"x": (TensorProto.FLOAT, list(nchw.shape))},
                   {"y": (TensorProto.FLOAT, None), "indices": (TensorProto.INT64, None)})
    y_nchw, indices = make_session(model).run(None, {"x": nchw})
    np.testing.assert_array_equal(y, y_nchw.transpose(0, 2, 3, 1))
    scattered = np.zeros(nchw.size, np.float64)
    np.add.at(scattered, indices.ravel(), dy.transpose(0, 3, 1, 2).astype(np.float64).ravel())
    np.testing.assert_allclose(dx, scattered.reshape(nchw.shape).transpose(0, 2, 3, 1), rtol=1e-6, atol=1e-6)


def test_same_bits_for_any_thread_count():
    rng = np.random.default_rng(4)
    kernel, strides, pads = (3, 3), (2, 2), (1, 1, 1, 1)
    for dtype in (np.float32, np.float16):
        x = np.maximum(rng.standard_normal((3, 23, 21, 16)), 0).astype(dtype)
        runs = [_pool(x, kernel, strides, pads, threads=t) for t in (1, 4)]
        assert all(np.array_equal(_bits(r[0]), _bits(runs[0][0])) and np.array_equal(r[1], runs[0][1]) for r in runs)
        dy = rng.standard_normal(runs[0][0].shape).astype(dtype)
        grads = [_pool_grad(dy, runs[0][1], x.shape[1:3], kernel, strides, pads, threads=t) for t in (1, 4)]
        assert np.array_equal(_bits(grads[0]), _bits(grads[1]))


def test_output_types_and_shapes_when_the_model_loads():
    """y and dx take x's and dy's type and shape (a symbolic batch kept), argmax is uint8 (its
    shape is known at run time only: ORT does not tell the op whether the node lists it)."""
    attrs = _attrs((3, 3), (2, 2), (1, 1, 1, 1))
    graph_nodes = [nodes.max_pool_nhwc("x", output="y", argmax="argmax", name="pool", **attrs),
                   nodes.max_pool_nhwc_grad("y", "argmax", output="dx", input_spatial=(9, 11), name="grad", **attrs)]
    graph_nodes += [helper.make_node("Identity", [t], [t + "_out"]) for t in ("y", "argmax", "dx")]
    for batch in (2, "N"):
        model = _model(graph_nodes, {"x": (TensorProto.FLOAT16, [batch, 9, 11, 8])},
                       {"y_out": (TensorProto.FLOAT16, None), "argmax_out": (TensorProto.UINT8, None),
                        "dx_out": (TensorProto.FLOAT16, None)})
        session = make_session(model)
        declared = {o.name: (o.type, o.shape) for o in session.get_outputs()}
        assert declared["y_out"] == ("tensor(float16)", [batch, 5, 6, 8])
        assert declared["dx_out"] == ("tensor(float16)", [batch, 9, 11, 8])
        assert declared["argmax_out"][0] == "tensor(uint8)"
    x = np.random.default_rng(5).standard_normal((2, 9, 11, 8)).astype(np.float16)
    y, argmax, dx = session.run(None, {"x": x})
    assert (y.dtype, argmax.dtype, dx.dtype) == (np.float16, np.uint8, np.float16)
    assert y.shape == argmax.shape == (2, 5, 6, 8) and dx.shape == x.shape


def test_onnxcampo_types_argmax_uint8():
    """onnxcampo's own inference (no schema for the ops): y and dx follow the pooled type, argmax is
    uint8 (oplists.custom_fixed_types), and the precision passes never retype it."""
    from onnxcampo.ir.shapes import infer_tensor_info
    from onnxcampo.signature import Slot, signature

    attrs = _attrs((3, 3), (2, 2), (1, 1, 1, 1))
    graph_nodes = [nodes.max_pool_nhwc("x", output="y", argmax="argmax", name="pool", **attrs),
                   nodes.max_pool_nhwc_grad("y", "argmax", output="dx", input_spatial=(9, 11), name="grad", **attrs)]
    model = _model(graph_nodes, {"x": (TensorProto.FLOAT16, [2, 9, 11, 8])}, {"dx": (TensorProto.FLOAT16, None)})
    info, _ = infer_tensor_info(model)
    assert (info["y"].dtype, info["argmax"].dtype, info["dx"].dtype) == (TensorProto.FLOAT16, TensorProto.UINT8,
                                                                         TensorProto.FLOAT16)
    assert signature("MaxPoolNhwc", "ai.onnxcampo", 17, 1, 2).outputs == (Slot.FOLLOW, Slot.FIXED)
    assert signature("MaxPoolNhwcGrad", "ai.onnxcampo", 17, 2, 1).inputs == (Slot.FOLLOW, Slot.FIXED)


@pytest.mark.parametrize("outputs", [["y"], ["y", ""]], ids=["y-only", "empty-argmax-name"])
def test_argmax_output_is_optional(outputs):
    x = np.random.default_rng(6).standard_normal((2, 9, 11, 8)).astype(np.float32)
    node = helper.make_node("MaxPoolNhwc", ["x"], outputs, domain="ai.onnxcampo", kernel_shape=[3, 3],
                            strides=[2, 2], pads=[1, 1, 1, 1])
    model = _model([node], {"x": (TensorProto.FLOAT, list(x.shape))}, {"y": (TensorProto.FLOAT, None)})
    (y,) = make_session(model).run(None, {"x": x})
    assert np.array_equal(y, ref.max_pool_nhwc(x, (3, 3), (2, 2), (1, 1, 1, 1))[0])


@pytest.mark.parametrize("attributes, message", [
    ({"kernel_shape": [3, 3], "pads": [3, 1, 1, 1]}, "pads [3, 1, 1, 1] must each be below the kernel size"),
    ({"kernel_shape": [16, 16]}, "has more than 255 taps"),
    ({"kernel_shape": [3, 3], "strides": [0, 1]}, "strides must be 2 positive ints"),
    ({"strides": [2, 2]}, "attribute kernel_shape [kh, kw] is required"),
    ({"kernel_shape": [3, 3], "dilations": [2, 2]}, "dilations are not supported"),
    ({"kernel_shape": [9, 3]}, "kernel_shape 9 x 3 exceeds the padded input 5 x 5"),
])
def test_bad_attributes_fail_clearly(attributes, message):
    """Nodes written without the builders: the kernel refuses them when the session is made (or,
    for a kernel larger than the input, when it runs), naming the node."""
    x = np.zeros((1, 5, 5, 8), np.float32)
    node = helper.make_node("MaxPoolNhwc", ["x"], ["y"], domain="ai.onnxcampo", name="p", **attributes)
    model = _model([node], {"x": (TensorProto.FLOAT, list(x.shape))}, {"y": (TensorProto.FLOAT, None)})
    with pytest.raises(Exception, match=re.escape(message)):
        make_session(model).run(None, {"x": x})


def test_gradient_checks_its_inputs():
    dy, argmax = np.zeros((1, 3, 3, 8), np.float32), np.zeros((1, 3, 3, 8), np.uint8)
    with pytest.raises(Exception, match=re.escape("MaxPoolNhwcGrad node 'grad': dy has shape [1, 3, 3, 8]; "
                                                  "input_spatial [9, 11] and the attributes give [1, 5, 6, C]")):
        _pool_grad(dy, argmax, (9, 11), (3, 3), (2, 2), (1, 1, 1, 1))
    with pytest.raises(Exception, match=re.escape("argmax has shape [1, 3, 2, 8], dy [1, 3, 3, 8]")):
        _pool_grad(dy, argmax[:, :, :2].copy(), (5, 5), (3, 3), (2, 2), (1, 1, 1, 1))
    node = helper.make_node("MaxPoolNhwcGrad", ["dy", "argmax"], ["dx"], domain="ai.onnxcampo", name="g",
                            kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    model = _model([node], {"dy": (TensorProto.FLOAT, [1, 3, 3, 8]), "argmax": (TensorProto.UINT8, [1, 3, 3, 8])},
                   {"dx": (TensorProto.FLOAT, None)})
    with pytest.raises(Exception, match="input_spatial must be 2 positive ints"):
        make_session(model).run(None, {"dy": dy, "argmax": argmax})


def test_builders_refuse_bad_attributes():
    with pytest.raises(ValueError, match=re.escape("MaxPoolNhwc: pads [1, 3, 1, 1] must each be below the kernel")):
        nodes.max_pool_nhwc("x", output="y", kernel_shape=(3, 3), pads=(1, 3, 1, 1), name="p")
    with pytest.raises(ValueError, match="has 256 taps; at most 255"):
        nodes.max_pool_nhwc("x", output="y", kernel_shape=(16, 16), name="p")
    with pytest.raises(ValueError, match="MaxPoolNhwcGrad: strides must be 2 positive ints"):
        nodes.max_pool_nhwc_grad("dy", "a", output="dx", input_spatial=(4, 4), kernel_shape=(2, 2), strides=(1,), name="g")
    with pytest.raises(ValueError, match="input_spatial must be 2 positive ints"):
        nodes.max_pool_nhwc_grad("dy", "a", output="dx", input_spatial=(4, 0), kernel_shape=(2, 2), name="g")
    node = nodes.max_pool_nhwc("x", output="y", argmax="a", kernel_shape=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1),
                               name="p")
    assert list(node.output) == ["y", "a"] and node.domain == "ai.onnxcampo"
    assert list(nodes.max_pool_nhwc("x", output="y", kernel_shape=(2, 2), name="q").output) == ["y"]
