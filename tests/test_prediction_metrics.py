"""The prediction-metrics subcommand (benchmarks/prediction_metrics.py): predictions paired with the runs of the same plan and mode."""

from __future__ import annotations

import json

from onnxcampo.benchmarks import prediction_metrics as pm


def row(policy, ms, batch=1, execution=None, predicted=None, time="2026-12-01T12:00"):
    out = {"key": f"m|{batch}|inference|{policy}", "model": "m", "batch": batch, "mode": "inference",
           "policy": policy, "status": "ok", "ms": ms, "time": time}
    if execution:
        out.update(execution=execution, predicted_us=predicted)
    return out


ROWS = [row("fp32", 2.0), row("fp16", 1.0, execution="plain", predicted={"fp16": 1100.0, "fp32": 1800.0, "amp": 1500.0}),
        row("campo", 1.2, execution="plain", predicted={"campo": 1000.0, "fp32": 2200.0, "amp": 1500.0}),
        row("amp", 1.6),
        row("fp32-graph", 1.0), row("campo-graph", 0.8, execution="cuda-graph", predicted={"campo": 700.0, "fp32": 1000.0}),
        row("fp16", 9.0, time="2026-11-01T00:00")]


def test_pairs_take_the_median_prediction_and_the_measured_plan_of_the_same_mode(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    found = {(p["mode"], p["plan"]): p for p in pm.pairs(pm.load_rows(path, "2026-12-01"))}
    assert found[("plain", "fp32")]["predicted_ms"] == 2.0  # median of 1.8 and 2.2
    assert found[("plain", "fp16")]["measured_ms"] == 1.0  # the old 9 ms row is before --since
    assert found[("cuda-graph", "fp32")]["measured_ms"] == 1.0  # paired with fp32-graph
    assert round(found[("cuda-graph", "campo")]["error"], 3) == -0.125


def test_regret_is_the_predicted_best_plans_measured_time_over_the_best(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    found = pm.pairs(pm.load_rows(path, "2026-12-01"))
    plain = next(r for r in pm.regrets(found) if r["mode"] == "plain")
    # campo predicted fastest (1.0 ms) but measured 1.2; fp16 measured 1.0
    assert (plain["predicted_best"], plain["measured_best"], plain["regret"]) == ("campo", "fp16", 0.2)
    assert pm.main([str(path), "--out", str(tmp_path / "out"), "--since", "2026-12-01"]) == 0
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    assert summary["regret"]["within_2pct"] == 1 and summary["regret"]["groups"] == 2
    assert "| MAPE fp32 and all-fp16 plans, b1 |" in (tmp_path / "out.md").read_text()


def test_missing_rows_file_is_one_line_and_rc_2(tmp_path, capsys):
    assert pm.main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
