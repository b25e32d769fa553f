"""Every policy's model on the CUDA execution provider, end to end (tests/gpu/conftest.py: skipped
without a GPU): ``optimize()`` with fp32, amp, fp16 and campo (the GPU's cost database where one
is found, the analytic model, and ``--profile cuda``: measured fp32 node times), the optimized
model run on CUDA against the fp32 model's outputs there, its latency recorded (median of bound
runs, TF32 on as ORT has it) with the plan's Casts, Pads and fp16 nodes.

Models: the bundled MLP block (16384 rows), whose outputs must match within rtol 0.02 and atol
0.01; BERT-base (b32 s128) and GPT-2 small (b8 s256) built from their configs with random
weights and exported with torch on the machine (transformers and torch needed; no network),
within 0.05 of the fp32 hidden states (fp16 through 12 layers: about 0.01 measured).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnxcampo
from onnxcampo.profile import measure_latency
from onnxcampo.runtime import compare_outputs, run

VARIANTS = {"fp32": {"policy": "fp32"}, "amp": {"policy": "amp"}, "fp16": {"policy": "fp16"},
            "campo": {"policy": "campo"}, "campo-analytic": {"policy": "campo", "analytic": True},
            "campo-profile-cuda": {"policy": "campo", "profile": "cuda"}}


def _optimize(model, shapes, options: dict, monkeypatch):
    """optimize(); the GPU's cost database is looked up unless ``analytic`` (or a GPU is named)."""
    from onnxcampo.costdb import select

    options = dict(options)
    if options.pop("analytic", False):
        monkeypatch.setenv("ONNXCAMPO_DEVICE", "none")
    elif os.environ.get("ONNXCAMPO_DEVICE", "none").strip().lower() in ("", "none"):  # tests/conftest.py's default
        monkeypatch.delenv("ONNXCAMPO_DEVICE", raising=False)
    select.detected_gpu.cache_clear()
    try:
        return onnxcampo.optimize(model, input_shapes=shapes, **options)
    finally:
        select.detected_gpu.cache_clear()


def _check(device, results, monkeypatch, model, feeds, shapes, options, *, rtol=0.02, atol=1e-2, max_abs=None):
    if not device.cuda:
        options = {k: v for k, v in options.items() if k != "profile"}
    reference = run(device.session(model, cpu_fallback=True), feeds)
    start = time.perf_counter()
    result = _optimize(model, shapes, options, monkeypatch)
    seconds = time.perf_counter() - start
    diffs = compare_outputs(reference, run(device.session(result.model, cpu_fallback=True), feeds), rtol=rtol, atol=atol)
    latency = measure_latency(result.model, provider=device.name, feeds=feeds, warmup=20, runs=100)
    report = result.report
    results.record(optimize_s=seconds, latency_ms=latency.median_ms, p10_ms=latency.p10_ms, p90_ms=latency.p90_ms,
                   max_rel_err=max(float(d.max_rel_err) for d in diffs),
                   max_abs_err=max(float(d.max_abs_err) for d in diffs), casts=report.get("casts_inserted"),
                   pads=report.get("pads_inserted"), nodes_fp16=report.get("nodes_fp16"),
                   chosen_plan=report.get("chosen_plan"), cost_model=report.get("cost_model", {}).get("name"))
    if max_abs is None:
        assert all(d.ok for d in diffs), diffs
    else:
        assert all(np.isfinite(d.max_abs_err) and d.max_abs_err <= max_abs for d in diffs), diffs


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_mlp_block_runs_and_matches_fp32_under_every_policy(device, results, monkeypatch, variant):
    model = onnx.load(str(Path(onnxcampo.__file__).parent / "examples" / "mlp_block.onnx"))
    x = np.random.default_rng(0).standard_normal((16384, 256)).astype(np.float32)
    _check(device, results, monkeypatch, model, {"x": x}, {"x": (16384, 256)}, VARIANTS[variant])


@pytest.fixture(scope="module")
def transformers_models(tmp_path_factory):
    """(name -> (model, feeds, shapes)): BERT-base b32 s128 and GPT-2 small b8 s256, exported once."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from onnxcampo.benchmarks.models import export_hf  # the benchmark's exporter (TorchScript, opset 17)

    folder = tmp_path_factory.mktemp("hf")
    return {"bert": export_hf("bert", lambda: transformers.BertModel(transformers.BertConfig()), 32, 128, 30522,
                              folder),
            "gpt2": export_hf("gpt2", lambda: transformers.GPT2Model(transformers.GPT2Config()), 8, 256, 50257, folder)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_transformers_run_and_stay_close_to_fp32_under_every_policy(device, results, monkeypatch, transformers_models,
                                                                    name, variant):
    model, feeds, shapes = transformers_models[name]
    _check(device, results, monkeypatch, model, feeds, shapes, VARIANTS[variant], max_abs=0.05)

