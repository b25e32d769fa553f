"""Run a training-step graph step after step on ONNX Runtime.

Weights and optimizer state live on the device between steps: two sets of buffers, one bound
as inputs and one as outputs, swapped after every step (ping-pong), so nothing but the batch
goes to the device and nothing but the loss comes back.

With ``cuda_graph=True`` (CUDA) the batch, ``lr`` and the loss also live in fixed device
buffers (the batch is copied into them before each step) and each of the two ping-pong
bindings is captured once into its own CUDA graph (run option ``gpu_graph_id``), so a step
costs one graph launch instead of one host dispatch per node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from onnxcampo import ir
from onnxcampo.errors import ConfigError
from onnxcampo.runtime import make_session
from onnxcampo.training.scaling import LOSS_SCALE, initial_state
from onnxcampo.training.step import INITIAL_PREFIX, LOSS, LR, UPDATED, initial_weights, step_spec


class Trainer:
    """``Trainer(step_model, provider="cpu"|"cuda").step(batch) -> loss``.

    ``weights`` are the initial fp32 master weights; by default the starting values that
    ``build_train_step`` stores in the step graph, else ``initial_weights(forward, step)``;
    optimizer state starts at zero, except scalars the graph gives a start value in its metadata
    (``loss_scale``). ``cuda_graph``: replay each step as a CUDA graph (provider "cuda"; every
    batch must then have the shapes of the first one).
    """

    def __init__(self, step_model: str | os.PathLike | onnx.ModelProto, *, provider: str = "cpu",
                 weights: Mapping[str, np.ndarray] | None = None, lr: float | None = None,
                 cuda_graph: bool = False) -> None:
        self.model, _ = ir.read_model(step_model)
        self.spec = step_spec(self.model)
        if weights is None:
            weights = initial_weights(None, self.model)
        starts = [t for t in self.model.graph.initializer if t.name.startswith(INITIAL_PREFIX)]
        for tensor in starts:  # no node reads them: not for the session
            self.model.graph.initializer.remove(tensor)
        missing = [w for w in self.spec.weights if w not in weights]
        if missing:
            raise ConfigError(f"initial values missing for weights {missing[:5]}")
        self.lr = lr if lr is not None else float(ir.metadata(self.model, "onnxcampo.lr", "0.01"))
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.session = make_session(self.model, provider=provider, cuda_graph=cuda_graph)
        self.cuda_graph = cuda_graph
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in self.model.graph.input}
        # Our own copies: on the CPU an OrtValue borrows the numpy array's memory, so the caller's
        # arrays must not be bound (steps would overwrite them) and ours must outlive the buffers.
        initial = {name: np.array(weights[name], dtype=np.float32, order="C", copy=True) for name in self.spec.weights}
        starts = initial_state(self.model)
        for name in self.spec.state:
            initial[name] = np.full(shapes[name], starts.get(name, 0.0), np.float32)
        self._host = [initial, {name: np.empty_like(value) for name, value in initial.items()}]
        self._buffers = [{name: ort.OrtValue.ortvalue_from_numpy(value, self.device, 0) for name, value in arrays.items()}
                         for arrays in self._host]
        if self.device != "cpu":
            self._host = []  # copied to the device: the host arrays may go
        self._loss_host = np.zeros((), np.float32)  # kept alive: the OrtValue borrows it
        self._loss = ort.OrtValue.ortvalue_from_numpy(self._loss_host, "cpu", 0)
        self._current = 0
        self.steps = 0
        self._graph: list | None = None  # cuda_graph: (binding, run options) per buffer set

    def step(self, batch: Mapping[str, np.ndarray]) -> float:
        """One update on ``batch`` (the forward inputs plus ``labels``); returns the loss."""
        unknown = sorted(set(batch) - set(self.spec.batch))
        missing = sorted(set(self.spec.batch) - set(batch))
        if unknown or missing:
            raise ConfigError(f"batch does not match the step graph: missing {missing}, unknown {unknown}")
        if self.cuda_graph:
            return self._graph_step(batch)
        # Arrays and OrtValues held until the run is over (on the CPU the values borrow the arrays).
        feeds = {name: np.ascontiguousarray(array) for name, array in batch.items()}
        feeds[LR] = np.array(self.lr, np.float32)
        values = {name: ort.OrtValue.ortvalue_from_numpy(array, self.device, 0) for name, array in feeds.items()}
        # the loss is the one value that comes back to the host
        return self._run(self._bind(values, self._current, self._loss), self._loss)

    def _bind(self, values: Mapping[str, ort.OrtValue], k: int, loss: ort.OrtValue) -> ort.IOBinding:
        """Batch and lr ``values``, weights and state read from buffer set ``k``, written to ``1 - k``."""
        binding = self.session.io_binding()
        for name, value in (*values.items(), *self._buffers[k].items()):
            binding.bind_ortvalue_input(name, value)
        for name, value in self._buffers[1 - k].items():
            binding.bind_ortvalue_output(name + UPDATED, value)
        binding.bind_ortvalue_output(LOSS, loss)
        return binding

    def _run(self, binding: ort.IOBinding, loss: ort.OrtValue, options: ort.RunOptions | None = None) -> float:
        self.session.run_with_iobinding(binding, options)
        binding.synchronize_outputs()
        self._current = 1 - self._current
        self.steps += 1
        return float(loss.numpy())

    def _graph_step(self, batch: Mapping[str, np.ndarray]) -> float:
        """A step replayed from a CUDA graph: the batch and lr are copied into fixed device
        buffers; binding ``k`` (weights in set k, out to set 1 - k) is graph ``k + 1``."""
        feeds = {name: np.ascontiguousarray(array) for name, array in batch.items()}
        feeds[LR] = np.array(self.lr, np.float32)
        if self._graph is None:
            # own copies: a CPU OrtValue would borrow (and later overwrite) the caller's arrays
            self._graph_host = {name: np.array(array, copy=True) for name, array in feeds.items()}
            self._graph_values = {name: ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)
                                  for name, array in self._graph_host.items()}
            self._graph_loss = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32), self.device, 0)
            self._graph = []
            for k in (0, 1):
                options = ort.RunOptions()
                options.add_run_config_entry("gpu_graph_id", str(k + 1))
                self._graph.append((self._bind(self._graph_values, k, self._graph_loss), options))
        else:
            for name, array in feeds.items():
                first = self._graph_host[name]
                if (array.dtype, array.shape) != (first.dtype, first.shape):
                    raise ConfigError(f"with CUDA graphs every batch keeps the first one's shapes and types: "
                                      f"{name} is {array.dtype}{list(array.shape)}, was {first.dtype}{list(first.shape)}")
                self._graph_values[name].update_inplace(array)
        binding, options = self._graph[self._current]
        return self._run(binding, self._graph_loss, options)

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (``None`` when the graph has no loss scaling)."""
        value = self._buffers[self._current].get(LOSS_SCALE)
        return None if value is None else float(value.numpy())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Current weights and optimizer state, copied to the host."""
        return {name: value.numpy().copy() for name, value in self._buffers[self._current].items()}

    def export(self, forward: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
        """The forward (inference) model with the trained weights."""
        model, _ = ir.read_model(forward)
        state = self.state_dict()
        for index, tensor in enumerate(model.graph.initializer):
            if tensor.name in self.spec.weights:
                model.graph.initializer[index].CopyFrom(numpy_helper.from_array(state[tensor.name], tensor.name))
        for node in model.graph.node:  # weights kept as Constant nodes (Paddle exports)
            if node.op_type == "Constant" and node.output[0] in self.spec.weights:
                value = next(a for a in node.attribute if a.name == "value")
                value.t.CopyFrom(numpy_helper.from_array(state[node.output[0]], value.t.name))
        return model
