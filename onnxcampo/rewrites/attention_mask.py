"""The padding mask of ORT's fused BERT ``Attention`` as an additive attention bias.

ONNX Runtime's transformers optimizer gives each ``com.microsoft::Attention`` of a BERT-like
graph the model's 2-D padding mask (``[batch, sequence]``, 1 keep, 0 drop) in one of two forms:

- a *mask index* (its default for BERT: the mask summed per row, the keys' end position). This
  assumes right-side padding: a left-padded or gapped mask attends to the wrong keys.
- the *raw mask* (``use_raw_attention_mask``; what ``--fuse`` asks for, since it keeps the
  model's meaning for any mask).

Neither form reaches ORT's fused attention kernels on Hopper: the CUDA ``Attention`` kernel picks
memory-efficient attention (CUTLASS) only without a mask index (or with the packed start/end
form), and TensorRT's fused runners have no sm90 kernels below 385 tokens, so both forms run the
unfused path (two batched GEMMs around a masked softmax, the ``[B, N, S, S]`` scores written and
read back). An additive ``attention_bias`` (input 5, ``[B, 1, S, S]``, 0 where the mask keeps a
key and ``mask_filter_value`` where it drops one) means the same for any mask and is accepted by
memory-efficient attention (fp16, sequence length a multiple of 8).

:func:`mask_as_bias` moves each such mask there: the bias is computed once per mask tensor
(Cast, ``(1 - mask) * filter``, Unsqueeze, Expand over the query positions) and shared by every
Attention that read the mask. An Attention is left alone when it is unidirectional (GPT-2's
causal fused kernels take the 2-D mask), has past state, already has a bias, or its mask is not
a 2-D tensor of the graph (a mask index, a 3-D or 4-D mask).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

import numpy as np

from onnxcampo import ir

MS_DOMAIN = "com.microsoft"
MASK_INPUT, PAST_INPUT, BIAS_INPUT = 3, 4, 5
DEFAULT_MASK_FILTER = -10000.0  # the Attention op's mask_filter_value default


def mask_as_bias(model: onnx.ModelProto, shapes: dict[str, int] | None = None) -> int:
    """Rewrite ``model`` in place: every eligible Attention reads its 2-D padding mask as an
    additive ``attention_bias``. ``shapes``: ``{tensor: rank}`` known for the masks (ONNX shape inference on
    a weightless copy when not given). Returns the number of Attention nodes changed."""
    graph = model.graph
    if not any(n.op_type == "Attention" and n.domain == MS_DOMAIN for n in graph.node):
        return 0  # no shape inference for a graph with no Attention (GPT-2's, most models)
    ranks = dict(shapes) if shapes is not None else _ranks(model)
    eligible = [node for node in graph.node if _eligible(node, ranks)]
    if not eligible:
        return 0
    opset = ir.default_opset(model)
    edit = ir.ModelEdit(model, fresh_prefix="attention_bias")
    biases: dict[tuple[str, float], str] = {}
    groups: dict[str, list[onnx.NodeProto]] = {}  # by mask: the nodes computing its biases
    for node in eligible:
        mask = node.input[MASK_INPUT]
        fill = float(ir.attribute(node, "mask_filter_value", DEFAULT_MASK_FILTER))
        if (mask, fill) not in biases:
            bias, nodes, initializers = _bias_nodes(mask, fill, opset, edit.fresh)
            biases[mask, fill] = bias
            groups.setdefault(mask, []).extend(nodes)
            graph.initializer.extend(initializers)
        inputs = list(node.input) + [""] * max(0, BIAS_INPUT + 1 - len(node.input))
        inputs[MASK_INPUT] = ""
        inputs[BIAS_INPUT] = biases[mask, fill]
        del node.input[:]
        node.input.extend(inputs)
    # each mask's bias nodes right after the mask's producer (first for a graph input): still sorted
    produced = {out for n in graph.node for out in n.output if out}
    order = [n for mask, nodes in groups.items() if mask not in produced for n in nodes]
    for node in graph.node:
        order.append(node)
        order.extend(n for out in node.output if out in groups for n in groups[out])
    del graph.node[:]
    graph.node.extend(order)
    return len(eligible)


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """``{tensor: rank}`` from ONNX shape inference on a weightless copy of ``model``."""
    try:
        inferred = onnx.shape_inference.infer_shapes(ir.skeleton(model))
    except Exception:  # noqa: BLE001 - the declared shapes then decide alone
        inferred = model
    graph = inferred.graph
    return {vi.name: len(vi.type.tensor_type.shape.dim) for vi in (*graph.input, *graph.value_info)
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")}


def _eligible(node: onnx.NodeProto, ranks: dict[str, int]) -> bool:
    if node.op_type != "Attention" or node.domain != MS_DOMAIN:
        return False
    inputs = list(node.input)
    mask = inputs[MASK_INPUT] if len(inputs) > MASK_INPUT else ""
    if not mask or ranks.get(mask) != 2:
        return False
    if any(len(inputs) > i and inputs[i] for i in (PAST_INPUT, BIAS_INPUT, BIAS_INPUT + 1)):
        return False
    return not ir.attribute(node, "unidirectional", 0) and not ir.attribute(node, "past_present_share_buffer", 0)


def _bias_nodes(mask: str, fill: float, opset: int, fresh) -> tuple[str, list[onnx.NodeProto], list]:
    """Nodes computing ``[B, 1, S, S]`` float: ``fill`` where ``mask`` (``[B, S]``) is 0, else 0.
    ``fresh(stem)``: a name no tensor or node has."""
    one, filler = fresh("one"), fresh("fill")
    target, nodes, initializers = square_bias_shape(mask, fresh)
    initializers += [numpy_helper.from_array(np.array(1.0, np.float32), one),
                     numpy_helper.from_array(np.array(fill, np.float32), filler)]
    as_float, dropped, scaled, unit, bias = (fresh(p) for p in ("float", "dropped", "scaled", "unit", "bias"))
    nodes += [helper.make_node("Cast", [mask], [as_float], to=TensorProto.FLOAT),
              helper.make_node("Sub", [one, as_float], [dropped]),
              helper.make_node("Mul", [dropped, filler], [scaled])]
    if opset >= 13:
        axes = fresh("axes")
        initializers.append(numpy_helper.from_array(np.array([1, 2], np.int64), axes))
        nodes.append(helper.make_node("Unsqueeze", [scaled, axes], [unit]))
    else:
        nodes.append(helper.make_node("Unsqueeze", [scaled], [unit], axes=[1, 2]))
    nodes.append(helper.make_node("Expand", [unit, target], [bias]))
    return bias, named(nodes), initializers


def square_bias_shape(source: str, fresh) -> tuple[str, list[onnx.NodeProto], list]:
    """``[B, 1, S, S]`` as a tensor (an attention bias's shape), B and S the first two dims of
    ``source`` (``[B, S, ...]``): its name, the nodes that make it, their initializers."""
    shape, rows, seq, target, first, second, one = (
        fresh(p) for p in ("shape", "rows", "seq", "target", "first", "second", "ones"))
    initializers = [numpy_helper.from_array(np.array([k], np.int64), name)
                    for k, name in ((0, first), (1, second), (1, one))]
    nodes = [helper.make_node("Shape", [source], [shape]),
             helper.make_node("Gather", [shape, first], [rows], axis=0),
             helper.make_node("Gather", [shape, second], [seq], axis=0),
             helper.make_node("Concat", [rows, one, seq, seq], [target], axis=0)]
    return target, named(nodes), initializers


def named(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes``, each named after what it writes (a fresh name, so unique)."""
    for node in nodes:
        node.name = node.name or f"{node.output[0]}/{node.op_type}"
    return nodes
