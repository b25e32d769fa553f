"""The program: :func:`main` parses, sets up logging (``-q``, ``-v``, ``--log-file``), runs the
command and turns errors into one line on stderr and an exit code."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import signal
import sys

from onnxcampo.cli import bench, costdb, inspect, optimize, train, train_graph
from onnxcampo.cli.parser import build_parser
from onnxcampo.config import ExperimentalOptions
from onnxcampo.errors import CampoError, command_line, did_you_mean
from onnxcampo.install import require_onnxruntime

COMMANDS = {"optimize": optimize, "inspect": inspect, "train-graph": train_graph, "train": train, "bench": bench,
            "costdb": costdb}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            _unrecognized(parser, args, extras)
    except SystemExit as exc:  # --help, --version, or a usage error (one line, printed already)
        return exc.code if isinstance(exc.code, int) else 2
    if args.quiet and args.verbose:
        print("onnxcampo: error: -q and -v exclude each other", file=sys.stderr)
        return 2
    if args.log_file is not None and not args.log_file.parent.is_dir():
        print(f"onnxcampo: error: --log-file {args.log_file}: folder {args.log_file.parent} does not exist", file=sys.stderr)
        return 2
    _configure_logging(args)
    try:
        with command_line(sys.argv[1:] if argv is None else argv), _quiet(args.quiet):
            require_onnxruntime()  # not pinned by the core: onnxcampo[cpu] or onnxcampo[gpu]
            code = COMMANDS[args.command].run(args)
            sys.stdout.flush()  # a reader that left (``| head``) shows here, not at the interpreter's exit
            return code
    except BrokenPipeError:
        return _reader_left()
    except CampoError as exc:
        print(f"onnxcampo: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - a bug: one line unless --debug
        if args.debug:
            raise
        print(f"onnxcampo: internal error: {exc.__class__.__name__}: {exc} (rerun with --debug for details)", file=sys.stderr)
        return 3


def _reader_left() -> int:
    """The reader of stdout closed it (``onnxcampo inspect M --nodes | head -1``): end quietly, as
    a program that SIGPIPE stops does (exit status 141), with nothing more written to the pipe."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """The usage error of the (sub)command given, naming the closest option of that command."""
    for name in (args.command, getattr(args, "costdb_command", None)):
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if name is None or action is None:
            break
        parser = action.choices[name]
    flags = [flag for action in parser._actions for flag in action.option_strings]
    unknown = next((extra.split("=")[0] for extra in extras if extra.startswith("-")), None)
    hint = did_you_mean(unknown, flags, cutoff=0.75) if unknown else ""
    if unknown and not hint and "--experimental" in flags:
        hint = _experimental_hint(unknown)
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def _experimental_hint(flag: str) -> str:
    """``--no-fuse-column-sums``, ``--cost-graph``: the ``--experimental`` setting of that name."""
    name = flag.lstrip("-")
    negated = name.startswith("no-")
    key = name.removeprefix("no-").replace("-", "_")
    if key not in ExperimentalOptions.names():
        return ""
    default = getattr(ExperimentalOptions(), key)
    value = "false" if negated else "true" if default is False else "VALUE"
    return f": {key} is an experimental option: --experimental {key}={value}"


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# timing candidates and benchmarks take a while: their info lines are shown without -v
PROGRESS_LOGGERS = {"tune": ("onnxcampo.tune",), "bench": ("onnxcampo.bench", "onnxcampo.runtime.timing")}


class ConsoleFormatter(logging.Formatter):
    """Warnings and errors in the program's own style (``onnxcampo: warning: ...``, as its error
    lines are); info and debug lines (``-v``, ``-vv``) keep their level and logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.WARNING:
            return super().format(record)
        text = f"onnxcampo: {'error' if record.levelno >= logging.ERROR else 'warning'}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class OncePerRun(logging.Filter):
    """Passes each distinct warning or error once (distinct: another logger or another formatted
    message); lower levels pass. Every probe of the culprit search re-optimizes the model, and a
    model is read more than once: their warnings would repeat."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def _configure_logging(args: argparse.Namespace) -> None:
    """stderr: warnings and errors (-q too), each distinct one once, info with -v, debug with -vv,
    and the progress of --tune and bench unless -q; --log-file: every record, debug level,
    timestamped."""
    level = logging.WARNING if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    progress = () if args.quiet else (
        *(PROGRESS_LOGGERS["tune"] if getattr(args, "tune", None) else ()),
        *(PROGRESS_LOGGERS["bench"] if args.command == "bench" else ()))

    def shown(record: logging.LogRecord) -> bool:
        return record.levelno >= level or (record.levelno >= logging.INFO and any(
            record.name == name or record.name.startswith(name + ".") for name in progress))

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(ConsoleFormatter(LOG_FORMAT))
    console.addFilter(shown)
    console.addFilter(OncePerRun())
    handlers: list[logging.Handler] = [console]
    if args.log_file is not None:
        log_file = logging.FileHandler(args.log_file, mode="w", encoding="utf-8")
        log_file.setFormatter(logging.Formatter("%(asctime)s " + LOG_FORMAT))
        handlers.append(log_file)
    root = logging.DEBUG if args.log_file is not None else min(level, logging.INFO if progress else level)
    logging.basicConfig(level=root, handlers=handlers, force=True)


@contextlib.contextmanager
def _quiet(quiet: bool):
    """-q: the commands' own stderr lines (summaries, 'wrote', validation and progress lines)
    are dropped; the log handler keeps the real stderr, so warnings and errors still show."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield
