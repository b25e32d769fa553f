"""ONNX Runtime in a child process, so that a crash of ORT (a segfault at session creation) is an
error of onnxcampo instead of the end of the process.

The test-load of every written model (:mod:`onnxcampo.runtime.check`) and the CLI's
``--validate`` runs go through here. How:

1. the child is ``sys.executable`` running :func:`serve` (a plain subprocess, not
   ``multiprocessing``: spawning would re-import the caller's ``__main__``), with the parent's
   ``sys.path``; requests and answers are pickles over its stdin/stdout, which the child keeps for
   itself (ORT's own prints go to stderr);
2. the child loads this file by its path, not the ``onnxcampo.runtime`` package, and imports
   only onnxruntime at its start: a test-load (:func:`create_session`, from the recipe
   :func:`onnxcampo.runtime.session_recipe` makes of ``make_session``'s options) needs nothing
   else, so the child is ready in about the time ``import onnxruntime`` takes; ``--validate``'s
   runs import the rest of onnxcampo there (early when :func:`start` is told they will come);
3. a request names a function of :data:`FUNCTIONS` (nothing else runs there); models go as file
   paths or serialized bytes, never as live objects; the answer is the return value or the
   exception raised, plus the log records the child's ``onnxcampo`` loggers wrote, which the
   parent logs again under the same names;
4. one child serves the process, started at the first request (or earlier by :func:`start`: the
   CLI's ``optimize`` starts it before planning, so that its imports, a second or two, overlap the
   work) and kept for the next (the test-load and ``--validate`` share it; a test run's saves
   too), until :func:`close` or the end of the process; after a crash the next request starts a
   new one;
5. a child that dies (a negative return code: a signal) or does not answer within the time limit
   (:data:`TIMEOUT_S`, ``$ONNXCAMPO_CHILD_TIMEOUT_S``; then it is killed) raises
   :class:`~onnxcampo.errors.RuntimeCrashError`; the caller says what was being done.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from onnxcampo.errors import RuntimeCrashError

log = logging.getLogger(__name__)

TIMEOUT_S = float(os.environ.get("ONNXCAMPO_CHILD_TIMEOUT_S", "1800"))
# what a request may run: name -> (module, function); None: this file
FUNCTIONS = {
    "session": (None, "create_session"),
    "validate": ("onnxcampo.runtime", "validate_files"),
}
_HEADER = struct.Struct("<Q")
_lock = threading.Lock()  # one request at a time on the shared child
_shared: list["Child"] = []  # the process's child, once started


class Child:
    """One child process serving requests until :meth:`close`."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        bootstrap = (f"import sys, importlib.util as u; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                     f"s = u.spec_from_file_location('onnxcampo_isolated', {os.path.abspath(__file__)!r}); "
                     f"m = u.module_from_spec(s); s.loader.exec_module(m); m.serve({list(preload)!r})")
        self.process = subprocess.Popen([sys.executable, "-c", bootstrap], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, close_fds=True)

    def call(self, function: str, *args, timeout_s: float | None = None, **kwargs):
        """``FUNCTIONS[function](*args, **kwargs)`` in the child: its value, or its exception raised
        here; :class:`RuntimeCrashError` when the child dies or runs past the time limit."""
        level = logging.getLogger("onnxcampo").getEffectiveLevel()
        request = pickle.dumps((function, args, kwargs, level), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.process.stdin.write(_HEADER.pack(len(request)) + request)
            self.process.stdin.flush()
            answer = self._read(TIMEOUT_S if timeout_s is None else timeout_s)
        except BrokenPipeError:
            answer = None
        if answer is None:
            raise self._died()
        ok, value, records = pickle.loads(answer)
        for name, levelno, message in records:
            logging.getLogger(name).log(levelno, "%s", message)
        if not ok:
            raise value
        return value

    def _read(self, limit_s: float) -> bytes | None:
        deadline = time.monotonic() + limit_s
        header = self._read_exact(_HEADER.size, deadline, limit_s)
        return None if header is None else self._read_exact(_HEADER.unpack(header)[0], deadline, limit_s)

    def _read_exact(self, size: int, deadline: float, limit_s: float) -> bytes | None:
        chunks, left, fd = [], size, self.process.stdout.fileno()
        while left:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(remaining, 0))
            if not ready:
                self.process.kill()
                self.process.wait()
                raise RuntimeCrashError(f"ONNX Runtime did not finish within {limit_s:g} s (the child process "
                                        "was stopped; $ONNXCAMPO_CHILD_TIMEOUT_S sets the limit)")
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _died(self) -> RuntimeCrashError:
        code = self.process.wait()
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            hint = ", killed: out of memory?" if -code == signal.SIGKILL else ""
            return RuntimeCrashError(f"ONNX Runtime crashed (signal {-code}, {name}{hint})", signal=-code)
        return RuntimeCrashError(f"ONNX Runtime's child process exited with code {code} before answering")

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self, *, wait: bool = True) -> None:
        """Close its stdin (it then ends); a child still importing, or busy, is killed after 1 s
        (``wait=False``: left to end by itself)."""
        if self.process.poll() is None:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            if not wait:
                return
            try:
                self.process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()


def start(*, validate: bool = False) -> None:
    """Start the process's child now (it imports ONNX Runtime while the caller works on);
    ``validate``: it imports what :data:`FUNCTIONS`' ``validate`` needs too."""
    with _lock:
        _child(("onnxcampo.runtime",) if validate else ())


def call(function: str, *args, **kwargs):
    """Run ``FUNCTIONS[function]`` in the process's child (started, or restarted, if need be)."""
    with _lock:
        return _child().call(function, *args, **kwargs)


def close(*, wait: bool = True) -> None:
    """Stop the process's child (the next request starts another); at exit without waiting for
    it (it ends when it reads the end of its stdin)."""
    with _lock:
        while _shared:
            _shared.pop().close(wait=wait)


def _child(preload: tuple[str, ...] = ()) -> Child:
    if not _shared or not _shared[0].alive():
        if _shared:
            _shared.pop().close()
        _shared.append(Child(preload))
    return _shared[0]


atexit.register(close, wait=False)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.levelno, record.getMessage()))


def create_session(source: str | bytes, recipe: dict) -> tuple[bool, object]:
    """An ORT session of ``source`` made from ``recipe`` (:func:`onnxcampo.runtime.session_recipe`),
    then dropped: ``(True, its providers)``, or ``(False, (ORT's exception class, message))``."""
    import onnxruntime as ort

    os.environ.update(recipe["env"])
    if recipe["preload_dlls"] and hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001 - best effort, as make_session has it
            pass
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, recipe["level"])
    for name, value in recipe["attributes"].items():
        setattr(options, name, value)
    for key, value in recipe["entries"].items():
        options.add_session_config_entry(key, value)
    try:
        for library in recipe["libraries"]:
            options.register_custom_ops_library(library)
        session = ort.InferenceSession(source, sess_options=options, providers=recipe["providers"])
    except Exception as exc:  # noqa: BLE001 - ORT's pybind errors: the parent words them
        return False, (exc.__class__.__name__, str(exc))
    return True, session.get_providers()


def serve(preload: list[str] = ()) -> None:
    """The child's loop: read a request, answer it, until stdin closes."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # native prints to stdout go to stderr: stdout is the channel
    sys.stdout = sys.stderr
    requests = sys.stdin.buffer
    importlib.import_module("onnxruntime")  # while the parent works, not at its first request
    for module in preload:
        importlib.import_module(module)
    collect = _Collect()
    logger = logging.getLogger("onnxcampo")
    logger.addHandler(collect)
    logger.propagate = False
    while True:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        function, args, kwargs, level = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
        logger.setLevel(level)
        collect.records = []
        try:
            module, name = FUNCTIONS[function]
            target = globals()[name] if module is None else getattr(importlib.import_module(module), name)
            answer = (True, target(*args, **kwargs), collect.records)
        except Exception as exc:  # noqa: BLE001 - the parent raises it
            exc.__traceback__ = None
            answer = (False, _picklable(exc), collect.records)
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        channel.write(_HEADER.pack(len(data)) + data)
        channel.flush()


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception type that does not round-trip
        return RuntimeError(f"{exc.__class__.__name__}: {exc}")


__all__ = ["Child", "call", "close", "start"]
