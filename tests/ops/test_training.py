"""Training steps with the fused update equal the standard-op steps (tests/training/test_step.py's
MLP), and the fused graph keeps the step graph's conventions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxcampo import cli, ops
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec
from onnxcampo.training.step import FOUND_INF
from training.test_step import CLASSES, TARGET, X, mlp

LABELS = {"mse": TARGET, "cross_entropy": CLASSES}


def train(optimizer: str, loss: str, fused: bool, steps: int = 4):
    forward = mlp()
    step = build_train_step(forward, loss=loss, optimizer=optimizer, lr=0.05, momentum=0.8, fused=fused)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    losses = [trainer.step({"x": X, "labels": LABELS[loss]}) for _ in range(steps)]
    return step, losses, trainer.state_dict()


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_fused_step_equals_standard_step(library, optimizer, loss):
    step, fused_losses, fused_state = train(optimizer, loss, fused=True)
    _, losses, state = train(optimizer, loss, fused=False)
    assert [n.op_type for n in step.graph.node if n.domain == ops.DOMAIN] == \
        ["MultiTensorAdamW" if optimizer == "adamw" else "MultiTensorSGD"]
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-5)
    assert fused_state.keys() == state.keys()
    for name, value in state.items():
        np.testing.assert_allclose(fused_state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_fused_graph_keeps_names_order_and_a_found_inf_initializer(library, optimizer):
    fused = build_train_step(mlp(), optimizer=optimizer, fused=True)
    plain = build_train_step(mlp(), optimizer=optimizer, fused=False)
    assert [i.name for i in fused.graph.input] == [i.name for i in plain.graph.input]
    assert [o.name for o in fused.graph.output] == [o.name for o in plain.graph.output]
    assert step_spec(fused) == step_spec(plain)
    flag = next(t for t in fused.graph.initializer if t.name == FOUND_INF)
    assert flag.data_type == onnx.TensorProto.BOOL and numpy_helper.to_array(flag).shape == ()
    assert not numpy_helper.to_array(flag)
    update = next(n for n in fused.graph.node if n.domain == ops.DOMAIN)
    assert update.input[1 if optimizer != "adamw" else 2] == FOUND_INF
    assert (ops.DOMAIN, 1) in {(o.domain, o.version) for o in fused.opset_import}
    assert all(o.type.tensor_type.elem_type for o in fused.graph.output)  # ORT rejects elem_type 0
    onnx.checker.check_model(fused, full_check=True)
    assert not ops.uses_ops(plain)


def test_fused_is_the_default_when_the_library_is_available(library):
    assert ops.uses_ops(build_train_step(mlp()))


def test_standard_ops_by_default_without_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv(ops.ENV_VAR, str(tmp_path / "missing.so"))
    assert not ops.uses_ops(build_train_step(mlp()))


def test_train_graph_cli_fused_by_default_and_no_fused_ops(library, tmp_path):
    forward = tmp_path / "mlp.onnx"
    onnx.save(mlp(), forward)
    assert cli.main(["train-graph", str(forward), str(tmp_path / "fused.onnx"), "--optimizer", "adamw"]) == 0
    assert cli.main(["train-graph", str(forward), str(tmp_path / "plain.onnx"), "--optimizer", "adamw",
                     "--no-fused-ops"]) == 0
    assert ops.uses_ops(onnx.load(tmp_path / "fused.onnx"))
    assert not ops.uses_ops(onnx.load(tmp_path / "plain.onnx"))
