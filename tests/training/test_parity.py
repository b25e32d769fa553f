"""Accuracy parity of mixed-precision step graphs on CPU (the small models of
the train-parity subcommand, benchmarks/train_parity.py): the fp32, amp and campo step graphs of an MLP and a CNN train on the
same fixed data to final losses within 2 % of each other, without divergence, and the loss
really falls. ORT's CPU provider hides most fp16 rounding, so this guards the plumbing (step
graph -> optimize -> Trainer, loss scaling state) more than the numerics; the CUDA run of the
script is the numerical test."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def parity():
    from onnxcampo.benchmarks import train_parity

    return train_parity


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_amp_and_campo_train_like_fp32(parity, name):
    steps = 24
    result = parity.train_case(parity.CASES[name], policies=("fp32", "amp", "campo"), provider="cpu", steps=steps,
                               exclude_ops=frozenset())
    parity.assess(result, steps=steps, tolerance=0.02)
    runs = result["policies"]
    assert runs["amp"]["nodes_fp16"] > 0  # the test must exercise fp16 somewhere
    for policy, run in runs.items():
        assert "error" not in run, (policy, run.get("error"))
        assert not run["diverged"], policy
        assert run["decreased"] and run["final_loss"] < 0.8 * run["losses"][0], (policy, run["losses"])
        assert run["within_tolerance"], (policy, run["final_loss"], runs["fp32"]["final_loss"])


def test_assess_flags_divergence_and_gaps(parity):
    """The judge itself: NaN and 10x growth count as divergence; a 5 % gap fails 2 %."""
    flat = [1.0, 0.9, 0.8, 0.7]
    result = {"batches": 2, "policies": {
        "fp32": {"losses": flat},
        "amp": {"losses": [1.0, 0.9, 0.8, float("nan")]},
        "campo": {"losses": [v * 1.05 for v in flat]},
        "fp16": {"losses": [1.0, 11.0, 0.8, 0.7]},
    }}
    parity.assess(result, steps=4, tolerance=0.02)
    runs = result["policies"]
    assert runs["fp32"]["within_tolerance"] and runs["fp32"]["final_loss"] == pytest.approx(0.75)
    assert runs["amp"]["diverged"] and not runs["amp"]["within_tolerance"]
    assert runs["campo"]["rel_diff"] == pytest.approx(0.05) and not runs["campo"]["within_tolerance"]
    assert runs["fp16"]["diverged"]
    assert np.isnan(runs["amp"]["rel_diff"])
