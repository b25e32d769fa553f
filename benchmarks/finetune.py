"""Fine-tune a real model: magika's file-type classifier on the files matplotlib ships.

The model is magika 1.0.3's ``standard_v3_3`` (a corpus model, :mod:`onnxcampo.benchmarks.corpus`: byte
embedding -> Conv -> max pool -> LayerNorms -> 214 file-type logits). The task is a new one: tell
apart seven kinds of file that the installed matplotlib package ships (Python source, Adobe font
metrics, TrueType fonts, matplotlib style sheets, PNG, SVG, PDF; the label is the kind the file
name says). The 214-way head is replaced by a new 7-way one (a MatMul and an Add, seeded random
weights); the byte embedding, its bias and the Conv weight stay frozen by default (their gradients are
most of a step's cost on a CPU; ``--train-all`` trains them too), the Conv bias, the LayerNorms and the new head
train, with AdamW and cross-entropy. Every fourth file is held out; the held-out loss and accuracy
are measured before and after.

    python -m onnxcampo.benchmarks finetune                              # CPU, 120 steps, docs/benchmarks/training/
    python -m onnxcampo.benchmarks finetune --provider cuda --corpus-dir .cache/corpus   # on a GPU machine, offline
    python -m onnxcampo.benchmarks finetune --provider cuda --train-all --lr 3e-4        # everything trains

Writes ``finetune-magika-<provider>.json`` (the command, the losses of every step, held-out loss
and accuracy before and after, timings, versions) and ``.png`` (the loss curve) into ``--out``.
Exit status 1 when the training loss did not fall (the mean of the last tenth of the steps not
below the mean of the first tenth) or went non-finite.

Each file is read as magika's v3 models read files: the first and the last 1024 bytes after
stripping leading / trailing whitespace from the first / last 4096, padded with token 256.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo.benchmarks import corpus
from onnxcampo.training import Trainer, build_train_step, initial_weights

from onnxcampo.benchmarks import ROOT
log = logging.getLogger("onnxcampo.benchmarks.finetune")

#: the seven kinds of file, by name suffix (class index = position)
KINDS = (("python", (".py", ".pyi")), ("font metrics", (".afm",)), ("truetype", (".ttf",)),
         ("style sheet", (".mplstyle",)), ("png", (".png",)), ("svg", (".svg",)), ("pdf", (".pdf",)))
PER_KIND = 48  # at most this many files of a kind (Python would outnumber the rest 5 to 1)
FEATURES, BLOCK, PADDING = 1024, 4096, 256  # magika standard_v3: beg/end sizes, block size, padding token
FROZEN = r"Conv_0|Dense_0|/Const:0$"  # the byte embedding (Const:0), its bias and the Conv weight
HIDDEN_OUTPUT = "LayerNorm_1/AddV2_1:0"  # the features the 214-way Dense_1 reads


def features(path: Path) -> np.ndarray:
    """The 2048 int32 tokens magika's v3 models read from a file (module docstring)."""
    content = path.read_bytes()
    begin = content[:BLOCK].lstrip()[:FEATURES]
    end = content[-BLOCK:].rstrip()[-FEATURES:]
    tokens = np.full(2 * FEATURES, PADDING, np.int32)
    tokens[:len(begin)] = np.frombuffer(begin, np.uint8)
    if end:
        tokens[2 * FEATURES - len(end):] = np.frombuffer(end, np.uint8)
    return tokens


def dataset(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(train, held out, description): ``{"bytes": [n, 2048] int32, "labels": [n] int64}`` from
    the files of the installed matplotlib, every fourth file of a kind held out."""
    import matplotlib

    root = Path(matplotlib.__file__).parent
    files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    rng = np.random.default_rng(seed)
    train, held, counts = ([], []), ([], []), {}
    for label, (kind, suffixes) in enumerate(KINDS):
        chosen = [p for p in files if p.suffix in suffixes]
        if len(chosen) > PER_KIND:
            chosen = [chosen[i] for i in sorted(rng.choice(len(chosen), PER_KIND, replace=False))]
        counts[kind] = len(chosen)
        for index, path in enumerate(chosen):
            part = held if index % 4 == 3 else train
            part[0].append(features(path))
            part[1].append(label)
    pack = lambda part: {"bytes": np.stack(part[0]), "labels": np.array(part[1], np.int64)}  # noqa: E731
    return pack(train), pack(held), {"package": f"matplotlib=={matplotlib.__version__}", "files_per_kind": counts}


def forward_model(seed: int) -> onnx.ModelProto:
    """magika with its 214-way head replaced by a new 7-way one (logits, batch dim symbolic)."""
    model = corpus.load(corpus.get("magika"))
    width = 512
    hidden = next(n.output[0] for n in model.graph.node if n.output[0].endswith(HIDDEN_OUTPUT))
    graph = corpus.cut_at(model, hidden, ["batch", width]).graph  # the old head and its softmax go
    rng = np.random.default_rng(seed)
    graph.initializer.extend([
        numpy_helper.from_array((rng.standard_normal((width, len(KINDS))) / np.sqrt(width)).astype(np.float32), "head.weight"),
        numpy_helper.from_array(np.zeros(len(KINDS), np.float32), "head.bias")])
    graph.node.extend([helper.make_node("MatMul", [hidden, "head.weight"], ["head.matmul"], name="head/MatMul"),
                       helper.make_node("Add", ["head.matmul", "head.bias"], ["logits"], name="head/Add")])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", len(KINDS)]))
    return model


def held_out(trainer: Trainer, data: dict[str, np.ndarray], batch: int) -> dict:
    """Loss and accuracy on ``data``, in batches of the step graph's size; the last one padded
    with copies of its first row, whose predictions are not counted (the forward treats the rows
    of a batch independently, so padding is sound here, unlike in a training step)."""
    losses, correct = [], 0
    rows = len(data["labels"])
    for start in range(0, rows, batch):
        part = {name: value[start:start + batch] for name, value in data.items()}
        real = len(part["labels"])
        if real < batch:
            part = {name: np.concatenate([value, np.repeat(value[:1], batch - real, axis=0)]) for name, value in part.items()}
        logits = trainer.evaluate({"bytes": part["bytes"]})["logits"][:real].astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        log_softmax = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        labels = part["labels"][:real]
        losses.extend(-log_softmax[np.arange(real), labels])
        correct += int((logits.argmax(axis=1) == labels).sum())
    return {"loss": float(np.mean(losses)), "accuracy": correct / rows, "rows": rows}


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = np.array(result["losses"])
    steps = np.arange(1, len(losses) + 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, losses, lw=0.8, alpha=0.45, label="training loss (each step)")
    window = max(1, result["steps_per_epoch"])
    if len(losses) >= window:
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, lw=1.8, label=f"mean of the last {window} steps (one epoch)")
    before, after = result["held_out_before"], result["held_out_after"]
    ax.axhline(after["loss"], color="C2", ls="--", lw=1,
               label=f"held-out loss after ({after['loss']:.3f}; accuracy {100 * before['accuracy']:.0f} -> "
                     f"{100 * after['accuracy']:.0f} %)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"magika fine-tuned on matplotlib's files, 7 kinds ({result['provider']}, batch {result['batch']})",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    train, held, description = dataset(args.seed)
    forward = forward_model(args.seed)
    step = build_train_step(forward, loss="cross_entropy", optimizer="adamw", lr=args.lr,
                            input_shapes={"bytes": (args.batch, 2 * FEATURES)},
                            freeze=None if args.train_all else FROZEN)
    weights = initial_weights(forward, step)
    trainer = Trainer(step, weights=weights, provider=args.provider)
    built = time.perf_counter() - started
    log.info("%d weights train (%d parameters), %d training files, %d held out; built in %.1f s",
             len(weights), sum(w.size for w in weights.values()), len(train["labels"]), len(held["labels"]), built)
    before = held_out(trainer, held, args.batch)
    rng = np.random.default_rng(args.seed)
    per_epoch = len(train["labels"]) // args.batch  # the last partial batch of each epoch is dropped
    losses, order, t0 = [], [], time.perf_counter()
    for index in range(args.steps):
        if not order:
            permutation = rng.permutation(len(train["labels"]))
            order = [permutation[i:i + args.batch] for i in range(0, per_epoch * args.batch, args.batch)]
        rows = order.pop(0)
        losses.append(trainer.step({"bytes": train["bytes"][rows], "labels": train["labels"][rows]}))
        if (index + 1) % max(1, args.steps // 10) == 0:
            log.info("step %d/%d: loss %.4f", index + 1, args.steps, losses[-1])
    losses = [float(loss) for loss in losses]  # read once the steps are queued (waits for the last)
    train_s = time.perf_counter() - t0
    after = held_out(trainer, held, args.batch)
    tenth = max(1, args.steps // 10)
    return {
        "command": shlex.join(["python", "-m", "onnxcampo.benchmarks", "finetune", *sys.argv[1:]]),
        "model": "magika==1.0.3 magika/models/standard_v3_3/model.onnx (corpus key magika), 214-way head -> 7-way",
        "data": {**description, "kinds": [kind for kind, _ in KINDS], "train_rows": len(train["labels"]),
                 "held_out_rows": len(held["labels"])},
        "provider": args.provider, "batch": args.batch, "steps": args.steps, "lr": args.lr, "optimizer": "adamw",
        "loss": "cross_entropy", "frozen": None if args.train_all else FROZEN,
        "trained_weights": len(weights), "trained_parameters": int(sum(w.size for w in weights.values())),
        "steps_per_epoch": per_epoch, "losses": losses,
        "first_tenth_mean": float(np.mean(losses[:tenth])), "last_tenth_mean": float(np.mean(losses[-tenth:])),
        "held_out_before": before, "held_out_after": after,
        "build_s": round(built, 2), "train_s": round(train_s, 2), "ms_per_step": round(1000 * train_s / args.steps, 1),
        "cuda_graph": trainer.cuda_graph,
        "versions": {"onnxcampo": getattr(onnxcampo, "__version__", "?"), "onnxruntime": ort.__version__,
                     "onnx": onnx.__version__, "numpy": np.__version__, "python": platform.python_version()},
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    parser.add_argument("--batch", type=int, default=8, help="batch rows (default 8)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--train-all", action="store_true", help="train the byte embedding and the Conv too")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "training",
                        help="folder for finetune-magika-<provider>.json and .png")
    parser.add_argument("--no-plot", action="store_true", help="write the JSON only")
    parser.add_argument("--corpus-dir", type=Path,
                        help="corpus cache laid out as <package>-<version>/<member> (default: the tests' cache); "
                             "nothing is downloaded when given")
    args = parser.parse_args(argv)
    if args.corpus_dir:
        os.environ["ONNXCAMPO_CACHE"] = str(args.corpus_dir.resolve())
        os.environ["ONNXCAMPO_CORPUS_OFFLINE"] = "1"
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        result = run(args)
    except corpus.CorpusUnavailable as exc:
        print(f"finetune: the magika model cannot be had: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"finetune-magika-{args.provider}{'-all' if args.train_all else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_plot:
        plot(stem.with_suffix(".png"), result)
    before, after = result["held_out_before"], result["held_out_after"]
    print(f"loss {result['first_tenth_mean']:.4f} -> {result['last_tenth_mean']:.4f} (first / last tenth of "
          f"{args.steps} steps, {result['ms_per_step']} ms a step); held out: loss {before['loss']:.4f} -> "
          f"{after['loss']:.4f}, accuracy {100 * before['accuracy']:.1f} -> {100 * after['accuracy']:.1f} %; "
          f"wrote {stem}.json{'' if args.no_plot else ' and .png'}")
    losses = np.array(result["losses"])
    return 0 if np.isfinite(losses).all() and result["last_tenth_mean"] < result["first_tenth_mean"] else 1


if __name__ == "__main__":
    sys.exit(main())
