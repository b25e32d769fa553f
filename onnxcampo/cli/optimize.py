"""``onnxcampo optimize``: the mixed fp16/fp32 model written, checked for accuracy against the
fp32 model first."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from onnxcampo.cli.options import EXAMPLE, add_model_argument, add_plan_options, config_from_args, examples, group
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import CampoError, ConfigError, ValidationError
from onnxcampo.report import summary

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

