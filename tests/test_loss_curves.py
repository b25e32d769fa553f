"""The loss-curves subcommand (benchmarks/loss_curves.py): the comparison of loss curves with the
reference, on made-up curves, and a ``--quick --provider cpu`` run end to end on the benchmark's
tiny models (the JSON's layout, finite losses, resuming)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from onnxcampo.benchmarks import loss_curves as lc
from onnxcampo.benchmarks import measure as bench_measure
from onnxcampo.benchmarks import models as bench_models


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ONNXCAMPO_BENCH_PKGS", str(tmp_path / "pkgs"))
    monkeypatch.setenv("ONNXCAMPO_DEVICE", "none")


def _curve(steps=200, start=4.0, end=1.0, batches=8, spread=0.3):
    """A falling loss with a repeating per-batch pattern (what cycling K batches gives)."""
    t = np.arange(steps)
    pattern = spread * np.sin(2 * np.pi * (t % batches) / batches)
    return list(end + (start - end) * np.exp(-t / 60) + pattern)


def test_a_curve_within_two_percent_is_met():
    """1 % above the reference on every step: the window means are 1 % apart, within 2 %."""
    reference = _curve()
    result = lc.compare([1.01 * v for v in reference], reference)
    assert result["within"] and not result["diverged"] and result["finite"]
    assert result["max_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert result["final_rel_diff"] == pytest.approx(0.01, rel=1e-9)
    assert len(result["windows"]) == 5 and result["windows"][0]["steps"] == [150, 160]
    assert result["windows"][-1]["steps"] == [190, 200]
    assert result["reference_drop"] > 0.5
    assert lc.verdict({"status": "ok", "comparison": result}) == "met (1.00 %)"


def test_a_curve_three_percent_off_in_one_late_window_is_not_met():
    """Only steps 170-179 are 3 % high: the largest window difference over the last 50 says so,
    while the final window alone is still exact."""
    reference = _curve()
    losses = list(reference)
    for i in range(170, 180):
        losses[i] *= 1.03
    result = lc.compare(losses, reference)
    assert not result["within"] and not result["diverged"]
    assert result["max_rel_diff"] == pytest.approx(0.03, rel=1e-6)
    assert result["final_rel_diff"] == pytest.approx(0.0, abs=1e-12)
    assert lc.verdict({"status": "ok", "comparison": result}) == "not met (3.00 %)"


def test_differences_before_the_last_fifty_steps_do_not_count():
    reference = _curve()
    losses = [v * (1.5 if i < 150 else 1.0) for i, v in enumerate(reference)]
    assert lc.compare(losses, reference)["within"]


def test_a_nan_loss_is_divergence():
    reference = _curve()
    losses = list(reference)
    losses[37] = math.nan
    losses[38] = None  # how a non-finite loss is stored in the JSON
    result = lc.compare(losses, reference)
    assert result["diverged"] and not result["finite"] and not result["within"]
    assert result["nonfinite_steps"] == 2
    assert lc.verdict({"status": "ok", "comparison": result}) == "not met (diverged: 2 non-finite losses)"


def test_ending_above_where_the_reference_started_is_divergence():
    reference = _curve()
    losses = list(reference[:100]) + [reference[0] * 1.5] * 100
    result = lc.compare(losses, reference)
    assert result["diverged"] and result["finite"] and not result["within"]
    assert lc.verdict({"status": "ok", "comparison": result}).startswith("not met (diverged: final window")


def test_a_shorter_curve_is_incomplete_and_short_runs_use_what_there_is():
    reference = _curve(steps=30)
    short = lc.compare(reference[:20], reference)
    assert not short["complete"] and not short["within"]
    result = lc.compare(reference, reference, window=10, tail=50)  # 30 steps: three windows, all compared
    assert result["within"] and len(result["windows"]) == 3 and result["max_rel_diff"] == 0.0
    assert lc.window_means([1.0, 2.0, 3.0], 10) == [2.0]
    assert lc.window_means(list(range(25)), 10) == [9.5, 19.5]  # aligned to the end: steps 0-4 dropped


def test_extra_batches_are_seeded_by_their_index_and_shaped_like_the_benchmarks():
    built = bench_models.MODELS["odd_mlp"].build(4, training=True, quick=True)
    first = built.training_batch(0)
    assert set(first) == {"x", "labels"} and first["x"] is built.feeds["x"]
    again = bench_models.MODELS["odd_mlp"].build(4, training=True, quick=True)
    for index in (1, 2):
        a, b = built.training_batch(index), again.training_batch(index)
        np.testing.assert_array_equal(a["x"], b["x"])
        assert a["x"].shape == first["x"].shape and a["labels"].dtype == first["labels"].dtype
        assert not np.array_equal(a["x"], first["x"])
    assert not np.array_equal(built.training_batch(1)["x"], built.training_batch(2)["x"])


@pytest.mark.slow
def test_step_runner_set_batch_trains_like_the_trainer_on_each_batch(tmp_path):
    """Two batches alternated through set_batch give the Trainer's losses, and the caller's
    arrays are not written into (on CPU the bound buffers are updated in place)."""
    from test_bench import _tiny_step

    from onnxcampo.training import Trainer, initial_weights

    forward, step, path, batch = _tiny_step(tmp_path, "fp32")
    other = {"x": np.random.default_rng(5).standard_normal(batch["x"].shape).astype(np.float32),
             "labels": np.random.default_rng(6).integers(0, 8, 8)}
    kept = {k: v.copy() for k, v in batch.items()}
    weights = initial_weights(forward, step)
    trainer = Trainer(step, weights={k: v.copy() for k, v in weights.items()}, provider="cpu")
    expected = [trainer.step(b) for b in (batch, other, batch, other)]
    runner = bench_measure.StepRunner(path, weights=weights, batch=batch, provider="cpu")
    got = []
    for b in (batch, other, batch, other):
        runner.set_batch(b)
        got.append(runner())
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    for name, value in kept.items():
        np.testing.assert_array_equal(batch[name], value)
    with pytest.raises(bench_measure.MeasureError, match="batch x"):
        runner.set_batch({**batch, "x": batch["x"][:4]})


@pytest.mark.slow
def test_quick_cpu_run_end_to_end_and_resume(tmp_path, capsys):
    """The tiny MLP and CNN, four variants (one of them CUDA-only), 24 steps on 3 batches: the
    JSON holds every loss, finite, the comparison and the run; a second run trains nothing."""
    out = tmp_path / "lc.json"
    args = ["--provider", "cpu", "--quick", "--models", "odd_mlp,odd_cnn", "--steps", "24", "--batches", "3",
            "--policies", "fp32,amp,campo,campo-graph", "--out", str(out), "--wheels", str(tmp_path / "none")]
    assert lc.main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["format"] == lc.FORMAT and data["settings"]["steps"] == 24 and data["settings"]["batches"] == 3
    assert len(data["runs"]) == 1 and data["runs"][0]["command"].startswith("python -m onnxcampo.benchmarks loss-curves --provider cpu")
    assert data["runs"][0]["versions"]["onnx"] and data["runs"][0]["start"] and data["runs"][0]["end"]
    assert set(data["models"]) == {"odd_mlp", "odd_cnn"}
    for name, model in data["models"].items():
        assert model["batch"] == 4
        policies = model["policies"]
        assert list(policies) == ["fp32-notf32", "fp32", "amp", "campo", "campo-graph"]  # the reference first
        assert policies["campo-graph"]["status"] == "unavailable"
        for policy in ("fp32-notf32", "fp32", "amp", "campo"):
            entry = policies[policy]
            assert entry["status"] == "ok", (name, policy, entry.get("error"))
            assert len(entry["losses"]) == 24 and all(math.isfinite(v) for v in entry["losses"])
            c = entry["comparison"]
            assert c["finite"] and c["complete"] and not c["diverged"] and len(c["windows"]) == 2
            assert c["within"], (name, policy, c)  # CPU: fp16 ops compute in fp32, the curves match
        assert policies["fp32-notf32"]["losses"][0] == policies["campo"]["losses"][0]  # same weights, same batch 0
        assert policies["amp"]["loss_scale"]["final"] == 65536.0 and policies["amp"]["loss_scale"]["skipped_steps"] == 0
        assert policies["fp32"]["comparison"]["max_rel_diff"] == 0.0  # no TF32 on CPU: the same graph
    assert data["targets"]["met"] and not data["targets"]["missed"]
    assert 'within 2 % of fp32; no divergence": met' in printed
    mlp = data["models"]["odd_mlp"]["policies"]["fp32-notf32"]["comparison"]
    assert mlp["final_window"] < mlp["first_window"]  # three batches memorized: the loss moves
    assert lc.main(args) == 0  # everything recorded: nothing trained again
    again = json.loads(out.read_text())
    assert len(again["runs"]) == 2 and again["models"]["odd_mlp"]["policies"]["amp"]["run"] == data["runs"][0]["run"]
    assert lc.main([*args, "--plot-only"]) == 0


def test_the_target_is_missed_when_a_variant_or_the_reference_diverges():
    reference = _curve()
    ok = {"status": "ok", "losses": [1.005 * v for v in reference]}
    data = {"settings": {"steps": 200}, "models": {"m": {"policies": {
        "fp32-notf32": {"status": "ok", "losses": reference}, "amp": ok,
        "campo": {"status": "ok", "losses": [1.03 * v for v in reference]},
        "campo-graph": {"status": "unavailable", "error": "CUDA graphs need the CUDA execution provider"}}}}}
    lc.assess(data, window=10, tail=50, tolerance=0.02)
    result = lc.targets(data)
    assert not result["met"] and result["missed"] == ["m/campo"]
    assert result["worst"] == {"model": "m", "policy": "campo", "max_rel_diff": pytest.approx(0.03)}
    del data["models"]["m"]["policies"]["campo"]
    lc.assess(data, window=10, tail=50, tolerance=0.02)
    assert lc.targets(data)["met"]
    rising = list(reversed(reference))
    data["models"]["m"]["policies"]["fp32-notf32"]["losses"] = rising
    data["models"]["m"]["policies"]["amp"]["losses"] = rising
    lc.assess(data, window=10, tail=50, tolerance=0.02)
    assert lc.targets(data)["missed"] == ["m/fp32-notf32 (the reference diverged)", "m/amp"]
