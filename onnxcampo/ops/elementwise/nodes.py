"""The ONNX nodes of the elementwise unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops import elementwise


def fused_elementwise(inputs: Sequence[str], outputs: Sequence[str], *, program: Sequence[int], registers: int,
                      constants: Sequence[float] = (), output_types: Sequence[int],
                      input_types: Sequence[int] = (), column_sums: Sequence[int] | None = None,
                      column_sums_type: int = onnx.TensorProto.FLOAT, column_sums_shape: Sequence[int] | None = None,
                      name: str) -> onnx.NodeProto:
    """``(y_1..y_m) = FusedElementwise(x_1..x_n)``: the register program ``program`` (four ints per
    instruction, :mod:`onnxcampo.ops.elementwise`) run per element of the inputs' broadcast shape;
    output ``k`` is float32 (``output_types[k] == 1``) or float16 (10). The program is checked here
    (:class:`~onnxcampo.ops.elementwise.ProgramError`) as the kernels check it; ``constants`` is
    left out of the node when empty (ONNX has no empty-list attribute without a type).
    ``input_types`` (optional, one per input) are the element types the program was written for:
    the kernels check them, and run the node in fp32 where ORT's CPU provider casts its fp16
    inputs to fp32 (``docs/ops.md``). ``column_sums`` (``[k, Q]``): ``outputs`` holds one more
    name, last, for the column sums of output ``k`` (Q columns) in ``column_sums_type``, shaped
    ``column_sums_shape`` (default ``[Q]``)."""
    summed = column_sums is not None
    if len(outputs) != len(output_types) + summed:
        raise ValueError(f"{name}: {len(outputs)} outputs but {len(output_types)} output_types"
                         + (" and the column sums" if summed else ""))
    elementwise.check(program, registers, constants, len(inputs), output_types)
    attributes = {"program": [int(v) for v in program], "registers": int(registers),
                  "output_types": [int(t) for t in output_types]}
    if len(constants):
        attributes["constants"] = [float(c) for c in constants]
    if len(input_types):
        if len(input_types) != len(inputs) or any(t not in elementwise.NUMPY_TYPES for t in input_types):
            raise ValueError(f"{name}: input_types must give 1 or 10 for each of the {len(inputs)} inputs")
        attributes["input_types"] = [int(t) for t in input_types]
    if summed:
        elementwise.check_column_sums(column_sums, column_sums_type, column_sums_shape, len(output_types))
        attributes["column_sums"] = [int(v) for v in column_sums]
        attributes["column_sums_type"] = int(column_sums_type)
        if column_sums_shape is not None:
            attributes["column_sums_shape"] = [int(d) for d in column_sums_shape]
    return helper.make_node(elementwise.OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, **attributes)
