"""Accumulating scatters of a step graph as ``ai.onnxcampo::ScatterNDAdd`` (``docs/ops.md``).

onnx-ad's adjoint of Gather (the embedding lookups of BERT and GPT-2) is ``ScatterND(zeros,
indices, dY, reduction="add")``. ONNX Runtime's CUDA kernel for it runs one thread per index
tuple, each looping over its slice: on an H200 the word-embedding gradient of a BERT-base b32
s128 step (4096 tuples of 768 elements) took 2.92 ms of a 22 ms step. ``ScatterNDAdd`` computes
the same with one thread per update element. :func:`build_train_step
<onnxcampo.training.build_train_step>` calls :func:`fuse_scatter_add` when it emits fused ops.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxcampo import ir
from onnxcampo.oplists import DEFAULT_DOMAINS
from onnxcampo.ops import nodes as op_nodes

SCATTER_ND = "ScatterND"
DATA_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)  # what the op's kernels take


def fuse_scatter_add(model: onnx.ModelProto) -> int:
    """Replace, in ``model``'s main graph, every default-domain ``ScatterND`` with
    ``reduction="add"`` whose data is float32 or float16 by ``ScatterNDAdd`` with the same
    inputs, output and node name, in the same place; returns how many were replaced. ONNX shape
    inference knows no ``ai.onnxcampo`` op, so the output gets a value info with data's type and
    shape (what inference gave the ScatterND's output) where the graph has none for it. Imports
    the ``ai.onnxcampo`` domain when it replaced any. Other reductions, other data types and the
    bodies of If/Loop/Scan are left alone."""
    graph = model.graph
    candidates = [i for i, node in enumerate(graph.node) if _adds(node)]
    if not candidates:
        return 0
    data = _data_types(model, {graph.node[i].input[0] for i in candidates})
    declared = {v.name for v in (*graph.value_info, *graph.output)}
    replaced = 0
    for i in candidates:
        node = graph.node[i]
        value = data.get(node.input[0])
        if value is None or value.tensor_type.elem_type not in DATA_TYPES:
            continue
        fused = op_nodes.scatter_nd_add(*node.input, output=node.output[0], name=node.name)
        fused.doc_string = node.doc_string
        graph.node[i].CopyFrom(fused)
        if node.output[0] not in declared:
            graph.value_info.append(onnx.ValueInfoProto(name=node.output[0], type=value))
        replaced += 1
    if replaced:
        op_nodes.import_domain(model)
    return replaced


def _adds(node: onnx.NodeProto) -> bool:
    reduction = ir.attribute(node, "reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    return node.op_type == SCATTER_ND and node.domain in DEFAULT_DOMAINS and reduction == "add" and len(node.input) == 3


def _data_types(model: onnx.ModelProto, names: set[str]) -> dict[str, onnx.TypeProto]:
    """The tensor types (element type and shape) of ``names``: from initializers, Constant nodes,
    inputs and value infos (onnx-ad's scatter data is a Constant), else from one run of type
    inference (the shape left out where it is unknown)."""
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer if t.name in names}
    for node in graph.node:
        if node.op_type == "Constant" and node.output and node.output[0] in names:
            value = ir.attribute(node, "value")
            if isinstance(value, onnx.TensorProto):
                tensors[node.output[0]] = value
    types = {name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for name, t in tensors.items()}
    for value_info in (*graph.input, *graph.value_info):
        if value_info.name in names and value_info.type.tensor_type.elem_type:
            types.setdefault(value_info.name, value_info.type)
    if names - types.keys():
        info, _ = ir.infer_tensor_info(model)
        for name in names - types.keys():
            if name in info and info[name].dtype:
                types[name] = helper.make_tensor_type_proto(info[name].dtype, info[name].shape)
    return types


__all__ = ["fuse_scatter_add"]
