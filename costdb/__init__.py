"""Cost models: predicted fp32/fp16 node times and Cast costs (``onnxcampo.costdb``)."""

from onnxcampo.costdb.analytic import AnalyticCostModel, DevicePeaks, H200
from onnxcampo.costdb.features import OpFeatures, op_features
from onnxcampo.costdb.model import CostModel

__all__ = ["AnalyticCostModel", "CostModel", "DevicePeaks", "H200", "OpFeatures", "op_features"]
