"""Every command that reads a model, fed what a user may give it by mistake: a missing file, an
empty one, a truncated model, a text file, an image, a model with wrong inputs for the data, a
data file that is no .npz. Each must end in one clear line on stderr and a non-zero exit code
(2: the input's fault), never an internal error (exit 3) or a traceback, and write nothing."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxcampo.cli import main

EXAMPLE = "onnxcampo/examples/mlp_block.onnx"


def bad_models(folder):
    """(name, path) of the model files a user gets wrong."""
    good = onnx.load(EXAMPLE).SerializeToString()
    files = {"missing": None, "empty": b"", "truncated": good[: len(good) // 3], "text": b"not a model\n" * 20,
             "png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4}
    out = []
    for name, content in files.items():
        path = folder / f"{name}.onnx"
        if content is not None:
            path.write_bytes(content)
        out.append((name, path))
    return out


def commands(model, folder):
    """Each command that reads ``model``, with what else it needs (outputs under ``folder``)."""
    data = folder / "batch.npz"
    np.savez(data, x=np.zeros((4, 256), np.float32), labels=np.zeros((4, 256), np.float32))
    return {"optimize": ["optimize", str(model), str(folder / "out.onnx")],
            "inspect": ["inspect", str(model)],
            "inspect --html": ["inspect", str(model), "--html", str(folder / "plan.html")],
            "train-graph": ["train-graph", str(model), str(folder / "step.onnx")],
            "train": ["train", str(model), "--data", str(data), "--steps", "1"],
            "bench": ["bench", str(model), "--policies", "fp32,fp16", "--input-shape", "x:4,256"]}


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "text", "png"])
@pytest.mark.parametrize("command", ["optimize", "inspect", "inspect --html", "train-graph", "train", "bench"])
def test_a_bad_model_file_is_one_line_and_nothing_written(tmp_path, capsys, command, kind):
    path = dict(bad_models(tmp_path))[kind]
    args = commands(path, tmp_path)[command]
    before = {p.name for p in tmp_path.iterdir()}
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and "internal error" not in err[0] and "Traceback" not in err[0], err
    assert {p.name for p in tmp_path.iterdir()} == before  # nothing written, no leftovers


@pytest.mark.parametrize("content, fragment", [
    (b"", "not a readable .npz"),
    (b"x,y\n1,2\n", "not a readable .npz"),
])
def test_data_that_is_no_npz_is_one_line(tmp_path, capsys, content, fragment):
    data = tmp_path / "inputs.npz"
    data.write_bytes(content)
    code = main(["optimize", EXAMPLE, str(tmp_path / "o.onnx"), "--input-shape", "x:4,256", "--validate",
                 "--inputs", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and fragment in err[-1] and "internal error" not in err[-1]
    assert not (tmp_path / "o.onnx").exists()


def test_inputs_of_the_wrong_shape_are_one_line(tmp_path, capsys):
    data = tmp_path / "inputs.npz"
    np.savez(data, x=np.zeros((4, 3), np.float32))
    code = main(["optimize", EXAMPLE, str(tmp_path / "o.onnx"), "--input-shape", "x:4,256", "--validate",
                 "--inputs", str(data)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "internal error" not in "\n".join(err) and "x" in err[-1]
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint\n"])
def test_a_checkpoint_that_is_no_npz_is_one_line(tmp_path, capsys, content):
    step = tmp_path / "step.onnx"
    assert main(["train-graph", EXAMPLE, str(step), "--input-shape", "x:4,256", "--loss", "mse"]) == 0
    capsys.readouterr()
    data, checkpoint = tmp_path / "batch.npz", tmp_path / "ckpt.npz"
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(step).graph.input}
    np.savez(data, x=np.zeros(shapes["x"], np.float32), labels=np.zeros(shapes["labels"], np.float32))
    checkpoint.write_bytes(content)
    assert main(["train", str(step), "--data", str(data), "--steps", "1", "--resume", str(checkpoint)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "not an onnxcampo checkpoint" in err[-1] and "internal error" not in err[-1]


@pytest.mark.parametrize("kind", ["missing", "empty", "text", "truncated"])
@pytest.mark.parametrize("command", ["fit", "eval"])
def test_costdb_on_bad_sample_or_database_files_is_one_line(tmp_path, capsys, command, kind):
    """``costdb fit SAMPLES OUT`` and ``costdb eval DB SAMPLES`` on files that are not what they
    say: one line, exit 2, no database written."""
    bad = tmp_path / ("samples.jsonl" if command == "fit" else "db.json")
    content = {"missing": None, "empty": b"", "text": b"not json at all\n", "truncated": b'{"key": "a", "kind": '}[kind]
    if content is not None:
        bad.write_bytes(content)
    out = tmp_path / "out.json"
    args = (["costdb", "fit", str(bad), str(out)] if command == "fit"
            else ["costdb", "eval", str(bad), str(tmp_path / "missing-samples.jsonl")])
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert err and "internal error" not in err[-1] and "Traceback" not in "\n".join(err)
    assert not out.exists()
