"""``python -m onnxcampo.benchmarks host-overlap``'s fit: the share of the smaller of GPU work and
host launches a plain run adds, judged leaving each model out."""

from __future__ import annotations

import numpy as np

from onnxcampo.benchmarks import host_overlap


def synthetic(share: float, noise: float = 0.0) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for model in ("a", "b", "c"):
        for gpu, host in ((100.0, 400.0), (900.0, 300.0), (500.0, 500.0), (2000.0, 100.0)):
            ms = (max(gpu, host) + share * min(gpu, host) + 10.0) / 1000 * (1 + noise * rng.standard_normal())
            rows.append({"model": model, "batch": 1, "plan": "fp16", "ms": ms, "gpu_us": gpu, "host_us": host,
                         "run_us": 10.0})
    return rows


def test_the_fit_finds_the_share_the_runs_were_made_with():
    result = host_overlap.fit(synthetic(0.35))
    assert result["overlap"] == 0.35 and result["mape"] < 1e-6 and result["left_out_mape"] < 1e-6
    assert result["additive_mape"] > 5 and result["larger_alone_mape"] > 5
    assert set(result["left_out"]) == {"a", "b", "c"}


def test_the_left_out_error_is_the_honest_one():
    result = host_overlap.fit(synthetic(0.6, noise=0.05))
    assert abs(result["overlap"] - 0.6) <= 0.1
    assert result["left_out_mape"] >= result["mape"]  # fitted without the model it is judged on
    assert "| model left out |" in host_overlap.markdown({"fit": result, "rows": synthetic(0.6)}, "cmd")
