"""The Python API on real inputs: options, external data, profiling, cost databases, opsets,
training-graph ops."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo import OptimizeConfig
from onnxcampo import ir
from onnxcampo.errors import ConfigError, CostModelError
from onnxcampo.runtime import make_session, run


def mlp(batch=4096, hidden=1024, ffn=4096, opset=17, dynamic=False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((hidden, ffn)) * 0.02).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((ffn, hidden)) * 0.02).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2"),
    ]
    rows = "batch" if dynamic else batch
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, hidden])], [w1, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8 if opset < 13 else 10)


@pytest.mark.slow
def test_input_model_is_never_modified():
    model = mlp()
    before = model.SerializeToString()
    result = onnxcampo.optimize(model)
    assert model.SerializeToString() == before
    assert result.report["nodes_fp16"] == 3  # a large aligned MLP pays in fp16


@pytest.mark.slow
def test_keyword_options_override_config():
    result = onnxcampo.optimize(mlp(), config=OptimizeConfig(policy="fp32"), policy="amp")
    assert result.report["policy"] == "amp"
    with pytest.raises(ConfigError):
        OptimizeConfig(policy="fastest")


@pytest.mark.parametrize("stem", [5, True, -1])
def test_a_stem_padding_other_than_0_4_or_8_is_a_config_error(stem):
    with pytest.raises(ConfigError, match="channels_last_stem must be (0|an integer)"):
        OptimizeConfig(experimental={"channels_last_stem": stem})


@pytest.mark.slow
def test_dynamic_model_keeps_its_dynamic_shapes():
    result = onnxcampo.optimize(mlp(dynamic=True), input_shapes={"x": (4096, 1024)})
    dims = result.model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch"
    assert result.report["nodes_fp16"] == 3
    x = np.random.default_rng(1).standard_normal((3, 1024)).astype(np.float32)
    out = run(make_session(result.model), {"x": x})["y"]
    assert out.shape == (3, 1024)


@pytest.mark.slow
@pytest.mark.parametrize("opset", [11, 13, 17, 21])
def test_opsets_11_and_newer(opset):
    model = mlp(batch=2048, opset=opset)
    result = onnxcampo.optimize(model, experimental={"check_invariants": True})
    onnx.checker.check_model(result.model, full_check=True)
    assert ir.default_opset(result.model) == opset


def test_external_data_round_trip(tmp_path):
    """A model stored with external data loads, and a model over protobuf's limit is written
    with its tensors in ``<output>.<hex>.data`` (the limit is lowered here to keep the test small). Its
    outputs on ORT CPU are compared with the source's as a wiring check (ORT's CPU provider hides
    fp16 rounding)."""
    source = tmp_path / "in.onnx"
    onnx.save_model(mlp(batch=512, hidden=256, ffn=1024), str(source), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="in.onnx.data", size_threshold=0)
    result = onnxcampo.optimize(source, input_shapes={})
    out = tmp_path / "out.onnx"
    import onnxcampo.ir.io as g

    limit = g._PROTOBUF_LIMIT
    g._PROTOBUF_LIMIT = 1024
    try:
        result.save(out)
    finally:
        g._PROTOBUF_LIMIT = limit
    assert len(list(tmp_path.glob("out.onnx.*.data"))) == 1
    assert out.stat().st_size < 100_000
    loaded = onnx.load(str(out))
    onnx.checker.check_model(str(out), full_check=True)
    x = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)
    expected = run(make_session(source), {"x": x})["y"]
    got = run(make_session(out), {"x": x})["y"]
    np.testing.assert_allclose(got, expected, rtol=0.02, atol=2e-3)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert loaded.graph.initializer


def test_profile_cpu_uses_measured_times():
    result = onnxcampo.optimize(mlp(batch=64, hidden=64, ffn=64), experimental={"profile": "cpu"}, min_gain=0.0)
    plan = result.report["plan"]
    assert result.report["profile"] == "cpu"
    assert plan["mm1"]["numbers"]["fp32_us"] > 0


def _database(**ops) -> dict:
    linear = {"features": ["flops"], "coef": [1e-8], "intercept": 5.0}
    return {
        "schema_version": 1,
        "device": {"name": "test-gpu", "compute_capability": "9.0", "ort_version": "1.31.1",
                   "cuda_version": "13.0", "date": "2026-11-30"},
        "cast": {"C_I": 1000.0, "r": 0.0},  # absurdly expensive Casts: nothing may pay
        "ops": {"MatMul": {"fp32": linear, "fp16": {**linear, "sigma": 0.0, "coef": [1e-9]},
                           "samples": 10, "holdout_mape": 0.05}, **ops},
        "summary": {"holdout_mape": 0.05, "wrong_decision_rate": 0.01, "samples": 10},
    }


@pytest.mark.slow
def test_device_db_replaces_the_analytic_model(tmp_path):
    db = tmp_path / "db.json"
    db.write_text(json.dumps(_database()))
    default = onnxcampo.optimize(mlp())
    measured = onnxcampo.optimize(mlp(), device_db=db)
    assert default.report["nodes_fp16"] == 3
    assert measured.report["cost_model"]["kind"] == "regression"
    assert measured.report["nodes_fp16"] == 0  # 1000 us per Cast never pays
    assert measured.report["plan"]["mm1"]["reason"] == "allow_does_not_pay"


@pytest.mark.slow
@pytest.mark.parametrize(
    "content, message",
    [("[]", "not an object"), ('{"schema_version": 99}', "schema version 99"),
     ('{"schema_version": 1, "device": {"name": "x"}, "cast": {"C_I": 1}, "ops": {}}', "'C_I' and 'r'")],
)
def test_bad_device_db_is_rejected(tmp_path, content, message):
    db = tmp_path / "db.json"
    db.write_text(content)
    with pytest.raises(CostModelError, match=message):
        onnxcampo.optimize(mlp(), device_db=db)


def test_training_graph_ops_are_classified():
    """ORT training graphs: *Grad ops follow their forward op's list, gradient accumulators
    stay fp32 (training state, whatever the policy)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((1024, 1024)) * 0.02).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fwd_mm"),
        helper.make_node("Relu", ["h"], ["a"], name="fwd_relu"),
        helper.make_node("ReluGrad", ["dy", "a"], ["dh"], name="relu_grad", domain="com.microsoft"),
        helper.make_node("Transpose", ["x"], ["xt"], name="xt"),
        helper.make_node("MatMul", ["xt", "dh"], ["dw"], name="grad_mm"),
        helper.make_node("InPlaceAccumulatorV2", ["acc", "dw"], ["updated", "acc_out"], name="accumulate",
                         domain="com.microsoft"),
    ]
    graph = helper.make_graph(
        nodes, "train",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 1024]),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT, [4096, 1024]),
         helper.make_tensor_value_info("acc", TensorProto.FLOAT, [1024, 1024])],
        [helper.make_tensor_value_info("updated", TensorProto.BOOL, [1]),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [1024, 1024])], [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    result = onnxcampo.optimize(model, policy="amp")
    plan = result.report["plan"]
    assert plan["accumulate"]["reason"] == "training_state"
    assert plan["fwd_mm"]["precision"] == "fp16" and plan["grad_mm"]["precision"] == "fp16"
    assert plan["relu_grad"]["precision"] == "fp16"  # between fp16 ops
    # the gradient reaches the fp32 accumulator through one Cast back
    acc = next(n for n in result.model.graph.node if n.name == "accumulate")
    producer = next(n for n in result.model.graph.node if acc.input[1] in n.output)
    assert producer.op_type == "Cast"


def test_saved_model_has_the_usual_permissions(tmp_path):
    out = tmp_path / "m.onnx"
    onnxcampo.optimize(mlp(batch=64, hidden=64, ffn=64)).save(out)
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_the_pipeline_runs_step_by_step_as_the_python_api_guide_shows():
    # docs/guide/python-api.md: load -> prepare -> plan_policies, the plans and their costs
    from importlib import resources

    from onnxcampo import OptimizeConfig, pipeline

    example = resources.files("onnxcampo.examples") / "mlp_block.onnx"
    config = OptimizeConfig(input_shapes={"x": (16384, 256)}, experimental={"cost_graph": "onnx"})
    loaded = pipeline.load(str(example), config, None)
    prepared = pipeline.prepare(loaded)
    chosen = pipeline.plan_policies(prepared.ctx)
    assert set(chosen.plans) == {"campo", "fp32", "amp"} and chosen.chosen in chosen.plans
    assert chosen.times["campo"].total_us > 0 and isinstance(chosen.notes, list)
    assert [p.name for p in pipeline.FINISHING] and pipeline.ANALYSIS["amp"]


def test_a_planning_reads_and_writes_its_context_but_owns_its_plan():
    from helpers import build_context, parse

    from onnxcampo.context import Planning
    from onnxcampo.plan import Precision, Reason

    planning = build_context(parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [relu] y = Relu(x)
    }
    """))
    other = Planning(planning.ctx)
    planning.plan.decide("relu", Precision.FP16, Reason.POLICY_FP16)
    assert not other.plan.items() and not hasattr(planning.ctx, "plan")  # the context holds no plan
    planning.nodes = list(planning.nodes)  # what a mutating pass does: written to the context
    assert other.nodes is planning.nodes and other.categories is planning.ctx.categories
    import copy

    assert copy.copy(planning).plan is planning.plan  # copies build it without __init__: no recursion


def test_an_analysis_planning_looks_consumers_up_once_and_a_mutating_one_sees_edits():
    from helpers import build_context, parse

    from onnxcampo.context import Planning

    planning = build_context(parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [relu] r = Relu(x)
      [neg] y = Neg(r)
    }
    """))
    analysis = Planning(planning.ctx, analysis=True)
    relu = next(n for n in planning.nodes if n.name == "relu")
    r = relu.outputs[0]
    assert [u.node.name for u in analysis.uses(r)] == ["neg"]
    assert [n.name for n in analysis.downstream(relu)] == ["neg"]  # the context's rule, through the cache
    assert analysis.uses(r) is analysis.uses(r)
    r.outputs.clear()  # an edit: only a Planning that promised none keeps the old answer
    assert [u.node.name for u in analysis.uses(r)] == ["neg"]
    assert planning.uses(r) == [] and not planning.analysis and analysis.analysis


def _zero_rows_model():
    """MatMul -> Softmax -> ReduceSum over an input of 0 rows (a static zero-size dim, as ONNX's
    backend node tests have them)."""
    nodes = [onnx.helper.make_node("MatMul", ["x", "w"], ["m"]), onnx.helper.make_node("Softmax", ["m"], ["s"], axis=-1),
             onnx.helper.make_node("ReduceSum", ["s"], ["y"], keepdims=1)]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [0, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 1])],
        [onnx.numpy_helper.from_array(np.ones((4, 8), np.float32), "w")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("policy", ["campo", "fp16"])
def test_a_static_zero_size_dim_is_a_dim_not_a_dynamic_one(policy):
    """Planned and checked as it is (no "pin it" refusal, no division by a zero amount of work);
    a pin may still give the 0 a size, as for exporters that write 0 for 'unknown'."""
    result = onnxcampo.optimize(_zero_rows_model(), policy=policy, accuracy="validate")
    assert result.report["accuracy"].get("ok") is not False
    assert [d.dim_value for d in result.model.graph.input[0].type.tensor_type.shape.dim] == [0, 4]
    pinned = onnxcampo.optimize(_zero_rows_model(), policy=policy, input_shapes={"x": (8, 4)}, accuracy="off")
    assert pinned.report["options"]["input_shapes"] == {"x": [8, 4]}
