"""The custom-op library ``onnxcampo_ops`` (domain ``ai.onnxcampo``): where it is, whether it
loads, and how sessions register it.

The library is built from the op units (``onnxcampo/ops/<unit>/``, ``common/``) by ``python -m onnxcampo.ops.build`` into
``onnxcampo/ops/lib/``; ``$ONNXCAMPO_OPS_LIBRARY`` points elsewhere. Ops (``docs/ops.md``):

* ``UnscaleCheckFinite(inv_scale, g_1..g_n) -> (found_inf, u_1..u_n)`` and
  ``CheckFinite(g_1..g_n) -> found_inf`` (its flag alone, for an update that unscales)
* ``MultiTensorSGD[momentum, unscale](lr, found_inf[, inv_scale], w.., g..[, v..]) -> (w'..[, v'..])``
  (``unscale=1``: the g scaled, used as ``float32(g) * inv_scale``; MultiTensorAdamW alike)
* ``MultiTensorAdamW[beta1, beta2, eps, weight_decay](lr, step, found_inf, w.., g.., m.., v..)
  -> (step', w'.., m'.., v'..)``
* ``ScatterNDAdd(data, indices, updates) -> output``: ONNX ScatterND with ``reduction="add"``
  (float32/float16 data and updates, int64 indices), one CUDA thread per update element
* ``AvgMatMulInteger(A, B[, a_zero_point, b_zero_point]) -> Y`` (uint8 x uint8 -> float32, 16-bit
  tree-averaging accumulation) and ``ExactMatMulInteger`` (the same, exact int32 accumulation)
* ``FusedElementwise[program, registers, constants, output_types](x_1..x_n) -> (y_1..y_m)``: a
  chain of elementwise ops as one kernel, a register program per element of the inputs' broadcast
  shape, float16/float32 inputs and outputs (:mod:`onnxcampo.ops.elementwise` specifies it); on
  CUDA a kernel generated per program and compiled by NVRTC (:mod:`onnxcampo.ops.elementwise.jit`); with
  ``column_sums=[k, Q]`` also the column sums of output k (a bias gradient) as one more output
* ``Im2Col[kernel_shape, strides, dilations, pads](x) -> columns`` (x [N, C, H, W] float16/float32
  -> [C*kh*kw, N*Ho*Wo] of x's type: a Conv's column matrix, for the weight gradient's Gemm)
* ``ConvWeightGrad[kernel_shape, strides, dilations, pads](x, dy) -> dw`` (a Conv's weight
  gradient, [Cout, Cin, kh, kw]; cuDNN's backward filter on CUDA, a direct loop on the CPU)
* ``MultiTensorCast(x_1..x_n) -> (y_1..y_n)`` (float32 -> float16, ``y_i = Cast(x_i)``, one
  launch for all: what ``--fuse-elementwise`` writes for a training step's weight Casts)
* ``BlockReduceSum[sizes=[P, Q, R], output_type, output_shape](x) -> y`` (x as a contiguous
  [P, Q, R] array summed over P and R in float32, one rounding to float32 or float16; what
  ``--fuse-reductions`` writes for ReduceSums and the Casts around them)
* ``MaxPoolNhwc[kernel_shape, strides, pads](x) -> (y[, argmax])`` and
  ``MaxPoolNhwcGrad[kernel_shape, strides, pads, input_spatial](dy, argmax) -> dx`` (a
  channels-last max pooling, x [N, H, W, C] float16/float32, argmax the uint8 tap of each
  window's first maximum, and its gradient as a gather: no scatter-add, deterministic;
  :mod:`onnxcampo.ops.max_pool` has the numpy reference)
* ``NchwToNhwc[to, channels](x) -> y`` (x [N, C, S...] float16/float32 -> [N, S..., channels] of
  ``to``'s type, zero channels past C: a Transpose, Cast and Pad in one pass, the image a
  channels-last stem reads; :mod:`onnxcampo.ops.conv_nhwc` has the numpy reference)
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import onnx
import onnxruntime as ort

from onnxcampo.errors import OpsLibraryError
from onnxcampo.ops.elementwise import jit

DOMAIN = "ai.onnxcampo"
OPSET_VERSION = 1
ENV_VAR = "ONNXCAMPO_OPS_LIBRARY"
LIBRARY_FILE = "libonnxcampo_ops.so"
BUILD_COMMAND = "python -m onnxcampo.ops.build"
MIN_ORT = (1, 21)  # the headers' API version; an older runtime cannot hand the library its API

_loaded: dict[tuple[str, int, int], str | None] = {}  # (path, mtime, size) -> load error or None


def default_path() -> Path:
    """Where ``python -m onnxcampo.ops.build`` puts the library."""
    return Path(__file__).resolve().parent / "lib" / LIBRARY_FILE


def library_path() -> str:
    """The library file: ``$ONNXCAMPO_OPS_LIBRARY`` if set, else the built one.

    Raises :class:`OpsLibraryError` when the file does not exist.
    """
    override = os.environ.get(ENV_VAR)
    path = Path(override).expanduser() if override else default_path()
    if not path.is_file():
        origin = f"${ENV_VAR}={override}" if override else str(path)
        raise OpsLibraryError(
            f"custom-op library {origin} does not exist; build it with `{BUILD_COMMAND}`"
            + (f" or unset {ENV_VAR}" if override else ""))
    return str(path)


def register(options: ort.SessionOptions) -> str:
    """Register the library with ``options``; returns its path.

    Raises :class:`OpsLibraryError` when it is missing or does not load.
    """
    path = check()
    jit.export_nvrtc()  # the generated CUDA kernels find the nvidia-cuda-nvrtc wheel's NVRTC
    options.register_custom_ops_library(path)
    return path


def available() -> bool:
    """True when the library exists and loads into this onnxruntime."""
    try:
        path = library_path()
    except OpsLibraryError:
        return False
    return _load_error(path) is None


def cuda_kernels_here() -> bool:
    """Whether a model written here would run its custom ops on CUDA: this onnxruntime offers the
    CUDA execution provider and the library loads and was built with its CUDA kernels."""
    if "CUDAExecutionProvider" not in ort.get_available_providers() or not available():
        return False
    return build_info().get("kernels") == "cpu+cuda"


def generated_kernels_here() -> bool:
    """:func:`cuda_kernels_here` and NVRTC found: FusedElementwise's generated kernels (without
    NVRTC its CUDA kernel is the interpreter, slower than ONNX Runtime's unfused ops)."""
    return cuda_kernels_here() and jit.nvrtc_library() is not None


def missing_cuda_kernels(*, generated: bool = False) -> str | None:
    """Why a model written here would not run the library's CUDA kernels (``generated``: nor
    FusedElementwise's generated ones), in words; None when it would (:func:`cuda_kernels_here`,
    :func:`generated_kernels_here`)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"this onnxruntime ({ort.__version__}) has no CUDA execution provider (onnxruntime-gpu has)"
    try:
        path = library_path()
    except OpsLibraryError:
        return f"the custom-op library is not built ({BUILD_COMMAND})"
    error = _load_error(path)
    if error:
        return error
    if build_info().get("kernels") != "cpu+cuda":
        return f"the custom-op library {path} has no CUDA kernels (nvcc was not found when it was built)"
    if generated and jit.nvrtc_library() is None:
        return "NVRTC was not found (FusedElementwise's generated kernels need it)"
    return None


def check() -> str:
    """The library's path once it is known to load; :class:`OpsLibraryError` otherwise."""
    path = library_path()
    error = _load_error(path)
    if error:
        raise OpsLibraryError(error)
    return path


def require() -> str:
    """:func:`check` for a model that uses the ops: the error says why the library is needed."""
    try:
        return check()
    except OpsLibraryError as exc:
        raise OpsLibraryError(f"the model uses {DOMAIN} ops, but {exc}") from None


def build_info() -> dict[str, str]:
    """What the library was built with and runs: ``{"kernels": "cpu" | "cpu+cuda", "ort_api": "21",
    "matmul_u8": "avx2" | "neon" | "scalar"}``."""
    library = ctypes.CDLL(check())
    library.OnnxcampoOpsBuildInfo.restype = ctypes.c_char_p
    text = library.OnnxcampoOpsBuildInfo().decode()
    return dict(item.split("=", 1) for item in text.split())


def uses_ops(model: onnx.ModelProto) -> bool:
    """Whether ``model`` imports the ``ai.onnxcampo`` domain or has nodes in it."""
    return any(opset.domain == DOMAIN for opset in model.opset_import) or any(
        node.domain == DOMAIN for node in model.graph.node)


def _load_error(path: str) -> str | None:
    """Why the library at ``path`` does not load (None when it does); cached per file version."""
    stat = os.stat(path)
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _loaded:
        _loaded[key] = _try_load(path)
    return _loaded[key]


def _try_load(path: str) -> str | None:
    version = tuple(int(part) for part in ort.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_ORT:
        return (f"custom-op library {path} needs onnxruntime >= {'.'.join(map(str, MIN_ORT))}, "
                f"this is {ort.__version__}")
    try:
        ort.SessionOptions().register_custom_ops_library(path)
    except Exception as exc:  # ORT raises RuntimeError/Fail/InvalidArgument by version
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return f"custom-op library {path} does not load ({reason}); rebuild it with `{BUILD_COMMAND}`"
    return None


__all__ = ["DOMAIN", "ENV_VAR", "OPSET_VERSION", "available", "build_info", "check", "default_path",
           "library_path", "register", "require", "uses_ops"]
