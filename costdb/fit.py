"""Fit a cost database (schema v1, :mod:`onnxcampo.costdb.regression`) from measured samples.

Input: JSON lines written by the measurement harness, one measurement a line (op rows, Cast rows,
Pad/Slice rows; see :func:`load_samples`). Output: a database :class:`RegressionCostModel`
accepts. Rules:

1. Every ``time_us`` is clamped to a floor of 0.5 us (tiny ops minus the empty-model baseline can
   come out near zero or slightly negative). Rows without a finite ``time_us`` are skipped and
   counted.
2. Cast cost ``C_I + r * n``: one weighted least-squares fit over both directions pooled, plus one
   per direction (``to_fp16`` / ``to_fp32``) for reference. Pad cost likewise from Pad and Slice
   rows (``pad`` is omitted when there are none).
3. Op rows are paired by ``case``: the fp32 side is a ``precision == "fp32"`` row with TF32 on
   (``tf32`` missing counts as on, ORT's default), the fp16 side a ``precision == "fp16"`` row.
   fp32 rows with ``tf32: false`` and rows with ``padded: true`` (a different kernel than the op
   the shapes describe) are not used; repeated rows of one side are reduced to their median.
4. Per op type with at least ``min_samples`` paired cases, a share ``holdout`` of the cases (by
   case, stratified by Tensor Core alignment, deterministic from ``seed``) is held out; the models
   are fitted on the rest and their errors measured on the held-out cases. The shipped models are
   the ones fitted without the held-out cases, so ``holdout_cases`` stay honest for
   :func:`onnxcampo.costdb.evaluate.evaluate`.
5. Models, each fitted by least squares weighted by ``1 / t**2`` (the loss is relative error,
   which is what MAPE measures); coefficients may take any sign (predictions are clamped at 0):

   * ``fp32``: ``t32 ~ b + sum_i w_i f_i``;
   * ``fp16``: ``t16 ~ b + sum_i w_i f_i + sigma * t32`` (Campo's form; ``t32`` is the measured
     fp32 time of the same case), on the cases that are not Tensor Core aligned (all cases for
     ops without a GEMM, or when fewer than ``min_samples`` unaligned cases exist);
   * ``fp16_tc``: the same form on aligned cases, for GEMM ops with ``min_samples`` aligned cases;
   * ``fp16_even``: when the unaligned cases split into odd and even K/N
     (:attr:`OpFeatures.even_aligned`) with ``min_samples`` training cases each and the split
     lowers their leave-one-out error by ``MIN_GAIN``, ``fp16`` is refitted on the odd cases
     (``fit_on: "odd"``) and ``fp16_even`` on the even ones;
   * ``regimes`` (op types in :data:`REGIME_RULES`, Conv: 1x1 / spatial kernels): the models above
     once per regime, kept when every regime has ``2 * min_samples`` cases and the split lowers
     the fp16 leave-one-out error on the training cases by ``MIN_GAIN``; the pooled models stay.

   Feature choice (Campo): candidates are the :data:`FEATURES` whose Spearman ``|rho|`` against
   the target time (on the training cases) exceeds ``rho``; when none does, the single best one.
   Many candidates rank alike (``flops`` and ``log_flops`` have identical ranks), so fitting them
   all would give collinear, overfitted models; the candidates are therefore added one at a time
   (forward selection), each only while it lowers the leave-one-out relative error by at least
   5 %; near-ties (within ``TIE``) go to the earlier feature. ``fp32`` keeps at least one
   feature; ``fp16`` may keep none (``sigma * t32`` alone). fp16 models also have the
   :data:`FP32_RUN_FEATURES` (measured fp32 time times a shape quantity) as candidates.
6. The measured times of every case are kept under ``measured`` (keyed by :func:`shape_key`):
   a node of exactly such a shape gets them instead of a prediction. The evaluation ignores the
   table, so the held-out errors measure the models alone.
7. Op types with fewer than ``min_samples`` paired cases are left out of ``ops`` and listed in
   ``fallback_ops``: :class:`RegressionCostModel` predicts them with the analytic roofline model
   (:class:`AnalyticCostModel`), as it does for any op type the database lacks.

Additions to schema v1 (all optional for readers; ``validate_database`` ignores them)::

    "cast": {..., "to_fp16": {"C_I", "r"}, "to_fp32": {"C_I", "r"}, "samples": rows}
    "pad": {..., "samples": rows}
    "ops": {OP: {..., "holdout": n held out, "holdout_mape_fp32": x, "fp16_even": MODEL,
                 "regimes": {"rule", "models": {REGIME: entry}, "loo_mape", "pooled_loo_mape"},
                 MODEL: {..., "samples": training cases, "fit_on": "all"|"unaligned"|"aligned",
                         "loo_mape": leave-one-out error on the training cases,
                         "rho": {feature: Spearman rho of each candidate}}}}
    "fallback_ops": [op types predicted by the analytic model]
    "dispatch": {"us": per-node host dispatch time, "samples": n, "rule": ...} (fit_dispatch)
    "chains": {PATTERN: {"fp32": ratio, "fp16": ratio, "samples": n, "range": {...}}}
        (chain time / sum of its nodes' times, median over shapes: rows with a ``chain`` field,
        see :mod:`onnxcampo.costdb.chains`)
    "holdout_cases": [case keys held out]
    "summary": {"holdout_mape", "holdout_mape_fp32", "wrong_decision_rate", "samples", "cases",
                "rows_skipped", "fit": {"holdout", "seed", "min_samples", "rho"}}

Errors (``*_mape``, ``wrong_decision_rate``) are fractions: 0.06 is 6 %.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from onnxcampo.costdb.chains import fit_chains
from onnxcampo.costdb.features import OpFeatures, keyed, op_features
from onnxcampo.costdb.regression import (FP32_RUN_FEATURES, REGIME_RULES, SHAPE_FEATURES, SCHEMA_VERSION, feature_vector, shape_key,
                                         validate_database)
from onnxcampo.errors import ConfigError, CostModelError

log = logging.getLogger(__name__)

TIME_FLOOR_US = 0.5
MIN_GAIN = 0.05  # forward selection: a feature must cut the leave-one-out error by 5 %
TIE = 0.02  # forward selection: LOO errors within 2 % of the best count as tied
MIN_GAIN_ABS = 1e-4  # ... and by 0.01 points (exact fits must not grow features from rounding)
# forward selection: a candidate that the chosen columns explain this well on the training cases
# adds no information there, only two large opposed coefficients that blow up off the grid
# (SkipLayerNormalization's elements are 3 x its FLOPs + 2 x 768 on a grid of one width: its
# fp16 model took both and predicted 1.2 ms for a 10 us node with a second output)
COLLINEAR_R2 = 0.9999
CAST_OP = "Cast"
PAD_OPS = frozenset({"Pad", "Slice"})
# Input positions that hold constant weights (converted offline, never cast at run time) when a
# row does not list them itself in "weights": the weight matrix of products, their bias, and the
# scale and bias of normalizations.
WEIGHT_INPUTS = {"MatMul": (1,), "FusedMatMul": (1,), "Gemm": (1, 2), "Conv": (1, 2), "FusedConv": (1, 2),
                 "ConvTranspose": (1, 2), "LayerNormalization": (1, 2), "BatchNormalization": (1, 2, 3, 4)}


# --------------------------------------------------------------------------------------------
# Samples


def load_samples(path: str | Path) -> list[dict]:
    """Samples from a JSON-lines file; blank lines are skipped."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CostModelError(f"{path}: samples file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CostModelError(f"{path}: cannot read samples ({exc})") from None
    samples = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CostModelError(f"{path}:{number}: malformed sample line ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CostModelError(f"{path}:{number}: malformed sample line (not a JSON object)")
        samples.append(row)
    return samples


def sample_time(row: dict) -> float | None:
    """``time_us`` clamped to the floor, or None when the row has no usable time."""
    value = row.get("time_us")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return max(float(value), TIME_FLOOR_US)


def _shapes(value) -> list[tuple | None]:
    return [None if s is None else tuple(s) for s in (value or [])]


def _elements(row: dict) -> int:
    if isinstance(row.get("elements"), (int, float)):
        return int(row["elements"])
    shapes = row.get("output_shapes") if row.get("op_type") in PAD_OPS else row.get("input_shapes")
    shapes = shapes or row.get("input_shapes") or [[0]]
    return int(math.prod(shapes[0]))


@dataclass
class Case:
    """One op measured in both precisions (``t32`` with TF32 on)."""

    key: str
    op_type: str
    features: OpFeatures
    t32: float
    t16: float
    cast_inputs: list[int] = field(default_factory=list)  # elements of each float activation input
    # (inputs listed in the row's "weights", else WEIGHT_INPUTS, are constants: never cast)
    cast_outputs: list[int] = field(default_factory=list)  # elements of each float output
    rows: int = 2

    @property
    def values(self) -> dict[str, float]:
        return feature_vector(self.features, self.t32)

    @property
    def aligned(self) -> bool:
        return self.features.tensor_core_aligned


@dataclass
class SampleSet:
    cases: list[Case]
    cast_rows: list[tuple[str, int, float]]  # (direction, elements, time)
    pad_rows: list[tuple[str, int, float]]  # (op type, elements, time)
    rows_used: int
    rows_skipped: dict[str, int]
    chain_rows: list[dict] = field(default_factory=list)
    tf32_off: dict[str, float] = field(default_factory=dict)  # case key -> fp32 time, TF32 off


def _cast_sizes(op_type: str, row: dict) -> tuple[list[int], list[int]]:
    ins, outs = _shapes(row.get("input_shapes")), _shapes(row.get("output_shapes"))
    float_in = row.get("float_inputs") or [True] * len(ins)
    float_out = row.get("float_outputs") or [True] * len(outs)
    weights = row.get("weights")
    if not isinstance(weights, list):
        weights = WEIGHT_INPUTS.get(op_type, ())
    cast_in = [math.prod(s) for i, (s, f) in enumerate(zip(ins, float_in))
               if f and i not in weights and s is not None and None not in s]
    cast_out = [math.prod(s) for s, f in zip(outs, float_out) if f and s is not None and None not in s]
    return cast_in, cast_out


def collect(samples: Iterable[dict]) -> SampleSet:
    """Sort rows into paired op cases, Cast rows and Pad/Slice rows."""
    skipped: dict[str, int] = defaultdict(int)
    cast_rows, pad_rows, chain_rows = [], [], []
    tf32_off: dict[str, list[float]] = defaultdict(list)
    sides: dict[str, dict[str, list]] = defaultdict(lambda: {"fp32": [], "fp16": []})
    for index, row in enumerate(samples):
        if isinstance(row, dict) and isinstance(row.get("kind"), str):
            skipped[f"{row['kind']} rows"] += 1  # costdb calibrate's host and fused-kernel timings, fitted apart
            continue
        if not isinstance(row, dict) or not isinstance(row.get("op_type"), str):
            raise CostModelError(f"sample #{index + 1}: not a measurement (no 'op_type')")
        op_type, precision = row["op_type"], row.get("precision")
        time = sample_time(row)
        if time is None:
            skipped["no time"] += 1
            continue
        if row.get("chain"):
            chain_rows.append(row)
            continue
        if op_type == CAST_OP:
            if precision not in ("to_fp16", "to_fp32"):
                raise CostModelError(f"sample #{index + 1}: Cast precision {precision!r}, expected to_fp16 or to_fp32")
            cast_rows.append((precision, _elements(row), time))
            continue
        if op_type in PAD_OPS:
            pad_rows.append((op_type, _elements(row), time))
            continue
        if not isinstance(row.get("case"), str):
            raise CostModelError(f"sample #{index + 1}: {op_type} row has no 'case' key")
        if row.get("padded"):
            skipped["padded"] += 1
            continue
        if precision == "fp32":
            if row.get("tf32", True) is False:
                skipped["fp32 without TF32"] += 1
                tf32_off[row["case"]].append(time)
                continue
        elif precision != "fp16":
            raise CostModelError(f"sample #{index + 1}: precision {precision!r}, expected fp32 or fp16")
        sides[row["case"]][precision].append((time, row))

    cases = []
    for key in sorted(sides):
        fp32, fp16 = sides[key]["fp32"], sides[key]["fp16"]
        if not fp32 or not fp16:
            skipped["unpaired"] += len(fp32) + len(fp16)
            continue
        row = fp32[0][1]
        op_type = row["op_type"]
        features = keyed(op_features(op_type, _shapes(row.get("input_shapes")), _shapes(row.get("output_shapes")),
                                     row.get("attrs") or {}, float_inputs=row.get("float_inputs"),
                                     float_outputs=row.get("float_outputs")), row.get("domain") or "")
        op_type = features.op_type
        if not features.known:
            skipped["unknown shapes"] += len(fp32) + len(fp16)
            continue
        cast_in, cast_out = _cast_sizes(op_type, row)
        cases.append(Case(key, op_type, features, statistics.median(t for t, _ in fp32),
                          statistics.median(t for t, _ in fp16), cast_in, cast_out, len(fp32) + len(fp16)))
    rows_used = sum(c.rows for c in cases) + len(cast_rows) + len(pad_rows) + len(chain_rows)
    return SampleSet(cases, cast_rows, pad_rows, rows_used, dict(skipped), chain_rows,
                     {key: statistics.median(times) for key, times in tf32_off.items()})


def device_info(samples: Sequence[dict]) -> dict:
    """The device block: one GPU name across all samples; versions of the latest sample."""
    names = sorted({row["device"] for row in samples if isinstance(row.get("device"), str)})
    if len(names) > 1:
        raise CostModelError(f"samples come from several devices ({', '.join(names)}); fit one database per GPU")
    dated = [row for row in samples if isinstance(row.get("date"), str)]
    latest = max(dated, key=lambda row: row["date"]) if dated else (samples[0] if samples else {})
    info = {"name": names[0] if names else "unknown device"}
    for key in ("compute_capability", "ort_version", "cuda_version", "date"):
        info[key] = latest.get(key)
    return info


# --------------------------------------------------------------------------------------------
# Weighted least squares with leave-one-out error


@dataclass
class LinearFit:
    coef: np.ndarray  # one per design column (intercept first)
    loo_mape: float  # leave-one-out mean relative error on the training rows


def weighted_fit(design: np.ndarray, target: np.ndarray) -> LinearFit:
    """Least squares of ``target`` on ``design`` weighted by ``1 / target**2`` (scikit-learn's
    ``LinearRegression`` on the rows scaled by ``1 / target``).

    Weighted residuals are relative errors, so the leave-one-out error follows from the hat
    matrix without refitting: ``e_i / (1 - h_ii)``.
    """
    weights = 1.0 / target
    a = design * weights[:, None]
    b = target * weights  # all ones
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a_scaled = a / scale
    u, s, vt = np.linalg.svd(a_scaled, full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum()) if s.size and s[0] > 0 else 0
    u, s, vt = u[:, :rank], s[:rank], vt[:rank]
    # The coefficients by scikit-learn (weighted least squares on the column-scaled design, no
    # intercept: it is a column of the design); the SVD gives the leverages for the error.
    from sklearn.linear_model import LinearRegression

    solution = LinearRegression(fit_intercept=False).fit(a_scaled, b).coef_ if rank else np.zeros(a.shape[1])
    coef = solution / scale
    residual = b - a_scaled @ solution
    leverage = (u**2).sum(axis=1)
    room = 1.0 - leverage
    if np.any(room < 1e-8):
        loo = math.inf
    else:
        loo = float(np.mean(np.abs(residual / room)))
    return LinearFit(coef, loo)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rho, 0 for a constant input."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    from scipy.stats import spearmanr

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = float(spearmanr(x, y).statistic)
    return 0.0 if math.isnan(value) else value


def fit_model(cases: Sequence[Case], *, fp16: bool, rho: float, fit_on: str = "all") -> dict:
    """One MODEL dict (``features``, ``coef``, ``intercept``, ``sigma`` for fp16) from cases."""
    target = np.array([c.t16 if fp16 else c.t32 for c in cases])
    names = SHAPE_FEATURES + FP32_RUN_FEATURES if fp16 else SHAPE_FEATURES
    values = [c.values for c in cases]
    columns = {name: np.array([v[name] for v in values]) for name in names}
    rhos = {name: spearman(col, target) for name, col in columns.items()}
    candidates = [n for n in names if abs(rhos[n]) > rho]
    if not candidates:
        best = max(names, key=lambda n: abs(rhos[n]))
        candidates = [best] if abs(rhos[best]) > 0 else []
    t32 = np.array([c.t32 for c in cases])

    def design(names: list[str]) -> np.ndarray:
        cols = [np.ones(len(cases))] + [columns[n] for n in names]
        if fp16:
            cols.append(t32)
        return np.column_stack(cols)

    chosen: list[str] = []
    current = weighted_fit(design(chosen), target)
    max_params = max(len(cases) - 2, 1)
    while True:
        base = design(chosen)
        remaining = [n for n in candidates if n not in chosen and not _collinear(columns[n], base)]
        if not remaining or len(chosen) + 1 + (2 if fp16 else 1) > max_params:
            break
        trials = {n: weighted_fit(design(chosen + [n]), target) for n in remaining}
        best = min(trials[n].loo_mape for n in remaining)
        # near-ties go to the simpler feature (earlier in FEATURES): padded or wave-quantized
        # FLOPs equal plain FLOPs for most shapes and must earn their place
        name = next(n for n in remaining if trials[n].loo_mape <= best * (1 + TIE))
        forced = not fp16 and not chosen  # fp32 keeps at least one feature
        gain = current.loo_mape - trials[name].loo_mape
        if not forced and not (gain > MIN_GAIN * current.loo_mape and gain > MIN_GAIN_ABS):
            break
        chosen.append(name)
        current = trials[name]
    coef = current.coef
    model = {
        "features": chosen,
        "coef": [float(w) for w in coef[1:1 + len(chosen)]],
        "intercept": float(coef[0]),
    }
    if fp16:
        model["sigma"] = float(coef[-1])
    model["samples"] = len(cases)
    model["fit_on"] = fit_on
    model["loo_mape"] = None if math.isinf(current.loo_mape) else round(current.loo_mape, 6)
    model["rho"] = {n: round(rhos[n], 4) for n in candidates}
    return model


def _collinear(column: np.ndarray, design: np.ndarray) -> bool:
    """Whether ``column`` is all but a linear combination of ``design``'s columns (R^2 above
    :data:`COLLINEAR_R2`, scale-free: columns are scaled to their largest value first)."""
    spread = float(np.sum((column - column.mean()) ** 2))
    if spread == 0:
        return True  # constant: the intercept has it
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    solution, *_ = np.linalg.lstsq(design / scale, column, rcond=None)
    residual = column - (design / scale) @ solution
    return 1.0 - float(np.sum(residual ** 2)) / spread > COLLINEAR_R2


def _even_split(unaligned: Sequence[Case], pooled: dict, *, rho: float, min_samples: int) -> tuple[dict, dict] | None:
    """Separate models for odd and even unaligned cases (:attr:`OpFeatures.even_aligned`) when
    both have ``min_samples`` training cases and the split lowers the leave-one-out error of
    the unaligned training cases by ``MIN_GAIN`` (a choice made on training cases only)."""
    odd = [c for c in unaligned if not c.features.even_aligned]
    even = [c for c in unaligned if c.features.even_aligned]
    if len(odd) < min_samples or len(even) < min_samples or pooled["loo_mape"] is None:
        return None
    odd_model = fit_model(odd, fp16=True, rho=rho, fit_on="odd")
    even_model = fit_model(even, fp16=True, rho=rho, fit_on="even")
    if odd_model["loo_mape"] is None or even_model["loo_mape"] is None:
        return None
    split_loo = (odd_model["loo_mape"] * len(odd) + even_model["loo_mape"] * len(even)) / len(unaligned)
    if split_loo > (1 - MIN_GAIN) * pooled["loo_mape"]:
        return None
    return odd_model, even_model


def fit_size_cost(rows: Sequence[tuple[int, float]]) -> dict:
    """``C_I + r * n`` by least squares weighted by ``1 / t**2``."""
    if not rows:
        raise ValueError("no rows")
    n = np.array([float(e) for e, _ in rows])
    t = np.array([t for _, t in rows])
    if np.ptp(n) == 0:  # one size only: all of it is the fixed cost
        return {"C_I": float(np.median(t)), "r": 0.0}
    fit = weighted_fit(np.column_stack([np.ones_like(n), n]), t)
    return {"C_I": float(fit.coef[0]), "r": float(fit.coef[1])}


# --------------------------------------------------------------------------------------------
# The database


def fit_op(train: Sequence[Case], cases: Sequence[Case], *, rho: float, min_samples: int) -> dict:
    """The models of one op type (rule 5) fitted on ``train``; ``cases`` (all of the op's cases)
    decide which models the op has, so that the held-out share does not change the layout."""
    entry = {"fp32": fit_model(train, fp16=False, rho=rho)}
    is_gemm = any(c.features.is_gemm for c in cases)
    unaligned = [c for c in train if not c.aligned]
    aligned = [c for c in train if c.aligned]
    if is_gemm and sum(not c.aligned for c in cases) >= min_samples:
        entry["fp16"] = fit_model(unaligned, fp16=True, rho=rho, fit_on="unaligned")
    else:
        entry["fp16"] = fit_model(train, fp16=True, rho=rho, fit_on="all")
    if is_gemm and sum(c.aligned for c in cases) >= min_samples and len(aligned) >= 3:
        entry["fp16_tc"] = fit_model(aligned, fp16=True, rho=rho, fit_on="aligned")
    if entry["fp16"]["fit_on"] == "unaligned":
        split = _even_split(unaligned, entry["fp16"], rho=rho, min_samples=min_samples)
        if split is not None:
            entry["fp16"], entry["fp16_even"] = split
    return entry


def _training_loo(entry: dict, train: Sequence[Case]) -> float | None:
    """Leave-one-out error of an entry's fp16 models over the training cases they were fitted on."""
    models = [entry[k] for k in ("fp16", "fp16_tc", "fp16_even") if k in entry]
    if any(m["loo_mape"] is None for m in models) or not train:
        return None
    return sum(m["loo_mape"] * m["samples"] for m in models) / sum(m["samples"] for m in models)


def _fit_regimes(op_type: str, train: Sequence[Case], cases: Sequence[Case], pooled: dict, *, rho: float,
                 min_samples: int) -> dict | None:
    """One entry per kernel regime (:data:`REGIME_RULES`) when every regime has ``2 * min_samples``
    cases and the split lowers the fp16 leave-one-out error on the training cases by
    ``MIN_GAIN`` (decided on training cases only, like the feature choice)."""
    rule = REGIME_RULES.get(op_type)
    if rule is None:
        return None
    name, key = rule
    groups: dict[str, list[Case]] = defaultdict(list)
    for case in cases:
        groups[key(case.features)].append(case)
    if len(groups) < 2 or any(len(g) < 2 * min_samples for g in groups.values()):
        return None
    held = {c.key for c in cases} - {c.key for c in train}
    models, loo, count = {}, 0.0, 0
    for regime, group in sorted(groups.items()):
        sub_train = [c for c in group if c.key not in held]
        entry = fit_op(sub_train, group, rho=rho, min_samples=min_samples)
        error = _training_loo(entry, sub_train)
        if error is None:
            return None
        models[regime] = {**entry, "samples": len(group)}
        loo += error * len(sub_train)
        count += len(sub_train)
    pooled_loo = _training_loo(pooled, train)
    if pooled_loo is None or loo / count > (1 - MIN_GAIN) * pooled_loo:
        log.info("%s: regimes by %s do not pay (LOO %.3f vs pooled %s)", op_type, name, loo / count, pooled_loo)
        return None
    return {"rule": name, "models": models, "loo_mape": round(loo / count, 6), "pooled_loo_mape": round(pooled_loo, 6)}


def split_holdout(cases: Sequence[Case], share: float, seed: int) -> tuple[list[Case], list[Case]]:
    """Held-out cases of one op type: by case, stratified by alignment, deterministic in seed."""
    if share <= 0:
        return list(cases), []
    groups: dict[bool, list[Case]] = defaultdict(list)
    for case in sorted(cases, key=lambda c: c.key):
        groups[case.aligned].append(case)
    rng = np.random.default_rng([seed, zlib.crc32(cases[0].op_type.encode())])
    train, held = [], []
    for aligned in (False, True):
        group = groups.get(aligned, [])
        order = rng.permutation(len(group))
        count = int(round(share * len(group)))
        if len(group) >= 2:
            count = min(max(count, 1), len(group) - 1)
        else:
            count = 0
        held += [group[i] for i in order[:count]]
        train += [group[i] for i in order[count:]]
    return train, held


def _mape(pairs: Iterable[tuple[float, float]]) -> float | None:
    errors = [abs(p - m) / m for p, m in pairs]
    return float(np.mean(errors)) if errors else None


def fit_database(samples: list[dict], *, holdout: float = 0.2, seed: int = 0, min_samples: int = 8,
                 rho: float = 0.75) -> dict:
    """A schema-v1 cost database from measured samples (see the module docstring)."""
    if not 0 <= holdout < 1:
        raise ConfigError(f"holdout must be in [0, 1), got {holdout}")
    if min_samples < 3:
        raise ConfigError(f"min_samples must be at least 3, got {min_samples}")
    if not 0 <= rho < 1:
        raise ConfigError(f"rho must be in [0, 1), got {rho}")
    data = collect(samples)
    if not data.cast_rows:
        raise CostModelError("samples hold no Cast rows: the cast cost model cannot be fitted")

    cast = fit_size_cost([(e, t) for _, e, t in data.cast_rows])
    for direction in ("to_fp16", "to_fp32"):
        rows = [(e, t) for d, e, t in data.cast_rows if d == direction]
        if rows:
            cast[direction] = fit_size_cost(rows)
    cast["samples"] = len(data.cast_rows)
    database: dict = {"schema_version": SCHEMA_VERSION, "device": device_info(samples), "cast": cast}
    if data.pad_rows:
        database["pad"] = {**fit_size_cost([(e, t) for _, e, t in data.pad_rows]), "samples": len(data.pad_rows)}
        for kind in ("Pad", "Slice"):
            rows = [(e, t) for op, e, t in data.pad_rows if op == kind]
            if rows:
                database["pad"][kind] = fit_size_cost(rows)

    by_op: dict[str, list[Case]] = defaultdict(list)
    for case in data.cases:
        by_op[case.op_type].append(case)
    ops, fallback, holdout_keys, measured = {}, [], [], {}
    for op_type in sorted(by_op):
        cases = by_op[op_type]
        if len(cases) < min_samples:
            fallback.append(op_type)
            log.info("%s: %d paired cases (< %d): analytic fallback", op_type, len(cases), min_samples)
            continue
        train, held = split_holdout(cases, holdout, seed)
        entry = fit_op(train, cases, rho=rho, min_samples=min_samples)
        regimes = _fit_regimes(op_type, train, cases, entry, rho=rho, min_samples=min_samples)
        if regimes is not None:
            entry["regimes"] = regimes
        entry["samples"] = len(cases)
        ratios = [c.t16 / c.t32 for c in cases if c.t32 > 0]
        entry["fp16_ratio"] = [round(min(ratios), 4), round(max(ratios), 4)]
        entry["holdout"] = len(held)
        ops[op_type] = entry
        holdout_keys += [c.key for c in held]
        for case in cases:
            measured[shape_key(case.features)] = {"fp32": round(case.t32, 4), "fp16": round(case.t16, 4)}

    database["ops"] = ops
    database["fallback_ops"] = fallback
    database["holdout_cases"] = sorted(holdout_keys)
    database["measured"] = measured
    dispatch = fit_dispatch(samples)
    if dispatch:
        database["dispatch"] = dispatch
    if data.chain_rows:
        database["chains"] = fit_chains(data.chain_rows)
    database["summary"] = {}
    validate_database(database, "fitted database")

    from onnxcampo.costdb.evaluate import evaluate_cases  # evaluate imports this module

    result = evaluate_cases(database, data, holdout_only=True)
    for op_type, entry in ops.items():
        numbers = result["ops"].get(op_type, {})
        entry["holdout_mape"] = numbers.get("mape_fp16")
        entry["holdout_mape_fp32"] = numbers.get("mape_fp32")
        log.info("%s: %d cases, fp32 %s, fp16 %s, held-out MAPE fp16 %s", op_type, entry["samples"],
                 entry["fp32"]["features"], entry["fp16"]["features"], _percent(entry["holdout_mape"]))
    overall = result["overall"]
    database["summary"] = {
        "holdout_mape": overall["mape_fp16"],
        "holdout_mape_fp32": overall["mape_fp32"],
        "wrong_decision_rate": overall["wrong_rate"],
        "samples": data.rows_used,
        "cases": len(data.cases),
        "rows_skipped": data.rows_skipped,
        "fit": {"holdout": holdout, "seed": seed, "min_samples": min_samples, "rho": rho},
    }
    return database


DISPATCH_KERNEL_US = 2.0  # single-op samples with kernels this short are dispatch-bound


def fit_dispatch(samples: Iterable[dict]) -> dict | None:
    """Per-node host dispatch time: the median wall time, minus an empty model's, of single-op
    runs whose GPU kernels take under ``DISPATCH_KERNEL_US`` (there the host is the bottleneck).
    None without such rows (wall times of CPU runs say nothing about a GPU)."""
    times = [row["wall_time_us"] for row in samples
             if not row.get("chain") and isinstance(row.get("kernel_us"), (int, float))
             and row["kernel_us"] < DISPATCH_KERNEL_US and isinstance(row.get("wall_time_us"), (int, float))
             and row["wall_time_us"] > 0]
    if not times:
        return None
    return {"us": round(statistics.median(times), 3), "samples": len(times),
            "rule": f"median wall_time_us of single-op runs with kernel_us < {DISPATCH_KERNEL_US}"}


STEP_DISPATCH_MIN_GAIN = 1.10  # the CUDA-graph replay must be this much faster: the host bound the run
# database key of the per-node host time fitted from benchmark rows, per benchmark mode
DISPATCH_KEYS = {"training": "dispatch_step", "inference": "dispatch_model"}


def fit_step_dispatch(rows: Iterable[dict], mode: str = "training", run_us: float = 0.0) -> dict | None:
    """Per-node host time of whole runs (``mode`` "training": steps; "inference": models), from
    benchmark rows (``benchmarks/runner.py``).

    Where a model's fp32 run was at least ``STEP_DISPATCH_MIN_GAIN`` times faster replayed as a
    CUDA graph (``fp32-graph``: no host dispatch), the host bounded the plain run, which took at
    least ``nodes`` dispatches: its time over its nodes bounds the per-node host time from above
    (it includes GPU time the host did not hide), and it is the figure that makes ``plan_time``'s
    max(GPU work, dispatch x nodes) reproduce the plain run. ``run_us``, the fixed cost of a run
    (``fit_run_overhead``, which plan_time adds on top), is taken off first. The smallest over the
    models is kept. None without such pairs."""
    runs: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("mode") == mode and row.get("status") == "ok" and isinstance(row.get("ms"), (int, float)):
            runs.setdefault((row.get("model"), row.get("batch")), {})[row.get("policy")] = row
    values = {}
    for (model, batch), policies in sorted(runs.items(), key=str):
        plain, graph = policies.get("fp32"), policies.get("fp32-graph")
        if plain and graph and plain.get("nodes") and plain["ms"] >= STEP_DISPATCH_MIN_GAIN * graph["ms"]:
            values[f"{model} b{batch}"] = round(max(1e3 * plain["ms"] - run_us, 0.0) / plain["nodes"], 3)
    if not values:
        return None
    return {"us": min(values.values()), "samples": len(values), "per_model_us": values,
            "rule": f"smallest fp32 {mode} ms / nodes over the models that ran >= {STEP_DISPATCH_MIN_GAIN}x "
                    "faster as a CUDA graph"}


def fit_host_launch(rows: Iterable[dict], run_us: float = 0.0) -> dict | None:
    """Host time per kernel launch by class (``conv``, ``other``; ``CostModel.launch_us``) from whole
    inference runs: a model's fp32 run node by node (``fp32``) took longer than the same model
    replayed as a CUDA graph (``fp32-graph``: the same kernels, launched once) by what its launches
    cost, ``ort_launches`` of them (ORT's own optimized graph on the benchmark's provider). Measured
    on the H200 that difference grows with the launches at every batch, large ones included (2.3-4.4
    us a launch over BERT, GPT-2 and ResNet-50 at batch 1 and large): the host's launches add to the
    GPU's work, they do not hide behind it (``additive``; ``estimate.plan_time``). Non-negative
    least squares over the models; the leave-one-model-out error of each model's plain run (its
    replayed time plus the launches at the others' fit) says how far the fit carries. ``run_us`` is
    kept for the signature of the other fits (the difference of two runs holds no fixed cost).
    None without such rows."""
    from scipy.optimize import nnls

    del run_us
    runs: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        if row.get("mode") == "inference" and row.get("status") == "ok" and isinstance(row.get("ms"), (int, float)):
            runs.setdefault((row.get("model"), row.get("batch")), {})[row.get("policy")] = row
    samples = []
    for (model, batch), policies in sorted(runs.items(), key=str):
        plain, graph = policies.get("fp32"), policies.get("fp32-graph")
        launches = (plain or {}).get("ort_launches")
        if plain and graph and launches and sum(launches.values()):
            samples.append((f"{model} b{batch}", model, (launches.get("conv", 0), launches.get("other", 0)),
                            max(1e3 * (plain["ms"] - graph["ms"]), 0.0), 1e3 * plain["ms"]))
    if not samples:
        return None

    def fit(chosen) -> tuple[float, float]:
        design = np.array([x for _, _, x, _, _ in chosen], dtype=float)
        target = np.array([y for _, _, _, y, _ in chosen], dtype=float)
        if not design[:, 0].any():  # no convolutions: one per-launch figure for both classes
            other = float(nnls(design.sum(axis=1, keepdims=True), target)[0][0])
            return other, other
        conv, other = nnls(design, target)[0]
        return float(conv), float(other)

    conv, other = fit(samples)
    held_out = {}
    for key, model, (n_conv, n_other), host, plain in samples:
        rest = [s for s in samples if s[1] != model]
        if rest:
            c, o = fit(rest)
            held_out[key] = round((plain - host + c * n_conv + o * n_other) / plain - 1, 4)
    return {"conv": round(conv, 3), "other": round(other, 3), "host": "additive", "samples": len(samples),
            "per_model_us_per_launch": {key: round(host / sum(x), 3) for key, _, x, host, _ in samples},
            "leave_one_model_out_error": held_out,
            "rule": "non-negative least squares of (fp32 - fp32-graph inference us) over ORT's launches by class"}


def fit_run_overhead(rows: Iterable[dict]) -> dict | None:
    """Fixed cost of a run (``CostModel.run_us``): the fastest inference run replayed as a CUDA
    graph (``fp32-graph``, one launch: what is left is the call, the launch, the synchronisation
    and a few microseconds of kernels, so an upper bound). None without such rows."""
    times = {f"{row.get('model')} b{row.get('batch')}": round(1e3 * row["ms"], 3) for row in rows
             if row.get("mode") == "inference" and row.get("policy") == "fp32-graph" and row.get("status") == "ok"
             and isinstance(row.get("ms"), (int, float)) and row["ms"] > 0}
    if not times:
        return None
    fastest = min(times, key=times.get)
    return {"us": times[fastest], "model": fastest, "samples": len(times),
            "rule": "smallest fp32-graph inference ms: a replayed run of almost no GPU work"}


def with_launches(rows: list[dict], launches: Iterable[dict]) -> list[dict]:
    """``rows`` whose fp32 inference rows lack ``ort_launches`` take them from ``launches``
    (``{"model", "batch", "ort_launches"}`` lines: ORT's CPU stand-in counted them where the row
    was measured before the benchmark recorded them; ``benchmarks/graph_factors.py --launches-out``)."""
    known = {(entry["model"], entry["batch"]): entry for entry in launches}
    out = []
    for row in rows:
        entry = known.get((row.get("model"), row.get("batch")))
        if entry and row.get("policy") == "fp32" and row.get("mode") == "inference" and not row.get("ort_launches"):
            row = {**row, "ort_launches": entry["ort_launches"], "ort_provider": entry.get("ort_provider")}
        out.append(row)
    return out


def add_step_dispatch(bench_rows_path: str | Path, database_path: str | Path,
                      launches_path: str | Path | None = None) -> dict[str, dict]:
    """Fit ``dispatch_step`` (training), ``dispatch_model`` (inference), ``host_launch`` and
    ``run_overhead`` from a benchmark's rows into an existing database file (atomically); returns
    the entries fitted. ``launches_path``: launch counts for rows that have none (:func:`with_launches`)."""
    rows = load_samples(bench_rows_path)
    if launches_path is not None:
        rows = with_launches(rows, load_samples(launches_path))
    overhead = fit_run_overhead(rows)
    run_us = overhead["us"] if overhead else 0.0
    fitted = {key: entry for mode, key in DISPATCH_KEYS.items() if (entry := fit_step_dispatch(rows, mode, run_us))}
    launch = fit_host_launch(rows, run_us)
    if launch:
        fitted["host_launch"] = {"inference": launch}
    if fitted and overhead:
        fitted["run_overhead"] = overhead
    if not fitted:
        raise CostModelError(f"{bench_rows_path}: no training step or model with fp32 and fp32-graph rows where "
                             "the CUDA graph ran clearly faster")
    database = json.loads(Path(database_path).read_text())
    for key, entry in fitted.items():
        database[key] = {**entry, "source": Path(bench_rows_path).name}
    write_json(database, database_path)
    return fitted


def merge_fused_elementwise(database_path: str | Path, measured_path: str | Path) -> dict:
    """Write the ``fused_elementwise`` entry of ``benchmarks/fused_elementwise_costs.py``'s
    JSON (``bytes_per_us``, ``fixed_us``: the fused kernel's bandwidth fit) into a database file
    (atomically); returns the entry."""
    try:
        entry = json.loads(Path(measured_path).read_text())["fused_elementwise"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CostModelError(f"{measured_path}: not a fused-elementwise measurement ({exc})") from None
    if not (isinstance(entry.get("bytes_per_us"), (int, float)) and entry["bytes_per_us"] > 0
            and isinstance(entry.get("fixed_us"), (int, float)) and entry["fixed_us"] >= 0):
        raise CostModelError(f"{measured_path}: fused_elementwise needs bytes_per_us > 0 and fixed_us >= 0")
    database = json.loads(Path(database_path).read_text())
    database["fused_elementwise"] = {**entry, "source": Path(measured_path).name}
    write_json(database, database_path)
    return database["fused_elementwise"]


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def fit_file(samples_path: str | Path, out_path: str | Path, **kw) -> dict:
    """Fit the samples of a JSON-lines file and write the database atomically (JSON, indent 1)."""
    database = fit_database(load_samples(samples_path), **kw)
    previous = Path(out_path)
    if previous.is_file():  # fitted from benchmark rows (add_step_dispatch), not from these samples: keep it
        try:
            old = json.loads(previous.read_text())
        except (OSError, ValueError):
            old = {}
        for key in (*DISPATCH_KEYS.values(), "run_overhead", "host_launch", "fused_elementwise"):
            if old.get(key):
                database[key] = old[key]
    write_json(database, out_path)
    return database


def write_json(data: dict, out_path: str | Path) -> None:
    from onnxcampo.ir.io import write_text_atomically

    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise CostModelError(f"{out_path}: folder {out_path.parent} does not exist")
    write_text_atomically(out_path, json.dumps(data, indent=1) + "\n")
