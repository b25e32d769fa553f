"""The GPU tests (``tests/gpu``) on ORT's CPU provider, the library's CPU kernels standing in for
its CUDA kernels (``ONNXCAMPO_GPU_TESTS_DEVICE=cpu``): their models, references, tolerances and
results files work before a GPU run spends device time on them. Only the fast ones run here (the
timings and the large shapes are ``slow`` there too); on a machine without a GPU the suite itself
collects and skips every one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_fast_gpu_tests_pass_on_the_cpu_provider_and_write_their_figures(library, tmp_path):
    env = {**os.environ, "ONNXCAMPO_GPU_TESTS_DEVICE": "cpu", "ONNXCAMPO_GPU_RESULTS": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu and not slow", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    written = json.loads((tmp_path / "test_trainer_cuda.json").read_text())
    assert written["environment"]["device"] == "cpu"
    losses = [entry["losses"] for entry in written["tests"].values()]
    assert losses and all(len(run) == 20 for run in losses)
