"""Which cost model a run uses.

1. ``--device-db PATH`` (``OptimizeConfig.device_db``): that database;
2. else the database shipped for the GPU this machine has (``costdb/data/<gpu>.json``, the GPU
   name from ``nvidia-smi`` lowercased with spaces as dashes: ``nvidia-h200.json``);
3. else the analytic H200 roofline model.

``ONNXCAMPO_DEVICE`` overrides the detection: a GPU name (``"NVIDIA H200"``) picks that GPU's
database, ``none`` forces the analytic model.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.model import CostModel

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"


def slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.strip().lower()).strip("-")


@functools.lru_cache(maxsize=1)
def detected_gpu() -> str | None:
    """The first GPU's name, or None when there is none (or no ``nvidia-smi``)."""
    override = os.environ.get("ONNXCAMPO_DEVICE")
    if override is not None:
        return None if override.strip().lower() in ("", "none") else override
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return names[0] if out.returncode == 0 and names else None


def shipped_database(device_name: str | None) -> Path | None:
    if not device_name:
        return None
    path = DATA / f"{slug(device_name)}.json"
    return path if path.is_file() else None


def load_cost_model(device_db: Path | None = None) -> CostModel:
    from onnxcampo.costdb.regression import RegressionCostModel

    if device_db is not None:
        return RegressionCostModel.load(device_db)
    gpu = detected_gpu()
    shipped = shipped_database(gpu)
    if shipped is not None:
        log.info("using the cost database shipped for %s (%s)", gpu, shipped.name)
        return RegressionCostModel.load(shipped)
    if gpu:
        log.info("no cost database for %s; using the analytic H200 model", gpu)
    return AnalyticCostModel()
