"""``--fuse-reductions``, the loss: a cross-entropy over the last axis and its gradient as one
``ai.onnxcampo::SoftmaxCrossEntropy`` and one ``SoftmaxCrossEntropyGrad`` node
(``onnxcampo/ops/xent/__init__.py``, ``docs/ops.md``).

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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, oplists
from onnxcampo.plan import Precision
from onnxcampo.rewrites.matcher import FLOATS, VIEWS, GraphView, Miss, match_all

if TYPE_CHECKING:
    from onnxcampo.casting import PrecisionOf
    from onnxcampo.context import GraphContext

log = logging.getLogger(__name__)

GRADIENT_VIEWS = ("Reshape", "Squeeze", "Unsqueeze", "Identity")  # rule 5's views


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


class _LossView(GraphView):
    """The matcher's view with what the loss rules read besides: the opset, the nodes' order and
    the step's prediction (which rule 3 may slice back at evaluation)."""

    def __init__(self, model: onnx.ModelProto, info: dict[str, ir.TensorInfo]) -> None:
        super().__init__(model, info, fresh_prefix="xent", empty=False)
        self.prediction = ir.metadata(model, ir.PREDICTION_KEY)
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.position = {id(n): k for k, n in enumerate(model.graph.node)}

    def uses(self, name: str) -> list[onnx.NodeProto]:
        """The readers of ``name``, none when it is protected (a graph output or read by a subgraph)."""
        return [] if name in self.protected else self.readers(name)


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
    view = _LossView(model, info)
    matches: list[_Match] = match_all(view, "LogSoftmax", [_loss], "fuse-reductions (loss)")
    if not matches:
        return result
    made = _replace(view, matches, result)
    for node in [n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyGrad" and n.output[0] in made]:
        _fold_gradient_casts_and_pads(model, node, info, result)  # the graph's own node (extend copies)
    for match in matches:
        if match.prediction_slice is not None:
            ir.set_metadata(model, ir.PREDICTION_SLICE_KEY, json.dumps(match.prediction_slice))
            result.prediction_slices += 1
    op_nodes.import_domain(model)
    log.info("fuse-reductions: %d cross-entropy loss(es) (%d with the gradient) as fused ops, %d nodes replaced",
             result.forward, result.backward, result.nodes)
    return result


# --- the pattern (rules 1-3) ------------------------------------------------------------------


def _loss(view: _LossView, node: onnx.NodeProto) -> _Match | Miss:
    """Rules 1-3 from the LogSoftmax ``node``."""
    found = _forward(view, node)
    if not found:
        return found
    match, exp, onehot_users, rows = found
    if exp is not None:
        missed = _backward(view, match, exp, onehot_users, rows)
        if missed is not None:
            return missed
    elif onehot_users:
        return Miss("the one-hot has other readers and there is no gradient")
    _fold_input(view, match, node)
    return match


def _forward(view: _LossView, node: onnx.NodeProto):
    """Rule 1: (the match, the Exp reading the log probabilities or None, the one-hot's other
    readers, the rows), or a Miss."""
    xf, logp = node.input[0], node.output[0]
    shape = view.static(xf)
    if shape is None or view.dtype(xf) not in FLOATS or view.static(logp) != shape:
        return Miss("the logits are not a float tensor of a static shape")
    rank = len(shape)
    axis = ir.attribute(node, "axis", -1 if view.opset >= 13 else 1)
    if axis % rank != rank - 1 or (view.opset < 13 and rank != 2):
        return Miss("not over the last axis")
    classes, rows = shape[-1], math.prod(shape[:-1])
    users = view.uses(logp)
    mul = [u for u in users if view.is_op(u, "Mul")]
    exp = [u for u in users if view.is_op(u, "Exp")]
    if len(mul) != 1 or len(exp) > 1 or len(users) != len(mul) + len(exp):
        return Miss("the log probabilities are not read by one Mul and at most one Exp")
    mul = mul[0]
    onehot_out = view.other(mul, logp)
    onehot = view.producers.get(onehot_out) if onehot_out else None
    if not view.is_op(onehot, "OneHot") or view.static(mul.output[0]) != shape or onehot_out in view.protected:
        return Miss("the Mul does not read a one-hot of the logits' shape")
    labels = _onehot_labels(view, onehot, rows, classes)
    if not labels:
        return labels
    total = view.sole_reader(mul.output[0])
    if not view.is_op(total, "ReduceSum") or view.static(total.output[0]) != view.static(labels):
        return Miss("the product is not summed to the labels' shape")
    if view.reduce_axes(total, rank) != [rank - 1] or view.dtype(total.output[0]) not in FLOATS:
        return Miss("the sum is not over the classes")
    onehot_users = view.uses(onehot_out)
    if mul not in onehot_users or len(onehot_users) > 2:
        return Miss("the one-hot has more readers than the Mul and the gradient")
    forward_at = max((node, onehot), key=lambda n: view.position[id(n)])
    match = _Match(x=xf, labels=labels, classes=classes, width=classes, picked=total.output[0],
                   forward_at=forward_at, removed=[node, onehot, mul, total])
    return match, (exp[0] if exp else None), [u for u in onehot_users if u is not mul], rows


def _onehot_labels(view: GraphView, onehot: onnx.NodeProto, rows: int, classes: int) -> str | Miss:
    """Rule 1's one-hot: its int64 labels, one a row, ``classes`` deep with values [0, 1] on the
    last axis; else a Miss."""
    labels, depth, values = (list(onehot.input) + ["", "", ""])[:3]
    depth_value, values_value = view.constant(depth), view.constant(values)
    labels_shape = view.static(labels)
    if view.dtype(labels) != TensorProto.INT64 or labels_shape is None or math.prod(labels_shape) != rows:
        return Miss("the labels are not int64, one a row")
    if depth_value is None or depth_value.size != 1 or int(depth_value.reshape(-1)[0]) != classes:
        return Miss("the one-hot's depth is not the classes")
    if values_value is None or values_value.reshape(-1).tolist() != [0.0, 1.0]:
        return Miss("the one-hot's values are not [0, 1]")
    if ir.attribute(onehot, "axis", -1) % (len(labels_shape) + 1) != len(labels_shape):
        return Miss("the one-hot is not on the last axis")
    return labels


def _backward(view: _LossView, match: _Match, exp: onnx.NodeProto, onehot_users: list[onnx.NodeProto],
              rows: int) -> Miss | None:
    """Rule 2: fills ``match``'s backward; a Miss when the pattern is not there."""
    if len(onehot_users) != 1:
        return Miss("the gradient does not read the one-hot once")
    onehot_out, first = match.removed[1].output[0], onehot_users[0]
    v, v_chain = onehot_out, []
    if first.op_type in VIEWS and first.domain in oplists.DEFAULT_DOMAINS and first.input[0] == onehot_out \
            and view.static(first.output[0]) is not None:
        v, v_chain = view.views_after(first.output[0])
        v_chain.insert(0, first)
    g_node = view.sole_reader(v) if v_chain else first
    if not view.is_op(g_node, "Mul"):
        return Miss("the one-hot is not scaled by a Mul")
    g, a = g_node.output[0], view.other(g_node, v)
    g_shape = view.static(g)
    if g_shape is None or a is None or view.static(v) != g_shape or view.dtype(g) not in FLOATS:
        return Miss("the scaled one-hot is not a float tensor of the one-hot's shape")
    split = _row_split(g_shape, rows, match.classes)
    if split is None:
        return Miss("the scaled one-hot's shape does not split into rows and classes")
    scale, expand = _scale_of(view, a, g_shape, split)
    if scale is None:
        return Miss("the one-hot's scale is not one value a row")
    g_users = view.uses(g)
    t_node = next((u for u in g_users if view.is_op(u, "ReduceSum")), None)
    sub = next((u for u in g_users if view.is_op(u, "Sub")), None)
    if len(g_users) != 2 or t_node is None or sub is None or sub.input[0] != g:
        return Miss("the scaled one-hot is not read by one ReduceSum and one Sub")
    t = t_node.output[0]
    class_axes = list(range(split, len(g_shape)))
    reduced = view.reduce_axes(t_node, len(g_shape))
    row_shape = tuple(g_shape[:split]) + (1,) * (len(g_shape) - split)
    if (reduced is None or not set(d for d in class_axes if g_shape[d] > 1) <= set(reduced) <= set(class_axes)
            or view.static(t) != row_shape or ir.attribute(t_node, "keepdims", 1) != 1):
        return Miss("the gradient's sum is not over the classes with keepdims")
    e, e_chain = view.views_after(exp.output[0])
    m_node = view.sole_reader(t)
    if not view.is_op(m_node, "Mul") or view.other(m_node, t) != e or view.sole_reader(e) is not m_node \
            or view.static(e) != g_shape:
        return Miss("the sum does not scale the probabilities")
    m = m_node.output[0]
    if view.sole_reader(m) is not sub or sub.input[1] != m or view.static(sub.output[0]) != g_shape:
        return Miss("the scaled probabilities are not subtracted from the scaled one-hot")
    if view.dtype(sub.output[0]) not in FLOATS or view.dtype(scale) not in FLOATS:
        return Miss("the gradient or its scale is not float")
    match.removed += [*v_chain, g_node, t_node, exp, *e_chain, m_node, sub] + ([expand] if expand else [])
    match.scale, match.dx, match.backward_at = scale, sub.output[0], sub
    return None


def _scale_of(view: GraphView, a: str, g_shape: tuple[int, ...],
              split: int) -> tuple[str | None, onnx.NodeProto | None]:
    """Rule 2's ``a``: (the scale tensor, the Expand to remove or None)."""
    shape = view.static(a)
    if shape is not None and math.prod(shape) == 1:
        return a, None
    expand = view.producers.get(a)
    if not view.is_op(expand, "Expand") or view.sole_reader(a) is None or view.static(expand.input[0]) is None:
        return None, None
    s = expand.input[0]
    s_shape = (1,) * (len(g_shape) - len(view.static(s))) + tuple(view.static(s))
    if len(s_shape) != len(g_shape) or any(d != 1 for d in s_shape[split:]):
        return None, None
    if s_shape[:split] != tuple(g_shape[:split]) and math.prod(s_shape) != 1:
        return None, None
    return s, expand


def _fold_input(view: _LossView, match: _Match, log_softmax: onnx.NodeProto) -> None:
    """Rule 3: the Cast to float32 and the Slice of padded classes in front of the logits."""
    x = match.x
    cast = view.producers.get(x)
    if (view.is_op(cast, "Cast") and view.sole_reader(x) is log_softmax
            and ir.attribute(cast, "to") == TensorProto.FLOAT and view.dtype(cast.input[0]) == TensorProto.FLOAT16):
        match.removed.append(cast)
        match.casts += 1
        x = cast.input[0]
    cut = view.producers.get(x)
    if view.is_op(cut, "Slice") and _slices_classes(view, cut, x, match.classes):
        match.width = view.static(cut.input[0])[-1]
        match.slices += 1
        if len(view.uses(x)) == 1 and x not in view.protected:
            match.removed.append(cut)
        elif x == view.prediction and len(view.readers(x)) == 1:
            match.removed.append(cut)  # rule 3: evaluation slices the prediction back
            match.prediction_slice = {"input": cut.input[0], "columns": match.classes}
        x = cut.input[0]
    match.x = x


def _slices_classes(view: GraphView, cut: onnx.NodeProto, x: str, classes: int) -> bool:
    """Whether the Slice ``cut`` (writing ``x``) keeps the first ``classes`` of a wider last axis."""
    source = view.static(cut.input[0])
    if source is None:
        return False
    rank = len(source)
    starts, ends = view.constant(cut.input[1]), view.constant(cut.input[2])
    axes = view.constant(cut.input[3]) if len(cut.input) > 3 and cut.input[3] else np.arange(rank)
    steps = view.constant(cut.input[4]) if len(cut.input) > 4 and cut.input[4] else np.ones(rank)
    return (starts is not None and ends is not None and axes is not None and steps is not None
            and axes.size == 1 and int(axes.reshape(-1)[0]) % rank == rank - 1
            and int(starts.reshape(-1)[0]) == 0 and int(steps.reshape(-1)[0]) == 1
            and view.static(x) == source[:-1] + (classes,) and source[-1] > classes)


def _replace(view: _LossView, matches: list[_Match], result: LossFusionResult) -> set[str]:
    """Rule 4: the fused nodes in the matches' places; the names of the gradients made."""
    from onnxcampo.ops import nodes as op_nodes

    made: dict[int, onnx.NodeProto] = {}
    outputs: list[str] = []
    lses: list[onnx.ValueInfoProto] = []
    for match in matches:
        classes = match.classes if match.width != match.classes else None
        lse = view.edit.fresh(f"{match.picked}/lse")
        made[id(match.forward_at)] = op_nodes.softmax_cross_entropy(
            match.x, match.labels, picked=match.picked, lse=lse, classes=classes,
            output_type=view.dtype(match.picked),
            name=view.edit.fresh(f"{match.forward_at.name or 'loss'}/softmax_cross_entropy"))
        outputs.append(match.picked)
        lses.append(helper.make_tensor_value_info(lse, TensorProto.FLOAT, list(view.static(match.picked))))
        result.forward += 1
        if match.dx is not None:
            made[id(match.backward_at)] = op_nodes.softmax_cross_entropy_grad(
                match.x, lse, match.labels, match.scale, output=match.dx, classes=classes,
                output_type=view.dtype(match.dx), output_shape=list(view.static(match.dx)),
                name=view.edit.fresh(f"{match.backward_at.name or 'loss'}/softmax_cross_entropy_grad"))
            outputs.append(match.dx)
            result.backward += 1
        result.nodes += len(match.removed)
        result.casts += match.casts
        result.slices += match.slices
    view.replace(made, {id(n) for m in matches for n in m.removed}, outputs, extra=lses)
    return {m.dx for m in matches if m.dx is not None}


# --- after the gradient (rule 5) --------------------------------------------------------------


def _last_non_one(shape: tuple[int, ...]) -> int | None:
    """The index of the last dimension that is not 1 (None when all are)."""
    return next((k for k in reversed(range(len(shape))) if shape[k] != 1), None)


def _pad_width(constants: dict[str, onnx.TensorProto], node: onnx.NodeProto, shape: tuple[int, ...]) -> int | None:
    """W when the Pad ``node`` pads only the end of ``shape``'s last axis (the classes) with zeros."""
    if ir.attribute(node, "mode", b"constant") not in (b"constant", "constant") or len(node.input) < 2:
        return None
    amounts = constants.get(node.input[1])
    value = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if amounts is None or (len(node.input) > 2 and node.input[2] and value is None) or len(node.input) > 3:
        return None
    if value is not None and np.any(numpy_helper.to_array(value) != 0):
        return None
    pads = [int(v) for v in numpy_helper.to_array(amounts).reshape(-1)]
    rank = len(shape)
    if len(pads) != 2 * rank or _last_non_one(shape) != rank - 1 or any(pads[:2 * rank - 1]) or pads[-1] < 0:
        return None
    return shape[-1] + pads[-1]


@dataclass
class _GradientPaths:
    """Rule 5's walk over every reader path of the gradient ``dx`` of ``classes`` columns."""

    view: GraphView
    classes: int
    views: list[onnx.NodeProto] = field(default_factory=list)
    casts: list[onnx.NodeProto] = field(default_factory=list)
    pads: list[onnx.NodeProto] = field(default_factory=list)
    ends: list[onnx.NodeProto] = field(default_factory=list)  # readers after a Cast, neither views nor Pads
    matmuls: list[onnx.NodeProto] = field(default_factory=list)  # of those, MatMuls with K the classes (5b)
    widths: set[int] = field(default_factory=set)

    def walk(self, value: str, cast_seen: bool) -> bool:
        """Every reader path from ``value`` fits rule 5 (collecting its nodes)."""
        readers = self.view.readers(value)
        if value in self.view.protected or not readers:
            return False
        for node in readers:
            if node.domain not in oplists.DEFAULT_DOMAINS or not node.input or node.input[0] != value:
                if not cast_seen:
                    return False
                self.ends.append(node)
            elif not self._step(node, value, cast_seen):
                return False
        return True

    def _step(self, node: onnx.NodeProto, value: str, cast_seen: bool) -> bool:
        view = self.view
        if node.op_type in GRADIENT_VIEWS:
            shape = view.static(node.output[0]) if node.output else None
            if shape is None or _last_non_one(shape) is None or shape[_last_non_one(shape)] != self.classes:
                return False
            self.views.append(node)
            return self.walk(node.output[0], cast_seen)
        if node.op_type == "Cast" and not cast_seen:
            if ir.attribute(node, "to") != TensorProto.FLOAT16:
                return False
            self.casts.append(node)
            return self.walk(node.output[0], True)
        if not cast_seen:
            return False
        source = view.static(value)
        if node.op_type == "Pad":
            width = None if source is None else _pad_width(view.constants, node, source)
            if width is None:
                self.ends.append(node)  # another Pad: a reader like any other
            else:
                self.widths.add(width)
                self.pads.append(node)
            return True
        self.ends.append(node)
        b = view.static(node.input[1]) if len(node.input) > 1 else None
        if node.op_type == "MatMul" and source is not None and _last_non_one(source) == len(source) - 1 \
                and b is not None and len(b) == 2 and b[0] == self.classes:
            self.matmuls.append(node)
        return True


def _fold_gradient_casts_and_pads(model: onnx.ModelProto, grad: onnx.NodeProto, info: dict[str, ir.TensorInfo],
                                  result: LossFusionResult) -> None:
    """Rule 5 on one SoftmaxCrossEntropyGrad node (made float32 by rule 4)."""
    view = GraphView(model, info, fresh_prefix="xent", empty=False)
    dx = grad.output[0]
    classes = ir.attribute(grad, "classes", None)
    dx_shape = view.static(dx) or tuple(ir.attribute(grad, "output_shape", None) or ()) or None
    if ir.attribute(grad, "output_type", TensorProto.FLOAT) != TensorProto.FLOAT or dx_shape is None:
        return
    axis = _last_non_one(dx_shape)
    if axis is None or (classes is not None and dx_shape[axis] != classes):
        return
    paths = _GradientPaths(view, dx_shape[axis])
    if not paths.walk(dx, False) or not paths.casts:
        return
    padded_matmuls: list[str] = []  # rule 5b: the outputs of the MatMuls whose B gets a Pad
    if len(paths.widths) == 1 and paths.ends and len(paths.matmuls) == len(paths.ends):
        # a MatMul reading the gradient as A (K the classes) reads it padded too, its B padded
        # with zero rows to the same K; its products with the zeros add nothing
        padded_matmuls = [node.output[0] for node in paths.matmuls]
        paths.ends = []
    if paths.ends or len(paths.widths) != 1:  # the Pads stay (readers like the others): float16 rows of C
        paths.ends += paths.pads
        paths.pads, paths.widths = [], set()
    width = paths.widths.pop() if paths.widths else paths.classes
    _write_float16_gradient(view, grad, paths, dx_shape, width)
    for node in [n for n in model.graph.node if n.output and n.output[0] in padded_matmuls]:
        _pad_matmul_b(view, node, paths.classes, width, result)
    if padded_matmuls:
        ir.toposort_model(model)
    result.gradient_casts += len(paths.casts)
    result.gradient_pads += len(paths.pads)


def _write_float16_gradient(view: GraphView, grad: onnx.NodeProto, paths: _GradientPaths,
                            dx_shape: tuple[int, ...], width: int) -> None:
    """Rule 5's rewrite: ``grad`` writes float16 rows of ``width``, the views take ``width`` for
    the classes, the Casts and the Pads go."""
    model, dx = view.model, grad.output[0]

    def widened(shape: tuple[int, ...]) -> list[int]:
        out = list(shape)
        out[_last_non_one(shape)] = width
        return out

    new_info = []
    old_shapes = {node.input[1] for node in paths.views if node.op_type == "Reshape"}
    for node in paths.views:
        shape = widened(view.static(node.output[0]))
        if node.op_type == "Reshape":
            target = view.edit.fresh(f"{node.name or 'reshape'}/padded_shape")
            model.graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), target))
            node.input[1] = target
        new_info.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT16, shape))
    new_info.append(helper.make_tensor_value_info(dx, TensorProto.FLOAT16, widened(dx_shape)))
    for key, value in (("output_type", TensorProto.FLOAT16), ("output_shape", widened(dx_shape))):
        for attribute in list(grad.attribute):
            if attribute.name == key:
                grad.attribute.remove(attribute)
        grad.attribute.append(helper.make_attribute(key, value))
    if width != paths.classes:
        grad.attribute.append(helper.make_attribute("output_columns", width))
    if ir.attribute(grad, "classes", None) is None:
        grad.attribute.append(helper.make_attribute("classes", paths.classes))
    for node in paths.casts + paths.pads:
        view.edit.replace_uses(node.output[0], node.input[0])
    view.edit.replace_nodes({}, {id(n) for n in paths.casts + paths.pads}, new_info)
    view.edit.drop_unread(old_shapes)
    ir.record_value_infos(view.info, new_info)


def _pad_matmul_b(view: GraphView, node: onnx.NodeProto, classes: int, width: int,
                  result: LossFusionResult) -> None:
    """Rule 5b on one MatMul reading the padded gradient as A: its B gets ``width - classes`` zero
    rows, or, where B is the Transpose of a weight that a Pad already widens to ``width`` (the LM
    head's forward), the Transpose reads that Pad's output."""
    model = view.model
    producers, readers_of = view.edit.producers(), view.edit.consumers()
    b, b_shape = node.input[1], view.static(node.input[1])
    dtype_b = view.dtype(b)
    b_info = None
    transpose = producers.get(b)
    if transpose is not None and transpose.op_type == "Transpose" and len(readers_of.get(b, [])) == 1 \
            and b not in view.protected and list(ir.attribute(transpose, "perm", [1, 0]) or [1, 0]) == [1, 0]:
        source = transpose.input[0]
        for pad in readers_of.get(source, []):
            if pad.op_type == "Pad" and pad.domain in oplists.DEFAULT_DOMAINS and pad.input[0] == source \
                    and _pad_width(view.constants, pad, (b_shape[1], classes)) == width:
                transpose.input[0] = pad.output[0]
                b_info = helper.make_tensor_value_info(b, dtype_b, [width, b_shape[1]])
                result.gradient_transposes += 1
                break
    if b_info is None:
        amounts = view.edit.fresh(f"{node.name or 'matmul'}/pad_k_rows")
        padded_b = view.edit.fresh(f"{b}/padded_k")
        model.graph.initializer.append(numpy_helper.from_array(np.array([0, 0, width - classes, 0], np.int64),
                                                               amounts))
        model.graph.node.append(helper.make_node("Pad", [b, amounts], [padded_b],
                                                 name=view.edit.fresh(f"{node.name or 'matmul'}/pad_b")))
        b_info = helper.make_tensor_value_info(padded_b, dtype_b, [width, b_shape[1]])
        node.input[1] = padded_b
    kept_info = [v for v in model.graph.value_info if v.name != b_info.name]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info + [b_info])
    ir.record_value_infos(view.info, [b_info])
    result.gradient_matmuls += 1


def _row_split(shape: tuple[int, ...], rows: int, classes: int) -> int | None:
    """The axis ``k`` with ``prod(shape[:k]) == rows`` and ``prod(shape[k:]) == classes`` (the
    rows' axes before it, the classes' from it), the last such; None when there is none."""
    found = None
    for k in range(len(shape) + 1):
        if math.prod(shape[:k]) == rows and math.prod(shape[k:]) == classes:
            found = k
    return found



# --- the prediction: what the plan prices of this rewrite (``onnxcampo.estimate``) --------------


def reads_logits_cast(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    """Whether ``tensor`` is the logits of a cross-entropy loss: one fp32 LogSoftmax over the last
    axis reads it (rule 3 folds a Cast to it: SoftmaxCrossEntropy reads float16)."""
    readers = [use.node for use in ctx.uses(tensor)]
    if len(readers) != 1 or readers[0].op != "LogSoftmax" or (readers[0].domain or "") not in oplists.DEFAULT_DOMAINS:
        return False
    last = len(tensor.shape or ()) - 1
    return precision_of(readers[0].name) is Precision.FP32 and readers[0].attrs.get("axis", -1) in (-1, last)


def gradient_written_fp16(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    """Whether ``tensor`` is, through views, onnx-ad's cross-entropy gradient ``Sub(g, Mul(Exp(
    LogSoftmax(x)), t))`` and every node that reads it past the views runs fp16: rule
    5 then has ``SoftmaxCrossEntropyGrad`` write float16 and no Cast is made."""
    def default(node: gs.Node | None, *ops: str) -> bool:
        return node is not None and node.op in ops and (node.domain or "") in oplists.DEFAULT_DOMAINS

    def through_views(node: gs.Node | None) -> gs.Node | None:
        while default(node, *GRADIENT_VIEWS) and node.inputs:
            node = ctx.producer(node.inputs[0])
        return node

    source = through_views(ctx.producer(tensor))
    if not default(source, "Sub") or len(source.inputs) != 2:
        return False
    product = ctx.producer(source.inputs[1])
    if not default(product, "Mul"):
        return False
    exps = [through_views(ctx.producer(t)) for t in product.inputs]
    if not any(default(e, "Exp") and default(through_views(ctx.producer(e.inputs[0])), "LogSoftmax") for e in exps
               if e is not None and e.inputs):
        return False
    pending, readers = list(source.outputs), []
    outputs = {o.name for o in ctx.graph.outputs}
    while pending:
        value = pending.pop()
        if value.name in outputs:
            return False
        for use in ctx.uses(value):
            if default(use.node, *GRADIENT_VIEWS) and use.node.inputs and use.node.inputs[0] is value:
                pending.extend(use.node.outputs)
            else:
                readers.append(use.node)
    return bool(readers) and all(precision_of(n.name) is Precision.FP16 for n in readers)


__all__ = ["LossFusionResult", "fuse_softmax_cross_entropy"]
