"""Kernel-aware candidate features and regimes (costdb/regression.py, costdb/fit.py).

Policy under test: GEMM tile/wave features (``wave_flops_*``: FLOPs of the padded waves of
output tiles over the H200's 132 SMs) are candidates the Spearman + forward selection can pick;
unaligned GEMMs with even K and N get their own ``fp16_even`` model when it pays on the training
cases; Conv splits into 1x1 and spatial regimes when it pays; databases without these keys still
load and predict as before; the fit is deterministic.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
from synthetic_samples import cast_samples, matmul_samples, pair_rows

from onnxcampo.costdb.features import op_features
from onnxcampo.costdb.fit import fit_database
from onnxcampo.costdb.regression import FEATURES, RegressionCostModel, feature_vector, validate_database

SHIPPED = Path(__file__).resolve().parents[2] / "costdb" / "data" / "nvidia-h200.json"


def _waves(m: int, n: int, tile: int = 128) -> int:
    return math.ceil(math.ceil(m / tile) * math.ceil(n / tile) / 132)


def test_wave_features_of_a_gemm():
    f = op_features("MatMul", [(1024, 512), (512, 2048)], [(1024, 2048)])
    v = feature_vector(f)
    assert v["waves_128"] == 1.0 and v["wave_eff_128"] == 128 / 132  # 8 x 16 tiles in one wave
    assert v["wave_flops_128"] == 2.0 * 132 * 128 * 128 * 512
    f2 = op_features("MatMul", [(1025, 512), (512, 2048)], [(1025, 2048)])  # one more row of tiles
    assert feature_vector(f2)["waves_128"] == 2.0
    assert feature_vector(op_features("Add", [(4, 4), (4, 4)], [(4, 4)]))["wave_flops_128"] == 0.0
    assert feature_vector(f, 10.0)["t32_log_flops"] == 10.0 * v["log_flops"]


@pytest.mark.slow
def test_planted_wave_quantization_is_recovered():
    # fp32 and fp16 both take a fixed time per wave of 128 x 128 tiles (plus a per-case factor
    # in fp32 the features cannot see): a GEMM one tile over a wave boundary costs a whole wave.
    rng = np.random.default_rng(3)
    rows, seen = [], set()
    while len(seen) < 150:
        m, n = (int(rng.integers(64, 6000)) for _ in range(2))
        k = int(rng.choice((256, 512, 1024)))
        if (m, k, n) in seen:
            continue
        seen.add((m, k, n))
        waves = _waves(m, n)
        t32 = (3 + 4.0 * waves * k / 512) * (1 + 0.3 * rng.uniform(-1, 1))
        t16 = 1 + 1.5 * waves * k / 512 + 0.1 * t32
        rows += pair_rows("MatMul", [[m, k], [k, n]], [[m, n]], t32 * (1 + 0.005 * rng.standard_normal()),
                          t16 * (1 + 0.005 * rng.standard_normal()))
    database = fit_database(rows + cast_samples())
    entry = database["ops"]["MatMul"]
    models = [entry[k] for k in ("fp16", "fp16_tc", "fp16_even") if k in entry]
    assert any("wave_flops_128" in m["features"] for m in models)
    assert entry["holdout_mape"] < 0.03


def test_even_unaligned_gemms_get_their_own_model():
    # odd K or N: t16 = 0.9 t32; even (not multiple of 8): t16 = 0.6 t32
    rng = np.random.default_rng(4)
    rows, seen = [], set()
    while len(seen) < 200:
        m, k, n = (int(rng.integers(50, 3000)) for _ in range(3))
        if (m, k, n) in seen:
            continue
        seen.add((m, k, n))
        f = op_features("MatMul", [(m, k), (k, n)], [(m, n)])
        t32 = (2 + 1e-9 * f.flops) * (1 + 0.3 * rng.uniform(-1, 1))
        ratio = 0.4 if f.tensor_core_aligned else 0.6 if f.even_aligned else 0.9
        rows += pair_rows("MatMul", [[m, k], [k, n]], [[m, n]], t32, ratio * t32 * (1 + 0.005 * rng.standard_normal()))
    database = fit_database(rows + cast_samples())
    entry = database["ops"]["MatMul"]
    assert entry["fp16"]["fit_on"] == "odd" and entry["fp16_even"]["fit_on"] == "even"
    assert abs(entry["fp16"]["sigma"] - 0.9) < 0.05 and abs(entry["fp16_even"]["sigma"] - 0.6) < 0.05
    model = RegressionCostModel(database)
    even = op_features("MatMul", [(100, 102), (102, 202)], [(100, 202)])
    odd = op_features("MatMul", [(100, 101), (101, 202)], [(100, 202)])
    assert abs(model.fp16_time(even, 100.0) - 60.0) < 3 and abs(model.fp16_time(odd, 100.0) - 90.0) < 3


def _conv_rows(kernel: int, count: int, ratio: float, rng) -> list[dict]:
    rows = []
    for _ in range(count):
        c_in, c_out, hw = (int(rng.integers(8, 64)) * 8, int(rng.integers(8, 64)) * 8, int(rng.integers(7, 60)))
        ins = [[1, c_in, hw, hw], [c_out, c_in, kernel, kernel]]
        out_hw = hw - kernel + 1
        outs = [[1, c_out, out_hw, out_hw]]
        f = op_features("Conv", ins, outs)
        t32 = (2 + 1e-9 * f.flops) * (1 + 0.3 * rng.uniform(-1, 1))
        rows += pair_rows("Conv", ins, outs, t32, ratio * t32 * (1 + 0.005 * rng.standard_normal()))
    return rows


@pytest.mark.slow
def test_conv_regimes_split_1x1_from_spatial_kernels():
    rng = np.random.default_rng(6)
    rows = _conv_rows(1, 60, 0.5, rng) + _conv_rows(3, 60, 0.95, rng)
    database = fit_database(rows + cast_samples())
    entry = database["ops"]["Conv"]
    regimes = entry["regimes"]
    assert regimes["rule"] == "kernel" and set(regimes["models"]) == {"1x1", "spatial"}
    assert regimes["loo_mape"] < regimes["pooled_loo_mape"]
    assert entry["holdout_mape"] < 0.02
    validate_database(database)
    # a reader that ignores regimes still finds the pooled models at the top level
    pooled = copy.deepcopy(database)
    del pooled["ops"]["Conv"]["regimes"]
    RegressionCostModel(pooled)


@pytest.mark.slow
def test_no_regimes_when_they_do_not_pay():
    rng = np.random.default_rng(7)
    rows = _conv_rows(1, 60, 0.7, rng) + _conv_rows(3, 60, 0.7, rng)
    assert "regimes" not in fit_database(rows + cast_samples())["ops"]["Conv"]


def test_old_database_without_new_keys_still_loads_and_predicts():
    # a schema-v1 database as the first fits wrote it: original features, no fp16_even/regimes
    old = {"schema_version": 1, "device": {"name": "Old GPU"}, "cast": {"C_I": 4.0, "r": 1e-6},
           "ops": {"MatMul": {"fp32": {"features": ["flops"], "coef": [1e-8], "intercept": 5.0},
                              "fp16": {"features": ["log_elements"], "coef": [0.1], "intercept": 1.0, "sigma": 0.5},
                              "fp16_tc": {"features": [], "coef": [], "intercept": 0.5, "sigma": 0.4}},
                   "Conv": {"fp32": {"features": ["elements"], "coef": [1e-6], "intercept": 2.0},
                            "fp16": {"features": [], "coef": [], "intercept": 0.0, "sigma": 0.8}}},
           "summary": {"holdout_mape": 0.1, "wrong_decision_rate": 0.09, "samples": 10}}
    model = RegressionCostModel(old)
    even = op_features("MatMul", [(100, 102), (102, 202)], [(100, 202)])
    assert model.fp16_time(even, 100.0) == 1.0 + 0.1 * math.log1p(even.elements) + 50.0
    conv = op_features("Conv", [(1, 8, 10, 10), (8, 8, 1, 1)], [(1, 8, 10, 10)])
    assert model.fp16_time(conv, 10.0) == 8.0


def test_shipped_database_is_valid_and_uses_known_features():
    database = json.loads(SHIPPED.read_text())
    validate_database(database)
    assert set(database) >= {"device", "cast", "ops", "summary"}
    assert {"C_I", "r"} <= set(database["cast"])
    assert all("holdout_mape" in e for e in database["ops"].values())
    used = {f for e in database["ops"].values() for k in ("fp32", "fp16", "fp16_tc", "fp16_even") if k in e
            for f in e[k]["features"]}
    assert used <= set(FEATURES)


@pytest.mark.slow
def test_fit_is_deterministic():
    rows = matmul_samples(n_cases=80) + cast_samples()
    assert json.dumps(fit_database(rows)) == json.dumps(fit_database(rows))
