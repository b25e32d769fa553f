"""``--fuse-reductions``: ReduceSums that add up blocks of leading and trailing axes, with the
Reshapes and Casts around them, as one ``ai.onnxcampo::BlockReduceSum`` node each
(``onnxcampo/ops/reduce/__init__.py``, ``docs/ops.md``).

A training step's bias and LayerNorm-scale gradients are sums over the rows of ``[P, Q]``
matrices, a Conv bias gradient sums ``[N, C, H*W]`` over N and H*W, and
``onnxcampo.training.simplify`` (rule 7) writes the latter as two ReduceSums with Reshapes
between; a mixed-precision plan often feeds them a Cast float16 -> float32, one more pass over
memory. ONNX Runtime's CUDA reductions run these several times slower than the memory allows.
One BlockReduceSum reads the input once, in its own type, and writes the sum in the type its
readers want.

Runs on the written model, after the precision plan, its Casts and loss scaling, before
``--fuse-elementwise``. Rules:

1. A *block reduction* is a default-domain ReduceSum of a float32 or float16 tensor with static
   input and output shapes (no size-0 dim) and constant, non-empty axes (attribute, or an
   initializer or Constant input) whose reduced axes, size-1 dims set aside, are a leading
   block, a trailing block or both around a kept block of more than one element: the input is
   a ``[P, Q, R]`` array (``simplify._split_sizes``) with ``P * R > 1``.
2. A chain starts at a block reduction and goes on into another one through its output when
   every value between is read only by the next node and is no graph output, and the nodes
   between are views (Reshape, Squeeze, Unsqueeze, Flatten, Identity: the elements in their
   order) or Casts between float32 and float16: two block reductions in a row are one,
   ``[P1, Q1, R1]`` then ``Q1`` as ``[P2, Q2, R2]`` is ``[P1*P2, Q2, R2*R1]`` (rule 7's pair:
   ``[P, Q, R] -> [P*Q] -> [Q]``).
3. Before the chain, views and Casts float16 -> float32 (exact: no value changes) whose output
   is read only by the chain and is no graph output are folded: the node reads their input. A
   Cast to float16 before it stays (it rounds each element). 3b: a Cast float16 -> float32 read
   by other nodes too (a residual gradient whose two bias gradients each sum it) is read
   through: the chain reads the Cast's input, and the Cast goes once no other node reads it.
4. After the chain, views and Casts between float32 and float16 that are the only reader of the
   value before them (no graph output) are folded: the node writes the last one's name, shape
   and type.
5. The chain and its folded nodes become one node, placed where the last of them was; the
   values between lose their value_info, the output gets one (its type and shape: later passes
   and ORT read them from there), and constants only the removed nodes read are dropped.
6. Chains that sum the same tensor the same way (one x, [P, Q, R] and output type and shape)
   are one node: the one placed first stays, the others' readers read its output (a ResNet
   stage's first block: its conv3 and downsample bias gradients both sum the residual's
   gradient, 102 MB at b64 for layer1, read twice before). A chain whose output is a graph
   output keeps its own node.

7. A block ReduceMean (rule 1's conditions, ReduceMean for ReduceSum: a training BatchNorm's batch
   statistics) is a chain of its own, never continued (rules 2 and 4 do not apply): one
   BlockReduceSum writing the float32 sum and a Mul by ``1 / (P * R)`` writing the mean, then a
   Cast when the mean's type is float16. The sum is float32 whatever the plan: a float16 sum of a
   whole channel (800k values for ResNet-50's first BatchNorm at batch 64) would overflow where
   the mean does not.

The values are the float32 sums of the same elements in another order, rounded once to the
output type. Where the unfused graph rounds to float16 in between (a float16 ReduceSum read by
a Cast to float32, a pair of float16 ReduceSums), the fused node does not: its value is the
closer one, and an intermediate float16 overflow to inf becomes a finite float32 sum.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo import ir, oplists
from onnxcampo.plan import Precision
from onnxcampo.rewrites.matcher import FLOATS, VIEWS, GraphView
from onnxcampo.training.simplify import _split_sizes

if TYPE_CHECKING:
    from onnxcampo.casting import PrecisionOf
    from onnxcampo.context import GraphContext
    from onnxcampo.estimate import RewritePrediction

log = logging.getLogger(__name__)



@dataclass
class ReductionFusionResult:
    fused: int = 0  # BlockReduceSum nodes made
    reductions: int = 0  # ReduceSums they replace
    casts: int = 0  # Casts folded in
    reshapes: int = 0  # views folded in (Reshape, Squeeze, Unsqueeze, Flatten, Identity)
    shared: int = 0  # chains that read another's output (rule 6: the same sum of the same tensor)
    kinds: Counter = field(default_factory=Counter)  # "column_sums" (R == 1), "row_sums" (P == 1), "blocks"

    def to_json(self) -> dict:
        return {"fused_nodes": self.fused, "reduce_sums_replaced": self.reductions, "casts_folded": self.casts,
                "reshapes_folded": self.reshapes, "sums_shared": self.shared, "kinds": dict(sorted(self.kinds.items()))}


@dataclass
class _Chain:
    nodes: list[onnx.NodeProto]
    x: str
    sizes: tuple[int, int, int]
    output: str
    reductions: int
    same_as: str | None = None  # rule 6: another chain's output, which this one's readers read
    mean: bool = False  # rule 7: a ReduceMean's chain (the sum times 1 / (P * R))


def fuse_reductions(model: onnx.ModelProto, info: dict[str, ir.TensorInfo] | None = None) -> ReductionFusionResult:
    """Replace the block reductions of ``model`` (in place) by ``BlockReduceSum`` nodes; ``info``:
    the model's tensor types and shapes when the caller has them (else inferred here)."""
    result = ReductionFusionResult()
    if info is None:
        info, _ = ir.infer_tensor_info(model)
    view = GraphView(model, info, fresh_prefix="reduce")
    taken: set[int] = set()
    chains: list[_Chain] = []
    shared: dict[int, onnx.NodeProto] = {}  # rule 3b's Casts, read through by some chains
    for node in model.graph.node:
        if id(node) in taken:
            continue
        found = _chain_at(view, node, taken)
        if found is None:
            continue
        chain, through = found
        taken.update(id(n) for n in chain.nodes)
        chains.append(chain)
        shared.update({id(n): n for n in through})
    if not chains:
        return result
    _share(view, chains)
    _replace(view, chains, shared, result)
    log.info("fuse-reductions: %d ReduceSums (%d Casts, %d Reshapes) as %d BlockReduceSum nodes (%d sums shared)",
             result.reductions, result.casts, result.reshapes, result.fused, result.shared)
    return result


def _block(view: GraphView, node: onnx.NodeProto | None) -> tuple[int, int, int] | None:
    """Rule 1 (and 7: a ReduceMean): the node's [P, Q, R], or None."""
    if (node is None or node.op_type not in ("ReduceSum", "ReduceMean") or node.domain not in oplists.DEFAULT_DOMAINS
            or not node.input):
        return None
    shape, out = view.static(node.input[0]), view.static(node.output[0])
    if shape is None or out is None or 0 in shape or view.dtype(node.input[0]) not in FLOATS:
        return None
    axes = view.reduce_axes(node, len(shape))
    if axes is None:
        return None
    sizes = _split_sizes(shape, axes)
    if sizes is None or sizes[0] * sizes[2] == 1 or math.prod(out) != sizes[1]:
        return None
    return sizes


def _moves(view: GraphView, node: onnx.NodeProto, source: str, *, widen_only: bool) -> bool:
    """Whether ``node`` passes ``source``'s elements on unchanged in order (a view of it) or
    converts them between the float types (with ``widen_only``: float16 -> float32 or to its own
    type only)."""
    if node.domain not in oplists.DEFAULT_DOMAINS or not node.input or node.input[0] != source:
        return False
    if node.op_type in VIEWS:
        return view.static(node.output[0]) is not None
    if node.op_type != "Cast":
        return False
    to, src = ir.attribute(node, "to"), view.dtype(source)
    if to not in FLOATS or src not in FLOATS:
        return False
    return not widen_only or to == src or (src == TensorProto.FLOAT16 and to == TensorProto.FLOAT)


def _chain_at(view: GraphView, node: onnx.NodeProto, taken: set[int]) -> tuple[_Chain, list[onnx.NodeProto]] | None:
    """Rules 2-4 from the block reduction ``node``: the chain, and the Casts it reads through (3b)."""
    sizes = _block(view, node)
    if sizes is None:
        return None
    members, (p, q, r), reductions = [node], sizes, 1
    current = node.output[0]
    if node.op_type == "ReduceMean":  # rule 7: a chain of its own
        x, through = _before(view, members, taken, p * q * r)
        if view.dtype(x) not in FLOATS or view.dtype(current) not in FLOATS:
            return None
        return _Chain(members, x, sizes, current, 1, mean=True), through
    while True:  # rule 2: on through the output into further block reductions
        between: list[onnx.NodeProto] = []
        value, nxt = current, view.sole_reader(current)
        while nxt is not None and nxt.op_type not in ("ReduceSum", "ReduceMean") and _moves(view, nxt, value,
                                                                                           widen_only=False):
            between.append(nxt)
            value = nxt.output[0]
            nxt = view.sole_reader(value)
        more = (_block(view, nxt) if nxt is not None and nxt.op_type == "ReduceSum" and nxt.input[0] == value
                and id(nxt) not in taken else None)
        if more is None or more[0] * more[1] * more[2] != q:
            break
        members += between + [nxt]
        p, q, r = p * more[0], more[1], more[2] * r
        reductions += 1
        current = nxt.output[0]
    output = current
    while True:  # rule 4: the moves after it
        nxt = view.sole_reader(output)
        if nxt is None or nxt.op_type in ("ReduceSum", "ReduceMean") or not _moves(view, nxt, output, widen_only=False):
            break
        members.append(nxt)
        output = nxt.output[0]
    x, through = _before(view, members, taken, p * q * r)
    if view.dtype(x) not in FLOATS or view.dtype(output) not in FLOATS or view.static(output) is None:
        return None
    return _Chain(members, x, (p, q, r), output, reductions), through


def _before(view: GraphView, members: list[onnx.NodeProto], taken: set[int],
            elements: int) -> tuple[str, list[onnx.NodeProto]]:
    """Rule 3: the moves before the chain are folded (inserted into ``members``); 3b: a widening
    move others read too is read through. Returns what the chain reads and the Casts read through."""
    x = members[0].input[0]
    through: list[onnx.NodeProto] = []
    while True:
        before = view.producers.get(x)
        if before is None or id(before) in taken or not before.input:
            break
        if not _moves(view, before, before.input[0], widen_only=True):
            break
        if view.sole_reader(x) is members[0] and not through:
            members.insert(0, before)
        elif x not in view.protected and before.op_type in ("Cast", *VIEWS):
            through.append(before)  # the chain reads its input; it stays for its other readers
        else:
            break
        x = before.input[0]
    if through and (any(n.op_type in VIEWS for n in through)
                    or view.static(x) is None or math.prod(view.static(x)) != elements):
        x, through = through[0].output[0], []  # read through Casts only, over the same elements
    return x, through


def _share(view: GraphView, chains: list[_Chain]) -> None:
    """Rule 6: one node per (x, sizes, output type and shape), the one placed first."""
    position = {id(n): i for i, n in enumerate(view.model.graph.node)}
    first: dict[tuple, _Chain] = {}
    for chain in sorted(chains, key=lambda c: position[id(c.nodes[-1])]):
        key = (chain.x, chain.sizes, view.dtype(chain.output), tuple(view.static(chain.output)), chain.mean)
        kept = first.setdefault(key, chain)
        if kept is not chain and chain.output not in view.protected:
            chain.same_as = kept.output


def _mean_nodes(view: GraphView, chain: _Chain) -> list[onnx.NodeProto]:
    """Rule 7: the float32 sum, times 1 / (P * R), cast to the mean's type if it is float16."""
    from onnxcampo.ops import nodes as op_nodes

    last, (p, _, r) = chain.nodes[-1], chain.sizes
    base = last.name or "block_mean"
    shape = list(view.static(chain.output))
    total, per_value = view.edit.fresh(base + "/sum"), view.edit.fresh(base + "/per_value")
    view.model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1.0 / (p * r), np.float32), per_value))
    half = view.dtype(chain.output) == TensorProto.FLOAT16
    mean = view.edit.fresh(base + "/mean") if half else chain.output
    made = [op_nodes.block_reduce_sum(chain.x, output=total, sizes=chain.sizes, output_shape=shape,
                                      input_type=view.dtype(chain.x), name=view.edit.fresh(base + "/block_sum")),
            onnx.helper.make_node("Mul", [total, per_value], [mean], name=view.edit.fresh(base + "/mean"))]
    if half:
        made.append(onnx.helper.make_node("Cast", [mean], [chain.output], to=TensorProto.FLOAT16,
                                          name=view.edit.fresh(base + "/cast_fp16")))
    return made


def _replace(view: GraphView, chains: list[_Chain], shared: dict[int, onnx.NodeProto],
             result: ReductionFusionResult) -> None:
    """Rule 5: each chain as one BlockReduceSum; the shared chains' readers read the kept one's
    output; a Cast read through that nothing reads any more goes."""
    from onnxcampo.ops import nodes as op_nodes

    made: dict[int, onnx.NodeProto | list[onnx.NodeProto]] = {}  # id of a chain's last node -> its nodes
    for chain in chains:
        result.reductions += chain.reductions
        if chain.same_as is not None:
            result.shared += 1
            continue
        last = chain.nodes[-1]
        made[id(last)] = _mean_nodes(view, chain) if chain.mean else op_nodes.block_reduce_sum(
            chain.x, output=chain.output, sizes=chain.sizes, output_type=view.dtype(chain.output),
            output_shape=list(view.static(chain.output)), input_type=view.dtype(chain.x),
            name=view.edit.fresh(last.name or "block_reduce_sum"))
        result.fused += 1
        result.casts += sum(n.op_type == "Cast" for n in chain.nodes)
        result.reshapes += sum(n.op_type in VIEWS for n in chain.nodes)
        p, _, r = chain.sizes
        result.kinds["column_sums" if r == 1 else "row_sums" if p == 1 else "blocks"] += 1
    removed = {id(n) for chain in chains for n in chain.nodes}
    between = [onnx.helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, list(view.static(chain.output)))
               for chain in chains if chain.mean and chain.same_as is None
               for n in made[id(chain.nodes[-1])] if n.output[0] != chain.output]
    view.replace(made, removed, [c.output for c in chains if c.same_as is None], between)
    for chain in chains:
        if chain.same_as is not None:
            view.edit.replace_uses(chain.output, chain.same_as)
    model = view.model
    read = {name for n in model.graph.node for name in n.input} | view.protected
    unread = {n.output[0] for n in shared.values() if not any(o in read for o in n.output)}
    if unread:  # every reader of a shared Cast was a chain: it goes (graph.node holds copies: by name)
        result.casts += len(unread)
        dead = [n for n in model.graph.node if n.output and n.output[0] in unread]  # held: their ids stay theirs
        view.edit.replace_nodes({}, {id(n) for n in dead}, [])
    op_nodes.import_domain(model)



# --- the prediction --------------------------------------------------------------------------


def costed(ctx: GraphContext) -> bool:
    """Whether the plan is costed with this rewrite: ``fuse_reductions`` and ``plan_for_fusion``."""
    return bool(ctx.config.fuse_reductions and ctx.config.experimental.plan_for_fusion)


def predict(ctx: GraphContext, plan) -> RewritePrediction:
    """``fuse_reductions``: the plan's total with the Casts its BlockReduceSums read folded
    (:func:`reads_cast`; a cross-entropy's logits: ``onnxcampo.rewrites.loss.reads_logits_cast``)
    and without. The reduction's own kernel is costed as the ReduceSum it replaces."""
    from onnxcampo import estimate

    return estimate.with_and_without(ctx, plan, "fuse_reductions")


def reads_cast(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    """Whether every reader of ``tensor`` is an fp32 ReduceSum: the rewrite folds a Cast to fp32
    in front of one into its BlockReduceSum (a Cast to fp16 rounds every element and stays)."""
    readers = [use.node for use in ctx.uses(tensor)]
    return bool(readers) and all(n.op in ("ReduceSum", "ReduceMean") and (n.domain or "") in oplists.DEFAULT_DOMAINS
                                 and precision_of(n.name) is Precision.FP32 for n in readers)


__all__ = ["ReductionFusionResult", "fuse_reductions"]
