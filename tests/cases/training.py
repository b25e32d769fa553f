"""A small CNN with BatchNorm and Dropout in training mode and the checks its training must pass
on a provider: the loss falls, the running statistics move, ``evaluate`` changes no state, a
resumed run continues the uninterrupted one, a partial batch is one clear error or skipped.
``tests/training/test_training_checks.py`` runs them on the CPU, ``tests/gpu/test_trainer_cuda.py``
on CUDA against the CPU.

The model: Conv 3x3 (no bias) -> BatchNormalization -> Relu -> Dropout(0.25) -> global average
pool -> Gemm -> 10 logits, exported in eval mode and built with ``build_train_step(train_mode=True)``
(batch statistics, running statistics as state, a seeded dropout mask), cross-entropy, AdamW, a
cosine schedule with linear warm-up set through ``trainer.lr``; three step graphs: fp32 as
built, campo's plan and the all-fp16 plan (fp16 compute, dynamic loss scaling, the running
statistics kept fp32 state).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

N, CIN, H, W, C, CLASSES = 16, 3, 16, 16, 8, 10
LR = 1e-2
PLANS = ("fp32", "campo", "fp16", "campo-bnsums")


def cnn() -> onnx.ModelProto:
    """x [N, 3, 16, 16] -> Conv 3x3 (8, no bias, as a Conv before a BatchNorm is: the batch mean
    removes a bias, so its gradient is rounding noise, which AdamW's normalised step turns into
    updates of lr a step in a direction the summation order decides; the running mean, which adds
    the bias back, would then differ between CPU, CUDA and a resumed CUDA run) ->
    BatchNormalization -> Relu -> Dropout(0.25) -> GlobalAveragePool -> Flatten -> Gemm -> logits
    [N, 10]; BatchNorm and Dropout in eval mode."""
    rng = np.random.default_rng(0)
    inits = {
        "conv.w": (rng.standard_normal((C, CIN, 3, 3)) * math.sqrt(2 / (CIN * 9))).astype(np.float32),
        "bn.weight": np.ones(C, np.float32), "bn.bias": np.zeros(C, np.float32),
        "bn.running_mean": np.zeros(C, np.float32), "bn.running_var": np.ones(C, np.float32),
        "fc.w": (rng.standard_normal((CLASSES, C)) * math.sqrt(1 / C)).astype(np.float32),
        "fc.b": np.zeros(CLASSES, np.float32),
        "ratio": np.array(0.25, np.float32),
    }
    graph_nodes = [
        helper.make_node("Conv", ["x", "conv.w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["b"], name="bn", epsilon=1e-5, momentum=0.9),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r", "ratio"], ["d"], name="dropout"),
        helper.make_node("GlobalAveragePool", ["d"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(graph_nodes, "cnn_bn_dropout",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, CIN, H, W])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [N, CLASSES])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def batches(count: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """A learnable task: the label is the channel-and-quadrant pattern with the largest mean."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        labels = rng.integers(0, CLASSES, N)
        x = rng.standard_normal((N, CIN, H, W)).astype(np.float32) * 0.5
        for k, label in enumerate(labels):
            channel, quadrant = label % CIN, label // CIN
            rows, cols = (slice(0, 8), slice(8, 16))[quadrant % 2], (slice(0, 8), slice(8, 16))[(quadrant // 2) % 2]
            x[k, channel, rows, cols] += 2.5
        out.append({"x": x, "labels": labels.astype(np.int64)})
    return out


def step_graphs(lr: float = LR) -> dict[str, onnx.ModelProto]:
    """The fp32 step graph, campo's plan of it, the all-fp16 plan, and campo with the fusions and the
    BatchNorm sums in one pass (``batchnorm_sums``: the library's BatchNormStats and BatchNormGradSums)."""
    from onnxcampo import optimize
    from onnxcampo.training import build_train_step

    step = build_train_step(cnn(), loss="cross_entropy", optimizer="adamw", lr=lr, train_mode=True)
    bnsums = optimize(step, policy="campo", fuse_reductions=True, fuse_elementwise=True,
                      experimental={"batchnorm_sums": True}).model
    assert {"BatchNormStats", "BatchNormGradSums"} <= {n.op_type for n in bnsums.graph.node}
    return {"fp32": step, "campo": optimize(step, policy="campo").model, "fp16": optimize(step, policy="fp16").model,
            "campo-bnsums": bnsums}


def train(step: onnx.ModelProto, provider: str, data, steps: int, lr: float = LR, *,
          checkpoint: tuple[int, Path] | None = None, resume_from: Path | None = None, start: int = 0):
    """Steps start .. steps - 1 of one run (from a checkpoint when given): losses, lrs, the
    Trainer, the seconds per step after the first."""
    from onnxcampo.training import Trainer
    from onnxcampo.training.schedules import parse_schedule

    trainer = Trainer(step, provider=provider, seed=0)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    schedule = parse_schedule(f"warmup:{max(1, steps // 10)},cosine:{steps}", lr)
    losses, lrs, times = [], [], []
    for k in range(start, steps):
        trainer.lr = schedule(k)
        began = time.perf_counter()
        loss = trainer.step(data[k % len(data)])
        times.append(time.perf_counter() - began)
        losses.append(float(loss) if loss is not None else float("nan"))
        lrs.append(trainer.lr)
        if checkpoint is not None and k + 1 == checkpoint[0]:
            trainer.save_checkpoint(checkpoint[1])
    return losses, lrs, trainer, times[1:]


def relative(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference relative to the largest value of ``want``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12)) if want.size else 0.0


def run_checks(step: onnx.ModelProto, provider: str, folder: Path, *, steps: int = 40, lr: float = LR,
               rtol: float = 0.02) -> dict:
    """Train ``step`` for ``steps`` steps on ``provider`` and check it; ``{"checks": {name: {"ok",
    ...figures}}, "losses", "lrs", "resumed_losses", "step_ms", "evaluate", "running"}``. A resumed
    run must equal the uninterrupted one bit for bit on the CPU, on CUDA within ``rtol`` of its
    weights (cuDNN may pick non-deterministic algorithms)."""
    from onnxcampo.errors import ConfigError
    from onnxcampo.training import Trainer
    from onnxcampo.training.train_mode import running_stats

    data, held_out = batches(8), batches(1, seed=99)[0]
    checks: dict[str, dict] = {}
    half = steps // 2
    saved = folder / f"{provider}-{half}.npz"
    losses, lrs, trainer, times = train(step, provider, data, steps, lr, checkpoint=(half, saved))
    quarter = max(1, len(losses) // 4)
    first, last = float(np.mean(losses[:quarter])), float(np.mean(losses[-quarter:]))
    checks["the loss falls and stays finite"] = {"ok": all(map(math.isfinite, losses)) and last < first,
                                                 "first": first, "last": last}

    state = trainer.state_dict()
    running = running_stats(trainer.model)
    initial = {t.name: numpy_helper.to_array(t) for t in cnn().graph.initializer}
    moved = all(not np.allclose(state[name], initial[source]) for name, source in running.items() if source in initial)
    checks["the running statistics moved"] = {"ok": bool(running) and moved, "statistics": len(running)}

    before = {k: v.copy() for k, v in state.items()}
    evaluated = trainer.evaluate(held_out)
    unchanged = all(np.array_equal(before[k], v) for k, v in trainer.state_dict().items())
    logits = evaluated.get("logits")
    accuracy = float(np.mean(np.argmax(logits, axis=1) == held_out["labels"])) if logits is not None else float("nan")
    checks["evaluate gives finite logits and the loss, and changes no state"] = {
        "ok": logits is not None and bool(np.isfinite(logits).all()) and math.isfinite(float(evaluated["loss"]))
        and unchanged, "loss": float(evaluated["loss"]), "accuracy": accuracy}

    resumed_losses, _, resumed, _ = train(step, provider, data, steps, lr, resume_from=saved, start=half)
    resumed_state = resumed.state_dict()
    if provider == "cpu":
        same = all(np.array_equal(state[k], resumed_state[k]) for k in state) and resumed_losses == losses[half:]
        checks[f"a run resumed from the step-{half} checkpoint equals the uninterrupted one"] = {"ok": same}
    else:
        worst = max(relative(resumed_state[k], state[k]) for k in state)
        checks[f"a run resumed from the step-{half} checkpoint equals the uninterrupted one"] = {
            "ok": worst <= rtol, "max_rel_diff": worst}

    partial = {"x": data[0]["x"][: N - 3], "labels": data[0]["labels"][: N - 3]}
    try:
        trainer.step(partial)
        refused, message = False, "the partial batch was taken"
    except ConfigError as exc:
        refused, message = str(N - 3) in str(exc) and str(N) in str(exc) and "\n" not in str(exc), str(exc)
    dropping = Trainer(step, provider=provider, partial_batch="drop")
    skipped = dropping.step(partial) is None and dropping.dropped == 1
    checks["a partial batch is one clear error, or skipped with partial_batch='drop'"] = {
        "ok": refused and skipped, "message": message[:160]}
    return {"checks": checks, "losses": losses, "lrs": lrs, "resumed_losses": resumed_losses,
            "step_ms": 1e3 * float(np.median(times)), "evaluate": {"loss": float(evaluated["loss"]), "accuracy": accuracy},
            "running": {name: state[name].tolist() for name in running}}


def failed(report: dict) -> dict:
    """The checks of a :func:`run_checks` report that failed, with their figures."""
    return {name: check for name, check in report["checks"].items() if not check["ok"]}
