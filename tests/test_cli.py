"""The command line: the main job, the report, and every kind of bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import one_error_line as assert_one_line_error, run_cli

EXAMPLE = Path(str(resources.files("onnxcampo.examples") / "mlp_block.onnx"))
# The H200 database (what an H200 user gets), and no minimum gain: the example's bias Adds are
# fused into their products in both precisions, its launches add to its GPU work, and campo's plan is
# predicted less than 2 % faster than fp32 (these tests are about the command line, not that margin).
PIN = ["--input-shape", "x:16384,256", "--device-db", str(resources.files("onnxcampo.costdb") / "data" / "nvidia-h200.json"),
       "--min-gain", "0"]


def tiny_model(opset: int = 17, dtype: int = TensorProto.FLOAT, dims=("batch", 16)) -> onnx.ModelProto:
    np_dtype = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    weight = numpy_helper.from_array(np.ones((16, 16), dtype=np_dtype), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", dtype, list(dims))],
        [helper.make_tensor_value_info("y", dtype, list(dims))], [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8 if opset < 11 else 10)


@pytest.mark.slow
def test_optimize_example_writes_model_and_report(tmp_path, capsys):
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, out, *PIN, "--report", report_path, "--validate")
    assert code == 0, err
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == onnx.load(str(EXAMPLE)).ir_version
    report = json.loads(report_path.read_text())
    for key in ("casts_inserted", "pads_inserted", "nodes_fp16", "nodes_fp32", "predicted_us", "plan", "validation"):
        assert key in report
    assert report["nodes_fp16"] > 0
    assert report["predicted_us"]["campo"]["total_us"] <= report["predicted_us"]["fp32"]["total_us"]
    assert all(row["ok"] for row in report["validation"])
    assert "policy campo" in err and "predicted time" in err
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    assert len(casts) == report["casts_inserted"]


def test_optimizing_twice_changes_nothing(tmp_path, capsys):
    first, second = tmp_path / "a.onnx", tmp_path / "b.onnx"
    assert run_cli(capsys, "optimize", EXAMPLE, first, *PIN)[0] == 0
    report = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "optimize", first, second, *PIN, "--report", report)
    assert code == 0, err
    assert json.loads(report.read_text())["casts_inserted"] == 0
    assert [n.op_type for n in onnx.load(str(second)).graph.node] == [n.op_type for n in onnx.load(str(first)).graph.node]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["campo", "amp", "fp16", "fp32"])
def test_every_policy_gives_a_valid_model(tmp_path, capsys, policy):
    out = tmp_path / f"{policy}.onnx"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, out, *PIN, "--policy", policy, "--validate")
    assert code == 0, err
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)


def test_inspect_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    before = set(tmp_path.iterdir())
    code, out, _ = run_cli(capsys, "inspect", EXAMPLE, *PIN, "--nodes")
    assert code == 0
    assert "up_proj" in out and "log_softmax" in out and "deny_list" in out
    assert set(tmp_path.iterdir()) == before


@pytest.mark.slow
def test_validation_failure_exits_1_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, out, *PIN, "--validate", "--rtol", "0", "--atol", "0")
    assert code == 1
    assert "differ beyond" in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_the_accuracy_check_runs_the_file_it_writes_test_loaded_once(tmp_path, capsys, monkeypatch):
    """The default accuracy check: the model is serialized once, to the temporary file that is
    renamed to the output, test-loaded once from it and run (on ORT) from it; the output is the
    model optimize() makes, and no temporary file is left."""
    import onnxcampo
    from onnxcampo.accuracy import check as accuracy_check
    from onnxcampo.runtime import check

    loads, runs = [], []
    real_loads, real_run = check.check_loads, accuracy_check.run_model
    monkeypatch.setattr(check, "check_loads", lambda source, **kw: loads.append(source) or real_loads(source, **kw))
    monkeypatch.setattr(accuracy_check, "run_model",
                        lambda model, *a, **kw: runs.append(model) or real_run(model, *a, **kw))
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, out, *PIN)
    assert code == 0 and "accuracy check" in err, err
    assert len(loads) == 1 and runs == [str(loads[0])] and loads[0].parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]
    expected = onnxcampo.optimize(EXAMPLE, input_shapes={"x": (16384, 256)}, device_db=PIN[3], min_gain=0.0)
    assert out.read_bytes() == expected.model.SerializeToString()


# --- bad input: one line, exit 2, nothing written -------------------------------------------

def test_missing_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", tmp_path / "nope.onnx", tmp_path / "out.onnx")
    assert code == 2
    assert_one_line_error(err, "no such file")
    assert not (tmp_path / "out.onnx").exists()


def test_not_onnx(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_text("this is not a model\n" * 10)
    code, _, err = run_cli(capsys, "optimize", bad, tmp_path / "out.onnx")
    assert code == 2
    assert_one_line_error(err, "not an ONNX model")


def test_truncated_model(tmp_path, capsys):
    data = EXAMPLE.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(capsys, "optimize", cut, tmp_path / "out.onnx", *PIN)
    assert code == 2
    assert_one_line_error(err)


def test_old_opset(tmp_path, capsys):
    old = tmp_path / "old.onnx"
    onnx.save(tiny_model(opset=9, dims=(4, 16)), str(old))
    code, _, err = run_cli(capsys, "optimize", old, tmp_path / "out.onnx")
    assert code == 2
    assert_one_line_error(err, "opset 9")


def test_unresolved_dynamic_dims(tmp_path, capsys):
    path = tmp_path / "dyn.onnx"
    onnx.save(tiny_model(), str(path))
    code, _, err = run_cli(capsys, "optimize", path, tmp_path / "out.onnx")
    assert code == 2
    assert_one_line_error(err, "dynamic dim 'batch'", "--input-shape x:N,16", "--dim batch=N")
    assert not (tmp_path / "out.onnx").exists()
    assert run_cli(capsys, "optimize", path, tmp_path / "out.onnx", "--dim", "batch=8")[0] == 0


def test_output_equal_to_input_is_refused_and_input_untouched(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    shutil.copy(EXAMPLE, path)
    before = path.read_bytes()
    code, _, err = run_cli(capsys, "optimize", path, path, *PIN)
    assert code == 2
    assert_one_line_error(err, "output path is the input")
    assert path.read_bytes() == before


def test_output_folder_missing(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "no" / "out.onnx", *PIN)
    assert code == 2
    assert_one_line_error(err, "does not exist")


def test_failed_run_keeps_existing_output(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    out.write_bytes(b"previous")
    code, _, _ = run_cli(capsys, "optimize", tmp_path / "missing.onnx", out)
    assert code == 2
    assert out.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]


def test_bad_option_values(tmp_path, capsys):
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", "--input-shape", "x:4,a")
    assert code == 2
    assert_one_line_error(err, "--input-shape")
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--exclude-node", "([")
    assert code == 2
    assert_one_line_error(err, "regular expression")
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", "--input-shape", "nosuch:1,2")
    assert code == 2
    assert_one_line_error(err, "nosuch")


def test_corrupt_device_db(tmp_path, capsys):
    db = tmp_path / "db.json"
    db.write_text("{ not json")
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, tmp_path / "o.onnx", *PIN, "--device-db", db)
    assert code == 2
    assert_one_line_error(err, "not a cost database")


# --- models with nothing to do: a valid result and a clear message ---------------------------

@pytest.mark.parametrize(
    "model, message",
    [
        (tiny_model(dtype=TensorProto.FLOAT16, dims=(4, 16)), "no float32 tensors"),
        (tiny_model(dtype=TensorProto.INT32, dims=(4, 16)), "no float32 tensors"),
        (helper.make_model(helper.make_graph([], "empty", [], []), opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
         "no nodes"),
    ],
    ids=["already-fp16", "no-float-ops", "empty-graph"],
)
def test_nothing_to_do_writes_model_unchanged(tmp_path, capsys, model, message):
    path, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(path))
    code, _, err = run_cli(capsys, "optimize", path, out)
    assert code == 0, err
    assert message in err
    written = onnx.load(str(out))
    assert written.graph == model.graph
    onnx.checker.check_model(written, full_check=True)


@pytest.mark.slow
def test_console_script_and_module(tmp_path):
    script = Path(sys.executable).with_name("onnxcampo")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "onnxcampo"]
    out = tmp_path / "out.onnx"
    done = subprocess.run([*command, "optimize", str(EXAMPLE), str(out), *PIN], capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert out.exists()
    done = subprocess.run([sys.executable, "-m", "onnxcampo", "optimize", str(tmp_path / "missing.onnx"), str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_report_in_a_missing_folder_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "optimize", EXAMPLE, out, *PIN, "--report", tmp_path / "no" / "r.json")
    assert code == 2
    assert_one_line_error(err, "does not exist")
    assert not out.exists()


# Fields whose flag is not ``--<field-name>`` (config.OptimizeConfig's docstring lists them).
RENAMED_FLAGS = {
    "keep_io_types": "--no-keep-io-types", "input_shapes": "--input-shape", "dim_values": "--dim",
    "exclude_ops": "--exclude-op", "include_ops": "--include-op", "exclude_nodes": "--exclude-node",
    "include_nodes": "--include-node", "loss_scaling": "--no-loss-scaling", "experimental": "--experimental",
}


def test_every_config_field_has_an_optimize_flag_as_the_config_docstring_says():
    """Every OptimizeConfig field has a flag of ``onnxcampo optimize``: its own name, or the one
    the docstring names for it; every experimental option is named in ``--experimental``'s help."""
    import dataclasses

    from onnxcampo.cli import build_parser
    from onnxcampo.config import ExperimentalOptions, OptimizeConfig

    optimize = build_parser()._subparsers._group_actions[0].choices["optimize"]
    flags = {flag for action in optimize._actions for flag in action.option_strings}
    doc = OptimizeConfig.__doc__
    for f in dataclasses.fields(OptimizeConfig):
        if f.name.startswith("_"):  # set by onnxcampo itself (the accuracy fix's nodes), no option
            continue
        flag = RENAMED_FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        assert flag in flags, f.name
        if f.name in RENAMED_FLAGS:
            assert f"``{f.name}``" in doc and f"``{flag}" in doc, f.name
    help_text = next(a.help for a in optimize._actions if "--experimental" in a.option_strings)
    assert all(f"{name}=" in help_text for name in ExperimentalOptions.names())


class _ClosedPipe:
    """A stdout whose reader has left: every write and flush raises BrokenPipeError."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise OSError("no file descriptor")


def test_a_reader_that_leaves_ends_the_command_quietly(monkeypatch, capsys):
    """``onnxcampo inspect MODEL --nodes | head -1``: the reader closes the pipe; the command ends as
    SIGPIPE would end it (141), with no error line."""
    from onnxcampo.cli import main

    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["inspect", str(EXAMPLE), "--input-shape", "x:64,256", "--nodes"])
    assert code == 141
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, named, hint", [
    (["optimise", "a.onnx", "b.onnx"], "onnxcampo: error: argument COMMAND", "did you mean 'optimize'?"),
    (["costdb", "calibrat"], "onnxcampo: error: onnxcampo costdb: argument", "did you mean 'calibrate'?"),
])
def test_a_misspelt_command_is_one_line_naming_the_closest(argv, named, hint, capsys):
    from onnxcampo.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(named) and hint in err[0]
    assert "onnxcampo: onnxcampo" not in err[0] and "error: onnxcampo: " not in err[0]


def test_an_inputs_file_that_is_not_an_npz_says_so_without_numpys_pickle_advice(tmp_path, capsys):
    from onnxcampo.cli import main

    text = tmp_path / "inputs.txt"
    text.write_text("hello\n")
    code = main(["optimize", str(EXAMPLE), str(tmp_path / "out.onnx"), "--input-shape", "x:64,256",
                 "--validate", "--inputs", str(text)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "is not a readable .npz (not a NumPy .npz archive)" in err[0] and "numpy.savez" in err[0]
    assert "pickle" not in err[0] and not (tmp_path / "out.onnx").exists()


def test_train_graph_says_how_to_pin_shapes_on_the_command_line(tmp_path, capsys):
    from onnxcampo.cli import main

    assert main(["train-graph", str(EXAMPLE), str(tmp_path / "step.onnx")]) != 0
    err = capsys.readouterr().err
    assert "pin the inputs with --input-shape" in err and "input_shapes" not in err


def test_validate_on_a_provider_this_build_lacks_blames_the_provider_not_the_model(tmp_path, capsys):
    import onnxruntime

    from onnxcampo.cli import main

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    out = tmp_path / "out.onnx"
    code = main(["optimize", str(EXAMPLE), str(out), "--input-shape", "x:64,256", "--validate", "--provider", "cuda"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not out.exists()
    assert err[0].startswith("onnxcampo: error: provider 'cuda' needs onnxruntime-gpu") and "fp32 model" not in err[0]


def test_a_model_of_ai_onnx_ml_ops_only_is_written_unchanged_not_refused_for_its_opset(tmp_path, capsys):
    """No default-domain import at all (an ai.onnx.ml classifier): not "opset 0 is older than 11",
    but nothing to convert, the model written as it is."""
    from onnxcampo.cli import main

    graph = helper.make_graph([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.5)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    source, out = tmp_path / "ml.onnx", tmp_path / "ml.out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 3)], ir_version=8), str(source))
    assert main(["optimize", str(source), str(out)]) == 0
    err = capsys.readouterr().err
    assert "opset 0" not in err and "its ops are all of ai.onnx.ml" in err
    assert onnx.load(str(out)).SerializeToString() == onnx.load(str(source)).SerializeToString()


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The disk fills while the model is written: exit 2 with one line naming the output, no
    temporary file left, an existing output unchanged (was an internal error)."""
    import errno

    from onnxcampo.cli import main

    out = tmp_path / "out.onnx"
    out.write_bytes(b"the previous model")
    real = Path.write_bytes

    def full(self, data):
        if self.name.startswith(".out.onnx."):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    code = main(["optimize", str(EXAMPLE), str(out), "--input-shape", "x:64,256", "--no-accuracy-check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"onnxcampo: error: {out}: no space left on the device") and "nothing was written" in err[0]
    assert out.read_bytes() == b"the previous model" and sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"]


def test_warnings_on_stderr_read_like_the_programs_own_lines(tmp_path, capsys):
    """One style on stderr: ``onnxcampo: warning: ...`` as ``onnxcampo: error: ...``; level and
    logger names only with -v (and in --log-file)."""
    from onnxcampo.cli import main

    graph = helper.make_graph([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.5)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    source = tmp_path / "ml.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("ai.onnx.ml", 3)], ir_version=8), str(source))
    assert main(["optimize", str(source), str(tmp_path / "out.onnx")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("onnxcampo: warning: ") and "nothing to optimize" in line for line in err)
    assert not any(line.startswith(("WARNING ", "INFO ")) for line in err)


def test_an_input_ort_cannot_load_is_the_inputs_problem_not_an_internal_error(tmp_path, capsys):
    """Acosh on float64 has no kernel in ONNX Runtime's CPU provider: the written model cannot
    load, and neither can the input: one user error naming the input (exit 2), nothing written."""
    from onnxcampo.cli import main

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "x"], ["m"]), helper.make_node("Cast", ["m"], ["d"], to=TensorProto.DOUBLE),
         helper.make_node("Acosh", ["d"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("z", TensorProto.DOUBLE, [64, 64])])
    source, out = tmp_path / "acosh.onnx", tmp_path / "out.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), str(source))
    code = main(["optimize", str(source), str(out), "--no-accuracy-check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and not out.exists()
    assert err[0].startswith(f"onnxcampo: error: {source}: the input model does not load in ONNX Runtime either")
    assert "Acosh" in err[0]
