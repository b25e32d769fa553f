"""Graph edits shared by the mutating passes: unique names, typed tensors, new nodes.

Every tensor created here gets its dtype recorded in ``ctx.dtypes`` (the exporter and the
invariant checks read types from there) and every node a signature.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxcampo.context import GraphContext
from onnxcampo.signature import signature


class GraphEditor:
    def __init__(self, ctx: GraphContext) -> None:
        self.ctx = ctx
        self.names = set(ctx.graph.tensors()) | {n.name for n in ctx.graph.nodes}

    def unique(self, name: str) -> str:
        candidate, index = name, 1
        while candidate in self.names:
            candidate = f"{name}_{index}"
            index += 1
        self.names.add(candidate)
        return candidate

    def variable(self, name: str, dtype: int) -> gs.Variable:
        variable = gs.Variable(self.unique(name), dtype=onnx.helper.tensor_dtype_to_np_dtype(dtype))
        self.ctx.dtypes[variable.name] = dtype
        return variable

    def constant(self, name: str, values: np.ndarray) -> gs.Constant:
        constant = gs.Constant(self.unique(name), np.asarray(values))
        self.ctx.dtypes[constant.name] = onnx.helper.np_dtype_to_tensor_dtype(constant.values.dtype)
        return constant

    def set_dtype(self, tensor: gs.Tensor, dtype: int) -> None:
        if isinstance(tensor, gs.Variable):
            tensor.dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
        self.ctx.dtypes[tensor.name] = dtype

    def node(self, op: str, name: str, inputs, outputs, attrs=None) -> gs.Node:
        node = gs.Node(op, self.unique(name), attrs=attrs or {}, inputs=list(inputs), outputs=list(outputs))
        self.ctx.graph.nodes.append(node)
        self.ctx.signatures[node.name] = signature(op, "", self.ctx.opset, len(node.inputs), len(node.outputs))
        return node
