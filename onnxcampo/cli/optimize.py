"""``onnxcampo optimize``: the mixed fp16/fp32 model written, checked for accuracy against the
fp32 model first."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from onnxcampo.cli.options import EXAMPLE, add_model_argument, add_plan_options, config_from_args, examples, group
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import ConfigError, ModelLoadError, ValidationError, WrittenModelLoadError
from onnxcampo.report import summary

if TYPE_CHECKING:
    from onnxcampo.accuracy.guard import AccuracyCheck

EPILOGS = {"optimize": examples(
    f"onnxcampo optimize {EXAMPLE} out.onnx --input-shape x:16384,256 --validate",
    "onnxcampo optimize model.onnx out.onnx --dim batch=32 --exclude-op Softmax --report r.json",
    "onnxcampo optimize model.onnx out.onnx --dim batch=8 --tune cuda --execution cuda-graph")}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    opt = sub.add_parser("optimize", epilog=EPILOGS["optimize"], help="write a mixed fp16/fp32 model")
    add_model_argument(opt)
    opt.add_argument("output", type=Path, help="where to write the optimized model (written atomically)")
    add_plan_options(opt)
    out = group(opt, "report and validation")
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
    out.add_argument("--inputs", type=Path, metavar="FILE.npz|FILE.json|FOLDER",
                      help="inputs for --validate, the accuracy check, --tune and --activation-limit: an .npz, a "
                           "Polygraphy JSON file of feed sets (polygraphy run --save-inputs) or a folder of such "
                           "files; --validate and the accuracy check run every set until one fails, --tune and "
                           "--activation-limit take the first (default: "
                           "generated: floats standard normal, images [N,C,H,W] or [N,H,W,C] of 1, 3 or 4 channels "
                           "smooth random images, integers in [0, 8), *mask* ones, token_type_ids zeros, "
                           "position_ids 0..n-1, sr 16000)")
    out.add_argument("--tolerance", default=None, metavar="CRITERION",
                      help="the accuracy criterion of --validate, the accuracy check and --tune, per output: a "
                           "number (a bound on the relative L2 error ||out - ref|| / ||ref||) or bounds "
                           "STAT=VALUE,... on mean_abs, median_abs, p99_abs, max_abs, mean_rel, median_rel, p99_rel, "
                           "max_rel, rel_l2 (float outputs) and mismatch (share of integer elements that differ); "
                           "OUTPUT:STAT=VALUE or OUTPUT:NUMBER judges one output by its own bounds instead "
                           "(e.g. 0.01,boxes:max_abs=0.5); "
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
    return [opt]


def run(args: argparse.Namespace) -> int:
    from onnxcampo.runtime import isolated

    isolated.start(validate=args.validate)  # ORT's child process imports while the model is planned
    return _optimize(args)


def _optimize(args: argparse.Namespace) -> int:
    from onnxcampo import ir
    from onnxcampo.api import optimize

    config = config_from_args(args)
    input_path = args.input if args.input.exists() else None
    output = ir.check_output_path(args.output, input_path)
    if args.report is not None:
        ir.check_output_path(args.report, input_path, taken=(output,))
    if args.inputs and not (config.tune or config.activation_limit is not None or args.validate
                            or not args.no_accuracy_check):
        raise ConfigError("--inputs feeds --validate, the accuracy check, --tune or --activation-limit; none of them "
                          "is on")
    if args.fix and args.no_accuracy_check and not args.validate:
        raise ConfigError("--fix acts on a failed accuracy check: drop --no-accuracy-check or give --validate")
    inputs = _optimization_inputs(args, config)
    try:
        with ir.StagedModel(output) as staged:  # the check runs the model written there, before the rename
            try:
                result = optimize(args.input, config=config, inputs=inputs, accuracy=_accuracy(args, staged))
            except ValidationError as exc:
                if args.report and exc.report is not None:  # the failed check's figures, for the record
                    ir.write_text_atomically(args.report, json.dumps(exc.report, indent=1) + "\n")
                raise
            if staged.model is not result.model:  # not checked, or --fix gave another
                staged.write(result.model, check_loads=result.changed)
            staged.commit()
    except WrittenModelLoadError as exc:
        _blame_the_input_if_it_fails_too(args.input, exc)
        raise
    report = result.report
    if args.report:
        ir.write_text_atomically(args.report, json.dumps(report, indent=1) + "\n")
    print(summary(report, output), file=sys.stderr)
    return 0


def _blame_the_input_if_it_fails_too(source: Path, error: WrittenModelLoadError) -> None:
    """The written model does not load in ONNX Runtime: when the input does not either, the
    problem is the input's (an op this onnxruntime has no kernel for, say): one user error naming
    it (exit 2), not an internal one about the output."""
    from onnxcampo.runtime.check import check_loads

    label = "the input model"  # check_loads' message starts with it: "<label>: ONNX Runtime ... cannot load ..."
    try:
        check_loads(source, label=label)
    except WrittenModelLoadError as input_error:
        why = str(input_error).removeprefix(f"{label}: ")
        raise ModelLoadError(f"{source}: the input model does not load in ONNX Runtime either ({why}); "
                             "onnxcampo writes only models ONNX Runtime loads: nothing was written") from error
    except Exception:  # noqa: BLE001 - the input's own check failed otherwise: the written model's error stands
        return


def _optimization_inputs(args: argparse.Namespace, config: OptimizeConfig):
    """``--inputs`` as optimize()'s ``inputs``: what --tune times and --activation-limit calibrates on."""
    if not ((config.tune or config.activation_limit is not None) and args.inputs):
        return None
    from onnxcampo import ir
    from onnxcampo.runtime import load_input_sets
    from onnxcampo.training.scaling import is_train_step
    from onnxcampo.training.step import step_spec

    model, _ = ir.read_model(args.input)
    # a training step is timed on its batch (and labels); weights and state come from the graph
    batch = step_spec(model).batch if is_train_step(model) else None
    return load_input_sets(args.inputs, model, only=batch)[0][0]  # the first set


def _accuracy(args: argparse.Namespace, staged) -> AccuracyCheck:
    """optimize()'s ``accuracy``: ``--validate`` (with ``--fix``: fixed on failure), ``--fix``,
    ``--no-accuracy-check`` or the default report; checked from the output's temporary file, the
    lines on stderr."""
    from onnxcampo.accuracy.guard import AccuracyCheck

    if args.validate:
        mode = "validate"
    elif args.no_accuracy_check:
        mode = "off"
    else:
        mode = "fix" if args.fix else "report"
    return AccuracyCheck(mode, tolerance=args.tolerance, provider=args.provider, inputs=args.inputs, rtol=args.rtol,
                         atol=args.atol, fix=args.fix, staged=staged, progress=_stderr)


def _stderr(line: str, level: int) -> None:
    print(line, file=sys.stderr)
