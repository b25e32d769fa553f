"""``--tune PROVIDER``: the cost model proposes plans, the device picks one.

Campo's plan comes from predicted node times; where the prediction is off (batch-1 models whose
runs are bound by host dispatch, kernels the database has few samples of) the predicted
comparison with fp32 and amp can pick the slower plan. With ``tune`` set, ``optimize`` builds
the candidate plans (campo's own, campo's without Tensor Core padding when it padded, the greedy
amp plan, fp32), runs each on ONNX Runtime with that provider and keeps the fastest, as
TensorRT's builder times its tactics. Identical candidates are timed once.

Timing: every candidate gets its session and warm-up; then rounds of blocks of at least
``BLOCK_MS`` run in turn over the candidates (so a drift of the device's clocks touches all of
them alike) and each candidate's time is the median of its block means. Inference models run
through IO binding (inputs on the device, outputs pre-bound); training steps run in a
:class:`~onnxcampo.training.trainer.Trainer` from the graph's starting weights, one batch
resident, as ``onnxcampo train`` would run them.

A candidate whose outputs (inference) or loss (training) are not finite where fp32's are is
dropped. fp32 is kept unless a mixed candidate is measured at least ``min_gain`` faster: the
same rule the predicted comparison follows, now on measured times.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from onnxcampo import graph as graph_io
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import CampoError, ConfigError

log = logging.getLogger(__name__)

BLOCK_MS = 20.0  # a timed block lasts at least this long
ROUNDS = 7  # blocks per candidate; the median is kept
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
    max_rel_err: float | None = None  # inference: against fp32's outputs on the same inputs
    loss: float | None = None  # training: the loss of the last timed step
    same_as: str | None = None  # an identical candidate timed in its place
    error: str | None = None

    def to_json(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if value is not None and key != "name"}


def candidate_configs(config: OptimizeConfig) -> dict[str, OptimizeConfig]:
    """The plans ``tune`` times, as configurations of an untuned ``optimize``."""
    base = config.replace(tune=None)
    candidates = {"fp32": base.replace(policy="fp32"), "amp": base.replace(policy="amp"),
                  "campo": base.replace(compare_plans=False)}
    if config.pad_tensor_cores:
        candidates["campo-nopad"] = base.replace(compare_plans=False, pad_tensor_cores=False)
    return candidates


def tune(model: onnx.ModelProto, config: OptimizeConfig, optimize: Callable,
         inputs: Mapping[str, np.ndarray] | None = None):
    """Build the candidates with ``optimize`` (the untuned one), time them on ``config.tune``,
    and return the fastest one's result, its report extended with ``tuning``."""
    if config.policy != "campo":
        raise ConfigError(f"--tune chooses among campo's candidate plans; it does not apply to --policy {config.policy}")
    built, results, same, seen = {}, {}, {}, {}
    for name, candidate in candidate_configs(config).items():
        if name == "campo-nopad" and not built["campo"].report.get("pads_inserted"):
            continue  # campo padded nothing: the same graph
        log.info("tune: building the %s candidate", name)
        built[name] = optimize(model, config=candidate)
        key = built[name].model.graph.SerializeToString(deterministic=True)
        if key in seen:
            same[name] = seen[key]
        else:
            seen[key] = name
            results[name] = built[name]
    timed = _measure(results, config, inputs)
    timings = {name: timed.get(name) or Timing(name, same_as=same[name]) for name in candidate_configs(config)
               if name in timed or name in same}
    chosen = choose(timings, config.min_gain)
    result = results[chosen]
    graph_io.set_metadata(result.model, "onnxcampo.policy", "campo")
    report = result.report
    predicted = built["campo"].report.get("predicted_us", {})
    report["policy"] = "campo"
    report["chosen_plan"] = chosen
    report["tuning"] = {
        "provider": config.tune, "chosen": chosen, "block_ms": BLOCK_MS, "rounds": ROUNDS,
        "candidates": {name: {**t.to_json(), **({"predicted_us": predicted[name]["total_us"]} if name in predicted else {})}
                       for name, t in timings.items()},
    }
    report["predicted_us"] = predicted
    report.setdefault("notes", []).append(f"tuned on {config.tune}: {describe(timings)}; keeping {chosen}")
    return result


def choose(timings: Mapping[str, Timing], min_gain: float) -> str:
    """The fastest usable candidate; fp32 unless a mixed one is at least ``min_gain`` faster."""
    usable = {name: t.ms for name, t in timings.items() if t.ms is not None and t.finite and t.error is None}
    if "fp32" not in usable:
        raise CampoError(f"--tune could not time the fp32 model: {timings['fp32'].error or 'non-finite outputs'}")
    fastest = min(usable, key=usable.get)
    if fastest != "fp32" and usable[fastest] > (1 - min_gain) * usable["fp32"]:
        return "fp32"
    return fastest


def describe(timings: Mapping[str, Timing]) -> str:
    parts = []
    for name, t in timings.items():
        if t.same_as:
            parts.append(f"{name} = {t.same_as}")
        elif t.error:
            parts.append(f"{name} failed ({t.error})")
        else:
            parts.append(f"{name} {t.ms:.3f} ms" + ("" if t.finite else " (non-finite)"))
    return ", ".join(parts)


def _measure(results: Mapping, config: OptimizeConfig, inputs: Mapping[str, np.ndarray] | None) -> dict[str, Timing]:
    from onnxcampo.training.scaling import is_train_step

    models = {name: result.model for name, result in results.items()}
    training = is_train_step(models["fp32"])
    make = _training_runner if training else _inference_runner
    timings, runners = {}, {}
    for name, model in models.items():
        try:
            runners[name] = make(model, config, inputs)
            deadline, runs = time.perf_counter() + WARMUP_S, 0
            while runs < WARMUP_RUNS or time.perf_counter() < deadline:
                runners[name].run()
                runs += 1
            timings[name] = Timing(name, runs_per_block=_runs_per_block(runners[name]))
        except Exception as exc:  # an ORT failure of a mixed candidate must not end the tuning
            if name == "fp32":
                raise CampoError(f"--tune could not run the fp32 model on {config.tune}: {exc}") from exc
            log.warning("tune: %s cannot run on %s: %s", name, config.tune, exc)
            timings[name] = Timing(name, error=str(exc))
            runners.pop(name, None)
    blocks = {name: [] for name in runners}
    for round_index in range(ROUNDS):
        order = list(runners)
        order = order[round_index % len(order):] + order[:round_index % len(order)]
        for name in order:
            count = timings[name].runs_per_block
            start = time.perf_counter()
            for _ in range(count):
                runners[name].run()
            blocks[name].append((time.perf_counter() - start) * 1e3 / count)
    reference = runners["fp32"].result() if "fp32" in runners else None
    for name, runner in runners.items():
        timing = timings[name]
        timing.blocks_ms = [round(b, 4) for b in blocks[name]]
        timing.ms = round(statistics.median(blocks[name]), 4)
        runner.judge(timing, reference)
        log.info("tune: %s %.3f ms (%d blocks of %d)", name, timing.ms, ROUNDS, timing.runs_per_block)
    return timings


def _runs_per_block(runner) -> int:
    start = time.perf_counter()
    runner.run()
    once_ms = (time.perf_counter() - start) * 1e3
    return max(1, math.ceil(BLOCK_MS / max(once_ms, 1e-3)))


class _InferenceRun:
    def __init__(self, model: onnx.ModelProto, config: OptimizeConfig, inputs) -> None:
        from onnxcampo.profile import BoundRunner, check_feeds
        from onnxcampo.runtime import make_session, random_inputs

        feeds = inputs if inputs is not None else random_inputs(model, input_shapes=config.input_shapes,
                                                                dim_values=config.dim_values)
        session = make_session(model, provider=config.tune)
        check_feeds(session, feeds)
        self.runner = BoundRunner(session, feeds, "cuda" if config.tune == "cuda" else "cpu")

    def run(self) -> None:
        self.runner()

    def result(self) -> dict[str, np.ndarray]:
        return self.runner.outputs()

    def judge(self, timing: Timing, reference: dict[str, np.ndarray] | None) -> None:
        outputs = self.result()
        timing.finite = _finite(outputs) or reference is None or not _finite(reference)
        if reference is None:
            return
        worst = 0.0
        for name, ref in reference.items():
            if np.issubdtype(ref.dtype, np.floating) and np.isfinite(ref).all():
                scale = float(np.abs(ref).max()) or 1.0
                worst = max(worst, float(np.abs(outputs[name].astype(np.float64) - ref).max()) / scale)
        timing.max_rel_err = round(worst, 6)


def _finite(outputs: Mapping[str, np.ndarray]) -> bool:
    return all(np.isfinite(a).all() for a in outputs.values() if np.issubdtype(a.dtype, np.floating))


def _inference_runner(model, config, inputs) -> _InferenceRun:
    return _InferenceRun(model, config, inputs)


class _TrainingRun:
    def __init__(self, model: onnx.ModelProto, config: OptimizeConfig, inputs) -> None:
        from onnxcampo.runtime import random_inputs
        from onnxcampo.training.step import LABELS
        from onnxcampo.training.trainer import Trainer

        self.trainer = Trainer(model, provider=config.tune)
        if inputs is None:
            inputs = random_inputs(model, input_shapes=config.input_shapes, dim_values=config.dim_values,
                                   only=self.trainer.spec.batch)
            if LABELS in inputs and np.issubdtype(inputs[LABELS].dtype, np.integer):
                inputs[LABELS] = np.zeros_like(inputs[LABELS])  # class 0 exists in every head
        self.batch = {name: inputs[name] for name in self.trainer.spec.batch}
        self.loss = math.nan

    def run(self) -> None:
        self.loss = self.trainer.step(self.batch)

    def result(self) -> float:
        return self.loss

    def judge(self, timing: Timing, reference: float | None) -> None:
        timing.loss = round(self.loss, 6)
        timing.finite = math.isfinite(self.loss) or not (reference is not None and math.isfinite(reference))


def _training_runner(model, config, inputs) -> _TrainingRun:
    return _TrainingRun(model, config, inputs)
