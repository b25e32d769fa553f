"""The training checks of tests/cases/training.py on the CPU (tests/gpu/test_trainer_cuda.py runs
them on CUDA against these runs): BatchNorm and Dropout in training mode, evaluate, checkpoints
and resume, a learning-rate schedule, partial batches, for the fp32 step graph, the campo and
fp16 plans and campo with the BatchNorm sums in one pass (a wiring check for the plans: ORT's CPU
provider computes their fp16 nodes in fp32, the library's CPU kernels the fused ones)."""

from __future__ import annotations

import pytest

from cases import training as cases
from onnxcampo.training import Trainer


@pytest.fixture(scope="module")
def plans():
    return cases.step_graphs()


@pytest.mark.parametrize("plan", cases.PLANS)
def test_every_check_passes_and_the_report_holds_the_run(plans, plan, tmp_path):
    report = cases.run_checks(plans[plan], "cpu", tmp_path, steps=20)
    assert not cases.failed(report) and len(report["checks"]) == 5
    assert len(report["losses"]) == 20 and report["resumed_losses"] == report["losses"][10:]
    assert report["lrs"][0] < report["lrs"][1]  # the warm-up
    assert {"bn.running_mean", "bn.running_var"} <= set(report["running"])


def test_a_trainer_that_does_not_restore_checkpoints_fails_the_resume_check(plans, tmp_path, monkeypatch):
    monkeypatch.setattr(Trainer, "load_checkpoint", lambda self, path: None)
    report = cases.run_checks(plans["fp32"], "cpu", tmp_path, steps=8)
    assert list(cases.failed(report)) == ["a run resumed from the step-4 checkpoint equals the uninterrupted one"]
