"""Mutating pass: apply the precision plan, with one Cast per (tensor, dtype).

Rules:
1. every precision-following float32 output of an fp16 node becomes float16; a Cast node planned
   fp16 gets ``to = FLOAT16``;
2. a tensor whose name must keep its dtype (graph output with ``keep_io_types``, or read by an
   If/Loop/Scan body) but is now produced in fp16 is renamed ``<name>/fp16`` and a Cast gives
   back the original name in fp32;
3. every consumer slot that needs another dtype than the tensor has gets the tensor's version in
   that dtype, made once and shared: the source of a Cast when that source already has the
   dtype (the reverse cast returns the original tensor, never a round trip), else a constant
   converted offline (values clamped to the fp16 range, counted), else a new Cast;
4. a constant all of whose uses want fp16 is converted in place; one with fp32 uses too is
   duplicated;
5. with ``keep_io_types`` off, a graph input read only in fp16 (and by readers of any dtype, such as
   Shape) becomes an fp16 input, and graph outputs take the dtype their producer gives them.
The graph is topologically sorted at the end. Every node the pass adds is recorded with why it is
there (``ctx.inserted``: the report's ``inserted_nodes``, the written node's doc_string). Which dtype a tensor has and each use needs, and
which names are pinned, are the rules of ``onnxcampo.casting``, which the estimate counts too.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxcampo import casting
from onnxcampo.context import GraphContext
from onnxcampo.editing import GraphEditor
from onnxcampo.ir.topology import toposort
from onnxcampo.plan import Precision
from onnxcampo.signature import Slot

from onnxcampo.passes.manager import PassBase, PassResult

FP16_MAX = float(np.finfo(np.float16).max)
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
_SUFFIX = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16"}
_NAMES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}


class InsertCasts(PassBase):
    name = "insert_casts"
    mutates = True

    def requires(self, ctx: GraphContext) -> str | None:
        missing = [n.name for n in ctx.nodes if not ctx.plan.is_decided(n.name)]
        return f"{len(missing)} nodes have no precision (first: {missing[0]})" if missing else None

    def run(self, ctx: GraphContext) -> PassResult:
        self.ctx = ctx
        self.cache: dict[tuple[str, int], gs.Tensor] = {}
        self.edit = GraphEditor(ctx)
        self.casts = self.retyped = self.converted = self.clamped = 0
        self.made: list[gs.Node] = []
        precision_of = ctx.plan.precision
        tensors = self._float_tensors()
        for node in list(ctx.nodes):
            if precision_of(node.name) is Precision.FP16:
                self._retype_outputs(node)
        for tensor in tensors:
            self._feed_consumers(tensor, precision_of)
        if not ctx.config.keep_io_types:
            self._retype_graph_inputs()
        toposort(ctx.graph)
        ctx.nodes = list(ctx.graph.nodes)
        self._record_inserted()
        counts = {"casts": self.casts, "retyped": self.retyped, "constants": self.converted, "clamped": self.clamped}
        return PassResult(self.name, bool(self.casts or self.retyped or self.converted), counts)

    # --- rule 1 and 2 -------------------------------------------------------------------
    def _retype_outputs(self, node: gs.Node) -> None:
        ctx = self.ctx
        if node.op == "Cast" and int(node.attrs.get("to", 0)) == TensorProto.FLOAT:
            node.attrs["to"] = TensorProto.FLOAT16
        # casting.produced_dtype's rule, walked per fp16 node over its signature; that function
        # also says None (any dtype) for a constant's output, which classify never lets run fp16.
        sig = ctx.signatures[node.name]
        for index, (tensor, slot) in enumerate(zip(list(node.outputs), sig.outputs)):
            if slot is not Slot.FOLLOW or ctx.dtype(tensor) != TensorProto.FLOAT:
                continue
            if casting.pinned_dtype(ctx, tensor) == TensorProto.FLOAT:
                half = self.edit.variable(f"{tensor.name}/fp16", TensorProto.FLOAT16)
                node.outputs[index] = half
                self._cast(half, TensorProto.FLOAT, output=tensor)
                self.cache[(tensor.name, TensorProto.FLOAT16)] = half
            else:
                self.edit.set_dtype(tensor, TensorProto.FLOAT16)
            self.retyped += 1

    # --- rule 3 and 4 -------------------------------------------------------------------
    def _float_tensors(self) -> list[gs.Tensor]:
        """Float tensors read by a node, where a node next to them runs fp16 (no other tensor
        can need another dtype)."""
        ctx = self.ctx
        found = {}
        for node in ctx.nodes:
            if not ctx.plan.is_fp16(node.name):
                continue
            for tensor in (*node.inputs, *node.outputs):
                if tensor.name and ctx.is_float(tensor):
                    found.setdefault(tensor.name, tensor)
        return list(found.values())

    def _feed_consumers(self, tensor: gs.Tensor, precision_of) -> None:
        ctx = self.ctx
        # casting.required_dtypes over the uses, except those of nodes with no signature: the
        # Casts this pass has added, which read the tensor in the dtype it has.
        uses = [u for u in ctx.uses(tensor) if u.node.name in ctx.signatures]
        wanted = {id(u): casting.use_dtype(ctx, tensor, u, precision_of) for u in uses}
        needed = {d for d in wanted.values() if d is not None}
        if ctx.is_constant(tensor) and needed == {TensorProto.FLOAT16} and ctx.dtype(tensor) == TensorProto.FLOAT \
                and casting.pinned_dtype(ctx, tensor) is None and tensor.name not in ctx.graph_inputs:
            self._convert_in_place(tensor)
            return
        for use in uses:
            dtype = wanted[id(use)]
            if dtype is None or dtype == ctx.dtype(tensor):
                continue
            use.node.inputs[use.index] = self._version(tensor, dtype)

    def _version(self, tensor: gs.Tensor, dtype: int) -> gs.Tensor:
        ctx = self.ctx
        key = (tensor.name, dtype)
        if key in self.cache:
            return self.cache[key]
        producer = ctx.producer(tensor)
        if producer is not None and producer.op == "Cast" and producer.inputs and ctx.dtype(producer.inputs[0]) == dtype:
            version = producer.inputs[0]
        elif isinstance(tensor, gs.Constant):
            version = self.edit.constant(f"{tensor.name}/{_SUFFIX[dtype]}", self._converted(tensor.values, dtype))
        elif ctx.is_constant(tensor):  # a Constant node's tensor value, converted offline
            values = self._converted(producer.attrs["value"].values, dtype)
            version = self.edit.variable(f"{tensor.name}/{_SUFFIX[dtype]}", dtype)
            constant = gs.Constant(self.edit.unique(f"{version.name}/value"), values)
            self.made.append(self.edit.node("Constant", f"{producer.name}/{_SUFFIX[dtype]}", [], [version],
                                            {"value": constant}))
        else:
            version = self.edit.variable(f"{tensor.name}/{_SUFFIX[dtype]}", dtype)
            self._cast(tensor, dtype, output=version)
        self.cache[key] = version
        return version

    def _convert_in_place(self, tensor: gs.Tensor) -> None:
        if isinstance(tensor, gs.Constant):
            tensor.values = self._converted(tensor.values, TensorProto.FLOAT16)
        else:
            producer = tensor.inputs[0]
            value = producer.attrs["value"]
            value.values = self._converted(value.values, TensorProto.FLOAT16)
        self.edit.set_dtype(tensor, TensorProto.FLOAT16)

    def _converted(self, values: np.ndarray, dtype: int) -> np.ndarray:
        values = np.asarray(values)
        if dtype == TensorProto.FLOAT16:
            finite = np.isfinite(values)
            outside = finite & (np.abs(values) > FP16_MAX)
            self.clamped += int(np.count_nonzero(outside))
            values = np.where(outside, np.clip(values, -FP16_MAX, FP16_MAX), values)
        self.converted += 1
        return values.astype(_NP[dtype])

    # --- rule 5 -------------------------------------------------------------------------
    def _retype_graph_inputs(self) -> None:
        # The rule casting.tensor_casts counts for a graph input (fp16 when every reader that
        # cares wants fp16), read here off the Casts made: the input's readers are Casts to its
        # fp16 version and readers of any dtype (Shape, Size), which read the fp16 input as well.
        ctx = self.ctx
        for tensor in ctx.graph.inputs:
            if ctx.dtype(tensor) != TensorProto.FLOAT:
                continue
            half = self.cache.get((tensor.name, TensorProto.FLOAT16))
            if half is None:
                continue
            slots: dict[int, set[Slot]] = {}
            for use in ctx.uses(tensor):
                slots.setdefault(id(use.node), set()).add(use.slot)
            any_dtype = {node for node, kinds in slots.items() if kinds == {Slot.ANY}}
            if any(c for c in tensor.outputs if not (c.op == "Cast" and c.outputs[0] is half) and id(c) not in any_dtype):
                continue
            cast = half.inputs[0]
            for consumer in list(half.outputs):
                for index, inp in enumerate(consumer.inputs):
                    if inp is half:
                        consumer.inputs[index] = tensor
            cast.inputs.clear()
            cast.outputs.clear()
            ctx.graph.nodes.remove(cast)
            self.casts -= 1
            self.edit.set_dtype(tensor, TensorProto.FLOAT16)

    # --- helpers ------------------------------------------------------------------------
    def _cast(self, source: gs.Tensor, dtype: int, *, output: gs.Tensor) -> None:
        self.made.append(self.edit.node("Cast", f"{source.name}/cast_{_SUFFIX[dtype]}", [source], [output], {"to": dtype}))
        self.casts += 1

    def _record_inserted(self) -> None:
        """Why each node this pass added is there, in words (rule 5 removed some Casts again)."""
        ctx = self.ctx
        precision_of = ctx.plan.precision
        for node in self.made:
            if not node.outputs:
                continue
            output = node.outputs[0]
            readers = [f"{precision_of(r.name).value} {r.name}" for r in output.outputs]
            if len(readers) > 4:
                readers = readers[:4] + [f"{len(readers) - 4} more"]
            if node.op == "Constant":
                why = f"{output.name}: a Constant node's value converted offline to {_NAMES[ctx.dtypes[output.name]]}"
            else:
                source = node.inputs[0]
                maker = source.inputs[0] if source.inputs else None
                origin = "graph input" if maker is None else f"made by {precision_of(maker.name).value} {maker.name}"
                why = f"Cast to {_NAMES[int(node.attrs['to'])]} of {source.name} ({origin})"
            parts = [why]
            if readers:
                parts.append("for " + ", ".join(readers))
            if output.name in ctx.graph_outputs:
                parts.append(f"graph output {output.name} keeps its dtype")
            elif output.name in ctx.implicit_names:
                parts.append(f"{output.name} is read by an If/Loop/Scan body and keeps its dtype")
            ctx.inserted[node.name] = {"op": node.op, "why": "; ".join(parts)}
