"""Bundled example models."""

from __future__ import annotations

import os
import tempfile
from importlib import resources
from pathlib import Path


def mlp_block_path() -> Path:
    return Path(str(resources.files(__name__) / "mlp_block.onnx"))


def quantized_mlp_block(output: str | os.PathLike) -> Path:
    """``mlp_block.onnx`` dynamically quantized by ONNX Runtime (uint8 weights and activations):
    three DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul patterns, the demo of the experimental ``int8_avg``.

    The LayerNormalization weights are renamed first: the quantizer names the scale of the
    quantized ``ln`` tensor ``ln_scale`` and collides with them ("Graph is not a DAG").
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(mlp_block_path()))
    renames = {"ln_scale": "ln_gamma", "ln_bias": "ln_beta"}
    for tensor in model.graph.initializer:
        tensor.name = renames.get(tensor.name, tensor.name)
    for node in model.graph.node:
        node.input[:] = [renames.get(name, name) for name in node.input]
    with tempfile.TemporaryDirectory(prefix="onnxcampo-quantize-") as tmp:
        source = Path(tmp) / "mlp_block.onnx"
        onnx.save(model, str(source))
        quantize_dynamic(str(source), str(output), weight_type=QuantType.QUInt8)
    return Path(output)
