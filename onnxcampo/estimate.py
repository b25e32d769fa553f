"""Predicted time of a plan: node times plus the Casts its precision boundaries need, on the graph
ONNX Runtime executes, in the mode it executes.

Casts are counted the way Cast insertion makes them (the rules of ``onnxcampo.casting``), each
costing ``CostModel.cast_time`` of its tensor. Passes use :func:`delta` for local decisions; the pipeline uses
:func:`plan_time` to compare whole plans.

What ORT runs (``GraphContext.ort_status``, read from ORT's own optimized graph): an aliased op
(``oplists.ALIASED``) costs nothing; a node ORT absorbed into a fused neighbour costs no launch,
and no time unless it is the Tensor Core product whose work the fused node does; a Cast the plan
puts on one of its tensors breaks the fusion, and the node costs what it costs alone.
``execution="cuda-graph"``: the run is replayed, so no node costs host time; the plan costs its GPU
work plus one replay (``CostModel.run_us``). ``plain``: the GPU's work and the host's launches
(``CostModel.launch_us`` per launch; cuDNN's layout transforms around fp16 NCHW convolutions are
launches too): the larger of the GPU's work and the host's launches, plus the share of the smaller
that a run adds (``CostModel.host_overlap``: 1 where the database says the launches add, 0 where
they hide, or a share fitted from whole runs, ``python -m onnxcampo.benchmarks host-overlap``).

With ``fuse_elementwise`` the plan is costed as the fused model runs (``plan_for_fusion``, the
default; ``False`` costs the fusion-blind plan as if neither fusion pass ran, though both still run
after it). :func:`onnxcampo.rewrites.elementwise.predicted_groups` predicts the ``FusedElementwise`` groups on the planning
graph (``onnxcampo.rewrites.elementwise``'s rule 2: fusable nodes ORT runs as they are, joined to a
producer's group of the same shape, no cycle, at most 16 inputs; not its other kernel limits nor
rule 2b, and the Casts the plan will add are not in this graph). A group of two or more nodes is
one kernel, ``CostModel.fused_kernel``: ``fixed_us + bytes / bytes_per_us``, bytes being what it
reads from outside the group plus what it writes for readers outside it (``fused_elementwise`` in
the cost database, fitted by ``benchmarks/fused_elementwise_costs.py``; without it an
estimate that is not measured, :data:`onnxcampo.costdb.model.DEFAULT_FUSED_KERNEL`). Then:

1. A member of a group costs its share of that kernel (:class:`FusedMember`): 1/size of the fixed
   cost and the bytes of its own outside inputs and outputs, in its precision; one launch per
   group. An interior member reads and writes nothing outside the group, so its precision only
   moves the Casts around it, which cost nothing:
2. a Cast whose producer and every reader are in one group costs nothing (no pass, no launch);
3. a Cast at a group's edge costs the bytes it changes there (``elementwise.group_cast_us``): the group
   writes the tensor in the readers' type instead of (or, when it is also read in its own type,
   besides) the producer's, or reads it in the type it is made in instead of its members'. The
   difference can be negative: an fp16 MatMul feeding an fp32 chain saves the chain 2 bytes an
   element.
4. A Cast next to a lone fusable op (the fusion pass fuses the pair) folds as before: no launch and
   only the memory pass it adds to the kernel (:data:`FOLDED_CAST_SHARE` of a Cast's memory time:
   one of the Cast's three passes, reading 4 and writing 2 bytes an element, is left).

With ``fuse_reductions`` (and ``plan_for_fusion``) a Cast to fp32 whose every reader is an fp32
ReduceSum costs nothing: ``--fuse-reductions`` folds it into the BlockReduceSum, which reads either
type (``onnxcampo.rewrites.reductions``); so does the Cast of a cross-entropy loss's logits to its fp32
LogSoftmax (``onnxcampo.rewrites.loss``: SoftmaxCrossEntropy reads float16). With both fusions
(and ``fuse_column_sums``) a bias gradient's column sums of a value a predicted group writes cost
the fused kernel's fixed cost only (``elementwise.summed_in_kernel``: the group's kernel adds them as it
stores, ``onnxcampo.rewrites.elementwise`` rule 4).

With ``channels_last`` (and ``plan_for_fusion``) an inference model's plan is costed with what
the layout pass does to it (``onnxcampo.rewrites.layout.layout_change``: the pass run on a copy of the planning graph; cuDNN's layout
transforms around float16 convolutions gone, the Transposes it inserts added, each NHWC
convolution call ``layout.CONV_NHWC_HOST_US`` of host time, or what the database measured).

Each model-file rewrite brings its own pricing, next to its rules in ``onnxcampo/rewrites/``:
``costed(ctx)`` (whether the plan is costed with it), what it changes (the fused groups, the
folded Casts, the layout change) and ``predict(ctx, plan)``, the plan's total with it and without
it (:func:`with_and_without`), the other rewrites as configured. :data:`PREDICTIONS` collects the
``predict`` functions: what ``pipeline.decide_rewrites`` compares. This module composes them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo import oplists
from onnxcampo.casting import PrecisionOf, produced_dtype, tensor_casts
from onnxcampo.context import GraphContext
from onnxcampo.padding import pad_plan
from onnxcampo.plan import Precision, PrecisionPlan
from onnxcampo.rewrites import elementwise, loss, reductions
from onnxcampo.rewrites import layout as channels_last

log = logging.getLogger(__name__)

FOLDED_CAST_SHARE = 1 / 3


@dataclass(frozen=True)
class PlanTime:
    """``total_us`` is the larger of the GPU's work (``nodes_us + casts_us``) and the host's
    (``dispatch_us``: one dispatch per node launched, Casts and Pad/Slice included), plus the
    fixed cost of a run whatever its plan (``run_us``: the call, launch and synchronisation; it
    keeps the relative ``--min-gain`` honest for models of a few microseconds of work)."""

    total_us: float
    nodes_us: float
    casts_us: float
    casts: int
    dispatch_us: float = 0.0
    launched: int = 0
    run_us: float = 0.0
    execution: str = "plain"

    def to_json(self) -> dict:
        return {"total_us": round(self.total_us, 3), "nodes_us": round(self.nodes_us, 3),
                "casts_us": round(self.casts_us, 3), "casts": self.casts,
                "dispatch_us": round(self.dispatch_us, 3), "launched_nodes": self.launched,
                "run_us": round(self.run_us, 3), "execution": self.execution}


def node_time(ctx: GraphContext, node: gs.Node, precision: Precision, precision_of: PrecisionOf | None = None) -> float:
    """fp16 time is the padded one where padding pays and is enabled (campo only).

    With ``precision_of`` (the plan), a member of a fusable chain whose members all run in
    ``precision`` costs its time times the chain's measured factor (``CostModel.chain_factor``).
    Otherwise a node ORT runs no kernel of its own for costs nothing (:func:`runs_alone`).
    With ``fuse_elementwise`` (and ``plan_for_fusion``), a member of a predicted fused group costs
    its share of the group's kernel (``onnxcampo.rewrites.elementwise.predicted_groups``).
    """
    member = _fused_member(ctx, node)
    if member is not None:
        return member.time_us(ctx.cost.fused_kernel(), precision)
    if elementwise.summed_in_kernel(ctx, node):
        return ctx.cost.fused_kernel().fixed_us  # the partial sums' finishing launch
    chain = ctx.chains.get(node.name)
    if chain is not None and precision_of is not None:
        pattern, members = chain
        factor = ctx.cost.chain_factor(pattern, precision.value)
        if factor != 1.0 and all(precision_of(m) is precision for m in members if m != node.name):
            # a measured chain factor prices the chain as ORT ran it, fused or not: every member
            # its alone time times the factor (ORT's statuses decide the launches only)
            return alone_time(ctx, node, precision) * factor
    if not _costs_time(ctx, node, precision_of):
        return 0.0
    return alone_time(ctx, node, precision)


def aliased(node: gs.Node) -> bool:
    return node.op in oplists.ALIASED and (node.domain or "") in oplists.DEFAULT_DOMAINS


def _fusion_broken(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf | None) -> bool:
    """Whether the plan puts a Cast inside the fused group the node belongs to (ORT's fusions do
    not look through a Cast, and a group broken anywhere runs as its nodes; Casts on the group's
    edges leave it whole). Local decisions (no plan) take the fusion to hold."""
    if precision_of is None or eliminated(ctx, node):
        return False
    group = fusion_groups(ctx)[0].get(node.name)
    return group is not None and any(tensor_casts(ctx, t, precision_of) for t in group)


def fusion_groups(ctx: GraphContext) -> tuple[dict[str, tuple[gs.Tensor, ...]], dict[str, frozenset[str]],
                                                dict[str, str]]:
    """node name -> the tensors inside its fused group, -> the op types of the group's nodes, and
    -> the group (one member's name): ORT's statuses joined through the outputs of absorbed nodes
    (gone from ORT's graph) into their consumers that ORT does not run as they are. Cached per
    status set (a training step swaps two)."""
    cache = ctx.__dict__.setdefault("fusion_groups", {})
    key = id(ctx.ort_status)
    if key in cache:
        return cache[key]
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    inner: list[tuple[str, gs.Tensor]] = []
    for node in ctx.nodes:
        if ctx.ort_status.get(node.name) != "absorbed" or eliminated(ctx, node):
            continue
        find(node.name)
        for tensor in node.outputs:
            members = [c for c in tensor.outputs if c.name in ctx.ort_status and not eliminated(ctx, c)]
            for consumer in members:
                parent[find(consumer.name)] = find(node.name)
            if members:
                inner.append((node.name, tensor))
    tensors: dict[str, list[gs.Tensor]] = {}
    for owner, tensor in inner:
        tensors.setdefault(find(owner), []).append(tensor)
    ops_of = {node.name: node.op for node in ctx.nodes}
    kinds: dict[str, set[str]] = {}
    for name in parent:
        kinds.setdefault(find(name), set()).add(ops_of.get(name, ""))
    groups = ({name: tuple(tensors.get(find(name), ())) for name in parent},
              {name: frozenset(kinds[find(name)]) for name in parent},
              {name: find(name) for name in parent})
    cache[key] = groups
    return groups


def eliminated(ctx: GraphContext, node: gs.Node) -> bool:
    """An absorbed node ORT removes whatever its neighbours' precision (Dropout and Identity at
    inference, nodes of constants only, which it folds): no Cast brings it back."""
    if ctx.ort_status.get(node.name) != "absorbed":
        return False
    return node.op in oplists.ELIMINATED or all(ctx.is_constant(t) for t in node.inputs if t.name)


def _product(ctx: GraphContext, node: gs.Node) -> bool:
    return ctx.categories.get(node.name) is oplists.Category.ALLOW


def runs_alone(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf | None = None) -> bool:
    """Whether the node costs a launch of its own under the plan: not an aliased op, and not
    absorbed into a fused group unless a Cast breaks the group. A fused group launches once per
    node ORT keeps of it (the BatchNormalization's output a Conv makes, the LayerNorm sub-graph's
    last Add, the Attention node of its many products)."""
    if aliased(node):
        return False
    if ctx.ort_status.get(node.name) == "absorbed":
        return _fusion_broken(ctx, node, precision_of)  # the group's node that ORT keeps launches it
    return True


def _costs_time(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf | None) -> bool:
    """An absorbed Tensor Core product still does its work inside the fused node; the element-wise
    ops absorbed with it, and those whose output the product now makes (``carried``), do not."""
    if aliased(node):
        return False
    status = ctx.ort_status.get(node.name)
    if status == "absorbed" and _product(ctx, node) and not eliminated(ctx, node):
        return True
    return status not in ("absorbed", "carried") or _fusion_broken(ctx, node, precision_of)


def host_launches(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf) -> tuple[int, int, int]:
    """(convolution launches, other launches, float16 NCHW convolution calls) the node costs the
    host under the plan. A float16 NCHW convolution that runs by itself is one call priced whole
    where the database measured such calls (``host_launch.inference.conv_fp16``: cuDNN's layout
    transforms launched with it), else one convolution launch and
    ``oplists.NCHW_FP16_LAYOUT_LAUNCHES`` other launches."""
    member = _fused_member(ctx, node)
    if member is not None:
        return 0, int(member.leader), 0  # the group's kernel: one launch, counted on its first member
    fp16 = precision_of(node.name) is Precision.FP16
    fp16_conv = node.op in oplists.NCHW_FP16_LAYOUT_OPS and fp16
    layout = oplists.NCHW_FP16_LAYOUT_LAUNCHES if fp16_conv and not _fp16_conv_measured(ctx) else 0
    if not runs_alone(ctx, node, precision_of):
        return 0, layout, 0  # priced whole, the call is counted on the node that carries it
    convolution = node.op in oplists.NCHW_FP16_LAYOUT_OPS or (
        ctx.ort_status.get(node.name) in ("carried", "fused") and not _fusion_broken(ctx, node, precision_of)
        and fusion_groups(ctx)[1].get(node.name, frozenset()) & oplists.NCHW_FP16_LAYOUT_OPS)
    if convolution and fp16 and _fp16_conv_measured(ctx):
        return 0, 0, 1
    return (1, layout, 0) if convolution else (0, 1 + layout, 0)


def _fp16_conv_measured(ctx: GraphContext) -> bool:
    """Whether the database prices a float16 NCHW convolution call whole (``conv_fp16``)."""
    return ctx.cost.library_launch_us("conv_fp16") is not None


def alone_time(ctx: GraphContext, node: gs.Node, precision: Precision) -> float:
    fp32 = ctx.fp32_us[node.name]
    if precision is Precision.FP32:
        return fp32
    if ctx.padding:
        plan = pad_plan(ctx, node)
        if plan is not None:
            return plan.padded_us
    return ctx.cost.fp16_time(ctx.features[node.name], fp32)


def casts_time(ctx: GraphContext, tensors: Iterable[gs.Tensor], precision_of: PrecisionOf) -> tuple[float, int]:
    """The Casts the tensors need and their time; with ``fuse_elementwise`` the Casts that fold
    into a fused kernel cost their memory share only and are not counted as launches."""
    total, count = 0.0, 0
    folding, reducing = elementwise.costed(ctx), reductions.costed(ctx)
    for tensor in tensors:
        casts = tensor_casts(ctx, tensor, precision_of)
        if not casts:
            continue
        if tensor.name in ctx.loss_scaling_gradients and _produced_fp16(ctx, tensor, precision_of):
            continue  # loss scaling's fused unscale reads the fp16 gradient itself: no Cast is made
        if reducing and (reductions.reads_cast(ctx, tensor, precision_of)
                         or loss.reads_logits_cast(ctx, tensor, precision_of)):
            continue  # BlockReduceSum reads the tensor itself, in either type: no pass, no launch
        if reducing and loss.gradient_written_fp16(ctx, tensor, precision_of):
            continue  # SoftmaxCrossEntropyGrad writes the float16 its readers want (loss fusion rule 5)
        edge = elementwise.group_cast_us(ctx, tensor, precision_of) if folding else None
        if edge is not None:
            total += edge  # inside a fused group: nothing; at its edge: the bytes it changes there
            continue
        if folding and elementwise.cast_folds(ctx, tensor):
            memory = ctx.cost.cast_time(ctx.numel(tensor)) - ctx.cost.cast_time(0)
            total += casts * FOLDED_CAST_SHARE * max(memory, 0.0)
            continue
        count += casts
        total += casts * ctx.cost.cast_time(ctx.numel(tensor))
    return total, count


def _produced_fp16(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    producer = ctx.producer(tensor)
    return producer is not None and precision_of(producer.name) is Precision.FP16


def _fused_member(ctx: GraphContext, node: gs.Node) -> elementwise.FusedMember | None:
    if not elementwise.costed(ctx):
        return None
    return elementwise.predicted_groups(ctx).get(node.name)


def precision_function(plan: PrecisionPlan, overrides: dict[str, Precision] | None = None) -> PrecisionOf:
    if not overrides:
        return plan.precision
    return lambda name: overrides.get(name) or plan.precision(name)


def plan_time(ctx: GraphContext, plan: PrecisionPlan) -> PlanTime:
    if ctx.ort_status_fp32 is not None and not any(plan.precision(n.name) is Precision.FP16 for n in ctx.nodes):
        # an all-fp32 training step gets no loss scaling: ORT folds what scaling would keep live
        mixed, ctx.ort_status = ctx.ort_status, ctx.ort_status_fp32
        try:
            return _plan_time(ctx, plan)
        finally:
            ctx.ort_status = mixed
    return _plan_time(ctx, plan)


def _plan_time(ctx: GraphContext, plan: PrecisionPlan) -> PlanTime:
    precision_of = plan.precision
    nodes_us = sum(node_time(ctx, n, precision_of(n.name), precision_of) for n in ctx.nodes)
    # Only a tensor touching an fp16 node can need a Cast.
    tensors = {id(t): t for n in ctx.nodes if precision_of(n.name) is Precision.FP16 for t in (*n.inputs, *n.outputs)}
    cast_us, casts = casts_time(ctx, tensors.values(), precision_of)
    conv_launches, other_launches, fp16_conv_calls = 0, casts + _pad_nodes(ctx, precision_of), 0
    fused_calls = 0  # FusedElementwise kernels: library calls, priced as such where measured
    for node in ctx.nodes:
        conv, other, fp16_conv = host_launches(ctx, node, precision_of)
        conv_launches, other_launches = conv_launches + conv, other_launches + other
        fp16_conv_calls += fp16_conv
        member = _fused_member(ctx, node)
        fused_calls += int(member is not None and member.leader)
    training = bool(ctx.training_fp32)
    if ctx.loss_scaling is not None and any(precision_of(n.name) is Precision.FP16 for n in ctx.nodes):
        # a mixed training step gets dynamic loss scaling: its nodes, and a pass over the gradients
        # (a fused unscale reads fp16 gradients itself: casts_time counts no Cast for them)
        other_launches += ctx.loss_scaling.nodes
        # the gradient pass, plus the fixed cost of each further (small or scalar) kernel
        nodes_us += ctx.cost.cast_time(ctx.loss_scaling.elements) + (ctx.loss_scaling.nodes - 1) * ctx.cost.cast_time(0)
    layout = channels_last.layout_change(ctx, precision_of)
    nodes_us += layout.gpu_us
    conv_launches += layout.conv_launches
    other_launches += layout.launches
    fp16_conv_calls += layout.fp16_conv_calls
    launched = conv_launches + other_launches + fp16_conv_calls + layout.nhwc_calls
    run = ctx.cost.run_us()
    if ctx.config.execution == "cuda-graph":
        # replayed: the launches were recorded once; what is left is the GPU's work and one replay
        return PlanTime(nodes_us + cast_us + run, nodes_us, cast_us, casts, 0.0, launched, run, "cuda-graph")
    # a training step's nodes cost the host more than single ops do (CostModel.launch_us)
    dispatch = (ctx.cost.launch_us("conv", training=training) * conv_launches
                + ctx.cost.launch_us("other", training=training) * other_launches
                + channels_last.nhwc_call_us(ctx.cost) * layout.nhwc_calls
                + (ctx.cost.library_launch_us("conv_fp16") or 0.0) * fp16_conv_calls
                + fused_call_extra_us(ctx.cost, training) * fused_calls)
    gpu = nodes_us + cast_us
    # the larger of the GPU's work and the host's launches, and the share of the smaller that adds
    # to it (1: both add; fitted from whole runs where the database has it)
    total = max(gpu, dispatch) + ctx.cost.host_overlap(training=training) * min(gpu, dispatch)
    return PlanTime(total + run, nodes_us, cast_us, casts, dispatch, launched, run)


def _pad_nodes(ctx: GraphContext, precision_of: PrecisionOf) -> int:
    """Pad and Slice nodes the padding pass adds to fp16 products (weights are padded offline)."""
    if not ctx.padding:
        return 0
    count = 0
    for node in ctx.nodes:
        if precision_of(node.name) is Precision.FP16:
            plan = pad_plan(ctx, node)
            if plan is not None:
                count += (plan.k_padded != plan.k) + (plan.n_padded != plan.n)
    return count


def delta(ctx: GraphContext, plan: PrecisionPlan, nodes: list[gs.Node]) -> dict[str, float]:
    """Change of predicted time if ``nodes`` ran fp16 instead of their current precision.

    Returns the numbers a decision records: ``fp32_us``, ``fp16_us`` (node times), ``cast_us``
    (Cast time after minus before) and ``gain_us`` (positive: fp16 is faster).
    """
    overrides = {n.name: Precision.FP16 for n in nodes}
    after = precision_function(plan, overrides)
    before = precision_function(plan, {n.name: Precision.FP32 for n in nodes})
    touched = {id(t): t for n in nodes for t in (*n.inputs, *n.outputs)}
    cast_after, _ = casts_time(ctx, touched.values(), after)
    cast_before, _ = casts_time(ctx, touched.values(), before)
    # Fusable chains: undecided members are taken to follow ``nodes`` (later passes usually
    # paint them alike); decided partners outside ``nodes`` keep their precision but may gain or
    # lose a fusion, so their times count too.
    def follow(precision: Precision) -> PrecisionOf:
        def precision_of(name: str) -> Precision:
            if name in overrides or not plan.is_decided(name):
                return precision
            return plan.precision(name)
        return precision_of

    fp32 = sum(node_time(ctx, n, Precision.FP32, follow(Precision.FP32)) for n in nodes)
    fp16 = sum(node_time(ctx, n, Precision.FP16, follow(Precision.FP16)) for n in nodes)
    partners = {m for n in nodes for m in ctx.chains.get(n.name, ("", ()))[1]} - set(overrides)
    for name in partners:
        if plan.is_decided(name):
            partner = ctx.chain_nodes[name]
            fp32 += node_time(ctx, partner, plan.precision(name), follow(Precision.FP32))
            fp16 += node_time(ctx, partner, plan.precision(name), follow(Precision.FP16))
    cast = cast_after - cast_before
    return {"fp32_us": fp32, "fp16_us": fp16, "cast_us": cast, "gain_us": fp32 - fp16 - cast}


def node_costs(ctx: GraphContext, plan: PrecisionPlan) -> dict[str, dict[str, float]]:
    """Each node's own numbers under the whole ``plan``: its time in fp32 and in fp16 (every other
    node as planned) and the Casts it causes, with their time.

    A Cast belongs to the fp16 side of its boundary: a Cast back to fp32 to the fp16 node that
    produces the tensor, a Cast to fp16 to the fp16 nodes that read it, shared equally where
    several do. The nodes' Casts then add up to the plan's (loss scaling's adjustments of a
    training step aside). Decisions keep the numbers their rule priced (an island's are the
    island's sums); these are the per-node view of the plan as a whole."""
    precision_of = plan.precision

    def own(node: gs.Node, precision: Precision) -> float:  # the node in ``precision``, the rest as planned
        return node_time(ctx, node, precision, precision_function(plan, {node.name: precision}))

    costs = {n.name: {"fp32_us": own(n, Precision.FP32), "fp16_us": own(n, Precision.FP16), "casts": 0.0,
                      "cast_us": 0.0} for n in ctx.nodes}
    tensors = {id(t): t for n in ctx.nodes if precision_of(n.name) is Precision.FP16 for t in (*n.inputs, *n.outputs)}
    for tensor in tensors.values():
        cast_us, casts = casts_time(ctx, [tensor], precision_of)
        if not casts and not cast_us:
            continue
        producer = ctx.producer(tensor)
        if producer is not None and produced_dtype(ctx, tensor, precision_of) == TensorProto.FLOAT16:
            owners = [producer.name]
        else:
            owners = list(dict.fromkeys(use.node.name for use in ctx.uses(tensor)
                                        if precision_of(use.node.name) is Precision.FP16))
            if not owners and producer is not None:
                owners = [producer.name]
        for owner in owners:
            if owner in costs:
                costs[owner]["casts"] += casts / len(owners)
                costs[owner]["cast_us"] += cast_us / len(owners)
    return costs


# --- channels-last ---------------------------------------------------------------------------

def fused_call_extra_us(cost, training: bool = False) -> float:
    """What a FusedElementwise call costs the host beyond an ORT kernel's launch (the custom-op
    API's call, measured by ``costdb calibrate`` as ``host_launch.inference.custom``); 0 where
    the database has no measurement or for a training step (its launches are fitted whole)."""
    measured = cost.library_launch_us("custom")
    return 0.0 if measured is None or training else max(measured - cost.launch_us("other"), 0.0)


# --- what each model-file rewrite is predicted to change ---------------------------------------

@dataclass(frozen=True)
class RewritePrediction:
    """A rewrite's predicted run time: the plan costed with the rewrite (``with_us``) and without it
    (``without_us``), every other rewrite as configured, in the configured execution mode."""

    name: str
    with_us: float
    without_us: float

    @property
    def gain(self) -> float:
        """The share of the run the rewrite is predicted to save (negative: it costs)."""
        return (self.without_us - self.with_us) / self.without_us if self.without_us > 0 else 0.0

    def to_json(self) -> dict:
        return {"with_us": round(self.with_us, 3), "without_us": round(self.without_us, 3),
                "gain": round(self.gain, 4)}


def with_and_without(ctx: GraphContext, plan: PrecisionPlan, option: str) -> RewritePrediction:
    """``plan_time`` of ``plan`` with ``option`` on and off (the rewrites costed: ``plan_for_fusion``)."""
    config = ctx.config
    totals = {}
    for on in (True, False):
        ctx.config = config.replace(**{option: on}).with_experimental(plan_for_fusion=True)
        try:
            totals[on] = plan_time(ctx, plan).total_us
        finally:
            ctx.config = config
    return RewritePrediction(option, totals[True], totals[False])


PREDICTIONS = {"channels_last": channels_last.predict, "fuse_reductions": reductions.predict,
               "fuse_elementwise": elementwise.predict}
