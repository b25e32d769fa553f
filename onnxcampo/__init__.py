"""onnxcampo: cost-aware mixed-precision optimizer for ONNX graphs (the Campo method)."""

__version__ = "0.1.0"

from onnxcampo.config import OptimizeConfig  # noqa: E402
from onnxcampo.errors import CampoError  # noqa: E402
from onnxcampo.plan import Precision, PrecisionPlan  # noqa: E402

try:  # the core does not pin ONNX Runtime (onnxcampo[cpu] or onnxcampo[gpu] brings one)
    import onnxruntime as _onnxruntime  # noqa: F401
except ImportError:  # the API says so, in one line, when it is used (onnxcampo.install)
    def __getattr__(name: str):
        if name in ("OptimizeResult", "optimize"):
            from onnxcampo.install import require_onnxruntime

            require_onnxruntime()
        raise AttributeError(f"module 'onnxcampo' has no attribute {name!r}")
else:
    from onnxcampo.api import OptimizeResult, optimize

__all__ = ["CampoError", "OptimizeConfig", "OptimizeResult", "Precision", "PrecisionPlan", "__version__", "optimize"]
