"""The Trainer on CUDA (tests/gpu/conftest.py: skipped without a GPU).

1. Batches and CUDA graphs: one step graph (``wide_mlp`` 256x512 -> 64, mse, AdamW; the update
   in standard ops and as the library's fused op) trained 20 steps from the same weights on the
   same batches by one Trainer per variant: numpy batches with cuda_graph False (the reference),
   True and None (the default, which must pick True); OrtValue batches in CUDA memory; torch CUDA
   tensors, tensors written on a side stream just before each step after a ~1 ms stall (the
   Trainer must wait for that stream), tensors seen through DLPack alone; CuPy arrays (torch and
   CuPy variants skip without them); torch tensors overwritten with NaN on torch's stream right
   after each step returns (the queued step must have read them first). The reference waits for
   each step (``queued=False``); the CUDA-graph variants queue their steps (the default on CUDA)
   unless named "waited", the node-by-node ones are waited for (onnxcampo.training.trainer), and
   their losses are read after the last step. Every variant's losses within 1e-4 of
   the reference's, steps replayed as asked, device batches read without a host copy; the step
   times are recorded.
   Wrong device batches (float64, transposed, requiring grad) are one-line ConfigErrors. Trainers
   dropped while in use and at exit leave the process to end normally.
2. Training features (tests/cases/training.py): BatchNorm and Dropout in training mode,
   evaluate, checkpoints and resume, a learning-rate schedule, partial batches, for the fp32 step
   graph and the campo and fp16 plans; on CUDA every check passes, and every loss and the final
   running statistics are within 2 % of the CPU run's (relative to the first loss; TF32 on CUDA).
3. The test MLP's fp32, campo and amp step graphs trained 50 steps on CUDA and on the CPU: the
   losses finite and falling; the largest gap of each curve to fp32 on the CPU is recorded.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import onnxruntime as ort
import pytest

from cases import training as cases
from helpers import DLPackOnly
from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import CLASSES, X, mlp, wide_mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training.batches import DeviceArray, batch_value
from onnxcampo.training.trainer import CAPTURE_STEPS

STEPS = 20
RTOL = 1e-4
UPDATES = {"standard-ops": False, "fused-ops": None}  # build_train_step's fused


@pytest.fixture(scope="module", params=list(UPDATES))
def wide(request):
    """(step graph, weights, batches, the reference run's losses and state)."""
    forward = wide_mlp()
    step = build_train_step(forward, loss="mse", optimizer="adamw", lr=1e-3, fused=UPDATES[request.param])
    weights = initial_weights(forward, step)
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((256, 512)).astype(np.float32),
             "labels": rng.standard_normal((256, 64)).astype(np.float32)} for _ in range(STEPS)]
    return step, weights, data


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


def _converters(device, kind: str):
    """(convert a numpy batch once, before the clock; make it again just before each step)."""
    if kind == "numpy":
        return (lambda b: b), None
    if kind == "ortvalue":
        return (lambda b: {k: ort.OrtValue.ortvalue_from_numpy(v, device.name, 0) for k, v in b.items()}), None
    if kind == "cupy":
        cupy = pytest.importorskip("cupy")
        return (lambda b: {k: cupy.asarray(v) for k, v in b.items()}), None
    torch = _torch()

    def to_torch(b):
        return {k: torch.from_numpy(v).cuda() for k, v in b.items()}

    if kind == "dlpack":
        return (lambda b: {k: DLPackOnly(v) for k, v in to_torch(b).items()}), None
    if kind in ("torch", "torch-overwritten"):
        return to_torch, None
    stream = torch.cuda.Stream()

    def on_side_stream(b):  # written on a side stream after a ~1 ms stall, not waited for here
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(2_000_000)
            return {k: (v * 2.0) * 0.5 for k, v in b.items()}

    return to_torch, on_side_stream


def _train(device, wide, cuda_graph, kind, queued=None):
    step, weights, data = wide
    convert, again = _converters(device, kind)
    trainer = Trainer(step, weights={k: v.copy() for k, v in weights.items()}, provider=device.name,
                      cuda_graph=cuda_graph if device.cuda else False, queued=queued if device.cuda else False)
    prepared = [convert(batch) for batch in data]  # on the device before the clock starts
    how = {name: type(batch_value(trainer.inputs[name], value)).__name__ for name, value in prepared[0].items()}
    losses, times = [], []
    for batch in prepared:
        if again is not None:
            batch = again(batch)
        start = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(1e3 * (time.perf_counter() - start))
        if kind == "torch-overwritten":  # on torch's stream: after the step's reads, or the step sees NaN
            for value in batch.values():
                value.fill_(float("nan"))
    return trainer, np.array([float(loss) for loss in losses]), times, how


@pytest.fixture(scope="module")
def reference(device, wide):
    trainer, losses, _, _ = _train(device, wide, False, "numpy", queued=False)
    return losses, trainer.state_dict()


VARIANTS = {"numpy/plain": ("numpy", False), "numpy/graph": ("numpy", True), "numpy/default": ("numpy", None),
            "ortvalue/plain": ("ortvalue", False), "ortvalue/graph": ("ortvalue", True),
            "torch/plain": ("torch", False), "torch/graph": ("torch", True),
            "torch-side-stream/plain": ("torch-side-stream", False), "torch-side-stream/graph": ("torch-side-stream", True),
            "dlpack/plain": ("dlpack", False), "dlpack/graph": ("dlpack", True),
            "cupy/plain": ("cupy", False), "cupy/graph": ("cupy", True),
            "torch-overwritten/plain": ("torch-overwritten", False), "torch-overwritten/graph": ("torch-overwritten", True),
            "numpy/graph/waited": ("numpy", True, False), "torch/graph/waited": ("torch", True, False)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_batch_kind_and_graph_mode_trains_as_the_reference(device, wide, reference, results, variant):
    kind, cuda_graph, queued = (*VARIANTS[variant], None)[:3]
    if kind not in ("numpy", "ortvalue") and not device.cuda:
        pytest.skip(f"{kind} batches need CUDA memory")
    trainer, losses, times, how = _train(device, wide, cuda_graph, kind, queued)
    state = trainer.state_dict()
    gap = np.abs(losses - reference[0])
    settled = times[CAPTURE_STEPS:] or times
    results.record(asked=cuda_graph, cuda_graph=trainer.cuda_graph, queued=trainer.queued, read_as=how,
                   losses=losses.tolist(),
                   ms_per_step=[round(t, 4) for t in times], median_ms=statistics.median(settled),
                   max_rel_loss_diff=float((gap / np.abs(reference[0])).max()),
                   max_abs_weight_diff=max(float(np.abs(state[k] - reference[1][k]).max()) for k in state))
    assert np.isfinite(losses).all() and float((gap / np.abs(reference[0])).max()) <= RTOL
    wanted = (cuda_graph if cuda_graph is not None else True) and device.cuda  # static shapes on CUDA: graphs
    assert trainer.cuda_graph == wanted
    assert trainer.queued == (device.cuda and queued is not False and trainer.cuda_graph)  # node by node: waited
    if kind != "numpy":
        assert all(v != "ndarray" for v in how.values()), how


_LIFETIMES = """
import gc, sys
import numpy as np
from onnxcampo.examples.training_mlp import wide_mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
device = sys.argv[1]
forward = wide_mlp()
step = build_train_step(forward, loss="mse", optimizer="adamw", lr=1e-3, fused=False)
weights = initial_weights(forward, step)
batch = {"x": np.ones((256, 512), np.float32), "labels": np.zeros((256, 64), np.float32)}
kept = []
for graph in (False, True, False, True):
    trainer = Trainer(step, weights=weights, provider=device, cuda_graph=graph and device == "cuda")
    losses = [trainer.step(batch) for _ in range(5)]
    trainer.evaluate(batch)
    if graph:
        kept.append(trainer)  # goes at exit, its last steps unread
    else:
        float(losses[-1])
        del trainer, losses
        gc.collect()
print("done", flush=True)
"""


def test_trainers_and_their_sessions_go_without_aborting_the_process(device):
    """Trainers dropped while in use and at exit, node by node and as CUDA graphs, evaluation
    sessions included, in a process of their own: it ends normally. (ONNX Runtime's CUDA provider
    on a caller's stream frees a node-by-node run's pinned staging memory from a stream callback
    once the session is gone, which aborts the process: such steps are not run on the Trainer's
    stream, onnxcampo.training.trainer.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-P", "-c", _LIFETIMES, device.name], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "done" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_wrong_device_batches_are_one_line_config_errors(device, wide):
    torch = _torch()
    step, weights, data = wide
    trainer = Trainer(step, weights=weights, provider="cuda")
    good = {k: torch.from_numpy(v).cuda() for k, v in data[0].items()}
    assert all(isinstance(batch_value(trainer.inputs[k], v), DeviceArray) for k, v in good.items())
    bad = {"float64": {**good, "x": good["x"].double()},
           "transposed": {**good, "x": torch.zeros(512, 256, device="cuda").t()},
           "requires_grad": {**good, "x": good["x"].clone().requires_grad_()}}
    for case, batch in bad.items():
        with pytest.raises(ConfigError) as caught:
            trainer.step(batch)
        assert "\n" not in str(caught.value), case


@pytest.fixture(scope="module")
def plans():
    return cases.step_graphs()


@pytest.mark.slow
@pytest.mark.parametrize("plan", cases.PLANS)
def test_the_training_checks_pass_and_follow_the_cpu(device, plans, results, tmp_path, plan):
    rtol = 0.02
    here = cases.run_checks(plans[plan], device.name, tmp_path, rtol=rtol)
    cpu = cases.run_checks(plans[plan], "cpu", tmp_path)
    scale = abs(cpu["losses"][0]) or 1.0
    loss_gap = max(abs(a - b) for a, b in zip(cpu["losses"], here["losses"])) / scale
    statistics_gap = max(cases.relative(np.array(here["running"][k]), np.array(cpu["running"][k])) for k in cpu["running"])
    results.record(**{device.name: here, "cpu": cpu, "loss_rel_diff": loss_gap, "statistics_rel_diff": statistics_gap})
    assert not cases.failed(here), cases.failed(here)
    assert loss_gap <= rtol and statistics_gap <= rtol, (loss_gap, statistics_gap)


@pytest.mark.slow
def test_the_test_mlp_trains_on_the_device_as_on_the_cpu(device, results):
    import onnxcampo

    forward = mlp()
    step = build_train_step(forward, loss="cross_entropy", optimizer="adamw", lr=0.01)
    variants = {"fp32": step, "campo": onnxcampo.optimize(step, policy="campo").model,
                "amp": onnxcampo.optimize(step, policy="amp").model}
    curves = {}
    for name, model in variants.items():
        for provider in ("cpu", device.name):
            trainer = Trainer(model, weights=initial_weights(forward, step), provider=provider)
            curves[f"{name}/{provider}"] = np.array([trainer.step({"x": X, "labels": CLASSES}) for _ in range(50)])
    reference = curves["fp32/cpu"]
    gaps = {key: float(np.max(np.abs(losses - reference) / reference)) for key, losses in curves.items()}
    results.record(losses={key: losses.tolist() for key, losses in curves.items()}, rel_gap_to_fp32_cpu=gaps)
    for key, losses in curves.items():
        assert np.isfinite(losses).all() and losses[-1] < losses[0], key
