"""``onnxcampo.runtime.compare``: the one output comparison of --validate, --tune and bench.

Every case is a pair of arrays -> the expected error; the criterion is the module docstring's
numbered list (1. float: relative L2 over finite reference elements, 2. integer/bool: share of
differing elements, 3. missing or reshaped: inf; the worst output decides).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from onnxcampo import runtime
from onnxcampo.runtime.compare import (DEFAULT_TOLERANCE, OutputCheck, check_outputs, output_error,
                                       worst_error)


def test_float_outputs_give_the_relative_l2_error():
    assert output_error(np.array([3.0, 4.0], np.float32), np.array([3.0, 4.5], np.float32)) == pytest.approx(0.1)
    assert output_error(np.ones((2, 3), np.float32), np.ones((2, 3), np.float16)) == 0.0  # dtype may change


def test_non_finite_reference_elements_are_left_out_and_a_new_non_finite_output_is_inf():
    ref = np.array([3.0, np.inf, 4.0, np.nan], np.float32)
    assert output_error(ref, np.array([3.0, 0.0, 4.5, 7.0], np.float32)) == pytest.approx(0.1)
    assert output_error(ref, np.array([3.0, np.inf, np.inf, np.nan], np.float32)) == math.inf  # fp16 overflow
    assert output_error(ref, np.array([np.nan, np.inf, 4.0, np.nan], np.float32)) == math.inf
    assert output_error(np.full(3, np.nan, np.float32), np.zeros(3, np.float32)) is None  # nothing to compare


def test_an_all_zero_reference_takes_the_rms_of_the_difference():
    assert output_error(np.zeros(4, np.float32), np.array([0.0, 0.0, 0.0, 2.0], np.float32)) == pytest.approx(1.0)
    assert output_error(np.zeros(4, np.float32), np.zeros(4, np.float32)) == 0.0


def test_integer_and_bool_outputs_give_the_share_of_differing_elements():
    assert output_error(np.array([3, 1, 2, 0], np.int64), np.array([3, 1, 0, 0], np.int64)) == pytest.approx(0.25)
    assert output_error(np.array([True, False]), np.array([True, True])) == pytest.approx(0.5)
    assert output_error(np.array([], np.int64), np.array([], np.int64)) == 0.0


def test_a_missing_or_reshaped_output_is_inf():
    assert output_error(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)) == math.inf
    assert output_error(np.zeros(2, np.float32), None) == math.inf
    assert worst_error({"y": np.ones(2, np.float32)}, {}) == math.inf


def test_the_worst_output_decides():
    ref = {"a": np.array([3.0, 4.0], np.float32), "k": np.array([1, 2, 3, 4], np.int64)}
    out = {"a": np.array([3.0, 4.5], np.float32), "k": np.array([1, 2, 0, 0], np.int64)}
    assert worst_error(ref, out) == pytest.approx(0.5)
    assert worst_error({"y": np.full(2, np.nan, np.float32)}, {"y": np.zeros(2, np.float32)}) is None


def test_rounding_noise_on_small_logits_passes_where_an_element_wise_relative_check_fails():
    """Logits near zero carry fp16's absolute rounding error: relative to each element it is
    large (the element-wise check fails), against the output's energy it is small."""
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal(4096) * 0.5).astype(np.float32)
    out = ref + (rng.standard_normal(4096) * 2e-3).astype(np.float32)
    [check] = check_outputs({"logits": ref}, {"logits": out})
    assert check.error < 0.01 and check.ok and check.measure == "rel_l2"
    assert check.max_rel_err > 0.5  # the element-wise number, for the report only
    [strict] = check_outputs({"logits": ref}, {"logits": out}, rtol=0.02)
    assert not strict.ok and strict.elementwise and not strict.diff.ok


def test_check_outputs_judges_each_output_against_the_tolerance():
    ref = {"y": np.array([3.0, 4.0], np.float32), "k": np.array([1, 2], np.int64)}
    checks = check_outputs(ref, {"y": np.array([3.0, 4.5], np.float32), "k": ref["k"]})
    assert [c.name for c in checks] == ["y", "k"] and DEFAULT_TOLERANCE == 0.02
    assert [c.ok for c in checks] == [False, True]
    assert [c.measure for c in checks] == ["rel_l2", "mismatch"]
    assert check_outputs(ref, {"y": np.array([3.0, 4.5], np.float32), "k": ref["k"]}, tolerance=0.2)[0].ok
    row = checks[0].to_json()
    assert row["error"] == pytest.approx(0.1) and row["tolerance"] == 0.02 and row["ok"] is False
    assert "elementwise_ok" not in row and row["max_abs_err"] == pytest.approx(0.5)
    assert "elementwise_ok" in check_outputs(ref, ref, atol=1e-3)[0].to_json()


def test_the_element_wise_report_carries_the_benchmarks_scaled_errors():
    """OutputDiff.scaled_max_err = max|c - r| / max|r|, scaled_mean_err = mean|c - r| / mean|r|,
    over the finite reference elements (the benchmark's rel_err_max / rel_err_mean)."""
    ref = np.array([1.0, -4.0, 2.0, np.inf], np.float32)
    (diff,) = runtime.compare_outputs({"y": ref}, {"y": np.array([1.5, -4.0, 2.0, 0.0], np.float32)}, rtol=0.02, atol=1e-3)
    assert diff.scaled_max_err == pytest.approx(0.5 / 4.0) and diff.scaled_mean_err == pytest.approx((0.5 / 3) / (7.0 / 3))
    (zeros,) = runtime.compare_outputs({"y": np.zeros(2, np.float32)}, {"y": np.array([0.1, 0.0], np.float32)},
                                       rtol=0.02, atol=1e-3)
    assert zeros.scaled_max_err == pytest.approx(0.1) and zeros.scaled_mean_err == pytest.approx(0.05)  # scale 1
    overflow, missing = runtime.compare_outputs({"y": ref, "z": ref}, {"y": np.full(4, np.inf, np.float32)},
                                                rtol=0.02, atol=1e-3)
    assert overflow.scaled_max_err == math.inf and missing.scaled_mean_err == math.inf


def test_the_runtime_package_exports_the_comparison():
    assert runtime.check_outputs is check_outputs and runtime.OutputCheck is OutputCheck
    assert runtime.worst_error is worst_error
