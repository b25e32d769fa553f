"""The ONNX nodes of the reduce unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN


def block_reduce_sum(x: str, *, output: str, sizes: Sequence[int], output_type: int = onnx.TensorProto.FLOAT,
                     output_shape: Sequence[int] | None = None, input_type: int | None = None,
                     name: str) -> onnx.NodeProto:
    """``y = BlockReduceSum(x)``: ``x`` (float16 or float32, ``P*Q*R`` elements, any shape) read as
    a contiguous ``[P, Q, R]`` array and summed over axes 0 and 2 in float32, rounded once to
    ``output_type`` (1 float32, 10 float16); ``y`` is shaped ``output_shape`` (default ``[Q]``).
    ``input_type`` (optional): the type ``x`` was planned in; a float16 ``x`` that ORT's CPU
    provider turns into float32 (running the node in fp32) makes a float16 ``y`` float32 too."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != 3 or min(sizes) < 0:
        raise ValueError(f"{name}: sizes must be three ints [P, Q, R] >= 0, got {sizes}")
    if output_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: output_type must be 1 (float32) or 10 (float16), got {output_type}")
    attributes = {"sizes": sizes, "output_type": int(output_type)}
    if input_type is not None:
        if input_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            raise ValueError(f"{name}: input_type must be 1 (float32) or 10 (float16), got {input_type}")
        attributes["input_type"] = int(input_type)
    if output_shape is not None:
        shape = [int(d) for d in output_shape]
        if min(shape, default=0) < 0 or math.prod(shape) != sizes[1]:
            raise ValueError(f"{name}: output_shape {shape} must hold Q = {sizes[1]} elements")
        attributes["output_shape"] = shape
    return helper.make_node("BlockReduceSum", [x], [output], name=name, domain=DOMAIN, **attributes)
