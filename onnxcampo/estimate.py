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
launches too), added where the database says so (``CostModel.host_adds``: fitted from whole runs,
where every launch cost 2.3-4.4 us on top of the replayed run), else the larger of the two.

With ``fuse_elementwise`` the plan is costed as the fused model runs (``plan_for_fusion``, the
default; ``False`` costs the fusion-blind plan as if neither fusion pass ran, though both still run
after it). :func:`elementwise_groups` predicts the ``FusedElementwise`` groups on the planning
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
3. a Cast at a group's edge costs the bytes it changes there (:func:`_group_cast_us`): the group
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
the fused kernel's fixed cost only (:func:`_summed_in_kernel`: the group's kernel adds them as it
stores, ``onnxcampo.rewrites.elementwise`` rule 4).

With ``channels_last`` (and ``plan_for_fusion``) an inference model's plan is costed with what
the layout pass does to it (:func:`layout_change`: the pass run on a copy of the planning graph; cuDNN's layout
transforms around float16 convolutions gone, the Transposes it inserts added, each NHWC
convolution call :data:`CONV_NHWC_HOST_US` of host time).

Each rewrite's prediction (:data:`PREDICTIONS`: :func:`predict_channels_last`,
:func:`predict_fuse_reductions`, :func:`predict_fuse_elementwise`) is the plan's total with it
and without it, the other rewrites as configured: what ``pipeline.decide_rewrites`` compares.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo import ir, oplists
from onnxcampo.casting import PrecisionOf, pinned_dtype, produced_dtype, tensor_casts, use_dtype
from onnxcampo.context import GraphContext
from onnxcampo.ir import TensorInfo
from onnxcampo.costdb.regression import H200_SMS
from onnxcampo.rewrites.elementwise import FUSABLE, MOVES, SUM
from onnxcampo.rewrites.layout import to_channels_last
from onnxcampo.ops import DOMAIN as ops_domain
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops.elementwise import MAX_INPUTS
from onnxcampo.rewrites.reductions import MOVES as REDUCTION_VIEWS
from onnxcampo.padding import pad_plan
from onnxcampo.plan import Precision, PrecisionPlan


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
    its share of the group's kernel (:func:`elementwise_groups`).
    """
    member = _fused_member(ctx, node)
    if member is not None:
        return member.time_us(ctx.cost.fused_kernel(), precision)
    if _summed_in_kernel(ctx, node):
        return ctx.cost.fused_kernel().fixed_us  # the partial sums' finishing launch
    chain = ctx.chains.get(node.name)
    if chain is not None and precision_of is not None:
        pattern, members = chain
        factor = ctx.cost.chain_factor(pattern, precision.value)
        if factor != 1.0 and all(precision_of(m) is precision for m in members if m != node.name):
            # a measured chain factor prices the chain as ORT ran it, fused or not: every member
            # its alone time times the factor (ORT's statuses decide the launches only)
            return _alone_time(ctx, node, precision) * factor
    if not _costs_time(ctx, node, precision_of):
        return 0.0
    return _alone_time(ctx, node, precision)


def _summed_in_kernel(ctx: GraphContext, node: gs.Node) -> bool:
    """Whether the node is a bias gradient's column sums that the fused kernel writing its input
    adds as it stores it (``onnxcampo.rewrites.elementwise`` rule 4; both fusions and
    ``fuse_column_sums`` costed): a ReduceSum over leading axes, or, channels-last, over axes
    other than the channels of a rank >= 3 tensor (the layout stores them last and merges
    simplify's pair over the spatial axes, then the batch, into one over the leading block), of a
    value a predicted fused group writes (directly or through views), where the kernel's grid
    sums them (``ops.elementwise.sum_grid`` on the H200's/H100's 132 multiprocessors: not BERT's
    ``[4096, 768]``, whose partials would be as large as the output). What is left of it is a
    small finishing launch over the partial sums."""
    elementwise, reductions = fusion_costed(ctx)
    if not (elementwise and reductions and ctx.config.experimental.fuse_column_sums):
        return False
    if node.op != "ReduceSum" or (node.domain or "") not in oplists.DEFAULT_DOMAINS or not node.inputs:
        return False
    shape = ctx.info.get(node.inputs[0].name)
    rank = len(shape.shape) if shape is not None and shape.shape is not None else 0
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        given = node.inputs[1]
        if not isinstance(given, gs.Constant) and ctx.is_constant(given):
            given = given.inputs[0].attrs["value"]  # a Constant node's value (a gs.Constant)
        axes = given.values.tolist() if isinstance(given, gs.Constant) else None
    if not rank or axes is None:
        return False
    axes = sorted({int(a) % rank for a in axes})
    leading = axes == list(range(len(axes))) and len(axes) < rank
    channels_last = bool(getattr(ctx.config, "channels_last", False)) and rank >= 3 and 1 not in axes
    if not (leading or channels_last):
        return False
    dims = shape.shape
    if not all(isinstance(d, int) for d in dims):
        return False
    columns = dims[1] if channels_last and not leading else math.prod(dims[len(axes):])
    if ew.sum_grid(math.prod(dims), columns, ew.JIT_BLOCKS_PER_SM * H200_SMS) is None:
        return False  # the kernel would sum no columns: BlockReduceSum reads the stored output
    producer = ctx.producer(node.inputs[0])  # the summed value's writer, past the views
    while producer is not None and producer.op in REDUCTION_VIEWS and (producer.domain or "") in oplists.DEFAULT_DOMAINS:
        producer = ctx.producer(producer.inputs[0])
    return producer is not None and producer.name in elementwise_groups(ctx)


def _aliased(node: gs.Node) -> bool:
    return node.op in oplists.ALIASED and (node.domain or "") in oplists.DEFAULT_DOMAINS


def _fusion_broken(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf | None) -> bool:
    """Whether the plan puts a Cast inside the fused group the node belongs to (ORT's fusions do
    not look through a Cast, and a group broken anywhere runs as its nodes; Casts on the group's
    edges leave it whole). Local decisions (no plan) take the fusion to hold."""
    if precision_of is None or _eliminated(ctx, node):
        return False
    group = _fusion_groups(ctx)[0].get(node.name)
    return group is not None and any(tensor_casts(ctx, t, precision_of) for t in group)


def _fusion_groups(ctx: GraphContext) -> tuple[dict[str, tuple[gs.Tensor, ...]], dict[str, frozenset[str]],
                                                dict[str, str]]:
    """node name -> the tensors inside its fused group, -> the op types of the group's nodes, and
    -> the group (one member's name): ORT's statuses joined through the outputs of absorbed nodes
    (gone from ORT's graph) into their consumers that ORT does not run as they are. Cached per
    status set (a training step swaps two)."""
    cache = ctx.__dict__.setdefault("_fusion_groups", {})
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
        if ctx.ort_status.get(node.name) != "absorbed" or _eliminated(ctx, node):
            continue
        find(node.name)
        for tensor in node.outputs:
            members = [c for c in tensor.outputs if c.name in ctx.ort_status and not _eliminated(ctx, c)]
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


def _eliminated(ctx: GraphContext, node: gs.Node) -> bool:
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
    if _aliased(node):
        return False
    if ctx.ort_status.get(node.name) == "absorbed":
        return _fusion_broken(ctx, node, precision_of)  # the group's node that ORT keeps launches it
    return True


def _costs_time(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf | None) -> bool:
    """An absorbed Tensor Core product still does its work inside the fused node; the element-wise
    ops absorbed with it, and those whose output the product now makes (``carried``), do not."""
    if _aliased(node):
        return False
    status = ctx.ort_status.get(node.name)
    if status == "absorbed" and _product(ctx, node) and not _eliminated(ctx, node):
        return True
    return status not in ("absorbed", "carried") or _fusion_broken(ctx, node, precision_of)


def host_launches(ctx: GraphContext, node: gs.Node, precision_of: PrecisionOf) -> tuple[int, int]:
    """(convolution launches, other launches) the node costs the host under the plan."""
    member = _fused_member(ctx, node)
    if member is not None:
        return 0, int(member.leader)  # the group's kernel: one launch, counted on its first member
    fp16_conv = node.op in oplists.NCHW_FP16_LAYOUT_OPS and precision_of(node.name) is Precision.FP16
    layout = oplists.NCHW_FP16_LAYOUT_LAUNCHES if fp16_conv else 0
    if not runs_alone(ctx, node, precision_of):
        return 0, layout
    convolution = node.op in oplists.NCHW_FP16_LAYOUT_OPS or (
        ctx.ort_status.get(node.name) in ("carried", "fused") and not _fusion_broken(ctx, node, precision_of)
        and _fusion_groups(ctx)[1].get(node.name, frozenset()) & oplists.NCHW_FP16_LAYOUT_OPS)
    return (1, layout) if convolution else (0, 1 + layout)


def _alone_time(ctx: GraphContext, node: gs.Node, precision: Precision) -> float:
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
    folding, reducing = fusion_costed(ctx)
    for tensor in tensors:
        casts = tensor_casts(ctx, tensor, precision_of)
        if not casts:
            continue
        if tensor.name in ctx.loss_scaling_gradients and _produced_fp16(ctx, tensor, precision_of):
            continue  # loss scaling's fused unscale reads the fp16 gradient itself: no Cast is made
        if reducing and _reduction_reads(ctx, tensor, precision_of):
            continue  # BlockReduceSum reads the tensor itself, in either type: no pass, no launch
        if reducing and _loss_gradient_written_fp16(ctx, tensor, precision_of):
            continue  # SoftmaxCrossEntropyGrad writes the float16 its readers want (loss fusion rule 5)
        edge = _group_cast_us(ctx, tensor, precision_of) if folding else None
        if edge is not None:
            total += edge  # inside a fused group: nothing; at its edge: the bytes it changes there
            continue
        if folding and _cast_folds(ctx, tensor):
            memory = ctx.cost.cast_time(ctx.numel(tensor)) - ctx.cost.cast_time(0)
            total += casts * FOLDED_CAST_SHARE * max(memory, 0.0)
            continue
        count += casts
        total += casts * ctx.cost.cast_time(ctx.numel(tensor))
    return total, count


def _produced_fp16(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    producer = ctx.producer(tensor)
    return producer is not None and precision_of(producer.name) is Precision.FP16


def fusion_costed(ctx: GraphContext) -> tuple[bool, bool]:
    """(``fuse_elementwise``, ``fuse_reductions``) as the plan is costed: both off for the
    fusion-blind plan (``plan_for_fusion=False``), whose passes still run after it."""
    config = ctx.config
    aware = config.experimental.plan_for_fusion
    return bool(config.fuse_elementwise and aware), bool(config.fuse_reductions and aware)


def layout_costed(ctx: GraphContext) -> bool:
    """Whether the plan is costed channels-last: ``channels_last`` on an inference model, unless
    ``plan_for_fusion=False`` asks for the plan as if no rewrite ran. A training step's plans are
    costed NCHW (its gradient convolutions' NHWC calls are not priced, and the Trainer replays the
    step, where their host time is not paid)."""
    config = ctx.config
    return bool(config.channels_last and config.experimental.plan_for_fusion
                and not ctx.training_fp32)


# --- the fused elementwise groups -------------------------------------------------------------

_BYTES = {Precision.FP16: 2, Precision.FP32: 4}


@dataclass(frozen=True)
class FusedMember:
    """A node of a predicted ``FusedElementwise`` group and its share of the group's kernel:
    the elements it reads from outside the group (an input read by k members: 1/k each), the
    elements of its outputs read outside the group (or graph outputs), and 1/``size`` of the
    kernel's fixed cost. Bytes are counted in the node's own precision; a Cast at the group's
    edge corrects them to the type actually read or written (:func:`_group_cast_us`)."""

    group: int
    size: int
    leader: bool
    read_elements: float
    written_elements: float

    def time_us(self, kernel, precision: Precision) -> float:
        moved = (self.read_elements + self.written_elements) * _BYTES[precision]
        return kernel.fixed_us / self.size + moved / kernel.bytes_per_us


def _fused_member(ctx: GraphContext, node: gs.Node) -> FusedMember | None:
    if not fusion_costed(ctx)[0]:
        return None
    return elementwise_groups(ctx).get(node.name)


def _fusable_node(ctx: GraphContext, node: gs.Node) -> tuple[int, ...] | None:
    """The node's output shape when ``--fuse-elementwise`` can fuse it (its rule 1) and ORT runs
    it as it is (a node ORT fuses or aliases keeps the costing of ORT's graph), else None."""
    if (node.domain or "") not in oplists.DEFAULT_DOMAINS or len(node.outputs) != 1 or node.name in ctx.ort_status:
        return None
    if node.op in FUSABLE:
        if len(node.inputs) != FUSABLE[node.op][1]:
            return None
    elif node.op == SUM:
        if not 1 <= len(node.inputs) <= MAX_INPUTS:
            return None
    elif node.op not in MOVES or (node.op == "Cast" and int(node.attrs.get("to", 0)) not in _FLOATS):
        return None
    out = ctx.info.get(node.outputs[0].name)
    if out is None or out.dtype not in _FLOATS or out.shape is None or not out.numel:
        return None
    for tensor in node.inputs:
        entry = ctx.info.get(tensor.name)
        if entry is None or entry.dtype not in _FLOATS or entry.shape is None:
            return None
    if not all(written_static(ctx, t.name) for t in (*node.inputs, node.outputs[0]) if t.name):
        return None  # the pass fuses static shapes of the written model only
    return tuple(out.shape)


_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def written_info(ctx: GraphContext) -> dict[str, TensorInfo]:
    """The tensor types and shapes of the model as written, which the model-file rewrites read:
    the planning graph's without the pins of ``input_shapes`` / ``dim_values`` (they size the
    costs; the written model keeps its dynamic inputs) where a graph input has a dynamic dim, else
    the planning table itself. The fusions and the layout pass act where these shapes are static."""
    base = getattr(ctx, "ctx", ctx)
    found = base.__dict__.get("_written_info")
    if found is None:
        dynamic = any(not vi.type.tensor_type.HasField("shape")
                      or not all(d.HasField("dim_value") and d.dim_value > 0 for d in vi.type.tensor_type.shape.dim)
                      for vi in ir.graph_inputs(base.model) if vi.type.HasField("tensor_type"))
        found = ir.infer_tensor_info(base.model, require_static=False)[0] if dynamic else base.info
        base.__dict__["_written_info"] = found
    return found


def written_static(ctx: GraphContext, name: str) -> bool:
    """Whether ``name`` has a static shape in the written model (:func:`written_info`)."""
    info = written_info(ctx)
    return info is getattr(ctx, "ctx", ctx).info or ir.static_shape(info, name) is not None


def elementwise_groups(ctx: GraphContext) -> dict[str, FusedMember]:
    """node name -> its :class:`FusedMember`, for the groups of two or more nodes that
    ``--fuse-elementwise`` is predicted to make of the planning graph (``onnxcampo.rewrites.elementwise``'s
    rule 2 without its kernel limits other than the input count, and without rule 2b: the Casts
    the plan adds are not in this graph; they are costed at the groups' edges instead). One pass in
    graph order with dependencies as bit sets; computed once per node list."""
    base = getattr(ctx, "ctx", ctx)  # a Planning reads through to its context: cache there
    cache = base.__dict__.setdefault("_elementwise_groups", {})
    key = (id(base.nodes), len(base.nodes))
    if key in cache:
        return cache[key]
    group_of: dict[str, int] = {}  # tensor -> group writing it
    depends: dict[str, int] = {}  # tensor -> bit set of the groups it depends on
    shapes: list[tuple[int, ...]] = []
    inputs: list[set[str]] = []
    members: list[list[gs.Node]] = []
    scalar = lambda t: ctx.numel(t) == 1 and ctx.is_constant(t)  # noqa: E731  (folded into the program)
    for node in ctx.nodes:
        names = [t.name for t in node.inputs if t.name]
        upstream = 0
        for name in names:
            upstream |= depends.get(name, 0)
        shape = _fusable_node(ctx, node)
        own = 0
        if shape is not None:
            chosen = None
            for tensor in node.inputs:
                g = group_of.get(tensor.name)
                if g is None or shapes[g] != shape:
                    continue
                others = [t for t in node.inputs if t.name and not scalar(t) and group_of.get(t.name) != g]
                if any(depends.get(t.name, 0) >> g & 1 for t in others):
                    continue  # a path from the group outside it reaches this node: a cycle
                if len(inputs[g] | {t.name for t in others}) > MAX_INPUTS:
                    continue
                chosen = g
                break
            if chosen is None:
                chosen = len(shapes)
                shapes.append(shape)
                inputs.append(set())
                members.append([])
            members[chosen].append(node)
            inputs[chosen].update(t.name for t in node.inputs
                                  if t.name and not scalar(t) and group_of.get(t.name) != chosen)
            group_of[node.outputs[0].name] = chosen
            own = 1 << chosen
        for tensor in node.outputs:
            depends[tensor.name] = upstream | own
    found: dict[str, FusedMember] = {}
    for g, nodes in enumerate(members):
        if len(nodes) < 2:
            continue
        names = {n.name for n in nodes}
        readers: dict[str, int] = {}
        for n in nodes:
            for name in {t.name for t in n.inputs if t.name and not scalar(t) and group_of.get(t.name) != g}:
                readers[name] = readers.get(name, 0) + 1
        for k, n in enumerate(nodes):
            own = {t.name: t for t in n.inputs if t.name in readers}
            read = sum(ctx.numel(t) / readers[name] for name, t in own.items())
            out = n.outputs[0]
            escapes = out.name in ctx.graph_outputs or any(c.name not in names for c in out.outputs)
            found[n.name] = FusedMember(g, len(nodes), k == 0, read, ctx.numel(out) if escapes else 0.0)
    cache[key] = found
    return found


def _group_cast_us(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> float | None:
    """What the Casts of ``tensor`` cost when a predicted fused group folds them, else None.

    1. The producer and every reader in one group: the value never leaves the registers; 0.
    2. The producer in a group: the kernel writes the tensor in each type needed (the members'
       share counted it in the producer's precision): a type the readers outside the group no
       longer read in the produced type replaces it (the byte difference), else it is written too.
    3. Every reader needing a Cast in groups: each such group reads the tensor in the type it is
       produced in instead of its members' (the byte difference, per group).
    """
    groups = elementwise_groups(ctx)
    producer = ctx.producer(tensor)
    uses = ctx.uses(tensor)
    if not uses:
        return None
    made = produced_dtype(ctx, tensor, precision_of) or ctx.original_dtype(tensor)
    size = {TensorProto.FLOAT16: 2, TensorProto.FLOAT: 4}
    if made not in size:
        return None
    rate = ctx.cost.fused_kernel().bytes_per_us
    numel = ctx.numel(tensor)
    home = groups.get(producer.name) if producer is not None else None
    if home is not None:
        outside = [u for u in uses if groups.get(u.node.name) is None or groups[u.node.name].group != home.group]
        pinned = pinned_dtype(ctx, tensor)
        needed = {use_dtype(ctx, tensor, u, precision_of) for u in outside} | {pinned}
        needed.discard(None)
        extra = [d for d in needed if d != made and d in size]
        if not extra:
            return 0.0  # only members read another type: in registers
        keeps = made in needed
        moved = sum(size[d] for d in extra) - (0 if keeps else size[made])
        return numel * moved / rate
    casting = [u for u in uses if use_dtype(ctx, tensor, u, precision_of) not in (None, made)]
    if not casting or any(u.node.name not in groups for u in casting):
        return None
    readers = {groups[u.node.name].group: use_dtype(ctx, tensor, u, precision_of) for u in casting}
    return sum(numel * (size[made] - size.get(d, size[made])) / rate for d in readers.values())


def _reduction_reads(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    """Whether every reader of ``tensor`` is an fp32 ReduceSum (``--fuse-reductions`` folds a Cast
    to fp32 in front of one into its BlockReduceSum; a Cast to fp16 rounds every element and stays),
    or the tensor is the logits of a cross-entropy loss: one fp32 LogSoftmax over the last axis
    reads it (``onnxcampo.rewrites.loss`` folds that Cast: SoftmaxCrossEntropy reads float16)."""
    readers = [use.node for use in ctx.uses(tensor)]
    if len(readers) == 1 and readers[0].op == "LogSoftmax" and (readers[0].domain or "") in oplists.DEFAULT_DOMAINS:
        last = len(tensor.shape or ()) - 1
        return precision_of(readers[0].name) is Precision.FP32 and readers[0].attrs.get("axis", -1) in (-1, last)
    return bool(readers) and all(n.op == "ReduceSum" and (n.domain or "") in oplists.DEFAULT_DOMAINS
                                 and precision_of(n.name) is Precision.FP32 for n in readers)


_VIEWS = ("Reshape", "Squeeze", "Unsqueeze", "Identity")  # the views loss fusion rule 5 follows


def _loss_gradient_written_fp16(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> bool:
    """Whether ``tensor`` is, through views, onnx-ad's cross-entropy gradient ``Sub(g, Mul(Exp(
    LogSoftmax(x)), t))`` and every node that reads it past the views runs fp16: loss fusion's rule
    5 then has ``SoftmaxCrossEntropyGrad`` write float16 and no Cast is made."""
    def default(node: gs.Node | None, *ops: str) -> bool:
        return node is not None and node.op in ops and (node.domain or "") in oplists.DEFAULT_DOMAINS

    def through_views(node: gs.Node | None) -> gs.Node | None:
        while default(node, *_VIEWS) and node.inputs:
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
            if default(use.node, *_VIEWS) and use.node.inputs and use.node.inputs[0] is value:
                pending.extend(use.node.outputs)
            else:
                readers.append(use.node)
    return bool(readers) and all(precision_of(n.name) is Precision.FP16 for n in readers)


def _cast_folds(ctx: GraphContext, tensor: gs.Tensor) -> bool:
    """Whether ``--fuse-elementwise`` would fold a Cast of ``tensor`` into a neighbour: its
    producer, or every reader, is an op it fuses (static shapes)."""
    def fusable(node: gs.Node | None) -> bool:
        return (node is not None and node.op in FUSABLE and (node.domain or "") in oplists.DEFAULT_DOMAINS
                and all(ctx.info.get(t.name) is not None and ctx.info[t.name].numel and written_static(ctx, t.name)
                        for t in node.outputs))

    if ctx.numel(tensor) == 0:
        return False
    readers = [use.node for use in ctx.uses(tensor)]
    return fusable(ctx.producer(tensor)) or (bool(readers) and all(fusable(n) for n in readers))


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
    conv_launches, other_launches = 0, casts + _pad_nodes(ctx, precision_of)
    fused_calls = 0  # FusedElementwise kernels: library calls, priced as such where measured
    for node in ctx.nodes:
        conv, other = host_launches(ctx, node, precision_of)
        conv_launches, other_launches = conv_launches + conv, other_launches + other
        member = _fused_member(ctx, node)
        fused_calls += int(member is not None and member.leader)
    training = bool(ctx.training_fp32)
    if ctx.loss_scaling is not None and any(precision_of(n.name) is Precision.FP16 for n in ctx.nodes):
        # a mixed training step gets dynamic loss scaling: its nodes, and a pass over the gradients
        # (a fused unscale reads fp16 gradients itself: casts_time counts no Cast for them)
        other_launches += ctx.loss_scaling.nodes
        # the gradient pass, plus the fixed cost of each further (small or scalar) kernel
        nodes_us += ctx.cost.cast_time(ctx.loss_scaling.elements) + (ctx.loss_scaling.nodes - 1) * ctx.cost.cast_time(0)
    layout = layout_change(ctx, precision_of)
    nodes_us += layout.gpu_us
    conv_launches += layout.conv_launches
    other_launches += layout.launches
    launched = conv_launches + other_launches + layout.nhwc_calls
    run = ctx.cost.run_us()
    if ctx.config.execution == "cuda-graph":
        # replayed: the launches were recorded once; what is left is the GPU's work and one replay
        return PlanTime(nodes_us + cast_us + run, nodes_us, cast_us, casts, 0.0, launched, run, "cuda-graph")
    # a training step's nodes cost the host more than single ops do (CostModel.launch_us)
    dispatch = (ctx.cost.launch_us("conv", training=training) * conv_launches
                + ctx.cost.launch_us("other", training=training) * other_launches
                + nhwc_call_us(ctx.cost) * layout.nhwc_calls
                + fused_call_extra_us(ctx.cost, training) * fused_calls)
    gpu = nodes_us + cast_us
    # launches that add to the GPU's work (fitted so from whole runs), or hide behind it
    total = gpu + dispatch if ctx.cost.host_adds(training=training) else max(gpu, dispatch)
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

# Host time of one ConvNhwc (or ConvNhwcDataGrad) call: the custom op calls cuDNN's legacy
# convolution API, which costs the host far more than ORT's own Conv launch. Measured on the H200
# (ResNet-50 b64 inference, FusedElementwise and channels-last): run plainly 6.42 ms, replayed as a
# CUDA graph 2.85 ms, the difference over its 53 convolutions about 60 us a call after the other
# launches (docs/benchmarks/raw/h200.jsonl; docs/ops.md has ~85 us for the same API).
CONV_NHWC_HOST_US = 60.0


def nhwc_call_us(cost) -> float:
    """Host time of one NHWC convolution call: the database's measurement (``costdb calibrate``),
    else :data:`CONV_NHWC_HOST_US`."""
    measured = cost.library_launch_us("conv_nhwc")
    return CONV_NHWC_HOST_US if measured is None else measured


def fused_call_extra_us(cost, training: bool = False) -> float:
    """What a FusedElementwise call costs the host beyond an ORT kernel's launch (the custom-op
    API's call, measured by ``costdb calibrate`` as ``host_launch.inference.custom``); 0 where
    the database has no measurement or for a training step (its launches are fitted whole)."""
    measured = cost.library_launch_us("custom")
    return 0.0 if measured is None or training else max(measured - cost.launch_us("other"), 0.0)


# At most this share of a float16 NCHW convolution's predicted time is taken to be cuDNN's layout
# transforms (the database's times are measured with them; the analytic model's are not).
LAYOUT_SHARE_MAX = 0.5
_LAYOUT_CONVS = {("Conv", ""), ("ConvTranspose", ""), ("ConvWeightGrad", ops_domain)}
_NHWC_CONVS = frozenset({"ConvNhwc", "ConvNhwcDataGrad", "ConvNhwcWeightGrad"})


@dataclass(frozen=True)
class LayoutChange:
    """What ``channels_last`` changes in a plan's predicted run, as :func:`layout_change` prices it:
    GPU time (``gpu_us``, negative where it saves), launches of ORT kernels (``launches``) and of
    convolutions (``conv_launches``), and the NHWC convolution calls that replace these
    (``nhwc_calls``, each :data:`CONV_NHWC_HOST_US` of host time). ``convolutions``: the
    convolutions converted, ``inserted``: the kernels the layout pass adds (Transposes, NchwToNhwc,
    Pads, bias Adds, ...)."""

    convolutions: int = 0
    inserted: int = 0
    gpu_us: float = 0.0
    launches: int = 0
    conv_launches: int = 0
    nhwc_calls: int = 0


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
    """What channels-last changes in the plan's run (nothing unless :func:`layout_costed`).

    The layout pass (``onnxcampo.rewrites.layout.to_channels_last``, its ``float16`` set to the plan's float16
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
    if not layout_costed(ctx):
        return LayoutChange()
    trial = _layout_trial(ctx, precision_of)
    if trial is None or not trial.converted:
        return LayoutChange()
    base = getattr(ctx, "ctx", ctx)
    by_name = {n.name: n for n in base.nodes}
    roots = _fusion_groups(ctx)[2]
    in_group: dict[str, list[str]] = {}
    for member, root in roots.items():
        in_group.setdefault(root, []).append(member)
    fused = fusion_costed(ctx)[0]
    cast = ctx.cost.cast_time
    gpu, launches, conv_launches, nhwc, convolutions = 0.0, 0, 0, 0, 0
    converted = set(trial.converted)
    for name in trial.converted:
        node = by_name[name]
        if node.op not in oplists.NCHW_FP16_LAYOUT_OPS:
            continue  # ConvWeightGrad: the library's cuDNN call either way
        convolutions += 1
        conv, other = host_launches(ctx, node, precision_of)
        conv_launches -= conv
        launches -= other
        nhwc += 1
        alone = _alone_time(ctx, node, Precision.FP16)
        transforms = cast(ctx.numel(node.inputs[0])) + cast(ctx.numel(node.outputs[0]))
        gpu += alone - min(transforms, LAYOUT_SHARE_MAX * alone) - node_time(ctx, node, Precision.FP16, precision_of)
        members = [by_name[m] for m in in_group.get(roots.get(name), ()) if m != name and m in by_name
                   and m not in converted and not _aliased(by_name[m]) and not _eliminated(ctx, by_name[m])]
        for member in members:
            conv, other = host_launches(ctx, member, precision_of)
            conv_launches -= conv
            if fused:
                launches += conv  # the epilogue's fused kernel launches where the fused Conv did
            else:
                launches += 1 - other
                precision = precision_of(member.name)
                gpu += _alone_time(ctx, member, precision) - node_time(ctx, member, precision, precision_of)
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
        gpu -= node_time(ctx, node, precision_of(node.name), precision_of)
        conv, other = host_launches(ctx, node, precision_of)
        conv_launches -= conv
        launches -= other
    inserted = sum(1 for name, op, _ in trial.inserted if op not in oplists.ALIASED)
    return LayoutChange(convolutions, inserted, gpu, launches, conv_launches, nhwc)


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


def predict_channels_last(ctx: GraphContext, plan: PrecisionPlan) -> RewritePrediction:
    """``channels_last``: the plan's total with the layout pass's changes (:func:`layout_change`)
    and without them."""
    return _with_and_without(ctx, plan, "channels_last")


def predict_fuse_reductions(ctx: GraphContext, plan: PrecisionPlan) -> RewritePrediction:
    """``fuse_reductions``: the plan's total with the Casts its BlockReduceSums read folded (a Cast
    to float32 read only by float32 ReduceSums, a cross-entropy's logits: :func:`casts_time`) and
    without. The reduction's own kernel is costed as the ReduceSum it replaces."""
    return _with_and_without(ctx, plan, "fuse_reductions")


def predict_fuse_elementwise(ctx: GraphContext, plan: PrecisionPlan) -> RewritePrediction:
    """``fuse_elementwise``: the plan's total with the predicted FusedElementwise groups (one
    kernel and launch each, the Casts inside and at their edges folded: :func:`elementwise_groups`)
    and without them."""
    return _with_and_without(ctx, plan, "fuse_elementwise")


def _with_and_without(ctx: GraphContext, plan: PrecisionPlan, option: str) -> RewritePrediction:
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


PREDICTIONS = {"channels_last": predict_channels_last, "fuse_reductions": predict_fuse_reductions,
               "fuse_elementwise": predict_fuse_elementwise}
