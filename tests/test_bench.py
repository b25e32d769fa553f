"""The benchmark suite's own logic, on CPU: keys and resuming, the report's target wording, the
training-step time breakdown, and a ``--quick --provider cpu`` run end to end (``python -m
onnxcampo.benchmarks run``, benchmarks/runner.py)."""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path

import numpy as np
import pytest
from onnxcampo.benchmarks import measure as bench_measure
from onnxcampo.benchmarks import models as bench_models
from onnxcampo.benchmarks import policies as bench_policies
from onnxcampo.benchmarks import report as bench_report
from onnxcampo.benchmarks import runner as bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ONNXCAMPO_BENCH_PKGS", str(tmp_path / "pkgs"))
    monkeypatch.setenv("ONNXCAMPO_DEVICE", "none")


@pytest.mark.slow
def test_the_benchmarks_import_without_torch():
    """The device-only parts import torch lazily: every benchmark module loads on a machine without it."""
    from onnxcampo.benchmarks.__main__ import COMMANDS

    modules = ["results", "measure", "models", "policies", "torch_twins", "corpus",
               *(module for module, _ in COMMANDS.values())]
    code = (f"import importlib, sys; [importlib.import_module('onnxcampo.benchmarks.' + m) for m in {modules!r}]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_every_subcommand_answers_help():
    """``python -m onnxcampo.benchmarks`` lists the subcommands; each answers ``--help`` with its
    own options under its own name (from the repository root, as the docs run them)."""
    from onnxcampo.benchmarks.__main__ import COMMANDS

    done = subprocess.run([sys.executable, "-m", "onnxcampo.benchmarks", "--help"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0 and all(f"  {name} " in done.stdout for name in COMMANDS), done.stdout
    for name in ("run", "report", "ops", "loss-curves", "rotate", "fetch-corpus"):
        done = subprocess.run([sys.executable, "-m", "onnxcampo.benchmarks", name, "--help"], cwd=ROOT,
                              capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr[-500:])
        assert done.stdout.startswith(f"usage: python -m onnxcampo.benchmarks {name} "), (name, done.stdout[:200])
    done = subprocess.run([sys.executable, "-m", "onnxcampo.benchmarks", "nonsense"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "unknown subcommand 'nonsense'" in done.stderr


def test_keys_resume_and_killed_items(tmp_path):
    """Keys are model|batch|mode|policy; done rows are skipped (failed ones only with --retry-failed);
    a torn last line is ignored; an item started twice with a full run ahead and never finished is dead."""
    assert bench.make_key("bert", 32, "training", "campo") == "bert|32|training|campo"
    items = bench.work_list(["odd_mlp"], ["fp32", "campo", "torch-eager"], ["inference", "training"], quick=True)
    assert [i.key for i in items] == ["odd_mlp|1|inference|fp32", "odd_mlp|1|inference|campo",
                                      "odd_mlp|4|inference|fp32", "odd_mlp|4|inference|campo",
                                      "odd_mlp|4|training|fp32", "odd_mlp|4|training|campo",
                                      "odd_mlp|4|training|torch-eager"]
    results = bench.Results(tmp_path, "h200", mirror=tmp_path / "mirror")
    results.add({"key": items[0].key, "status": "ok"})
    results.add({"key": items[1].key, "status": "failed", "error": "x"})
    with results.path.open("a") as f:
        f.write('{"key": "odd_mlp|4|infer')  # a run killed mid-line
    rows = bench.read_rows(results.path)
    assert bench.done_keys(rows) == {items[0].key, items[1].key}
    assert bench.done_keys(rows, retry_failed=True) == {items[0].key}
    assert (tmp_path / "mirror" / "h200.jsonl").is_file()
    attempts = [{"key": "a", "left_s": 500}, {"key": "a", "left_s": 520}, {"key": "b", "left_s": 500},
                {"key": "b", "left_s": 20}, {"key": "c", "left_s": 500}, {"key": "c", "left_s": 500}]
    assert bench.killed_items(attempts, [{"key": "c", "time": "2026-11-30T10:00:00+00:00"}], [], full_run_s=270) == {"a": 2}


def test_killed_items_count_only_attempts_after_the_last_row():
    """A key measured again (--redo) has attempts from the runs that finished it before: those do not
    make it dead; attempts after its latest row do (their own time, or their run's start)."""
    runs = [{"run": "r1", "start": "2026-11-30T10:00:00+00:00"}, {"run": "r2", "start": "2026-11-30T11:00:00+00:00"},
            {"run": "r3", "start": "2026-11-30T12:00:00+00:00"}]
    rows = [{"key": "k", "status": "ok", "run": "r1", "time": "2026-11-30T10:05:00+00:00"},
            {"key": "k", "status": "ok", "run": "r2", "time": "2026-11-30T11:05:00+00:00"}]
    finished = [{"key": "k", "run": "r1", "left_s": 500}, {"key": "k", "run": "r2", "left_s": 500}]
    assert bench.killed_items(finished, rows, runs, full_run_s=270) == {}
    killed_twice = finished + [{"key": "k", "run": "r3", "left_s": 500},
                               {"key": "k", "run": "r4", "left_s": 480, "time": "2026-11-30T13:00:00+00:00"}]
    assert bench.killed_items(killed_twice, rows, runs, full_run_s=270) == {"k": 2}
    assert bench.killed_items(killed_twice[:3], rows, runs, full_run_s=270) == {}
    # a naive timestamp (older files) compares as UTC
    assert bench.killed_items(killed_twice, [dict(r, time=r["time"][:19]) for r in rows], runs, full_run_s=270) == {"k": 2}


@pytest.mark.slow
def test_quick_cpu_run_end_to_end_and_resume(tmp_path, capsys):
    """--quick --provider cpu on the onnx.helper odd MLP: every variant gives a row; a second run
    does nothing; anchors whose packages are missing are rows with the reason, not crashes."""
    out = tmp_path / "raw"
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--out", str(out), "--budget-s", "120",
            "--wheels", str(tmp_path / "none"), "--policies", "fp32,fp32-notf32,modelopt,amp,campo,campo-nocost,torch-eager"]
    assert bench.main(args) == 0
    rows = [json.loads(line) for line in (out / "cpu.jsonl").read_text().splitlines()]
    by_key = {r["key"]: r for r in rows}
    assert len(rows) == len(by_key) == 2 * 6 + 6
    campo = by_key["odd_mlp|4|inference|campo"]
    assert campo["status"] == "ok" and campo["ms"] > 0 and len(campo["ms_blocks"]) == 5
    assert campo["rel_err_max"] < 0.02 and "casts" in campo and "tc" in campo
    train = by_key["odd_mlp|4|training|campo"]
    assert train["status"] == "ok" and train["steps"] == 11 and np.isfinite(train["loss_last"])
    assert train["loss_last"] < train["loss_first"]
    assert set(train["breakdown"]["per_step_us"]) == set(bench_measure.CATEGORIES)
    assert by_key["odd_mlp|1|inference|modelopt"]["status"] in ("unavailable", "ok")
    # each inference group's variants measured in this run, timed again side by side (--interleave 7)
    records = {r["key"]: r for r in map(json.loads, (out / "cpu.interleaved.jsonl").read_text().splitlines())}
    assert set(records) == {"odd_mlp|1|inference", "odd_mlp|4|inference"}
    measured = {r["policy"] for r in rows if r["key"].startswith("odd_mlp|4|inference|") and r["status"] == "ok"}
    assert set(records["odd_mlp|4|inference"]["ms"]) == measured and len(measured) >= 4
    assert all(len(blocks) == 7 for blocks in records["odd_mlp|4|inference"]["ms_blocks"].values())
    assert records["odd_mlp|4|inference"]["run"] == campo["run"]
    assert "everything is done" in capsys.readouterr().out
    assert bench.main(args) == 0
    assert len((out / "cpu.jsonl").read_text().splitlines()) == len(rows)
    assert len((out / "cpu.interleaved.jsonl").read_text().splitlines()) == 2  # nothing measured: nothing interleaved
    assert "0 measurements left" not in capsys.readouterr().out
    runs = bench_report.read_runs(out / "cpu.runs.jsonl")
    assert [r["finished"] for r in runs] == [len(rows), 0] and runs[0]["versions"]["onnx"]


@pytest.mark.slow
def test_interleave_fresh_makes_a_session_per_visit(tmp_path, monkeypatch):
    """--interleave-fresh: every visit of the rotation makes its own session (one alive at a
    time) and times 3 blocks; rounds x variants sessions in all."""
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    settings = bench.Settings.make("cpu", True, False, (), interleave=2, interleave_fresh=True)
    (tmp_path / "w").mkdir()
    group = bench.Group("odd_mlp", 4, "inference", settings, tmp_path / "w")
    for policy in ("fp32", "amp"):
        bench.measure_inference(group, policy)
    from onnxcampo import runtime

    made = []
    real = runtime.make_session
    monkeypatch.setattr(runtime, "make_session", lambda *a, **k: made.append(a[0]) or real(*a, **k))
    record = bench.interleave(group)
    assert record["fresh"] is True and len(made) == 2 * 2
    assert all(len(blocks) == 2 * 3 for blocks in record["ms_blocks"].values())
    assert bench.interleave_estimate_s(group) > 5.0


@pytest.mark.slow
def test_interleave_keeps_variants_until_the_group_ends(tmp_path, monkeypatch, capsys):
    """Measured inference variants stay on disk until the group ends; then they are timed again
    side by side (when the budget allows) and removed either way."""
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    settings = bench.Settings.make("cpu", True, False, (), interleave=3)
    results = bench.Results(tmp_path / "raw", "cpu", mirror=None)

    def measured_group(work: Path) -> bench.Group:
        work.mkdir()
        group = bench.Group("odd_mlp", 4, "inference", settings, work)
        for policy in ("fp32", "amp"):
            assert bench.measure_inference(group, policy)["ms_blocks"]
        return group

    group = measured_group(tmp_path / "a")
    amp = group.kept["amp"].path
    assert set(group.kept) == {"fp32", "amp"} and amp.is_file() and group.kept["fp32"].path == group.built.path
    bench.finish_group(group, results, "r1", left_s=0.01)
    assert "no interleaved timing" in capsys.readouterr().out
    assert not amp.exists() and group.built.path.is_file() and not group.kept
    assert not results.interleaved_path.exists()

    group = measured_group(tmp_path / "b")
    bench.finish_group(group, results, "r2", left_s=100.0)
    (record,) = [json.loads(line) for line in results.interleaved_path.read_text().splitlines()]
    assert record["key"] == "odd_mlp|4|inference" and record["run"] == "r2" and record["rounds"] == 3
    assert record["policies"] == ["fp32", "amp"] and all(len(b) == 3 for b in record["ms_blocks"].values())
    assert all(v > 0 for v in record["ms"].values()) and not group.kept


@pytest.mark.slow
def test_budget_stops_cleanly_and_next_run_continues(tmp_path, capsys):
    """With no budget left a run still finishes one item, records it and says what is left."""
    out = tmp_path / "raw"
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--out", str(out),
            "--policies", "fp32,fp32-notf32,campo", "--no-tc", "--budget-s", "0"]
    assert bench.main(args) == 0
    assert len((out / "cpu.jsonl").read_text().splitlines()) == 1
    assert "5 measurements left" in capsys.readouterr().out
    assert bench.main([*args[:-1], "60"]) == 0
    assert len((out / "cpu.jsonl").read_text().splitlines()) == 6


def _row(model, batch, mode, policy, ms, **extra):
    row = {"key": bench.make_key(model, batch, mode, policy), "model": model, "batch": batch, "mode": mode,
           "policy": policy, "status": "ok", "ms": ms, "throughput": batch * 1000.0 / ms}
    if mode == "inference":
        row.update(rel_err_max=1e-3)
    else:
        row.update(loss_first=2.0, loss_last=1.0)
    row.update(extra)
    return row


@pytest.mark.slow
def test_report_states_targets_met(tmp_path):
    """campo 1.25x amp in training, faster than every anchor and fp32, within tolerance: all met."""
    rows = []
    for model in ("resnet50", "bert"):
        rows += [_row(model, 32, "training", "fp32-notf32", 40), _row(model, 32, "training", "fp32", 30),
                 _row(model, 32, "training", "amp", 25), _row(model, 32, "training", "campo", 20),
                 _row(model, 32, "training", "torch-compile", 24)]
        rows += [_row(model, 1, "inference", "fp32-notf32", 3), _row(model, 1, "inference", "fp32", 2),
                 _row(model, 1, "inference", "amp", 2.5), _row(model, 1, "inference", "modelopt", 2.0),
                 _row(model, 1, "inference", "campo", 1.6)]
    targets = bench_report.evaluate_targets(rows)
    assert [t["met"] for t in targets] == [True] * len(targets)
    assert "geometric mean 1.250x over 2 models" in targets[0]["text"]
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench_report.main([str(raw)]) == 0
    text = (tmp_path / "h200.md").read_text()
    assert "**not met**" not in text and text.count("**met**") == len(targets)
    assert (tmp_path / "h200-throughput.png").is_file() and (tmp_path / "h200-speedup-over-amp.png").is_file()


def test_report_states_targets_not_met_and_why(tmp_path):
    """campo slower than fp32 and than ModelOpt, a loss off by 10 %: each target says not met, with numbers;
    an anchor outside tolerance is not the best anchor; a failed row is listed with its reason."""
    rows = [_row("gpt2", 8, "training", "fp32-notf32", 40), _row("gpt2", 8, "training", "fp32", 30),
            _row("gpt2", 8, "training", "amp", 35), _row("gpt2", 8, "training", "campo", 31, loss_last=1.1),
            _row("gpt2", 8, "inference", "fp32-notf32", 9), _row("gpt2", 8, "inference", "fp32", 8),
            _row("gpt2", 8, "inference", "amp", 13), _row("gpt2", 8, "inference", "modelopt", 7),
            _row("gpt2", 8, "inference", "ort-fp16", 1, rel_err_max=0.5),
            _row("gpt2", 8, "inference", "campo", 8.4),
            {"key": "gpt2|8|inference|occ-fp16", "model": "gpt2", "batch": 8, "mode": "inference",
             "policy": "occ-fp16", "status": "failed", "error": "ONNX Runtime rejected the model: Type Error"}]
    targets = {t["name"]: t for t in bench_report.evaluate_targets(rows)}
    amp = next(t for n, t in targets.items() if n.startswith("campo training throughput"))
    assert amp["met"] is False and "0.875x" not in amp["text"] and "1.129x" in amp["text"]
    best = next(t for n, t in targets.items() if "every model" in n and "(inference)" in n)
    assert best["met"] is False and "of modelopt" in best["text"]  # ort-fp16 is outside tolerance
    fp32 = next(t for n, t in targets.items() if "never slower" in n)
    assert fp32["met"] is False and "gpt2 b8 inference: 0.952x" in fp32["text"]
    acc = next(t for n, t in targets.items() if "accuracy" in n)
    assert acc["met"] is False and "gpt2 b8 training" in acc["text"]
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench_report.main([str(raw), "--no-plots"]) == 0
    text = (tmp_path / "h200.md").read_text()
    assert "**not met**" in text and "Type Error" in text and "outside tolerance" in text


def test_classify_node_by_step_graph_names():
    weights, state = ("fc0.weight", "a/b:0"), ("fc0.weight.momentum", "loss_scale")
    forward = {"fc0/MatMul", "fc0/Add"}
    expect = {
        ("fc0/MatMul", "MatMul"): "forward",
        ("fc0/MatMul_grad/MatMul_1", "MatMul"): "backward",
        ("loss/log_softmax", "LogSoftmax"): "loss",
        ("fc0.weight/squeeze", "Squeeze"): "update",
        ("fc0.weight/lr_v", "Mul"): "update",
        ("a/b:0/velocity", "Add"): "update",
        ("update/seed", "Reshape"): "update",
        ("fc0.weight/grad", "Mul"): "loss_scale",
        ("fc0.weight/grad.sum", "ReduceSum"): "loss_scale",
        ("loss_scale/grad_sum", "Sum"): "loss_scale",
        ("found_inf", "IsNaN"): "loss_scale",
        ("fc0.weight.momentum.updated", "Where"): "loss_scale",
        ("fc0/relu/cast_fp16", "Cast"): "cast",
        ("fc0/MatMul/pad_k", "Pad"): "pad",
        ("Memcpy_token_3", "MemcpyFromHost"): "memcpy",
    }
    for (name, op), part in expect.items():
        assert bench_measure.classify_node(name, op, forward=forward, weights=weights, state=state) == part, name


def _tiny_step(tmp_path, policy):
    import onnx

    import onnxcampo
    from onnxcampo.training import build_train_step

    forward = bench_models.odd_mlp_model(8, [16, 24, 24, 8])
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", lr=0.05)
    if policy != "fp32":
        step = onnxcampo.optimize(step, policy=policy).model
    path = tmp_path / f"step-{policy}.onnx"
    onnx.save(step, str(path))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 16)).astype(np.float32), "labels": rng.integers(0, 8, 8)}
    return forward, step, path, batch


def test_step_runner_computes_the_trainers_losses(tmp_path):
    from onnxcampo.training import Trainer, initial_weights

    forward, step, path, batch = _tiny_step(tmp_path, "fp32")
    weights = initial_weights(forward, step)
    # copies: on CPU the Trainer's OrtValues borrow (and update in place) the arrays it is given
    trainer = Trainer(step, weights={k: v.copy() for k, v in weights.items()}, provider="cpu")
    expected = [trainer.step(batch) for _ in range(4)]
    runner = bench_measure.StepRunner(path, weights=weights, batch=batch, provider="cpu")
    got = [runner() for _ in range(4)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_step_runner_reading_every_third_loss_queues_the_steps_between(tmp_path, monkeypatch):
    """read_every=3 on CUDA: steps queue on a StepQueue and a call returns the loss every third
    step (None between); the block's sync() waits; losses and state are the waited runner's.
    Forced on the CPU with a stand-in CUDA runtime (tests/training/test_queue.py): a wiring check."""
    from helpers import FakeRuntime

    from onnxcampo.training.queue import StepQueue

    forward, step, path, batch = _tiny_step(tmp_path, "fp32")
    from onnxcampo.training import initial_weights

    weights = initial_weights(forward, step)
    waited = bench_measure.StepRunner(path, weights={k: v.copy() for k, v in weights.items()}, batch=batch,
                                      provider="cpu")
    expected = [waited() for _ in range(7)]
    fake = FakeRuntime()
    monkeypatch.setattr(bench_measure, "make_queue",
                        lambda provider, queued, cuda_graph=True: None if queued is False else StepQueue(fake, device="cpu"))
    runner = bench_measure.StepRunner(path, weights=weights, batch=batch, provider="cpu", read_every=3)
    got = [runner() for _ in range(7)]
    assert [g is None for g in got] == [True, True, False, True, True, False, True]
    assert got[2] == pytest.approx(expected[2], rel=1e-6) and got[5] == pytest.approx(expected[5], rel=1e-6)
    syncs = fake.syncs()
    runner.sync()
    assert fake.syncs() == syncs + 1
    np.testing.assert_allclose(runner.losses, expected, rtol=1e-6)


@pytest.mark.slow
def test_breakdown_of_a_profiled_step(tmp_path):
    """An all-fp16 step graph (Casts, loss scaling) profiled on CPU: every part gets time, the
    parts add up to the total, and the node counts match the classified graph."""
    from onnxcampo.training import initial_weights

    forward, step, path, batch = _tiny_step(tmp_path, "fp16")
    runner = bench_measure.StepRunner(path, weights=initial_weights(forward, step), batch=batch, provider="cpu",
                                      profiling=True, optimization="disable",
                                      profile_prefix=str(tmp_path / "prof"))
    for _ in range(3):
        runner()
    result = bench_measure.breakdown(runner.session.end_profiling(), step, forward)
    assert result["steps"] == 2
    for part in ("forward", "loss", "backward", "update", "loss_scale", "cast"):
        assert result["per_step_us"][part] > 0, part
    assert result["per_step_us"]["memcpy"] == 0 and result["per_step_us"]["pad"] == 0
    assert sum(result["per_step_us"].values()) == pytest.approx(result["total_us"])
    assert result["nodes"]["forward"] == len([n for n in forward.graph.node if n.op_type != "Identity"]) or \
        result["nodes"]["forward"] <= len(forward.graph.node)


def test_output_error_keeps_the_rows_measures_and_adds_the_one_criterion():
    """rel_err_max / rel_err_mean (what bench_report judges) and output_error (relative L2, as
    --validate has it) come from onnxcampo.runtime.compare; a lost, reshaped or overflowing output
    fails the row."""
    from onnxcampo.runtime.compare import worst_error

    reference = {"y": np.array([1.0, -4.0, 2.0], np.float32), "ids": np.array([1, 2, 3, 4])}
    candidate = {"y": np.array([1.5, -4.0, 2.0], np.float16), "ids": np.array([1, 2, 3, 0])}
    row = bench_measure.output_error(reference, candidate)
    assert row == {"rel_err_max": pytest.approx(0.25), "rel_err_mean": pytest.approx(0.5 / 7.0),
                   "output_error": worst_error(reference, candidate), "accurate": False,
                   "criterion": "rel_l2=0.01,mismatch=0.01", "max_abs_err": pytest.approx(0.5),
                   "p99_rel_err": pytest.approx(0.49)}  # onnxcampo.accuracy's verdict and statistics too
    assert row["output_error"] == pytest.approx(0.25)  # the share of differing ids; y's L2 error is 0.11
    for broken, message in (({"y": candidate["y"]}, "missing"), ({**candidate, "y": np.ones(2, np.float32)}, "shape"),
                            ({**candidate, "y": np.array([1.0, np.inf, 2.0], np.float32)}, "non-finite")):
        with pytest.raises(bench_measure.MeasureError, match=message):
            bench_measure.output_error(reference, broken)


def test_tensor_core_rule():
    eligible = bench_measure.tensor_core_eligible
    assert eligible("MatMul", [{"float16": [7, 1000]}], [{"float16": [7, 1008]}]) is True
    assert eligible("MatMul", [{"float16": [8, 1001]}], [{"float16": [8, 1000]}]) is False
    assert eligible("MatMul", [{"float": [8, 1024]}], [{"float": [8, 1024]}]) is False
    assert eligible("Conv", [{"float16": [1, 3, 32, 32]}], [{"float16": [1, 64, 16, 16]}]) is False
    assert eligible("FusedConv", [{"float16": [1, 64, 32, 32]}], [{"float16": [1, 64, 16, 16]}]) is True


def test_report_writes_throughput_json(tmp_path):
    """h200.json next to h200.md: per model and mode the throughput per policy under underscore names
    (the rows' values), failed or non-finite rows absent, every batch kept, the largest batch with
    a measurement as the headline, rows outside tolerance kept but listed, units and versions stated."""
    rows = [_row("bert", 1, "inference", "fp32-notf32", 4), _row("bert", 1, "inference", "fp32", 2),
            _row("bert", 1, "inference", "campo", 1.5),
            _row("bert", 32, "inference", "fp32-notf32", 40), _row("bert", 32, "inference", "fp32", 20),
            _row("bert", 32, "inference", "occ-fp16", 12), _row("bert", 32, "inference", "ort-fp16", 11, rel_err_max=0.5),
            _row("bert", 32, "inference", "amp", 13), _row("bert", 32, "inference", "campo", 10),
            _row("bert", 32, "inference", "campo-nopad", 14), _row("bert", 32, "inference", "campo-nocost", 10.5),
            {**_row("bert", 32, "inference", "modelopt", 9), "status": "failed", "error": "x"},
            _row("bert", 32, "inference", "fp16", 9.5, throughput=float("nan")),
            _row("bert", 32, "training", "fp32-notf32", 80), _row("bert", 32, "training", "fp32", 60),
            _row("bert", 32, "training", "amp", 50), _row("bert", 32, "training", "campo", 40),
            _row("bert", 32, "training", "fp16", 35, loss_last=1.5),
            _row("bert", 32, "training", "torch-eager", 70, loss_last=1.7),
            _row("bert", 32, "training", "torch-compile", 45), _row("bert", 32, "training", "torch-eager-amp", 55),
            {**_row("bert", 32, "training", "torch-compile-amp", 30), "status": "failed", "error": "y"},
            # a corpus model with a fixed batch dim: every policy fails at the large batch
            _row("ppocr_cls", 1, "inference", "fp32-notf32", 1), _row("ppocr_cls", 1, "inference", "campo", 0.5),
            {**_row("ppocr_cls", 64, "inference", "campo", 1), "status": "unavailable", "error": "fixed batch"},
            # a batch where every variant crashed: its targets are "not measurable", not dropped
            {**_row("magika", 256, "inference", "campo", 1), "status": "failed", "error": "out of memory"},
            {**_row("magika", 256, "inference", "fp32", 1), "status": "failed", "error": "out of memory"}]
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"run": "r1", "start": "2026-11-30T11:00:00+00:00", "end": "2026-11-30T11:08:00+00:00", "provider": "cuda",
           "command": "bench.py --out docs/benchmarks/raw",
           "versions": {"gpu": "NVIDIA H200", "onnxruntime-gpu": "1.31.1", "onnxruntime (imported)": "1.31.1 /tmp/x"}}
    (raw / "h200.runs.jsonl").write_text(json.dumps(run) + "\n")
    assert bench_report.main([str(raw), "--no-plots"]) == 0
    text = (tmp_path / "h200.json").read_text()
    doc = json.loads(text)
    assert "NaN" not in text and not list(tmp_path.glob(".*.tmp"))
    meta = doc["meta"]
    assert "samples per second" in meta["units"] and meta["higher_is_better"] is True
    assert (meta["device"], meta["onnxruntime"], meta["commands"]) == ("NVIDIA H200", "1.31.1", [run["command"]])

    bert = doc["models"]["bert"]
    by_key = {r["key"]: r for r in rows}
    assert set(bert) >= {"inference", "training", "batch", "batches"}
    assert bert["batch"] == {"inference": 32, "training": 32}
    inference, training = bert["inference"], bert["training"]
    assert list(inference) == ["fp32", "fp32_notf32", "occ_fp16", "ort_fp16", "amp", "campo", "campo_nopad",
                               "campo_nocost"]  # modelopt failed, fp16 has a NaN throughput: absent
    assert set(training) == {"fp32_notf32", "fp32", "amp", "fp16", "campo", "torch_eager", "torch_compile",
                             "torch_eager_amp"}  # torch-compile-amp failed
    assert all("-" not in k for k in [*inference, *training])
    for mode, entry in (("inference", inference), ("training", training)):
        for name, value in entry.items():
            assert value == by_key[f"bert|32|{mode}|{name.replace('_', '-')}"]["throughput"]
    assert inference["campo"] == pytest.approx(3200.0)
    assert bert["inaccurate"] == {"inference": ["ort_fp16"], "training": ["fp16"]}  # torch-eager not judged
    assert bert["unchecked"] == {"inference": [], "training": []}
    assert list(bert["batches"]["inference"]) == ["1", "32"] and list(bert["batches"]["training"]) == ["32"]
    assert bert["batches"]["inference"]["1"]["throughput"] == {
        "fp32": by_key["bert|1|inference|fp32"]["throughput"],
        "fp32_notf32": by_key["bert|1|inference|fp32-notf32"]["throughput"],
        "campo": by_key["bert|1|inference|campo"]["throughput"]}
    assert bert["batches"]["inference"]["32"]["throughput"] == inference

    cls = doc["models"]["ppocr_cls"]
    assert cls["batch"] == {"inference": 1, "training": None} and cls["training"] == {}
    assert cls["inference"] == {"fp32_notf32": 1000.0, "campo": 2000.0}
    assert cls["batches"]["inference"]["64"]["throughput"] == {}
    # in the markdown, a batch nothing ran at is a failure, not a row of dashes or "not measurable"
    markdown = (tmp_path / "h200.md").read_text()
    assert "ppocr_cls, batch 64" not in markdown and "ppocr_cls b64" not in markdown
    assert "| ppocr_cls|64|inference|campo | unavailable | fixed batch |" in markdown
    assert "magika b256 (campo failed or missing)" in markdown

    assert bench_report.main([str(raw), "--no-plots"]) == 0
    assert (tmp_path / "h200.json").read_text() == text  # deterministic


@pytest.mark.slow
def test_prepare_only_times_stages_and_records_no_results(tmp_path, capsys):
    """--prepare-only builds the step graph and each policy's graph and session, writes their stage
    times to <name>.prepare.jsonl, and leaves the results (and so the next real run's work) alone;
    the real run then reuses the cached step graph and optimized graphs."""
    out = tmp_path / "raw"
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "training", "--out", str(out),
            "--budget-s", "120", "--wheels", str(tmp_path / "none"), "--policies", "fp32,campo"]
    assert bench.main([*args, "--prepare-only"]) == 0
    assert not (out / "cpu.jsonl").exists()
    prepared = {r["key"]: r for r in bench.read_rows(out / "cpu.prepare.jsonl")}
    fp32, campo = prepared["odd_mlp|4|training|fp32"], prepared["odd_mlp|4|training|campo"]
    assert fp32["status"] == campo["status"] == "ok" and "ms" not in campo
    assert {"model", "step_graph", "convert", "session"} <= set(fp32["stage_s"])
    assert "model" not in campo["stage_s"] and campo["stage_s"]["convert"] >= 0 and "casts" in campo
    assert "prepared:" in capsys.readouterr().out
    assert bench.main(args) == 0
    rows = {r["key"]: r for r in bench.read_rows(out / "cpu.jsonl")}
    assert rows["odd_mlp|4|training|campo"]["cached"] is True and rows["odd_mlp|4|training|fp32"]["step_build_s"] is None
    assert {"session", "measure", "breakdown"} <= set(rows["odd_mlp|4|training|campo"]["stage_s"])


def _softmax_classifier(written_out: bool):
    """x[2, 4] -> MatMul -> Softmax (or Exp(x - max) / sum, as jax2tf writes it) -> probabilities."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "w")
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["logits"])]
    if written_out:
        nodes += [helper.make_node("ReduceMax", ["logits", "axes"], ["max"]),
                  helper.make_node("Sub", ["logits", "max"], ["shifted"]),
                  helper.make_node("Exp", ["shifted"], ["exp"]),
                  helper.make_node("ReduceSum", ["exp", "axes"], ["sum"]),
                  helper.make_node("Div", ["exp", "sum"], ["probs"])]
    else:
        nodes.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=-1))
    graph = helper.make_graph(nodes, "cls", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [2, 3])], [w, axes])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("written_out", [False, True])
def test_corpus_classifiers_train_on_logits(written_out):
    """A model ending in a softmax is trained on the softmax's input: cross-entropy on probabilities
    would keep the loss at log(classes). The cut model computes the logits, nothing else."""
    import onnx
    import onnxruntime as ort

    model = _softmax_classifier(written_out)
    cut = bench_models.logits_before_softmax(model)
    assert cut == ("Exp/ReduceSum/Div softmax" if written_out else "Softmax")
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node] == ["MatMul"] and [t.name for t in model.graph.initializer] == ["w"]
    assert model.graph.output[0].name == "logits"
    x = np.ones((2, 4), np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ (np.arange(12, dtype=np.float32).reshape(4, 3) / 10), rtol=1e-6)
    plain = bench_models.odd_mlp_model(2, [4, 3])
    assert bench_models.logits_before_softmax(plain) is None and plain.graph.output[0].name == "logits"


def _convertible_classifier(op: str = "GlobalMaxPool"):
    """x[2, 4, 5, 5] -> grouped Conv -> Relu -> 1x1 Conv -> ``op`` (a global pool) -> Flatten ->
    MatMul with a Constant-node weight (a Paddle export's) -> Add -> logits[2, 3]; IR 10, opset 17."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    tensor = lambda name, *shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)  # noqa: E731
    nodes = [
        helper.make_node("Conv", ["x", "grouped.w", "grouped.b"], ["g"], group=2, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["g"], ["r"]),
        helper.make_node("Conv", ["r", "point.w"], ["p"], kernel_shape=[1, 1]),
        helper.make_node(op, ["p"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Constant", [], ["fc.w"], value=tensor("fc.w", 6, 3)),
        helper.make_node("MatMul", ["flat", "fc.w"], ["mm"]),
        helper.make_node("Add", ["mm", "fc.b"], ["logits"]),
    ]
    graph = helper.make_graph(nodes, "convertible", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 5, 5])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])],
                              [tensor("grouped.w", 4, 2, 3, 3), tensor("grouped.b", 4), tensor("point.w", 6, 4, 1, 1),
                               tensor("fc.b", 3)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def _twin_of(model, tmp_path):
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4, 5, 5)).astype(np.float32)}
    labels = np.array([0, 2], np.int64)
    return path, feeds, labels, bench_models.onnx_twin(path, feeds, labels)


def test_onnx_twin_without_onnx2torch_is_unavailable(tmp_path, monkeypatch):
    """No onnx2torch (or no torch): the twin of an ONNX-only model is 'unavailable' with the reason."""
    monkeypatch.setitem(sys.modules, "onnx2torch", None)  # import onnx2torch raises ModuleNotFoundError
    *_, make = _twin_of(_convertible_classifier(), tmp_path)
    with pytest.raises(bench_policies.Unavailable, match="onnx2torch not installed"):
        make()


def test_onnx_twin_computes_the_onnx_model_and_trains_the_step_graphs_weights(tmp_path):
    """onnx2torch's module, called with the ONNX inputs by name, gives ORT's logits; it trains the
    weights the step graph trains (the Constant-node MatMul weight and the Add bias, which
    onnx2torch keeps as buffers, included; the grouped Conv's weight frozen), and its first loss
    is the cross-entropy of ORT's logits. An op onnx2torch cannot convert is named."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx2torch")
    import onnxruntime as ort

    from onnxcampo.benchmarks import torch_twins as bench_torch

    path, feeds, labels, make = _twin_of(_convertible_classifier(), tmp_path)
    module, inputs, torch_labels = make()
    with torch.no_grad():
        got = module.eval()(**inputs).numpy()
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    trained = sorted(tuple(p.shape) for p in module.parameters() if p.requires_grad)
    assert trained == [(3,), (4,), (6, 3), (6, 4, 1, 1)]  # fc.b, grouped.b, fc.w, point.w
    assert [tuple(p.shape) for p in module.parameters() if not p.requires_grad] == [(4, 2, 3, 3)]
    built = bench_models.Built("convertible", 2, path, feeds, labels, make)
    row = bench_torch.train(built, "torch-eager", provider="cpu", warmup=1, blocks=1, per_block=2)
    loss = torch.nn.functional.cross_entropy(torch.from_numpy(ref), torch_labels)
    assert row["loss_first"] == pytest.approx(float(loss), rel=1e-5) and row["loss_last"] < row["loss_first"]
    *_, make = _twin_of(_convertible_classifier("GlobalLpPool"), tmp_path)
    with pytest.raises(bench_policies.Unavailable, match=r"cannot convert GlobalLpPool \(opset 17\): it has no converter"):
        make()


def _computed_shapes_model():
    """x[2, 4, 6] -> Reshape to Concat(Gather(Shape(x), [0]), [1, -1]) -> Squeeze(axes [1]) ->
    Slice(20:4:-2 on axis 1) -> MatMul w[8, 3] -> Add Expand(b[3], Shape(mm)) -> logits[2, 3]:
    every shape, axis and bound a tensor, as exporters write them; IR 10, opset 17."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    ints = lambda name, *values: numpy_helper.from_array(np.array(values, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["x.shape"]),
        helper.make_node("Gather", ["x.shape", "first"], ["batch"], axis=0),
        helper.make_node("Concat", ["batch", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Squeeze", ["flat", "axis1"], ["rows"]),
        helper.make_node("Slice", ["rows", "start", "end", "axis1", "step"], ["part"]),
        helper.make_node("MatMul", ["part", "w"], ["mm"]),
        helper.make_node("Shape", ["mm"], ["mm.shape"]),
        helper.make_node("Expand", ["b", "mm.shape"], ["bias"]),
        helper.make_node("Add", ["mm", "bias"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes, "computed_shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3])],
        [ints("first", 0), ints("rest", 1, -1), ints("axis1", 1), ints("start", 20), ints("end", 4), ints("step", -2),
         numpy_helper.from_array(rng.standard_normal((8, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model


def test_onnx_twin_fixes_computed_shapes_so_dynamo_traces_it(tmp_path, monkeypatch):
    """onnx2torch's Reshape, Expand, Squeeze and Slice read shapes from tensors, which dynamo cannot
    trace; the twin has them as Python ints (the shape subgraph gone), computes exactly what the
    converted module computed, trains the same parameters, and compiles as one graph."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx2torch")
    import onnx
    import onnxruntime as ort

    path = tmp_path / "model.onnx"
    onnx.save(_computed_shapes_model(), str(path))
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 4, 6)).astype(np.float32)}
    make = bench_models.onnx_twin(path, feeds, np.array([0, 2], np.int64))
    module, inputs, _ = make()
    kinds = {type(m).__name__ for m in module.modules()}
    assert not kinds & {"OnnxShape", "OnnxReshape", "OnnxExpand", "OnnxSqueezeDynamicAxes", "OnnxSlice"}, kinds
    with monkeypatch.context() as patch:
        patch.setattr(bench_models, "fixed_shapes", lambda *args: None)
        converted, *_ = make()
    with torch.no_grad():
        got, before = module.eval()(**inputs), converted.eval()(**inputs)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(got.numpy() - ref).max() <= 1e-5 * np.abs(ref).max()
    assert torch.equal(got, before)
    assert [(n, p.shape) for n, p in module.named_parameters()] == [(n, p.shape) for n, p in converted.named_parameters()]
    assert sorted(tuple(p.shape) for p in module.parameters()) == [(3,), (8, 3)]
    compiled = torch.compile(module, fullgraph=True)  # inductor: ~7 s on 2 CPU cores, the first time
    assert np.abs(compiled(**inputs).detach().numpy() - got.numpy()).max() <= 1e-5 * np.abs(ref).max()


def test_cuda_graph_policies_are_unavailable_off_cuda(tmp_path):
    """campo-graph replays the step graph campo planned for the replay as a CUDA graph, fp32-graph
    the fp32 one: on the CPU it is a recorded 'unavailable' row with the reason, not a crash or a
    silent fp32 measurement."""
    assert bench_policies.graph_base("campo-graph") == "campo-graph"  # optimize(execution="cuda-graph")
    assert bench_policies.graph_base("fp32-graph") == "fp32" and bench_policies.graph_base("fp32") == "fp32"
    out = tmp_path / "raw"
    assert bench.main(["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "training", "--out", str(out),
                       "--budget-s", "60", "--wheels", str(tmp_path / "none"), "--policies", "campo-graph"]) == 0
    (row,) = bench.read_rows(out / "cpu.jsonl")
    assert (row["key"], row["status"]) == ("odd_mlp|4|training|campo-graph", "unavailable")
    assert "CUDA graphs need the CUDA execution provider" in row["error"]


def test_redo_measures_matching_older_rows_again():
    rows = [{"key": "a|1|inference|campo", "status": "ok", "time": "2026-11-30T11:00:00+00:00"},
            {"key": "a|1|inference|fp32", "status": "ok", "time": "2026-11-30T11:00:00+00:00"},
            {"key": "b|1|inference|campo-nopad", "status": "failed", "time": "2026-11-30T15:00:00+00:00"}]
    assert bench.done_keys(rows) == {r["key"] for r in rows}
    assert bench.done_keys(rows, redo="*|campo*", redo_before="2026-11-30T14:00") == {"a|1|inference|fp32",
                                                                                     "b|1|inference|campo-nopad"}
    assert bench.done_keys(rows, retry_failed=True, redo="*|campo*", redo_before="2026-11-30T14:00") == {
        "a|1|inference|fp32"}


def test_report_compares_cuda_graph_replays():
    rows = [_row("m", 8, "training", "fp32-notf32", 20), _row("m", 8, "training", "fp32", 10),
            _row("m", 8, "training", "amp", 9), _row("m", 8, "training", "campo", 8),
            _row("m", 8, "training", "fp32-graph", 7), _row("m", 8, "training", "campo-graph", 6),
            _row("m", 8, "training", "torch-compile", 5),
            _row("n", 8, "training", "amp", 4), _row("n", 8, "training", "campo", 4),  # no replay: no line
            _row("m", 1, "inference", "fp32-notf32", 2), _row("m", 1, "inference", "fp32", 1),
            _row("m", 1, "inference", "campo", 1), _row("m", 1, "inference", "campo-graph", 0.5)]
    lines = bench_report.cuda_graph_comparison(rows)
    assert not any("| n |" in line for line in lines)
    train = next(line for line in lines if line.startswith("| m | training | 8 |"))
    assert "| torch-compile 5.00 | 1.50x | 1.33x | 0.83x |" in train  # 9/6, 8/6, 5/6
    infer = next(line for line in lines if line.startswith("| m | inference | 1 |"))
    assert infer.endswith("| fp32 1.00 | – | 2.00x | 2.00x |")  # no amp row
    assert lines[-1] == ("Geometric means (inference: campo-graph / campo 2.000x over 1, campo-graph / best anchor "
                         "2.000x over 1; training: campo-graph / amp 1.500x over 1, campo-graph / campo 1.333x over 1, "
                         "campo-graph / best anchor 0.833x over 1).")
    assert bench_report.cuda_graph_comparison(rows[7:9]) == ["Nothing was replayed as a CUDA graph yet."]


@pytest.mark.slow
def test_sessions_time_each_variant_in_several_sessions(tmp_path):
    """--sessions 2: every ONNX row holds the per-session medians and the blocks of both sessions."""
    out = tmp_path / "raw"
    assert bench.main(["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "all", "--out", str(out),
                       "--budget-s", "120", "--wheels", str(tmp_path / "none"), "--policies", "fp32-notf32,campo",
                       "--sessions", "2", "--no-tc", "--breakdown-policies", ""]) == 0
    rows = [r for r in bench.read_rows(out / "cpu.jsonl") if r["status"] == "ok"]
    assert {r["mode"] for r in rows} == {"inference", "training"} and len(rows) >= 4
    for row in rows:  # quick settings: five blocks per session in either mode
        assert len(row["ms_sessions"]) == 2 and len(row["ms_blocks"]) == 2 * 5
    assert bench.main(["--out", str(out), "--sessions", "0", "--provider", "cpu", "--quick"]) == 2


@pytest.mark.slow
def test_campo_tune_times_the_candidates_on_the_benchmark_inputs(tmp_path):
    """campo-tune: optimize(..., tune=<the benchmark's provider>) on the benchmark's feeds (a step
    graph: its batch); the row keeps the measured candidates and the plan kept."""
    out = tmp_path / "raw"
    assert bench.main(["--quick", "--provider", "cpu", "--models", "odd_mlp", "--out", str(out), "--no-tc",
                       "--budget-s", "120", "--wheels", str(tmp_path / "none"), "--policies", "campo-tune"]) == 0
    rows = {r["key"]: r for r in bench.read_rows(out / "cpu.jsonl")}
    assert set(rows) == {"odd_mlp|1|inference|campo-tune", "odd_mlp|4|inference|campo-tune",
                         "odd_mlp|4|training|campo-tune"}
    for row in rows.values():
        assert row["status"] == "ok", row.get("error")
        tuning = row["tuning"]
        assert tuning["provider"] == "cpu" and row["chosen_plan"] == tuning["chosen"]
        assert "ms" in tuning["candidates"]["fp32"] and tuning["chosen"] in tuning["candidates"]
    assert np.isfinite(rows["odd_mlp|4|training|campo-tune"]["tuning"]["candidates"]["fp32"]["loss"])
    assert all(row["fp32_ms_paired"] > 0 for row in rows.values())  # fp32 timed in the same run


def test_campo_against_fp32_same_graph_paired_or_rows():
    """A campo row that kept every node fp32 and padded nothing is the fp32 graph (1.0 whatever two
    runs measured); one with fp32 timed in the same run compares with that; else the two rows."""
    def group(**campo):
        return {"fp32": _row("m", 1, "inference", "fp32", 1.0), "campo": _row("m", 1, "inference", "campo", 1.25, **campo)}

    assert bench_report.vs_fp32(group(nodes_fp16=0, pads_inserted=0)) == (1.0, "same graph")
    assert bench_report.vs_fp32(group(nodes_fp16=3, fp32_ms_paired=1.5)) == (pytest.approx(1.2), "paired")
    assert bench_report.vs_fp32(group(nodes_fp16=3)) == (pytest.approx(0.8), "")
    assert bench_report.vs_fp32({"fp32": _row("m", 1, "inference", "fp32", 1.0)}) == (None, "")
    rows = [*group(nodes_fp16=0).values(), _row("n", 1, "inference", "fp32", 1.0),
            _row("n", 1, "inference", "campo", 1.25, nodes_fp16=3, fp32_ms_paired=1.5)]
    target = next(t for t in bench_report.evaluate_targets(rows) if "never slower" in t["name"])
    assert target["met"] is True
    assert "the fp32 graph itself (no fp16 node, no pad): m b1 inference (measured 0.80x in another run)" in target["text"]
    assert "1 of 1 compared with fp32 timed in the same run" in target["text"]


def test_training_accuracy_is_a_share_of_the_loss_decrease_widened_by_fp32s_spread():
    ref = _row("m", 8, "training", "fp32-notf32", 10, loss_first=10.0, loss_last=0.001)
    near_zero = _row("m", 8, "training", "campo", 10, loss_first=10.0, loss_last=0.0015)
    group = {"fp32-notf32": ref, "campo": near_zero}
    assert bench_report.accuracy(near_zero, group) == pytest.approx(0.0005 / 9.999)  # not 50 % of the loss
    assert bench_report.accurate(near_zero, group)
    ref = _row("m", 8, "training", "fp32-notf32", 10, loss_first=14.0, loss_last=9.0)
    campo = _row("m", 8, "training", "campo", 10, loss_first=14.0, loss_last=9.5)  # 10 % of the decrease
    group = {"fp32-notf32": ref, "campo": campo}
    assert not bench_report.accurate(campo, group)
    group["fp32"] = _row("m", 8, "training", "fp32", 10, loss_first=14.0, loss_last=9.6)  # fp32 itself: 12 %
    assert bench_report.tolerance(campo, group) == pytest.approx(0.12) and bench_report.accurate(campo, group)


def test_a_model_that_cannot_take_the_batch_is_unavailable_not_failed(tmp_path, monkeypatch):
    """A corpus model whose batch dim is fixed cannot run the large batch: its items are
    'unavailable' rows with the reason (built once), not failures."""
    calls = []

    def build(batch, *, training=False, quick=False):
        calls.append(batch)
        raise bench_policies.Unavailable("corpus model fixed: its batch dim is fixed; no input has a dynamic one to set to 4")

    spec = bench_models.ModelSpec("fixed", (1,), None, build)
    monkeypatch.setitem(bench_models.MODELS, "fixed", spec)
    out = tmp_path / "raw"
    assert bench.main(["--quick", "--provider", "cpu", "--models", "fixed", "--mode", "inference", "--out", str(out),
                       "--budget-s", "60", "--wheels", str(tmp_path / "none"), "--policies", "fp32,campo"]) == 0
    rows = bench.read_rows(out / "cpu.jsonl")
    assert {r["status"] for r in rows} == {"unavailable"} and len(rows) == 4  # quick batches 1 and 4, two policies
    assert all("batch dim is fixed" in r["error"] for r in rows)
    assert calls == [1, 4]  # once per group


def test_report_prefers_interleaved_timings_of_the_same_run(tmp_path):
    """A group's interleaved record replaces the ms (and throughput) of its rows only when it covers
    the whole group (every ok row from the record's run and in it): no group mixes the methods; a
    campo row's paired fp32 gives way to the interleaved fp32."""
    def row(policy, ms, run="r1", **extra):
        return {"key": f"gpt2|1|inference|{policy}", "model": "gpt2", "batch": 1, "mode": "inference", "policy": policy,
                "status": "ok", "ms": ms, "throughput": 1000.0 / ms, "run": run, "rel_err_max": 0.001, **extra}

    records = [{"key": "gpt2|1|inference", "run": "r1", "rounds": 7,
                "ms": {"fp32-notf32": 3.2, "fp32": 2.5, "campo": 2.0, "ort-fp16": 1.0}},
               {"key": "bert|1|inference", "run": "r1", "rounds": 7, "ms": {"fp32": 1.0, "campo": 0.5}}]
    path = tmp_path / "h200.interleaved.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" + '{"key": "x|1|inference", "status": "failed"}\n{torn')
    read = bench_report.read_interleaved(path)
    assert sorted(r["key"] for r in read) == ["bert|1|inference", "gpt2|1|inference"]

    partial = [row("fp32-notf32", 3.3), row("fp32", 2.9), row("ort-fp16", 2.1, run="r0"),
               row("campo", 3.5, fp32_ms_paired=3.0), row("amp", 9.0, run="r1", status="failed")]
    assert bench_report.apply_interleaved(partial, read) == []  # ort-fp16 came from another run
    assert all("interleaved" not in r and r.get("ms") in (3.3, 2.9, 2.1, 3.5, 9.0) for r in partial)

    whole = [row("fp32-notf32", 3.3), row("fp32", 2.9), row("ort-fp16", 2.1), row("campo", 3.5, fp32_ms_paired=3.0),
             row("amp", 9.0, run="r0", status="failed")]  # a failed row does not count
    # the ratios come from the rotation, the level from fp32's own row (2.9 ms; 2.5 side by side)
    assert bench_report.apply_interleaved(whole, read) == [
        "gpt2 b1 (4 variants, 7 rounds; side by side, fp32 ran 0.86x its own row)"]
    by = {r["policy"]: r for r in whole}
    scale = 2.9 / 2.5
    assert by["fp32"]["ms"] == pytest.approx(2.9) and by["campo"]["ms"] == pytest.approx(2.0 * scale)
    assert by["campo"]["ms_row"] == 3.5 and by["campo"]["throughput"] == pytest.approx(1000 / (2.0 * scale))
    assert "fp32_ms_paired" not in by["campo"] and by["campo"]["fp32_ms_paired_row"] == 3.0
    assert by["ort-fp16"]["ms"] == pytest.approx(scale) and by["amp"]["ms"] == 9.0 and "interleaved" not in by["amp"]
    group = bench_report.group_rows(whole)[("gpt2", 1, "inference")]
    assert bench_report.vs_fp32(group)[0] == pytest.approx(2.5 / 2.0) and bench_report.vs_fp32(group)[1] == "interleaved"
    assert bench_report._batch_entry(group, "inference")["interleaved"] is True
    text = bench_report.render(whole, [], [], "raw/h200.jsonl", ["gpt2 b1 (4 variants, 7 rounds)"])
    assert "Interleaved groups: the inference variants of gpt2 b1 (4 variants, 7 rounds)" in text
    assert "scaled so that fp32 keeps its own row's time" in text


@pytest.mark.slow
def test_an_item_killed_twice_is_recorded_and_shown(tmp_path, capsys):
    """Two attempts with a full run ahead and no row since: the item is recorded as failed without
    being started, and the run says so (not only "everything is done")."""
    out = tmp_path / "raw"
    out.mkdir()
    attempts = [{"key": "odd_mlp|1|inference|fp32", "run": r, "left_s": 500.0, "time": f"2026-11-30T1{i}:00:00+00:00"}
                for i, r in enumerate(("k1", "k2"))]
    (out / "cpu.attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--policies", "fp32",
            "--out", str(out), "--budget-s", "120", "--wheels", str(tmp_path / "none"), "--interleave", "0"]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "odd_mlp|1|inference|fp32" in printed and "did not finish in 2 runs" in printed
    rows = {r["key"]: r for r in bench.read_rows(out / "cpu.jsonl")}
    assert rows["odd_mlp|1|inference|fp32"]["status"] == "failed" and rows["odd_mlp|4|inference|fp32"]["status"] == "ok"


def test_gpu_kernels_are_split_by_class_and_reported():
    """CUPTI kernel names (ORT's, cuBLAS's, cuDNN's, ours) go to their classes; the split sums to the
    total; the report shows it per training row and in the 'slower than PyTorch' sentence."""
    kernels = [("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nchw", 4.0, 53.0),
               ("nvjet_tst_128x64_64x4_1x2_h_bz_NNT", 3.0, 60.0),
               ("void onnxruntime::cuda::_UnaryElementWise<__half, float, onnxruntime::cuda::OP_Cast<__half, float> >", 1.5, 200.0),
               ("void onnxruntime::cuda::_SliceKernel<false, 4, float>", 1.0, 400.0),
               ("void onnxcampo::(anonymous namespace)::SgdKernel(onnxcampo::Table<5>)", 0.5, 2.0),
               ("void onnxruntime::cuda::Transpose3DKernel<float>", 0.25, 10.0),
               ("Memset (Device)", 0.1, 5.0), ("mystery_kernel", 0.05, 1.0)]
    assert [bench_measure.kernel_class(k[0]) for k in kernels] == [
        "conv", "gemm", "cast", "copy", "update", "transpose", "memset", "other"]
    split = bench_measure.gpu_split(kernels, top=3)
    assert split["total_ms"] == pytest.approx(10.4) and sum(split["by_class_ms"].values()) == pytest.approx(10.4)
    assert list(split["by_class_ms"])[:2] == ["conv", "gemm"] and len(split["top"]) == 3
    assert split["launches"]["copy"] == 400.0
    row = {"key": "resnet50|64|training|campo", "model": "resnet50", "batch": 64, "mode": "training", "policy": "campo",
           "status": "ok", "ms": 40.0, "gpu": split}
    table = bench_report.gpu_table([row])
    # columns in KERNEL_CLASSES order: cast, update, softmax, norm, pool, reduce, conv, gemm, transpose, copy, ...
    assert table[2].startswith("| resnet50 b64 | campo | 40.00 | 10.40 | 1.50 | 0.50 | – | – | – | – | 4.00 | 3.00 |")
    best = {"ms": 15.0}
    text = bench_report._where_time_goes(("resnet50", 64, "training"), row, "torch-compile", best)
    assert "GPU kernels (CUPTI, the step as run: 10.40 ms): conv 4.00, gemm 3.00" in text
    assert "No profile" not in text
    assert bench_measure.cupti_kernels(lambda: None, 1) is None  # no torch (CI) or no CUDA here


@pytest.mark.slow
def test_probe_options_times_each_policy_under_each_option_set(tmp_path, capsys):
    """probe-options (benchmarks/probe_options.py): every (policy, option set) pair of both modes timed and kept as
    JSON, ratios to the first set; a bad --options argument is one line and exit 2."""
    from onnxcampo.benchmarks import probe_options

    out = tmp_path / "probe.json"
    args = ["--model", "odd_mlp", "--batch", "4", "--mode", "inference,training", "--policies", "fp32,campo",
            "--options", "{}", '{"prefer_nhwc": 1}', "--provider", "cpu", "--quick", "--sessions", "2",
            "--wheels", str(tmp_path / "none"), "--out", str(out)]
    assert probe_options.main(args) == 0
    result = json.loads(out.read_text())
    assert result["options"] == ["default", "prefer_nhwc=1"]
    for mode in ("inference", "training"):
        for policy in ("fp32", "campo"):
            cells = result["modes"][mode][policy]
            assert cells["default"]["vs_first"] == 1.0 and cells["prefer_nhwc=1"]["ms"] > 0
            assert len(cells["default"]["ms_blocks"]) == 2 * 5  # two sessions of five quick blocks
    printed = capsys.readouterr().out
    assert "ignores CUDA EP options" in printed
    assert "    session 2/2 prefer_nhwc=1: " in printed and "  campo: built (" in printed  # progress as it goes
    threads = '{"session.intra_op_num_threads": "1", "session.intra_op.allow_spinning": "0"}'
    assert probe_options.main([threads if a == '{"prefer_nhwc": 1}' else a for a in args]) == 0  # they apply on CPU too
    cells = json.loads(out.read_text())["modes"]["inference"]["fp32"]
    assert cells["session.intra_op_num_threads=1,session.intra_op.allow_spinning=0"]["ms"] > 0
    cuda_options, session_config = probe_options._split(
        {"prefer_nhwc": "1", "session.intra_op_num_threads": "1", "session.enable_mem_pattern": "0"}, "cpu")
    assert cuda_options is None
    from onnxcampo.runtime import make_session

    session = make_session(bench_models.MODELS["odd_mlp"].build(4, quick=True).path, provider="cpu",
                           session_config=session_config)
    assert session.get_session_options().intra_op_num_threads == 1
    assert session.get_session_options().enable_mem_pattern is False
    assert probe_options.main(args[:-2] + ["--options", "[1]"]) == 2
    assert "not a JSON object" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_options_keeps_what_it_measured_when_cut_short(tmp_path, monkeypatch):
    """--out is rewritten after each policy: a run killed during the second keeps the first."""
    from onnxcampo.benchmarks import probe_options

    real = probe_options._timer

    def timer(group, policy, path, options):
        if policy == "campo":
            raise KeyboardInterrupt  # the device run's time limit, as far as this process can tell
        return real(group, policy, path, options)

    monkeypatch.setattr(probe_options, "_timer", timer)
    out = tmp_path / "probe.json"
    with pytest.raises(KeyboardInterrupt):
        probe_options.main(["--model", "odd_mlp", "--batch", "4", "--policies", "fp32,campo", "--provider", "cpu",
                            "--quick", "--sessions", "1", "--wheels", str(tmp_path / "none"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert list(result["modes"]["inference"]) == ["fp32"] and result["modes"]["inference"]["fp32"]["default"]["ms"] > 0
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.slow
def test_interleaved_groups_are_started_whole_and_timed_on_their_own_time(tmp_path, monkeypatch, capsys):
    """The interleaved timing runs before the next item's clock starts (its item_s stays its own);
    an inference group that will not fit with its interleaved timing is left whole for the next
    run; with --sessions 2 the round robin runs twice, with fresh sessions."""
    real = bench.interleave

    def slow(group):
        time.sleep(1.0)
        return real(group)

    monkeypatch.setattr(bench, "interleave", slow)
    out = tmp_path / "raw"
    base = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--policies", "fp32,amp",
            "--out", str(out), "--wheels", str(tmp_path / "none"), "--interleave", "3", "--sessions", "2"]
    assert bench.main(base + ["--budget-s", "120"]) == 0
    rows = {r["key"]: r for r in bench.read_rows(out / "cpu.jsonl")}
    assert rows["odd_mlp|4|inference|fp32"]["item_s"] < 1.0  # b1's interleaved second is not b4's
    records = [json.loads(line) for line in (out / "cpu.interleaved.jsonl").read_text().splitlines()]
    assert [r["key"] for r in records] == ["odd_mlp|1|inference", "odd_mlp|4|inference"]
    assert all(r["sessions"] == 2 and len(r["ms_blocks"]["amp"]) == 2 * 3 for r in records)

    capsys.readouterr()
    fresh = tmp_path / "raw2"
    args = [a if a != str(out) else str(fresh) for a in base]
    assert bench.main(args + ["--budget-s", "12"]) == 0  # b1 fits (the first group always starts), b4 does not
    printed = capsys.readouterr().out
    assert "may take" in printed and "odd_mlp|4|inference|fp32" in printed
    keys = {r["key"] for r in bench.read_rows(fresh / "cpu.jsonl")}
    assert keys == {"odd_mlp|1|inference|fp32", "odd_mlp|1|inference|amp"}


@pytest.mark.slow
def test_no_interleaved_timing_for_a_group_with_rows_of_other_runs(tmp_path, capsys):
    """Re-measuring part of a group (its other rows are from earlier runs) records no interleaved
    timing: the report could not use it."""
    out = tmp_path / "raw"
    base = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--out", str(out),
            "--wheels", str(tmp_path / "none"), "--interleave", "2", "--budget-s", "120"]
    assert bench.main(base + ["--policies", "fp32,amp"]) == 0
    assert len((out / "cpu.interleaved.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    assert bench.main(base + ["--policies", "fp32,amp,campo,campo-nocost"]) == 0
    assert "no interleaved timing (rows of other runs: amp, fp32)" in capsys.readouterr().out
    assert len((out / "cpu.interleaved.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_a_group_cut_by_the_budget_is_not_interleaved_and_dead_sessions_are_dropped(tmp_path, monkeypatch, capsys):
    """A run that stops inside an inference group times no part of it side by side (the report
    could not use it); in the interleaved timing a variant whose session fails is left out with
    its reason instead of failing the record."""
    real = bench.estimate_s
    monkeypatch.setattr(bench, "estimate_s", lambda item, rows, budget, **kw: 100.0 if item.policy == "campo"
                        else real(item, rows, budget, **kw))
    out = tmp_path / "raw"
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--policies", "fp32,amp,campo",
            "--out", str(out), "--wheels", str(tmp_path / "none"), "--interleave", "2", "--budget-s", "60"]
    assert bench.main(args) == 0
    printed = capsys.readouterr().out
    assert "no interleaved timing (the run stops inside the group)" in printed
    assert not (out / "cpu.interleaved.jsonl").exists()
    assert {r["key"] for r in bench.read_rows(out / "cpu.jsonl")} == {"odd_mlp|1|inference|fp32", "odd_mlp|1|inference|amp"}

    monkeypatch.setattr(bench, "estimate_s", real)
    settings = bench.Settings.make("cpu", True, False, (), interleave=2)
    (tmp_path / "w").mkdir()
    group = bench.Group("odd_mlp", 4, "inference", settings, tmp_path / "w")
    for policy in ("fp32", "amp"):
        bench.measure_inference(group, policy)
    group.kept["amp"].path.write_bytes(b"not onnx")
    record = bench.interleave(group)
    assert list(record["ms"]) == ["fp32"] and "amp" in record["dropped"]
    group.kept["fp32"] = bench.Kept(tmp_path / "missing.onnx", True, False, 5, 0.1)
    record = bench.interleave(group)  # no session at all: an empty record, not a ZeroDivisionError
    assert record["ms"] == {} and set(record["dropped"]) == {"fp32", "amp"}


@pytest.mark.slow
def test_campo_calib_variant_is_calibrated_on_the_benchmark_inputs(tmp_path):
    """campo-calib: campo with activation_limit=512 on the benchmark's feeds (inference only); its
    row records the calibration, and the report states its inference targets."""
    out = tmp_path / "raw"
    args = ["--quick", "--provider", "cpu", "--models", "odd_mlp", "--mode", "inference", "--policies",
            "fp32-notf32,fp32,amp,campo-calib", "--out", str(out), "--wheels", str(tmp_path / "none"), "--budget-s", "120"]
    assert bench.main(args) == 0
    rows = {r["key"]: r for r in bench.read_rows(out / "cpu.jsonl")}
    calib = rows["odd_mlp|4|inference|campo-calib"]
    assert calib["status"] == "ok" and calib["calibration"]["activation_limit"] == 512.0
    assert calib["calibration"]["inputs"] == "given" and calib["calibration"]["tensors"] > 0
    assert "fp32_ms_paired" in calib
    training = [i.key for i in bench.work_list(["odd_mlp"], None, ["training"], quick=True)]
    assert "odd_mlp|4|training|campo" in training and "odd_mlp|4|training|campo-calib" not in training
    text = bench_report.render(list(rows.values()), [], [], "raw/cpu.jsonl")
    assert "The inference targets for `campo-calib`" in text
