"""FusedElementwise's generated CUDA kernels seen from Python: where NVRTC is, the source a node's
kernel has, and compiling that source (for the tests).

On CUDA the custom-op library writes one kernel per FusedElementwise program and call layout
(onnxcampo/ops/elementwise/elementwise_jit.h) and compiles it with NVRTC, loaded at run time; without NVRTC it runs
its slower interpreter kernel and says so once on stderr. NVRTC comes from ``$ONNXCAMPO_NVRTC``
(a path to ``libnvrtc.so``), else the loader's path. :func:`export_nvrtc` points
``$ONNXCAMPO_NVRTC`` at the ``nvidia-cuda-nvrtc`` wheel's library (PyTorch's CUDA wheels bring
it; ``pip install nvidia-cuda-nvrtc`` otherwise) when it is installed: :func:`onnxcampo.ops.register`
calls it.

Standard library only (ctypes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

ENV_VAR = "ONNXCAMPO_NVRTC"
KERNEL_ENV_VAR = "ONNXCAMPO_EW_KERNEL"  # "interpreter": the fallback kernel, not the generated one
KERNEL_NAME = "onnxcampo_fused_elementwise"

# Where the NVIDIA wheels put the library, relative to a site-packages folder (CUDA 13, 12).
_WHEEL_PATTERNS = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.1[23]",
                   "nvidia/cu12/lib/libnvrtc.so.12")
_SYSTEM_PATTERNS = ("/usr/local/cuda/lib64/libnvrtc.so.1[23]", "/usr/local/cuda/lib64/libnvrtc.so")


class NvrtcError(RuntimeError):
    """NVRTC is missing or refused a source."""


def nvrtc_library() -> str | None:
    """The NVRTC library file the generated kernels would use, or None: ``$ONNXCAMPO_NVRTC``, an
    installed NVIDIA wheel's, the CUDA toolkit's, then what the loader finds by name."""
    override = os.environ.get(ENV_VAR)
    if override:
        return override if Path(override).is_file() else None
    return _installed_nvrtc()


@functools.lru_cache(maxsize=1)
def _installed_nvrtc() -> str | None:
    """The search of :func:`nvrtc_library` past the variable, once a process (every session with
    the custom-op library asks)."""
    for folder in sys.path:
        for pattern in _WHEEL_PATTERNS:
            found = sorted(glob.glob(os.path.join(folder or ".", pattern)))
            if found:
                return found[-1]
    for pattern in _SYSTEM_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[-1]
    return ctypes.util.find_library("nvrtc")


def export_nvrtc() -> str | None:
    """Set ``$ONNXCAMPO_NVRTC`` to :func:`nvrtc_library` when it is unset and a library is found
    (the custom-op library reads it at its first generated kernel); returns the path in use."""
    if os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    path = nvrtc_library()
    if path and os.path.isabs(path):
        os.environ[ENV_VAR] = path
    return path


def generated_source(library: str, program: Sequence[int], registers: int, constants: Sequence[float],
                     output_types: Sequence[int], input_types: Sequence[int], shapes: Sequence[Sequence[int]],
                     literal_shape: bool = True, column_sums: Sequence[int] | None = None) -> str:
    """The CUDA source of the kernel the custom-op ``library`` generates for a FusedElementwise
    node with these attributes, called with inputs of ``input_types`` (1 float32, 10 float16)
    and ``shapes`` (``column_sums``: the node's attribute ``[output, columns]``, the kernel that
    also writes their partial sums). Raises ValueError with the library's reason for a program or shapes it refuses."""
    lib = ctypes.CDLL(library)
    fn = lib.OnnxcampoFusedElementwiseSource
    fn.restype = ctypes.c_int64
    i64 = ctypes.POINTER(ctypes.c_int64)
    fn.argtypes = [i64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_float), ctypes.c_int64, i64,
                   ctypes.c_int64, i64, i64, i64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int64,
                   ctypes.c_char_p, ctypes.c_int64]

    def ints(values):
        values = [int(v) for v in values]
        return (ctypes.c_int64 * max(1, len(values)))(*values)

    flat = [d for shape in shapes for d in shape]
    args = [ints(program), len(program), int(registers), (ctypes.c_float * max(1, len(constants)))(*constants),
            len(constants), ints(output_types), len(output_types), ints(input_types), ints(flat),
            ints([len(s) for s in shapes]), len(shapes), int(literal_shape),
            int(column_sums[0]) if column_sums else -1, int(column_sums[1]) if column_sums else 0]
    size = 1 << 16
    while True:
        buffer = ctypes.create_string_buffer(size)
        length = fn(*args, buffer, size)
        if abs(length) < size:
            break
        size = abs(length) + 1
    text = buffer.value.decode()
    if length < 0:
        raise ValueError(text)
    return text


def kernel_stats(library: str) -> dict[str, int]:
    """What the custom-op ``library`` loaded in this process did with FusedElementwise on CUDA:
    ``{"generated": launches, "interpreter": launches that fell back, "compiled": NVRTC compiles,
    "cached": cubins read from the disk cache}``; ``{}`` for a library built without CUDA."""
    fn = ctypes.CDLL(library).OnnxcampoFusedElementwiseStats
    fn.restype = ctypes.c_char_p
    text = fn().decode()
    return {key: int(value) for key, value in (item.split("=") for item in text.split())}


def compile_source(source: str, arch: int = 90, library: str | None = None) -> bytes:
    """Compile a generated source with NVRTC for ``sm_<arch>`` with the options the custom-op
    library uses; returns the cubin. Raises :class:`NvrtcError` (no NVRTC, or the log)."""
    path = library or nvrtc_library()
    if not path:
        raise NvrtcError(f"NVRTC not found: install nvidia-cuda-nvrtc or set {ENV_VAR}")
    nvrtc = ctypes.CDLL(path)
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"fused_elementwise.cu", 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    try:
        options = [f"--gpu-architecture=sm_{arch}".encode(), b"--fmad=false", b"--prec-div=true",
                   b"--prec-sqrt=true", b"--ftz=false"]
        status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        if status:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise NvrtcError(f"NVRTC could not compile for sm_{arch}: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, cubin)
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


__all__ = ["ENV_VAR", "KERNEL_ENV_VAR", "KERNEL_NAME", "NvrtcError", "compile_source", "export_nvrtc",
           "generated_source", "kernel_stats", "nvrtc_library"]
