"""The channels-last ops on CUDA (tests/gpu/conftest.py: skipped without a GPU): ``ConvNhwc``,
``ConvNhwcDataGrad``, ``ConvNhwcWeightGrad`` (cuDNN, NHWC tensors, KRSC filters), ``MaxPoolNhwc``,
``MaxPoolNhwcGrad`` and ``NchwToNhwc``, against the numpy references (``onnxcampo.ops.conv_nhwc``,
``onnxcampo.ops.max_pool``) and the NCHW ops a step graph runs otherwise.

1. Convolutions, small shapes (strides, dilation, 1x1, 7x7, odd sizes), float32 and float16: the
   three ops against numpy within ``RTOL`` of the largest value; grouped and depthwise ConvNhwc
   (``group``: a KRSC filter of Cin / group channels) against numpy and the CPU kernel. Each with
   cuDNN's graph API (the default) and its legacy calls (``ONNXCAMPO_CUDNN_API=legacy``), and each
   way's host time per call on a chain of 96 small convolutions (plain minus replayed), recorded;
   ResNet-50 b64's forward convolutions run node by node with each API beside ORT's NCHW Conv.
2. MobileNetV3 / PP-OCR depthwise shapes (float16, batch 1 and 8): ConvNhwc[group] against ORT's
   NCHW Conv[group] on the same numbers, both replayed as CUDA graphs and timed side by side.
3. ResNet-50 b64's convolution shapes (float16, the stem aside: it stays NCHW): the three NHWC ops
   against ORT's Conv, ConvTranspose and the library's NCHW ConvWeightGrad, a CUDA-graph replay
   bit for bit the plain run; both triples replayed and timed (the step's count of the shape is
   recorded with the figures).
4. Max pooling, small shapes (the stem's pool, 2x2 stride 2, 3x3 stride 1, asymmetric pads, 3
   channels, an empty batch) and ResNet-50 b64's stem pool after a ReLU (many ties): y and argmax
   exact, dx bit for bit the float32 sums in the op's order, a replay bit for bit the plain run;
   the stem pool timed against ORT's NCHW MaxPool with Indices and against that MaxPool plus
   onnx-ad's adjoint (float32 zeros, dy cast, ScatterND add), all replayed.
5. NchwToNhwc on a stem's image and filter and odd shapes (float32 / float16 in and out, channels
   padded or not, NaN, inf, signed zeros, subnormals, float16 overflow among the values): bit for
   bit numpy's, plain and replayed; ResNet-50 b64's image against ORT's Transpose, Cast and Pad,
   the same bits, timed.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cases.im2col import RESNET50_B64, close, resnet_cout
from onnxcampo.ops import conv_nhwc as ref
from onnxcampo.ops import to_nhwc as to_nhwc_ref
from onnxcampo.ops import max_pool as pool_ref
from onnxcampo.ops import nodes

RTOL = 4e-3
TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
         np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64}
DTYPES = [np.float32, np.float16]
DTYPE_IDS = ["fp32", "fp16"]

# (N, H, W, Cin), kernel, strides, dilations, pads, Cout
SMALL = [((2, 9, 11, 3), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 5), ((2, 8, 8, 8), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 16),
         ((1, 8, 7, 16), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 8), ((2, 9, 9, 8), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3), 8),
         ((1, 11, 10, 8), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2), 24), ((3, 5, 6, 32), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 64)]
SMALL_IDS = ["3x3", "3x3-s2", "1x1-s2", "7x7-s2", "dilated", "1x1-c32"]
# grouped forward cases: (N, H, W, Cin), kernel, strides, dilations, pads, Cout, group
GROUPED = [((2, 9, 11, 16), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 16, 16),
           ((1, 16, 15, 32), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 32, 32),
           ((2, 10, 12, 24), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), 24, 24),
           ((1, 11, 10, 8), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2), 8, 8),
           ((2, 8, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 16, 8),  # 2 output channels per input channel
           ((3, 7, 9, 32), (3, 3), (2, 1), (1, 1), (1, 1, 1, 1), 64, 4),
           ((1, 6, 6, 48), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 24, 3)]
GROUPED_IDS = ["dw3x3", "dw3x3-s2", "dw5x5", "dw-dilated", "dw-multiplier", "g4-s21", "g3-1x1"]
# depthwise shapes of MobileNetV3-small (PP-OCR cls) and PP-LCNet (PP-OCRv4 det/rec): (label,
# NCHW input, kernel, strides, pads)
DEPTHWISE = [("c16 112x112 k3 s2", (16, 112, 112), (3, 3), (2, 2), (1, 1, 1, 1)),
             ("c72 56x56 k3 s2", (72, 56, 56), (3, 3), (2, 2), (1, 1, 1, 1)),
             ("c88 28x28 k3", (88, 28, 28), (3, 3), (1, 1), (1, 1, 1, 1)),
             ("c96 28x28 k5 s2", (96, 28, 28), (5, 5), (2, 2), (2, 2, 2, 2)),
             ("c240 14x14 k5", (240, 14, 14), (5, 5), (1, 1), (2, 2, 2, 2)),
             ("c576 7x7 k5", (576, 7, 7), (5, 5), (1, 1), (2, 2, 2, 2)),
             ("c64 80x80 k3", (64, 80, 80), (3, 3), (1, 1), (1, 1, 1, 1)),
             ("c256 20x20 k5", (256, 20, 20), (5, 5), (1, 1), (2, 2, 2, 2))]
# ResNet-50 b64 less the stem: (label, NCHW input shape, kernel, strides, pads, Cout, count)
RESNET = {label.replace(" ", "-"): (shape, kernel, stride, pads, resnet_cout(shape, kernel, stride), count)
          for label, shape, kernel, stride, pads, count in RESNET50_B64 if shape[1] % 8 == 0}


def _model(graph_nodes, inputs: dict, outputs: dict, initializers=()) -> onnx.ModelProto:
    """inputs / outputs: name -> (shape, numpy dtype)."""
    graph = helper.make_graph(graph_nodes, "g",
                              [helper.make_tensor_value_info(k, TYPES[np.dtype(t)], list(s)) for k, (s, t) in inputs.items()],
                              [helper.make_tensor_value_info(k, TYPES[np.dtype(t)], list(s)) for k, (s, t) in outputs.items()],
                              list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _random(rng, shapes: dict, dtype, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: (scale * rng.standard_normal(v)).astype(dtype) for k, v in shapes.items()}


def _to_nhwc(array: np.ndarray) -> np.ndarray:
    return array.transpose(0, 2, 3, 1).copy()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same_bits(got: dict, want: dict) -> list[str]:
    """The names whose arrays differ in shape, type or bits."""
    return [k for k in want if got[k].shape != want[k].shape or got[k].dtype != want[k].dtype
            or not np.array_equal(_bits(got[k]), _bits(want[k]))]


# ---- convolutions --------------------------------------------------------------------------------


def nhwc_model(x_shape, kernel, strides, dilations, pads, cout, dtype):
    """y = ConvNhwc(x, w); dx = ConvNhwcDataGrad(dy, w); dw = ConvNhwcWeightGrad(x, dy): the model
    and its input shapes."""
    n, h, w, cin = x_shape
    ho, wo = ref.output_hw(h, w, kernel, strides, dilations, pads)
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads}
    made = [nodes.conv_nhwc("x", "w", output="y", name="f", **attrs),
            nodes.conv_nhwc_data_grad("dy", "w", output="dx", input_spatial=(h, w), name="d", **attrs),
            nodes.conv_nhwc_weight_grad("x", "dy", output="dw", name="g", **attrs)]
    shapes = {"x": x_shape, "w": (cout, *kernel, cin), "dy": (n, ho, wo, cout)}
    outputs = {"y": (n, ho, wo, cout), "dx": x_shape, "dw": (cout, *kernel, cin)}
    return _model(made, {k: (v, dtype) for k, v in shapes.items()}, {k: (v, dtype) for k, v in outputs.items()}), shapes


def nchw_model(x_shape, kernel, strides, pads, cout, dtype):
    """The same three in NCHW as a step graph had them: Conv, ConvTranspose, ConvWeightGrad."""
    n, cin, h, w = x_shape
    ho, wo = ref.output_hw(h, w, kernel, strides, (1, 1), pads)
    made = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=list(kernel), strides=list(strides), pads=list(pads)),
            helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], strides=list(strides), pads=list(pads),
                             output_shape=[h, w]),
            nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=kernel, strides=strides, pads=pads, name="g")]
    shapes = {"x": x_shape, "w": (cout, cin, *kernel), "dy": (n, cout, ho, wo)}
    outputs = {"y": (n, cout, ho, wo), "dx": x_shape, "dw": (cout, cin, *kernel)}
    return _model(made, {k: (v, dtype) for k, v in shapes.items()}, {k: (v, dtype) for k, v in outputs.items()}), shapes


APIS = ["graph", "legacy"]  # ONNXCAMPO_CUDNN_API: how the CUDA kernels call cuDNN (conv_grad.cu)


@pytest.fixture(params=APIS)
def cudnn_api(request, monkeypatch):
    """The cuDNN API the CUDA kernels plan new shapes with (read on each call: a shape planned both
    ways has a plan of each)."""
    monkeypatch.setenv("ONNXCAMPO_CUDNN_API", request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("x_shape, kernel, strides, dilations, pads, cout", SMALL, ids=SMALL_IDS)
def test_the_three_convolutions_match_numpy(device, cudnn_api, x_shape, kernel, strides, dilations, pads, cout, dtype):
    model, shapes = nhwc_model(x_shape, kernel, strides, dilations, pads, cout, dtype)
    feeds = _random(np.random.default_rng(cout), shapes, dtype)
    got = device.run(model, feeds)
    attrs = {"strides": strides, "dilations": dilations, "pads": pads}
    want = {"y": ref.conv_nhwc(feeds["x"], feeds["w"], **attrs),
            "dx": ref.conv_nhwc_data_grad(feeds["dy"], feeds["w"], x_shape[1:3], **attrs),
            "dw": ref.conv_nhwc_weight_grad(feeds["x"], feeds["dy"], kernel, **attrs)}
    parts = {k: close(got[k], want[k], RTOL) for k in want}
    assert all(p["ok"] for p in parts.values()), parts


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("x_shape, kernel, strides, dilations, pads, cout, group", GROUPED, ids=GROUPED_IDS)
def test_grouped_and_depthwise_conv_matches_numpy_and_the_cpu_kernel(device, cudnn_api, x_shape, kernel, strides,
                                                                      dilations, pads, cout, group, dtype):
    n, h, w, cin = x_shape
    ho, wo = ref.output_hw(h, w, kernel, strides, dilations, pads)
    attrs = {"strides": strides, "dilations": dilations, "pads": pads}
    node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=kernel, group=group, name="f", **attrs)
    shapes = {"x": x_shape, "w": (cout, *kernel, cin // group)}
    model = _model([node], {k: (v, dtype) for k, v in shapes.items()}, {"y": ((n, ho, wo, cout), dtype)})
    feeds = _random(np.random.default_rng(cout + group), shapes, dtype)
    got = device.run(model, feeds)["y"]
    vs_numpy = close(got, ref.conv_nhwc(feeds["x"], feeds["w"], group=group, **attrs), RTOL)
    vs_cpu = close(got, device.cpu(model, feeds)["y"].astype(np.float64), RTOL)
    assert vs_numpy["ok"] and vs_cpu["ok"], {"vs_numpy": vs_numpy, "vs_cpu": vs_cpu}


def test_host_time_per_call_with_each_cudnn_api(device, results, cudnn_api):
    """96 float16 1x1 ConvNhwc calls on [1, 8, 8, 8] one after another (the cost database's host
    probe, ``costdb.calibrate``): run plainly and replayed; (plain - replayed) / 96 is the host
    time of a call, recorded for each API. The outputs of both runs agree."""
    from onnxcampo.costdb.calibrate import HOST_CHAIN, _chain_model

    model, feeds = _chain_model("conv_nhwc", HOST_CHAIN)
    runners = {"plain": device.bound(model, feeds), "replayed": device.bound(model, feeds, cuda_graph=True)}
    for runner in runners.values():
        runner()
        runner()
    assert not _same_bits(runners["replayed"].outputs(), runners["plain"].outputs())
    timing = device.time(runners)
    us = {k: timing[k]["ms"] * 1e3 for k in runners}
    assert all(v > 0 for v in us.values()), timing
    results.record(api=cudnn_api, launches=HOST_CHAIN, plain_us=us["plain"], replayed_us=us["replayed"],
                   us_per_call=max(us["plain"] - us["replayed"], 0.0) / HOST_CHAIN, timing=timing)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("label, chw, kernel, strides, pads", DEPTHWISE, ids=[d[0].replace(" ", "-") for d in DEPTHWISE])
def test_depthwise_against_ort_nchw_conv_replayed_and_timed(device, results, label, chw, kernel, strides, pads, n):
    """ConvNhwc[group = C] against ORT's Conv[group = C] (float16): whether cuDNN's NHWC depthwise
    kernels keep up with its NCHW ones (the layout pass converts depthwise convolutions too)."""
    c, h, w = chw
    ho, wo = ref.output_hw(h, w, kernel, strides, (1, 1), pads)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=list(kernel), strides=list(strides), pads=list(pads),
                            group=c)
    f16 = np.float16
    plain = _model([conv], {"x": ((n, c, h, w), f16), "w": ((c, 1, *kernel), f16)}, {"y": ((n, c, ho, wo), f16)})
    node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=kernel, strides=strides, pads=pads, group=c, name="f")
    channels_last = _model([node], {"x": ((n, h, w, c), f16), "w": ((c, *kernel, 1), f16)}, {"y": ((n, ho, wo, c), f16)})
    feeds = _random(np.random.default_rng(c * n), {"x": (n, c, h, w), "w": (c, 1, *kernel)}, f16, 0.5)
    runners = {"nchw": device.bound(plain, feeds, cuda_graph=True),
               "nhwc": device.bound(channels_last, {k: _to_nhwc(v) for k, v in feeds.items()}, cuda_graph=True)}
    for runner in runners.values():
        runner()
    part = close(runners["nhwc"].outputs()["y"].transpose(0, 3, 1, 2),
                 runners["nchw"].outputs()["y"].astype(np.float64), 1e-2)
    assert part["ok"], part
    results.record(shape=f"n{n} {label}", y=part, timing=device.time(runners))


def _resnet_runners(device, key, cuda_graph):
    shape, kernel, strides, pads, cout, _ = RESNET[key]
    n, cin, h, w = shape
    plain, shapes = nchw_model(shape, kernel, strides, pads, cout, np.float16)
    channels_last, _ = nhwc_model((n, h, w, cin), kernel, strides, (1, 1), pads, cout, np.float16)
    feeds = _random(np.random.default_rng(cin + cout), shapes, np.float16, 0.5)
    return {"nchw": device.bound(plain, feeds, cuda_graph=cuda_graph),
            "nhwc": device.bound(channels_last, {k: _to_nhwc(v) for k, v in feeds.items()}, cuda_graph=cuda_graph)}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_resnet50_convolutions_match_the_nchw_ops_and_replay(device, key):
    runners = _resnet_runners(device, key, cuda_graph=False)
    for runner in runners.values():
        runner()
    got, want = runners["nhwc"].outputs(), runners["nchw"].outputs()
    parts = {k: close(got[k].transpose(0, 3, 1, 2), want[k].astype(np.float64), 1e-2) for k in want}
    assert all(p["ok"] for p in parts.values()), parts
    replayed = _resnet_runners(device, key, cuda_graph=True)["nhwc"]
    for _ in range(4):  # the capture, then replays
        replayed()
    assert not _same_bits(replayed.outputs(), got)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_resnet50_convolutions_timed_nchw_against_nhwc(device, results, key):
    """Forward, input gradient and weight gradient of one convolution, both layouts replayed."""
    shape, kernel, strides, pads, cout, count = RESNET[key]
    results.record(x=list(shape), cout=cout, count=count, timing=device.time(_resnet_runners(device, key, True)))


def _resnet_forward_models():
    """ResNet-50 b64's 52 forward convolutions less the stem (each shape as many times as the network
    has it, one input per shape), float16: ConvNhwc and ORT's NCHW Conv; the models, their feeds."""
    nhwc_nodes, nchw_nodes, nhwc_io, nchw_io, inits_nhwc, inits_nchw, outputs = [], [], {}, {}, [], [], {}
    rng = np.random.default_rng(50)
    feeds_nchw = {}
    for k, (key, (shape, kernel, strides, pads, cout, count)) in enumerate(RESNET.items()):
        n, cin, h, w = shape
        ho, wo = ref.output_hw(h, w, kernel, strides, (1, 1), pads)
        feeds_nchw[f"x{k}"] = (0.5 * rng.standard_normal(shape)).astype(np.float16)
        weight = (0.05 * rng.standard_normal((cout, cin, *kernel))).astype(np.float16)
        inits_nchw.append(onnx.numpy_helper.from_array(weight, f"w{k}"))
        inits_nhwc.append(onnx.numpy_helper.from_array(weight.transpose(0, 2, 3, 1).copy(), f"w{k}"))
        for r in range(count):
            nchw_nodes.append(helper.make_node("Conv", [f"x{k}", f"w{k}"], [f"y{k}_{r}"], kernel_shape=list(kernel),
                                               strides=list(strides), pads=list(pads)))
            nhwc_nodes.append(nodes.conv_nhwc(f"x{k}", f"w{k}", output=f"y{k}_{r}", kernel_shape=kernel,
                                              strides=strides, pads=pads, name=f"c{k}_{r}"))
            outputs[f"y{k}_{r}"] = ((n, cout, ho, wo), (n, ho, wo, cout))
        nchw_io[f"x{k}"] = (shape, np.float16)
        nhwc_io[f"x{k}"] = ((n, h, w, cin), np.float16)
    nchw = _model(nchw_nodes, nchw_io, {k: (v[0], np.float16) for k, v in outputs.items()}, inits_nchw)
    nhwc = _model(nhwc_nodes, nhwc_io, {k: (v[1], np.float16) for k, v in outputs.items()}, inits_nhwc)
    return nchw, nhwc, feeds_nchw


@pytest.mark.slow
def test_resnet50_forward_convolutions_run_plainly_with_each_cudnn_api(device, results, monkeypatch):
    """The network's forward convolutions run node by node (not replayed: each call's host time
    counts), ConvNhwc with cuDNN's legacy calls and with its graph API, beside ORT's NCHW Conv:
    the three agree, and their times are recorded side by side."""
    nchw, nhwc, feeds = _resnet_forward_models()
    nhwc_feeds = {k: _to_nhwc(v) for k, v in feeds.items()}
    runners = {"ort-nchw": device.bound(nchw, feeds)}
    for api in APIS:
        monkeypatch.setenv("ONNXCAMPO_CUDNN_API", api)  # read when the session makes its kernels
        runners[f"nhwc-{api}"] = device.bound(nhwc, nhwc_feeds)
    for runner in runners.values():
        runner()
    want = runners["ort-nchw"].outputs()
    for api in APIS:
        got = runners[f"nhwc-{api}"].outputs()
        parts = {k: close(got[k].transpose(0, 3, 1, 2), want[k].astype(np.float64), 1e-2) for k in want}
        assert all(part["ok"] for part in parts.values()), (api, {k: v for k, v in parts.items() if not v["ok"]})
    results.record(convolutions=len(want), timing=device.time(runners, rounds=5))


# ---- max pooling ---------------------------------------------------------------------------------

# (N, H, W, C), kernel, strides, pads (tests/ops/test_max_pool.py's cases)
POOLS = [((2, 9, 11, 8), (3, 3), (2, 2), (1, 1, 1, 1)), ((2, 8, 10, 8), (2, 2), (2, 2), (0, 0, 0, 0)),
         ((1, 7, 6, 8), (3, 3), (1, 1), (1, 1, 1, 1)), ((2, 7, 9, 8), (3, 2), (2, 1), (2, 0, 1, 1)),
         ((2, 9, 11, 3), (3, 3), (2, 2), (1, 1, 1, 1)), ((0, 5, 5, 8), (3, 3), (2, 2), (1, 1, 1, 1))]
POOL_IDS = ["stem", "2x2-s2", "3x3-s1", "asym", "c3", "empty"]
STEM = ((64, 112, 112, 64), (3, 3), (2, 2), (1, 1, 1, 1))  # ResNet-50 b64's stem pool


def pool_model(x_shape, kernel, strides, pads, dtype) -> onnx.ModelProto:
    """(y, argmax) = MaxPoolNhwc(x); dx = MaxPoolNhwcGrad(dy, argmax): the forward's argmax feeds
    the gradient, as in a step graph."""
    n, h, w, c = x_shape
    y_shape = (n, *pool_ref.pool_output_hw(h, w, kernel, strides, pads), c)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads}
    made = [nodes.max_pool_nhwc("x", output="y", argmax="argmax", name="pool", **attrs),
            nodes.max_pool_nhwc_grad("dy", "argmax", output="dx", input_spatial=(h, w), name="grad", **attrs)]
    return _model(made, {"x": (x_shape, dtype), "dy": (y_shape, dtype)},
                  {"y": (y_shape, dtype), "argmax": (y_shape, np.uint8), "dx": (x_shape, dtype)})


def pool_feeds(x_shape, kernel, strides, pads, dtype, rng, relu=False) -> dict[str, np.ndarray]:
    x = rng.standard_normal(x_shape).astype(dtype)
    if relu:
        x = np.maximum(x, 0).astype(dtype)
    n, h, w, c = x_shape
    return {"x": x, "dy": rng.standard_normal((n, *pool_ref.pool_output_hw(h, w, kernel, strides, pads), c)).astype(dtype)}


def _pool_against_numpy(device, x_shape, kernel, strides, pads, dtype, feeds) -> None:
    model = pool_model(x_shape, kernel, strides, pads, dtype)
    got = device.run(model, feeds)
    want_y, want_argmax = pool_ref.max_pool_nhwc(feeds["x"], kernel, strides, pads)
    # the gradient reads the op's own argmax: the numpy gradient of the same selection
    want_dx = pool_ref.max_pool_nhwc_grad_float32(feeds["dy"], got["argmax"], x_shape[1:3], kernel, strides, pads)
    assert not _same_bits(got, {"y": want_y, "argmax": want_argmax, "dx": want_dx})
    if device.cuda:
        assert not _same_bits(device.run(model, feeds, cuda_graph=True), got), "the replay differs from the plain run"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("x_shape, kernel, strides, pads", POOLS, ids=POOL_IDS)
def test_max_pool_and_its_gradient_match_numpy_and_replay(device, x_shape, kernel, strides, pads, dtype):
    feeds = pool_feeds(x_shape, kernel, strides, pads, dtype, np.random.default_rng(sum(x_shape)))
    _pool_against_numpy(device, x_shape, kernel, strides, pads, dtype, feeds)


@pytest.mark.slow
def test_the_resnet50_stem_pool_matches_numpy_and_replays(device):
    x_shape, kernel, strides, pads = STEM
    feeds = pool_feeds(x_shape, kernel, strides, pads, np.float16, np.random.default_rng(0), relu=True)
    _pool_against_numpy(device, x_shape, kernel, strides, pads, np.float16, feeds)


def nchw_pool_models(x_shape, kernel, strides, pads):
    """float16 NCHW models of x [N, C, H, W]: ORT's MaxPool with Indices (the forward), and that
    MaxPool plus onnx-ad's adjoint as the step graph ran it (float32 zeros, dy cast to float32,
    ScatterND reduction "add" at the Indices)."""
    n, c, h, w = x_shape
    y_shape = (n, c, *pool_ref.pool_output_hw(h, w, kernel, strides, pads))
    f16 = np.float16
    pool = helper.make_node("MaxPool", ["x"], ["y", "indices"], kernel_shape=list(kernel), strides=list(strides),
                            pads=list(pads))
    forward = _model([pool], {"x": (x_shape, f16)}, {"y": (y_shape, f16), "indices": (y_shape, np.int64)})
    step_nodes = [
        pool,
        helper.make_node("ConstantOfShape", ["numel"], ["zeros"], value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Unsqueeze", ["indices", "last"], ["where"]),
        helper.make_node("Cast", ["dy"], ["dy32"], to=TensorProto.FLOAT),
        helper.make_node("ScatterND", ["zeros", "where", "dy32"], ["flat"], reduction="add"),
        helper.make_node("Reshape", ["flat", "x_shape"], ["dx"]),
    ]
    constants = [helper.make_tensor("numel", TensorProto.INT64, [1], [n * c * h * w]),
                 helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
                 helper.make_tensor("x_shape", TensorProto.INT64, [4], list(x_shape))]
    step = _model(step_nodes, {"x": (x_shape, f16), "dy": (y_shape, f16)},
                  {"y": (y_shape, f16), "dx": (x_shape, np.float32)}, constants)
    return forward, step


@pytest.mark.slow
def test_the_resnet50_stem_pool_timed_against_the_nchw_pool_and_scatter_add(device, results):
    x_shape, kernel, strides, pads = STEM
    feeds = pool_feeds(x_shape, kernel, strides, pads, np.float16, np.random.default_rng(0), relu=True)
    forward, step = nchw_pool_models((x_shape[0], x_shape[3], *x_shape[1:3]), kernel, strides, pads)
    nchw = {k: v.transpose(0, 3, 1, 2).copy() for k, v in feeds.items()}
    runners = {"nhwc_pool_and_grad": device.bound(pool_model(x_shape, kernel, strides, pads, np.float16), feeds,
                                                  cuda_graph=True),
               "nchw_max_pool_indices": device.bound(forward, {"x": nchw["x"]}, cuda_graph=True),
               "nchw_pool_and_scatter_add": device.bound(step, nchw, cuda_graph=True)}
    figures = device.time(runners)
    # reported, not checked: the NCHW step's float32 gradient against the op's float16 one (ORT's
    # MaxPool breaks a tie as it likes; where it takes the first maximum too, only the float16
    # rounding differs: <= 2^-11 of the largest value)
    ours = runners["nhwc_pool_and_grad"].outputs()["dx"].astype(np.float32)
    theirs = runners["nchw_pool_and_scatter_add"].outputs()["dx"].transpose(0, 2, 3, 1)
    results.record(timing=figures, dx_vs_nchw_step_max_error_over_max=float(
        np.abs(ours - theirs).max(initial=0.0) / max(float(np.abs(theirs).max(initial=0.0)), 1e-30)))


# ---- NchwToNhwc ----------------------------------------------------------------------------------

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}
# (x shape, x dtype, to, channels)
TO_NHWC = [((2, 3, 9, 11), np.float32, FLOAT16, 4), ((2, 3, 9, 11), np.float32, FLOAT16, 8),
           ((64, 3, 7, 7), np.float16, FLOAT16, 4), ((3, 3, 5, 5), np.float32, FLOAT, 4),
           ((2, 5, 3, 7), np.float32, FLOAT16, 7), ((2, 6, 3, 3), np.float16, FLOAT16, None),
           ((1, 2, 3, 2, 5), np.float16, FLOAT, 3), ((1, 3, 1, 1), np.float32, FLOAT16, 4)]
IMAGE = (64, 3, 224, 224)


def to_nhwc_model(x_shape, x_dtype, to, channels) -> onnx.ModelProto:
    y_shape = (x_shape[0], *x_shape[2:], channels or x_shape[1])
    node = nodes.nchw_to_nhwc("x", output="y", to=to, channels=channels, name="t")
    return _model([node], {"x": (x_shape, x_dtype)}, {"y": (y_shape, NUMPY[to])})


def transpose_cast_pad_model(x_shape, channels) -> onnx.ModelProto:
    """Transpose, Cast to float16 and Pad of the channels: the chain the op replaces."""
    n, c, h, w = x_shape
    made = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
            helper.make_node("Cast", ["t"], ["h"], to=FLOAT16),
            helper.make_node("Pad", ["h", "pads"], ["y"], mode="constant")]
    pads = helper.make_tensor("pads", TensorProto.INT64, [8], [0, 0, 0, 0, 0, 0, 0, channels - c])
    return _model(made, {"x": (x_shape, np.float32)}, {"y": ((n, h, w, channels), np.float16)}, [pads])


def _values(shape, dtype, rng) -> np.ndarray:
    x = (rng.standard_normal(shape) * 300).astype(dtype)
    specials = [np.nan, np.inf, -np.inf, -0.0, 1e-7, 70000.0, 65520.0, 2.0 ** -25]
    with np.errstate(over="ignore"):
        x.flat[:min(len(specials), x.size)] = np.array(specials[:x.size], np.float64).astype(dtype)
    return x


def _same_but_any_nan(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit, but any NaN matches any NaN (CUDA's conversions write the canonical NaN,
    numpy keeps the payload)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and got[~nan].tobytes() == want[~nan].tobytes())


@pytest.mark.parametrize("x_shape, x_dtype, to, channels", TO_NHWC,
                         ids=[f"{'x'.join(map(str, s))}-{np.dtype(d).name}-to{t}-c{c}" for s, d, t, c in TO_NHWC])
def test_nchw_to_nhwc_is_numpys_bit_for_bit_plain_and_replayed(device, x_shape, x_dtype, to, channels):
    x = _values(x_shape, x_dtype, np.random.default_rng(sum(x_shape)))
    model = to_nhwc_model(x_shape, x_dtype, to, channels)
    with np.errstate(over="ignore"):
        want = to_nhwc_ref.nchw_to_nhwc(x, to, channels)
    assert _same_but_any_nan(device.run(model, {"x": x})["y"], want)
    assert _same_but_any_nan(device.run(model, {"x": x}, cuda_graph=True)["y"], want)


@pytest.mark.slow
def test_the_resnet50_image_timed_against_transpose_cast_pad(device, results):
    """[64, 3, 224, 224] float32 NCHW -> [64, 224, 224, 4] float16 NHWC, both replayed: the same bits."""
    x = np.random.default_rng(0).standard_normal(IMAGE).astype(np.float32)
    runners = {"nchw_to_nhwc": device.bound(to_nhwc_model(IMAGE, np.float32, FLOAT16, 4), {"x": x}, cuda_graph=True),
               "transpose_cast_pad": device.bound(transpose_cast_pad_model(IMAGE, 4), {"x": x}, cuda_graph=True)}
    figures = device.time(runners)
    same = _same_but_any_nan(runners["nchw_to_nhwc"].outputs()["y"], runners["transpose_cast_pad"].outputs()["y"])
    results.record(timing=figures, same_bits_as_ort=same)
    assert same
