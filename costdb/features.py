"""What a cost model knows of a node: FLOPs, elements moved, GEMM dims, Tensor Core alignment.

Computed from shapes alone (pinned at load), so the same features serve the analytic model, the
regression database and the measurement harness that builds it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Shape = tuple[int | None, ...] | None

TENSOR_CORE_MULTIPLE = 8
_GEMM_OPS = frozenset({"MatMul", "FusedMatMul", "Gemm", "FusedGemm", "GemmFastGelu"})
_CONV_OPS = frozenset({"Conv", "FusedConv", "ConvTranspose"})
_ATTENTION_OPS = frozenset({"Attention", "MultiHeadAttention"})
# Inputs an op reads at the rows it gathers (B x S of them, the size of its output), not whole.
_GATHERED_TABLES = {"EmbedLayerNormalization": (2, 3, 4)}  # word, position, segment embeddings


@dataclass(frozen=True)
class OpFeatures:
    """Size features of one node.

    ``gemm`` is the (batch, M, K, N) of the matrix product the op performs (Conv as implicit
    GEMM: M = output pixels, K = input channels per group x kernel, N = output channels per
    group); ``None`` for ops that are not products.
    """

    op_type: str
    known: bool
    flops: float = 0.0
    elements: int = 0  # float elements read and written
    elements_out: int = 0
    gemm: tuple[int, int, int, int] | None = None
    kernel: int = 1  # Conv: kernel elements folded into K (K = channels per group x kernel)
    stride: int = 1  # Conv: product of the strides
    chunk: int = 0  # Transpose: elements of the innermost run copied contiguously (1: the last axis moves)

    @property
    def is_gemm(self) -> bool:
        return self.gemm is not None

    @property
    def tensor_core_aligned(self) -> bool:
        """fp16 Tensor Cores need the leading dims K and N in multiples of 8 (M does not matter:
        it is no row stride), and for Conv the channels per group."""
        if self.gemm is None:
            return False
        _, m, k, n = self.gemm
        if self.op_type in _CONV_OPS:  # channels, not the kernel-folded K, must be aligned
            return (k // self.kernel) % TENSOR_CORE_MULTIPLE == 0 and n % TENSOR_CORE_MULTIPLE == 0
        return k % TENSOR_CORE_MULTIPLE == 0 and n % TENSOR_CORE_MULTIPLE == 0

    @property
    def even_aligned(self) -> bool:
        """K and N (Conv: channels per group and output channels) are even but not Tensor Core
        aligned: fp16 rows start on 4-byte boundaries, which lets cuBLAS use Tensor Core kernels
        with narrow loads; odd dims leave 2-byte rows and slower kernels (measured on the H200:
        fp16/fp32 median 0.62 for even, 0.85 for odd unaligned MatMuls)."""
        if self.gemm is None or self.tensor_core_aligned:
            return False
        _, _, k, n = self.gemm
        if self.op_type in _CONV_OPS:
            k //= self.kernel
        return k % 2 == 0 and n % 2 == 0

    def with_gemm(self, m: int, k: int, n: int) -> "OpFeatures":
        """The same op with other GEMM dims (what padding would produce)."""
        if self.gemm is None:
            raise ValueError(f"{self.op_type} is not a matrix product")
        batch, m0, k0, n0 = self.gemm
        scale_in = (m * k + k * n) / max(m0 * k0 + k0 * n0, 1)
        scale_out = (m * n) / max(m0 * n0, 1)
        elements_in = self.elements - self.elements_out
        return OpFeatures(
            op_type=self.op_type,
            known=self.known,
            flops=2.0 * batch * m * k * n,
            elements=int(elements_in * scale_in + self.elements_out * scale_out),
            elements_out=int(self.elements_out * scale_out),
            gemm=(batch, m, k, n),
            kernel=self.kernel,
            stride=self.stride,
        )


def cost_key(op_type: str, domain: str = "") -> str:
    """The name a cost model knows an op by: its type, qualified by its domain where another
    domain's op has the same name (com.microsoft's Gelu and Attention against ONNX's Gelu-20 and
    Attention-23: ORT runs them with other kernels, and the H200 measured contrib Gelu's fp16 no
    faster than its fp32)."""
    if not domain or domain == "ai.onnx":
        return op_type
    import onnx

    return f"{domain}.{op_type}" if onnx.defs.has(op_type) else op_type


# ai.onnxcampo ops costed as the standard op whose work they do: :func:`op_features` gives them
# that op's name and sizes (ConvWeightGrad: the Gemm over Im2Col(x) it replaces, [Cout, N*Ho*Wo]
# x [N*Ho*Wo, Cin*kh*kw]).
STANDS_FOR = {"ConvWeightGrad": "Gemm"}


def keyed(features: OpFeatures, domain: str) -> OpFeatures:
    """``features`` under :func:`cost_key` (the same sizes; only the name the models look up)."""
    if domain == "ai.onnxcampo" and features.op_type in STANDS_FOR.values():
        return features  # an ai.onnxcampo op costed as a standard one (STANDS_FOR)
    key = cost_key(features.op_type, domain)
    return features if key == features.op_type else dataclasses.replace(features, op_type=key)


def _numel(shape: Shape) -> int | None:
    if shape is None or any(d is None for d in shape):
        return None
    return math.prod(shape)


def op_features(
    op_type: str,
    input_shapes: Sequence[Shape],
    output_shapes: Sequence[Shape],
    attrs: Mapping[str, object] | None = None,
    *,
    float_inputs: Sequence[bool] | None = None,
    float_outputs: Sequence[bool] | None = None,
) -> OpFeatures:
    """Features from the shapes of a node's float inputs and outputs (others are ignored)."""
    attrs = attrs or {}
    if op_type in _GATHERED_TABLES and output_shapes and output_shapes[0] is not None:
        rows = _GATHERED_TABLES[op_type]
        input_shapes = [output_shapes[0] if i in rows and s is not None else s for i, s in enumerate(input_shapes)]
    float_inputs = float_inputs if float_inputs is not None else [True] * len(input_shapes)
    float_outputs = float_outputs if float_outputs is not None else [True] * len(output_shapes)
    ins = [s for s, f in zip(input_shapes, float_inputs) if f]
    outs = [s for s, f in zip(output_shapes, float_outputs) if f]
    counts_in = [_numel(s) for s in ins]
    counts_out = [_numel(s) for s in outs]
    if any(c is None for c in (*counts_in, *counts_out)) or not outs:
        return OpFeatures(op_type=op_type, known=False)
    elements_out = sum(counts_out)
    elements = sum(counts_in) + elements_out
    gemm, kernel = _gemm_dims(op_type, input_shapes, output_shapes, attrs)
    if op_type in STANDS_FOR:
        op_type = STANDS_FOR[op_type]
    attention = _attention_dims(op_type, input_shapes, output_shapes, attrs) if op_type in _ATTENTION_OPS else None
    if attention is not None:
        gemm, flops = attention
    elif gemm is not None:
        batch, m, k, n = gemm
        flops = 2.0 * batch * m * k * n
    else:
        flops = float(elements_out)
    stride = 1
    if op_type in _CONV_OPS:
        stride = math.prod(int(s) for s in (attrs.get("strides") or (1,)))
    chunk = _transpose_chunk(ins[0], attrs.get("perm")) if op_type == "Transpose" and ins else 0
    return OpFeatures(op_type, True, flops, elements, elements_out, gemm, kernel, stride, chunk)


def _transpose_chunk(shape: Shape, perm) -> int:
    """Elements of the trailing input axes a Transpose leaves in place (copied as one run)."""
    rank = len(shape)
    try:
        perm = tuple(int(p) for p in perm) if perm is not None else tuple(reversed(range(rank)))
    except (TypeError, ValueError):
        return 0
    if len(perm) != rank:
        return 0
    chunk, axis = 1, rank - 1
    while axis >= 0 and perm[axis] == axis:
        chunk *= shape[axis]
        axis -= 1
    return int(chunk)


def _gemm_dims(op_type, input_shapes, output_shapes, attrs) -> tuple[tuple[int, int, int, int] | None, int]:
    try:
        if op_type in _GEMM_OPS:
            a, b = input_shapes[0], input_shapes[1]
            if a is None or b is None or len(a) < 1 or len(b) < 1:
                return None, 1
            trans_a = int(attrs.get("transA", 0))
            trans_b = int(attrs.get("transB", 0))
            a2 = (1, a[0]) if len(a) == 1 else (a[-1], a[-2]) if trans_a else (a[-2], a[-1])
            b2 = (b[0], 1) if len(b) == 1 else (b[-1], b[-2]) if trans_b else (b[-2], b[-1])
            m, k = a2
            n = b2[1]
            out = output_shapes[0]
            batch = math.prod(out[:-2]) if out is not None and len(out) > 2 else 1
            if batch > 1 and len(b) <= 2 and not trans_a:
                # A [..., M, K] times a 2-D B: ORT runs one GEMM of M = batch x M (as cuBLAS sees
                # it, and as the database measured a [batch x M, K] input)
                batch, m = 1, batch * m
            return (int(batch), int(m), int(k), int(n)), 1
        if op_type == "ConvWeightGrad":  # x [N, Cin, H, W], dy [N, Cout, Ho, Wo] -> [Cout, Cin, kh, kw]
            x, dy, dw = input_shapes[0], input_shapes[1], output_shapes[0]
            if x is None or dy is None or dw is None or len(dy) != 4 or len(dw) != 4:
                return None, 1
            return (1, int(dy[1]), int(dy[0] * dy[2] * dy[3]), int(dw[1] * dw[2] * dw[3])), 1
        if op_type in _CONV_OPS:
            x, w, y = input_shapes[0], input_shapes[1], output_shapes[0]
            if x is None or w is None or y is None or len(w) < 3:
                return None, 1
            group = int(attrs.get("group", 1))
            kernel = math.prod(w[2:])
            if op_type == "ConvTranspose":
                # A GEMM per kernel tap: M = input pixels x kernel, K = in channels / group,
                # N = out channels / group; Tensor Cores want K and N aligned.
                c_in, c_out_g = w[0], w[1]
                pixels = math.prod(x[2:]) * x[0]
                return (group, int(pixels * kernel), int(c_in // group), int(c_out_g)), 1
            c_out, c_in_g = w[0], w[1]
            pixels = math.prod(y[2:]) * y[0]
            return (group, int(pixels), int(c_in_g * kernel), int(c_out // group)), int(kernel)
    except (TypeError, IndexError, ValueError):
        return None, 1
    return None, 1


def _attention_dims(op_type, input_shapes, output_shapes, attrs) -> tuple[tuple[int, int, int, int], float] | None:
    """The GEMM that stands for an attention op, and the FLOPs of all its products.

    ``Attention`` (input [B, S, D], weights [D, Dq + Dk + Dv], past [2, B, N, P, H]): the QKV
    projection, which is its GEMM, then Q K^T and softmax(.) V over L = P + S keys. ``MultiHeadAttention``
    (query [B, S, Dq] or packed [B, S, N, 3, H]; key [B, L, Dk], [B, N, L, H] or packed [B, L, N, 2, H]):
    the two batched products alone, Q K^T of one head as its GEMM ([B x N, S, Dq / N, L]).
    """
    def shape(index):
        return input_shapes[index] if index < len(input_shapes) else None

    try:
        if op_type == "Attention":
            (batch, seq, hidden), (_, width) = shape(0), shape(1)
            q, _, v = attrs.get("qkv_hidden_sizes") or (width // 3,) * 3
            past = shape(4)
            keys = seq + (past[3] if past is not None and len(past) == 5 else 0)
            flops = 2.0 * batch * seq * (hidden * width + keys * (int(q) + int(v)))
            return (int(batch), int(seq), int(hidden), int(width)), flops
        heads = int(attrs["num_heads"])
        query, key, past = shape(0), shape(1), shape(6)
        if len(query) == 5:  # packed QKV
            batch, seq, _, _, head = query
            keys, q = seq, heads * head
        else:
            (batch, seq, q), keys = query, key[2] if len(key) == 4 else key[1]
        if past is not None and len(past) == 4 and key is not None and len(key) == 3:
            keys += past[2]
        v = output_shapes[0][-1]
        flops = 2.0 * batch * seq * keys * (q + v)
        return (int(batch * heads), int(seq), int(q // heads), int(keys)), flops
    except (KeyError, TypeError, IndexError, ValueError):
        return None
