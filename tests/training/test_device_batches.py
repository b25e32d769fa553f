"""The Trainer's CUDA-graph default and the batch values it takes besides numpy arrays.

Everything here runs on ORT CPU. The CUDA-graph rule is a function of the step graph and the
provider; OrtValue and DLPack batches check the wiring (the same losses as numpy batches), not
GPU behaviour; CUDA memory is imitated by objects exposing ``__cuda_array_interface__``, which
the Trainer must check and refuse before any CUDA call. ``tests/gpu/test_trainer_cuda.py``
runs the real thing on a GPU.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import DLPackOnly

from onnxcampo.errors import ConfigError, ModelLoadError
from onnxcampo.examples.training_mlp import TARGET, X, mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training import trainer as trainer_module
from onnxcampo.training.batches import DeviceArray, InputSpec, batch_value, input_specs
from onnxcampo.training.trainer import CAPTURE_STEPS, choose_cuda_graph, dynamic_inputs


@pytest.fixture(scope="module")
def step():
    return build_train_step(mlp(), loss="mse", optimizer="momentum", lr=0.1)


def _trainer(step, **options):
    return Trainer(step, weights=initial_weights(mlp(), step), **options)


def _batches(n=4):
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal(X.shape).astype(np.float32), "labels": TARGET} for _ in range(n)]


def _dynamic(step, *, shapeless=False):
    model = onnx.ModelProto()
    model.CopyFrom(step)
    x = next(i for i in model.graph.input if i.name == "x")
    if shapeless:
        x.type.tensor_type.ClearField("shape")
    else:
        x.type.tensor_type.shape.dim[0].dim_param = "batch"
    return model


# --- the CUDA-graph rule --------------------------------------------------------------------

def test_cuda_graphs_by_default_on_cuda_when_every_input_shape_is_static(step):
    assert dynamic_inputs(step) == []
    assert choose_cuda_graph(step, "cuda", None) == (True, "provider 'cuda', static input shapes")
    assert choose_cuda_graph(step, "cuda", True)[0] is True
    assert choose_cuda_graph(step, "cuda", False) == (False, "cuda_graph=False")  # the way out


def test_no_cuda_graphs_by_default_on_the_cpu_or_with_dynamic_shapes(step):
    assert choose_cuda_graph(step, "cpu", None) == (False, "provider 'cpu' (CUDA graphs need 'cuda')")
    for model, shown in ((_dynamic(step), "x float32[?, 8]"), (_dynamic(step, shapeless=True), "x float32?")):
        assert dynamic_inputs(model) == [shown]
        use, why = choose_cuda_graph(model, "cuda", None)
        assert not use and shown in why and "--input-shape" in why
        assert choose_cuda_graph(model, "cuda", False)[0] is False


def test_cuda_graphs_asked_for_where_they_cannot_be_are_one_line_errors(step):
    with pytest.raises(ConfigError, match="CUDA graphs need provider 'cuda', not 'cpu'"):
        choose_cuda_graph(step, "cpu", True)
    with pytest.raises(ConfigError, match=r"need static input shapes, but the step graph has x float32\[\?, 8\]"):
        choose_cuda_graph(_dynamic(step), "cuda", True)
    with pytest.raises(ConfigError, match="CUDA graphs need provider 'cuda', not 'cpu'"):
        _trainer(step, cuda_graph=True)


def test_the_trainer_logs_why_it_runs_node_by_node(step, caplog):
    with caplog.at_level(logging.INFO, logger="onnxcampo.training.trainer"):
        trainer = _trainer(step)
    assert trainer.cuda_graph is False
    assert "not as CUDA graphs: provider 'cpu'" in caplog.text


def test_a_graph_ort_will_not_capture_falls_back_to_plain_runs_only_when_chosen_automatically(step, monkeypatch, caplog):
    """_session: ORT refuses enable_cuda_graph for a graph with a node off the CUDA EP; under
    cuda_graph=None that means plain runs (logged), under True the error stands."""
    made = []

    def fake_make_session(model, *, provider, cuda_graph, cuda_options=None):
        made.append(cuda_graph)
        if cuda_graph:
            raise ModelLoadError("ONNX Runtime could not load the model: This session cannot use the graph "
                                 "capture feature as requested by the user as all compute graph nodes have not "
                                 "been partitioned to the CUDA EP.")
        return "plain session"

    monkeypatch.setattr(trainer_module, "make_session", fake_make_session)
    with caplog.at_level(logging.INFO, logger="onnxcampo.training.trainer"):
        assert trainer_module._session(step, "cuda", True, auto=True) == ("plain session", False)
    assert made == [True, False] and "refused to capture" in caplog.text
    with pytest.raises(ModelLoadError, match="graph capture"):
        trainer_module._session(step, "cuda", True, auto=False)
    assert trainer_module._session(step, "cuda", False, auto=True) == ("plain session", False)


class _FailingFirstRuns:
    """A session whose first ``failures`` runs with run options (the CUDA-graph path) fail."""

    def __init__(self, session, failures):
        self.session, self.failures = session, failures

    def io_binding(self):
        return self.session.io_binding()

    def run_with_iobinding(self, binding, options=None):
        if options is not None and self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA failure 901: operation not permitted when stream is capturing")
        return self.session.run_with_iobinding(binding, options)


def test_a_failed_capture_in_the_first_steps_falls_back_to_plain_runs(step, caplog):
    """Wiring on ORT CPU (the CPU session runs the CUDA-graph path's bindings and ignores the
    graph id): under cuda_graph=None a run of the graph path that fails in the first steps makes
    the Trainer go on node by node from the same weights; later, or under True, it is an error."""
    plain, auto = _trainer(step), _trainer(step)
    auto.cuda_graph, auto._auto = True, True  # as chosen on CUDA
    batches = _batches(CAPTURE_STEPS + 2)
    for batch in batches[:3]:
        assert auto.step(batch) == pytest.approx(plain.step(batch), rel=1e-6)
    auto.session = _FailingFirstRuns(auto.session, 1)
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.trainer"):
        assert auto.step(batches[3]) == pytest.approx(plain.step(batches[3]), rel=1e-6)
    assert auto.cuda_graph is False and "running steps node by node from now on" in caplog.text
    assert auto.step(batches[4]) == pytest.approx(plain.step(batches[4]), rel=1e-6)

    late = _trainer(step)
    late.cuda_graph, late._auto = True, True
    for batch in batches[:CAPTURE_STEPS]:
        late.step(batch)
    late.session = _FailingFirstRuns(late.session, 1)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        late.step(batches[CAPTURE_STEPS])
    insisted = _trainer(step)
    insisted.cuda_graph, insisted._auto = True, False  # as cuda_graph=True makes it: no fallback
    insisted.session = _FailingFirstRuns(insisted.session, 1)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        insisted.step(batches[0])


def test_the_command_line_has_a_way_out(tmp_path, capsys):
    from onnxcampo.cli import main

    forward, path, data = tmp_path / "fwd.onnx", tmp_path / "step.onnx", tmp_path / "data.npz"
    onnx.save(mlp(), str(forward))
    assert main(["train-graph", str(forward), str(path), "--loss", "mse"]) == 0
    np.savez(data, x=X, labels=TARGET)
    assert main(["train", str(path), "--data", str(data), "--steps", "2", "--no-cuda-graph"]) == 0
    capsys.readouterr()
    # one or the other: a usage error, one line
    assert main(["train", str(path), "--data", str(data), "--cuda-graph", "--no-cuda-graph"]) == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and len(err.strip().splitlines()) == 1


# --- OrtValue and DLPack batches on the CPU ---------------------------------------------------

@pytest.mark.parametrize("graph_path", [False, True], ids=["plain", "fixed-buffers"])
def test_ortvalue_and_dlpack_batches_give_the_losses_of_numpy_batches(step, graph_path):
    """Wiring on ORT CPU: OrtValues are bound as they are (plain path) or copied into the fixed
    buffers (the CUDA-graph path, run here by the CPU session); host DLPack objects are read as
    numpy arrays. Both give numpy batches' losses and leave the caller's values alone."""
    reference, ortvalues, dlpack, mixed = (_trainer(step) for _ in range(4))
    for trainer in (ortvalues, dlpack, mixed):
        trainer.cuda_graph = graph_path
    batches = _batches()
    kept = [batch["x"].copy() for batch in batches]
    for batch in batches:
        expected = reference.step(batch)
        as_values = {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in batch.items()}
        assert ortvalues.step(as_values) == pytest.approx(expected, rel=1e-6)
        assert dlpack.step({name: DLPackOnly(value) for name, value in batch.items()}) == pytest.approx(expected, rel=1e-6)
        assert mixed.step({"x": as_values["x"], "labels": batch["labels"]}) == pytest.approx(expected, rel=1e-6)
    assert all(np.array_equal(batch["x"], x) for batch, x in zip(batches, kept))
    for trainer in (ortvalues, dlpack, mixed):
        for name, value in reference.state_dict().items():
            np.testing.assert_allclose(trainer.state_dict()[name], value, rtol=1e-6)


def test_ortvalue_batches_are_checked_against_the_graph(step):
    trainer = _trainer(step)
    with pytest.raises(ConfigError, match=r"batch input x \(OrtValue on cpu\) is float64\[32, 8\]; the step graph "
                                          r"takes float32\[32, 8\]"):
        trainer.step({"x": ort.OrtValue.ortvalue_from_numpy(X.astype(np.float64)), "labels": TARGET})
    with pytest.raises(ConfigError, match=r"batch input labels \(host array\) has shape \[32, 2\]"):
        trainer.step({"x": X, "labels": TARGET[:, :2]})
    assert trainer.steps == 0


# --- CUDA memory: checked, then refused on the CPU, before any CUDA call ----------------------

class _FakeCuda:
    """Looks like CUDA memory: ``__cuda_array_interface__`` over a host array's pointer (never
    read here: the CPU provider refuses it first)."""

    def __init__(self, array, *, strides=None, version=2, device=None, **extra):
        self._array, self._device = array, device
        self.__cuda_array_interface__ = {"shape": array.shape, "typestr": array.dtype.str,
                                         "data": (array.ctypes.data, False), "strides": strides,
                                         "version": version, **extra}
        if device is not None:
            self.__dlpack_device__ = lambda: device


def _spec(step, name="x"):
    return input_specs(step)[name]


def test_cuda_memory_is_read_by_pointer_and_waited_for_as_its_interface_says(step):
    value = batch_value(_spec(step), _FakeCuda(X))
    assert isinstance(value, DeviceArray)
    assert (value.ptr, value.shape, value.dtype, value.nbytes) == (X.ctypes.data, (32, 8), np.float32, X.nbytes)
    assert value.wait and value.stream is None  # v2 (torch) names no stream: the whole device
    named = batch_value(_spec(step), _FakeCuda(X, version=3, stream=7))
    assert named.wait and named.stream == 7
    assert not batch_value(_spec(step), _FakeCuda(X, version=3, stream=None)).wait  # v3: nothing to wait for
    # C-contiguous strides given explicitly are fine, as are odd strides of size-1 dims
    assert isinstance(batch_value(_spec(step), _FakeCuda(X, strides=(32, 4))), DeviceArray)
    column = InputSpec("column", np.dtype(np.float32), (32, 1))
    assert isinstance(batch_value(column, _FakeCuda(np.zeros((32, 1), np.float32), strides=(4, 999))), DeviceArray)
    assert isinstance(batch_value(_spec(step), _FakeCuda(X, device=(2, 0))), DeviceArray)


@pytest.mark.parametrize("fake, message", [
    (lambda: _FakeCuda(X.astype(np.float16)), r"x \(CUDA memory\) is float16\[32, 8\]; the step graph takes float32\[32, 8\]"),
    (lambda: _FakeCuda(X[:16]), r"x \(CUDA memory\) has shape \[16, 8\]"),
    (lambda: _FakeCuda(np.zeros((32, 8, 1), np.float32)), r"has shape \[32, 8, 1\]"),
    (lambda: _FakeCuda(X, strides=(4, 128)), r"x is not C-contiguous \(strides \[4, 128\] for shape \[32, 8\]\)"),
    (lambda: _FakeCuda(X, device=(2, 1)), "x is on CUDA device 1; the Trainer runs on device 0"),
    (lambda: _FakeCuda(X, device=(4, 0)), "x is on DLPack device type 4"),
    (lambda: _FakeCuda(X, mask=object()), "x is a masked array"),
])
def test_cuda_memory_that_does_not_fit_is_a_one_line_error(step, fake, message):
    trainer = _trainer(step)
    with pytest.raises(ConfigError, match=message):
        trainer.step({"x": fake(), "labels": TARGET})
    assert trainer.steps == 0


def test_a_partial_batch_in_cuda_memory_is_named_before_any_cuda_call(step):
    """A torch CUDA loader's last batch: the sizes are read from the interface, nothing is bound."""
    trainer = _trainer(step, partial_batch="drop")
    assert trainer.step({"x": _FakeCuda(X[:16]), "labels": _FakeCuda(TARGET[:16])}) is None
    assert (trainer.steps, trainer.dropped) == (0, 1)
    with pytest.raises(ConfigError, match="partial batch: x, labels have 16 rows, the step graph takes 32"):
        _trainer(step).step({"x": _FakeCuda(X[:16]), "labels": _FakeCuda(TARGET[:16])})


def test_cuda_memory_on_the_cpu_provider_is_refused_before_it_is_bound(step):
    trainer = _trainer(step)
    for graph_path in (False, True):
        trainer.cuda_graph = graph_path
        with pytest.raises(ConfigError, match="batch input x is in CUDA memory, but the Trainer runs on provider 'cpu'"):
            trainer.step({"x": _FakeCuda(X), "labels": TARGET})
    assert trainer.steps == 0 and trainer._graph is None


def test_an_interface_that_raises_is_a_config_error(step):
    class RequiresGrad:  # torch: RuntimeError for a tensor that requires grad
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad.")

    with pytest.raises(ConfigError, match="requires grad"):
        batch_value(_spec(step), RequiresGrad())


def test_torch_tensors_on_the_host_train_like_numpy_arrays(step):
    """Wiring on ORT CPU: torch CPU tensors are host memory (read through DLPack)."""
    torch = pytest.importorskip("torch")
    reference, trainer = _trainer(step), _trainer(step)
    for batch in _batches(3):
        tensors = {name: torch.from_numpy(value.copy()) for name, value in batch.items()}
        assert trainer.step(tensors) == pytest.approx(reference.step(batch), rel=1e-6)
    with pytest.raises(ConfigError, match="from_dlpack failed"):
        trainer.step({"x": torch.from_numpy(X.copy()).requires_grad_(), "labels": TARGET})
