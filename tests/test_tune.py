"""``tune``: campo's candidate plans timed on ONNX Runtime, the fastest kept."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo import ir
from onnxcampo import tune as tune_mod
from onnxcampo.cli import main
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step
from onnxcampo.tune import Timing, candidate_configs, choose

from helpers import FakeCost
from training.test_step import mlp as small_mlp


def odd_mlp(batch: int = 64, widths=(1001, 1000, 1001)) -> onnx.ModelProto:
    """Wide, unaligned layers: campo pads them for Tensor Cores (so campo-nopad is a candidate)."""
    rng = np.random.default_rng(0)
    nodes, inits, current = [], [], "x"
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        inits.append(numpy_helper.from_array((rng.standard_normal((n_in, n_out)) * 0.03).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        nodes.append(helper.make_node("Relu", [f"h{i}"], [f"a{i}"], name=f"relu{i}"))
        current = f"a{i}"
    graph = helper.make_graph(nodes, "odd", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, widths[0]])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, [batch, widths[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture
def padding_pays(monkeypatch):
    """A cost model under which campo converts the odd MLP to fp16 and pads it (unaligned fp16
    GEMMs gain nothing, Pads and Casts are cheap), whatever the machine."""
    import onnxcampo.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_cost_model",
                        lambda device_db=None: FakeCost(speedup=2.0, unaligned_speedup=1.0, pad_us=0.1, cast_us=0.1))


def timings(**ms) -> dict[str, Timing]:
    return {name: Timing(name, ms=value) for name, value in ms.items()}


def test_candidates_are_all_fp16_campo_without_comparison_without_padding_amp_and_fp32():
    """Issue 15 added the all-fp16 plan (policy fp16, keep_io_types as given: Casts only at the I/O)."""
    config = OptimizeConfig(tune="cuda", min_gain=0.05, execution="cuda-graph")
    candidates = candidate_configs(config)
    assert list(candidates) == ["fp32", "amp", "campo", "campo-nopad", "fp16"]  # fp16 last: a shared graph keeps amp's name
    assert all(c.tune is None and c.min_gain == 0.05 and c.execution == "cuda-graph" for c in candidates.values())
    assert candidates["campo"].policy == "campo" and not candidates["campo"].experimental.compare_plans
    assert not candidates["campo-nopad"].experimental.pad_tensor_cores
    assert (candidates["fp16"].policy, candidates["fp16"].keep_io_types) == ("fp16", True)
    assert not candidate_configs(config.replace(keep_io_types=False))["fp16"].keep_io_types
    assert (candidates["amp"].policy, candidates["fp32"].policy) == ("amp", "fp32")
    assert "campo-nopad" not in candidate_configs(config.with_experimental(pad_tensor_cores=False))


def test_choose_keeps_fp32_unless_a_mixed_plan_is_min_gain_faster():
    assert choose(timings(fp32=10.0, amp=9.0, campo=8.0), 0.02) == "campo"
    assert choose(timings(fp32=10.0, amp=9.9, campo=9.85), 0.02) == "fp32"  # 1.5 % is noise
    assert choose(timings(fp32=10.0, amp=9.9, campo=9.85), 0.0) == "campo"
    assert choose(timings(fp32=10.0, amp=12.0, campo=11.0), 0.02) == "fp32"


def test_choose_skips_failed_and_non_finite_candidates():
    found = timings(fp32=10.0, amp=5.0, campo=6.0)
    found["amp"].finite = False
    assert choose(found, 0.02) == "campo"
    found["campo"] = Timing("campo", error="ORT rejected it")
    assert choose(found, 0.02) == "fp32"
    with pytest.raises(CampoError, match="could not time the fp32 model"):
        choose({"fp32": Timing("fp32", error="no GPU"), "amp": Timing("amp", ms=1.0)}, 0.02)


def test_choose_drops_candidates_outside_the_tolerance():
    found = timings(fp32=10.0, amp=5.0, campo=6.0)
    found["amp"].rel_err, found["campo"].rel_err = 0.05, 0.01
    assert choose(found, 0.02, 0.02) == "campo"
    found["campo"].rel_err = 0.03
    assert choose(found, 0.02, 0.02) == "fp32"
    assert choose(found, 0.02) == "amp"  # no tolerance given: speed alone


@pytest.mark.slow
def test_candidates_run_one_session_at_a_time(monkeypatch):
    """Sessions side by side slowed host-bound runs on the GPU: each candidate's runner is gone
    before the next one starts, and every candidate gets PASSES fresh runners."""
    alive, most, made = [0], [0], []

    class Counted(tune_mod._InferenceRun):
        def __init__(self, model, config, inputs):
            super().__init__(model, config, inputs)
            alive[0] += 1
            most[0] = max(most[0], alive[0])
            made.append(1)

        def __del__(self):
            alive[0] -= 1

    monkeypatch.setattr(tune_mod, "_InferenceRun", Counted)
    result = onnxcampo.optimize(odd_mlp(batch=8), tune="cpu")
    timed = [n for n, e in result.report["tuning"]["candidates"].items() if "ms" in e]
    assert most[0] == 1 and len(made) == tune_mod.PASSES * len(timed)


@pytest.mark.slow
def test_tune_times_every_distinct_candidate_and_returns_the_chosen_one(padding_pays):
    """Tuning on ORT CPU times each distinct candidate and returns the chosen one as the untuned
    optimize builds it; its outputs stay close to the fp32 model's there (a wiring check: ORT's
    CPU provider hides fp16 rounding)."""
    model = odd_mlp(batch=64)
    result = onnxcampo.optimize(model, tune="cpu")
    tuning = result.report["tuning"]
    entries = tuning["candidates"]
    assert set(entries) == {"fp32", "fp16", "amp", "campo", "campo-nopad"}  # campo padded: its unpadded plan is a candidate
    assert tuning["execution"] == "plain"
    timed = {name for name, entry in entries.items() if "ms" in entry}
    assert "fp32" in timed and tuning["chosen"] in timed
    for name in timed:
        entry = entries[name]
        assert len(entry["blocks_ms"]) == tune_mod.BLOCKS * tune_mod.PASSES
        assert entry["ms"] == pytest.approx(np.median(entry["blocks_ms"]), rel=1e-3)
        assert entry["runs_per_block"] >= 1 and entry["finite"]
        if name != "fp32":  # the reference
            assert entry["rel_err"] < 1e-2  # the CPU EP computes fp16 ops in fp32: only I/O rounding
    for name, entry in entries.items():
        assert ("same_as" in entry) != (name in timed)
    # the returned model is the chosen candidate's, built as the untuned optimize builds it
    chosen = tuning["chosen"]
    alone = onnxcampo.optimize(model, config=candidate_configs(OptimizeConfig(tune="cpu"))[chosen])
    assert result.model.graph.SerializeToString(deterministic=True) == alone.model.graph.SerializeToString(deterministic=True)
    assert ir.metadata(result.model, "onnxcampo.policy") == "campo"
    assert result.report["policy"] == "campo" and result.report["chosen_plan"] == chosen
    assert any(note.startswith("tuned on cpu:") for note in result.report["notes"])
    x = np.random.default_rng(1).standard_normal((64, 1001)).astype(np.float32)
    ref = run(make_session(model), {"x": x})
    out = run(make_session(result.model), {"x": x})
    np.testing.assert_allclose(out["a1"], ref["a1"], rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_tune_keeps_the_measured_fastest(monkeypatch, padding_pays):
    """Whatever the cost model predicts, the measured times decide (here: amp measured fastest)."""
    def fake_measure(results, config, inputs):
        return {name: Timing(name, ms={"fp32": 10.0, "amp": 4.0}.get(name, 7.0)) for name in results}

    monkeypatch.setattr(tune_mod, "_measure", fake_measure)
    result = onnxcampo.optimize(odd_mlp(batch=64), tune="cpu")
    assert "amp" in result.report["tuning"]["candidates"] and "same_as" not in result.report["tuning"]["candidates"]["amp"]
    assert result.report["chosen_plan"] == "amp"
    amp = onnxcampo.optimize(odd_mlp(batch=64), policy="amp")
    assert result.model.graph.SerializeToString(deterministic=True) == amp.model.graph.SerializeToString(deterministic=True)
    assert ir.metadata(result.model, "onnxcampo.policy") == "campo"
    assert result.report["tuning"]["candidates"]["amp"]["ms"] == 4.0


@pytest.mark.slow
def test_tune_uses_the_given_inputs_and_reports_bad_ones():
    model = odd_mlp(batch=8)
    x = np.ones((8, 1001), np.float32)
    result = onnxcampo.optimize(model, tune="cpu", inputs={"x": x})
    assert "ms" in result.report["tuning"]["candidates"]["fp32"]
    with pytest.raises(ConfigError, match=r"tune inputs do not match the model's inputs: missing \['x'\], unknown \['y'\]"):
        onnxcampo.optimize(model, tune="cpu", inputs={"y": x})


@pytest.mark.slow
def test_tune_a_training_step_runs_it_in_the_trainer():
    step = build_train_step(small_mlp(), loss="cross_entropy", optimizer="momentum", lr=0.05)
    result = onnxcampo.optimize(step, tune="cpu")
    entries = result.report["tuning"]["candidates"]
    timed = [name for name, entry in entries.items() if "ms" in entry]
    assert "fp32" in timed
    for name in timed:
        assert np.isfinite(entries[name]["loss"]) and entries[name]["finite"]
    trainer = Trainer(result.model)
    losses = [trainer.step(batch) for batch in [_batch(step)] * 3]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def _batch(step: onnx.ModelProto) -> dict[str, np.ndarray]:
    from training.test_step import CLASSES, X

    return {"x": X, "labels": CLASSES}


def test_tune_applies_to_campo_only():
    with pytest.raises(ConfigError, match="does not apply to policy='amp'"):
        onnxcampo.optimize(odd_mlp(batch=8), policy="amp", tune="cpu")
    with pytest.raises(ConfigError, match="unknown tuning provider"):
        OptimizeConfig(tune="tpu")


@pytest.mark.slow
def test_cli_tune_writes_the_tuned_model_and_reports_the_times(tmp_path, capsys):
    source, output, report = tmp_path / "odd.onnx", tmp_path / "out.onnx", tmp_path / "report.json"
    onnx.save(odd_mlp(batch=64), source)
    assert main(["optimize", str(source), str(output), "--tune", "cpu", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert "note: tuned on cpu: fp32 " in err
    assert "tune: building the amp candidate" in err and "tune: timing fp32 (session 2 of 2)" in err  # progress
    written = json.loads(report.read_text())
    assert written["tuning"]["provider"] == "cpu" and written["chosen_plan"] == written["tuning"]["chosen"]
    assert ir.metadata(onnx.load(output), "onnxcampo.policy") == "campo"
    assert main(["optimize", str(source), str(output), "--tune", "cpu", "--tune-tolerance", "1e-12", "--report",
                 str(report)]) == 0  # nothing mixed is that close to fp32: fp32 is kept
    written = json.loads(report.read_text())
    assert written["chosen_plan"] == "fp32" and written["tuning"]["tolerance"] == "rel_l2=1e-12,mismatch=0.01"
    capsys.readouterr()
    assert main(["optimize", str(source), str(tmp_path / "amp.onnx"), "--policy", "amp", "--tune", "cpu"]) == 2
    assert "--tune chooses among campo's candidate plans" in capsys.readouterr().err
    assert not (tmp_path / "amp.onnx").exists()


def test_output_error_compares_where_fp32_is_finite_and_counts_moved_integers():
    """Issue 15: the relative L2 error of onnxcampo.runtime.compare (was max |d| / max |ref|: 0.05 here)."""
    ref = {"y": np.array([1.0, np.inf, -2.0], np.float32), "k": np.array([3, 1, 2, 0], np.int64)}
    assert tune_mod.output_error(ref, {"y": np.array([1.1, 5.0, -2.0], np.float32), "k": ref["k"]}) == pytest.approx(
        0.1 / np.sqrt(5), rel=1e-5)
    assert tune_mod.output_error(ref, {"y": np.array([1.0, 0.0, np.nan], np.float32), "k": ref["k"]}) == np.inf
    moved = {"y": ref["y"].copy(), "k": np.array([3, 1, 0, 0], np.int64)}  # one arg-max of four moved
    assert tune_mod.output_error(ref, moved) == pytest.approx(0.25)
    assert tune_mod.output_error({"y": np.full(2, np.nan, np.float32)}, {"y": np.zeros(2, np.float32)}) is None


@pytest.mark.slow
def test_fp16_inputs_of_a_candidate_get_the_given_fp32_inputs_cast():
    """--no-keep-io-types: the mixed candidates take fp16 inputs; the given fp32 inputs are cast
    for them instead of failing them."""
    x = np.random.default_rng(0).standard_normal((64, 1001)).astype(np.float32)
    result = onnxcampo.optimize(odd_mlp(), tune="cpu", keep_io_types=False, inputs={"x": x},
                                experimental={"pad_tensor_cores": False})
    entries = result.report["tuning"]["candidates"]
    assert "error" not in entries["amp"] and "ms" in entries["amp"]


def test_inputs_without_tune_are_refused():
    with pytest.raises(ConfigError, match="feeds tune"):
        onnxcampo.optimize(odd_mlp(), inputs={"x": np.zeros((64, 1001), np.float32)})


@pytest.mark.slow
def test_tuned_report_names_its_input_and_campos_plans(tmp_path, monkeypatch, padding_pays):
    def fake_measure(results, config, inputs):
        return {name: Timing(name, ms={"fp32": 10.0}.get(name, 4.0 if name == "amp" else 7.0)) for name in results}

    monkeypatch.setattr(tune_mod, "_measure", fake_measure)
    path = tmp_path / "odd.onnx"
    onnx.save(odd_mlp(), path)
    report = onnxcampo.optimize(path, tune="cpu").report
    assert report["input"] == str(path) and report["chosen_plan"] == "amp"
    assert set(report["plans"]) == {"campo", "fp32", "amp"}  # campo's comparison, not the amp build's


@pytest.mark.slow
def test_cli_tune_inputs_of_a_training_step_are_its_batch(tmp_path, capsys):
    from training.test_step import CLASSES, X

    step = tmp_path / "step.onnx"
    onnx.save(build_train_step(small_mlp(), loss="cross_entropy", optimizer="momentum", lr=0.05), step)
    np.savez(tmp_path / "batch.npz", x=X, labels=CLASSES)
    assert main(["optimize", str(step), str(tmp_path / "out.onnx"), "--tune", "cpu", "--inputs",
                 str(tmp_path / "batch.npz")]) == 0
    assert "note: tuned on cpu: fp32 " in capsys.readouterr().err
    np.savez(tmp_path / "bad.npz", x=X, labels=CLASSES, w1=np.zeros(3, np.float32))
    assert main(["optimize", str(step), str(tmp_path / "out2.onnx"), "--tune", "cpu", "--inputs",
                 str(tmp_path / "bad.npz")]) == 2
    assert "unknown input name(s) ['w1']" in capsys.readouterr().err
    assert not (tmp_path / "out2.onnx").exists()


def test_nothing_is_timed_when_every_candidate_is_the_fp32_graph(monkeypatch):
    """A model with nothing any plan converts (here: one Det, an op in no list, which even the
    all-fp16 plan keeps fp32): every candidate is the fp32 graph, so it is kept without a session."""
    def no_measure(*args):
        raise AssertionError("nothing should be timed")

    monkeypatch.setattr(tune_mod, "_measure", no_measure)
    graph = helper.make_graph([helper.make_node("Det", ["x"], ["y"], name="det")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    result = onnxcampo.optimize(model, tune="cpu")
    tuning = result.report["tuning"]
    assert tuning["chosen"] == "fp32" and tuning["candidates"]["amp"]["same_as"] == "fp32"
    assert "fp32 not timed" in result.report["notes"][-1]


@pytest.mark.slow
def test_the_all_fp16_plan_is_a_candidate_of_its_own_where_it_converts_more():
    """A MatMul feeding Softplus (a deny-list op): amp keeps Softplus fp32, the all-fp16 plan does
    not, so fp16 is timed under its own name (CPU: wiring only, ORT CPU hides fp16 rounding)."""
    w = numpy_helper.from_array(np.full((16, 16), 0.1, np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                               helper.make_node("Softplus", ["h"], ["y"], name="softplus")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 16])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    entries = onnxcampo.optimize(model, tune="cpu").report["tuning"]["candidates"]
    assert "ms" in entries["fp16"] and entries["fp16"]["rel_err"] < 0.02


def test_tune_with_cuda_graphs_needs_the_cuda_provider(capsys, tmp_path):
    with pytest.raises(ConfigError, match="execution='cuda-graph' replays on the CUDA EP: tune with tune='cuda'"):
        onnxcampo.optimize(odd_mlp(batch=8), tune="cpu", execution="cuda-graph")
    source = tmp_path / "odd.onnx"
    onnx.save(odd_mlp(batch=8), source)
    assert main(["optimize", str(source), str(tmp_path / "out.onnx"), "--tune", "cpu", "--execution", "cuda-graph"]) == 2
    assert "tune with --tune cuda" in capsys.readouterr().err


def test_host_per_launch_is_the_plain_runs_excess_over_the_replay():
    """What --tune measures where the model runs (CUDA, plain): 2.0 ms node by node against
    1.2 ms replayed over 200 launches is 4 us a launch; nothing without launches or times."""
    from onnxcampo.tune import host_per_launch

    assert host_per_launch(2.0, 1.2, 200) == pytest.approx(4.0)
    assert host_per_launch(1.0, 1.1, 10) == 0.0  # replay noise above the plain run: no negative host time
    assert host_per_launch(2.0, 1.2, 0) is None and host_per_launch(0.0, 1.2, 5) is None


@pytest.mark.slow
def test_host_is_not_remeasured_off_cuda():
    """--tune cpu: no CUDA graph to compare with, the report has no host entry."""
    result = onnxcampo.optimize(odd_mlp(batch=8), tune="cpu")
    assert "host" not in result.report["tuning"]
