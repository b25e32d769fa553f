"""``ai.onnxcampo::Im2Col`` and ``ConvWeightGrad`` (cuDNN's backward filter) on CUDA
(tests/gpu/conftest.py: skipped without a GPU); the cases are ``tests/cases/im2col.py``'s.

Im2Col, outputs compared bit for bit:

1. the small cases, float32 and float16 (strides 1 and 2, dilation 2, asymmetric pads, 1x1, 7x7
   stride 2, a 3x5 kernel on a non-square image, an empty batch): against the numpy reference
   (the formula element by element) and against the CPU kernel;
2. every ResNet-50 b64 shape (float16): against the Slice + Concat subgraph on the GPU and
   against the numpy taps; a CUDA-graph replay against the plain run;
3. an output of more than 2^31 elements (the kernel's int64 path; [1, 16, 4096, 4096] float16,
   3x3: 2.4 G elements, 4.8 GB), checked at 2 M sampled positions and over its last 1 M elements.

ConvWeightGrad, within ``RTOL`` of the largest value (float16 outputs: one rounding; TF32
products: 10-bit mantissas): the small cases whose pads cuDNN's symmetric padding serves,
float32 (TF32, as ORT's Conv) and float16, against the float64 numpy reference and the CPU kernel;
every ResNet-50 b64 shape in float16 against Im2Col + Gemm (and the exact sums where the float64
im2col matrix is small enough); a CUDA-graph replay against the plain run.

Timed side by side, float16, each ResNet-50 b64 shape (figures to the results sink, with the
step's count of Convs of that shape): ``slice_concat`` against ``im2col``, and ``im2col_gemm``
(Im2Col, dy to channels-first, Gemm transB=1) against ``conv_weight_grad``.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from cases import im2col as cases
from onnxcampo.ops import nodes

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
TYPES = [(np.float32, FLOAT), (np.float16, FLOAT16)]
TYPE_IDS = ["fp32", "fp16"]
RTOL = 4e-3
SMALL = {cases.case_id(*case): case for case in cases.SMALL_CASES}
FITTING = {key: case for key, case in SMALL.items() if cases.cudnn_fits(*case)}
RESNET = {name.replace(" ", "-"): case for name, *case in cases.RESNET50_B64}


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(sum(key.encode()))


# ---- Im2Col ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, onnx_type", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("key", list(SMALL))
def test_im2col_matches_numpy_and_the_cpu_kernel_bit_for_bit(device, key, dtype, onnx_type):
    shape, kernel, stride, dilation, pads = SMALL[key]
    x = _rng(key).standard_normal(shape).astype(dtype)
    model = cases.im2col_model(shape, kernel, stride, dilation, pads, onnx_type)
    got = device.run(model, {"x": x})["columns"]
    vs_numpy = cases.same_bits(got, cases.reference_im2col(x, kernel, stride, dilation, pads))
    vs_cpu = cases.same_bits(got, device.cpu(model, {"x": x})["columns"])
    assert vs_numpy["ok"] and vs_cpu["ok"], {"vs_numpy": vs_numpy, "vs_cpu": vs_cpu}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_im2col_matches_the_slice_concat_subgraph_on_resnet50_shapes(device, key):
    shape, kernel, stride, pads, _ = RESNET[key]
    x = _rng(key).standard_normal(shape).astype(np.float16)
    new = device.run(cases.im2col_model(shape, kernel, stride, (1, 1), pads, FLOAT16), {"x": x})["columns"]
    old = device.run(cases.slice_concat_model(shape, kernel, stride, pads, FLOAT16), {"x": x},
                     cpu_fallback=True)["columns"]
    vs_graph, vs_numpy = cases.same_bits(new, old), cases.same_bits(new, cases.tap_im2col(x, kernel, stride, (1, 1), pads))
    assert vs_graph["ok"] and vs_numpy["ok"], {"vs_slice_concat": vs_graph, "vs_numpy": vs_numpy}


@pytest.mark.slow
def test_im2col_replayed_as_a_cuda_graph_equals_the_plain_run(device):
    shape, kernel, stride, pads = (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1)
    x = _rng("graph").standard_normal(shape).astype(np.float16)
    model = cases.im2col_model(shape, kernel, stride, (1, 1), pads, FLOAT16)
    replayed = device.run(model, {"x": x}, cuda_graph=True)["columns"]
    same = cases.same_bits(replayed, device.run(model, {"x": x})["columns"])
    assert same["ok"], same


@pytest.mark.slow
def test_im2col_of_more_than_2_to_the_31_elements(device):
    """The int64 index path: [1, 16, 4096, 4096] float16, 3x3 (2.4 G output elements), sampled."""
    shape, kernel, stride, dilation, pads = (1, 16, 4096, 4096), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)
    rng = _rng("large")
    x = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    rows, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads)
    total = rows * columns
    got = device.run(cases.im2col_model(shape, kernel, stride, dilation, pads, FLOAT16), {"x": x})["columns"].reshape(-1)
    assert got.size == total > 2 ** 31
    flat = np.concatenate([rng.integers(0, total, 2_000_000), np.arange(total - 1_000_000, total)])
    row, col = flat // columns, flat % columns
    ho, wo = cases.output_hw(shape, kernel, stride, dilation, pads)
    ow, oh, n = col % wo, (col // wo) % ho, col // (wo * ho)
    j, i, c = row % kernel[1], (row // kernel[1]) % kernel[0], row // (kernel[0] * kernel[1])
    h, w = oh * stride[0] + i * dilation[0] - pads[0], ow * stride[1] + j * dilation[1] - pads[1]
    inside = (h >= 0) & (h < shape[2]) & (w >= 0) & (w < shape[3])
    want = np.where(inside, x[n, c, np.clip(h, 0, shape[2] - 1), np.clip(w, 0, shape[3] - 1)], np.float16(0))
    assert np.count_nonzero(got[flat].view(np.uint16) != want.view(np.uint16)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_im2col_timed_against_the_slice_concat_subgraph(device, results, key):
    shape, kernel, stride, pads, count = RESNET[key]
    feeds = {"x": _rng(key).standard_normal(shape).astype(np.float16)}
    models = {"slice_concat": cases.slice_concat_model(shape, kernel, stride, pads, FLOAT16),
              "im2col": cases.im2col_model(shape, kernel, stride, (1, 1), pads, FLOAT16)}
    runners = {"slice_concat": device.bound(models["slice_concat"], feeds, cpu_fallback=True),
               "im2col": device.bound(models["im2col"], feeds)}
    figures = device.time(runners)
    rows, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, pads=pads)
    moved = 2 * (rows * columns + int(np.prod(shape)))  # float16: written once, x read (at least) once
    results.record(x=list(shape), kernel=list(kernel), stride=list(stride), pads=list(pads), count=count,
                   columns=[rows, columns], nodes={k: len(m.graph.node) for k, m in models.items()}, timing=figures,
                   speedup=figures["slice_concat"]["ms"] / figures["im2col"]["ms"],
                   im2col_GBps=moved / (figures["im2col"]["ms"] * 1e-3) / 1e9)


# ---- ConvWeightGrad ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, onnx_type", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("key", list(FITTING))
def test_conv_weight_grad_matches_numpy_and_the_cpu_kernel(device, key, dtype, onnx_type):
    shape, kernel, stride, dilation, pads = FITTING[key]
    cout = 5
    rng = _rng(key)
    feeds = {"x": rng.standard_normal(shape).astype(dtype),
             "dy": rng.standard_normal(cases.dy_shape(shape, kernel, stride, dilation, pads, cout)).astype(dtype)}
    model = cases.weight_grad_model(shape, kernel, stride, dilation, pads, cout, onnx_type)
    got = device.run(model, feeds)["dw"]
    vs_cpu = cases.close(got, device.cpu(model, feeds)["dw"].astype(np.float64), RTOL)
    if shape[0] == 0:  # an empty sum: zeros exactly
        vs_numpy = {"ok": bool(np.all(got == 0)), "zeros": True}
    else:
        vs_numpy = cases.close(got, cases.reference_weight_grad(feeds["x"], feeds["dy"], kernel, stride, dilation, pads),
                               RTOL)
    assert vs_numpy["ok"] and vs_cpu["ok"], {"vs_numpy": vs_numpy, "vs_cpu": vs_cpu}


def _weight_grad_feeds(key, shape, kernel, stride, pads, cout):
    rng = _rng(key)
    return {"x": rng.standard_normal(shape).astype(np.float16),
            "dy": rng.standard_normal(cases.dy_shape(shape, kernel, stride, (1, 1), pads, cout)).astype(np.float16)}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_conv_weight_grad_matches_im2col_gemm_on_resnet50_shapes(device, key):
    shape, kernel, stride, pads, _ = RESNET[key]
    cout = 64
    feeds = _weight_grad_feeds(key, shape, kernel, stride, pads, cout)
    new = device.run(cases.weight_grad_model(shape, kernel, stride, (1, 1), pads, cout, FLOAT16), feeds)["dw"]
    old = device.run(cases.im2col_gemm_model(shape, kernel, stride, pads, cout, FLOAT16), feeds, cpu_fallback=True)["dw"]
    parts = {"vs_im2col_gemm": cases.close(new, old.astype(np.float64), RTOL)}
    if cases.exact_sum_fits(shape, kernel, stride, pads):
        parts["vs_numpy"] = cases.close(new, cases.reference_weight_grad(feeds["x"], feeds["dy"], kernel, stride,
                                                                         (1, 1), pads), RTOL)
    assert all(part["ok"] for part in parts.values()), parts


@pytest.mark.slow
def test_conv_weight_grad_replayed_as_a_cuda_graph_equals_the_plain_run(device):
    shape, kernel, stride, pads, cout = (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1), 64
    feeds = _weight_grad_feeds("graph", shape, kernel, stride, pads, cout)
    model = cases.weight_grad_model(shape, kernel, stride, (1, 1), pads, cout, FLOAT16)
    replayed, plain = device.run(model, feeds, cuda_graph=True)["dw"], device.run(model, feeds)["dw"]
    np.testing.assert_array_equal(replayed.view(np.uint16), plain.view(np.uint16))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(RESNET))
def test_conv_weight_grad_timed_against_im2col_gemm(device, results, key):
    shape, kernel, stride, pads, count = RESNET[key]
    cout = cases.resnet_cout(shape, kernel, stride)
    feeds = _weight_grad_feeds(key, shape, kernel, stride, pads, cout)
    runners = {"im2col_gemm": device.bound(cases.im2col_gemm_model(shape, kernel, stride, pads, cout, FLOAT16), feeds,
                                           cpu_fallback=True),
               "conv_weight_grad": device.bound(cases.weight_grad_model(shape, kernel, stride, (1, 1), pads, cout,
                                                                        FLOAT16), feeds)}
    figures = device.time(runners)
    results.record(x=list(shape), cout=cout, kernel=list(kernel), stride=list(stride), pads=list(pads), count=count,
                   timing=figures, speedup=figures["im2col_gemm"]["ms"] / figures["conv_weight_grad"]["ms"])
