"""evaluate / write_report: errors and wrong fp16/fp32 decisions of a database on measured cases.

Policy under test (costdb/evaluate.py): fp16 predicted from the measured fp32 time; choice fp16
when ``fp16 + casts < fp32`` (one Cast per float activation input and output, weights free); a
choice is wrong when it picks the measured-slower side by more than ``noise``.
"""

from __future__ import annotations

import copy
import sys

import pytest
from synthetic_samples import cast_samples, elementwise_samples, matmul_samples, pair_rows

from onnxcampo.costdb.evaluate import evaluate, markdown, write_report
from onnxcampo.costdb.fit import fit_database
from onnxcampo.errors import CostModelError


# Fitting this database takes seconds: the tests that use it are marked slow.
@pytest.fixture(scope="module")
def clean():
    """Noise-free samples whose formulas the models can represent exactly."""
    rows = (matmul_samples(n_cases=160, noise=0.0, spread=0.3) + elementwise_samples("Softmax", n_cases=4)
            + cast_samples(noise=0.0))
    return rows, fit_database(rows)


@pytest.mark.slow
def test_noise_free_data_gives_zero_error(clean):
    rows, database = clean
    result = evaluate(database, rows)
    overall = result["overall"]
    assert overall["cases"] == len(database["holdout_cases"]) == 32
    assert overall["mape_fp16"] < 1e-9
    assert overall["wrong"] == 0 and overall["wrong_rate"] == 0.0
    assert result["verdict"] == {"mape": "met", "wrong_decision_rate": "met"}
    assert result["cast"]["mape"] < 0.05  # one pooled model for two directions of different r
    # what fit_database stored is what evaluate finds
    assert database["summary"]["holdout_mape"] == overall["mape_fp16"]
    assert database["ops"]["MatMul"]["holdout_mape_fp32"] == result["ops"]["MatMul"]["mape_fp32"]


@pytest.mark.slow
def test_wrong_database_shows_higher_error_and_wrong_decisions(clean):
    rows, database = clean
    wrong = copy.deepcopy(database)
    for kind in ("fp16", "fp16_tc"):
        wrong["ops"]["MatMul"][kind]["sigma"] *= 2
    good = evaluate(database, rows, holdout_only=False)["overall"]
    bad = evaluate(wrong, rows, holdout_only=False)
    assert bad["overall"]["mape_fp16"] > good["mape_fp16"] + 0.1
    assert good["wrong"] == 0 < bad["overall"]["wrong"]
    assert bad["overall"]["lost_us"] > 0
    assert bad["verdict"]["mape"].startswith("missed by")
    assert bad["ops"]["MatMul"]["wrong"] == bad["overall"]["wrong"]
    assert all(r["predicted_choice"] == "fp32" and r["measured_choice"] == "fp16"
               for r in bad["cases"] if r["wrong"])  # a slower fp16 prediction only loses fp16 wins


@pytest.mark.slow
def test_holdout_only_evaluates_held_out_cases_of_fitted_ops(clean):
    rows, database = clean
    held = evaluate(database, rows)
    everything = evaluate(database, rows, holdout_only=False)
    assert held["ops"]["MatMul"]["cases"] == 32 and everything["ops"]["MatMul"]["cases"] == 160
    assert {r["case"] for r in held["cases"] if r["fitted"]} == set(database["holdout_cases"])
    # the analytic fallback op: all its cases, apart from the overall numbers
    assert held["ops"]["Softmax"]["model"] == "analytic" and held["ops"]["Softmax"]["cases"] == 4
    assert held["fallback"]["cases"] == 4
    fewer = [r for r in rows if r.get("case") != database["holdout_cases"][0]]
    assert evaluate(database, fewer)["holdout_missing"] == 1
    no_holdout = {k: v for k, v in database.items() if k != "holdout_cases"}
    with pytest.raises(CostModelError, match="holdout_cases"):
        evaluate(no_holdout, rows)


def _one_case_database(fp16_us: float) -> dict:
    """MatMul always predicted 100 us in fp32 and ``fp16_us`` in fp16; casts 5 us each."""
    return {
        "schema_version": 1,
        "device": {"name": "Test GPU"},
        "cast": {"C_I": 5.0, "r": 0.0},
        "ops": {"MatMul": {"fp32": {"features": [], "coef": [], "intercept": 100.0},
                           "fp16": {"features": [], "coef": [], "intercept": fp16_us, "sigma": 0.0}}},
        "holdout_cases": [],
    }


@pytest.mark.parametrize(
    ("predicted16", "measured16", "wrong"),
    [
        (80.0, 80.0, False),  # both say fp16 (80 + 10 < 100)
        (80.0, 97.0, True),  # predicted fp16; measured 97 + 10 = 107: fp32 faster by 7 %
        (80.0, 93.0, False),  # measured 103 vs 100: the slower side, but within the 5 % noise band
        (95.0, 70.0, True),  # predicted fp32 (105 > 100); fp16 + casts measured 80: 25 % faster
    ],
)
def test_decision_counts_casts_of_activations_only(predicted16, measured16, wrong):
    rows = pair_rows("MatMul", [[64, 64], [64, 64]], [[64, 64]], 100.0, measured16)
    result = evaluate(_one_case_database(predicted16), rows + cast_samples(count=2), holdout_only=False)
    record = result["cases"][0]
    assert record["casts"] == 10.0  # input 0 and the output; input 1 is a weight
    assert record["wrong"] is wrong
    assert result["overall"]["wrong"] == int(wrong)


@pytest.mark.parametrize(
    ("predicted16", "measured16", "per_op_wrong", "boundary_wrong"),
    [
        (95.0, 80.0, True, False),  # fp16 inside a region: both 80/95 < 100; per op 105 > 100 predicted fp32, measured 90
        (80.0, 97.0, True, False),  # cast-free 97 < 100 is fp16 too; per op 107 > 100
        (90.0, 110.0, False, True),  # cast-free: predicted fp16 (90), measured fp32 (110 > 100, 10 % apart)
    ],
)
def test_boundary_decision_is_cast_free_and_time_weighted(predicted16, measured16, per_op_wrong, boundary_wrong):
    """The boundary decision charges no Cast (a product inside an fp16 region); its time lost is
    |t16 - t32| of the wrong decisions over the cases' fp32 time."""
    rows = pair_rows("MatMul", [[64, 64], [64, 64]], [[64, 64]], 100.0, measured16)
    result = evaluate(_one_case_database(predicted16), rows + cast_samples(count=2), holdout_only=False)
    record = result["cases"][0]
    assert (record["wrong"], record["boundary_wrong"]) == (per_op_wrong, boundary_wrong)
    boundary = result["boundary"]
    assert boundary["wrong"] == int(boundary_wrong)
    assert boundary["lost_share"] == pytest.approx(abs(measured16 - 100.0) / 100.0 if boundary_wrong else 0.0)
    assert "at region boundaries" in markdown(result)


@pytest.mark.slow
def test_markdown_states_targets_and_worst_cases(clean, tmp_path):
    rows, database = clean
    wrong = copy.deepcopy(database)
    wrong["ops"]["MatMul"]["fp16"]["sigma"] *= 2
    result = evaluate(wrong, rows, holdout_only=False)
    text = markdown(result)
    assert "MAPE" in text and "<= 6 %" in text and "<= 1.5 %" in text
    assert "missed by" in text and "Worst cases" in text
    assert "| MatMul | regression | 160 | 160 |" in text
    assert "\\|in=" in text  # case keys keep their pipes escaped inside table cells
    worst = text.split("## Worst cases")[1].splitlines()
    assert len([line for line in worst if line.startswith("| ") and "\\|attrs=" in line]) == 10
    good = markdown(evaluate(database, rows))
    assert "| met |" in good


@pytest.mark.slow
def test_write_report_with_png(clean, tmp_path):
    pytest.importorskip("matplotlib")
    rows, database = clean
    written = write_report(evaluate(database, rows), tmp_path / "report.md", tmp_path / "fit.png")
    assert written["png"] and written["png_skipped"] is None
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fit.png" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_write_report_without_matplotlib(clean, tmp_path, monkeypatch):
    rows, database = clean
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    written = write_report(evaluate(database, rows), tmp_path / "report.md", tmp_path / "fit.png")
    assert written["png"] is None and "matplotlib" in written["png_skipped"]
    assert not (tmp_path / "fit.png").exists()
    assert "matplotlib is not installed" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    ("op_type", "ins", "weights", "casts"),
    [
        ("MatMul", [[64, 64], [64, 64]], None, 10.0),  # weight input 1 is converted offline
        ("MatMul", [[64, 64], [64, 64]], [], 15.0),  # attention: both inputs are activations
        ("Gemm", [[64, 64], [64, 64], [64]], None, 10.0),  # weight and bias
        ("Add", [[64, 64], [64, 64]], None, 15.0),
    ],
)
def test_cast_count_follows_the_row_weights(op_type, ins, weights, casts):
    extra = {} if weights is None else {"weights": weights}
    rows = pair_rows(op_type, ins, [[64, 64]], 100.0, 50.0, **extra)
    record = evaluate(_one_case_database(80.0), rows, holdout_only=False)["cases"][0]
    assert record["casts"] == casts
