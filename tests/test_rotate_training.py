"""The rotate subcommand (benchmarks/rotate_training.py) on the CPU (wiring only; its figures are the GPU's): every variant
made once, timed in rotation, one row each, a variant that cannot be made reported and skipped."""

from __future__ import annotations

import json
import sys

import pytest

from onnxcampo.benchmarks import rotate_training


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ONNXCAMPO_DEVICE", "none")


@pytest.mark.slow
@pytest.mark.usefixtures("library")
def test_variants_are_timed_in_rotation_and_a_bad_one_is_reported(tmp_path, capsys):
    out = tmp_path / "rotation.json"
    rc = rotate_training.main(["--model", "odd_cnn", "--quick", "--provider", "cpu", "--policies",
                               "fp32,nonsense,campo-fused", "--rounds", "2", "--block-ms", "5", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "nonsense" in printed and "not made" in printed
    result = json.loads(out.read_text())
    rows = result["policies"]
    assert list(rows) == ["fp32", "nonsense", "campo-fused"] and "error" in rows["nonsense"]
    for policy in ("fp32", "campo-fused"):
        row = rows[policy]
        assert row["ms"] > 0 and len(row["blocks_ms"]) == 2 and row["finite"] and row["steps"] > 2
    assert rows["campo-fused"]["kind"] == "onnxcampo" and result["rounds"] == 2
    assert result["command"].startswith("python -m onnxcampo.benchmarks rotate --model odd_cnn")


def test_a_model_without_a_training_batch_is_one_clear_error(capsys):
    assert rotate_training.main(["--model", "no-such-model", "--provider", "cpu", "--policies", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-model" in err[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
