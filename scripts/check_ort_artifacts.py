"""Check that ONNX Runtime training artifacts optimized by onnxcampo still train.

For each fixture in ``tests/fixtures/ort_artifacts`` (built by ``scripts/make_ort_artifacts.py``)
and each policy, the training model is optimized with the onnxcampo command line, loaded with
``onnxruntime.training.api`` next to the fixture's own checkpoint, eval and optimizer models, and
trained for ``--steps`` AdamW steps on fixed, seeded synthetic data. The loss curve is compared
with the one of the unoptimized training model: every loss finite, the loss going down, the final
loss within ``--tolerance`` (relative) of the original's. The original eval model then scores the
trained weights on held-out data, which shows that the optimized graph updated the checkpoint's
parameters and not a copy.

Runs in the training venv (docs/benchmarks/training/ort-artifacts.md), calling onnxcampo from the
project venv (onnxcampo itself needs a newer onnx than the training build accepts)::

    /work/ortt-venv/bin/python scripts/check_ort_artifacts.py --onnxcampo .venv/bin/onnxcampo

Prints a table, writes ``docs/benchmarks/training/ort-artifacts.md`` and ``ort-artifacts.json``
next to it (``--out``), and exits 1 if any check fails.

onnxcampo is not installed in that venv (the script calls onnxcampo's command line in the project
venv); the one inference session it needs (:func:`fp16_nodes_at_run_time`) comes from
``onnxcampo/runtime/placed.py``, which imports nothing of onnxcampo and is loaded by its path.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from onnxruntime.training.api import CheckpointState, Module, Optimizer

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "ort_artifacts"
POLICIES = ("fp32", "amp", "campo", "fp16")
INPUT_SHAPES = {"mlp": (64,), "cnn": (3, 8, 8)}  # without the batch dim
CLASSES = 10
SEED = 0
TRAIN_BATCHES, HELD_OUT_BATCHES = 8, 4


def dataset(name: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and labels of a fixed random linear teacher: a task the models can learn."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((count, *INPUT_SHAPES[name])).astype(np.float32)
    teacher = rng.standard_normal((int(np.prod(INPUT_SHAPES[name])), CLASSES)).astype(np.float32)
    labels = np.argmax(x.reshape(count, -1) @ teacher, axis=1).astype(np.int64)
    return x, labels


def optimize(onnxcampo: str, source: Path, target: Path, policy: str, batch: int) -> dict:
    report = target.with_suffix(".report.json")
    command = [onnxcampo, "optimize", str(source), str(target), "--policy", policy,
               "--dim", f"batch={batch}", "--report", str(report)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    data = json.loads(report.read_text())
    return {"nodes_fp16": data["nodes_fp16"], "casts": data["casts_inserted"], "chosen_plan": data["chosen_plan"]}


def _placed_module():
    """``onnxcampo/runtime/placed.py`` by its path (the package is not installed in this venv)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "onnxcampo" / "runtime" / "placed.py"
    spec = importlib.util.spec_from_file_location("onnxcampo_placed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fp16_nodes_at_run_time(training_model: Path, work: Path) -> int:
    """Nodes (other than Cast) still touching an fp16 tensor once ONNX Runtime's CPU has placed
    the training graph (graph optimizations off: what remains are the transformations every
    session makes). On the CPU most fp16 nodes have no fp16 kernel, so this can be far below the
    plan's count."""
    placed = _placed_module()
    return placed.fp16_nodes(placed.placed_graph(training_model, work / "as_placed.onnx"))


def train(folder: Path, training_model: Path, work: Path, steps: int, batch: int) -> dict:
    """``steps`` steps over a fixed training set of TRAIN_BATCHES batches, in order."""
    x, y = dataset(folder.name, (HELD_OUT_BATCHES + TRAIN_BATCHES) * batch)
    held_out_x, held_out_y = x[: HELD_OUT_BATCHES * batch], y[: HELD_OUT_BATCHES * batch]
    x, y = x[HELD_OUT_BATCHES * batch:], y[HELD_OUT_BATCHES * batch:]
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(training_model), state, str(folder / "eval_model.onnx"), device="cpu")
    optimizer = Optimizer(str(folder / "optimizer_model.onnx"), module)
    module.train()
    losses = []
    for step in range(steps):
        first = (step % TRAIN_BATCHES) * batch
        rows = slice(first, first + batch)
        losses.append(float(module(x[rows], y[rows])))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    eval_loss = float(module(held_out_x, held_out_y))
    return {"losses": losses, "eval_loss": eval_loss, "fp16_nodes_run": fp16_nodes_at_run_time(training_model, work)}


def check(name: str, onnxcampo: str, steps: int, batch: int, tolerance: float, work: Path) -> list[dict]:
    folder = FIXTURES / name
    rows = []
    reference = None
    for variant in ("original", *POLICIES):
        target = work / name / variant / "training_model.onnx"
        target.parent.mkdir(parents=True)
        if variant == "original":
            source, plan = folder / "training_model.onnx", {"nodes_fp16": 0, "casts": 0, "chosen_plan": None}
        else:
            plan = optimize(onnxcampo, folder / "training_model.onnx", target, variant, batch)
            source = target
        run = train(folder, source, target.parent, steps, batch)
        losses = run["losses"]
        reference = reference or losses
        final_rel = abs(losses[-1] - reference[-1]) / abs(reference[-1])
        curve_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        problems = []
        if not all(math.isfinite(v) for v in (*losses, run["eval_loss"])):
            problems.append("non-finite loss")
        start, end = np.mean(losses[:TRAIN_BATCHES]), np.mean(losses[-TRAIN_BATCHES:])
        if not end < 0.9 * start:
            problems.append("mean loss of the last epoch not 10 % below the first's")
        if final_rel > tolerance:
            problems.append(f"final loss {final_rel:.2%} off the original's")
        rows.append({
            "model": name, "variant": variant, **plan, "fp16_nodes_run": run["fp16_nodes_run"],
            "first_epoch_loss": float(start), "last_epoch_loss": float(end),
            "first_loss": losses[0], "final_loss": losses[-1], "final_rel_diff": final_rel,
            "max_curve_rel_diff": curve_rel, "eval_loss": run["eval_loss"], "ok": not problems,
            "problems": problems, "losses": losses,
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| model | variant | fp16 nodes (plan) | Casts | fp16 nodes as placed | first-epoch loss | last-epoch loss | final loss | final vs original | max curve diff | eval loss | ok |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['variant']}{'' if r['chosen_plan'] in (None, r['variant']) else ' (' + r['chosen_plan'] + ' plan)'}"
            f" | {r['nodes_fp16']} | {r['casts']} | {r['fp16_nodes_run']} | {r['first_epoch_loss']:.4f}"
            f" | {r['last_epoch_loss']:.4f} | {r['final_loss']:.4f}"
            f" | {r['final_rel_diff']:.2e} | {r['max_curve_rel_diff']:.2e} | {r['eval_loss']:.4f}"
            f" | {'yes' if r['ok'] else 'NO: ' + '; '.join(r['problems'])} |"
        )
    return "\n".join(lines)


def versions(onnxcampo: str) -> dict:
    campo = subprocess.run([onnxcampo, "--version"], capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "python": platform.python_version(), "onnxruntime-training-cpu": onnxruntime.__version__,
        "onnx (training venv)": onnx.__version__, "torch": torch.__version__, "numpy": np.__version__,
        "onnxcampo": f"{campo} (commit {commit})", "machine": f"{platform.machine()}, {platform.system()}",
    }


DOC = """# ONNX Runtime training artifacts as input

`onnxcampo optimize` accepts the `training_model.onnx` written by
`onnxruntime.training.artifacts.generate_artifacts`. The optimized file replaces the original next
to the same `checkpoint`, `eval_model.onnx` and `optimizer_model.onnx`: its inputs and outputs
(parameters, `*_grad.accumulation.buffer`, `lazy_reset_grad`, the loss, the accumulators' flags)
keep their names and dtypes, and its IR version and opsets are the original's.

## What onnxcampo does with a training graph

- **Loading.** ORT writes `MaxPoolGrad` (and, for other models, `AveragePoolGrad`, ...) in the
  default domain although ONNX defines no such op, so `onnx.checker` rejects the graph.
  onnxcampo checks these known ORT training ops (`oplists.ORT_DEFAULT_DOMAIN_OPS`, none of which
  `onnx.defs.has`) like ops of a foreign domain; every other node is checked as usual, and a
  default-domain op that is neither ONNX's nor in that list is still an error.
- **Types and shapes.** Plain ONNX Runtime has no schemas for the training ops (ReluGrad,
  ConvGrad, InPlaceAccumulatorV2, ...), so ONNX inference stops at them. Their outputs are typed by
  binding their float inputs (integer labels, indices and bool flags do not count), and the shapes
  the generator declared after them use the inputs' dim names, which `--dim` / `--input-shape`
  pin there too. Give the batch: `--dim batch=N` for these fixtures.
- **Precision.** Gradient ops follow their forward op's list (`ConvGrad` is an allow-list op,
  `ReluGrad` and `BatchNormalizationGrad` infer-list ops, `SoftmaxCrossEntropyLossGrad` a deny-list
  op). Whatever the policy:
  - `InPlaceAccumulatorV2` and the other ops that update training state in place (accumulators,
    optimizer ops) stay fp32 (`training_state`): ORT aliases their output to the buffer they read,
    so in fp16 they would accumulate into a Cast's copy and leave the real gradient buffer at zero.
    They read the buffer itself; an fp16 gradient reaches them through a Cast back to fp32.
  - `MaxPoolGrad` / `AveragePoolGrad` stay fp32 (`declared_output_shape`): their ORT kernels take
    their output shape from the graph. ORT's CPU has no fp16 kernel for them and runs an fp16 node
    in fp32 on a new, undeclared output tensor; onnxruntime-training-cpu 1.19.2 then crashes
    (segmentation fault) while creating the training session.
  - com.microsoft ops in no list (here `BatchNormInternal`) stay fp32 (`unknown_op`).
  - `--no-keep-io-types` is refused: the checkpoint binds the graph's inputs by name and dtype.

## Results

{table}

Columns: *fp16 nodes (plan)* and *Casts* are onnxcampo's plan; *fp16 nodes as placed* counts the
nodes still touching an fp16 tensor once ONNX Runtime's CPU has placed the training graph (an
inference session with graph optimizations off, saved with `optimized_model_filepath`); the
*epoch* losses are means over the {train_batches} batches of the first and last pass over the
training set; *final vs original* is |final loss - original's| / original's and *max curve diff*
the largest such difference over all {steps} steps; *eval loss* is the original
`eval_model.onnx` scoring the trained weights on {held_out} held-out samples (the training set is
small enough to be memorized, so it stays near chance; what matters is that it is the same for
every variant).

What this shows, and what it does not:
- Every optimized artifact loads in onnxruntime-training-cpu 1.19.2, trains (the loss goes down
  over {steps} AdamW steps at batch {batch}, cycling over {train_batches} fixed batches of seeded
  synthetic data) and follows the original's loss curve (checked: final loss within
  {tolerance:.0%}); the gradient buffers, checkpoint and optimizer work unchanged with it. Had the
  accumulators updated a copy, the gradients would stay zero and nothing would train.
- It does **not** measure fp16 numerics. The CPU build has no fp16 kernels for Gemm, Conv or the
  gradient ops: ORT runs those nodes in fp32 between Casts of its own and then removes
  fp32->fp16->fp32 Cast pairs, so only data movement and the like stays fp16 (*fp16 nodes as
  placed*), and the curves match to about 1e-4. fp16 training numerics (and loss scaling, still to
  come) need a GPU training build, which this machine does not have.
- campo costs these tiny models on the H200 model and finds that no conversion pays, so its plan
  is the fp32 one (the analytic cost model gives the same answer at batch 65536).

## Reproduce

The training build needs its own venv (onnxruntime-training-cpu 1.19.2 is the last release and
imports torch; onnx newer than 1.16 writes IR versions it refuses). The CPU wheel of torch
2.13.0 came from this machine's local wheel folder (pip's find-links); elsewhere take it from
PyTorch's CPU index (`--extra-index-url https://download.pytorch.org/whl/cpu`): a plain
`torch==2.13.0` from PyPI pulls gigabytes of CUDA libraries.

```bash
python -m venv /work/ortt-venv
/work/ortt-venv/bin/pip install 'torch==2.13.0+cpu' onnxruntime-training-cpu==1.19.2 onnx==1.16.2
/work/ortt-venv/bin/python scripts/make_ort_artifacts.py        # rewrites tests/fixtures/ort_artifacts (deterministic)
python -m venv .venv && .venv/bin/pip install -e '.[test]'      # onnxcampo itself
{command}
```

Versions:

{versions}

Raw data (every loss of every run): `ort-artifacts.json`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnxcampo", default=str(ROOT / ".venv" / "bin" / "onnxcampo"),
                        help="the onnxcampo command of the project venv")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative, on the final loss")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "training",
                        help="folder for ort-artifacts.md and ort-artifacts.json")
    parser.add_argument("models", nargs="*", metavar="MODEL", help="mlp and/or cnn (default: both)")
    args = parser.parse_args(argv)
    models = args.models or sorted(INPUT_SHAPES, reverse=True)
    unknown = sorted(set(models) - set(INPUT_SHAPES))
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(INPUT_SHAPES)}")
    if not Path(args.onnxcampo).exists():
        parser.error(f"--onnxcampo {args.onnxcampo}: no such file (create the project venv first)")
    onnxruntime.set_default_logger_severity(3)

    rows = []
    with tempfile.TemporaryDirectory(prefix="ort-artifacts-") as tmp:
        for name in models:
            rows.extend(check(name, args.onnxcampo, args.steps, args.batch, args.tolerance, Path(tmp)))
    text = table(rows)
    print(text)

    command = "/work/ortt-venv/bin/python scripts/check_ort_artifacts.py --onnxcampo .venv/bin/onnxcampo"
    extra = [f"--steps {args.steps}" if args.steps != 50 else "", f"--batch {args.batch}" if args.batch != 16 else ""]
    command = " ".join([command, *filter(None, extra)])
    info = versions(args.onnxcampo)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = {"command": command, "versions": info, "steps": args.steps, "batch": args.batch,
           "tolerance": args.tolerance, "seed": SEED, "results": rows}
    (args.out / "ort-artifacts.json").write_text(json.dumps(raw, indent=1) + "\n")
    (args.out / "ort-artifacts.md").write_text(DOC.format(
        table=text, steps=args.steps, batch=args.batch, held_out=HELD_OUT_BATCHES * args.batch,
        train_batches=TRAIN_BATCHES, tolerance=args.tolerance, command=command,
        versions="\n".join(f"- {k}: {v}" for k, v in info.items()),
    ))
    failed = [f"{r['model']}/{r['variant']}" for r in rows if not r["ok"]]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"all {len(rows)} runs train like the originals; wrote {args.out / 'ort-artifacts.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
