"""What every pass reads: the graph, its tensor table, node signatures, list membership, costs.

Built once after loading. The passes work on a :class:`Planning` over it (the context's tables
and the plan being made): analysis passes write only the plan; mutating passes change ``graph``
and keep ``dtypes`` (the current elem type of every tensor) in step.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo import ir
from onnxcampo import oplists, patterns
from onnxcampo.config import OptimizeConfig
from onnxcampo.costdb.features import OpFeatures, keyed, op_features
from onnxcampo.costdb.model import CostModel
from onnxcampo.ir import TensorInfo
from onnxcampo.oplists import Category
from onnxcampo.plan import PrecisionPlan
from onnxcampo.signature import Signature, Slot, signature

if TYPE_CHECKING:  # training imports this module's users; only the annotation needs it
    from onnxcampo.training.scaling import ScalingOverhead

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Use:
    """One consumer slot of a tensor."""

    node: gs.Node
    index: int
    slot: Slot


@dataclass
class GraphContext:
    model: onnx.ModelProto  # the input model (never modified)
    source: Path | None
    config: OptimizeConfig
    cost: CostModel
    graph: gs.Graph
    info: dict[str, TensorInfo]
    opset: int
    nodes: list[gs.Node] = field(default_factory=list)
    signatures: dict[str, Signature] = field(default_factory=dict)
    categories: dict[str, Category] = field(default_factory=dict)
    dtypes: dict[str, int] = field(default_factory=dict)
    features: dict[str, OpFeatures] = field(default_factory=dict)
    fp32_us: dict[str, float] = field(default_factory=dict)
    implicit_inputs: dict[str, set[str]] = field(default_factory=dict)
    subgraph_nodes: dict[str, list[str]] = field(default_factory=dict)
    graph_inputs: set[str] = field(default_factory=set)
    graph_outputs: set[str] = field(default_factory=set)
    implicit_names: set[str] = field(default_factory=set)
    original_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unresolved_dims: list[str] = field(default_factory=list)
    training_fp32: frozenset[str] = frozenset()  # loss and update nodes of a training step
    activation_max: dict[str, float] = field(default_factory=dict)  # calibration: tensor -> max |x|
    # a training step: what dynamic loss scaling adds to a plan with fp16 nodes (None: nothing),
    # and the names of its gradients_read_as_is (tensors of the graph)
    loss_scaling: ScalingOverhead | None = None
    loss_scaling_gradients: frozenset[str] = frozenset()
    # Chains ONNX Runtime may fuse: {node name: (pattern, member nodes)} (patterns.fusion_chains).
    chains: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    chain_nodes: dict[str, gs.Node] = field(default_factory=dict)
    # Nodes ONNX Runtime does not run as they are (``runtime.optimized.ExecutedGraph.node_status``:
    # "absorbed", "fused", "carried"); empty when ORT's graph was not read (``cost_graph="onnx"``).
    ort_status: dict[str, str] = field(default_factory=dict)
    ort_nodes: int | None = None  # nodes ORT runs of the fp32 graph
    # a training step: ORT's statuses without the loss scaling a mixed plan brings (None: the same)
    ort_status_fp32: dict[str, str] | None = None
    # nodes the mutating passes added: name -> {"op": ..., "why": ...} (the report's inserted_nodes,
    # the written nodes' doc_string)
    inserted: dict[str, dict[str, str]] = field(default_factory=dict)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        model: onnx.ModelProto,
        source: Path | None,
        config: OptimizeConfig,
        cost: CostModel,
        info: dict[str, TensorInfo],
        unresolved_dims: list[str],
    ) -> "GraphContext":
        graph = ir.to_graphsurgeon(model)
        ctx = cls(model, source, config, cost, graph, info, ir.default_opset(model))
        ctx.unresolved_dims = unresolved_dims
        ctx.dtypes = {name: entry.dtype for name, entry in info.items()}
        ctx.graph_inputs = {t.name for t in graph.inputs}
        ctx.graph_outputs = {t.name for t in graph.outputs}
        by_name = {n.name: n for n in model.graph.node}
        ctx.nodes = list(graph.nodes)
        for node in ctx.nodes:
            sig = signature(node.op, node.domain or "", ctx.opset, len(node.inputs), len(node.outputs))
            ctx.signatures[node.name] = sig
            ctx.categories[node.name] = ctx._category(node)
            ctx.original_inputs[node.name] = tuple(t.name for t in node.inputs)
            proto = by_name.get(node.name)
            if proto is not None and ir.has_subgraph(proto):
                ctx.implicit_inputs[node.name] = ir.outer_scope_names(proto)
                ctx.subgraph_nodes[node.name] = ir.subgraph_node_names(proto)
        ctx.implicit_names = set().union(*ctx.implicit_inputs.values()) if ctx.implicit_inputs else set()
        for name in patterns.tanh_gelu_powers(ctx) | patterns.gaussian_exps(ctx) | patterns.softmax_gradient_sums(ctx):
            ctx.categories[name] = Category.INFER  # see patterns.py: saturates, overflow-safe
        ctx.chains = patterns.fusion_chains(ctx)
        ctx.chain_nodes = {n.name: n for n in ctx.nodes if n.name in ctx.chains}
        ctx._compute_features()
        return ctx

    def _category(self, node: gs.Node) -> Category:
        category = oplists.category_of(node.op, node.domain or "")
        if node.op == oplists.CAST and int(node.attrs.get("to", 0)) in ir.FLOAT_TYPES:
            return Category.CLEAR  # its `to` can follow the plan like any data movement
        return category

    def _compute_features(self) -> None:
        for node in self.nodes:
            ins = [self.info.get(t.name) for t in node.inputs]
            outs = [self.info.get(t.name) for t in node.outputs]
            self.features[node.name] = keyed(op_features(
                node.op,
                [i.shape if i else None for i in ins],
                [o.shape if o else None for o in outs],
                node.attrs,
                float_inputs=[bool(i and i.is_float) for i in ins],
                float_outputs=[bool(o and o.is_float) for o in outs],
            ), node.domain or "")
            self.fp32_us[node.name] = self.cost.fp32_time(self.features[node.name])

    # --- tensors ------------------------------------------------------------------------
    def dtype(self, tensor: gs.Tensor) -> int:
        return self.dtypes.get(tensor.name, 0)

    def original_dtype(self, tensor: gs.Tensor) -> int:
        entry = self.info.get(tensor.name)
        return entry.dtype if entry else self.dtypes.get(tensor.name, 0)

    def is_float32(self, tensor: gs.Tensor) -> bool:
        return self.dtype(tensor) == TensorProto.FLOAT

    def is_float(self, tensor: gs.Tensor) -> bool:
        return self.dtype(tensor) in ir.FLOAT_TYPES

    def is_constant(self, tensor: gs.Tensor) -> bool:
        """Initializers and Constant-node outputs: converted offline, never cast at run time."""
        if isinstance(tensor, gs.Constant):
            return True
        # A Constant node given by value_float(s) has no tensor to convert: it is cast like any
        # other producer's output.
        return len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant" and "value" in tensor.inputs[0].attrs

    def numel(self, tensor: gs.Tensor) -> int:
        entry = self.info.get(tensor.name)
        return entry.numel or 0 if entry else 0

    def producer(self, tensor: gs.Tensor) -> gs.Node | None:
        return tensor.inputs[0] if tensor.inputs else None

    def uses(self, tensor: gs.Tensor) -> list[Use]:
        """The consumer slots reading ``tensor``, found in the graph as it is now."""
        found = []
        for consumer in tensor.outputs:
            sig = self.signatures.get(consumer.name)
            for index, inp in enumerate(consumer.inputs):
                if inp is tensor:
                    slot = sig.inputs[index] if sig and index < len(sig.inputs) else Slot.FIXED
                    found.append(Use(consumer, index, slot))
        return _unique_uses(found)

    def constant_sources(self, tensor: gs.Tensor, depth: int = 8) -> list[gs.Tensor]:
        """The constants a tensor is made of when it is a constant, or a constant moved around
        by data-movement ops only (a Reshape of a weight); empty otherwise."""
        if self.is_constant(tensor):
            return [tensor]
        producer = self.producer(tensor)
        if depth == 0 or producer is None or producer.op not in oplists.DATA_MOVEMENT:
            return []
        sources = []
        for source in self.follow_inputs(producer):
            found = self.constant_sources(source, depth - 1)
            if not found:
                return []
            sources.extend(found)
        return sources

    def constant_array(self, tensor: gs.Tensor) -> np.ndarray:
        """A constant's values without keeping a decoded copy in the graph (graphsurgeon caches
        what ``.values`` decodes, which would double the memory of a large model)."""
        source = tensor if isinstance(tensor, gs.Constant) else tensor.inputs[0].attrs["value"]
        raw = source._values
        return raw.load() if isinstance(raw, gs.ir.tensor.LazyValues) else np.asarray(raw)

    # --- nodes --------------------------------------------------------------------------
    def follow_inputs(self, node: gs.Node) -> list[gs.Tensor]:
        sig = self.signatures[node.name]
        return [t for t, s in zip(node.inputs, sig.inputs) if s is Slot.FOLLOW and self.is_float(t)]

    def follow_outputs(self, node: gs.Node) -> list[gs.Tensor]:
        sig = self.signatures[node.name]
        return [t for t, s in zip(node.outputs, sig.outputs) if s is Slot.FOLLOW and self.is_float(t)]

    def float_tensors(self, node: gs.Node) -> list[gs.Tensor]:
        return [t for t in (*node.inputs, *node.outputs) if self.is_float(t)]

    def upstream(self, node: gs.Node) -> list[gs.Node]:
        """Producers of the node's precision-following float inputs."""
        found = []
        for tensor in self.follow_inputs(node):
            producer = self.producer(tensor)
            if producer is not None and producer.op != "Constant":
                found.append(producer)
        return found

    def downstream(self, node: gs.Node) -> list[gs.Node]:
        """Consumers that read the node's following outputs through following slots."""
        found = []
        for tensor in self.follow_outputs(node):
            found.extend(use.node for use in self.uses(tensor) if use.slot is Slot.FOLLOW)
        return found

    def excluded_by_user(self, node: gs.Node) -> bool:
        return node.op in self.config.exclude_ops or any(
            re.search(p, node.name) for p in self.config.exclude_nodes
        )

    def included_by_user(self, node: gs.Node) -> bool:
        return node.op in self.config.include_ops or any(
            re.search(p, node.name) for p in self.config.include_nodes
        )


def _unique_uses(uses: list[Use]) -> list[Use]:
    seen = set()
    result = []
    for use in uses:
        key = (id(use.node), use.index)
        if key not in seen:
            seen.add(key)
            result.append(use)
    return result



class Planning:
    """What the passes work on: a context's tables, read and written through, and the one plan
    being made (``plan``) with how it is costed (``padding``: Tensor Core padding counted, for
    campo's plans). The context itself holds no plan: each policy's plan is made on a Planning
    of its own over the same context.

    ``analysis=True`` promises that the passes run on it leave the graph as it is (the pass
    manager's fingerprint check holds analysis passes to it): consumer lists are then looked up
    once per tensor. The mutating passes get a Planning without that promise."""

    _OWN = frozenset({"ctx", "plan", "padding", "_uses"})

    def __init__(self, ctx: GraphContext, plan: PrecisionPlan | None = None, *, padding: bool = False,
                 analysis: bool = False) -> None:
        object.__setattr__(self, "ctx", ctx)
        object.__setattr__(self, "plan", plan if plan is not None else PrecisionPlan())
        object.__setattr__(self, "padding", padding)
        object.__setattr__(self, "_uses", {} if analysis else None)

    @property
    def analysis(self) -> bool:
        return self._uses is not None

    def uses(self, tensor: gs.Tensor) -> list[Use]:
        if self._uses is None:
            return self.ctx.uses(tensor)
        found = self._uses.get(tensor.name)
        if found is None:
            found = self._uses[tensor.name] = self.ctx.uses(tensor)
        return found

    downstream = GraphContext.downstream  # the context's rule, reading consumers through uses() above

    def __getattr__(self, name: str):
        if name in Planning._OWN:  # not set yet (copy/pickle build the object without __init__)
            raise AttributeError(name)
        return getattr(self.ctx, name)  # every table and method of the context

    def __setattr__(self, name: str, value) -> None:
        if name in Planning._OWN:
            object.__setattr__(self, name, value)
        else:  # a mutating pass refreshing ctx.nodes, a rule filling a table: the context's
            setattr(self.ctx, name, value)


def written_info(ctx: GraphContext) -> dict[str, TensorInfo]:
    """The tensor types and shapes of the model as written, which the model-file rewrites read:
    the planning graph's without the pins of ``input_shapes`` / ``dim_values`` (they size the
    costs; the written model keeps its dynamic inputs) where a graph input has a dynamic dim, else
    the planning table itself. The fusions and the layout pass act where these shapes are static."""
    base = getattr(ctx, "ctx", ctx)
    found = base.__dict__.get("_written_info")
    if found is None:
        found = ir.infer_tensor_info(base.model, require_static=False)[0] if ir.dynamic_inputs(base.model) else base.info
        base.__dict__["_written_info"] = found
    return found


def written_static(ctx: GraphContext, name: str) -> bool:
    """Whether ``name`` has a static shape in the written model (:func:`written_info`)."""
    info = written_info(ctx)
    return info is getattr(ctx, "ctx", ctx).info or ir.static_shape(info, name) is not None
