"""Command line: ``onnxcampo optimize | inspect | bench | train-graph | train | costdb
{measure | fit | fit-step-dispatch | fit-fused-elementwise | eval}``.

User errors print one line on stderr and exit 2 (validation failures exit 1); no traceback
unless ``--debug``. Options are never abbreviated (a usage error names the closest one); ``-q``
keeps only warnings and errors on stderr, ``--log-file`` writes the full log; messages of the code
shared with the Python API name flags here (:func:`onnxcampo.errors.command_line`).

Every option is described once, in its help text here: ``docs/guide/cli-reference.md`` is
rendered from :func:`build_parser` (``python -m onnxcampo.cli_reference``), and a test fails when
it is out of date.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import sys
import time
from pathlib import Path

from onnxcampo import __version__
from onnxcampo.config import (EXECUTION_MODES, FUSE_MODES, POLICIES, TUNE_PROVIDERS, ExperimentalOptions,
                              OptimizeConfig, parse_dim_value, parse_experimental, parse_input_shape)
from onnxcampo.errors import CampoError, ConfigError, ValidationError, command_line, did_you_mean
from onnxcampo.install import require_onnxruntime
from onnxcampo.report import summary

log = logging.getLogger("onnxcampo")


class _Parser(argparse.ArgumentParser):
    """No abbreviated options (``--input-shap`` is an error, not ``--input-shape``); a usage
    error is one line on stderr, exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # epilogs keep their lines
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"onnxcampo: error: {self.prog}: {message} ({self.prog} --help lists the options)\n")


def _group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group of this title (made on first use), as ``--help`` shows it."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _examples(*lines: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLE = "onnxcampo/examples/mlp_block.onnx"
EPILOGS = {
    "optimize": _examples(f"onnxcampo optimize {EXAMPLE} out.onnx --input-shape x:16384,256 --validate",
                          "onnxcampo optimize model.onnx out.onnx --dim batch=32 --exclude-op Softmax --report r.json",
                          "onnxcampo optimize model.onnx out.onnx --dim batch=8 --tune cuda --execution cuda-graph"),
    "inspect": _examples(f"onnxcampo inspect {EXAMPLE} --input-shape x:16384,256 --nodes",
                         "onnxcampo inspect model.onnx --dim batch=1 --policy amp"),
    "train-graph": _examples("onnxcampo train-graph fwd.onnx step.onnx --loss cross_entropy --optimizer adamw --lr 1e-3",
                             "onnxcampo train-graph fwd.onnx step.onnx --input-shape x:32,3,224,224 --train-mode"),
    "train": _examples("onnxcampo train step.onnx --data batches/ --steps 500 --log loss.jsonl --forward fwd.onnx "
                       "--out trained.onnx",
                       "onnxcampo train step.onnx --data b.npz --provider cuda --lr-schedule warmup:100,cosine:1000"),
    "bench": _examples("onnxcampo bench model.onnx --dim batch=32 --policies fp32,amp,campo --json bench.json",
                       "onnxcampo bench model.onnx --dim batch=1 --execution cuda-graph --rounds 20"),
    "costdb": _examples("onnxcampo costdb calibrate", "onnxcampo costdb measure --out samples.jsonl --budget-s 540",
                        "onnxcampo costdb fit samples.jsonl db.json",
                        "onnxcampo costdb eval db.json samples.jsonl --report eval.md"),
    "calibrate": _examples("onnxcampo costdb calibrate", "onnxcampo costdb calibrate --budget-s 300   # run again to finish",
                           "onnxcampo costdb calibrate --where"),
    "measure": _examples("onnxcampo costdb measure --out samples.jsonl --budget-s 540 --seed 0"),
    "fit": _examples("onnxcampo costdb fit samples.jsonl costdb/data/nvidia-h200.json --holdout 0.2"),
    "fit-fused-elementwise": _examples(
        "onnxcampo costdb fit-fused-elementwise fused_elementwise_costs.json costdb/data/nvidia-h200.json"),
    "fit-step-dispatch": _examples("onnxcampo costdb fit-step-dispatch docs/benchmarks/raw/h200.jsonl db.json"),
    "eval": _examples("onnxcampo costdb eval db.json samples.jsonl --report eval.md --png eval.png"),
}


def _add_common_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-q`` and ``--log-file``, given before or after the subcommand (a subcommand's copy sets
    them only when given, so it does not undo the program's)."""
    common = _group(parser, "common options")
    default = {} if top else {"default": argparse.SUPPRESS}
    common.add_argument("-q", "--quiet", action="store_true", **({"default": False} if top else default),
                        help="warnings and errors only: no progress, summaries or 'wrote' lines on stderr (what a "
                             "command prints on stdout, inspect's plan or bench's table, stays)")
    common.add_argument("--log-file", type=Path, metavar="FILE", **({"default": None} if top else default),
                        help="also write the full log (debug level, timestamped, whatever -v or -q) to FILE")


def _add_shape_options(parser: argparse.ArgumentParser, inputs_pin: str) -> None:
    """``inputs_pin``: when the inputs of ``--inputs`` pin the dims no option pins."""
    shapes = _group(parser, "input shapes")
    shapes.add_argument("--input-shape", action="append", default=[], metavar="NAME:D0,D1,...",
                        help="pin a dynamic input's shape for cost estimation and runs (repeatable); campo needs "
                             "the sizes. " + inputs_pin)
    shapes.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="pin a named dynamic dim (e.g. batch=8) wherever it occurs (repeatable; NAME is one of "
                             "the model's symbolic dims, another is an error naming the closest)")


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    plan = _group(parser, "precision plan")
    plan.add_argument("--policy", choices=POLICIES, default="campo",
                        help="campo (default): cost-aware, the four passes; amp: TensorFlow-AMP-style greedy "
                             "painting with a Cast at every boundary (the paper's baseline); fp16: every op that may "
                             "run fp16; fp32: nothing converted")
    _add_shape_options(parser, "The written model keeps its dynamic shapes. With --tune or --activation-limit, "
                               "the inputs of --inputs (optimize) pin the dynamic dims nothing else pins")
    timing = _group(parser, "timing and tuning")
    custom = _group(parser, "custom ops (need the library: python -m onnxcampo.ops.build)")
    plan.add_argument("--exclude-op", action="append", default=[], metavar="OP",
                      help="op type kept fp32 (repeatable; case-sensitive: one of the model's op types, an ONNX op "
                           "or one of onnxcampo's op lists, e.g. ORT's fused Attention; any other name is an error "
                           "naming the closest)")
    plan.add_argument("--include-op", action="append", default=[], metavar="OP",
                        help="op type forced fp16 where it has an fp16 schema (repeatable; names as --exclude-op)")
    plan.add_argument("--exclude-node", action="append", default=[], metavar="REGEX",
                        help="nodes whose names match kept fp32 (repeatable)")
    plan.add_argument("--include-node", action="append", default=[], metavar="REGEX",
                        help="nodes whose names match forced fp16 where they have an fp16 schema (repeatable)")
    plan.add_argument("--min-gain", type=float, default=0.02, metavar="SHARE",
                        help="campo keeps fp32 unless a mixed plan is predicted at least this share faster "
                             "(default 0.02: 2 %%; smaller predicted gains are within the cost model's error)")
    plan.add_argument("--no-keep-io-types", action="store_true",
                        help="let graph inputs/outputs become fp16 (a training step keeps its own, with a warning; "
                             "refused for ONNX Runtime training artifacts, bound by name and dtype to their checkpoint)")
    plan.add_argument("--no-loss-scaling", action="store_true",
                        help="training steps: do not insert dynamic loss scaling (on by default when fp16 is used)")
    timing.add_argument("--tune", choices=TUNE_PROVIDERS, metavar="PROVIDER",
                        help="time campo's candidate plans (all-fp16, its own, without padding, amp, fp32) on this "
                             "ONNX Runtime provider (cuda or cpu) in the --execution mode and keep the fastest (fp32 "
                             "unless a mixed plan is --min-gain faster); inputs random, or (optimize) from --inputs "
                             "(a training step: its batch and labels). Needs the provider here: onnxruntime-gpu and a "
                             "GPU for cuda; --execution cuda-graph needs cuda")
    timing.add_argument("--tune-tolerance", default=None, metavar="CRITERION",
                         help="--tune keeps no inference candidate whose outputs fail this accuracy criterion against "
                              "the fp32 plan's, as --tolerance writes it (default: optimize's --tolerance, else "
                              "rel_l2=0.01)")
    plan.add_argument("--activation-limit", type=float, default=None, metavar="MAX",
                        help="calibrate: run the fp32 model once on ORT's CPU provider on random inputs, or "
                             "(optimize) on --inputs, and keep fp32 every node reading or writing values beyond |MAX| "
                             "there (reason 'reads or writes values beyond --activation-limit'; the report's "
                             "calibration entry lists the nodes). fp16 values are 0.5 apart above 512 and 2 apart "
                             "above 2048; ModelOpt AutoCast's data_max is 512. Inference models only; off by default")
    timing.add_argument("--execution", choices=EXECUTION_MODES, default="plain",
                        help="how ORT will run the model, which plans are costed, tuned and validated for: plain "
                             "(node by node, default) or cuda-graph (captured once and replayed as a CUDA graph: no "
                             "per-node host time; needs static shapes and every node on the CUDA EP)")
    _add_cost_options(parser)
    custom.add_argument("--fuse-elementwise", action=argparse.BooleanOptionalAction, default=None,
                        help="after the plan: chains of elementwise ops, their Casts and the Conv/Gemm biases they "
                             "read included, as ai.onnxcampo FusedElementwise nodes, one kernel each, and a training "
                             "step's weight Casts as one MultiTensorCast (needs the custom-op library; docs/ops.md). "
                             "Default, where the library's CUDA kernels and NVRTC are (onnxruntime-gpu): on for a "
                             "training step built with the fused ops, by predicted cost for an inference model (on "
                             "when the plan is predicted --min-gain faster with it, in the --execution mode); off "
                             "elsewhere, with one line saying why")
    custom.add_argument("--fuse-reductions", action=argparse.BooleanOptionalAction, default=None,
                        help="after the plan: a cross-entropy loss and its gradient as ai.onnxcampo "
                             "SoftmaxCrossEntropy(Grad) nodes (one pass over the logits each), layer-norm and softmax "
                             "input gradients as LayerNormGrad / SoftmaxGrad nodes, and ReduceSums over "
                             "leading/trailing blocks of axes (bias, LayerNorm and Conv-bias gradients), with the "
                             "Reshapes and float16->float32 Casts around them, as BlockReduceSum nodes, one kernel "
                             "each (needs the custom-op library; docs/ops.md). Default: as --fuse-elementwise's, where "
                             "the library's CUDA kernels are")
    custom.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                        help="after the plan, before the fusions: store the 2-D convolutions' activations "
                             "channels-last (NHWC) and run the convolutions and their gradients as ai.onnxcampo "
                             "ConvNhwc / ConvNhwcDataGrad / ConvNhwcWeightGrad nodes (cuDNN's NHWC kernels, no layout "
                             "transform around each; needs the custom-op library; docs/ops.md). Convolutions whose "
                             "channels are not multiples of 8 stay NCHW. Default: as --fuse-elementwise's, where the "
                             "library's CUDA kernels are (the prediction counts the layout transforms it removes, the "
                             "Transposes it adds and each NHWC convolution call's host time)")
    _add_experimental_option(parser)


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    """How plans are costed and what the graph looks like before planning: options of
    ``optimize`` and ``inspect`` that ``bench`` passes to every policy too."""
    cost = _group(parser, "cost model and graph fusion")
    cost.add_argument("--device-db", type=Path, metavar="DB.json",
                        help="regression cost database (JSON, schema in costdb/regression.py; default: the one "
                             "`costdb calibrate` measured on this GPU, else the one shipped for it, else a roofline "
                             "model from its specs; $ONNXCAMPO_DEVICE, a GPU name or none for the reference model, "
                             "overrides the detection)")
    cost.add_argument("--fuse", choices=FUSE_MODES, default="auto",
                        help="before planning, run ONNX Runtime's transformers optimizer (its Python fusions: "
                             "SkipLayerNormalization, Attention, BiasGelu, EmbedLayerNormalization, ...), so that "
                             "the graph ORT users run on the GPU is planned: auto (default) fuses graphs it "
                             "recognises as BERT-like (layer norm, attention Softmax, Gelu, no causal mask) or "
                             "GPT-2-like (with a causal mask) and leaves any other as it is; bert/gpt2 force the "
                             "model type; none never fuses. Training steps, quantized graphs (under auto) and graphs "
                             "already fused are left alone; the report's fuse entry counts the fused ops, or says "
                             "why nothing was fused")
    cost.add_argument("--num-heads", type=int, default=0, metavar="N",
                        help="attention heads for --fuse (default 0: detected from the graph, else by ORT's optimizer)")
    cost.add_argument("--hidden-size", type=int, default=0, metavar="N",
                        help="hidden size for --fuse (default 0: detected from the graph, else by ORT's optimizer)")


def _add_experimental_option(parser: argparse.ArgumentParser) -> None:
    """``--experimental KEY=VALUE``: :class:`~onnxcampo.config.ExperimentalOptions`, the switches
    kept for A/B measurements and development, apart from the product's options."""
    defaults = ", ".join(f"{name}={_text(value)}" for name, value in dataclasses.asdict(ExperimentalOptions()).items())
    _group(parser, "experimental").add_argument(
        "--experimental", action="append", default=[], metavar="KEY=VALUE",
        help="set one of the switches kept for A/B measurements and development (repeatable; VALUE read as the "
             "option's type: true/false, an integer or a word; docs/guide/cli.md says what each switches). The "
             f"options and their defaults: {defaults}")


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cost_fields(args: argparse.Namespace) -> dict:
    """The OptimizeConfig fields of :func:`_add_cost_options` and :func:`_add_experimental_option`
    (``--debug`` sets ``check_invariants``)."""
    experimental = dict(parse_experimental(text) for text in args.experimental)
    if args.debug:
        experimental["check_invariants"] = True
    return dict(device_db=args.device_db, fuse=args.fuse, num_heads=args.num_heads, hidden_size=args.hidden_size,
                experimental=experimental)


def _config(args: argparse.Namespace) -> OptimizeConfig:
    shapes = dict(parse_input_shape(text) for text in args.input_shape)
    dims = dict(parse_dim_value(text) for text in args.dim)
    return OptimizeConfig(
        policy=args.policy,
        keep_io_types=not args.no_keep_io_types,
        input_shapes=shapes,
        dim_values=dims,
        exclude_ops=frozenset(args.exclude_op),
        include_ops=frozenset(args.include_op),
        exclude_nodes=tuple(args.exclude_node),
        include_nodes=tuple(args.include_node),
        min_gain=args.min_gain,
        loss_scaling=not args.no_loss_scaling,
        fuse_elementwise=args.fuse_elementwise,
        fuse_reductions=args.fuse_reductions,
        channels_last=args.channels_last,
        tune=args.tune,
        tune_tolerance=args.tune_tolerance if args.tune_tolerance is not None else getattr(args, "tolerance", None),
        activation_limit=args.activation_limit,
        execution=args.execution,
        **_cost_fields(args),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="onnxcampo", description="Cost-aware mixed-precision optimizer for ONNX graphs",
                     epilog=_examples(f"onnxcampo optimize {EXAMPLE} out.onnx --input-shape x:16384,256 --validate",
                                      "onnxcampo COMMAND --help"))
    parser.add_argument("--version", action="version", version=f"onnxcampo {__version__}",
                        help="print the version and exit")
    _add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    opt = sub.add_parser("optimize", help="write a mixed fp16/fp32 model")
    opt.add_argument("input", type=Path, help="fp32 ONNX model")
    opt.add_argument("output", type=Path, help="where to write the optimized model (written atomically)")
    _add_plan_options(opt)
    out = _group(opt, "report and validation")
    out.add_argument("--report", type=Path, metavar="FILE.json",
                     help="write the full report as JSON: counts by reason, Casts, Pads, the predicted times of every "
                          "plan, the per-node plan (precision, reason, numbers)")
    out.add_argument("--validate", action="store_true",
                      help="run both models on ORT (provider cuda: in the --execution mode) on --inputs or generated "
                           "inputs, one line per output with its error statistics judged by --tolerance; on failure "
                           "name the nodes most responsible (bisecting the fp16 nodes back to fp32: a line first says "
                           "how many re-optimizations it takes at most, up to 64, and about how long each takes), "
                           "exit 1 and write nothing (with --fix: keep them fp32 and write the model that passes)")
    out.add_argument("--provider", choices=("cpu", "cuda", "reference"), default="cpu",
                      help="where --validate runs both models: ONNX Runtime's cpu (default) or cuda provider, or the "
                           "ONNX reference evaluator (reference: numpy in each tensor's dtype, so fp16 nodes round and "
                           "overflow as fp16 does, which ORT's CPU provider, running most fp16 nodes in fp32, hides; "
                           "slow on large models)")
    out.add_argument("--inputs", type=Path, metavar="FILE.npz",
                      help="inputs for --validate, the accuracy check, --tune and --activation-limit (default: "
                           "generated: floats standard normal, integers in [0, 8), *mask* ones, token_type_ids zeros, "
                           "position_ids 0..n-1, sr 16000)")
    out.add_argument("--tolerance", default=None, metavar="CRITERION",
                      help="the accuracy criterion of --validate, the accuracy check and --tune, per output: a "
                           "number (a bound on the relative L2 error ||out - ref|| / ||ref||) or bounds "
                           "STAT=VALUE,... on mean_abs, median_abs, p99_abs, max_abs, mean_rel, median_rel, p99_rel, "
                           "max_rel, rel_l2 (float outputs) and mismatch (share of integer elements that differ); "
                           "default rel_l2=0.01,mismatch=0.01 (fp16 models as good as the anchors: 0.06-0.5 %%)")
    out.add_argument("--fix", action="store_true",
                      help="when the written model fails the criterion (--validate or the accuracy check), keep the "
                           "nodes most responsible fp32 (found by bisection: at most 8 culprits and 64 "
                           "re-optimizations, the bound and the time of one said before it starts) and write the "
                           "model that passes")
    out.add_argument("--no-accuracy-check", action="store_true",
                      help="do not run the accuracy check (on by default without --validate: both models once on "
                           "ORT's CPU provider on --inputs or generated inputs; a failure is a warning, with the "
                           "figures, in the report and on stderr, and the model is written; it never re-optimizes: "
                           "it says what --validate's or --fix's search of the nodes responsible would take)")
    out.add_argument("--rtol", type=float, default=None, metavar="R",
                     help="--validate also checks every element, |out - ref| <= atol + rtol * |ref|, and fails "
                          "where one does not (off unless --rtol or --atol is given; the other then defaults to "
                          "0.02 / 1e-3)")
    out.add_argument("--atol", type=float, default=None, metavar="A",
                     help="absolute tolerance of --rtol's element-wise check")

    ins = sub.add_parser("inspect", help="print the precision plan without writing a model")
    ins.add_argument("input", type=Path, help="fp32 ONNX model")
    _add_plan_options(ins)
    ins.add_argument("--nodes", action="store_true",
                     help="print the nodes table: one line per node (and per Cast or Pad/Slice onnxcampo inserts) "
                          "with its precision, op type, its own predicted fp32 and fp16 times, the Casts it causes "
                          "(a Cast belongs to the fp16 side of its boundary, shared equally among the fp16 nodes "
                          "reading it), its name and the reason")
    ins.add_argument("--op", action="append", default=[], metavar="OP",
                     help="nodes table and --json: only nodes of this op type (repeatable; implies --nodes)")
    ins.add_argument("--precision", choices=("fp16", "fp32", "inserted"),
                     help="nodes table and --json: only nodes of this precision, or the nodes onnxcampo inserts "
                          "(implies --nodes)")
    ins.add_argument("--name", metavar="REGEX",
                     help="nodes table and --json: only nodes whose names match (re.search; implies --nodes)")
    ins.add_argument("--json", action="store_true",
                     help="print the report (as optimize --report writes it) as JSON on stdout, with the nodes "
                          "table's rows as its nodes entry, instead of the text")
    ins.add_argument("--html", type=Path, metavar="FILE.html",
                     help="write the plan as one self-contained page (written atomically): the planned graph "
                          "coloured by precision, inserted Casts and Pad/Slice marked, a node's reason and predicted "
                          "times on click, a searchable nodes table, the summary counts and every plan's predicted "
                          "time")

    tg = sub.add_parser("train-graph", help="build a training-step graph (forward + loss + backward + update)")
    tg.add_argument("forward", type=Path, help="forward (inference) model; its float initializers are trained")
    tg.add_argument("output", type=Path, help="training-step model to write")
    loss, update, graph = (_group(tg, title) for title in ("loss", "weight update", "step graph"))
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

    tr = sub.add_parser("train", help="run a training-step graph on ONNX Runtime")
    tr.add_argument("step", type=Path, help="training-step model (from train-graph, optionally optimized)")
    data, run, state = (_group(tr, title) for title in ("weights and batches", "run", "checkpoints and outputs"))
    data.add_argument("--forward", type=Path, metavar="FWD.onnx", help="the forward model: initial weights (default: those the step "
                    "graph carries) and, with --out, the model the trained weights are written into")
    data.add_argument("--data", type=Path, required=True, metavar="FILE.npz|FOLDER",
                    help=".npz with the batch inputs and 'labels' (an extra leading axis = one batch per step, cycled), "
                         "or a folder of such .npz files, one batch each, taken in sorted name order and cycled; every "
                         "file is checked against the step graph before the first step")
    data.add_argument("--partial-batch", choices=("error", "drop"), default="error",
                    help="a batch file with fewer rows than the step graph takes (a folder's last one, say; the step "
                         "graph's shapes are static): error (default, naming the sizes) or drop (left out of the cycle)")
    run.add_argument("--steps", type=int, default=100, metavar="N",
                    help="training steps to run (default 100); with --resume, steps to run after the checkpoint's")
    run.add_argument("--lr", type=float, help="learning rate, the base of --lr-schedule (default: the one the graph was "
                    "built with; with --resume and no --lr, the checkpoint's)")
    run.add_argument("--lr-schedule", metavar="SCHEDULE",
                    help="learning rate per step from --lr: constant | step:STEP_SIZE:GAMMA (times GAMMA every STEP_SIZE "
                         "steps) | cosine:TOTAL_STEPS[:MIN_LR] | warmup:STEPS[,SCHEDULE] (linear warmup, then SCHEDULE "
                         "counted from its end; default constant); steps count from the start of the run, resumed or not")
    state.add_argument("--resume", type=Path, metavar="CKPT.npz",
                    help="start from a checkpoint (written by --save-checkpoint): weights, optimizer and loss-scaling "
                         "state, step count; the batches and the schedule continue where it stopped")
    state.add_argument("--save-checkpoint", type=Path, metavar="CKPT.npz",
                    help="write a checkpoint after the last step (.npz, written atomically; see docs/guide/training.md)")
    run.add_argument("--provider", choices=("cpu", "cuda"), default="cpu", help="ONNX Runtime provider (default cpu)")
    graphs = run.add_mutually_exclusive_group()
    graphs.add_argument("--cuda-graph", dest="cuda_graph", action="store_const", const=True, default=None,
                        help="replay each step as a CUDA graph, refused unless --provider cuda and every input shape of "
                             "the step graph is static (default: so on cuda when the shapes are static; -v says why not): "
                             "removes the host's per-node launch cost; every batch keeps the first one's shapes")
    graphs.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_const", const=False,
                        help="run each step node by node, also where a CUDA graph would be replayed by default")
    run.add_argument("--seed", type=int, default=0, metavar="N",
                    help="the starting dropout_seed of a step graph with training-mode Dropout (default 0; one "
                         "more each step, so a run is reproduced by its seed; a checkpoint restores it)")
    state.add_argument("--log", type=Path, metavar="LOG.jsonl", help="one JSON line per step: step, loss (and loss_scale)")
    state.add_argument("--out", type=Path, metavar="OUT.onnx", help="write the forward model with the trained weights")

    bn = sub.add_parser("bench", help="optimize a model under several policies and time them side by side on ORT")
    bn.add_argument("input", type=Path, help="fp32 ONNX model")
    timed = _group(bn, "policies and timing")
    timed.add_argument("--policies", default="fp32,fp16,amp,campo", metavar="P1,P2,...",
                    help=f"comma-separated policies of {', '.join(POLICIES)} (default fp32,fp16,amp,campo; fp32 is "
                         "always timed: it is the reference)")
    timed.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="ONNX Runtime provider (default cuda)")
    timed.add_argument("--execution", choices=EXECUTION_MODES, default="plain",
                    help="plain (node by node, default) or cuda-graph (captured once and replayed; --provider cuda); "
                         "the plans are costed for it too")
    _add_shape_options(bn, "The inputs of --inputs pin the dynamic dims nothing else pins")
    timed.add_argument("--inputs", type=Path, metavar="FILE.npz", help="inputs to run on (default: random)")
    timed.add_argument("--json", type=Path, metavar="FILE.json",
                    help='write the results as JSON (atomically): {"policies": {name: {"ms", "min_ms", "max_ms", '
                         '"q1_ms", "q3_ms", "blocks_ms", "speedup", "rel_err", "casts", ...}}, "provider", '
                         '"execution", "plan_options", ...}')
    timed.add_argument("--rounds", type=int, default=10, metavar="N",
                    help="rotation rounds: each times one block of every policy, in a rotated order (default 10)")
    timed.add_argument("--block-ms", type=float, default=20.0, metavar="MS",
                    help="a timed block lasts at least this long (default 20)")
    _add_cost_options(bn)  # every policy is optimized with them
    _add_experimental_option(bn)

    cost = sub.add_parser("costdb", help="measure, fit and evaluate a GPU cost database")
    cost_sub = cost.add_subparsers(dest="costdb_command", required=True)
    calibrate = cost_sub.add_parser(
        "calibrate", help="measure and fit a cost database for this machine's GPU (about 10 minutes; resumable); "
                          "optimize picks it up from then on")
    calibrate.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                           help="stop measuring after this many seconds (default 540) and fit what is measured; "
                                "the next run measures the cases left")
    calibrate.add_argument("--fresh", action="store_true",
                           help="discard the samples of earlier runs and measure everything again")
    calibrate.add_argument("--out", type=Path, metavar="DB.json",
                           help="write the database here instead of the user's cache folder (samples beside it); "
                                "optimize then needs --device-db to use it")
    calibrate.add_argument("--no-fused", action="store_true",
                           help="do not measure the FusedElementwise kernel (measured by default where the custom-op "
                                "library's CUDA kernels and NVRTC are here)")
    calibrate.add_argument("--where", action="store_true",
                           help="print where the database of this GPU is kept and whether it exists; measure nothing")
    measure = cost_sub.add_parser("measure", help="time single-op models on ONNX Runtime (appends, resumable)")
    measure.add_argument("--out", type=Path, required=True, metavar="SAMPLES.jsonl", help="samples file (JSON lines); existing samples are kept")
    measure.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="ONNX Runtime provider (default cuda)")
    measure.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                         help="stop after this many seconds (default 540); the next run resumes")
    measure.add_argument("--limit", type=int, metavar="N", help="measure at most this many samples")
    measure.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random part of the shape grid (default 0)")
    fit = cost_sub.add_parser("fit", help="fit a database from samples")
    fit.add_argument("samples", type=Path, help="samples file (JSON lines, from costdb measure)")
    fit.add_argument("out", type=Path, help="database JSON to write (e.g. costdb/data/nvidia-h200.json)")
    fit.add_argument("--holdout", type=float, default=0.2, metavar="SHARE",
                     help="share of each op type's cases held out of the fit and measured (default 0.2)")
    fit.add_argument("--min-samples", type=int, default=8, metavar="N",
                     help="op types with fewer paired fp32/fp16 cases are not fitted: the analytic model predicts "
                          "them (default 8)")
    step_dispatch = cost_sub.add_parser(
        "fit-step-dispatch", help="add the per-node host time of whole models and training steps, from benchmark "
                                  "rows (fp32 against fp32-graph), to a database")
    step_dispatch.add_argument("bench_rows", type=Path, help="the benchmark suite's rows (python -m onnxcampo.benchmarks run; e.g. docs/benchmarks/raw/h200.jsonl)")
    step_dispatch.add_argument("database", type=Path, help="database JSON to update (e.g. costdb/data/nvidia-h200.json)")
    step_dispatch.add_argument("--launches", type=Path, metavar="FILE.jsonl",
                               help="ORT launch counts for fp32 rows measured before the benchmark recorded them "
                                    "(python -m onnxcampo.benchmarks graph-factors --launches-out)")
    fused_cost = cost_sub.add_parser(
        "fit-fused-elementwise", help="add the FusedElementwise kernel's cost (bytes/us and fixed us, fitted by "
                                      "python -m onnxcampo.benchmarks fused-elementwise-costs on the GPU) to a database")
    fused_cost.add_argument("measured", type=Path, help="the measurement script's --out JSON")
    fused_cost.add_argument("database", type=Path, help="database JSON to update (e.g. costdb/data/nvidia-h200.json)")
    evaluate = cost_sub.add_parser("eval", help="accuracy of a database on its held-out samples")
    evaluate.add_argument("database", type=Path, help="database JSON (from costdb fit)")
    evaluate.add_argument("samples", type=Path, help="the samples file it was fitted from (its held-out cases are used)")
    evaluate.add_argument("--report", type=Path, metavar="FILE.md", help="markdown report to write")
    evaluate.add_argument("--png", type=Path, metavar="FILE.png", help="predicted-vs-measured plot to write (needs matplotlib)")

    for p in (opt, ins, bn, calibrate, measure, fit, step_dispatch, fused_cost, evaluate, tg, tr):
        common = _group(p, "common options")
        common.add_argument("-v", "--verbose", action="count", default=0, help="-v: info lines (optimizing: one per pass); -vv: debug lines")
        common.add_argument("--debug", action="store_true",
                            help="check graph invariants after every pass (optimizing); show tracebacks instead of "
                                 "one-line errors")
        _add_common_options(p)
    for p in (parser, cost):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    child.epilog = EPILOGS.get(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            _unrecognized(parser, args, extras)
    except SystemExit as exc:  # --help, --version, or a usage error (one line, printed already)
        return exc.code if isinstance(exc.code, int) else 2
    if args.quiet and args.verbose:
        print("onnxcampo: error: -q and -v exclude each other", file=sys.stderr)
        return 2
    if args.log_file is not None and not args.log_file.parent.is_dir():
        print(f"onnxcampo: error: --log-file {args.log_file}: folder {args.log_file.parent} does not exist", file=sys.stderr)
        return 2
    _configure_logging(args)
    try:
        with command_line(), _quiet(args.quiet):
            require_onnxruntime()  # not pinned by the core: onnxcampo[cpu] or onnxcampo[gpu]
            return _run(args)
    except CampoError as exc:
        print(f"onnxcampo: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - a bug: one line unless --debug
        if args.debug:
            raise
        print(f"onnxcampo: internal error: {exc.__class__.__name__}: {exc} (rerun with --debug for details)", file=sys.stderr)
        return 3


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """The usage error of the (sub)command given, naming the closest option of that command."""
    for name in (args.command, getattr(args, "costdb_command", None)):
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if name is None or action is None:
            break
        parser = action.choices[name]
    flags = [flag for action in parser._actions for flag in action.option_strings]
    unknown = next((extra.split("=")[0] for extra in extras if extra.startswith("-")), None)
    hint = did_you_mean(unknown, flags, cutoff=0.75) if unknown else ""
    if unknown and not hint and "--experimental" in flags:
        hint = _experimental_hint(unknown)
    parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def _experimental_hint(flag: str) -> str:
    """``--no-fuse-column-sums``, ``--cost-graph``: the ``--experimental`` setting of that name."""
    name = flag.lstrip("-")
    negated = name.startswith("no-")
    key = name.removeprefix("no-").replace("-", "_")
    if key not in ExperimentalOptions.names():
        return ""
    default = getattr(ExperimentalOptions(), key)
    value = "false" if negated else "true" if default is False else "VALUE"
    return f": {key} is an experimental option: --experimental {key}={value}"


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# timing candidates and benchmarks take a while: their info lines are shown without -v
PROGRESS_LOGGERS = {"tune": ("onnxcampo.tune",), "bench": ("onnxcampo.bench", "onnxcampo.runtime.timing")}


class OncePerRun(logging.Filter):
    """Passes each distinct warning or error once (distinct: another logger or another formatted
    message); lower levels pass. Every probe of the culprit search re-optimizes the model, and a
    model is read more than once: their warnings would repeat."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.getMessage())
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def _configure_logging(args: argparse.Namespace) -> None:
    """stderr: warnings and errors (-q too), each distinct one once, info with -v, debug with -vv,
    and the progress of --tune and bench unless -q; --log-file: every record, debug level,
    timestamped."""
    level = logging.WARNING if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    progress = () if args.quiet else (
        *(PROGRESS_LOGGERS["tune"] if getattr(args, "tune", None) else ()),
        *(PROGRESS_LOGGERS["bench"] if args.command == "bench" else ()))

    def shown(record: logging.LogRecord) -> bool:
        return record.levelno >= level or (record.levelno >= logging.INFO and any(
            record.name == name or record.name.startswith(name + ".") for name in progress))

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(LOG_FORMAT))
    console.addFilter(shown)
    console.addFilter(OncePerRun())
    handlers: list[logging.Handler] = [console]
    if args.log_file is not None:
        log_file = logging.FileHandler(args.log_file, mode="w", encoding="utf-8")
        log_file.setFormatter(logging.Formatter("%(asctime)s " + LOG_FORMAT))
        handlers.append(log_file)
    root = logging.DEBUG if args.log_file is not None else min(level, logging.INFO if progress else level)
    logging.basicConfig(level=root, handlers=handlers, force=True)


@contextlib.contextmanager
def _quiet(quiet: bool):
    """-q: the commands' own stderr lines (summaries, 'wrote', validation and progress lines)
    are dropped; the log handler keeps the real stderr, so warnings and errors still show."""
    if not quiet:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def _run(args: argparse.Namespace) -> int:
    if args.command == "optimize":
        from onnxcampo.runtime import isolated

        isolated.start(validate=args.validate)  # ORT's child process imports while the model is planned
        return _optimize(args)
    if args.command == "costdb":
        return _costdb(args)
    if args.command == "train-graph":
        return _train_graph(args)
    if args.command == "train":
        return _train(args)
    if args.command == "bench":
        return _bench(args)
    return _inspect(args)


def _optimize(args: argparse.Namespace) -> int:
    from onnxcampo import ir
    from onnxcampo.api import optimize

    config = _config(args)
    input_path = args.input if args.input.exists() else None
    output = ir.check_output_path(args.output, input_path)
    if args.report is not None:
        ir.check_output_path(args.report, input_path, taken=(output,))
    inputs = None
    if args.inputs and not (config.tune or config.activation_limit is not None or args.validate
                            or not args.no_accuracy_check):
        raise ConfigError("--inputs feeds --validate, the accuracy check, --tune or --activation-limit; none of them "
                          "is on")
    if args.fix and args.no_accuracy_check and not args.validate:
        raise ConfigError("--fix acts on a failed accuracy check: drop --no-accuracy-check or give --validate")
    if (config.tune or config.activation_limit is not None) and args.inputs:
        from onnxcampo.runtime import load_inputs_npz
        from onnxcampo.training.scaling import is_train_step
        from onnxcampo.training.step import step_spec

        model, _ = ir.read_model(args.input)
        # a training step is timed on its batch (and labels); weights and state come from the graph
        batch = step_spec(model).batch if is_train_step(model) else None
        inputs = load_inputs_npz(args.inputs, model, only=batch)
    started = time.perf_counter()
    result = optimize(args.input, config=config, inputs=inputs)
    with ir.StagedModel(output) as staged:  # the check runs the model written there, before the rename
        if args.validate or not args.no_accuracy_check:
            result = _check_accuracy(args, config, result, time.perf_counter() - started, inputs, staged=staged)
        if staged.model is not result.model:  # not checked, or --fix gave another
            staged.write(result.model, check_loads=result.changed)
        staged.commit()
    report = result.report
    if args.report:
        ir.write_text_atomically(args.report, json.dumps(report, indent=1) + "\n")
    print(summary(report, output), file=sys.stderr)
    return 0


NOTHING_CONVERTED = "nothing converted"
GUARD_MAX_BYTES = 1 << 30  # the accuracy check is skipped by default for larger models (two CPU runs)


def _check_accuracy(args: argparse.Namespace, config: OptimizeConfig, result, optimize_s: float = 0.0,
                    inputs=None, staged=None):
    """``--validate`` (a failure exits 1, nothing written) or the default accuracy check (a
    failure warns): both models once on the same inputs, judged by ``--tolerance``
    (:mod:`onnxcampo.accuracy`). On failure, under ``--validate`` or ``--fix``, the culprits are
    searched (each probe re-optimizes; a line gives the bound first), and with ``--fix`` the
    model that keeps them fp32 replaces ``result``; the default check never re-optimizes: it
    says what that search would cost. ``optimize_s``: how long the optimization took (about
    one probe's time); ``inputs``: what the optimization was given (--tune, --activation-limit),
    given to every probe too; ``staged``: the :class:`onnxcampo.ir.StagedModel` the result is
    written to, first (and test-loaded there). Returns the result to write."""
    from onnxcampo import accuracy_check as acc
    from onnxcampo.accuracy import Criterion
    from onnxcampo.runtime import load_inputs_npz

    criterion = Criterion.parse(args.tolerance)
    what = "validate" if args.validate else "accuracy check"
    report = result.report
    skipped = None if args.validate else _guard_skipped(args, config, result)
    if skipped:
        report["accuracy"] = {"skipped": skipped}
        if skipped != NOTHING_CONVERTED:
            print(f"onnxcampo: accuracy check skipped: {skipped}", file=sys.stderr)
        return result
    # the written model is first loaded in the child process (onnxcampo.runtime.isolated), as its
    # save does: an ONNX Runtime crash on it is one clear error, not the end of this process
    from onnxcampo import ir
    from onnxcampo.errors import WrittenModelLoadError
    from onnxcampo.runtime.check import check_loads

    def written() -> None:  # the test-load's verdict first: a model ORT cannot load is an error, not a figure
        if staged is not None:
            staged.wait()

    if staged is not None:  # written once, test-loaded from the file it is renamed from, while the reference runs
        staged.write(result.model, background=True)
    else:
        try:
            check_loads(result.model, label=str(args.output))
        except WrittenModelLoadError as exc:
            raise WrittenModelLoadError(f"{exc}; nothing was written") from exc.__cause__
    original, _ = ir.read_model(args.input)  # names that are not UTF-8 escaped as the plan saw them
    if args.validate:
        provider, execution = args.provider, config.execution if args.provider != "reference" else "plain"
    else:  # the fp32 model on ORT's CPU provider; the written one on the reference evaluator where quick
        provider, execution = "cpu", "plain"
    feeds = load_inputs_npz(args.inputs, original) if args.inputs else None
    inputs_text = f"{'the inputs of ' + str(args.inputs) if feeds is not None else 'generated inputs'}"
    dims, batch_one = config.dim_values, []
    if not args.validate and feeds is None:  # the quick check: batch 1 where the batch is dynamic
        dims, batch_one = acc.batch_one_dims(original, config.input_shapes, config.dim_values)
        if batch_one:
            inputs_text += f" at {', '.join(f'{name}=1' for name in batch_one)} (--validate checks the planned shapes)"
    try:
        ref = acc.reference(original, feeds=feeds, source=args.input, provider=provider, execution=execution,
                            input_shapes=config.input_shapes, dim_values=dims, path=args.input)
        if not args.validate and not (acc.small_enough_for_reference(original, ref.run_seconds)
                                      or acc.small_enough_for_reference(result.model)):
            provider = "reference"  # it computes fp16 nodes in fp16, which ORT's CPU provider does not
        where = ("ONNX Runtime cpu (fp32) and the ONNX reference evaluator (written)" if provider == "reference"
                 and not args.validate else "the ONNX reference evaluator" if provider == "reference"
                 else f"ONNX Runtime {provider}")
        announce = f"onnxcampo: {what}: the fp32 and the written model on {where}, {inputs_text} ({criterion.describe()})"
    except acc.ReferenceError as exc:
        written()
        if args.validate:
            raise
        report["accuracy"] = {"skipped": str(exc)}
        print(f"onnxcampo: warning: accuracy check skipped: {exc}", file=sys.stderr)
        return result
    except CampoError as exc:  # dynamic dims nothing pins, and the like
        written()
        if args.validate:
            raise
        report["accuracy"] = {"skipped": str(exc)}
        print(f"onnxcampo: accuracy check skipped: {exc}", file=sys.stderr)
        return result
    written()
    print(announce, file=sys.stderr)
    try:
        try:
            outputs = _run_written(result, ref, staged, provider=provider, execution=execution)
        except CampoError as exc:
            if args.validate or provider != "reference":
                raise
            print(f"onnxcampo: {what}: {str(exc).splitlines()[0]}; running the written model on ONNX Runtime cpu",
                  file=sys.stderr)
            provider = "cpu"
            outputs = _run_written(result, ref, staged, provider=provider, execution=execution)
    except CampoError as exc:
        if args.validate:
            raise
        # the written model is test-loaded when saved, and that names the fault
        report["accuracy"] = {"skipped": f"the written model did not run: {str(exc).splitlines()[0]}"}
        print(f"onnxcampo: warning: accuracy check skipped: {report['accuracy']['skipped']}", file=sys.stderr)
        return result
    verdict = acc.evaluate(ref.outputs, outputs, criterion, inputs=ref.inputs)
    elementwise = _elementwise(args, ref.outputs, outputs)
    for line in _verdict_lines(verdict, elementwise):
        print(f"  {what} {line}", file=sys.stderr)
    entry = {**verdict.to_json(), "provider": provider, **({"reference_notes": ref.notes} if ref.notes else {}),
             **({"dims": {name: 1 for name in batch_one}} if batch_one else {})}
    if elementwise is not None:
        entry["elementwise"] = [{"name": d.name, "ok": bool(d.ok), "max_abs_err": d.max_abs_err,
                                 "max_rel_err": d.max_rel_err} for d in elementwise]
    ok = verdict.ok and all(d.ok for d in elementwise or ())
    if args.validate:
        report["validation"] = _validation_rows(entry["outputs"], criterion)
    report["accuracy"] = entry
    if ok:
        return result
    needed = verdict.needed_text()
    parts = [o.failure(criterion) for o in verdict.failed]
    parts += [f"{d.name} elements beyond --rtol/--atol (max abs {d.max_abs_err:.3g})"
              for d in elementwise or () if not d.ok]
    figures = f"outputs differ beyond the tolerance ({criterion.describe()}): {'; '.join(parts)}"
    culprits = None
    # the search judges by the criterion: an element-wise failure alone is not searched
    searchable = config.policy != "fp32" and not verdict.ok
    # the probes plan without --tune: this optimization's time is no measure of theirs then
    probe_s = None if config.tune else optimize_s
    if searchable and (args.fix or args.validate):
        culprits = acc.find_culprits(args.input, config, ref, criterion, result, provider=provider,
                                     execution=execution, inputs=inputs, probe_seconds=probe_s,
                                     progress=lambda line: print(f"onnxcampo: {line}", file=sys.stderr))
        entry["culprits"] = culprits.to_json()
    search = None
    if searchable and not (args.fix or args.validate):
        fp16_count = len(acc.fp16_nodes(result))
        bound = acc.max_reoptimizations(fp16_count)
        search = (f"--validate or --fix searches the nodes responsible: a bisection of the {fp16_count} fp16 "
                  f"nodes, {acc.search_cost(bound, probe_s)}")
        entry["culprits"] = {"searched": False, "why": "the default check runs the written model once and never "
                             f"re-optimizes; {search}", "max_reoptimizations": bound,
                             "reoptimization_s": None if probe_s is None else round(probe_s, 2)}
    if args.fix and culprits is not None and culprits.ok and culprits.result is not None:
        fixed = culprits.result
        fixed.report["accuracy"] = {**culprits.verdict.to_json(), "provider": provider, "fixed": True,
                                    "before": {k: v for k, v in entry.items() if k != "culprits"},
                                    "culprits": culprits.to_json()}
        if args.validate:
            fixed.report["validation"] = _validation_rows(fixed.report["accuracy"]["outputs"], criterion)
        fixed.report.setdefault("notes", []).append(
            f"--fix: kept fp32 {len(culprits.nodes)} nodes so that the model passes {criterion.describe()}: "
            f"{', '.join(culprits.nodes)} ({culprits.verdict.summary()})")
        print(f"onnxcampo: --fix: kept fp32 {', '.join(culprits.nodes)}; {culprits.verdict.summary()} "
              f"({culprits.probes} re-optimizations, {culprits.seconds:.1f} s)", file=sys.stderr)
        return fixed
    blame = _blame(culprits)
    advice = (f"loosen --tolerance (--tolerance {needed} would pass)" if needed else "loosen --tolerance") + \
        ("" if args.fix or culprits is None or not culprits.nodes else ", or --fix to keep the culprits fp32")
    if verdict.ok:  # only the element-wise check failed
        advice = "loosen --rtol/--atol"
    if args.validate:
        raise ValidationError(f"{figures}{blame}; nothing written ({advice})")
    warning = f"the written model's {figures}{blame} ({advice}, or --exclude-node)"
    report.setdefault("notes", []).append(f"accuracy check: {warning}")
    print(f"onnxcampo: warning: {warning}", file=sys.stderr)
    if search is not None:
        print(f"onnxcampo: accuracy check: {search}", file=sys.stderr)
    return result


def _run_written(result, ref, staged, *, provider: str, execution: str):
    """The written model's outputs on the reference's feeds (``accuracy_check.run_candidate``); on
    ONNX Runtime from the file it was written to (``staged``), not serialized once more."""
    from onnxcampo import accuracy_check as acc

    path = staged.path if staged is not None and staged.model is result.model else None
    if path is None or provider == "reference":
        return acc.run_candidate(result.model, ref, provider=provider, execution=execution)
    from onnxcampo.runtime import feeds_for

    return acc.run_model(str(path), feeds_for(result.model, ref.feeds), provider=provider, execution=execution)


def _validation_rows(outputs: list[dict], criterion) -> list[dict]:
    """The report's ``validation`` rows: the statistics plus the keys they always had."""
    return [{**row, "error": row.get("rel_l2", row.get("mismatch")),
             "measure": "rel_l2" if "rel_l2" in row else "mismatch", "tolerance": str(criterion),
             "max_abs_err": row.get("max_abs"), "max_rel_err": row.get("max_rel")} for row in outputs]


def _guard_skipped(args: argparse.Namespace, config: OptimizeConfig, result) -> str | None:
    """Why the default accuracy check does not run, or ``None``."""
    from onnxcampo.training.scaling import is_train_step

    if not result.changed or config.policy == "fp32" or not result.report.get("nodes_fp16"):
        return NOTHING_CONVERTED
    if is_train_step(result.model):
        return "a training step (its outputs are updated weights; check with onnxcampo train)"
    size = args.input.stat().st_size if args.input.exists() else 0
    if size > GUARD_MAX_BYTES and args.inputs is None:
        return (f"the model is {size / 2**30:.1f} GiB: two CPU runs would take long; give --validate (or --inputs) "
                "to check it")
    return None


def _elementwise(args: argparse.Namespace, reference, outputs):
    """``--rtol`` / ``--atol``: the element-wise report, or ``None`` when neither is given."""
    if args.rtol is None and args.atol is None:
        return None
    from onnxcampo.runtime.compare import ELEMENTWISE_ATOL, ELEMENTWISE_RTOL, compare_outputs

    return compare_outputs(reference, outputs, rtol=ELEMENTWISE_RTOL if args.rtol is None else args.rtol,
                           atol=ELEMENTWISE_ATOL if args.atol is None else args.atol)


def _verdict_lines(verdict, elementwise) -> list[str]:
    lines = []
    diffs = {d.name: d for d in elementwise or ()}
    for output in verdict.outputs:
        line = output.line(verdict.criterion)
        diff = diffs.get(output.name)
        if diff is not None:
            line += (f"; element-wise |out - ref| <= atol + rtol |ref| {'holds' if diff.ok else 'FAILS'} "
                     f"(max abs {diff.max_abs_err:.3g})")
        lines.append(line)
    return lines


def _blame(culprits) -> str:
    if culprits is None:
        return ""
    if culprits.nodes:
        return (f"; the nodes most responsible (bisection, {culprits.probes} re-optimizations): "
                f"{', '.join(culprits.nodes[:8])}{' ...' if len(culprits.nodes) > 8 else ''}")
    return f"; {culprits.note}" if culprits.note else ""


def _bench(args: argparse.Namespace) -> int:
    from onnxcampo import ir
    from onnxcampo.bench import bench, write_json

    if args.json is not None:
        ir.check_output_path(args.json, args.input if args.input.exists() else None)
    result = bench(args.input, policies=args.policies, provider=args.provider, execution=args.execution,
                   input_shapes=dict(parse_input_shape(text) for text in args.input_shape),
                   dim_values=dict(parse_dim_value(text) for text in args.dim), inputs=args.inputs,
                   rounds=args.rounds, block_ms=args.block_ms,
                   config=OptimizeConfig(**_cost_fields(args)))
    print(result.table())
    if args.json is not None:
        write_json(result, args.json)
        print(f"onnxcampo: wrote {args.json}", file=sys.stderr)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import re

    from onnxcampo import ir
    from onnxcampo.api import optimize
    from onnxcampo.plan_html import write_html
    from onnxcampo.plan_view import filter_rows, node_rows, table

    if args.name is not None:
        try:
            re.compile(args.name)
        except re.error as exc:
            raise ConfigError(f"--name {args.name!r} is no regular expression: {exc}") from None
    if args.html is not None:
        ir.check_output_path(args.html, args.input if args.input.exists() else None)
    result = optimize(args.input, config=_config(args))
    rows = filter_rows(node_rows(result.report), ops=args.op, precision=args.precision, name=args.name)
    if args.json:
        print(json.dumps({**result.report, "nodes": [row.to_json() for row in rows]}, indent=1))
    else:
        print(summary(result.report, None))
        if args.nodes or args.op or args.precision or args.name:
            print(table(rows))
    if args.html is not None:
        write_html(args.html, result.model, result.report, title=args.input.name)
        print(f"onnxcampo: wrote {args.html}", file=sys.stderr)
    return 0


def _train_graph(args: argparse.Namespace) -> int:
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


MAX_SKIPPED_STEPS = 20  # non-finite losses in a row tolerated while the loss scale comes down


def _train(args: argparse.Namespace) -> int:
    import numpy as np

    from onnxcampo import ir
    from onnxcampo.training import Trainer, initial_weights
    from onnxcampo.training.batches import input_specs
    from onnxcampo.training.data import NpzBatches, dropped_text
    from onnxcampo.training.step import step_spec
    from onnxcampo.training.schedules import parse_schedule

    if not args.data.exists():
        raise ConfigError(f"{args.data}: no such file or folder")
    if args.steps <= 0:
        raise ConfigError("--steps must be positive")
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
    lines = []
    bad = 0  # non-finite losses in a row: dynamic loss scaling skips such steps, a few are fine
    first = trainer.steps  # 0, or the checkpoint's step count
    last = first + args.steps
    for index in range(first, last):  # global step numbers: a resumed run continues the batches and the schedule
        batch = batches[index]
        if schedule is not None:
            trainer.lr = schedule(index)
        loss = trainer.step(batch)
        scale = trainer.loss_scale
        lines.append(json.dumps({"step": index + 1, "loss": loss, **({"lr": trainer.lr} if schedule else {}),
                                 **({"loss_scale": scale} if scale else {})}))
        bad = 0 if np.isfinite(loss) else bad + 1
        if bad > (MAX_SKIPPED_STEPS if scale else 0):
            raise ValidationError(f"the loss is {loss} at step {index + 1}: training diverged")
        if (index + 1 - first) % max(1, args.steps // 20) == 0 or index + 1 == last:
            shown = f", loss scale {scale:g}" if scale else ""
            print(f"\rstep {index + 1}/{last}: loss {loss:.5g}{shown}   ", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if args.log:
        ir.write_text_atomically(args.log, "\n".join(lines) + "\n")
    if args.save_checkpoint:
        trainer.save_checkpoint(args.save_checkpoint)
        print(f"onnxcampo: wrote checkpoint {args.save_checkpoint} (step {trainer.steps})", file=sys.stderr)
    if args.out:
        ir.save_model(trainer.export(args.forward), args.out)
        print(f"onnxcampo: wrote {args.out}", file=sys.stderr)
    return 0


def _calibrate_costdb(args: argparse.Namespace) -> int:
    from onnxcampo.costdb import calibrate, select

    if args.where:
        gpu = select.detected_gpu()
        if gpu is None:
            raise ConfigError("no NVIDIA GPU found here (ONNXCAMPO_DEVICE=none, or neither the CUDA driver nor "
                              "nvidia-smi answered)")
        path = select.user_database_path(gpu)
        state = "exists" if path.is_file() else "absent: onnxcampo costdb calibrate writes it"
        shipped = select.shipped_database(gpu)
        print(f"{path} ({state}); shipped for {gpu}: {shipped.name if shipped else 'none'}")
        return 0
    try:
        result = calibrate.calibrate(budget_s=args.budget_s, fresh=args.fresh, out=args.out,
                                     fused=False if args.no_fused else None)
    except KeyboardInterrupt:
        print("onnxcampo: interrupted: the samples measured so far are kept; run the command again to resume",
              file=sys.stderr)
        return 130
    return 0 if result.database is not None else 130


def _costdb(args: argparse.Namespace) -> int:
    if args.costdb_command == "calibrate":
        return _calibrate_costdb(args)
    if args.costdb_command == "measure":
        from onnxcampo.costdb.measure import measure

        measure(args.out, provider=args.provider, budget_s=args.budget_s, seed=args.seed, limit=args.limit)
        return 0
    if args.costdb_command == "fit":
        from onnxcampo.costdb.fit import fit_file

        database = fit_file(args.samples, args.out, holdout=args.holdout, min_samples=args.min_samples)
        summary_ = database["summary"]
        print(f"onnxcampo: wrote {args.out}: {len(database['ops'])} op types fitted "
              f"({', '.join(sorted(database['ops']))}), analytic fallback for "
              f"{', '.join(database.get('fallback_ops', [])) or 'none'}; held-out MAPE "
              f"{100 * (summary_.get('holdout_mape') or 0):.1f} %, wrong decisions "
              f"{100 * (summary_.get('wrong_decision_rate') or 0):.2f} %", file=sys.stderr)
        return 0
    if args.costdb_command == "fit-step-dispatch":
        from onnxcampo.costdb.fit import add_step_dispatch

        for key, entry in add_step_dispatch(args.bench_rows, args.database, args.launches).items():
            if key == "run_overhead":
                print(f"onnxcampo: wrote {args.database}: {key} {entry['us']} us per run (the fastest of "
                      f"{entry['samples']} replayed runs: {entry['model']})", file=sys.stderr)
            elif key == "host_launch":
                launch = entry["inference"]
                print(f"onnxcampo: wrote {args.database}: {key} {launch['conv']} us a conv launch, {launch['other']} "
                      f"us any other, {launch['host']} (from {launch['samples']} models; leave-one-model-out error "
                      f"of the plain runs: {launch['leave_one_model_out_error']})", file=sys.stderr)
            else:
                print(f"onnxcampo: wrote {args.database}: {key} {entry['us']} us per node "
                      f"(from {entry['samples']} models: {entry['per_model_us']})", file=sys.stderr)
        return 0
    if args.costdb_command == "fit-fused-elementwise":
        from onnxcampo.costdb.fit import merge_fused_elementwise

        entry = merge_fused_elementwise(args.database, args.measured)
        print(f"onnxcampo: wrote {args.database}: fused_elementwise {entry['bytes_per_us']:.0f} bytes/us, "
              f"{entry['fixed_us']} us fixed", file=sys.stderr)
        return 0
    from onnxcampo.costdb.evaluate import evaluate, markdown, write_report
    from onnxcampo.costdb.fit import load_samples
    from onnxcampo.costdb.regression import RegressionCostModel

    database = RegressionCostModel.load(args.database).database
    result = evaluate(database, load_samples(args.samples))
    if args.report:
        written = write_report(result, args.report, args.png)
        if written.get("png_skipped"):
            print(f"onnxcampo: no plot: {written['png_skipped']}", file=sys.stderr)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
