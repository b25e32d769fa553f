"""Training steps queued on the GPU, and the loss read on demand.

On provider "cuda" the Trainer does not wait for a step before it returns: like a PyTorch loop,
the host queues the next steps while the GPU runs this one, and waits only when a loss is read
(``float(loss)``, ``loss.item()``, a format, arithmetic, numpy). Reading every step stays
possible, and costs what it costs in PyTorch: one wait per read.

How (:class:`StepQueue`):

1. ONNX Runtime runs every step on one stream of the Trainer's own (the CUDA provider's
   ``user_compute_stream``), with ``disable_synchronize_execution_providers``: a run returns once
   its kernels are queued.
2. What a step reads is written *on that stream*: the batch and ``lr`` are copied into fixed
   device buffers with ``cudaMemcpyAsync`` (a copy from pageable host memory is staged before the
   call returns, so the caller's arrays may change afterwards), so a copy for step n + 1 cannot
   overtake step n's reads of the same buffer.
3. Each step's loss is copied, on the stream, into its slot of a ring in pinned host memory; the
   :class:`Loss` waits for the stream when it is first read. Before a slot is reused (the ring
   has :data:`SLOTS` of them), a loss still held and not read yet is read.
4. Memory the caller owns (a torch CUDA tensor, an OrtValue on the device) is read on the stream
   after it waits, on the device, for the producing stream; afterwards that producing stream
   waits for the reads, so the caller's next writes to the memory (or its allocator's reuse of
   it) come after them.
5. Anything that reads or writes the Trainer's state from the host (``state_dict``, checkpoints,
   ``evaluate``, ``loss_scale``) first waits for the queued steps.
6. Only steps replayed as CUDA graphs are queued on CUDA (:mod:`onnxcampo.training.trainer`),
   and a session goes only after the steps queued on it are done (:meth:`StepQueue.keep`).

On the CPU provider a step runs to its end before :meth:`Trainer.step` returns and the
:class:`Loss` holds its value.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import weakref
from collections.abc import Callable

import numpy as np
import onnxruntime as ort

from onnxcampo.runtime.cudart import LEGACY_STREAM, CudaRuntime

__all__ = ["SLOTS", "Loss", "StepQueue"]

SLOTS = 1024  # pinned loss slots: at most this many unread losses before the oldest is read
NO_SYNC = "disable_synchronize_execution_providers"  # ORT's run config entry: return once queued


class Loss:
    """One step's loss, read on demand (module docstring). Behaves as a float wherever it is
    converted: ``float(loss)``, ``loss.item()``, ``f"{loss:.4f}"``, ``loss + 1``, ``loss < 2``,
    ``np.asarray(loss)``, ``math.isfinite(loss)``. ``loss.ready`` says whether it was read.
    ``loss.step`` is the step's number (1 for the first step a Trainer takes)."""

    __slots__ = ("__weakref__", "_read", "_value", "step")

    def __init__(self, step: int, value: float | None = None, read: Callable[[], float] | None = None) -> None:
        if (value is None) == (read is None):
            raise ValueError("a Loss has a value or a way to read it, exactly one")
        self.step = step
        self._value = value
        self._read = read

    @property
    def ready(self) -> bool:
        """Whether the value is on the host (read, or a CPU step's)."""
        return self._value is not None

    def item(self) -> float:
        """The value, waiting for the step to finish if it has not."""
        if self._value is None:
            self._value = float(self._read())
            self._read = None
        return self._value

    __float__ = item

    def __int__(self) -> int:
        return int(self.item())

    def __bool__(self) -> bool:
        return bool(self.item())

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.item(), dtype=dtype if dtype is not None else np.float64)

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"Loss({self._value!r}, step={self.step})" if self.ready else f"Loss(<queued>, step={self.step})"

    def __str__(self) -> str:
        return str(self.item())

    def __hash__(self) -> int:
        return hash(self.item())

    def __round__(self, digits: int | None = None):
        return round(self.item(), digits)

    def __neg__(self) -> float:
        return -self.item()

    def __abs__(self) -> float:
        return abs(self.item())

    def __trunc__(self) -> int:
        return math.trunc(self.item())


def _binary(name: str) -> Callable:
    operation = getattr(float, name)

    def method(self: Loss, other):
        if isinstance(other, Loss):
            other = other.item()
        return operation(self.item(), other)
    method.__name__ = name
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
              "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__"):
    setattr(Loss, _name, _binary(_name))
numbers.Real.register(Loss)


class StepQueue:
    """The stream a Trainer's steps run on, its fixed input buffers and its ring of pinned loss
    slots (module docstring). ``runtime``: the CUDA runtime (:func:`onnxcampo.runtime.cudart.cuda_runtime`;
    a stand-in with the same calls for tests). ``device``: where the fixed buffers live."""

    def __init__(self, runtime: CudaRuntime, *, device: str = "cuda", device_id: int = 0, slots: int = SLOTS) -> None:
        self.runtime = runtime
        self.device, self.device_id = device, device_id
        # The stream lives as long as the process: ORT sessions made on it may outlive this queue.
        self.stream = runtime.create_stream()
        self._event = runtime.create_event()
        self._slots = slots
        self._host = runtime.host_alloc(4 * slots)
        self._values = (ctypes.c_float * slots).from_address(self._host)
        self._held: list[weakref.ref | None] = [None] * slots
        self._next = 0
        self._issued = self._done = 0  # losses queued; of those, the ones known done (after a wait)
        self._fixed: dict[str, tuple[np.dtype, tuple[int, ...], ort.OrtValue]] = {}
        # freed with the queue; not at exit, when the CUDA runtime may be gone (the OS frees it then)
        weakref.finalize(self, _free_quietly, runtime, self._host).atexit = False

    def run_options(self, options: ort.RunOptions | None = None) -> ort.RunOptions:
        """``options`` (new ones when None) that return from a run once its kernels are queued."""
        options = options if options is not None else ort.RunOptions()
        options.add_run_config_entry(NO_SYNC, "1")
        return options

    def fixed(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> ort.OrtValue:
        """The fixed device buffer for input ``name``: the same one while the dtype and shape stay,
        a new one (after the queued steps are done with the old) when they change."""
        dtype, shape = np.dtype(dtype), tuple(shape)
        known = self._fixed.get(name)
        if known is not None and known[:2] == (dtype, shape):
            return known[2]
        if known is not None:
            self.drain()  # queued steps may still read the old buffer
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, self.device, self.device_id)
        self._fixed[name] = (dtype, shape, value)
        return value

    def upload(self, target: ort.OrtValue, array: np.ndarray) -> None:
        """Copy host ``array`` into device buffer ``target`` on the stream."""
        array = np.ascontiguousarray(array)
        self.runtime.copy(target.data_ptr(), array.ctypes.data, array.nbytes, self.stream)

    def copy(self, target: int, source: int, nbytes: int) -> None:
        """Copy ``nbytes`` from device memory ``source`` to ``target`` on the stream."""
        self.runtime.copy(target, source, nbytes, self.stream)

    def after(self, streams: set[int | None]) -> None:
        """The stream waits, on the device, for the work queued so far on ``streams`` (``None``:
        every stream of the device, waited for on the host)."""
        if None in streams:
            self.runtime.synchronize(None)
            return
        for stream in sorted(streams):
            self.runtime.wait(self.stream, stream, self._event)

    def release(self, streams: set[int | None]) -> None:
        """``streams`` (``None``: the legacy default stream) wait, on the device, for what is queued
        on the stream so far: the caller's next writes to memory a step reads come after it."""
        for stream in sorted({LEGACY_STREAM if s is None else s for s in streams}):
            self.runtime.wait(stream, self.stream, self._event)

    def loss(self, source: ort.OrtValue, step: int) -> Loss:
        """A :class:`Loss` for the float32 scalar that the queued step writes to ``source``."""
        slot = self._next
        self._next = (slot + 1) % self._slots
        held = self._held[slot]() if self._held[slot] is not None else None
        if held is not None:
            held.item()  # its slot is about to be reused: read it first
        self.runtime.copy(self._host + 4 * slot, source.data_ptr(), 4, self.stream)
        self._issued += 1
        issued = self._issued
        loss = Loss(step, read=lambda: self._read(slot, issued))
        self._held[slot] = weakref.ref(loss)
        return loss

    def _read(self, slot: int, issued: int) -> float:
        if issued > self._done:  # one wait makes every loss queued so far readable
            self.drain()
        self._held[slot] = None
        return float(self._values[slot])

    def drain(self) -> None:
        """Wait on the host until every queued step is done."""
        self.runtime.synchronize(self.stream)
        self._done = self._issued

    def keep(self, owner: object) -> None:
        """Drain the queue before ``owner`` (a Trainer) and the sessions it holds go (module
        docstring, 6); at exit too, before the sessions are torn down."""
        weakref.finalize(owner, _drain_quietly, self)


def _drain_quietly(queue: StepQueue) -> None:
    """:meth:`StepQueue.drain` from a finalizer: a runtime that refuses (the device gone, the
    process ending) is left as it is, nothing raised."""
    try:
        queue.drain()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


def _free_quietly(runtime: CudaRuntime, pointer: int) -> None:
    """Give pinned memory back; a runtime that refuses (shutting down) keeps it, nothing raised."""
    try:
        runtime.host_free(pointer)
    except Exception:  # noqa: BLE001 - a finalizer must not raise; the process is ending or the device gone
        pass
