"""Which float initializers of a forward model a training step may update, and which stay constant.

An exported inference model keeps everything it needs as initializers: the weights, but also
BatchNormalization running statistics, Resize scales, epsilons and other constants of a formula,
and shape-like values that only reach the output through integer arithmetic. Only the weights
may become trainable inputs of the step graph; lifting the rest would train running statistics,
let an epsilon go negative, or hand onnx-ad a Resize whose scales are no longer constant.

An initializer stays constant, in this order of precedence (the first case that applies is the
reason reported):

1. ``user``: its name matches the ``freeze`` regular expression.
2. it is not float32 or is a scalar (rank 0): a constant of the formula, never reported.
   A model :func:`onnxcampo.training.export` wrote lists its parameters: those it lists as
   frozen (``requires_grad`` False) are ``user`` too, and an initializer it does not list is a
   ``buffer`` (running statistics, a registered constant); rules 6 to 8 do not apply to a
   listed parameter (it may hold one element, or any values).
3. ``statistics``/``configuration``: some consumer reads it at a slot that is not a weight
   (BatchNormalization mean and variance, which become step state instead where the BatchNorm
   trains, :mod:`onnxcampo.training.train_mode`; Resize roi and scales; Clip bounds; Pad widths and
   value; Pow's exponent; Dropout's ratio; an RNN's initial state); see ``CONSTANT_SLOTS``.
4. ``grouped-conv`` / ``conv-transpose``: it is the weight of a Conv with ``group > 1`` or of any
   ConvTranspose, which onnx-ad 0.3.0 cannot differentiate with respect to the weight (the bias
   stays trainable, and gradients still flow through to the layer's input).
5. ``no-gradient-path``: no differentiable path leads from it to the prediction (the model's
   first output, or the one `build_train_step(output=)` names): it feeds only shape arithmetic, comparisons, integer casts or other outputs.
6. ``formula-constant``: it holds one element and no consumer reads it as a layer's weight or
   bias (``LAYER_SLOTS``): an epsilon, a scale factor such as GELU's 0.5, a clamp bound.
7. ``mask``: every value is 0 or a large negative number (<= -1e4, -inf included): an attention
   mask an exporter folded into a constant (torch.onnx's dynamo exporter does, for GPT-2).
8. ``folded-input``: a model of token inputs (an integer input ``[batch, sequence]``) and an
   initializer ``[1 or batch, sequence, ...]``: a value computed from the positions of this input
   shape and folded by the exporter (a position embedding already gathered, a mask), not a
   parameter of the module.

Everything else is a weight. Rules 7 and 8 are warned about, once, naming the tensors and
:func:`onnxcampo.training.export`, which exports without folding.

Two more things exporters do are handled where the weights are lifted (:func:`tie_transposed`,
:func:`shared_parameter_warnings`): the TorchScript exporter writes a tied output projection (GPT-2's
LM head, the token embedding transposed) as an initializer of its own, which would then train
apart from the embedding: an initializer exactly the transpose of another trainable one becomes a
Transpose of it. And it merges parameters of equal value (fresh LayerNorm scales, zero biases) into
one initializer that many layers read: they would train as one; this is warned about.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field

import onnx
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir
from onnxcampo.errors import ConfigError, UnsupportedModelError, option

log = logging.getLogger(__name__)

# Input slots that hold configuration or statistics, not parameters, grouped by why.
CONSTANT_SLOTS: dict[str, dict[int, str]] = {
    # Running statistics: frozen in eval mode; training them by gradient is meaningless.
    "BatchNormalization": {3: "statistics", 4: "statistics"},
    # Sampling grids: onnx-ad needs them constant, and they are geometry, not parameters.
    "Resize": {1: "configuration", 2: "configuration", 3: "configuration"},
    "Upsample": {1: "configuration"},
    # Bounds, widths, exponents and rates of a formula.
    "Clip": {1: "configuration", 2: "configuration"},
    "Pad": {1: "configuration", 2: "configuration", 3: "configuration"},
    "Pow": {1: "configuration"},
    "Dropout": {1: "configuration", 2: "configuration"},
    # Initial hidden/cell states stored as constants (usually zeros): state, not parameters.
    "LSTM": {4: "configuration", 5: "statistics", 6: "statistics", 7: "configuration"},
    "GRU": {4: "configuration", 5: "statistics"},
    "RNN": {4: "configuration", 5: "statistics"},
}

# Slots that are a layer's learned weight or bias, even when they hold a single element
# (the one-unit output Conv of a detector head has a bias of shape [1]).
LAYER_SLOTS: dict[str, frozenset[int]] = {
    "Conv": frozenset({1, 2}),
    "ConvTranspose": frozenset({1, 2}),
    "Gemm": frozenset({1, 2}),
    "MatMul": frozenset({0, 1}),
    "LSTM": frozenset({1, 2, 3}),
    "GRU": frozenset({1, 2, 3}),
    "RNN": frozenset({1, 2, 3}),
    "BatchNormalization": frozenset({1, 2}),
    "InstanceNormalization": frozenset({1, 2}),
    "LayerNormalization": frozenset({1, 2}),
    "GroupNormalization": frozenset({1, 2}),
    "PRelu": frozenset({1}),
}

# Ops whose outputs carry no gradient to any input: shape queries, comparisons, logic,
# piecewise-constant rounding, index results.
NO_GRADIENT_OPS = frozenset({
    "Shape", "Size", "ConstantOfShape", "Range", "EyeLike", "NonZero", "OneHot",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf", "ArgMax", "ArgMin", "Floor", "Ceil", "Round", "Sign",
    "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
})
# Slots of otherwise differentiable ops that only index or shape the result.
INDEX_SLOTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}), "Gather": frozenset({1}), "GatherElements": frozenset({1}),
    "GatherND": frozenset({1}), "ScatterElements": frozenset({1}), "ScatterND": frozenset({1}),
    "Squeeze": frozenset({1}), "Unsqueeze": frozenset({1}), "Split": frozenset({1}),
    "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}), "ReduceProd": frozenset({1}), "ReduceL2": frozenset({1}),
    "TopK": frozenset({1}), "CumSum": frozenset({1}), "Where": frozenset({0}),
}
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}


@dataclass(frozen=True)
class TrainableSelection:
    """The initializers to train, in model order, and the reason each other float one is frozen."""

    weights: tuple[str, ...]
    frozen: dict[str, str] = field(default_factory=dict)

    values: int = 0  # elements of the trainable weights

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for reason in self.frozen.values():
            counts[reason] = counts.get(reason, 0) + 1
        kept = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items())) or "none"
        return f"{len(self.weights)} weights trainable ({_count(self.values)} values); frozen: {kept}"


def _count(values: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if values >= size:
            return f"{values / size:.1f}{unit}"
    return str(values)


def select_trainable(model: onnx.ModelProto, *, freeze: str | None = None,
                     prediction: str | None = None) -> TrainableSelection:
    """Sort the model's float32 initializers into weights and constants (module docstring)."""
    try:
        pattern = re.compile(freeze) if freeze else None
    except re.error as exc:
        raise ConfigError(f"{option('freeze')} {freeze!r} is not a regular expression: {exc}") from None
    graph = model.graph
    prediction = prediction or graph.output[0].name
    consumers = _consumers(graph)
    reaching = _reaching(graph, prediction)
    weights: list[str] = []
    frozen: dict[str, str] = {}
    token_shapes = _token_input_shapes(graph)
    declared = _declared_parameters(model)
    for tensor in graph.initializer:
        listed = declared is not None and tensor.name in declared[0]
        name = tensor.data_type == TensorProto.FLOAT and (len(tensor.dims) > 0 or listed) and tensor.name
        if not name:
            continue
        uses = consumers.get(name, [])
        reason = None
        if pattern and pattern.search(name):
            reason = "user"
        if reason is None:
            reason = next((CONSTANT_SLOTS[n.op_type][slot] for n, slot in uses
                           if slot in CONSTANT_SLOTS.get(n.op_type, {})), None)
        if reason is None and declared is not None and not listed:
            reason = "user" if name in declared[1] else "buffer"
        if reason is None:
            reason = next((_conv_weight_reason(n) for n, slot in uses if slot == 1 and _conv_weight_reason(n)), None)
        if reason is None and name not in reaching:
            reason = "no-gradient-path"
        if reason is None and not listed and math.prod(tensor.dims) == 1 \
                and not any(slot in LAYER_SLOTS.get(n.op_type, ()) for n, slot in uses):
            reason = "formula-constant"
        if reason is None and not listed and _is_mask(tensor):
            reason = "mask"
        if reason is None and not listed and _folded_from_input(tensor, token_shapes):
            reason = "folded-input"
        if reason is None:
            weights.append(name)
        else:
            frozen[name] = reason
    for kind, label in (("grouped-conv", "grouped Conv"), ("conv-transpose", "ConvTranspose")):
        names = [n for n, r in frozen.items() if r == kind]
        if names:
            log.warning("freezing the weights of %d %s layers (onnx-ad cannot differentiate them with "
                        "respect to the weight; their biases still train): %s", len(names), label,
                        ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""))
    folded = [n for n, r in frozen.items() if r in ("mask", "folded-input")]
    if folded:
        log.warning("not training %d constants the exporter folded (%s): %s; they are no parameters of the module, "
                    "or parameters it folded; onnxcampo.training.export exports a module without folding",
                    len(folded), "attention masks or values computed from the input's positions",
                    ", ".join(folded[:5]) + (" ..." if len(folded) > 5 else ""))
    sizes = {t.name: math.prod(t.dims) for t in graph.initializer}
    selection = TrainableSelection(tuple(weights), frozen, sum(sizes[w] for w in weights))
    log.info("%s", selection.summary())
    return selection


def _declared_parameters(model: onnx.ModelProto) -> tuple[set[str], set[str]] | None:
    """The parameters :func:`onnxcampo.training.export` recorded: (trained, frozen), or None."""
    from onnxcampo.training.export import FROZEN_PARAMETERS_KEY, PARAMETERS_KEY

    listed = ir.metadata(model, PARAMETERS_KEY)
    if listed is None:
        return None
    return set(json.loads(listed)), set(json.loads(ir.metadata(model, FROZEN_PARAMETERS_KEY, "[]")))


MASK_FLOOR = -1e4  # a mask's dropped positions: -10000 (BERT), finfo.min, -inf


def _is_mask(tensor: onnx.TensorProto) -> bool:
    """Every value 0 or <= MASK_FLOOR, at least one of each: an additive attention mask."""
    if math.prod(tensor.dims) < 2:
        return False
    value = numpy_helper.to_array(tensor)
    dropped = value <= MASK_FLOOR
    return bool(dropped.any()) and bool(np.all(dropped | (value == 0)))


def _token_input_shapes(graph: onnx.GraphProto) -> list[tuple[int, int]]:
    """``(batch, sequence)`` of each static 2-D integer graph input (token ids, masks)."""
    initializers = {t.name for t in graph.initializer}
    shapes = []
    for vi in graph.input:
        tensor_type = vi.type.tensor_type
        if vi.name in initializers or tensor_type.elem_type not in (TensorProto.INT64, TensorProto.INT32):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor_type.shape.dim]
        if len(dims) == 2 and all(d > 0 for d in dims):
            shapes.append((dims[0], dims[1]))
    return shapes


def _folded_from_input(tensor: onnx.TensorProto, token_shapes: list[tuple[int, int]]) -> bool:
    dims = list(tensor.dims)
    return len(dims) >= 2 and any(dims[1] == sequence > 1 and dims[0] in (1, batch) for batch, sequence in token_shapes)


def tie_transposed(model: onnx.ModelProto, weights: list[str]) -> dict[str, str]:
    """Each 2-D trainable initializer that is exactly the transpose of another one (the
    TorchScript exporter's tied LM head) becomes a Transpose of that one, in place; returns
    ``{removed: kept}``. ``weights`` loses the removed names."""
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer if t.name in set(weights) and len(t.dims) == 2}
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, tensor in tensors.items():
        by_shape.setdefault(tuple(tensor.dims), []).append(name)
    tied: dict[str, str] = {}
    for name in weights:  # the first of a pair (in model order) is kept
        tensor = tensors.get(name)
        if tensor is None or name in tied:
            continue
        rows, columns = tensor.dims
        if rows == columns:
            continue  # a square matrix and its transpose: no exporter writes that for a tie
        for other in by_shape.get((columns, rows), []):
            if other in tied or other in tied.values():
                continue
            if np.array_equal(numpy_helper.to_array(tensors[other]), numpy_helper.to_array(tensor).T):
                tied[other] = name
                break
    if not tied:
        return {}
    for removed, kept in tied.items():
        graph.node.insert(0, helper.make_node("Transpose", [kept], [removed], name=f"{removed}/tied", perm=[1, 0]))
        weights.remove(removed)
    initializers = [t for t in graph.initializer if t.name not in tied]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    log.info("tied %d initializers to the transpose of another weight (a tied output projection the exporter "
             "wrote apart): %s", len(tied), ", ".join(f"{a} = {b}^T" for a, b in list(tied.items())[:3]))
    return tied


SHARED_SLOT_READERS = 4  # a tensor read in a parameter's slot by this many nodes of one kind is warned about


def shared_parameter_warnings(model: onnx.ModelProto, weights: list[str]) -> list[str]:
    """Warn about each trainable tensor that many nodes of one kind read in a parameter's slot
    (``LAYER_SLOTS``, MatMul aside): an exporter merged parameters of equal value (fresh LayerNorm
    scales, zero biases), which then train as one. Returns the warnings' tensors."""
    consumers = _consumers(model.graph)
    shared = []
    for name in weights:
        kinds: dict[str, int] = {}
        for node, slot in consumers.get(name, []):
            if node.op_type != "MatMul" and slot in LAYER_SLOTS.get(node.op_type, ()):
                kinds[node.op_type] = kinds.get(node.op_type, 0) + 1
        kind, count = max(kinds.items(), key=lambda item: item[1], default=("", 0))
        if count >= SHARED_SLOT_READERS:
            shared.append(name)
            log.warning("%s is the parameter of %d %s nodes: the exporter merged parameters of equal value, which now "
                        "train as one; onnxcampo.training.export exports one initializer per parameter", name, count, kind)
    return shared


def check_trainable(model: onnx.ModelProto) -> None:
    """Raise a one-line UnsupportedModelError for what the step graph cannot express.

    Non-standard ops are caught here (training-mode BatchNorm and Dropout are written out by
    :mod:`onnxcampo.training.train_mode`); onnx-ad itself names the other limits (MaxPool
    auto_pad=SAME_UPPER, Slice steps other than 1, ...)."""
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedModelError(
                f"{node.op_type} node {node.name or node.output[0]!r} is in domain {node.domain!r}; "
                "only standard ONNX ops can be differentiated")


def constants_to_initializers(model: onnx.ModelProto) -> int:
    """Turn top-level ``Constant`` nodes holding a float tensor into initializers of the same
    name (Paddle exports keep every weight as a Constant node); returns how many moved."""
    moved, kept = [], []
    for node in model.graph.node:
        value = _attr(node, "value", None) if node.op_type == "Constant" and len(node.attribute) == 1 else None
        if isinstance(value, onnx.TensorProto) and value.data_type == TensorProto.FLOAT and len(value.dims) > 0:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(value)
            tensor.name = node.output[0]
            moved.append(tensor)
        else:
            kept.append(node)
    if moved:
        del model.graph.node[:]
        model.graph.node.extend(kept)
        model.graph.initializer.extend(moved)
    return len(moved)


def forward_values(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Every float tensor a step graph may train, by name: initializers and Constant-node values."""
    values = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        value = _attr(node, "value", None) if node.op_type == "Constant" else None
        if isinstance(value, onnx.TensorProto):
            values.setdefault(node.output[0], value)
    return values


def forget_declared_shapes(model: onnx.ModelProto) -> None:
    """Drop the declared shapes of the graph outputs (keeping their types) and every value_info:
    inference recomputes them from the pinned inputs and must not merge them with stale ones
    (ddddocr's recognizer declares [1, seqlen] and returns [seqlen, 1, 8210]; the opset
    converter leaves dims of -1 behind on Paddle exports)."""
    for output in model.graph.output:
        if output.type.HasField("tensor_type"):
            elem = output.type.tensor_type.elem_type
            output.CopyFrom(helper.make_tensor_value_info(output.name, elem, None))
    del model.graph.value_info[:]


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    """name -> (node, input slot); a name a subgraph captures counts as slot -1 of its node."""
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            if name:
                out.setdefault(name, []).append((node, slot))
        if ir.has_subgraph(node):
            for name in ir.outer_scope_names(node):
                out.setdefault(name, []).append((node, -1))
    return out


def _reaching(graph: onnx.GraphProto, prediction: str) -> set[str]:
    """Names from which a differentiable path leads to ``prediction`` (walked backwards)."""
    producer: dict[str, onnx.NodeProto] = {o: n for n in graph.node for o in n.output if o}
    cast_to = {n.output[0]: _attr(n, "to", 0) for n in graph.node if n.op_type == "Cast"}
    reach = {prediction}
    stack = [prediction]
    while stack:
        node = producer.get(stack.pop())
        if node is None or node.op_type in NO_GRADIENT_OPS:
            continue
        if node.op_type == "Cast" and cast_to.get(node.output[0]) not in _FLOATS:
            continue
        blocked = INDEX_SLOTS.get(node.op_type, frozenset())
        names = [name for slot, name in enumerate(node.input) if name and slot not in blocked]
        if ir.has_subgraph(node):
            names.extend(ir.outer_scope_names(node))
        for name in names:
            if name not in reach:
                reach.add(name)
                stack.append(name)
    return reach


def _conv_weight_reason(node: onnx.NodeProto) -> str | None:
    if node.op_type == "ConvTranspose":
        return "conv-transpose"
    if node.op_type == "Conv" and int(_attr(node, "group", 1)) > 1:
        return "grouped-conv"
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default
