"""Tests for onnxcampo.runtime: inputs, sessions, output comparison and validation."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, runtime
from onnxcampo.errors import CampoError, ConfigError, ModelLoadError, ShapeError
from onnxcampo.runtime import (
    OutputDiff,
    compare_outputs,
    load_inputs_npz,
    make_session,
    random_inputs,
    run,
    validate,
)


def mlp(*, batch: str | int = "batch", shift: float | None = None) -> onnx.ModelProto:
    """MatMul + Add + Relu with a dynamic batch; ``shift`` adds a constant to the output."""
    rng = np.random.default_rng(1)
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3],
                           rng.standard_normal(12).astype(np.float32))
    b = helper.make_tensor("B", TensorProto.FLOAT, [3], rng.standard_normal(3).astype(np.float32))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "B"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r" if shift is not None else "y"], name="relu"),
    ]
    inits = [w, b]
    if shift is not None:
        inits.append(helper.make_tensor("S", TensorProto.FLOAT, [], [shift]))
        nodes.append(helper.make_node("Add", ["r", "S"], ["y"], name="shift"))
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def embed() -> onnx.ModelProto:
    """Gather from an 8-row table by int64 ids, a bool mask, and a weight also listed as input."""
    table = helper.make_tensor("T", TensorProto.FLOAT, [8, 2], np.arange(16, dtype=np.float32))
    graph = helper.make_graph(
        [helper.make_node("Gather", ["T", "ids"], ["g"], name="gather"),
         helper.make_node("Cast", ["mask"], ["mf"], name="cast", to=TensorProto.FLOAT),
         helper.make_node("Mul", ["g", "mf"], ["y"], name="mul")],
        "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 5]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n", 5, 1]),
         helper.make_tensor_value_info("T", TensorProto.FLOAT, [8, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5, 2])],
        [table],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


# ---- random_inputs ------------------------------------------------------------------------


def test_random_inputs_dim_values_and_pins():
    feeds = random_inputs(mlp(), dim_values={"batch": 5})
    assert list(feeds) == ["x"]
    assert feeds["x"].shape == (5, 4) and feeds["x"].dtype == np.float32
    pinned = random_inputs(mlp(), input_shapes={"x": (2, 4)}, dim_values={"batch": 5})
    assert pinned["x"].shape == (2, 4)


@pytest.mark.parametrize("shape, axes", [((2, 3, 64, 48), (2, 3)), ((2, 64, 48, 3), (1, 2)), ((1, 1, 32, 32), (2, 3))])
def test_a_batch_of_images_is_generated_smooth_with_unit_spread(shape, axes):
    """Image inputs get regions and edges (neighbouring pixels close: their mean difference a
    fraction of the spread), not independent noise; their spread stays about 1; other floats stay
    standard normal."""
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    x = random_inputs(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))["x"]
    assert x.shape == shape and x.dtype == np.float32
    assert 0.8 < x.std() < 1.2 and abs(x.mean()) < 0.3
    step = np.abs(np.diff(x, axis=axes[1])).mean()
    assert step < 0.35 * x.std()  # independent noise: about 1.13 times the spread
    noise = random_inputs(mlp(), dim_values={"batch": 4096})["x"]
    assert np.abs(np.diff(noise, axis=0)).mean() > 1.0


def test_random_inputs_is_seeded():
    a = random_inputs(mlp(), dim_values={"batch": 3}, seed=7)["x"]
    b = random_inputs(mlp(), dim_values={"batch": 3}, seed=7)["x"]
    c = random_inputs(mlp(), dim_values={"batch": 3}, seed=8)["x"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_random_inputs_dynamic_dim_error_has_pin_hint():
    """From Python the hint names the API's arguments; under the command line its flags."""
    from onnxcampo.errors import command_line

    with pytest.raises(ShapeError) as info:
        random_inputs(mlp())
    msg = str(info.value)
    assert "input 'x' has dynamic dim 'batch' (axis 0)" in msg
    assert "input_shapes={'x': (1,4)}" in msg and "dim_values={'batch': N}" in msg and "--" not in msg
    with command_line(), pytest.raises(ShapeError) as info:
        random_inputs(mlp())
    assert "--input-shape x:1,4" in str(info.value) and "--dim batch=N" in str(info.value)


def test_random_inputs_unnamed_dynamic_dim():
    model = mlp()
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()  # neither dim_value nor dim_param: dynamic
    with pytest.raises(ShapeError, match=r"unnamed dynamic dim \(axis 0\).*input_shapes=\{'x': \(1,4\)\}"):
        random_inputs(model)


def test_random_inputs_of_a_zero_size_dim_have_no_rows():
    """dim_value 0 is a zero-size dim (ONNX's backend tests have them), not a dynamic one."""
    assert random_inputs(mlp(batch=0))["x"].shape[0] == 0


def test_random_inputs_pin_rank_mismatch():
    with pytest.raises(ShapeError, match="rank 2 but input_shapes gives 3"):
        random_inputs(mlp(), input_shapes={"x": (1, 4, 1)})


def test_random_inputs_pin_conflicts_with_static_dim():
    with pytest.raises(ShapeError, match="axis 1 is fixed at 4"):
        random_inputs(mlp(), input_shapes={"x": (1, 5)})


def test_random_inputs_unknown_pin_name():
    with pytest.raises(ConfigError, match="unknown input"):
        random_inputs(mlp(), input_shapes={"nope": (1,)}, dim_values={"batch": 1})


def test_random_inputs_int_bool_and_initializer_inputs():
    feeds = random_inputs(embed(), dim_values={"n": 64})
    assert set(feeds) == {"ids", "mask"}  # T is an initializer too: not a real input
    ids = feeds["ids"]
    assert ids.dtype == np.int64 and ids.shape == (64, 5)
    assert ids.min() >= 0 and ids.max() < 8
    assert len(np.unique(ids)) > 1
    assert feeds["mask"].dtype == np.bool_ and feeds["mask"].all()  # a mask: everything attended
    run(make_session(embed()), feeds)  # ids are valid indices into the 8-row table


def test_random_inputs_give_named_inputs_the_values_they_take():
    """Masks ones, token type ids zeros, position ids 0..n-1, a sample rate 16000; an input the
    names say nothing about stays random (bools: a fair coin)."""
    from onnx import TensorProto as T

    def vi(name, dtype, shape):
        return onnx.helper.make_tensor_value_info(name, dtype, shape)

    names = [("attention_mask", T.INT64, [2, 4]), ("token_type_ids", T.INT64, [2, 4]),
             ("position_ids", T.INT64, [2, 4]), ("sr", T.INT64, []), ("flags", T.BOOL, [64]),
             ("input_ids", T.INT64, [2, 4])]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", [n], [n + "_out"]) for n, _, _ in names], "g",
                                   [vi(*n) for n in names], [vi(n + "_out", t, s) for n, t, s in names])
    feeds = random_inputs(onnx.helper.make_model(graph))
    assert (feeds["attention_mask"] == 1).all() and (feeds["token_type_ids"] == 0).all()
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert feeds["sr"].shape == () and int(feeds["sr"]) == 16000
    assert feeds["flags"].any() and not feeds["flags"].all()
    assert len(np.unique(feeds["input_ids"])) > 1


# ---- load_inputs_npz ------------------------------------------------------------------------


def test_load_inputs_npz_ok(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, x=np.ones((2, 4), np.float32))
    feeds = load_inputs_npz(path, mlp())
    assert feeds["x"].shape == (2, 4)


@pytest.mark.parametrize("arrays, pattern", [
    ({}, r"missing input\(s\) \['x'\]"),
    ({"x": np.ones((2, 4), np.float64)},
     "input 'x' has dtype float64 but the model expects float32"),
    ({"x": np.ones((2, 4), np.float32), "z": np.ones(1)}, r"unknown input name\(s\) \['z'\]"),
    ({"x": np.ones((2, 5), np.float32)}, "axis 1 is 5"),
])
def test_load_inputs_npz_errors(tmp_path, arrays, pattern):
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    with pytest.raises(ConfigError, match=pattern):
        load_inputs_npz(path, mlp())


def test_load_inputs_npz_missing_and_garbage_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_inputs_npz(tmp_path / "none.npz", mlp())
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a readable"):
        load_inputs_npz(bad, mlp())


# ---- sessions -------------------------------------------------------------------------------


def test_make_session_from_proto_bytes_and_path(tmp_path):
    model = mlp()
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path)
    feeds = {"x": np.ones((2, 4), np.float32)}
    results = [run(make_session(src, optimization_level=level), feeds)["y"]
               for src, level in [(model, "all"), (model.SerializeToString(), "basic"),
                                  (str(path), "disable"), (path, "all")]]
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=1e-6)


def test_make_session_large_model_goes_through_external_data(monkeypatch, caplog):
    model = mlp()
    # a raw_data weight above onnx's 1 KiB threshold really goes to the external file
    model.graph.initializer.append(
        numpy_helper.from_array(np.full((32, 32), 0.5, np.float32), "big"))
    model.graph.node.append(helper.make_node("ReduceSum", ["big"], ["big_sum"], name="rs"))
    model.graph.output.append(helper.make_tensor_value_info("big_sum", TensorProto.FLOAT, [1, 1]))
    before = model.SerializeToString()
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    with caplog.at_level(logging.INFO, logger="onnxcampo.runtime"):
        session = make_session(model)
    assert "external data" in caplog.text
    assert model.SerializeToString() == before  # caller's proto left intact
    out = run(session, {"x": np.ones((1, 4), np.float32)})
    assert out["big_sum"].item() == 512.0
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 2**31 - 1)
    ref = run(make_session(model), {"x": np.ones((1, 4), np.float32)})
    np.testing.assert_array_equal(out["y"], ref["y"])


def test_make_session_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown provider"):
        make_session(mlp(), provider="tpu")
    with pytest.raises(ConfigError, match="optimization level"):
        make_session(mlp(), optimization_level="max")
    with pytest.raises(ModelLoadError, match="does not exist"):
        make_session(tmp_path / "missing.onnx")
    with pytest.raises(ModelLoadError, match="could not load"):
        make_session(b"garbage")
    with pytest.raises(ConfigError, match="custom-op library"):
        make_session(mlp(), custom_ops_library=str(tmp_path / "nope.so"))


def test_make_session_cuda_unavailable_is_clear(monkeypatch):
    monkeypatch.setattr(runtime.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(CampoError, match="CUDAExecutionProvider"):
        make_session(mlp(), provider="cuda")


def test_make_session_session_config_sets_attributes_and_config_entries():
    """``session.<attribute>`` of SessionOptions is set as that attribute (booleans as 0/1), any
    other key is a config entry; log_severity is ORT's log level."""
    session = make_session(mlp(), session_config={"session.intra_op_num_threads": "1",
                                                  "session.enable_mem_pattern": "0",
                                                  "session.intra_op.allow_spinning": "0"}, log_severity=3)
    options = session.get_session_options()
    assert options.intra_op_num_threads == 1 and options.enable_mem_pattern is False
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.log_severity_level == 3
    assert make_session(mlp(), intra_op_threads=2,
                        session_config={"session.intra_op_num_threads": 1}).get_session_options().intra_op_num_threads == 1


@pytest.mark.parametrize("kwargs, pattern", [
    ({"session_config": {"session.enable_mem_pattern": "maybe"}}, "enable_mem_pattern"),
    ({"session_config": {"session.intra_op_num_threads": "many"}}, "intra_op_num_threads"),
    ({"session_config": {"session.graph_optimization_level": "1"}}, "not set from text"),
    ({"log_severity": 7}, "log severity"),
    ({"cuda_options": {"prefer_nhwc": "1"}}, "need provider 'cuda'"),
])
def test_make_session_option_errors(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        make_session(mlp(), **kwargs)


def test_cuda_provider_options_tf32_graphs_and_extras(monkeypatch):
    """The CUDA EP's options: use_tf32 from tf32 (on by default), enable_cuda_graph from
    cuda_graph, cuda_options on top; the two own keys cannot come through cuda_options."""
    monkeypatch.setattr(runtime.ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "_dlls_preloaded", True)
    assert runtime._providers("cuda") == [("CUDAExecutionProvider", {"use_tf32": "1"}), "CPUExecutionProvider"]
    cuda, cpu = runtime._providers("cuda", True, tf32=False, cuda_options={"prefer_nhwc": 1,
                                                                         "cudnn_conv_algo_search": "HEURISTIC"})
    assert cuda == ("CUDAExecutionProvider", {"use_tf32": "0", "enable_cuda_graph": "1", "prefer_nhwc": "1",
                                              "cudnn_conv_algo_search": "HEURISTIC"})
    for key, parameter in (("use_tf32", "tf32="), ("enable_cuda_graph", "cuda_graph=")):
        with pytest.raises(ConfigError, match=parameter):
            runtime._providers("cuda", cuda_options={key: "1"})


def test_run_bad_feeds():
    session = make_session(mlp())
    with pytest.raises(ConfigError, match=r"missing \['x'\]"):
        run(session, {"z": np.ones((1, 4), np.float32)})
    with pytest.raises(CampoError, match="failed to run"):
        run(session, {"x": np.ones((1, 5), np.float32)})


# ---- compare_outputs ------------------------------------------------------------------------


def one(ref, cand, rtol=0.01, atol=1e-3) -> OutputDiff:
    [diff] = compare_outputs({"y": np.asarray(ref)}, {"y": np.asarray(cand)}, rtol=rtol, atol=atol)
    return diff


def test_compare_within_tolerance():
    diff = one(np.array([1.0, 100.0, 0.0], np.float32),
               np.array([1.005, 100.9, 0.0005], np.float32))
    assert diff.ok and diff.name == "y" and diff.shape == (3,) and diff.dtype == "float32"
    assert diff.max_abs_err == pytest.approx(0.9, rel=1e-4)
    # relative error skips the zero reference (|r| <= atol): 0.005/1 beats 0.9/100
    assert diff.max_rel_err == pytest.approx(0.009, rel=1e-3)


def test_compare_exceeding_tolerance():
    diff = one([1.0, 2.0], [1.0, 2.1])
    assert not diff.ok
    assert diff.max_abs_err == pytest.approx(0.1)
    assert diff.max_rel_err == pytest.approx(0.05)


def test_compare_atol_governs_near_zero():
    assert one([0.0], [0.0009]).ok
    assert not one([0.0], [0.002]).ok


def test_compare_nan_and_inf():
    diff = one([1.0, 2.0], [np.nan, 2.0])
    assert not diff.ok and diff.max_abs_err == np.inf
    same = one([np.nan, np.inf, -np.inf, 1.0], [np.nan, np.inf, -np.inf, 1.0])
    assert same.ok and same.max_abs_err == 0.0 and same.max_rel_err == 0.0
    assert not one([np.inf], [1e30]).ok  # inf vs finite must not pass through inf tolerance
    assert not one([1.0], [np.inf]).ok
    assert not one([np.nan], [1.0]).ok


def test_compare_shape_mismatch_and_missing():
    diff = one(np.zeros((2, 3)), np.zeros((3, 2)))
    assert not diff.ok and diff.max_abs_err == np.inf and diff.max_rel_err == np.inf
    assert "shape" in diff.note
    [missing] = compare_outputs({"y": np.zeros(2)}, {}, rtol=0.1, atol=0.1)
    assert not missing.ok and missing.max_abs_err == np.inf


def test_compare_ints_bools_and_dtype_change():
    assert one(np.array([1, 2], np.int64), np.array([1, 2], np.int64)).ok
    assert not one(np.array([True, False]), np.array([True, True])).ok
    diff = one(np.array([1.0], np.float32), np.array([1.0], np.float16))
    assert diff.ok and "float16" in diff.note


def test_output_diff_is_frozen():
    diff = one([1.0], [1.0])
    with pytest.raises(AttributeError):
        diff.ok = False  # type: ignore[misc]


# ---- validate -------------------------------------------------------------------------------


def test_validate_self_is_ok():
    diffs = validate(mlp(), mlp(), dim_values={"batch": 4})
    assert [d.name for d in diffs] == ["y"]
    assert all(d.ok for d in diffs) and diffs[0].max_abs_err == 0.0


def test_validate_detects_perturbed_output():
    diffs = validate(mlp(), mlp(shift=1.0), input_shapes={"x": (4, 4)})
    assert not diffs[0].ok
    assert diffs[0].max_abs_err == pytest.approx(1.0)


def test_validate_with_given_feeds_and_small_shift():
    feeds = {"x": np.ones((2, 4), np.float32)}
    assert validate(mlp(), mlp(shift=1e-4), feeds=feeds)[0].ok
