"""Which cost model a run uses: ``--device-db``, else the database shipped for the running GPU,
else the analytic H200 model."""

from __future__ import annotations

import logging
from pathlib import Path

from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.model import CostModel

log = logging.getLogger(__name__)


def load_cost_model(device_db: Path | None = None) -> CostModel:
    if device_db is not None:
        from onnxcampo.costdb.regression import RegressionCostModel

        return RegressionCostModel.load(device_db)
    return AnalyticCostModel()
