"""The final choice between campo's plan and fp32: the --min-gain margin and the host's dispatch
floor (a run cannot be faster than the host can launch its nodes)."""

from __future__ import annotations

import json

import pytest

import onnxcampo
from onnxcampo.costdb.fit import fit_dispatch

from test_api import _database, mlp


def _db(tmp_path, *, cast_ci=0.5, fp16_share=0.9, dispatch=None):
    """MatMul fp32 = 5 us + 1e-8 us/FLOP, fp16 = ``fp16_share`` of the fp32 time; cheap Casts."""
    database = _database()
    database["cast"] = {"C_I": cast_ci, "r": 0.0}
    linear = database["ops"]["MatMul"]["fp32"]
    database["ops"]["MatMul"]["fp16"] = {"features": [], "coef": [], "intercept": 0.0, "sigma": fp16_share}
    assert linear["features"] == ["flops"]
    if dispatch is not None:
        database["dispatch"] = {"us": dispatch, "samples": 1, "rule": "test"}
    path = tmp_path / "db.json"
    path.write_text(json.dumps(database))
    return path


@pytest.mark.slow
def test_a_small_predicted_gain_keeps_fp32(tmp_path):
    """The fp16 plan is predicted 3.5 % faster: under a 5 % margin fp32 stays (with a note);
    --min-gain 0 takes the 3.5 %."""
    db = _db(tmp_path, fp16_share=0.99)
    kept = onnxcampo.optimize(mlp(), device_db=db, min_gain=0.05)
    predicted = kept.report["predicted_us"]
    assert 0.95 < predicted["amp"]["total_us"] / predicted["fp32"]["total_us"] < 0.98
    assert kept.report["chosen_plan"] == "fp32" and kept.report["nodes_fp16"] == 0
    assert any("--min-gain" in note for note in kept.report["notes"])
    taken = onnxcampo.optimize(mlp(), device_db=db, min_gain=0.0)
    assert taken.report["chosen_plan"] != "fp32" and taken.report["nodes_fp16"] > 0


@pytest.mark.slow
def test_a_clear_predicted_gain_goes_fp16(tmp_path):
    result = onnxcampo.optimize(mlp(), device_db=_db(tmp_path, fp16_share=0.5))
    assert result.report["chosen_plan"] == "campo" and result.report["nodes_fp16"] == 3


def test_dispatch_floor_counts_every_launched_node_and_cast(tmp_path):
    """With a 50 us dispatch per node the 3-node MLP is host-bound: fp32 costs 3 dispatches, the
    fp16 plan 5 (its two Casts), so fp32 wins although its kernels are slower."""
    result = onnxcampo.optimize(mlp(batch=16, hidden=64, ffn=64), device_db=_db(tmp_path, fp16_share=0.5, dispatch=50.0))
    predicted = result.report["predicted_us"]
    assert predicted["fp32"]["launched_nodes"] == 3 and predicted["fp32"]["total_us"] == pytest.approx(150.0)
    assert predicted["amp"]["launched_nodes"] == 5 and predicted["amp"]["total_us"] == pytest.approx(250.0)
    assert result.report["chosen_plan"] == "fp32" and result.report["nodes_fp16"] == 0
    # the same graph without a dispatch floor takes fp16 (kernels 2x faster, Casts cheap)
    assert onnxcampo.optimize(mlp(batch=16, hidden=64, ffn=64),
                              device_db=_db(tmp_path, fp16_share=0.5)).report["nodes_fp16"] == 3


def test_fit_dispatch_takes_the_median_of_dispatch_bound_runs():
    rows = [{"op_type": "Add", "kernel_us": 1.0, "wall_time_us": t} for t in (2.0, 3.0, 9.0)]
    rows += [{"op_type": "MatMul", "kernel_us": 40.0, "wall_time_us": 45.0},  # kernel-bound: not counted
             {"op_type": "chain", "chain": "conv_relu", "kernel_us": 1.0, "wall_time_us": 50.0}]
    assert fit_dispatch(rows)["us"] == 3.0 and fit_dispatch(rows)["samples"] == 3
    assert fit_dispatch([{"op_type": "Add", "wall_time_us": 3.0}]) is None  # CPU runs: no kernel time


def test_the_fixed_cost_of_a_run_shrinks_a_small_models_relative_gain(tmp_path):
    """A run's fixed cost (run_overhead) is the same for every plan: it adds to each total, so a
    gain of a few microseconds on a tiny model no longer clears --min-gain."""
    small = dict(batch=16, hidden=64, ffn=64)
    db = _db(tmp_path, fp16_share=0.5)
    taken = onnxcampo.optimize(mlp(**small), device_db=db)
    assert taken.report["nodes_fp16"] == 3
    gain_us = taken.report["predicted_us"]["fp32"]["total_us"] - taken.report["predicted_us"]["amp"]["total_us"]
    database = json.loads(db.read_text())
    database["run_overhead"] = {"us": 100 * gain_us, "model": "test", "samples": 1, "rule": "test"}
    db.write_text(json.dumps(database))
    kept = onnxcampo.optimize(mlp(**small), device_db=db)
    predicted = kept.report["predicted_us"]
    assert predicted["fp32"]["run_us"] == pytest.approx(100 * gain_us)
    assert predicted["fp32"]["total_us"] - predicted["amp"]["total_us"] == pytest.approx(gain_us)
    assert kept.report["chosen_plan"] == "fp32" and kept.report["nodes_fp16"] == 0
