"""The NCHW weight gradient's ops, ``ai.onnxcampo::Im2Col`` and ``ConvWeightGrad``: their shapes
(the kernel tests' small cases, every Conv of a ResNet-50 b64 training step), numpy references,
single-node models, and the subgraphs the ops replace (Slice + Concat im2col, Im2Col + Gemm).

``tests/ops/test_im2col.py`` and ``tests/ops/test_conv_weight_grad.py`` run them on the CPU
kernels, ``tests/gpu/test_im2col_cuda.py`` on the CUDA kernels (cuDNN's backward filter for
ConvWeightGrad).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.ops import nodes
from onnxcampo.training.simplify import MAX_CONCAT_INPUTS

# (name, x shape [N, C, H, W], kernel, stride, pads [top, left, bottom, right], convs of ResNet-50 with it)
RESNET50_B64 = [
    ("stem 7x7/2", (64, 3, 224, 224), (7, 7), (2, 2), (3, 3, 3, 3), 1),
    ("3x3 c64 56", (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1), 3),
    ("3x3 c128 28", (64, 128, 28, 28), (3, 3), (1, 1), (1, 1, 1, 1), 3),
    ("3x3 c256 14", (64, 256, 14, 14), (3, 3), (1, 1), (1, 1, 1, 1), 5),
    ("3x3 c512 7", (64, 512, 7, 7), (3, 3), (1, 1), (1, 1, 1, 1), 2),
    ("3x3/2 c128 56", (64, 128, 56, 56), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("3x3/2 c256 28", (64, 256, 28, 28), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("3x3/2 c512 14", (64, 512, 14, 14), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("1x1/2 c256 56", (64, 256, 56, 56), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1/2 c512 28", (64, 512, 28, 28), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1/2 c1024 14", (64, 1024, 14, 14), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1 c64 56", (64, 64, 56, 56), (1, 1), (1, 1), (0, 0, 0, 0), 5),
    ("1x1 c256 56", (64, 256, 56, 56), (1, 1), (1, 1), (0, 0, 0, 0), 3),
    ("1x1 c128 28", (64, 128, 28, 28), (1, 1), (1, 1), (0, 0, 0, 0), 4),
    ("1x1 c512 28", (64, 512, 28, 28), (1, 1), (1, 1), (0, 0, 0, 0), 4),
    ("1x1 c256 14", (64, 256, 14, 14), (1, 1), (1, 1), (0, 0, 0, 0), 6),
    ("1x1 c1024 14", (64, 1024, 14, 14), (1, 1), (1, 1), (0, 0, 0, 0), 6),
    ("1x1 c512 7", (64, 512, 7, 7), (1, 1), (1, 1), (0, 0, 0, 0), 3),
    ("1x1 c2048 7", (64, 2048, 7, 7), (1, 1), (1, 1), (0, 0, 0, 0), 2),
]
assert sum(case[-1] for case in RESNET50_B64) == 53

# (x shape, kernel, stride, dilation, pads): the kernel tests' shapes
SMALL_CASES = [
    ((2, 3, 9, 11), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2)),
    ((2, 3, 9, 11), (3, 3), (2, 1), (1, 2), (0, 2, 1, 3)),
    ((2, 3, 16, 13), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3)),
    ((3, 5, 9, 11), (3, 5), (1, 2), (2, 1), (1, 0, 2, 2)),
    ((2, 4, 8, 6), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((2, 4, 9, 7), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),
    ((1, 1, 5, 5), (5, 5), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((0, 3, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((4, 33, 31, 29), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # several CPU tasks
]


def case_id(shape, kernel, stride, dilation, pads) -> str:
    return f"x{'x'.join(map(str, shape))}-k{kernel[0]}{kernel[1]}-s{stride[0]}{stride[1]}-d{dilation[0]}{dilation[1]}" \
           f"-p{''.join(map(str, pads))}"


# ---- references ------------------------------------------------------------------------------


def output_hw(shape, kernel, stride, dilation, pads) -> tuple[int, int]:
    _, _, h, w = shape
    ho = (h + pads[0] + pads[2] - ((kernel[0] - 1) * dilation[0] + 1)) // stride[0] + 1
    wo = (w + pads[1] + pads[3] - ((kernel[1] - 1) * dilation[1] + 1)) // stride[1] + 1
    return ho, wo


def reference_im2col(x: np.ndarray, kernel, stride=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """columns[(c*kh + i)*kw + j, (n*Ho + oh)*Wo + ow] = x[n, c, oh*sh + i*dh - pt, ow*sw + j*dw - pl],
    0 outside x: the op's formula, element by element (index arrays; small inputs)."""
    n, c, h, w = x.shape
    ho, wo = output_hw(x.shape, kernel, stride, dilation, pads)
    ci, ii, ji, ni, ohi, owi = np.ix_(range(c), range(kernel[0]), range(kernel[1]), range(n), range(ho), range(wo))
    rows = ohi * stride[0] + ii * dilation[0] - pads[0]
    cols = owi * stride[1] + ji * dilation[1] - pads[1]
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    values = x[ni, ci, np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)]
    out = np.where(inside, values, np.zeros((), x.dtype)).astype(x.dtype)
    return out.reshape(c * kernel[0] * kernel[1], n * ho * wo)


def tap_im2col(x: np.ndarray, kernel, stride=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """The same matrix as the Slice + Concat subgraph builds it: the padded, transposed input
    sliced once per tap, the taps stacked ([Cin, kh, kw, N, Ho, Wo]); memory-light for large inputs."""
    n, c, _, _ = x.shape
    ho, wo = output_hw(x.shape, kernel, stride, dilation, pads)
    padded = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    out = np.empty((c, kernel[0], kernel[1], n, ho, wo), x.dtype)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dilation[0], j * dilation[1]
            tap = padded[:, :, top:top + (ho - 1) * stride[0] + 1:stride[0], left:left + (wo - 1) * stride[1] + 1:stride[1]]
            out[:, i, j] = tap.transpose(1, 0, 2, 3)
    return out.reshape(c * kernel[0] * kernel[1], n * ho * wo)


def reference_weight_grad(x, dy, kernel, stride, dilation, pads) -> np.ndarray:
    """ConvWeightGrad in float64: dy (channels first, flattened) times the im2col matrix."""
    columns = reference_im2col(x.astype(np.float64), kernel, stride, dilation, pads)  # [Cin*kh*kw, N*Ho*Wo]
    cout = dy.shape[1]
    d = dy.astype(np.float64).transpose(1, 0, 2, 3).reshape(cout, -1)
    return (d @ columns.T).reshape(cout, x.shape[1], *kernel)


def close(got, want, rtol) -> dict:
    """``ok`` when ``got`` is finite, shaped like ``want`` and within ``rtol`` of its largest value."""
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    error = float(np.abs(got - want).max(initial=0.0)) / scale
    return {"ok": bool(got.shape == want.shape and np.isfinite(got).all() and error <= rtol),
            "max_error_over_max_ref": error}


def same_bits(got: np.ndarray, want: np.ndarray) -> dict:
    """``ok`` when equal bit for bit (NaN payloads and signed zeros too); how many elements differ."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"ok": False, "why": f"{got.dtype}[{got.size}], expected {want.dtype}[{want.size}]"}
    bits = f"u{got.dtype.itemsize}"
    differ = int(np.count_nonzero(got.view(bits) != want.view(bits)))
    return {"ok": differ == 0, "elements": int(got.size), "differ": differ}


# ---- models ----------------------------------------------------------------------------------


def _model(graph_nodes, inputs, out_name, dtype, out_shape, inits=(), value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(graph_nodes, "g", [helper.make_tensor_value_info(k, dtype, list(v)) for k, v in inputs],
                              [helper.make_tensor_value_info(out_name, dtype, list(out_shape))], list(inits),
                              value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def im2col_model(x_shape, kernel, stride, dilation, pads, dtype) -> onnx.ModelProto:
    rows, columns = nodes.im2col_shape(x_shape, kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads)
    node = nodes.im2col("x", output="columns", kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads,
                        name="im2col")
    return _model([node], [("x", x_shape)], "columns", dtype, (rows, columns))


def slice_concat_model(x_shape, kernel, stride, pads, dtype) -> onnx.ModelProto:
    """The subgraph ``onnxcampo/training/simplify.py`` (``_emit_weight_gradient``) emits without
    the custom ops, with the forward Conv's Pad and Transpose before it; dilation 1 (ResNet); its
    output [Cin, kh*kw*N, Ho, Wo] is the column matrix's memory."""
    n, c, h, w = x_shape
    ho, wo = output_hw(x_shape, kernel, stride, (1, 1), pads)
    graph_nodes, inits = [], []

    def const(name, values):
        inits.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    source = "x"
    if any(pads):
        graph_nodes.append(helper.make_node("Pad", ["x", const("pads", [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]])],
                                            ["padded"], mode="constant"))
        source = "padded"
    graph_nodes.append(helper.make_node("Transpose", [source], ["images"], perm=[1, 0, 2, 3]))
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    if tuple(kernel) == (1, 1) and tuple(stride) == (1, 1) and (ho, wo) == (hp, wp):
        taps = ["images"]
    else:
        taps = []
        const("axes", [2, 3])
        const("steps", list(stride))
        for a in range(kernel[0]):
            for b in range(kernel[1]):
                ends = [a + (ho - 1) * stride[0] + 1, b + (wo - 1) * stride[1] + 1]
                tap = f"tap_{a}_{b}"
                graph_nodes.append(helper.make_node("Slice", ["images", const(f"{tap}/starts", [a, b]),
                                                              const(f"{tap}/ends", ends), "axes", "steps"], [tap]))
                taps.append(tap)
    level = 0
    while len(taps) > MAX_CONCAT_INPUTS:
        groups = [taps[i:i + MAX_CONCAT_INPUTS] for i in range(0, len(taps), MAX_CONCAT_INPUTS)]
        taps = []
        for k, group in enumerate(groups):
            if len(group) == 1:
                taps.append(group[0])
                continue
            part = f"part_{level}_{k}"
            graph_nodes.append(helper.make_node("Concat", group, [part], axis=1))
            taps.append(part)
        level += 1
    out_shape = (c, kernel[0] * kernel[1] * n, ho, wo)
    if len(taps) > 1:
        graph_nodes.append(helper.make_node("Concat", taps, ["columns"], axis=1))
    else:  # one tap (the Transpose itself for a 1x1 stride-1 Conv): it is the graph output
        graph_nodes[-1].output[0] = "columns"
    return _model(graph_nodes, [("x", x_shape)], "columns", dtype, out_shape, inits)


def cudnn_fits(shape, kernel, stride, dilation, pads) -> bool:
    """cuDNN pads top/left on both sides: the same (Ho, Wo) as the op's pads (simplify's test)."""
    ho, wo = output_hw(shape, kernel, stride, dilation, pads)
    for size, begin, k, d, s, o in zip(shape[2:], pads[:2], kernel, dilation, stride, (ho, wo)):
        if (size + 2 * begin - ((k - 1) * d + 1)) // s + 1 != o:
            return False
    return True


def dy_shape(shape, kernel, stride, dilation, pads, cout):
    ho, wo = output_hw(shape, kernel, stride, dilation, pads)
    return (shape[0], cout, ho, wo)


def weight_grad_model(shape, kernel, stride, dilation, pads, cout, dtype) -> onnx.ModelProto:
    node = nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=kernel, strides=stride, dilations=dilation,
                                  pads=pads, name="conv_weight_grad")
    return _model([node], [("x", shape), ("dy", dy_shape(shape, kernel, stride, dilation, pads, cout))], "dw", dtype,
                  (cout, shape[1], *kernel))


def im2col_gemm_model(shape, kernel, stride, pads, cout, dtype) -> onnx.ModelProto:
    """Im2Col(x), dy reshaped to [Cout, N*Ho*Wo] after the Transpose to channels-first, Gemm
    transB=1: what the step graph runs without ConvWeightGrad."""
    rows, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, pads=pads)
    dy = dy_shape(shape, kernel, stride, (1, 1), pads, cout)
    graph_nodes = [
        nodes.im2col("x", output="columns", kernel_shape=kernel, strides=stride, pads=pads, name="im2col"),
        helper.make_node("Transpose", ["dy"], ["dy_cnhw"], perm=[1, 0, 2, 3]),
        helper.make_node("Constant", [], ["dy_shape"], value=helper.make_tensor("s", TensorProto.INT64, [2], [cout, columns])),
        helper.make_node("Reshape", ["dy_cnhw", "dy_shape"], ["dy2"]),
        helper.make_node("Gemm", ["dy2", "columns"], ["product"], transB=1),
        helper.make_node("Constant", [], ["w_shape"],
                         value=helper.make_tensor("w", TensorProto.INT64, [4], [cout, shape[1], *kernel])),
        helper.make_node("Reshape", ["product", "w_shape"], ["dw"]),
    ]
    info = [helper.make_tensor_value_info("columns", dtype, [rows, columns])]
    return _model(graph_nodes, [("x", shape), ("dy", dy)], "dw", dtype, (cout, shape[1], *kernel), value_info=info)


def resnet_cout(shape, kernel, stride) -> int:
    """The output channels of the torchvision ResNet-50 Conv with this input: the stem 64, a
    bottleneck's 3x3 keeps its width, the downsample 1x1/2 doubles, a 1x1/1 expands a stage's
    width (64, 128, 256, 512 at 56, 28, 14, 7 pixels) 4x and reduces anything wider 4x."""
    cin = shape[1]
    if kernel == (7, 7):
        return 64
    if kernel == (3, 3):
        return cin
    if stride == (2, 2):
        return 2 * cin
    width = {56: 64, 28: 128, 14: 256, 7: 512}[shape[2]]
    return 4 * cin if cin == width else cin // 4


def exact_sum_fits(shape, kernel, stride, pads) -> bool:
    """Whether the float64 im2col matrix of ``x`` is small enough for the exact reference."""
    return shape[1] * math.prod(kernel) * shape[0] * math.prod(output_hw(shape, kernel, stride, (1, 1), pads)) <= 6e7
