"""The CUDA runtime library (libcudart), called through ctypes.

The Trainer takes batches that are already on the GPU (torch CUDA tensors, CuPy arrays,
anything with ``__cuda_array_interface__``), and queues its steps on a stream of its own
(:mod:`onnxcampo.training.queue`). It needs a few things from the CUDA runtime: that stream
(``cudaStreamCreateWithFlags``), copies on it into the fixed buffers the steps read and of each
step's loss into pinned host memory (``cudaMemcpyAsync``, ``cudaMallocHost``), events to order
one stream after another without waiting on the host (``cudaEventRecord``,
``cudaStreamWaitEvent``), and waits (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``).
Nothing else (torch, CuPy, cuda-python) is needed: the library is the one onnxruntime-gpu's CUDA
execution provider has already loaded into the process.

:func:`cuda_runtime` finds it once and keeps it; the first place whose library loads wins:

1. ``$ONNXCAMPO_CUDART``, a path, when set (and then nothing else);
2. a ``libcudart.so.N`` already mapped into this process (``/proc/self/maps``): once a CUDA
   session exists, the one ORT's CUDA EP loaded. A copy of ORT's CUDA major version comes
   first, then the newest;
3. by name (``libcudart.so.N``; ``cudart64_N.dll`` on Windows), N being ORT's CUDA major, then 13
   and 12: the dynamic loader hands back a copy already loaded under that name, else searches
   its usual paths (``LD_LIBRARY_PATH``, the ldconfig cache);
4. the NVIDIA wheels onnxruntime-gpu depends on, in every ``sys.path`` folder:
   ``nvidia/cu13/lib/libcudart.so.13`` (CUDA 13) and ``nvidia/cuda_runtime/lib/libcudart.so.12``
   (CUDA 12);
5. ``$CUDA_HOME``, ``$CUDA_PATH`` and ``/usr/local/cuda``, folder ``lib64``.

Two copies of the runtime in one process (ORT's for CUDA 12, torch's for CUDA 13, say) share
the device's primary context, so pointers and stream handles are valid in either; the copy
ORT loaded comes first because the driver is known to run it.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from pathlib import Path

from onnxcampo.errors import CampoError

__all__ = ["CudaRuntime", "candidates", "cuda_runtime", "ort_cuda_major", "LEGACY_STREAM"]

ENV = "ONNXCAMPO_CUDART"
LEGACY_STREAM = 0  # the legacy default stream (the plain, not _ptsz, entry points read 0 so)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking
_EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
_LOADED = re.compile(r"^libcudart(?:-[0-9a-f]+)?\.so\.\d+(?:\.\d+)*$")  # torch's vendored copies have a hash
_WHEELS = (("nvidia", "cu13", "lib", "libcudart.so.13"), ("nvidia", "cuda_runtime", "lib", "libcudart.so.12"),
           ("nvidia", "cu13", "bin", "x86_64", "cudart64_13.dll"), ("nvidia", "cuda_runtime", "bin", "cudart64_12.dll"))

_lock = threading.Lock()
_runtime: CudaRuntime | None = None


def ort_cuda_major() -> int | None:
    """The CUDA major version onnxruntime was built with (``None`` for a CPU build)."""
    try:
        from onnxruntime.capi import onnxruntime_validation

        version = onnxruntime_validation.get_package_name_and_version_info()[2]
    except Exception:  # an unusual build: no version info, only the later guesses
        return None
    match = re.match(r"(\d+)", version or "")
    return int(match.group(1)) if match else None


def _mapped(maps: str | os.PathLike = "/proc/self/maps") -> list[str]:
    """Paths of CUDA runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode [path]
        path = fields[5] if len(fields) == 6 else ""
        if path.startswith("/") and _LOADED.match(os.path.basename(path)) and path not in found:
            found.append(path)
    return found


def _major(path: str) -> int:
    match = re.search(r"cudart(?:64_(\d+)|(?:-[0-9a-f]+)?\.so\.(\d+))", os.path.basename(path))
    return int(match.group(1) or match.group(2)) if match else 0


def candidates(maps: str | os.PathLike = "/proc/self/maps", major: int | None = None,
               search_path: list[str] | None = None) -> list[str]:
    """Where :func:`cuda_runtime` looks, in order (module docstring): paths and library names."""
    if os.environ.get(ENV):
        return [os.environ[ENV]]
    major = ort_cuda_major() if major is None else major
    mapped = sorted(_mapped(maps), key=lambda p: (_major(p) != major, -_major(p)))
    majors = [m for m in dict.fromkeys((major, 13, 12)) if m]
    windows = sys.platform == "win32"
    names = [f"cudart64_{m}.dll" if windows else f"libcudart.so.{m}" for m in majors]
    wheels = [os.path.join(folder, *parts) for folder in (search_path if search_path is not None else sys.path)
              for parts in _WHEELS if folder and parts[-1].endswith(".dll") == windows]
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    toolkits = [os.path.join(home, "lib64", name) for home in homes if home for name in names]
    found = [*mapped, *names, *(p for p in (*wheels, *toolkits) if os.path.isfile(p))]
    return list(dict.fromkeys(found))


class CudaRuntime:
    """The few CUDA runtime calls the Trainer makes; each raises a CampoError naming the call and
    CUDA's error when it fails."""

    def __init__(self, library: ctypes.CDLL, where: str) -> None:
        self.where = where
        self._memcpy = library.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._stream_sync = library.cudaStreamSynchronize
        self._stream_sync.argtypes = [ctypes.c_void_p]
        self._device_sync = library.cudaDeviceSynchronize
        self._device_sync.argtypes = []
        self._error_name = library.cudaGetErrorName
        self._error_name.argtypes = [ctypes.c_int]
        self._error_name.restype = ctypes.c_char_p
        pointer_out = [ctypes.POINTER(ctypes.c_void_p)]
        self._calls = {name: (getattr(library, name), args) for name, args in (
            ("cudaStreamCreateWithFlags", [*pointer_out, ctypes.c_uint]),
            ("cudaEventCreateWithFlags", [*pointer_out, ctypes.c_uint]),
            ("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
            ("cudaMallocHost", [*pointer_out, ctypes.c_size_t]),
            ("cudaFreeHost", [ctypes.c_void_p]))}
        for function in (self._memcpy, self._stream_sync, self._device_sync, *(f for f, _ in self._calls.values())):
            function.restype = ctypes.c_int
        for function, args in self._calls.values():
            function.argtypes = args
        version = ctypes.c_int(0)
        library.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        library.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value  # 1000 * major + 10 * minor, e.g. 12080

    def _check(self, code: int, call: str) -> None:
        if code:
            name = (self._error_name(code) or b"?").decode(errors="replace")
            raise CampoError(f"CUDA runtime ({self.where}): {call} failed with {name} ({code})")

    def copy(self, dst: int, src: int, nbytes: int, stream: int = LEGACY_STREAM) -> None:
        """Queue a copy of ``nbytes`` from ``src`` to ``dst`` (device or host pointers) on ``stream``."""
        if nbytes:
            self._check(self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")

    def synchronize(self, stream: int | None = LEGACY_STREAM) -> None:
        """Wait until ``stream`` has done its work; ``None``: the whole device."""
        if stream is None:
            self._check(self._device_sync(), "cudaDeviceSynchronize")
        else:
            self._check(self._stream_sync(stream), "cudaStreamSynchronize")

    def _call(self, name: str, *args) -> None:
        self._check(self._calls[name][0](*args), name)

    def _made(self, name: str, *args) -> int:
        handle = ctypes.c_void_p(0)
        self._call(name, ctypes.byref(handle), *args)
        return int(handle.value or 0)

    def create_stream(self) -> int:
        """A new stream that does not wait for the legacy default stream (ORT's own are such)."""
        return self._made("cudaStreamCreateWithFlags", _STREAM_NON_BLOCKING)

    def create_event(self) -> int:
        """A new event without timing (the cheapest to record and wait for)."""
        return self._made("cudaEventCreateWithFlags", _EVENT_DISABLE_TIMING)

    def wait(self, stream: int, after: int, event: int) -> None:
        """Make ``stream`` wait, on the device, for the work queued on stream ``after`` so far."""
        self._call("cudaEventRecord", event, after)
        self._call("cudaStreamWaitEvent", stream, event, 0)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory: a copy from the device into it does not wait on the host."""
        return self._made("cudaMallocHost", nbytes)

    def host_free(self, pointer: int) -> None:
        self._call("cudaFreeHost", pointer)


def _load(places: list[str]) -> CudaRuntime:
    tried = []
    for place in places:
        try:
            return CudaRuntime(ctypes.CDLL(place), place)
        except (OSError, AttributeError) as exc:  # not there, or not a CUDA runtime
            tried.append(f"{place} ({exc})")
    raise CampoError("no CUDA runtime library (libcudart) could be loaded for batches in GPU memory; tried "
                     + ("; ".join(tried) or "nothing") + f". Set {ENV} to the library's path")


def cuda_runtime() -> CudaRuntime:
    """The process's CUDA runtime, found once (module docstring); a CampoError listing the places
    tried when none loads."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = _load(candidates())
        return _runtime
