"""Data for the Trainer: the last partial batch, torch DataLoader batches, ``train --data FOLDER``.

A step graph's shapes are static, so a batch with fewer rows is named as a partial batch (one
ConfigError with the sizes) or, under ``partial_batch="drop"``, skipped; a second step graph for
the remainder's size takes it, with the state moved over through a checkpoint. torch tests skip
without torch (CI has none).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from onnxcampo.cli import main
from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import TARGET, X, mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training.batches import BatchShapeError, InputSpec, PartialBatch, input_specs, partial_batch
from onnxcampo.training.data import NpzBatches, npz_header

ROWS = 32  # the MLP's batch


@pytest.fixture(scope="module")
def step():
    return build_train_step(mlp(), loss="mse", optimizer="momentum", lr=0.1)


def _trainer(step, **options):
    return Trainer(step, weights=initial_weights(mlp(), step), **options)


def _dataset(rows, seed=7):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 8)).astype(np.float32), rng.standard_normal((rows, 3)).astype(np.float32)


def _dynamic_mlp() -> onnx.ModelProto:
    """The MLP with a symbolic batch dim, so step graphs can be built for any batch size."""
    model = mlp()
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    return model


# --- partial_batch: what counts as one -------------------------------------------------------

SPECS = {"x": InputSpec("x", np.dtype(np.float32), (32, 8)), "labels": InputSpec("labels", np.dtype(np.int64), (32,)),
         "scale": InputSpec("scale", np.dtype(np.float32), ())}


def _errors(**shapes):
    return [BatchShapeError(SPECS[name], shape, "host array") for name, shape in shapes.items()]


def test_a_batch_cut_short_in_every_input_with_the_batch_dim_is_a_partial_batch():
    assert partial_batch(SPECS, _errors(x=(20, 8), labels=(20,))) == PartialBatch(("x", "labels"), 20, 32)


@pytest.mark.parametrize("shapes", [
    {"x": (20, 8)},                      # labels still has 32 rows: a mismatch, not a partial batch
    {"x": (20, 8), "labels": (10,)},     # cut short by different counts
    {"x": (40, 8), "labels": (40,)},     # more rows than the graph takes
    {"x": (20, 4), "labels": (20,)},     # another dim differs too
    {"x": (20,), "labels": (20,)},       # another rank
    {"x": (0, 8), "labels": (0,)},       # an empty batch
])
def test_other_shape_mismatches_are_not_partial_batches(shapes):
    assert partial_batch(SPECS, _errors(**shapes)) is None


# --- the Trainer --------------------------------------------------------------------------------

def test_a_partial_batch_is_one_error_naming_the_sizes_by_default(step):
    trainer = _trainer(step)
    with pytest.raises(ConfigError) as error:
        trainer.step({"x": X[:20], "labels": TARGET[:20]})
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("partial batch: x, labels have 20 rows, the step graph takes 32 (its shapes are static)")
    assert "drop_last=True" in message and "partial_batch='drop'" in message
    assert trainer.steps == 0
    with pytest.raises(ConfigError, match="partial batch: x, labels have 20 rows, .*: pad it to 32 rows and ignore"):
        trainer.evaluate({"x": X[:20], "labels": TARGET[:20]})  # evaluation has the static shapes too
    with pytest.raises(ConfigError, match="partial_batch must be one of error, drop"):
        _trainer(step, partial_batch="pad")


def test_a_dropped_partial_batch_changes_nothing(step):
    trainer, reference = _trainer(step, partial_batch="drop"), _trainer(step)
    assert trainer.step({"x": X, "labels": TARGET}) == reference.step({"x": X, "labels": TARGET})
    before = trainer.state_dict()
    assert trainer.step({"x": X[:20], "labels": TARGET[:20]}) is None
    assert (trainer.steps, trainer.dropped) == (1, 1)
    assert all(np.array_equal(value, before[name]) for name, value in trainer.state_dict().items())
    with pytest.raises(ConfigError, match=r"batch input x \(host array\) has shape \[20, 8\]"):
        trainer.step({"x": X[:20], "labels": TARGET})  # not a partial batch: still an error
    assert trainer.step({"x": X, "labels": TARGET}) == reference.step({"x": X, "labels": TARGET})


def test_a_second_step_graph_for_the_remainder_size_takes_the_partial_batch_and_the_state():
    """The documented way to train on the remainder: a step graph built for its size, the
    state moved over (and back) through a checkpoint; the result equals a step on a Trainer
    built for that size from the same state."""
    forward = _dynamic_mlp()
    full = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1, input_shapes={"x": (ROWS, 8)})
    tail = build_train_step(forward, loss="mse", optimizer="momentum", lr=0.1, input_shapes={"x": (20, 8)})
    x, y = _dataset(ROWS + 20)
    main_trainer = Trainer(full, weights=initial_weights(forward, full))
    main_trainer.step({"x": x[:ROWS], "labels": y[:ROWS]})
    state = main_trainer.state_dict()
    with pytest.raises(ConfigError, match="partial batch: x, labels have 20 rows, the step graph takes 32"):
        main_trainer.step({"x": x[ROWS:], "labels": y[ROWS:]})
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/run.npz"
        main_trainer.save_checkpoint(path)
        tail_trainer = Trainer(tail, weights=initial_weights(forward, tail))
        tail_trainer.load_checkpoint(path)
        loss = tail_trainer.step({"x": x[ROWS:], "labels": y[ROWS:]})
        tail_trainer.save_checkpoint(path)
        main_trainer.load_checkpoint(path)
    assert main_trainer.steps == 2 and np.isfinite(loss)
    # the same update by hand: the tail step graph's mse over 20 rows, from the first step's state
    expected = float(np.mean((np.maximum(x[ROWS:] @ state["w1"] + state["b1"], 0) @ state["w2"] - y[ROWS:]) ** 2))
    assert loss == pytest.approx(expected, rel=1e-5)
    assert not np.array_equal(main_trainer.state_dict()["w1"], state["w1"])


# --- torch: tensors and a DataLoader loop --------------------------------------------------------

def test_a_torch_dataloader_loop_trains_like_numpy_batches(step):
    """The loop in docs/guide/training.md: a DataLoader over a TensorDataset (tuples) or a
    dataset of dicts; CPU tensors go in as they are (read through DLPack). The last partial
    batch is the Trainer's one-line error, drop_last=True or partial_batch="drop" skip it."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    x, y = _dataset(3 * ROWS + 5)
    reference = _trainer(step)
    expected = [reference.step({"x": x[i:i + ROWS], "labels": y[i:i + ROWS]}) for i in range(0, 3 * ROWS, ROWS)]

    trainer = _trainer(step)
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=ROWS)
    losses = []
    with pytest.raises(ConfigError, match="partial batch: x, labels have 5 rows, the step graph takes 32"):
        for inputs, labels in loader:
            losses.append(trainer.step({"x": inputs, "labels": labels}))
    assert losses == pytest.approx(expected, rel=1e-6)

    trainer = _trainer(step)
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=ROWS, drop_last=True)
    assert [trainer.step({"x": a, "labels": b}) for a, b in loader] == pytest.approx(expected, rel=1e-6)

    class Rows(Dataset):  # a dataset of dicts: the default collate makes dicts of batched tensors
        def __len__(self):
            return len(x)

        def __getitem__(self, index):
            return {"x": torch.from_numpy(x[index]), "labels": torch.from_numpy(y[index])}

    trainer = _trainer(step, partial_batch="drop")
    losses = [trainer.step(batch) for batch in DataLoader(Rows(), batch_size=ROWS)]
    assert losses[:3] == pytest.approx(expected, rel=1e-6) and losses[3] is None and trainer.dropped == 1


# --- train --data FOLDER -------------------------------------------------------------------------

def _folder(tmp_path, sizes=(ROWS, ROWS, ROWS), name="batches"):
    folder = tmp_path / name
    folder.mkdir()
    x, y = _dataset(sum(sizes))
    start = 0
    for index, rows in enumerate(sizes):
        np.savez(folder / f"b{index:03d}.npz", x=x[start:start + rows], labels=y[start:start + rows])
        start += rows
    return folder, x, y


def _losses(log):
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def _one_error_line(capsys, *fragments):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxcampo: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def test_train_reads_a_folder_of_npz_batches_in_sorted_order_cycling(tmp_path, step, capsys):
    path, log = tmp_path / "step.onnx", tmp_path / "log.jsonl"
    onnx.save(step, str(path))
    folder, x, y = _folder(tmp_path)
    (folder / "notes.txt").write_text("not a batch")  # only .npz files are batches
    assert main(["train", str(path), "--data", str(folder), "--steps", "7", "--log", str(log)]) == 0
    reference = _trainer(step)
    expected = [reference.step({"x": x[i % 3 * ROWS:][:ROWS], "labels": y[i % 3 * ROWS:][:ROWS]}) for i in range(7)]
    assert _losses(log) == pytest.approx(expected, rel=1e-6)
    # a resumed run continues with the file the step count names
    ckpt = tmp_path / "run.npz"
    assert main(["train", str(path), "--data", str(folder), "--steps", "4", "--save-checkpoint", str(ckpt)]) == 0
    assert main(["train", str(path), "--data", str(folder), "--steps", "3", "--resume", str(ckpt),
                 "--log", str(log)]) == 0
    assert _losses(log) == pytest.approx(expected[4:], rel=1e-6)


def test_a_folder_whose_last_batch_is_partial_is_an_error_or_dropped(tmp_path, step, capsys):
    path, log = tmp_path / "step.onnx", tmp_path / "log.jsonl"
    onnx.save(step, str(path))
    folder, x, y = _folder(tmp_path, sizes=(ROWS, ROWS, 12))
    assert main(["train", str(path), "--data", str(folder), "--steps", "3"]) == 2
    _one_error_line(capsys, "b002.npz: partial batch: x, labels have 12 rows, the step graph takes 32",
                    "--partial-batch drop")
    assert main(["train", str(path), "--data", str(folder), "--steps", "4", "--partial-batch", "drop",
                 "--log", str(log)]) == 0
    assert "left out 1 partial batch (b002.npz: 12 rows, the step graph takes 32)" in capsys.readouterr().err
    reference = _trainer(step)
    expected = [reference.step({"x": x[i % 2 * ROWS:][:ROWS], "labels": y[i % 2 * ROWS:][:ROWS]}) for i in range(4)]
    assert _losses(log) == pytest.approx(expected, rel=1e-6)
    only_partial, _, _ = _folder(tmp_path, sizes=(12,), name="partial")
    assert main(["train", str(path), "--data", str(only_partial), "--partial-batch", "drop"]) == 2
    _one_error_line(capsys, "every batch is partial (12 rows, the step graph takes 32): nothing to train on")


@pytest.mark.parametrize("write, fragments", [
    (lambda folder: None, ["no .npz files in this folder"]),
    (lambda folder: np.savez(folder / "a.npz", x=X, y=TARGET),
     ["a.npz: does not match the step graph's batch inputs ['labels', 'x']: missing ['labels'], unknown ['y']"]),
    (lambda folder: (np.savez(folder / "a.npz", x=X, labels=TARGET), np.savez(folder / "b.npz", x=X[:, :4], labels=TARGET)),
     ["b.npz: batch input x (in b.npz) has shape [32, 4]; the step graph takes float32[32, 8]"]),
    (lambda folder: np.savez(folder / "a.npz", x=X.astype(np.float64), labels=TARGET),
     ["a.npz: batch input x (in a.npz) is float64[32, 8]; the step graph takes float32[32, 8]"]),
    (lambda folder: (folder / "a.npz").write_bytes(b"not a zip"), ["a.npz: not a readable .npz"]),
])
def test_a_bad_folder_is_one_error_line_before_any_step(tmp_path, step, capsys, write, fragments):
    path, folder = tmp_path / "step.onnx", tmp_path / "batches"
    onnx.save(step, str(path))
    folder.mkdir()
    write(folder)
    assert main(["train", str(path), "--data", str(folder), "--steps", "2"]) == 2
    _one_error_line(capsys, *fragments)


def test_a_single_file_still_stacks_batches_and_is_checked_up_front(tmp_path, step, capsys):
    path, data, log = tmp_path / "step.onnx", tmp_path / "data.npz", tmp_path / "log.jsonl"
    onnx.save(step, str(path))
    x, y = _dataset(2 * ROWS)
    np.savez(data, x=x.reshape(2, ROWS, 8), labels=y[:ROWS])  # x stacked: two batches; labels shared
    assert main(["train", str(path), "--data", str(data), "--steps", "3", "--log", str(log)]) == 0
    reference = _trainer(step)
    expected = [reference.step({"x": x[i % 2 * ROWS:][:ROWS], "labels": y[:ROWS]}) for i in range(3)]
    assert _losses(log) == pytest.approx(expected, rel=1e-6)
    capsys.readouterr()
    np.savez(data, x=x[:20], labels=y[:20])
    assert main(["train", str(path), "--data", str(data)]) == 2
    _one_error_line(capsys, "data.npz: partial batch: x, labels have 20 rows")
    assert main(["train", str(path), "--data", str(tmp_path / "none")]) == 2
    _one_error_line(capsys, "none: no such file or folder")


def test_npz_headers_are_read_without_the_arrays(tmp_path):
    np.savez(tmp_path / "a.npz", x=X, labels=np.arange(5))
    np.savez_compressed(tmp_path / "b.npz", x=X)
    assert npz_header(tmp_path / "a.npz") == {"x": (np.dtype(np.float32), (32, 8)), "labels": (np.dtype(np.int64), (5,))}
    assert npz_header(tmp_path / "b.npz") == {"x": (np.dtype(np.float32), (32, 8))}
    specs = input_specs(build_train_step(mlp(), loss="mse", optimizer="sgd"))
    batches = NpzBatches(tmp_path / "b.npz", {"x": specs["x"]})
    assert np.array_equal(batches[5]["x"], X)


def test_train_on_a_forward_model_says_how_to_build_a_step_graph_before_reading_the_data(tmp_path, capsys):
    """``onnxcampo train FORWARD.onnx --data batch.npz``: the model is checked first (the data
    need not even exist), one line naming train-graph."""
    forward = tmp_path / "forward.onnx"
    onnx.save(mlp(), str(forward))
    assert main(["train", str(forward), "--data", str(tmp_path / "missing.npz"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a training-step graph" in err[0] and "onnxcampo train-graph" in err[0]


def test_train_progress_in_a_log_file_is_one_line_a_report_without_carriage_returns(tmp_path, step, capsys):
    """stderr is no terminal here (a log file, a pipe): each progress report is its own line."""
    path = tmp_path / "step.onnx"
    onnx.save(step, str(path))
    folder, _, _ = _folder(tmp_path)
    assert main(["train", str(path), "--data", str(folder), "--steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [line for line in err.splitlines() if line.startswith("step ")][-1].startswith("step 4/4: loss ")
