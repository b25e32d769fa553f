"""ONNX Runtime glue: make inputs, build sessions, run them and compare outputs.

Everything that touches ``onnxruntime`` goes through here so that the rest of onnxcampo sees
one error family (:mod:`onnxcampo.errors`) instead of ORT's pybind exceptions, and so that the
quirks of ORT (silent CUDA fallback to CPU, the 2 GB protobuf limit, exceptions that do not
derive from ``RuntimeError``) are handled once. :func:`make_session` is the only maker of
sessions, for the cost database's measurements and the benchmark scripts too
(``tests/test_runtime_door.py`` checks it). :mod:`onnxcampo.runtime.timing` runs sessions
the fast way (IO binding, CUDA-graph replay) and times variants in rotation;
:mod:`onnxcampo.runtime.compare` holds the one output comparison (relative L2 error).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from onnxcampo import ops
from onnxcampo.ir.io import exceeds_protobuf_limit, graph_inputs
from onnxcampo.ir.shapes import dim_pin, shape_pin
from onnxcampo.runtime.compare import (DEFAULT_TOLERANCE, OutputCheck, OutputDiff, check_outputs, compare_outputs,
                                       output_error, worst_error)
from onnxcampo.errors import (
    CampoError,
    ConfigError,
    ModelLoadError,
    ProviderUnavailableError,
    ShapeError,
    UnsupportedModelError,
    ValidationError,
    option,
)

logger = logging.getLogger(__name__)

# this module's names, and those of compare (the output comparison) and timing (bound runs,
# rotation), which it re-exports
__all__ = [
    "require_provider", "available_providers", "graph_inputs", "load_input_sets", "load_inputs_npz", "make_session",
    "preload_cuda_dlls", "random_inputs", "run", "session_recipe", "validate", "validate_isolated",
    "DEFAULT_TOLERANCE", "OutputCheck", "OutputDiff", "check_outputs", "compare_outputs", "output_error", "worst_error",
    "BlockTimes", "BoundRunner", "bound_runner", "check_feeds", "run_once", "time_in_rotation",
]

# ORT's pybind exceptions derive straight from Exception (not RuntimeError), so collect them.
_ORT_ERRORS: tuple[type[BaseException], ...] = tuple(
    v for v in vars(_ort_state).values() if isinstance(v, type) and issubclass(v, Exception)
) + (RuntimeError, ValueError)

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.DOUBLE: np.float64,
}
_INT_TYPES = {
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.UINT32: np.uint32,
    onnx.TensorProto.UINT64: np.uint64,
}
_NP_TYPES = {**_FLOAT_TYPES, **_INT_TYPES, onnx.TensorProto.BOOL: np.bool_}

# Random integer inputs are drawn from [0, _INT_HIGH): small and non-negative, so they are safe
# as Gather indices, token ids or one-hot positions in almost any model.
_INT_HIGH = 8

_OPT_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}
_PROVIDERS = ("cpu", "cuda")
_dlls_preloaded = False


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _elem_type(vi: onnx.ValueInfoProto) -> int:
    """The tensor element type of an input; non-tensor inputs cannot be made up."""
    if vi.type.WhichOneof("value") != "tensor_type":
        raise UnsupportedModelError(
            f"input '{vi.name}' is not a tensor ({vi.type.WhichOneof('value')}); "
            "onnxcampo only feeds tensor inputs"
        )
    return vi.type.tensor_type.elem_type


def _np_dtype(vi: onnx.ValueInfoProto) -> type[np.generic]:
    """The numpy dtype for an input, or UnsupportedModelError for types we cannot generate."""
    elem = _elem_type(vi)
    if elem not in _NP_TYPES:
        name = onnx.TensorProto.DataType.Name(elem) if elem else "UNDEFINED"
        raise UnsupportedModelError(
            f"input '{vi.name}' has element type {name}; onnxcampo can make or check inputs "
            "of float16/float32/float64, integer and bool types only"
        )
    return _NP_TYPES[elem]


def _model_dims(vi: onnx.ValueInfoProto) -> list[onnx.TensorShapeProto.Dimension] | None:
    """The declared dims of an input, or None when the model gives no shape at all."""
    tensor_type = vi.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return list(tensor_type.shape.dim)


def _static_value(dim: onnx.TensorShapeProto.Dimension) -> int | None:
    """A dim's fixed size, 0 included (a zero-size dim, as ONNX's backend tests have them; a pin
    may still replace a 0, which some exporters write for 'unknown')."""
    if dim.HasField("dim_value") and dim.dim_value >= 0:
        return dim.dim_value
    return None


def _pin_hint(name: str, dims: list[onnx.TensorShapeProto.Dimension],
              dim_values: Mapping[str, int]) -> str:
    """An example pin for this input, as the caller writes it: known sizes kept, unknown ones 1."""
    sizes = []
    for dim in dims:
        static = _static_value(dim)
        if static is None and dim.dim_param in dim_values:
            static = dim_values[dim.dim_param]
        sizes.append(str(static if static is not None else 1))
    return shape_pin(name, ",".join(sizes))


def _check_pinned(name: str, pinned: tuple[int, ...],
                  dims: list[onnx.TensorShapeProto.Dimension] | None) -> tuple[int, ...]:
    """Validate a user pin against the declared rank and fixed sizes of the input."""
    pinned = tuple(int(d) for d in pinned)
    if any(d < 0 for d in pinned):
        raise ShapeError(f"input '{name}': {option('input_shapes')} gives {pinned}, a negative size")
    if dims is None:
        return pinned
    if len(pinned) != len(dims):
        raise ShapeError(
            f"input '{name}' has rank {len(dims)} but {option('input_shapes')} gives {len(pinned)} dims "
            f"{pinned}"
        )
    for axis, (size, dim) in enumerate(zip(pinned, dims)):
        static = _static_value(dim)
        if static is not None and static != size:
            raise ShapeError(
                f"input '{name}' axis {axis} is fixed at {static} in the model but "
                f"{option('input_shapes')} gives {size}"
            )
    return pinned


def _resolve_shape(vi: onnx.ValueInfoProto, input_shapes: Mapping[str, tuple[int, ...]],
                   dim_values: Mapping[str, int]) -> tuple[int, ...]:
    """Concrete shape of one input: pin, else static size, else named dim value, else error."""
    dims = _model_dims(vi)
    if vi.name in input_shapes:
        return _check_pinned(vi.name, input_shapes[vi.name], dims)
    if dims is None:
        raise ShapeError(
            f"input '{vi.name}' has no shape in the model; pin it with "
            f"{shape_pin(vi.name)}"
        )
    shape = []
    for axis, dim in enumerate(dims):
        static = _static_value(dim)
        if static is None and dim.dim_param and dim.dim_param in dim_values:
            static = int(dim_values[dim.dim_param])
            if static < 0:
                raise ShapeError(f"{option('dim_values')} gives {dim.dim_param}={static}, a negative size")
        if static is None:
            hint = _pin_hint(vi.name, dims, dim_values)
            if dim.dim_param:
                raise ShapeError(
                    f"input '{vi.name}' has dynamic dim '{dim.dim_param}' (axis {axis}); "
                    f"pin it with {hint} or {dim_pin(dim.dim_param)}"
                )
            raise ShapeError(
                f"input '{vi.name}' has an unnamed dynamic dim (axis {axis}); pin it with {hint}"
            )
        shape.append(static)
    return tuple(shape)


def _random_array(rng: np.random.Generator, dtype: type[np.generic],
                  shape: tuple[int, ...]) -> np.ndarray:
    """Floats: standard normal, or image-like (:func:`_image_like`) for an image's shape; ints:
    [0, 8) so they are valid indices; bool: fair coin."""
    if dtype is np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, _INT_HIGH, size=shape, dtype=dtype)
    axes = _image_axes(shape)
    if axes is not None:
        return _image_like(rng, shape, axes).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


IMAGE_CHANNELS = (1, 3, 4)  # grey, RGB, RGBA
IMAGE_MIN_SIDE = 16


def _image_axes(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(height axis, width axis) of a batch of images, [N, C, H, W] or [N, H, W, C] with C
    among :data:`IMAGE_CHANNELS` and both sides at least :data:`IMAGE_MIN_SIDE`; None otherwise."""
    if len(shape) != 4:
        return None
    if shape[1] in IMAGE_CHANNELS and min(shape[2], shape[3]) >= IMAGE_MIN_SIDE:
        return 2, 3
    if shape[3] in IMAGE_CHANNELS and min(shape[1], shape[2]) >= IMAGE_MIN_SIDE:
        return 1, 2
    return None


def _image_like(rng: np.random.Generator, shape: tuple[int, ...], axes: tuple[int, int]) -> np.ndarray:
    """Smooth random images, normalized as preprocessing leaves them: a coarse grid of normal
    values (one per 8 x 8 pixels, std 1.5: interpolated, about 1) interpolated bilinearly over
    each image and channel, plus fine noise (std 0.1): regions and edges, as a detector's or a
    classifier's inputs have, where independent noise per pixel has none."""
    height, width = shape[axes[0]], shape[axes[1]]
    others = [d for k, d in enumerate(shape) if k not in axes]
    coarse = 1.5 * rng.standard_normal((*others, -(-height // 8) + 1, -(-width // 8) + 1))
    rows = np.linspace(0, coarse.shape[-2] - 1, height)
    cols = np.linspace(0, coarse.shape[-1] - 1, width)
    r0, c0 = np.floor(rows).astype(int), np.floor(cols).astype(int)
    r1, c1 = np.minimum(r0 + 1, coarse.shape[-2] - 1), np.minimum(c0 + 1, coarse.shape[-1] - 1)
    fr, fc = (rows - r0)[:, None], (cols - c0)[None, :]
    top = coarse[..., r0, :][..., c0] * (1 - fc) + coarse[..., r0, :][..., c1] * fc
    bottom = coarse[..., r1, :][..., c0] * (1 - fc) + coarse[..., r1, :][..., c1] * fc
    smooth = top * (1 - fr) + bottom * fr + 0.1 * rng.standard_normal((*others, height, width))
    # (the other axes..., H, W) back to the input's axis order
    return np.moveaxis(smooth, range(4), [k for k in range(4) if k not in axes] + list(axes))


# Inputs whose name says what values they take (a model's own checks or arithmetic break on
# random ones: an attention mask of 0..7 where 0/1 is meant gives NaN rows in MiniLM, silero VAD
# refuses a sample rate of 5): (pattern on the lowercased name, which dtypes, the value).
_NAMED_INPUTS = (
    (re.compile(r"mask"), "biuf", "ones"),  # attention / padding masks: everything attended
    (re.compile(r"(token_)?type_ids?$|segment_ids?$"), "iu", "zeros"),  # one segment
    (re.compile(r"position_ids?$|positions$"), "iu", "arange"),  # 0, 1, 2, ... along the last axis
    (re.compile(r"^(sr|sample_rate|sampling_rate)$"), "iuf", 16000),  # speech models' sample rate
)


def _named_value(name: str, dtype: type[np.generic], shape: tuple[int, ...]) -> np.ndarray | None:
    """The value an input of this name takes (see ``_NAMED_INPUTS``), or ``None``."""
    kind = np.dtype(dtype).kind
    for pattern, kinds, value in _NAMED_INPUTS:
        if kind in kinds and pattern.search(name.lower()):
            if value == "ones":
                return np.ones(shape, dtype=dtype)
            if value == "zeros":
                return np.zeros(shape, dtype=dtype)
            if value == "arange":
                if not shape:
                    return np.zeros(shape, dtype=dtype)
                return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()
            return np.full(shape, value, dtype=dtype)
    return None


def random_inputs(
    model: onnx.ModelProto,
    *,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    dim_values: Mapping[str, int] | None = None,
    seed: int = 0,
    only: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
    """One random array per real graph input (initializer-backed inputs are skipped; with
    ``only``, just those inputs).

    Shapes come from ``input_shapes[name]`` (checked against rank and fixed sizes), else the
    static dim, else ``dim_values[dim_param]``; anything still dynamic raises ShapeError with
    the flags that fix it. Values are reproducible for a given ``seed`` and input order. Inputs
    whose names say what they hold get such values: ``*mask*`` ones, ``token_type_ids`` zeros,
    ``position_ids`` 0, 1, 2, ..., a sample rate ``sr`` 16000; others: floats standard normal
    (a batch of images, [N, C, H, W] or [N, H, W, C] with 1, 3 or 4 channels and sides of 16 or
    more, smooth random images of about that spread: :func:`_image_like`), integers in [0, 8),
    bools a fair coin.
    """
    input_shapes = dict(input_shapes or {})
    dim_values = dict(dim_values or {})
    inputs = graph_inputs(model)
    unknown = sorted(set(input_shapes) - {vi.name for vi in inputs})
    if unknown:
        raise ConfigError(
            f"{option('input_shapes')} names unknown input(s) {unknown}; model inputs are "
            f"{[vi.name for vi in inputs]}"
        )
    rng = np.random.default_rng(seed)
    feeds = {}
    wanted = None if only is None else set(only)
    for vi in inputs:
        if wanted is not None and vi.name not in wanted:
            continue
        dtype = _np_dtype(vi)
        shape = _resolve_shape(vi, input_shapes, dim_values)
        named = _named_value(vi.name, dtype, shape)
        feeds[vi.name] = named if named is not None else _random_array(rng, dtype, shape)
    return feeds


def _check_loaded(vi: onnx.ValueInfoProto, array: np.ndarray, path: Path) -> None:
    """A feed from a file must have the model's dtype, rank and fixed sizes."""
    want = np.dtype(_np_dtype(vi))
    if array.dtype != want:
        raise ConfigError(
            f"{path}: input '{vi.name}' has dtype {array.dtype} but the model expects {want}"
        )
    dims = _model_dims(vi)
    if dims is None:
        return
    if array.ndim != len(dims):
        raise ConfigError(
            f"{path}: input '{vi.name}' has rank {array.ndim} {array.shape} but the model "
            f"expects rank {len(dims)}"
        )
    for axis, (size, dim) in enumerate(zip(array.shape, dims)):
        static = _static_value(dim)
        if static is not None and static != size:
            raise ConfigError(
                f"{path}: input '{vi.name}' axis {axis} is {size} but the model fixes it at "
                f"{static}"
            )


def load_inputs_npz(path: str | os.PathLike[str], model: onnx.ModelProto,
                    only: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Read user-supplied feeds from an ``.npz`` and check them against the model's inputs.

    Every real input (with ``only``: each of those inputs) must be present with the model's
    dtype; inputs backed by an initializer may be overridden; any other key is an error (most
    likely a typo or the wrong file).
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except FileNotFoundError as exc:
        raise ConfigError(f"inputs file {path} does not exist") from exc
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: an empty file
        why = ("not a NumPy .npz archive" if "pickle" in str(exc) or isinstance(exc, (zipfile.BadZipFile, EOFError))
               else str(exc))
        raise ConfigError(f"inputs file {path} is not a readable .npz ({why}); write one with "
                          "numpy.savez(path, **{input name: array})") from exc
    return checked_inputs(arrays, model, path, only)


INPUT_SET_SUFFIXES = (".npz", ".json")


def load_input_sets(path: str | os.PathLike[str], model: onnx.ModelProto,
                    only: Iterable[str] | None = None) -> list[tuple[dict[str, np.ndarray], str]]:
    """Every feed set at ``path``, with the words that name it: an ``.npz`` (one set), a
    Polygraphy JSON file (``polygraphy run --save-inputs``: a list of feed dicts, each set), or
    a folder of such files (in sorted name order). Each set is checked as :func:`load_inputs_npz`
    checks one (``only``: those inputs); one ConfigError names the first file or set at fault."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in INPUT_SET_SUFFIXES and p.is_file())
        if not files:
            raise ConfigError(f"inputs folder {path} holds no .npz or Polygraphy .json file")
    else:
        files = [path]
    sets = []
    for file in files:
        if file.suffix == ".json":
            loaded = _polygraphy_sets(file)
            sets += [(checked_inputs(feeds, model, f"{file} (set {k})", only),
                      f"{file.name} set {k}" if len(loaded) > 1 else file.name) for k, feeds in enumerate(loaded)]
        else:
            sets.append((load_inputs_npz(file, model, only), file.name))
    return sets


def _polygraphy_sets(path: Path) -> list[dict[str, np.ndarray]]:
    """The feed dicts of a Polygraphy JSON file (its arrays: ``{"array": base64 of numpy.save's
    bytes, "polygraphy_class": "ndarray"}``; one dict or a list of them)."""
    import base64
    import io
    import json

    how = "write it with polygraphy run --save-inputs, or use .npz files"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"inputs file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"inputs file {path} is not readable JSON ({exc}); {how}") from exc
    sets = data if isinstance(data, list) else [data]
    out = []
    for feeds in sets:
        if not isinstance(feeds, dict) or not feeds:
            raise ConfigError(f"inputs file {path} is not a list of {{input name: array}} feed sets; {how}")
        arrays = {}
        for name, value in feeds.items():
            if not (isinstance(value, dict) and value.get("polygraphy_class") == "ndarray" and "array" in value):
                raise ConfigError(f"inputs file {path}: {name} is not an array as Polygraphy writes one; {how}")
            try:
                arrays[name] = np.load(io.BytesIO(base64.b64decode(value["array"])), allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:  # bad base64, not numpy.save's bytes, empty
                raise ConfigError(f"inputs file {path}: {name} cannot be read ({exc or type(exc).__name__})") from exc
        out.append(arrays)
    return out


def checked_inputs(arrays: dict[str, np.ndarray], model: onnx.ModelProto, path,
                   only: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """``arrays`` checked against the model's inputs as :func:`load_inputs_npz` says; ``path``
    names them in the errors."""
    all_inputs = {vi.name: vi for vi in model.graph.input}
    if only is not None:
        all_inputs = {name: all_inputs[name] for name in only if name in all_inputs}
    unknown = sorted(set(arrays) - set(all_inputs))
    if unknown:
        raise ConfigError(
            f"{path}: unknown input name(s) {unknown}; model inputs are {sorted(all_inputs)}"
        )
    required = [vi for vi in graph_inputs(model) if vi.name in all_inputs]
    missing = [vi.name for vi in required if vi.name not in arrays]
    if missing:
        raise ConfigError(f"{path}: missing input(s) {missing}")
    for name, array in arrays.items():
        _check_loaded(all_inputs[name], array, path)
    return arrays


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


def preload_cuda_dlls() -> None:
    """Let onnxruntime-gpu find pip-installed CUDA/cuDNN libraries (ORT >= 1.21), once.

    :func:`make_session` calls it for provider "cuda"; call it yourself only where the CUDA
    libraries must be loaded before something else (e.g. before torch's profiler starts)."""
    global _dlls_preloaded
    if _dlls_preloaded or not hasattr(ort, "preload_dlls"):
        return
    try:
        ort.preload_dlls()
    except Exception as exc:  # best effort: the libraries may be on the system path anyway
        logger.warning("onnxruntime.preload_dlls() failed: %s", exc)
    _dlls_preloaded = True


def available_providers() -> list[str]:
    """The execution providers this onnxruntime build offers (for reports and early checks)."""
    return list(ort.get_available_providers())


def require_provider(provider: str) -> None:
    """Say now, before any work, that ``provider`` ("cpu", "cuda") cannot run here: a ConfigError
    for an unknown name, a CampoError naming what to install when the CUDA EP is missing."""
    _providers(provider)


# CUDA EP options that make_session's own parameters set: cuda_options must not set them too.
_CUDA_OPTION_PARAMS = {"use_tf32": "tf32", "enable_cuda_graph": "cuda_graph"}


def _providers(provider: str, cuda_graph: bool = False, *, tf32: bool = True,
               cuda_options: Mapping[str, object] | None = None) -> list[str | tuple[str, dict[str, str]]]:
    """Execution providers for a provider key; CUDA keeps TF32 on unless ``tf32=False``, as users
    get by default. ``cuda_graph``: the CUDA EP captures the run into a CUDA graph and replays
    it (CUDA only); ``cuda_options``: more CUDA EP options (values as strings; CUDA only)."""
    if provider not in _PROVIDERS:
        raise ConfigError(f"unknown provider '{provider}'; choose one of {list(_PROVIDERS)}")
    if provider == "cpu":
        if cuda_options:
            raise ConfigError(f"CUDA EP options {sorted(cuda_options)} need provider 'cuda', not 'cpu'")
        return ["CPUExecutionProvider"]
    preload_cuda_dlls()
    available = available_providers()
    if "CUDAExecutionProvider" not in available:
        from onnxcampo.install import cuda_provider_hint

        raise ProviderUnavailableError(
            "provider 'cuda' needs onnxruntime-gpu with CUDAExecutionProvider, but this "
            f"onnxruntime {ort.__version__} offers only {available}; {cuda_provider_hint()}; "
            "or choose the cpu provider"
        )
    options = {"use_tf32": "1" if tf32 else "0"}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    for key, value in (cuda_options or {}).items():
        if key in _CUDA_OPTION_PARAMS:
            raise ConfigError(f"CUDA EP option {key} is make_session's {_CUDA_OPTION_PARAMS[key]}=; "
                              "set it there, not in cuda_options")
        options[str(key)] = str(value)
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def _session_options(*, profiling: bool, optimization_level: str,
                     custom_ops_library: str | None, intra_op_threads: int | None,
                     profile_file_prefix: str | None,
                     session_config: Mapping[str, object] | None = None,
                     log_severity: int | None = None) -> ort.SessionOptions:
    """Translate onnxcampo's options into ORT SessionOptions, rejecting bad values early.

    ``session_config`` is applied last (see :func:`make_session`)."""
    if optimization_level not in _OPT_LEVELS:
        raise ConfigError(
            f"unknown optimization level '{optimization_level}'; choose one of "
            f"{list(_OPT_LEVELS)}"
        )
    options = ort.SessionOptions()
    options.graph_optimization_level = _OPT_LEVELS[optimization_level]
    options.enable_profiling = profiling
    if profile_file_prefix is not None:
        options.profile_file_prefix = profile_file_prefix
    if log_severity is not None:
        if log_severity not in range(5):
            raise ConfigError(f"log severity must be 0 (verbose) to 4 (fatal), got {log_severity}")
        options.log_severity_level = log_severity
    if intra_op_threads is not None:
        if intra_op_threads < 0:
            raise ConfigError(
                f"intra-op threads must be >= 0 (0 = ORT default), got {intra_op_threads}"
            )
        options.intra_op_num_threads = intra_op_threads
    if custom_ops_library is not None:
        if not Path(custom_ops_library).is_file():
            raise ConfigError(f"custom-op library {custom_ops_library} does not exist")
        from onnxcampo.ops.elementwise import jit  # standard library only

        jit.export_nvrtc()  # NVRTC for FusedElementwise's generated CUDA kernels, when installed
        try:
            options.register_custom_ops_library(str(custom_ops_library))
        except _ORT_ERRORS as exc:
            raise ConfigError(
                f"could not load custom-op library {custom_ops_library}: {exc}"
            ) from exc
    # onnxcampo's own ops (ai.onnxcampo) in every session whenever the library loads; a graph
    # that needs them without it fails in make_session with OpsLibraryError.
    if ops.available() and not _same_file(custom_ops_library, ops.library_path()):
        ops.register(options)
    for key, value in (session_config or {}).items():
        _configure(options, str(key), value)
    return options


def _configure(options: ort.SessionOptions, key: str, value: object) -> None:
    """One ``session_config`` entry: ``session.<attribute>`` of SessionOptions, else a config entry."""
    name = key[len("session."):] if key.startswith("session.") else ""
    current = getattr(options, name, None) if name and not name.startswith("_") else None
    if current is not None and not callable(current):
        text = str(value).strip().lower()
        try:
            if isinstance(current, bool):
                if text not in ("0", "1", "false", "true"):
                    raise ValueError("not one of 0, 1, false, true")
                setattr(options, name, text in ("1", "true"))
            elif isinstance(current, (int, float, str)):
                setattr(options, name, type(current)(value))
            else:
                raise ValueError(f"a {type(current).__name__} is not set from text (make_session's own "
                                 "parameters set the optimization level)")
        except (*_ORT_ERRORS, TypeError) as exc:
            raise ConfigError(f"session option {key}={value!r}: {exc}") from exc
        return
    try:
        options.add_session_config_entry(key, str(value))
    except _ORT_ERRORS as exc:
        raise ConfigError(f"session config entry {key}={value!r}: {exc}") from exc


def _same_file(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _create(source: str | bytes, options: ort.SessionOptions,
            providers: list[str | tuple[str, dict[str, str]]],
            disabled_optimizers: tuple[str, ...] = ()) -> ort.InferenceSession:
    """Create the session, turning ORT's exceptions into ModelLoadError."""
    try:
        if disabled_optimizers:
            return ort.InferenceSession(source, sess_options=options, providers=providers,
                                        disabled_optimizers=list(disabled_optimizers))
        return ort.InferenceSession(source, sess_options=options, providers=providers)
    except _ORT_ERRORS as exc:
        if ops.DOMAIN in str(exc) and not ops.available():
            ops.require()  # a file or bytes model that needs the missing library: say how to build it
        raise ModelLoadError(f"ONNX Runtime could not load the model: {exc}") from exc


def _create_from_proto(model: onnx.ModelProto, options: ort.SessionOptions,
                       providers: list[str | tuple[str, dict[str, str]]],
                       disabled_optimizers: tuple[str, ...] = ()) -> ort.InferenceSession:
    """Load a ModelProto; over 2 GiB go through a temp file with external data.

    The proto is copied first because ``onnx.save_model(save_as_external_data=True)`` strips
    the tensors of the proto it is given. The temp dir may go once the session exists: ORT has
    read (or, on Linux, mapped) the data by then, and an unlinked mapped file stays valid.
    """
    if not exceeds_protobuf_limit(model):
        return _create(model.SerializeToString(), options, providers, disabled_optimizers)
    logger.info("model is over protobuf's 2 GB limit: loading it through external data")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with tempfile.TemporaryDirectory(prefix="onnxcampo-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save_model(copy, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data")
        del copy
        return _create(path, options, providers, disabled_optimizers)


def make_session(
    model: onnx.ModelProto | bytes | str | os.PathLike[str],
    *,
    provider: str = "cpu",
    profiling: bool = False,
    optimization_level: str = "all",
    custom_ops_library: str | None = None,
    intra_op_threads: int | None = None,
    profile_file_prefix: str | None = None,
    cuda_graph: bool = False,
    tf32: bool = True,
    cuda_options: Mapping[str, object] | None = None,
    session_config: Mapping[str, object] | None = None,
    log_severity: int | None = None,
    disabled_optimizers: tuple[str, ...] = (),
) -> ort.InferenceSession:
    """An InferenceSession on ``provider`` ("cpu" or "cuda"): the one place onnxcampo (and its
    scripts) make ORT sessions.

    ``cuda_graph`` (CUDA only): ORT captures a run into a CUDA graph and replays it, which
    removes the host's per-node launch cost; every input and output must then be bound with
    IO binding to device buffers that keep their addresses (see ``training.Trainer``).
    ``tf32``: the CUDA EP's ``use_tf32`` (on by default, as ORT has it; no effect on the CPU).
    ``cuda_options``: more CUDA EP options, values as strings (e.g. ``{"prefer_nhwc": "1",
    "cudnn_conv_algo_search": "HEURISTIC"}``); a ConfigError on the CPU provider, and for
    ``use_tf32`` / ``enable_cuda_graph`` (the parameters above set those).
    ``session_config``: ``session.<name>`` sets the SessionOptions attribute ``name`` when there
    is one (``session.intra_op_num_threads``, ``session.enable_mem_pattern``: booleans as 0/1),
    every other key is an ORT config entry (``session.intra_op.allow_spinning``,
    ``session.disable_prepacking``); applied after the other options, so they win over them.
    ``log_severity``: ORT's log level for the session (0 verbose ... 3 errors only, 4 fatal).
    ``disabled_optimizers``: ORT graph transformers not to run (by name, e.g.
    ``ConvActivationFusion``).

    ``model`` may be a ModelProto, serialized bytes or a path (paths keep external data
    working). ``optimization_level`` is "all", "basic" or "disable"; profiling needs
    "disable" if profiler node names must match the model's nodes. ORT silently falls back to
    CPU when the CUDA EP fails to initialise, so for "cuda" the session's providers are
    checked and a CampoError is raised instead of measuring the wrong device.
    """
    if cuda_graph and provider != "cuda":
        raise ConfigError(f"CUDA graphs need provider 'cuda', not '{provider}'")
    providers = _providers(provider, cuda_graph, tf32=tf32, cuda_options=cuda_options)
    if isinstance(model, onnx.ModelProto) and ops.uses_ops(model):
        ops.require()  # OpsLibraryError saying how to build the library, before ORT's own message
    options = _session_options(
        profiling=profiling, optimization_level=optimization_level,
        custom_ops_library=custom_ops_library, intra_op_threads=intra_op_threads,
        profile_file_prefix=profile_file_prefix, session_config=session_config,
        log_severity=log_severity,
    )
    if isinstance(model, onnx.ModelProto):
        session = _create_from_proto(model, options, providers, disabled_optimizers)
    elif isinstance(model, bytes):
        session = _create(model, options, providers, disabled_optimizers)
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelLoadError(f"model file {path} does not exist")
        session = _create(str(path), options, providers, disabled_optimizers)
    if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise CampoError(
            "ONNX Runtime fell back to CPU: CUDAExecutionProvider failed to initialise "
            "(check the CUDA/cuDNN libraries; see ORT's warnings above)"
        )
    return session


def session_recipe(*, provider: str = "cpu", optimization_level: str = "all", intra_op_threads: int | None = None,
                   log_severity: int | None = None, session_config: Mapping[str, object] | None = None) -> dict:
    """What :func:`make_session` would give a session, as plain data for a process that has only
    onnxruntime (:func:`onnxcampo.runtime.isolated.create_session`): the providers with their
    options, the optimization level, SessionOptions attributes, config entries, custom-op
    libraries (onnxcampo's when it loads) and environment variables they read."""
    providers = _providers(provider)
    probe = _session_options(profiling=False, optimization_level=optimization_level, custom_ops_library=None,
                             intra_op_threads=intra_op_threads, profile_file_prefix=None, log_severity=log_severity)
    attributes = {"intra_op_num_threads": probe.intra_op_num_threads, "log_severity_level": probe.log_severity_level}
    entries = {}
    for key, value in (session_config or {}).items():
        name = key[len("session."):] if key.startswith("session.") else ""
        if name and not name.startswith("_") and not callable(getattr(probe, name, callable)):
            _configure(probe, key, value)  # checked and converted as make_session does
            attributes[name] = getattr(probe, name)
        else:
            entries[str(key)] = str(value)
    libraries = [ops.check()] if ops.available() else []
    env = {}
    if libraries:
        from onnxcampo.ops.elementwise import jit

        path = jit.export_nvrtc()
        if path and os.path.isabs(path):
            env[jit.ENV_VAR] = path
    level = {value: key for key, value in vars(ort.GraphOptimizationLevel).items() if key.startswith("ORT_")}
    return {"providers": providers, "level": level[_OPT_LEVELS[optimization_level]], "attributes": attributes,
            "entries": entries, "libraries": libraries, "env": env, "preload_dlls": provider == "cuda"}


def run(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run once; output name -> array. Feed-name mistakes and ORT failures become CampoErrors."""
    expected = {i.name for i in session.get_inputs()}
    unknown = sorted(set(feeds) - expected - _overridable(session))
    missing = sorted(expected - set(feeds))
    if unknown or missing:
        raise ConfigError(
            f"feeds do not match the model inputs: missing {missing}, unknown {unknown}"
        )
    names = [o.name for o in session.get_outputs()]
    try:
        outputs = session.run(names, dict(feeds))
    except _ORT_ERRORS as exc:
        raise CampoError(f"ONNX Runtime failed to run the model: {exc}") from exc
    return dict(zip(names, outputs))


def _overridable(session: ort.InferenceSession) -> set[str]:
    """Initializers that are also graph inputs may be fed; ORT lists them as overridable."""
    try:
        return {i.name for i in session.get_overridable_initializers()}
    except AttributeError:  # very old ORT
        return set()


# --------------------------------------------------------------------------------------------
# Comparing outputs
# --------------------------------------------------------------------------------------------


def feeds_for(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Feeds for the optimized model: same names, cast where it changed a float input type.

    An optimizer that does not keep I/O types may turn an fp32 input into fp16; the test
    values are the same numbers, so they are cast rather than rejected.
    """
    adapted = {}
    for vi in graph_inputs(model):
        if vi.name not in feeds:
            raise ValidationError(
                f"the optimized model has input '{vi.name}' that the original does not feed"
            )
        array = np.asarray(feeds[vi.name])
        want = np.dtype(_np_dtype(vi))
        if array.dtype != want:
            if array.dtype.kind != "f" or want.kind != "f":
                raise ValidationError(
                    f"input '{vi.name}' changed type from {array.dtype} to {want}"
                )
            logger.info("casting input '%s' from %s to %s for the optimized model",
                        vi.name, array.dtype, want)
            array = array.astype(want)
        adapted[vi.name] = array
    return adapted


def validate(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    *,
    feeds: Mapping[str, np.ndarray] | None = None,
    provider: str = "cpu",
    tolerance: float = DEFAULT_TOLERANCE,
    rtol: float | None = None,
    atol: float | None = None,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    dim_values: Mapping[str, int] | None = None,
    seed: int = 0,
    execution: str = "plain",
) -> list[OutputCheck]:
    """Run both models on the same feeds and judge the optimized outputs against the original's
    with :func:`~onnxcampo.runtime.compare.check_outputs` (relative L2 error <= ``tolerance``;
    with ``rtol``/``atol`` also element-wise).

    Feeds default to :func:`random_inputs` of the original. ``execution``: ``cuda-graph`` with
    provider "cuda" runs both models as they will run there, captured and replayed from bound
    device buffers (:func:`onnxcampo.runtime.timing.run_once`); on the CPU runs are plain.
    Returns the checks; the caller decides whether a failure raises ValidationError (it knows
    the user's tolerance intent).
    """
    from onnxcampo.runtime.timing import run_once

    if feeds is None:
        feeds = random_inputs(original, input_shapes=input_shapes, dim_values=dim_values,
                              seed=seed)
    if execution != "plain" and provider != "cuda":
        logger.info("validating on %s: plain runs (CUDA graphs replay on the CUDA EP only)", provider)
        execution = "plain"
    reference = run_once(original, feeds, provider=provider, execution=execution)
    candidate = run_once(optimized, feeds_for(optimized, feeds), provider=provider, execution=execution)
    checks = check_outputs(reference, candidate, tolerance=tolerance, rtol=rtol, atol=atol)
    for check in checks:
        logger.debug("validate %s", check)
    return checks


def validate_isolated(
    original: onnx.ModelProto | str | os.PathLike[str],
    optimized: onnx.ModelProto | str | os.PathLike[str],
    **options,
) -> list[OutputCheck]:
    """:func:`validate` in a child process (:mod:`onnxcampo.runtime.isolated`, the process's
    child, which the test-load of written models uses too): models as files (by path) or ModelProtos (sent serialized; over
    2 GB written to a temporary folder first), ``options`` as :func:`validate`'s. An ORT crash
    there is a :class:`RuntimeCrashError` saying so."""
    from onnxcampo.errors import RuntimeCrashError
    from onnxcampo.runtime import isolated

    with tempfile.TemporaryDirectory(prefix="onnxcampo-validate-") as folder:
        sources = [_sendable(model, os.path.join(folder, f"{index}.onnx"))
                   for index, model in enumerate((original, optimized))]
        try:
            return isolated.call("validate", *sources, **options)
        except RuntimeCrashError as exc:
            raise RuntimeCrashError(f"{exc} running the models for --validate (ONNX Runtime {ort.__version__}, "
                                    f"{options.get('provider', 'cpu')}); nothing was written", signal=exc.signal) from exc


def _sendable(model: onnx.ModelProto | str | os.PathLike[str], path: str) -> str | bytes:
    if not isinstance(model, onnx.ModelProto):
        return str(model)
    if not exceeds_protobuf_limit(model):
        return model.SerializeToString()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=os.path.basename(path) + ".data")
    return path


def validate_files(original: str | bytes, optimized: str | bytes, **options) -> list[OutputCheck]:
    """:func:`validate` of two models given as paths or serialized bytes (what the child process
    of :func:`validate_isolated` receives)."""
    from onnxcampo.ir.io import repair_utf8

    models = [onnx.load(source) if isinstance(source, str) else onnx.ModelProto.FromString(source)
              for source in (original, optimized)]
    for model in models:
        repair_utf8(model)  # the names the optimized model was written with (ir.read_model)
    return validate(*models, **options)


# The fast way to run a model (bound, replayed) and the rotation timing build on the sessions above.
from onnxcampo.runtime.timing import (BlockTimes, BoundRunner, bound_runner, check_feeds, run_once,  # noqa: E402
                                      time_in_rotation)
