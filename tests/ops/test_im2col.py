"""ai.onnxcampo::Im2Col on the CPU against numpy (the reference of tests/gpu/test_im2col_cuda.py,
which checks the CUDA kernel the same way on a GPU): float32 and float16, strides 1 and 2,
dilation 2, asymmetric pads, 1x1, 7x7, non-square kernels and images, an empty batch; the
output type and shape ORT infers; the same bits for any thread count; clear errors for bad
attributes and inputs. Skipped when the custom-op library is not built."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cases.im2col import im2col_model, reference_im2col, slice_concat_model, tap_im2col
from onnxcampo import ops
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session

pytestmark = pytest.mark.skipif(not ops.available(), reason=f"custom-op library not built ({ops.BUILD_COMMAND})")

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
RNG = np.random.default_rng(0)

# (x shape, kernel, stride, dilation, pads [top, left, bottom, right])
CASES = [
    ((2, 3, 9, 11), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2)),       # dilation 2
    ((2, 3, 9, 11), (3, 3), (2, 1), (1, 2), (0, 2, 1, 3)),       # asymmetric pads, mixed strides
    ((2, 3, 16, 13), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3)),      # the ResNet stem's 7x7 / 2
    ((3, 5, 9, 11), (3, 5), (1, 2), (2, 1), (1, 0, 2, 2)),       # non-square kernel on a non-square image
    ((2, 4, 8, 6), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),        # 1x1: a transpose
    ((2, 4, 9, 7), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),        # 1x1 stride 2 (downsample)
    ((1, 1, 5, 5), (5, 5), (1, 1), (1, 1), (0, 0, 0, 0)),        # one output position
    ((2, 2, 4, 4), (3, 3), (1, 1), (1, 1), (2, 0, 0, 3)),        # pads larger on one side than the kernel reach
]
IDS = [f"x{'x'.join(map(str, s))}-k{k[0]}x{k[1]}-s{st[0]}{st[1]}-d{d[0]}{d[1]}-p{''.join(map(str, p))}"
       for s, k, st, d, p in CASES]


def run(model: onnx.ModelProto, x: np.ndarray, threads: int | None = None) -> np.ndarray:
    return make_session(model, intra_op_threads=threads).run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kernel, stride, dilation, pads", CASES, ids=IDS)
def test_im2col_matches_numpy(shape, kernel, stride, dilation, pads, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    model = im2col_model(shape, kernel, stride, dilation, pads, HALF if dtype == np.float16 else FLOAT)
    got = run(model, x)
    want = reference_im2col(x, kernel, stride, dilation, pads)
    assert got.dtype == dtype and got.shape == want.shape
    assert got.shape == nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tap_im2col(x, kernel, stride, dilation, pads), want)  # the two references agree


@pytest.mark.parametrize("shape, kernel, stride, pads", [
    ((2, 3, 16, 13), (7, 7), (2, 2), (3, 3, 3, 3)), ((2, 4, 9, 7), (3, 3), (1, 1), (1, 1, 1, 1)),
    ((2, 4, 9, 7), (1, 1), (2, 2), (0, 0, 0, 0)), ((2, 4, 9, 7), (1, 1), (1, 1), (0, 0, 0, 0))])
def test_im2col_equals_the_slice_concat_subgraph_it_replaces(shape, kernel, stride, pads):
    """The matrix of simplify rule 1's standard-op emission (Pad, Transpose, a Slice per tap,
    Concats of <= 32), read as [Cin*kh*kw, N*Ho*Wo]: the same bits."""
    x = RNG.standard_normal(shape).astype(np.float16)
    old = run(slice_concat_model(shape, kernel, stride, pads, HALF), x)
    new = run(im2col_model(shape, kernel, stride, (1, 1), pads, HALF), x)
    np.testing.assert_array_equal(new, old.reshape(new.shape))


def test_the_same_bits_for_any_thread_count():
    """A call of many 64K-element tasks (x [4, 33, 31, 29], 3x3: 1.1 M elements)."""
    shape, kernel, stride, dilation, pads = (4, 33, 31, 29), (3, 3), (1, 1), (1, 1), (1, 2, 0, 1)
    x = RNG.standard_normal(shape).astype(np.float32)
    model = im2col_model(shape, kernel, stride, dilation, pads, FLOAT)
    want = reference_im2col(x, kernel, stride, dilation, pads)
    for threads in (1, 2, 4):
        np.testing.assert_array_equal(run(model, x, threads), want)


def test_an_empty_batch_gives_empty_columns():
    x = np.zeros((0, 3, 8, 8), np.float16)
    got = run(im2col_model(x.shape, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), HALF), x)
    assert got.shape == (27, 0) and got.dtype == np.float16


@pytest.mark.parametrize("onnx_type, name", [(FLOAT, "tensor(float)"), (HALF, "tensor(float16)")])
def test_ort_infers_the_output_type_and_shape(onnx_type, name):
    """No value_info needed: the output takes x's type and, with x's dims known, [C*kh*kw, N*Ho*Wo]."""
    node = nodes.im2col("x", output="c", kernel_shape=(3, 5), strides=(2, 1), pads=(1, 2, 0, 2), name="im2col")
    graph = helper.make_graph([node, helper.make_node("Relu", ["c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx_type, [2, 3, 9, 11])],
                              [helper.make_tensor_value_info("y", onnx_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    output = make_session(model).get_outputs()[0]
    assert output.type == name and output.shape == [45, 2 * 4 * 11]  # Ho = (9 + 1 - 3) // 2 + 1, Wo = 11 + 4 - 5 + 1


def test_the_builder_checks_attributes():
    with pytest.raises(ValueError, match="pads must be 4 non-negative ints"):
        nodes.im2col("x", output="c", kernel_shape=(3, 3), pads=(1, 1), name="n")
    with pytest.raises(ValueError, match="strides must be 2 positive ints"):
        nodes.im2col_shape((1, 1, 4, 4), kernel_shape=(3, 3), strides=(0, 1))
    with pytest.raises(ValueError, match="exceeds the padded input 4 x 4"):
        nodes.im2col_shape((1, 1, 4, 4), kernel_shape=(5, 5))


def _raw_model(x_type, x_shape, **attributes) -> onnx.ModelProto:
    node = helper.make_node("Im2Col", ["x"], ["columns"], name="bad", domain=ops.DOMAIN, **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info("columns", x_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


@pytest.mark.parametrize("attributes, message", [
    ({}, "Im2Col node 'bad': attribute kernel_shape \\[kh, kw\\] is required"),
    ({"kernel_shape": [3]}, "kernel_shape must be 2 positive ints \\[kh, kw\\], got \\[3\\]"),
    ({"kernel_shape": [3, 0]}, "kernel_shape must be 2 positive ints"),
    ({"kernel_shape": [3, 3], "strides": [1, 0]}, "strides must be 2 positive ints \\[sh, sw\\], got \\[1, 0\\]"),
    ({"kernel_shape": [3, 3], "dilations": [2]}, "dilations must be 2 positive ints"),
    ({"kernel_shape": [3, 3], "pads": [1, 1]}, "pads must be 4 non-negative ints \\[top, left, bottom, right\\]"),
    ({"kernel_shape": [3, 3], "pads": [1, -1, 1, 1]}, "pads must be 4 non-negative ints"),
])
def test_bad_attributes_fail_at_session_creation(attributes, message):
    with pytest.raises(Exception, match=message):
        make_session(_raw_model(FLOAT, [1, 2, 5, 5], **attributes))


@pytest.mark.parametrize("x_type, shape, attributes, message", [
    (FLOAT, [1, 2, 4, 4], {"kernel_shape": [7, 7]},
     "the kernel's extent 7 x 7 .* exceeds the padded input 4 x 4"),
    (FLOAT, [1, 2, 4, 4], {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [0, 0, 0, 0]},
     "extent 5 x 5"),
    (FLOAT, [2, 4, 4], {"kernel_shape": [3, 3]}, "x must be 4-D \\[N, C, H, W\\], got rank 3"),
    (TensorProto.INT64, [1, 2, 4, 4], {"kernel_shape": [3, 3]}, "x must be float32 or float16"),
])
def test_bad_inputs_fail_with_the_reason(x_type, shape, attributes, message):
    model = _raw_model(x_type, shape, **attributes)
    dtype = helper.tensor_dtype_to_np_dtype(x_type)
    with pytest.raises(Exception, match=message):
        make_session(model).run(None, {"x": np.zeros(shape, dtype)})
