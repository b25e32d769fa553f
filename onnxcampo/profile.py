"""Measured per-node times of a model (the Campo paper's "graph profiling").

Campo decides fp16 vs fp32 per node from costs; estimates alone mislead (DESIGN.md: the
all-fp16 GPT-2 is slower than fp32 for reasons only measured per-node times can find). This
module runs a model under ONNX Runtime's profiler and returns a time per ONNX node, together
with the wall time of a run so the caller can see that the node times add up to it.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.runtime import make_session, trace
# BoundRunner and check_feeds live in onnxcampo.runtime.timing now; imported from here as before
from onnxcampo.runtime.timing import BoundRunner, bound_runner, check_feeds

logger = logging.getLogger(__name__)

__all__ = ["BoundRunner", "check_feeds", "Latency", "MeasuredProfile", "measure_latency", "measure_node_times"]

_DEVICES = {"cpu": "cpu", "cuda": "cuda"}


@dataclass(frozen=True)
class MeasuredProfile:
    """Per-node kernel times of one model on one provider.

    ``node_us``: ONNX node name -> median over the timed runs of that node's kernel time in one
    run (us). Model nodes ORT never executed (Constant nodes become initializers at load time;
    ORT may drop nodes such as Cast(fp32->fp16)->Cast(fp16->fp32) pairs even with
    optimizations disabled) are listed in ``absent`` and given 0.0, which is what they cost
    in ORT. ``run_us``: median wall time of one run (profiling on, inputs and outputs bound on
    the device). ``node_sum_us``: sum of ``node_us``. ``unmatched``: profiler node names that
    are not model nodes (nodes ORT inserted, e.g. Memcpy on CUDA or casts around kernels a
    provider lacks in fp16); ``unmatched_us``: their median per-run total.
    """

    node_us: dict[str, float]
    run_us: float
    node_sum_us: float
    provider: str
    unmatched: tuple[str, ...]
    absent: tuple[str, ...] = ()
    unmatched_us: float = 0.0


def _node_names(model: onnx.ModelProto) -> list[str]:
    """Top-level node names, which must be unique and non-empty to map profiler events."""
    names = [node.name for node in model.graph.node]
    if any(not name for name in names):
        raise CampoError("measure_node_times needs every node to have a name; some are empty")
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise CampoError(f"measure_node_times needs unique node names; duplicated: {duplicates}")
    return names


def _run_windows(events: list[dict[str, Any]], warmup: int, runs: int) -> list[tuple[int, int]]:
    """(start, end) in trace us of the timed runs (:func:`onnxcampo.runtime.trace.run_windows`
    after the warm-up)."""
    windows = trace.run_windows(events)
    if len(windows) < warmup + runs:
        raise CampoError(
            f"the profiler recorded {len(windows)} runs, expected {warmup + runs}; "
            "the trace may have hit ORT's event limit (use fewer runs)"
        )
    return windows[warmup:warmup + runs]


def _per_run_times(events: list[dict[str, Any]],
                   windows: list[tuple[int, int]]) -> list[dict[str, float]]:
    """For each timed run, profiler node name -> summed kernel time (us)."""
    starts = [start for start, _ in windows]
    per_run: list[dict[str, float]] = [defaultdict(float) for _ in windows]
    outside = 0
    for event in events:
        if not trace.is_kernel_event(event):
            continue
        name = event["name"]
        ts = int(event["ts"])
        index = bisect.bisect_right(starts, ts) - 1
        if index < 0 or ts > windows[index][1]:
            outside += 1  # warm-up runs, or events outside any run
            continue
        per_run[index][name[: -len(trace.KERNEL_SUFFIX)]] += float(event["dur"])
    logger.debug("%d kernel events outside the timed runs (warm-up) dropped", outside)
    return per_run


def _median_per_name(per_run: list[dict[str, float]], names: set[str]) -> dict[str, float]:
    """Median over runs of each name's time, counting runs where it did not appear as 0."""
    return {name: statistics.median(run.get(name, 0.0) for run in per_run) for name in names}


def _profile(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray], device: str,
             warmup: int, runs: int) -> tuple[list[float], list[dict[str, Any]]]:
    """Run warm-up and timed runs under the profiler; return timed walls (s) and the trace."""
    runner = BoundRunner(session, feeds, device)
    walls = []
    try:
        for _ in range(warmup):
            runner()
        walls = [runner() for _ in range(runs)]
    finally:
        trace_path = session.end_profiling()
    return walls, trace.read_events(trace_path)


def measure_node_times(
    model: onnx.ModelProto,
    *,
    provider: str = "cpu",
    feeds: Mapping[str, np.ndarray],
    warmup: int = 3,
    runs: int = 10,
) -> MeasuredProfile:
    """Measure each node's kernel time with ORT's profiler (median over ``runs`` runs).

    Graph optimizations are DISABLED for the session so that ORT does not fuse or rename
    nodes and profiler node names map 1:1 onto the model's nodes; the times are therefore
    those of the graph as written, which is what a per-node cost model needs. Warm-up runs are
    dropped by locating each kernel event inside the profiler's ``model_run`` windows. The
    wall time is measured around ``run_with_iobinding`` in the same runs, so ``node_sum_us``
    can be checked against ``run_us`` (the gap is framework overhead between kernels).
    Nodes must have unique non-empty names.
    """
    if warmup < 0 or runs < 1:
        raise ConfigError(f"need warmup >= 0 and runs >= 1, got warmup={warmup} runs={runs}")
    if provider not in _DEVICES:
        raise ConfigError(f"unknown provider '{provider}'; choose one of {list(_DEVICES)}")
    names = _node_names(model)
    with tempfile.TemporaryDirectory(prefix="onnxcampo-profile-") as tmp:
        session = make_session(model, provider=provider, profiling=True,
                               optimization_level="disable",
                               profile_file_prefix=str(Path(tmp) / "ort_profile"))
        check_feeds(session, feeds)
        walls, events = _profile(session, feeds, _DEVICES[provider], warmup, runs)
    per_run = _per_run_times(events, _run_windows(events, warmup, runs))
    return _summarise(names, per_run, walls, provider)


def _summarise(names: list[str], per_run: list[dict[str, float]], walls: list[float],
               provider: str) -> MeasuredProfile:
    """Build the MeasuredProfile and log how much of the run the node times explain."""
    seen = set().union(*per_run)
    model_names = set(names)
    unmatched = tuple(sorted(seen - model_names))
    absent = tuple(name for name in names if name not in seen)
    medians = _median_per_name(per_run, seen & model_names)
    node_us = {name: medians.get(name, 0.0) for name in names}
    unmatched_us = statistics.median(sum(run.get(n, 0.0) for n in unmatched) for run in per_run)
    run_us = statistics.median(walls) * 1e6
    node_sum_us = sum(node_us.values())
    share = 100.0 * node_sum_us / run_us if run_us > 0 else float("nan")
    logger.info("node times sum to %.1f us of a %.1f us run (%.1f %%)",
                node_sum_us, run_us, share)
    if unmatched:
        logger.info("%d profiler nodes not in the model add %.1f us per run: %s",
                    len(unmatched), unmatched_us, ", ".join(unmatched[:10]))
    if absent:
        logger.info("%d model nodes never ran in ORT (folded or removed at load): %s",
                    len(absent), ", ".join(absent[:10]))
    return MeasuredProfile(node_us=node_us, run_us=run_us, node_sum_us=node_sum_us,
                           provider=provider, unmatched=unmatched, absent=absent,
                           unmatched_us=unmatched_us)


@dataclass(frozen=True)
class Latency:
    """Wall time of one run through IO binding (inputs and outputs on the device)."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    provider: str


def measure_latency(
    model: onnx.ModelProto | str,
    *,
    provider: str = "cpu",
    feeds: Mapping[str, np.ndarray],
    warmup: int = 10,
    runs: int = 50,
    execution: str = "plain",
) -> Latency:
    """Median wall time of ``runs`` runs after ``warmup`` runs, with all graph optimizations
    on (what a user gets), inputs bound on the device once and outputs pre-allocated;
    ``execution="cuda-graph"`` (provider cuda): replayed from a CUDA graph."""
    runner = bound_runner(model, feeds, provider=provider, execution=execution)
    for _ in range(warmup):
        runner()
    times = np.array([runner() for _ in range(runs)]) * 1e3
    return Latency(float(np.median(times)), float(np.percentile(times, 10)),
                   float(np.percentile(times, 90)), runs, provider)
