"""The argument groups the commands share, and the :class:`~onnxcampo.config.OptimizeConfig`
they make: the input shapes and dims, the precision plan, the cost model and fusions, the
experimental switches, the provider, and the common options (``-q``, ``--log-file``, ``-v``,
``--debug``). A command module adds its own arguments and calls these for the rest."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from onnxcampo.config import (EXECUTION_MODES, FUSE_MODES, POLICIES, TUNE_PROVIDERS, ExperimentalOptions,
                              OptimizeConfig, parse_dim_value, parse_experimental, parse_input_shape)


class Parser(argparse.ArgumentParser):
    """No abbreviated options (``--input-shap`` is an error, not ``--input-shape``); a usage
    error is one line on stderr, exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)  # epilogs keep their lines
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        where = "" if self.prog == "onnxcampo" else f"{self.prog}: "  # the command named once
        self.exit(2, f"onnxcampo: error: {where}{_command_hint(message)} ({self.prog} --help lists the options)\n")


def _command_hint(message: str) -> str:
    """argparse's "invalid choice: 'optimise' (choose from ...)" with the closest choice named."""
    import re

    from onnxcampo.errors import did_you_mean

    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found.group(2)) or [c.strip() for c in found.group(2).split(",")]
    return message + did_you_mean(found.group(1), choices, cutoff=0.6)


def group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The parser's argument group of this title (made on first use), as ``--help`` shows it."""
    for existing in parser._action_groups:
        if existing.title == title:
            return existing
    return parser.add_argument_group(title)


def examples(*lines: str) -> str:
    """A command's epilog: the examples ``--help`` ends with."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


EXAMPLE = "onnxcampo/examples/mlp_block.onnx"


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model a command reads (``optimize``, ``inspect``, ``bench``)."""
    parser.add_argument("input", type=Path, help="fp32 ONNX model")


def add_provider_option(container, default: str) -> None:
    """``--provider``, the ONNX Runtime provider a command runs on (``bench``, ``train``, ``costdb measure``)."""
    other = "cpu" if default == "cuda" else "cuda"
    container.add_argument("--provider", choices=(default, other), default=default,
                           help=f"ONNX Runtime provider (default {default})")


def add_verbosity_options(parser: argparse.ArgumentParser) -> None:
    """``-v`` and ``--debug``, every command's."""
    common = group(parser, "common options")
    common.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: info lines (optimizing: one per pass); -vv: debug lines")
    common.add_argument("--debug", action="store_true",
                        help="check graph invariants after every pass (optimizing); show tracebacks instead of "
                             "one-line errors")

def add_common_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``-q`` and ``--log-file``, given before or after the subcommand (a subcommand's copy sets
    them only when given, so it does not undo the program's)."""
    common = group(parser, "common options")
    default = {} if top else {"default": argparse.SUPPRESS}
    common.add_argument("-q", "--quiet", action="store_true", **({"default": False} if top else default),
                        help="warnings and errors only: no progress, summaries or 'wrote' lines on stderr (what a "
                             "command prints on stdout, inspect's plan or bench's table, stays)")
    common.add_argument("--log-file", type=Path, metavar="FILE", **({"default": None} if top else default),
                        help="also write the full log (debug level, timestamped, whatever -v or -q) to FILE")


def add_shape_options(parser: argparse.ArgumentParser, inputs_pin: str) -> None:
    """``inputs_pin``: when the inputs of ``--inputs`` pin the dims no option pins."""
    shapes = group(parser, "input shapes")
    shapes.add_argument("--input-shape", action="append", default=[], metavar="NAME:D0,D1,...",
                        help="pin a dynamic input's shape for cost estimation and runs (repeatable); campo needs "
                             "the sizes. " + inputs_pin)
    shapes.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE",
                        help="pin a named dynamic dim (e.g. batch=8) wherever it occurs (repeatable; NAME is one of "
                             "the model's symbolic dims, another is an error naming the closest)")


def add_plan_options(parser: argparse.ArgumentParser) -> None:
    plan = group(parser, "precision plan")
    plan.add_argument("--policy", choices=POLICIES, default="campo",
                        help="campo (default): cost-aware, the four passes; amp: TensorFlow-AMP-style greedy "
                             "painting with a Cast at every boundary (the paper's baseline); fp16: every op that may "
                             "run fp16; fp32: nothing converted")
    add_shape_options(parser, "The written model keeps its dynamic shapes. With --tune or --activation-limit, "
                               "the inputs of --inputs (optimize) pin the dynamic dims nothing else pins")
    timing = group(parser, "timing and tuning")
    custom = group(parser, "custom ops (need the library: python -m onnxcampo.ops.build)")
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
    add_cost_options(parser)
    _add_custom_op_switch(custom, "--fuse-elementwise",
                          "after the plan: chains of elementwise ops, their Casts and the Conv/Gemm biases they "
                          "read included, as ai.onnxcampo FusedElementwise nodes, one kernel each, and a training "
                          "step's weight Casts as one MultiTensorCast (needs the custom-op library; docs/ops.md). "
                          "Default, where the library's CUDA kernels and NVRTC are (onnxruntime-gpu): on for a "
                          "training step built with the fused ops, by predicted cost for an inference model (on "
                          "when the plan is predicted --min-gain faster with it, in the --execution mode); off "
                          "elsewhere, with one line saying why")
    _add_custom_op_switch(custom, "--fuse-reductions",
                          "after the plan: a cross-entropy loss and its gradient as ai.onnxcampo "
                          "SoftmaxCrossEntropy(Grad) nodes (one pass over the logits each), layer-norm and softmax "
                          "input gradients as LayerNormGrad / SoftmaxGrad nodes, and ReduceSums over "
                          "leading/trailing blocks of axes (bias, LayerNorm and Conv-bias gradients), with the "
                          "Reshapes and float16->float32 Casts around them, as BlockReduceSum nodes, one kernel "
                          "each (needs the custom-op library; docs/ops.md). Default: as --fuse-elementwise's, where "
                          "the library's CUDA kernels are")
    _add_custom_op_switch(custom, "--channels-last",
                          "after the plan, before the fusions: store the 2-D convolutions' activations "
                          "channels-last (NHWC) and run the convolutions and their gradients as ai.onnxcampo "
                          "ConvNhwc / ConvNhwcDataGrad / ConvNhwcWeightGrad nodes (cuDNN's NHWC kernels, no layout "
                          "transform around each; needs the custom-op library; docs/ops.md). Convolutions whose "
                          "channels are not multiples of 8 stay NCHW. Default: as --fuse-elementwise's, where the "
                          "library's CUDA kernels are (the prediction counts the layout transforms it removes, the "
                          "Transposes it adds and each NHWC convolution call's host time)")
    add_experimental_option(parser)


def _add_custom_op_switch(custom: argparse._ArgumentGroup, flag: str, text: str) -> None:
    """``flag`` and its ``--no-`` form, a rewrite of the custom ops switched on or off; given
    neither, None: the default decided where the library is (docs/ops.md)."""
    custom.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)


def add_cost_options(parser: argparse.ArgumentParser) -> None:
    """How plans are costed and what the graph looks like before planning: options of
    ``optimize`` and ``inspect`` that ``bench`` passes to every policy too."""
    cost = group(parser, "cost model and graph fusion")
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


def add_experimental_option(parser: argparse.ArgumentParser) -> None:
    """``--experimental KEY=VALUE``: :class:`~onnxcampo.config.ExperimentalOptions`, the switches
    kept for A/B measurements and development, apart from the product's options."""
    defaults = ", ".join(f"{name}={_text(value)}" for name, value in dataclasses.asdict(ExperimentalOptions()).items())
    group(parser, "experimental").add_argument(
        "--experimental", action="append", default=[], metavar="KEY=VALUE",
        help="set one of the switches kept for A/B measurements and development (repeatable; VALUE read as the "
             "option's type: true/false, an integer or a word; docs/guide/cli.md says what each switches). The "
             f"options and their defaults: {defaults}")


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def cost_fields(args: argparse.Namespace) -> dict:
    """The OptimizeConfig fields of :func:`add_cost_options` and :func:`add_experimental_option`
    (``--debug`` sets ``check_invariants``)."""
    experimental = dict(parse_experimental(text) for text in args.experimental)
    if args.debug:
        experimental["check_invariants"] = True
    return dict(device_db=args.device_db, fuse=args.fuse, num_heads=args.num_heads, hidden_size=args.hidden_size,
                experimental=experimental)


def config_from_args(args: argparse.Namespace) -> OptimizeConfig:
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
        **cost_fields(args),
    )

