"""Finding, loading and building the library; the errors a user sees when it is missing or broken."""

from __future__ import annotations

import os

import numpy as np
import pytest

from onnxcampo import ops
from onnxcampo.errors import OpsLibraryError
from onnxcampo.ops import build as ops_build
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step
from training.test_step import mlp


def test_library_path_is_the_built_file(library):
    assert os.path.isfile(ops.library_path()) and ops.available()
    assert ops.build_info()["kernels"] in ("cpu", "cpu+cuda")


def test_missing_library_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv(ops.ENV_VAR, str(tmp_path / "nowhere.so"))
    with pytest.raises(OpsLibraryError, match=r"does not exist; build it with `python -m onnxcampo\.ops\.build`"):
        ops.library_path()
    assert not ops.available()


def test_unloadable_library_is_reported(monkeypatch, tmp_path):
    bogus = tmp_path / "libonnxcampo_ops.so"
    bogus.write_text("not a shared library\n")
    monkeypatch.setenv(ops.ENV_VAR, str(bogus))
    assert ops.library_path() == str(bogus)
    assert not ops.available()
    with pytest.raises(OpsLibraryError, match=r"does not load .*python -m onnxcampo\.ops\.build"):
        ops.check()
    import onnxruntime as ort

    with pytest.raises(OpsLibraryError, match="does not load"):
        ops.register(ort.SessionOptions())


@pytest.mark.parametrize("broken", ["missing", "unloadable"])
def test_fused_graph_without_the_library_fails_clearly(library, monkeypatch, tmp_path, broken):
    step = build_train_step(mlp(), optimizer="sgd", fused=True)
    path = tmp_path / "lib.so"
    if broken == "unloadable":
        path.write_text("junk")
    monkeypatch.setenv(ops.ENV_VAR, str(path))
    with pytest.raises(OpsLibraryError, match=r"the model uses ai\.onnxcampo ops, but .*onnxcampo\.ops\.build"):
        make_session(step)
    file = tmp_path / "step.onnx"
    file.write_bytes(step.SerializeToString())
    with pytest.raises(OpsLibraryError, match=r"the model uses ai\.onnxcampo ops"):
        make_session(file)  # a path: recognised from ORT's message


def test_graphs_without_custom_ops_run_when_the_library_is_broken(monkeypatch, tmp_path):
    bogus = tmp_path / "junk.so"
    bogus.write_text("junk")
    monkeypatch.setenv(ops.ENV_VAR, str(bogus))
    step = build_train_step(mlp(), optimizer="sgd", fused=False)
    feeds = {"x": np.zeros((32, 8), np.float32), "labels": np.zeros((32, 3), np.float32),
             "lr": np.array(0.1, np.float32), **{t.name: np.zeros(t.dims, np.float32) for t in mlp().graph.initializer}}
    assert "loss" in run(make_session(step), feeds)


def test_build_is_idempotent(library):
    """A second build with unchanged sources, headers and compilers compiles nothing."""
    before = os.stat(library).st_mtime_ns
    assert ops_build.main(["--quiet"]) == 0
    assert os.stat(library).st_mtime_ns == before


@pytest.mark.slow
def test_header_download_failure_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(ops_build.INCLUDE_ENV, raising=False)
    monkeypatch.setattr(ops_build, "MIRROR", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(OpsLibraryError, match=r"could not download the ONNX Runtime headers .*ONNXCAMPO_ORT_INCLUDE"):
        ops_build.ort_headers()
