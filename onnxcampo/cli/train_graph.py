"""``onnxcampo train-graph``: a training-step graph (forward, loss, backward, weight update)
built from a forward model (:mod:`onnxcampo.training`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxcampo.cli.options import examples, group
from onnxcampo.config import parse_input_shape

EPILOGS = {"train-graph": examples(
    "onnxcampo train-graph fwd.onnx step.onnx --loss cross_entropy --optimizer adamw --lr 1e-3",
    "onnxcampo train-graph fwd.onnx step.onnx --input-shape x:32,3,224,224 --train-mode")}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    tg = sub.add_parser("train-graph", epilog=EPILOGS["train-graph"], help="build a training-step graph (forward + loss + backward + update)")
    tg.add_argument("forward", type=Path, help="forward (inference) model; its float initializers are trained")
    tg.add_argument("output", type=Path, help="training-step model to write")
    loss, update, graph = (group(tg, title) for title in ("loss", "weight update", "step graph"))
    loss.add_argument("--loss", choices=("mse", "cross_entropy", "bce_with_logits", "l1", "huber"), default="mse",
                    help="loss on the prediction against the batch input labels, a mean: mse (default), l1, huber "
                         "(see --huber-delta) and bce_with_logits (binary cross-entropy on logits) take float "
                         "targets of the prediction's shape; cross_entropy int64 class indices (softmax over the "
                         "last axis)")
    loss.add_argument("--output", dest="loss_output", metavar="NAME",
                    help="the model output the loss reads (default: the first); the step graph returns the loss "
                         "and the updated state, not the model's outputs")
    loss.add_argument("--huber-delta", type=float, default=1.0,
                    help="where huber turns from quadratic to linear (default 1.0)")
    update.add_argument("--optimizer", choices=("sgd", "momentum", "adamw"), default="sgd",
                    help="weight update (default sgd): sgd, momentum (0.9) or adamw (betas 0.9/0.999, eps 1e-8, "
                         "weight decay 0.01); its state is graph inputs paired with <name>.updated outputs")
    update.add_argument("--lr", type=float, default=0.01,
                    help="default learning rate (default 0.01; lr is an input of the graph, so schedules need no "
                         "new graph)")
    update.add_argument("--freeze", metavar="REGEX", help="initializers kept constant (besides BatchNorm statistics, "
                    "Resize scales, formula constants and grouped Conv/ConvTranspose weights, frozen automatically)")
    graph.add_argument("--input-shape", action="append", default=[], metavar="NAME:D0,D1,...",
                    help="pin a dynamic input's shape (repeatable); the shape arithmetic it makes constant is folded")
    graph.add_argument("--train-mode", action="store_const", const=True, default=None,
                    help="every BatchNormalization and Dropout runs in training mode: batch statistics (their "
                         "gradient included), running mean/variance as state updated each step, a dropout mask "
                         "drawn from the dropout_seed state (default: each node as exported; a "
                         "training-mode export trains so anyway); evaluation uses the running statistics")
    graph.add_argument("--bn-running-var", choices=("unbiased", "biased"), default="unbiased",
                    help="the batch variance a training BatchNormalization's running variance takes: unbiased "
                         "n/(n-1) (default, as PyTorch) or biased (the ONNX specification, ONNX Runtime)")
    graph.add_argument("--no-simplify", dest="simplify", action="store_false",
                    help="keep onnx-ad's backward graph as emitted (default: Conv weight gradients as one GEMM "
                         "over an im2col, seed-axis Transposes and no-op copies removed; same math)")
    graph.add_argument("--no-fused-ops", dest="fused_ops", action="store_false",
                    help="standard ONNX ops only (default, when the custom-op library is built: the update as "
                         "one ai.onnxcampo multi-tensor op, each Conv weight gradient's im2col as one Im2Col, "
                         "onnx-ad's Gather adjoints (embedding gradients) as ScatterNDAdd)")
    graph.add_argument("--conv-weight-grad", choices=("auto", "gemm", "cudnn"), default="auto",
                    help="with the fused ops, each Conv weight gradient as the Gemm over one Im2Col (gemm) or "
                         "as one ConvWeightGrad op (cudnn: cuDNN's backward filter on CUDA, a slow direct loop on "
                         "the CPU); auto (default): cudnn where onnxruntime has the CUDA provider and the "
                         "custom-op library its CUDA kernels, else gemm")
    return [tg]


def run(args: argparse.Namespace) -> int:
    from onnxcampo import ir
    from onnxcampo import ops
    from onnxcampo.training import build_train_step, step_spec
    from onnxcampo.training.train_mode import DROPOUT_SEED, running_stats

    output = ir.check_output_path(args.output, args.forward if args.forward.exists() else None)
    shapes = dict(parse_input_shape(text) for text in args.input_shape)
    step = build_train_step(args.forward, loss=args.loss, optimizer=args.optimizer, lr=args.lr,
                            output=args.loss_output, huber_delta=args.huber_delta, freeze=args.freeze,
                            input_shapes=shapes, fused=None if args.fused_ops else False, simplify=args.simplify,
                            train_mode=args.train_mode, running_var=args.bn_running_var,
                            conv_weight_grad=None if args.conv_weight_grad == "auto" else args.conv_weight_grad)
    ir.save_model(step, output)
    spec = step_spec(step)
    update = "fused ai.onnxcampo op" if ops.uses_ops(step) else "standard ops"
    print(f"onnxcampo: wrote {output}: {len(spec.weights)} weights trained with {args.optimizer} ({update}) on "
          f"{args.loss} of {ir.metadata(step, 'onnxcampo.prediction')}; batch inputs {', '.join(spec.batch)}; "
          f"{len(step.graph.node)} nodes", file=sys.stderr)
    frozen = ir.metadata(step, "onnxcampo.frozen")
    if frozen:
        print(f"onnxcampo: {frozen}", file=sys.stderr)
    statistics = running_stats(step)
    seeded = DROPOUT_SEED in spec.state
    if statistics or seeded:
        print(f"onnxcampo: training mode: {len(statistics) // 2} BatchNormalization with batch statistics "
              f"(running statistics as state){', Dropout seeded by dropout_seed' if seeded else ''}", file=sys.stderr)
    return 0
