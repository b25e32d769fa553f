"""Accuracy parity of mixed-precision training steps: fp32 vs ``amp`` vs ``campo``.

Every model trains for a fixed number of steps on a small fixed synthetic dataset (a few seeded
batches, cycled, so the loss can go down) with the step graph of each policy: ``fp32`` is the
step graph from ``build_train_step`` as is, ``amp``/``campo`` are that graph through
``onnxcampo.optimize``. The Trainer is a black box: whatever state an optimized graph adds
(a loss scale, counters) it handles through the ``<name>.updated`` convention.

    python -m onnxcampo.benchmarks train-parity                                  # every model, CPU, docs/benchmarks/training/
    python -m onnxcampo.benchmarks train-parity --models mlp,cnn --steps 30
    python -m onnxcampo.benchmarks train-parity --provider cuda --corpus-dir .cache/corpus

Writes ``parity-<provider>.json`` (curves and numbers), ``.png`` (one subplot per model, one
curve per policy) and ``.md`` (the table) into ``--out``. Exit status 1 if any policy diverged or
ended more than ``--tolerance`` (2 %) away from fp32, 0 otherwise.

The "final loss" of a run is its mean loss over the whole passes through the dataset that fit in
the last quarter of the steps (at least one), so it depends neither on which batch the run ends on
nor on one noisy step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.benchmarks import ROOT
import onnxcampo
from onnxcampo.benchmarks import corpus
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step, initial_weights

log = logging.getLogger("train_parity")

POLICIES = ("fp32", "amp", "campo")
TOLERANCE = 0.02
DIVERGENCE_GROWTH = 10.0  # a loss this many times its first value counts as divergence


# ------------------------------------------------------------------------------------------
# Small models built in code (IR 10, opset 17): what CI trains
# ------------------------------------------------------------------------------------------


def _rng_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def mlp(batch: int = 32, features: int = 16, hidden: int = 64, classes: int = 10) -> onnx.ModelProto:
    """x[B,16] -> MatMul/Add/Relu -> MatMul/Add/Relu -> MatMul/Add -> logits[B,10]."""
    rng = np.random.default_rng(1)
    dims = [features, hidden, hidden, classes]
    nodes, inits, x = [], [], "x"
    for i in range(3):
        w, b = f"fc{i}.weight", f"fc{i}.bias"
        inits += [_rng_tensor(rng, w, (dims[i], dims[i + 1]), (2.0 / dims[i]) ** 0.5),
                  numpy_helper.from_array(np.zeros(dims[i + 1], np.float32), b)]
        nodes += [helper.make_node("MatMul", [x, w], [f"fc{i}/mm"]), helper.make_node("Add", [f"fc{i}/mm", b], [f"fc{i}/out"])]
        x = f"fc{i}/out"
        if i < 2:
            nodes.append(helper.make_node("Relu", [x], [f"fc{i}/relu"]))
            x = f"fc{i}/relu"
    nodes.append(helper.make_node("Identity", [x], ["logits"]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def cnn(batch: int = 16, classes: int = 10) -> onnx.ModelProto:
    """x[B,3,16,16] -> Conv3x3(16)+BatchNorm+Relu -> MaxPool -> Conv3x3(32)+BatchNorm+Relu ->
    GlobalAveragePool -> Flatten -> Gemm -> logits[B,10]. BatchNorm runs in inference mode with
    running statistics, which the step graph keeps frozen."""
    rng = np.random.default_rng(2)
    nodes, inits, x, channels = [], [], "x", 3
    for i, out in enumerate((16, 32)):
        p = f"conv{i}"
        inits += [
            _rng_tensor(rng, f"{p}.weight", (out, channels, 3, 3), (2.0 / (9 * channels)) ** 0.5),
            numpy_helper.from_array(np.zeros(out, np.float32), f"{p}.bias"),
            numpy_helper.from_array(np.ones(out, np.float32), f"bn{i}.weight"),
            numpy_helper.from_array(np.zeros(out, np.float32), f"bn{i}.bias"),
            numpy_helper.from_array((rng.standard_normal(out) * 0.1).astype(np.float32), f"bn{i}.running_mean"),
            numpy_helper.from_array((1 + rng.random(out)).astype(np.float32), f"bn{i}.running_var"),
        ]
        nodes += [
            helper.make_node("Conv", [x, f"{p}.weight", f"{p}.bias"], [f"{p}/out"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"{p}/out", f"bn{i}.weight", f"bn{i}.bias",
                                                    f"bn{i}.running_mean", f"bn{i}.running_var"], [f"bn{i}/out"]),
            helper.make_node("Relu", [f"bn{i}/out"], [f"{p}/relu"]),
        ]
        x, channels = f"{p}/relu", out
        if i == 0:
            nodes.append(helper.make_node("MaxPool", [x], ["pool0"], kernel_shape=[2, 2], strides=[2, 2]))
            x = "pool0"
    inits += [_rng_tensor(rng, "fc.weight", (channels, classes), (1.0 / channels) ** 0.5),
              numpy_helper.from_array(np.zeros(classes, np.float32), "fc.bias")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["gap"]), helper.make_node("Flatten", ["gap"], ["flat"]),
              helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def magika_logits(proto: onnx.ModelProto) -> onnx.ModelProto:
    """magika ends in a softmax written out (Exp/ReduceSum/Div); cross-entropy wants the logits
    before it (Dense_1's output)."""
    logits = next(n.output[0] for n in proto.graph.node if n.output[0].endswith("Dense_1/AddV2:0"))
    return corpus.cut_at(proto, logits, ["batch", 214])


def softmax_input(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A model whose first output is a Softmax: the logits it normalizes become the output
    (cross-entropy on probabilities barely trains)."""
    node = next(n for n in proto.graph.node if proto.graph.output[0].name in n.output)
    if node.op_type != "Softmax":
        raise ValueError(f"the first output comes from {node.op_type}, not Softmax")
    rank = len(proto.graph.output[0].type.tensor_type.shape.dim)
    return corpus.cut_at(proto, node.input[0], [f"d{i}" for i in range(rank)])


# ------------------------------------------------------------------------------------------
# Cases
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One model to train: its forward model, loss, optimizer and synthetic data."""

    name: str
    loss: str
    optimizer: str
    lr: float
    corpus_key: str | None = None
    build: Callable[[], onnx.ModelProto] | None = None  # small models built in code
    adapt: Callable[[onnx.ModelProto], onnx.ModelProto] | None = None  # corpus model -> forward
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    teacher_scale: float = 0.5  # labels come from the model with weights perturbed this much
    label_noise: float = 0.3  # cross_entropy: fraction of labels flipped; mse: noise / label std
    batches: int = 4  # even: two label draws per input set
    notes: str = ""


CASES: dict[str, Case] = {c.name: c for c in (
    Case("mlp", "cross_entropy", "momentum", 0.05, build=mlp, notes="3-layer MLP, 10 classes"),
    Case("cnn", "cross_entropy", "adamw", 0.003, build=cnn, notes="2 Conv+BatchNorm (frozen statistics), 10 classes"),
    Case("silero_vad_v6", "mse", "adamw", 3e-4, corpus_key="silero_vad_v6_fw", label_noise=2.0,
         notes="faster-whisper VAD: STFT Conv, LSTM; mse on the speech probabilities"),
    Case("magika", "cross_entropy", "adamw", 3e-4, corpus_key="magika", adapt=magika_logits,
         input_shapes={"bytes": (8, 2048)}, teacher_scale=1.0, notes="file-type classifier, 214 classes, on its logits"),
    Case("ddddocr_rec", "cross_entropy", "adamw", 1e-4, corpus_key="ddddocr_common",
         notes="CNN + biLSTM (lowered to Scan), per-frame cross-entropy over 8210 classes (CTC stand-in)"),
    Case("ddddocr_det", "mse", "adamw", 1e-4, corpus_key="ddddocr_det", batches=2,
         notes="YOLO-style detector 416x416; mse on the raw head output"),
    Case("ppocr_rec", "cross_entropy", "adamw", 1e-4, corpus_key="ppocr_rec", adapt=softmax_input,
         input_shapes={"x": (1, 3, 48, 160)},
         notes="PP-OCRv4 SVTR recognizer, per-frame cross-entropy over 6625 classes on the logits; 14 depthwise Conv weights frozen"),
)}
DEFAULT_MODELS = ("mlp", "cnn", "silero_vad_v6", "magika", "ddddocr_rec", "ddddocr_det", "ppocr_rec")


def forward_model(case: Case) -> onnx.ModelProto:
    if case.build is not None:
        return case.build()
    proto = corpus.load(corpus.get(case.corpus_key))
    return case.adapt(proto) if case.adapt else proto


def pinned_shapes(case: Case) -> dict[str, tuple[int, ...]]:
    if case.corpus_key is None:
        return dict(case.input_shapes)
    return {**corpus.get(case.corpus_key).input_shapes, **case.input_shapes}


def teacher(forward: onnx.ModelProto, *, scale: float, seed: int) -> onnx.ModelProto:
    """The forward model with every trainable weight perturbed by ``scale`` (relative, seeded)."""
    from onnxcampo.training.trainable import select_trainable

    rng = np.random.default_rng(seed)
    model = onnx.ModelProto()
    model.CopyFrom(forward)
    weights = set(select_trainable(model).weights)
    for tensor in model.graph.initializer:
        if tensor.name in weights:
            value = numpy_helper.to_array(tensor)
            noisy = value + scale * value.std() * rng.standard_normal(value.shape)
            tensor.CopyFrom(numpy_helper.from_array(noisy.astype(value.dtype), tensor.name))
    return model


def make_dataset(case: Case, forward: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> list[dict]:
    """``case.batches`` fixed batches: seeded inputs (the corpus entry's value rules) and the labels
    of a teacher (the same model, weights perturbed by ``case.teacher_scale``) plus label noise.

    Every input set appears twice, with independent label noise (batches A, B, A', B'), so the
    loss falls from the student-teacher gap towards a floor that memorizing cannot remove (the
    best prediction is the mean of two disagreeing labels): final losses stay well away from
    zero and their relative differences mean something."""
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in forward.graph.initializer}
    inputs = [i for i in forward.graph.input if i.name not in initializers]
    entry = corpus.get(case.corpus_key) if case.corpus_key else None
    if entry is not None:
        entry = corpus.CorpusModel(**{**entry.__dict__, "input_shapes": shapes})
    batches = []
    for index in range(max(1, case.batches // 2)):
        if entry is not None:
            feeds = corpus.make_inputs(entry, seed=seed * 100 + index, proto=forward)
        else:
            feeds = {}
            for vi in inputs:
                shape = shapes.get(vi.name) or tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
                feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
        batches.append(feeds)
    model = teacher(forward, scale=case.teacher_scale, seed=seed + 1)
    session = make_session(corpus.pin_input_shapes(model, entry) if entry else model)
    output = model.graph.output[0].name
    predictions = [run(session, feeds)[output] for feeds in batches]
    dataset = []
    for _ in range(2):
        for feeds, prediction in zip(batches, predictions):
            if case.loss == "cross_entropy":
                labels = prediction.argmax(-1).astype(np.int64)
                flip = rng.random(labels.shape) < case.label_noise
                labels[flip] = rng.integers(0, prediction.shape[-1], int(flip.sum()))
            else:
                spread = max(float(prediction.std()), 0.1 * float(np.abs(prediction).mean()), 1e-3)
                labels = (prediction + case.label_noise * spread * rng.standard_normal(prediction.shape)).astype(np.float32)
            dataset.append({**feeds, "labels": labels})
    return dataset


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


def train_case(case: Case, *, policies: tuple[str, ...], provider: str, steps: int,
               exclude_ops: frozenset[str] = frozenset()) -> dict:
    """Loss curves and timings of ``case`` under each policy (the parity numbers added later)."""
    started = time.perf_counter()
    forward = forward_model(case)
    shapes = pinned_shapes(case)
    data = make_dataset(case, forward, shapes)
    step = build_train_step(forward, loss=case.loss, optimizer=case.optimizer, lr=case.lr, input_shapes=shapes)
    weights = initial_weights(forward, step)
    result = {"loss": case.loss, "optimizer": case.optimizer, "lr": case.lr, "batches": len(data),
              "weights": len(weights), "parameters": int(sum(w.size for w in weights.values())),
              "step_nodes": len(step.graph.node), "build_s": round(time.perf_counter() - started, 2),
              "notes": case.notes, "policies": {}}
    for policy in policies:
        t0 = time.perf_counter()
        run_info: dict = {}
        if policy == "fp32":
            model = step
        else:
            optimized = onnxcampo.optimize(step, policy=policy, exclude_ops=exclude_ops)
            model = optimized.model
            run_info["nodes_fp16"] = optimized.report.get("nodes_fp16")
            run_info["nodes_fp32"] = optimized.report.get("nodes_fp32")
        run_info["optimize_s"] = round(time.perf_counter() - t0, 2)
        losses, times = [], []
        try:
            trainer = Trainer(model, weights=weights, provider=provider)
            for index in range(steps):
                t0 = time.perf_counter()
                loss = float(trainer.step(data[index % len(data)]))  # each step waited for: its own time
                times.append(time.perf_counter() - t0)
                losses.append(loss)
                if not np.isfinite(loss):
                    break  # diverged; the curve ends here
        except RuntimeError as exc:  # ONNX Runtime refused the graph (a kernel missing for a dtype, ...)
            message = str(exc).splitlines()[0]
            run_info["error"] = message[message.find("Status Message:") + 16:] if "Status Message:" in message else message
            log.error("%s %s: %s", case.name, policy, run_info["error"])
            run_info.update(losses=losses, ms_per_step=float("nan"))
            result["policies"][policy] = run_info
            continue
        scale = getattr(trainer, "loss_scale", None)
        if scale is not None:
            run_info["final_loss_scale"] = scale
        warm = times[2:] or times
        run_info.update(losses=losses, ms_per_step=round(1000 * float(np.median(warm)), 3))
        result["policies"][policy] = run_info
        log.info("%s %s: loss %.5g -> %.5g, %.1f ms/step", case.name, policy, losses[0], losses[-1],
                 run_info["ms_per_step"])
    return result


def assess(result: dict, *, steps: int, tolerance: float) -> None:
    """Add final loss, divergence and the relative difference to fp32 to every policy's entry."""
    window = result["batches"] * max(1, steps // 4 // result["batches"])  # whole passes: every batch equally
    for entry in result["policies"].values():
        losses = np.array(entry["losses"], dtype=np.float64)
        finite = bool(np.isfinite(losses).all()) and len(losses) == steps
        if "error" in entry:
            entry.update(diverged=False, final_loss=float("nan"), decreased=False)
            continue
        entry["diverged"] = (not finite) or bool(losses.max() > DIVERGENCE_GROWTH * losses[0])
        entry["final_loss"] = float(losses[-window:].mean()) if finite else float("nan")
        entry["decreased"] = finite and entry["final_loss"] < float(losses[:window].mean())
    reference = result["policies"].get("fp32", {}).get("final_loss")
    for policy, entry in result["policies"].items():
        if reference is None or not np.isfinite(reference) or not np.isfinite(entry["final_loss"]):
            entry["rel_diff"] = float("nan")
        else:
            entry["rel_diff"] = abs(entry["final_loss"] - reference) / abs(reference)
        entry["within_tolerance"] = bool(np.isfinite(entry["rel_diff"]) and entry["rel_diff"] <= tolerance
                                         and not entry["diverged"])


# ------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------


def write_reports(results: dict, meta: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    provider = meta["provider"]
    paths = [out / f"parity-{provider}.json", out / f"parity-{provider}.md", out / f"parity-{provider}.png"]
    paths[0].write_text(json.dumps({"meta": meta, "models": results}, indent=1, default=float) + "\n")
    paths[1].write_text(markdown(results, meta))
    try:
        plot(results, meta, paths[2])
    except ImportError:  # a bare GPU machine: plot later with --report-only
        log.warning("matplotlib is missing: no %s (run --report-only %s where it is installed)", paths[2], paths[0])
        paths.pop()
    return paths


def markdown(results: dict, meta: dict) -> str:
    lines = [
        f"# Training accuracy parity on {meta['provider'].upper()} ({meta['device']})",
        "",
        f"{meta['steps']} steps per run on a fixed synthetic dataset (a few seeded batches, cycled); "
        f"final loss = mean over the whole passes through the dataset in the last quarter of the steps; tolerance {100 * meta['tolerance']:.0f} % "
        "relative to fp32; divergence = a NaN/inf loss or one above "
        f"{DIVERGENCE_GROWTH:.0f}x the first. Generated by `{meta['command']}` "
        f"(onnxruntime {meta['onnxruntime']}, {meta['date']}).",
        "",
    ]
    if meta["exclude_ops"]:
        lines += [f"optimize() ran with `exclude_ops={{{', '.join(meta['exclude_ops'])}}}` (kept fp32): ONNX Runtime's "
                  "CPU provider has no float16 kernel for them with reduction='add', which onnx-ad's MaxPool and "
                  "Gather adjoints use.", ""]
    if meta["provider"] == "cpu":
        lines += [
            "**Weak evidence:** ONNX Runtime's CPU execution provider runs most float16 ops by casting "
            "to float32 and back, so fp16 rounding inside ops is largely hidden here; only the "
            "storage roundings at the Casts remain. The CUDA run (`parity-cuda.md`) is the real test.",
            "",
        ]
    lines += ["| model | policy | fp16 nodes | first loss | final loss | rel. diff vs fp32 | within 2 %? | diverged | "
              "final loss scale | ms/step |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        if "error" in result:
            lines.append(f"| {name} | - | - | - | - | - | no | error: {result['error']} | - | - |")
            continue
        for policy, e in result["policies"].items():
            if "error" in e:
                lines.append(f"| {name} | {policy} | - | - | - | - | **no** | error: {e['error']} | - | - |")
                continue
            fp16 = "-" if e.get("nodes_fp16") is None else f"{e['nodes_fp16']}/{e['nodes_fp16'] + e['nodes_fp32']}"
            rel = "-" if policy == "fp32" else f"{100 * e['rel_diff']:.3f} %"
            ok = "yes" if e["within_tolerance"] else "**no**"
            lines.append(f"| {name} | {policy} | {fp16} | {e['losses'][0]:.5g} | {e['final_loss']:.5g} | {rel} | "
                         f"{ok} | {'**yes**' if e['diverged'] else 'no'} | {e.get('final_loss_scale', '-')} | "
                         f"{e['ms_per_step']:.1f} |")
    lines += ["", "Final loss scale: dynamic loss scaling starts at 65536 and halves on every step whose gradients "
              "overflow, skipping that update; 65536 / 2^k means k skipped steps (amp lags fp32 by k steps).",
              "", "| model | loss | optimizer | lr | weights (parameters) | step-graph nodes | notes |",
              "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" not in r:
            lines.append(f"| {name} | {r['loss']} | {r['optimizer']} | {r['lr']:g} | {r['weights']} ({r['parameters']:,}) | "
                         f"{r['step_nodes']} | {r['notes']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in results.items() if "error" not in r]
    cols = min(4, max(1, len(names)))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    styles = {"fp32": ("black", "-"), "amp": ("tab:orange", "--"), "campo": ("tab:blue", ":")}
    for ax, name in zip(axes.flat, names):
        for policy, e in results[name]["policies"].items():
            color, style = styles.get(policy, (None, "-"))
            ax.plot(range(1, len(e["losses"]) + 1), e["losses"], style, color=color, label=policy, linewidth=1.4)
        curves = [v for e in results[name]["policies"].values() for v in e["losses"]]
        if curves and min(curves) > 0 and max(curves) > 20 * min(curves):
            ax.set_yscale("log")  # losses that fall by orders of magnitude
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(results[name]["loss"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(f"training loss, fp32 vs amp vs campo step graphs ({meta['provider']}, {meta['device']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _device(provider: str) -> str:
    if provider == "cuda":
        try:
            import subprocess

            return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "CUDA GPU"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "training")
    parser.add_argument("--corpus-dir", type=Path,
                        help="corpus cache laid out as <package>-<version>/<member> (default: the tests' cache); "
                        "nothing is downloaded when given")
    parser.add_argument("--exclude-ops", default=None, metavar="OP,OP",
                        help="op types optimize() keeps fp32 (default: none; accumulating scatters, which ORT's "
                        "CPU provider has no float16 kernel for, stay fp32 by onnxcampo's own rule)")
    parser.add_argument("--report-only", type=Path, metavar="PARITY.json",
                        help="rewrite the .md and .png of an earlier run's JSON into --out, training nothing")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.INFO)
    if args.report_only:
        saved = json.loads(args.report_only.read_text())
        for result in saved["models"].values():  # the judgement follows this script, not the file
            if "error" not in result:
                assess(result, steps=saved["meta"]["steps"], tolerance=saved["meta"]["tolerance"])
        for path in write_reports(saved["models"], saved["meta"], args.out):
            print(f"wrote {path}")
        return 0
    if args.corpus_dir:
        os.environ["ONNXCAMPO_CACHE"] = str(args.corpus_dir.resolve())
        os.environ["ONNXCAMPO_CORPUS_OFFLINE"] = "1"
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in CASES]
    policies = tuple(p for p in args.policies.split(",") if p)
    if unknown or not set(policies) <= set(POLICIES) or "fp32" not in policies:
        parser.error(f"unknown models {unknown} or policies {policies} (fp32 is required as the reference)")
    if args.exclude_ops is None:
        args.exclude_ops = "none"
    exclude_ops = frozenset() if args.exclude_ops == "none" else frozenset(o for o in args.exclude_ops.split(",") if o)
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)  # no warnings about initializers folded away

    meta = {"provider": args.provider, "device": _device(args.provider), "steps": args.steps,
            "tolerance": args.tolerance, "policies": policies, "exclude_ops": sorted(exclude_ops), "onnxruntime": onnxruntime.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "command": "python -m onnxcampo.benchmarks train-parity " + " ".join(a for a in (argv or sys.argv[1:]))}
    results, failed = {}, []
    started = time.perf_counter()
    for name in models:
        t0 = time.perf_counter()
        try:
            results[name] = train_case(CASES[name], policies=policies, provider=args.provider, steps=args.steps,
                                       exclude_ops=exclude_ops)
        except (onnxcampo.CampoError if hasattr(onnxcampo, "CampoError") else Exception, corpus.CorpusUnavailable) as exc:
            log.error("%s: %s", name, exc)
            results[name] = {"error": str(exc).splitlines()[0]}
            failed.append(name)
            continue
        assess(results[name], steps=args.steps, tolerance=args.tolerance)
        results[name]["total_s"] = round(time.perf_counter() - t0, 1)
        bad = [p for p, e in results[name]["policies"].items() if not e["within_tolerance"]]
        if bad:
            failed.append(name)
        log.info("%s done in %.0f s%s", name, results[name]["total_s"], f"; outside tolerance: {bad}" if bad else "")
        meta["total_s"] = round(time.perf_counter() - started, 1)
        write_reports(results, meta, args.out)  # after every model: a run cut short keeps what it trained
    meta["total_s"] = round(time.perf_counter() - started, 1)
    for path in write_reports(results, meta, args.out):
        print(f"wrote {path}")
    print(markdown(results, meta))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
