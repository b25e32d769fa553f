"""Check issue 18's training features on a device: BatchNorm and Dropout in training mode,
evaluate, checkpoints and resume, a learning-rate schedule, partial batches, on CUDA against the CPU.

Run on a CUDA machine (onnxruntime-gpu, numpy, this repository installed):

    python3 scripts/check_training_cuda.py --out results.json            # CUDA against the CPU
    python3 scripts/check_training_cuda.py --provider cpu --out r.json   # the CPU alone (CI runs this)

The model: Conv 3x3 (no bias) -> BatchNormalization -> Relu -> Dropout(0.25) -> global average
pool -> Gemm -> 10 logits, exported in eval mode and built with ``build_train_step(train_mode=True)``
(batch statistics, running statistics as state, a seeded dropout mask), cross-entropy, AdamW, a
cosine schedule with linear warm-up set through ``trainer.lr``. Three step graphs: fp32 as built,
campo's plan (``optimize(policy="campo")``: fp16 where it pays) and the all-fp16 plan (fp16
compute, dynamic loss scaling, the running statistics kept fp32 state). For each
step graph and provider it trains --steps steps on fixed synthetic batches and checks:

- the loss falls (mean of the last quarter below the first quarter's) and stays finite;
- ``evaluate`` (running statistics, no dropout) returns finite logits and the loss on a held-out
  batch, and leaves the state as it was;
- a checkpoint saved half-way and loaded into a new Trainer continues the run to the same state:
  bit for bit on the CPU, on CUDA within --rtol of the uninterrupted run's weights (cuDNN may pick
  non-deterministic algorithms);
- the running mean and variance moved from their starting values;
- a partial last batch is one clear ConfigError naming the sizes, and ``partial_batch="drop"``
  skips it;
- on CUDA: every loss within --rtol of the CPU run's (relative to the first loss; TF32 on CUDA) and
  the final running statistics within --rtol.

Prints one line per check and (with --out) writes JSON: the checks, every step's loss and lr per
variant, and the step times. Exit 1 on any failed check, 2 when --provider cuda has no CUDA EP.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

N, CIN, H, W, C, CLASSES = 16, 3, 16, 16, 8, 10


def cnn() -> onnx.ModelProto:
    """x [N, 3, 16, 16] -> Conv 3x3 (8, no bias, as a Conv before a BatchNorm is: the batch mean
    removes a bias, so its gradient is rounding noise, which AdamW's normalised step turns into
    updates of lr a step in a direction the summation order decides; the running mean, which adds
    the bias back, then differs between CPU, CUDA and a resumed CUDA run, found on the H200) ->
    BatchNormalization -> Relu -> Dropout(0.25) ->
    GlobalAveragePool -> Flatten -> Gemm -> logits [N, 10]; BatchNorm and Dropout in eval mode."""
    rng = np.random.default_rng(0)
    inits = {
        "conv.w": (rng.standard_normal((C, CIN, 3, 3)) * math.sqrt(2 / (CIN * 9))).astype(np.float32),
        "bn.weight": np.ones(C, np.float32), "bn.bias": np.zeros(C, np.float32),
        "bn.running_mean": np.zeros(C, np.float32), "bn.running_var": np.ones(C, np.float32),
        "fc.w": (rng.standard_normal((CLASSES, C)) * math.sqrt(1 / C)).astype(np.float32),
        "fc.b": np.zeros(CLASSES, np.float32),
        "ratio": np.array(0.25, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "conv.w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["b"], name="bn", epsilon=1e-5, momentum=0.9),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("Dropout", ["r", "ratio"], ["d"], name="dropout"),
        helper.make_node("GlobalAveragePool", ["d"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(nodes, "cnn_bn_dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, CIN, H, W])],
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


def _schedule(steps: int, lr: float):
    from onnxcampo.training.schedules import parse_schedule

    return parse_schedule(f"warmup:{max(1, steps // 10)},cosine:{steps}", lr)


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, name: str, ok: bool, **details) -> None:
        self.rows.append({"check": name, "ok": bool(ok), **details})
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in details.items())
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + shown if shown else ''}", flush=True)


def train(step: onnx.ModelProto, provider: str, data, steps: int, lr: float, *,
          checkpoint: tuple[int, Path] | None = None,
          resume_from: Path | None = None, start: int = 0):
    """Steps start .. steps - 1 of one run (from a checkpoint when given): losses, lrs, the
    Trainer, the seconds per step after the first."""
    from onnxcampo.training import Trainer

    trainer = Trainer(step, provider=provider, seed=0)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
    schedule = _schedule(steps, lr)
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


_FOLDER = Path(tempfile.mkdtemp(prefix="onnxcampo-check-training-"))  # the checkpoints, removed at exit
atexit.register(shutil.rmtree, _FOLDER, True)




def run_variant(label: str, step: onnx.ModelProto, provider: str, data, held_out, args, checks: Checks) -> dict:
    from onnxcampo.errors import ConfigError
    from onnxcampo.training import Trainer
    from onnxcampo.training.train_mode import running_stats

    half = args.steps // 2
    saved = _FOLDER / f"{label}-{provider}-{half}.npz"
    losses, lrs, trainer, times = train(step, provider, data, args.steps, args.lr, checkpoint=(half, saved))
    tag = f"{label}/{provider}"
    finite = all(math.isfinite(v) for v in losses)
    quarter = max(1, len(losses) // 4)
    first, last = float(np.mean(losses[:quarter])), float(np.mean(losses[-quarter:]))
    checks.add(f"{tag}: the loss falls and stays finite", finite and last < first, first=first, last=last)

    state = trainer.state_dict()
    running = running_stats(trainer.model)
    start = cnn()
    initial = {t.name: numpy_helper.to_array(t) for t in start.graph.initializer}
    moved = all(not np.allclose(state[name], initial[initializer]) for name, initializer in running.items()
                if initializer in initial)
    checks.add(f"{tag}: the running statistics moved", bool(running) and moved, statistics=len(running))

    before = {k: v.copy() for k, v in state.items()}
    evaluated = trainer.evaluate(held_out)
    after = trainer.state_dict()
    unchanged = all(np.array_equal(before[k], after[k]) for k in before)
    logits = evaluated.get("logits")
    accuracy = float(np.mean(np.argmax(logits, axis=1) == held_out["labels"])) if logits is not None else float("nan")
    checks.add(f"{tag}: evaluate gives finite logits and the loss, and changes no state",
               logits is not None and bool(np.isfinite(logits).all()) and math.isfinite(float(evaluated["loss"]))
               and unchanged, loss=float(evaluated["loss"]), accuracy=accuracy)

    resumed_losses, _, resumed, _ = train(step, provider, data, args.steps, args.lr,
                                          resume_from=saved, start=half)
    resumed_state = resumed.state_dict()
    if provider == "cpu":
        same = all(np.array_equal(state[k], resumed_state[k]) for k in state) and resumed_losses == losses[half:]
        checks.add(f"{tag}: a run resumed from the step-{half} checkpoint equals the uninterrupted one bit for bit", same)
    else:
        worst = max(_relative(resumed_state[k], state[k]) for k in state)
        checks.add(f"{tag}: a run resumed from the step-{half} checkpoint matches the uninterrupted one",
                   worst <= args.rtol, max_rel_diff=worst)

    partial = {"x": data[0]["x"][: N - 3], "labels": data[0]["labels"][: N - 3]}
    try:
        trainer.step(partial)
        refused, message = False, "the partial batch was taken"
    except ConfigError as exc:
        refused, message = str(N - 3) in str(exc) and str(N) in str(exc) and "\n" not in str(exc), str(exc)
    dropping = Trainer(step, provider=provider, partial_batch="drop")
    skipped = dropping.step(partial) is None and dropping.dropped == 1
    checks.add(f"{tag}: a partial batch is one clear error, or skipped with partial_batch='drop'",
               refused and skipped, message=message[:160])
    return {"losses": losses, "lrs": lrs, "resumed_losses": resumed_losses, "step_ms": 1e3 * float(np.median(times)),
            "evaluate": {"loss": float(evaluated["loss"]), "accuracy": accuracy},
            "running": {name: state[name].tolist() for name in running}}


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-12)) if want.size else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: the CUDA runs checked against the CPU's (default); cpu: the CPU alone")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW's peak learning rate (default 1e-2)")
    parser.add_argument("--rtol", type=float, default=0.02,
                        help="CUDA against CPU: largest loss difference relative to the first loss, and of the "
                             "weights and statistics relative to their largest value (default 0.02)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args(argv)
    if args.steps < 8:
        parser.error("--steps must be at least 8")
    import onnxruntime as ort

    from onnxcampo import optimize
    from onnxcampo.training import build_train_step

    if hasattr(ort, "preload_dlls") and args.provider == "cuda":
        ort.preload_dlls()
    if args.provider == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
        print("error: --provider cuda needs onnxruntime-gpu with the CUDA execution provider", file=sys.stderr)
        return 2
    checks = Checks()
    data, held_out = batches(8), batches(1, seed=99)[0]
    step = build_train_step(cnn(), loss="cross_entropy", optimizer="adamw", lr=args.lr, train_mode=True)
    steps = {"fp32": step, "campo": optimize(step, policy="campo").model, "fp16": optimize(step, policy="fp16").model}
    providers = ["cpu", "cuda"] if args.provider == "cuda" else ["cpu"]
    report: dict = {"command": " ".join(["python3", "scripts/check_training_cuda.py", *(argv or sys.argv[1:])]),
                    "onnxruntime": ort.__version__, "steps": args.steps, "variants": {}}
    for label, model in steps.items():
        for provider in providers:
            try:
                report["variants"][f"{label}/{provider}"] = run_variant(label, model, provider, data, held_out, args,
                                                                        checks)
            except Exception as exc:  # noqa: BLE001 - one variant's failure is a failed check, the others run
                checks.add(f"{label}/{provider}: trains", False, error=f"{type(exc).__name__}: {exc}"[:300])
                traceback.print_exc(file=sys.stderr)
        cpu, cuda = report["variants"].get(f"{label}/cpu"), report["variants"].get(f"{label}/cuda")
        if cpu and cuda:
            scale = abs(cpu["losses"][0]) or 1.0
            worst = max(abs(a - b) for a, b in zip(cpu["losses"], cuda["losses"])) / scale
            stats = max(_relative(np.array(cuda["running"][k]), np.array(cpu["running"][k])) for k in cpu["running"])
            checks.add(f"{label}: CUDA's losses and running statistics follow the CPU's",
                       worst <= args.rtol and stats <= args.rtol, loss_rel_diff=worst, statistics_rel_diff=stats)
    report["checks"] = checks.rows
    report["failed"] = [row["check"] for row in checks.rows if not row["ok"]]
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"{len(checks.rows) - len(report['failed'])} of {len(checks.rows)} checks passed", file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
