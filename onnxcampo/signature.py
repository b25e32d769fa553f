"""Which inputs and outputs of a node follow its precision.

A node runs in fp16 by retyping the tensors bound to its float type parameter (``T`` of Add, ``T1``
of Resize). Other float inputs keep their declared type: Resize's ``scales`` is ``tensor(float)``
whatever the data type, LayerNormalization's statistics are ``U``. Deciding this from the op
schema (and not from a hand-written list of "data inputs") is what keeps Resize scales, Reshape
shapes and Slice indices from ever being cast.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import onnx
import onnx.defs

from onnxcampo import oplists

_FLOAT = "tensor(float)"
_HALF = "tensor(float16)"


class Slot(enum.Enum):
    FOLLOW = "follow"  # float32 here becomes float16 when the node runs in fp16
    FIXED = "fixed"  # keeps its dtype whatever the node's precision
    ANY = "any"  # accepts any float precision (Shape's input, Cast's input)


@dataclass(frozen=True)
class Signature:
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    schema_found: bool

    @property
    def has_fp16(self) -> bool:
        return Slot.FOLLOW in self.inputs or Slot.FOLLOW in self.outputs


@functools.lru_cache(maxsize=1)
def _contrib_schemas() -> dict[tuple[str, str], object]:
    """Schemas known to the installed ONNX Runtime (latest version of each): com.microsoft's, and
    the ONNX-domain ones including the ops ORT adds there."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        schemas = ort_c.get_all_operator_schema()
    except Exception:  # noqa: BLE001 - an ORT build without the schema API: fall back below
        return {}
    latest: dict[tuple[str, str], object] = {}
    for schema in schemas:
        key = (schema.domain, schema.name)
        if key not in latest or schema.since_version > latest[key].since_version:
            latest[key] = schema
    return latest


def _schema(op_type: str, domain: str, opset: int):
    if domain in oplists.DEFAULT_DOMAINS:
        try:
            return onnx.defs.get_schema(op_type, opset, "")
        except onnx.defs.SchemaError:
            # ORT registers a few ops of its own in the ONNX domain (SimplifiedLayerNormalization)
            schema = _contrib_schemas().get(("", op_type))
            return schema if schema is not None and schema.since_version <= opset else None
    return _contrib_schemas().get((domain, op_type))


def _slots(formals, count: int, following: set[str], fixed: set[str]) -> tuple[Slot, ...]:
    slots = []
    for index in range(count):
        if not formals:
            slots.append(Slot.FOLLOW)
            continue
        formal = formals[min(index, len(formals) - 1)]  # variadic: the last formal repeats
        type_str = formal.type_str if hasattr(formal, "type_str") else formal.typeStr
        slots.append(Slot.FOLLOW if type_str in following and type_str not in fixed else Slot.FIXED)
    return tuple(slots)


def _shares_type_param(formals, count: int, following: set[str]) -> bool:
    params = []
    for index in range(count):
        formal = formals[min(index, len(formals) - 1)] if formals else None
        type_str = getattr(formal, "type_str", None) or getattr(formal, "typeStr", None)
        if type_str in following:
            params.append(type_str)
    return len(params) != len(set(params))


@functools.lru_cache(maxsize=4096)
def fixed_output_dtypes(op_type: str, domain: str, opset: int, n_outputs: int) -> tuple[int, ...]:
    """The dtype of each output that has one whatever the inputs (MaxPool's indices are int64,
    Shape's output too, MaxPoolNhwc's argmax uint8: ``oplists.custom_fixed_types``); 0 where it
    depends on the inputs or the op has no schema."""
    schema = _schema(op_type, domain, opset)
    if schema is None:
        fixed = oplists.custom_fixed_types(op_type, domain)[1]
        return tuple(fixed.get(index, 0) for index in range(n_outputs))
    allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
    formals = list(schema.outputs)
    dtypes = []
    for index in range(n_outputs):
        if not formals:
            dtypes.append(0)
            continue
        formal = formals[min(index, len(formals) - 1)]
        type_str = formal.type_str if hasattr(formal, "type_str") else formal.typeStr
        types = allowed.get(type_str, [type_str])
        dtypes.append(_dtype_of(types[0]) if len(types) == 1 else 0)
    return tuple(dtypes)


def _dtype_of(type_str: str) -> int:
    """``tensor(int64)`` -> ``TensorProto.INT64``; 0 for sequences, maps and unknown names."""
    if not (type_str.startswith("tensor(") and type_str.endswith(")")):
        return 0
    try:
        return onnx.TensorProto.DataType.Value(type_str[len("tensor("):-1].upper())
    except ValueError:
        return 0


@functools.lru_cache(maxsize=4096)
def signature(op_type: str, domain: str, opset: int, n_inputs: int, n_outputs: int) -> Signature:
    """The slots of one node. Ops without a schema (training ops missing from the installed
    ORT, the ``ai.onnxcampo`` ops) are assumed to compute all their float tensors in one type,
    but for the ``ai.onnxcampo`` tensors of a type of their own (``oplists.custom_fixed_types``)."""
    schema = _schema(op_type, domain, opset)
    if schema is None:
        fixed_inputs, fixed_outputs = oplists.custom_fixed_types(op_type, domain)
        return Signature(tuple(Slot.FIXED if i in fixed_inputs else Slot.FOLLOW for i in range(n_inputs)),
                         tuple(Slot.FIXED if i in fixed_outputs else Slot.FOLLOW for i in range(n_outputs)), False)
    following = set()
    for constraint in schema.type_constraints:
        allowed = set(constraint.allowed_type_strs)
        if _FLOAT in allowed and _HALF in allowed:
            following.add(constraint.type_param_str)
    fixed = set(oplists.FIXED_TYPE_PARAMS.get(op_type, ()))
    inputs = _slots(list(schema.inputs), n_inputs, following, fixed)
    outputs = _slots(list(schema.outputs), n_outputs, following, fixed)
    if oplists.category_of(op_type, domain) is oplists.Category.NEUTRAL:
        shared = _shares_type_param(list(schema.inputs), n_inputs, following)
        # One input of any precision (Shape, IsNaN, Cast) is free; inputs bound to one type
        # (Less, Equal) must agree, so they keep their dtype.
        inputs = tuple((Slot.FIXED if shared else Slot.ANY) if s is Slot.FOLLOW else s for s in inputs)
        if op_type == "CastLike":  # the output takes the target's type: keep the target as it is
            inputs = (Slot.ANY, *(Slot.FIXED for _ in inputs[1:]))
        if op_type != "Cast":  # Cast's output follows: its ``to`` is rewritten
            outputs = tuple(Slot.FIXED for _ in outputs)
    return Signature(inputs, outputs, True)
