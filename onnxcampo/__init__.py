"""onnxcampo: cost-aware mixed-precision optimizer for ONNX graphs (the Campo method)."""

__version__ = "0.1.0"

# The public names are imported on first use (PEP 562): ``import onnxcampo.<module>`` stays cheap,
# which the child process that test-loads written models (onnxcampo.runtime.isolated) and the
# CLI's start rely on. The core pins no ONNX Runtime (onnxcampo[cpu] or onnxcampo[gpu]): the
# names that need it say what to install when it is missing (onnxcampo.install).
_PUBLIC = {
    "CampoError": "onnxcampo.errors",
    "OptimizeConfig": "onnxcampo.config",
    "OptimizeResult": "onnxcampo.api",
    "Precision": "onnxcampo.plan",
    "PrecisionPlan": "onnxcampo.plan",
    "optimize": "onnxcampo.api",
}
_NEED_ONNXRUNTIME = ("OptimizeResult", "optimize")

__all__ = ["CampoError", "OptimizeConfig", "OptimizeResult", "Precision", "PrecisionPlan", "__version__", "optimize"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        if name in _NEED_ONNXRUNTIME:
            from onnxcampo.install import require_onnxruntime

            require_onnxruntime()
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'onnxcampo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
