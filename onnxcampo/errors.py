"""One exception family for everything a user can get wrong.

Every message is meant to be printed as one line on stderr by the CLI, so it names the thing
at fault (file, input, node, option) and, where there is one, the fix.
"""

from __future__ import annotations


class CampoError(Exception):
    """Base class: a problem the user can act on (bad file, bad option, unsupported model)."""

    exit_code = 2


class ModelLoadError(CampoError):
    """The input file is missing, unreadable, not ONNX, truncated or fails the ONNX checker."""


class UnsupportedModelError(CampoError):
    """The model is valid ONNX but uses something onnxcampo cannot handle (old opset, ...)."""


class ShapeError(CampoError):
    """A dynamic dimension cannot be resolved; the message says how to pin it."""


class ConfigError(CampoError):
    """An option has a bad value (unknown policy, malformed --input-shape, bad regex, ...)."""


class OutputPathError(CampoError):
    """The output path is unusable (same as the input, in a missing folder, ...)."""


class CostModelError(CampoError):
    """A cost database is missing, corrupt or of an unsupported schema version."""


class ValidationError(CampoError):
    """The optimized model's outputs differ from the original's by more than the tolerance."""

    exit_code = 1


class OpsLibraryError(CampoError):
    """The custom-op library (onnxcampo_ops) is missing or cannot be loaded; the message says
    how to build it."""


class WrittenModelLoadError(ModelLoadError):
    """ONNX Runtime cannot load a model onnxcampo was about to write (``ir.save_model``
    test-loads it first), so nothing was written. A bug of onnxcampo or of ONNX Runtime, not of
    the input: the message names the execution provider and ORT's cause."""

    exit_code = 3


class RuntimeCrashError(CampoError):
    """ONNX Runtime crashed (a signal) or hung in the child process onnxcampo runs it in
    (:mod:`onnxcampo.runtime.isolated`); ``signal`` is the signal's number, if one."""

    exit_code = 3

    def __init__(self, message: str, *, signal: int | None = None) -> None:
        super().__init__(message)
        self.signal = signal
