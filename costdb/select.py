"""Which cost model a run uses, the first that applies:

1. ``--device-db PATH`` (``OptimizeConfig.device_db``): that database;
2. the database ``onnxcampo costdb calibrate`` measured on this GPU with this ONNX Runtime and
   CUDA (:func:`user_database_path`: the user's cache folder, keyed by the GPU's name and the
   two versions); a file there that is not a valid database is reported and ignored;
3. the database shipped for this GPU (``costdb/data/<gpu>.json``, the GPU's name lowercased with
   runs of other characters as dashes: ``nvidia-h100-80gb-hbm3.json``);
4. on a GPU without a database: the analytic roofline model built from that GPU's own specs
   (:mod:`onnxcampo.costdb.device`), with one warning saying that the plan is uncalibrated and
   how to calibrate;
5. without a GPU (planning on another machine): the analytic model of the reference GPU (an
   H200), logged at info level; ``ONNXCAMPO_DEVICE`` or ``--device-db`` name the target.

``ONNXCAMPO_DEVICE`` overrides the detection: a GPU name (``"NVIDIA H100 80GB HBM3"``) picks that
GPU's databases (the specs are then unknown: case 4 falls back to case 5), ``none`` forces the
reference analytic model. ``ONNXCAMPO_CACHE_DIR`` moves the cache folder (default
``$XDG_CACHE_HOME/onnxcampo``, else ``~/.cache/onnxcampo``).
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import os
import re
from pathlib import Path

from onnxcampo.costdb.analytic import TYPICAL_HOST, AnalyticCostModel
from onnxcampo.costdb.device import GpuSpec, gpu_spec, peaks_for
from onnxcampo.costdb.model import CostModel
from onnxcampo.errors import CostModelError

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"


def slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.strip().lower()).strip("-")


def _override() -> str | None:
    return os.environ.get("ONNXCAMPO_DEVICE")


@functools.lru_cache(maxsize=1)
def detected_gpu() -> str | None:
    """The first GPU's name (``ONNXCAMPO_DEVICE`` when set), or None when there is none."""
    override = _override()
    if override is not None:
        return None if override.strip().lower() in ("", "none") else override.strip()
    spec = gpu_spec()
    return spec.name if spec is not None else None


def detected_spec() -> GpuSpec | None:
    """The detected GPU's spec, None without one or when ``ONNXCAMPO_DEVICE`` names a GPU."""
    return None if _override() is not None else gpu_spec()


def cache_dir() -> Path:
    """The user's folder for calibrated databases (``ONNXCAMPO_CACHE_DIR``, else the XDG cache)."""
    explicit = os.environ.get("ONNXCAMPO_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "costdb"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "onnxcampo" / "costdb"


def runtime_versions() -> tuple[str, str]:
    """(ONNX Runtime version, the CUDA version its build targets; "" for a CPU build)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "", ""
    cuda = ""
    try:
        from onnxruntime.capi import build_and_package_info as build

        cuda = str(getattr(build, "cuda_version", "") or "")
    except ImportError:
        pass
    return ort.__version__, cuda


def user_database_key(device_name: str, ort_version: str, cuda_version: str) -> str:
    return f"{slug(device_name)}--ort-{slug(ort_version) or 'none'}--cuda-{slug(cuda_version) or 'none'}"


def user_database_path(device_name: str, ort_version: str | None = None, cuda_version: str | None = None) -> Path:
    """Where ``costdb calibrate`` keeps the database of ``device_name`` with these versions
    (default: the installed ONNX Runtime's)."""
    if ort_version is None or cuda_version is None:
        ort_version, cuda_version = runtime_versions()
    return cache_dir() / f"{user_database_key(device_name, ort_version, cuda_version)}.json"


def shipped_database(device_name: str | None) -> Path | None:
    if not device_name:
        return None
    path = DATA / f"{slug(device_name)}.json"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def _say_once(message: str) -> None:
    """A warning once per process (every optimize call loads the cost model again)."""
    log.warning("%s", message)


def _age_days(date: str | None) -> int | None:
    try:
        return (dt.date.today() - dt.date.fromisoformat(str(date)[:10])).days
    except (TypeError, ValueError):
        return None


def _regression(path: Path, origin: str) -> CostModel:
    from onnxcampo.costdb.regression import RegressionCostModel

    model = RegressionCostModel.load(path)
    device = model.database["device"]
    model.origin = {"source": origin, "path": str(path), "gpu": device.get("name"),
                    "measured": device.get("date"), "age_days": _age_days(device.get("date"))}
    return model


def load_cost_model(device_db: Path | None = None) -> CostModel:
    """The cost model of the module's rules; its ``origin`` says which rule chose it."""
    if device_db is not None:
        return _regression(Path(device_db), "--device-db")
    gpu = detected_gpu()
    if gpu:
        calibrated = user_database_path(gpu)
        if calibrated.is_file():
            try:
                model = _regression(calibrated, "calibrated")
            except CostModelError as exc:
                _say_once(f"ignoring the calibrated cost database {calibrated}: {exc}; run "
                          "`onnxcampo costdb calibrate --fresh` to measure it again")
            else:
                log.info("using the cost database calibrated on this %s (%s)", gpu, calibrated)
                return model
        shipped = shipped_database(gpu)
        if shipped is not None:
            log.info("using the cost database shipped for %s (%s)", gpu, shipped.name)
            return _regression(shipped, "shipped")
    spec = detected_spec() if gpu else None
    peaks = peaks_for(spec) if spec is not None else None
    if peaks is not None:
        _say_once(f"no cost database for {gpu}: the plan is uncalibrated (a roofline model from its specs: "
                  f"{spec.describe()}); `onnxcampo costdb calibrate` measures one in about 10 minutes")
        model = AnalyticCostModel(peaks, host=TYPICAL_HOST)
        model.origin = {"source": "analytic-spec", "gpu": gpu, "spec": spec.to_json()}
        return model
    model = AnalyticCostModel()
    if gpu:
        _say_once(f"no cost database for {gpu} and its specs are unknown here: the plan is uncalibrated (the "
                  "reference H200 roofline model); `onnxcampo costdb calibrate` on that GPU measures one")
    else:
        log.info("no GPU here: planning with the reference H200 roofline model (ONNXCAMPO_DEVICE or --device-db "
                 "name the GPU the model will run on)")
    model.origin = {"source": "analytic-reference", "gpu": gpu}
    return model
