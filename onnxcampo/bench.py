"""``onnxcampo bench MODEL.onnx``: the precision policies side by side on ONNX Runtime.

1. the model is optimized under each policy (:func:`onnxcampo.optimize` with ``policy``,
   ``execution`` and the shape pins on top of ``config``: the cost database, padding, the cost
   graph and ORT fusion are the same for every policy), fp32 always among them: it is the
   reference;
2. each optimized model gets a session and a :class:`~onnxcampo.runtime.timing.BoundRunner` on
   the same inputs (``inputs``, else random ones), in the ``execution`` mode (``cuda-graph``:
   captured once and replayed; provider cuda only);
3. all sessions stay alive and are timed in rotation in this one process
   (:func:`~onnxcampo.runtime.timing.time_in_rotation`): the median of each policy's block means,
   and their spread;
4. each policy's outputs are judged against fp32's by the one criterion ``--validate``,
   ``--tune`` and the accuracy guard use (:mod:`onnxcampo.accuracy`; default relative L2 error
   <= 0.01 per output): ``rel_err`` is the worst relative L2 error, ``within_tolerance`` the
   verdict, ``accuracy`` the per-output statistics.

A policy that cannot be built or run is reported with its error and the others go on; fp32
failing ends the bench.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxcampo import ir
from onnxcampo.config import EXECUTION_MODES, POLICIES, OptimizeConfig
from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.accuracy import DEFAULT_CRITERION, Criterion, evaluate
from onnxcampo.runtime.compare import worst_error
from onnxcampo.runtime.timing import BLOCK_MS, ROUNDS, BlockTimes, bound_runner, time_in_rotation

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_POLICIES", "BenchResult", "PolicyResult", "bench", "parse_policies"]

DEFAULT_POLICIES = ("fp32", "fp16", "amp", "campo")
REFERENCE = "fp32"
PROVIDERS = ("cuda", "cpu")


@dataclass
class PolicyResult:
    """One policy's model, timed and compared with fp32's outputs."""

    name: str
    times: BlockTimes | None = None
    rel_err: float | None = None
    accuracy: object | None = None  # onnxcampo.accuracy.Verdict against fp32's outputs
    casts: int | None = None  # Casts the policy inserted
    nodes_fp16: int | None = None
    chosen_plan: str | None = None  # campo may keep the fp32 or amp plan (the report's chosen_plan)
    error: str | None = None

    @property
    def accurate(self) -> bool:
        return self.accuracy is None or self.accuracy.ok

    @property
    def ms(self) -> float | None:
        return self.times.median_ms if self.times is not None and self.error is None else None

    def to_json(self, reference_ms: float | None, tolerance=None) -> dict:
        if self.error is not None:
            return {"error": self.error}
        row = dict(self.times.to_json())
        row["speedup"] = round(reference_ms / self.ms, 4) if reference_ms and self.ms else None
        row["rel_err"] = self.rel_err
        row["within_tolerance"] = self.accurate
        if self.accuracy is not None:
            row["accuracy"] = self.accuracy.to_json()
        row["casts"] = self.casts
        row["nodes_fp16"] = self.nodes_fp16
        if self.chosen_plan is not None:
            row["chosen_plan"] = self.chosen_plan
        return row


@dataclass
class BenchResult:
    """The bench of one model: every policy's result and how it was measured."""

    model: str | None
    provider: str
    execution: str
    rounds: int
    block_ms: float
    inputs: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dim_values: dict[str, int] = field(default_factory=dict)
    policies: dict[str, PolicyResult] = field(default_factory=dict)
    tolerance: Criterion = DEFAULT_CRITERION
    config: OptimizeConfig = field(default_factory=OptimizeConfig)  # what every policy was optimized with

    def to_json(self) -> dict:
        import onnxruntime as ort

        from onnxcampo import __version__

        reference = self.policies[REFERENCE].ms
        return {
            "model": self.model, "provider": self.provider, "execution": self.execution,
            "onnxruntime": ort.__version__, "onnxcampo": __version__,
            "rounds": self.rounds, "block_ms": self.block_ms, "inputs": self.inputs,
            "input_shapes": {name: list(dims) for name, dims in self.input_shapes.items()},
            "dim_values": dict(self.dim_values), "reference": REFERENCE, "tolerance": str(self.tolerance),
            "plan_options": {"device_db": str(self.config.device_db) if self.config.device_db else None,
                             "fuse": self.config.fuse, "experimental": self.config.experimental.changed()},
            "error_measure": "rel_err: relative L2 against fp32's outputs (integer outputs: share differing), worst "
                             "output; within_tolerance: the onnxcampo.accuracy criterion (tolerance)",
            "policies": {name: p.to_json(reference, self.tolerance) for name, p in self.policies.items()},
        }

    def table(self) -> str:
        """The human table: policy, median ms, spread, speed-up over fp32, rel err, Casts."""
        reference = self.policies[REFERENCE].ms
        head = (f"{self.model or 'model'}: {self.provider}, {self.execution}, {self.rounds} rounds of >= "
                f"{self.block_ms:g} ms blocks in rotation, inputs {self.inputs}")
        rows = [("policy", "median ms", "spread (min-max)", "vs fp32", "rel err", "Casts")]
        for name, p in self.policies.items():
            if p.error is not None:
                rows.append((name, "failed", p.error.splitlines()[0][:100], "", "", ""))
                continue
            t = p.times
            err = "-" if name == REFERENCE else "n/a" if p.rel_err is None else f"{p.rel_err:.2e}"
            if not p.accurate:
                err += f" (fails {self.tolerance.describe()})"
            plan = f" ({p.chosen_plan} plan)" if p.chosen_plan not in (None, name) else ""
            rows.append((name + plan, f"{t.median_ms:.4g}", f"{t.min_ms:.4g}-{t.max_ms:.4g}",
                         f"{reference / t.median_ms:.2f}x", err, str(p.casts)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [head]
        for row in rows:
            cells = [cell.ljust(w) if i in (0, 2, 4) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)


def parse_policies(text: str | Iterable[str]) -> tuple[str, ...]:
    """``fp32,fp16,amp,campo`` -> the policies in that order, fp32 first (added when left out:
    it is the reference); an unknown name is a ConfigError."""
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else [n.strip() for n in text]
    names = [n for n in names if n]
    if not names:
        raise ConfigError(f"--policies is empty; name some of {', '.join(POLICIES)}")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise ConfigError(f"--policies: unknown policy {unknown[0]!r}; choose from {', '.join(POLICIES)}")
    ordered = dict.fromkeys([REFERENCE, *names])
    if REFERENCE not in names:
        log.info("fp32 is timed too: it is the reference")
    return tuple(ordered)


def _pins_from_inputs(model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]],
                      dim_values: Mapping[str, int], inputs: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Pin the dynamic dims of the given inputs to their shapes, where no pin of the user does."""
    pins = dict(input_shapes)
    for vi in ir.graph_inputs(model):
        if vi.name in pins or vi.name not in inputs or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        open_dims = [d for d in dims if not (d.HasField("dim_value") and d.dim_value >= 0)
                     and not (d.HasField("dim_param") and d.dim_param in dim_values)]
        if open_dims and np.ndim(inputs[vi.name]) == len(dims):
            pins[vi.name] = tuple(int(d) for d in np.shape(inputs[vi.name]))
    return pins


def bench(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    policies: str | Iterable[str] = DEFAULT_POLICIES,
    provider: str = "cuda",
    execution: str = "plain",
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    dim_values: Mapping[str, int] | None = None,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    rounds: int = ROUNDS,
    block_ms: float = BLOCK_MS,
    tolerance: Criterion | str | float | None = None,
    config: OptimizeConfig | None = None,
) -> BenchResult:
    """Optimize ``model`` under each of ``policies``, time the results side by side in rotation
    on ``provider`` in the ``execution`` mode and compare their outputs with fp32's (see the
    module's numbered steps). ``inputs``: an ``.npz`` path or arrays (default: random, from the
    shapes and pins). ``tolerance``: the accuracy criterion (:class:`~onnxcampo.accuracy.Criterion` or its text; default
    relative L2 <= 0.01), which only marks the policies that fail it. ``config``:
    the options every policy is optimized with (``device_db``, ``fuse``, ``experimental``, ...);
    its policy, execution and pins are replaced by the bench's."""
    from onnxcampo.api import optimize
    from onnxcampo.runtime import feeds_for, load_inputs_npz, random_inputs, require_provider

    names = parse_policies(policies)
    if provider not in PROVIDERS:
        raise ConfigError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if execution not in EXECUTION_MODES:
        raise ConfigError(f"unknown execution mode {execution!r}; choose one of {', '.join(EXECUTION_MODES)}")
    if execution == "cuda-graph" and provider != "cuda":
        raise ConfigError(f"--execution cuda-graph needs --provider cuda: CUDA graphs replay on the CUDA EP, "
                          f"not on {provider}")
    if rounds < 1 or not block_ms > 0:
        raise ConfigError(f"need --rounds >= 1 and --block-ms > 0, got {rounds} and {block_ms}")
    require_provider(provider)  # no GPU, no onnxruntime-gpu: say so before optimizing anything
    config = config or OptimizeConfig()
    original, source = ir.read_model(model)
    input_shapes, dim_values = dict(input_shapes or {}), dict(dim_values or {})
    if inputs is None:
        feeds, described = random_inputs(original, input_shapes=input_shapes, dim_values=dim_values), "random"
    elif isinstance(inputs, Mapping):
        feeds, described = dict(inputs), "given"
    else:
        feeds, described = load_inputs_npz(inputs, original), str(inputs)
    input_shapes = _pins_from_inputs(original, input_shapes, dim_values, feeds)

    results = {name: PolicyResult(name) for name in names}
    runners = {}
    for name in names:
        result = results[name]
        try:
            log.info("optimizing under %s", name)
            built = optimize(original, config=config, accuracy="off", policy=name, execution=execution,
                             input_shapes=input_shapes, dim_values=dim_values)
            report = built.report
            result.casts, result.nodes_fp16 = report.get("casts_inserted"), report.get("nodes_fp16")
            result.chosen_plan = report.get("chosen_plan") if name == "campo" else None
            log.info("building the %s session (%s, %s)", name, provider, execution)
            runners[name] = bound_runner(built.model, feeds_for(built.model, feeds), provider=provider,
                                         execution=execution)
        except CampoError as exc:
            if name == REFERENCE:
                raise
            log.warning("%s: %s", name, exc)
            result.error = str(exc)
    timed = time_in_rotation(runners, rounds=rounds, block_ms=block_ms)
    if timed[REFERENCE].error is not None:
        raise CampoError(f"the fp32 model failed on {provider}: {timed[REFERENCE].error}")
    reference = runners[REFERENCE].outputs()
    for name, times in timed.items():
        result = results[name]
        result.times = times
        if times.error is not None:
            result.error = times.error
            continue
        if name == REFERENCE:
            result.rel_err = 0.0
            continue
        outputs = runners[name].outputs()
        result.rel_err = worst_error(reference, outputs)
        result.accuracy = evaluate(reference, outputs, Criterion.parse(tolerance), inputs="given")
    return BenchResult(model=str(source) if source else None, provider=provider, execution=execution, rounds=rounds,
                       block_ms=block_ms, inputs=described, input_shapes=input_shapes, dim_values=dim_values,
                       policies=results, tolerance=Criterion.parse(tolerance), config=config)


def write_json(result: BenchResult, path: str | os.PathLike) -> None:
    """The bench's JSON, written atomically."""
    import json

    ir.write_text_atomically(Path(path), json.dumps(result.to_json(), indent=1) + "\n")
