"""The graph the passes edit (onnx-graphsurgeon) made from a model, and the output model built
from the edited graph: the original's IR version, opsets, metadata, declared inputs and outputs
and value infos, retyped where a tensor changed precision."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from onnxcampo.ir.topology import CONTROL_FLOW_ATTRS, _implicit_inputs, has_subgraph, outer_scope_names


def to_graphsurgeon(model: onnx.ModelProto) -> gs.Graph:
    """The graph the passes edit; its constants read ``model``'s initializers lazily."""
    return gs.import_onnx(model)


def export_model(
    graph: gs.Graph,
    original: onnx.ModelProto,
    dtypes: dict[str, int],
    metadata: dict[str, str],
    *,
    in_place: bool = False,
) -> onnx.ModelProto:
    """The graph as a model with the original's IR version, opsets and metadata.

    With ``in_place`` the original model (our own copy) becomes the output: its unchanged
    initializers stay where they are instead of being copied, which keeps peak memory near the
    model's size. Value infos are the original ones, retyped where a tensor changed precision;
    no new shape information is invented (invented dim names once made ORT reuse a buffer of
    the wrong size). Graph inputs and outputs are exactly as declared, retyped if asked.
    """
    from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
    from onnx_graphsurgeon.ir.tensor import LazyValues

    model = original if in_place else _copy_without_initializers(original)
    graph_proto = model.graph
    old_value_info = {vi.name: onnx.ValueInfoProto.FromString(vi.SerializeToString()) for vi in original.graph.value_info}
    declared = {vi.name: onnx.ValueInfoProto.FromString(vi.SerializeToString())
                for vi in (*original.graph.input, *original.graph.output)}

    nodes, body_reads = _export_nodes(graph, original, OnnxExporter)  # before the in-place export clears them
    del graph_proto.node[:]
    graph_proto.node.extend(nodes)
    _export_initializers(graph, graph_proto, in_place, LazyValues, OnnxExporter, body_reads)

    produced = {o for n in graph_proto.node for o in n.output}
    del graph_proto.value_info[:]
    for name, value_info in old_value_info.items():
        if name in produced:
            _retype(value_info, dtypes.get(name))
            graph_proto.value_info.append(value_info)
    for field_name, tensors in (("input", graph.inputs), ("output", graph.outputs)):
        entries = []
        for tensor in tensors:
            entry = declared.get(tensor.name) or OnnxExporter.export_value_info_proto(tensor, False)
            _retype(entry, dtypes.get(tensor.name))
            entries.append(entry)
        repeated = getattr(graph_proto, field_name)
        del repeated[:]
        repeated.extend(entries)

    used_domains = {n.domain for n in graph_proto.node} - {e.domain for e in model.opset_import}
    for domain in sorted(used_domains - {"", "ai.onnx"}):
        model.opset_import.add(domain=domain, version=1)
    for prop in list(model.metadata_props):
        if prop.key in metadata:
            model.metadata_props.remove(prop)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    return model


def _copy_without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of everything but the weights, leaving ``model`` untouched (its initializers are
    what graphsurgeon's lazy constants point at)."""
    copy_ = onnx.ModelProto()
    _copy_fields(model, copy_, skip="graph")
    _copy_fields(model.graph, copy_.graph, skip="initializer")
    return copy_


def _copy_fields(source, target, *, skip: str) -> None:
    for field, value in source.ListFields():
        if field.name == skip:
            continue
        if hasattr(value, "extend"):  # repeated
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)


def _export_nodes(graph: gs.Graph, original: onnx.ModelProto, exporter) -> tuple[list[onnx.NodeProto], list[gs.Constant]]:
    """The graph's nodes as protos, and the outer constants that kept If/Loop/Scan bodies read.

    graphsurgeon exports a body with a copy of every outer constant it reads (and the outer graph
    then drops those read only there): an unchanged body would grow the model by its weights once
    per branch. A body that comes out as it went in (:func:`_same_graph`) is written as it was
    read (each attribute on its own: an If's unchanged branch, even when the other changed), and
    the outer constants it reads stay in the outer graph; a changed body is written as
    graphsurgeon exports it, copies included (the outer graph may no longer hold what it reads).
    """
    sources = {tuple(node.output): node for node in original.graph.node if has_subgraph(node)}
    nodes, body_reads = [], []
    for node in graph.nodes:
        proto = exporter.export_node(node)
        source = sources.get(tuple(proto.output))
        if source is not None and source.op_type == proto.op_type:
            originals = {attr.name: attr for attr in source.attribute if attr.type in CONTROL_FLOW_ATTRS}
            kept = onnx.NodeProto()  # holds the bodies written as read, for what they read outside
            for attr in proto.attribute:
                if attr.name in originals and _same_attribute(attr, originals[attr.name]):
                    attr.CopyFrom(originals[attr.name])
                    kept.attribute.append(attr)
            outer = outer_scope_names(kept)
            body_reads.extend(t for t in _implicit_inputs(node) if isinstance(t, gs.Constant) and t.name in outer)
        nodes.append(proto)
    return nodes, body_reads


def _graphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)


def _same_attribute(exported: onnx.AttributeProto, source: onnx.AttributeProto) -> bool:
    ours, theirs = _graphs(exported), _graphs(source)
    return exported.type == source.type and len(ours) == len(theirs) and all(map(_same_graph, ours, theirs))


def _same_bodies(exported: onnx.NodeProto, source: onnx.NodeProto) -> bool:
    ours = {attr.name: attr for attr in exported.attribute if attr.type in CONTROL_FLOW_ATTRS}
    theirs = {attr.name: attr for attr in source.attribute if attr.type in CONTROL_FLOW_ATTRS}
    return ours.keys() == theirs.keys() and all(_same_attribute(ours[name], theirs[name]) for name in ours)


def _same_graph(exported: onnx.GraphProto, source: onnx.GraphProto) -> bool:
    """Whether graphsurgeon's export of a body is the body as read: the same nodes (attributes,
    nested bodies) in the same order, inputs, outputs and own initializers; the initializers the
    export adds for outer constants do not count."""
    own = {tensor.name: tensor for tensor in source.initializer}
    initializers = {tensor.name: tensor for tensor in exported.initializer if tensor.name in own}
    if initializers.keys() != own.keys() or any(initializers[name] != own[name] for name in own):
        return False
    for ours, theirs in ((exported.input, source.input), (exported.output, source.output)):
        if [(v.name, v.type.tensor_type.elem_type) for v in ours] != [(v.name, v.type.tensor_type.elem_type) for v in theirs]:
            return False
    if len(exported.node) != len(source.node):
        return False
    for ours, theirs in zip(exported.node, source.node):
        if (ours.op_type, ours.domain, list(ours.input), list(ours.output)) != (
                theirs.op_type, theirs.domain, list(theirs.input), list(theirs.output)):
            return False
        plain = sorted((a.SerializeToString(deterministic=True) for a in ours.attribute if a.type not in CONTROL_FLOW_ATTRS))
        if plain != sorted(a.SerializeToString(deterministic=True) for a in theirs.attribute if a.type not in CONTROL_FLOW_ATTRS):
            return False
        if not _same_bodies(ours, theirs):
            return False
    return True


def _export_initializers(graph: gs.Graph, graph_proto: onnx.GraphProto, in_place: bool, lazy_type, exporter,
                         body_reads: list[gs.Constant]) -> None:
    """Initializers of the exported graph: untouched ones are kept in place (in-place export),
    unused ones dropped, new or rewritten ones exported; ``body_reads``, outer constants that
    bodies written as they were read use, count as used."""
    constants = {
        name: tensor for name, tensor in graph.tensors().items() if isinstance(tensor, gs.Constant)
    }
    for tensor in body_reads:
        constants.setdefault(tensor.name, tensor)
    kept: set[str] = set()
    if in_place:
        for index in range(len(graph_proto.initializer) - 1, -1, -1):
            name = graph_proto.initializer[index].name
            tensor = constants.get(name)
            if tensor is not None and isinstance(tensor._values, lazy_type):
                kept.add(name)  # unchanged: the proto in place is the lazy value's source
            else:
                del graph_proto.initializer[index]
    for name, tensor in constants.items():
        if name not in kept:
            graph_proto.initializer.append(exporter.export_tensor_proto(tensor))


def _retype(value_info: onnx.ValueInfoProto, dtype: int | None) -> None:
    if dtype and value_info.type.HasField("tensor_type"):
        value_info.type.tensor_type.elem_type = dtype

