"""Multi-node patterns whose numerical risk differs from that of their ops one by one.

The tanh approximation of GELU (GPT-2's ``gelu_new``, BERT variants, ViT) computes
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``. ``Pow`` is on the deny list, but
here ``x^3`` only feeds ``x + c * x^3`` (same sign as ``x``, so no inf - inf) and then ``Tanh``,
which saturates: in fp16 ``x^3`` overflows to +-inf for |x| > 40, ``tanh(+-inf) = +-1``, and the
result is ``x`` or ``0``, which is what GELU gives there. ONNX Runtime fuses the same pattern into
``FastGelu``, an infer-list op. Its ``Pow`` is therefore treated as an infer-list op.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

_CUBE = 3.0


def _single_consumer(ctx, tensor: gs.Tensor, op: str) -> gs.Node | None:
    consumers = list(tensor.outputs)
    if len(consumers) == 1 and consumers[0].op == op and tensor.name not in ctx.graph_outputs:
        return consumers[0]
    return None


def _constant_operand(ctx, node: gs.Node, other: gs.Tensor) -> bool:
    operands = [t for t in node.inputs if t is not other]
    return len(operands) == 1 and ctx.is_constant(operands[0])


def tanh_gelu_powers(ctx) -> set[str]:
    """Names of ``Pow`` nodes that start a tanh-GELU: ``Pow(x, 3) -> Mul(c) -> Add(x) ->
    Mul(c) -> Tanh``, each intermediate read by the next node only."""
    found = set()
    for node in ctx.nodes:
        if node.op != "Pow" or len(node.inputs) != 2 or not ctx.is_constant(node.inputs[1]):
            continue
        exponent = np.asarray(ctx.constant_array(node.inputs[1]), dtype=np.float64)
        if exponent.size != 1 or float(exponent.reshape(-1)[0]) != _CUBE:
            continue
        x, cube = node.inputs[0], node.outputs[0]
        scaled = _single_consumer(ctx, cube, "Mul")
        if scaled is None or not _constant_operand(ctx, scaled, cube):
            continue
        summed = _single_consumer(ctx, scaled.outputs[0], "Add")
        if summed is None or x not in summed.inputs:
            continue
        argument = _single_consumer(ctx, summed.outputs[0], "Mul")
        if argument is None or not _constant_operand(ctx, argument, summed.outputs[0]):
            continue
        if _single_consumer(ctx, argument.outputs[0], "Tanh") is not None:
            found.add(node.name)
    return found
