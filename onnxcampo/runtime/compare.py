"""Output comparison helpers: how far a candidate model's outputs are from a reference's.

Whether a model passes is :mod:`onnxcampo.accuracy`'s business (the one criterion of ``optimize
--validate``, its default accuracy check, ``--tune`` and ``onnxcampo bench``: per-output
statistics and bounds, default relative L2 <= 0.01). This module keeps the single number they
report as ``rel_err``, :func:`output_error`, per output:

1. float outputs: the relative L2 error ``||out - ref||_2 / ||ref||_2`` over the elements where
   the reference is finite; ``inf`` when the output is not finite at such an element (an fp16
   overflow is a failed conversion, not a large error); a reference of zeros only: the RMS of
   ``out - ref`` (there is no scale to be relative to);
2. integer and bool outputs: the share of elements that differ (an arg-max that moved);
3. a missing output or one whose shape changed: ``inf``.

A model's error is the worst over its outputs (:func:`worst_error`). :func:`check_outputs`
judges it against :data:`DEFAULT_TOLERANCE` (0.02), the tolerance of :func:`onnxcampo.runtime.validate`
(a Python helper kept for its callers; the command line uses :mod:`onnxcampo.accuracy`).

:func:`compare_outputs` (:class:`OutputDiff`) is the element-wise report ``|c - r| <= atol + rtol
* |r|`` that ``--validate`` adds to the criterion when ``--rtol`` / ``--atol`` are given.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TOLERANCE",
    "OutputCheck",
    "OutputDiff",
    "check_outputs",
    "compare_outputs",
    "output_error",
    "worst_error",
]

DEFAULT_TOLERANCE = 0.02
# rtol/atol of the element-wise report when only its numbers are wanted (the old --validate defaults)
ELEMENTWISE_RTOL = 0.02
ELEMENTWISE_ATOL = 1e-3


# --------------------------------------------------------------------------------------------
# The criterion
# --------------------------------------------------------------------------------------------


def output_error(reference: np.ndarray, output: np.ndarray | None) -> float | None:
    """The error of one output (see the module's numbered cases); ``None`` when nothing can be
    compared (a float reference with no finite element)."""
    ref = np.asarray(reference)
    if output is None:
        return math.inf
    out = np.asarray(output)
    if out.shape != ref.shape:
        return math.inf
    if ref.size == 0:
        return 0.0
    if ref.dtype.kind not in "fc" or out.dtype.kind not in "fc":
        return float(np.mean(out != ref))
    kept = np.isfinite(ref)
    if not kept.any():
        return None
    r = ref[kept].astype(np.float64)
    o = out[kept].astype(np.float64)
    if not np.isfinite(o).all():
        return math.inf
    diff = float(np.linalg.norm(o - r))
    scale = float(np.linalg.norm(r))
    if scale == 0.0:
        return diff / math.sqrt(r.size)
    return diff / scale


def worst_error(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> float | None:
    """The largest :func:`output_error` over the reference's outputs (rounded to 6 significant
    digits for reports); ``None`` when no output could be compared."""
    worst = None
    for name, ref in reference.items():
        error = output_error(ref, outputs.get(name))
        if error is not None:
            worst = error if worst is None else max(worst, error)
    if worst is None:
        logger.warning("no output could be compared with the reference's (all non-finite)")
        return None
    return float(f"{worst:.6g}")


@dataclass(frozen=True)
class OutputCheck:
    """One output judged against the reference.

    ``error``: :func:`output_error` (``measure`` says which: ``rel_l2`` for float outputs,
    ``mismatch`` for the others); ``ok``: ``error <= tolerance`` (an output with nothing to
    compare passes) and, when ``elementwise`` (``rtol``/``atol`` were asked for), ``diff.ok``
    too. ``diff``: the element-wise report (:class:`OutputDiff`), computed with the given
    ``rtol``/``atol`` or, when none was given, with 0.02 / 1e-3 for its numbers only.
    """

    name: str
    error: float | None
    tolerance: float
    ok: bool
    diff: "OutputDiff"
    elementwise: bool = False

    @property
    def measure(self) -> str:
        return "rel_l2" if np.dtype(self.diff.dtype).kind in "fc" else "mismatch"

    @property
    def max_abs_err(self) -> float:
        return self.diff.max_abs_err

    @property
    def max_rel_err(self) -> float:
        return self.diff.max_rel_err

    @property
    def note(self) -> str:
        return self.diff.note

    def to_json(self) -> dict:
        row = {"name": self.name, "error": self.error, "measure": self.measure, "tolerance": self.tolerance,
               "ok": bool(self.ok), "max_abs_err": float(self.max_abs_err), "max_rel_err": float(self.max_rel_err)}
        if self.elementwise:
            row["elementwise_ok"] = bool(self.diff.ok)
        if self.note:
            row["note"] = self.note
        return row


def check_outputs(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    rtol: float | None = None,
    atol: float | None = None,
) -> list[OutputCheck]:
    """One :class:`OutputCheck` per reference output, in the reference's order. With ``rtol`` or
    ``atol`` (the other one then takes its default, 0.02 / 1e-3) every element must also satisfy
    ``|c - r| <= atol + rtol * |r|``."""
    elementwise = rtol is not None or atol is not None
    rtol = ELEMENTWISE_RTOL if rtol is None else rtol
    atol = ELEMENTWISE_ATOL if atol is None else atol
    checks = []
    for diff in compare_outputs(reference, candidate, rtol=rtol, atol=atol):
        error = output_error(reference[diff.name], candidate.get(diff.name))
        ok = (error is None or error <= tolerance) and (diff.ok or not elementwise)
        checks.append(OutputCheck(diff.name, error, tolerance, ok, diff, elementwise))
    return checks


# --------------------------------------------------------------------------------------------
# The element-wise report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutputDiff:
    """How far one candidate output is from the reference.

    ``max_abs_err`` is max |c - r|. ``max_rel_err`` is max |c - r| / max(|r|, tiny) taken only
    over elements with |r| > atol, so that near-zero references (where atol governs) do not
    blow it up; it is 0.0 when no element qualifies. Both are inf when shapes differ, the
    output is missing, or a non-finite value is not matched by the same value. ``ok`` means
    every element satisfies |c - r| <= atol + rtol * |r| (computed in float64), with identical
    non-finite values (NaN vs NaN, inf vs inf) accepted. ``shape`` and ``dtype`` are the
    reference's; ``note`` says what else went wrong (shape or dtype change, missing output).

    ``scaled_max_err`` (max |c - r| / max |r|) and ``scaled_mean_err`` (mean |c - r| / mean
    |r|) are taken over the elements where the reference is finite (a reference of zeros: scale
    1): the numbers the benchmark suite reports as ``rel_err_max`` / ``rel_err_mean``; inf like the
    others, and when the candidate is not finite at such an element.
    """

    name: str
    max_abs_err: float
    max_rel_err: float
    ok: bool
    shape: tuple[int, ...]
    dtype: str
    note: str = ""
    scaled_max_err: float = 0.0
    scaled_mean_err: float = 0.0


def _errors(ref: np.ndarray, cand: np.ndarray, rtol: float,
            atol: float) -> tuple[float, float, bool]:
    """(max abs error, max relative error, ok) of two same-shaped arrays, in float64."""
    r = ref.astype(np.float64)
    c = cand.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        same = (c == r) | (np.isnan(c) & np.isnan(r))
        abs_err = np.where(same, 0.0, np.abs(c - r))
        abs_err = np.where(np.isnan(abs_err), np.inf, abs_err)
        finite = np.isfinite(c) & np.isfinite(r)
        ok = bool(np.all(same | (finite & (abs_err <= atol + rtol * np.abs(r)))))
        tiny = np.finfo(np.float64).tiny
        rel = abs_err / np.maximum(np.abs(r), tiny)
        rel = np.where(same, 0.0, np.where(np.isnan(rel), np.inf, rel))
        rel_mask = ~(np.abs(r) <= atol)  # NaN references count: they cannot be "small"
    max_abs = float(abs_err.max()) if abs_err.size else 0.0
    max_rel = float(rel[rel_mask].max()) if rel_mask.any() else 0.0
    return max_abs, max_rel, ok


def _scaled(ref: np.ndarray, cand: np.ndarray) -> tuple[float, float]:
    """(max |c - r| / max |r|, mean |c - r| / mean |r|) where ``ref`` is finite, in float64."""
    kept = np.isfinite(ref.astype(np.float64))
    r = ref[kept].astype(np.float64)
    c = cand[kept].astype(np.float64)
    if r.size == 0:
        return 0.0, 0.0
    if not np.isfinite(c).all():
        return math.inf, math.inf
    diff = np.abs(c - r)
    peak = float(np.max(np.abs(r))) or 1.0
    mean = float(np.mean(np.abs(r))) or 1.0
    return float(diff.max()) / peak, float(diff.mean()) / mean


def _compare_one(name: str, ref: np.ndarray, cand: np.ndarray | None,
                 rtol: float, atol: float) -> OutputDiff:
    """OutputDiff for one output name."""
    ref = np.asarray(ref)
    shape, dtype = tuple(ref.shape), str(ref.dtype)
    inf = (math.inf, math.inf)
    if cand is None:
        return OutputDiff(name, math.inf, math.inf, False, shape, dtype, "missing from candidate", *inf)
    cand = np.asarray(cand)
    if cand.shape != ref.shape:
        return OutputDiff(name, math.inf, math.inf, False, shape, dtype,
                          f"shape {tuple(cand.shape)} instead of {shape}", *inf)
    if ref.dtype.kind not in "biuf" or cand.dtype.kind not in "biuf":
        equal = bool(np.array_equal(ref, cand))
        err = 0.0 if equal else math.inf
        return OutputDiff(name, err, err, equal, shape, dtype, "" if equal else "values differ", err, err)
    max_abs, max_rel, ok = _errors(ref, cand, rtol, atol)
    note = "" if cand.dtype == ref.dtype else f"dtype {cand.dtype} instead of {ref.dtype}"
    return OutputDiff(name, max_abs, max_rel, ok, shape, dtype, note, *_scaled(ref, cand))


def compare_outputs(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float,
) -> list[OutputDiff]:
    """One OutputDiff per reference output, in the reference's order (see OutputDiff).

    Candidate outputs the reference lacks are ignored with a warning: an optimizer may expose
    extra values, but it must not lose or change the original ones.
    """
    extra = sorted(set(candidate) - set(reference))
    if extra:
        logger.warning("candidate has outputs the reference lacks, ignored: %s", extra)
    return [_compare_one(name, ref, candidate.get(name), rtol, atol)
            for name, ref in reference.items()]
