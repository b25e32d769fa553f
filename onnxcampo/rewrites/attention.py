"""Attention that ONNX Runtime's transformers optimizer leaves unfused, as one
``com.microsoft::MultiHeadAttention``.

ORT's optimizer fuses BERT's eager attention as torch.onnx's TorchScript exporter writes it, and
nothing else: not transformers' SDPA attention (its default since transformers 4.36), not the
dynamo exporter's graphs. Those keep the attention as separate nodes, the ``[B, N, S, S]`` scores
written and read back by each: two batched products, the scale, the mask, the Softmax and its NaN
guard, plus the head splits and their transposes. :func:`fuse_attention` writes each as one
MultiHeadAttention node reading the three projections (``[B, S, hidden]``) and the mask as an
additive ``attention_bias``; on the GPU ORT then runs a fused attention kernel
(memory-efficient attention, which takes a bias).

The pattern, anchored at a Softmax over the last axis:

1. scores: ``MatMul(Qh', Kt')`` where ``Qh'`` is ``Qh`` or ``Mul(Qh, c)`` and ``Kt'`` likewise
   (SDPA scales both by ``sqrt(scale)``), then optionally ``Div(., c)`` or ``Mul(., c)`` (eager),
   then optionally ``Add(., mask)``, into the Softmax. The scale is the product of the constants
   (1 where there are none).
2. ``Qh`` and ``Vh``: ``Transpose(Reshape(proj), perm=[0, 2, 1, 3])``, the Reshape splitting a
   3-D projection into heads; ``Kt``: the key projection split the same way and moved to
   ``[B, N, d, S]``: ``Transpose(Reshape(proj), [0, 2, 3, 1])`` (TorchScript),
   ``Transpose(Transpose(., [0, 2, 1, 3]), [0, 1, 3, 2])`` (eager), or the dynamo exporter's
   ``Reshape(Transpose(Reshape(Transpose(Reshape(proj), [0, 2, 1, 3])), [0, 2, 1]))`` through
   ``[B * N, S, d]``.
3. probabilities: the Softmax's output, or SDPA's ``Where(IsNaN(p), 0, p)`` of it, read only by
   ``MatMul(., Vh)``; then optionally a rank-4 Reshape (the TorchScript SDPA export's), the
   Transpose ``[0, 2, 1, 3]`` (the fused node writes its output, ``[B, S, hidden]`` in the same
   element order) and a Reshape merging the heads, kept (its target may be ``[B * S, hidden]``).
4. The heads: the head-split Reshapes' last two target values when constant (``N``, ``d``),
   else the detected heads; ``N * d`` must be the hidden size.

The mask is given as ``attention_bias`` expanded to ``[B, 1, S, S]`` and floored at -10000 (a
finite value in float16: a row the mask drops entirely gets uniform weights, not NaN; SDPA's
guard gave zeros, which is also what no valid token reads). Every node that only the matched
ones read goes with them (the head splits' shape arithmetic). The rewrite's result is checked by
the caller: the fused model is run against the unfused one on ONNX Runtime's CPU provider.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxcampo import ir
from onnxcampo.rewrites.attention_mask import named, square_bias_shape
from onnxcampo.rewrites.matcher import GraphView, Miss

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
BIAS_FLOOR = -10000.0
QV_PERM = [0, 2, 1, 3]


@dataclass
class AttentionMatch:
    """One attention found: the projections, the mask (or ""), the scale, the output, the heads."""

    query: str
    key: str
    value: str
    mask: str
    scale: float
    output: str
    heads: int | None
    removed: list[onnx.NodeProto] = field(default_factory=list)
    merge: onnx.NodeProto | None = None  # the Reshape merging the heads: it reads the fused output instead


def _scalar(view: GraphView, name: str) -> float | None:
    """The value of a one-element constant, else None."""
    value = view.constant(name)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def _perm(node: onnx.NodeProto | None) -> list[int] | None:
    return None if node is None else list(ir.attribute(node, "perm", []) or [])


def _scaled(view: GraphView, name: str, removed: list) -> tuple[str, float]:
    """``name`` through one ``Mul(x, c)`` by a scalar constant: (x, c); else (name, 1)."""
    mul = view.made_by(name, "Mul")
    if mul is not None and view.sole_reader(name) is not None:
        for k in (0, 1):
            c = _scalar(view, mul.input[1 - k])
            if c is not None:
                removed.append(mul)
                return mul.input[k], c
    return name, 1.0


def _heads_of(view: GraphView, reshape: onnx.NodeProto) -> int | None:
    """N of a head split ``Reshape(proj, [B, S, N, d])`` when its target's third value is known."""
    target = view.constant(reshape.input[1])
    if target is not None and target.size == 4 and target[2] > 0:
        return int(target[2])
    concat = view.made_by(reshape.input[1], "Concat")
    if concat is not None and len(concat.input) == 4:
        heads = view.constant(concat.input[2])
        if heads is not None and heads.size == 1 and int(heads.reshape(-1)[0]) > 0:
            return int(heads.reshape(-1)[0])
    return None


def _split(view: GraphView, name: str, removed: list) -> tuple[str, onnx.NodeProto] | Miss:
    """``Transpose(Reshape(proj), [0, 2, 1, 3])``: (proj, the Reshape)."""
    transpose = view.made_by(name, "Transpose")
    if transpose is None or _perm(transpose) != QV_PERM:
        return Miss(f"{name} is not a head split's Transpose [0, 2, 1, 3]")
    reshape = view.made_by(transpose.input[0], "Reshape")
    if reshape is None or view.sole_reader(transpose.input[0]) is None:
        return Miss(f"{name}: no Reshape into heads before the Transpose")
    removed += [transpose, reshape]
    return reshape.input[0], reshape


def _key(view: GraphView, name: str, removed: list) -> tuple[str, onnx.NodeProto] | Miss:
    """The key projection of ``Kt`` ([B, N, d, S]) in the three forms of the module docstring."""
    transpose = view.made_by(name, "Transpose")
    if transpose is not None and _perm(transpose) == [0, 2, 3, 1]:
        reshape = view.made_by(transpose.input[0], "Reshape")
        if reshape is not None and view.sole_reader(transpose.input[0]) is not None:
            removed += [transpose, reshape]
            return reshape.input[0], reshape
    if transpose is not None and _perm(transpose) == [0, 1, 3, 2]:
        found = _split(view, transpose.input[0], removed)
        if found:
            removed.append(transpose)
        return found
    back = view.made_by(name, "Reshape")  # dynamo: through [B * N, S, d] and [B * N, d, S]
    flipped = view.made_by(back.input[0], "Transpose") if back is not None else None
    flat = view.made_by(flipped.input[0], "Reshape") if flipped is not None and _perm(flipped) == [0, 2, 1] else None
    if flat is not None and view.sole_reader(back.input[0]) is not None and view.sole_reader(flipped.input[0]) is not None:
        found = _split(view, flat.input[0], removed)
        if found:
            removed += [back, flipped, flat]
        return found
    return Miss(f"{name} is not a key split into heads and transposed")


def match(view: GraphView, softmax: onnx.NodeProto) -> AttentionMatch | Miss:
    """The pattern of the module docstring at ``softmax``."""
    if int(ir.attribute(softmax, "axis", -1)) not in (-1, 3):
        return Miss("the Softmax is not over the last axis")
    removed: list[onnx.NodeProto] = [softmax]
    # 3. the probabilities into MatMul(p, Vh)
    probs = softmax.output[0]
    readers = view.readers(probs)
    if len(readers) == 2 and {r.op_type for r in readers} == {"IsNaN", "Where"}:
        isnan = next(r for r in readers if r.op_type == "IsNaN")
        where = next(r for r in readers if r.op_type == "Where")
        if list(where.input) != [isnan.output[0], where.input[1], probs] or _scalar(view, where.input[1]) != 0.0 \
                or view.sole_reader(isnan.output[0]) is None:
            return Miss("the Softmax's NaN guard is not Where(IsNaN(p), 0, p)")
        removed += [isnan, where]
        probs = where.output[0]
    context = view.sole_reader(probs)
    if context is None or context.op_type != "MatMul" or context.input[0] != probs:
        return Miss("the probabilities are not read by one MatMul with the values")
    removed.append(context)
    value = _split(view, context.input[1], removed)
    if not value:
        return value
    out = context.output[0]
    step = view.sole_reader(out)
    if step is not None and step.op_type == "Reshape":  # TorchScript SDPA: the same 4-D shape again
        removed.append(step)
        out, step = step.output[0], view.sole_reader(step.output[0])
    if step is None or step.op_type != "Transpose" or _perm(step) != QV_PERM:
        return Miss("the context is not transposed back [0, 2, 1, 3]")
    merge = view.sole_reader(step.output[0])
    if merge is None or merge.op_type != "Reshape":
        return Miss("the heads are not merged by a Reshape")
    removed.append(step)
    # 1. the scores
    scores, mask = softmax.input[0], ""
    add = view.made_by(scores, "Add")
    if add is not None and view.sole_reader(scores) is not None:
        for k in (0, 1):
            if view.made_by(add.input[k], "MatMul") or view.made_by(add.input[k], "Div") or view.made_by(add.input[k], "Mul"):
                scores, mask = add.input[k], add.input[1 - k]
                removed.append(add)
                break
    scale = 1.0
    divide = view.made_by(scores, "Div")
    if divide is not None and _scalar(view, divide.input[1]) and view.sole_reader(scores) is not None:
        scale, scores = 1.0 / _scalar(view, divide.input[1]), divide.input[0]
        removed.append(divide)
    elif view.made_by(scores, "Mul") is not None:
        scores, factor = _scaled(view, scores, removed)
        scale *= factor
    product = view.made_by(scores, "MatMul")
    if product is None or view.sole_reader(scores) is None:
        return Miss("the Softmax does not read a product of the queries and keys")
    removed.append(product)
    queries, q_scale = _scaled(view, product.input[0], removed)
    keys, k_scale = _scaled(view, product.input[1], removed)
    query = _split(view, queries, removed)
    if not query:
        return query
    key = _key(view, keys, removed)
    if not key:
        return key
    heads = {h for h in (_heads_of(view, query[1]), _heads_of(view, key[1]), _heads_of(view, value[1])) if h}
    if len(heads) > 1:
        return Miss(f"the head splits disagree on the heads: {sorted(heads)}")
    found = AttentionMatch(query[0], key[0], value[0], mask, scale * q_scale * k_scale, step.output[0],
                           heads.pop() if heads else None, removed)
    found.merge = merge
    return found


def fuse_attention(model: onnx.ModelProto, *, num_heads: int = 0, hidden_size: int = 0) -> int:
    """Rewrite ``model`` in place (module docstring); returns the number of MultiHeadAttention
    nodes written. ``num_heads`` / ``hidden_size``: the detected ones, for splits whose heads
    are not constants."""
    view = GraphView(model, {}, fresh_prefix="attention")  # no shapes needed: the patterns read ops and constants
    matches, taken = [], set()
    for node in model.graph.node:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        found = match(view, node)
        if isinstance(found, Miss):
            log.debug("attention: %s left unfused: %s", node.name or node.output[0], found)
            continue
        heads = found.heads or num_heads
        if not heads or any(id(n) in taken for n in found.removed):
            continue
        found.heads = heads
        taken.update(id(n) for n in found.removed)
        matches.append(found)
    if not matches:
        return 0
    graph = model.graph
    made: dict[int, list[onnx.NodeProto]] = {}
    for found in matches:
        nodes = []
        bias = ""
        if found.mask:
            bias, nodes = _bias_nodes(view, found, graph)
        # [B, S, hidden]: the elements of the transposed context, in its order; the merging Reshape
        # (kept: its target may be [B * S, hidden]) reads it instead
        nodes.append(helper.make_node("MultiHeadAttention", [found.query, found.key, found.value, "", "", bias],
                                      [found.output], name=f"{found.output}/MultiHeadAttention", domain=MS_DOMAIN,
                                      num_heads=found.heads, scale=float(found.scale)))
        made[id(found.merge)] = nodes + [found.merge]
    removed = {id(n) for found in matches for n in found.removed}
    order = []
    for node in graph.node:
        if id(node) in made:
            order.extend(made[id(node)])
        elif id(node) not in removed:
            order.append(node)
    del graph.node[:]
    graph.node.extend(order)
    view.edit.drop_dead()  # what only the matched nodes read: the head splits' shape arithmetic
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=MS_DOMAIN, version=1)
    return len(matches)


def _bias_nodes(view: GraphView, found: AttentionMatch, graph: onnx.GraphProto):
    """``Max(Expand(mask, [B, 1, S, S]), floor)`` with B and S read from the query's shape."""
    target, nodes, initializers = square_bias_shape(found.query, view.edit.fresh)
    wide, floor, bias = (view.edit.fresh(p) for p in ("wide", "floor", "bias"))
    graph.initializer.extend([*initializers, numpy_helper.from_array(np.array(BIAS_FLOOR, np.float32), floor)])
    nodes += [helper.make_node("Expand", [found.mask, target], [wide]),
              helper.make_node("Max", [wide, floor], [bias])]
    return bias, named(nodes)
