"""What onnxcampo writes is safe to keep (issue 19, item 2): every written model is test-loaded by
ONNX Runtime in a child process (a segfault there is one error line, and nothing is written);
output paths are checked before any work; names that are not valid UTF-8 are read."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, optimize, patterns
from onnxcampo.errors import OutputPathError, RuntimeCrashError, WrittenModelLoadError
from onnxcampo.runtime import isolated
from helpers import one_error_line, run_cli

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16




def transpose_matmul(dtype: int = FLOAT) -> onnx.ModelProto:
    """x[2,3,4] -> Transpose([1,0,2]) -> MatMul(., w[4,5]): in fp16, ORT 1.32's CPU EP segfaults
    creating a session of it (``patterns.ort_cpu_crashing_transposes``)."""
    weight = numpy_helper.from_array(np.full((4, 5), 0.5, dtype=helper.tensor_dtype_to_np_dtype(dtype)), "w")
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2], name="tr"),
         helper.make_node("MatMul", ["t", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", dtype, [2, 3, 4])], [helper.make_tensor_value_info("y", dtype, [3, 2, 5])],
        [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- (a) the test-load in a child process ----------------------------------------------------
def test_a_model_ort_crashes_on_is_an_error_and_nothing_is_written(tmp_path):
    """save_model of the fp16 pattern ORT segfaults on: WrittenModelLoadError naming the signal;
    no output, no temporary file, and an existing output stays as it was. This process lives on."""
    out = tmp_path / "out.onnx"
    with pytest.raises(WrittenModelLoadError, match=r"crashed \(signal 11, SIGSEGV\) loading the written model on "
                                                    r"the CPU EP .*; nothing was written$") as raised:
        ir.save_model(transpose_matmul(FLOAT16), out)
    assert raised.value.exit_code == 3
    assert not out.exists() and leftovers(tmp_path) == []
    out.write_bytes(b"previous")
    with pytest.raises(WrittenModelLoadError):
        ir.save_model(transpose_matmul(FLOAT16), out)
    assert out.read_bytes() == b"previous"
    ir.save_model(transpose_matmul(FLOAT), out)  # the next save gets a new child
    assert onnx.load(str(out)).graph.node[0].op_type == "Transpose"


@pytest.mark.parametrize("validate", [False, True])
def test_cli_reports_an_ort_crash_in_one_line(tmp_path, capsys, monkeypatch, validate):
    """Without the plan rule the fp16 policy writes the crashing pattern: optimize exits 3 with one
    line (the test-load's, which runs before --validate's or the accuracy check's runs), no
    traceback, nothing written."""
    monkeypatch.setattr(patterns, "ort_cpu_crashing_transposes", lambda ctx: set())
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(transpose_matmul(), str(source))
    code, _, err = run_cli(capsys, "optimize", source, out, "--policy", "fp16", *(["--validate"] if validate else []))
    doing = "loading the written model"
    assert code == 3
    one_error_line(err, "ONNX Runtime crashed (signal 11, SIGSEGV)", doing, "nothing was written")
    assert not out.exists() and leftovers(tmp_path) == []


def test_with_the_rule_the_same_model_is_written_and_validated(tmp_path, capsys):
    """The plan rule keeps the Transpose fp32: the same command writes a model that loads."""
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(transpose_matmul(), str(source))
    code, _, err = run_cli(capsys, "optimize", source, out, "--policy", "fp16", "--validate")
    assert code == 0, err
    assert "validate y: rel L2" in err and out.exists()


def test_the_child_is_reused_restarted_after_a_crash_and_forwards_its_logs(tmp_path, caplog):
    """One child serves the process's requests; a crash ends it and the next request starts
    another; log records of the child's onnxcampo loggers are logged here under their names."""
    from onnxcampo.runtime import session_recipe

    good = tmp_path / "good.onnx"
    onnx.save(transpose_matmul(), str(good))
    recipe = session_recipe(provider="cpu")
    assert isolated.call("session", str(good), recipe) == (True, ["CPUExecutionProvider"])
    first = isolated._shared[0].process.pid
    ok, (kind, message) = isolated.call("session", b"not a model", recipe)
    assert not ok and "INVALID_PROTOBUF" in message and isolated._shared[0].process.pid == first
    with pytest.raises(RuntimeCrashError, match="signal 11") as crash:
        isolated.call("session", transpose_matmul(FLOAT16).SerializeToString(), recipe)
    assert crash.value.signal == 11
    with caplog.at_level(logging.INFO, logger="onnxcampo"):
        checks = isolated.call("validate", str(good), str(good), provider="cpu", execution="cuda-graph")
    assert isolated._shared[0].process.pid != first
    assert [c.ok for c in checks] == [True]
    assert any(r.name == "onnxcampo.runtime" and "plain runs" in r.getMessage() for r in caplog.records)


def test_a_child_past_the_time_limit_is_stopped(tmp_path):
    from onnxcampo.runtime import session_recipe

    good = tmp_path / "good.onnx"
    onnx.save(transpose_matmul(), str(good))
    isolated.close()  # a fresh child (one that served earlier tests may have an answer ready)
    with pytest.raises(RuntimeCrashError, match="did not finish within 0 s"):
        isolated.call("session", str(good), session_recipe(), timeout_s=0)
    assert isolated.call("session", str(good), session_recipe())[0] is True


# --- (c) output paths, before any work ----------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the CLI starts optimizing."""
    import onnxcampo.api

    def refuse(*args, **kwargs):
        raise AssertionError("optimize ran before the output paths were checked")
    monkeypatch.setattr(onnxcampo.api, "optimize", refuse)


def unwritable(monkeypatch, folder: Path) -> None:
    """Make ``folder`` refuse new files, also for root (which chmod does not stop)."""
    real = tempfile.NamedTemporaryFile

    def probe(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)
    monkeypatch.setattr(ir.io.tempfile, "NamedTemporaryFile", probe)
    if os.geteuid() != 0:
        folder.chmod(0o555)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "in.onnx"
    onnx.save(transpose_matmul(), str(path))
    return path


@pytest.mark.parametrize("which", ["output", "report"])
def test_an_unwritable_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch, no_work, source, which):
    locked = tmp_path / "locked"
    locked.mkdir()
    unwritable(monkeypatch, locked)
    out = locked / "out.onnx" if which == "output" else tmp_path / "out.onnx"
    report = locked / "report.json" if which == "report" else tmp_path / "report.json"
    try:
        code, _, err = run_cli(capsys, "optimize", source, out, "--report", report)
    finally:
        locked.chmod(0o755)
    assert code == 2
    one_error_line(err, f"cannot write in folder {locked} (permission denied)")
    assert not out.exists() and not report.exists() and list(locked.iterdir()) == []


@pytest.mark.parametrize("case, fragment", [
    ("report_is_output", "already the path of another output"),
    ("parent_is_a_file", "is not a folder"),
    ("report_is_input", "the output path is the input model"),
    ("output_is_a_folder", "is a folder"),
])
def test_other_bad_output_paths_are_refused_before_any_work(tmp_path, capsys, no_work, source, case, fragment):
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    if case == "report_is_output":
        report = out
    elif case == "parent_is_a_file":
        out = source / "out.onnx"
    elif case == "report_is_input":
        report = source
    else:
        out = tmp_path
    code, _, err = run_cli(capsys, "optimize", source, out, "--report", report)
    assert code == 2
    one_error_line(err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


def test_check_output_path_on_a_folder_nobody_may_write(tmp_path):
    """A real refusal, no monkeypatch: /proc takes no new files, not even root's."""
    with pytest.raises(OutputPathError, match="cannot write in folder /proc"):
        ir.check_output_path("/proc/out.onnx", None)
    assert ir.check_output_path(tmp_path / "out.onnx", None) == tmp_path / "out.onnx"
    assert leftovers(tmp_path) == []  # the probe leaves nothing


def test_train_log_in_an_unwritable_folder_is_refused_before_any_step(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    unwritable(monkeypatch, locked)
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((2, 4), np.float32))
    import onnxcampo.ir as ir_package

    def refuse(*args, **kwargs):
        raise AssertionError("the step graph was read before the output paths were checked")
    monkeypatch.setattr(ir_package, "read_model", refuse)
    try:
        code, _, err = run_cli(capsys, "train", tmp_path / "step.onnx", "--data", data, "--log", locked / "log.jsonl")
    finally:
        locked.chmod(0o755)
    assert code == 2
    one_error_line(err, "cannot write in folder")


# --- (d) names that are not valid UTF-8 --------------------------------------------------------
def with_bytes(model: onnx.ModelProto, placeholder: bytes, replacement: bytes) -> bytes:
    """The serialized model with a name's bytes replaced (same length: no length prefix changes);
    Python's protobuf cannot set a string field to bytes that are not UTF-8."""
    assert len(placeholder) == len(replacement)
    data = model.SerializeToString()
    assert data.count(placeholder) >= 1
    return data.replace(placeholder, replacement)


BAD_NODE = b"mm\xff\xfe\xc3(node_"  # 0xff, 0xfe: never UTF-8; 0xc3 '(': a broken sequence


def model_with_bad_names(tmp_path) -> Path:
    model = transpose_matmul()
    model.graph.node[1].name = "PLACEHOLDER"
    model.graph.node[0].output[0] = model.graph.node[1].input[0] = "TENSOR_NAME"
    data = with_bytes(model, b"PLACEHOLDER", BAD_NODE)
    data = data.replace(b"TENSOR_NAME", b"t\xff\xfe__tensor")
    path = tmp_path / "bad_names.onnx"
    path.write_bytes(data)
    onnx.checker.check_model(str(path))  # the checker accepts them (and ONNX Runtime loads them)
    return path


def test_names_that_are_not_utf8_are_read_with_escapes(tmp_path, caplog):
    """read_model decodes every such string with the bad bytes as \\xNN escapes (the same
    everywhere a tensor name occurs), with one warning; optimize then runs and writes them so."""
    path = model_with_bad_names(tmp_path)
    assert isinstance(onnx.load(str(path)).graph.node[1].name, bytes)  # what protobuf hands over
    with caplog.at_level(logging.WARNING, logger="onnxcampo.ir.io"):
        model, _ = ir.read_model(path)
    assert model.graph.node[1].name == "mm\\xff\\xfe\\xc3(node_"
    assert model.graph.node[0].output[0] == model.graph.node[1].input[0] == "t\\xff\\xfe__tensor"
    assert "2 string(s) not valid UTF-8 (" in caplog.text
    assert "node name 'mm\\xff\\xfe\\xc3(node_'" in caplog.text and "node output 't\\xff\\xfe__tensor'" in caplog.text
    out = tmp_path / "out.onnx"
    optimize(path, policy="fp16").save(out)
    written = onnx.load(str(out))
    assert "mm\\xff\\xfe\\xc3(node_" in [n.name for n in written.graph.node]


def test_cli_optimizes_a_model_with_a_node_name_that_is_not_utf8(tmp_path, capsys):
    path = model_with_bad_names(tmp_path)
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "optimize", path, out, "--policy", "fp16", "--validate")
    assert code == 0, err
    assert "not valid UTF-8" in err and "internal error" not in err and out.exists()


def test_a_graph_input_name_that_is_not_utf8_is_validated_under_its_escaped_name(tmp_path, capsys):
    """--validate reads the original again (in the child): with the same escapes, so the feeds of
    the two models match."""
    model = transpose_matmul()
    model.graph.node[0].input[0] = model.graph.input[0].name = "INPUT_NAME"
    path = tmp_path / "bad_input.onnx"
    path.write_bytes(with_bytes(model, b"INPUT_NAME", b"in\xff\xfe_name_"))
    out = tmp_path / "out.onnx"
    code, _, err = run_cli(capsys, "optimize", path, out, "--policy", "fp16", "--validate")
    assert code == 0, err
    assert "validate y: rel L2" in err and "ok" in err
    assert onnx.load(str(out)).graph.input[0].name == "in\\xff\\xfe_name_"
