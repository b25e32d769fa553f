"""The experimental ``int8_avg``: MatMulInteger (+ its Cast to float) -> ``ai.onnxcampo::AvgMatMulInteger``.

Runs on the exported model, after the precision passes (they never see the custom op). A node
is replaced when (each rule failing gives the reason reported for it):

1. it is a ``MatMulInteger`` whose A is uint8 (any rank >= 1; ranks other than 2, or unknown,
   are flattened to [-1, K] by a Reshape and the result reshaped back to A's leading dims + [N]);
2. its B is a constant (initializer or Constant) uint8 2-D tensor;
3. its zero points, if any, are uint8 scalars or 1-D (B's: one value or one per column; A's of
   a rank-2 A: one value or one per row; flattened A: a scalar);
4. its int32 output feeds exactly one node, a ``Cast`` to float32 or float16, and is no graph
   output. The Cast to float32 goes away (the op gives float32); one to float16 stays.

What follows the Cast (the ``Mul`` by the scales of DynamicQuantizeMatMul patterns, a bias Add)
is untouched. The output differs from MatMulInteger's by the tree's rounding only: at most
``sum over subtrees of 2^n * n / 2`` per element (docs/avg-matmul.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir
from onnxcampo import oplists
from onnxcampo.ops import nodes

log = logging.getLogger(__name__)


@dataclass
class Int8AvgResult:
    replaced: list[str] = field(default_factory=list)  # MatMulInteger node names
    reshaped: int = 0  # of which A needed flattening
    skipped: dict[str, str] = field(default_factory=dict)  # node name -> reason

    def to_json(self) -> dict:
        return {"replaced": len(self.replaced), "reshaped": self.reshaped, "nodes": list(self.replaced),
                "skipped": dict(Counter(self.skipped.values()))}


@dataclass(frozen=True)
class _Candidate:
    node: onnx.NodeProto
    cast: onnx.NodeProto
    reshape: bool
    k: int
    n: int


def replace_matmul_integer(model: onnx.ModelProto) -> Int8AvgResult:
    """Replace every eligible MatMulInteger of ``model`` in place; returns what was done."""
    result = Int8AvgResult()
    candidates = _find(model, result)
    if candidates:
        _apply(model, candidates, result)
        nodes.import_domain(model)
    log.info("int8_avg: %d MatMulInteger replaced (%d flattened), %d kept", len(result.replaced), result.reshaped,
             len(result.skipped))
    return result


# ---- analysis -----------------------------------------------------------------------------------


def _find(model: onnx.ModelProto, result: Int8AvgResult) -> list[_Candidate]:
    graph = model.graph
    info, _ = ir.infer_tensor_info(model)
    edit = ir.ModelEdit(model)
    constants, consumers = edit.constants(), edit.consumers()
    outputs = {o.name for o in graph.output}
    found = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type != oplists.INT8_AVG_REPLACES:
            continue
        candidate = _check(node, info, constants, consumers, outputs)
        if isinstance(candidate, str):
            result.skipped[node.name] = candidate
            log.debug("int8_avg: keep %s: %s", node.name, candidate)
        else:
            found.append(candidate)
    return found


def _check(node, info, constants, consumers, outputs) -> _Candidate | str:
    a, b = node.input[0], node.input[1]
    za = node.input[2] if len(node.input) > 2 else ""
    zb = node.input[3] if len(node.input) > 3 else ""
    a_info = info.get(a)
    if a_info is None or a_info.dtype != TensorProto.UINT8:
        return "A is not uint8"
    if b not in constants:
        return "B is not a constant"
    b_tensor = constants[b]
    if b_tensor.data_type != TensorProto.UINT8 or len(b_tensor.dims) != 2:
        return "B is not a 2-D uint8 constant"
    k, n = (int(d) for d in b_tensor.dims)
    rank = len(a_info.shape) if a_info.shape is not None else None
    reshape = rank != 2
    # A's zero point: one value, or (rank-2 A only) one per row; B's: one value or one per column.
    for name, what, allowed in ((za, "a_zero_point", None if not reshape else {1}), (zb, "b_zero_point", {1, n})):
        if not name:
            continue
        zp = info.get(name)
        if zp is None or zp.dtype != TensorProto.UINT8 or zp.shape is None or len(zp.shape) > 1:
            return f"{what} is not a uint8 scalar or 1-D tensor"
        if len(zp.shape) == 1 and allowed is not None and zp.shape[0] not in allowed:
            return f"{what} has {zp.shape[0]} values where the op takes {' or '.join(map(str, sorted(allowed)))}"
    users = consumers.get(node.output[0], [])
    if node.output[0] in outputs:
        return "its int32 output is a graph output"
    if len(users) != 1 or users[0].op_type != oplists.INT8_AVG_CAST:
        return "its int32 output does not feed exactly one Cast"
    cast = users[0]
    to = next((attr.i for attr in cast.attribute if attr.name == "to"), None)
    if to not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        return "its Cast is not to float32 or float16"
    return _Candidate(node, cast, reshape, k, n)


# ---- mutation -----------------------------------------------------------------------------------


def _apply(model: onnx.ModelProto, candidates: list[_Candidate], result: Int8AvgResult) -> None:
    graph = model.graph
    replacements: dict[int, list[onnx.NodeProto]] = {}  # id of a replaced node -> nodes in its place
    dropped: set[int] = set()
    for c in candidates:
        node, cast = c.node, c.cast
        keep_cast = next(attr.i for attr in cast.attribute if attr.name == "to") != TensorProto.FLOAT
        y = cast.output[0] if not keep_cast else node.output[0] + "/avg"
        a = node.input[0]
        za = node.input[2] if len(node.input) > 2 else ""
        zb = node.input[3] if len(node.input) > 3 else ""
        new: list[onnx.NodeProto] = []
        base = node.name
        if c.reshape:
            flat_shape = f"{base}/flat_shape"
            graph.initializer.append(numpy_helper.from_array(_int64([-1, c.k]), flat_shape))
            n_dim = f"{base}/n"
            graph.initializer.append(numpy_helper.from_array(_int64([c.n]), n_dim))
            starts, ends = f"{base}/lead_start", f"{base}/lead_end"
            graph.initializer.append(numpy_helper.from_array(_int64([0]), starts))
            graph.initializer.append(numpy_helper.from_array(_int64([-1]), ends))
            new += [
                helper.make_node("Reshape", [a, flat_shape], [f"{base}/A2"], name=f"{base}/flatten"),
                nodes.avg_matmul_integer(f"{base}/A2", node.input[1], za, zb, output=f"{base}/Y2", name=base),
                helper.make_node("Shape", [a], [f"{base}/a_shape"], name=f"{base}/a_shape"),
                helper.make_node("Slice", [f"{base}/a_shape", starts, ends], [f"{base}/lead"], name=f"{base}/lead"),
                helper.make_node("Concat", [f"{base}/lead", n_dim], [f"{base}/y_shape"], name=f"{base}/y_shape", axis=0),
                helper.make_node("Reshape", [f"{base}/Y2", f"{base}/y_shape"], [y], name=f"{base}/unflatten"),
            ]
            result.reshaped += 1
        else:
            new.append(nodes.avg_matmul_integer(a, node.input[1], za, zb, output=y, name=base))
        replacements[id(node)] = new
        if keep_cast:
            cast.input[0] = y
        else:
            dropped.add(id(cast))
        result.replaced.append(node.name)
    kept = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        kept.extend(replacements.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(kept)
    names = {c.node.output[0] for c in candidates}
    stale = [v for v in graph.value_info if v.name in names]  # the int32 products are gone
    for value in stale:
        graph.value_info.remove(value)


def _int64(values):
    return np.array(values, np.int64)
