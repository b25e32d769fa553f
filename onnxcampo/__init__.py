"""onnxcampo: cost-aware mixed-precision optimizer for ONNX graphs (the Campo method)."""

__version__ = "0.1.0"

from onnxcampo.config import OptimizeConfig  # noqa: E402
from onnxcampo.errors import CampoError  # noqa: E402
from onnxcampo.install import onnxruntime_error  # noqa: E402
from onnxcampo.plan import Precision, PrecisionPlan  # noqa: E402

if onnxruntime_error() is not None:  # the core pins no ONNX Runtime: onnxcampo[cpu] or onnxcampo[gpu]
    def __getattr__(name: str):  # the API says what to install when it is used (onnxcampo.install)
        if name in ("OptimizeResult", "optimize"):
            from onnxcampo.install import require_onnxruntime

            require_onnxruntime()
        raise AttributeError(f"module 'onnxcampo' has no attribute {name!r}")
else:
    from onnxcampo.api import OptimizeResult, optimize

__all__ = ["CampoError", "OptimizeConfig", "OptimizeResult", "Precision", "PrecisionPlan", "__version__", "optimize"]
