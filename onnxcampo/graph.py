"""Loading, shape/type inference, export and atomic saving of models.

Inference runs once, at load, on a copy whose dynamic input dims are pinned (the written model
keeps its original dynamic shapes). Its results live in a plain table (:class:`TensorInfo` per
tensor name) that the passes read; the graph the passes change is an onnx-graphsurgeon graph.
"""

from __future__ import annotations

import copy
import functools
import math
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx.defs
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx import TensorProto

from onnxcampo import oplists
from onnxcampo.errors import ConfigError, ModelLoadError, OutputPathError, ShapeError, UnsupportedModelError

log = logging.getLogger(__name__)

MIN_OPSET = 11
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
# Initializers bigger than this are left out of the copy that shape inference sees: inference
# needs their type and dims only, and the model may be larger than protobuf's 2 GB limit.
_SKELETON_BYTES = 1024  # keeps Resize scales and the like, drops weights
_PROTOBUF_LIMIT = (1 << 31) - (1 << 20)
_FOREIGN_DOMAIN = "onnxcampo.ort_training"  # where check_model puts ORT's default-domain training ops
CONTROL_FLOW_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


@dataclass(frozen=True)
class TensorInfo:
    """Type and (pinned) shape of one tensor; ``shape`` entries are None where unknown."""

    dtype: int
    shape: tuple[int | None, ...] | None

    @functools.cached_property
    def numel(self) -> int | None:
        if self.shape is None or any(d is None for d in self.shape):
            return None
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES


def read_model(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, Path | None]:
    """The model and the file it came from, checked by ``onnx.checker``; every failure is a
    :class:`ModelLoadError` or :class:`UnsupportedModelError` with a one-line message.

    A file is checked by path *before* Python loads it, so the checker's copy of the model is
    gone before ours exists (peak memory stays near twice the model size).
    """
    if isinstance(source, onnx.ModelProto):
        model, path = copy.deepcopy(source), None
        invalid = None if exceeds_protobuf_limit(model) else _checker_error(model)
    else:
        path = Path(source)
        if not path.exists():
            raise ModelLoadError(f"{path}: no such file")
        if not path.is_file():
            raise ModelLoadError(f"{path}: not a file")
        invalid = _checker_error(str(path))
        try:
            model = onnx.load(str(path), load_external_data=False)
        except (DecodeError, ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"{path}: not an ONNX model, or the file is truncated ({exc.__class__.__name__})") from None
        if model.ir_version == 0 or not model.HasField("graph"):
            raise ModelLoadError(f"{path}: not an ONNX model (no IR version or graph)")
        if invalid and ort_default_domain_nodes(model) and not exceeds_protobuf_limit(model):
            invalid = _checker_error(model)  # again, with ORT's default-domain training ops set aside
    where = str(path) if path else "model"
    if invalid:
        raise ModelLoadError(f"{where}: invalid ONNX model: {invalid}")
    if path is not None:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external data: {exc}") from None
    _check_opset(model, where)
    return model, path


def _checker_error(model: onnx.ModelProto | str) -> str | None:
    try:
        check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError, OSError) as exc:
        text = str(exc).strip()
        return text.splitlines()[0] if text else exc.__class__.__name__
    return None


def ort_default_domain_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Top-level nodes of ONNX Runtime training ops that sit in the default domain without being
    ONNX ops (MaxPoolGrad in ``generate_artifacts`` output; see ``oplists.ORT_DEFAULT_DOMAIN_OPS``)."""
    return [
        node for node in model.graph.node
        if node.domain in oplists.DEFAULT_DOMAINS and node.op_type in oplists.ORT_DEFAULT_DOMAIN_OPS
        and not onnx.defs.has(node.op_type)
    ]


def check_model(model: onnx.ModelProto | str, *, full_check: bool = False) -> None:
    """``onnx.checker.check_model``, except that ONNX Runtime's default-domain training ops are
    checked like ops of a foreign domain (the checker knows no schema for them; every other node
    is checked as usual). A path goes to the checker as it is (external data, > 2 GB);
    ``read_model`` checks such a model again in memory when the path check fails."""
    if isinstance(model, str):
        onnx.checker.check_model(model, full_check=full_check)
        return
    foreign = ort_default_domain_nodes(model)
    if not foreign:
        onnx.checker.check_model(model, full_check=full_check)
        return
    # Our own copy of the model is borrowed for the check (no second copy of the weights).
    declared = any(entry.domain == _FOREIGN_DOMAIN for entry in model.opset_import)
    if not declared:
        model.opset_import.add(domain=_FOREIGN_DOMAIN, version=1)
    domains = [node.domain for node in foreign]
    for node in foreign:
        node.domain = _FOREIGN_DOMAIN
    try:
        onnx.checker.check_model(model, full_check=full_check)
    finally:
        for node, domain in zip(foreign, domains):
            node.domain = domain
        if not declared:
            del model.opset_import[len(model.opset_import) - 1]


def _check_opset(model: onnx.ModelProto, where: str) -> None:
    opset = default_opset(model)
    if opset < MIN_OPSET:
        raise UnsupportedModelError(
            f"{where}: opset {opset} is older than {MIN_OPSET}; convert it first "
            f"(onnx.version_converter.convert_version(model, 17))"
        )
    if opset > onnx.defs.onnx_opset_version():
        raise UnsupportedModelError(
            f"{where}: opset {opset} is newer than this onnx ({onnx.__version__}) knows "
            f"({onnx.defs.onnx_opset_version()}); upgrade onnx"
        )


def metadata(model: onnx.ModelProto, key: str, default: str | None = None) -> str | None:
    """The value of metadata property ``key``, or ``default``."""
    return next((p.value for p in model.metadata_props if p.key == key), default)


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set metadata property ``key`` (replacing its value if present)."""
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every top-level node a unique name (ORT's profiler and the plan key on names)."""
    seen: set[str] = set()
    renamed = 0
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{index}"
            name = base
            while name in seen:
                name += "_"
            node.name = name
            renamed += 1
        seen.add(node.name)
    return renamed


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller must feed: graph inputs that are not also initializers.

    Old exporters list every weight as a graph input too; those have defaults and are skipped.
    """
    initializers = {t.name for t in model.graph.initializer}
    initializers.update(t.name for t in model.graph.sparse_initializer)
    return [vi for vi in model.graph.input if vi.name not in initializers]


def pin_input_shapes(
    model: onnx.ModelProto,
    input_shapes: dict[str, tuple[int, ...]],
    dim_values: dict[str, int],
    *,
    require_static: bool,
) -> list[str]:
    """Fix dynamic input dims in place; returns descriptions of dims left dynamic.

    Raises :class:`ShapeError` for a pin of the wrong rank or a dim that cannot be resolved
    when ``require_static``.
    """
    inputs = {i.name: i for i in graph_inputs(model)}
    unknown = sorted(set(input_shapes) - set(inputs))
    if unknown:
        raise ConfigError(
            f"--input-shape names {', '.join(map(repr, unknown))}, but the model's inputs are "
            f"{', '.join(map(repr, inputs)) or 'none'}"
        )
    left = []
    for name, value_info in inputs.items():
        if not value_info.type.HasField("tensor_type"):
            continue
        tensor_type = value_info.type.tensor_type
        if not tensor_type.HasField("shape"):
            if name in input_shapes:
                for d in input_shapes[name]:
                    tensor_type.shape.dim.add().dim_value = d
            elif require_static:
                raise ShapeError(
                    f"input {name!r} has no shape; give it with --input-shape {name}:D0,D1,..."
                )
            continue
        dims = tensor_type.shape.dim
        if name in input_shapes:
            pinned = input_shapes[name]
            if len(pinned) != len(dims):
                raise ShapeError(
                    f"--input-shape {name}: {len(pinned)} dims given, the input has rank {len(dims)}"
                )
            for dim, value in zip(dims, pinned):
                if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != value:
                    raise ShapeError(
                        f"--input-shape {name}: dim {value} conflicts with the model's fixed {dim.dim_value}"
                    )
                dim.dim_value = value
            continue
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                continue
            if dim.HasField("dim_param") and dim.dim_param in dim_values:
                dim.dim_value = dim_values[dim.dim_param]
                continue
            label = dim.dim_param or "?"
            example = ",".join(
                str(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else "N" for d in dims
            )
            hint = f"pin it with --input-shape {name}:{example}"
            if dim.dim_param:
                hint += f" or --dim {dim.dim_param}=N"
            if require_static:
                raise ShapeError(f"input {name!r} has dynamic dim {label!r} (axis {axis}); {hint}")
            left.append(f"{name}[{axis}]={label}")
    return left


def _pinned_symbols(
    model: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]], dim_values: dict[str, int]
) -> dict[str, int]:
    """Named dims and their pinned values: ``--dim`` ones, and the names of input dims that an
    ``--input-shape`` pins (a name means the same size wherever it appears)."""
    symbols = dict(dim_values)
    for value_info in graph_inputs(model):
        pinned = input_shapes.get(value_info.name)
        dims = value_info.type.tensor_type.shape.dim
        if pinned is None or len(dims) != len(pinned):
            continue  # pin_input_shapes reports a wrong rank
        for dim, value in zip(dims, pinned):
            if dim.HasField("dim_param") and dim.dim_param:
                symbols.setdefault(dim.dim_param, value)
    return symbols


def skeleton(model: onnx.ModelProto, *, weights_as_inputs: bool = False) -> onnx.ModelProto:
    """A copy for inference whose large float initializers keep type and dims but no data
    (inference needs no weights; small and integer ones stay for data propagation); with
    ``weights_as_inputs`` they become graph inputs of their type and dims instead (ORT's symbolic
    inference reads initializer values)."""
    out = onnx.ModelProto()
    out.ir_version = model.ir_version
    out.opset_import.extend(model.opset_import)
    out.functions.extend(model.functions)
    source, graph = model.graph, out.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    declared = {vi.name for vi in source.input}
    for tensor in source.initializer:
        if tensor.data_type in (TensorProto.INT64, TensorProto.INT32) or _tensor_bytes(tensor) <= _SKELETON_BYTES:
            graph.initializer.append(tensor)
            continue
        if weights_as_inputs:
            if tensor.name not in declared:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            continue
        slim = graph.initializer.add()
        slim.name, slim.data_type = tensor.name, tensor.data_type
        slim.dims.extend(tensor.dims)
    return out


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    count = math.prod(tensor.dims)
    return count * 4


def _value_info_to_info(value_info: onnx.ValueInfoProto, symbols: dict[str, int]) -> TensorInfo | None:
    """Named dims left by inference take their pinned values: ONNX inference cannot see through
    ops it has no schema for (ORT training ops), so what lies behind them has the shapes their
    producer declared, in the inputs' dim names (pinning those in the declarations before
    inference could make a wrong declaration conflict with what inference finds)."""
    if not value_info.type.HasField("tensor_type"):
        return None
    tensor_type = value_info.type.tensor_type
    shape = None
    if tensor_type.HasField("shape"):
        shape = tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0
            else symbols.get(d.dim_param) if d.HasField("dim_param") else None
            for d in tensor_type.shape.dim
        )
    return TensorInfo(tensor_type.elem_type, shape)


def infer_tensor_info(
    model: onnx.ModelProto,
    *,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    dim_values: dict[str, int] | None = None,
    require_static: bool = False,
) -> tuple[dict[str, TensorInfo], list[str]]:
    """Types and shapes of every top-level tensor, from one run of ONNX shape inference on a
    copy whose dynamic input dims are pinned, completed by ORT's symbolic inference where that
    leaves float shapes unknown (:mod:`onnxcampo.shapes`). Also returns the input dims left dynamic."""
    working = skeleton(model)
    symbols = _pinned_symbols(working, input_shapes or {}, dim_values or {})
    unresolved = pin_input_shapes(working, input_shapes or {}, dim_values or {}, require_static=require_static)
    try:
        inferred = onnx.shape_inference.infer_shapes(working, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        log.warning("shape inference failed (%s); continuing with declared types only", str(exc).splitlines()[0])
        inferred = working
    graph = inferred.graph
    info: dict[str, TensorInfo] = {}
    for tensor in graph.initializer:
        info[tensor.name] = TensorInfo(tensor.data_type, tuple(int(d) for d in tensor.dims))
    for value_info in (*graph.input, *graph.value_info, *graph.output):
        entry = _value_info_to_info(value_info, symbols)
        if entry is not None and entry.dtype:
            info.setdefault(value_info.name, entry)
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    info[node.output[0]] = TensorInfo(attr.t.data_type, tuple(int(d) for d in attr.t.dims))
    _propagate_dtypes(graph, info, default_opset(model))
    from onnxcampo import shapes  # it imports this module

    shapes.fill_unknown_shapes(working, info, symbols)  # where ONNX left float shapes unknown
    return info, unresolved


def _propagate_dtypes(graph: onnx.GraphProto, info: dict[str, TensorInfo], opset: int) -> None:
    """Fill output dtypes ONNX inference left unknown (ORT contrib and training ops, and what
    follows them) by binding the node's type parameters to its input dtypes. An op with no
    schema at all is taken to compute its float tensors in one float type: its integer and bool
    inputs (SoftmaxCrossEntropyLossGrad's labels, MaxPoolGrad's indices, an accumulator's reset
    flag) do not bind it. Outputs whose schema allows one type (MaxPool's indices) get it."""
    from onnxcampo.signature import Slot, fixed_output_dtypes, signature

    for node in graph.node:
        missing = [o for o in node.output if o and (o not in info or not info[o].dtype)]
        if not missing:
            continue
        for name, dtype in zip(node.output, fixed_output_dtypes(node.op_type, node.domain, opset, len(node.output))):
            if dtype and name in missing:
                previous = info.get(name)
                info[name] = TensorInfo(dtype, previous.shape if previous else None)
                missing.remove(name)
        sig = signature(node.op_type, node.domain, opset, len(node.input), len(node.output))
        following = {info[i].dtype for i, s in zip(node.input, sig.inputs) if i and s is Slot.FOLLOW and i in info and info[i].dtype}
        if not sig.schema_found:
            following &= set(FLOAT_TYPES)
        if len(following) != 1:
            continue
        dtype = following.pop()
        for name, slot in zip(node.output, sig.outputs):
            if name in missing and slot is Slot.FOLLOW:
                previous = info.get(name)
                info[name] = TensorInfo(dtype, previous.shape if previous else None)


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in CONTROL_FLOW_ATTRS for attr in node.attribute)


def outer_scope_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the enclosing scope (implicit inputs)."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto, bound: set[str]) -> None:
        local = set(bound)
        local.update(i.name for i in graph.input)
        local.update(t.name for t in graph.initializer)
        for inner in graph.node:
            for name in inner.input:
                if name and name not in local:
                    names.add(name)
            for attr in inner.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g, local)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        visit(sub, local)
            local.update(inner.output)

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            visit(attr.g, set())
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                visit(sub, set())
    return names


def subgraph_node_names(node: onnx.NodeProto) -> list[str]:
    """``parent/child`` names of every node inside a node's subgraphs (for the plan)."""
    found = []

    def visit(graph: onnx.GraphProto, prefix: str) -> None:
        for index, inner in enumerate(graph.node):
            name = f"{prefix}/{inner.name or inner.op_type + '_' + str(index)}"
            found.append(name)
            for attr in inner.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for sub in subs:
                    visit(sub, name)

    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            visit(sub, f"{node.name}:{attr.name}")
    return found


def toposort(graph: gs.Graph) -> None:
    """Stable topological order: nodes keep their current order unless a producer comes later,
    in which case it is moved up just in front of its first consumer. Linear time (graphsurgeon's
    own sort recomputes hierarchy levels and takes seconds on 20k nodes)."""
    producer = {id(t): n for n in graph.nodes for t in n.outputs}
    placed: set[int] = set()
    order: list[gs.Node] = []
    for start in graph.nodes:
        if id(start) in placed:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in placed:
                continue
            if expanded:
                placed.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for tensor in reversed([*node.inputs, *_implicit_inputs(node)]):
                source = producer.get(id(tensor))
                if source is not None and id(source) not in placed:
                    stack.append((source, False))
    graph.nodes = order


def _implicit_inputs(node: gs.Node) -> list[gs.Tensor]:
    """Tensors an If/Loop/Scan body reads from the enclosing graph (graphsurgeon shares the
    tensor objects across scopes)."""
    found: list[gs.Tensor] = []
    for value in node.attrs.values():
        for body in (value if isinstance(value, list) else [value]):
            if isinstance(body, gs.Graph):
                inner = {id(t) for n in body.nodes for t in n.outputs} | {id(t) for t in body.inputs}
                for inner_node in body.nodes:
                    found.extend(t for t in (*inner_node.inputs, *_implicit_inputs(inner_node)) if id(t) not in inner)
    return found


def to_graphsurgeon(model: onnx.ModelProto) -> gs.Graph:
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


def check_output_path(output: str | os.PathLike, input_path: Path | None) -> Path:
    out = Path(output)
    if input_path is not None and out.exists() and out.resolve() == input_path.resolve():
        raise OutputPathError(f"{out}: the output path is the input model; choose another path")
    if input_path is not None and out.resolve() == input_path.resolve():
        raise OutputPathError(f"{out}: the output path is the input model; choose another path")
    if out.is_dir():
        raise OutputPathError(f"{out}: is a folder; give a file name for the output model")
    if not out.parent.exists():
        raise OutputPathError(f"{out}: folder {out.parent} does not exist")
    return out


def save_model(model: onnx.ModelProto, output: Path, *, check_loads: bool = True) -> None:
    """Write atomically: a temporary file in the same folder, then a rename.

    Models over protobuf's 2 GB limit get their tensors in ``<output>.data`` next to them.
    With ``check_loads`` ONNX Runtime first loads the temporary file (and its data, under their
    temporary names; :func:`onnxcampo.runtime.check.check_loads`): a model it cannot load raises
    :class:`WrittenModelLoadError` and nothing is written, an existing output stays as it was.
    Callers that write what this onnxruntime need not load may pass ``check_loads=False``.
    """
    output = Path(output)
    directory = output.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp_data = None
    try:
        if not exceeds_protobuf_limit(model):
            tmp.write_bytes(model.SerializeToString())
            if check_loads:
                _check_loads(tmp, model, output)
        else:
            data_name = f"{output.name}.data"
            tmp_data = directory / f".{data_name}.tmp"
            if tmp_data.exists():
                tmp_data.unlink()
            # Converts ``model``'s tensors to external ones in place: it is our own output model.
            onnx.save_model(
                model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                location=tmp_data.name, size_threshold=1024,
            )
            if check_loads:  # before the data replaces an existing <output>.data
                _check_loads(tmp, model, output)
            # The model names its data file: rewrite the location to the final name.
            saved = onnx.load(str(tmp), load_external_data=False)
            for tensor in _all_tensors(saved):
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = data_name
            tmp.write_bytes(saved.SerializeToString())
            os.replace(tmp_data, directory / data_name)
        _apply_umask(tmp)  # mkstemp creates 0600; a saved model gets the usual permissions
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if tmp_data is not None:
            tmp_data.unlink(missing_ok=True)
        raise


def _check_loads(path: Path, model: onnx.ModelProto, output: Path) -> None:
    from onnxcampo.errors import WrittenModelLoadError
    from onnxcampo.runtime.check import check_loads  # the runtime imports this module

    try:
        check_loads(path, model=model, label=str(output))
    except WrittenModelLoadError as exc:
        raise WrittenModelLoadError(f"{exc}; nothing was written") from exc.__cause__


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """A text file written whole or not at all (temporary file in the same folder, then rename)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise OutputPathError(f"{path}: folder {path.parent} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        _apply_umask(Path(tmp_name))
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether the model cannot be serialized as one protobuf (2 GB). ``ByteSize`` itself
    overflows past 2 GB (it came out small for a 2.4 GB model), so the tensor bytes are summed
    first."""
    data = 0
    for tensor in _all_tensors(model):
        data += len(tensor.raw_data) + 4 * (len(tensor.float_data) + len(tensor.int32_data)) + 8 * len(tensor.int64_data)
        if data >= _PROTOBUF_LIMIT:
            return True
    size = model.ByteSize()
    return size < 0 or size >= _PROTOBUF_LIMIT


def _apply_umask(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
