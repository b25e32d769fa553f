"""Trainer.evaluate, Trainer.save_checkpoint / load_checkpoint, and train --resume (CPU)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnxcampo.api import optimize
from onnxcampo.cli import main
from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import CLASSES, TARGET, X, mlp
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step, initial_weights

pytestmark = pytest.mark.slow

LABELS = {"mse": TARGET, "cross_entropy": CLASSES}


def batches(n: int, loss: str) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": (X + 0.1 * rng.standard_normal(X.shape)).astype(np.float32), "labels": LABELS[loss]} for _ in range(n)]


@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_evaluate_is_the_forward_on_the_current_weights(loss):
    forward = mlp()
    step = build_train_step(forward, loss=loss, optimizer="momentum", lr=0.05)
    trainer = Trainer(step)
    for batch in batches(3, loss):
        trainer.step(batch)
    before = trainer.state_dict()
    out = trainer.evaluate({"x": X})
    assert list(out) == ["y"]
    expected = run(make_session(trainer.export(forward)), {"x": X})["y"]
    np.testing.assert_allclose(out["y"], expected, rtol=1e-6, atol=1e-7)
    with_loss = trainer.evaluate({"x": X, "labels": LABELS[loss]})
    np.testing.assert_array_equal(with_loss["y"], out["y"])
    # the loss is the one the next step reports (it is computed before that step's update)
    after = trainer.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before) and trainer.steps == 3
    assert trainer.step({"x": X, "labels": LABELS[loss]}) == pytest.approx(float(with_loss["loss"]), rel=1e-6)
    with pytest.raises(ConfigError, match="unknown"):
        trainer.evaluate({"x": X, "extra": X})
    with pytest.raises(ConfigError, match="missing"):
        trainer.evaluate({"labels": LABELS[loss]})


def _run(step, batches_, trainer=None):
    trainer = trainer or Trainer(step)
    return trainer, [trainer.step(batch) for batch in batches_]


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_resumed_run_equals_an_uninterrupted_one_bit_for_bit(tmp_path, optimizer):
    step = build_train_step(mlp(), loss="cross_entropy", optimizer=optimizer, lr=0.05)
    data = batches(10, "cross_entropy")
    straight, losses = _run(step, data)
    first, head = _run(step, data[:5])
    first.save_checkpoint(tmp_path / "ckpt.npz")
    resumed = Trainer(step, lr=0.5)  # lr comes back from the checkpoint
    resumed.load_checkpoint(tmp_path / "ckpt.npz")
    assert resumed.steps == 5 and resumed.lr == first.lr
    _, tail = _run(step, data[5:], resumed)
    assert head + tail == losses  # exact: same float32 bits
    final, expected = resumed.state_dict(), straight.state_dict()
    assert sorted(final) == sorted(expected) and resumed.steps == straight.steps == 10
    for name in expected:
        np.testing.assert_array_equal(final[name], expected[name])
    if optimizer == "adamw":
        assert "step" in final and "w1.adam_m" in final


def test_resume_keeps_the_loss_scaling_state(tmp_path):
    forward = mlp()
    step = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.05)
    amp = optimize(step, policy="amp").model
    data = batches(8, "mse")
    weights = initial_weights(forward, step)
    straight, losses = _run(amp, data, Trainer(amp, weights=weights))
    first, head = _run(amp, data[:4], Trainer(amp, weights=weights))
    first.save_checkpoint(tmp_path / "amp.npz")
    resumed = Trainer(amp, weights=weights)
    resumed.load_checkpoint(tmp_path / "amp.npz")
    assert resumed.loss_scale == first.loss_scale is not None
    _, tail = _run(amp, data[4:], resumed)
    assert head + tail == losses and resumed.loss_scale == straight.loss_scale
    state = resumed.state_dict()
    assert {"loss_scale", "loss_scale_clean_steps"} <= set(state)


def test_checkpoint_format_and_mismatches(tmp_path):
    step = build_train_step(mlp(), loss="mse", optimizer="adamw", lr=0.01)
    trainer = Trainer(step)
    trainer.step(batches(1, "mse")[0])
    path = tmp_path / "ckpt.npz"
    trainer.save_checkpoint(path)
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt.npz"]  # no temporary file left
    with np.load(path) as data:  # plain numpy reads it
        meta = json.loads(str(data["onnxcampo.checkpoint"]))
        assert meta["format"] == 1 and meta["steps"] == 1 and "x" in meta["inputs"]
        assert set(data.files) == {"onnxcampo.checkpoint", *trainer.state_dict()}
    other = Trainer(build_train_step(mlp(), loss="mse", optimizer="momentum", lr=0.01))
    with pytest.raises(ConfigError, match="does not match the step graph: missing .*momentum") as error:
        other.load_checkpoint(path)
    assert "\n" not in str(error.value)
    arrays = dict(np.load(path))
    arrays["w1"] = arrays["w1"][:1]
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConfigError, match=r"w1 is float32\[1, 8\], the graph wants float32\[4, 8\]|w1 is float32"):
        trainer.load_checkpoint(tmp_path / "bad.npz")
    np.savez(tmp_path / "plain.npz", w1=arrays["w1"])
    with pytest.raises(ConfigError, match="not an onnxcampo checkpoint"):
        trainer.load_checkpoint(tmp_path / "plain.npz")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        trainer.load_checkpoint(tmp_path / "none.npz")
    assert trainer.steps == 1


def test_train_command_saves_and_resumes(tmp_path):
    forward, step, data = tmp_path / "fwd.onnx", tmp_path / "step.onnx", tmp_path / "data.npz"
    onnx.save(mlp(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--loss", "cross_entropy", "--optimizer", "adamw"]) == 0
    x = np.stack([b["x"] for b in batches(6, "cross_entropy")])
    np.savez(data, x=x, labels=CLASSES)
    straight, head, tail = (tmp_path / n for n in ("straight.jsonl", "head.jsonl", "tail.jsonl"))
    ckpt = tmp_path / "run.ckpt.npz"
    assert main(["train", str(step), "--data", str(data), "--steps", "10", "--log", str(straight)]) == 0
    assert main(["train", str(step), "--data", str(data), "--steps", "4", "--log", str(head),
                 "--save-checkpoint", str(ckpt)]) == 0
    assert main(["train", str(step), "--data", str(data), "--steps", "6", "--log", str(tail), "--resume", str(ckpt)]) == 0

    def rows(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    assert rows(head) + rows(tail) == rows(straight)
    assert [r["step"] for r in rows(tail)] == list(range(5, 11))


def test_train_command_lr_schedule(tmp_path, capsys):
    forward, step, data, log = tmp_path / "fwd.onnx", tmp_path / "step.onnx", tmp_path / "data.npz", tmp_path / "log.jsonl"
    onnx.save(mlp(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--loss", "mse", "--optimizer", "momentum", "--lr", "0.05"]) == 0
    np.savez(data, x=X, labels=TARGET)
    assert main(["train", str(step), "--data", str(data), "--steps", "6", "--lr", "0.1",
                 "--lr-schedule", "warmup:2,step:2:0.5", "--log", str(log)]) == 0
    lrs = [json.loads(line)["lr"] for line in log.read_text().splitlines()]
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.05, 0.05])
    assert main(["train", str(step), "--data", str(data), "--lr-schedule", "cosine:x"]) == 2
    assert "--lr-schedule 'cosine:x': the total steps must be an integer" in capsys.readouterr().err
    assert main(["train", str(step), "--data", str(data), "--resume", str(tmp_path / "none.npz")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
