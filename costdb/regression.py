"""A cost database fitted on one GPU (Campo's per-op linear models), behind :class:`CostModel`.

Schema (``schema_version`` 1)::

    {"schema_version": 1,
     "device": {"name", "compute_capability", "ort_version", "cuda_version", "date"},
     "cast": {"C_I": us, "r": us per element},
     "pad": {"C_I": us, "r": us per element,                   # optional; pooled Pad+Slice,
             "Pad": {"C_I", "r"}, "Slice": {"C_I", "r"}},      # and per op when fitted
     "ops": {"MatMul": {"fp32": MODEL, "fp16": MODEL, "fp16_tc": MODEL,   # fp16_tc optional
                        "fp16_even": MODEL,                                # optional, see fp16_model
                        "fp16_ratio": [lo, hi],     # optional: fp16/fp32 over the measured cases,
                                                    # which bounds every fp16 prediction
                        "samples": n, "holdout_mape": x}, ...},
     "summary": {"holdout_mape", "wrong_decision_rate", "samples"}}

    MODEL = {"features": [names], "coef": [w_i], "intercept": b, "sigma": s}   # sigma: fp16 only

A prediction is ``b + sum_i w_i * f_i (+ sigma * t_fp32)`` with features from
:func:`feature_vector`. Op types the database lacks fall back to the analytic model.

An optional ``"measured": {shape_key: {"fp32": us, "fp16": us}}`` holds the measured times of
every measured shape, held-out ones included (the evaluation drops the table, so held-out errors
are the models' own): a node of exactly such a shape gets its measured times, its fp16 time
scaled by the node's fp32 time over the measured one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.features import OpFeatures
from onnxcampo.costdb.model import DEFAULT_FUSED_KERNEL, CostModel, FusedKernelCost
from onnxcampo.errors import CostModelError

SCHEMA_VERSION = 1
H200_SMS = 132  # streaming multiprocessors: one output tile per SM per wave
TILES = ((64, 64), (128, 128), (128, 256))  # CUTLASS/cuBLAS output tiles (M x N) on Hopper
TILE_K = 32
SHAPE_FEATURES = ("flops", "elements", "elements_out", "intensity", "aligned", "log_flops", "log_elements",
                  "padded_flops", "wave_flops_64", "wave_flops_128", "wave_flops_256",
                  "waves_64", "waves_128", "waves_256", "wave_eff_64", "wave_eff_128", "wave_eff_256",
                  "log_k", "log_mn")
# Features of the fp32 run (Campo's counters are measured in the fp32 run too): the measured fp32
# time times a shape quantity, so that the fp16/fp32 ratio may change with size. Candidates of
# fp16 models only.
FP32_RUN_FEATURES = ("t32_log_flops", "t32_log_elements", "t32_wave_eff_128")
FEATURES = SHAPE_FEATURES + FP32_RUN_FEATURES


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def feature_vector(features: OpFeatures, fp32_time: float | None = None) -> dict[str, float]:
    """Candidate features of a node; the fp32-run ones are 0 without ``fp32_time``.

    Products (``gemm`` dims) get tile and wave features: an output tile of TM x TN runs on one
    SM, ``waves = ceil(tiles / 132)``, and a GEMM takes about ``waves`` times the time of one tile
    (``wave_flops``: the FLOPs of the padded waves, ``wave_eff``: the share of the last-wave slots
    doing work). Other ops get 0 for them.
    """
    flops, elements = features.flops, max(features.elements, 1)
    values = {
        "flops": flops,
        "elements": float(features.elements),
        "elements_out": float(features.elements_out),
        "intensity": flops / elements,
        "aligned": 1.0 if features.tensor_core_aligned else 0.0,
        "log_flops": math.log1p(flops),
        "log_elements": math.log1p(elements),
    }
    gemm = {name: 0.0 for name in SHAPE_FEATURES if name not in values}
    if features.gemm is not None:
        batch, m, k, n = (max(int(d), 1) for d in features.gemm)
        gemm["padded_flops"] = 2.0 * batch * _ceil(m, 8) * 8 * _ceil(k, 8) * 8 * _ceil(n, 8) * 8
        k_padded = _ceil(k, TILE_K) * TILE_K
        for tm, tn in TILES:
            tiles = batch * _ceil(m, tm) * _ceil(n, tn)
            waves = _ceil(tiles, H200_SMS)
            gemm[f"wave_flops_{tn}"] = 2.0 * waves * H200_SMS * tm * tn * k_padded
            gemm[f"waves_{tn}"] = float(waves)
            gemm[f"wave_eff_{tn}"] = tiles / (waves * H200_SMS)
        gemm["log_k"] = math.log(k)
        gemm["log_mn"] = math.log(batch * m * n)
    values.update(gemm)
    t32 = float(fp32_time) if fp32_time is not None else 0.0
    values["t32_log_flops"] = t32 * values["log_flops"]
    values["t32_log_elements"] = t32 * values["log_elements"]
    values["t32_wave_eff_128"] = t32 * gemm["wave_eff_128"]
    return values


def shape_key(features: OpFeatures) -> str:
    """Identifies a node's shape through its features: the GEMM dims of a product (exact also for
    the padded shapes :meth:`OpFeatures.with_gemm` describes), element counts otherwise."""
    if features.gemm is not None:
        return f"{features.op_type}|gemm={features.gemm}|kernel={features.kernel}"
    return f"{features.op_type}|{features.flops:.0f}|{features.elements}|{features.elements_out}"


def _linear(model: dict, values: dict[str, float], fp32_time: float | None = None) -> float:
    total = float(model.get("intercept", 0.0))
    for name, weight in zip(model["features"], model["coef"]):
        total += weight * values[name]
    if fp32_time is not None:
        total += float(model.get("sigma", 0.0)) * fp32_time
    return max(total, 0.0)


class RegressionCostModel(CostModel):
    def __init__(self, database: dict, *, source: str = "database") -> None:
        validate_database(database, source)
        self.database = database
        self.name = f"{database['device']['name']} (regression, {source})"
        self.fallback = _fallback_model(database)
        self.measured = database.get("measured", {})

    @classmethod
    def load(cls, path: str | Path) -> "RegressionCostModel":
        path = Path(path)
        if not path.is_file():
            raise CostModelError(f"{path}: cost database not found")
        try:
            database = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CostModelError(f"{path}: not a cost database (invalid JSON: {exc})") from None
        return cls(database, source=str(path))

    def fp32_time(self, features: OpFeatures) -> float:
        measured = self.measured.get(shape_key(features)) if features.known else None
        if measured is not None:
            return float(measured["fp32"])
        entry = self.database["ops"].get(features.op_type)
        if entry is None or not features.known:
            return self.fallback.fp32_time(features)
        return _linear(regime_entry(entry, features)["fp32"], feature_vector(features))

    def fp16_time(self, features: OpFeatures, fp32_time: float) -> float:
        measured = self.measured.get(shape_key(features)) if features.known else None
        if measured is not None:
            scale = fp32_time / measured["fp32"] if measured["fp32"] > 0 else 1.0
            return float(measured["fp16"]) * scale
        entry = self.database["ops"].get(features.op_type)
        if entry is None or not features.known:
            return self.fallback.fp16_time(features, fp32_time)
        model = fp16_model(regime_entry(entry, features), features)
        predicted = _linear(model, feature_vector(features, fp32_time), fp32_time)
        bounds = entry.get("fp16_ratio")
        if bounds and fp32_time > 0:  # a linear model off its grid: no further than the op ever measured
            predicted = min(max(predicted, bounds[0] * fp32_time), bounds[1] * fp32_time)
        return predicted

    def cast_time(self, elements: int) -> float:
        cast = self.database["cast"]
        return float(cast["C_I"]) + float(cast["r"]) * elements

    def pad_time(self, elements: int, kind: str = "Pad") -> float:
        pad = self.database.get("pad")
        if pad is None:
            return self.fallback.pad_time(elements, kind)
        model = pad.get(kind, pad)  # per-op fits when present (Pad costs ~3x Slice), else pooled
        return float(model["C_I"]) + float(model["r"]) * elements

    def dispatch_us(self, training: bool = False) -> float:
        """The single-op figure (``dispatch``), or the larger whole-run one fitted from benchmark
        rows (``dispatch_step`` for training steps, ``dispatch_model`` for models) where present."""
        single = self.database.get("dispatch", {}).get("us")
        single = float(single) if isinstance(single, (int, float)) and single > 0 else 0.0
        whole = self.database.get("dispatch_step" if training else "dispatch_model", {}).get("us")
        return max(single, float(whole)) if isinstance(whole, (int, float)) and whole > 0 else single

    def launch_us(self, op_class: str = "other", training: bool = False) -> float:
        """``host_launch[mode][op_class]`` fitted from whole-model runs (``costdb.fit.fit_host_launch``),
        else the per-node figure of :meth:`dispatch_us`."""
        fitted = self.database.get("host_launch", {}).get("training" if training else "inference", {})
        value = fitted.get(op_class, fitted.get("other"))
        return float(value) if isinstance(value, (int, float)) and value > 0 else self.dispatch_us(training)

    def library_launch_us(self, kind: str) -> float | None:
        value = self.database.get("host_launch", {}).get("inference", {}).get(kind)
        return float(value) if isinstance(value, (int, float)) and value >= 0 else None

    def host_adds(self, training: bool = False) -> bool:
        """True where ``host_launch`` was fitted additive from whole runs (``fit_host_launch``)."""
        fitted = self.database.get("host_launch", {}).get("training" if training else "inference", {})
        return fitted.get("host") == "additive"

    def host_overlap(self, training: bool = False) -> float:
        """``host_launch``'s fitted ``overlap`` share where the database has one (in [0, 1]),
        else 1 or 0 as :meth:`host_adds` says."""
        fitted = self.database.get("host_launch", {}).get("training" if training else "inference", {})
        share = fitted.get("overlap")
        if isinstance(share, (int, float)) and 0.0 <= share <= 1.0:
            return float(share)
        return super().host_overlap(training)

    def run_us(self) -> float:
        """``run_overhead`` fitted from benchmark rows (``costdb fit-step-dispatch``), else 0."""
        value = self.database.get("run_overhead", {}).get("us")
        return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0

    def chain_factor(self, pattern: str, precision: str) -> float:
        entry = self.database.get("chains", {}).get(pattern, {})
        value = entry.get(precision)
        return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0

    def fused_kernel(self) -> FusedKernelCost:
        """``fused_elementwise`` (``bytes_per_us``, ``fixed_us``) where the database has it."""
        entry = self.database.get("fused_elementwise", {})
        rate, fixed = entry.get("bytes_per_us"), entry.get("fixed_us")
        if isinstance(rate, (int, float)) and rate > 0 and isinstance(fixed, (int, float)) and fixed >= 0:
            return FusedKernelCost(float(rate), float(fixed), measured=bool(entry.get("measured", True)))
        return DEFAULT_FUSED_KERNEL

    def describe(self) -> dict:
        return {"name": self.name, "kind": "regression", "device": self.database["device"],
                "summary": self.database.get("summary", {}), **self._origin()}


def _fallback_model(database: dict) -> AnalyticCostModel:
    """The analytic model for what the database lacks: from the GPU's specs where the database
    records them (``device.spec``, written by ``costdb calibrate``), else the reference model."""
    from onnxcampo.costdb.device import GpuSpec, peaks_for

    spec = database["device"].get("spec")
    if isinstance(spec, dict):
        try:
            peaks = peaks_for(GpuSpec(**spec))
        except TypeError:
            peaks = None
        if peaks is not None:
            return AnalyticCostModel(peaks)
    return AnalyticCostModel()


# Kernel regimes: op types whose cases fall into groups run by different kernel families get one
# set of models per group under "regimes" (the op entry keeps its pooled models, which readers
# unaware of regimes use). Conv: 1x1 convolutions are plain GEMMs; spatial kernels go through
# cuDNN's implicit-GEMM / Winograd / FFT algorithms.
REGIME_RULES = {"Conv": ("kernel", lambda f: "1x1" if f.kernel == 1 else "spatial")}


def regime_entry(entry: dict, features: OpFeatures) -> dict:
    """The sub-entry of the node's regime when the entry has one, else the entry itself."""
    regimes = entry.get("regimes")
    rule = REGIME_RULES.get(features.op_type)
    if not isinstance(regimes, dict) or rule is None or regimes.get("rule") != rule[0]:
        return entry
    return regimes.get("models", {}).get(rule[1](features), entry)


def fp16_model(entry: dict, features: OpFeatures) -> dict:
    """The fp16 MODEL of an op entry for a node: ``fp16_tc`` when Tensor Core aligned,
    ``fp16_even`` when K and N are even but not aligned (:attr:`OpFeatures.even_aligned`), each
    only where the entry has it; ``fp16`` otherwise."""
    if features.tensor_core_aligned and "fp16_tc" in entry:
        return entry["fp16_tc"]
    if features.even_aligned and "fp16_even" in entry:
        return entry["fp16_even"]
    return entry["fp16"]


def validate_database(database: object, source: str = "database") -> None:
    """Raise :class:`CostModelError` naming the first problem of a database."""
    if not isinstance(database, dict):
        raise CostModelError(f"{source}: not a cost database (top level is not an object)")
    version = database.get("schema_version")
    if version != SCHEMA_VERSION:
        raise CostModelError(
            f"{source}: cost database schema version {version!r}; this onnxcampo reads version {SCHEMA_VERSION}"
        )
    for key in ("device", "cast", "ops"):
        if key not in database:
            raise CostModelError(f"{source}: cost database lacks {key!r}")
    cast = database["cast"]
    if not isinstance(cast, dict) or not all(isinstance(cast.get(k), (int, float)) for k in ("C_I", "r")):
        raise CostModelError(f"{source}: 'cast' needs numbers 'C_I' and 'r'")
    if not isinstance(database["device"], dict) or "name" not in database["device"]:
        raise CostModelError(f"{source}: 'device' needs a 'name'")
    for op, entry in database["ops"].items():
        _validate_entry(source, op, entry)
        regimes = entry.get("regimes") if isinstance(entry, dict) else None
        if regimes is not None:
            if not isinstance(regimes, dict) or not isinstance(regimes.get("models"), dict):
                raise CostModelError(f"{source}: op {op!r} has malformed 'regimes'")
            for name, sub in regimes["models"].items():
                _validate_entry(source, f"{op}[{name}]", sub)


def _validate_entry(source: str, op: str, entry: object) -> None:
    for kind in ("fp32", "fp16", "fp16_tc", "fp16_even"):
        model = entry.get(kind) if isinstance(entry, dict) else None
        if model is None and kind in ("fp16_tc", "fp16_even"):
            continue
        if not isinstance(model, dict) or not isinstance(model.get("features"), list) \
                or not isinstance(model.get("coef"), list) or len(model["features"]) != len(model["coef"]):
            raise CostModelError(f"{source}: op {op!r} has no valid {kind!r} model")
        unknown = set(model["features"]) - set(FEATURES)
        if unknown:
            raise CostModelError(f"{source}: op {op!r} uses unknown features {sorted(unknown)}")
