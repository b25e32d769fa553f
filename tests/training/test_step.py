"""Training-step graphs (forward + loss + onnx-ad backward + update) and the Trainer, on CPU."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnxcampo.errors import ConfigError
# the MLP and its data (other tests import them from here too)
from onnxcampo.examples.training_mlp import B1, CLASSES, TARGET, W1, W2, X, mlp  # noqa: F401
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec


def numpy_gradients(loss: str) -> tuple[float, dict[str, np.ndarray]]:
    """Hand-written backward pass of the MLP (float64), the reference for onnx-ad's graph."""
    x, w1, b1, w2 = (a.astype(np.float64) for a in (X, W1, B1, W2))
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    y = a @ w2
    if loss == "mse":
        value = np.mean((y - TARGET) ** 2)
        dy = 2 * (y - TARGET) / y.size
    else:
        shifted = y - y.max(axis=1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        value = -np.mean(logp[np.arange(len(CLASSES)), CLASSES])
        onehot = np.eye(3)[CLASSES]
        dy = (np.exp(logp) - onehot) / len(CLASSES)
    dw2 = a.T @ dy
    dh = (dy @ w2.T) * (h > 0)
    return float(value), {"w1": x.T @ dh, "b1": dh.sum(axis=0), "w2": dw2}


@pytest.mark.parametrize("loss, labels", [("mse", TARGET), ("cross_entropy", CLASSES)])
def test_sgd_step_applies_the_exact_gradient(loss, labels):
    """One SGD step moves each weight by lr x its gradient, the gradient matching a hand-written
    backward pass; weights are graph inputs (fp32 master copies) paired with '.updated' outputs."""
    step = build_train_step(mlp(), loss=loss, optimizer="sgd", lr=0.1)
    spec = step_spec(step)
    assert set(spec.weights) == {"w1", "b1", "w2"} and spec.state == ()
    assert set(spec.batch) == {"x", "labels"}
    assert not step.graph.initializer or all(t.name not in spec.weights for t in step.graph.initializer)
    feeds = {"x": X, "labels": labels, "lr": np.array(0.1, np.float32), "w1": W1, "b1": B1, "w2": W2}
    out = run(make_session(step), feeds)
    value, grads = numpy_gradients(loss)
    assert out["loss"] == pytest.approx(value, rel=1e-5)
    for name, weight in (("w1", W1), ("b1", B1), ("w2", W2)):
        np.testing.assert_allclose((weight - out[name + ".updated"]) / 0.1, grads[name], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
@pytest.mark.parametrize("loss, labels", [("mse", TARGET), ("cross_entropy", CLASSES)])
def test_trainer_lowers_the_loss(optimizer, loss, labels):
    forward = mlp()
    lr = {"sgd": 0.2, "momentum": 0.05, "adamw": 0.01}[optimizer]
    step = build_train_step(forward, loss=loss, optimizer=optimizer, lr=lr)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    losses = [trainer.step({"x": X, "labels": labels}) for _ in range(60)]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.6 * losses[0]
    assert trainer.steps == 60


def test_momentum_matches_the_update_rule():
    """v' = mu v + g; w' = w - lr v' over two steps (state in '.momentum' inputs/outputs)."""
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1, momentum=0.5)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    _, g1 = numpy_gradients("mse")
    trainer.step({"x": X, "labels": TARGET})
    state = trainer.state_dict()
    np.testing.assert_allclose(state["w2.momentum"], g1["w2"], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(state["w2"], W2 - 0.1 * g1["w2"], rtol=1e-4, atol=1e-6)


def test_export_carries_the_trained_weights():
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="sgd", lr=0.05)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    for _ in range(5):
        trainer.step({"x": X, "labels": TARGET})
    trained = trainer.export(forward)
    y = run(make_session(trained), {"x": X})["y"]
    expected = np.mean((y - TARGET) ** 2)
    assert trainer.step({"x": X, "labels": TARGET}) == pytest.approx(expected, rel=1e-4)
    assert not np.allclose(numpy_helper.to_array(trained.graph.initializer[0]), W1)


def test_frozen_weights_stay_constants():
    step = build_train_step(mlp(), loss="mse", optimizer="sgd", freeze="^b1$")
    assert set(step_spec(step).weights) == {"w1", "w2"}
    assert "b1" in {t.name for t in step.graph.initializer}


def test_bad_options_and_batches():
    with pytest.raises(ConfigError, match="unknown loss"):
        build_train_step(mlp(), loss="hinge")
    with pytest.raises(ConfigError, match="unknown optimizer"):
        build_train_step(mlp(), optimizer="lion")
    with pytest.raises(ConfigError, match="nothing|no float initializer"):
        build_train_step(mlp(), freeze=".")
    forward = mlp()
    step = build_train_step(forward)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    with pytest.raises(ConfigError, match="missing \\['labels'\\]"):
        trainer.step({"x": X})
    with pytest.raises(ConfigError, match="CUDA graphs need provider 'cuda', not 'cpu'"):
        Trainer(step, cuda_graph=True)


def test_optimized_step_keeps_fp32_master_weights_and_trains():
    """An amp-optimized step graph: weights stay fp32 graph inputs and outputs (cast inside the
    graph), and it still trains on ORT CPU."""
    import onnxcampo

    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.05)
    optimized = onnxcampo.optimize(step, policy="amp").model
    onnx.checker.check_model(optimized, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (*optimized.graph.input, *optimized.graph.output)}
    assert all(types[w] == TensorProto.FLOAT and types[w + ".updated"] == TensorProto.FLOAT for w in ("w1", "b1", "w2"))
    assert any(n.op_type == "Cast" for n in optimized.graph.node)
    trainer = Trainer(optimized, weights=initial_weights(forward, step))
    losses = [trainer.step({"x": X, "labels": TARGET}) for _ in range(40)]
    assert losses[-1] < 0.6 * losses[0]


def test_command_line_builds_and_trains(tmp_path, capsys):
    from onnxcampo.cli import main

    forward, step, data, log, out = (tmp_path / n for n in ("fwd.onnx", "step.onnx", "data.npz", "log.jsonl", "trained.onnx"))
    onnx.save(mlp(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--loss", "cross_entropy", "--optimizer", "adamw", "--lr", "0.01"]) == 0
    np.savez(data, x=X, labels=CLASSES)
    assert main(["train", str(step), "--forward", str(forward), "--data", str(data), "--steps", "30",
                 "--log", str(log), "--out", str(out)]) == 0
    losses = [__import__("json").loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 30 and losses[-1] < losses[0]
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    assert main(["train", str(step), "--forward", str(forward), "--data", str(tmp_path / "none.npz")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["train", str(step), "--data", str(data), "--cuda-graph"]) == 2  # CPU provider: refused
    assert "CUDA graphs need provider 'cuda'" in capsys.readouterr().err


def test_trainer_leaves_the_callers_weights_alone():
    """On the CPU an OrtValue borrows numpy memory: the Trainer must train copies."""
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1)
    weights = initial_weights(forward, step)
    before = {name: value.copy() for name, value in weights.items()}
    trainer = Trainer(step, weights=weights)
    for _ in range(3):
        trainer.step({"x": X, "labels": TARGET})
    for name, value in weights.items():
        np.testing.assert_array_equal(value, before[name])
    assert not np.array_equal(trainer.state_dict()["w1"], before["w1"])


def test_trainer_leaves_the_initial_weights_alone():
    """On the CPU an OrtValue wraps the numpy array it is made from; the Trainer must copy the
    initial weights, so two Trainers started from one dict begin at the same point."""
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="sgd", lr=0.1)
    weights = initial_weights(forward, step)
    before = {name: value.copy() for name, value in weights.items()}
    first = Trainer(step, weights=weights)
    losses = [first.step({"x": X, "labels": TARGET}) for _ in range(3)]
    for name, value in weights.items():
        np.testing.assert_array_equal(value, before[name])
    assert Trainer(step, weights=weights).step({"x": X, "labels": TARGET}) == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.slow
def test_trainer_starts_from_the_weights_the_step_graph_carries(tmp_path):
    """Trainer(step_model_or_path, provider="cpu"): build_train_step stores the starting weights
    (initializers onnxcampo.initial/<w>, read by no node), and optimize keeps them."""
    from onnxcampo.api import optimize

    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1)
    path = tmp_path / "step.amp.onnx"
    optimize(step, policy="amp").save(path)
    reference = Trainer(step, weights=initial_weights(forward, step))
    expected = [reference.step({"x": X, "labels": TARGET}) for _ in range(3)]
    carried = Trainer(step)
    assert [carried.step({"x": X, "labels": TARGET}) for _ in range(3)] == expected
    amp = Trainer(path, provider="cpu")  # wiring: ORT CPU runs most fp16 nodes in fp32 (close, not equal)
    assert [amp.step({"x": X, "labels": TARGET}) for _ in range(3)] == pytest.approx(expected, rel=1e-2)
    np.testing.assert_array_equal(initial_weights(None, step)["w1"], W1)


def test_train_command_without_forward_uses_the_carried_weights(tmp_path):
    forward, step = tmp_path / "mlp.onnx", tmp_path / "step.onnx"
    onnx.save(mlp(), forward)
    from onnxcampo.cli import main

    assert main(["train-graph", str(forward), str(step), "--loss", "mse"]) == 0
    np.savez(tmp_path / "data.npz", x=X, labels=TARGET)
    assert main(["train", str(step), "--data", str(tmp_path / "data.npz"), "--steps", "3"]) == 0
    assert main(["train", str(step), "--data", str(tmp_path / "data.npz"), "--steps", "3",
                 "--out", str(tmp_path / "o.onnx")]) == 2  # --out needs the forward model


def test_fixed_buffer_steps_of_the_cuda_graph_path_equal_plain_steps():
    """The CUDA-graph path (batch, lr and loss in fixed buffers updated in place, one binding per
    ping-pong side, run option gpu_graph_id) computes the plain path's steps. CUDA graphs need a
    GPU; the CPU session runs the same bindings and ignores the graph id."""
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1)
    plain = Trainer(step, weights=initial_weights(forward, step))
    fixed = Trainer(step, weights=initial_weights(forward, step))
    fixed.cuda_graph = True  # the path, without the CUDA EP option that only a GPU session takes
    rng = np.random.default_rng(3)
    batches = [rng.standard_normal(X.shape).astype(np.float32) for _ in range(4)]
    kept = [x.copy() for x in batches]
    for x in batches:  # different batches of one shape: copied into the same buffers
        assert fixed.step({"x": x, "labels": TARGET}) == pytest.approx(plain.step({"x": x, "labels": TARGET}), rel=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(batches, kept))  # the caller's arrays are left alone
    for name, value in plain.state_dict().items():
        np.testing.assert_allclose(fixed.state_dict()[name], value, rtol=1e-6)
    with pytest.raises(ConfigError, match=r"partial batch: x, labels have 1 row, the step graph takes 32"):
        fixed.step({"x": X[:1], "labels": TARGET[:1]})
    with pytest.raises(ConfigError, match=r"batch input x \(host array\) has shape \[1, 8\]; the step graph takes float32\[32, 8\]"):
        fixed.step({"x": X[:1], "labels": TARGET})  # not cut short everywhere: not a partial batch


def _with_softmax(op: str) -> onnx.ModelProto:
    """The MLP whose output is a (Log)Softmax of its logits ``y``."""
    from onnx import helper

    model = mlp()
    graph = model.graph
    graph.node.append(helper.make_node(op, ["y"], ["probs"], axis=-1))
    del graph.output[:]
    graph.output.extend([helper.make_tensor_value_info("probs", TensorProto.FLOAT, [32, 3]),
                         helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 3])])
    return model


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_cross_entropy_on_a_softmax_output_warns_that_it_normalizes_twice(op, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.step"):
        build_train_step(_with_softmax(op), loss="cross_entropy")
    said = [r.getMessage() for r in caplog.records if "normalized twice" in r.getMessage()]
    assert len(said) == 1 and f"output of a {op}" in said[0] and "pass output='y'" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.step"):
        build_train_step(_with_softmax(op), loss="cross_entropy", output="y")  # the logits: no warning
        build_train_step(_with_softmax(op), loss="mse")  # another loss: no warning
    assert not [r for r in caplog.records if "normalized twice" in r.getMessage()]


def test_without_the_custom_op_library_the_standard_op_step_is_said_not_silent(monkeypatch, caplog):
    import logging

    from onnxcampo import ops

    monkeypatch.setattr(ops, "available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.step"):
        build_train_step(mlp())
    said = [r.getMessage() for r in caplog.records if "custom-op library is not built" in r.getMessage()]
    assert len(said) == 1 and "python -m onnxcampo.ops.build" in said[0] and "fused=False" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.step"):
        build_train_step(mlp(), fused=False)  # asked for: nothing to say
    assert not caplog.records
