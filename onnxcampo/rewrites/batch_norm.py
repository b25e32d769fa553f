"""``--experimental batchnorm_sums=true`` (with ``--fuse-reductions``; off by default): a training BatchNorm's
per-channel sums as one pass each, ``ai.onnxcampo::BatchNormStats`` forward and
``BatchNormGradSums`` backward (``onnxcampo/ops/batch_norm/``, ``docs/ops.md``).

A training step's BatchNorm (``onnxcampo.training.train_mode``) reduces four times over its
``[N, C, H*W]`` (or channels-last ``[N*H*W, C, 1]``) blocks: forward the sum of ``x`` and the sum
of ``(x - mean)^2``, which needs ``x - mean`` squared and written first; backward the sums of ``dy``
and of ``dy * xhat``, which needs the product written first. After the block reductions
(``onnxcampo.rewrites.reductions``) those are four ``BlockReduceSum`` nodes reading ``x``, the
squares, ``dy`` and the products. Runs on the written model after them, before the elementwise
fusion. Rules:

1. Forward, anchored at a BlockReduceSum ``S2`` of ``sq = Mul(c, c)`` (read by ``S2`` alone), with
   ``c = Sub(x, mean)``, ``mean = Where(onnxcampo.train_mode, m, running)`` and ``m = Mul(S1, k)``
   (either order; Casts between the float types anywhere on the way) where ``S1`` is a
   BlockReduceSum of ``x`` over the same ``[P, Q, R]`` and ``k`` the constant ``1 / (P * R)``;
   both sums float32 of one shape: one ``BatchNormStats(x)`` writes ``S1``'s and ``S2``'s outputs
   (the sum, and the squared deviations from its mean: the step's ``train_mode`` flag is true, so
   ``mean`` is ``S1 / n``). ``S1``, ``S2`` and ``sq`` go; ``c`` stays for its other readers.
2. Backward, anchored at a BlockReduceSum ``S4`` of ``p = Mul(dy, h)`` (read by ``S4`` alone),
   ``h = Mul(c, s)`` (views and float Casts before its inputs allowed: the node reads what they
   read, ``s`` in float32) with ``c`` of ``dy``'s element
   count and ``s`` a float32 value of Q elements that broadcasts along the Q block only (one value
   per channel: ``invstd``), where a BlockReduceSum ``S3`` of ``dy`` over the same ``[P, Q, R]``
   exists; both sums float32 of one shape: one ``BatchNormGradSums(dy, c, s)`` writes ``S3``'s and
   ``S4``'s outputs (``sum(dy)`` and ``s * sum(dy * c)``, which is ``sum(dy * c * s)`` for ``s``
   constant per channel). ``S3``, ``S4``, ``p``, ``h`` when only ``p`` read it (the closed form's
   ``dx`` reads ``xhat`` too) and the views only they read go. 2b: where an earlier match took
   ``S3`` (a ResNet block's last BatchNorm and its shortcut's share the gradient, and so its sum,
   reductions rule 6), the node's first output is a sum nothing reads and ``S3`` stays the other's.

The values are the float32 sums of the same products (the squares from ``x`` and its float32 mean
rather than from ``c`` as the plan rounded it), in another order.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from onnxcampo import ir
from onnxcampo.ops import DOMAIN
from onnxcampo.rewrites.matcher import FLOATS, VIEWS, GraphView, Miss
from onnxcampo.training.train_mode import TRAIN_FLAG

log = logging.getLogger(__name__)

BLOCK_SUM = "BlockReduceSum"


@dataclass
class BatchNormSumsResult:
    forward: int = 0  # BatchNormStats nodes made
    backward: int = 0  # BatchNormGradSums nodes made
    nodes: int = 0  # nodes they replace

    def to_json(self) -> dict:
        return {"stats": self.forward, "grad_sums": self.backward, "nodes_replaced": self.nodes}


@dataclass
class _Match:
    node: onnx.NodeProto  # the new node, in the place of the first sum
    first: onnx.NodeProto  # the sum it takes the place of
    removed: list[onnx.NodeProto]


def fuse_batchnorm_sums(model: onnx.ModelProto, info: dict[str, ir.TensorInfo] | None = None) -> BatchNormSumsResult:
    """Rules 1 and 2 on ``model`` in place; ``info``: its tensor types and shapes (inferred when None)."""
    result = BatchNormSumsResult()
    if info is None:
        info, _ = ir.infer_tensor_info(model)
    view = GraphView(model, info, fresh_prefix="batchnorm")
    sums = [n for n in model.graph.node if n.op_type == BLOCK_SUM and n.domain == DOMAIN]
    matches, taken = [], set()
    for node in sums:
        found = _forward(view, node, sums) or _backward(view, node, sums, taken)
        if not found or any(id(n) in taken for n in found.removed):
            if isinstance(found, Miss):
                log.debug("batchnorm sums: %s not rewritten (%s)", node.name, found)
            continue
        taken.update(id(n) for n in found.removed)
        matches.append(found)
    if not matches:
        return result
    removed = {id(n) for m in matches for n in m.removed}
    removed |= view.feeders_left_unread(removed, [i for m in matches for i in m.node.input])
    outputs = [o for m in matches for o in m.node.output]
    known = [o for o in outputs if view.static(o) is not None]
    unread = [onnx.helper.make_tensor_value_info(o, TensorProto.FLOAT, list(view.static(m.node.output[1])))
              for m in matches for o in m.node.output if view.static(o) is None]  # rule 2b's sums
    view.replace({id(m.first): m.node for m in matches}, removed, known, unread)
    for m in matches:
        if m.node.op_type == "BatchNormStats":
            result.forward += 1
        else:
            result.backward += 1
    result.nodes = len(removed)
    log.info("batchnorm sums: %d BatchNormStats and %d BatchNormGradSums in place of %d nodes",
             result.forward, result.backward, result.nodes)
    return result


def _sizes(node: onnx.NodeProto) -> tuple[int, int, int]:
    return tuple(int(s) for s in ir.attribute(node, "sizes"))


def _float32_sums(view: GraphView, first: onnx.NodeProto, second: onnx.NodeProto) -> Miss | None:
    """Both sums float32 of one shape over the same blocks, else why not."""
    if _sizes(first) != _sizes(second):
        return Miss(f"the sums' blocks differ ({_sizes(first)}, {_sizes(second)})")
    if view.dtype(first.output[0]) != TensorProto.FLOAT or view.dtype(second.output[0]) != TensorProto.FLOAT:
        return Miss("a sum is not float32")
    shape = view.static(first.output[0])
    if shape is None or shape != view.static(second.output[0]):
        return Miss("the sums' shapes differ or are unknown")
    return None


def _uncast(view: GraphView, name: str) -> str:
    """``name`` back through Casts between the float types."""
    while True:
        node = view.producers.get(name)
        if not view.is_op(node, "Cast") or view.dtype(node.input[0]) not in FLOATS:
            return name
        name = node.input[0]


def _made(view: GraphView, name: str, op: str) -> onnx.NodeProto | None:
    """The default domain's ``op`` that makes ``name``, through Casts between the float types."""
    node = view.producers.get(_uncast(view, name))
    return node if view.is_op(node, op) else None


def _sum_of(view: GraphView, x: str, sizes: tuple[int, int, int], sums: list[onnx.NodeProto],
            but: onnx.NodeProto) -> onnx.NodeProto | None:
    """A BlockReduceSum (other than ``but``) of ``x`` (up to float Casts) over ``sizes``."""
    source = _uncast(view, x)
    return next((n for n in sums if n is not but and _sizes(n) == sizes and _uncast(view, n.input[0]) == source), None)


def _forward(view: GraphView, s2: onnx.NodeProto, sums: list[onnx.NodeProto]):
    """Rule 1 at ``s2``: the match, or a Miss."""
    sq = view.producers.get(s2.input[0])
    if not view.is_op(sq, "Mul") or sq.input[0] != sq.input[1] or not view.only(sq.output[0], s2):
        return Miss("not a sum of squares")
    sub = _made(view, sq.input[0], "Sub")
    if sub is None:
        return Miss("the squares are not of a difference")
    where = _made(view, sub.input[1], "Where")
    if where is None or where.input[0] != TRAIN_FLAG:
        return Miss("the difference is not from the train_mode mean")
    scaled = _made(view, where.input[1], "Mul")
    sizes = _sizes(s2)
    p, _, r = sizes
    s1 = _sum_of(view, sub.input[0], sizes, sums, s2)
    if scaled is None or s1 is None or s1.output[0] not in scaled.input:
        return Miss("the mean is not this input's block sum scaled")
    k = view.constant(GraphView.other(scaled, s1.output[0]) or "")
    if k is None or k.size != 1 or not math.isclose(float(k.reshape(-1)[0]), 1.0 / (p * r), rel_tol=1e-6):
        return Miss("the mean's factor is not 1 / n")
    wrong = _float32_sums(view, s1, s2)
    if wrong:
        return wrong
    from onnxcampo.ops import nodes as op_nodes

    node = op_nodes.batch_norm_stats(_uncast(view, s1.input[0]), outputs=[s1.output[0], s2.output[0]], sizes=sizes,
                                     output_shape=list(view.static(s1.output[0])),
                                     name=view.edit.fresh(s1.name + "/stats"))
    return _Match(node, s1, [s1, s2, sq])


def _per_channel(view: GraphView, name: str, shape: tuple[int, ...], sizes: tuple[int, int, int]) -> bool:
    """Whether ``name`` (static, right-aligned to ``shape``) varies along the axes of the Q block
    only, with one value per channel (``shape`` cut as [P, Q, R] by ``sizes``)."""
    own = view.static(name)
    p, q, _ = sizes
    if own is None or len(own) > len(shape) or math.prod(own) != q:
        return False
    padded = (1,) * (len(shape) - len(own)) + tuple(own)
    varying = [k for k, d in enumerate(padded) if d != 1]
    if not varying:
        return q == 1
    first, last = varying[0], varying[-1]
    return (all(padded[k] == shape[k] for k in range(first, last + 1)) and math.prod(shape[:first]) == p
            and math.prod(shape[first:last + 1]) == q)


def _backward(view: GraphView, s4: onnx.NodeProto, sums: list[onnx.NodeProto], taken: set[int]):
    """Rule 2 at ``s4``: the match, or a Miss. The node goes where the first sum was when its
    inputs are made before it, else where the second was when the first's readers come after it.
    Rule 2b: where an earlier match took ``dy``'s sum (two BatchNorms on one gradient), the node
    writes a sum of ``dy`` nothing reads and takes the place of ``S4`` alone."""
    product = view.producers.get(s4.input[0])
    if not view.is_op(product, "Mul") or not view.only(product.output[0], s4):
        return Miss("not a sum of a product")
    sizes = _sizes(s4)
    for dy, h in (product.input, reversed(product.input)):
        s3 = _sum_of(view, dy, sizes, sums, s4)
        scaled = view.producers.get(h)
        if s3 is None or not view.is_op(scaled, "Mul"):
            continue
        shape = view.static(h)
        count = math.prod(sizes)
        if shape is None or view.static(dy) != shape:
            continue
        for c, s in (scaled.input, reversed(scaled.input)):
            # c and s read before the views and float Casts the plan put in front of the product;
            # s must be float32: the Cast's output where its source is float16
            c_source = view.source(c, count, casts=True)
            s_source = next((t for t in (view.source(s, sizes[1], casts=True), view.source(s, sizes[1], casts=False))
                             if view.dtype(t) == TensorProto.FLOAT), None)
            if (view.static(c) == shape and _per_channel(view, s, shape, sizes) and s_source is not None
                    and view.dtype(c_source) in FLOATS):
                wrong = _float32_sums(view, s3, s4)
                if wrong:
                    return wrong
                from onnxcampo.ops import nodes as op_nodes

                shared = id(s3) in taken  # rule 2b
                first = view.edit.fresh(s4.output[0] + "/unread_sum") if shared else s3.output[0]
                node = op_nodes.batch_norm_grad_sums(
                    _uncast(view, s3.input[0]), c_source, s_source, outputs=[first, s4.output[0]], sizes=sizes,
                    output_shape=list(view.static(s3.output[0])), name=view.edit.fresh(s4.name + "/grad_sums"))
                place = _place(view, node, s4, s4) if shared else _place(view, node, s3, s4)
                if place is None:
                    return Miss("no place in the graph's order for one node")
                # h stays where others read it too (the closed form's dx reads xhat)
                return _Match(node, place, [*([] if shared else [s3]), s4, product,
                                            *([scaled] if view.only(h, product) else [])])
    return Miss("not dy times a centered value times one value per channel, with dy's sum beside it")


def _place(view: GraphView, node: onnx.NodeProto, first: onnx.NodeProto, second: onnx.NodeProto) -> onnx.NodeProto | None:
    """Which of the two sums ``node`` may take the place of (graph order: its inputs made before,
    its outputs read after), or None."""
    position = {id(n): i for i, n in enumerate(view.model.graph.node)}
    made = max((position[id(view.producers[i])] for i in node.input if i in view.producers), default=-1)
    read = min((position[id(r)] for o in node.output for r in view.readers(o)
                if r is not first and r is not second), default=len(position))
    for candidate in sorted((first, second), key=lambda n: position[id(n)]):
        if made < position[id(candidate)] < read:
            return candidate
    return None


__all__ = ["BatchNormSumsResult", "fuse_batchnorm_sums"]
