"""``onnxcampo costdb calibrate``: a cost database for this machine's GPU, measured and fitted by
one command, kept per user and picked up by every later run (:mod:`onnxcampo.costdb.select`).

1. Where: :func:`onnxcampo.costdb.select.user_database_path` (the user's cache folder; the file
   is named after the GPU and the ONNX Runtime and CUDA versions, since a new ORT or CUDA changes
   the kernels); the samples go beside it (``.jsonl``, one JSON line a measurement, flushed as
   it is taken).
2. What, in this order (the fit needs the first groups most):
   a. the host: ONNX Runtime's per-launch host time of a chain of small elementwise nodes, of
      small float32 convolutions and of small float16 NCHW convolutions (``conv_fp16``: cuDNN's
      layout transforms around each call launch with it), and where the custom-op library's CUDA kernels are, of its NHWC
      convolution and FusedElementwise calls (each chain run node by node minus the same chain
      replayed as a CUDA graph, over its launches), and the fixed cost of one replayed run
      (``host_launch``, ``run_overhead``: what ``onnxcampo.estimate.plan_time`` adds for launches);
   b. Casts, Pads and Slices (the Cast and padding cost models);
   c. the single-op grid of :func:`onnxcampo.costdb.measure.default_grid` (GEMMs, convolutions,
      elementwise ops, normalizations, ONNX Runtime's fused transformer ops, the shapes of common
      models) with TF32 on, as ONNX Runtime runs fp32 products by default, then the short op
      chains of :mod:`onnxcampo.costdb.chains`;
   d. the ``FusedElementwise`` kernel over sizes and input counts, where the custom-op library's
      CUDA kernels and NVRTC are here (``fused_elementwise``: its bandwidth and fixed cost).
   Times are GPU kernel times seen by CUPTI where PyTorch is installed (``torch.profiler``), else
   wall times minus an empty model's (coarser for kernels of a few microseconds); the database
   records which (``clock``).
3. ``budget_s`` bounds the measuring (default 540 s; the fit takes seconds): what is measured is
   kept, and a later run resumes where this one stopped, measuring only the cases not in the
   samples file. A partial grid still gives a database: op types without enough samples fall
   back to the analytic model of this GPU's specs, and the database says how many cases are left
   (``calibration.cases_left``).
4. Ctrl-C stops at once: every sample taken is on disk (a truncated last line is dropped when the
   file is read again), nothing is fitted, and the message says how to resume.
5. The fit is :func:`onnxcampo.costdb.fit.fit_database` (held-out error in ``summary``), plus the
   host and FusedElementwise entries and the GPU's spec (``device.spec``: the analytic fallback
   of op types the grid lacks uses it); the database is written atomically.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxcampo.costdb import measure
from onnxcampo.costdb.device import GpuSpec
from onnxcampo.errors import ConfigError, CostModelError

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 540.0
HOST_CHAIN = 96  # nodes in a host-probe chain: the per-launch figure is (plain - replayed) / launches
FUSED_SIZES = (16, 18, 20, 22, 24)  # log2 elements of the FusedElementwise cases
FUSED_INPUTS = (1, 2, 4)


@dataclass
class CalibrationResult:
    database_path: Path
    samples_path: Path
    measured: int  # samples taken by this run
    cases_left: int  # left for a later run (budget)
    database: dict | None  # None when interrupted

    @property
    def complete(self) -> bool:
        return self.cases_left == 0


# --- the samples file --------------------------------------------------------------------------

def read_samples(path: Path) -> list[dict]:
    """The samples of ``path``; a last line cut short by an interrupted write is dropped (and
    the file truncated to the complete lines), any other malformed line is an error."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the write a Ctrl-C or a crash cut
                log.warning("%s: dropping an incomplete last sample line", path)
                kept = "".join(f"{entry}\n" for entry in lines[:-1])
                path.write_text(kept)
                break
            raise CostModelError(f"{path}:{number}: malformed sample line; remove the file (or use --fresh) "
                                 "to measure again") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


# --- a. the host -------------------------------------------------------------------------------

# host-probe classes: ORT's own kernels, and (where the library's CUDA kernels are) its custom ops
HOST_CLASSES = ("other", "conv", "conv_fp16")
LIBRARY_HOST_CLASSES = ("conv_nhwc", "conv_nhwc_graph", "custom")  # conv_nhwc*: per cuDNN API


def library_host_classes() -> tuple[str, ...]:
    """The library's host classes measured here: the NHWC convolution call under the cuDNN API
    this process's sessions use (``onnxcampo.ops.conv_nhwc.host_class``), and FusedElementwise's."""
    from onnxcampo.ops.conv_nhwc import host_class

    return host_class(), "custom"


def _chain_model(kind: str, length: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``length`` nodes one after another: Adds of a [1, 256] tensor and a constant (``other``),
    1x1 convolutions of [1, 8, 8, 8] (``conv``), float16 1x1 convolutions of [1, 64, 8, 8] NCHW
    (``conv_fp16``: enough channels for cuDNN's Tensor Core kernels, and their layout transforms,
    at a GPU time below the host's), float16 ``ConvNhwc`` 1x1 convolutions of
    [1, 8, 8, 8] channels-last (``conv_nhwc``, or ``conv_nhwc_graph`` under cuDNN's graph API) or one-input ``FusedElementwise`` copies of [1, 256]
    (``custom``: a custom-op call)."""
    nodes, inits = [], []
    opsets = [helper.make_opsetid("", 17)]
    element = TensorProto.FLOAT
    if kind in LIBRARY_HOST_CLASSES:
        from onnxcampo.ops import nodes as library

        opsets.append(helper.make_opsetid(library.DOMAIN, 1))
    if kind.startswith("conv_nhwc"):  # the same chain under either cuDNN API
        shape, element = [1, 8, 8, 8], TensorProto.FLOAT16
        inits.append(onnx.numpy_helper.from_array(np.full((8, 1, 1, 8), 0.125, np.float16), "w"))
        for i in range(length):
            nodes.append(library.conv_nhwc(f"t{i}", "w", output=f"t{i + 1}", kernel_shape=(1, 1), name=f"n{i}"))
    elif kind == "custom":
        from onnxcampo.ops.elementwise import Op

        shape = [1, 256]
        program = [int(v) for v in (Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0)]
        for i in range(length):
            nodes.append(library.fused_elementwise([f"t{i}"], [f"t{i + 1}"], program=program, registers=1,
                                                   output_types=[TensorProto.FLOAT], name=f"n{i}"))
    elif kind == "conv_fp16":
        shape, element = [1, 64, 8, 8], TensorProto.FLOAT16
        inits.append(onnx.numpy_helper.from_array(np.full((64, 64, 1, 1), 1 / 64, np.float16), "w"))
        for i in range(length):
            nodes.append(helper.make_node("Conv", [f"t{i}", "w"], [f"t{i + 1}"], name=f"n{i}"))
    elif kind == "conv":
        shape = [1, 8, 8, 8]
        inits.append(onnx.numpy_helper.from_array(np.full((8, 8, 1, 1), 0.125, np.float32), "w"))
        for i in range(length):
            nodes.append(helper.make_node("Conv", [f"t{i}", "w"], [f"t{i + 1}"], name=f"n{i}"))
    else:
        shape = [1, 256]
        inits.append(onnx.numpy_helper.from_array(np.full(shape, 1e-3, np.float32), "c"))
        for i in range(length):
            nodes.append(helper.make_node("Add", [f"t{i}", "c"], [f"t{i + 1}"], name=f"n{i}"))
    graph = helper.make_graph(nodes, f"host_{kind}", [helper.make_tensor_value_info("t0", element, shape)],
                              [helper.make_tensor_value_info(f"t{length}", element, shape)], inits)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return model, {"t0": np.ones(shape, np.float16 if element == TensorProto.FLOAT16 else np.float32)}


def _median_run_us(model: onnx.ModelProto, feeds: dict, *, cuda_graph: bool, runs: int = 200) -> float:
    from onnxcampo.runtime import make_session
    from onnxcampo.runtime.timing import BoundRunner

    session = make_session(model, provider="cuda", cuda_graph=cuda_graph, log_severity=3)
    runner = BoundRunner(session, feeds, "cuda", cuda_graph=cuda_graph)
    for _ in range(10):
        runner()
    return float(np.median([runner() for _ in range(runs)]) * 1e6)


def host_samples(facts: dict, done: set[str], library: bool = False) -> Iterator[dict]:
    """Rule 2a: per-launch host time of each class (the library's ops too with ``library``),
    and a replayed run's fixed cost."""
    for kind in HOST_CLASSES + (library_host_classes() if library else ()):
        key = f"host|{kind}|{HOST_CHAIN}"
        if key in done:
            continue
        model, feeds = _chain_model(kind, HOST_CHAIN)
        try:
            plain = _median_run_us(model, feeds, cuda_graph=False)
            replayed = _median_run_us(model, feeds, cuda_graph=True)
        except Exception as exc:  # noqa: BLE001 - recorded (the estimate keeps its default), the run goes on
            log.warning("host probe %s: %s", kind, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            yield {"key": key, "kind": "host_error", "class": kind, "error": f"{type(exc).__name__}: {exc}"[:500], **facts}
            continue
        yield {"key": key, "kind": "host", "class": kind, "launches": HOST_CHAIN, "plain_us": plain,
               "replayed_us": replayed, "us_per_launch": max(plain - replayed, 0.0) / HOST_CHAIN, **facts}
    key = "host|run|1"
    if key not in done:
        model, feeds = _chain_model("other", 1)
        yield {"key": key, "kind": "host", "class": "run", "replayed_us": _median_run_us(model, feeds, cuda_graph=True),
               **facts}


def host_entries(rows: list[dict]) -> dict:
    """The database's ``host_launch`` and ``run_overhead`` from the host rows (rule 2a)."""
    by_class = {row["class"]: row for row in rows if row.get("kind") == "host"}
    out = {}
    if "other" in by_class:
        other = round(by_class["other"]["us_per_launch"], 3)
        conv = round(by_class["conv"]["us_per_launch"], 3) if "conv" in by_class else other
        out["host_launch"] = {"inference": {
            "conv": conv, "other": other, "host": "additive", "samples": len(by_class) - ("run" in by_class),
            "rule": f"(chain of {HOST_CHAIN} small nodes run node by node - the same chain replayed as a CUDA graph) "
                    "/ launches, per class"}}
        for kind in ("conv_fp16", *LIBRARY_HOST_CLASSES):  # fp16 NCHW Conv; the library's calls (ConvNhwc, FusedElementwise)
            if kind in by_class:
                out["host_launch"]["inference"][kind] = round(by_class[kind]["us_per_launch"], 3)
    if "run" in by_class:
        out["run_overhead"] = {"us": round(by_class["run"]["replayed_us"], 3),
                               "rule": "a one-node model replayed as a CUDA graph"}
    return out


# --- d. the FusedElementwise kernel ---------------------------------------------------------

def _fused_model(elements: int, inputs: int, fp16: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray], int]:
    from onnxcampo.ops import nodes
    from onnxcampo.ops.elementwise import Op

    element = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    rows = [(Op.LOAD, 0, 0, 0)]
    for k in range(1, inputs):
        rows += [(Op.LOAD, 1, k, 0), (Op.ADD, 0, 0, 1)]
    if fp16:
        rows.append((Op.ROUND_F16, 0, 0, 0))
    rows.append((Op.STORE, 0, 0, 0))
    names = [f"x{k}" for k in range(inputs)]
    node = nodes.fused_elementwise(names, ["y"], program=[int(v) for row in rows for v in row], registers=2,
                                   output_types=[element], input_types=[element] * inputs, name="fused")
    graph = helper.make_graph([node], "fused", [helper.make_tensor_value_info(n, element, [elements]) for n in names],
                              [helper.make_tensor_value_info("y", element, [elements])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(nodes.DOMAIN, 1)],
                              ir_version=8)
    dtype = np.float16 if fp16 else np.float32
    feeds = {n: np.random.default_rng(k).standard_normal(elements).astype(dtype) for k, n in enumerate(names)}
    moved = (inputs + 1) * elements * (2 if fp16 else 4)
    return model, feeds, moved


def fused_samples(timer: measure.Timer, facts: dict, done: set[str]) -> Iterator[dict]:
    for log2 in FUSED_SIZES:
        for inputs in FUSED_INPUTS:
            for fp16 in (False, True):
                key = f"fused_elementwise|2^{log2}|x{inputs}|{'fp16' if fp16 else 'fp32'}"
                if key in done:
                    continue
                model, feeds, moved = _fused_model(2 ** log2, inputs, fp16)
                timing = timer.time_us(model, feeds)
                yield {"key": key, "kind": "fused_elementwise", "bytes": moved,
                       "time_us": timing.get("kernel_us", timing["wall_us"] - timer.baseline_us), **timing, **facts}


def fused_entry(rows: list[dict]) -> dict | None:
    """``fused_elementwise``: least squares of ``us = fixed_us + bytes / bytes_per_us``."""
    points = [(row["bytes"], row["time_us"]) for row in rows
              if row.get("kind") == "fused_elementwise" and isinstance(row.get("time_us"), (int, float))]
    if len(points) < 4:
        return None
    x = np.array([p[0] for p in points], np.float64)
    y = np.array([p[1] for p in points], np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)
    (fixed, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    if slope <= 0:
        return None
    predicted = design @ np.array([fixed, slope])
    return {"bytes_per_us": round(float(1.0 / slope), 1), "fixed_us": round(max(float(fixed), 0.0), 3),
            "samples": len(points), "mape": round(float(np.mean(np.abs(predicted - y) / np.maximum(y, 1e-9))), 4),
            "measured": True, "source": "costdb calibrate"}


# --- the run ------------------------------------------------------------------------------------

def _ordered(grid: list[measure.Case]) -> list[measure.Case]:
    """Rule 2b then 2c: Casts, Pads and Slices first."""
    first = [case for case in grid if case.op_type in ("Cast", "Pad", "Slice")]
    return first + [case for case in grid if case.op_type not in ("Cast", "Pad", "Slice")]


def _tf32_only(cases: list[measure.Case]) -> list[tuple[measure.Case, str, bool]]:
    return [(case, precision, tf32) for case in cases for precision, tf32 in measure.precisions_of(case) if tf32]


def _progress(total: int):
    """A progress bar on a terminal; disabled (lines instead) when stderr is a file or a pipe."""
    from tqdm import tqdm

    return tqdm(total=total, unit="sample", desc="calibrating", file=sys.stderr, disable=not sys.stderr.isatty(),
                dynamic_ncols=True)


class _Interrupted(Exception):
    def __init__(self, measured: int) -> None:
        super().__init__(measured)
        self.measured = measured


def _drain(streams: list[Iterator[dict]], samples_path: Path, todo: int, budget_s: float,
           say: Callable[[str], None]) -> int:
    """Append the streams' samples to the file, a flushed line each, until they end or the budget
    is spent (rules 3-4); a progress bar on a terminal, a line every 200 samples otherwise."""
    measured, started = 0, time.perf_counter()
    bar = _progress(todo)
    try:
        with samples_path.open("a") as sink, bar:
            for sample in (sample for stream in streams for sample in stream):
                sink.write(json.dumps(sample) + "\n")
                sink.flush()
                measured += 1
                bar.update(1)
                elapsed = time.perf_counter() - started
                if bar.disable and measured % 200 == 0:
                    say(f"calibrating: {measured}/{todo} samples, {elapsed:.0f} s")
                if elapsed > budget_s:
                    break
    except KeyboardInterrupt:
        raise _Interrupted(measured) from None
    return measured


def _fit_line(summary: dict) -> str:
    def percent(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{100 * value:.1f} %"

    return (f"{summary.get('cases', 0)} cases, held-out error {percent('holdout_mape')} (fp16) / "
            f"{percent('holdout_mape_fp32')} (fp32), wrong fp16/fp32 decisions {percent('wrong_decision_rate')}")


def _check_here(provider: str) -> GpuSpec:
    import onnxruntime as ort

    from onnxcampo.costdb.select import detected_spec

    if provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        raise ConfigError("costdb calibrate measures this machine's GPU through ONNX Runtime's CUDA execution "
                          f"provider, and this onnxruntime ({ort.__version__}) has none: install onnxcampo[gpu] "
                          "(onnxruntime-gpu) in an environment without onnxruntime")
    spec = detected_spec()
    if spec is None:
        raise ConfigError("costdb calibrate: no NVIDIA GPU found (neither the CUDA driver nor nvidia-smi answered); "
                          "unset ONNXCAMPO_DEVICE, which overrides the detection")
    return spec


def calibrate(*, budget_s: float = DEFAULT_BUDGET_S, fresh: bool = False, out: Path | None = None, seed: int = 0,
              fused: bool | None = None, say: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
              grid: list[measure.Case] | None = None, chains: list | None = None,
              provider: str = "cuda") -> CalibrationResult:
    """Measure (rules 2-4) and fit (rule 5); ``out`` replaces the per-user database path (the
    samples go beside it). ``fused``: measure FusedElementwise (None: where its kernels are here).
    ``grid`` / ``chains``: the single-op and chain cases (default :func:`measure.default_grid`,
    :func:`onnxcampo.costdb.chains.chain_cases`); ``provider``: "cpu" measures on ONNX Runtime's CPU
    provider (tests of the command's wiring; the host probes need CUDA graphs and are left out)."""
    from onnxcampo import ops, runtime
    from onnxcampo.costdb import select
    from onnxcampo.costdb.fit import fit_database, write_json

    if budget_s <= 0:
        raise ConfigError(f"--budget-s must be positive, got {budget_s}")
    spec = _check_here(provider)
    ort_version, cuda_version = select.runtime_versions()
    database_path = Path(out) if out is not None else select.user_database_path(spec.name, ort_version, cuda_version)
    samples_path = database_path.with_suffix(".jsonl")
    database_path.parent.mkdir(parents=True, exist_ok=True)
    if fresh and samples_path.exists():
        samples_path.unlink()
    rows = read_samples(samples_path)
    done = {row["key"] for row in rows if "key" in row}
    if fused is None:
        fused = ops.generated_kernels_here()
    cases = _ordered(measure.default_grid(seed) if grid is None else grid)
    singles = [item for item in _tf32_only(cases) if measure.sample_key(*item) not in done]

    chains = measure.chain_cases() if chains is None else chains
    chains_left = sum(1 for c in chains for p in ("fp32", "fp16") if f"{c.key}|{p}|tf32=1" not in done)
    fused_left = 0 if not fused else sum(
        1 for log2 in FUSED_SIZES for n in FUSED_INPUTS for p in ("fp32", "fp16")
        if f"fused_elementwise|2^{log2}|x{n}|{p}" not in done)
    host = provider == "cuda"
    host_keys = [f"host|{kind}|{HOST_CHAIN}" for kind in HOST_CLASSES + (library_host_classes() if fused else ())]
    host_left = host * sum(1 for key in (*host_keys, "host|run|1") if key not in done)
    todo = host_left + len(singles) + chains_left + fused_left
    say(f"calibrating {spec.describe()}, onnxruntime {ort_version}, CUDA {cuda_version or 'unknown'}: "
        f"{len(done)} samples kept from earlier runs, {todo} to measure (at most {budget_s:.0f} s); samples in "
        f"{samples_path}")
    if provider == "cuda":
        runtime.preload_cuda_dlls()
    facts = {**measure._device_facts(provider), "cuda_version": cuda_version, "device": spec.name,
             "compute_capability": spec.compute_capability}
    timer = measure.Timer(provider)
    facts["clock"] = "cupti" if timer.kernel_clock is not None else "wall"
    if timer.kernel_clock is None and provider == "cuda":
        say("PyTorch is not installed: times are wall times minus an empty model's, coarser for small kernels than "
            "CUPTI's kernel times (pip install torch to use those)")
    # the fp32 rows without TF32 are not fitted (ORT runs fp32 products on TF32): not measured here
    skip = done | {measure.sample_key(case, p, tf32) for case in cases for p, tf32 in measure.precisions_of(case)
                   if not tf32}
    streams = [host_samples(facts, done, library=fused)] if host else []
    streams += [measure.iter_samples(cases, timer, facts, skip), measure.iter_chain_samples(chains, timer, facts, done)]
    if fused:
        streams.append(fused_samples(timer, facts, done))
    started = time.perf_counter()
    try:
        measured = _drain(streams, samples_path, todo, budget_s, say)
    except _Interrupted as stop:
        say(f"interrupted: {stop.measured} new samples kept in {samples_path} ({len(done) + stop.measured} in all); "
            "run `onnxcampo costdb calibrate` again to resume")
        return CalibrationResult(database_path, samples_path, stop.measured, todo - stop.measured, None)
    rows = read_samples(samples_path)
    left = max(todo - measured, 0)
    try:
        database = fit_database([row for row in rows if "kind" not in row])
    except CostModelError as exc:
        raise CostModelError(f"costdb calibrate: {len(rows)} samples are too few to fit a database yet ({exc}); run "
                             "`onnxcampo costdb calibrate` again to measure more") from None
    database.update(host_entries(rows))
    entry = fused_entry(rows)
    if entry is not None:
        database["fused_elementwise"] = {**entry, "date": dt.date.today().isoformat(), "onnxruntime": ort_version}
    database["device"] = {**database["device"], "name": spec.name, "ort_version": ort_version,
                          "cuda_version": cuda_version, "spec": spec.to_json()}
    database["calibration"] = {"clock": facts["clock"], "samples": len(rows), "cases_left": left,
                               "seconds_this_run": round(time.perf_counter() - started, 1), "seed": seed}
    write_json(database, database_path)
    say(f"wrote {database_path}: {_fit_line(database['summary'])}"
        + (f"; {left} cases left: run `onnxcampo costdb calibrate` again to measure them" if left else "")
        + ("" if out is not None else "; optimize uses it from now on (--device-db still wins)"))
    return CalibrationResult(database_path, samples_path, measured, left, database)


