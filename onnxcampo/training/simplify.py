"""Rewrite onnx-ad's backward graph into the same math with fewer, cheaper ops.

onnx-ad 0.3.0 emits a correct but literal vector-Jacobian graph: every adjoint carries a trailing
seed axis (size 1 here), moved to the front and back with Transposes around every Conv and
MatMul, materialized with Expands to the shape it already has, and the weight gradient of a Conv
is a convolution of the transposed input with the transposed output gradient as a filter bank
whose spatial size is the *output's* (a 56x56 or, dilated, 223x223 kernel) producing a kh x kw
image. On ResNet-50 that convolution is most of the backward time (see
``docs/guide/step-performance.md``). :func:`simplify_backward` applies these rules, in this
order, each until nothing matches, then drops nodes nothing reads:

1. **Conv weight gradient as one GEMM** (2-D, ``group=1``, one seed): the chain
   ``Conv(Transpose(Pad(x)), Reshape(Transpose(dy))) -> Slice -> Reshape -> Transpose`` becomes
   ``Gemm(dy as [Cout, N*Ho*Wo], im2col(x) as [Cin*kh*kw, N*Ho*Wo], transB=1) -> Reshape``, where
   im2col is one strided Slice of the transposed padded input per kernel tap (none for a 1x1
   stride-1 Conv) and a Concat (of Concats of at most 32 taps each: ORT's CUDA Concat takes at
   most 32 inputs inside a CUDA graph, and copies a pointer table per run above that). The same products are summed; only the order of the additions
   differs. The swapped Conv also computed a larger image than kh x kw whenever the stride does not
   divide the padded size (a 1x1 stride-2 Conv computed 2x2 and kept 1x1); the GEMM computes only
   what is kept. With ``fused=True`` (the step builder's choice when the custom-op library is
   available) the im2col is one ``ai.onnxcampo::Im2Col(x)`` reading the Pad's input (the forward
   Conv's input) with the Pad's top/left pads and the bottom/right ones the kept rows need: no Pad,
   Transpose, Slices or Concats. Its ``[Cin*kh*kw, N*Ho*Wo]`` (row ``(c*kh + i)*kw + j``, column
   ``(n*Ho + oh)*Wo + ow``) is the tap Concat's ``[Cin, kh*kw, N, Ho, Wo]`` memory, so the Gemm and
   the final Reshape are unchanged and so are the gradients; a value_info declares its shape (ONNX
   shape inference knows no ai.onnxcampo op). A Pad that is not a zero Pad of H and W alone keeps
   the standard-op emission. With ``conv_weight_grad="cudnn"`` as well, the whole gradient is one
   ``ai.onnxcampo::ConvWeightGrad(x, dy)`` (cuDNN's backward-filter convolution on CUDA; no column
   matrix, no Gemm, no Transpose of dy) where cuDNN's symmetric padding gives the gradient's
   ``(Ho, Wo)``; the same products, summed in cuDNN's order.
1b. **MatMul weight gradient as one GEMM** (after rules 3 and 4): for ``y = x W`` with a batched ``x`` (``[B, S, K]``,
   a transformer's activations), onnx-ad sums per-sample products: ``ReduceSum(MatMul(Transpose(x),
   dy))`` over the batch, a ``[B, K, N]`` product (BERT-base b32: 2.7 G elements a step, written,
   cast and summed) for a ``[K, N]`` result. It becomes ``Gemm(x as [B*S, K], dy as [B*S, N],
   transA=1)`` and a Reshape to the ReduceSum's shape: the same products, added in another order.
2. **Expand to the shape its input already has**: the input is used instead; an **Identity**'s
   readers read its input.
3. **Transpose that only moves size-1 axes** (the seed axis): a Reshape, which copies nothing.
4. **Transpose of a Transpose** read by nothing else: one Transpose with the composed permutation
   (none when that is the identity).
5. **Squeeze and Unsqueeze** with static shapes become Reshapes; a **Reshape of a Reshape** read
   by nothing else: one Reshape to the final (static) shape; a Reshape to the shape its input
   already has: the input. (onnx-ad ends each weight gradient with Reshape, Identity, Squeeze:
   one Reshape is left.)
6. **Slice that keeps everything** (starts 0, ends past the end, steps 1): the input.
7. **ReduceSum as matrix reductions**: ONNX Runtime's CUDA ReduceSum has fast kernels only for
   axes that form one block at the start or at the end of the shape (a matrix's rows or columns);
   any other axes (size-1 dims set aside) go to cuDNN's general reduction, several times slower. A Conv bias gradient
   reduces ``[N, C, H, W, seed]`` over ``(0, 2, 3)`` (on ResNet-50 b64 the step's 53 such
   reductions took 12 of its 37.6 GPU ms, CUPTI). With size-1 axes set aside, a ReduceSum whose
   reduced axes are a leading block, a trailing block or both becomes a Reshape to ``[P, Q, R]``
   (leading reduced, kept, trailing reduced), a ReduceSum over the last axis, one over the first,
   and a Reshape to the original output shape (Reshapes copy nothing). Only the order of the
   additions changes. (It runs after rule 4, so that rule 5 merges its Reshapes with their
   neighbours.)
7b. **Elementwise op of Reshapes** (last): ``Add/Sub/Mul/Div(Reshape(a), Reshape(b))`` with ``a`` and
   ``b`` of one shape reshaped to one other shape becomes ``Reshape(op(a, b))``: the same values.
   onnx-ad appends its seed axis to each ReLU's backward mask, ``Reshape(Cast(Greater(x, 0))) *
   Reshape(dy)``; without the Reshapes between them ``--fuse-elementwise`` makes the comparison,
   its Cast and the product one kernel.

8. **LayerNorm statistics from the forward node**: onnx-ad's adjoint of a ``LayerNormalization``
   recomputes the statistics the forward node already has: ``mean = ReduceMean(x)``, ``d = x -
   mean``, ``invstd = Reciprocal(Sqrt(ReduceMean(d * d) + epsilon))`` over the normalized axes
   (two row reductions and three more elementwise kernels per LayerNorm, on BERT-base b32 each over
   [4096, 768]). The forward node's optional outputs ``Mean`` and ``InvStdDev`` (float32,
   ``stash_type`` 1) are the same values (ORT computes them in float32 as the recompute does, in
   another order of additions): the rule gives the node those outputs and lets the adjoint read
   them; the recompute is dropped. Only where the epsilon, the axes and the float32 input match.
   (ORT's SkipLayerNormFusion, whose CUDA kernel writes no statistics, cannot take such a node:
   the adjoint's ``x - mean`` keeps a second reader on the residual Add it would fuse, and the
   fusion needs the Add's output read once.)

9. **A ReLU's mask from its output**: onnx-ad's adjoint of ``y = Relu(x)`` gates the gradient with
   ``Greater(x, 0)``, which keeps ``x`` alive from the forward into the backward besides ``y``
   (which the next layer's weight gradient reads anyway). ``x > 0`` exactly when ``y > 0`` (NaN:
   false both), so the comparison reads ``y``: with ``--fuse-elementwise`` the forward group that
   computes ``x`` (a Conv's bias, a residual Add) and ``y`` then writes ``y`` alone, and the mask,
   its Cast and the product become one backward kernel (ResNet-50: 33 ReLUs).
9b. **A ReLU mask's Reshape first**: where the gradient the mask gates carries onnx-ad's seed axis
   and the mask does not (a residual block's output, whose gradient is a sum of two seeds; the
   stem's, gated after the pool's adjoint), the mask is reshaped to the gradient's shape after its
   Cast, ``Reshape(Cast(Greater(y, 0)))``, and the Reshape, which no fusion crosses, left the
   comparison and its Cast in the forward kernel that writes ``y``: that kernel wrote the mask
   too, a second float16 tensor of ``y``'s size, read back in the backward. The Reshape moves to
   ``y``, ``Cast(Greater(Reshape(y), 0))`` (ORT aliases it), so the comparison joins the
   product's backward kernel and the forward one writes ``y`` alone (ResNet-50: the stem and the
   16 block outputs, ~0.8 GB of writes a b64 step).

A rule never touches a value that is a graph output (its name is the step's interface), and
every rewrite uses static shapes from one shape inference run at the start; a node whose shapes
are not fully static is left alone. The rules are exact: the outputs are the same values, up to
the order of floating-point additions in rule 1.
"""

from __future__ import annotations

import logging
import sys
import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxcampo import ir
from onnxcampo.passes.manager import PassBase, PassManager, PassResult

log = logging.getLogger(__name__)

# ORT's CUDA Concat refuses more inputs than this while a CUDA graph is captured
MAX_CONCAT_INPUTS = 32


class _Graph(ir.ModelEdit):
    """The step graph with the tables the rules read besides producers and consumers: static
    shapes from one inference at the start, the int64 constants, the names no rule may touch."""

    def __init__(self, model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]],
                 constants: dict[str, np.ndarray], protected: set[str], dtypes: dict[str, int] | None = None) -> None:
        super().__init__(model, fresh_prefix="simplify")
        self.shapes, self.constants, self.protected = shapes, constants, protected
        self.dtypes = dtypes or {}
        self.fused = False  # rule 1 may emit ai.onnxcampo::Im2Col (simplify_backward(fused=True))
        self.conv_weight_grad = "gemm"  # with fused: "cudnn" emits ai.onnxcampo::ConvWeightGrad instead

    def static(self, name: str) -> tuple[int, ...] | None:
        shape = self.shapes.get(name)
        return shape if shape is not None and all(isinstance(d, int) and d >= 0 for d in shape) else None

    def const(self, values, stem: str) -> str:
        name = self.fresh(stem)
        array = np.asarray(values, dtype=np.int64)
        self.model.graph.initializer.append(numpy_helper.from_array(array, name))
        self.constants[name] = array
        self.shapes[name] = tuple(array.shape)
        return name

    def of_type(self, *op_types: str):
        """The nodes of these op types, in graph order, over a copy of the node list (a rule may
        edit the graph as it goes; a node's op type is read when the walk reaches it)."""
        for node in list(self.nodes):
            if node.op_type in op_types:
                yield node


_attr = ir.attribute


def _load(model: onnx.ModelProto, fold: bool = True) -> _Graph:
    if fold:
        from onnx_ad.fold import fold_constants  # the folder onnx-ad itself uses; small results only

        folded = fold_constants(model)  # the seed count and sizes that MaxPool's adjoint computes at run time
        if folded is not model:
            model.CopyFrom(folded)
    info, _ = ir.infer_tensor_info(model)
    shapes = {name: tuple(entry.shape) for name, entry in info.items() if entry.shape is not None}
    dtypes = {name: entry.dtype for name, entry in info.items() if entry.dtype}
    edit = ir.ModelEdit(model)
    constants = {name: numpy_helper.to_array(t) for name, t in edit.constants().items()
                 if t.data_type == onnx.TensorProto.INT64}
    return _Graph(model, shapes, constants, edit.interface(), dtypes)


# --------------------------------------------------------------------------------------------
# rule 1: the Conv weight gradient
# --------------------------------------------------------------------------------------------

def _sole_producer(g: _Graph, producers, consumers, name: str, op_type: str):
    """The ``op_type`` node producing ``name`` when ``name`` is read only once and is no graph
    output (so it may be folded into its reader), else None."""
    first = producers.get(name)
    if first is None or first.op_type != op_type or len(consumers[first.output[0]]) != 1 \
            or first.output[0] in g.protected:
        return None
    return first


def _only_consumer(g: _Graph, consumers, name: str, op_type: str):
    users = consumers.get(name, [])
    if len(users) != 1 or users[0].op_type != op_type or name in g.protected:
        return None
    return users[0]


def conv_weight_gradient(g: _Graph) -> int:
    """Rule 1 (see the module docstring); returns how many Convs it rewrote."""
    producers, consumers = g.producers(), g.consumers()
    rewritten = 0
    for conv in list(g.nodes):
        match = _match_weight_gradient(g, conv, producers, consumers)
        if match is None:
            continue
        _emit_weight_gradient(g, *match)
        rewritten += 1
        producers, consumers = g.producers(), g.consumers()
    return rewritten


def _match_weight_gradient(g: _Graph, conv, producers, consumers):
    if conv.op_type != "Conv" or len(conv.input) != 2 or _attr(conv, "group", 1) != 1:
        return None
    if any(_attr(conv, "pads", [0]) ) or _attr(conv, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    images, filters = (producers.get(n) for n in conv.input)
    if images is None or filters is None or images.op_type != "Transpose" or filters.op_type != "Reshape":
        return None
    if list(_attr(images, "perm", [])) != [1, 0, 2, 3]:
        return None
    seeded = producers.get(filters.input[0])
    if seeded is None or seeded.op_type != "Transpose" or list(_attr(seeded, "perm", [])) != [1, 4, 0, 2, 3]:
        return None
    dy = g.static(seeded.input[0])             # [N, Cout, Ho, Wo, 1]
    padded = g.static(images.input[0])         # [N, Cin, Hp, Wp]
    result = g.static(conv.output[0])          # [Cin, Cout, oh, ow]
    if dy is None or padded is None or result is None or len(dy) != 5 or dy[4] != 1 or len(padded) != 4:
        return None
    crop = _only_consumer(g, consumers, conv.output[0], "Slice")
    if crop is None:
        return None
    split = _only_consumer(g, consumers, crop.output[0], "Reshape")
    if split is None:
        return None
    final = _only_consumer(g, consumers, split.output[0], "Transpose")
    if final is None or list(_attr(final, "perm", [])) != [1, 0, 3, 4, 2]:
        return None
    weight_grad = g.static(final.output[0])    # [Cout, Cin, kh, kw, 1]
    if weight_grad is None or len(weight_grad) != 5 or weight_grad[4] != 1:
        return None
    n, cout, ho, wo, _ = dy
    _, cin, hp, wp = padded
    if weight_grad[:2] != (cout, cin) or result[:2] != (cin, cout):
        return None
    kernel = weight_grad[2:4]
    step = list(_attr(conv, "dilations", [1, 1]))   # the forward Conv's strides
    reach = list(_attr(conv, "strides", [1, 1]))    # the forward Conv's dilations
    if _crop_window(g, crop) != kernel:
        return None
    for k, r, s, o, p in zip(kernel, reach, step, (ho, wo), (hp, wp)):
        if (k - 1) * r + (o - 1) * s + 1 > p:
            return None
    return conv, images, filters, final, (n, cin, cout, ho, wo, hp, wp), kernel, step, reach


def _crop_window(g: _Graph, crop) -> tuple[int, ...] | None:
    """The (kh, kw) a Slice over axes 2, 3 from 0 keeps, or None when it is another slice."""
    values = [g.constants.get(name) for name in crop.input[1:]]
    if len(values) < 3 or any(v is None for v in values[:3]):
        return None
    starts, ends, axes = (list(v.reshape(-1)) for v in values[:3])
    steps = list(values[3].reshape(-1)) if len(values) > 3 and values[3] is not None else [1] * len(axes)
    if len(values) > 3 and values[3] is None:
        return None
    if sorted(axes) != [2, 3] or any(starts) or any(s != 1 for s in steps):
        return None
    order = np.argsort(axes)
    return tuple(int(ends[i]) for i in order)


def _unpadded_source(g: _Graph, producers, images, dims, kernel, step, reach):
    """``(x, pads)`` for :func:`_emit_im2col`: the tensor the swapped Conv's images were padded
    from (the forward Conv's input) and Im2Col's ``[top, left, bottom, right]``, so that
    ``Im2Col(x)`` has exactly the ``(Ho, Wo)`` columns the Gemm reads; None when the images are
    not a zero ``Pad`` of H and W alone (or no Pad) of a static ``[N, Cin, H, W]``."""
    n, cin, _, ho, wo, _, _ = dims
    source = images.input[0]
    begin = [0, 0]
    pad = producers.get(source)
    if pad is not None and pad.op_type == "Pad":
        mode = _attr(pad, "mode", "constant")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
            return None
        if len(pad.input) > 3 and pad.input[3]:  # axes (opset 18): not what onnx-ad writes
            return None
        if len(pad.input) > 2 and pad.input[2]:  # the fill value must be a constant 0
            fill = ir.ModelEdit(g.model).constants().get(pad.input[2])
            if fill is None or np.any(numpy_helper.to_array(fill) != 0):
                return None
        pads = g.constants.get(pad.input[1]) if len(pad.input) > 1 and pad.input[1] else None
        values = [int(v) for v in pads.reshape(-1)] if pads is not None else list(_attr(pad, "pads", []) or [])
        if len(values) != 8 or any(values[a] for a in (0, 1, 4, 5)) or any(v < 0 for v in values):
            return None
        begin = [values[2], values[3]]
        source = pad.input[0]
    shape = g.static(source)
    if shape is None or len(shape) != 4 or shape[:2] != (n, cin):
        return None
    pads = begin + [0, 0]
    for axis, (size, k, r, s, o) in enumerate(zip(shape[2:], kernel, reach, step, (ho, wo))):
        extent = (k - 1) * r + 1
        end = max(0, (o - 1) * s + extent - size - begin[axis])  # what the last output row/column needs
        if (size + begin[axis] + end - extent) // s + 1 != o:
            return None
        pads[2 + axis] = end
    return source, pads


def _emit_weight_gradient(g: _Graph, conv, images, filters, final, dims, kernel, step, reach) -> None:
    if g.fused:
        producers = g.producers()
        found = _unpadded_source(g, producers, images, dims, kernel, step, reach)
        if found is not None:
            if g.conv_weight_grad == "cudnn" and _cudnn_pads(g, found[0], found[1], dims, kernel, step, reach):
                dy = producers[filters.input[0]].input[0]  # [N, Cout, Ho, Wo, 1] (the seed axis last)
                return _emit_conv_weight_grad(g, dy, final, dims, kernel, step, reach, *found)
            return _emit_im2col(g, filters, final, dims, kernel, step, reach, *found)
    n, cin, cout, ho, wo, hp, wp = dims
    taps = []
    stem = final.output[0]
    whole = kernel == (1, 1) and step == [1, 1] and (ho, wo) == (hp, wp)
    new = []
    if whole:
        taps = [images.output[0]]
    else:
        for a in range(kernel[0]):
            for b in range(kernel[1]):
                starts = [a * reach[0], b * reach[1]]
                ends = [starts[0] + (ho - 1) * step[0] + 1, starts[1] + (wo - 1) * step[1] + 1]
                tap = g.fresh("tap")
                new.append(helper.make_node(
                    "Slice", [images.output[0], g.const(starts, "starts"), g.const(ends, "ends"),
                              g.const([2, 3], "axes"), g.const(step, "steps")], [tap], name=tap))
                g.shapes[tap] = (cin, n, ho, wo)
                taps.append(tap)
    while len(taps) > MAX_CONCAT_INPUTS:  # Concat is associative along its axis: group the taps
        groups = [taps[i:i + MAX_CONCAT_INPUTS] for i in range(0, len(taps), MAX_CONCAT_INPUTS)]
        taps = []
        for group in groups:
            if len(group) == 1:
                taps.append(group[0])
                continue
            part = g.fresh("im2col_part")
            new.append(helper.make_node("Concat", group, [part], name=part, axis=1))
            g.shapes[part] = (cin, sum(g.shapes[t][1] for t in group), ho, wo)
            taps.append(part)
    columns = taps[0]
    if len(taps) > 1:  # [Cin, kh*kw*N, Ho, Wo] in memory is [Cin, kh*kw, N, Ho, Wo]
        columns = g.fresh("im2col")
        new.append(helper.make_node("Concat", taps, [columns], name=columns, axis=1))
    rows = math.prod(kernel) * cin
    columns_2d, dy_2d, product = g.fresh("columns"), g.fresh("dy"), g.fresh("weight_grad")
    new += [
        helper.make_node("Reshape", [columns, g.const([rows, n * ho * wo], "shape")], [columns_2d], name=columns_2d),
        helper.make_node("Reshape", [filters.output[0], g.const([cout, n * ho * wo], "shape")], [dy_2d], name=dy_2d),
        helper.make_node("Gemm", [dy_2d, columns_2d], [product], name=product, transB=1),
        helper.make_node("Reshape", [product, g.const([cout, cin, kernel[0], kernel[1], 1], "shape")],
                         [final.output[0]], name=g.fresh("weight_grad_shape")),
    ]
    g.shapes[columns_2d], g.shapes[dy_2d], g.shapes[product] = (rows, n * ho * wo), (cout, n * ho * wo), (cout, rows)
    index = list(g.nodes).index(final)
    g.nodes.remove(final)  # the old chain (Conv, Slice, Reshape) is dead now and dropped at the end
    for offset, node in enumerate(new):
        g.nodes.insert(index + offset, node)
    log.debug("conv weight gradient %s -> Gemm [%d x %d] . [%d x %d]^T", stem, cout, n * ho * wo, rows, n * ho * wo)


def _cudnn_pads(g: _Graph, x: str, pads: list[int], dims, kernel, step, reach) -> bool:
    """Whether cuDNN's symmetric padding (top and left on both sides) gives the gradient's
    ``(Ho, Wo)`` from ``x``: what ConvWeightGrad's CUDA kernel needs."""
    _, _, _, ho, wo, _, _ = dims
    h, w = g.static(x)[2:]
    for size, begin, k, r, s, o in zip((h, w), pads[:2], kernel, reach, step, (ho, wo)):
        if (size + 2 * begin - ((k - 1) * r + 1)) // s + 1 != o:
            return False
    return True


def _emit_conv_weight_grad(g: _Graph, dy: str, final, dims, kernel, step, reach, x: str, pads: list[int]) -> None:
    """Rule 1 as one ``ai.onnxcampo::ConvWeightGrad(x, dy)`` (cuDNN's backward filter on CUDA):
    the forward Conv's input and the output gradient in NCHW (onnx-ad's seed axis dropped by a
    Reshape); no im2col matrix, no Gemm, and the Transpose of dy to channels-first goes too."""
    from onnxcampo.ops import nodes as op_nodes

    n, cin, cout, ho, wo, _, _ = dims
    dy_4d, product = g.fresh("dy_nchw"), g.fresh("weight_grad")
    new = [
        helper.make_node("Reshape", [dy, g.const([n, cout, ho, wo], "shape")], [dy_4d], name=dy_4d),
        op_nodes.conv_weight_grad(x, dy_4d, output=product, kernel_shape=kernel, strides=step, dilations=reach,
                                  pads=pads, name=product),
        helper.make_node("Reshape", [product, g.const([cout, cin, kernel[0], kernel[1], 1], "shape")],
                         [final.output[0]], name=g.fresh("weight_grad_shape")),
    ]
    # ONNX shape inference knows no ai.onnxcampo op: the declared shape lets it (and the cost model)
    # see the product; the precision passes retype it with the node
    g.model.graph.value_info.append(helper.make_tensor_value_info(
        product, g.dtypes.get(x, onnx.TensorProto.FLOAT), [cout, cin, kernel[0], kernel[1]]))
    op_nodes.import_domain(g.model)
    g.shapes[dy_4d], g.shapes[product] = (n, cout, ho, wo), (cout, cin, kernel[0], kernel[1])
    index = list(g.nodes).index(final)
    g.nodes.remove(final)  # the old chain is dead now, dropped at the end
    for offset, node in enumerate(new):
        g.nodes.insert(index + offset, node)
    log.debug("conv weight gradient %s -> ConvWeightGrad(%s, %s)", final.output[0], x, dy)


def _emit_im2col(g: _Graph, filters, final, dims, kernel, step, reach, x: str, pads: list[int]) -> None:
    """Rule 1 with the custom op: ``Gemm(dy as [Cout, N*Ho*Wo], Im2Col(x), transB=1) -> Reshape``,
    Im2Col reading the forward Conv's input ``x`` (no Pad, Transpose, Slices, Concats). Its
    ``[Cin*kh*kw, N*Ho*Wo]`` is the tap Concat's ``[Cin, kh*kw, N, Ho, Wo]`` reshaped: the same
    matrix, so the same Gemm."""
    from onnxcampo.ops import nodes as op_nodes

    n, cin, cout, ho, wo, _, _ = dims
    rows = math.prod(kernel) * cin
    columns_2d, dy_2d, product = g.fresh("columns"), g.fresh("dy"), g.fresh("weight_grad")
    new = [
        op_nodes.im2col(x, output=columns_2d, kernel_shape=kernel, strides=step, dilations=reach, pads=pads,
                        name=columns_2d),
        helper.make_node("Reshape", [filters.output[0], g.const([cout, n * ho * wo], "shape")], [dy_2d], name=dy_2d),
        helper.make_node("Gemm", [dy_2d, columns_2d], [product], name=product, transB=1),
        helper.make_node("Reshape", [product, g.const([cout, cin, kernel[0], kernel[1], 1], "shape")],
                         [final.output[0]], name=g.fresh("weight_grad_shape")),
    ]
    # ONNX shape inference knows no ai.onnxcampo op: the declared shape lets it (and the cost
    # model) see through to the Gemm; the precision passes retype it with the node
    g.model.graph.value_info.append(helper.make_tensor_value_info(
        columns_2d, g.dtypes.get(x, onnx.TensorProto.FLOAT), [rows, n * ho * wo]))
    op_nodes.import_domain(g.model)
    g.shapes[columns_2d], g.shapes[dy_2d], g.shapes[product] = (rows, n * ho * wo), (cout, n * ho * wo), (cout, rows)
    index = list(g.nodes).index(final)
    g.nodes.remove(final)  # the old chain (Pad, Transpose, Conv, Slice, Reshape) is dead now, dropped at the end
    for offset, node in enumerate(new):
        g.nodes.insert(index + offset, node)
    log.debug("conv weight gradient %s -> Gemm [%d x %d] . Im2Col(%s) [%d x %d]^T", final.output[0], cout,
              n * ho * wo, x, rows, n * ho * wo)


# --------------------------------------------------------------------------------------------
# rule 1b: the MatMul weight gradient
# --------------------------------------------------------------------------------------------

def _non_unit(shape: tuple[int, ...]) -> list[int]:
    return [d for d in shape if d != 1]


def matmul_weight_gradient(g: _Graph) -> int:
    """Rule 1b (see the module docstring); returns how many ReduceSums of batched products it rewrote."""
    count = 0
    producers, consumers = g.producers(), g.consumers()
    for node in g.of_type("ReduceSum"):
        found = _match_matmul_gradient(g, node, producers, consumers)
        if found is None:
            continue
        x, dy, rows, k, n = found
        x_2d, dy_2d, product = g.fresh("x_rows"), g.fresh("dy_rows"), g.fresh("weight_grad")
        new = [
            helper.make_node("Reshape", [x, g.const([rows, k], "shape")], [x_2d], name=x_2d),
            helper.make_node("Reshape", [dy, g.const([rows, n], "shape")], [dy_2d], name=dy_2d),
            helper.make_node("Gemm", [x_2d, dy_2d], [product], name=product, transA=1),
            helper.make_node("Reshape", [product, g.const(list(g.static(node.output[0])), "shape")],
                             [node.output[0]], name=g.fresh("weight_grad_shape")),
        ]
        g.shapes[x_2d], g.shapes[dy_2d], g.shapes[product] = (rows, k), (rows, n), (k, n)
        index = list(g.nodes).index(node)
        g.nodes.remove(node)  # the batched MatMul and its Reshape are dead now, dropped at the end
        for offset, made in enumerate(new):
            g.nodes.insert(index + offset, made)
        log.debug("matmul weight gradient %s -> Gemm [%d x %d]^T . [%d x %d]", node.output[0], rows, k, rows, n)
        count += 1
        producers, consumers = g.producers(), g.consumers()
    return count


def _match_matmul_gradient(g: _Graph, reduce, producers, consumers):
    """``(x, dy, rows, K, N)`` when ``reduce`` sums a batched ``MatMul(Transpose(x), dy)`` over
    all its batch dims (through a Reshape that only moves size-1 axes), else None."""
    shape, out = g.static(reduce.input[0]), g.static(reduce.output[0])
    if shape is None or out is None or 0 in shape:
        return None
    axes = _reduce_axes(g, reduce, len(shape))
    if axes is None:
        return None
    source = producers.get(reduce.input[0])
    if source is not None and source.op_type == "Reshape":
        if len(consumers[source.output[0]]) != 1 or source.output[0] in g.protected:
            return None
        before = g.static(source.input[0])
        if before is None or _non_unit(before) != _non_unit(shape):
            return None
        source = producers.get(source.input[0])
    if source is None or source.op_type != "MatMul" or len(consumers[source.output[0]]) != 1 \
            or source.output[0] in g.protected:
        return None
    product = g.static(source.output[0])
    a, dy = (g.static(name) for name in source.input)
    transpose = producers.get(source.input[0])
    if product is None or a is None or dy is None or len(a) < 3 or len(dy) < 3 or transpose is None \
            or transpose.op_type != "Transpose":
        return None
    x = g.static(transpose.input[0])
    perm = list(_attr(transpose, "perm", []) or [])
    if x is None or perm != [*range(len(x) - 2), len(x) - 1, len(x) - 2]:
        return None
    k, n = product[-2], product[-1]
    batch = _non_unit(product[:-2])
    # both operands carry the same batch (no broadcast of one over the other), every batch dim is
    # summed and K, N are kept in that order
    if not batch or _non_unit(a[:-2]) != batch or _non_unit(dy[:-2]) != batch:
        return None
    non_unit_axes = [axis for axis, dim in enumerate(shape) if dim != 1]
    reduced = [axis for axis in non_unit_axes if axis in axes]
    kept = [shape[axis] for axis in non_unit_axes if axis not in axes]
    if reduced != non_unit_axes[:len(batch)] or kept != _non_unit((k, n)) or math.prod(out) != k * n:
        return None
    rows = math.prod(batch) * x[-2]
    return transpose.input[0], source.input[1], rows, k, n


# --------------------------------------------------------------------------------------------
# rule 7: reductions ORT's CUDA EP runs as matrix reductions
# --------------------------------------------------------------------------------------------

def _reduce_axes(g: _Graph, node, rank: int) -> list[int] | None:
    """The normalized axes a ReduceSum reduces (attribute before opset 13, input since), or None
    when they are not a known constant (or empty: all axes, or none with noop_with_empty_axes)."""
    if len(node.input) > 1 and node.input[1]:
        axes = g.constants.get(node.input[1])
        values = None if axes is None else [int(a) for a in axes.reshape(-1)]
    else:
        values = list(_attr(node, "axes", []) or [])
    if not values or any(not -rank <= a < rank for a in values):
        return None
    return sorted({a % rank for a in values})


def _matrix_block(shape: tuple[int, ...], axes: list[int]) -> bool:
    """Whether ORT reduces ``axes`` of ``shape`` as matrix rows or columns already: with size-1
    dims set aside (ORT drops them first), one contiguous block that starts at the first dim or
    ends at the last, but not both."""
    kept = [axis for axis, dim in enumerate(shape) if dim != 1]
    reduced = [i for i, axis in enumerate(kept) if axis in axes]
    if not reduced:
        return True  # nothing is added up
    block = reduced == list(range(reduced[0], reduced[-1] + 1))
    return block and (reduced[0] == 0) != (reduced[-1] == len(kept) - 1)


def _split_sizes(shape: tuple[int, ...], axes: list[int]) -> tuple[int, int, int] | None:
    """``(P, Q, R)``: the products of the leading reduced, kept and trailing reduced dims when the
    dims other than 1 fall in that order with some kept (Q > 1), else None."""
    sizes, part = [1, 1, 1], 0
    for axis, dim in enumerate(shape):
        if dim == 1:
            continue
        reduced = axis in axes
        if part == 0 and not reduced:
            part = 1
        elif part == 1 and reduced:
            part = 2
        elif part == 2 and not reduced:
            return None
        sizes[part] *= dim
    return (sizes[0], sizes[1], sizes[2]) if sizes[1] > 1 else None


def matrix_reductions(g: _Graph) -> int:
    """Rule 7 (see the module docstring); returns how many ReduceSums it rewrote."""
    count = 0
    for node in g.of_type("ReduceSum"):
        shape, out = g.static(node.input[0]), g.static(node.output[0])
        if shape is None or out is None or 0 in shape or 0 in out:
            continue
        axes = _reduce_axes(g, node, len(shape))
        if axes is None or _matrix_block(shape, axes):
            continue
        sizes = _split_sizes(shape, axes)
        if sizes is None:  # kept dims on both sides of a reduced one: no matrix without a transpose
            continue
        p, q, r = sizes  # P > 1 and R > 1: a block at one end only would be a matrix block
        as_input = len(node.input) > 1 and bool(node.input[1])
        new = []

        def emit(op: str, source: str, result: tuple[int, ...], *, axis: int | None = None, name: str | None = None) -> str:
            target = name or g.fresh("reduce")
            if op == "Reshape":
                new.append(helper.make_node("Reshape", [source, g.const(list(result), "shape")], [target],
                                            name=g.fresh("reduce_shape")))
            elif as_input:
                new.append(helper.make_node("ReduceSum", [source, g.const([axis], "axes")], [target],
                                            name=g.fresh("reduce_sum"), keepdims=0))
            else:
                new.append(helper.make_node("ReduceSum", [source], [target], name=g.fresh("reduce_sum"),
                                            axes=[axis], keepdims=0))
            g.shapes[target] = result
            return target

        current = emit("Reshape", node.input[0], (p, q, r))
        current = emit("ReduceSum", current, (p, q), axis=2)  # each row of [P*Q, R] (ORT's column reduction)
        current = emit("ReduceSum", current, (q,), axis=0)    # the rows of [P, Q] (ORT's row reduction)
        emit("Reshape", current, out, name=node.output[0])
        index = list(g.nodes).index(node)
        g.nodes.remove(node)
        for offset, made in enumerate(new):
            g.nodes.insert(index + offset, made)
        count += 1
    return count


# --------------------------------------------------------------------------------------------
# rules 2-6: data movement that moves nothing
# --------------------------------------------------------------------------------------------

def _alias(g: _Graph, node, source: str) -> bool:
    """Let the readers of ``node``'s output read ``source`` instead (not for graph outputs)."""
    if node.output[0] in g.protected:
        return False
    g.replace_uses(node.output[0], source)
    g.nodes.remove(node)
    return True


def same_shape_expand(g: _Graph) -> int:
    """Rule 2."""
    count = 0
    for node in g.of_type("Expand"):
        shape = g.static(node.input[0])
        if shape is not None and shape == g.static(node.output[0]) and _alias(g, node, node.input[0]):
            count += 1
    return count


def identity(g: _Graph) -> int:
    """Rule 2b: an Identity's readers read its input (onnx-ad ends every weight gradient with one)."""
    return sum(_alias(g, node, node.input[0]) for node in g.of_type("Identity"))


def squeeze_as_reshape(g: _Graph) -> int:
    """Rule 5a: a Squeeze or Unsqueeze with a static output shape is a Reshape to that shape, which
    rule 5 then merges with its neighbours (onnx-ad squeezes the seed axis off every gradient)."""
    count = 0
    for node in g.of_type("Squeeze", "Unsqueeze"):
        out = g.static(node.output[0])
        if out is None or 0 in out or g.static(node.input[0]) is None:  # a 0 in a Reshape shape copies a dim
            continue
        _as_reshape(g, node, out)
        count += 1
    return count


def _as_reshape(g: _Graph, node, shape: tuple[int, ...]) -> None:
    """Turn ``node`` (same input and output) into a Reshape of its first input to ``shape``."""
    node.op_type = "Reshape"
    del node.input[1:]
    del node.attribute[:]
    node.input.append(g.const(list(shape), "shape"))


def _moves_only_ones(shape: tuple[int, ...], perm: list[int]) -> bool:
    kept = [axis for axis in perm if shape[axis] != 1]
    return kept == sorted(kept)


def unit_axis_transpose(g: _Graph) -> int:
    """Rule 3."""
    count = 0
    for node in g.of_type("Transpose"):
        shape, out = g.static(node.input[0]), g.static(node.output[0])
        perm = list(_attr(node, "perm", []))
        if shape is None or out is None or not perm or not _moves_only_ones(shape, perm):
            continue
        _as_reshape(g, node, out)
        count += 1
    return count


def transpose_pairs(g: _Graph) -> int:
    """Rule 4."""
    count = 0
    producers, consumers = g.producers(), g.consumers()
    for node in g.of_type("Transpose"):
        first = _sole_producer(g, producers, consumers, node.input[0], "Transpose")
        if first is None:
            continue
        outer, inner = list(_attr(node, "perm", [])), list(_attr(first, "perm", []))
        if not outer or not inner:
            continue
        composed = [inner[axis] for axis in outer]
        if composed == list(range(len(composed))):
            if node.output[0] in g.protected:
                continue
            g.nodes.remove(first)
            _alias(g, node, first.input[0])
            count += 1
        else:
            g.nodes.remove(first)
            node.input[0] = first.input[0]
            for a in node.attribute:
                if a.name == "perm":
                    del a.ints[:]
                    a.ints.extend(composed)
            count += 1
        producers, consumers = g.producers(), g.consumers()
    return count


def reshape_chains(g: _Graph) -> int:
    """Rule 5."""
    count = 0
    producers, consumers = g.producers(), g.consumers()
    for node in g.of_type("Reshape"):
        out = g.static(node.output[0])
        if out is None:
            continue
        if g.static(node.input[0]) == out and _alias(g, node, node.input[0]):
            count += 1
            producers, consumers = g.producers(), g.consumers()
            continue
        first = _sole_producer(g, producers, consumers, node.input[0], "Reshape")
        if first is None or 0 in out:
            continue
        node.input[0] = first.input[0]
        node.input[1] = g.const(list(out), "shape")
        g.nodes.remove(first)
        count += 1
        producers, consumers = g.producers(), g.consumers()
    return count


def full_slice(g: _Graph) -> int:
    """Rule 6."""
    return sum(_takes_all(g, node) and _alias(g, node, node.input[0]) for node in g.of_type("Slice"))


def _takes_all(g: _Graph, node) -> bool:
    """Whether the Slice ``node`` keeps every element of its input (static shape, constant
    starts/ends/axes/steps)."""
    shape = g.static(node.input[0])
    values = [g.constants.get(name) for name in node.input[1:]]
    if shape is None or len(values) < 2 or any(v is None for v in values):
        return False
    starts, ends = list(values[0].reshape(-1)), list(values[1].reshape(-1))
    axes = list(values[2].reshape(-1)) if len(values) > 2 else list(range(len(starts)))
    steps = list(values[3].reshape(-1)) if len(values) > 3 else [1] * len(starts)
    return all(s == 0 and st == 1 and e >= shape[a % len(shape)] for s, e, a, st in zip(starts, ends, axes, steps))


ELEMENTWISE_BINARY = ("Add", "Sub", "Mul", "Div")


def elementwise_of_reshapes(g: _Graph) -> int:
    """Rule 7b: ``op(Reshape(a), Reshape(b))`` for an elementwise ``op`` whose inputs are Reshapes
    of two tensors of one shape to one other shape becomes ``Reshape(op(a, b))``: the same values
    in the same order (a Reshape moves no element), with the seed axis that onnx-ad appends off the
    arithmetic, so a ReLU's backward mask ``Cast(Greater(x, 0))`` meets the gradient it multiplies
    without a Reshape between them (``--fuse-elementwise`` then makes the three one kernel)."""
    count = 0
    producers = g.producers()
    for node in list(g.nodes):
        if node.op_type not in ELEMENTWISE_BINARY or len(node.input) != 2 or node.domain not in ("", "ai.onnx"):
            continue
        firsts = [producers.get(name) for name in node.input]
        if any(f is None or f.op_type != "Reshape" for f in firsts):
            continue
        sources = [f.input[0] for f in firsts]
        shapes = [g.static(name) for name in sources]
        outs = [g.static(f.output[0]) for f in firsts]
        result = g.static(node.output[0])
        if None in shapes or None in outs or shapes[0] != shapes[1] or outs[0] != outs[1] or result != outs[0] \
                or shapes[0] == result or 0 in result:
            continue
        inner = g.fresh(f"{node.op_type.lower()}_before_reshape")
        g.nodes.insert(list(g.nodes).index(node), helper.make_node(node.op_type, sources, [inner], name=inner))
        g.shapes[inner] = shapes[0]
        if node.output[0] in g.dtypes:
            g.dtypes[inner] = g.dtypes[node.output[0]]
        node.op_type = "Reshape"
        del node.input[:]
        node.input.extend([inner, g.const(list(result), "shape")])
        del node.attribute[:]
        count += 1
        producers = g.producers()
    return count


def drop_dead(g: _Graph) -> int:
    """Nodes none of whose outputs is read or is a graph output (iterated to a fixed point)."""
    removed = 0
    while True:
        read = {name for node in g.nodes for name in node.input} | {o.name for o in g.model.graph.output} | g.protected
        dead = [node for node in g.nodes if not any(out in read for out in node.output if out)]
        if not dead:
            break
        for node in dead:
            g.nodes.remove(node)
        removed += len(dead)
    used = {name for node in g.nodes for name in node.input}
    kept = [t for t in g.model.graph.initializer if t.name in used or t.name in g.protected]
    if len(kept) != len(g.model.graph.initializer):
        del g.model.graph.initializer[:]
        g.model.graph.initializer.extend(kept)
    return removed


class _Rule(PassBase):
    """One rewrite rule as a pass over the step graph: ``fn(g)`` returns how often it fired."""

    mutates = True

    def __init__(self, name: str, fn) -> None:
        self.name, self.fn = name, fn

    def run(self, g: _Graph) -> PassResult:
        fired = self.fn(g)
        return PassResult(self.name, bool(fired), {self.name: fired})


UNTIL_FIXED = sys.maxsize  # PassManager steps: rounds until a rule fires no more

def _mean_axes(g: _Graph, node) -> tuple[int, ...] | None:
    """A ReduceMean's axes (rule 7's :func:`_reduce_axes`) when it keeps the reduced dims, else None."""
    rank = len(g.shapes.get(node.input[0], ()))
    axes = _reduce_axes(g, node, rank) if rank and _attr(node, "keepdims", 1) == 1 else None
    return tuple(axes) if axes else None


def _float_scalar(g: _Graph, name: str) -> float | None:
    """The value of a float scalar initializer or Constant (``ModelEdit.constants``), else None."""
    tensor = ir.ModelEdit.constants(g).get(name)  # _Graph.constants is the int64 table
    value = None if tensor is None else numpy_helper.to_array(tensor)
    return float(value) if value is not None and value.size == 1 and value.dtype.kind == "f" else None


def layernorm_statistics(g: _Graph) -> int:
    """Rule 8."""
    count = 0
    consumers = g.consumers()

    def only(name: str, op_type: str):
        return _only_consumer(g, consumers, name, op_type)

    for ln in list(g.nodes):
        if ln.op_type != "LayerNormalization" or (ln.domain or "") not in ("", "ai.onnx") \
                or _attr(ln, "stash_type", 1) != 1 or g.dtypes.get(ln.input[0]) != onnx.TensorProto.FLOAT:
            continue
        x, rank = ln.input[0], len(g.shapes.get(ln.input[0], ()))
        if not rank or (len(ln.output) > 1 and ln.output[1]) or (len(ln.output) > 2 and ln.output[2]):
            continue  # the node's statistics already go somewhere: left as they are
        axis, epsilon = _attr(ln, "axis", -1) % rank, float(_attr(ln, "epsilon", 1e-5))
        normalized = tuple(range(axis, rank))
        for mean_node in [n for n in consumers.get(x, []) if n.op_type == "ReduceMean"]:
            if _mean_axes(g, mean_node) != normalized or mean_node.output[0] in g.protected:
                continue
            mean = mean_node.output[0]
            sub = next((n for n in consumers.get(mean, []) if n.op_type == "Sub" and list(n.input) == [x, mean]), None)
            square = sub and next((n for n in consumers.get(sub.output[0], [])
                                   if n.op_type == "Mul" and list(n.input) == [sub.output[0]] * 2), None)
            variance = square and only(square.output[0], "ReduceMean")
            if variance is None or _mean_axes(g, variance) != normalized:
                continue
            plus = only(variance.output[0], "Add")
            other = plus and next((i for i in plus.input if i != variance.output[0]), None)
            value = _float_scalar(g, other) if other else None
            if value is None or abs(value - epsilon) > 1e-6 * max(abs(epsilon), 1e-12):
                continue
            root = only(plus.output[0], "Sqrt")
            inverse = root and only(root.output[0], "Reciprocal")
            if inverse is None or inverse.output[0] in g.protected:
                continue
            stats = [g.fresh("ln_mean"), g.fresh("ln_invstd")]
            while len(ln.output) < 3:
                ln.output.append("")
            ln.output[1], ln.output[2] = stats
            for made, old in zip(stats, (mean, inverse.output[0])):
                g.shapes[made], g.dtypes[made] = g.shapes.get(old), onnx.TensorProto.FLOAT
                g.replace_uses(old, made)
            log.debug("LayerNorm %s: the adjoint reads its Mean and InvStdDev", ln.name)
            count += 1
            consumers = g.consumers()
            break
    if count:  # the adjoint now reads the forward node: keep the nodes in topological order
        ir.toposort_model(g.model)
    return count


def relu_mask_from_output(g: _Graph) -> int:
    """Rule 9."""
    count = 0
    consumers = g.consumers()
    for node in list(g.nodes):
        if node.op_type != "Greater" or (node.domain or "") not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        x, zero = node.input
        if _float_scalar(g, zero) != 0.0:
            continue
        relu = next((n for n in consumers.get(x, []) if n.op_type == "Relu" and (n.domain or "") in ("", "ai.onnx")),
                    None)
        if relu is None or g.shapes.get(relu.output[0]) != g.shapes.get(x) or g.shapes.get(x) is None:
            continue
        node.input[0] = relu.output[0]
        count += 1
    if count:  # the comparison now reads the Relu: keep the nodes in topological order
        ir.toposort_model(g.model)
    return count


def relu_mask_reshape(g: _Graph) -> int:
    """Rule 9b."""
    count = 0
    producers, consumers = g.producers(), g.consumers()
    for node in list(g.nodes):
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            continue
        cast = _sole_producer(g, producers, consumers, node.input[0], "Cast")
        greater = cast and _sole_producer(g, producers, consumers, cast.input[0], "Greater")
        if not greater or len(greater.input) != 2 or _float_scalar(g, greater.input[1]) != 0.0:
            continue
        source, target = g.static(greater.input[0]), g.static(node.output[0])
        if source is None or target is None or math.prod(source) != math.prod(target):
            continue
        # Reshape(Cast(Greater(y, 0))) -> Cast(Greater(Reshape(y), 0)): the same values, in the
        # reshaped layout from the start (ORT aliases the Reshape of y)
        reshaped = g.fresh("mask_input")
        g.nodes.insert(list(g.nodes).index(greater),
                       helper.make_node("Reshape", [greater.input[0], node.input[1]], [reshaped], name=reshaped))
        g.shapes[reshaped] = target
        if greater.input[0] in g.dtypes:
            g.dtypes[reshaped] = g.dtypes[greater.input[0]]
        greater.input[0] = reshaped
        g.shapes[greater.output[0]] = g.shapes[cast.output[0]] = target
        stale = {greater.output[0], cast.output[0]}  # declared with the shape they had
        kept = [v for v in g.model.graph.value_info if v.name not in stale]
        if len(kept) != len(g.model.graph.value_info):
            del g.model.graph.value_info[:]
            g.model.graph.value_info.extend(kept)
        cast.output[0] = node.output[0]
        g.nodes.remove(node)
        count += 1
        producers, consumers = g.producers(), g.consumers()
    return count


RULES = (
    ("conv weight gradient as Gemm", conv_weight_gradient),
    ("same-shape Expand", same_shape_expand),
    ("Identity", identity),
    ("unit-axis Transpose as Reshape", unit_axis_transpose),
    ("Transpose pair", transpose_pairs),
    ("matmul weight gradient as Gemm", matmul_weight_gradient),  # once the seed's Transposes are Reshapes
    ("ReduceSum as matrix reductions", matrix_reductions),
    ("Squeeze/Unsqueeze as Reshape", squeeze_as_reshape),
    ("Reshape chain", reshape_chains),
    ("full Slice", full_slice),
    ("elementwise of Reshapes", elementwise_of_reshapes),
    ("LayerNorm statistics from the forward", layernorm_statistics),
    ("ReLU mask from the output", relu_mask_from_output),
    ("ReLU mask's Reshape first", relu_mask_reshape),
)


ALIAS_RULES = ("Identity", "Squeeze/Unsqueeze as Reshape", "Reshape chain")


CONV_WEIGHT_GRADS = ("gemm", "cudnn")


def simplify_backward(model: onnx.ModelProto, *, keep: Iterable[str] = (), rules: Iterable[str] | None = None,
                      fused: bool = False, conv_weight_grad: str = "gemm") -> dict[str, int]:
    """Apply :data:`RULES` (or those named in ``rules``) to ``model`` in place; returns how often
    each fired (and nodes dropped). Tensors named in ``keep`` are never aliased away (like graph
    inputs and outputs). ``fused``: rule 1 builds each im2col with one ``ai.onnxcampo::Im2Col``
    (the model then needs the custom-op library); False keeps standard ops. ``conv_weight_grad``
    (with ``fused``): ``"gemm"`` the Gemm over the im2col, ``"cudnn"`` one
    ``ai.onnxcampo::ConvWeightGrad(x, dy)`` per Conv where cuDNN's symmetric padding fits (the
    Gemm elsewhere).

    A rule fires only where shapes are static: onnx-ad declares the seed axis symbolic
    (``nadj``), so pin the seed input's shape first (the step builder pins it to ``[1]``).
    """
    chosen = set(rules) if rules is not None else None
    # constant folding is for onnx-ad's graph; a later pass (alias rules only, on a step whose seed
    # is an initializer that loss scaling replaces) must not fold anything
    g = _load(model, fold=chosen is None or not chosen <= set(ALIAS_RULES))
    g.protected |= set(keep)
    g.fused = fused
    if conv_weight_grad not in CONV_WEIGHT_GRADS:
        raise ValueError(f"conv_weight_grad must be one of {', '.join(CONV_WEIGHT_GRADS)}, not {conv_weight_grad!r}")
    g.conv_weight_grad = conv_weight_grad
    unknown = (chosen or set()) - {name for name, _ in RULES}
    if unknown:
        raise ValueError(f"unknown simplify rules {sorted(unknown)}")
    before = len(g.nodes)
    # each rule to its own fixpoint, in order: one manager per rule inside the manager of all
    rules_run = [PassManager([_Rule(name, rule)], steps=UNTIL_FIXED, name=name, log_level=logging.DEBUG)
                 for name, rule in RULES if chosen is None or name in chosen]
    PassManager(rules_run, name="simplify_backward", log_level=logging.DEBUG).run(g)
    counts = {manager.name: sum(r.counts.get(manager.name, 0) for r in manager.results) for manager in rules_run}
    counts["dead nodes dropped"] = drop_dead(g)
    log.info("simplify_backward: %d -> %d nodes (%s)", before, len(g.nodes),
             ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    return counts


__all__ = ["ALIAS_RULES", "RULES", "simplify_backward"]
