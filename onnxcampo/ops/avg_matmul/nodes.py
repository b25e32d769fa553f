"""The ONNX nodes of the avg_matmul unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def avg_matmul_integer(a: str, b: str, a_zero_point: str = "", b_zero_point: str = "", *, output: str,
                       name: str, exact: bool = False) -> onnx.NodeProto:
    """``Y = AvgMatMulInteger(A, B[, a_zero_point, b_zero_point])``: uint8 [M, K] x uint8 [K, N]
    -> float32 [M, N], the products summed by tree averaging in 16 bits (``docs/avg-matmul.md``);
    ``exact=True`` gives ``ExactMatMulInteger``, the same with exact 32-bit accumulation."""
    inputs = [a, b, a_zero_point, b_zero_point]
    while inputs[-1] == "":
        inputs.pop()
    op = "ExactMatMulInteger" if exact else "AvgMatMulInteger"
    return helper.make_node(op, inputs, [output], name=name, domain=DOMAIN)
