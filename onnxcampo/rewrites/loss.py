"""``--fuse-reductions``, the loss: a cross-entropy over the last axis and its gradient as one
``ai.onnxcampo::SoftmaxCrossEntropy`` and one ``SoftmaxCrossEntropyGrad`` node
(``onnxcampo/ops/cross_entropy.py``, ``docs/ops.md``).

``onnxcampo train-graph`` writes the cross-entropy loss as LogSoftmax, OneHot, Mul and ReduceSum;
onnx-ad's backward of it is ``g - Exp(logp) * ReduceSum(g)`` with ``g = scale * OneHot``. Over
GPT-2's ``[2048, 50257]`` logits that is a dozen dense passes of float32 (the log probabilities,
the one-hot, the expanded scale, the products; 411 MB each) where the fused ops read the logits
once each and write the gradient once. Runs on the written model after the precision plan, before
the block reductions and the elementwise fusion. Rules:

1. The forward: ``logp = LogSoftmax(x)`` over the last axis (opset >= 13, or rank 2), ``x``
   float32 or float16 with a static shape ``[..., C]``; ``p = Mul(OneHot(labels, C, [0, 1],
   axis=-1), logp)`` (either operand order), ``labels`` int64 of ``x``'s leading shape;
   ``picked = ReduceSum(p)`` over the last axis, shaped like ``labels``. ``logp`` is read by the
   Mul and at most one Exp, the one-hot by the Mul and at most one view chain (rule 2), ``p`` by
   the ReduceSum only; none of them is a graph output.
2. The backward (when ``logp`` has an Exp reader): ``g = Mul(a, v)``, ``v`` the one-hot through
   views (Reshape, Squeeze, Unsqueeze, Flatten, Identity), ``a`` one value or ``Expand(s)`` of a
   tensor ``s`` with one value per row (its dimensions the rows' or 1 over the row axes, 1 over
   the class axes); ``t = ReduceSum(g)`` over the class axes with keepdims, one value per row;
   ``m = Mul(exp, t)``, ``exp`` the Exp through views, shaped like ``g``; ``dx = Sub(g, m)``. Each
   value between is read once and is no graph output.
3. In front of ``x``: a Cast float16 -> float32 read only by the LogSoftmax is folded (the fused
   ops read float16, exactly); then a Slice of the last axis ``[0, C)`` (step 1) of a wider tensor
   (the padded LM head: ``onnxcampo.padding``) is read past: the ops take ``classes = C`` and the
   padded rows; the Slice goes when nothing else reads it. When it computes the step's prediction
   (``onnxcampo.prediction``) and nothing else, it goes too (ORT would run it every step, a 206 MB
   copy on GPT-2) and ``onnxcampo.prediction_slice`` records ``{"input", "columns"}``: evaluation
   (``training.evaluate.eval_model``) slices the prediction back from the padded tensor.
4. ``SoftmaxCrossEntropy(x, labels) -> (picked, lse)`` takes the forward's place (the position
   of the later of the LogSoftmax and the OneHot), ``SoftmaxCrossEntropyGrad(x, lse, labels, s)
   -> dx`` the Sub's; ``picked`` and ``dx`` keep their names, types and shapes (value_info).
   Constants only the removed nodes read are dropped.

5. After ``dx``: when every reader path of ``dx`` is views (Reshape, Squeeze, Unsqueeze,
   Identity) with one Cast float32 -> float16 among them, the op writes float16 (``output_type``)
   and the Casts go. When moreover every path ends at a Pad of the class axis with zeros to one
   width ``W`` (``onnxcampo.padding``'s K or N of the LM head's backward GEMMs), the op writes rows
   of ``W`` (``output_columns``) and the Pads go too, the views' shapes taking ``W`` for ``C``;
   else the Pads stay, reading the float16 views. 5b: a path that ends at a MatMul reading the
   gradient as A with the classes its K (GPT-2's dX = dlogits @ W^T, K = 50257) does not stop
   the padding when the other paths pad: the MatMul's B gets a Pad of its K rows with zeros (a
   77 MB weight instead of the 206 MB gradient) and K is aligned for the Tensor Cores; the
   products with the zero rows add nothing (the same values up to the GEMM's order of
   additions). Where B is the Transpose of a weight that a Pad already widens to W (the LM head's
   forward pad), the Transpose reads that Pad's output instead and no Pad is added. The op rounds its float32 result once to float16
   as the Cast did and writes the Pad's zeros, so the values are the same bits. On GPT-2 b8 s256
   the float32 ``dx`` (412 MB) and its two Casts were ~1.6 GB of traffic a step, the Pad of the
   weight gradient's N 0.4 GB; the fused op writes 206 MB.

The values agree with the unfused graph's within float32 rounding: ``lse`` is the float32
log-sum-exp (LogSoftmax's ``x - max - log(sum)`` in another order), ``dx`` is ``g - exp(x - lse)
* t`` element by element. A row whose label is outside ``[-C, C)`` has a zero one-hot row in both.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, oplists
from onnxcampo.rewrites.reductions import MOVES, reduce_axes

log = logging.getLogger(__name__)

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


@dataclass
class LossFusionResult:
    forward: int = 0  # SoftmaxCrossEntropy nodes made
    backward: int = 0  # SoftmaxCrossEntropyGrad nodes made
    nodes: int = 0  # nodes they replace
    casts: int = 0  # Casts of the logits folded in
    slices: int = 0  # Slices of padded logits read past
    prediction_slices: int = 0  # of those, Slices of the prediction removed (evaluation slices it back)
    gradient_casts: int = 0  # rule 5: Casts after the gradient folded into it
    gradient_pads: int = 0  # rule 5: Pads after the gradient folded into it
    gradient_matmuls: int = 0  # rule 5b: MatMuls reading the padded gradient, their B padded
    gradient_transposes: int = 0  # of those, B the Transpose of a weight already padded (no Pad added)

    def to_json(self) -> dict:
        return {"softmax_cross_entropy": self.forward, "softmax_cross_entropy_grad": self.backward,
                "nodes_replaced": self.nodes, "casts_folded": self.casts, "slices_read_past": self.slices,
                "prediction_slices_removed": self.prediction_slices, "gradient_casts_folded": self.gradient_casts,
                "gradient_pads_folded": self.gradient_pads, "gradient_matmuls_padded": self.gradient_matmuls,
                "gradient_matmuls_reading_a_padded_weight": self.gradient_transposes}


@dataclass
class _Match:
    x: str
    labels: str
    classes: int
    width: int
    picked: str
    forward_at: onnx.NodeProto  # the node whose place the forward takes
    removed: list[onnx.NodeProto]
    scale: str | None = None
    dx: str | None = None
    backward_at: onnx.NodeProto | None = None
    casts: int = 0
    slices: int = 0
    prediction_slice: dict | None = None


def fuse_softmax_cross_entropy(model: onnx.ModelProto,
                               info: dict[str, ir.TensorInfo] | None = None) -> LossFusionResult:
    """Replace the cross-entropy losses of ``model`` (in place) and their gradients by the fused ops.
    ``info``: the model's tensor types and shapes when the caller has them (else inferred here);
    the tensors the rewrite makes are added to it."""
    result = LossFusionResult()
    if not any(n.op_type == "LogSoftmax" for n in model.graph.node):
        return result
    from onnxcampo.ops import nodes as op_nodes

    if info is None:
        info, _ = ir.infer_tensor_info(model)
    edit = ir.ModelEdit(model, fresh_prefix="xent")
    constants = edit.constants()
    producers, consumers = edit.producers(), edit.consumers()
    protected = edit.interface()
    prediction = ir.metadata(model, ir.PREDICTION_KEY)
    kept_names = protected - {prediction}  # graph inputs and outputs, what subgraphs read
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)

    def static(name: str) -> tuple[int, ...] | None:
        return ir.static_shape(info, name, empty=False)

    def dtype(name: str) -> int | None:
        return ir.tensor_dtype(info, name)

    def readers(name: str) -> list[onnx.NodeProto]:
        return [] if name in protected else consumers.get(name, [])

    def sole(name: str) -> onnx.NodeProto | None:
        found = readers(name)
        return found[0] if len(found) == 1 else None

    def default(node: onnx.NodeProto | None, op: str) -> bool:
        return node is not None and node.op_type == op and node.domain in oplists.DEFAULT_DOMAINS

    def constant(name: str) -> np.ndarray | None:
        tensor = constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    def other(node: onnx.NodeProto, name: str) -> str | None:
        """The Mul/Sub input that is not ``name`` (None when both or neither are)."""
        if len(node.input) != 2 or (node.input[0] == name) == (node.input[1] == name):
            return None
        return node.input[1] if node.input[0] == name else node.input[0]

    def views(start: str) -> tuple[str, list[onnx.NodeProto]]:
        """``start`` through the view chain its sole readers make: (the last value, the views)."""
        chain, value = [], start
        while True:
            nxt = sole(value)
            if nxt is None or nxt.op_type not in MOVES or nxt.domain not in oplists.DEFAULT_DOMAINS \
                    or nxt.input[0] != value or static(nxt.output[0]) is None:
                return value, chain
            chain.append(nxt)
            value = nxt.output[0]

    def forward(node: onnx.NodeProto) -> _Match | None:
        """Rule 1 (and rule 3), from the LogSoftmax."""
        xf, logp = node.input[0], node.output[0]
        shape = static(xf)
        if shape is None or dtype(xf) not in FLOATS or static(logp) != shape:
            return None
        rank = len(shape)
        axis = ir.attribute(node, "axis", -1 if opset >= 13 else 1)
        if axis % rank != rank - 1 or (opset < 13 and rank != 2):
            return None
        classes = shape[-1]
        rows = math.prod(shape[:-1])
        users = readers(logp)
        mul = [u for u in users if default(u, "Mul")]
        exp = [u for u in users if default(u, "Exp")]
        if len(mul) != 1 or len(exp) > 1 or len(users) != len(mul) + len(exp):
            return None
        mul = mul[0]
        onehot_out = other(mul, logp)
        onehot = producers.get(onehot_out) if onehot_out else None
        if not default(onehot, "OneHot") or static(mul.output[0]) != shape or onehot_out in protected:
            return None
        labels, depth, values = (list(onehot.input) + ["", "", ""])[:3]
        depth_value, values_value = constant(depth), constant(values)
        if (dtype(labels) != TensorProto.INT64 or static(labels) is None or math.prod(static(labels)) != rows
                or depth_value is None or depth_value.size != 1 or int(depth_value.reshape(-1)[0]) != classes
                or values_value is None or values_value.reshape(-1).tolist() != [0.0, 1.0]
                or ir.attribute(onehot, "axis", -1) % (len(static(labels)) + 1) != len(static(labels))):
            return None
        total = sole(mul.output[0])
        if not default(total, "ReduceSum") or static(total.output[0]) != static(labels):
            return None
        if reduce_axes(total, constants, rank) != [rank - 1] or dtype(total.output[0]) not in FLOATS:
            return None
        onehot_users = readers(onehot_out)
        if mul not in onehot_users or len(onehot_users) > 2:
            return None
        removed = [node, onehot, mul, total]
        forward_at = max((node, onehot), key=lambda n: position[id(n)])
        match = _Match(x=xf, labels=labels, classes=classes, width=classes, picked=total.output[0],
                       forward_at=forward_at, removed=removed)
        if exp:
            if not backward(match, exp[0], [u for u in onehot_users if u is not mul], rows):
                return None
        elif len(onehot_users) != 1:
            return None
        fold_input(match, node)
        return match

    def backward(match: _Match, exp: onnx.NodeProto, onehot_users: list[onnx.NodeProto], rows: int) -> bool:
        """Rule 2: fills ``match``'s backward; False when the pattern is not there."""
        if len(onehot_users) != 1:
            return False
        onehot_out = match.removed[1].output[0]
        first = onehot_users[0]
        v, v_chain = onehot_out, []
        if first.op_type in MOVES and first.domain in oplists.DEFAULT_DOMAINS and first.input[0] == onehot_out \
                and static(first.output[0]) is not None:
            v, v_chain = views(first.output[0])
            v_chain.insert(0, first)
        g_node = sole(v) if v_chain else first
        if not default(g_node, "Mul"):
            return False
        g = g_node.output[0]
        g_shape = static(g)
        a = other(g_node, v)
        if g_shape is None or a is None or static(v) != g_shape or dtype(g) not in FLOATS:
            return False
        split = _row_split(g_shape, rows, match.classes)
        if split is None:
            return False
        scale, expand = scale_of(a, g_shape, split)
        if scale is None:
            return False
        g_users = readers(g)
        t_node = next((u for u in g_users if default(u, "ReduceSum")), None)
        sub = next((u for u in g_users if default(u, "Sub")), None)
        if len(g_users) != 2 or t_node is None or sub is None or sub.input[0] != g:
            return False
        t = t_node.output[0]
        class_axes = list(range(split, len(g_shape)))
        reduced = reduce_axes(t_node, constants, len(g_shape))
        row_shape = tuple(g_shape[:split]) + (1,) * (len(g_shape) - split)
        if (reduced is None or not set(d for d in class_axes if g_shape[d] > 1) <= set(reduced) <= set(class_axes)
                or static(t) != row_shape or ir.attribute(t_node, "keepdims", 1) != 1):
            return False
        e, e_chain = views(exp.output[0])
        m_node = sole(t)
        if not default(m_node, "Mul") or other(m_node, t) != e or sole(e) is not m_node or static(e) != g_shape:
            return False
        m = m_node.output[0]
        if sole(m) is not sub or sub.input[1] != m or static(sub.output[0]) != g_shape:
            return False
        if dtype(sub.output[0]) not in FLOATS or dtype(scale) not in FLOATS:
            return False
        match.removed += [*v_chain, g_node, t_node, exp, *e_chain, m_node, sub] + ([expand] if expand else [])
        match.scale, match.dx, match.backward_at = scale, sub.output[0], sub
        return True

    def scale_of(a: str, g_shape: tuple[int, ...], split: int) -> tuple[str | None, onnx.NodeProto | None]:
        """Rule 2's ``a``: (the scale tensor, the Expand to remove or None)."""
        shape = static(a)
        if shape is not None and math.prod(shape) == 1:
            return a, None
        expand = producers.get(a)
        if not default(expand, "Expand") or sole(a) is None or static(expand.input[0]) is None:
            return None, None
        s = expand.input[0]
        s_shape = (1,) * (len(g_shape) - len(static(s))) + tuple(static(s))
        if len(s_shape) != len(g_shape) or any(d != 1 for d in s_shape[split:]):
            return None, None
        if s_shape[:split] != tuple(g_shape[:split]) and math.prod(s_shape) != 1:
            return None, None
        return s, expand

    def fold_input(match: _Match, log_softmax: onnx.NodeProto) -> None:
        """Rule 3."""
        x = match.x
        cast = producers.get(x)
        if (default(cast, "Cast") and sole(x) is log_softmax and ir.attribute(cast, "to") == TensorProto.FLOAT
                and dtype(cast.input[0]) == TensorProto.FLOAT16):
            match.removed.append(cast)
            match.casts += 1
            x = cast.input[0]
        cut = producers.get(x)
        if default(cut, "Slice") and static(cut.input[0]) is not None:
            source = static(cut.input[0])
            starts, ends = constant(cut.input[1]), constant(cut.input[2])
            axes = constant(cut.input[3]) if len(cut.input) > 3 and cut.input[3] else np.arange(len(source))
            steps = constant(cut.input[4]) if len(cut.input) > 4 and cut.input[4] else np.ones(len(source))
            rank = len(source)
            if (starts is not None and ends is not None and axes is not None and steps is not None
                    and axes.size == 1 and int(axes.reshape(-1)[0]) % rank == rank - 1
                    and int(starts.reshape(-1)[0]) == 0 and int(steps.reshape(-1)[0]) == 1
                    and static(x) == source[:-1] + (match.classes,) and source[-1] > match.classes):
                match.width = source[-1]
                match.slices += 1
                if len(readers(x)) == 1 and x not in protected:
                    match.removed.append(cut)
                elif x == prediction and x not in kept_names and len(consumers.get(x, [])) == 1:
                    match.removed.append(cut)  # rule 3: evaluation slices the prediction back
                    match.prediction_slice = {"input": cut.input[0], "columns": match.classes}
                x = cut.input[0]
        match.x = x

    position = {id(n): k for k, n in enumerate(model.graph.node)}
    matches: list[_Match] = []
    taken: set[int] = set()
    for node in list(model.graph.node):
        if not default(node, "LogSoftmax") or id(node) in taken:
            continue
        match = forward(node)
        if match is None or any(id(n) in taken for n in match.removed):
            continue
        taken.update(id(n) for n in match.removed)
        matches.append(match)
    if not matches:
        return result

    made: dict[int, onnx.NodeProto] = {}
    new_info: list[onnx.ValueInfoProto] = []
    for match in matches:
        classes = match.classes if match.width != match.classes else None
        lse = edit.fresh(f"{match.picked}/lse")
        made[id(match.forward_at)] = op_nodes.softmax_cross_entropy(
            match.x, match.labels, picked=match.picked, lse=lse, classes=classes,
            output_type=dtype(match.picked), name=edit.fresh(f"{match.forward_at.name or 'loss'}/softmax_cross_entropy"))
        new_info += [helper.make_tensor_value_info(match.picked, dtype(match.picked), list(static(match.picked))),
                     helper.make_tensor_value_info(lse, TensorProto.FLOAT, list(static(match.picked)))]
        result.forward += 1
        if match.dx is not None:
            made[id(match.backward_at)] = op_nodes.softmax_cross_entropy_grad(
                match.x, lse, match.labels, match.scale, output=match.dx, classes=classes,
                output_type=dtype(match.dx), output_shape=list(static(match.dx)),
                name=edit.fresh(f"{match.backward_at.name or 'loss'}/softmax_cross_entropy_grad"))
            new_info.append(helper.make_tensor_value_info(match.dx, dtype(match.dx), list(static(match.dx))))
            result.backward += 1
        result.nodes += len(match.removed)
        result.casts += match.casts
        result.slices += match.slices

    edit.replace_nodes(made, {id(n) for m in matches for n in m.removed}, new_info)
    ir.record_value_infos(info, new_info)
    made_grads = {n.output[0] for n in made.values() if n.op_type == "SoftmaxCrossEntropyGrad"}
    for node in [n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyGrad" and n.output[0] in made_grads]:
        _fold_gradient_casts_and_pads(model, node, info, result)  # the graph's own node (extend copies)
    for match in matches:
        if match.prediction_slice is not None:
            ir.set_metadata(model, ir.PREDICTION_SLICE_KEY, json.dumps(match.prediction_slice))
            result.prediction_slices += 1
    op_nodes.import_domain(model)
    log.info("fuse-reductions: %d cross-entropy loss(es) (%d with the gradient) as fused ops, %d nodes replaced",
             result.forward, result.backward, result.nodes)
    return result


def _last_non_one(shape: tuple[int, ...]) -> int | None:
    """The index of the last dimension that is not 1 (None when all are)."""
    return next((k for k in reversed(range(len(shape))) if shape[k] != 1), None)


def _fold_gradient_casts_and_pads(model: onnx.ModelProto, grad: onnx.NodeProto, info: dict[str, ir.TensorInfo],
                                  result: LossFusionResult) -> None:
    """Rule 5 on one SoftmaxCrossEntropyGrad node (made float32 by rule 4)."""
    edit = ir.ModelEdit(model, fresh_prefix="xent")
    constants, consumers = edit.constants(), edit.consumers()
    protected = edit.interface()
    dx = grad.output[0]
    classes = ir.attribute(grad, "classes", None)
    dx_shape = ir.static_shape(info, dx, empty=False) or tuple(ir.attribute(grad, "output_shape", None) or ()) or None
    if ir.attribute(grad, "output_type", TensorProto.FLOAT) != TensorProto.FLOAT or dx_shape is None:
        return
    axis = _last_non_one(dx_shape)
    if axis is None or (classes is not None and dx_shape[axis] != classes):
        return
    classes = dx_shape[axis]
    views: list[onnx.NodeProto] = []
    casts: list[onnx.NodeProto] = []
    pads: list[onnx.NodeProto] = []
    ends: list[onnx.NodeProto] = []  # readers after a Cast that are neither views nor Pads
    matmuls: list[onnx.NodeProto] = []  # of those, MatMuls whose K is the class axis (rule 5b)
    widths: set[int] = set()

    def pad_width(node: onnx.NodeProto, shape: tuple[int, ...]) -> int | None:
        """W when ``node`` pads only the end of ``shape``'s last axis (the classes) with zeros."""
        if ir.attribute(node, "mode", b"constant") not in (b"constant", "constant") or len(node.input) < 2:
            return None
        amounts = constants.get(node.input[1])
        value = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if amounts is None or (len(node.input) > 2 and node.input[2] and value is None) or len(node.input) > 3:
            return None
        if value is not None and np.any(numpy_helper.to_array(value) != 0):
            return None
        pads_ = [int(v) for v in numpy_helper.to_array(amounts).reshape(-1)]
        rank = len(shape)
        if len(pads_) != 2 * rank or _last_non_one(shape) != rank - 1 or any(pads_[:2 * rank - 1]) or pads_[-1] < 0:
            return None
        return shape[-1] + pads_[-1]

    def walk(value: str, cast_seen: bool) -> bool:
        """Every reader path from ``value`` fits rule 5 (collecting its nodes)."""
        readers = consumers.get(value, [])
        if value in protected or not readers:
            return False
        for node in readers:
            if node.domain not in oplists.DEFAULT_DOMAINS or not node.input or node.input[0] != value:
                if cast_seen:
                    ends.append(node)
                    continue
                return False
            shape = ir.static_shape(info, node.output[0], empty=False) if node.output else None
            if node.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Identity"):
                if shape is None or _last_non_one(shape) is None or shape[_last_non_one(shape)] != classes:
                    return False
                views.append(node)
                if not walk(node.output[0], cast_seen):
                    return False
            elif node.op_type == "Cast" and not cast_seen:
                if ir.attribute(node, "to") != TensorProto.FLOAT16:
                    return False
                casts.append(node)
                if not walk(node.output[0], True):
                    return False
            elif node.op_type == "Pad" and cast_seen:
                source = ir.static_shape(info, value, empty=False)
                width = None if source is None else pad_width(node, source)
                if width is None:
                    ends.append(node)  # another Pad: a reader like any other
                else:
                    widths.add(width)
                    pads.append(node)
            elif cast_seen:
                ends.append(node)
                source = ir.static_shape(info, value, empty=False)
                b = ir.static_shape(info, node.input[1], empty=False) if len(node.input) > 1 else None
                if node.op_type == "MatMul" and source is not None and _last_non_one(source) == len(source) - 1 \
                        and b is not None and len(b) == 2 and b[0] == classes:
                    matmuls.append(node)
            else:
                return False
        return True

    if not walk(dx, False) or not casts:
        return
    padded_matmuls: list[str] = []  # rule 5b: the outputs of the MatMuls whose B gets a Pad
    if len(widths) == 1 and ends and len(matmuls) == len(ends):
        # a MatMul reading the gradient as A (K the classes) reads it padded too, its B padded
        # with zero rows to the same K; its products with the zeros add nothing
        padded_matmuls = [node.output[0] for node in matmuls]
        ends = []
    if ends or len(widths) != 1:  # the Pads stay (readers like the others): float16 rows of C
        ends += pads
        pads, widths = [], set()
    width = widths.pop() if widths else classes
    new_info = []

    def widened(shape: tuple[int, ...]) -> list[int]:
        out = list(shape)
        out[_last_non_one(shape)] = width
        return out

    old_shapes = {view.input[1] for view in views if view.op_type == "Reshape"}
    for view in views:
        shape = widened(ir.static_shape(info, view.output[0], empty=False))
        if view.op_type == "Reshape":
            target = edit.fresh(f"{view.name or 'reshape'}/padded_shape")
            model.graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), target))
            view.input[1] = target
        new_info.append(helper.make_tensor_value_info(view.output[0], TensorProto.FLOAT16, shape))
    new_info.append(helper.make_tensor_value_info(dx, TensorProto.FLOAT16, widened(dx_shape)))
    for key, value in (("output_type", TensorProto.FLOAT16), ("output_shape", widened(dx_shape))):
        for attribute in list(grad.attribute):
            if attribute.name == key:
                grad.attribute.remove(attribute)
        grad.attribute.append(helper.make_attribute(key, value))
    if width != classes:
        grad.attribute.append(helper.make_attribute("output_columns", width))
    if ir.attribute(grad, "classes", None) is None:
        grad.attribute.append(helper.make_attribute("classes", classes))
    for node in casts + pads:
        edit.replace_uses(node.output[0], node.input[0])
    edit.replace_nodes({}, {id(n) for n in casts + pads}, new_info)
    edit.drop_unread(old_shapes)
    ir.record_value_infos(info, new_info)
    if padded_matmuls:
        producers, readers_of = edit.producers(), edit.consumers()
    for node in [n for n in model.graph.node if n.output and n.output[0] in padded_matmuls]:
        b, b_shape = node.input[1], ir.static_shape(info, node.input[1], empty=False)
        dtype_b = ir.tensor_dtype(info, b)
        b_info = None
        # B = Transpose(X) of a weight X [N, C] that a Pad already widens to [N, W] (the LM head's
        # forward): B padded is the Transpose of that Pad's output, no Pad of its own
        transpose = producers.get(b)
        if transpose is not None and transpose.op_type == "Transpose" and len(readers_of.get(b, [])) == 1 \
                and b not in protected and list(ir.attribute(transpose, "perm", [1, 0]) or [1, 0]) == [1, 0]:
            source = transpose.input[0]
            for pad in readers_of.get(source, []):
                if pad.op_type == "Pad" and pad.domain in oplists.DEFAULT_DOMAINS and pad.input[0] == source \
                        and pad_width(pad, (b_shape[1], classes)) == width:
                    transpose.input[0] = pad.output[0]
                    b_info = helper.make_tensor_value_info(b, dtype_b, [width, b_shape[1]])
                    result.gradient_transposes += 1
                    break
        if b_info is None:
            amounts = edit.fresh(f"{node.name or 'matmul'}/pad_k_rows")
            padded_b = edit.fresh(f"{b}/padded_k")
            model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, width - classes, 0], np.int64),
                                                                   amounts))
            model.graph.node.append(helper.make_node("Pad", [b, amounts], [padded_b],
                                                     name=edit.fresh(f"{node.name or 'matmul'}/pad_b")))
            b_info = helper.make_tensor_value_info(padded_b, dtype_b, [width, b_shape[1]])
            node.input[1] = padded_b
        kept_info = [v for v in model.graph.value_info if v.name != b_info.name]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept_info + [b_info])
        ir.record_value_infos(info, [b_info])
        result.gradient_matmuls += 1
    if padded_matmuls:
        ir.toposort_model(model)
    result.gradient_casts += len(casts)
    result.gradient_pads += len(pads)


def _row_split(shape: tuple[int, ...], rows: int, classes: int) -> int | None:
    """The axis ``k`` with ``prod(shape[:k]) == rows`` and ``prod(shape[k:]) == classes`` (the
    rows' axes before it, the classes' from it), the last such; None when there is none."""
    found = None
    for k in range(len(shape) + 1):
        if math.prod(shape[:k]) == rows and math.prod(shape[k:]) == classes:
            found = k
    return found


__all__ = ["LossFusionResult", "fuse_softmax_cross_entropy"]
