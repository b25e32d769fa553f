"""``--fuse-reductions``, row gradients: the backward of a LayerNormalization over the last axis as
one ``ai.onnxcampo::LayerNormGrad`` node (``onnxcampo/ops/norm/layer_norm.py``), and a Softmax's as one
``SoftmaxGrad`` (``onnxcampo/ops/norm/softmax.py``; ``docs/ops.md``).

onnx-ad and ``training.simplify`` write a layer norm's input gradient from the standardized input
``xhat`` as ``g = dy * gamma``, ``dx = invstd * ((g - ReduceMean(g)) - xhat * ReduceMean(g * xhat))``:
four elementwise products, two Subs and two ReduceMeans over the normalized axis, each a pass over
``[rows, cols]`` (BERT-base b32: 25 layer norms of ``[4096, 768]``), and ORT's CUDA ReduceMean
runs well below the memory bandwidth. One LayerNormGrad reads dy and xhat once (a row twice, the
second time from cache) and writes dx once, the residual branch's gradient added in. Runs on the
written model after the precision plan, with the loss fusion, before the block reductions and the
elementwise fusion. Rules:

1. The pattern: ``p = Mul(dy, gamma)``; ``a = ReduceMean(p)``, ``d1 = Sub(p, a)``; ``q = Mul(xhat,
   p)``, ``b = ReduceMean(q)``, ``m = Mul(xhat, b)``; ``d2 = Sub(d1, m)``; ``dx = Mul(invstd, d2)``
   (either operand order of each Mul). ``dy``, ``xhat``, ``p`` and ``dx`` have one static shape
   whose reduced axes (constant, keepdims) are the last axes of size > 1 and hold ``cols``
   elements, the rest ``rows``; ``gamma`` holds ``cols`` elements and ``invstd`` ``rows``, each
   broadcast along the other axes only. ``p`` is read by the two ReduceMeans' branches and the
   Sub only, every other value between by the next node only, none is a graph output.
2. A two-input ``Sum(acc, dx)`` (or Add) that is dx's only reader is folded: the node adds ``acc``
   and writes the Sum's output.
3. The node takes the place of dx's Mul (or of the Sum). It reads invstd and gamma before the
   views (Reshape, Squeeze, Unsqueeze, Flatten, Identity) that broadcast them, invstd also before
   a Cast between the float types (the float32 invstd of the LayerNormalization: the plan's
   float16 copy then stays in its elementwise group instead of a Cast kernel of its own); views
   and Casts that only the removed nodes read are removed too.
4. Softmax: ``p = Mul(y, dy)``, ``t = ReduceSum(p)`` over the last axes of size > 1 (keepdims),
   ``dx = Mul(y, Sub(dy, t))`` (either operand order of the Muls), one static shape, each value
   between read by the next node only: ``SoftmaxGrad(dy, y)`` with ``cols`` the reduced length. A
   Mul by a one-element constant that is dx's only reader (the attention's scale) is folded
   (``scale``); dy and y are read before views and float Casts as in rule 3.

The result is the float32 evaluation of the same expression, rounded once to dx's type (the
unfused plan rounds each node's output to float16 where the plan put the node in fp16).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from onnxcampo import ir, oplists
from onnxcampo.rewrites.matcher import FLOATS, GraphView, Miss, match_all

log = logging.getLogger(__name__)


@dataclass
class NormFusionResult:
    fused: int = 0  # LayerNormGrad nodes made
    softmax: int = 0  # SoftmaxGrad nodes made
    nodes: int = 0  # nodes they replace (views and Casts left unread included)
    sums: int = 0  # residual Sums folded into LayerNormGrad
    scales: int = 0  # constant factors folded into SoftmaxGrad

    def to_json(self) -> dict:
        return {"layer_norm_grad": self.fused, "softmax_grad": self.softmax, "nodes_replaced": self.nodes,
                "sums_folded": self.sums, "scales_folded": self.scales}


@dataclass
class _Match:
    reads: list[str]  # what the new node reads
    output: str
    at: onnx.NodeProto  # the node whose place it takes
    removed: list[onnx.NodeProto]
    build: Callable[[str], onnx.NodeProto]  # the new node, given its name
    kind: str  # "layer_norm" | "softmax"
    folded: bool = False  # a residual Sum (layer_norm) or a constant factor (softmax)


def fuse_layer_norm_grad(model: onnx.ModelProto, info: dict[str, ir.TensorInfo] | None = None) -> NormFusionResult:
    """Replace the layer-norm and softmax input gradients of ``model`` (in place) by LayerNormGrad
    and SoftmaxGrad nodes. ``info`` as for :func:`onnxcampo.rewrites.loss.fuse_softmax_cross_entropy`."""
    result = NormFusionResult()
    if not any(n.op_type in ("ReduceMean", "ReduceSum") for n in model.graph.node):
        return result
    from onnxcampo.ops import nodes as op_nodes

    if info is None:
        info, _ = ir.infer_tensor_info(model)
    view = GraphView(model, info, fresh_prefix="lngrad", empty=False)
    matches: list[_Match] = match_all(view, "Mul", (_layer_norm, _softmax), "fuse-reductions")
    if not matches:
        return result
    removed = {id(n) for m in matches for n in m.removed}
    removed |= view.feeders_left_unread(removed, [name for m in matches for name in m.reads])  # rule 3
    made: dict[int, onnx.NodeProto] = {}
    for m in matches:
        stem = "layer_norm_grad" if m.kind == "layer_norm" else "softmax_grad"
        made[id(m.at)] = m.build(view.edit.fresh(f"{m.at.name or m.kind}/{stem}"))
        if m.kind == "layer_norm":
            result.fused += 1
            result.sums += m.folded
        else:
            result.softmax += 1
            result.scales += m.folded
    result.nodes = len(removed)
    view.replace(made, removed, [m.output for m in matches])
    op_nodes.import_domain(model)
    log.info("fuse-reductions: %d layer-norm and %d softmax gradients as LayerNormGrad / SoftmaxGrad nodes (%d "
             "nodes replaced)", result.fused, result.softmax, result.nodes)
    return result


def _last_axes(view: GraphView, node: onnx.NodeProto, shape: tuple[int, ...]) -> set[int] | None:
    """The axes ``node`` reduces when they are the last axes of size > 1 (trailing 1s allowed)."""
    reduced = set(view.reduce_axes(node, len(shape)) or [])
    tail = set(range(min(reduced, default=len(shape)), len(shape)))
    if not reduced or not {k for k in tail if shape[k] > 1} <= reduced <= tail:
        return None
    return reduced


def _pick(view: GraphView, pair: tuple[str, str], op: str, reader: onnx.NodeProto):
    """The ``(other, produced)`` order of ``pair`` whose second is made by ``op`` and read by
    ``reader`` only, and that producer; None when neither is."""
    for first, second in (pair, pair[::-1]):
        node = view.made_by(second, op)
        if node is not None and view.only(second, reader):
            return first, second, node
    return None


def _of_mul_by_sub(pattern: Callable[..., _Match | Miss]) -> Callable[[GraphView, onnx.NodeProto], _Match | Miss]:
    """``pattern(view, dx_node, other, sub)`` as a pattern anchored at dx's Mul: it runs where dx =
    Mul(other, Sub(..)) with the Sub read by dx alone; elsewhere the pattern is a Miss."""

    @functools.wraps(pattern)
    def match(view: GraphView, dx_node: onnx.NodeProto) -> _Match | Miss:
        pair = view.operands(dx_node)
        picked = _pick(view, pair, "Sub", dx_node) if pair else None
        if picked is None:
            return Miss("dx is no Mul of a Sub read by it alone")
        other, _, sub = picked
        return pattern(view, dx_node, other, sub)

    return match


@_of_mul_by_sub
def _layer_norm(view: GraphView, dx_node: onnx.NodeProto, invstd: str, sub2: onnx.NodeProto) -> _Match | Miss:
    """Rules 1 and 2, from dx's Mul."""
    d1, m = sub2.input
    sub1, mul_m = view.made_by(d1, "Sub"), view.made_by(m, "Mul")
    if sub1 is None or mul_m is None or not view.only(d1, sub2) or not view.only(m, sub2):
        return Miss("no Sub(Sub(p, mean), Mul(xhat, mean)) before it")
    p, a = sub1.input
    shape, mean_a = view.static(p), view.made_by(a, "ReduceMean")
    if shape is None or mean_a is None or not view.only(a, sub1) or view.static(dx_node.output[0]) != shape:
        return Miss("no static ReduceMean(p) read by the first Sub alone")
    reduced = _last_axes(view, mean_a, shape)
    if reduced is None or not any(d > 1 for d in shape) or not view.reduces(mean_a, p, shape, reduced):
        return Miss("the mean is not over the last axes, keeping dims")
    cols = math.prod(shape[k] for k in reduced)
    rows = math.prod(shape) // cols
    tail = set(range(min(reduced), len(shape)))
    picked = _pick(view, tuple(mul_m.input), "ReduceMean", mul_m)  # m = Mul(xhat, b), b = ReduceMean(q)
    if picked is None:
        return Miss("no Mul(xhat, ReduceMean(q))")
    xhat, _, mean_b = picked
    q = mean_b.input[0]
    mul_q = view.made_by(q, "Mul")  # q = Mul(xhat, p)
    if mul_q is None or not view.only(q, mean_b) or not view.reduces(mean_b, q, shape, reduced):
        return Miss("no ReduceMean(Mul(xhat, p)) over the same axes")
    if sorted(mul_q.input) != sorted([xhat, p]) or view.static(xhat) != shape:
        return Miss("q is not Mul(xhat, p)")
    mul_p = view.made_by(p, "Mul")  # p = Mul(dy, gamma), read by the two branches' nodes and the first Sub only
    if mul_p is None or sorted(id(n) for n in view.readers(p)) != sorted(id(n) for n in (mean_a, sub1, mul_q)):
        return Miss("p is no Mul read by the two means' branches alone")
    dy, gamma = mul_p.input if view.static(mul_p.input[0]) == shape else mul_p.input[::-1]
    if view.static(dy) != shape or not view.broadcast(gamma, shape, reduced) or math.prod(view.static(gamma)) != cols:
        return Miss("gamma is not broadcast along the rows")
    if not view.broadcast(invstd, shape, set(range(len(shape))) - tail) or math.prod(view.static(invstd)) != rows:
        return Miss("invstd is not broadcast along the columns")
    invstd, gamma = view.source(invstd, rows, casts=True), view.source(gamma, cols, casts=False)
    if any(view.dtype(n) not in FLOATS for n in (dy, xhat, invstd, gamma, dx_node.output[0])):
        return Miss("a value is not float or float16")
    removed = [mul_p, mean_a, sub1, mul_q, mean_b, mul_m, sub2, dx_node]
    acc, out, at = _residual_sum(view, dx_node, shape, removed)
    return _layer_norm_match(view, (dy, xhat, invstd, gamma, acc), out, at, removed)


def _residual_sum(view: GraphView, dx_node: onnx.NodeProto, shape: tuple[int, ...],
                  removed: list[onnx.NodeProto]) -> tuple[str | None, str, onnx.NodeProto]:
    """Rule 2: a two-input Sum (or Add) that is dx's only reader is folded: ``(acc, output, the
    node whose place the new node takes)``; the Sum is appended to ``removed``."""
    out = dx_node.output[0]
    users = view.readers(out)
    if out in view.protected or len(users) != 1 or users[0].op_type not in ("Sum", "Add") \
            or users[0].domain not in oplists.DEFAULT_DOMAINS or len(users[0].input) != 2 \
            or users[0].input[0] == users[0].input[1]:
        return None, out, dx_node
    total = users[0]
    other = total.input[1] if total.input[0] == out else total.input[0]
    if view.static(other) != shape or view.static(total.output[0]) != shape or view.dtype(other) not in FLOATS:
        return None, out, dx_node
    removed.append(total)
    return other, total.output[0], total


def _layer_norm_match(view: GraphView, reads: tuple, out: str, at: onnx.NodeProto,
                      removed: list[onnx.NodeProto]) -> _Match:
    from onnxcampo.ops import nodes as op_nodes

    dy, xhat, invstd, gamma, acc = reads
    shape_out, out_type = list(view.static(out)), view.dtype(out)

    def build(name: str) -> onnx.NodeProto:
        return op_nodes.layer_norm_grad(dy, xhat, invstd, gamma, acc, output=out, output_type=out_type,
                                        output_shape=shape_out, name=name)

    return _Match([n for n in reads if n], out, at, removed, build, "layer_norm", acc is not None)


@_of_mul_by_sub
def _softmax(view: GraphView, dx_node: onnx.NodeProto, y: str, sub: onnx.NodeProto) -> _Match | Miss:
    """Rule 4, from dx's Mul."""
    dy, t = sub.input
    total, shape = view.made_by(t, "ReduceSum"), view.static(dy)
    if total is None or not view.only(t, sub) or shape is None or view.static(y) != shape:
        return Miss("no Sub(dy, ReduceSum(..)) of y's shape")
    p = total.input[0]
    mul_p = view.made_by(p, "Mul")
    if mul_p is None or not view.only(p, total) or sorted(mul_p.input) != sorted([y, dy]):
        return Miss("the sum is not of Mul(y, dy)")
    reduced = _last_axes(view, total, shape)
    if reduced is None or not view.reduces(total, p, shape, reduced) or view.static(dx_node.output[0]) != shape:
        return Miss("the sum is not over the last axes, keeping dims")
    cols = math.prod(shape[k] for k in reduced)
    removed = [mul_p, total, sub, dx_node]
    scale, out, at = _constant_factor(view, dx_node, shape, removed)
    count = math.prod(shape)
    dy, y = view.source(dy, count, casts=True), view.source(y, count, casts=True)
    if any(view.dtype(n) not in FLOATS for n in (dy, y, out)):
        return Miss("a value is not float or float16")
    from onnxcampo.ops import nodes as op_nodes

    shape_out, out_type = list(view.static(out)), view.dtype(out)

    def build(name: str) -> onnx.NodeProto:
        return op_nodes.softmax_grad(dy, y, output=out, cols=cols, scale=scale, output_type=out_type,
                                     output_shape=shape_out, name=name)

    return _Match([dy, y], out, at, removed, build, "softmax", scale != 1.0)


def _constant_factor(view: GraphView, dx_node: onnx.NodeProto, shape: tuple[int, ...],
                     removed: list[onnx.NodeProto]) -> tuple[float, str, onnx.NodeProto]:
    """Rule 4's scale: a Mul by a one-element finite constant that is dx's only reader is folded:
    ``(scale, output, the node whose place the new node takes)``; the Mul is appended to ``removed``."""
    out = dx_node.output[0]
    users = view.readers(out)
    if out in view.protected or len(users) != 1 or not view.is_op(users[0], "Mul") or len(users[0].input) != 2:
        return 1.0, out, dx_node
    factor = users[0].input[1] if users[0].input[0] == out else users[0].input[0]
    array = view.constant(factor)
    if array is None or factor == out or view.static(users[0].output[0]) != shape:
        return 1.0, out, dx_node
    if array.size != 1 or not np.isfinite(array).all():
        return 1.0, out, dx_node
    removed.append(users[0])
    return float(array.reshape(-1)[0]), users[0].output[0], users[0]


__all__ = ["NormFusionResult", "fuse_layer_norm_grad"]
