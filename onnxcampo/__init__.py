"""onnxcampo: cost-aware mixed-precision optimizer for ONNX graphs (the Campo method)."""

__version__ = "0.1.0"

from onnxcampo.api import OptimizeResult, optimize  # noqa: E402
from onnxcampo.config import OptimizeConfig  # noqa: E402
from onnxcampo.errors import CampoError  # noqa: E402
from onnxcampo.plan import Precision, PrecisionPlan  # noqa: E402

__all__ = ["CampoError", "OptimizeConfig", "OptimizeResult", "Precision", "PrecisionPlan", "__version__", "optimize"]
