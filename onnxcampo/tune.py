"""``--tune PROVIDER``: the cost model proposes plans, the device picks one.

Campo's plan comes from predicted node times; where the prediction is off (batch-1 models whose
runs are bound by host dispatch, kernels the database has few samples of) the predicted
comparison with fp32 and amp can pick the slower plan. With ``tune`` set, ``optimize`` builds
the candidate plans (all-fp16: every op that may run fp16, campo's own, campo's without Tensor
Core padding when it padded, the greedy amp plan, fp32), runs each on ONNX Runtime with that
provider and keeps the fastest, as TensorRT's builder times its tactics. Identical candidates
are timed once. Each runs as ``config.execution`` says the model will: ``cuda-graph`` sessions
capture the run once and replay it (:class:`~onnxcampo.runtime.timing.BoundRunner`; provider
cuda only).

Timing: each candidate runs in its own session, one session alive at a time (as the model will
run; sessions side by side in one process slowed host-bound runs by up to 60 % on the H200): a
warm-up, then ``BLOCKS`` blocks of at least ``BLOCK_MS``; that twice (``PASSES``), in fresh
sessions and rotated order, since a session's start (cuDNN's algorithm search, memory layout)
moves small runs by more than the blocks of one session do. A candidate's time is the median of
all its block means. Inference models run through IO binding (inputs on the device, outputs
pre-bound); training steps run in a :class:`~onnxcampo.training.trainer.Trainer` from the
graph's starting weights, on one batch, as ``onnxcampo train`` runs them.

Dropped: a candidate whose outputs (inference) or loss (training) are not finite where fp32's
are, and (inference only) one whose outputs fail the accuracy criterion against the fp32 plan's
on the same inputs: :mod:`onnxcampo.accuracy`, the criterion ``--validate`` and the accuracy
guard use, ``tune_tolerance`` (default: relative L2 error ||out - ref|| / ||ref|| <= 0.01 per
float output, integer outputs at most 1 % of elements differing). Training
candidates are judged by a finite loss only: their losses come after different numbers of steps. fp32 is kept unless a mixed candidate is measured at least ``min_gain`` faster: the
same rule the predicted comparison follows, now on measured times.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from onnxcampo import ir
from onnxcampo import pipeline
from onnxcampo.accuracy import Criterion, evaluate
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import CampoError, ConfigError, option
from onnxcampo.runtime.compare import worst_error
from onnxcampo.runtime.timing import bound_runner, runs_per_block, time_block, warm_up

log = logging.getLogger(__name__)

BLOCK_MS = 20.0  # a timed block lasts at least this long
BLOCKS = 5  # timed blocks per candidate and pass
PASSES = 2  # fresh sessions per candidate; the median over all their blocks is kept
WARMUP_S = 0.2  # warm-up per candidate (at least WARMUP_RUNS runs)
WARMUP_RUNS = 3


@dataclass
class Timing:
    """One candidate's measurement."""

    name: str
    ms: float | None = None  # median block mean, per run (inference) or step (training)
    blocks_ms: list[float] | None = None
    runs_per_block: int = 0
    finite: bool = True
    rel_err: float | None = None  # inference: the worst relative L2 error against fp32's outputs on the same inputs
    accurate: bool | None = None  # inference: passes the accuracy criterion (onnxcampo.accuracy)
    accuracy: dict | None = None  # inference: the criterion's verdict (per-output statistics)
    loss: float | None = None  # training: the loss of the last timed step (not compared: the
    # candidates ran different numbers of steps; a non-finite loss drops the candidate)
    same_as: str | None = None  # an identical candidate timed in its place
    error: str | None = None

    def to_json(self) -> dict:
        if self.same_as:
            return {"same_as": self.same_as}
        return {key: value for key, value in self.__dict__.items() if value is not None and key != "name"}


def candidate_configs(config: OptimizeConfig) -> dict[str, OptimizeConfig]:
    """The plans ``tune`` times, as configurations of an untuned ``optimize``."""
    base = config.replace(tune=None)
    # fp32 first: its outputs are the others' reference. fp16 last: a graph it shares with amp or
    # campo is timed (and chosen) under their name. It keeps keep_io_types as given (Casts at the I/O).
    candidates = {"fp32": base.replace(policy="fp32"), "amp": base.replace(policy="amp"),
                  "campo": base.with_experimental(compare_plans=False)}
    if config.experimental.pad_tensor_cores:
        candidates["campo-nopad"] = base.with_experimental(compare_plans=False, pad_tensor_cores=False)
    candidates["fp16"] = base.replace(policy="fp16")
    return candidates


def tune(model: onnx.ModelProto, config: OptimizeConfig,
         inputs: Mapping[str, np.ndarray] | None = None, source=None):
    """Build the candidates with the untuned pipeline (``pipeline.run``), time them on ``config.tune``,
    and return the fastest one's result, its report extended with ``tuning``. ``source``: the
    input model's path, for the report."""
    from onnxcampo.runtime import require_provider

    if config.policy != "campo":
        raise ConfigError(f"{option('tune')} chooses among campo's candidate plans; it does not apply to "
                          f"{option('policy', config.policy)}")
    if config.execution == "cuda-graph" and config.tune != "cuda":
        raise ConfigError(f"{option('execution', 'cuda-graph')} replays on the CUDA EP: tune with {option('tune', 'cuda')}, "
                          f"not {config.tune}")
    require_provider(config.tune)  # no GPU, no onnxruntime-gpu: say so before building anything
    if inputs is not None:
        _check_inputs(model, inputs)
        for name, dims in config.input_shapes.items():
            if name in inputs and tuple(np.shape(inputs[name])) != tuple(dims):
                log.warning("the tuning input %s has shape %s, the plans were costed for %s: the candidates are "
                            "timed on the given shape", name, list(np.shape(inputs[name])), list(dims))
    from onnxcampo.rewrites import transformer

    # ORT's transformer fusions once, not once per candidate: every candidate plans the fused graph
    model, fused = transformer.fuse_transformer(model, config)
    built, results, same, seen = {}, {}, {}, {}
    for name, candidate in candidate_configs(config.replace(fuse="none")).items():
        if name == "campo-nopad" and not built["campo"].report.get("pads_inserted"):
            continue  # campo padded nothing: the same graph
        log.info("building the %s candidate", name)
        # a calibrating candidate calibrates on the same inputs it is timed on
        built[name] = pipeline.run(model, candidate, inputs if candidate.activation_limit is not None else None)
        key = ir.graph_key(built[name].model.graph)  # the same computation, whatever the doc_strings say
        if key in seen:
            same[name] = seen[key]
        else:
            seen[key] = name
            results[name] = built[name]
    if list(results) == ["fp32"]:  # every plan is the fp32 graph: nothing to choose, nothing to time
        log.info("every candidate is the fp32 graph: nothing to time")
        timed = {"fp32": Timing("fp32")}
    else:
        timed = _measure(results, config, inputs)
    timings = {name: timed.get(name) or Timing(name, same_as=same[name]) for name in built}
    chosen = "fp32" if len(results) == 1 else choose(timings, config.min_gain)
    result = results[chosen]
    ir.set_metadata(result.model, "onnxcampo.policy", "campo")
    report = result.report
    predicted = built["campo"].report.get("predicted_us", {})
    report["policy"] = "campo"
    report["chosen_plan"] = chosen
    report["fuse"] = fused
    report["tuning"] = {
        "provider": config.tune, "execution": config.execution, "chosen": chosen,
        "tolerance": str(Criterion.parse(config.tune_tolerance)),
        "error_measure": "onnxcampo.accuracy criterion; rel_err: the worst relative L2 error",
        "block_ms": BLOCK_MS, "blocks": BLOCKS, "passes": PASSES,
        "candidates": {name: {**t.to_json(), **({"predicted_us": predicted[name]["total_us"]} if name in predicted else {})}
                       for name, t in timings.items()},
    }
    host = _host_on_this_machine(results["fp32"].model, timings["fp32"], config, inputs, report)
    if host is not None:
        report["tuning"]["host"] = host
    report["predicted_us"] = predicted
    report["plans"] = built["campo"].report.get("plans", report.get("plans"))
    report["input"] = str(source) if source else report.get("input")
    mode = "" if config.execution == "plain" else f" ({config.execution})"
    report.setdefault("notes", []).append(f"tuned on {config.tune}{mode}: {describe(timings)}; "
                                          f"keeping {chosen}")
    return result


HOST_DRIFT = 0.25  # a measured per-launch host time this far from the database's is worth a warning


def host_per_launch(plain_ms: float, replayed_ms: float, launches: int) -> float | None:
    """Host time per kernel launch (us) of this machine: what a run node by node costs over the
    same kernels replayed as a CUDA graph, over the launches ORT makes (``costdb.fit.fit_host_launch``
    fits the database's figure the same way from benchmark rows)."""
    if launches <= 0 or not plain_ms > 0 or not replayed_ms > 0:
        return None
    return max(1e3 * (plain_ms - replayed_ms), 0.0) / launches


def _host_on_this_machine(model: onnx.ModelProto, fp32: Timing, config: OptimizeConfig, inputs,
                          report: dict) -> dict | None:
    """The host term measured again where the model will run (host speed differed ~40 % between
    two H200 machines of the benchmark): inference on CUDA, plain execution only; the fp32 candidate is
    timed once more replayed as a CUDA graph. None where that does not apply or fails (a model
    CUDA graphs cannot capture, e.g. with CPU-placed nodes)."""
    from onnxcampo.costdb.select import load_cost_model
    from onnxcampo.errors import CampoError
    from onnxcampo.runtime.optimized import executed_graph
    from onnxcampo.training.scaling import is_train_step

    if config.tune != "cuda" or config.execution != "plain" or fp32.ms is None or is_train_step(model):
        return None
    runner = None
    try:
        runner = _InferenceRun(model, config.replace(execution="cuda-graph"), inputs)
        _warm_up(runner)
        replayed_ms = statistics.median(_blocks(runner, _runs_per_block(runner)))
        launches = sum(executed_graph(model, provider="cuda", level="all").launches().values())
    except CampoError as exc:
        log.info("host time per launch not measured: %s", str(exc).splitlines()[0])
        return None
    finally:
        runner = None
        gc.collect()
    measured = host_per_launch(fp32.ms, replayed_ms, launches)
    if measured is None:
        return None
    database = load_cost_model(config.device_db).launch_us("other")
    host = {"fp32_ms": fp32.ms, "fp32_replayed_ms": round(replayed_ms, 4), "launches": launches,
            "us_per_launch": round(measured, 3), "database_us_per_launch": round(database, 3)}
    if database > 0 and abs(measured / database - 1) > HOST_DRIFT:
        report.setdefault("notes", []).append(
            f"this machine's host takes {measured:.2f} us a launch, the cost database {database:.2f} us: predicted "
            "times of plans with many launches (batch 1) are off by that much; the tuned choice is measured")
    return host


def _check_inputs(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray]) -> None:
    """The given inputs name the model's inputs (a training step's: its batch), no more, no less."""
    from onnxcampo.runtime import graph_inputs
    from onnxcampo.training.scaling import is_train_step
    from onnxcampo.training.step import step_spec

    training = is_train_step(model)
    expected = set(step_spec(model).batch) if training else {vi.name for vi in graph_inputs(model)}
    missing, unknown = sorted(expected - set(inputs)), sorted(set(inputs) - expected)
    if missing or unknown:
        raise ConfigError(f"tune inputs do not match the model's {'batch' if training else 'inputs'}: "
                          f"missing {missing}, unknown {unknown}")


def choose(timings: Mapping[str, Timing], min_gain: float, tolerance: float = math.inf) -> str:
    """The fastest usable candidate (timed, finite, not failing the accuracy criterion, and with
    ``tolerance``, its relative L2 error within it); fp32 unless a mixed one is at least
    ``min_gain`` faster."""
    usable = {name: t.ms for name, t in timings.items()
              if t.ms is not None and t.finite and t.error is None and t.accurate is not False
              and (t.rel_err or 0.0) <= tolerance}
    if "fp32" not in usable:
        raise CampoError(f"{option('tune')} could not time the fp32 model: {timings['fp32'].error or 'non-finite outputs'}")
    fastest = min(usable, key=usable.get)
    if fastest != "fp32" and usable[fastest] > (1 - min_gain) * usable["fp32"]:
        return "fp32"
    return fastest


def describe(timings: Mapping[str, Timing], tolerance: float = math.inf) -> str:
    parts = []
    for name, t in timings.items():
        if t.same_as:
            parts.append(f"{name} = {t.same_as}")
        elif t.error:
            parts.append(f"{name} failed ({t.error})")
        elif t.ms is None:
            parts.append(f"{name} not timed")
        else:
            off = (t.rel_err is not None and t.rel_err > tolerance) or t.accurate is False
            parts.append(f"{name} {t.ms:.3f} ms" + ("" if t.finite else " (non-finite)")
                         + (f" (inaccurate: rel L2 {t.rel_err:.2g})" if off and t.rel_err is not None else
                            " (inaccurate)" if off else ""))
    return ", ".join(parts)


def _measure(results: Mapping, config: OptimizeConfig, inputs: Mapping[str, np.ndarray] | None) -> dict[str, Timing]:
    """Time every candidate in ``PASSES`` fresh sessions, one session alive at a time (as the
    model will run: sessions side by side in one process slowed host-bound runs by up to 60 %
    on the H200), the order rotated per pass; each pass gives ``BLOCKS`` blocks."""
    from onnxcampo.training.scaling import is_train_step

    models = {name: result.model for name, result in results.items()}
    make = _TrainingRun if is_train_step(models["fp32"]) else _InferenceRun
    timings = {name: Timing(name, blocks_ms=[]) for name in models}
    reference = None
    for index in range(PASSES):
        # rotated per pass; the first pass keeps candidate_configs' order, fp32 first: its outputs
        # are the others' reference
        names = list(models)[index % len(models):] + list(models)[:index % len(models)]
        for name in names:
            timing = timings[name]
            if timing.error:
                continue
            log.info("timing %s (session %d of %d)", name, index + 1, PASSES)
            try:
                runner = make(models[name], config, inputs)
                _warm_up(runner)
                timing.runs_per_block = timing.runs_per_block or _runs_per_block(runner)
                timing.blocks_ms += _blocks(runner, timing.runs_per_block)
                if index == 0:
                    runner.judge(timing, reference)
                    if name == "fp32":
                        reference = runner.result()
            except Exception as exc:  # an ORT failure of a mixed candidate must not end the tuning
                if name == "fp32":
                    raise CampoError(f"{option('tune')} could not run the fp32 model on {config.tune}: {exc}") from exc
                log.warning("%s cannot run on %s: %s", name, config.tune, exc)
                timing.error = str(exc)
            finally:
                runner = None
                gc.collect()  # the session and its device buffers go before the next one
    for timing in timings.values():
        if timing.error:
            timing.blocks_ms = None
            continue
        timing.blocks_ms = [round(b, 4) for b in timing.blocks_ms]
        timing.ms = round(statistics.median(timing.blocks_ms), 4)
        log.info("%s %.3f ms (%d blocks of %d runs)", timing.name, timing.ms, len(timing.blocks_ms),
                 timing.runs_per_block)
    return timings


def _warm_up(runner) -> None:
    warm_up(runner.run, seconds=WARMUP_S, runs=WARMUP_RUNS)


def _blocks(runner, count: int) -> list[float]:
    return [time_block(runner.run, count) for _ in range(BLOCKS)]


def _runs_per_block(runner) -> int:
    start = time.perf_counter()
    runner.run()
    return runs_per_block(time.perf_counter() - start, BLOCK_MS)


class _InferenceRun:
    def __init__(self, model: onnx.ModelProto, config: OptimizeConfig, inputs) -> None:
        from onnxcampo.runtime import feeds_for, random_inputs

        # given inputs are fp32 where the model was; a candidate with fp16 inputs gets them cast
        feeds = feeds_for(model, inputs) if inputs is not None else random_inputs(
            model, input_shapes=config.input_shapes, dim_values=config.dim_values)
        self.runner = bound_runner(model, feeds, provider=config.tune, execution=config.execution)
        self.criterion = Criterion.parse(config.tune_tolerance)

    def run(self) -> None:
        self.runner()

    def result(self) -> dict[str, np.ndarray]:
        return self.runner.outputs()

    def judge(self, timing: Timing, reference: dict[str, np.ndarray] | None) -> None:
        if reference is None:  # fp32 itself
            return
        verdict = evaluate(reference, self.result(), self.criterion)
        timing.rel_err = output_error(reference, self.result())
        timing.finite = timing.rel_err is None or math.isfinite(timing.rel_err)
        timing.accurate = verdict.ok
        timing.accuracy = verdict.to_json()


# the relative L2 error reported beside the verdict: the worst over the outputs, integer outputs the share differing
output_error = worst_error


class _TrainingRun:
    def __init__(self, model: onnx.ModelProto, config: OptimizeConfig, inputs) -> None:
        from onnxcampo.runtime import random_inputs
        from onnxcampo.training.step import LABELS
        from onnxcampo.training.trainer import Trainer

        self.trainer = Trainer(model, provider=config.tune, cuda_graph=config.execution == "cuda-graph")
        if inputs is None:
            inputs = random_inputs(model, input_shapes=config.input_shapes, dim_values=config.dim_values,
                                   only=self.trainer.spec.batch)
            if LABELS in inputs and np.issubdtype(inputs[LABELS].dtype, np.integer):
                inputs[LABELS] = np.zeros_like(inputs[LABELS])  # class 0 exists in every head
        self.batch = {name: inputs[name] for name in self.trainer.spec.batch}
        self.loss = math.nan

    def run(self) -> None:
        self.loss = float(self.trainer.step(self.batch))  # waits for the step: a run's time is the step's

    def result(self) -> float:
        return self.loss

    def judge(self, timing: Timing, reference: float | None) -> None:
        timing.loss = round(self.loss, 6)
        timing.finite = math.isfinite(self.loss) or not (reference is not None and math.isfinite(reference))
