"""``onnxcampo train``: a training-step graph run on ONNX Runtime over batches of .npz files
(:class:`onnxcampo.training.Trainer`), with checkpoints, a loss log and the trained forward model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from onnxcampo.cli.options import add_provider_option, examples, group
from onnxcampo.errors import ConfigError, ValidationError

EPILOGS = {"train": examples(
    "onnxcampo train step.onnx --data batches/ --steps 500 --log loss.jsonl --forward fwd.onnx --out trained.onnx",
    "onnxcampo train step.onnx --data b.npz --provider cuda --lr-schedule warmup:100,cosine:1000")}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    tr = sub.add_parser("train", epilog=EPILOGS["train"], help="run a training-step graph on ONNX Runtime")
    tr.add_argument("step", type=Path, help="training-step model (from train-graph, optionally optimized)")
    data, running, state = (group(tr, title) for title in ("weights and batches", "run", "checkpoints and outputs"))
    data.add_argument("--forward", type=Path, metavar="FWD.onnx", help="the forward model: initial weights (default: those the step "
                    "graph carries) and, with --out, the model the trained weights are written into")
    data.add_argument("--data", type=Path, required=True, metavar="FILE.npz|FOLDER",
                    help=".npz with the batch inputs and 'labels' (an extra leading axis = one batch per step, cycled), "
                         "or a folder of such .npz files, one batch each, taken in sorted name order and cycled; every "
                         "file is checked against the step graph before the first step")
    data.add_argument("--partial-batch", choices=("error", "drop"), default="error",
                    help="a batch file with fewer rows than the step graph takes (a folder's last one, say; the step "
                         "graph's shapes are static): error (default, naming the sizes) or drop (left out of the cycle)")
    running.add_argument("--steps", type=int, default=100, metavar="N",
                    help="training steps to run (default 100); with --resume, steps to run after the checkpoint's")
    running.add_argument("--lr", type=float, help="learning rate, the base of --lr-schedule (default: the one the graph was "
                    "built with; with --resume and no --lr, the checkpoint's)")
    running.add_argument("--lr-schedule", metavar="SCHEDULE",
                    help="learning rate per step from --lr: constant | step:STEP_SIZE:GAMMA (times GAMMA every STEP_SIZE "
                         "steps) | cosine:TOTAL_STEPS[:MIN_LR] | warmup:STEPS[,SCHEDULE] (linear warmup, then SCHEDULE "
                         "counted from its end; default constant); steps count from the start of the run, resumed or not")
    state.add_argument("--resume", type=Path, metavar="CKPT.npz",
                    help="start from a checkpoint (written by --save-checkpoint): weights, optimizer and loss-scaling "
                         "state, step count; the batches and the schedule continue where it stopped")
    state.add_argument("--save-checkpoint", type=Path, metavar="CKPT.npz",
                    help="write a checkpoint after the last step (.npz, written atomically; see docs/guide/training.md)")
    add_provider_option(running, "cpu")
    graphs = running.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graph", dest="cuda_graph", action="store_const", const=True, default=None,
                        help="replay each step as a CUDA graph, refused unless --provider cuda and every input shape of "
                             "the step graph is static (default: so on cuda when the shapes are static; -v says why not): "
                             "removes the host's per-node launch cost; every batch keeps the first one's shapes")
    graphs.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_const", const=False,
                        help="run each step node by node, also where a CUDA graph would be replayed by default")
    running.add_argument("--seed", type=int, default=0, metavar="N",
                    help="the starting dropout_seed of a step graph with training-mode Dropout (default 0; one "
                         "more each step, so a run is reproduced by its seed; a checkpoint restores it)")
    running.add_argument("--log-every", type=int, default=None, metavar="N",
                         help="read the losses every N steps: print the last, write them to --log, stop on a diverged "
                              "loss (default: 20 times in a run). On CUDA, replayed as CUDA graphs, the steps in between queue "
                              "on the GPU without waiting for each other; --log-every 1 waits for every step")
    state.add_argument("--log", type=Path, metavar="LOG.jsonl",
                       help="one JSON line per step: step, loss (and lr under a schedule; loss_scale on the lines where "
                            "the losses are read, --log-every)")
    state.add_argument("--out", type=Path, metavar="OUT.onnx", help="write the forward model with the trained weights")
    return [tr]


MAX_SKIPPED_STEPS = 20  # non-finite losses in a row tolerated while the loss scale comes down


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from onnxcampo import ir
    from onnxcampo.training import Trainer, initial_weights
    from onnxcampo.training.batches import input_specs
    from onnxcampo.training.data import NpzBatches, dropped_text
    from onnxcampo.training.scaling import is_train_step
    from onnxcampo.training.step import step_spec
    from onnxcampo.training.schedules import parse_schedule

    if args.steps <= 0:
        raise ConfigError("--steps must be positive")
    if args.log_every is not None and args.log_every <= 0:
        raise ConfigError("--log-every must be positive")
    if args.out is not None:
        if args.forward is None:
            raise ConfigError("--out needs --forward: the trained weights are written into the forward model")
        ir.check_output_path(args.out, args.forward)
    if args.resume is not None and not args.resume.is_file():
        raise ConfigError(f"{args.resume}: no such checkpoint")
    if args.save_checkpoint is not None and not args.save_checkpoint.parent.is_dir():
        raise ConfigError(f"{args.save_checkpoint}: folder {args.save_checkpoint.parent} does not exist")
    for written in (args.log, args.save_checkpoint):  # writable, before any step
        if written is not None:
            ir.check_output_path(written, args.step)
    step_model, _ = ir.read_model(args.step)
    if not is_train_step(step_model):  # before the data: the model is the first thing to be wrong
        raise ConfigError(f"{args.step} is not a training-step graph; build one from the forward model with "
                          f"`onnxcampo train-graph {args.step} step.onnx` and train step.onnx")
    if not args.data.exists():
        raise ConfigError(f"{args.data}: no such file or folder")
    specs = input_specs(step_model)  # the batch files are checked before the session is made
    batches = NpzBatches(args.data, {name: specs[name] for name in step_spec(step_model).batch},
                         drop_partial=args.partial_batch == "drop")
    if batches.dropped:
        print(f"onnxcampo: {args.data}: {dropped_text(batches.dropped)}", file=sys.stderr)
    weights = initial_weights(args.forward, step_model) if args.forward else None
    base_lr = args.lr if args.lr is not None else float(ir.metadata(step_model, "onnxcampo.lr", "0.01"))
    schedule = parse_schedule(args.lr_schedule, base_lr) if args.lr_schedule else None  # base: --lr or the graph's
    trainer = Trainer(step_model, weights=weights, provider=args.provider, lr=args.lr, cuda_graph=args.cuda_graph,
                      partial_batch=args.partial_batch, seed=args.seed)
    if args.resume is not None:
        trainer.load_checkpoint(args.resume)
        if args.lr is not None:
            trainer.lr = args.lr
    first = trainer.steps  # 0, or the checkpoint's step count
    lines = _steps(trainer, batches, schedule, first, first + args.steps,
                   args.log_every or max(1, args.steps // 20))
    if args.log:
        ir.write_text_atomically(args.log, "\n".join(lines) + "\n")
    if args.save_checkpoint:
        trainer.save_checkpoint(args.save_checkpoint)
        print(f"onnxcampo: wrote checkpoint {args.save_checkpoint} (step {trainer.steps})", file=sys.stderr)
    if args.out:
        ir.save_model(trainer.export(args.forward), args.out)
        print(f"onnxcampo: wrote {args.out}", file=sys.stderr)
    return 0


def _steps(trainer, batches, schedule, first: int, last: int, every: int) -> list[str]:
    """Steps ``first`` .. ``last - 1`` (global numbers: a resumed run continues the batches and the
    schedule), the losses read every ``every`` steps and at the end: the JSON log lines, and the
    progress on stderr (one line rewritten in place on a terminal, a line each otherwise). On CUDA
    the steps between two reads queue on the GPU."""
    import numpy as np

    lines, pending = [], []  # pending: (step number, loss, lr) not read yet
    live = sys.stderr.isatty()
    bad = 0  # non-finite losses in a row: dynamic loss scaling skips such steps, a few are fine
    for index in range(first, last):
        if schedule is not None:
            trainer.lr = schedule(index)
        pending.append((index + 1, trainer.step(batches[index]), trainer.lr if schedule else None))
        if (index + 1 - first) % every and index + 1 != last:
            continue
        scale = trainer.loss_scale  # waits for the queued steps, as reading their losses does
        for number, loss, lr in pending:
            loss = float(loss)
            lines.append(json.dumps({"step": number, "loss": loss, **({"lr": lr} if lr is not None else {}),
                                     **({"loss_scale": scale} if scale and number == index + 1 else {})}))
            bad = 0 if np.isfinite(loss) else bad + 1
            if bad > (MAX_SKIPPED_STEPS if scale else 0):
                raise ValidationError(f"the loss is {loss} at step {number}: training diverged")
        pending = []
        shown = f", loss scale {scale:g}" if scale else ""
        text = f"step {index + 1}/{last}: loss {loss:.5g}{shown}"
        if live:
            print(f"\r{text}   ", end="", file=sys.stderr, flush=True)
        else:
            print(text, file=sys.stderr, flush=True)
    if live:
        print(file=sys.stderr)
    return lines
