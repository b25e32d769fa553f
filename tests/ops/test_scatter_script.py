"""scripts/check_scatter_cuda.py on ORT's CPU provider: the plumbing of the GPU check (models
written without onnx, the numpy reference and its bound, the bad-index cases, IO-bound timing of
both variants) runs and passes; without the CUDA EP the real run says so and exits 2."""

from __future__ import annotations

import json

import onnxruntime as ort
import pytest

import check_scatter_cuda as check


@pytest.mark.slow
def test_the_check_passes_on_the_cpu_provider(library, tmp_path, capsys):
    out = tmp_path / "scatter.json"
    assert check.main(["--provider", "cpu", "--quick", "--timing", "--rounds", "2", "--block", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["provider"] == "cpu"
    ours = [c for c in result["checks"] if c["variant"] == "ScatterNDAdd"]
    assert len(ours) == len(check.cases()) and all(c["ok"] and "skipped" not in c for c in ours)
    refused = [c for c in ours if "out of range" in c["case"]]
    assert len(refused) == 2 and all("is out of range for data dimension 0 of size 4" in c["error"] for c in refused)
    assert [b["name"] for b in result["timing"]] == ["bert-like", "same-index"]
    for bench in result["timing"]:
        assert set(bench["variants"]) == {f"{v}/{m}" for v in check.VARIANTS for m in ("sync", "queued")}
        assert all(v["ok"] and v["output"]["ok"] and v["median_ms"] > 0 for v in bench["variants"].values())
    assert "all checks passed" in capsys.readouterr().out


def test_a_wrong_result_fails_the_check():
    import numpy as np

    data = np.zeros((3, 2), np.float32)
    tuples = np.array([[0], [2]])
    updates = np.ones((2, 2), np.float32)
    right = np.array([[1, 1], [0, 0], [1, 1]], np.float32)
    assert check.compare(right, data, tuples, updates)["ok"]
    assert not check.compare(right[[0, 2, 1]], data, tuples, updates)["ok"]  # row 2's update in row 1
    touched_wrongly = right.copy()
    touched_wrongly[1, 0] = 1e-30  # an element no update reaches must keep data's bits
    report = check.compare(touched_wrongly, data, tuples, updates)
    assert not report["ok"] and not report["untouched_equal_data"]


def test_without_the_cuda_ep_the_check_exits_2(library, capsys):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    assert check.main([]) == 2
    assert "no CUDAExecutionProvider" in capsys.readouterr().err
