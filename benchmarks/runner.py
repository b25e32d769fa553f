"""Benchmark suite: fp32, fp16, amp, campo and the anchors, inference and training, with accuracy.

One command, resumable, for runs of at most 10 minutes on the GPU machine::

    PYTHONPATH=/tmp/ortgpu:/tmp/oc:$PYTHONPATH python3 -P -m onnxcampo.benchmarks run --out docs/benchmarks/raw \\
        --budget-s 540 --corpus-dir .benchcorpus --mirror "$OUT"

Every finished measurement is appended as one JSON line to ``OUT/<name>.jsonl`` (key
``model|batch|mode|policy``); keys already there are skipped, so the same command is repeated
until it prints ``everything is done``. Before an item starts, a line goes to
``<name>.attempts.jsonl``; an item that was started twice with most of a run ahead of it and never
finished (the run was killed) is recorded as failed instead of being tried forever.
After an inference group, the variants measured in the run are timed again side by side
(``--interleave``: all sessions alive, one block each in rotation) into ``<name>.interleaved.jsonl``.
``docs/benchmarks/README.md`` says how to run it on the GPU machine; ``benchmarks/report.py``
turns the JSON lines into ``docs/benchmarks/h200.md`` and plots.

    python -m onnxcampo.benchmarks run --quick --provider cpu --models odd_mlp --out /tmp/b   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Callable
from typing import Any

from onnxcampo.benchmarks import models as bench_models
from onnxcampo.benchmarks import policies as pol
from onnxcampo.benchmarks.results import Item, Results, done_keys, killed_items, make_key, read_rows  # noqa: F401  (also the harness's API)

log = logging.getLogger("bench")
from onnxcampo.benchmarks import ROOT
MODES = ("inference", "training")
DEFAULT_MODELS = tuple(bench_models.MODELS)
DEFAULT_BREAKDOWN = ("fp32", "amp", "campo")


def work_list(models: list[str], policies: list[str] | None, modes: list[str], *, quick: bool) -> list[Item]:
    """Every measurement, grouped by (model, batch, mode): inference of all models first (cheap,
    most rows), then training; within a group the reference (fp32 without TF32) first."""
    items = []
    for mode in modes:
        wanted = pol.INFERENCE_POLICIES if mode == "inference" else pol.TRAINING_POLICIES
        chosen = [p for p in wanted if policies is None or p in policies]
        for name in models:
            spec = bench_models.MODELS[name]
            if mode == "inference":
                batches = bench_models.QUICK_BATCHES["infer"] if quick else spec.infer_batches
            else:
                if spec.train_batch is None:
                    continue
                batches = (bench_models.QUICK_BATCHES["train"],) if quick else (spec.train_batch,)
            for batch in batches:
                items += [Item(name, batch, mode, p) for p in chosen]
    return items


# default seconds an item may take when no earlier row says better (first run of the suite)
_BIG = {"resnet50", "bert", "gpt2", "minilm"}


def estimate_s(item: Item, rows: list[dict[str, Any]], budget_s: float, *, typical: bool = False) -> float:
    """Seconds ``item`` may take: 1.2x the longest earlier row of the same model, mode and policy
    (``typical``: the median, for planning whole groups), else a guess by model size and policy."""
    same = [r.get("item_s", 0) for r in rows if r.get("model") == item.model and r.get("mode") == item.mode
            and r.get("policy") == item.policy and r.get("item_s")]
    if same:
        return float(statistics.median(same) if typical else max(same)) * 1.2
    big = item.model in _BIG
    if item.mode == "inference":
        guess = 60 if big and item.policy in ("modelopt", "occ-fp16", "ort-fp16") else (30 if big else 10)
    elif item.policy.startswith("torch-compile"):
        guess = 180 if big else 60
    elif item.policy.startswith("torch"):
        guess = 40 if big else 15
    else:
        guess = 150 if big else 30
    return min(guess, 0.8 * budget_s)


class OutOfTime(BaseException):
    """Raised by the alarm shortly before the run's hard limit: stop with what is recorded."""


# --------------------------------------------------------------------------------------------
# measuring one group
# --------------------------------------------------------------------------------------------


@dataclass
class Settings:
    provider: str
    quick: bool
    tc: bool
    breakdown: tuple[str, ...]
    inference_warmup: int = 10
    inference_blocks: int = 7
    block_ms: float = 50.0
    train_warmup: int = 5
    train_blocks: int = 5
    train_per_block: int = 10
    sessions: int = 1  # ONNX Runtime sessions per ONNX variant, each timed; the blocks of all count
    interleave: int = 0  # rounds of the interleaved timing of an inference group (0: none)
    interleave_fresh: bool = False  # a fresh session per visit (one alive at a time) instead of all alive

    @classmethod
    def make(cls, provider: str, quick: bool, tc: bool, breakdown: tuple[str, ...], sessions: int = 1,
             interleave: int = 0, interleave_fresh: bool = False) -> "Settings":
        if quick:
            return cls(provider, quick, tc, breakdown, inference_warmup=2, inference_blocks=5, block_ms=1.0,
                       train_warmup=1, train_blocks=5, train_per_block=2, sessions=sessions, interleave=interleave,
                       interleave_fresh=interleave_fresh)
        return cls(provider, quick, tc, breakdown, sessions=sessions, interleave=interleave,
                   interleave_fresh=interleave_fresh)


@dataclass
class Kept:
    """An inference variant measured in this run, kept on disk for the group's interleaved timing."""

    path: Path
    tf32: bool
    cuda_graph: bool
    per_block: int
    session_s: float


class Group:
    """One (model, batch, mode): the built model, and lazily its reference outputs / step graph."""

    def __init__(self, model: str, batch: int, mode: str, settings: Settings, work: Path) -> None:
        self.model, self.batch, self.mode, self.settings, self.work = model, batch, mode, settings, work
        start = time.perf_counter()
        self.built = bench_models.MODELS[model].build(batch, training=mode == "training", quick=settings.quick)
        self.build_s = round(time.perf_counter() - start, 2)
        self._reference = None
        self._steps: dict[tuple, Path] = {}  # build_train_step options -> step graph file
        self.step_build_s: float | None = None
        self.step_error: str | None = None
        self._weights: dict | None = None
        self.kept: dict[str, Kept] = {}  # policy -> its model, for interleave()

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.built.input_shapes

    def reference(self) -> dict:
        """fp32 outputs without TF32: what every policy's outputs are compared with."""
        if self._reference is None:
            from onnxcampo.benchmarks import measure as m

            runner = m.bound(self.built.path, self.built.feeds, provider=self.settings.provider, tf32=False)
            runner()
            self._reference = runner.outputs()
        return self._reference

    def step_graph(self, **options) -> Path:
        """The fp32 training-step graph (cross-entropy, SGD momentum), built once per model,
        batch and ``options`` (build_train_step's, pol.STEP_OPTIONS) and cached on disk (every
        policy of the group, and later runs while /tmp lives, start from the same file)."""
        if self.step_error:
            raise pol.Unavailable(self.step_error)
        key = tuple(sorted(options.items()))
        if key not in self._steps:
            lr = "" if self.built.lr == 0.01 else f"-lr{self.built.lr:g}"
            tag = "".join(f"-{value}" for _, value in key)
            if "conv_weight_grad" not in options:  # build_train_step's default depends on the host
                from onnxcampo import ops

                tag += "-cwg" if ops.cuda_kernels_here() else ""
            path = bench_models.cache_dir() / f"step-{self.built.path.stem}{lr}{tag}{_ops_tag()}.onnx"
            if not path.is_file():
                from onnxcampo import ir
                from onnxcampo.training import build_train_step

                start = time.perf_counter()
                try:
                    step = build_train_step(str(self.built.path), loss="cross_entropy", optimizer="momentum",
                                            lr=self.built.lr, input_shapes=self.shapes, **options)
                except Exception as exc:  # noqa: BLE001 - onnx-ad's limits: record why
                    if options:  # this policy's step only; the group's plain step may still build
                        raise pol.Unavailable(f"build_train_step({options}) failed: {exc}") from None
                    self.step_error = f"build_train_step failed: {exc.__class__.__name__}: {str(exc)[:300]}"
                    raise pol.Unavailable(self.step_error) from None
                ir.save_model(step, path)
                self.step_build_s = round(time.perf_counter() - start, 1)
            self._steps[key] = path
        return self._steps[key]

    def step_weights(self) -> dict:
        """The starting weights every policy's step graph trains from (read once per group from
        the values the fp32 step graph carries)."""
        if self._weights is None:
            import onnx
            from onnxcampo.training import initial_weights

            self._weights = initial_weights(None, onnx.load(str(self.step_graph())))
        return self._weights


def _ops_tag() -> str:
    """Step graphs built with the custom-op library differ (fused update, loss scaling): cache them apart."""
    from onnxcampo import ops

    return "-ops" if ops.available() else ""


class Stages:
    """Wall seconds of the named stages of one item (``row["stage_s"]``): where device time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def timer():
            start = time.perf_counter()
            try:
                yield
            finally:
                self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - start, 2)
        return timer()


def runs_for_block(run_once, block_ms: float) -> int:
    """Runs per block of ``block_ms`` from one timed run of ``run_once`` (at least 5, at most 200)."""
    start = time.perf_counter()
    run_once()
    ms = (time.perf_counter() - start) * 1e3
    return int(min(200, max(5, math.ceil(block_ms / max(ms, 1e-3)))))


def _more_sessions(row: dict[str, Any], sessions: int, measure: Callable[[], list[float]], stages: Stages) -> None:
    """``--sessions``: time ``sessions - 1`` more fresh sessions (``measure`` makes one and returns
    its blocks); their blocks join ``row["ms_blocks"]``, each session's median goes to ``ms_sessions``."""
    if sessions <= 1:
        return
    per_session = [statistics.median(row["ms_blocks"])]
    for _ in range(sessions - 1):
        with stages("measure"):
            blocks = measure()
            gc.collect()  # the session is gone once measure returns
        row["ms_blocks"] += blocks
        per_session.append(statistics.median(blocks))
    row["ms_sessions"] = per_session


TUNE_CACHE_TAG = "t2"  # bump when --tune's measurement changes: cached campo-tune step graphs are then rebuilt
PAIRED = ("campo", "campo-tune", "campo-calib")  # policies whose rows also time the fp32 model right after, in the same process


def _paired_fp32(row: dict[str, Any], policy: str, measure: Callable[[], list[float]], stages: Stages) -> None:
    """``fp32_ms_paired``: the fp32 model (or step graph) timed right after ``policy``'s in the same
    run (``measure`` makes the session and returns its blocks). Host-bound runs moved by up to 40 %
    between runs of the same graph an hour apart; the report compares campo with fp32 on these."""
    if policy not in PAIRED:
        return
    try:
        with stages("paired_fp32"):
            row["fp32_ms_paired"] = statistics.median(measure())
    except Exception as exc:  # noqa: BLE001 - the row's own timing stands without it
        row["fp32_paired_error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
    gc.collect()


def ort_launches(path: Path, provider: str) -> dict[str, Any]:
    """The kernels ORT launches in one run of the fp32 model on ``provider`` (its own optimized
    graph, ``onnxcampo.runtime.optimized``), by class: what ``costdb fit-step-dispatch`` fits the
    per-launch host time from."""
    import onnx

    from onnxcampo.errors import CampoError
    from onnxcampo.runtime.optimized import executed_graph

    try:
        executed = executed_graph(onnx.load(str(path)), provider=provider, level="all")
    except CampoError as exc:
        return {"ort_launches_error": str(exc)[:200]}
    return {"ort_launches": executed.launches(), "ort_nodes": executed.nodes, "ort_provider": provider}


def measure_inference(group: Group, policy: str, *, prepare_only: bool = False) -> dict[str, Any]:
    from onnxcampo.benchmarks import measure as m
    import onnx

    s = group.settings
    built = group.built
    stages = Stages()
    graph = policy in pol.GRAPH_POLICIES
    if graph and s.provider != "cuda":
        raise pol.Unavailable("CUDA graphs need the CUDA execution provider")
    target = group.work / f"{built.path.stem}-{policy}.onnx"
    with stages("convert"):
        path, info = pol.make_variant(policy, built.path, target, built.feeds, group.shapes, provider=s.provider)
    keep = False
    try:
        row: dict[str, Any] = {**info, **m.node_counts(onnx.load(str(path), load_external_data=False)),
                               "stage_s": stages.seconds}
        if pol.graph_base(policy) == "fp32":
            row.update(ort_launches(path, s.provider))
        with stages("session"):
            runner = m.bound(path, built.feeds, provider=s.provider, tf32=pol.tf32_of(policy), cuda_graph=graph)
        if prepare_only:
            return row
        with stages("measure"):
            runner()
            row.update(m.output_error(group.reference(), runner.outputs()))
            for _ in range(s.inference_warmup):
                runner()
            per_block = runs_for_block(runner, s.block_ms)
            row["ms_blocks"] = m.timed_blocks(runner, warmup=0, blocks=s.inference_blocks, per_block=per_block)
            row["runs_per_block"] = per_block
        del runner
        gc.collect()
        def again() -> list[float]:
            runner = m.bound(path, built.feeds, provider=s.provider, tf32=pol.tf32_of(policy), cuda_graph=graph)
            return m.timed_blocks(runner, warmup=1 + s.inference_warmup, blocks=s.inference_blocks,
                                  per_block=per_block)
        _more_sessions(row, s.sessions, again, stages)

        def fp32() -> list[float]:
            runner = m.bound(built.path, built.feeds, provider=s.provider)
            return m.timed_blocks(runner, warmup=1 + s.inference_warmup, blocks=s.inference_blocks, per_block=per_block)
        _paired_fp32(row, policy, fp32, stages)
        if s.tc and not graph:  # the profile of a replayed graph is its base policy's
            try:
                with stages("tc"):
                    trace = m.profile_runs(path, built.feeds, provider=s.provider, directory=group.work,
                                           runs=3 if s.quick else 10, tf32=pol.tf32_of(policy))
                    row["tc"] = m.tensor_core_share(trace)
                    Path(trace).unlink()
            except Exception as exc:  # noqa: BLE001 - the timing stands without it
                row["tc_error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
        if s.interleave > 0:  # measured: its model waits for the group's interleaved timing
            group.kept[policy] = Kept(Path(path), pol.tf32_of(policy), graph, per_block, stages.seconds.get("session", 0.0))
            keep = True
        return row
    finally:
        if not keep:
            pol.cleanup(path, built.path)


def interleave(group: Group) -> dict[str, Any]:
    """Every variant of an inference group measured in this run, timed again in rotation:
    ``rounds`` rounds, each visiting every variant once, in an order that rotates every round.

    Batch-1 runs wait on the host, and the same graph measured up to 1.4x apart in runs minutes
    or an hour apart: rows of one group timed one after another compare that drift, not the
    policies. Blocks in rotation see the same machine state, so their medians compare the graphs.
    By default all the group's sessions stay alive and a visit is one block; with
    ``--interleave-fresh`` a visit makes a fresh session (one alive at a time, as the model will
    run: sessions side by side were up to 60 % slower as a whole for ``--tune`` on the H200), warms
    it up and times 3 blocks, so session-to-session variance is sampled too, at the cost of a
    session per visit. With ``--sessions N`` (alive) the whole round robin runs N times with fresh
    sessions. A variant whose session fails here is left out of the record with its reason.
    """
    from onnxcampo.benchmarks import measure as m
    from onnxcampo.errors import CampoError
    from onnxcampo.runtime.timing import time_in_rotation

    s = group.settings
    blocks: dict[str, list[float]] = {policy: [] for policy in group.kept}
    dropped: dict[str, str] = {}

    def runner_of(policy: str, kept: Kept):
        try:
            runner = m.bound(kept.path, group.built.feeds, provider=s.provider, tf32=kept.tf32,
                             cuda_graph=kept.cuda_graph)
            for _ in range(1 + s.inference_warmup):
                runner()
            return runner
        except Exception as exc:  # noqa: BLE001 - the others are still comparable
            dropped[policy] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
            return None

    def rotation(turn: int, names: list[str]) -> list[str]:
        shift = turn % len(names)
        return names[shift:] + names[:shift]

    if s.interleave_fresh:
        for turn in range(s.interleave):
            for policy in rotation(turn, list(group.kept)):
                if policy in dropped:
                    continue
                runner = runner_of(policy, group.kept[policy])
                if runner is not None:
                    blocks[policy] += m.timed_blocks(runner, warmup=0, blocks=3, per_block=group.kept[policy].per_block)
                del runner
                gc.collect()
    else:
        for _ in range(s.sessions):
            runners = {policy: runner_of(policy, kept) for policy, kept in group.kept.items() if policy not in dropped}
            alive = {policy: runner for policy, runner in runners.items() if runner is not None}
            if alive and s.interleave:
                # warmed up by runner_of; each block as long as the variant's own row's blocks
                timed = time_in_rotation(alive, rounds=s.interleave, warmup_s=0.0, warmup_runs=0,
                                         per_block={policy: group.kept[policy].per_block for policy in alive})
                failed = next((times.error for times in timed.values() if times.error is not None), None)
                if failed is not None:  # a variant failing in a round fails the record, as a failed row would
                    raise CampoError(failed)
                for policy, times in timed.items():
                    blocks[policy] += list(times.blocks_ms)
            del runners, alive
            gc.collect()
    blocks = {policy: values for policy, values in blocks.items() if values and policy not in dropped}
    return {"key": f"{group.model}|{group.batch}|{group.mode}", "model": group.model, "batch": group.batch,
            "mode": group.mode, "rounds": s.interleave, "sessions": s.sessions, "fresh": s.interleave_fresh,
            "policies": list(blocks), "ms": {policy: statistics.median(values) for policy, values in blocks.items()},
            "ms_blocks": blocks, "runs_per_block": {policy: group.kept[policy].per_block for policy in blocks},
            **({"dropped": dropped} if dropped else {})}


def interleave_estimate_s(group: Group) -> float:
    """Sessions made again, warm-up and the rounds of blocks, with a margin."""
    s = group.settings
    if s.interleave_fresh:  # a session and 3 blocks per visit
        return 5.0 + s.interleave * sum(1.5 * kept.session_s + 4 * s.block_ms / 1e3 for kept in group.kept.values())
    return 5.0 + s.sessions * sum(1.5 * kept.session_s + (s.interleave + 2) * s.block_ms / 1e3
                                  for kept in group.kept.values())


def rows_of_other_runs(rows: list[dict[str, Any]], group: tuple[str, int, str], run: str,
                       pending: set[str] = frozenset()) -> list[str]:
    """Policies of the group whose latest row ran (status ok) in another run than ``run`` and
    will not be measured again (``pending``): with them, an interleaved timing of the group would
    be spent for nothing (the report uses a record only for a whole group from its run)."""
    prefix = "|".join(map(str, group)) + "|"
    latest = {r["key"]: r for r in rows if r.get("key", "").startswith(prefix)}
    return sorted(r["policy"] for key, r in latest.items()
                  if r.get("status") == "ok" and r.get("run") != run and key not in pending)


def interleave_follows(items: list[Item], rows: list[dict[str, Any]], run: str, settings: Settings,
                       prepare_only: bool) -> bool:
    """Whether measuring ``items`` (the pending items of one inference group) ends in an interleaved
    timing: two or more of them, and no row of the group that ran stays from another run."""
    if prepare_only or settings.interleave <= 0 or len(items) < 2 or items[0].mode != "inference":
        return False
    return not rows_of_other_runs(rows, items[0].group, run, {item.key for item in items})


def group_estimate_s(items: list[Item], rows: list[dict[str, Any]], settings: Settings, budget_s: float) -> float:
    """What an inference group's pending items take, with its interleaved timing (a guess before
    any is measured: 3 s a variant and session): an interleaved group is started only whole."""
    measure = sum(estimate_s(item, rows, budget_s, typical=True) for item in items)
    if settings.interleave <= 0:
        return measure
    visits = settings.interleave if settings.interleave_fresh else settings.sessions
    return measure + 5.0 + 3.0 * visits * len(items)


def finish_group(group: Group | None, results: "Results", run: str, left_s: float, *, timed: bool = True) -> None:
    """The group's interleaved timing (``--interleave``) when two or more of its inference variants
    were measured in this run, every variant of the group that ran was (the report uses a record
    only for a whole group: with rows of other runs it would be time spent for nothing), and the
    budget allows; then its kept model files go."""
    if group is None or not group.kept:
        return
    try:
        name = f"{group.model}|{group.batch}|{group.mode}"
        others = rows_of_other_runs(results.rows, (group.model, group.batch, group.mode), run)
        if not timed:
            print(f"  {name}: no interleaved timing (the run stops inside the group)", flush=True)
        elif others:
            print(f"  {name}: no interleaved timing (rows of other runs: {', '.join(others)})", flush=True)
        elif len(group.kept) >= 2 and group.settings.interleave > 0:
            need = interleave_estimate_s(group)
            if left_s < need:
                print(f"  {name}: no interleaved timing ({left_s:.0f} s left, it may take {need:.0f} s)", flush=True)
            else:
                try:
                    record = interleave(group)
                except Exception as exc:  # noqa: BLE001 - the rows stand without it
                    record = {"key": name, "status": "failed",
                              "error": f"{exc.__class__.__name__}: {str(exc)[:300]}"}
                record.update(run=run, time=datetime.now(timezone.utc).isoformat(timespec="seconds"))
                results.add_interleaved(record)
                if "ms" in record:
                    shown = " ".join(f"{p} {v:.3f}" for p, v in record["ms"].items())
                    print(f"  {record['key']} interleaved ({record['rounds']} rounds): {shown}", flush=True)
                else:
                    print(f"  {record['key']} interleaved: failed: {record['error'][:150]}", flush=True)
    except Exception as exc:  # noqa: BLE001 - never the next item's failure (e.g. the mirror copy)
        print(f"  {group.model}|{group.batch}|{group.mode}: interleaved timing not recorded: "
              f"{exc.__class__.__name__}: {str(exc)[:150]}", flush=True)
    finally:
        for kept in group.kept.values():
            pol.cleanup(kept.path, group.built.path)
        group.kept.clear()
        gc.collect()


def training_variant(group: Group, policy: str) -> tuple[Path, dict[str, Any]]:
    """The step graph of ``policy``: the fp32 step itself, or its optimized copy, made once per
    model, batch and policy and cached on disk next to the step graph."""
    step = group.step_graph(**pol.STEP_OPTIONS.get(policy, {}))
    policy = pol.graph_base(policy)  # a CUDA-graph policy replays its base policy's graph
    if policy in ("fp32", "fp32-notf32"):
        return step, {"convert_s": 0.0}
    # campo-tune's choice depends on where and by which version of --tune it was timed
    tuned = f"-{group.settings.provider}-{TUNE_CACHE_TAG}" if policy == "campo-tune" else ""
    path = bench_models.cache_dir() / f"{step.stem}-{policy}{tuned}.onnx"
    info_path = path.with_suffix(".json")
    if path.is_file() and info_path.is_file():
        return path, {**json.loads(info_path.read_text()), "cached": True}
    batch = {**group.built.feeds, "labels": group.built.labels}
    _, info = pol.make_variant(policy, step, path, batch, {}, provider=group.settings.provider)
    info_path.write_text(json.dumps(info))
    return path, info


def _ew_kernel_stats() -> dict[str, int]:
    """onnxcampo.ops.elementwise.jit.kernel_stats of the loaded custom-op library ({} without one or CUDA)."""
    try:
        from onnxcampo import ops
        from onnxcampo.ops.elementwise import jit

        return jit.kernel_stats(ops.check()) if ops.available() else {}
    except Exception:  # noqa: BLE001 - a diagnostic only
        return {}


def measure_training(group: Group, policy: str, *, prepare_only: bool = False) -> dict[str, Any]:
    """One training variant: its step graph, a session, timed steps, and for the breakdown
    policies a profiled run. ``row["stage_s"]`` says how long each stage took; with
    ``prepare_only`` it stops once the session exists (nothing is measured)."""
    s = group.settings
    stages = Stages()
    if policy in pol.TORCH_POLICIES:
        from onnxcampo.benchmarks import torch_twins as bench_torch

        if prepare_only:
            return {"stage_s": {}}
        with stages("measure"):
            row = bench_torch.train(group.built, policy, provider=s.provider, warmup=s.train_warmup,
                                    blocks=s.train_blocks, per_block=s.train_per_block, lr=group.built.lr)
        return {**row, "stage_s": stages.seconds}
    from onnxcampo.benchmarks import measure as m
    import onnx

    graph = policy in pol.GRAPH_POLICIES
    if graph and s.provider != "cuda":
        raise pol.Unavailable("CUDA graphs need the CUDA execution provider")
    with stages("step_graph"):
        group.step_graph()
    row: dict[str, Any] = {"step_build_s": group.step_build_s}
    with stages("convert"):
        path, info = training_variant(group, policy)
    row.update(info)
    with stages("load"):
        step_model = onnx.load(str(path), load_external_data=False)
        row.update(m.node_counts(step_model))
        weights = group.step_weights()
    batch = {**group.built.feeds, "labels": group.built.labels}
    with stages("session"):
        runner = m.StepRunner(path, weights=weights, batch=batch, provider=s.provider, tf32=pol.tf32_of(policy),
                              model=step_model, cuda_graph=graph, cuda_options=pol.cuda_options_of(policy))
    if prepare_only:
        del runner
        return {**row, "stage_s": stages.seconds}
    with stages("measure"):
        row["ms_blocks"] = m.timed_blocks(runner, warmup=s.train_warmup, blocks=s.train_blocks,
                                          per_block=s.train_per_block)
    row.update(loss_first=runner.losses[0], loss_last=runner.losses[-1], steps=len(runner.losses),
               loss_scale=runner.state("loss_scale"), finite=all(math.isfinite(x) for x in runner.losses))
    cupti = s.provider == "cuda" and policy in s.breakdown and not graph
    if not cupti:
        del runner
        gc.collect()

    def again() -> list[float]:
        runner = m.StepRunner(path, weights=weights, batch=batch, provider=s.provider, tf32=pol.tf32_of(policy),
                              model=step_model, cuda_graph=graph, cuda_options=pol.cuda_options_of(policy))
        return m.timed_blocks(runner, warmup=s.train_warmup, blocks=s.train_blocks, per_block=s.train_per_block)
    _more_sessions(row, s.sessions, again, stages)

    def fp32() -> list[float]:
        runner = m.StepRunner(group.step_graph(), weights=weights, batch=batch, provider=s.provider)
        return m.timed_blocks(runner, warmup=s.train_warmup, blocks=s.train_blocks, per_block=s.train_per_block)
    _paired_fp32(row, policy, fp32, stages)
    if cupti:  # GPU time per kernel class (CUPTI), after every timing: the profiler may slow what follows
        try:
            with stages("gpu_kernels"):
                kernels = m.cupti_kernels(runner, 5)  # 5 more steps of the timed session (its loss is read)
            if kernels:
                row["gpu"] = m.gpu_split(kernels)
        except Exception as exc:  # noqa: BLE001 - the timing stands without it
            row["gpu_error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
        del runner
        gc.collect()
    row["stage_s"] = stages.seconds
    stats = _ew_kernel_stats()
    if stats:  # FusedElementwise's generated CUDA kernels so far in this process (a fallback shows here)
        row["ew_kernels"] = stats
    if not row["finite"]:
        raise m.MeasureError(f"non-finite loss after {row['steps']} steps (last {row['loss_last']})")
    if policy in s.breakdown:
        try:
            with stages("breakdown"):
                profiled = m.StepRunner(path, weights=weights, batch=batch, provider=s.provider,
                                        tf32=pol.tf32_of(policy), profiling=True, optimization="disable",
                                        profile_prefix=str(group.work / "step_profile"), model=step_model)
                for _ in range(1 + (2 if s.quick else 5)):
                    profiled()
                trace = profiled.session.end_profiling()
                row["breakdown"] = m.breakdown(trace, step_model, group.built.path)
                row["tc"] = m.tensor_core_share(trace)
                Path(trace).unlink()
                del profiled
        except Exception as exc:  # noqa: BLE001
            row["breakdown_error"] = f"{exc.__class__.__name__}: {str(exc)[:200]}"
    return row


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


def _finish_row(item: Item, group: Group | None, row: dict[str, Any], run: str, started: float) -> dict[str, Any]:
    import statistics

    out = {"key": item.key, "model": item.model, "batch": item.batch, "mode": item.mode, "policy": item.policy,
           "status": "ok", **row}
    if "ms_blocks" in out and out["ms_blocks"]:
        out["ms"] = statistics.median(out["ms_blocks"])
        out["throughput"] = item.batch * 1000.0 / out["ms"]  # samples (sequences, images) per second
    out.setdefault("tf32", pol.tf32_of(item.policy))
    if group is not None:
        out["build_s"] = group.build_s
        out["shape_note"] = group.built.shape_note
    out.update(run=run, item_s=round(time.perf_counter() - started, 1),
               time=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return out


def _failed(item: Item, reason: str, status: str = "failed") -> dict[str, Any]:
    return {"status": status, "error": reason}


def check_provider(provider: str) -> str | None:
    """Why ``provider`` cannot run here (one line), or None."""
    import onnxruntime as ort

    from onnxcampo.runtime import available_providers

    if provider == "cuda" and "CUDAExecutionProvider" not in available_providers():
        return ("onnxruntime has no CUDAExecutionProvider: install onnxruntime-gpu as ../shared/device/README.md "
                f"says and put /tmp/ortgpu first on PYTHONPATH (found onnxruntime {ort.__version__} at "
                f"{Path(ort.__file__).parent})")
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(prog=_program(), description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "raw", help="results folder")
    p.add_argument("--name", default=None, help="results file stem (default h200 on cuda, cpu on cpu)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting work after this many seconds")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(DEFAULT_MODELS)}")
    p.add_argument("--policies", default=None, help="comma-separated subset of the policies")
    p.add_argument("--mode", choices=("inference", "training", "all"), default="all")
    p.add_argument("--quick", action="store_true", help="tiny models and few repeats (a smoke test)")
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--corpus-dir", type=Path, default=None, help="folder laid out like the corpus cache")
    p.add_argument("--wheels", type=Path, default=ROOT / ".benchwheels", help="anchor wheels (bench_wheels.sh)")
    p.add_argument("--mirror", type=Path, default=None, help="also copy the JSONL files here after every line ($OUT)")
    p.add_argument("--retry-failed", action="store_true", help="measure again keys whose last row failed")
    p.add_argument("--no-tc", action="store_true", help="skip the profiling run for the Tensor Core share")
    p.add_argument("--breakdown-policies", default=",".join(DEFAULT_BREAKDOWN),
                   help="training policies whose step is profiled for the time breakdown")
    p.add_argument("--interleave", type=int, default=7, metavar="ROUNDS",
                   help="after an inference group, time every variant measured in this run again with all their "
                        "sessions alive, one block each in rotation, ROUNDS times (to <name>.interleaved.jsonl; the "
                        "report prefers these for the group); 0 turns it off (default 7)")
    p.add_argument("--interleave-fresh", action="store_true",
                   help="the interleaved timing makes a fresh session per visit (one alive at a time, 3 blocks) "
                        "instead of keeping the group's sessions alive: slower, closer to how a model runs alone")
    p.add_argument("--sessions", type=int, default=1,
                   help="time each ONNX variant in this many fresh ONNX Runtime sessions (cuDNN's algorithm search "
                        "can differ between sessions); the blocks of all sessions make the median (default 1)")
    p.add_argument("--redo", metavar="GLOB",
                   help="measure again the keys matching GLOB (model|batch|mode|policy, e.g. '*|campo*') whose last "
                        "row is older than --redo-before (rows made by an older onnxcampo)")
    p.add_argument("--redo-before", metavar="ISO_TIME", help="with --redo: e.g. 2026-11-30T14:00 (UTC)")
    p.add_argument("--list", action="store_true", help="print the work list with done/left and exit")
    p.add_argument("--prepare-only", action="store_true",
                   help="build what the pending items need (exports, step graphs, converted models, sessions), "
                        "time each stage into OUT/<name>.prepare.jsonl, measure and record nothing")
    p.add_argument("--prepare-corpus", type=Path, default=None, metavar="DIR",
                   help="copy the benchmarked corpus models from the local cache into DIR and exit")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def prepare_corpus(target: Path) -> int:
    total = 0
    for key, source, relative in bench_models.corpus_files():
        if not source.is_file():
            print(f"{key}: not cached at {source}; run python -m onnxcampo.benchmarks fetch-corpus {key}", file=sys.stderr)
            return 1
        dest = target / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        total += dest.stat().st_size
        print(f"{key}: {dest} ({dest.stat().st_size / 2**20:.1f} MiB)")
    print(f"corpus selection: {total / 2**20:.1f} MiB in {target}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.prepare_corpus:
        return prepare_corpus(args.prepare_corpus)
    started = time.monotonic()
    name = args.name or ("h200" if args.provider == "cuda" else "cpu")
    if args.corpus_dir is not None:
        os.environ["ONNXCAMPO_CACHE"] = str(args.corpus_dir.resolve())
        os.environ["ONNXCAMPO_CORPUS_OFFLINE"] = "1"
    models = args.models.split(",") if args.models else list(DEFAULT_MODELS)
    unknown = [m for m in models if m not in bench_models.MODELS]
    policies = args.policies.split(",") if args.policies else None
    bad = [p for p in policies or () if p not in set(pol.INFERENCE_POLICIES) | set(pol.TRAINING_POLICIES)]
    if unknown or bad:
        print(f"error: unknown models {unknown} or policies {bad}", file=sys.stderr)
        return 2
    modes = list(MODES) if args.mode == "all" else [args.mode]
    items = work_list(models, policies, modes, quick=args.quick)
    results = Results(args.out, name, args.mirror)
    if bool(args.redo) != bool(args.redo_before):
        print("error: --redo and --redo-before go together", file=sys.stderr)
        return 2
    try:
        done = done_keys(results.rows, retry_failed=args.retry_failed, redo=args.redo, redo_before=args.redo_before)
    except ValueError as exc:
        print(f"error: --redo-before: {exc}", file=sys.stderr)
        return 2
    pending = [i for i in items if i.key not in done]
    if args.list:
        for item in items:
            print(f"{'done' if item.key in done else 'left'}  {item.key}")
        print(f"{len(items) - len(pending)} done, {len(pending)} left")
        return 0
    if args.prepare_only:  # what is prepared (with stage times) goes to its own file; the results stay as they are
        results = Results(args.out, f"{name}.prepare", args.mirror)
    problem = check_provider(args.provider)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    run = uuid.uuid4().hex[:8]
    wheels_note = pol.install_wheels(args.wheels)
    from onnxcampo.benchmarks import torch_twins as bench_torch

    record = {"run": run, "start": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([_program(), *(sys.argv[1:] if argv is None else argv)]),
              "provider": args.provider, "quick": args.quick, "budget_s": args.budget_s, "python": platform.python_version(),
              "versions": {**pol.package_versions(), **bench_torch.versions()}, "wheels": wheels_note,
              "pending_at_start": len(pending)}
    results.run_record(record)  # written now too: a run killed at the device's limit still leaves its versions
    print(f"bench run {run}: {len(items) - len(pending)} of {len(items)} measurements done, {len(pending)} left "
          f"(budget {args.budget_s:.0f} s)", flush=True)

    killed = killed_items(results.attempts(), results.rows, results.runs(), full_run_s=min(300.0, 0.5 * args.budget_s))
    for item in pending:
        if item.key in killed:
            dead = _finish_row(item, None, _failed(item, f"did not finish in {killed[item.key]} runs "
                                                       "(the run was killed while measuring it)"), run, time.perf_counter())
            results.add(dead)
            _print_row(dead)  # recorded without being started: say so, or "everything is done" misleads
    pending = [i for i in pending if i.key not in killed]
    if args.sessions < 1:
        print("error: --sessions must be >= 1", file=sys.stderr)
        return 2
    if args.interleave < 0:
        print("error: --interleave must be >= 0", file=sys.stderr)
        return 2
    settings = Settings.make(args.provider, args.quick, not args.no_tc,
                             tuple(p for p in args.breakdown_policies.split(",") if p), args.sessions, args.interleave,
                             args.interleave_fresh)

    def left_s() -> float:
        return args.budget_s - (time.monotonic() - started)

    # a hard stop 25 s after the budget: whatever was recorded stays, the item in flight is retried
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGTERM, _alarm)  # a timeout's TERM: record the run's end, keep what is done
    signal.alarm(int(args.budget_s + 25))
    finished = 0
    stopped = None
    group: Group | None = None
    broken: dict[tuple, str] = {}  # groups whose model did not build: their items fail with the same reason
    try:
        with tempfile.TemporaryDirectory(prefix="onnxcampo-bench-") as tmp:
            work = Path(tmp)
            for index, item in enumerate(pending):
                if group is not None and (group.model, group.batch, group.mode) != item.group:
                    finish_group(group, results, run, left_s())  # on the group's time, not the next item's
                    group = None
                    gc.collect()
                need = estimate_s(item, results.rows, args.budget_s)
                if group is None and item.group not in broken:
                    rest = [i for i in pending[index:] if i.group == item.group]
                    if interleave_follows(rest, results.rows, run, settings, args.prepare_only):
                        need = group_estimate_s(rest, results.rows, settings, args.budget_s)
                if finished and left_s() < need:
                    stopped = f"budget: {left_s():.0f} s left, the next item ({item.key}) may take {need:.0f} s"
                    if group is not None and item.group == (group.model, group.batch, group.mode):
                        finish_group(group, results, run, left_s(), timed=False)  # a part of a group: not comparable
                        group = None
                    break
                results.attempt(item, run, left_s())
                t0 = time.perf_counter()
                new_group = False
                try:
                    if item.group in broken:
                        status, text = broken[item.group]
                        raise pol.Unavailable(text) if status == "unavailable" else RuntimeError(text)
                    if group is None:
                        try:
                            group = Group(item.model, item.batch, item.mode, settings, work)
                            new_group = True
                        except pol.Unavailable as exc:  # e.g. a corpus model whose batch is fixed
                            broken[item.group] = ("unavailable", str(exc))
                            raise
                        except Exception as exc:  # noqa: BLE001
                            broken[item.group] = ("failed", f"model build failed: {exc.__class__.__name__}: {str(exc)[:400]}")
                            raise RuntimeError(broken[item.group][1]) from None
                    measure = measure_inference if item.mode == "inference" else measure_training
                    row = measure(group, item.policy, prepare_only=args.prepare_only)
                except pol.Unavailable as exc:
                    row = _failed(item, str(exc), "unavailable")
                except Exception as exc:  # noqa: BLE001 - a failing variant is a result
                    if args.verbose:
                        traceback.print_exc()
                    text = str(exc) if item.group in broken else f"{exc.__class__.__name__}: {str(exc)[:500]}"
                    row = _failed(item, text)
                in_group = group if group is not None and (group.model, group.batch, group.mode) == item.group else None
                if new_group and in_group is not None and "stage_s" in row:
                    row["stage_s"] = {"model": group.build_s, **row["stage_s"]}  # export (or cache read) of the group
                new_group = False
                row = _finish_row(item, in_group, row, run, t0)
                results.add(row)
                finished += 1
                _print_row(row)
            finish_group(group, results, run, left_s())
    except OutOfTime:
        stopped = "hard stop (25 s past the budget, or SIGTERM); the item in flight will be measured again"
    finally:
        signal.alarm(0)
    left = len(pending) - finished
    record.update(end=datetime.now(timezone.utc).isoformat(timespec="seconds"), finished=finished, left=left,
                  stopped=stopped, wall_s=round(time.monotonic() - started, 1))
    results.run_record(record)
    if left <= 0:
        print(f"everything is done ({len(results.rows)} rows in {results.path})", flush=True)
    else:
        print(f"stopped ({stopped}); {left} measurements left: run the same command again", flush=True)
    return 0


def _program() -> str:
    """How this run is started, for ``--help`` and the run record."""
    return "python -m onnxcampo.benchmarks run"


def _alarm(signum, frame):
    raise OutOfTime()


def _print_row(row: dict[str, Any]) -> None:
    if row["status"] != "ok":
        print(f"  {row['key']:48s} {row['status']}: {row.get('error', '')[:150]}", flush=True)
        return
    if "ms" not in row:  # --prepare-only: where the item's time went
        stages = " ".join(f"{k} {v:.1f}" for k, v in row.get("stage_s", {}).items())
        print(f"  {row['key']:48s} prepared: {stages or '-'}  ({row['item_s']} s)", flush=True)
        return
    extra = ""
    if "rel_err_max" in row:
        extra = f" err {row['rel_err_max']:.2e}"
    if "loss_last" in row:
        extra = f" loss {row['loss_first']:.4f}->{row['loss_last']:.4f}"
    print(f"  {row['key']:48s} {row['ms']:9.3f} ms  casts {row.get('casts', '-')}{extra}  ({row['item_s']} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
