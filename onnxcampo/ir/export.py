"""The graph the passes edit (onnx-graphsurgeon) made from a model, and the output model built
from the edited graph: the original's IR version, opsets, metadata, declared inputs and outputs
and value infos, retyped where a tensor changed precision."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs


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

    del graph_proto.node[:]
    graph_proto.node.extend(OnnxExporter.export_node(node) for node in graph.nodes)
    _export_initializers(graph, graph_proto, in_place, LazyValues, OnnxExporter)

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


def _export_initializers(graph: gs.Graph, graph_proto: onnx.GraphProto, in_place: bool, lazy_type, exporter) -> None:
    """Initializers of the exported graph: untouched ones are kept in place (in-place export),
    unused ones dropped, new or rewritten ones exported."""
    constants = {
        name: tensor for name, tensor in graph.tensors().items() if isinstance(tensor, gs.Constant)
    }
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

