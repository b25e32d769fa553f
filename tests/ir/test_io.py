"""Reading, checking and writing models (``onnxcampo.ir.io``): the files written get the usual
permissions; a model is written whole or not at all, also in two steps (``StagedModel``); checks
and size tests of a large model give the verdicts of the whole model without serializing its
weights (``without_weights``, ``check_model``, ``exceeds_protobuf_limit``)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import make_model, tensor_vi, weight
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir
from onnxcampo.errors import ModelLoadError, WrittenModelLoadError


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_external_data_gets_the_model_files_mode(tmp_path, monkeypatch, umask):
    """A model past the protobuf limit (lowered here) -> ``<output>.<hex>.data`` next to it, with
    the model file's permissions (0666 less the umask), not the 0600 onnx writes it with."""
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [tensor_vi("x", [2, 64])],
                       [tensor_vi("y", [2, 64])], [numpy_helper.from_array(np.ones((64, 64), np.float32), "W")])
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    old = os.umask(umask)
    try:
        ir.save_model(model, tmp_path / "m.onnx", check_loads=False)
    finally:
        os.umask(old)
    modes = {_data_name(p.name): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"m.onnx": 0o666 & ~umask, "m.onnx.HEX.data": 0o666 & ~umask}


def _data_name(name: str) -> str:
    """``m.onnx.3fa2c1d0.data`` -> ``m.onnx.HEX.data``: a data file's name with its unique part."""
    return re.sub(r"\.[0-9a-f]{8}\.data$", ".HEX.data", name)


def mlp(width: int = 64) -> onnx.ModelProto:
    """Two MatMuls with width x width weights, a bias and an int64 shape constant."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("MatMul", ["a", "w2"], ["m"], name="mm2"),
             helper.make_node("Reshape", ["m", "shape"], ["y"], name="reshape")]
    inits = [weight("w1", (width, width)), weight("w2", (width, width), seed=1), weight("b", (width,)),
             numpy_helper.from_array(np.array([2, width], np.int64), "shape")]
    return make_model(nodes, [tensor_vi("x", [2, width])], [tensor_vi("y", [2, width])], inits)


# --- copies without the weights -------------------------------------------------------------
def test_a_weightless_copy_keeps_everything_but_the_large_initializers_data():
    """The held-out initializers (large, fixed-width, all their data in raw_data) become stubs
    with their name, type and dims, stored in the named location; the model's own tensors are
    handed back, not copied; small ones and those with typed data fields stay as they are; the
    model is not modified."""
    model = mlp()
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [32, 32], np.ones(1024, np.float32))  # float_data
    model.graph.initializer.append(typed)
    model.producer_name, model.doc_string = "maker", "doc"
    before = model.SerializeToString()
    copy, held = ir.without_weights(model, location="nowhere")
    assert model.SerializeToString() == before
    assert sorted(held) == ["w1", "w2"] and held["w1"] is model.graph.initializer[0]
    stubs = {t.name: t for t in copy.graph.initializer}
    assert [t.name for t in copy.graph.initializer] == [t.name for t in model.graph.initializer]
    assert (list(stubs["w1"].dims), stubs["w1"].data_type, stubs["w1"].raw_data) == ([64, 64], TensorProto.FLOAT, b"")
    assert stubs["w1"].data_location == TensorProto.EXTERNAL
    assert [(e.key, e.value) for e in stubs["w1"].external_data] == [("location", "nowhere")]
    for name in ("b", "shape", "typed"):
        assert stubs[name] == next(t for t in model.graph.initializer if t.name == name)
    assert copy.graph.node == model.graph.node and copy.producer_name == "maker" and copy.doc_string == "doc"


@pytest.fixture
def weightless_checks(monkeypatch):
    """Every ModelProto is checked from a weightless copy; the paths the checker is given."""
    monkeypatch.setattr(ir.io, "WEIGHTLESS_CHECK_BYTES", 0)
    paths = []
    real = onnx.checker.check_model

    def spy(model, *args, **kwargs):
        if isinstance(model, str):
            paths.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.checker, "check_model", spy)
    return paths


def test_a_large_model_is_checked_from_a_copy_without_its_weights(weightless_checks):
    """The weightless copy is checked by path next to an empty data file: a valid model passes,
    a model with a bad node fails with the checker's own message, and the model is left as it
    was."""
    model = mlp()
    before = model.SerializeToString()
    ir.check_model(model)
    assert len(weightless_checks) == 1 and model.SerializeToString() == before
    model.graph.node[0].attribute.append(helper.make_attribute("bogus", 1))
    with pytest.raises(onnx.checker.ValidationError) as weightless:
        ir.check_model(model)
    with pytest.raises(onnx.checker.ValidationError) as whole:
        onnx.checker.check_model(model)
    assert str(weightless.value).splitlines()[0] == str(whole.value).splitlines()[0]
    assert len(weightless_checks) == 2


def test_raw_data_of_the_wrong_size_is_checked_in_the_model_itself(weightless_checks):
    """The weightless check stands for the whole one only where each held-out tensor's raw data
    has its declared size: a short one is checked as it is, and fails as the checker says."""
    model = mlp()
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    with pytest.raises(onnx.checker.ValidationError, match="raw_data size"):
        ir.check_model(model)
    assert not weightless_checks


def test_ort_training_ops_pass_the_weightless_check_too(weightless_checks):
    """MaxPoolGrad in the default domain is checked as a foreign op in the weightless copy as in
    the model, which keeps its domain and opsets."""
    model = make_model([helper.make_node("MaxPoolGrad", ["dy", "indices"], ["dx"], name="pool_grad"),
                        helper.make_node("MatMul", ["dx", "w"], ["y"], name="mm")],
                       [tensor_vi("dy", [1, 64]), tensor_vi("indices", [1, 64], TensorProto.INT64)],
                       [tensor_vi("y", [1, 64])], [weight("w", (64, 64))],
                       opsets=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    ir.check_model(model)
    assert weightless_checks and model.graph.node[0].domain == "" and len(model.opset_import) == 2


def test_a_file_is_loaded_then_checked_without_a_second_copy_of_its_weights(tmp_path, weightless_checks):
    """read_model of a file: the checker sees the weightless copy; a file whose graph the checker
    rejects is a ModelLoadError naming it."""
    model = mlp()
    onnx.save(model, tmp_path / "m.onnx")
    loaded, path = ir.read_model(tmp_path / "m.onnx")
    assert loaded == model and path == tmp_path / "m.onnx"
    assert len(weightless_checks) == 1 and not weightless_checks[0].startswith(str(tmp_path))
    model.graph.node[1].input.append("extra")
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(ModelLoadError, match="bad.onnx: invalid ONNX model: "):
        ir.read_model(tmp_path / "bad.onnx")


# --- the protobuf limit ---------------------------------------------------------------------
def odd_tensor(index: int) -> onnx.TensorProto:
    """A tensor using every TensorProto field with awkward values (long names, negative int32
    and int64 data that encode in ten bytes, many dims, metadata)."""
    rng = np.random.default_rng(index)
    tensor = TensorProto(name="t" * int(rng.integers(1, 300)), doc_string="d" * int(rng.integers(0, 300)),
                         data_type=TensorProto.FLOAT)
    tensor.dims.extend(int(d) for d in rng.integers(0, 2**40, size=int(rng.integers(0, 12))))
    kind = index % 5
    count = int(rng.integers(0, 300))
    if kind == 0:
        tensor.raw_data = bytes(count)
    elif kind == 1:
        tensor.int32_data.extend([-1] * count)
    elif kind == 2:
        tensor.int64_data.extend([-(2**62)] * count)
    elif kind == 3:
        tensor.string_data.extend([b"s" * 40] * count)
    else:
        tensor.uint64_data.extend([2**63] * count)
        tensor.double_data.extend([1.5] * count)
    tensor.external_data.add(key="k" * count, value="v")
    tensor.metadata_props.add(key="m", value="v" * count)
    tensor.segment.begin, tensor.segment.end = 2**62, -1
    tensor.data_location = TensorProto.EXTERNAL
    return tensor


def test_the_size_bound_is_never_below_the_serialized_size():
    """exceeds_protobuf_limit answers from a bound of the serialized size (weights measured, not
    encoded) when that bound is below the limit: the bound must hold for any tensor."""
    for index in range(60):
        tensors = [odd_tensor(index * 3 + k) for k in range(3)]
        model = make_model([helper.make_node("Identity", ["x"], ["y"], name="n" * 70)], [tensor_vi("x", [1])],
                           [tensor_vi("y", [1])], tensors)
        model.metadata_props.add(key="k", value="v" * 500)
        raw = [len(t.raw_data) for t in model.graph.initializer]
        assert ir.io._size_bound(model, raw) >= model.ByteSize()


def test_a_model_near_the_limit_is_measured_whole(monkeypatch):
    """Where the bound reaches the limit (lowered here) the model's own ByteSize decides."""
    model = mlp()
    size = model.ByteSize()
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", size + 1)  # the bound is above, the size below
    assert ir.io._size_bound(model, [len(t.raw_data) for t in model.graph.initializer]) > size + 1
    assert ir.exceeds_protobuf_limit(model) is False
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", size)
    assert ir.exceeds_protobuf_limit(model) is True


# --- writing in two steps -------------------------------------------------------------------
def test_a_staged_model_is_written_and_test_loaded_once_then_renamed(tmp_path, monkeypatch):
    """write() writes the temporary file and test-loads it (once); commit() renames it over the
    output; the model file is save_model's."""
    loads = []
    from onnxcampo.runtime import check

    real = check.check_loads
    monkeypatch.setattr(check, "check_loads", lambda *args, **kwargs: loads.append(args[0]) or real(*args, **kwargs))
    model, output = mlp(), tmp_path / "m.onnx"
    output.write_bytes(b"old")
    with ir.StagedModel(output) as staged:
        staged.write(model)
        assert staged.model is model and staged.path.parent == tmp_path and output.read_bytes() == b"old"
        assert loads == [staged.path]
        staged.commit()
        assert staged.path is None
    assert output.read_bytes() == model.SerializeToString() and len(loads) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_a_staged_model_not_committed_leaves_nothing(tmp_path):
    """Leaving the block without commit (the accuracy check failed under --validate) removes the
    temporary file; an existing output stays as it was."""
    output = tmp_path / "m.onnx"
    output.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="check failed"):
        with ir.StagedModel(output) as staged:
            staged.write(mlp())
            raise RuntimeError("check failed")
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"] and output.read_bytes() == b"old"


def test_a_staged_model_ort_cannot_load_is_not_written(tmp_path):
    """The test-load fails at write(): the error says nothing was written, and nothing is."""
    model = mlp()
    model.graph.initializer[1].CopyFrom(weight("w2", (32, 64)))  # [2, 64] x [32, 64]
    with pytest.raises(WrittenModelLoadError, match="nothing was written"):
        with ir.StagedModel(tmp_path / "m.onnx") as staged:
            staged.write(model)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("loads", [True, False])
def test_a_background_write_is_finished_by_wait_and_commit(tmp_path, loads):
    """``write(background=True)`` returns at once; ``wait`` raises the test-load's error (its file
    removed, nothing written), and a model that loads is committed whole; leaving the block
    without ``wait`` leaves nothing behind either way."""
    model = mlp()
    if not loads:
        model.graph.initializer[1].CopyFrom(weight("w2", (32, 64)))  # [2, 64] x [32, 64]
    output = tmp_path / "m.onnx"
    with ir.StagedModel(output) as staged:
        staged.write(model, background=True)
        assert staged.model is model
        if not loads:
            with pytest.raises(WrittenModelLoadError, match="nothing was written"):
                staged.wait()
            assert not list(tmp_path.iterdir())
        else:
            staged.wait()
            assert staged.path.exists()
            staged.commit()
    assert [p.name for p in tmp_path.iterdir()] == (["m.onnx"] if loads else [])
    if loads:
        assert output.read_bytes() == model.SerializeToString()
    with ir.StagedModel(output) as staged:  # not waited for: the block's end finishes and removes it
        staged.write(mlp(), background=True)
    assert [p.name for p in tmp_path.iterdir()] == (["m.onnx"] if loads else [])


def test_a_staged_model_past_the_limit_is_saved_at_commit(tmp_path, monkeypatch):
    """Past the protobuf limit (lowered here) write() writes nothing (the conversion to external
    data strips the model's tensors, which the caller still runs): commit() saves the model and
    its data file, and the model the caller ran kept its weights until then."""
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    model, output = mlp(), tmp_path / "m.onnx"
    with ir.StagedModel(output) as staged:
        staged.write(model, check_loads=False)
        assert staged.path is None and not list(tmp_path.iterdir()) and model.graph.initializer[0].raw_data
        staged.commit()
    assert sorted(_data_name(p.name) for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.HEX.data"]


def _external_model(value: float):
    """A MatMul whose weight (64x64, every element ``value``) goes to external data past the
    lowered limit: the output says which write it came from."""
    return make_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [tensor_vi("x", [2, 64])],
                      [tensor_vi("y", [2, 64])], [numpy_helper.from_array(np.full((64, 64), value, np.float32), "W")])


def _written_value(path) -> float:
    loaded = onnx.load(str(path))
    values = {float(v) for v in numpy_helper.to_array(loaded.graph.initializer[0]).reshape(-1)}
    assert len(values) == 1, "a model whose data came from two writes"
    return values.pop()


def test_writers_racing_for_one_path_leave_one_whole_model_and_no_stale_data(tmp_path, monkeypatch):
    """Eight threads write eight external-data models to one path at once: the model left is one
    of them with its own data (every weight the same value), and only its data file is left."""
    import threading

    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    out = tmp_path / "m.onnx"
    start = threading.Barrier(8)

    def write(value):
        start.wait()
        ir.save_model(_external_model(value), out, check_loads=False)

    threads = [threading.Thread(target=write, args=(float(k),)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert _written_value(out) in {float(k) for k in range(8)}
    ir.save_model(_external_model(9.0), out, check_loads=False)  # a later write cleans what a race left
    assert _written_value(out) == 9.0
    names = sorted(_data_name(p.name) for p in tmp_path.iterdir())
    assert names[0] == "m.onnx" and set(names[1:]) == {"m.onnx.HEX.data"}


def test_a_crash_before_the_rename_leaves_the_old_model_whole(tmp_path, monkeypatch):
    """The new data is written under its own name and the model renamed last: a write that dies
    at the rename leaves the old model with its old data (and removes its own files)."""
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    out = tmp_path / "m.onnx"
    ir.save_model(_external_model(1.0), out, check_loads=False)
    before = sorted(p.name for p in tmp_path.iterdir())
    real_replace = os.replace

    def crash(src, dst):
        if str(dst) == str(out):
            raise KeyboardInterrupt("killed between writing the data and renaming the model")
        real_replace(src, dst)

    monkeypatch.setattr(ir.io.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ir.save_model(_external_model(2.0), out, check_loads=False)
    monkeypatch.setattr(ir.io.os, "replace", real_replace)
    assert _written_value(out) == 1.0 and sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_inline_rewrite_removes_the_data_the_old_model_had(tmp_path, monkeypatch):
    """An external-data model replaced by one under the limit: its data file goes too; a data
    file of another name (maybe shared by other models) is never touched."""
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    out = tmp_path / "m.onnx"
    ir.save_model(_external_model(1.0), out, check_loads=False)
    (tmp_path / "m.onnx.data").write_bytes(b"stale, from an older write")
    (tmp_path / "weights.bin").write_bytes(b"someone else's")
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", (1 << 31) - (1 << 20))
    ir.save_model(_external_model(3.0), out, check_loads=False)
    assert _written_value(out) == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "weights.bin"]


def test_a_killed_writes_leftovers_are_swept_by_the_next_write_when_old(tmp_path, monkeypatch):
    """A killed run leaves its hidden temporary file or an unnamed data file: the next write to
    the same output removes those older than an hour; a young one (a write still running) stays."""
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    out = tmp_path / "m.onnx"
    ir.save_model(_external_model(1.0), out, check_loads=False)
    old_tmp, young_tmp = tmp_path / ".m.onnx.dead.tmp", tmp_path / ".m.onnx.live.tmp"
    old_data = tmp_path / "m.onnx.0badc0de.data"
    for path in (old_tmp, young_tmp, old_data):
        path.write_bytes(b"left over")
    stale = os.path.getmtime(out) - 2 * ir.io.STALE_S
    os.utime(old_tmp, (stale, stale))
    os.utime(old_data, (stale, stale))
    ir.save_model(_external_model(2.0), out, check_loads=False)
    names = sorted(_data_name(p.name) for p in tmp_path.iterdir())
    assert names == [".m.onnx.live.tmp", "m.onnx", "m.onnx.HEX.data"] and _written_value(out) == 2.0


def test_forty_rounds_of_racing_writers_some_killed_leave_one_whole_model(tmp_path, monkeypatch):
    """40 rounds: each, eight threads write external-data models to one path at once, and three of
    them die at a different point (writing, before the rename, after it while removing the old
    data). After every round the model at the path loads whole: every weight one writer's value,
    its data file its own. No round leaves a model that mixes two writes."""
    import threading

    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    out = tmp_path / "m.onnx"
    real_replace, real_unlink = os.replace, Path.unlink
    doomed: dict[str, str] = {}  # thread name -> where it dies

    def replace(src, dst):
        if doomed.get(threading.current_thread().name) == "rename" and str(dst) == str(out):
            raise KeyboardInterrupt("killed before the rename")
        real_replace(src, dst)

    def unlink(self, missing_ok=False):
        if doomed.get(threading.current_thread().name) == "cleanup" and self.name.endswith(".data"):
            raise KeyboardInterrupt("killed removing the old data")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(ir.io.os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    for round_ in range(40):
        start = threading.Barrier(8)
        doomed.clear()
        names = [f"writer-{round_}-{k}" for k in range(8)]
        doomed.update({names[round_ % 8]: "rename", names[(round_ + 3) % 8]: "cleanup"})

        def write(value, name):
            start.wait()
            try:
                ir.save_model(_external_model(value), out, check_loads=False)
            except KeyboardInterrupt:
                pass

        threads = [threading.Thread(target=write, args=(float(round_ * 8 + k), n), name=n) for k, n in enumerate(names)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        value = _written_value(out)  # one writer's value throughout, its own data
        assert value in {float(round_ * 8 + k) for k in range(8)}
        assert doomed.get(names[int(value) % 8]) != "rename"  # a writer killed before its rename never wins
