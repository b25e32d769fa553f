"""``--fuse-elementwise``: chains of elementwise ops, with the Casts between and at their edges,
as one ``ai.onnxcampo::FusedElementwise`` node each (``onnxcampo/ops/elementwise/__init__.py``).

ONNX Runtime's CUDA provider launches one kernel per node, each reading its inputs from memory and
writing its output back; a Cast is one more such pass. A fused node reads the chain's inputs once,
keeps its intermediate values in registers and writes only what is read outside the chain, in the
type each reader expects: a Cast inside or at the edge of a chain costs no memory pass.

Runs on the written model, after the precision plan, its Casts and loss scaling (it sees the
model ORT will run; the plan's passes never see the custom op). Rules:

0. A float16 -> float32 Cast of a computed tensor read only by a Reshape whose readers are all
   fusable moves after the Reshape (``Cast(Reshape(x))``, the same values): it then joins its
   readers' group instead of making the group that computes ``x`` write a float32 copy of it (a
   float32 ReLU mask reading the float16 activation through onnx-ad's seed-axis Reshape).

1. A node can be fused when it is a default-domain op of :data:`FUSABLE`, a ``Sum`` or a Cast
   between float32 and float16, every input and output is float32 or float16 with a static shape, and a
   scalar constant input (an initializer or Constant of one element) is folded into the program.
   A comparison (:data:`COMPARES`: Greater, Less, GreaterOrEqual, LessOrEqual, Equal) of float
   inputs can be fused when only Casts to float32/float16 read its bool output (a ReLU's backward
   mask, ``Cast(Greater(x, 0)) * dy``), and so can those Casts: in the program the bool is 1.0 or
   0.0; it is never an output of the fused node (a group whose bool would be read outside it is
   not fused).
2. Nodes are visited in graph order; a node joins the group of a producer of one of its inputs
   when its output has that group's shape (the group's outputs all have the shape of the fused
   node's output; inputs may broadcast to it), when joining makes no cycle (no other input of the
   node depends on the group through a node outside it) and when the group stays within the
   kernel's limits (inputs, outputs, registers, instructions). Otherwise it starts a group.
   A group whose outputs only one other group reads joins that group whatever its shape (rule
   2b: a lone bias Cast, computed per element of the group's output; a ReLU's mask, its
   comparison and Cast, computed in the backward kernel of the gradient it gates). A node does not join a group when the
   fusable chain it starts reaches a node with another input that depends on that group (rule 2c:
   a backward node, such as the product of a gradient with a ReLU's mask computed from a forward
   value): the chain then starts a group of its own, which its backward reader joins, and the
   forward group writes the value the chain reads instead of the chain's result.
3. A group of two or more nodes becomes one node; its outputs are the member outputs read outside
   it or graph outputs, under their names and types. A lone node stays as it is.
4. A ``BlockReduceSum`` of column sums (``sizes [P, Q, 1]``, ``--fuse-reductions``) of an output of
   a node made here, read directly or through views (Reshape, Squeeze, Unsqueeze, Flatten,
   Identity), becomes that node's ``column_sums``: the node writes the sums as one more output
   (under the BlockReduceSum's output name, type and shape), its CUDA kernel adding the values as
   it stores them instead of a second kernel reading them back (a bias gradient: ResNet-50's
   conv biases, BERT's and GPT-2's Linear biases). One per node (the first in graph order); the
   views only the sum read go (``column_sums=False`` keeps the BlockReduceSums).

Before the groups are formed, a Conv's or Gemm's bias moves out of it when every reader of its
output can be fused (rule 1) and none is left to ORT: ``Conv(x, W, b)`` becomes ``Add(Conv(x, W),
Reshape(b, [C, 1, ...]))``, ``Gemm(a, B, c)`` (beta 1, c of [N]) ``Add(Gemm(a, B), c)``, also
through one Reshape that keeps the last axis (a torch Linear exported as ``addmm`` and ``view``),
and the Add joins its readers' group. ORT's CUDA Conv adds the bias in a pass of its own (cuDNN's
``cudnnAddTensor``, reading and writing the whole output: 2.5 of the 15.7 GPU ms of the ResNet-50
b64 training step), its Gemm broadcasts the bias into the output before the product reads it
back (``BroadcastBiasKernel``: 0.7 of GPT-2's 15.5); in the group the bias is one more input read
per element. A Conv's values do not change (cuDNN writes the convolution in the output's type
before it adds the bias, as the Add reads it); a Gemm's bias is added after the product is
rounded to its type, one rounding more (``split_biases=False`` keeps the biases in their nodes).

Last, the Casts left that turn a graph input from float32 into float16 (a training step's master
weights, cast for the fp16 compute every step) become one ``MultiTensorCast`` node, one launch
instead of one per weight (GPT-2's step: 124 Cast launches, 0.72 GPU ms for 0.74 GB;
``group_weight_casts=False`` keeps them). It is placed first: its inputs are graph inputs.

The values are those of the unfused graph up to the math library's last bits: a value the graph
holds in float16 is rounded to float16 where the graph rounds it (``ROUND_F16``).

The rules read the model through the shared matcher's view (``onnxcampo.rewrites.matcher``); the
bias split, rule 0 and rule 4 are patterns whose reason for leaving a node alone is logged at
debug level.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, numpy_helper

from onnxcampo import ir, oplists
from onnxcampo.casting import PrecisionOf, pinned_dtype, produced_dtype, use_dtype
from onnxcampo.context import GraphContext, written_static
from onnxcampo.costdb.regression import H200_SMS
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.ops.elementwise import Op
from onnxcampo.plan import Precision
from onnxcampo.rewrites import reductions
from onnxcampo.rewrites.matcher import VIEWS, GraphView, Miss, first_match  # VIEWS: what fuse_reductions folds

if TYPE_CHECKING:
    from onnxcampo.estimate import RewritePrediction

log = logging.getLogger(__name__)

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
# ONNX op -> (opcode, arity); Cast and Identity are handled apart (no arithmetic of their own)
FUSABLE: dict[str, tuple[Op, int]] = {
    "Add": (Op.ADD, 2), "Sub": (Op.SUB, 2), "Mul": (Op.MUL, 2), "Div": (Op.DIV, 2), "Pow": (Op.POW, 2),
    "Max": (Op.MAX, 2), "Min": (Op.MIN, 2),
    "Neg": (Op.NEG, 1), "Abs": (Op.ABS, 1), "Exp": (Op.EXP, 1), "Log": (Op.LOG, 1), "Sqrt": (Op.SQRT, 1),
    "Reciprocal": (Op.RECIP, 1), "Tanh": (Op.TANH, 1), "Erf": (Op.ERF, 1), "Sigmoid": (Op.SIGMOID, 1),
    "Relu": (Op.RELU, 1),
}
# comparisons of float inputs: a bool output, fused only into a group that also holds the Casts
# of it to float32/float16 (every reader of the bool is such a Cast: the bool never leaves the
# kernel; in the program it is 1.0 or 0.0, which the Cast keeps)
COMPARES: dict[str, Op] = {"Greater": Op.GREATER, "Less": Op.LESS, "GreaterOrEqual": Op.GREATER_EQUAL,
                           "LessOrEqual": Op.LESS_EQUAL, "Equal": Op.EQUAL}
MOVES = ("Cast", "Identity")
SUM = "Sum"  # variadic: a chain of additions, each rounded as the node's type is


@dataclass
class FusionResult:
    groups: int = 0  # fused nodes made
    nodes: int = 0  # nodes they replace
    by_size: Counter = field(default_factory=Counter)  # nodes per group -> groups
    biases: int = 0  # Conv and Gemm biases moved into the group reading the node
    weight_casts: int = 0  # Casts of graph inputs made one MultiTensorCast
    casts_moved: int = 0  # float16 -> float32 Casts moved after the Reshape that read them
    column_sums: int = 0  # BlockReduceSums made a fused node's column sums (rule 4)

    def to_json(self) -> dict:
        return {"fused_nodes": self.groups, "nodes_replaced": self.nodes,
                "group_sizes": {str(k): v for k, v in sorted(self.by_size.items())},
                "biases": self.biases, "weight_casts": self.weight_casts, "column_sums": self.column_sums}


@dataclass
class _Group:
    index: int
    shape: tuple[int, ...]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    outputs: set[str] = field(default_factory=set)  # tensors the members write
    inputs: dict[str, None] = field(default_factory=dict)  # external tensors read (ordered)
    constants: dict[str, float] = field(default_factory=dict)  # scalar constants folded in
    instructions: int = 0  # at most what the members' program takes (see _instructions)


@dataclass
class _Grouping:
    """The groups rule 2 forms in one pass over the graph, and what it tracks as it goes."""

    groups: list[_Group] = field(default_factory=list)
    group_of: dict[str, _Group] = field(default_factory=dict)  # tensor -> group that writes it
    depends: dict[str, frozenset[int]] = field(default_factory=dict)  # tensor -> groups it depends on


class _FusionView(GraphView):
    """The matcher's view with what the grouping reads besides: the scalar constants a program
    folds in (:func:`_scalar_constants`) and ``leave``, the names of the nodes left to ORT."""

    def __init__(self, model: onnx.ModelProto, info: dict[str, ir.TensorInfo], leave: Collection[str]) -> None:
        super().__init__(model, info, fresh_prefix="fused")
        self.leave = frozenset(leave)
        self.scalars = _scalar_constants(self.constants)

    def mask(self, name: str) -> tuple[int, ...] | None:
        """The shape of a comparison's bool output that only Casts to float32/float16 read."""
        readers = self.readers(name)
        if name in self.protected or not readers or any(
                not self.is_op(r, "Cast") or ir.attribute(r, "to") not in FLOATS for r in readers):
            return None
        return self.static(name, (TensorProto.BOOL,))

    def fusable(self, node: onnx.NodeProto) -> tuple[int, ...] | None:
        """The node's output shape when rule 1 lets it be fused and it is not left to ORT."""
        return None if node.name in self.leave else _fusable_shape(self, node)

    def fusable_readers(self, name: str) -> bool:
        """``name`` is read, not protected, and every reader can be fused."""
        readers = self.readers(name)
        return bool(readers) and name not in self.protected and all(self.fusable(r) is not None for r in readers)


def fuse_elementwise(model: onnx.ModelProto, *, leave: Collection[str] = (),
                     split_biases: bool = True, group_weight_casts: bool = True, column_sums: bool = True,
                     info: dict[str, ir.TensorInfo] | None = None) -> FusionResult:
    """Replace the elementwise chains of ``model`` (in place) by ``FusedElementwise`` nodes.
    ``leave``: names of nodes not to fuse (the pipeline's: those ONNX Runtime fuses into kernels of
    its own, such as a MatMul's scale Mul, a Softmax's mask Add or a LayerNormalization's skip Add;
    taking them would undo ORT's fusion and cost a kernel more). ``split_biases``: move a Conv's or
    Gemm's bias into the group that reads its output; ``group_weight_casts``: the float32 ->
    float16 Casts of graph inputs as one MultiTensorCast; ``column_sums``: a BlockReduceSum of a
    fused node's output as that node's column sums (rule 4; the module docstring). ``info``: the
    model's tensor types and shapes when the caller has them (the pipeline's, from
    ``--fuse-reductions``), else inferred here."""
    result = FusionResult()
    if info is None:
        info, _ = ir.infer_tensor_info(model)
    view = _FusionView(model, info, leave)
    if split_biases:
        result.biases = _split_biases(view)
    if result.biases:
        view.refresh()
    result.casts_moved = _widening_casts_after_reshapes(view)
    if result.casts_moved:
        view.refresh()

    grouping = _form_groups(view)
    for group in grouping.groups:
        _absorb_producers(view, grouping, group)
    fused = [g for g in grouping.groups if len(g.nodes) >= 2]
    replaced: list[tuple[_Group, onnx.NodeProto]] = []
    for group in fused:
        built = _build(view, group)
        if built is not None:
            replaced.append((group, built))
    if replaced:
        _replace(view, replaced, result)
        if column_sums:
            view.refresh()
            result.column_sums = _fuse_column_sums(view, {node.name for _, node in replaced})
    if group_weight_casts:
        result.weight_casts = _group_weight_casts(view)
    log.info("fuse-elementwise: %d chains of %d nodes as FusedElementwise (%d with column sums), %d weight Casts "
             "as one", result.groups, result.nodes, result.column_sums, result.weight_casts)
    return result


def _form_groups(view: _FusionView) -> _Grouping:
    """Rules 1, 2 and 2c: each node in graph order joins a producer's group or starts one."""
    grouping = _Grouping()
    for node in view.model.graph.node:
        upstream = frozenset().union(*(grouping.depends.get(name, frozenset()) for name in node.input if name))
        shape = view.fusable(node)
        group = None
        if shape is not None:
            group = _join(view, grouping, node, shape)
            bool_cast = node.op_type == "Cast" and view.dtype(node.input[0]) == TensorProto.BOOL
            if group is not None and not bool_cast and _leads_back(view, grouping, node, group):
                group = None  # rule 2c: the chain it heads belongs with the backward node that reads it
            if group is None and bool_cast:
                shape = None  # a mask's Cast only in its comparison's group (no bool input to a kernel)
            elif group is None:
                group = _Group(len(grouping.groups), shape)
                grouping.groups.append(group)
        if group is not None:
            _add(view, group, node)
            for out in node.output:
                grouping.group_of[out] = group
        own = frozenset((group.index,)) if group is not None else frozenset()
        for out in node.output:
            grouping.depends[out] = upstream | own
    return grouping


def _replace(view: _FusionView, replaced: list[tuple[_Group, onnx.NodeProto]], result: FusionResult) -> None:
    """Each group's members out, its fused node in (rule 3); the graph in topological order."""
    model = view.model
    members = {id(n) for group, _ in replaced for n in group.nodes}
    kept = [n for n in model.graph.node if id(n) not in members]
    del model.graph.node[:]
    model.graph.node.extend(kept + [node for _, node in replaced])
    ir.toposort_model(model)
    written = {o for group, node in replaced for o in node.output}
    gone = {o for group, _ in replaced for n in group.nodes for o in n.output} - written
    kept_info = [v for v in model.graph.value_info if v.name not in gone]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept_info)
    # the scalar constants the programs folded in: no node reads them any more
    declared = {i.name for i in model.graph.input}
    view.edit.drop_unread({i for group, _ in replaced for n in group.nodes for i in n.input if i and i not in declared})
    op_nodes.import_domain(model)
    for group, _ in replaced:
        result.groups += 1
        result.nodes += len(group.nodes)
        result.by_size[len(group.nodes)] += 1


def _fuse_column_sums(view: _FusionView, fused: set[str]) -> int:
    """Rule 4: BlockReduceSums of column sums of the outputs of the nodes named ``fused`` as those
    nodes' ``column_sums``; returns how many."""
    model = view.model
    where = {out: (node, k) for node in model.graph.node if node.op_type == ew.OP_TYPE and node.name in fused
             for k, out in enumerate(node.output)}
    summed: set[int] = set()  # fused nodes given their column sums
    gone: list[onnx.NodeProto] = []
    sums_info: list[onnx.ValueInfoProto] = []  # the sums' types and shapes, now the fused nodes' outputs

    def summed_output(view: _FusionView, node: onnx.NodeProto) -> tuple[str, list[onnx.NodeProto]] | Miss:
        """The pattern at the BlockReduceSum ``node``: the fused node's output it sums of columns
        and the views between, nearest the sum first."""
        _, _, R = (int(v) for v in ir.attribute(node, "sizes"))
        name, views = node.input[0], []
        while name not in where:
            step = view.producers.get(name)
            if step is None or step.op_type not in VIEWS or step.domain not in oplists.DEFAULT_DOMAINS:
                break
            views.append(step)
            name = step.input[0]
        if R != 1:
            return Miss("not a sum of columns")
        return (name, views) if name in where else Miss("not of a fused node's output")

    for node in model.graph.node:
        if node.op_type != "BlockReduceSum" or node.domain != op_nodes.DOMAIN:
            continue
        found = first_match([summed_output], view, node, "fuse-elementwise (column sums)")
        if found is None or id(where[found[0]][0]) in summed:
            continue
        name, views = found
        _, Q, _ = (int(v) for v in ir.attribute(node, "sizes"))
        target, k = where[name]
        sum_type, shape = int(ir.attribute(node, "output_type", TensorProto.FLOAT)), ir.attribute(node, "output_shape")
        attributes = {"column_sums": [k, Q], "column_sums_type": sum_type}
        if shape is not None:
            attributes["column_sums_shape"] = [int(d) for d in shape]
        target.attribute.extend(onnx.helper.make_attribute(key, value) for key, value in attributes.items())
        target.output.append(node.output[0])
        sums_info.append(onnx.helper.make_tensor_value_info(node.output[0], sum_type, list(shape or [Q])))
        summed.add(id(target))
        gone.append(node)
        reading = {id(node)}
        for step in views:  # nearest the sum first: a view goes when only what goes read it
            if step.output[0] in view.protected or any(id(r) not in reading for r in view.readers(step.output[0])):
                break
            reading.add(id(step))
            gone.append(step)
    if gone:  # the fused nodes come before the sums they take: the order holds
        view.edit.replace_nodes({}, {id(n) for n in gone}, sums_info)
    return len(summed)


def _group_weight_casts(view: _FusionView) -> int:
    """The float32 -> float16 Casts of graph inputs as one MultiTensorCast, first in the graph;
    returns how many it took (none when fewer than two)."""
    model = view.model
    inputs = {i.name for i in model.graph.input} - {t.name for t in model.graph.initializer}
    casts = [n for n in model.graph.node
             if view.is_op(n, "Cast") and n.name not in view.leave
             and len(n.input) == 1 and n.input[0] in inputs and ir.attribute(n, "to") == TensorProto.FLOAT16
             and view.dtype(n.input[0]) == TensorProto.FLOAT]
    if len(casts) < 2:
        return 0
    taken = {id(n) for n in casts}
    node = op_nodes.multi_tensor_cast([n.input[0] for n in casts], [n.output[0] for n in casts],
                                      name=view.edit.fresh("weight_casts"))
    kept = [n for n in model.graph.node if id(n) not in taken]
    del model.graph.node[:]
    model.graph.node.extend([node, *kept])
    op_nodes.import_domain(model)
    return len(casts)


@dataclass
class _Bias:
    """A Conv's or Gemm's bias to move out: ``anchor`` writes ``out`` (the node, or the one
    Reshape after a Gemm), which the Add will write instead; ``shape``: the node's output's."""

    node: onnx.NodeProto
    anchor: onnx.NodeProto
    out: str
    shape: tuple[int, ...]


def _bias(view: _FusionView, node: onnx.NodeProto) -> _Bias | Miss | None:
    """The pattern of the bias split at ``node`` (None when it is no Conv or Gemm with a bias)."""
    if node.op_type not in ("Conv", "Gemm") or node.domain not in oplists.DEFAULT_DOMAINS \
            or len(node.input) != 3 or not node.input[2] or len(node.output) != 1:
        return None
    out = node.output[0]
    shape, bias = view.static(out, FLOATS), view.static(node.input[2], FLOATS)
    if shape is None or bias is None:
        return Miss("the output or the bias is not a float tensor of a static shape")
    if node.op_type == "Conv":
        if len(shape) < 3 or bias != (shape[1],):
            return Miss("the bias is not one per channel")
        if not view.fusable_readers(out):
            return Miss("a reader of the output cannot be fused")
        return _Bias(node, node, out, shape)
    if ir.attribute(node, "beta", 1.0) != 1.0 or len(shape) != 2 or bias != (shape[1],):
        return Miss("beta is not 1 or the bias is not one per column")
    if view.fusable_readers(out):
        return _Bias(node, node, out, shape)
    reshape = view.sole_reader(out)
    if not view.is_op(reshape, "Reshape") or (view.static(reshape.output[0], FLOATS) or (None,))[-1] != shape[1] \
            or not view.fusable_readers(reshape.output[0]):
        return Miss("a reader of the output cannot be fused, nor is it one Reshape keeping the columns "
                    "that only fusable nodes read")
    return _Bias(node, reshape, reshape.output[0], shape)


def _move_bias(view: _FusionView, found: _Bias) -> list[onnx.NodeProto]:
    """The bias of ``found`` out of its node, into an Add (after a Reshape of a Conv's bias to
    ``[C, 1, ...]``); the new tensors go into ``view.info``. Returns the nodes to place after the
    anchor."""
    node, shape, out, info = found.node, found.shape, found.out, view.info
    bias_input, adds = node.input[2], []
    if node.op_type == "Conv":
        target, reshaped = view.edit.fresh("conv_bias_shape"), view.edit.fresh("conv_bias")
        view.model.graph.initializer.append(
            numpy_helper.from_array(np.array([shape[1]] + [1] * (len(shape) - 2), np.int64), target))
        reshape = onnx.helper.make_node("Reshape", [bias_input, target], [reshaped],
                                        name=view.edit.fresh("conv_bias_reshape"))
        info[target] = ir.TensorInfo(TensorProto.INT64, (len(shape) - 1,))
        info[reshaped] = ir.TensorInfo(view.dtype(bias_input), (shape[1],) + (1,) * (len(shape) - 2))
        bias_input, adds = reshaped, [reshape]
    raw = view.edit.fresh(f"{node.op_type.lower()}_raw")
    info[raw] = info[out]  # the Add's first input: the output without the bias, same type and shape
    del node.input[2]
    found.anchor.output[0] = raw
    adds.append(onnx.helper.make_node("Add", [raw, bias_input], [out],
                                      name=view.edit.fresh(f"{node.op_type.lower()}_bias_add")))
    return adds


def _split_biases(view: _FusionView) -> int:
    """Moves biases out of Conv and Gemm nodes whose output only fusable nodes read: ``Conv(x, W,
    b) -> y`` becomes ``Conv(x, W) -> y0; Add(y0, Reshape(b, [C, 1, ...])) -> y``, ``Gemm(a, B, c)
    -> y`` (beta 1, c of [N]) ``Gemm(a, B) -> y0; Add(y0, c) -> y``, also when one Reshape that
    keeps the last axis stands between the Gemm and the fusable readers (a torch Linear's
    ``addmm`` and ``view``). The tensors it makes go into ``info`` (no second shape inference).
    Returns how many nodes changed."""
    model = view.model
    after: dict[int, list[onnx.NodeProto]] = {}  # id of a node -> the nodes to place after it
    changed = 0
    for node in model.graph.node:
        found = first_match([_bias], view, node, "fuse-elementwise (biases)")
        if found is None:
            continue
        after.setdefault(id(found.anchor), []).extend(_move_bias(view, found))
        changed += 1
    if changed:
        nodes = [n for node in model.graph.node for n in (node, *after.get(id(node), ()))]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return changed


def _widening_cast(view: _FusionView, cast: onnx.NodeProto) -> onnx.NodeProto | Miss | None:
    """Rule 0's pattern at ``cast``: the Reshape it moves after (None when it is no float16 ->
    float32 Cast of a computed tensor)."""
    if not view.is_op(cast, "Cast") or cast.name in view.leave:
        return None
    x, mid = cast.input[0], cast.output[0]
    if x not in view.producers or view.dtype(x) != TensorProto.FLOAT16 or ir.attribute(cast, "to") != TensorProto.FLOAT:
        return None
    reshape = view.sole_reader(mid)
    if not view.is_op(reshape, "Reshape") or reshape.input[0] != mid:
        return Miss("the Cast is not read by a Reshape alone")
    out = reshape.output[0]
    if len(reshape.input) < 2 or reshape.input[1] not in view.constants or out in view.protected \
            or view.info.get(out) is None:
        return Miss("the Reshape's shape is not constant, or its output is protected or of no known type")
    fusable = set(FUSABLE) | set(COMPARES) | set(MOVES) | {SUM}
    readers = view.readers(out)
    if not readers or any(r.op_type not in fusable or r.domain not in oplists.DEFAULT_DOMAINS for r in readers):
        return Miss("a reader of the Reshape is not an op the rewrite fuses")
    return reshape


def _widening_casts_after_reshapes(view: _FusionView) -> int:
    """Rule 0: ``Reshape(Cast(x, to=float))`` of a float16 ``x`` that a node computes, the Cast read
    by the Reshape alone and the Reshape's readers all fusable, becomes ``Cast(Reshape(x))``: the
    same values. The Cast then joins the group of its readers (a float32 ReLU mask's comparison
    reading a Reshape of the float16 activation: simplify's rule 9b) instead of the group that
    computes ``x``, which would write a float32 copy of ``x`` for the backward to read back."""
    model = view.model
    moved = 0
    for cast in list(model.graph.node):
        reshape = first_match([_widening_cast], view, cast, "fuse-elementwise (rule 0)")
        if reshape is None:
            continue
        x, mid, out = cast.input[0], cast.output[0], reshape.output[0]
        made_reshape, made_cast = onnx.NodeProto(), onnx.NodeProto()
        made_reshape.CopyFrom(reshape)
        made_reshape.input[0] = x
        made_reshape.output[0] = mid
        made_cast.CopyFrom(cast)
        made_cast.input[0] = mid
        made_cast.output[0] = out
        cast.CopyFrom(made_reshape)  # the Cast's place (x is computed before it) now reshapes
        reshape.CopyFrom(made_cast)
        view.info[mid] = ir.TensorInfo(TensorProto.FLOAT16, view.info[out].shape)
        kept = [v for v in model.graph.value_info if v.name != mid]
        if len(kept) != len(model.graph.value_info):
            del model.graph.value_info[:]
            model.graph.value_info.extend(kept)
        moved += 1
    return moved


def _scalar_constants(constants: Mapping[str, onnx.TensorProto]) -> dict[str, float]:
    """Float constants of one element (initializers and Constant nodes), by name."""
    found = {}
    for name, tensor in constants.items():
        if tensor.data_type in FLOATS and math.prod(tensor.dims) == 1:
            found[name] = float(numpy_helper.to_array(tensor).reshape(-1)[0])
    return found


def _takes(op: str, inputs: int) -> bool | None:
    """Whether rule 1 takes an ``op`` node of this many inputs: a kernel op with its arity, a Sum
    of 1 to ``MAX_INPUTS``; None for the ops that only move a value (the caller's rule)."""
    if op in FUSABLE:
        return inputs == FUSABLE[op][1]
    if op == SUM:
        return 1 <= inputs <= ew.MAX_INPUTS
    return None


def _fusable_shape(view: _FusionView, node: onnx.NodeProto) -> tuple[int, ...] | None:
    """The node's output shape when rule 1 lets it be fused, else None."""
    if node.domain not in oplists.DEFAULT_DOMAINS or len(node.output) != 1:
        return None
    scalars = view.scalars
    if node.op_type in COMPARES:  # float inputs, a bool output only float Casts read
        if len(node.input) != 2 or any(not name or (name not in scalars and view.static(name, FLOATS) is None)
                                       for name in node.input):
            return None
        return view.mask(node.output[0])
    if node.op_type == "Cast" and len(node.input) == 1 and view.mask(node.input[0]) is not None \
            and ir.attribute(node, "to") in FLOATS:
        return view.static(node.output[0], FLOATS)  # a comparison's mask as 1.0 / 0.0
    takes = _takes(node.op_type, len(node.input))
    if takes is None:  # a value moved: Identity, or a Cast between the float types
        takes = node.op_type == "Identity" or (node.op_type == "Cast" and ir.attribute(node, "to") in FLOATS)
    if not takes:
        return None
    shape = view.static(node.output[0], FLOATS)
    if shape is None or any(not name or (name not in scalars and view.static(name, FLOATS) is None)
                            for name in node.input):
        return None
    return shape


def _join(view: _FusionView, grouping: _Grouping, node: onnx.NodeProto, shape: tuple[int, ...]) -> _Group | None:
    """The producer group ``node`` may join (rule 2), or None."""
    group_of, depends = grouping.group_of, grouping.depends
    for name in node.input:
        group = group_of.get(name)
        if group is None or group.shape != shape:
            continue
        others = [n for n in node.input if n and n not in view.scalars and group_of.get(n) is not group]
        if any(group.index in depends.get(n, frozenset()) for n in others):
            continue  # an outside path from the group reaches this node: fusing would make a cycle
        extra_inputs = {n for n in others if n not in group.inputs}
        if len(group.inputs) + len(extra_inputs) > ew.MAX_INPUTS \
                or group.instructions + _instructions(node) > ew.MAX_INSTRUCTIONS:
            continue
        return group
    return None


def _leads_back(view: _FusionView, grouping: _Grouping, node: onnx.NodeProto, group: _Group,
                limit: int = 8) -> bool:
    """Rule 2c: whether a fusable chain that ``node`` starts (its fusable readers, theirs, up to
    ``limit`` nodes) reaches a node with another input that depends on ``group`` through a node
    outside it: a backward node
    that reads what ``node`` computes from a forward value (a ReLU's mask and the gradient it
    gates). Joining would make ``group`` write the chain's result for that reader, which cannot
    join it (a cycle); not joining lets the chain and its reader form one group that reads the
    forward value instead."""
    chain = {id(node)}
    produced = set(node.output)
    frontier = list(node.output)
    while frontier and len(chain) <= limit:
        name = frontier.pop()
        for reader in view.readers(name):
            if id(reader) in chain or view.fusable(reader) is None:
                continue
            if any(i and i not in produced and i not in view.scalars and grouping.group_of.get(i) is not group
                   and group.index in grouping.depends.get(i, ()) for i in reader.input):
                return True
            chain.add(id(reader))
            produced.update(reader.output)
            frontier.extend(reader.output)
    return False


def _absorbable(view: _FusionView, grouping: _Grouping, group: _Group, name: str) -> _Group | None:
    """Rule 2b's test for the group writing the input ``name`` of ``group``: it joins when only
    ``group`` reads its outputs, it reads nothing ``group`` computes, and the kernel's limits hold."""
    owner = grouping.group_of.get(name)
    if view.producers.get(name) is None or owner is None or owner is group or not owner.nodes:
        return None
    members, owned = {id(n) for n in group.nodes}, {id(n) for n in owner.nodes}
    if any(out in view.protected or any(id(c) not in members and id(c) not in owned for c in view.readers(out))
           for out in owner.outputs):
        return None
    if any(i in group.outputs or group.index in grouping.depends.get(i, ()) for i in owner.inputs):
        return None  # the owner reads what the group computes: joining would make a cycle
    taken = [out for out in owner.outputs if out in group.inputs]
    extra = [i for i in owner.inputs if i not in group.inputs]
    if len(group.inputs) - len(taken) + len(extra) > ew.MAX_INPUTS \
            or group.instructions + owner.instructions > ew.MAX_INSTRUCTIONS:
        return None
    return owner


def _absorb_producers(view: _FusionView, grouping: _Grouping, group: _Group) -> None:
    """Rule 2b: a group whose outputs only this group reads joins it, whatever its (smaller,
    broadcast) shape: a lone bias Cast computed per element instead of in a launch of its own, a
    ReLU's mask (its comparison and Cast, on the forward value) computed where the gradient it
    gates is, instead of written and read back. Its inputs then are the group's, and its own
    producers may follow."""
    if not group.nodes:
        return
    changed = True
    while changed:
        changed = False
        for name in list(group.inputs):
            owner = _absorbable(view, grouping, group, name)
            if owner is None:
                continue
            for out in [out for out in owner.outputs if out in group.inputs]:
                del group.inputs[out]
            group.nodes[:0] = owner.nodes  # their inputs are all from outside the group: first is in order
            group.instructions += owner.instructions
            group.inputs.update(dict.fromkeys(owner.inputs))
            group.constants.update(owner.constants)
            group.outputs.update(owner.outputs)
            for out in owner.outputs:
                grouping.group_of[out] = group
            owner.nodes.clear()
            owner.inputs.clear()
            owner.outputs.clear()
            owner.instructions = 0
            changed = True
            break


def _instructions(node: onnx.NodeProto) -> int:
    """At most what a member adds to the program: a load per input, an operation and a rounding
    per input (a Sum's additions), a store."""
    return 3 * len(node.input) + 2


def _add(view: _FusionView, group: _Group, node: onnx.NodeProto) -> None:
    group.nodes.append(node)
    group.instructions += _instructions(node)
    for name in node.input:
        if name in group.outputs:
            continue
        if name in view.scalars:
            group.constants[name] = view.scalars[name]
        else:
            group.inputs[name] = None
    group.outputs.update(node.output)


def _build(view: _FusionView, group: _Group) -> onnx.NodeProto | None:
    """The FusedElementwise node of ``group`` (rule 3), or None when it exceeds the kernel's limits."""
    members = {id(n) for n in group.nodes}
    escaping = [out for n in group.nodes for out in n.output
                if out in view.protected or any(id(c) not in members for c in view.readers(out))]
    if not escaping or len(escaping) > ew.MAX_OUTPUTS:
        return None
    inputs = list(group.inputs)
    if any(view.dtype(name) not in FLOATS for name in inputs):
        return None  # a comparison's mask read from outside the group: the kernel reads floats only
    constants = list(dict.fromkeys(group.constants.values()))
    program: list[int] = []
    register: dict[str, int] = {}  # tensor -> register holding its value
    last_read = {}  # tensor -> index of the last member reading it
    for k, node in enumerate(group.nodes):
        for name in node.input:
            last_read[name] = k
    free: list[int] = []
    used = 0

    def allocate() -> int:
        nonlocal used
        if free:
            return free.pop()
        used += 1
        return used - 1

    def value(name: str) -> int:
        if name in register:
            return register[name]
        reg = register[name] = allocate()
        if name in group.constants:
            program.extend((Op.CONST, reg, constants.index(group.constants[name]), 0))
        else:
            program.extend((Op.LOAD, reg, inputs.index(name), 0))
        return reg

    stored = {name: i for i, name in enumerate(escaping)}
    for k, node in enumerate(group.nodes):
        args = [value(name) for name in node.input]
        # a Sum's additions read its terms after the first write: its register is none of theirs
        dst = allocate() if node.op_type == SUM else None
        for name in dict.fromkeys(node.input):  # registers whose value no later member reads
            if last_read.get(name) == k and name in register:
                free.append(register.pop(name))
        out = node.output[0]
        if dst is None:
            dst = allocate()  # may be an argument's register: one instruction reads before it writes
        half = view.dtype(out) == TensorProto.FLOAT16
        if node.op_type in COMPARES:  # 1.0 / 0.0: the bool the Casts after it read
            program.extend((COMPARES[node.op_type], dst, args[0], args[1]))
        elif node.op_type in FUSABLE:
            code, arity = FUSABLE[node.op_type]
            program.extend((code, dst, args[0], args[1] if arity == 2 else 0))
            if half:
                program.extend((Op.ROUND_F16, dst, dst, 0))
        elif node.op_type == SUM:
            program.extend((Op.COPY, dst, args[0], 0))
            for arg in args[1:]:
                program.extend((Op.ADD, dst, dst, arg))
                if half:
                    program.extend((Op.ROUND_F16, dst, dst, 0))
        else:  # Cast, Identity: the value moves; a Cast to float16 rounds it
            program.extend((Op.ROUND_F16 if half else Op.COPY, dst, args[0], 0))
        register[out] = dst
        if out in stored:
            program.extend((Op.STORE, stored[out], dst, 0))
        if out not in last_read:
            free.append(register.pop(out))
        if used > ew.MAX_REGISTERS:
            return None
    output_types = [view.dtype(name) for name in escaping]
    program = [int(v) for v in program]
    try:
        ew.check(program, used, constants, len(inputs), output_types)
    except ew.ProgramError as exc:
        log.debug("fuse-elementwise: group of %s not fused: %s", group.nodes[0].name, exc)
        return None
    return op_nodes.fused_elementwise(
        inputs, escaping, program=program, registers=used, constants=[float(np.float32(c)) for c in constants],
        output_types=output_types, input_types=[view.dtype(name) for name in inputs],
        name=view.edit.fresh(group.nodes[0].name or "chain"))



# --- the prediction: the groups this rewrite makes of the planning graph, and what they cost ------
#
# The plan is costed on the planning graph (``onnxcampo.context.GraphContext``, ORT's own fusions
# known) before any rewrite runs; ``onnxcampo.estimate`` asks these functions what the fused
# groups change: each member's share of its group's kernel, the Casts inside and at the edges of
# a group, a bias gradient's column sums added as the kernel stores.


def costed(ctx: GraphContext) -> bool:
    """Whether the plan is costed with this rewrite: ``fuse_elementwise`` and ``plan_for_fusion``
    (``False`` costs the fusion-blind plan, though the rewrite still runs after it)."""
    return bool(ctx.config.fuse_elementwise and ctx.config.experimental.plan_for_fusion)


def predict(ctx: GraphContext, plan) -> RewritePrediction:
    """``fuse_elementwise``: the plan's total with the predicted FusedElementwise groups (one
    kernel and launch each, the Casts inside and at their edges folded: :func:`predicted_groups`)
    and without them."""
    from onnxcampo import estimate

    return estimate.with_and_without(ctx, plan, "fuse_elementwise")


_BYTES = {Precision.FP16: 2, Precision.FP32: 4}


@dataclass(frozen=True)
class FusedMember:
    """A node of a predicted ``FusedElementwise`` group and its share of the group's kernel:
    the elements it reads from outside the group (an input read by k members: 1/k each), the
    elements of its outputs read outside the group (or graph outputs), and 1/``size`` of the
    kernel's fixed cost. Bytes are counted in the node's own precision; a Cast at the group's
    edge corrects them to the type actually read or written (:func:`group_cast_us`)."""

    group: int
    size: int
    leader: bool
    read_elements: float
    written_elements: float

    def time_us(self, kernel, precision: Precision) -> float:
        moved = (self.read_elements + self.written_elements) * _BYTES[precision]
        return kernel.fixed_us / self.size + moved / kernel.bytes_per_us


def _plan_fusable(ctx: GraphContext, node: gs.Node) -> tuple[int, ...] | None:
    """The node's output shape when ``--fuse-elementwise`` can fuse it (its rule 1) and ORT runs
    it as it is (a node ORT fuses or aliases keeps the costing of ORT's graph), else None."""
    if (node.domain or "") not in oplists.DEFAULT_DOMAINS or len(node.outputs) != 1 or node.name in ctx.ort_status:
        return None
    takes = _takes(node.op, len(node.inputs))
    if takes is None:
        takes = node.op in MOVES and (node.op != "Cast" or int(node.attrs.get("to", 0)) in FLOATS)
    if not takes:
        return None
    out = ctx.info.get(node.outputs[0].name)
    if out is None or out.dtype not in FLOATS or out.shape is None or not out.numel:
        return None
    for tensor in node.inputs:
        entry = ctx.info.get(tensor.name)
        if entry is None or entry.dtype not in FLOATS or entry.shape is None:
            return None
    if not all(written_static(ctx, t.name) for t in (*node.inputs, node.outputs[0]) if t.name):
        return None  # the pass fuses static shapes of the written model only
    return tuple(out.shape)


def predicted_groups(ctx: GraphContext) -> dict[str, FusedMember]:
    """node name -> its :class:`FusedMember`, for the groups of two or more nodes that
    ``--fuse-elementwise`` is predicted to make of the planning graph (this module's
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
        shape = _plan_fusable(ctx, node)
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
                if len(inputs[g] | {t.name for t in others}) > ew.MAX_INPUTS:
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


def group_cast_us(ctx: GraphContext, tensor: gs.Tensor, precision_of: PrecisionOf) -> float | None:
    """What the Casts of ``tensor`` cost when a predicted fused group folds them, else None.

    1. The producer and every reader in one group: the value never leaves the registers; 0.
    2. The producer in a group: the kernel writes the tensor in each type needed (the members'
       share counted it in the producer's precision): a type the readers outside the group no
       longer read in the produced type replaces it (the byte difference), else it is written too.
    3. Every reader needing a Cast in groups: each such group reads the tensor in the type it is
       produced in instead of its members' (the byte difference, per group).
    """
    groups = predicted_groups(ctx)
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


def cast_folds(ctx: GraphContext, tensor: gs.Tensor) -> bool:
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


def summed_in_kernel(ctx: GraphContext, node: gs.Node) -> bool:
    """Whether the node is a bias gradient's column sums that the fused kernel writing its input
    adds as it stores it (rule 4; both fusions and
    ``fuse_column_sums`` costed): a ReduceSum (or ReduceMean: a BatchNorm's statistics) over leading axes, or, channels-last, over axes
    other than the channels of a rank >= 3 tensor (the layout stores them last and merges
    simplify's pair over the spatial axes, then the batch, into one over the leading block), of a
    value a predicted fused group writes (directly or through views), where the kernel's grid
    sums them (``ops.elementwise.sum_grid`` on the H200's/H100's 132 multiprocessors: not BERT's
    ``[4096, 768]``, whose partials would be as large as the output). What is left of it is a
    small finishing launch over the partial sums."""
    if not (costed(ctx) and reductions.costed(ctx) and ctx.config.experimental.fuse_column_sums):
        return False
    if node.op not in ("ReduceSum", "ReduceMean") or (node.domain or "") not in oplists.DEFAULT_DOMAINS \
            or not node.inputs:
        return False  # a ReduceMean is a BlockReduceSum and a Mul by 1/n (reductions rule 7)
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
    while producer is not None and producer.op in VIEWS and (producer.domain or "") in oplists.DEFAULT_DOMAINS:
        producer = ctx.producer(producer.inputs[0])
    return producer is not None and producer.name in predicted_groups(ctx)

__all__ = ["COMPARES", "FUSABLE", "FusionResult", "fuse_elementwise"]
