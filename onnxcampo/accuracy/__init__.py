"""One accuracy criterion, shared by ``--validate``, ``--tune``, the accuracy guard and the benchmark.

A candidate model (mixed fp16/fp32) is judged against the fp32 model on the same inputs, per
output, from :class:`OutputStats` (the statistics Polygraphy's ``--check-error-stat`` reads):

1. float outputs: over the elements where the reference is finite, the mean, median, 99th
   percentile and maximum of the absolute error ``|c - r|`` and of the relative error
   ``|c - r| / |r|`` (taken where ``|r|`` exceeds ``1e-6 * max |r|``, so that zeros in the
   reference do not make it infinite), and the relative L2 error ``||c - r|| / ||r||``
   (a reference of zeros only: the RMS of ``c - r``). Every statistic is ``inf`` when the
   candidate is not finite where the reference is (an fp16 overflow is a failed conversion,
   not a large error). Reference elements that are not finite are left out and counted;
2. integer and bool outputs: ``mismatch``, the share of elements that differ (an arg-max that
   moved);
3. a missing output or one whose shape changed fails whatever the bounds.

A :class:`Criterion` bounds some of the statistics (every bound must hold, per output). The
default, :data:`DEFAULT_CRITERION`, is ``rel_l2 <= 0.01`` (and ``mismatch <= 0.01``), chosen
from measured fp16 models that are as good as the anchors (onnxconverter-common's fp16
converter, ORT's transformers fp16 conversion, TensorFlow-style AMP): on the H200, against fp32
without TF32, their relative L2 error is 0.06-0.21 % on ResNet-50, BERT, GPT-2 and MiniLM and
0.5 % on the PP-PicoDet layout model (docs/benchmarks/raw/h200.jsonl ``output_error``); the
four corpus models an element-wise ``rtol 0.02 / atol 1e-3`` rejected are within 0.61 %; the
PP-OCR detector, off by 1.4-7.8 % under amp and all-fp16, fails (TF32 alone moves it by
1.1-1.7 %: it is a sensitive model, and fp32 is the right answer for it). An element-wise bound
(``max_abs``, ``max_rel``) rejects models whose outputs include values near zero; relative L2
weighs the difference's energy against the signal's, so no single element decides.

``Criterion.parse`` reads the ``--tolerance`` syntax: ``0.02`` (a relative L2 bound) or
``rel_l2=0.01,p99_abs=1e-3,...``. :func:`evaluate` judges a candidate's outputs;
:class:`Verdict` carries the per-output statistics, what failed, and the tolerance that would
have passed (``needed``: for each bounded statistic, the worst value over the outputs).

Where the models run: the checks run on ONNX Runtime (the CPU provider by default). ORT's CPU
provider has few fp16 kernels: it runs most fp16 nodes in fp32 between Casts, so what it shows
is the rounding of fp16 *tensors* (overflow to inf included), not fp16 arithmetic inside a
kernel (accumulation in a MatMul). A model that passes on CPU can be further off on a GPU;
``--provider cuda`` checks what the GPU computes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CRITERION",
    "STATISTICS",
    "Criterion",
    "OutputStats",
    "OutputVerdict",
    "Verdict",
    "evaluate",
    "output_stats",
]

# the statistics a criterion may bound; for float outputs all of them, for integer ones mismatch
FLOAT_STATISTICS = ("mean_abs", "median_abs", "p99_abs", "max_abs",
                    "mean_rel", "median_rel", "p99_rel", "max_rel", "rel_l2")
STATISTICS = (*FLOAT_STATISTICS, "mismatch")
REL_FLOOR = 1e-6  # relative errors are taken where |r| > REL_FLOOR * max |r|

_LABELS = {"rel_l2": "rel L2", "max_abs": "max abs", "max_rel": "max rel", "p99_abs": "p99 abs",
           "p99_rel": "p99 rel", "mean_abs": "mean abs", "mean_rel": "mean rel", "median_abs": "median abs",
           "median_rel": "median rel", "mismatch": "share differing"}


# --------------------------------------------------------------------------------------------
# Statistics of one output
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputStats:
    """How far one candidate output is from the reference (the module's numbered cases).

    ``values``: statistic name -> value (float outputs: :data:`FLOAT_STATISTICS`; others:
    ``mismatch``); empty when nothing could be compared (``note`` says why). ``compared``:
    elements compared; ``reference_nonfinite``: reference elements left out (NaN/inf);
    ``candidate_nonfinite``: candidate elements not finite where the reference is.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    values: Mapping[str, float] = field(default_factory=dict)
    compared: int = 0
    reference_nonfinite: int = 0
    candidate_nonfinite: int = 0
    note: str = ""
    broken: bool = False  # missing, or its shape changed: fails whatever the bounds
    # where the largest absolute error is (a candidate's first non-finite value, if any): its
    # index in the output and the two values there
    worst_at: tuple[int, ...] | None = None
    worst_values: tuple[float, float] | None = None

    @property
    def kind(self) -> str:
        return "float" if "rel_l2" in self.values else "exact" if "mismatch" in self.values else "none"

    def get(self, statistic: str) -> float | None:
        return self.values.get(statistic)

    def to_json(self) -> dict:
        row = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               **{key: _json_float(value) for key, value in self.values.items()}, "compared": self.compared}
        if self.reference_nonfinite:
            row["reference_nonfinite"] = self.reference_nonfinite
        if self.candidate_nonfinite:
            row["candidate_nonfinite"] = self.candidate_nonfinite
        if self.note:
            row["note"] = self.note
        if self.worst_at is not None:
            row["worst_at"] = list(self.worst_at)
            row["worst_reference"], row["worst_candidate"] = (_json_float(v) for v in self.worst_values)
        return row

    def worst_text(self) -> str:
        """``largest error at [3, 17]: 1.25 (reference) against 1.2617``, or ``""``."""
        if self.worst_at is None:
            return ""
        ref, got = self.worst_values
        return f"largest error at {list(self.worst_at)}: {ref:.6g} (reference) against {got:.6g}"


def _json_float(value: float) -> float | str:
    """JSON has no inf: written as the string "inf"."""
    return value if math.isfinite(value) else str(value)


def output_stats(name: str, reference: np.ndarray, candidate: np.ndarray | None) -> OutputStats:
    """The statistics of one output (see the module's numbered cases), computed in float64."""
    ref = np.asarray(reference)
    shape, dtype = tuple(ref.shape), str(ref.dtype)
    if candidate is None:
        return OutputStats(name, shape, dtype, note="missing from the candidate", broken=True)
    out = np.asarray(candidate)
    if out.shape != ref.shape:
        return OutputStats(name, shape, dtype, note=f"shape {tuple(out.shape)} instead of {shape}", broken=True)
    note = "" if out.dtype == ref.dtype else f"dtype {out.dtype} instead of {ref.dtype}"
    if ref.dtype.kind not in "fc" or out.dtype.kind not in "fc":
        mismatch = float(np.mean(out != ref)) if ref.size else 0.0
        return OutputStats(name, shape, dtype, {"mismatch": mismatch}, int(ref.size), note=note)
    kept = np.isfinite(ref)
    reference_nonfinite = int(ref.size - np.count_nonzero(kept))
    if ref.size and not kept.any():
        return OutputStats(name, shape, dtype, reference_nonfinite=reference_nonfinite,
                           note=_join(note, "no finite reference value"))
    r = ref[kept].astype(np.float64).ravel()
    c = out[kept].astype(np.float64).ravel()
    positions = np.flatnonzero(kept.ravel())  # the compared elements' flat indices in the output

    def at(k: int) -> dict:
        index = tuple(int(i) for i in np.unravel_index(int(positions[k]), shape)) if shape else ()
        return {"worst_at": index, "worst_values": (float(r[k]), float(c[k]))}

    candidate_nonfinite = int(c.size - np.count_nonzero(np.isfinite(c)))
    if candidate_nonfinite:
        values = dict.fromkeys(FLOAT_STATISTICS, math.inf)
        return OutputStats(name, shape, dtype, values, int(r.size), reference_nonfinite, candidate_nonfinite,
                           _join(note, f"{candidate_nonfinite} non-finite values where the reference is finite"),
                           **at(int(np.flatnonzero(~np.isfinite(c))[0])))
    if r.size == 0:
        return OutputStats(name, shape, dtype, dict.fromkeys(FLOAT_STATISTICS, 0.0), 0, reference_nonfinite, note=note)
    diff = np.abs(c - r)
    magnitude = np.abs(r)
    floor = REL_FLOOR * float(magnitude.max())
    considered = magnitude > floor
    rel = diff[considered] / magnitude[considered] if considered.any() else np.zeros(1)
    scale = float(np.linalg.norm(r))
    rel_l2 = float(np.linalg.norm(c - r)) / scale if scale > 0 else float(np.sqrt(np.mean(diff ** 2)))
    values = {"mean_abs": float(diff.mean()), "median_abs": float(np.median(diff)),
              "p99_abs": float(np.percentile(diff, 99)), "max_abs": float(diff.max()),
              "mean_rel": float(rel.mean()), "median_rel": float(np.median(rel)),
              "p99_rel": float(np.percentile(rel, 99)), "max_rel": float(rel.max()), "rel_l2": rel_l2}
    return OutputStats(name, shape, dtype, values, int(r.size), reference_nonfinite, note=note,
                       **at(int(np.argmax(diff))))


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


# --------------------------------------------------------------------------------------------
# The criterion
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Criterion:
    """Upper bounds on statistics, every one to hold for every output.

    ``bounds``: statistic -> largest value accepted, for float outputs (default ``rel_l2``
    0.01); ``mismatch``: the largest share of differing elements of an integer/bool output.
    ``outputs``: output name -> the criterion for that output instead (Polygraphy's
    per-output tolerances). An output with no finite reference value cannot be judged and passes
    (it is reported).
    """

    bounds: Mapping[str, float] = field(default_factory=lambda: {"rel_l2": 0.01})
    mismatch: float = 0.01
    outputs: Mapping[str, "Criterion"] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from onnxcampo.errors import ConfigError

        if not self.bounds:
            raise ConfigError("an accuracy criterion needs at least one bound (e.g. rel_l2=0.01)")
        for key, value in self.bounds.items():
            if key not in FLOAT_STATISTICS:
                raise ConfigError(f"unknown accuracy statistic {key!r}; choose among {', '.join(STATISTICS)}")
            if not (isinstance(value, (int, float)) and value >= 0 and not math.isnan(value)):
                raise ConfigError(f"accuracy bound {key}={value!r} must be a number >= 0")
        if not 0 <= self.mismatch <= 1:
            raise ConfigError(f"accuracy bound mismatch={self.mismatch!r} must be a share in [0, 1]")
        object.__setattr__(self, "bounds", dict(self.bounds))
        object.__setattr__(self, "outputs", dict(self.outputs))

    def of(self, output: str) -> "Criterion":
        """The criterion ``output`` is judged by: its own where one is given, else this one."""
        return self.outputs.get(output, self)

    def check_outputs(self, names) -> None:
        """A per-output criterion must name an output of the model: one ConfigError otherwise."""
        from onnxcampo.errors import ConfigError

        unknown = sorted(set(self.outputs) - set(names))
        if unknown:
            raise ConfigError(f"--tolerance names {unknown[0]!r}, which is no output of the model; its outputs: "
                              + ", ".join(names))

    @classmethod
    def parse(cls, text: "str | float | Criterion | None") -> "Criterion":
        """``None`` -> the default; a number -> a relative L2 bound; ``KEY=VALUE[,KEY=VALUE...]``
        with keys among :data:`STATISTICS` (``mismatch`` bounds integer outputs)."""
        from onnxcampo.errors import ConfigError

        if text is None:
            return DEFAULT_CRITERION
        if isinstance(text, Criterion):
            return text
        if isinstance(text, (int, float)):
            return cls({"rel_l2": float(text)})
        given: dict[str, dict[str, float]] = {}  # "" -> the global bounds, else an output's
        for part in (p.strip() for p in str(text).split(",")):
            if not part:
                continue
            left, sep, right = part.partition("=")
            if sep:  # [OUTPUT:]KEY=VALUE (an output's name may hold colons itself: TensorFlow's "out:0")
                output, _, key = left.strip().rpartition(":")
                value = right
            else:  # [OUTPUT:]NUMBER, a relative L2 bound
                output, _, value = left.strip().rpartition(":")
                key = "rel_l2"
            key = key.strip()
            try:
                number = float(value)
            except ValueError:
                raise ConfigError(f"--tolerance {text!r}: {value!r} is not a number "
                                  "(expected e.g. 0.01, rel_l2=0.01,max_abs=1e-3 or logits:rel_l2=0.05)") from None
            given.setdefault(output, {})[key] = number
        if not given:
            raise ConfigError(f"--tolerance {text!r}: expected e.g. 0.01 or rel_l2=0.01,max_abs=1e-3")
        base = cls._from_bounds(given.pop("", {}), DEFAULT_CRITERION)
        outputs = {name: cls._from_bounds(bounds, base) for name, bounds in given.items()}
        return cls(base.bounds, base.mismatch, outputs)

    @classmethod
    def _from_bounds(cls, given: Mapping[str, float], start: "Criterion") -> "Criterion":
        """``start`` with the ``given`` bounds (and ``mismatch``) in place of its own."""
        bounds = {k: v for k, v in given.items() if k != "mismatch"}
        return cls(bounds or dict(start.bounds), given.get("mismatch", start.mismatch))

    def __str__(self) -> str:
        own = [f"{key}={value:g}" for key, value in (*self.bounds.items(), ("mismatch", self.mismatch))]
        return ",".join(own + [f"{name}:{key}={value:g}" for name, c in self.outputs.items()
                               for key, value in (*c.bounds.items(), ("mismatch", c.mismatch))])

    def describe(self) -> str:
        """``rel L2 <= 0.01`` (the float bounds; integer outputs' bound added when not default;
        the outputs judged otherwise after it)."""
        text = ", ".join(f"{_LABELS[k]} <= {v:g}" for k, v in self.bounds.items())
        text = text if self.mismatch == DEFAULT_CRITERION.mismatch else f"{text}, share differing <= {self.mismatch:g}"
        if self.outputs:
            text += "; " + "; ".join(f"{name}: {c.describe()}" for name, c in self.outputs.items())
        return text

    def judge(self, stats: OutputStats) -> "OutputVerdict":
        if stats.name in self.outputs:
            return self.outputs[stats.name].judge(stats)
        if stats.broken:
            return OutputVerdict(stats, False, ("output",))
        bounds = {"mismatch": self.mismatch} if stats.kind == "exact" else self.bounds if stats.kind == "float" else {}
        failed = tuple(key for key, bound in bounds.items() if not stats.values[key] <= bound)
        return OutputVerdict(stats, not failed, failed)


@dataclass(frozen=True)
class OutputVerdict:
    stats: OutputStats
    ok: bool
    failed: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.stats.name

    def failure(self, criterion: Criterion) -> str:
        """``logits rel L2 0.031 > 0.01 (12 non-finite values)``: what failed, in a few words."""
        s, criterion = self.stats, criterion.of(self.stats.name)
        if s.broken:
            return f"{s.name} {s.note}"
        parts = [f"{_LABELS[k]} {s.values[k]:.3g} > {criterion.mismatch if k == 'mismatch' else criterion.bounds[k]:g}"
                 for k in self.failed]
        extra = f" ({s.candidate_nonfinite} non-finite values)" if s.candidate_nonfinite else ""
        return f"{s.name} {', '.join(parts)}{extra}"

    def line(self, criterion: Criterion) -> str:
        """``logits: rel L2 0.0031, max abs 0.012, p99 abs 0.004, max rel 0.4, p99 rel 0.02 ok (rel L2
        <= 0.01)`` -- the bounded statistics first, then max/p99 of the absolute and relative
        errors, then the verdict with the bounds it is against."""
        s, criterion = self.stats, criterion.of(self.stats.name)
        if s.broken:
            return f"{s.name}: {s.note} FAIL"
        if s.kind == "none":
            return f"{s.name}: not compared ({s.note})"
        if s.kind == "exact":
            shown = ["mismatch"]
        else:
            shown = list(criterion.bounds) + [k for k in ("max_abs", "p99_abs", "max_rel", "p99_rel")
                                              if k not in criterion.bounds]
        parts = [f"{_LABELS[k]} {s.values[k]:.3g}" for k in shown]
        extra = [s.note] if s.note else []
        if s.reference_nonfinite:
            extra.append(f"{s.reference_nonfinite} non-finite reference values left out")
        if not self.ok and s.worst_text():
            extra.append(s.worst_text())
        tail = f" [{'; '.join(extra)}]" if extra else ""
        bounds = {"mismatch": criterion.mismatch} if s.kind == "exact" else criterion.bounds
        passed = "ok (" + ", ".join(f"{_LABELS[k]} <= {v:g}" for k, v in bounds.items()) + ")"
        verdict = passed if self.ok else "FAIL (" + ", ".join(
            f"{_LABELS[k]} > {criterion.mismatch if k == 'mismatch' else criterion.bounds[k]:g}" for k in self.failed) + ")"
        return f"{s.name}: {', '.join(parts)}{tail} {verdict}"


@dataclass(frozen=True)
class Verdict:
    """A candidate's outputs judged by a criterion: ``ok`` when every output passes."""

    criterion: Criterion
    outputs: tuple[OutputVerdict, ...]
    inputs: str = "given"  # or "generated": where the feeds came from

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def failed(self) -> list[OutputVerdict]:
        return [o for o in self.outputs if not o.ok]

    def needed(self) -> dict[str, float]:
        """The tolerance that would pass: each bounded statistic's worst value over the outputs."""
        needed: dict[str, float] = {}
        for o in self.outputs:
            keys = ("mismatch",) if o.stats.kind == "exact" else tuple(self.criterion.bounds) if o.stats.kind == "float" else ()
            for key in keys:
                needed[key] = max(needed.get(key, 0.0), o.stats.values[key])
        return needed

    def needed_text(self) -> str:
        """``--tolerance rel_l2=0.031`` would pass (empty when an output is missing or changed shape,
        or a value is not finite: no tolerance passes it)."""
        if any(o.stats.broken for o in self.outputs):
            return ""
        needed = self.needed()
        if not needed or not all(math.isfinite(v) for v in needed.values()):
            return ""
        return ",".join(f"{key}={_round_up(value):g}" for key, value in needed.items())

    def worst(self, statistic: str = "rel_l2") -> float | None:
        """The largest value of one statistic over the outputs that have it (``None``: none has);
        a broken output counts as inf."""
        values = [math.inf if o.stats.broken else o.stats.values[statistic] for o in self.outputs
                  if o.stats.broken or statistic in o.stats.values]
        return max(values) if values else None

    def summary(self) -> str:
        """One line: ``passes rel L2 <= 0.01 (worst rel L2 2.1e-03)`` or the failing outputs and figures."""
        measure = "rel_l2" if "rel_l2" in self.criterion.bounds else next(iter(self.criterion.bounds))
        worst = self.worst(measure)
        figure = "" if worst is None else f"worst {_LABELS[measure]} {worst:.3g}"
        if self.ok:
            return f"passes {self.criterion.describe()}" + (f" ({figure})" if figure else "")
        return f"fails {self.criterion.describe()}: {'; '.join(o.failure(self.criterion) for o in self.failed)}"

    def to_json(self) -> dict:
        return {"criterion": str(self.criterion), "ok": self.ok, "inputs": self.inputs,
                "needed_tolerance": self.needed_text() or None,
                "outputs": [{**o.stats.to_json(), "ok": o.ok, **({"failed": list(o.failed)} if o.failed else {})}
                            for o in self.outputs]}


def _round_up(value: float) -> float:
    """Two significant digits, rounded up, so that the tolerance printed passes."""
    if value <= 0:
        return 0.0
    exponent = math.floor(math.log10(value)) - 1
    step = 10.0 ** exponent
    return math.ceil(value / step - 1e-9) * step


DEFAULT_CRITERION = Criterion()


def evaluate(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray],
             criterion: Criterion | str | float | None = None, *, inputs: str = "given") -> Verdict:
    """Judge ``candidate``'s outputs against ``reference``'s, output by output, in the
    reference's order (outputs the reference lacks are ignored)."""
    criterion = Criterion.parse(criterion)
    criterion.check_outputs(list(reference))
    verdicts = tuple(criterion.judge(output_stats(name, ref, candidate.get(name))) for name, ref in reference.items())
    return Verdict(criterion, verdicts, inputs)
