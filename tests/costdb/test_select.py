"""Choosing the cost model: --device-db, the database shipped for the detected GPU, or the
analytic default; and the shipped H200 database's interface."""

from __future__ import annotations

import json

import pytest

from onnxcampo.costdb import select
from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.regression import FEATURES, RegressionCostModel, validate_database


@pytest.fixture(autouse=True)
def fresh_detection():
    select.detected_gpu.cache_clear()
    yield
    select.detected_gpu.cache_clear()


def test_shipped_h200_database_is_picked_for_an_h200(monkeypatch):
    monkeypatch.setenv("ONNXCAMPO_DEVICE", "NVIDIA H200")
    model = select.load_cost_model()
    assert isinstance(model, RegressionCostModel)
    assert model.database["device"]["name"] == "NVIDIA H200"


@pytest.mark.parametrize("device", ["none", "NVIDIA A100-SXM4-80GB"])
def test_analytic_model_without_a_matching_database(monkeypatch, device):
    monkeypatch.setenv("ONNXCAMPO_DEVICE", device)
    assert isinstance(select.load_cost_model(), AnalyticCostModel)


def test_device_db_wins_over_detection(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXCAMPO_DEVICE", "none")
    path = tmp_path / "db.json"
    path.write_text((select.DATA / "nvidia-h200.json").read_text())
    assert isinstance(select.load_cost_model(path), RegressionCostModel)


def test_slug():
    assert select.slug("NVIDIA H200") == "nvidia-h200"
    assert select.slug(" NVIDIA GeForce RTX 4090 ") == "nvidia-geforce-rtx-4090"


def test_shipped_database_interface():
    """The keys other checks rely on (issue 3): device, cast C_I and r, per-op coefficients with
    holdout_mape, and the summary."""
    database = json.loads((select.DATA / "nvidia-h200.json").read_text())
    validate_database(database)
    assert {"device", "cast", "ops", "summary"} <= set(database)
    assert database["cast"]["C_I"] > 0 and database["cast"]["r"] > 0
    assert {"MatMul", "Conv", "Gemm", "Softmax"} <= set(database["ops"])
    for entry in database["ops"].values():
        assert "holdout_mape" in entry and set(entry["fp16"]["features"]) <= set(FEATURES)
    assert {"holdout_mape", "wrong_decision_rate", "samples"} <= set(database["summary"])


@pytest.mark.slow
def test_measured_shapes_give_measured_times_but_not_to_the_evaluation():
    """The shipped database answers a measured shape with its measurement (scaled by the node's
    fp32 time); the evaluation ignores that table, so held-out errors are the models' own."""
    from onnxcampo.costdb.evaluate import evaluate
    from onnxcampo.costdb.fit import collect, load_samples

    database = json.loads((select.DATA / "nvidia-h200.json").read_text())
    model = RegressionCostModel(database)
    samples = load_samples(select.DATA / "raw" / "nvidia-h200.jsonl")
    case = next(c for c in collect(samples).cases if c.op_type == "MatMul" and c.key in set(database["holdout_cases"]))
    assert model.fp32_time(case.features) == pytest.approx(case.t32, rel=1e-3)
    assert model.fp16_time(case.features, case.t32) == pytest.approx(case.t16, rel=1e-3)
    assert model.fp16_time(case.features, 2 * case.t32) == pytest.approx(2 * case.t16, rel=1e-3)
    without = {k: v for k, v in database.items() if k != "measured"}
    assert evaluate(database, samples)["overall"] == evaluate(without, samples)["overall"]
    assert evaluate(database, samples)["overall"]["mape_fp16"] > 0.01
