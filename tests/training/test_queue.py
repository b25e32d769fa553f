"""Queued steps and the loss read on demand (onnxcampo.training.queue).

The Loss behaves as a float wherever it is converted. The queued path of the Trainer (fixed
buffers written on the Trainer's stream, the loss copied into a ring of pinned slots, a wait only
when a loss or the state is read) runs on the GPU; here it is forced on ORT's CPU provider with a
stand-in CUDA runtime that does each copy at once with memmove and records every call: a wiring
check of which copies, waits and reads happen when (the asynchrony itself is the GPU tests').
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import FakeRuntime

from onnxcampo.cli import main
from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import CLASSES, X, mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training import trainer as trainer_module
from onnxcampo.training.queue import Loss, StepQueue


@pytest.fixture
def forced(monkeypatch):
    """Trainers made now queue their steps on the CPU through a FakeRuntime (the runtime returned)."""
    runtime = FakeRuntime()
    monkeypatch.setattr(trainer_module, "make_queue",
                        lambda provider, queued, cuda_graph=True: None if queued is False else StepQueue(runtime, device="cpu", slots=8))
    return runtime


@pytest.fixture(scope="module")
def step():
    forward = mlp()
    return forward, build_train_step(forward, loss="cross_entropy", optimizer="momentum", lr=0.1)


def _batches(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [{"x": rng.standard_normal(X.shape).astype(np.float32), "labels": CLASSES} for _ in range(count)]


def test_loss_behaves_as_a_float_once_read():
    reads = []

    def read():
        reads.append(1)
        return 2.5

    loss = Loss(3, read=read)
    assert not loss.ready and repr(loss) == "Loss(<queued>, step=3)"
    assert float(loss) == 2.5 and loss.ready and repr(loss) == "Loss(2.5, step=3)"
    assert (loss + 1, 1 + loss, loss * 2, loss / 5, 5 - loss, -loss, loss ** 2) == (3.5, 3.5, 5.0, 0.5, 2.5, -2.5, 6.25)
    assert loss > 2 and loss <= 2.5 and loss == 2.5 and loss != Loss(0, value=1.0) and loss == Loss(0, value=2.5)
    assert f"{loss:.3f}" == "2.500" and str(loss) == "2.5" and round(loss) == 2 and int(loss) == 2
    assert math.isfinite(loss) and np.isfinite(loss) and np.asarray(loss).dtype == np.float64
    assert np.array([loss, Loss(4, value=1.0)]).tolist() == [2.5, 1.0]
    assert sum([loss, Loss(4, value=1.0)]) == 3.5 and np.mean([loss, Loss(4, value=1.5)]) == 2.0
    assert reads == [1]  # read once, kept
    with pytest.raises(TypeError):
        range(10)[loss]
    with pytest.raises(ValueError, match="exactly one"):
        Loss(1)


def test_cpu_steps_are_not_queued_and_return_their_loss(step):
    forward, model = step
    trainer = Trainer(model, weights=initial_weights(forward, model))
    loss = trainer.step(_batches(1)[0])
    assert isinstance(loss, Loss) and loss.ready and loss.step == 1 and not trainer.queued
    with pytest.raises(ConfigError, match="queued steps need provider 'cuda', not 'cpu'"):
        Trainer(model, queued=True)


@pytest.mark.parametrize("graph_path", [False, True])
def test_queued_steps_compute_the_waited_steps_and_wait_only_when_read(step, forced, graph_path):
    """Five steps on fixed buffers: no wait while stepping; the losses (read after the last step,
    one wait for all) and the weights equal a Trainer's that waits for each step; a batch array
    changed after its step returns does not change that step (it was copied)."""
    forward, model = step
    batches = _batches(5)
    waited = Trainer(model, weights=initial_weights(forward, model), queued=False)
    expected = [float(waited.step({k: v.copy() for k, v in b.items()})) for b in batches]
    queued = Trainer(model, weights=initial_weights(forward, model))
    queued.cuda_graph = graph_path  # the path; CUDA graphs themselves need a GPU session
    assert queued.queued
    losses = []
    for batch in batches:
        losses.append(queued.step(batch))
        batch["x"][:] = np.nan  # the caller reuses its array at once
    assert forced.syncs() == 0 and not any(loss.ready for loss in losses), forced.calls
    assert [loss.step for loss in losses] == [1, 2, 3, 4, 5]
    assert float(losses[2]) == pytest.approx(expected[2], rel=1e-6) and forced.syncs() == 1
    # that one wait covered every step queued before it: the other losses read without another
    assert [float(loss) for loss in losses] == pytest.approx(expected, rel=1e-6) and forced.syncs() == 1
    state = queued.state_dict()
    assert forced.syncs() == 2  # the state is read after the queued steps
    for name, value in waited.state_dict().items():
        np.testing.assert_allclose(state[name], value, rtol=1e-6)


def test_a_loss_still_held_is_read_before_its_slot_is_reused(step, forced):
    """Eight slots, ten steps, every loss kept: the first two are read when the ninth and tenth
    steps take their slots (one wait: it makes every loss queued so far readable); all ten keep
    their own values."""
    forward, model = step
    batches = _batches(10)
    waited = Trainer(model, weights=initial_weights(forward, model), queued=False)
    expected = [float(waited.step(b)) for b in batches]
    queued = Trainer(model, weights=initial_weights(forward, model))
    losses = [queued.step(b) for b in batches]
    assert [loss.ready for loss in losses] == [True] * 2 + [False] * 8 and forced.syncs() == 1
    assert [float(loss) for loss in losses] == pytest.approx(expected, rel=1e-6)


def test_a_loss_dropped_unread_frees_its_slot_without_a_wait(step, forced):
    forward, model = step
    queued = Trainer(model, weights=initial_weights(forward, model))
    for batch in _batches(20):
        queued.step(batch)  # the loss is not kept
    assert forced.syncs() == 0


def test_checkpoints_and_evaluation_wait_for_the_queued_steps(step, forced, tmp_path):
    forward, model = step
    queued = Trainer(model, weights=initial_weights(forward, model))
    for batch in _batches(3):
        queued.step(batch)
    queued.save_checkpoint(tmp_path / "ckpt.npz")
    assert forced.syncs() == 1
    queued.evaluate({"x": X})
    assert forced.syncs() == 2
    resumed = Trainer(model, weights=initial_weights(forward, model), queued=False)
    resumed.load_checkpoint(tmp_path / "ckpt.npz")  # written on the stream, then waited for
    for name, value in queued.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value)


def test_train_reads_the_losses_every_n_steps_and_logs_every_step(tmp_path, capsys):
    forward, step, data, log = (tmp_path / n for n in ("fwd.onnx", "step.onnx", "data.npz", "log.jsonl"))
    import onnx

    onnx.save(mlp(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--loss", "cross_entropy"]) == 0
    np.savez(data, x=X, labels=CLASSES)
    capsys.readouterr()
    assert main(["train", str(step), "--data", str(data), "--steps", "7", "--log-every", "3", "--log", str(log)]) == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in progress] == ["step 3/7", "step 6/7", "step 7/7"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 8)) and all(math.isfinite(line["loss"]) for line in lines)
    assert main(["train", str(step), "--data", str(data), "--log-every", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "onnxcampo: error: --log-every must be positive"


def test_a_session_refused_on_the_own_stream_falls_back_to_waited_steps(step, forced, monkeypatch, caplog):
    """queued=None: ONNX Runtime refusing the session on the Trainer's stream leaves the steps
    waited for (one warning); queued=True: the error stands."""
    import logging

    from onnxcampo.errors import ModelLoadError

    forward, model = step
    real = trainer_module._session

    def refusing(model, provider, graph, auto, queue=None):
        if queue is not None:
            raise ModelLoadError("ONNX Runtime could not load the model: user_compute_stream refused")
        return real(model, provider, graph, auto)

    monkeypatch.setattr(trainer_module, "_session", refusing)
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.trainer"):
        trainer = Trainer(model, weights=initial_weights(forward, model))
    assert not trainer.queued and "refused a session on the Trainer's own stream" in caplog.text
    assert trainer.step(_batches(1)[0]).ready
    with pytest.raises(ModelLoadError, match="user_compute_stream refused"):  # the fixture queues it anyway
        Trainer(model, weights=initial_weights(forward, model), queued=True)


def test_the_pinned_slots_go_with_the_queue_and_a_refusing_runtime_raises_nothing():
    import gc

    from onnxcampo.training.queue import StepQueue

    runtime = FakeRuntime()
    queue = StepQueue(runtime, device="cpu", slots=4)
    del queue
    gc.collect()
    assert [call[0] for call in runtime.calls] == ["free"]

    class Refusing(FakeRuntime):
        def host_free(self, pointer: int) -> None:
            raise RuntimeError("cudaErrorCudartUnloading")

    queue = StepQueue(Refusing(), device="cpu", slots=4)
    del queue
    gc.collect()  # nothing raised, nothing printed by the finalizer


def test_evaluate_keeps_its_session_between_calls(step):
    """The evaluation session is made once per kind (with or without labels) and reused."""
    forward, model = step
    trainer = Trainer(model, weights=initial_weights(forward, model))
    trainer.evaluate({"x": X})
    session = trainer._eval[False][0]
    trainer.step(_batches(1)[0])
    trainer.evaluate({"x": X})
    assert trainer._eval[False][0] is session


def test_a_trainer_waits_for_its_queued_steps_before_its_sessions_go(step, forced):
    """ORT returns a run's pinned staging buffers from a callback on the stream; a session (and
    with it that allocator) dropped while its steps are queued would leave the callback to free
    the pinned memory, which CUDA forbids there (the process aborts). So the queue is drained
    before a Trainer's sessions go: when it is collected, and when it leaves CUDA graphs."""
    import gc

    forward, model = step
    trainer = Trainer(model, weights=initial_weights(forward, model))
    trainer.step(_batches(1)[0])
    forced.calls.clear()
    session = trainer.session
    trainer._leave_graphs(RuntimeError("replay failed"))
    assert forced.syncs() == 1 and trainer.session is not session
    forced.calls.clear()
    trainer.step(_batches(1)[0])
    del trainer, session
    gc.collect()
    assert forced.syncs() == 1


def test_on_cuda_only_steps_replayed_as_cuda_graphs_queue(monkeypatch):
    """ORT's CUDA provider on a caller's stream frees a node-by-node run's pinned staging memory
    from a stream callback once the session is gone (the process aborts): such steps are waited
    for, their sessions (and evaluation's) on ORT's own stream; a CUDA-graph session runs on the
    queue's stream."""
    made = []
    monkeypatch.setattr(trainer_module, "make_session", lambda model, **kw: made.append(kw.get("cuda_options")))
    queue = StepQueue(FakeRuntime(), device="cpu", slots=4)
    trainer_module._make(None, "cuda", queue, cuda_graph=False)
    trainer_module._make(None, "cuda", queue, cuda_graph=True)
    trainer_module._make(None, "cuda", None, cuda_graph=True)
    assert made == [None, {"user_compute_stream": str(queue.stream)}, None]
    assert trainer_module.make_queue("cuda", None, cuda_graph=False) is None
    assert trainer_module.make_queue("cuda", False, cuda_graph=True) is None
    with pytest.raises(ConfigError, match="CUDA graphs"):
        trainer_module.make_queue("cuda", True, cuda_graph=False)
