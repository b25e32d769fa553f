"""Build the bundled example model ``onnxcampo/examples/mlp_block.onnx``.

A transformer-style MLP block (LayerNorm -> MatMul -> Gelu -> MatMul -> residual Add -> LogSoftmax
head) with an FFN width of 900, not a multiple of 8. Batch is dynamic; the README pins it to
16384 rows with ``--input-shape``, where one run shows every decision: the MatMul chain in
fp16 (it pays only as a whole), the 900 padded to 904 for Tensor Cores, the LogSoftmax
(deny list) in fp32. At a few hundred rows nothing pays and the model stays fp32.

    python scripts/make_example.py
"""

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, FFN, CLASSES = 256, 900, 10


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def weight(name, *shape, scale=0.02):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    initializers = [
        weight("ln_scale", HIDDEN, scale=1.0), weight("ln_bias", HIDDEN),
        weight("w_up", HIDDEN, FFN), weight("b_up", FFN),
        weight("w_down", FFN, HIDDEN), weight("b_down", HIDDEN),
        weight("w_head", HIDDEN, CLASSES), weight("b_head", CLASSES),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln_scale", "ln_bias"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["ln", "w_up"], ["up"], name="up_proj"),
        helper.make_node("Add", ["up", "b_up"], ["up_b"], name="up_bias"),
        helper.make_node("Gelu", ["up_b"], ["act"], name="gelu"),
        helper.make_node("MatMul", ["act", "w_down"], ["down"], name="down_proj"),
        helper.make_node("Add", ["down", "b_down"], ["down_b"], name="down_bias"),
        helper.make_node("Add", ["down_b", "x"], ["res"], name="residual"),
        helper.make_node("MatMul", ["res", "w_head"], ["logits"], name="head"),
        helper.make_node("Add", ["logits", "b_head"], ["logits_b"], name="head_bias"),
        helper.make_node("LogSoftmax", ["logits_b"], ["log_probs"], name="log_softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "mlp_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", HIDDEN])],
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["batch", CLASSES])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10,
                              producer_name="onnxcampo-example")
    onnx.checker.check_model(model, full_check=True)
    return model


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "onnxcampo" / "examples" / "mlp_block.onnx"
    onnx.save(build(), str(out))
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
