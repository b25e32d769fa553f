"""``--fuse-reductions``, row gradients: the backward of a LayerNormalization over the last axis as
one ``ai.onnxcampo::LayerNormGrad`` node (``onnxcampo/ops/layer_norm.py``), and a Softmax's as one
``SoftmaxGrad`` (``onnxcampo/ops/softmax.py``; ``docs/ops.md``).

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

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, oplists
from onnxcampo.reductions import MOVES, reduce_axes

log = logging.getLogger(__name__)

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


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
    and SoftmaxGrad nodes. ``info`` as for :func:`onnxcampo.loss_fusion.fuse_softmax_cross_entropy`."""
    result = NormFusionResult()
    if not any(n.op_type in ("ReduceMean", "ReduceSum") for n in model.graph.node):
        return result
    from onnxcampo.ops import nodes as op_nodes

    if info is None:
        info, _ = ir.infer_tensor_info(model)
    edit = ir.ModelEdit(model, fresh_prefix="lngrad")
    constants = edit.constants()
    producers, consumers = edit.producers(), edit.consumers()
    protected = edit.interface()

    def static(name: str) -> tuple[int, ...] | None:
        return ir.static_shape(info, name, empty=False)

    def dtype(name: str) -> int | None:
        return ir.tensor_dtype(info, name)

    def readers(name: str) -> list[onnx.NodeProto]:
        return consumers.get(name, [])

    def made_by(name: str, op: str) -> onnx.NodeProto | None:
        node = producers.get(name)
        ok = node is not None and node.op_type == op and node.domain in oplists.DEFAULT_DOMAINS
        return node if ok and name not in protected else None

    def only(name: str, reader: onnx.NodeProto) -> bool:
        return name not in protected and readers(name) == [reader]

    def operands(node: onnx.NodeProto) -> tuple[str, str] | None:
        return (node.input[0], node.input[1]) if len(node.input) == 2 else None

    def broadcast(name: str, shape: tuple[int, ...], keep: set[int]) -> bool:
        """Whether ``name`` is static, no longer than ``shape`` and, right-aligned, 1 on every
        axis outside ``keep`` and ``shape``'s size on those in it."""
        own = static(name)
        if own is None or len(own) > len(shape):
            return False
        padded = (1,) * (len(shape) - len(own)) + own
        return all(padded[k] == (shape[k] if k in keep else 1) for k in range(len(shape)))

    def reduces(node: onnx.NodeProto | None, x: str, shape: tuple[int, ...], axes: set[int]) -> bool:
        """Whether the ReduceMean/ReduceSum ``node`` reduces ``x`` over ``axes``, keeping dims."""
        return (node is not None and node.input[0] == x and ir.attribute(node, "keepdims", 1) == 1
                and set(reduce_axes(node, constants, len(shape)) or []) == axes)

    def source(name: str, count: int, *, casts: bool) -> str:
        """Rule 3's inputs: ``name`` back through views (and with ``casts`` Casts between the float
        types: the op reads either, and the float32 invstd is the exact one) to the first tensor."""
        while True:
            node = producers.get(name)
            if node is None or node.domain not in oplists.DEFAULT_DOMAINS or not node.input:
                return name
            before = node.input[0]
            moves = node.op_type in MOVES or (casts and node.op_type == "Cast" and dtype(before) in FLOATS)
            if not moves or static(before) is None or math.prod(static(before)) != count or dtype(before) not in FLOATS:
                return name
            name = before

    def match(dx_node: onnx.NodeProto) -> _Match | None:
        pair = operands(dx_node)
        if pair is None:
            return None
        for invstd, d2 in (pair, pair[::-1]):
            sub2 = made_by(d2, "Sub")
            if sub2 is not None and only(d2, dx_node):
                break
        else:
            return None
        d1, m = sub2.input
        sub1, mul_m = made_by(d1, "Sub"), made_by(m, "Mul")
        if sub1 is None or mul_m is None or not only(d1, sub2) or not only(m, sub2):
            return None
        p, a = sub1.input
        shape = static(p)
        mean_a = made_by(a, "ReduceMean")
        if shape is None or mean_a is None or not only(a, sub1) or static(dx_node.output[0]) != shape:
            return None
        reduced = set(reduce_axes(mean_a, constants, len(shape)) or [])
        big = [k for k, d in enumerate(shape) if d > 1]
        tail = set(range(min(reduced, default=len(shape)), len(shape)))
        if not reduced or not {k for k in tail if shape[k] > 1} <= reduced <= tail or not big:
            return None
        if not reduces(mean_a, p, shape, reduced):
            return None
        cols = math.prod(shape[k] for k in reduced)
        rows = math.prod(shape) // cols
        row_axes = set(range(len(shape))) - tail
        # m = Mul(xhat, b), b = ReduceMean(q), q = Mul(xhat, p)
        for xhat, b in (tuple(mul_m.input), tuple(mul_m.input)[::-1]):
            mean_b = made_by(b, "ReduceMean")
            if mean_b is not None and only(b, mul_m):
                break
        else:
            return None
        q = mean_b.input[0]
        mul_q = made_by(q, "Mul")
        if mul_q is None or not only(q, mean_b) or not reduces(mean_b, q, shape, reduced):
            return None
        if sorted(mul_q.input) != sorted([xhat, p]) or static(xhat) != shape:
            return None
        # p = Mul(dy, gamma), read by the two branches' nodes and the first Sub only
        mul_p = made_by(p, "Mul")
        if mul_p is None or sorted(id(n) for n in readers(p)) != sorted(id(n) for n in (mean_a, sub1, mul_q)):
            return None
        dy, gamma = mul_p.input
        if static(dy) != shape:
            dy, gamma = gamma, dy
        if static(dy) != shape or not broadcast(gamma, shape, reduced) or math.prod(static(gamma)) != cols:
            return None
        if not broadcast(invstd, shape, row_axes) or math.prod(static(invstd)) != rows:
            return None
        invstd, gamma = source(invstd, rows, casts=True), source(gamma, cols, casts=False)
        names = (dy, xhat, invstd, gamma, dx_node.output[0])
        if any(dtype(n) not in FLOATS for n in names):
            return None
        removed = [mul_p, mean_a, sub1, mul_q, mean_b, mul_m, sub2, dx_node]
        out, acc, at = dx_node.output[0], None, dx_node
        users = readers(out)
        if out not in protected and len(users) == 1 and users[0].op_type in ("Sum", "Add") \
                and users[0].domain in oplists.DEFAULT_DOMAINS and len(users[0].input) == 2 \
                and users[0].input[0] != users[0].input[1]:
            total = users[0]
            other = total.input[1] if total.input[0] == out else total.input[0]
            if static(other) == shape and static(total.output[0]) == shape and dtype(other) in FLOATS:
                acc, out, at = other, total.output[0], total
                removed.append(total)
        shape_out = list(static(out))

        def build(name: str, dy=dy, xhat=xhat, invstd=invstd, gamma=gamma, acc=acc, out=out) -> onnx.NodeProto:
            return op_nodes.layer_norm_grad(dy, xhat, invstd, gamma, acc, output=out, output_type=dtype(out),
                                            output_shape=shape_out, name=name)

        reads = [dy, xhat, invstd, gamma] + ([acc] if acc else [])
        return _Match(reads, out, at, removed, build, "layer_norm", acc is not None)

    def softmax(dx_node: onnx.NodeProto) -> _Match | None:
        """Rule 4."""
        pair = operands(dx_node)
        if pair is None:
            return None
        for y, s in (pair, pair[::-1]):
            sub = made_by(s, "Sub")
            if sub is not None and only(s, dx_node):
                break
        else:
            return None
        dy, t = sub.input
        total = made_by(t, "ReduceSum")
        shape = static(dy)
        if total is None or not only(t, sub) or shape is None or static(y) != shape:
            return None
        p = total.input[0]
        mul_p = made_by(p, "Mul")
        if mul_p is None or not only(p, total) or sorted(mul_p.input) != sorted([y, dy]):
            return None
        reduced = set(reduce_axes(total, constants, len(shape)) or [])
        tail = set(range(min(reduced, default=len(shape)), len(shape)))
        if not reduced or not {k for k in tail if shape[k] > 1} <= reduced <= tail:
            return None
        if not reduces(total, p, shape, reduced) or static(dx_node.output[0]) != shape:
            return None
        cols = math.prod(shape[k] for k in reduced)
        removed = [mul_p, total, sub, dx_node]
        out, at, scale = dx_node.output[0], dx_node, 1.0
        users = readers(out)
        if out not in protected and len(users) == 1 and users[0].op_type == "Mul" \
                and users[0].domain in oplists.DEFAULT_DOMAINS and len(users[0].input) == 2:
            factor = users[0].input[1] if users[0].input[0] == out else users[0].input[0]
            value = constants.get(factor)
            if value is not None and factor != out and static(users[0].output[0]) == shape:
                array = numpy_helper.to_array(value)
                if array.size == 1 and np.isfinite(array).all():
                    scale, out, at = float(array.reshape(-1)[0]), users[0].output[0], users[0]
                    removed.append(users[0])
        count = math.prod(shape)
        dy, y = source(dy, count, casts=True), source(y, count, casts=True)
        if any(dtype(n) not in FLOATS for n in (dy, y, out)):
            return None
        shape_out = list(static(out))

        def build(name: str, dy=dy, y=y, out=out, scale=scale) -> onnx.NodeProto:
            return op_nodes.softmax_grad(dy, y, output=out, cols=cols, scale=scale, output_type=dtype(out),
                                         output_shape=shape_out, name=name)

        return _Match([dy, y], out, at, removed, build, "softmax", scale != 1.0)

    matches: list[_Match] = []
    taken: set[int] = set()
    for node in list(model.graph.node):
        if node.op_type != "Mul" or node.domain not in oplists.DEFAULT_DOMAINS or id(node) in taken:
            continue
        found = match(node) or softmax(node)
        if found is None or any(id(n) in taken for n in found.removed):
            continue
        taken.update(id(n) for n in found.removed)
        matches.append(found)
    if not matches:
        return result

    removed = {id(n) for m in matches for n in m.removed}
    # rule 3: views and Casts whose every reader goes
    read_after: dict[str, int] = {}
    for node in model.graph.node:
        if id(node) not in removed:
            for name in node.input:
                read_after[name] = read_after.get(name, 0) + 1
    for m in matches:  # what the new nodes read
        for name in m.reads:
            read_after[name] = read_after.get(name, 0) + 1
    frontier = [i for m in matches for n in m.removed for i in n.input]
    while frontier:
        name = frontier.pop()
        node = producers.get(name)
        if (node is None or id(node) in removed or node.domain not in oplists.DEFAULT_DOMAINS
                or node.op_type not in (*MOVES, "Cast") or read_after.get(name, 0) or name in protected
                or any(o != name and (read_after.get(o, 0) or o in protected) for o in node.output)):
            continue
        if any(id(r) not in removed for r in readers(name)):
            continue
        removed.add(id(node))
        frontier.extend(node.input)

    made: dict[int, onnx.NodeProto] = {}
    new_info = []
    for m in matches:
        stem = "layer_norm_grad" if m.kind == "layer_norm" else "softmax_grad"
        made[id(m.at)] = m.build(edit.fresh(f"{m.at.name or m.kind}/{stem}"))
        new_info.append(helper.make_tensor_value_info(m.output, dtype(m.output), list(static(m.output))))
        if m.kind == "layer_norm":
            result.fused += 1
            result.sums += m.folded
        else:
            result.softmax += 1
            result.scales += m.folded
    result.nodes = len(removed)
    edit.replace_nodes(made, removed, new_info)
    ir.record_value_infos(info, new_info)
    op_nodes.import_domain(model)
    log.info("fuse-reductions: %d layer-norm and %d softmax gradients as LayerNormGrad / SoftmaxGrad nodes (%d "
             "nodes replaced)", result.fused, result.softmax, result.nodes)
    return result


__all__ = ["NormFusionResult", "fuse_layer_norm_grad"]
