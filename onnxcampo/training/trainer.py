"""Run a training-step graph step after step on ONNX Runtime.

Weights and optimizer state live on the device between steps: two sets of buffers, one bound
as inputs and one as outputs, swapped after every step (ping-pong), so nothing but the batch
goes to the device and nothing but the loss comes back.

CUDA graphs (:func:`choose_cuda_graph`): on provider "cuda", when every graph input has a
static shape, each step is replayed as a CUDA graph by default; ``cuda_graph=False`` runs it
node by node. The batch, ``lr`` and the loss then also live in fixed device buffers (the batch
is copied into them before each step) and each of the two ping-pong bindings is captured once
into its own CUDA graph (run option ``gpu_graph_id``), so a step costs one graph launch instead
of one host dispatch per node.

Queued steps (:mod:`onnxcampo.training.queue`): on provider "cuda" under CUDA graphs,
:meth:`Trainer.step` returns once the step is queued on the GPU, with a
:class:`~onnxcampo.training.queue.Loss` that is read (and waited for) when it is converted, so the
host prepares the next steps while the GPU runs this one, as a PyTorch loop does. The batch and
``lr`` are then copied into fixed device buffers on the Trainer's stream. ``queued=False`` waits
for every step instead. Steps run node by node are waited for: ONNX Runtime's CUDA provider, run
on a stream of the caller's, hands its pinned staging memory back from a callback on that stream,
and once the session is gone that callback frees the memory itself, which CUDA forbids there
(the process aborts); under CUDA graphs it frees that memory on the host.

Batches may already be on the device (:mod:`onnxcampo.training.batches`): OrtValues are bound
as they are, CUDA memory (torch CUDA tensors, CuPy arrays, DLPack) is bound by its pointer, and
under CUDA graphs or queued steps both are copied device to device into the fixed buffers
(:mod:`onnxcampo.runtime.cudart`): nothing goes through the host.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from onnxcampo import ir
from onnxcampo.errors import CampoError, ConfigError, ModelLoadError
from onnxcampo.runtime import _ORT_ERRORS, make_session
from onnxcampo.runtime.cudart import LEGACY_STREAM, cuda_runtime
from onnxcampo.training.batches import (DEVICE_ID, BatchShapeError, DeviceArray, InputSpec, batch_value, input_specs,
                                        is_device, np_dtype)
from onnxcampo.training.batches import partial_batch as partial_batch_of
from onnxcampo.training.checkpoint import read_checkpoint, write_checkpoint
from onnxcampo.training.evaluate import eval_model, training_mode
from onnxcampo.training.queue import Loss, StepQueue
from onnxcampo.training.scaling import LOSS_SCALE, initial_state
from onnxcampo.training.step import INITIAL_PREFIX, LABELS, LOSS, LR, UPDATED, initial_weights, step_spec
from onnxcampo.training.train_mode import DROPOUT_SEED, running_stats

logger = logging.getLogger(__name__)

# ORT's CUDA EP runs a graph id twice before it captures it (min_num_runs_before_cuda_graph_
# capture_ = 2); the two ids alternate, so both are captured by step 6. A run that fails before
# step CAPTURE_STEPS under cuda_graph=None makes the Trainer run node by node instead.
CAPTURE_STEPS = 8

# what Trainer.step does with a last partial batch (batches.partial_batch): one ConfigError naming
# the sizes, or skip the step
PARTIAL_BATCH = ("error", "drop")


def dynamic_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs without a static shape (a dim that is not a positive number, or no
    shape at all), as ``name dtype[dims]``."""
    specs = input_specs(model)
    return [f"{name} {specs[name].text()}" for name in ir.dynamic_inputs(model) if name in specs]


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def choose_cuda_graph(model: onnx.ModelProto, provider: str, cuda_graph: bool | None) -> tuple[bool, str]:
    """Whether a Trainer replays its steps as CUDA graphs, and why.

    ``cuda_graph=None`` (the default): yes on provider "cuda" when every graph input has a
    static shape, else no. ``True``: yes, or a ConfigError when the provider is not "cuda" or an
    input has a dynamic shape (every replay reads buffers of one shape). ``False``: no.
    """
    if cuda_graph is not None and not cuda_graph:
        return False, "cuda_graph=False"
    dynamic = dynamic_inputs(model)
    if cuda_graph:
        if provider != "cuda":
            raise ConfigError(f"CUDA graphs need provider 'cuda', not '{provider}'")
        if dynamic:
            raise ConfigError(f"CUDA graphs need static input shapes, but the step graph has {_listed(dynamic)}: "
                              "pin them (train-graph --input-shape) or run without CUDA graphs")
        return True, "cuda_graph=True"
    if provider != "cuda":
        return False, f"provider '{provider}' (CUDA graphs need 'cuda')"
    if dynamic:
        return False, (f"dynamic input shapes ({_listed(dynamic)}); a CUDA graph replays one shape "
                       "(train-graph --input-shape pins them)")
    return True, "provider 'cuda', static input shapes"


def _session(model: onnx.ModelProto, provider: str, graph: bool, auto: bool,
             queue: StepQueue | None = None) -> tuple[ort.InferenceSession, bool]:
    """The step's session and whether it captures CUDA graphs. Chosen automatically (``auto``),
    a graph that ORT cannot capture (a node placed on the CPU, say) falls back to a plain session."""
    if not (graph and auto):
        return _make(model, provider, queue, cuda_graph=graph), graph
    try:
        return _make(model, provider, queue, cuda_graph=True), True
    except ModelLoadError as exc:
        logger.info("Trainer: steps run node by node, not as CUDA graphs: ONNX Runtime refused to capture "
                    "this step graph (%s)", str(exc).splitlines()[0])
        return _make(model, provider, queue, cuda_graph=False), False


def _make(model: onnx.ModelProto, provider: str, queue: StepQueue | None, *, cuda_graph: bool = False) -> ort.InferenceSession:
    """A session of the Trainer's: on the queue's stream when its steps are queued on the GPU
    (CUDA graphs only: module docstring), else on ONNX Runtime's own."""
    on_queue = queue is not None and provider == "cuda" and cuda_graph
    stream = {"user_compute_stream": str(queue.stream)} if on_queue else None
    return make_session(model, provider=provider, cuda_graph=cuda_graph, cuda_options=stream)


def make_queue(provider: str, queued: bool | None, cuda_graph: bool = True) -> StepQueue | None:
    """The Trainer's :class:`StepQueue`: on provider "cuda" under CUDA graphs (``cuda_graph``: the
    steps may be replayed) unless ``queued=False``; ``queued=True`` insists (a ConfigError on
    another provider or without CUDA graphs, a CampoError without a CUDA runtime)."""
    if queued is not None and not queued:
        return None
    if provider == "cuda" and not cuda_graph:
        if queued:
            raise ConfigError("queued steps on CUDA need CUDA graphs (cuda_graph=None or True): steps run node by "
                              "node are waited for")
        return None
    if provider != "cuda":
        if queued:
            raise ConfigError(f"queued steps need provider 'cuda', not '{provider}'")
        return None
    try:
        return StepQueue(cuda_runtime(), device_id=DEVICE_ID)
    except CampoError as exc:
        if queued:
            raise
        logger.info("Trainer: each step is waited for (no CUDA runtime to queue them on: %s)", exc)
        return None


class _CaptureFailed(Exception):
    """A CUDA-graph run failed while the Trainer may still go back to plain runs."""


def _meta(value: np.ndarray | ort.OrtValue | DeviceArray) -> tuple[np.dtype, tuple[int, ...]]:
    if isinstance(value, ort.OrtValue):
        return np_dtype(value.element_type(), "an OrtValue"), tuple(value.shape())
    return value.dtype, tuple(value.shape)


def _producers(values: Iterable[object]) -> set[int | None]:
    """The streams that wrote the device memory in ``values`` and must be waited for (``None``:
    unknown, the whole device)."""
    return {value.stream for value in values if isinstance(value, DeviceArray) and value.wait}


class Trainer:
    """``Trainer(step_model, provider="cpu"|"cuda").step(batch) -> loss``.

    ``weights`` are the initial fp32 master weights; by default the starting values that
    ``build_train_step`` stores in the step graph, else ``initial_weights(forward, step)``;
    optimizer state starts at zero, except scalars the graph gives a start value in its metadata
    (``loss_scale``). ``cuda_graph``: replay each step as a CUDA graph; ``None`` (default) does
    so on provider "cuda" when every graph input has a static shape (:func:`choose_cuda_graph`;
    the log says why not), ``True`` insists, ``False`` runs node by node. Under CUDA graphs every
    batch keeps the first one's shapes and dtypes. ``self.cuda_graph`` says what was chosen.
    ``partial_batch``: a batch with fewer rows than the step graph's (a loader's last one) is one
    ConfigError naming the sizes (``"error"``, default) or a skipped step (``"drop"``); the step
    graph's shapes are static, so it cannot run as it is (:mod:`onnxcampo.training.batches`).
    ``queued``: on provider "cuda" under CUDA graphs (``None``, default, or ``True``) :meth:`step`
    returns once the step is queued and its :class:`~onnxcampo.training.queue.Loss` waits when
    read; ``False`` waits for each step, as do steps run node by node (module docstring;
    ``queued=True`` with ``cuda_graph=False`` is a ConfigError). ``self.queued`` says what was
    chosen.

    ``self.lr`` is the learning rate the next step uses (an input of the step graph, read at
    every step): set it between steps for a schedule (:mod:`onnxcampo.training.schedules`).
    ``self.steps`` counts the steps taken (restored by :meth:`load_checkpoint`).
    :meth:`evaluate` runs the forward alone; :meth:`save_checkpoint` / :meth:`load_checkpoint`
    save and restore weights, optimizer and loss-scaling state, the step count and ``lr``.

    Step graphs with training-mode BatchNormalization or Dropout (:mod:`onnxcampo.training.train_mode`)
    carry more state: the running mean and variance (starting from the values in ``weights`` when
    it has them, else the forward model's) and ``dropout_seed`` (starting at ``seed``, one more
    each step); :meth:`state_dict` and checkpoints hold them, :meth:`evaluate` runs on the running
    statistics without dropout and :meth:`export` writes the running statistics back.
    """

    def __init__(self, step_model: str | os.PathLike | onnx.ModelProto, *, provider: str = "cpu",
                 weights: Mapping[str, np.ndarray] | None = None, lr: float | None = None,
                 cuda_graph: bool | None = None, partial_batch: str = "error", seed: int = 0,
                 queued: bool | None = None) -> None:
        if partial_batch not in PARTIAL_BATCH:
            raise ConfigError(f"partial_batch must be one of {', '.join(PARTIAL_BATCH)}, not {partial_batch!r}")
        self.partial_batch = partial_batch
        self.dropped = 0  # partial batches skipped under partial_batch="drop"
        self.model, _ = ir.read_model(step_model)
        self.spec = step_spec(self.model)
        if not 0 <= seed < 2 ** 24:  # dropout_seed is a float32 scalar, exact up to 2^24
            raise ConfigError(f"seed must be an integer in [0, 2^24), not {seed!r}")
        if weights is None:
            weights = initial_weights(None, self.model)
        starts = [t for t in self.model.graph.initializer if t.name.startswith(INITIAL_PREFIX)]
        stored = {t.name[len(INITIAL_PREFIX):]: numpy_helper.to_array(t) for t in starts}
        for tensor in starts:  # no node reads them: not for the session
            self.model.graph.initializer.remove(tensor)
        missing = [w for w in self.spec.weights if w not in weights]
        if missing:
            raise ConfigError(f"initial values missing for weights {missing[:5]}")
        self.lr = lr if lr is not None else float(ir.metadata(self.model, "onnxcampo.lr", "0.01"))
        self.provider = provider
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.inputs = input_specs(self.model)
        graph, why = choose_cuda_graph(self.model, provider, cuda_graph)
        if not graph:
            logger.info("Trainer: steps run node by node, not as CUDA graphs: %s", why)
        self._auto = cuda_graph is None
        self._queue = make_queue(provider, queued, graph)
        stepping = training_mode(self.model)  # what the step session runs: the train-mode switches resolved
        try:
            self.session, self.cuda_graph = _session(stepping, provider, graph, self._auto, self._queue)
        except (ModelLoadError, *_ORT_ERRORS) as exc:
            if self._queue is None or queued:
                raise
            logger.warning("Trainer: each step is waited for: ONNX Runtime refused a session on the Trainer's own "
                           "stream (%s)", str(exc).splitlines()[0])
            self._queue = None
            self.session, self.cuda_graph = _session(stepping, provider, graph, self._auto)
        if self._queue is not None and provider == "cuda" and not self.cuda_graph:
            if queued:
                raise ConfigError("queued steps on CUDA need CUDA graphs, and ONNX Runtime could not capture this "
                                  "step graph (queued=None waits for each step instead)")
            self._queue = None  # node by node: waited steps (module docstring)
        if self._queue is not None:
            self._queue.keep(self)  # the sessions go after the steps queued on them
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in self.model.graph.input}
        # Our own copies: on the CPU an OrtValue borrows the numpy array's memory, so the caller's
        # arrays must not be bound (steps would overwrite them) and ours must outlive the buffers.
        initial = {name: np.array(weights[name], dtype=np.float32, order="C", copy=True) for name in self.spec.weights}
        starts = {**initial_state(self.model), DROPOUT_SEED: float(seed)}
        statistics = running_stats(self.model)
        for name in self.spec.state:
            if name in statistics:  # running mean/variance: given with the weights, else the forward's
                value = weights[name] if name in weights else stored[name]
                initial[name] = np.array(value, dtype=np.float32, order="C", copy=True)
            else:
                initial[name] = np.full(shapes[name], starts.get(name, 0.0), np.float32)
        self._host = [initial, {name: np.empty_like(value) for name, value in initial.items()}]
        self._buffers = [{name: ort.OrtValue.ortvalue_from_numpy(value, self.device, DEVICE_ID)
                          for name, value in arrays.items()} for arrays in self._host]
        if self.device != "cpu":
            self._host = []  # copied to the device: the host arrays may go
            if self._queue is not None:  # copied on the legacy stream: done before the queue's stream reads them
                self._queue.runtime.synchronize(None)
        self._loss_host = np.zeros((), np.float32)  # kept alive: the OrtValue borrows it
        self._loss = ort.OrtValue.ortvalue_from_numpy(self._loss_host, "cpu", 0)
        self._current = 0
        self.steps = 0
        # steps on fixed buffers (CUDA graphs, queued steps): (binding, run options) per buffer set,
        # made for the buffers in _bound (the batch, lr and loss buffers they read and write)
        self._graph: list | None = None
        self._bound: dict[str, ort.OrtValue] = {}
        self._fixed: dict[str, ort.OrtValue] = {}  # CUDA graphs, each step waited for: the buffers the graphs read
        self._first: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}  # CUDA graphs: the first batch's types
        self._eval: dict[bool, tuple[ort.InferenceSession, list[str], dict]] = {}  # with labels: session

    @property
    def queued(self) -> bool:
        """Whether steps are queued on the GPU (:mod:`onnxcampo.training.queue`)."""
        return self._queue is not None

    def synchronize(self) -> None:
        """Wait until every queued step is done (nothing to wait for when steps are not queued)."""
        if self._queue is not None:
            self._queue.drain()

    def step(self, batch: Mapping[str, object]) -> Loss | None:
        """One update on ``batch`` (the forward inputs plus ``labels``); returns its loss, a
        :class:`~onnxcampo.training.queue.Loss`: a float when converted, read from the GPU (waiting
        for the step) the first time it is, so steps queue until a loss is read.

        A value may be a numpy array, an ``onnxruntime.OrtValue``, a torch tensor (CPU or CUDA)
        or another object with ``__cuda_array_interface__`` or ``__dlpack__`` (CuPy array): see
        :mod:`onnxcampo.training.batches`. Device values are read where they are, never through
        the host; the Trainer waits for the stream that made them (the one
        ``__cuda_array_interface__`` names, else the whole device) before ORT reads them.

        A partial batch (fewer rows than the step graph's, in every input with its batch dim) is
        one ConfigError naming the sizes; under ``partial_batch="drop"`` the step is skipped and
        returns ``None`` (nothing updated, ``self.steps`` unchanged, ``self.dropped`` counts it).
        """
        values = self._values(batch, self.inputs, self.spec.batch, drop=self.partial_batch == "drop")
        if values is None:
            return None
        if self.cuda_graph:
            try:
                return self._fixed_step(values)
            except _CaptureFailed as failed:
                self._leave_graphs(failed.__cause__)
        if self._queue is not None:
            return self._fixed_step(values)
        return self._plain_step(values)

    def _values(self, batch: Mapping[str, object], specs: Mapping[str, InputSpec], expected: Iterable[str], *,
                drop: bool, evaluating: bool = False) -> dict[str, np.ndarray | ort.OrtValue | DeviceArray] | None:
        """``batch`` checked and turned into bindable values (:func:`batch_value`); ``None`` for a
        partial batch when ``drop``, else a partial batch is one ConfigError naming the sizes."""
        expected = list(expected)
        unknown = sorted(set(batch) - set(self.spec.batch))
        missing = sorted(set(expected) - set(batch))
        if unknown or missing:
            raise ConfigError(f"batch does not match the step graph: missing {missing}, unknown {unknown}")
        values, wrong = {}, []
        for name in expected:
            try:
                values[name] = batch_value(specs[name], batch[name])
            except BatchShapeError as error:
                wrong.append(error)
        if wrong:
            partial = partial_batch_of({name: specs[name] for name in expected}, wrong)
            if partial is None:
                raise wrong[0]
            if not drop:
                raise ConfigError(partial.message(evaluating=evaluating))
            if not self.dropped:
                logger.info("Trainer: dropping partial batches (%d rows, the step graph takes %d)",
                            partial.rows, partial.graph_rows)
            self.dropped += 1
            return None
        if self.device == "cpu":
            on_device = [name for name, value in values.items() if is_device(value)]
            if on_device:
                raise ConfigError(f"batch input {on_device[0]} is in CUDA memory, but the Trainer runs on provider "
                                  f"'{self.provider}': pass host arrays (or CPU OrtValues), or use provider 'cuda'")
        return values

    def _plain_step(self, values: Mapping[str, np.ndarray | ort.OrtValue | DeviceArray]) -> Loss:
        # Arrays (held in values until the run is over: on the CPU the OrtValues borrow them) go to
        # the device; OrtValues and device memory are bound where they are.
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(value, self.device, DEVICE_ID) if isinstance(value, np.ndarray)
                 else value for name, value in values.items()}
        feeds[LR] = ort.OrtValue.ortvalue_from_numpy(np.array(self.lr, np.float32), self.device, DEVICE_ID)
        self._wait_for_producers(values.values())
        # the loss is the one value that comes back to the host
        return self._run(self._bind(feeds, self._current, self._loss), self._loss)

    def _bind(self, values: Mapping[str, ort.OrtValue | DeviceArray], k: int, loss: ort.OrtValue) -> ort.IOBinding:
        """Batch and lr ``values``, weights and state read from buffer set ``k``, written to ``1 - k``."""
        binding = self.session.io_binding()
        for name, value in (*values.items(), *self._buffers[k].items()):
            if isinstance(value, DeviceArray):
                binding.bind_input(name, "cuda", DEVICE_ID, value.dtype, list(value.shape), value.ptr)
            else:
                binding.bind_ortvalue_input(name, value)
        for name, value in self._buffers[1 - k].items():
            binding.bind_ortvalue_output(name + UPDATED, value)
        binding.bind_ortvalue_output(LOSS, loss)
        return binding

    @staticmethod
    def _wait_for_producers(values: Iterable[object]) -> None:
        """Device memory is read by ORT's own stream: first wait for the streams that wrote it."""
        streams = _producers(values)
        if streams:
            runtime = cuda_runtime()
            for stream in [None] if None in streams else sorted(streams):
                runtime.synchronize(stream)

    def _run(self, binding: ort.IOBinding, loss: ort.OrtValue, options: ort.RunOptions | None = None) -> Loss:
        try:
            self.session.run_with_iobinding(binding, options)
        except _ORT_ERRORS as exc:
            if options is not None and self._auto and self.steps < CAPTURE_STEPS:
                raise _CaptureFailed() from exc
            raise
        self._current = 1 - self._current
        self.steps += 1
        if self._queue is not None:
            return self._queue.loss(loss, self.steps)
        binding.synchronize_outputs()
        return Loss(self.steps, value=float(loss.numpy()))

    def _fixed_step(self, values: Mapping[str, np.ndarray | ort.OrtValue | DeviceArray]) -> Loss:
        """A step on fixed device buffers, replayed from a CUDA graph or queued: the batch and lr are
        copied into the buffers, then binding ``k`` (weights in set k, out to set 1 - k) runs,
        as graph ``k + 1`` under CUDA graphs."""
        metas = {name: _meta(value) for name, value in values.items()}
        if self.cuda_graph:
            self._first = self._first or metas
            for name, (dtype, shape) in metas.items():
                first_dtype, first_shape = self._first[name]
                if (dtype, shape) != (first_dtype, first_shape):
                    raise ConfigError(f"with CUDA graphs every batch keeps the first one's shapes and types: "
                                      f"{name} is {dtype}{list(shape)}, was {first_dtype}{list(first_shape)}")
        buffers = {name: self._buffer(name, dtype, shape) for name, (dtype, shape) in metas.items()}
        buffers[LR] = self._buffer(LR, np.dtype(np.float32), ())
        buffers[LOSS] = self._buffer(LOSS, np.dtype(np.float32), ())
        if self._graph is None or any(buffers[name] is not self._bound.get(name) for name in buffers):
            self._bound = buffers
            self._graph = []
            for k in (0, 1):
                options = ort.RunOptions()
                if self.cuda_graph:
                    options.add_run_config_entry("gpu_graph_id", str(k + 1))
                if self._queue is not None:
                    self._queue.run_options(options)
                fed = {name: value for name, value in buffers.items() if name != LOSS}
                self._graph.append((self._bind(fed, k, buffers[LOSS]), options))
        self._fill(buffers, values)
        binding, options = self._graph[self._current]
        return self._run(binding, buffers[LOSS], options)

    def _buffer(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> ort.OrtValue:
        """The fixed device buffer of ``name``: the queue's, else made once for the CUDA graphs."""
        if self._queue is not None:
            return self._queue.fixed(name, dtype, shape)
        if name not in self._fixed:
            self._fixed[name] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type, self.device, DEVICE_ID)
        return self._fixed[name]

    def _fill(self, buffers: Mapping[str, ort.OrtValue], values: Mapping[str, np.ndarray | ort.OrtValue | DeviceArray]) -> None:
        """Copy the batch and lr into their fixed buffers: on the queue's stream when there is one,
        else from the host in place and device to device on the legacy stream, waited for."""
        queue = self._queue
        uploads, copies = {LR: np.array(self.lr, np.float32)}, []  # host arrays; (to, from, bytes) device to device
        for name, value in values.items():
            if isinstance(value, np.ndarray):
                uploads[name] = value
            elif isinstance(value, DeviceArray):
                copies.append((buffers[name].data_ptr(), value.ptr, value.nbytes))
            elif value.device_name() == "cpu":
                uploads[name] = value.numpy()
            else:
                dtype, shape = _meta(value)
                copies.append((buffers[name].data_ptr(), value.data_ptr(), int(np.prod(shape)) * dtype.itemsize))
        if queue is None:
            for name, array in uploads.items():
                buffers[name].update_inplace(array)
            if copies:
                self._wait_for_producers(values.values())
                runtime = cuda_runtime()
                for to, source, nbytes in copies:
                    runtime.copy(to, source, nbytes, LEGACY_STREAM)
                runtime.synchronize(LEGACY_STREAM)  # ORT's stream does not wait for the legacy one
            return
        for name, array in uploads.items():
            queue.upload(buffers[name], array)
        if copies:
            owners = {value.stream if isinstance(value, DeviceArray) else LEGACY_STREAM
                      for value in values.values() if is_device(value)}
            # ORT writes its OrtValues in CUDA memory on the legacy stream (its copies from the host)
            ort_values = any(isinstance(value, ort.OrtValue) for value in values.values() if is_device(value))
            queue.after(_producers(values.values()) | ({LEGACY_STREAM} if ort_values else set()))
            for to, source, nbytes in copies:
                queue.copy(to, source, nbytes)
            queue.release(owners)  # the owners write (or reuse) the memory on their streams only after these reads

    def _leave_graphs(self, cause: BaseException | None) -> None:
        """cuda_graph=None and a CUDA-graph run failed in the first steps: plain runs from now on."""
        logger.warning("Trainer: a step failed as a CUDA graph (%s); running steps node by node from now on "
                       "(cuda_graph=False skips the attempt)", str(cause).splitlines()[0] if cause else "?")
        if self._queue is not None:
            self._queue.drain()
            if self.provider == "cuda":
                self._queue = None  # node by node: waited steps (module docstring)
        self.session = None  # the capturing session goes before the plain one comes
        self._graph, self._bound, self._fixed, self._first = None, {}, {}, {}
        self.session = _make(training_mode(self.model), self.provider, self._queue)
        self.cuda_graph = False

    def evaluate(self, batch: Mapping[str, object]) -> dict[str, np.ndarray]:
        """The forward on the current weights: ``{prediction name: array}``, plus ``"loss"``
        when ``batch`` has ``labels``. Nothing is updated (no gradient, no optimizer state, no
        step counted). The weights are bound where they live (on the device), not copied; the
        batch takes the values :meth:`step` takes. The prediction is the forward model's first
        output, the one the loss reads (the step graph keeps no other)."""
        with_loss = LABELS in batch
        self.synchronize()  # the weights of the steps queued so far
        if with_loss not in self._eval:
            model = eval_model(self.model, with_loss=with_loss)
            names = [o.name for o in model.graph.output]
            self._eval[with_loss] = (_make(model, self.provider, None), names, input_specs(model))  # ORT's stream
        session, names, inputs = self._eval[with_loss]
        expected = [name for name in inputs if name in self.spec.batch]
        values = self._values(batch, inputs, expected, drop=False, evaluating=True)
        feeds = {name: ort.OrtValue.ortvalue_from_numpy(value, self.device, DEVICE_ID) if isinstance(value, np.ndarray)
                 else value for name, value in values.items()}
        binding = session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, DeviceArray):
                binding.bind_input(name, "cuda", DEVICE_ID, value.dtype, list(value.shape), value.ptr)
            else:
                binding.bind_ortvalue_input(name, value)
        for name, value in self._buffers[self._current].items():
            if name in inputs:
                binding.bind_ortvalue_input(name, value)
        for name in names:
            binding.bind_output(name, self.device, DEVICE_ID)
        self._wait_for_producers(values.values())
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return dict(zip(names, binding.copy_outputs_to_cpu()))

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write weights, optimizer and loss-scaling state, the step count and ``lr`` to ``path``
        (one ``.npz``, written atomically: :mod:`onnxcampo.training.checkpoint`)."""
        write_checkpoint(path, self.state_dict(), steps=self.steps, lr=self.lr,
                         inputs=[i.name for i in self.model.graph.input])

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what :meth:`save_checkpoint` wrote; the next step continues the saved run
        exactly. The arrays must match this step graph's state inputs in names, shapes and dtypes
        (else one ConfigError line, and nothing is changed)."""
        meta, arrays = read_checkpoint(path)
        current = self._buffers[self._current]
        missing = [name for name in current if name not in arrays]
        unknown = [name for name in arrays if name not in current]
        wrong = [f"{name} is {arrays[name].dtype}{list(arrays[name].shape)}, the graph wants {dtype}{list(shape)}"
                 for name, (dtype, shape) in ((n, _meta(v)) for n, v in current.items())
                 if name in arrays and (arrays[name].dtype != dtype or tuple(arrays[name].shape) != shape)]
        if missing or unknown or wrong:
            parts = ([f"missing {_listed(missing)}"] if missing else []) + \
                    ([f"not in the step graph: {_listed(unknown)}"] if unknown else []) + wrong[:2]
            raise ConfigError(f"{path}: checkpoint does not match the step graph: {'; '.join(parts)}")
        try:
            steps, lr = int(meta["steps"]), float(meta["lr"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: checkpoint metadata lacks steps or lr") from None
        self.synchronize()
        for name, value in current.items():
            if self._queue is not None:  # on the steps' stream, before the next step reads it
                self._queue.upload(value, arrays[name].astype(np.float32, copy=False))
            else:
                value.update_inplace(np.ascontiguousarray(arrays[name]))
        self.steps, self.lr = steps, lr

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (``None`` when the graph has no loss scaling)."""
        value = self._buffers[self._current].get(LOSS_SCALE)
        if value is None:
            return None
        self.synchronize()
        return float(value.numpy())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Current weights and optimizer state, copied to the host (after the queued steps)."""
        self.synchronize()
        return {name: value.numpy().copy() for name, value in self._buffers[self._current].items()}

    def export(self, forward: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
        """The forward (inference) model with the trained weights and running statistics."""
        model, _ = ir.read_model(forward)
        state = self.state_dict()
        for name, initializer in running_stats(self.model).items():
            state[initializer] = state.pop(name)
        trained = {*self.spec.weights, *running_stats(self.model).values()}
        for index, tensor in enumerate(model.graph.initializer):
            if tensor.name in trained:
                model.graph.initializer[index].CopyFrom(numpy_helper.from_array(state[tensor.name], tensor.name))
        for node in model.graph.node:  # weights kept as Constant nodes (Paddle exports)
            if node.op_type == "Constant" and node.output[0] in trained:
                value = next(a for a in node.attribute if a.name == "value")
                value.t.CopyFrom(numpy_helper.from_array(state[node.output[0]], value.t.name))
        return model
