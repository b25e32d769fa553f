"""A two-layer MLP (8 -> 16 -> 3, batch 32) with fixed weights and data, for training checks.

The training tests train it (``tests/gpu/test_trainer_cuda.py`` on CUDA too): ``mlp()`` is the forward
model (weights as initializers), ``X`` the batch, ``TARGET`` (mse) and ``CLASSES`` (cross entropy)
its labels. ``wide_mlp()`` is a larger one with a bias on both layers, big enough that campo's
cost model makes its products fp16.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_RNG = np.random.default_rng(0)
W1 = (_RNG.standard_normal((8, 16)) * 0.3).astype(np.float32)
B1 = (_RNG.standard_normal(16) * 0.1).astype(np.float32)
W2 = (_RNG.standard_normal((16, 3)) * 0.3).astype(np.float32)
X = _RNG.standard_normal((32, 8)).astype(np.float32)
TARGET = _RNG.standard_normal((32, 3)).astype(np.float32)
CLASSES = _RNG.integers(0, 3, 32).astype(np.int64)


def mlp() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["h2"]),
         helper.make_node("Relu", ["h2"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 3])],
        [numpy_helper.from_array(W1, "w1"), numpy_helper.from_array(B1, "b1"), numpy_helper.from_array(W2, "w2")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def wide_mlp(rows: int = 256, width: int = 512) -> onnx.ModelProto:
    """x @ w1 + b1 -> Relu -> @ w2 + b2 (64 outputs): b1's gradient in a step is a weight-gradient
    sum, b2's part of the loss's."""
    rng = np.random.default_rng(3)
    w1 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    w2 = (rng.standard_normal((width, 64)) / np.sqrt(width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["h2"]),
         helper.make_node("Relu", ["h2"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y0"]),
         helper.make_node("Add", ["y0", "b2"], ["y"])],
        "wide_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 64])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.full(width, 0.1, np.float32), "b1"),
         numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(np.zeros(64, np.float32), "b2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
