"""scripts/check_training_cuda.py, the issue-18 device check, on the CPU alone (the CUDA run is
the H200's: docs/benchmarks/training/README.md): every check passes and the JSON holds each
variant's losses; a wiring check (ORT's CPU provider computes the fp16 plan's nodes in fp32)."""

from __future__ import annotations

import json

import check_training_cuda


def test_the_cpu_run_passes_every_check_and_writes_the_losses(tmp_path, capsys):
    out = tmp_path / "training.json"
    assert check_training_cuda.main(["--provider", "cpu", "--steps", "20", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert not report["failed"] and len(report["checks"]) == 15
    assert set(report["variants"]) == {"fp32/cpu", "campo/cpu", "fp16/cpu"}
    fp32 = report["variants"]["fp32/cpu"]
    assert len(fp32["losses"]) == 20 and fp32["resumed_losses"] == fp32["losses"][10:]
    assert fp32["lrs"][0] < fp32["lrs"][1]  # the warm-up
    assert {"bn.running_mean", "bn.running_var"} <= set(fp32["running"])
    assert "15 of 15 checks passed" in capsys.readouterr().err


def test_a_failing_check_gives_exit_1(tmp_path, monkeypatch):
    """A Trainer that does not restore checkpoints makes the resume check fail: exit 1, named."""
    from onnxcampo.training import Trainer

    monkeypatch.setattr(Trainer, "load_checkpoint", lambda self, path: None)
    out = tmp_path / "training.json"
    assert check_training_cuda.main(["--provider", "cpu", "--steps", "8", "--out", str(out)]) == 1
    failed = json.loads(out.read_text())["failed"]
    assert failed and all("resumed" in name for name in failed)
