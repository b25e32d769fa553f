"""Channels-last convolutions: a model's 2-D convolutions as ai.onnxcampo's NHWC ops.

cuDNN's float16 convolution kernels on Tensor Cores read and write NHWC; an NCHW graph pays a
layout transform of the input and output around every Conv, ConvTranspose and weight gradient
(on ResNet-50's b64 training step 3.3 of 14.6 GPU ms in PyTorch's NCHW step, none in its
channels_last one: ``docs/benchmarks/custom-ops/2026-12-02b/torch-layout.json``). This pass
(``channels_last``, ``--channels-last``) rewrites

- ``Conv`` (2-D; grouped and depthwise too, ``group`` kept) as ``ConvNhwc`` plus an ``Add`` of its
  bias over the last axis; an inference ``BatchNormalization`` that alone reads its output (all
  constants) folded into its filter and bias,
- onnx-ad's ``ConvTranspose`` of a Conv's input gradient (``output_shape`` given) as ``ConvNhwcDataGrad``,
- ``ConvWeightGrad`` as ``ConvNhwcWeightGrad`` and a ``Transpose`` of the small filter gradient
  back to ONNX's ``[Cout, Cin, kh, kw]``,

- a 2-D ``MaxPool`` as ``MaxPoolNhwc``, and onnx-ad's adjoint of it (a second MaxPool whose
  Indices, reshaped, index a scatter-add of the pooled gradient into zeros) as
  ``MaxPoolNhwcGrad``, which reads the argmax the forward op writes (one pooling, no scatter, no
  zero fill, no copy),

and stores every activation those ops touch channels-last, with the channel axis moved to the
end, together with all tensors connected to them through layout-agnostic nodes (elementwise ops,
Casts, reshapes that only add or drop unit dims, reductions, Expand, GlobalAveragePool, Concat and
Split, a nearest-mode Resize, whose axes, broadcast constants, scales and shapes it permutes; an
inference BatchNormalization not folded, as a Mul and an Add by per-channel constants). Where such
a tensor meets a node that reads a layout (Flatten, a linear Resize, a graph output, ...) one
``Transpose`` (or a free ``Reshape`` where the bytes agree) converts it; the filters get one
``Transpose`` each to cuDNN's ``[Cout, kh, kw, Cin / group]``.
A convolution with fewer input channels than ``align`` (8: the Tensor Core kernels' granule;
ResNet's 3-channel stem) gets its input and filter zero-padded to ``stem`` channels (8, or 4:
the layout cuDNN's ``image_first_layer`` kernels read; two ``Pad``s, its filter gradient sliced
back), when every Conv and weight gradient of its input converts; ``stem=0`` leaves the stem and
the pools NCHW, as before they were converted. The stem's input (the image, a float32 NCHW graph
input) then reaches it as ``Pad(Cast(Transpose(x)))``: that chain, where only it reads its
intermediate values, is one ``NchwToNhwc`` node (one pass over the image instead of three:
``conversions``). Other convolutions whose channel counts are not
multiples of ``align``, and float32 ones (cuDNN's NHWC float32 kernels are slower than its NCHW
TF32 ones), stay NCHW. A grouped Conv converts under the same rule and, unless depthwise (one input
channel a group: cuDNN's own kernels), with each group's channels multiples of ``align``; it is
never padded (a depthwise Conv of unaligned channels stays NCHW), and its input gradient stays NCHW
(the NHWC gradient ops are group 1). A Conv on 1 x 1 H and W (a squeeze-excitation gate's) stays NCHW:
both layouts hold the same bytes. Graph inputs and outputs keep their layout.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, oplists
from onnxcampo.context import written_info
from onnxcampo.ir.edit import attribute
from onnxcampo.ops import DOMAIN, nodes
from onnxcampo.ops.conv_nhwc import output_hw
from onnxcampo.ops.max_pool import pool_output_hw
from onnxcampo.plan import Precision
from onnxcampo.rewrites import elementwise
from onnxcampo.rewrites.matcher import GraphView

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from onnxcampo.casting import PrecisionOf
    from onnxcampo.context import GraphContext
    from onnxcampo.estimate import RewritePrediction

ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Where", "Relu", "LeakyRelu", "Sigmoid",
    "Tanh", "Erf", "Exp", "Log", "Sqrt", "Reciprocal", "Neg", "Abs", "Identity", "Cast", "Clip", "Greater",
    "GreaterOrEqual", "Less", "LessOrEqual", "Equal", "Not", "And", "Or", "IsNaN", "IsInf", "Softplus",
    "HardSigmoid", "HardSwish", "Gelu"})
REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin"})
ALIGN = 8
STEM_CHANNELS = (0, 4, 8)  # what a stem's input channels may be padded to (0: not converted)


@dataclass
class LayoutResult:
    """What :func:`to_channels_last` did."""

    convolutions: int = 0  # Conv -> ConvNhwc
    data_grads: int = 0  # ConvTranspose -> ConvNhwcDataGrad
    weight_grads: int = 0  # ConvWeightGrad -> ConvNhwcWeightGrad
    channels_last: int = 0  # activations stored channels-last
    transposes: int = 0  # Transposes of activations written (layout boundaries)
    filter_transposes: int = 0  # Transposes of filters and filter gradients
    padded: int = 0  # Convs and weight gradients whose input channels were zero-padded (a stem)
    pools: int = 0  # MaxPool -> MaxPoolNhwc
    pool_grads: int = 0  # MaxPool's indices + scatter-add adjoint -> MaxPoolNhwcGrad
    conversions: int = 0  # Transpose (+ Cast) (+ Pad) chains of a small-channel input -> NchwToNhwc
    grouped: int = 0  # of the convolutions, grouped or depthwise (group > 1)
    norms_folded: int = 0  # inference BatchNormalizations folded into the ConvNhwc they read
    norms: int = 0  # other inference BatchNormalizations of channels-last tensors -> Mul + Add
    stem_kept: str = ""  # why a stem (and so the pools) stayed NCHW, when it did
    left: dict[str, int] = field(default_factory=dict)  # convolutions kept NCHW, by reason

    def to_json(self) -> dict:
        return asdict(self)


def to_physical_perm(rank: int, c: int) -> list[int]:
    """The Transpose perm that stores a tensor of ``rank`` with its axis ``c`` last."""
    return [i for i in range(rank) if i != c] + [c]


def to_logical_perm(rank: int, c: int) -> list[int]:
    """The inverse of :func:`to_physical_perm`."""
    return [i if i < c else rank - 1 if i == c else i - 1 for i in range(rank)]


_FLOAT_TYPES = (TensorProto.FLOAT16, TensorProto.FLOAT)


def _moves_float(node: onnx.NodeProto) -> bool:
    """A Reshape or Cast of the default domain: what the pooling adjoint's walks pass through."""
    return node.domain in ("", "ai.onnx") and node.op_type in ("Reshape", "Cast")


def same_bytes(shape: list[int], perm: list[int]) -> bool:
    """Whether transposing a tensor of ``shape`` by ``perm`` leaves its bytes in place (a Reshape
    does it): the axes longer than 1 keep their order. Axes are compared, not their lengths: a
    [16, 3, 3, 3] filter moved to [16, 3, 3, 3] channels-last is a real transpose."""
    moved = [axis for axis in perm if shape[axis] != 1]
    return moved == sorted(moved)


def physical_shape(shape, c: int) -> list[int]:
    return [int(shape[p]) for p in to_physical_perm(len(shape), c)]


def _same_bytes(shape, c: int) -> bool:
    """True when moving axis ``c`` last keeps the element order (the dims after it are all 1)."""
    return all(int(d) == 1 for d in shape[c + 1:])


def _reshaped_channel(source, target, c: int) -> int | None:
    """Where a Reshape from ``source`` to ``target`` puts axis ``c`` when it keeps that axis whole
    (the dims before it and after it regroup among themselves only: then the Reshape of the
    channels-last tensors is the same Reshape); None when it does not."""
    before, size = int(np.prod(source[:c], dtype=np.int64)), int(source[c])
    after = int(np.prod(source[c + 1:], dtype=np.int64))
    prefix = 1
    for k, d in enumerate(target):
        if prefix == before and int(d) == size and int(np.prod(target[k + 1:], dtype=np.int64)) == after:
            return k
        prefix *= int(d)
        if prefix > before:
            return None
    return None


def _text(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute's value as text (``attribute`` gives ONNX's bytes)."""
    value = attribute(node, name, default)
    return value.decode() if isinstance(value, bytes) else value


def _set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])


def _ints(edit_constants, name: str) -> list[int] | None:
    tensor = edit_constants.get(name)
    return None if tensor is None else [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]


@dataclass(eq=False)
class _Pool:
    """A 2-D MaxPool as ``MaxPoolNhwc``: its forward node (writing ``y``), onnx-ad's adjoint of it
    when the graph has one (a second MaxPool whose Indices, reshaped, index a scatter-add of the
    gradient of ``y`` into zeros shaped like ``x``) as ``MaxPoolNhwcGrad`` reading the argmax the
    forward op writes. ``dy`` / ``dx`` are the gradients of ``y`` / ``x``, shaped like them or with
    trailing unit dims (onnx-ad's seed axis); the Reshapes and Casts between them and the scatter
    go, and so do the indices' Reshapes and the zeros."""

    x: str
    attrs: dict
    forward: onnx.NodeProto | None = None
    y: str | None = None
    indices: onnx.NodeProto | None = None  # the adjoint's MaxPool
    scatter: onnx.NodeProto | None = None
    dy: str | None = None
    dx: str | None = None
    members: list[onnx.NodeProto] = field(default_factory=list)  # every node the two ops replace
    argmax: str | None = None  # what MaxPoolNhwc writes for MaxPoolNhwcGrad

    def tensors(self) -> list[str]:
        return [t for t in (self.x, self.y, self.dy, self.dx) if t]


def _trails(shape, lead) -> bool:
    """True when ``shape`` is ``lead`` followed by unit dims only."""
    return (shape is not None and len(shape) >= len(lead) and [int(d) for d in shape[:len(lead)]] == [int(d) for d in lead]
            and all(int(d) == 1 for d in shape[len(lead):]))


def _count(shape) -> int | None:
    return None if shape is None else int(np.prod([int(d) for d in shape], dtype=np.int64))


class _Layout(GraphView):
    """The layout pass over one model: the shared matcher's tables (producers, readers, constants,
    the interface), and what the pass has made so far."""

    def __init__(self, model: onnx.ModelProto, info: dict, align: int, float32: bool = False, stem: int = ALIGN,
                 float16: Collection[str] | None = None):
        super().__init__(model, info, fresh_prefix="onnxcampo/nhwc")
        self.align, self.stem = align, stem
        self.dtypes = (TensorProto.FLOAT16, TensorProto.FLOAT) if float32 else (TensorProto.FLOAT16,)
        self.float16 = None if float16 is None else frozenset(float16)
        self.graph = model.graph
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
        self.external = self.edit.interface() | set(self.constants)
        self.chan: dict[str, int] = {}
        self.result = LayoutResult()
        self.out_nodes: list[onnx.NodeProto] = []
        self.value_infos: dict[str, tuple[int, list[int]]] = {}
        self.initializers: list[onnx.TensorProto] = []
        self.to_physical_cache: dict[tuple[str, int], str] = {}
        self.to_logical_cache: dict[str, str] = {}
        self.filter_cache: dict[str, str] = {}
        self.convs: dict[int, list[str]] = {}  # id(node) -> its activations
        self.pad_cin: dict[int, tuple[int, int]] = {}  # id(conv node) -> (Cin, Cin padded)
        self.pad_cache: dict[str, str] = {}
        self.pad_widths: dict[str, int] = {}  # Pad output -> zero channels appended (padded())
        self.pools: list[_Pool] = []
        self.pool_of: dict[int, _Pool] = {}  # id(node) -> the pool it is part of
        self.folded: set[int] = set()  # id(node) of the BatchNormalizations folded into a ConvNhwc
        self.unwritten: set[str] = set()  # the outputs of the Convs folded with them

    # ---- shapes ----------------------------------------------------------------------------
    def shape(self, name: str):
        return ir.static_shape(self.info, name)

    def dtype(self, name: str) -> int:
        if name in self.value_infos:
            return self.value_infos[name][0]
        return ir.tensor_dtype(self.info, name) or TensorProto.FLOAT

    # ---- which convolutions ----------------------------------------------------------------
    def activations(self, node: onnx.NodeProto) -> list[str] | str:
        """The activation tensors of a convertible convolution node (channel axis 1 each), or
        why it stays NCHW."""
        op = node.op_type
        group = 1
        if op == "Conv" and node.domain in ("", "ai.onnx"):
            x, w = node.input[0], node.input[1]
            if _text(node, "auto_pad", "NOTSET") != "NOTSET":
                return "auto_pad"
            xs, ws, ys = self.shape(x), self.shape(w), self.shape(node.output[0])
            if xs is None or ws is None or ys is None or len(xs) != 4 or len(ws) != 4:
                return "not 2-D with static shapes"
            if list(xs[2:]) == [1, 1] and list(ys[2:]) == [1, 1]:
                # a squeeze-excitation gate's Conv on pooled [N, C, 1, 1]: the same bytes in either
                # layout (free Reshapes at its edges), where an NHWC call would only add host time
                return "1x1 spatial (the same bytes in either layout)"
            group = int(attribute(node, "group", 1))
            channels = (xs[1], ws[0])
            tensors = [x, node.output[0]]
            if group != 1:
                # cuDNN's grouped NHWC kernels: a depthwise convolution (one input channel a group)
                # has its own; other groups run as Tensor Core GEMMs per group, whose channels
                # must each be aligned as a group-1 convolution's are
                if xs[1] % self.align or ws[0] % self.align:
                    return f"channels not multiples of {self.align}"
                if ws[1] != 1 and (ws[1] % self.align or (ws[0] // group) % self.align):
                    return f"grouped with channels a group not multiples of {self.align}"
        elif op == "ConvTranspose" and node.domain in ("", "ai.onnx"):
            dy, w = node.input[0], node.input[1]
            out_hw = attribute(node, "output_shape")
            if (attribute(node, "group", 1) != 1 or _text(node, "auto_pad", "NOTSET") != "NOTSET" or len(node.input) > 2
                    or any(attribute(node, "output_padding", [0, 0])) or not out_hw or len(out_hw) != 2):
                return "not a Conv's input gradient (group, bias, output_padding or no output_shape)"
            ds, ws, xs = self.shape(dy), self.shape(w), self.shape(node.output[0])
            if ds is None or ws is None or xs is None or len(ds) != 4 or len(ws) != 4:
                return "not 2-D with static shapes"
            pads = list(attribute(node, "pads", [0, 0, 0, 0]))
            if output_hw(out_hw[0], out_hw[1], ws[2:], attribute(node, "strides", [1, 1]),
                         attribute(node, "dilations", [1, 1]), pads) != tuple(ds[2:]):
                return "output_shape and pads are not a Conv's"
            channels = (ws[1], ws[0])
            tensors = [dy, node.output[0]]
        elif op == "ConvWeightGrad" and node.domain == DOMAIN:
            x, dy = node.input
            xs, ds = self.shape(x), self.shape(dy)
            if xs is None or ds is None or len(xs) != 4 or len(ds) != 4:
                return "not 2-D with static shapes"
            channels = (xs[1], ds[1])
            tensors = [x, dy]
        else:
            return "not a convolution"
        cin, cout = channels
        # A stem's few input channels (ResNet's 3) are zero-padded to `align`: its Conv and weight
        # gradient run channels-last, as what they feed does (an input gradient would need its
        # padding sliced off: those stay NCHW)
        pad = bool(self.stem) and op != "ConvTranspose" and group == 1 and cin < self.align and self.opset >= 11
        if cout % self.align or (cin % self.align and not pad):
            return f"channels not multiples of {self.align}"
        planned = self.float16 is not None and node.name in self.float16  # a plan's float16 node, Casts not made yet
        if not planned and self.dtype(tensors[0]) not in self.dtypes:
            # cuDNN's float32 NHWC kernels lose to its NCHW TF32 ones: ResNet-50 inference at
            # batch 1, campo's plan fp32, 0.92 ms for 31 convolutions against 0.18 ms for 16
            # (docs/benchmarks/custom-ops/2026-12-02c/probe-cl-inference-plain.json)
            return "float32 (only float16 convolutions run faster channels-last)"
        if cin % self.align:  # to `stem` channels (4 or 8) where they hold the input's, else to `align`
            self.pad_cin[id(node)] = (cin, self.stem if cin <= self.stem else self.align)
        return tensors

    # ---- marking ---------------------------------------------------------------------------
    def neighbours(self, node: onnx.NodeProto, tensor: str, c: int) -> dict[str, int] | None:
        """The channel axis of ``node``'s other tensors when ``tensor`` has it at ``c``; None when
        the node reads or writes a layout (a barrier)."""
        op = node.op_type
        pool = self.pool_of.get(id(node))
        if pool is not None:  # a MaxPool and its adjoint: channels at axis 1 of each of its tensors
            return {t: 1 for t in pool.tensors()} if c == 1 else None
        if node.domain not in ("", "ai.onnx"):
            return None
        shape = self.shape(tensor)
        if shape is None:
            return None
        rank = len(shape)
        if op in ELEMENTWISE or op == "GlobalAveragePool":
            out = {}
            for name in (*node.input, *node.output):
                s = self.shape(name) if name else None
                if s is not None and len(s) == rank:
                    out[name] = c
            return out
        if op == "BatchNormalization":  # an inference one: a per-channel scale and shift
            if c != 1 or self.batch_norm(node) is None:
                return None
            return {node.input[0]: 1, node.output[0]: 1}
        if op in ("Resize", "Concat", "Split"):
            if op == "Resize" and not self.resize_carries(node, rank):
                return None
            data = [n for n in (*(node.input[:1] if op != "Concat" else node.input), *node.output) if n]
            if any(self.shape(n) is None or len(self.shape(n)) != rank for n in data):
                return None
            return {n: c for n in data}
        if op == "Expand":
            target = _ints(self.constants, node.input[1])
            if target is None or len(target) != rank:
                return None
            other = [n for n in (node.input[0], node.output[0]) if self.shape(n) is not None and len(self.shape(n)) == rank]
            return {n: c for n in other} if len(other) == 2 else None
        if op == "Reshape":
            data, out = node.input[0], node.output[0]
            a, b = self.shape(data), self.shape(out)
            if a is None or b is None or _ints(self.constants, node.input[1]) is None:
                return None
            here, there = (a, b) if tensor == data else (b, a)
            mapped = _reshaped_channel(here, there, c)
            if mapped is None:
                return None
            return {data if tensor == out else out: mapped, tensor: c}
        if op in REDUCTIONS:
            data, out = node.input[0], node.output[0]
            axes = self.reduced_axes(node)
            a = self.shape(data)
            if axes is None or a is None:
                return None
            keep = attribute(node, "keepdims", 1)
            if tensor == data:
                if c in axes:
                    return None
                return {data: c, out: c if keep else c - sum(1 for x in axes if x < c)}
            if keep:
                return None if c in axes else {data: c, out: c}
            kept = [i for i in range(len(a)) if i not in axes]
            return {data: kept[c], out: c}
        return None

    def batch_norm(self, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
        """An inference BatchNormalization as ``y = x * a + b`` per channel (float64 ``a``, ``b``;
        ``a = scale / sqrt(var + epsilon)``, ``b = B - mean * a``); None when it is not one (training
        mode, running statistics written, parameters not constants)."""
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) != 5:
            return None
        if attribute(node, "training_mode", 0) or any(node.output[1:]) or not attribute(node, "spatial", 1):
            return None
        found = [self.constants.get(name) for name in node.input[1:]]
        xs = self.shape(node.input[0])
        if any(t is None for t in found) or xs is None or len(xs) < 3:
            return None
        scale, shift, mean, var = (numpy_helper.to_array(t).astype(np.float64).reshape(-1) for t in found)
        if any(v.size != int(xs[1]) for v in (scale, shift, mean, var)):
            return None
        a = scale / np.sqrt(var + float(attribute(node, "epsilon", 1e-5)))
        return a, shift - mean * a

    def resize_carries(self, node: onnx.NodeProto, rank: int) -> bool:
        """A Resize that reads no layout: ``nearest`` (the samples are per element; ORT's linear and
        cubic kernels resize only the trailing axes of NCHW), constant per-axis scales or sizes of
        the tensor's rank, no ``axes`` subset, no crop box."""
        if self.opset < 11 or _text(node, "mode", "nearest") != "nearest" or attribute(node, "axes") is not None:
            return False
        if _text(node, "coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
            return False
        if _text(node, "keep_aspect_ratio_policy", "stretch") != "stretch":
            return False
        given = [name for name in node.input[2:4] if name]
        for name in given:
            if name not in self.constants:
                return False
            size = int(np.prod(self.constants[name].dims, dtype=np.int64))
            if size not in (0, rank):
                return False
        return bool(given)

    def folded_norm(self, node: onnx.NodeProto) -> tuple[onnx.NodeProto, np.ndarray, np.ndarray] | None:
        """The inference BatchNormalization that alone reads a Conv's output, when it folds into the
        ConvNhwc (its filter and bias constants): (the norm, a, b) as :meth:`batch_norm` gives them."""
        y = node.output[0]
        reader = self.only_reader(y)
        if node.op_type != "Conv" or reader is None or reader.input[0] != y or node.input[1] not in self.constants:
            return None
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias and bias not in self.constants:
            return None
        found = self.batch_norm(reader)
        return None if found is None else (reader, *found)

    def reduced_axes(self, node: onnx.NodeProto) -> list[int] | None:
        """The axes a reduction reduces (all of them when it names none), normalized."""
        rank = len(self.shape(node.input[0]) or ())
        axes = attribute(node, "axes")
        if axes is None and len(node.input) > 1 and node.input[1]:
            axes = _ints(self.constants, node.input[1])
            if axes is None:
                return None
        if axes is None:
            return None if attribute(node, "noop_with_empty_axes", 0) else list(range(rank))
        return sorted(int(a) % rank for a in axes)

    # ---- max pooling -----------------------------------------------------------------------
    def pool_attrs(self, node: onnx.NodeProto) -> dict | None:
        """A MaxPool's attributes as MaxPoolNhwc takes them, or None when that op cannot run it."""
        if node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx"):
            return None
        xs = self.shape(node.input[0])
        kernel = [int(k) for k in attribute(node, "kernel_shape", []) or []]
        if xs is None or len(xs) != 4 or len(kernel) != 2 or kernel[0] * kernel[1] > 255:
            return None
        if (_text(node, "auto_pad", "NOTSET") != "NOTSET" or attribute(node, "ceil_mode", 0)
                or attribute(node, "storage_order", 0) or any(int(d) != 1 for d in attribute(node, "dilations", [1, 1]))):
            return None
        pads = [int(p) for p in attribute(node, "pads", [0, 0, 0, 0])]
        if len(pads) != 4 or any(p < 0 or p >= kernel[k % 2] for k, p in enumerate(pads)):
            return None
        if self.dtype(node.input[0]) not in (TensorProto.FLOAT16, TensorProto.FLOAT):
            return None
        return {"kernel_shape": kernel, "strides": [int(v) for v in attribute(node, "strides", [1, 1])], "pads": pads}

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        readers = self.consumers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.external else None

    def is_zeros(self, name: str) -> bool:
        if name in self.constants:
            return not np.any(numpy_helper.to_array(self.constants[name]))
        node = self.producers.get(name)
        if node is None or node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx"):
            return False
        value = attribute(node, "value")
        return value is None or not np.any(numpy_helper.to_array(value))

    def pool_adjoint(self, node: onnx.NodeProto, pool: _Pool) -> bool:
        """Fills ``pool`` from onnx-ad's adjoint reading ``node``'s Indices; False when the graph
        around them is not that pattern."""
        xs, ys = self.shape(pool.x), self.shape(node.output[0])
        if ys is None:
            return False
        chain = [node]
        name = node.output[1]
        while (reader := self.only_reader(name)) is not None and reader.op_type == "Reshape" and reader.domain in ("", "ai.onnx") \
                and reader.input[0] == name:
            chain.append(reader)
            name = reader.output[0]
        scatter = reader
        if scatter is None or len(scatter.input) != 3 or scatter.input[1] != name or not (
                (scatter.op_type == "ScatterNDAdd" and scatter.domain == DOMAIN)
                or (scatter.op_type == "ScatterND" and scatter.domain in ("", "ai.onnx")
                    and attribute(scatter, "reduction", "none") == "add")):
            return False
        data, index_shape = scatter.input[0], self.shape(name)
        ds = self.shape(data)
        # indices of one entry (the flat NCHW offset MaxPool's Indices hold) into zeros [count, 1...]
        if (ds is None or index_shape is None or index_shape[-1] != 1 or int(ds[0]) != _count(xs)
                or any(int(d) != 1 for d in ds[1:]) or _count(index_shape) != _count(ys) or not self.is_zeros(data)):
            return False
        chain.append(scatter)
        if self.only_reader(data) is scatter and data in self.producers:
            chain.append(self.producers[data])  # the zeros' ConstantOfShape
        # dy: back from the updates through Reshapes and Casts read by nothing else
        def back(name: str, walked: list) -> tuple[onnx.NodeProto, str] | None:
            producer = self.producers.get(name)
            if producer is None or self.only_reader(name) is not (walked[-1] if walked else scatter) \
                    or not _moves_float(producer) or self.dtype(producer.input[0]) not in _FLOAT_TYPES:
                return None
            return producer, producer.input[0]

        # dx: on from the scatter's output likewise
        def on(name: str, walked: list) -> tuple[onnx.NodeProto, str] | None:
            reader = self.only_reader(name)
            if reader is None or not _moves_float(reader) or reader.input[0] != name \
                    or self.dtype(reader.output[0]) not in _FLOAT_TYPES:
                return None
            return reader, reader.output[0]

        start = scatter.input[2]
        dy = self.walk_moves(start, ys, back) or ((start, []) if _trails(self.shape(start), ys) else None)
        dx = self.walk_moves(scatter.output[0], xs, on)
        if dy is None or dx is None:
            return False
        pool.indices, pool.scatter = node, scatter
        pool.dy, pool.dx = dy[0], dx[0]
        pool.members += chain + dy[1] + dx[1]
        return True

    def walk_moves(self, name: str, target, step) -> tuple[str, list] | None:
        """From ``name`` one node at a time (``step(name, walked)``: the next node and the tensor it
        leads to, or None) while the element count stays ``target``'s: the last tensor whose
        shape trails ``target``, with the nodes walked to it; None when none does."""
        walked, found = [], None
        while (moved := step(name, walked)) is not None:
            node, name = moved
            walked.append(node)
            if _count(self.shape(name)) != _count(target):
                break
            if _trails(self.shape(name), target):
                found = (name, list(walked))
        return found

    def find_pools(self) -> None:
        """The MaxPools MaxPoolNhwc can run, each paired with onnx-ad's adjoint of it (:class:`_Pool`)."""
        forwards: list[_Pool] = []
        adjoints: list[_Pool] = []
        for node in self.graph.node:
            attrs = self.pool_attrs(node)
            if attrs is None:
                continue
            pool = _Pool(node.input[0], attrs)
            if len(node.output) > 1 and node.output[1] and self.consumers.get(node.output[1]):
                if not self.pool_adjoint(node, pool):
                    continue
                adjoints.append(pool)
                if self.consumers.get(node.output[0]) or node.output[0] in self.external:
                    pool.forward, pool.y = node, node.output[0]
            else:
                pool.forward, pool.y, pool.members = node, node.output[0], [node]
                forwards.append(pool)
        order = {id(node): k for k, node in enumerate(self.graph.node)}
        for pool in adjoints:
            if pool.forward is None:
                twin = next((f for f in forwards if f.x == pool.x and f.attrs == pool.attrs
                             and order[id(f.forward)] < order[id(pool.scatter)]), None)
                if twin is not None:  # the forward pool writes the argmax too: one pooling, not two
                    forwards.remove(twin)
                    pool.forward, pool.y = twin.forward, twin.y
                    pool.members.append(twin.forward)
        self.pools = forwards + adjoints
        self.pool_of = {id(node): pool for pool in self.pools for node in pool.members}

    def pool_node(self, node: onnx.NodeProto, pool: _Pool) -> None:
        """``node`` of a channels-last ``pool``: the first writes MaxPoolNhwc, the scatter
        MaxPoolNhwcGrad, the others go."""
        xs = self.shape(pool.x)
        ho, wo = pool_output_hw(xs[2], xs[3], pool.attrs["kernel_shape"], pool.attrs["strides"], pool.attrs["pads"])
        pooled = [xs[0], ho, wo, xs[1]]
        first = pool.forward or pool.indices
        if node is first:
            if pool.y:
                y, convert = self.output_name(pool.y, 1)
            else:
                y, convert = self.edit.fresh("pooled"), False
            self.record(y, self.dtype(pool.x), pooled)
            argmax = None
            if pool.scatter is not None:
                argmax = pool.argmax = self.edit.fresh("argmax")
                self.record(argmax, TensorProto.UINT8, pooled)
            self.out_nodes.append(nodes.max_pool_nhwc(self.physical(pool.x, 1), output=y, argmax=argmax,
                                                      name=first.name or self.edit.fresh("MaxPoolNhwc"), **pool.attrs))
            self.result.pools += 1
            if convert:
                self.finish_output(pool.y, y, 1)
        elif node is pool.scatter:
            dtype = self.dtype(pool.dy)
            dy = self.physical(pool.dy, 1)
            if len(self.shape(pool.dy)) != 4:  # [N, Ho, Wo, 1.., C] -> [N, Ho, Wo, C]: the same bytes
                flat = self.edit.fresh("dy")
                self.add("Reshape", [dy, self.add_constant(np.array(pooled, np.int64), "shape")], flat)
                self.record(flat, dtype, pooled)
                dy = flat
            out, convert = self.output_name(pool.dx, 1)
            steps = (["Cast"] if self.dtype(pool.dx) != dtype else []) + (["Reshape"] if len(self.shape(pool.dx)) != 4 else [])
            dx = out if not steps else self.edit.fresh("dx")
            self.out_nodes.append(nodes.max_pool_nhwc_grad(dy, pool.argmax, output=dx, input_spatial=list(xs[2:]),
                                                           name=node.name or self.edit.fresh("MaxPoolNhwcGrad"),
                                                           **pool.attrs))
            self.record(dx, dtype, [xs[0], xs[2], xs[3], xs[1]])
            for k, step in enumerate(steps):
                written = out if k == len(steps) - 1 else self.edit.fresh("dx")
                if step == "Cast":
                    dtype = self.dtype(pool.dx)
                    self.add("Cast", [dx], written, to=dtype)
                    self.record(written, dtype, [xs[0], xs[2], xs[3], xs[1]])
                else:
                    target = physical_shape(self.shape(pool.dx), 1)
                    self.add("Reshape", [dx, self.add_constant(np.array(target, np.int64), "shape")], written)
                    self.record(written, dtype, target)
                dx = written
            self.result.pool_grads += 1
            if convert:
                self.finish_output(pool.dx, out, 1)

    def mark(self, seeds: list[str]) -> None:
        queue: deque[str] = deque()

        def visit(name: str, c: int) -> None:
            if name in self.external or name in self.chan or self.shape(name) is None:
                return
            self.chan[name] = c
            queue.append(name)

        for name in seeds:
            visit(name, 1)
        while queue:
            name = queue.popleft()
            c = self.chan[name]
            around = ([self.producers[name]] if name in self.producers else []) + self.consumers.get(name, [])
            for node in around:
                if id(node) in self.convs:
                    continue
                found = self.neighbours(node, name, c)
                for other, axis in (found or {}).items():
                    if other and other != name and self.chan.get(other, axis) == axis:
                        visit(other, axis)

    # ---- writing ---------------------------------------------------------------------------
    def add(self, op: str, inputs: list[str], output: str, *, domain: str = "", **attrs) -> None:
        self.out_nodes.append(helper.make_node(op, inputs, [output], name=self.edit.fresh(op), domain=domain, **attrs))

    def add_constant(self, value: np.ndarray, stem: str) -> str:
        name = self.edit.fresh(stem)
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def record(self, name: str, dtype: int, shape) -> None:
        self.value_infos[name] = (dtype, [int(d) for d in shape])

    def physical(self, name: str, c: int, shape=None) -> str:
        """``name`` (logical, shaped ``shape``: its own unless given, for a broadcast operand
        right-aligned to a higher rank) stored with axis ``c`` last."""
        if shape is None and self.chan.get(name) == c:
            return name
        if shape is None and name in self.chan:
            name = self.logical(name)
        logical = list(shape if shape is not None else self.shape(name))
        key = (name, c) if shape is None else (f"{name}|{logical}", c)
        if key in self.to_physical_cache:
            return self.to_physical_cache[key]
        target = physical_shape(logical, c)
        if name in self.constants:
            value = numpy_helper.to_array(self.constants[name]).reshape(logical)
            out = self.add_constant(np.ascontiguousarray(value.transpose(to_physical_perm(len(logical), c))), "permuted")
        else:
            source = name
            if shape is not None and list(self.shape(name)) != logical:
                source = self.edit.fresh("unsqueezed")
                self.add("Reshape", [name, self.add_constant(np.array(logical, np.int64), "shape")], source)
                self.record(source, self.dtype(name), logical)
            out = self.edit.fresh("nhwc")
            if same_bytes(logical, to_physical_perm(len(logical), c)):
                self.add("Reshape", [source, self.add_constant(np.array(target, np.int64), "shape")], out)
            else:
                self.add("Transpose", [source], out, perm=to_physical_perm(len(logical), c))
                self.result.transposes += 1
            self.record(out, self.dtype(name), target)
        self.to_physical_cache[key] = out
        return out

    def logical(self, name: str) -> str:
        """A channels-last ``name`` in its own (logical) layout."""
        if name not in self.chan:
            return name
        c, shape = self.chan[name], self.shape(name)
        if c == len(shape) - 1:
            return name
        if name not in self.to_logical_cache:
            out = self.edit.fresh("nchw")
            self.convert(name, out, shape, c, to_logical=True)
            self.to_logical_cache[name] = out
        return self.to_logical_cache[name]

    def filter_move(self, source: str, target: str, shape: list[int], perm: list[int]) -> None:
        """``target`` (shaped ``shape``) = ``source`` between [Cout, Cin, kh, kw] and [Cout, kh, kw,
        Cin]: a Reshape for a 1x1 filter (the same bytes), else a Transpose."""
        if same_bytes([shape[perm.index(axis)] for axis in range(4)], perm):  # the source's shape
            self.add("Reshape", [source, self.add_constant(np.array(shape, np.int64), "shape")], target)
        else:
            self.add("Transpose", [source], target, perm=perm)
            self.result.filter_transposes += 1
        self.record(target, self.dtype(source), shape)

    def krsc(self, w: str) -> str:
        """A filter [Cout, Cin, kh, kw] as [Cout, kh, kw, Cin]."""
        if w not in self.filter_cache:
            shape = self.shape(w)
            if w in self.constants:
                value = numpy_helper.to_array(self.constants[w])
                out = self.add_constant(np.ascontiguousarray(value.transpose(0, 2, 3, 1)), "krsc")
            else:
                out = self.edit.fresh("krsc")
                self.filter_move(w, out, [shape[0], shape[2], shape[3], shape[1]], [0, 2, 3, 1])
            self.filter_cache[w] = out
        return self.filter_cache[w]

    @staticmethod
    def pad_to(channels: int, align: int) -> int:
        return -(-channels // align) * align

    def padded(self, name: str, channels: int, align: int) -> str:
        """A channels-last tensor (an activation or a KRSC filter; ``channels`` last) with zero
        channels appended up to a multiple of ``align``."""
        if name not in self.pad_cache:
            made = {t.name: t for t in self.initializers}
            if name in self.value_infos:
                shape = list(self.value_infos[name][1])
            elif name in made:
                shape = list(made[name].dims)
            else:
                shape = physical_shape(self.shape(name), self.chan[name]) if name in self.chan else list(self.shape(name))
            target = shape[:-1] + [self.pad_to(channels, align)]
            constant = made.get(name, self.constants.get(name))
            if constant is not None:
                value = numpy_helper.to_array(constant)
                widths = [(0, 0)] * (len(shape) - 1) + [(0, target[-1] - channels)]
                out = self.add_constant(np.pad(value, widths), "padded")
            else:
                out = self.edit.fresh("padded")
                pads = [0] * (2 * len(shape))
                pads[2 * len(shape) - 1] = target[-1] - channels
                self.add("Pad", [name, self.add_constant(np.array(pads, np.int64), "pads")], out, mode="constant")
                self.pad_widths[out] = target[-1] - channels
                self.record(out, self.dtype(name), target)
            self.pad_cache[name] = out
        return self.pad_cache[name]

    def convert(self, source: str, target: str, logical_shape, c: int, *, to_logical: bool) -> None:
        """``target`` = ``source`` moved between its logical layout (``logical_shape``) and
        channels-last at ``c``: a Reshape where the bytes agree, else a Transpose."""
        rank = len(logical_shape)
        shape = list(logical_shape) if to_logical else physical_shape(logical_shape, c)
        if _same_bytes(logical_shape, c):
            self.add("Reshape", [source, self.add_constant(np.array(shape, np.int64), "shape")], target)
        else:
            self.add("Transpose", [source], target, perm=to_logical_perm(rank, c) if to_logical else to_physical_perm(rank, c))
            self.result.transposes += 1
        self.record(target, self.dtype(source), shape)

    def output_name(self, name: str, c: int) -> tuple[str, bool]:
        """Where a rewritten node writes ``name`` (channels-last at ``c``): the name itself when it
        is marked, else a fresh one converted to ``name`` after the node (second value True)."""
        if self.chan.get(name) == c:
            return name, False
        return self.edit.fresh("nhwc_out"), True

    def finish_output(self, name: str, written: str, c: int) -> None:
        """``name`` (kept in its layout: a graph output, a barrier's input) from ``written``, its
        channels-last value."""
        shape = self.shape(name)
        self.record(written, self.dtype(name), physical_shape(shape, c))
        self.convert(written, name, shape, c, to_logical=True)

    def conv_node(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        attrs = {"strides": list(attribute(node, "strides", [1, 1])), "dilations": list(attribute(node, "dilations", [1, 1])),
                 "pads": list(attribute(node, "pads", [0, 0, 0, 0]))}
        pad = self.pad_cin.get(id(node))
        if op == "Conv":
            x, w = node.input[0], node.input[1]
            kernel = list(self.shape(w)[2:])
            y = node.output[0]
            bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
            x_in = self.physical(x, 1)
            norm = self.folded_norm(node)
            if norm is None:
                w_in = self.krsc(w)
            else:  # Conv + BatchNormalization as one ConvNhwc: the filter scaled, the bias shifted
                bn, a, b = norm
                self.folded.add(id(bn))
                filter_value = numpy_helper.to_array(self.constants[w])
                scaled = filter_value.astype(np.float64).transpose(0, 2, 3, 1) * a[:, None, None, None]
                w_in = self.add_constant(np.ascontiguousarray(scaled.astype(filter_value.dtype)), "krsc_folded")
                shift = b + (numpy_helper.to_array(self.constants[bias]).astype(np.float64) * a if bias else 0.0)
                bias = self.add_constant(shift.astype(helper.tensor_dtype_to_np_dtype(self.dtype(y))), "bias_folded")
                self.unwritten.add(y)
                y = bn.output[0]
                self.result.norms_folded += 1
            out, convert = self.output_name(y, 1)
            conv_out = self.edit.fresh("conv") if bias else out
            if pad:
                x_in, w_in = self.padded(x_in, *pad), self.padded(w_in, *pad)
                self.result.padded += 1
            self.out_nodes.append(nodes.conv_nhwc(x_in, w_in, output=conv_out, kernel_shape=kernel,
                                                  group=int(attribute(node, "group", 1)),
                                                  name=node.name or self.edit.fresh("ConvNhwc"), **attrs))
            self.record(conv_out, self.dtype(y), physical_shape(self.shape(y), 1))
            if bias:
                self.add("Add", [conv_out, bias], out)
                self.record(out, self.dtype(y), physical_shape(self.shape(y), 1))
            if convert:
                self.finish_output(y, out, 1)
            self.result.convolutions += 1
            self.result.grouped += int(attribute(node, "group", 1)) != 1
        elif op == "ConvTranspose":
            dy, w = node.input[0], node.input[1]
            dx = node.output[0]
            out, convert = self.output_name(dx, 1)
            self.out_nodes.append(nodes.conv_nhwc_data_grad(
                self.physical(dy, 1), self.krsc(w), output=out, input_spatial=list(attribute(node, "output_shape")),
                kernel_shape=list(self.shape(w)[2:]), name=node.name or self.edit.fresh("ConvNhwcDataGrad"), **attrs))
            self.record(out, self.dtype(dx), physical_shape(self.shape(dx), 1))
            if convert:
                self.finish_output(dx, out, 1)
            self.result.data_grads += 1
        else:  # ConvWeightGrad
            x, dy = node.input
            dw = node.output[0]
            shape = self.shape(dw) or [self.shape(dy)[1], self.shape(x)[1], *attribute(node, "kernel_shape")]
            krsc = self.edit.fresh("dw_krsc")
            x_in = self.physical(x, 1)
            if pad:
                x_in = self.padded(x_in, *pad)
            self.out_nodes.append(nodes.conv_nhwc_weight_grad(
                x_in, self.physical(dy, 1), output=krsc, kernel_shape=list(attribute(node, "kernel_shape")),
                name=node.name or self.edit.fresh("ConvNhwcWeightGrad"), **attrs))
            krsc_shape = [shape[0], shape[2], shape[3], shape[1]]
            if pad:  # the padded channels' gradient sliced off
                self.record(krsc, self.dtype(x), krsc_shape[:3] + [self.pad_to(*pad)])
                sliced = self.edit.fresh("dw_krsc")
                self.add("Slice", [krsc, self.add_constant(np.array([0], np.int64), "starts"),
                                   self.add_constant(np.array([pad[0]], np.int64), "ends"),
                                   self.add_constant(np.array([3], np.int64), "axes")], sliced)
                krsc = sliced
                self.result.padded += 1
            self.record(krsc, self.dtype(x), krsc_shape)
            self.filter_move(krsc, dw, list(shape), [0, 3, 1, 2])
            self.result.weight_grads += 1

    def agnostic_node(self, node: onnx.NodeProto, c: int) -> None:
        """``node`` (layout-agnostic, its output channels-last at ``c``) on channels-last operands."""
        op = node.op_type
        out_name = node.output[0]
        rank = len(self.shape(out_name))
        made = onnx.NodeProto()
        made.CopyFrom(node)
        if op in ELEMENTWISE:
            for k, name in enumerate(node.input):
                shape = self.shape(name) if name else None
                if not name or shape is None:
                    continue
                if len(shape) == rank:
                    made.input[k] = self.physical(name, c)
                elif int(np.prod(shape)) != 1:
                    made.input[k] = self.physical(name, c, [1] * (rank - len(shape)) + list(shape))
        elif op == "GlobalAveragePool":
            made = self.reduce_mean(node.input[0], out_name, c)
        elif op == "BatchNormalization":  # x * a + b over the last (channel) axis
            a, b = self.batch_norm(node)
            dtype = helper.tensor_dtype_to_np_dtype(self.dtype(node.input[0]))
            scaled = self.edit.fresh("norm_scaled")
            self.add("Mul", [self.physical(node.input[0], c), self.add_constant(a.astype(dtype), "norm_scale")], scaled)
            self.record(scaled, self.dtype(node.input[0]), physical_shape(self.shape(out_name), c))
            made = helper.make_node("Add", [scaled, self.add_constant(b.astype(dtype), "norm_shift")], [out_name],
                                    name=node.name or self.edit.fresh("Add"))
            self.result.norms += 1
        elif op == "Resize":
            perm = to_physical_perm(rank, c)
            made.input[0] = self.physical(node.input[0], c)
            for k in (2, 3):
                if k < len(node.input) and node.input[k]:
                    value = numpy_helper.to_array(self.constants[node.input[k]]).reshape(-1)
                    if value.size == rank:
                        made.input[k] = self.add_constant(np.ascontiguousarray(value[perm]), "resized")
        elif op in ("Concat", "Split"):
            axis = int(attribute(node, "axis", 0)) % rank
            for k in range(len(node.input) if op == "Concat" else 1):
                made.input[k] = self.physical(node.input[k], c)
            _set_attribute(made, "axis", to_physical_perm(rank, c).index(axis))
        elif op == "Expand":
            made.input[0] = self.physical(node.input[0], c)
            made.input[1] = self.add_constant(np.array(physical_shape(_ints(self.constants, node.input[1]), c), np.int64), "shape")
        elif op == "Reshape":
            c_in = self.neighbours(node, out_name, c)[node.input[0]]
            made.input[0] = self.physical(node.input[0], c_in)
            made.input[1] = self.add_constant(np.array(physical_shape(self.shape(out_name), c), np.int64), "shape")
        elif op in REDUCTIONS:
            c_in = self.neighbours(node, out_name, c)[node.input[0]]
            made.input[0] = self.physical(node.input[0], c_in)
            perm = to_physical_perm(len(self.shape(node.input[0])), c_in)
            axes = sorted(perm.index(a) for a in self.reduced_axes(node))
            if attribute(node, "axes") is not None:
                del made.attribute[:]
                made.attribute.extend([a for a in node.attribute if a.name != "axes"] + [helper.make_attribute("axes", axes)])
            else:
                while len(made.input) < 2:
                    made.input.append("")
                made.input[1] = self.add_constant(np.array(axes, np.int64), "axes")
        renamed = []
        for k, name in enumerate(node.output):
            if name and self.chan.get(name) != c:
                made.output[k] = self.edit.fresh("nhwc_out")
                renamed.append((name, made.output[k]))
            elif name:
                self.record(name, self.dtype(name), physical_shape(self.shape(name), c))
        self.out_nodes.append(made)
        for name, written in renamed:
            self.finish_output(name, written, c)

    def reduce_mean(self, x: str, y: str, c: int) -> onnx.NodeProto:
        """GlobalAveragePool of a channels-last x at ``c``: ReduceMean over the other non-batch axes."""
        rank = len(self.shape(x))
        axes = [to_physical_perm(rank, c).index(a) for a in range(2, rank)]
        if self.opset >= 18:
            return helper.make_node("ReduceMean", [self.physical(x, c), self.add_constant(np.array(axes, np.int64), "axes")], [y],
                                    name=self.edit.fresh("ReduceMean"), keepdims=1)
        return helper.make_node("ReduceMean", [self.physical(x, c)], [y], name=self.edit.fresh("ReduceMean"),
                                axes=axes, keepdims=1)

    def barrier_node(self, node: onnx.NodeProto) -> None:
        """A node that reads a layout: its channels-last inputs converted back, its channels-last
        outputs (a convolution's input made here) converted after it."""
        if node.op_type == "Shape" and node.input[0] in self.chan and len(node.input) == 1 and not node.attribute:
            value = np.array(self.shape(node.input[0]), np.int64)
            self.out_nodes.append(helper.make_node("Constant", [], [node.output[0]], name=node.name or self.edit.fresh("Shape"),
                                                   value=numpy_helper.from_array(value)))
            return
        made = onnx.NodeProto()
        made.CopyFrom(node)
        for k, name in enumerate(node.input):
            if name in self.chan:
                made.input[k] = self.logical(name)
        written = []
        for k, name in enumerate(node.output):
            if name in self.chan:
                made.output[k] = self.edit.fresh("nchw_out")
                self.info[made.output[k]] = self.info[name]
                written.append((name, made.output[k]))
        self.out_nodes.append(made)
        for name, logical in written:
            self.convert(logical, name, self.shape(name), self.chan[name], to_logical=False)

    def merge_reduce_sums(self) -> None:
        """A channels-last ReduceSum (keepdims 0) read only by another ReduceSum (keepdims 0) as
        one ReduceSum over both's axes: the step's bias gradients sum [N, C, H*W] over H*W, then
        over N; channels-last that is [N, H*W, C] over H*W (a middle axis) then N, which as one
        sum over the leading block [N, H*W] is what --fuse-reductions writes as one kernel."""
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.out_nodes:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        constants = {t.name: t for t in self.initializers} | self.constants
        gone: set[int] = set()
        for first in self.out_nodes:
            if (first.op_type != "ReduceSum" or id(first) in gone or attribute(first, "keepdims", 1) != 0
                    or first.input[0] not in self.chan or len(first.input) < 2):
                continue
            middle = first.output[0]
            after = readers.get(middle, [])
            if len(after) != 1 or middle in self.external:
                continue
            second = after[0]
            if (second.op_type != "ReduceSum" or attribute(second, "keepdims", 1) != 0 or len(second.input) < 2
                    or second.input[0] != middle or attribute(second, "noop_with_empty_axes", 0)):
                continue
            a1, a2 = _ints(constants, first.input[1]), _ints(constants, second.input[1])
            rank = len(self.value_infos.get(first.input[0], (0, self.shape(first.input[0])))[1])
            if a1 is None or a2 is None or not rank:
                continue
            a1 = sorted(a % rank for a in a1)
            kept = [i for i in range(rank) if i not in a1]
            merged = sorted(a1 + [kept[a % len(kept)] for a in a2])
            second.input[0] = first.input[0]
            second.input[1] = self.add_constant(np.array(merged, np.int64), "axes")
            gone.add(id(first))
            self.value_infos.pop(middle, None)
        self.out_nodes = [n for n in self.out_nodes if id(n) not in gone]

    def fold_conversions(self) -> None:
        """A Transpose to channels-last of a tensor of fewer than ``align`` channels, the float Cast
        that alone reads it and the zero Pad of the last axis that alone reads that (the stem's
        image: ``Pad(Cast(Transpose(x)))``, each an ORT kernel and a pass over memory) as one
        ``NchwToNhwc`` writing the last one's output. Only chains with a Cast or a Pad (a lone
        Transpose stays ORT's)."""
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.out_nodes:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        declared = {o.name for o in self.graph.output}

        def only_reader(name: str, op: str) -> onnx.NodeProto | None:
            found = readers.get(name, [])
            if name in declared or len(found) != 1 or found[0].op_type != op or found[0].domain not in ("", "ai.onnx"):
                return None
            return found[0]

        made: dict[int, onnx.NodeProto] = {}  # id of the chain's first node -> the NchwToNhwc
        gone: set[int] = set()
        unwritten: set[str] = set()  # the chains' intermediate values
        for node in self.out_nodes:
            if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
                continue
            source = self.shape(node.input[0])
            rank = len(source) if source is not None else 0
            if rank < 3 or list(attribute(node, "perm", [])) != to_physical_perm(rank, 1):
                continue
            channels_in = source[1]
            if not isinstance(channels_in, int) or channels_in >= self.align:
                continue
            chain, last, to, channels = [node], node.output[0], self.dtype(node.input[0]), channels_in
            cast = only_reader(last, "Cast")
            if cast is not None and attribute(cast, "to") in (TensorProto.FLOAT, TensorProto.FLOAT16):
                chain.append(cast)
                last, to = cast.output[0], int(attribute(cast, "to"))
            pad = only_reader(last, "Pad")
            if pad is not None and pad.output[0] in self.pad_widths:  # a Pad padded() wrote: zeros, last axis
                chain.append(pad)
                channels = channels_in + int(self.pad_widths[pad.output[0]])
                last = pad.output[0]
            if len(chain) == 1 or to not in (TensorProto.FLOAT, TensorProto.FLOAT16):
                continue
            made[id(node)] = nodes.nchw_to_nhwc(node.input[0], output=last, to=to,
                                                channels=channels if channels != channels_in else None,
                                                name=self.edit.fresh("NchwToNhwc"))
            gone.update(id(n) for n in chain[1:])
            unwritten.update(n.output[0] for n in chain[:-1])
            self.result.conversions += 1
        if made:
            dropped = {i for n in self.out_nodes if id(n) in gone for i in n.input[1:]}
            self.out_nodes = [made.get(id(n), n) for n in self.out_nodes if id(n) not in gone]
            read = {i for n in self.out_nodes for i in n.input}
            self.initializers = [t for t in self.initializers if t.name not in dropped or t.name in read]
            for name in unwritten:
                self.value_infos.pop(name, None)

    def find_convs(self) -> dict[int, list[str]]:
        convs: dict[int, list[str]] = {}
        self.result.left.clear()
        self.pad_cin.clear()
        for node in self.graph.node:
            found = self.activations(node)
            if isinstance(found, str):
                if found != "not a convolution":
                    self.result.left[found] = self.result.left.get(found, 0) + 1
                continue
            convs[id(node)] = found
        return convs

    def stem_converts_whole(self, convs: dict[int, list[str]]) -> bool:
        """True when every Conv and weight gradient reading a padded stem's input converts: a stem
        Conv channels-last beside a weight gradient kept NCHW (float32 in the plan) would cost a
        Transpose of the stem's full-size gradient, more than the pool's boundary it saves."""
        padded = {n.input[0] for n in self.graph.node if id(n) in self.pad_cin}
        for name in list(padded):  # the image before its Cast: a float32 weight gradient reads that
            producer = self.producers.get(name)
            if producer is not None and producer.op_type == "Cast" and producer.domain in ("", "ai.onnx"):
                padded.add(producer.input[0])
        readers = [n for name in padded for n in self.consumers.get(name, [])
                   if n.op_type in ("Conv", "ConvWeightGrad") and n.input[0] == name]
        return all(id(n) in convs for n in readers)

    def run(self) -> LayoutResult:
        convs = self.convs = self.find_convs()
        if self.stem and self.pad_cin and not self.stem_converts_whole(convs):
            self.stem = 0  # the stem and the pools stay NCHW, as with stem=0
            self.result.stem_kept = "a weight gradient of the stem's input stays NCHW (float32)"
            convs = self.convs = self.find_convs()
        if not convs:
            return self.result
        if self.stem:
            self.find_pools()
        self.mark([t for found in convs.values() for t in found])
        for node in self.graph.node:
            if id(node) in self.folded:  # written by its ConvNhwc
                continue
            if id(node) in convs:
                self.conv_node(node)
                continue
            pool = self.pool_of.get(id(node))
            if pool is not None and any(t in self.chan for t in pool.tensors()):
                self.pool_node(node, pool)
                continue
            outs = [o for o in node.output if o in self.chan]
            if outs and self.neighbours(node, outs[0], self.chan[outs[0]]) is not None:
                self.agnostic_node(node, self.chan[outs[0]])
            else:
                self.barrier_node(node)
        self.result.channels_last = len(self.chan)
        self.merge_reduce_sums()
        self.fold_conversions()
        del self.graph.node[:]
        self.graph.node.extend(self.out_nodes)
        read = {name for node in self.out_nodes for name in node.input}
        self.graph.initializer.extend(t for t in self.initializers if t.name in read)  # a folded filter's, padded: not
        declared = {o.name for o in self.graph.output}
        kept = [v for v in self.graph.value_info if v.name not in self.value_infos and v.name not in self.unwritten]
        made = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in self.value_infos.items()
                if name not in declared]
        del self.graph.value_info[:]
        self.graph.value_info.extend(kept + made)
        ir.record_value_infos(self.info, made)
        self.edit.drop_unread(set(self.constants))
        return self.result


def to_channels_last(model: onnx.ModelProto, info: dict | None = None, *, align: int = ALIGN,
                     float32: bool = False, stem: int = ALIGN, float16: Collection[str] | None = None) -> LayoutResult:
    """Rewrite ``model`` in place (module docstring); ``info``: its tensor types and shapes
    (``ir.infer_tensor_info``), inferred here when not given; updated with what the rewrite makes.
    ``float32``: float32 convolutions too (slower on cuDNN than NCHW; the rewrite checked in
    float32, as ORT's CPU provider computes it exactly). ``stem`` (``STEM_CHANNELS``): pad the
    input channels of a convolution with fewer than ``align`` (a stem) to that many (4 or 8) and
    run the MaxPools between channels-last tensors (and onnx-ad's adjoints of them) as
    MaxPoolNhwc / MaxPoolNhwcGrad; 0 keeps both NCHW, as before they existed (the benchmark's A/B).
    ``float16``: names of convolutions to treat as float16 whatever their tensors' types (a precision
    plan's, on the planning graph before its Casts exist: what ``onnxcampo.estimate`` prices)."""
    if stem not in STEM_CHANNELS:
        raise ValueError(f"stem must be one of {', '.join(map(str, STEM_CHANNELS))} (channels a stem's input is "
                         f"padded to; 0: the stem and pools stay NCHW), not {stem!r}")
    if info is None:
        info, _ = ir.infer_tensor_info(model)
    layout = _Layout(model, info, align, float32, stem, float16)
    result = layout.run()
    if result.convolutions or result.data_grads or result.weight_grads:
        nodes.import_domain(model)
    return result



# --- the prediction: what channels-last changes in a plan's run (``onnxcampo.estimate``) ---------


def costed(ctx: GraphContext) -> bool:
    """Whether the plan is costed channels-last: ``channels_last`` on an inference model, unless
    ``plan_for_fusion=False`` asks for the plan as if no rewrite ran. A training step's plans are
    costed NCHW (its gradient convolutions' NHWC calls are not priced, and the Trainer replays the
    step, where their host time is not paid)."""
    config = ctx.config
    return bool(config.channels_last and config.experimental.plan_for_fusion
                and not ctx.training_fp32)


def predict(ctx: GraphContext, plan) -> RewritePrediction:
    """``channels_last``: the plan's total with the layout pass's changes (:func:`layout_change`)
    and without them."""
    from onnxcampo import estimate

    return estimate.with_and_without(ctx, plan, "channels_last")


# Host time of one ConvNhwc (or ConvNhwcDataGrad) call through cuDNN's legacy convolution calls
# (the default, ONNXCAMPO_CUDNN_API), which cost the host far more than ORT's own Conv launch.
# Measured on the H200 (ResNet-50 b64 inference, FusedElementwise and channels-last): run plainly
# 6.42 ms, replayed as a CUDA graph 2.85 ms, the difference over its 53 convolutions about 60 us a
# call after the other launches (docs/benchmarks/raw/h200.jsonl; docs/ops.md has ~85 us for the
# same API).
CONV_NHWC_HOST_US = 60.0


def nhwc_call_us(cost) -> float:
    """Host time of one NHWC convolution call under the cuDNN API this process's sessions use
    (``onnxcampo.ops.conv_nhwc.cudnn_api``): the database's measurement of that API's calls
    (``costdb calibrate``: ``conv_nhwc`` or ``conv_nhwc_graph``), else :data:`CONV_NHWC_HOST_US`
    for the legacy calls and a convolution launch of ORT's for the graph API (how ORT's Conv calls
    cuDNN)."""
    from onnxcampo.ops.conv_nhwc import host_class

    kind = host_class()
    measured = cost.library_launch_us(kind)
    if measured is not None:
        return measured
    return cost.launch_us("conv") if kind == "conv_nhwc_graph" else CONV_NHWC_HOST_US


# At most this share of a float16 NCHW convolution's predicted time is taken to be cuDNN's layout
# transforms (the database's times are measured with them; the analytic model's are not).
LAYOUT_SHARE_MAX = 0.5
_LAYOUT_CONVS = {("Conv", ""), ("ConvTranspose", ""), ("ConvWeightGrad", DOMAIN)}
_NHWC_CONVS = frozenset({"ConvNhwc", "ConvNhwcDataGrad", "ConvNhwcWeightGrad"})


@dataclass(frozen=True)
class LayoutChange:
    """What ``channels_last`` changes in a plan's predicted run, as :func:`layout_change` prices it:
    GPU time (``gpu_us``, negative where it saves), launches of ORT kernels (``launches``) and of
    convolutions (``conv_launches``), and the NHWC convolution calls that replace these
    (``nhwc_calls``, each :data:`CONV_NHWC_HOST_US` of host time), and float16 NCHW convolution
    calls priced whole (``fp16_conv_calls``, ``estimate.host_launches``). ``convolutions``: the
    convolutions converted, ``inserted``: the kernels the layout pass adds (Transposes, NchwToNhwc,
    Pads, bias Adds, ...)."""

    convolutions: int = 0
    inserted: int = 0
    gpu_us: float = 0.0
    launches: int = 0
    conv_launches: int = 0
    nhwc_calls: int = 0
    fp16_conv_calls: int = 0


@dataclass(frozen=True)
class _LayoutTrial:
    """``onnxcampo.rewrites.layout`` run on a copy of the planning graph: the planning nodes it converts to
    NHWC ops and those it removes, and the nodes it inserts with the elements each moves (the
    largest of its float tensors), and the converted convolutions whose bias became an Add."""

    converted: tuple[str, ...]
    removed: tuple[str, ...]
    inserted: tuple[tuple[str, str, int], ...]  # (name, op type, elements)
    bias_adds: frozenset[str]  # inserted Adds of a converted convolution's bias (by the Add's name)


def layout_change(ctx: GraphContext, precision_of: PrecisionOf) -> LayoutChange:
    """What channels-last changes in the plan's run (nothing unless :func:`costed`).

    The layout pass (:func:`to_channels_last`, its ``float16`` set to the plan's float16
    convolutions) runs on a copy of the planning graph; what it did is priced against the plan's
    own costing of the nodes concerned:

    1. A converted float16 Conv or ConvTranspose: cuDNN's two layout transforms around it go (each
       costed as a Cast of its input or output: one pass over it, :meth:`CostModel.cast_time`; at
       most :data:`LAYOUT_SHARE_MAX` of the convolution's time), and with them the
       ``NCHW_FP16_LAYOUT_LAUNCHES``; its launch becomes an NHWC call (:data:`CONV_NHWC_HOST_US`).
    2. The nodes ORT fused into such a convolution (its ReLU, a residual Add): ORT no longer fuses
       them. Costed with ``fuse_elementwise``, they and the convolution's bias are one fused kernel
       as they are NCHW (the elementwise fusion moves a Conv's bias into its readers' group in
       either layout): the group's launch is that kernel's. Without it each runs alone (its own
       time and launch), and so does the bias: an Add, the pass over the output that ORT's Conv
       makes for its bias (cuDNN's ``cudnnAddTensor``) as a node of its own: one launch more.
    3. Each node the pass inserts other than a free reshape (a Transpose at a layout boundary, the
       stem's NchwToNhwc, a Pad, the ReduceMean of a GlobalAveragePool, ...): one pass over its
       largest tensor (a Cast's time) and one launch.
    4. Each planning node the pass removes (the GlobalAveragePool, a pool's adjoint): its time and
       launches under the plan go. MaxPool -> MaxPoolNhwc and ConvWeightGrad -> ConvNhwcWeightGrad
       cost what they did.
    Float32 convolutions stay NCHW (``onnxcampo.rewrites.layout``), so an all-fp32 plan changes nothing.
    """
    from onnxcampo import estimate

    if not costed(ctx):
        return LayoutChange()
    trial = _layout_trial(ctx, precision_of)
    if trial is None or not trial.converted:
        return LayoutChange()
    base = getattr(ctx, "ctx", ctx)
    by_name = {n.name: n for n in base.nodes}
    roots = estimate.fusion_groups(ctx)[2]
    in_group: dict[str, list[str]] = {}
    for member, root in roots.items():
        in_group.setdefault(root, []).append(member)
    fused = elementwise.costed(ctx)
    cast = ctx.cost.cast_time
    gpu, launches, conv_launches, nhwc, convolutions, fp16_calls = 0.0, 0, 0, 0, 0, 0
    converted = set(trial.converted)
    for name in trial.converted:
        node = by_name[name]
        if node.op not in oplists.NCHW_FP16_LAYOUT_OPS:
            continue  # ConvWeightGrad: the library's cuDNN call either way
        convolutions += 1
        conv, other, fp16_call = estimate.host_launches(ctx, node, precision_of)
        conv_launches -= conv
        launches -= other
        fp16_calls -= fp16_call
        nhwc += 1
        alone = estimate.alone_time(ctx, node, Precision.FP16)
        transforms = cast(ctx.numel(node.inputs[0])) + cast(ctx.numel(node.outputs[0]))
        gpu += alone - min(transforms, LAYOUT_SHARE_MAX * alone) - estimate.node_time(ctx, node, Precision.FP16, precision_of)
        members = [by_name[m] for m in in_group.get(roots.get(name), ()) if m != name and m in by_name
                   and m not in converted and not estimate.aliased(by_name[m]) and not estimate.eliminated(ctx, by_name[m])]
        for member in members:
            conv, other, fp16_call = estimate.host_launches(ctx, member, precision_of)
            conv_launches -= conv
            fp16_calls -= fp16_call
            if fused:
                launches += conv + fp16_call  # the epilogue's fused kernel launches where the fused Conv did
            else:
                launches += 1 - other
                precision = precision_of(member.name)
                gpu += estimate.alone_time(ctx, member, precision) - estimate.node_time(ctx, member, precision, precision_of)
    for name, op, elements in trial.inserted:
        if op in oplists.ALIASED:
            continue
        if name in trial.bias_adds:
            launches += 0 if fused else 1  # the pass ORT's Conv makes for its bias (cudnnAddTensor), as a node
            continue
        gpu += cast(elements)
        launches += 1
    for name in trial.removed:
        node = by_name.get(name)
        if node is None:
            continue
        gpu -= estimate.node_time(ctx, node, precision_of(node.name), precision_of)
        conv, other, fp16_call = estimate.host_launches(ctx, node, precision_of)
        conv_launches -= conv
        launches -= other
        fp16_calls -= fp16_call
    inserted = sum(1 for name, op, _ in trial.inserted if op not in oplists.ALIASED)
    return LayoutChange(convolutions, inserted, gpu, launches, conv_launches, nhwc, fp16_calls)


def _layout_trial(ctx: GraphContext, precision_of: PrecisionOf) -> _LayoutTrial | None:
    """The layout pass on a copy of the planning graph for the plan's float16 convolutions; None
    when the plan has none. Cached per set of float16 convolutions and stem setting."""
    base = getattr(ctx, "ctx", ctx)
    fp16 = frozenset(n.name for n in base.nodes if (n.op, n.domain or "") in _LAYOUT_CONVS
                     and precision_of(n.name) is Precision.FP16)
    if not fp16:
        return None
    stem = ctx.config.experimental.channels_last_stem
    cache = base.__dict__.setdefault("_layout_trials", {})
    key = (fp16, stem)
    if key in cache:
        return cache[key]
    model = onnx.ModelProto()
    model.CopyFrom(base.model)
    info = dict(written_info(ctx))  # the pass converts convolutions of static shapes in the written model
    try:
        to_channels_last(model, info, stem=stem, float16=fp16)
    except Exception as exc:  # noqa: BLE001 (a prediction: the pass itself reports on the written model)
        log.info("channels-last not priced: the layout pass fails on the planning graph (%s: %s)",
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        cache[key] = None
        return None
    planned = {n.name for n in base.nodes}
    written = {n.name: n for n in model.graph.node}
    producers = {o: n for n in model.graph.node for o in n.output if o}
    converted = tuple(name for name, n in written.items() if name in planned and n.op_type in _NHWC_CONVS)

    def elements(node) -> int:  # sized as the plan is costed (base.info: pinned), else as the pass made it
        sizes = [(base.info.get(t) or info[t]).numel or 0 for t in (*node.input, *node.output)
                 if t in info and info[t].is_float]
        return max(sizes, default=0)

    inserted = tuple((name, n.op_type, elements(n)) for name, n in written.items() if name not in planned)
    bias_adds = frozenset(name for name, n in written.items() if name not in planned and n.op_type == "Add"
                          and n.input and n.input[0] in producers and producers[n.input[0]].name in converted)
    removed = tuple(name for name in planned if name not in written)
    cache[key] = _LayoutTrial(converted, removed, inserted, bias_adds)
    return cache[key]


__all__ = ["ALIGN", "STEM_CHANNELS", "LayoutResult", "physical_shape", "to_channels_last", "to_logical_perm", "to_physical_perm"]
