"""What onnxcampo writes loads in ONNX Runtime.

* ``ir.save_model`` test-loads the temporary file (``onnxcampo.runtime.check``) before the
  rename: a model ORT rejects leaves nothing behind, and an existing output stays as it was;
* the exported model carries no tensor named like the initializers ORT's own fusions generate
  (``transformer.clean_export``): ORT names them without looking at the tensors already in the graph.

The model ORT rejects is a genuine one (reproduced on ORT CPU 1.32): a 3-D MatMul+Add saved by
ORT itself (``optimized_model_filepath``), whose MatMulAddFusion left the initializers
``gemm_input_shape`` / ``gemm_output_shape``, plus one more 3-D MatMul+Add: loading it at
``ORT_ENABLE_BASIC`` or higher fuses that one too, under the same names: "AddInitializedOrtValue
Attempt to replace the existing tensor".
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo import ir
from onnxcampo.rewrites import transformer
from onnxcampo.cli import main
from onnxcampo.errors import WrittenModelLoadError
from onnxcampo.runtime import make_session, run

COLLISION = "Attempt to replace the existing tensor"


def _weights(name: str, shape, seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def ort_optimized(tmp_path) -> onnx.ModelProto:
    """``y = x @ w1 + b1`` on a 3-D x, as ORT saves it after its graph optimizations."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="mm1"),
         helper.make_node("Add", ["m1", "b1"], ["y"], name="add1")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 32])],
        [_weights("w1", (16, 32), 0), _weights("b1", (32,), 1)])
    plain = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(plain))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(tmp_path / "plain.ort.onnx")
    ort.InferenceSession(str(plain), options, providers=["CPUExecutionProvider"])
    saved = onnx.load(options.optimized_model_filepath)
    assert {"gemm_input_shape", "gemm_output_shape"} <= {t.name for t in saved.graph.initializer}
    return saved


def colliding(tmp_path) -> onnx.ModelProto:
    """The ORT-saved model followed by another 3-D MatMul+Add, which ORT fuses at load."""
    model = ort_optimized(tmp_path)
    graph = model.graph
    graph.node.extend([helper.make_node("MatMul", ["y", "w2"], ["m2"], name="mm2"),
                       helper.make_node("Add", ["m2", "b2"], ["z"], name="add2")])
    graph.initializer.extend([_weights("w2", (32, 16), 2), _weights("b2", (16,), 3)])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8, 16]))
    onnx.checker.check_model(model, full_check=True)
    return model


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# --- the reproduction ---------------------------------------------------------------------------
def test_ort_collides_with_the_names_its_fusions_generate(tmp_path):
    """The failure the renaming avoids: ORT CPU, ORT_ENABLE_BASIC and up (MatMulAddFusion)."""
    model = colliding(tmp_path)
    make_session(model, optimization_level="disable")  # the graph itself is fine
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT's pybind error types
        assert COLLISION in str(exc)
    else:
        pytest.skip(f"onnxruntime {ort.__version__} no longer collides with its own generated names")


# --- save_model's check -----------------------------------------------------------------------
def test_a_model_ort_rejects_is_not_written_and_an_old_output_stays(tmp_path):
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    out.write_bytes(b"old model")
    model = colliding(tmp_path)
    with pytest.raises(WrittenModelLoadError) as caught:
        ir.save_model(model, out)
    message = str(caught.value)
    assert message == (f"{out}: ONNX Runtime {ort.__version__} cannot load the model on the CPU EP (ORT_ENABLE_ALL): "
                       f"AddInitializedOrtValue {COLLISION}; nothing was written")
    assert caught.value.exit_code == 3
    assert out.read_bytes() == b"old model"
    with pytest.raises(WrittenModelLoadError):
        ir.save_model(model, out.parent / "new.onnx")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]  # no temporary file left


def test_the_check_can_be_skipped(tmp_path):
    out = tmp_path / "model.onnx"
    ir.save_model(colliding(tmp_path), out, check_loads=False)
    assert onnx.load(str(out)).graph.output[0].name == "z"


def test_an_external_data_model_is_checked_before_its_data_replaces_the_old(tmp_path, monkeypatch):
    """Over protobuf's limit (lowered here) the model is loaded from the temporary file with its
    data under its own new name: a rejected model leaves the old model and its <output>.data
    alone; an accepted one replaces both (the old data file removed after the rename)."""
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 1024)
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    data = out.parent / "model.onnx.data"
    out.write_bytes(b"old model")
    data.write_bytes(b"old data")
    with pytest.raises(WrittenModelLoadError, match=COLLISION):
        ir.save_model(colliding(tmp_path), out)
    assert (out.read_bytes(), data.read_bytes()) == (b"old model", b"old data")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    ir.save_model(ort_optimized(tmp_path), out)
    assert not data.exists()
    (written,) = out.parent.glob("model.onnx.*.data")
    assert written.stat().st_size > 1024
    x = np.ones((2, 8, 16), dtype=np.float32)
    assert run(make_session(out), {"x": x})["y"].shape == (2, 8, 32)


def test_ops_no_session_here_can_run_are_written_with_a_warning(tmp_path, caplog):
    """A custom domain without a kernel in this onnxruntime: the build that runs it must load it."""
    graph = helper.make_graph([helper.make_node("Frobnicate", ["x"], ["y"], domain="example.custom")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    out = tmp_path / "custom.onnx"
    with caplog.at_level(logging.WARNING, logger="onnxcampo.runtime.check"):
        ir.save_model(model, out)
    assert out.exists()
    assert f"not test-loaded on the CPU EP: this onnxruntime {ort.__version__} has no kernel for " \
           "example.custom::Frobnicate" in caplog.text


def test_cli_exits_nonzero_with_one_line_and_keeps_the_old_output(tmp_path, capsys, monkeypatch):
    """Without the renaming at export, the colliding model's optimized output would not load; nor
    does the input itself (ORT's own collision): the error names the input, exit 2, one line."""
    monkeypatch.setattr(transformer, "rename_ort_generated_names", lambda model: {})
    source = tmp_path / "in.onnx"
    onnx.save(colliding(tmp_path), str(source))
    out = tmp_path / "out.onnx"
    out.write_bytes(b"old model")
    code = main(["optimize", str(source), str(out), "--policy", "fp32"])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"onnxcampo: error: {source}: the input model does not load in ONNX Runtime either")
    assert COLLISION in lines[0] and lines[0].endswith("nothing was written")
    assert out.read_bytes() == b"old model"
    assert leftovers(tmp_path) == []


# --- the renaming at export -------------------------------------------------------------------
def test_the_exported_model_renames_ort_generated_names_and_loads(tmp_path):
    """Fails without ``transformer.clean_export``: the written model would collide at load. The outputs
    on ORT CPU are compared as a wiring check (ORT's CPU provider hides fp16 rounding)."""
    model = colliding(tmp_path)
    result = onnxcampo.optimize(model)
    names = {t.name for t in result.model.graph.initializer}
    assert {"onnxcampo/gemm_input_shape", "onnxcampo/gemm_output_shape"} <= names
    assert not {"gemm_input_shape", "gemm_output_shape"} & names
    x = np.random.default_rng(4).standard_normal((2, 8, 16)).astype(np.float32)
    expected = run(make_session(model, optimization_level="disable"), {"x": x})["z"]
    got = run(make_session(result.model, optimization_level="all"), {"x": x})["z"]
    np.testing.assert_allclose(got, expected, rtol=0.02, atol=0.05)
    result.save(tmp_path / "out.onnx")  # the load check passes


def test_renaming_reaches_subgraphs_and_token_suffixes_and_spares_graph_outputs():
    shape = numpy_helper.from_array(np.array([4, 2], dtype=np.int64), "gemm_input_shape_token_3")
    branch = helper.make_graph([helper.make_node("Reshape", ["x", "gemm_input_shape_token_3"], ["r"])], "then", [],
                               [helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 2])])
    other = helper.make_graph([helper.make_node("Reshape", ["x", "gemm_input_shape_token_3"], ["s"])], "else", [],
                              [helper.make_tensor_value_info("s", TensorProto.FLOAT, [4, 2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["gemm_output_shape"], then_branch=branch, else_branch=other),
         helper.make_node("Identity", ["gemm_output_shape"], ["squeeze_axes"]),
         helper.make_node("Identity", ["squeeze_axes"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("gemm_output_shape", TensorProto.FLOAT, [4, 2]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    mapping = transformer.rename_ort_generated_names(model)
    assert mapping == {"gemm_input_shape_token_3": "onnxcampo/gemm_input_shape_token_3",
                       "squeeze_axes": "onnxcampo/squeeze_axes"}
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.node[0].attribute[0].g.node[0].input[1] == "onnxcampo/gemm_input_shape_token_3"
    assert [o.name for o in model.graph.output] == ["gemm_output_shape", "y"]
    outputs = run(make_session(model), {"x": np.arange(8, dtype=np.float32), "c": np.array(True)})
    assert outputs["y"].shape == (4, 2)


def test_a_device_failure_on_the_cuda_ep_is_a_warning_not_a_refusal(monkeypatch, caplog):
    """CUDA out of memory while test-loading (the CPU session loaded the same file): the model is
    kept with a warning; a graph error on the CUDA EP still refuses it."""
    import logging

    from onnxcampo.errors import ModelLoadError, WrittenModelLoadError
    from onnxcampo.runtime import check

    def failing(message):
        def make_session(*args, **kwargs):
            raise ModelLoadError("ONNX Runtime could not load the model") from RuntimeError(message)
        return make_session

    import onnxcampo.runtime as runtime

    model = onnx.parser.parse_model('<ir_version: 10, opset_import: ["" : 17]> g (float[2] x) => (float[2] y) { y = Relu(x) }')
    monkeypatch.setattr(runtime, "make_session", failing("CUDA failure 2: out of memory ; GPU=0"))
    with caplog.at_level(logging.WARNING, logger="onnxcampo.runtime.check"):
        assert check._load(model, check.CUDA, "m.onnx", False) is False
    assert "device failed" in caplog.text
    monkeypatch.setattr(runtime, "make_session", failing("Attempt to replace the existing tensor gemm_input_shape"))
    with pytest.raises(WrittenModelLoadError, match="replace the existing tensor"):
        check._load(model, check.CUDA, "m.onnx", False)
