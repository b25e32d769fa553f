"""The helpers the units' node builders share: the opset import, list and type checks."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN, OPSET_VERSION


def import_domain(model: onnx.ModelProto) -> None:
    """Add the ``ai.onnxcampo`` opset import if the model lacks it."""
    if not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))


def same_length(name: str, **lists: Sequence[str]) -> None:
    lengths = {key: len(value) for key, value in lists.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"{name}: lists must be non-empty and of one length, got {lengths}")


def check_output_type(name: str, output_type: int) -> int:
    if output_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: output_type must be 1 (float32) or 10 (float16), got {output_type}")
    return int(output_type)
