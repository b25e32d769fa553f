"""Test-load a model in ONNX Runtime before it is kept (``ir.save_model`` calls
:func:`check_loads` on the temporary file, before the rename).

onnx.checker does not see what ONNX Runtime does at session creation: its graph optimizations
run then, and their fusions can fail on a graph the checker accepts (they name new initializers
without looking at the tensors already there: ``onnxcampo.rewrites.transformer.ORT_GENERATED_NAMES``). A written
model that ORT cannot load must not replace anything. The check, case by case:

1. a session is created on the CPU EP at ``ORT_ENABLE_ALL``, and on the CUDA EP at
   ``ORT_ENABLE_ALL`` too when this onnxruntime has ``CUDAExecutionProvider`` (the EPs fuse
   differently);
2. a file is loaded by its path, so a model over 2 GB reads its external data where it lies,
   never through protobuf; the session is kept cheap (one thread, no weight prepacking) and ORT's
   own error log is silenced: the error is reported once, by us;
3. onnxcampo's custom-op library is registered when the library loads; a model that uses
   ``ai.onnxcampo`` without it, or ops no session of this onnxruntime can run on that EP (ORT's
   training ops in an inference build, other custom domains, CUDA-only contrib ops on the CPU
   EP: no CPU kernel; on the CUDA EP, which falls back to CPU kernels and whose own this
   onnxruntime does not list: no schema), is not test-loaded there, with a warning: no session
   here can load it, and the build that will run it must;
4. a failure raises :class:`WrittenModelLoadError` with one line: the model, the EP and ORT's
   cause without its source locations;
5. the sessions are created in a child process (:mod:`onnxcampo.runtime.isolated`; the file by its
   path, a ModelProto as bytes): ORT segfaults on some graphs the checker accepts (an fp16
   Transpose into a MatMul, ``onnxcampo.patterns.ort_cpu_crashing_transposes``), and a crash
   there is a :class:`WrittenModelLoadError` naming the signal, not the end of onnxcampo.
"""

from __future__ import annotations

import functools
import logging
import os
import re

import onnx
import onnx.defs
import onnxruntime as ort

from onnxcampo import ops
from onnxcampo.errors import CampoError, ModelLoadError, RuntimeCrashError, WrittenModelLoadError
from onnxcampo.ir.io import exceeds_protobuf_limit
from onnxcampo.ir.topology import iter_graphs

log = logging.getLogger(__name__)

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
_DEFAULT_DOMAINS = ("", "ai.onnx")
_FATAL_ONLY = 4  # ORT log severity: nothing below FATAL
_ORT_ERROR_HEADER = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
_SOURCE_LOCATION = re.compile(r"^(?:Exception during initialization: )?\S+\.(?:cc|cpp|h):\d+ ")
_SIGNATURE = re.compile(r"[^()\s]*::[^()]*\(")
_MAX_CAUSE = 400
# failures of the device (memory, driver, cuDNN's own state), not of the model
_DEVICE_TROUBLE = re.compile(r"out of memory|CUDA failure|cudaError|CUDNN_STATUS_(?!BAD_PARAM)|CUBLAS_STATUS|"
                             r"no CUDA-capable device|driver version", re.IGNORECASE)


def check_loads(source: str | os.PathLike | onnx.ModelProto, *, model: onnx.ModelProto | None = None,
                label: str | None = None) -> list[str]:
    """Create an ONNX Runtime session of ``source`` (a file, or a ModelProto) on every EP of
    rule 1; raise :class:`WrittenModelLoadError` if one fails. ``model``: the proto of a file
    source when the caller has it (its graph is read for rule 3); ``label`` names the model in the
    message (default: the file). Returns the EPs it loaded on."""
    if model is None:
        model = source if isinstance(source, onnx.ModelProto) else onnx.load(str(source), load_external_data=False)
    label = label or (str(source) if not isinstance(source, onnx.ModelProto) else "the model")
    uses_ops = ops.uses_ops(model)
    if uses_ops and not ops.available():
        log.warning("%s: not test-loaded in ONNX Runtime: it uses %s ops and the custom-op library is not built (%s)",
                    label, ops.DOMAIN, ops.BUILD_COMMAND)
        return []
    loaded = []
    for provider in (CPU, CUDA) if CUDA in ort.get_available_providers() else (CPU,):
        missing = _ops_without_kernels(model, provider)
        if missing:
            log.warning("%s: not test-loaded on the %s: this onnxruntime %s has no kernel for %s", label,
                        _short(provider), ort.__version__, ", ".join(missing[:5]))
            continue
        if _load_isolated(source, provider, label, uses_ops):
            loaded.append(provider)
    return loaded


def _load_isolated(source: str | os.PathLike | onnx.ModelProto, provider: str, label: str, uses_ops: bool) -> bool:
    """:func:`_load` with the session made in the child process (rule 5); a crash there is a
    :class:`WrittenModelLoadError`."""
    if isinstance(source, onnx.ModelProto):
        if exceeds_protobuf_limit(source):  # no bytes for it (save_model gives files): loaded here
            return _load(source, provider, label, uses_ops)
        source = source.SerializeToString()
    else:
        source = str(source)
    try:
        return _load(source, provider, label, uses_ops, create=_create_in_child)
    except RuntimeCrashError as exc:
        raise WrittenModelLoadError(
            f"{label}: {exc} loading the written model on the {_short(provider)} (ONNX Runtime {ort.__version__}, "
            "ORT_ENABLE_ALL)") from exc


# the session of a test-load: cheap (one thread, no weight prepacking), ORT's own log silenced
_TEST_LOAD = dict(optimization_level="all", intra_op_threads=1, log_severity=_FATAL_ONLY,
                  session_config={"session.inter_op_num_threads": 1, "session.disable_prepacking": "1"})


def _create_in_child(source: str | bytes, provider: str) -> None:
    """``make_session(source, **_TEST_LOAD)`` as the child process makes it, with its errors."""
    from onnxcampo.runtime import isolated, session_recipe

    ok, value = isolated.call("session", source, session_recipe(provider=provider, **_TEST_LOAD))
    if not ok:
        _, message = value  # (ORT's exception class, its message)
        if ops.DOMAIN in message and not ops.available():
            ops.require()
        raise ModelLoadError(f"ONNX Runtime could not load the model: {message}") from RuntimeError(message)
    if provider == "cuda" and CUDA not in value:
        raise CampoError("ONNX Runtime fell back to CPU: CUDAExecutionProvider failed to initialise "
                         "(check the CUDA/cuDNN libraries)")


def _load(source: str | os.PathLike | onnx.ModelProto | bytes, provider: str, label: str, uses_ops: bool,
          *, create=None) -> bool:
    """Create a session of ``source`` on ``provider`` (``create(source, "cpu"/"cuda")``, by default
    ``make_session`` in this process); False, with a warning, where the device, not the model,
    failed; a :class:`WrittenModelLoadError` where ORT refuses the model."""
    from onnxcampo.runtime import make_session  # this package's door (the custom-op library included)

    key = "cpu" if provider == CPU else "cuda"
    try:
        if create is not None:
            create(source, key)
        else:
            make_session(source if isinstance(source, (onnx.ModelProto, bytes)) else str(source), provider=key,
                         **_TEST_LOAD)
    except RuntimeCrashError:
        raise
    except ModelLoadError as exc:
        error = exc.__cause__ or exc
        cause = _cause(error, str(source) if not isinstance(source, (onnx.ModelProto, bytes)) else None, label)
        if provider == CUDA and _DEVICE_TROUBLE.search(cause):
            # the GPU, not the graph (the CPU session of the same file loaded): say so, keep the model
            log.warning("%s: not test-loaded on the CUDA EP: the device failed (%s)", label, cause)
            return False
        raise WrittenModelLoadError(
            f"{label}: ONNX Runtime {ort.__version__} cannot load the model on the {_short(provider)} "
            f"(ORT_ENABLE_ALL): {cause}") from exc
    except CampoError as exc:  # the CUDA EP did not initialise: ORT fell back to the CPU
        log.warning("%s: not test-loaded on the %s: %s", label, _short(provider), str(exc).splitlines()[0])
        return False
    return True


def _cause(exc: Exception, path: str | None, label: str) -> str:
    """ORT's message on one line: its last ``[ONNXRuntimeError] : code : NAME :`` part, without
    the source location; the temporary file's path replaced by the model's name."""
    text = " ".join(str(exc).split()) or exc.__class__.__name__
    cause = _ORT_ERROR_HEADER.split(text)[-1].strip() or text
    cause = _without_signature(_SOURCE_LOCATION.sub("", cause))
    if path:
        cause = cause.replace(path, label)
    return cause if len(cause) <= _MAX_CAUSE else cause[:_MAX_CAUSE] + " ..."


def _without_signature(text: str) -> str:
    """An ORT_ENFORCE message without the C++ signature it starts with (``ns::Type ns::f(args) cond
    was false. why``)."""
    start = _SIGNATURE.match(text)
    if start is None:
        return text
    depth = 0
    for index in range(start.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[index + 1:].strip() or text
    return text


def _short(provider: str) -> str:
    return "CUDA EP" if provider == CUDA else "CPU EP"


def _ops_without_kernels(model: onnx.ModelProto, provider: str) -> list[str]:
    """``domain::op`` of the nodes (subgraphs included) no session of this onnxruntime can run on
    ``provider``. On the CPU EP: no CPU kernel (where this onnxruntime lists them); on the CUDA EP,
    which falls back to CPU kernels and whose own kernels it does not list: no schema in ORT or
    ONNX. Model-local functions, and ONNX ops (ORT expands the function body of an ONNX op it has
    no kernel for), always count as runnable."""
    kernels = _cpu_kernels() if provider == CPU else None
    known = kernels if kernels is not None else _schemas()
    functions = {(f.domain, f.name) for f in model.functions}
    missing: set[str] = set()
    for node in (n for g in iter_graphs(model.graph) for n in g.node):
        domain = "" if node.domain in _DEFAULT_DOMAINS else node.domain
        if domain == ops.DOMAIN or (domain, node.op_type) in known or (node.domain, node.op_type) in functions:
            continue
        if onnx.defs.has(node.op_type, domain):
            continue
        missing.add(f"{domain or 'ai.onnx'}::{node.op_type}")
    return sorted(missing)




def _pairs(entries, name: str) -> frozenset[tuple[str, str]]:
    return frozenset(("" if e.domain in _DEFAULT_DOMAINS else e.domain, getattr(e, name)) for e in entries)


@functools.cache
def _cpu_kernels() -> frozenset[tuple[str, str]] | None:
    """The CPU EP's kernels, or None where this onnxruntime cannot list them safely:
    ``get_all_opkernel_def`` loads every provider library of a GPU build and segfaults when one
    of them (TensorRT's) cannot load (onnxruntime-gpu 1.31.1 on the H200)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    if hasattr(state, "get_registered_ep_kernel_defs"):
        try:
            return _pairs(state.get_registered_ep_kernel_defs(CPU), "op_name")
        except Exception:  # noqa: BLE001 - not listed there in this version
            pass
    if ort.get_available_providers() == [CPU]:
        return _pairs(state.get_all_opkernel_def(), "op_name")
    return None


@functools.cache
def _schemas() -> frozenset[tuple[str, str]]:
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return _pairs(state.get_all_operator_schema(), "name")


__all__ = ["check_loads"]
