"""The float-label losses (bce_with_logits, l1, huber) and the choice of the model output the loss
reads (``output=`` / ``train-graph --output``), on ORT CPU against numpy references."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import B1, TARGET, W1, W2, X, mlp
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step, step_spec
from onnxcampo.training.scaling import fp32_nodes

BINARY = (TARGET > 0).astype(np.float32)  # 0/1 targets for bce_with_logits
SOFT = (1 / (1 + np.exp(-TARGET))).astype(np.float32)  # soft targets in (0, 1)


def reference(loss: str, y: np.ndarray, t: np.ndarray, delta: float = 1.0) -> tuple[float, np.ndarray]:
    """The loss (float64) and its gradient with respect to the prediction ``y``."""
    y, t = y.astype(np.float64), t.astype(np.float64)
    d = y - t
    if loss == "l1":
        return float(np.mean(np.abs(d))), np.sign(d) / d.size
    if loss == "huber":
        small = np.abs(d) < delta
        value = np.where(small, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))
        return float(np.mean(value)), np.where(small, d, delta * np.sign(d)) / d.size
    assert loss == "bce_with_logits"
    p = 1 / (1 + np.exp(-y))
    value = -(t * np.log(p) + (1 - t) * np.log(1 - p))
    return float(np.mean(value)), (p - t) / d.size


def mlp_gradients(loss: str, labels: np.ndarray, delta: float = 1.0) -> tuple[float, dict[str, np.ndarray]]:
    x, w1, b1, w2 = (a.astype(np.float64) for a in (X, W1, B1, W2))
    h = x @ w1 + b1
    a = np.maximum(h, 0)
    value, dy = reference(loss, a @ w2, labels, delta)
    dh = (dy @ w2.T) * (h > 0)
    return value, {"w1": x.T @ dh, "b1": dh.sum(axis=0), "w2": a.T @ dy}


def feeds(labels: np.ndarray, lr: float = 0.1) -> dict[str, np.ndarray]:
    return {"x": X, "labels": labels, "lr": np.array(lr, np.float32), "w1": W1, "b1": B1, "w2": W2}


CASES = [("bce_with_logits", BINARY, 1.0), ("bce_with_logits", SOFT, 1.0), ("l1", TARGET, 1.0),
         ("huber", TARGET, 1.0), ("huber", TARGET, 0.5)]


@pytest.mark.parametrize("fused", [False, None])
@pytest.mark.parametrize("loss, labels, delta", CASES)
def test_sgd_step_applies_the_exact_gradient(loss, labels, delta, fused):
    """The loss equals the numpy reference and one SGD step moves each weight by lr x the
    analytic gradient (float64 backward pass of the MLP)."""
    step = build_train_step(mlp(), loss=loss, optimizer="sgd", lr=0.1, huber_delta=delta, fused=fused)
    assert step_spec(step).loss == loss and set(step_spec(step).batch) == {"x", "labels"}
    assert next(i for i in step.graph.input if i.name == "labels").type.tensor_type.elem_type == TensorProto.FLOAT
    out = run(make_session(step), feeds(labels))
    value, grads = mlp_gradients(loss, labels, delta)
    assert out["loss"] == pytest.approx(value, rel=1e-5)
    for name, weight in (("w1", W1), ("b1", B1), ("w2", W2)):
        np.testing.assert_allclose((weight - out[name + ".updated"]) / 0.1, grads[name], rtol=2e-3, atol=1e-6)


def test_huber_covers_both_branches():
    """The data puts prediction errors on both sides of delta, so both huber branches are tested."""
    x, w1, b1, w2 = (a.astype(np.float64) for a in (X, W1, B1, W2))
    errors = np.abs(np.maximum(x @ w1 + b1, 0) @ w2 - TARGET)
    for delta in (1.0, 0.5):
        assert (errors < delta).any() and (errors > delta).any()


@pytest.mark.parametrize("loss, labels", [("bce_with_logits", BINARY), ("l1", TARGET), ("huber", TARGET)])
def test_gradient_matches_finite_differences(loss, labels):
    """Central differences of the loss (the step graph's own forward, float64 steps) agree with
    the step's gradient for a few w2 entries."""
    step = build_train_step(mlp(), loss=loss, optimizer="sgd", lr=1.0, fused=False)
    session = make_session(step)
    base = feeds(labels, lr=1.0)
    grad = W2 - run(session, base)["w2.updated"]
    eps = 1e-2
    for index in [(0, 0), (3, 1), (7, 2), (15, 0)]:
        values = []
        for sign in (1, -1):
            w2 = W2.copy()
            w2[index] += sign * eps
            values.append(float(run(session, {**base, "w2": w2})["loss"]))
        assert (values[0] - values[1]) / (2 * eps) == pytest.approx(float(grad[index]), rel=0.05, abs=2e-4)


def test_bce_with_logits_is_stable_for_large_logits():
    """max(x, 0) - x y + log(1 + exp(-|x|)): finite for logits of +-100 where log(sigmoid) is not."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "w")])
    step = build_train_step(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
                            loss="bce_with_logits", lr=1.0, fused=False)
    x = np.array([100.0, -100.0, 100.0, -100.0], np.float32)
    t = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
    out = run(make_session(step), {"x": x, "labels": t, "lr": np.array(1.0, np.float32), "w": np.ones(4, np.float32)})
    assert out["loss"] == pytest.approx(50.0, rel=1e-6)  # (0 + 0 + 100 + 100) / 4
    grad_w = 1.0 - out["w.updated"]  # d/dw = (sigmoid(x) - t) x / 4
    np.testing.assert_allclose(grad_w, [0.0, 0.0, 25.0, 25.0], atol=1e-5)


@pytest.mark.parametrize("loss", ["bce_with_logits", "l1", "huber"])
def test_loss_nodes_stay_fp32(loss):
    """Every loss/* node reads only the prediction, the labels and constants: fp32_nodes keeps it."""
    step = build_train_step(mlp(), loss=loss)
    names = {n.name for n in step.graph.node if n.name.startswith("loss/")}
    assert names and names <= fp32_nodes(step)


def two_outputs() -> onnx.ModelProto:
    """The MLP with its hidden activation ``a`` (16 wide) listed before the prediction ``y``."""
    model = mlp()
    outputs = list(model.graph.output)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [32, 16]))
    model.graph.output.extend(outputs)
    return model


def test_output_picks_the_prediction():
    """output="y" reads the second output (the MLP's values and gradients); the default reads the
    first (here the 16-wide hidden activation); the step returns no model output either way."""
    step = build_train_step(two_outputs(), loss="l1", output="y", fused=False)
    assert [o.name for o in step.graph.output] == ["loss", "w1.updated", "b1.updated", "w2.updated"]
    out = run(make_session(step), feeds(TARGET))
    value, grads = mlp_gradients("l1", TARGET)
    assert out["loss"] == pytest.approx(value, rel=1e-5)
    np.testing.assert_allclose((W2 - out["w2.updated"]) / 0.1, grads["w2"], rtol=2e-3, atol=1e-6)
    first = build_train_step(two_outputs(), loss="l1", fused=False)
    labels = next(i for i in first.graph.input if i.name == "labels")
    assert [d.dim_value for d in labels.type.tensor_type.shape.dim] == [32, 16]
    assert "w2" not in step_spec(first).weights  # no gradient path from the hidden activation to w2


def test_errors():
    with pytest.raises(ConfigError, match=r"^the model has no output 'z'; its outputs: a, y$"):
        build_train_step(two_outputs(), output="z")
    with pytest.raises(ConfigError, match="huber_delta must be a positive number"):
        build_train_step(mlp(), loss="huber", huber_delta=0.0)
    with pytest.raises(ConfigError, match="unknown loss 'hinge'; choose one of .*bce_with_logits, l1, huber"):
        build_train_step(mlp(), loss="hinge")


def test_command_line_output_and_loss(tmp_path, capsys):
    from onnxcampo.cli import main

    forward, step_path = tmp_path / "fwd.onnx", tmp_path / "step.onnx"
    onnx.save(two_outputs(), str(forward))
    assert main(["train-graph", str(forward), str(step_path), "--loss", "huber", "--huber-delta", "0.5",
                 "--output", "y", "--no-fused-ops"]) == 0
    assert "huber of y" in capsys.readouterr().err
    step = onnx.load(str(step_path))
    out = run(make_session(step), feeds(TARGET))
    assert out["loss"] == pytest.approx(mlp_gradients("huber", TARGET, 0.5)[0], rel=1e-5)
    assert main(["train-graph", str(forward), str(tmp_path / "bad.onnx"), "--output", "nope"]) == 2
    err = capsys.readouterr().err
    assert "the model has no output 'nope'; its outputs: a, y" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("loss, labels", [("bce_with_logits", BINARY), ("l1", TARGET), ("huber", TARGET)])
def test_trainer_lowers_the_loss_and_the_amp_plan_keeps_the_loss_fp32(loss, labels):
    """Trained as-is and after `optimize --policy amp`: the loss goes down, and the optimized
    graph computes every loss/* node in fp32 (no fp16 value enters or leaves one)."""
    import onnxcampo
    from onnxcampo.training import Trainer, initial_weights

    forward = mlp()
    step = build_train_step(forward, loss=loss, optimizer="momentum", lr=0.05)
    optimized = onnxcampo.optimize(step, policy="amp").model
    onnx.checker.check_model(optimized, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(optimized)
    types = {v.name: v.type.tensor_type.elem_type
             for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    types.update({t.name: t.data_type for t in inferred.graph.initializer})
    assert TensorProto.FLOAT16 in types.values()  # the plan did make the forward fp16
    loss_nodes = [n for n in inferred.graph.node if n.name.startswith("loss/")]
    assert loss_nodes
    for node in loss_nodes:
        assert all(types.get(t) != TensorProto.FLOAT16 for t in (*node.input, *node.output) if t), node.name
    for model in (step, optimized):
        trainer = Trainer(model, weights=initial_weights(forward, step))
        losses = [trainer.step({"x": X, "labels": labels}) for _ in range(60)]
        assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0]


def test_command_line_loss_choices_are_the_library_losses():
    from onnxcampo.cli import build_parser
    from onnxcampo.training import LOSSES

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    loss = next(a for a in sub.choices["train-graph"]._actions if a.dest == "loss")
    assert tuple(loss.choices) == LOSSES
