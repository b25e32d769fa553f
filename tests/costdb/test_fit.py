"""fit_database: synthetic samples from known cost formulas -> the formulas come back.

Policy under test (costdb/fit.py): Cast and Pad cost ``C_I + r * n``; per op type, fp32 and
fp16 (Campo form, ``+ sigma * t32``) linear models on Spearman-chosen features, a Tensor Core
model for aligned GEMMs; op types with too few cases fall back to the analytic model.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from synthetic_samples import cast_samples, elementwise_samples, matmul_samples, pad_samples, pair_rows

from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.features import op_features
from onnxcampo.costdb.fit import collect, fit_database, fit_file, fit_model, load_samples, sample_time
from onnxcampo.costdb.regression import RegressionCostModel, validate_database
from onnxcampo.errors import ConfigError, CostModelError


def close(value, expected, rel):
    return abs(value - expected) <= rel * abs(expected)


@pytest.fixture(scope="module")
def spread_db():
    """fp32 times with a per-case factor the features cannot see (what makes sigma identifiable)."""
    rows = matmul_samples(n_cases=160, spread=0.3) + cast_samples() + pad_samples()
    return rows, fit_database(rows)


def test_fp32_model_recovers_known_coefficients():
    # t32 = 5 + 1e-8 * flops with 1 % noise
    database = fit_database(matmul_samples(n_cases=120, spread=0.0) + cast_samples())
    fp32 = database["ops"]["MatMul"]["fp32"]
    assert fp32["features"] == ["flops"]
    assert close(fp32["intercept"], 5.0, 0.03)
    assert close(fp32["coef"][0], 1e-8, 0.02)
    assert database["ops"]["MatMul"]["holdout_mape_fp32"] < 0.02
    assert database["ops"]["MatMul"]["holdout_mape"] < 0.02


def test_fp16_models_recover_campo_form(spread_db):
    # unaligned t16 = 2 + 3e-9 * flops + 0.2 * t32; aligned t16 = 1 + 1e-9 * flops + 0.25 * t32
    _, database = spread_db
    entry = database["ops"]["MatMul"]
    fp16, tc = entry["fp16"], entry["fp16_tc"]
    assert (fp16["fit_on"], tc["fit_on"]) == ("unaligned", "aligned")
    assert fp16["features"] == ["flops"] and tc["features"] == ["flops"]
    assert close(fp16["intercept"], 2.0, 0.05) and close(fp16["coef"][0], 3e-9, 0.05)
    assert close(fp16["sigma"], 0.2, 0.05)
    assert close(tc["intercept"], 1.0, 0.05) and close(tc["coef"][0], 1e-9, 0.05)
    assert close(tc["sigma"], 0.25, 0.05)
    assert entry["holdout_mape"] < 0.02
    assert database["summary"]["holdout_mape"] < 0.02
    assert database["summary"]["wrong_decision_rate"] == 0.0


def test_spearman_and_selection_pick_the_planted_feature():
    # times depend on elements moved only (a memory-bound MatMul), not on FLOPs or alignment
    rng = np.random.default_rng(5)
    rows, seen = [], set()
    dims = (64, 96, 128, 200, 333, 512, 1001, 1024, 2047, 4096)
    while len(seen) < 80:
        m, k, n = (int(rng.choice(dims)) for _ in range(3))
        if (m, k, n) in seen:
            continue
        seen.add((m, k, n))
        ins, outs = [[m, k], [k, n]], [[m, n]]
        elements = op_features("MatMul", ins, outs).elements
        t32 = (3 + 2e-6 * elements) * (1 + 0.01 * rng.standard_normal())
        t16 = (1 + 1e-6 * elements) * (1 + 0.01 * rng.standard_normal())
        rows += pair_rows("MatMul", ins, outs, t32, t16)
    database = fit_database(rows + cast_samples())
    for kind in ("fp32", "fp16", "fp16_tc"):
        model = database["ops"]["MatMul"][kind]
        # fp16: t16 is linear in t32 here, so elements adds nothing to sigma * t32 (a collinear
        # candidate, left out) or comes alone
        assert "elements" in model["features"] if kind == "fp32" else set(model["features"]) <= {"elements"}, kind
        assert not {"flops", "aligned", "intensity"} & set(model["features"]), kind
        assert "aligned" not in model["rho"]  # below the Spearman threshold: not even a candidate


def test_no_feature_above_rho_takes_the_single_best():
    cases = collect(elementwise_samples(n_cases=30)).cases
    model = fit_model(cases, fp16=False, rho=0.999)
    assert len(model["rho"]) == 1 and len(model["features"]) == 1


def test_cast_and_pad_fits_recover_c_i_and_r(spread_db):
    _, database = spread_db
    cast = database["cast"]
    assert close(cast["to_fp16"]["C_I"], 4.5, 0.03) and close(cast["to_fp16"]["r"], 2e-6, 0.03)
    assert close(cast["to_fp32"]["C_I"], 4.5, 0.03) and close(cast["to_fp32"]["r"], 2.4e-6, 0.03)
    assert close(cast["C_I"], 4.5, 0.03) and 2e-6 < cast["r"] < 2.4e-6  # pooled directions
    assert cast["samples"] == 60
    assert close(database["pad"]["C_I"], 10.0, 0.03) and close(database["pad"]["r"], 1.5e-6, 0.03)


@pytest.mark.slow
def test_pad_is_omitted_without_rows():
    database = fit_database(matmul_samples(n_cases=20) + cast_samples())
    assert "pad" not in database
    assert RegressionCostModel(database).pad_time(1000) == AnalyticCostModel().pad_time(1000)


def test_op_with_too_few_cases_falls_back_to_analytic(spread_db):
    rows, _ = spread_db
    database = fit_database(rows + elementwise_samples("Softmax", n_cases=5))
    assert database["fallback_ops"] == ["Softmax"]
    assert "Softmax" not in database["ops"]
    features = op_features("Softmax", [(4096, 1000)], [(4096, 1000)])
    model, analytic = RegressionCostModel(database), AnalyticCostModel()
    assert model.fp32_time(features) == analytic.fp32_time(features)
    assert model.fp16_time(features, 40.0) == analytic.fp16_time(features, 40.0)


def test_elementwise_op_fits_one_model_without_tensor_core_variant():
    database = fit_database(elementwise_samples("Add", n_cases=40) + cast_samples())
    entry = database["ops"]["Add"]
    assert "fp16_tc" not in entry and entry["fp16"]["fit_on"] == "all"
    assert entry["holdout_mape"] < 0.03


def test_database_validates_and_round_trips_through_json(spread_db, tmp_path):
    rows, database = spread_db
    validate_database(database)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "db.json"
    written = fit_file(samples, out)
    assert written == json.loads(out.read_text()) == json.loads(json.dumps(database))
    assert out.read_text().startswith('{\n "schema_version": 1')  # indent=1
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert stat.S_IMODE(os.stat(out).st_mode) != 0o600
    loaded, direct = RegressionCostModel.load(out), RegressionCostModel(database)
    for shape in ((512, 768, 768), (256, 2048, 1001), (4095, 1023, 1001)):
        m, k, n = shape
        features = op_features("MatMul", [(m, k), (k, n)], [(m, n)])
        assert loaded.fp32_time(features) == direct.fp32_time(features)
        assert loaded.fp16_time(features, 50.0) == direct.fp16_time(features, 50.0)
    assert loaded.cast_time(10_000) == direct.cast_time(10_000)


def test_device_block_and_summary(spread_db):
    rows, database = spread_db
    rows = [dict(r) for r in rows]
    rows[3]["date"] = "2026-12-02"
    database = fit_database(rows)
    assert database["device"] == {"name": "Test GPU", "compute_capability": "9.0", "ort_version": "1.31.1",
                                  "cuda_version": "13.0", "date": "2026-12-02"}
    summary = database["summary"]
    assert summary["samples"] == len(rows) and summary["cases"] == 160
    assert set(summary) >= {"holdout_mape", "holdout_mape_fp32", "wrong_decision_rate", "samples", "cases"}


@pytest.mark.slow
def test_holdout_is_by_case_and_deterministic(spread_db):
    rows, database = spread_db
    held = database["holdout_cases"]
    assert len(held) == len(set(held)) == database["ops"]["MatMul"]["holdout"] == 32
    assert all(key.startswith("MatMul|") for key in held)
    assert fit_database(rows, seed=0)["holdout_cases"] == held
    assert fit_database(rows, seed=1)["holdout_cases"] != held
    entry = database["ops"]["MatMul"]
    assert entry["fp16"]["samples"] + entry["fp16_tc"]["samples"] + entry["holdout"] == entry["samples"]


def test_no_holdout_fits_everything_and_measures_nothing():
    database = fit_database(matmul_samples(n_cases=40) + cast_samples(), holdout=0)
    assert database["holdout_cases"] == [] and database["ops"]["MatMul"]["holdout"] == 0
    assert database["summary"]["holdout_mape"] is None and database["ops"]["MatMul"]["holdout_mape"] is None


def test_fp32_without_tf32_and_padded_rows_are_not_used(spread_db):
    rows, database = spread_db
    extra = []
    for row in rows[:20]:
        if row["op_type"] == "MatMul":
            extra.append({**row, "tf32": False, "time_us": row["time_us"] * 3} if row["precision"] == "fp32"
                         else {**row, "padded": True, "time_us": row["time_us"] / 3})
    again = fit_database(rows + extra)
    assert again["ops"] == database["ops"]
    assert again["summary"]["rows_skipped"] == {"fp32 without TF32": 10, "padded": 10}


def test_repeated_rows_use_the_median():
    rows = matmul_samples(n_cases=10) + cast_samples()
    first = next(r for r in rows if r["precision"] == "fp32")
    rows += [{**first, "time_us": first["time_us"] * 10}, {**first, "time_us": first["time_us"] * 1.01}]
    case = next(c for c in collect(rows).cases if c.key == first["case"])
    assert case.t32 == pytest.approx(first["time_us"] * 1.01)


def test_calibrate_host_and_fused_kernel_rows_are_skipped_by_the_op_fit(spread_db):
    """``costdb calibrate``'s samples file also holds its host-launch and FusedElementwise timings
    (rows with a ``kind``): fitting or evaluating the op models over that file leaves them out."""
    rows, database = spread_db
    facts = {"device": rows[0]["device"]}
    extra = [{"key": "host|other|96", "kind": "host", "class": "other", "launches": 96, "plain_us": 700.0, **facts},
             {"key": "fe|1", "kind": "fused_elementwise", "bytes": 4096, "time_us": 3.0, **facts}]
    again = fit_database(rows + extra)
    assert again["ops"] == database["ops"]
    assert again["summary"]["rows_skipped"] == {"host rows": 1, "fused_elementwise rows": 1}
    with pytest.raises(CostModelError, match="not a measurement"):
        fit_database(rows + [{"key": "no op type", "time_us": 1.0}])


def test_time_floor():
    assert sample_time({"time_us": -0.3}) == 0.5
    assert sample_time({"time_us": 0.1}) == 0.5
    assert sample_time({"time_us": 12.0}) == 12.0
    assert sample_time({"time_us": None}) is None
    assert sample_time({"time_us": float("nan")}) is None


def test_corrupt_line_names_the_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    good = json.dumps(cast_samples(count=2)[0])
    path.write_text(f"{good}\n\n{good}\n{{\"op_type\": \"Cast\", \n{good}\n")
    with pytest.raises(CostModelError, match=r"samples\.jsonl:4: malformed"):
        load_samples(path)
    path.write_text(f"{good}\n\n{good}\n[1, 2]\n")
    with pytest.raises(CostModelError, match=r":4: .*not a JSON object"):
        load_samples(path)
    path.write_text(f"{good}\n\n  \n{good}\n")
    assert len(load_samples(path)) == 2
    with pytest.raises(CostModelError, match="not found"):
        load_samples(tmp_path / "missing.jsonl")


def test_bad_inputs_raise_clear_errors(spread_db):
    rows, _ = spread_db
    with pytest.raises(CostModelError, match="no Cast rows"):
        fit_database(matmul_samples(n_cases=10))
    with pytest.raises(CostModelError, match="several devices"):
        fit_database(rows + [{**rows[0], "device": "Other GPU"}])
    with pytest.raises(ConfigError, match="holdout"):
        fit_database(rows, holdout=1.0)
    with pytest.raises(ConfigError, match="min_samples"):
        fit_database(rows, min_samples=1)
    with pytest.raises(CostModelError, match="precision 'bf16'"):
        fit_database(rows + [{**rows[0], "precision": "bf16"}])


@pytest.mark.slow
def test_step_dispatch_from_benchmark_rows(tmp_path, spread_db):
    """Training steps whose CUDA-graph replay ran clearly faster were host-bound: their fp32 time
    over their nodes is a per-node host time; the smallest is stored as dispatch_step, which the
    regression model uses for training steps only, and a refit keeps it."""
    from onnxcampo.costdb.fit import add_step_dispatch, fit_step_dispatch

    def row(model, policy, ms, nodes=100, status="ok"):
        return {"model": model, "batch": 8, "mode": "training", "policy": policy, "ms": ms, "nodes": nodes,
                "status": status}
    rows = [row("a", "fp32", 1.0), row("a", "fp32-graph", 0.5),          # host-bound: 10 us per node
            row("b", "fp32", 3.0, nodes=200), row("b", "fp32-graph", 2.0),  # 15 us per node
            row("c", "fp32", 4.0), row("c", "fp32-graph", 3.9),           # GPU-bound: says nothing
            row("d", "fp32", 0.1), row("d", "fp32-graph", 0.01, status="failed")]
    entry = fit_step_dispatch(rows)
    assert entry["us"] == 10.0 and entry["per_model_us"] == {"a b8": 10.0, "b b8": 15.0}
    assert fit_step_dispatch(rows[4:]) is None and fit_step_dispatch(rows, "inference") is None
    infer = [{**r, "mode": "inference"} for r in rows[:2]]
    assert fit_step_dispatch(infer, "inference")["us"] == 10.0
    bench = tmp_path / "h200.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows + [{**infer[0], "ms": 0.8}, infer[1]]))
    db_path = tmp_path / "db.json"
    db_path.write_text(json.dumps({**spread_db[1], "dispatch": {"us": 3.0}}))
    add_step_dispatch(bench, db_path)
    model = RegressionCostModel.load(db_path)
    # the fastest replayed inference run (0.5 ms) is a run's fixed cost, taken off before dividing:
    # inference (0.8 - 0.5) ms / 100 = 3 us (the single-op 3.0 us), training a (1.0 - 0.5) / 100, b (3.0 - 0.5) / 200
    assert (model.dispatch_us(), model.dispatch_us(training=True)) == (3.0, 5.0)
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in spread_db[0]))
    fit_file(samples, db_path)
    refit = json.loads(db_path.read_text())  # a refit keeps both
    assert (refit["dispatch_step"]["us"], refit["dispatch_model"]["us"]) == (5.0, 3.0)
    # the fastest replayed inference run is the fixed cost of a run (upper bound), kept by a refit too
    assert refit["run_overhead"]["us"] == 500.0 and refit["run_overhead"]["model"] == "a b8"
    assert RegressionCostModel.load(db_path).run_us() == 500.0
    # and the host term fitted from whole models (`fit-step-dispatch --launches`), which the
    # samples cannot give: a refit that dropped it made plain runs as fast as replayed ones
    launch = {"inference": {"other": 3.4, "conv": 8.1, "host": "additive"}}
    db_path.write_text(json.dumps({**refit, "host_launch": launch}))
    fit_file(samples, db_path)
    assert json.loads(db_path.read_text())["host_launch"] == launch
    assert RegressionCostModel.load(db_path).launch_us("conv") == 8.1
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(CostModelError, match="no training step"):
        add_step_dispatch(tmp_path / "empty.jsonl", db_path)


def test_run_overhead_is_the_fastest_replayed_inference_run():
    from onnxcampo.costdb.fit import fit_run_overhead

    def row(model, ms, policy="fp32-graph", mode="inference", status="ok"):
        return {"model": model, "batch": 1, "mode": mode, "policy": policy, "ms": ms, "status": status}
    rows = [row("a", 0.2), row("b", 0.07), row("c", 0.01, status="failed"), row("d", 0.01, policy="fp32"),
            row("e", 0.01, mode="training")]
    assert fit_run_overhead(rows) == {"us": 70.0, "model": "b b1", "samples": 2,
                                      "rule": "smallest fp32-graph inference ms: a replayed run of almost no GPU work"}
    assert fit_run_overhead(rows[2:]) is None


def test_host_launch_is_fitted_per_class_from_plain_and_replayed_runs():
    """fit_host_launch: a plain run took its replayed time plus 4 us a conv launch and 2 us any
    other; the fit finds both, and a model left out is predicted from the others."""
    from onnxcampo.costdb.fit import fit_host_launch

    def group(model, conv, other, graph_ms):
        plain_ms = graph_ms + (4.0 * conv + 2.0 * other) / 1e3
        return [{"model": model, "batch": 1, "mode": "inference", "status": "ok", "policy": "fp32", "ms": plain_ms,
                 "ort_launches": {"conv": conv, "other": other}},
                {"model": model, "batch": 1, "mode": "inference", "status": "ok", "policy": "fp32-graph", "ms": graph_ms}]

    rows = [*group("cnn", 50, 40, 0.5), *group("bert", 0, 400, 1.0), *group("mixed", 20, 200, 0.4),
            *group("big", 10, 10, 10.0)]
    fitted = fit_host_launch(rows)
    assert (fitted["conv"], fitted["other"], fitted["samples"], fitted["host"]) == (4.0, 2.0, 4, "additive")
    assert all(abs(error) < 1e-6 for error in fitted["leave_one_model_out_error"].values())
    assert fit_host_launch([r for r in rows if r["policy"] == "fp32"]) is None  # no replayed twin


def test_rows_without_launch_counts_take_them_from_a_launches_file():
    """with_launches: an fp32 inference row measured before the benchmark recorded ORT's launches
    takes them from the given lines; rows that have them, or of other policies, keep theirs."""
    from onnxcampo.costdb.fit import with_launches

    rows = [{"model": "m", "batch": 1, "mode": "inference", "policy": "fp32", "ms": 1.0},
            {"model": "m", "batch": 1, "mode": "inference", "policy": "fp32-graph", "ms": 0.5},
            {"model": "n", "batch": 1, "mode": "inference", "policy": "fp32", "ms": 1.0, "ort_launches": {"conv": 0, "other": 9}}]
    lines = [{"model": "m", "batch": 1, "ort_launches": {"conv": 2, "other": 3}},
             {"model": "n", "batch": 1, "ort_launches": {"conv": 5, "other": 5}}]
    merged = with_launches(rows, lines)
    assert merged[0]["ort_launches"] == {"conv": 2, "other": 3} and "ort_launches" not in merged[1]
    assert merged[2]["ort_launches"] == {"conv": 0, "other": 9} and "ort_launches" not in rows[0]


RAW_H200 = Path(__file__).resolve().parents[2] / "costdb" / "data" / "raw" / "nvidia-h200.jsonl"


def test_collinear_features_are_no_candidates_off_a_one_width_grid():
    # The H200's SkipLayerNormalization rows of one output: elements = 3 x FLOPs + 2 x width. Fitted on both, the fp16 model took +1.1e-3 x FLOPs - 3.8e-4 x elements and
    # predicted 1.2 ms for the 10 us node ORT's GPT-2 fusion leaves (a second, summed output).
    rows = [json.loads(line) for line in RAW_H200.read_text().splitlines() if '"SkipLayerNormalization' in line]
    rows = [r for r in rows if r["case"].endswith("|fused")]
    assert len(rows) >= 24
    casts = [{**r, "device": rows[0]["device"]} for r in cast_samples()]
    database = fit_database(rows + casts)
    entry = database["ops"]["SkipLayerNormalization"]
    assert not {"flops", "elements"} <= set(entry["fp16"]["features"])
    model = RegressionCostModel(database)
    x, h = (8, 256, 768), (768,)
    passing_on = op_features("SkipLayerNormalization", [x, x, h, h, h], [x, x])
    t32 = model.fp32_time(passing_on)
    assert 0.3 * t32 < model.fp16_time(passing_on, t32) < t32


def test_fp16_predictions_stay_within_the_ratios_the_op_measured(spread_db):
    database = json.loads(json.dumps(spread_db[1]))
    entry = database["ops"]["MatMul"]
    lo, hi = entry["fp16_ratio"]
    assert 0 < lo < hi
    for kind in ("fp16", "fp16_tc"):  # a model gone wild off its grid ...
        entry[kind] = {**entry[kind], "features": ["flops"], "coef": [1.0], "intercept": 0.0, "sigma": 0.0}
    model = RegressionCostModel(database)
    features = op_features("MatMul", [(512, 768), (768, 768)], [(512, 768)])
    assert model.fp16_time(features, 40.0) == pytest.approx(hi * 40.0)  # ... is held to the largest ratio
    del entry["fp16_ratio"]
    assert RegressionCostModel(database).fp16_time(features, 40.0) > 1e8  # (without the bound: the wild value)
