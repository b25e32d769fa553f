"""Whether zero-padding a node's GEMM dims to multiples of 8 pays (analysis only).

Shared by the cost estimate (an fp16 node's time is the better of padded and unpadded, as
the paper's pass 1 weighs "fp16 on CUDA cores or on Tensor Cores") and by the padding pass that
applies it. See ``passes/pad_tensor_cores.py`` for the rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from onnxcampo.costdb.features import TENSOR_CORE_MULTIPLE

_UNSET = object()


@dataclass(frozen=True)
class PadPlan:
    rank: int  # rank of the activation input
    input_axis: int  # axis of the activation that holds K
    output_axis: int  # axis of the result that holds N
    weight_axes: tuple[int, int]  # (K axis, N axis) of the weight
    k: int
    k_padded: int
    n: int
    n_padded: int
    fp16_us: float  # unpadded fp16 time
    padded_us: float  # padded fp16 time plus the Pad/Slice time
    dynamic: bool = False  # the weight is computed in the graph: a Pad node pads it each run

    @property
    def gain_us(self) -> float:
        return self.fp16_us - self.padded_us


def round_up(value: int) -> int:
    return -(-value // TENSOR_CORE_MULTIPLE) * TENSOR_CORE_MULTIPLE


def pad_plan(ctx, node: gs.Node) -> PadPlan | None:
    """The padding that makes ``node`` faster in fp16, or None (cached per node)."""
    cache = ctx.__dict__.setdefault("_pad_plans", {})
    found = cache.get(node.name, _UNSET)
    if found is _UNSET:
        found = cache[node.name] = _compute(ctx, node)
    return found


def _layout(ctx, node: gs.Node, shape: tuple):
    if node.op == "MatMul" and len(shape) == 2:
        return shape[0], shape[1], (-1, -1, (0, 1))
    if node.op == "Gemm" and len(shape) == 2:
        k, n, axes = (shape[1], shape[0], (1, 0)) if int(node.attrs.get("transB", 0)) else (shape[0], shape[1], (0, 1))
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        # Only a bias of exactly [N] can be padded with N; a broadcast one ([1], [M, N]) cannot.
        if bias is not None and not (isinstance(bias, gs.Constant) and tuple(bias.shape) == (n,)):
            return None
        # transA: A is stored [K, M], K on its axis 0, and M is its row stride, which must be aligned
        # already (M is never padded)
        if int(node.attrs.get("transA", 0)):
            a = _static_shape(ctx, node, 0)
            if a is None or len(a) != 2 or a[1] % TENSOR_CORE_MULTIPLE:
                return None
            return k, n, (0, -1, axes)
        return k, n, (-1, -1, axes)
    if node.op in ("Conv", "ConvTranspose") and len(shape) >= 3 and int(node.attrs.get("group", 1)) == 1:
        # Conv weight [C_out, C_in, k...]; ConvTranspose weight [C_in, C_out, k...].
        k, n, axes = (shape[1], shape[0], (1, 0)) if node.op == "Conv" else (shape[0], shape[1], (0, 1))
        if node.op == "ConvTranspose" and any(node.attrs.get(a) for a in ("output_shape",)):
            return None  # an explicit output shape would have to be rewritten too
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None and not (isinstance(bias, gs.Constant) and tuple(bias.shape) == (n,)):
            return None
        return k, n, (1, 1, axes)
    return None


def _compute(ctx, node: gs.Node) -> PadPlan | None:
    features = ctx.features.get(node.name)
    if features is None or not features.known or features.gemm is None or features.tensor_core_aligned:
        return None
    if len(node.inputs) < 2:
        return None
    weight = node.inputs[1]
    dynamic = not isinstance(weight, gs.Constant)
    if dynamic and node.op not in ("MatMul", "Gemm"):
        return None
    shape = _static_shape(ctx, node, 1)
    if shape is None:
        return None
    layout = _layout(ctx, node, shape)
    if layout is None:
        return None
    k, n, (input_axis, output_axis, weight_axes) = layout
    source = ctx.info.get(ctx.original_inputs[node.name][0])
    if source is None or source.numel is None or source.shape is None:
        return None
    k2, n2 = round_up(k), round_up(n)
    _, m, gemm_k, _ = features.gemm
    padded = features.with_gemm(m, gemm_k // k * k2, n2)
    fp32 = ctx.fp32_us[node.name]
    before = ctx.cost.fp16_time(features, fp32)
    after = ctx.cost.fp16_time(padded, fp32)
    if k2 != k:
        after += ctx.cost.pad_time(source.numel * k2 // max(k, 1), "Pad")
    if n2 != n:
        after += ctx.cost.pad_time(features.elements_out, "Slice")
    if dynamic:  # a weight computed in the graph (a training step's) is padded by a Pad node each run
        after += ctx.cost.pad_time(k2 * n2, "Pad")
    if after >= before:
        return None
    return PadPlan(len(source.shape), input_axis, output_axis, weight_axes, k, k2, n, n2, before, after, dynamic)


def _static_shape(ctx, node: gs.Node, index: int) -> tuple[int, ...] | None:
    """The shape of the node's input ``index`` when every dim is known: a Constant's, else the
    shape inference's for the tensor the node read before the plan's Casts."""
    tensor = node.inputs[index]
    shape = tuple(tensor.shape) if isinstance(tensor, gs.Constant) else None
    if shape is None:
        originals = ctx.original_inputs.get(node.name) or ()
        entry = ctx.info.get(originals[index] if index < len(originals) else tensor.name)
        shape = tuple(entry.shape) if entry is not None and entry.shape is not None else None
    if shape is None or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    return shape
