"""The values a training step's batch may hold, checked against the step graph's inputs.

:meth:`Trainer.step <onnxcampo.training.Trainer.step>` takes, for each batch input:

- a numpy array (or anything ``numpy.asarray`` takes): host memory, copied to the device;
- an ``onnxruntime.OrtValue``: bound as it is, on the host or in CUDA memory;
- an object in CUDA memory with ``__cuda_array_interface__`` (torch CUDA tensors, CuPy arrays,
  Numba device arrays), read through its pointer: a :class:`DeviceArray`;
- an object with ``__dlpack__`` / ``__dlpack_device__`` only: on the host it is read as a numpy
  array, in CUDA memory it is wrapped by ``OrtValue.from_dlpack`` (no copy) and read through the
  OrtValue's pointer.

:func:`batch_value` turns one into a numpy array, an OrtValue or a DeviceArray and checks it
against the graph input (dtype, rank, static dims; C-contiguous, on CUDA device 0) before
anything touches the GPU, so a wrong batch is a one-line ConfigError, never a CUDA fault.

The last partial batch (:func:`partial_batch`): a step graph's shapes are static (the loss is a
mean over exactly its batch rows, shape arithmetic folded to constants), so a batch with fewer
rows cannot run on it. Padding it does not help either: the padded rows would count in the mean
and in every gradient, since the losses take no mask. A batch whose inputs all miss rows in the
leading dim, by the same count, is named as what it is in one ConfigError (the sizes, and the
ways out: drop it, or a second step graph built for its size); ``Trainer(partial_batch="drop")``
skips it instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from onnxcampo.errors import ConfigError

__all__ = ["BatchShapeError", "DeviceArray", "InputSpec", "PartialBatch", "batch_value", "check_array", "input_specs",
           "is_device", "np_dtype", "partial_batch"]

# DLPack device types (dlpack.h DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_MANAGED = 1, 2, 13
DEVICE_ID = 0  # the Trainer's OrtValues live on CUDA device 0


@dataclass(frozen=True)
class InputSpec:
    """A graph input as a batch value must fit it: ``dims`` has ``None`` for a dynamic dim and
    is ``None`` itself when the rank is unknown."""

    name: str
    dtype: np.dtype | None  # None: a type numpy has no dtype for (not checked)
    dims: tuple[int | None, ...] | None

    def text(self) -> str:
        dims = "?" if self.dims is None else "[" + ", ".join("?" if d is None else str(d) for d in self.dims) + "]"
        return f"{'?' if self.dtype is None else self.dtype}{dims}"


def np_dtype(onnx_type: int, what: str) -> np.dtype:
    """The numpy dtype of an ONNX element type; a ConfigError naming ``what`` if numpy has none."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{what}: ONNX element type {onnx_type} has no numpy dtype") from None


def input_specs(model: onnx.ModelProto) -> dict[str, InputSpec]:
    """Every graph input's :class:`InputSpec` (initializers that are also inputs left out)."""
    initializers = {t.name for t in model.graph.initializer}
    specs = {}
    for vi in model.graph.input:
        if vi.name in initializers or not vi.type.HasField("tensor_type"):
            continue
        tensor = vi.type.tensor_type
        dims = (tuple(d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None for d in tensor.shape.dim)
                if tensor.HasField("shape") else None)
        try:
            dtype = np_dtype(tensor.elem_type, vi.name)
        except ConfigError:
            dtype = None
        specs[vi.name] = InputSpec(vi.name, dtype, dims)
    return specs


@dataclass(frozen=True, eq=False)
class DeviceArray:
    """A C-contiguous array in CUDA memory, by pointer. ``owner`` is the object the memory
    belongs to, held until the run that reads it is over. ``wait``: whether the producer's work
    must be waited for before ORT reads it; ``stream`` the stream to wait for (``None``: none
    named, so the whole device)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    owner: object
    wait: bool = True
    stream: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def is_device(value: object) -> bool:
    """Whether a :func:`batch_value` result lives in CUDA memory."""
    return isinstance(value, DeviceArray) or (isinstance(value, ort.OrtValue) and value.device_name() != "cpu")


class BatchShapeError(ConfigError):
    """A batch value of the right dtype but another shape than its graph input's (``spec``)."""

    def __init__(self, spec: InputSpec, shape: tuple[int, ...], kind: str) -> None:
        super().__init__(f"batch input {spec.name} ({kind}) has shape {list(shape)}; the step graph takes {spec.text()}")
        self.spec, self.shape = spec, shape


def check_array(spec: InputSpec, dtype: np.dtype, shape: tuple[int, ...], kind: str) -> None:
    """A ConfigError unless an array of ``dtype`` and ``shape`` fits ``spec`` (a
    :class:`BatchShapeError` when only the shape does not); ``kind`` says where it lives."""
    if spec.dtype is not None and dtype != spec.dtype:
        raise ConfigError(f"batch input {spec.name} ({kind}) is {dtype}{list(shape)}; the step graph takes {spec.text()}")
    if spec.dims is not None and (len(shape) != len(spec.dims)
                                  or any(d is not None and d != s for d, s in zip(spec.dims, shape))):
        raise BatchShapeError(spec, tuple(shape), kind)



@dataclass(frozen=True)
class PartialBatch:
    """A batch whose inputs ``names`` have ``rows`` rows where the step graph takes ``graph_rows``."""

    names: tuple[str, ...]
    rows: int
    graph_rows: int

    def message(self, *, evaluating: bool = False) -> str:
        """The one-line error; ``evaluating``: the ways out of ``Trainer.evaluate`` (no update)."""
        names = ", ".join(self.names)
        rows = f"{self.rows} row{'' if self.rows == 1 else 's'}"
        head = (f"partial batch: {names} {'has' if len(self.names) == 1 else 'have'} {rows}, the step graph "
                f"takes {self.graph_rows} (its shapes are static): ")
        if evaluating:  # the forward treats rows independently: padding is sound for the predictions
            return head + (f"pad it to {self.graph_rows} rows and ignore the padded rows' predictions (not the "
                           "loss: a mean over every row)")
        return head + (f"drop it (DataLoader(drop_last=True), Trainer(partial_batch='drop'), train --partial-batch "
                       f"drop) or train it on a step graph built for {rows} (docs/guide/training.md, 'Data')")


def partial_batch(specs: Mapping[str, InputSpec], errors: Iterable[BatchShapeError]) -> PartialBatch | None:
    """The :class:`PartialBatch` that shape ``errors`` (of one batch) amount to, else ``None``.

    They do when every one of them differs from its static graph shape only in a smaller leading
    dim, all by the same rows, and no input with that static leading dim is missing from them (a
    batch cut short everywhere, as a loader's last one is).
    """
    errors = list(errors)
    sizes = set()
    for error in errors:
        dims, shape = error.spec.dims, error.shape
        if (dims is None or not dims or dims[0] is None or len(shape) != len(dims) or not 0 < shape[0] < dims[0]
                or any(d is not None and d != s for d, s in zip(dims[1:], shape[1:]))):
            return None
        sizes.add((shape[0], dims[0]))
    if len(sizes) != 1:
        return None
    (rows, graph_rows), = sizes
    names = {error.spec.name for error in errors}
    if any(spec.dims and spec.dims[0] == graph_rows and name not in names for name, spec in specs.items()):
        return None
    return PartialBatch(tuple(error.spec.name for error in errors), rows, graph_rows)


def _interface(name: str, value: object) -> dict | None:
    """``value.__cuda_array_interface__``, ``None`` when it has none (torch raises AttributeError
    for CPU tensors and RuntimeError for tensors that require grad)."""
    try:
        interface = getattr(value, "__cuda_array_interface__", None)
    except AttributeError:
        return None
    except Exception as exc:
        raise ConfigError(f"batch input {name}: {type(value).__name__}'s __cuda_array_interface__ failed: {exc}") from None
    if interface is not None and not isinstance(interface, dict):
        raise ConfigError(f"batch input {name}: __cuda_array_interface__ is a {type(interface).__name__}, not a dict")
    return interface


def _dlpack_device(name: str, value: object) -> tuple[int, int] | None:
    method = getattr(value, "__dlpack_device__", None)
    if method is None:
        return None
    try:
        device_type, device_id = method()
    except Exception as exc:
        raise ConfigError(f"batch input {name}: __dlpack_device__() failed: {exc}") from None
    return int(device_type), int(device_id)


def _on_device_0(name: str, device: tuple[int, int] | None) -> None:
    if device is None:
        return  # __cuda_array_interface__ alone does not say: taken to be the Trainer's device
    device_type, device_id = device
    if device_type not in (_DL_CUDA, _DL_CUDA_MANAGED):
        raise ConfigError(f"batch input {name} is on DLPack device type {device_type}: the Trainer takes host "
                          "arrays and CUDA memory")
    if device_id != DEVICE_ID:
        raise ConfigError(f"batch input {name} is on CUDA device {device_id}; the Trainer runs on device {DEVICE_ID}")


def _from_interface(spec: InputSpec, value: object, interface: dict, device: tuple[int, int] | None) -> DeviceArray:
    name = spec.name
    try:
        shape = tuple(int(d) for d in interface["shape"])
        dtype = np.dtype(interface["typestr"])
        ptr = int(interface["data"][0])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ConfigError(f"batch input {name}: unreadable __cuda_array_interface__ ({exc!r})") from None
    _on_device_0(name, device)
    if interface.get("mask") is not None:
        raise ConfigError(f"batch input {name} is a masked array: the Trainer takes plain arrays")
    check_array(spec, dtype, shape, "CUDA memory")
    strides = interface.get("strides")
    if strides is not None and math.prod(shape):
        expected, step = [], dtype.itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if any(n != 1 and int(s) != e for n, s, e in zip(shape, strides, reversed(expected))):
            raise ConfigError(f"batch input {name} is not C-contiguous (strides {list(strides)} for shape "
                              f"{list(shape)}): make it so first (torch .contiguous(), cupy.ascontiguousarray)")
    # v3 names the producer's stream (None: nothing to wait for); before v3 it says nothing
    names_stream = int(interface.get("version", 0)) >= 3 and "stream" in interface
    stream = interface.get("stream") if names_stream else None
    if stream is not None:
        stream = int(stream)
    return DeviceArray(ptr, shape, dtype, value, wait=not names_stream or stream is not None, stream=stream)


def _from_dlpack(spec: InputSpec, value: object) -> DeviceArray:
    """A CUDA DLPack object: ORT reads the capsule (no copy) and the OrtValue owns it."""
    from_dlpack = getattr(ort.OrtValue, "from_dlpack", None)
    if from_dlpack is None:
        raise ConfigError(f"batch input {spec.name}: this onnxruntime {ort.__version__} has no OrtValue.from_dlpack; "
                          "pass an object with __cuda_array_interface__, an OrtValue or a numpy array")
    try:
        # __dlpack__() with no stream: the producer orders its work before the legacy default
        # stream's; the DeviceArray waits for the whole device before ORT reads it
        ortvalue = from_dlpack(value)
    except Exception as exc:
        raise ConfigError(f"batch input {spec.name}: OrtValue.from_dlpack failed: {exc}") from None
    dtype = np_dtype(ortvalue.element_type(), f"batch input {spec.name}")
    shape = tuple(ortvalue.shape())
    check_array(spec, dtype, shape, "CUDA memory")
    return DeviceArray(ortvalue.data_ptr(), shape, dtype, ortvalue)


def batch_value(spec: InputSpec, value: object) -> np.ndarray | ort.OrtValue | DeviceArray:
    """``value`` as a C-contiguous numpy array, an OrtValue or a :class:`DeviceArray`, checked
    against ``spec`` (module docstring). No CUDA call is made."""
    name = spec.name
    if isinstance(value, ort.OrtValue):
        if not value.is_tensor():
            raise ConfigError(f"batch input {name} is an OrtValue that holds no tensor")
        dtype = np_dtype(value.element_type(), f"batch input {name}")
        check_array(spec, dtype, tuple(value.shape()), f"OrtValue on {value.device_name()}")
        return value
    if not isinstance(value, np.ndarray):
        interface = _interface(name, value)
        device = _dlpack_device(name, value)
        if interface is not None:
            return _from_interface(spec, value, interface, device)
        if device is not None and device[0] != _DL_CPU:
            _on_device_0(name, device)
            return _from_dlpack(spec, value)
        if device is not None:  # host memory with DLPack only (a torch CPU tensor, say)
            try:
                value = np.from_dlpack(value)
            except Exception as exc:
                raise ConfigError(f"batch input {name}: numpy.from_dlpack failed: {exc}") from None
    try:
        array = np.asarray(value)  # not ascontiguousarray: it makes 0-d arrays 1-d
    except Exception as exc:
        raise ConfigError(f"batch input {name}: not an array ({type(value).__name__}: {exc})") from None
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    check_array(spec, array.dtype, array.shape, "host array")
    return array
