"""``activation_limit``: a calibration run keeps fp32 the nodes whose values fp16 holds too coarsely."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxcampo
from onnxcampo.calibrate import activation_ranges
from onnxcampo.cli import main
from onnxcampo.errors import ConfigError
from onnxcampo.training import build_train_step

from training.test_step import mlp as small_mlp

OFFSET = 3000.0  # fp16 values near 3000 are 2 apart


def offset_model() -> onnx.ModelProto:
    """Two branches: ``y = ((x @ w + 3000) - 3000) @ v`` goes through values near 3000, where fp16
    is 2 apart, so its small result is lost in fp16; ``z = relu(x @ u) @ u2`` stays small."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 32)) * 0.2).astype(np.float32), name)
             for name in ("w", "v", "u", "u2")]
    inits.append(numpy_helper.from_array(np.full((32,), OFFSET, np.float32), "offset"))
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm_w"),
        helper.make_node("Add", ["a", "offset"], ["shifted"], name="add_offset"),
        helper.make_node("Sub", ["shifted", "offset"], ["back"], name="sub_offset"),
        helper.make_node("MatMul", ["back", "v"], ["y"], name="mm_v"),
        helper.make_node("MatMul", ["x", "u"], ["b"], name="mm_u"),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "u2"], ["z"], name="mm_u2"),
    ]
    graph = helper.make_graph(nodes, "offset", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, [16, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _x(seed: int = 1, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {"x": (np.random.default_rng(seed).standard_normal((16, 32)) * scale).astype(np.float32)}


def _rel_err(model: onnx.ModelProto, reference: onnx.ModelProto, feeds) -> dict[str, float]:
    """max |out - ref| / max |ref| per output, fp16 arithmetic as the reference evaluator does it."""
    got = dict(zip([o.name for o in model.graph.output], ReferenceEvaluator(model).run(None, feeds)))
    want = dict(zip([o.name for o in reference.graph.output], ReferenceEvaluator(reference).run(None, feeds)))
    return {k: float(np.abs(got[k].astype(np.float64) - want[k]).max() / np.abs(want[k]).max()) for k in want}


def test_activation_ranges_are_the_largest_finite_values_of_every_float_tensor():
    model = offset_model()
    feeds = _x()
    ranges = activation_ranges(model, feeds)
    assert set(ranges) == {"x", "a", "shifted", "back", "y", "b", "r", "z"}
    x = feeds["x"]
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert ranges["a"] == pytest.approx(np.abs(x @ weights["w"]).max(), rel=1e-6)
    assert ranges["shifted"] > OFFSET - 50 and ranges["back"] < 50 and ranges["x"] == np.abs(x).max()
    assert len(model.graph.output) == 2  # the model given is not modified


def test_nodes_beyond_the_limit_stay_fp32_and_that_keeps_the_result():
    """Policy fp16 converts everything; with the limit, the nodes touching values near 3000 stay
    fp32 (and only those): the offset branch's error drops from fp16's spacing there to ~fp16's
    ordinary rounding, the small branch stays fp16."""
    model = offset_model()
    plain = onnxcampo.optimize(model, policy="fp16")
    calibrated = onnxcampo.optimize(model, policy="fp16", activation_limit=512, inputs=_x())
    kept = {name for name, d in calibrated.plan.items() if d.reason.name == "ACTIVATION_RANGE"}
    assert kept == {"add_offset", "sub_offset"}
    assert calibrated.plan.precision("mm_u").name == "FP16" and calibrated.plan.precision("relu").name == "FP16"
    assert calibrated.report["calibration"] == {
        "inputs": "given", "activation_limit": 512, "tensors": 8, "nodes_kept_fp32": 2,
        "largest": pytest.approx(max(activation_ranges(model, _x()).values())), "nodes": ["add_offset", "sub_offset"]}
    feeds = _x(seed=7)
    before, after = _rel_err(plain.model, model, feeds), _rel_err(calibrated.model, model, feeds)
    assert before["y"] > 0.02 and after["y"] < 0.01 and after["y"] < before["y"] / 5
    assert after["z"] == pytest.approx(before["z"])  # the small branch: the same fp16 plan


def test_the_limit_and_the_inputs_decide_what_is_beyond():
    model = offset_model()
    assert not any(d.reason.name == "ACTIVATION_RANGE"
                   for _, d in onnxcampo.optimize(model, activation_limit=1e6).plan.items())
    random = onnxcampo.optimize(model, policy="fp16", activation_limit=512)
    assert random.report["calibration"]["inputs"] == "random" and random.report["calibration"]["nodes_kept_fp32"] == 2
    # x @ w (|values| ~ 4 on the usual inputs) goes beyond 200 only on inputs 100x larger
    usual = onnxcampo.optimize(model, policy="fp16", activation_limit=200, inputs=_x())
    big = onnxcampo.optimize(model, policy="fp16", activation_limit=200, inputs=_x(scale=100.0))
    assert "mm_w" not in usual.report["calibration"]["nodes"] and "mm_w" in big.report["calibration"]["nodes"]


def test_calibration_refuses_what_it_cannot_calibrate():
    with pytest.raises(ConfigError, match="activation_limit must be > 0"):
        onnxcampo.optimize(offset_model(), activation_limit=0)
    with pytest.raises(ConfigError, match="without either it has no use"):
        onnxcampo.optimize(offset_model(), inputs=_x())
    step = build_train_step(small_mlp(), loss="cross_entropy")
    with pytest.raises(ConfigError, match="calibrates inference models"):
        onnxcampo.optimize(step, activation_limit=512)


def test_cli_activation_limit_with_inputs(tmp_path, capsys):
    src, out, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(offset_model(), src)
    np.savez(tmp_path / "x.npz", **_x())
    code = main(["optimize", str(src), str(out), "--policy", "fp16", "--activation-limit", "512",
                 "--inputs", str(tmp_path / "x.npz"), "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 0 and "calibration (given inputs): 2 nodes kept fp32 for values beyond |512|" in err
    assert json.loads(report.read_text())["calibration"]["nodes"] == ["add_offset", "sub_offset"]
    assert main(["optimize", str(src), str(tmp_path / "p.onnx"), "--activation-limit", "-1"]) != 0
    err = capsys.readouterr().err
    assert "activation_limit must be > 0" in err and "Traceback" not in err and not (tmp_path / "p.onnx").exists()


@pytest.mark.slow
def test_tune_calibrates_its_candidates_on_its_inputs():
    """With --tune, every candidate plan is built with the calibration (on the inputs it is timed on)."""
    result = onnxcampo.optimize(offset_model(), tune="cpu", activation_limit=512, inputs=_x())
    assert result.report["tuning"]["candidates"] and result.report["calibration"]["inputs"] == "given"
    assert result.report["calibration"]["nodes"] == ["add_offset", "sub_offset"]


def test_infinity_sentinels_and_scalar_constants(caplog):
    """An attention mask's float32 minimum is an infinity sentinel, not a range (the Casts clamp
    it, as classify's rule 7 allows); a Constant given by value_float is calibrated like any value;
    random calibration inputs and tensors with no finite value are said."""
    mask = numpy_helper.from_array(np.array([0.0, np.finfo(np.float32).min], np.float32), "mask")
    nodes = [helper.make_node("Add", ["x", "mask"], ["masked"], name="add_mask"),
             helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
             helper.make_node("Constant", [], ["big"], name="big_const", value_float=5000.0),
             helper.make_node("Mul", ["p", "big"], ["scaled"], name="scale"),
             helper.make_node("Log", ["x"], ["logx"], name="log"),
             helper.make_node("Sub", ["logx", "logx"], ["nan"], name="nan_sub")]
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2])],
                              [helper.make_tensor_value_info("scaled", TensorProto.FLOAT, [4, 2]),
                               helper.make_tensor_value_info("nan", TensorProto.FLOAT, [4, 2])], [mask])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    feeds = {"x": -np.ones((4, 2), np.float32)}  # log(-1): NaN everywhere
    with caplog.at_level("WARNING", logger="onnxcampo"):
        ranges = activation_ranges(model, feeds)
    assert ranges["masked"] == 1.0 and ranges["big"] == 5000.0 and ranges["scaled"] == pytest.approx(5000.0)
    assert ranges["logx"] == 0.0 and "no finite value" in caplog.text and "logx" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="onnxcampo"):
        result = onnxcampo.optimize(model, policy="fp16", activation_limit=512)
    assert "calibrating on random inputs" in caplog.text
    kept = set(result.report["calibration"]["nodes"])
    assert "add_mask" not in kept and "softmax" not in kept and "scale" in kept


def test_cli_inputs_without_a_use_is_an_error(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(offset_model(), src)
    np.savez(tmp_path / "x.npz", **_x())
    assert main(["optimize", str(src), str(tmp_path / "o.onnx"), "--inputs", str(tmp_path / "x.npz"),
                 "--no-accuracy-check"]) != 0  # without it, --inputs feeds the accuracy check
    err = capsys.readouterr().err
    assert "--inputs feeds --validate, the accuracy check, --tune or --activation-limit" in err
    assert not (tmp_path / "o.onnx").exists()


def test_dynamic_dims_take_the_given_inputs_shapes_unless_pinned(caplog):
    """A dynamic batch is pinned to the calibration inputs' shape when nothing else pins it; a
    --dim or --input-shape the user gave wins."""
    model = offset_model()
    for vi in (*model.graph.input, *model.graph.output):
        vi.type.tensor_type.shape.dim[0].dim_param = "batch"
    with pytest.raises(onnxcampo.errors.CampoError, match="pin it with"):
        onnxcampo.optimize(model, activation_limit=512)  # random inputs need the batch
    with caplog.at_level("INFO", logger="onnxcampo"):
        result = onnxcampo.optimize(model, activation_limit=512, inputs=_x())
    assert "pinned to the given inputs' shapes: x:16,32" in caplog.text and result.report["calibration"]["tensors"] == 8
    pinned = onnxcampo.optimize(model, activation_limit=512, inputs=_x(), dim_values={"batch": 64})
    assert pinned.report["calibration"]["inputs"] == "given"
    written = onnxcampo.ir.graph_inputs(pinned.model)[0].type.tensor_type.shape.dim[0]
    assert written.dim_param == "batch"  # the written model keeps its dynamic dim
