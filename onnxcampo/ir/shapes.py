"""Types and shapes of every tensor: input dims pinned, ONNX shape inference once, at load, and
ONNX Runtime's symbolic shape inference where ONNX leaves float shapes unknown.

Inference runs on a copy (:func:`skeleton`, no weights) whose dynamic input dims are pinned; the
written model keeps its original dynamic shapes. Its results live in a plain table
(:class:`TensorInfo` per tensor name) that the passes read.

ONNX's inference has no schemas for ONNX Runtime's com.microsoft ops (SkipLayerNormalization,
FastGelu, Attention, ...), so what they produce and everything after them has no shape, and its
data propagation stops at some shape arithmetic (the head size, hidden // heads, that an attention
Reshape is built from). The cost model cannot price such nodes. ORT's symbolic shape inference,
what ORT's transformers optimizer runs, knows the contrib ops and computes shapes as expressions.

Rules of the symbolic fallback (:func:`fill_unknown_shapes`, called by :func:`infer_tensor_info`
after ONNX inference):
1. it runs only when a top-level float tensor has no static shape;
2. it reads the copy whose input dims are already pinned; the input model is never touched;
3. it fills only what ONNX left unknown: a shape or dim that ONNX knew is never overridden, nor a
   dtype; a tensor whose rank disagrees with ONNX's keeps ONNX's shape;
4. a symbolic dim stays unknown unless it names a pinned dim: a dynamic input dim left unpinned
   stays dynamic, and ``unresolved_dims`` still lists it; a rank alone is not taken;
5. it fails soft: when symbolic inference raises (or cannot be imported), one info line is logged
   and ONNX's result stands.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from onnxcampo.errors import ConfigError, ShapeError, did_you_mean, on_command_line, option
from onnxcampo.ir.io import default_opset, graph_inputs

log = logging.getLogger(__name__)

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
# Initializers bigger than this are left out of the copy that shape inference sees: inference
# needs their type and dims only, and the model may be larger than protobuf's 2 GB limit.
_SKELETON_BYTES = 1024  # keeps Resize scales and the like, drops weights


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


def static_shape(info: dict[str, TensorInfo], name: str, *, empty: bool = True) -> tuple[int, ...] | None:
    """``name``'s shape when every dimension is a known number (with ``empty=False``: none 0)."""
    entry = info.get(name)
    if entry is None or entry.shape is None:
        return None
    shape = tuple(entry.shape)
    low = 0 if empty else 1
    return shape if all(isinstance(d, int) and d >= low for d in shape) else None


def tensor_dtype(info: dict[str, TensorInfo], name: str) -> int | None:
    """``name``'s element type, or None when ``info`` does not know it."""
    entry = info.get(name)
    return entry.dtype if entry is not None else None


def record_value_infos(info: dict[str, TensorInfo], values: Iterable[onnx.ValueInfoProto]) -> None:
    """Add the tensors a rewrite made (their value_info) to ``info``, so that a later rewrite reads
    them without a second shape inference."""
    for value in values:
        entry = _value_info_to_info(value, {})
        if entry is not None:
            info[value.name] = entry


def symbolic_dims(model: onnx.ModelProto) -> set[str]:
    """The named (symbolic) dims of the graph's inputs, outputs and value infos."""
    names = set()
    for value_info in (*model.graph.input, *model.graph.output, *model.graph.value_info):
        if value_info.type.HasField("tensor_type"):
            names.update(d.dim_param for d in value_info.type.tensor_type.shape.dim if d.dim_param)
    return names


def check_dim_names(model: onnx.ModelProto, dim_values: dict[str, int]) -> None:
    """A :class:`ConfigError` naming the closest dim when ``dim_values`` names a dim the model
    does not have (before any pinning replaces the names by values)."""
    symbolic = symbolic_dims(model)
    unknown = sorted(set(dim_values) - symbolic)
    if unknown:
        raise ConfigError(
            f"{option('dim_values')}: the model has no dim {unknown[0]!r} (its symbolic dims: "
            f"{', '.join(map(repr, sorted(symbolic))) or 'none'}){did_you_mean(unknown[0], symbolic)}"
        )


def shape_pin(name: str, example: str = "D0,D1,...") -> str:
    """How to pin an input's shape, as the caller writes it."""
    if on_command_line():
        return f"--input-shape {name}:{example}"
    return f"input_shapes={{{name!r}: ({example})}}"


def dim_pin(name: str) -> str:
    return f"--dim {name}=N" if on_command_line() else f"dim_values={{{name!r}: N}}"


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
            f"{option('input_shapes')} names {', '.join(map(repr, unknown))}, but the model's inputs are "
            f"{', '.join(map(repr, inputs)) or 'none'}{did_you_mean(unknown[0], inputs)}"
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
                raise ShapeError(f"input {name!r} has no shape; give it with {shape_pin(name)}")
            continue
        dims = tensor_type.shape.dim
        if name in input_shapes:
            pinned = input_shapes[name]
            if len(pinned) != len(dims):
                raise ShapeError(
                    f"{option('input_shapes')} {name}: {len(pinned)} dims given, the input has rank {len(dims)}"
                )
            for dim, value in zip(dims, pinned):
                if dim.HasField("dim_value") and dim.dim_value > 0 and dim.dim_value != value:
                    raise ShapeError(
                        f"{option('input_shapes')} {name}: dim {value} conflicts with the model's fixed {dim.dim_value}"
                    )
                dim.dim_value = value
            continue
        for axis, dim in enumerate(dims):
            if dim.HasField("dim_value") and dim.dim_value >= 0:
                continue
            if dim.HasField("dim_param") and dim.dim_param in dim_values:
                dim.dim_value = dim_values[dim.dim_param]
                continue
            label = dim.dim_param or "?"
            example = ",".join(
                str(d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0 else "N" for d in dims
            )
            hint = f"pin it with {shape_pin(name, example)}"
            if dim.dim_param:
                hint += f" or {dim_pin(dim.dim_param)}"
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
            d.dim_value if d.HasField("dim_value") and d.dim_value >= 0
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
    leaves float shapes unknown (:func:`fill_unknown_shapes`). Also returns the input dims left dynamic."""
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
    fill_unknown_shapes(working, info, symbols)  # where ONNX left float shapes unknown
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


def fill_unknown_shapes(pinned: onnx.ModelProto, info: dict[str, TensorInfo], symbols: dict[str, int]) -> int:
    """Complete in ``info`` the float tensors without a static shape; returns how many changed."""
    missing = {
        name for node in pinned.graph.node for name in node.output
        if name in info and info[name].is_float and info[name].numel is None
    }
    if not missing:
        return 0
    try:
        inferred = _symbolic_value_info(pinned)
    except Exception as exc:  # noqa: BLE001 - a fallback: whatever goes wrong, ONNX's shapes stand
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log.info("ORT symbolic shape inference failed (%s); keeping ONNX's shapes", message)
        return 0
    filled = 0
    for name in sorted(missing):
        found = inferred.get(name)
        entry = _value_info_to_info(found, symbols) if found is not None else None
        merged = _merge(info[name], entry) if entry is not None else None
        if merged is not None:
            info[name] = merged
            filled += 1
    log.debug("ORT symbolic shape inference: %d of %d float tensors without a static shape completed",
              filled, len(missing))
    return filled


def _merge(known: TensorInfo, found: TensorInfo) -> TensorInfo | None:
    """``known`` with its unknown dims taken from ``found``; None when nothing changes."""
    if found.shape is None:
        return None
    if known.shape is None:
        shape = found.shape
    elif len(known.shape) != len(found.shape):
        return None
    else:
        shape = tuple(k if k is not None else f for k, f in zip(known.shape, found.shape))
    if shape == known.shape or (shape and all(d is None for d in shape)):
        return None  # nothing new, or a rank alone (ORT guesses the rank of ops it does not know)
    return TensorInfo(known.dtype, shape)


def _symbolic_value_info(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    """Value info of every tensor ORT's symbolic inference typed, from one run on ``model``."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True), less its
    # end: when some shape stays incomplete it writes sym_shape_infer_temp.onnx into the working
    # directory and raises, dropping every shape it did find.
    engine = SymbolicShapeInference(2**31 - 1, True, True, 0)
    # ORT's symbolic inference reads initializer values: the skeleton's data-less weights go in as
    # graph inputs (it fails on an empty initializer: "cannot reshape array of size 0")
    engine._preprocess(skeleton(model, weights_as_inputs=True))
    while engine.run_:
        engine._infer_impl()
    engine._update_output_from_vi()
    graph = engine.out_mp_.graph
    return {vi.name: vi for vi in (*graph.value_info, *graph.output)}
