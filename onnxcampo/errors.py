"""One exception family for everything a user can get wrong.

Every message is meant to be printed as one line on stderr by the CLI, so it names the thing
at fault (file, input, node, option) and, where there is one, the fix.
"""

from __future__ import annotations

import contextlib
import difflib
import shlex
from collections.abc import Iterable, Iterator
from contextvars import ContextVar


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


class ProviderUnavailableError(ConfigError):
    """The execution provider asked for is not in this ONNX Runtime build (``--provider cuda`` on
    the CPU build); the message says what to install."""


class OutputPathError(CampoError):
    """The output path is unusable (same as the input, in a missing folder, ...)."""


class CostModelError(CampoError):
    """A cost database is missing, corrupt or of an unsupported schema version."""


class ValidationError(CampoError):
    """The optimized model's outputs differ from the original's by more than the tolerance.
    ``report``: the optimization's report with the failed check, where there is one."""

    exit_code = 1
    report: dict | None = None


class OpsLibraryError(CampoError):
    """The custom-op library (onnxcampo_ops) is missing or cannot be loaded; the message says
    how to build it."""


class OnnxRuntimeMissingError(CampoError, ImportError):
    """``import onnxruntime`` fails: no ONNX Runtime installed (onnxcampo's core does not pin one:
    ``onnxcampo[cpu]`` or ``onnxcampo[gpu]``), or a broken one; the message says what to run
    (:mod:`onnxcampo.install`)."""


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


# --- naming options in messages ----------------------------------------------------------------
# Messages raised by code that the Python API and the command line share name an option the way
# the caller gave it: the OptimizeConfig field (``exclude_ops``) from Python, the flag
# (``--exclude-op``) under ``onnxcampo`` (cli.main runs inside :func:`command_line`).
_COMMAND_LINE: ContextVar[bool] = ContextVar("onnxcampo_command_line", default=False)
_ARGV: ContextVar[list[str] | None] = ContextVar("onnxcampo_argv", default=None)
_FLAGS = {"input_shapes": "--input-shape", "dim_values": "--dim", "exclude_ops": "--exclude-op",
          "include_ops": "--include-op", "exclude_nodes": "--exclude-node", "include_nodes": "--include-node"}
_NEGATED_FLAGS = {"keep_io_types": "--no-keep-io-types", "loss_scaling": "--no-loss-scaling",
                  "fuse_elementwise": "--no-fuse-elementwise", "fuse_reductions": "--no-fuse-reductions",
                  "channels_last": "--no-channels-last", "fused": "--no-fused-ops"}
_UNSET = object()


@contextlib.contextmanager
def command_line(argv: list[str] | None = None) -> Iterator[None]:
    """Within it, :func:`option` spells options as command-line flags; ``argv`` (the command's
    arguments) is what :func:`command_line_text` gives back, for the report."""
    token = _COMMAND_LINE.set(True)
    args = _ARGV.set(list(argv) if argv is not None else None)
    try:
        yield
    finally:
        _ARGV.reset(args)
        _COMMAND_LINE.reset(token)


def on_command_line() -> bool:
    return _COMMAND_LINE.get()


def command_line_text() -> str | None:
    """The running command as a shell line (``onnxcampo optimize m.onnx ...``), or None outside
    the command line."""
    argv = _ARGV.get()
    if not _COMMAND_LINE.get() or argv is None:
        return None
    return shlex.join(["onnxcampo", *argv])


def option(field: str, value: object = _UNSET) -> str:
    """An option as the caller gave it: ``option("tune", "cuda")`` is ``tune='cuda'`` from
    Python and ``--tune cuda`` on the command line; ``option("keep_io_types", False)`` is
    ``keep_io_types=False`` or ``--no-keep-io-types``. An experimental option
    (:class:`~onnxcampo.config.ExperimentalOptions`) is ``experimental={'int8_avg': True}`` or
    ``--experimental int8_avg=true``."""
    from onnxcampo.config import ExperimentalOptions

    if field in ExperimentalOptions.names():
        if not _COMMAND_LINE.get():
            return f"experimental={{{field!r}: {'...' if value is _UNSET else repr(value)}}}"
        text = "VALUE" if value is _UNSET else str(value).lower() if isinstance(value, bool) else value
        return f"--experimental {field}={text}"
    if not _COMMAND_LINE.get():
        return field if value is _UNSET else f"{field}={value!r}"
    if value is False and field in _NEGATED_FLAGS:
        return _NEGATED_FLAGS[field]
    flag = _FLAGS.get(field, "--" + field.replace("_", "-"))
    return flag if value is _UNSET or value is True else f"{flag} {value}"


def did_you_mean(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str:
    """``": did you mean 'MatMul'?"`` for the closest candidate (a case-insensitive match first,
    else difflib's), or ``""``."""
    candidates = sorted(set(candidates))
    folded = [c for c in candidates if c.lower() == name.lower()]
    close = folded or difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return f": did you mean {close[0]!r}?" if close else ""
