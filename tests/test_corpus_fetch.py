"""The corpus fetcher (benchmarks/corpus.py, onnxcampo.benchmarks.corpus): cache hits, pip failures, extraction, one real model.

All tests but the ``corpus``-marked ones run offline: ``subprocess.run`` is replaced by a fake
that fails, reports a pip error, or writes a hand-made wheel into pip's ``--dest`` folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.benchmarks import corpus
from onnxcampo.benchmarks.corpus import CorpusModel, CorpusUnavailable

FAKE = CorpusModel(
    key="fake",
    package="fake-pkg",
    version="1.0",
    member="fake_pkg/models/a.onnx",
    input_shapes={"x": (2, 3)},
)


@pytest.fixture(autouse=True)
def cache(request, tmp_path, monkeypatch) -> Path | None:
    """A private empty cache for every offline test; real-model tests use the user's cache."""
    if request.node.get_closest_marker("corpus"):
        return None
    monkeypatch.setattr(corpus, "_FAILED", {})
    root = tmp_path / "cache"
    monkeypatch.setenv("ONNXCAMPO_CACHE", str(root))
    monkeypatch.delenv("ONNXCAMPO_CORPUS_OFFLINE", raising=False)
    return root


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run: {args}")


def _tiny_model_bytes(external: str | None = None, tmp: Path | None = None) -> dict[str, bytes]:
    """y = x + w, with w stored inline or in an external-data file named ``external``."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if external is None:
        return {"model": model.SerializeToString()}
    path = tmp / "a.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location=external,
              size_threshold=0, all_tensors_to_one_file=True)  # fmt: skip
    return {"model": path.read_bytes(), "data": (tmp / external).read_bytes()}


def _fake_pip(members: dict[str, bytes], calls: list, wheel_name="fake_pkg-1.0-py3-none-any.whl"):
    def run(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("--dest") + 1])
        with zipfile.ZipFile(dest / wheel_name, "w") as zf:
            for name, data in members.items():
                zf.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "Saved ...", "")

    return run


# --- cache hits ---------------------------------------------------------------------------


def test_cached_file_is_returned_without_pip(cache, monkeypatch):
    """A file already at <root>/<package>-<version>/<member> comes back as is; pip never runs."""
    target = cache / "fake-pkg-1.0" / "fake_pkg" / "models" / "a.onnx"
    target.parent.mkdir(parents=True)
    target.write_bytes(_tiny_model_bytes()["model"])
    monkeypatch.setattr(corpus.subprocess, "run", _no_pip)

    assert corpus.fetch(FAKE) == target
    assert corpus.load(FAKE).graph.node[0].op_type == "Add"


def test_offline_switch_raises_before_pip(monkeypatch):
    monkeypatch.setenv("ONNXCAMPO_CORPUS_OFFLINE", "1")
    monkeypatch.setattr(corpus.subprocess, "run", _no_pip)
    with pytest.raises(CorpusUnavailable, match="ONNXCAMPO_CORPUS_OFFLINE"):
        corpus.fetch(FAKE)


# --- pip failures -------------------------------------------------------------------------


def test_missing_package_version_raises_with_pips_reason(monkeypatch):
    """pip's 'No matching distribution' becomes CorpusUnavailable naming PKG==VER."""
    stderr = (
        "ERROR: Could not find a version that satisfies the requirement ddddocr==9.9.9 "
        "(from versions: 1.4.0, 1.6.1)\n"
        "ERROR: No matching distribution found for ddddocr==9.9.9\n"
    )
    monkeypatch.setattr(
        corpus.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr),
    )  # fmt: skip
    model = dataclasses.replace(corpus.get("ddddocr_common"), version="9.9.9")

    with pytest.raises(CorpusUnavailable) as err:
        corpus.fetch(model)
    msg = str(err.value)
    assert "pip download ddddocr==9.9.9 failed (exit 1)" in msg
    assert "No matching distribution found for ddddocr==9.9.9" in msg
    assert not corpus.cached_path(model).exists()


def test_network_failure_is_flagged(monkeypatch):
    stderr = (
        "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
        "ERROR: No matching distribution found for magika==1.0.3\n"
    )
    monkeypatch.setattr(
        corpus.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", stderr),
    )  # fmt: skip
    with pytest.raises(CorpusUnavailable, match=r"network unreachable\?"):
        corpus.fetch(corpus.get("magika"))
    # Once the network looked down, other packages fail at once, without pip.
    monkeypatch.setattr(corpus.subprocess, "run", _no_pip)
    with pytest.raises(CorpusUnavailable, match="not retrying pip download silero-vad"):
        corpus.fetch(corpus.get("silero_vad"))


@pytest.mark.parametrize(
    "exc", [FileNotFoundError("no python"), subprocess.TimeoutExpired(["pip"], 1.0)]
)
def test_pip_that_cannot_run_or_hangs_raises(monkeypatch, exc):
    def run(cmd, **kwargs):
        raise exc

    monkeypatch.setattr(corpus.subprocess, "run", run)
    with pytest.raises(CorpusUnavailable, match="fake-pkg==1.0"):
        corpus.fetch(FAKE)


# --- extraction ---------------------------------------------------------------------------


def test_download_extracts_onnx_members_and_data_atomically(tmp_path, monkeypatch, cache):
    """pip runs once as `python -m pip download --no-deps --only-binary=:all:`; every .onnx
    member and the .data files beside them land in the cache, nothing else, no temp files."""
    tiny = _tiny_model_bytes(external="a.onnx.data", tmp=tmp_path)
    members = {
        "fake_pkg/models/a.onnx": tiny["model"],
        "fake_pkg/models/a.onnx.data": tiny["data"],
        "fake_pkg/other/b.onnx": _tiny_model_bytes()["model"],
        "fake_pkg/other/readme.txt": b"not wanted",
        "fake_pkg/__init__.py": b"",
        "fake_pkg-1.0.dist-info/METADATA": b"Name: fake-pkg\n",
    }
    calls: list = []
    monkeypatch.setattr(corpus.subprocess, "run", _fake_pip(members, calls))
    model = dataclasses.replace(FAKE, sha256=hashlib.sha256(tiny["model"]).hexdigest())

    path = corpus.fetch(model)

    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd) and cmd[-1] == "fake-pkg==1.0"
    pkg_dir = cache / "fake-pkg-1.0"
    assert path == pkg_dir / "fake_pkg" / "models" / "a.onnx"
    got = sorted(p.relative_to(pkg_dir).as_posix() for p in pkg_dir.rglob("*") if p.is_file())
    assert got == ["fake_pkg/models/a.onnx", "fake_pkg/models/a.onnx.data", "fake_pkg/other/b.onnx"]
    x = np.ones((2, 3), np.float32)
    import onnxruntime as ort

    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y, x + np.arange(6, dtype=np.float32).reshape(2, 3))

    # A second fetch of a sibling member is a cache hit.
    monkeypatch.setattr(corpus.subprocess, "run", _no_pip)
    sibling = dataclasses.replace(FAKE, member="fake_pkg/other/b.onnx")
    assert corpus.fetch(sibling) == pkg_dir / "fake_pkg" / "other" / "b.onnx"


def test_member_missing_from_wheel_lists_what_is_there(monkeypatch, cache):
    members = {"fake_pkg/models/other.onnx": _tiny_model_bytes()["model"]}
    monkeypatch.setattr(corpus.subprocess, "run", _fake_pip(members, []))
    with pytest.raises(CorpusUnavailable, match=r"no member 'fake_pkg/models/a.onnx'.*other\.onnx"):
        corpus.fetch(FAKE)


def test_hash_mismatch_leaves_nothing_in_the_cache(monkeypatch, cache):
    members = {"fake_pkg/models/a.onnx": _tiny_model_bytes()["model"]}
    monkeypatch.setattr(corpus.subprocess, "run", _fake_pip(members, []))
    with pytest.raises(CorpusUnavailable, match="does not match the pinned"):
        corpus.fetch(dataclasses.replace(FAKE, sha256="0" * 64))
    assert not any(p.is_file() for p in cache.rglob("*"))


def test_wheel_of_another_package_is_rejected(monkeypatch):
    members = {"fake_pkg/models/a.onnx": _tiny_model_bytes()["model"]}
    monkeypatch.setattr(
        corpus.subprocess, "run", _fake_pip(members, [], wheel_name="other-2.0-py3-none-any.whl")
    )
    with pytest.raises(CorpusUnavailable, match="no single matching wheel"):
        corpus.fetch(FAKE)


# --- the corpus table itself --------------------------------------------------------------


def test_corpus_entries_are_well_formed():
    keys = [m.key for m in corpus.CORPUS]
    assert len(keys) == len(set(keys))
    for m in corpus.CORPUS:
        assert m.member.endswith(".onnx") and len(m.sha256) == 64, m.key
        assert m.input_shapes, m.key
        for name, shape in m.input_shapes.items():
            assert isinstance(shape, tuple) and all(isinstance(d, int) and d > 0 for d in shape)
        assert set(m.fixed_inputs) <= set(m.input_shapes), m.key
        assert set(m.int_ranges) <= set(m.input_shapes), m.key
    hash(corpus.CORPUS[0])  # usable as a dict key / in sets despite the dict fields


def test_make_inputs_follows_pins_fixed_values_and_ranges(cache, monkeypatch):
    """Standard normal floats, zeros for ints, fixed_inputs cast to the input dtype."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
            helper.make_tensor_value_info("ids", TensorProto.INT32, ["n"]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["n"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    proto = helper.make_model(graph)
    model = dataclasses.replace(
        FAKE,
        input_shapes={"x": (3, 4), "sr": (), "ids": (1000,), "mask": (3,)},
        fixed_inputs={"sr": 16000},
        int_ranges={"ids": (0, 257)},
    )
    feeds = corpus.make_inputs(model, proto=proto)
    assert feeds["x"].shape == (3, 4) and feeds["x"].dtype == np.float32
    assert feeds["sr"].shape == () and feeds["sr"].dtype == np.int64 and feeds["sr"] == 16000
    assert feeds["ids"].dtype == np.int32 and 0 <= feeds["ids"].min() and feeds["ids"].max() <= 256
    assert feeds["mask"].tolist() == [0, 0, 0]
    pinned = corpus.pin_input_shapes(proto, model)
    assert [d.dim_value for d in pinned.graph.input[0].type.tensor_type.shape.dim] == [3, 4]


# --- real models (network on first run, cached after) ---------------------------------------


def _fetch_or_skip(model: CorpusModel) -> Path:
    try:
        return corpus.fetch(model)
    except CorpusUnavailable as e:
        pytest.skip(f"corpus model {model.key} unavailable: {e}")


@pytest.mark.corpus
def test_real_fetch_of_ppocr_cls_loads_and_runs_on_ort_cpu():
    import onnxruntime as ort

    model = corpus.get("ppocr_cls")
    path = _fetch_or_skip(model)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == model.sha256

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (probs,) = sess.run(None, corpus.make_inputs(model, proto=proto))
    assert probs.shape == (1, 2) and np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.corpus
@pytest.mark.slow
@pytest.mark.parametrize("model", corpus.CORPUS, ids=lambda m: m.key)
def test_every_corpus_model_runs_at_its_pins(model):
    """The pins and fixed inputs of every entry are enough for ORT CPU (about 130 MB once)."""
    import onnxruntime as ort

    path = _fetch_or_skip(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    outs = sess.run(None, corpus.make_inputs(model))
    assert all(np.isfinite(o).all() for o in outs if o.dtype.kind == "f")
