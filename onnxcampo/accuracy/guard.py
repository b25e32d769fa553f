"""The accuracy guard of :func:`onnxcampo.optimize`: the optimized model against the fp32 one.

``optimize(..., accuracy=...)`` takes a mode or an :class:`AccuracyCheck`:

1. ``"report"`` (the default): both models run once on the same inputs (given, else generated;
   batch 1 where the batch is dynamic and no input pins it), the fp32 one on ONNX Runtime's CPU
   provider, the optimized one on the ONNX reference evaluator where that is quick (it computes
   fp16 nodes in fp16), else on ONNX Runtime's CPU provider; judged by the criterion of
   :mod:`onnxcampo.accuracy`. The verdict is the report's ``accuracy`` entry; a failure is a
   warning and a note, never an error, and nothing is re-optimized: the entry says what the
   search of the nodes responsible would take.
2. ``"validate"``: the same at the planned shapes, on ``provider``; a failure searches the nodes
   responsible (:func:`onnxcampo.accuracy.check.find_culprits`, each probe re-optimizing) and
   raises :class:`~onnxcampo.errors.ValidationError`. The report also gets ``validation`` rows.
3. ``"fix"``: report's check; on failure the search, and the optimization that keeps the
   culprits fp32 is returned when it passes (``AccuracyCheck("validate", fix=True)``:
   validate's check, fixed the same way; it raises when the fix does not pass).
4. ``"off"``: no check.

The check is skipped (``{"skipped": why}``) where nothing was converted, for a training step,
and in report mode for a model over 1 GiB without given inputs. The optimized model is
test-loaded in ONNX Runtime before it runs there (:func:`onnxcampo.runtime.check.check_loads`, in
a child process: a crash there is an error, not the end of this process). With
``AccuracyCheck(staged=...)`` (the command line's output file, :class:`onnxcampo.ir.StagedModel`)
it is written there first and test-loaded from that file on a thread while the fp32 reference
runs, and run from the file; otherwise the check runs in memory and writes nothing.

The lines the check says (what runs where, one per output, warnings, the search's progress) go to
``AccuracyCheck.progress`` (the command line prints them on stderr) or else to the
``onnxcampo.accuracy`` logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from onnxcampo.errors import CampoError, ValidationError, on_command_line

log = logging.getLogger("onnxcampo.accuracy")

MODES = ("report", "validate", "fix", "off")
PROVIDERS = ("cpu", "cuda", "reference")
NOTHING_CONVERTED = "nothing converted"
GUARD_MAX_BYTES = 1 << 30  # report mode skips larger models without given inputs (two CPU runs)


def _log_line(line: str, level: int = logging.INFO) -> None:
    """The default ``progress``: the line, without the command line's prefixes, to the logger."""
    text = line.strip().removeprefix("onnxcampo: ").removeprefix("warning: ")
    log.log(level, "%s", text)


@dataclass(frozen=True)
class AccuracyCheck:
    """How :func:`onnxcampo.optimize` checks the optimized model (the module says what each
    ``mode`` does). ``tolerance``: the criterion (:meth:`onnxcampo.accuracy.Criterion.parse`:
    a relative-L2 bound or ``"rel_l2=0.01,max_abs=..."``; default rel_l2=0.01, mismatch=0.01);
    ``provider``: where validate runs both models (``cpu``, ``cuda`` or ``reference``, the ONNX
    reference evaluator); ``inputs``: the feeds (a mapping, or the path of an ``.npz``, of a
    Polygraphy JSON file of feed sets or of a folder of such files: every set is checked until
    one fails, which is judged; default: optimize's ``inputs`` if given, else generated); ``rtol``/``atol``: also check every
    element (off unless one is given); ``fix``: with ``validate``, keep the culprits fp32;
    ``staged``: an :class:`onnxcampo.ir.StagedModel` the optimized model is written to and run
    from; ``progress``: receives each line and its logging level."""

    mode: str = "report"
    tolerance: object = None
    provider: str = "cpu"
    inputs: Mapping[str, np.ndarray] | str | os.PathLike | None = None
    rtol: float | None = None
    atol: float | None = None
    fix: bool = False
    staged: object = None
    progress: Callable[[str, int], None] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"accuracy={self.mode!r}: expected one of {', '.join(repr(m) for m in MODES)} "
                             "(or an onnxcampo.accuracy.guard.AccuracyCheck)")
        if self.provider not in PROVIDERS:
            raise ValueError(f"AccuracyCheck(provider={self.provider!r}): expected one of "
                             f"{', '.join(repr(p) for p in PROVIDERS)}")

    @classmethod
    def of(cls, accuracy: str | AccuracyCheck) -> AccuracyCheck:
        if isinstance(accuracy, AccuracyCheck):
            return accuracy
        if not isinstance(accuracy, str):
            raise ValueError(f"accuracy={accuracy!r}: expected one of {', '.join(repr(m) for m in MODES)} "
                             "(or an onnxcampo.accuracy.guard.AccuracyCheck)")
        return cls(accuracy)

    @property
    def validating(self) -> bool:
        return self.mode == "validate"

    @property
    def fixing(self) -> bool:
        return self.mode == "fix" or (self.fix and self.mode == "validate")

    @property
    def searching(self) -> bool:
        """Whether a failure searches the nodes responsible (validate and fix only)."""
        return self.validating or self.fixing

    def say(self, line: str, level: int = logging.INFO) -> None:
        (self.progress or _log_line)(line, level)


@dataclass
class _Run:
    """What the check runs: the fp32 model, the reference's outputs, where the optimized one
    runs, and the words for it."""

    original: onnx.ModelProto
    ref: object  # accuracy_check.Reference
    provider: str
    execution: str
    criterion: object  # accuracy.Criterion
    what: str  # "validate" or "accuracy check"
    batch_one: list[str]


def check(model, config, result, accuracy: AccuracyCheck, *, optimize_s: float = 0.0,
          inputs: Mapping[str, np.ndarray] | None = None):
    """The guard over ``result``, the optimization of ``model`` (what optimize read: a path or
    a proto) with ``config``; returns the result to keep (the fixed one under fix), its report
    with the ``accuracy`` entry. ``optimize_s``: how long the optimization took (about one
    probe's time); ``inputs``: optimize's own, given to every probe of the search."""
    if accuracy.mode == "off":
        return result
    skipped = None if accuracy.validating else _skipped(model, config, result, accuracy, inputs)
    if skipped:
        result.report["accuracy"] = {"skipped": skipped}
        if skipped != NOTHING_CONVERTED:
            accuracy.say(f"onnxcampo: accuracy check skipped: {skipped}")
        return result
    sets = _input_sets(accuracy, model, inputs)
    judged = []  # (the set's words, whether it passed)
    for k, given in enumerate(sets):
        run = _prepare(model, config, result, accuracy, inputs, given, write=k == 0)
        if run is None:
            return result
        outputs = _run_optimized(result, run, accuracy)
        if outputs is None:
            return result
        if len(sets) == 1:
            break
        from onnxcampo.accuracy import evaluate

        ok = evaluate(run.ref.outputs, outputs, run.criterion).ok
        judged.append((given[1].removeprefix("the inputs of "), ok))
        if not ok:
            break  # the first set that fails is the one judged (and searched)
    failed = [words for words, ok in judged if not ok]
    if judged:
        result.report["input_sets"] = {"count": len(sets), "checked": len(judged), "failed": failed}
        accuracy.say(f"onnxcampo: {run.what}: {len(judged)} of {len(sets)} input sets checked, "
                     + (f"{failed[0]} fails: it is judged below" if failed else "every one passes"))
    kept = _judge(model, config, result, accuracy, run, outputs, optimize_s=optimize_s, inputs=inputs)
    if kept is not result and len(sets) > 1:  # the fix, fitted on the set that failed: every set judges it
        _fix_on_every_set(model, config, kept, accuracy, inputs, sets, failed[0])
    return kept


def _fix_on_every_set(model, config, fixed, accuracy: AccuracyCheck, inputs, sets, fitted: str) -> None:
    """The fixed model run on every input set; the report's ``input_sets`` says which it was fitted
    on and which fail it. Under validate a set that fails it is a ValidationError (nothing written);
    under fix alone, a warning."""
    from onnxcampo.accuracy import evaluate

    failing = []
    for given in sets:
        run = _prepare(model, config, fixed, accuracy, inputs, given, write=False)
        outputs = None if run is None else _run_optimized(fixed, run, accuracy)
        if outputs is not None and not evaluate(run.ref.outputs, outputs, run.criterion).ok:
            failing.append(given[1].removeprefix("the inputs of "))
    entry = {"count": len(sets), "fitted_on": fitted, "failed": failing}
    fixed.report["input_sets"] = entry
    if not failing:
        accuracy.say(f"onnxcampo: --fix: fitted on {fitted}; every one of the {len(sets)} input sets passes")
        return
    text = (f"--fix kept fp32 what {fitted} needs, but {len(failing)} of the {len(sets)} input sets still fail: "
            f"{', '.join(failing[:3])}{' ...' if len(failing) > 3 else ''}")
    if accuracy.validating:
        error = ValidationError(f"{text}; nothing written (loosen --tolerance, or --exclude-node what they need)")
        error.report = fixed.report
        raise error
    fixed.report.setdefault("notes", []).append(f"accuracy check: {text}")
    accuracy.say(f"onnxcampo: warning: {text}", logging.WARNING)


def _input_sets(accuracy: AccuracyCheck, model, inputs) -> list[tuple[dict | None, str]]:
    """The check's feed sets and the words for each: the sets at ``accuracy.inputs`` (an .npz,
    a Polygraphy JSON file or a folder of them), else the given mapping, else generated."""
    from onnxcampo.runtime import load_input_sets

    if accuracy.inputs is not None and not isinstance(accuracy.inputs, Mapping):
        original, _ = _source(model)
        sets = load_input_sets(accuracy.inputs, original)
        return [(feeds, f"the inputs of {accuracy.inputs}" if len(sets) == 1 else f"the inputs of {words}")
                for feeds, words in sets]
    given = accuracy.inputs if accuracy.inputs is not None else inputs
    if given is not None:
        return [(dict(given), "the given inputs")]
    return [(None, "generated inputs")]


def _skipped(model, config, result, accuracy: AccuracyCheck, inputs) -> str | None:
    """Why the report-mode check does not run, or ``None``."""
    from onnxcampo.training.scaling import is_train_step

    if not result.changed or config.policy == "fp32" or not result.report.get("nodes_fp16"):
        return NOTHING_CONVERTED
    if is_train_step(result.model):
        return "a training step (its outputs are updated weights; check with onnxcampo train)"
    size = _model_bytes(model)
    if size > GUARD_MAX_BYTES and accuracy.inputs is None and inputs is None:
        give = "give --validate (or --inputs)" if on_command_line() else "pass accuracy='validate' (or inputs)"
        return f"the model is {size / 2**30:.1f} GiB: two CPU runs would take long; {give} to check it"
    return None


def _model_bytes(model) -> int:
    """The model's size with its weights: in memory, the initializers' bytes; a file, its size
    plus that of each external data file its tensors name (once each)."""
    if isinstance(model, onnx.ModelProto):
        return sum(len(t.raw_data) for t in model.graph.initializer)
    path = Path(model)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size > GUARD_MAX_BYTES:
        return size
    try:
        header = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable here: the optimizer read it, its size is what we know
        return size
    locations = {entry.value for tensor in header.graph.initializer for entry in tensor.external_data
                 if entry.key == "location"}
    for location in locations:
        data = path.parent / location
        if data.is_file():
            size += data.stat().st_size
    return size


def _source(model) -> tuple[onnx.ModelProto, Path | None]:
    """The fp32 model, as the plan saw it, and the file it was read from."""
    from onnxcampo import ir

    if isinstance(model, onnx.ModelProto):
        return model, None
    original, _ = ir.read_model(model)  # names that are not UTF-8 escaped as the plan saw them
    return original, Path(model)


def _prepare(model, config, result, accuracy: AccuracyCheck, inputs, given: tuple[dict | None, str], *,
             write: bool = True) -> _Run | None:
    """The optimized model written (``staged``: test-loaded from the file on a thread; with
    ``write``, the first set's run) and the fp32 reference run on the feed set ``given`` (feeds or
    ``None``: generated, and its words), side by side; ``None`` where report mode skips the check
    (the report says why)."""
    from onnxcampo.accuracy import check as acc
    from onnxcampo.accuracy import Criterion

    criterion = Criterion.parse(accuracy.tolerance)
    what = "validate" if accuracy.validating else "accuracy check"
    staged = accuracy.staged if write else None
    if staged is not None:  # written once, test-loaded from the file it is renamed from, while the reference runs
        staged.write(result.model, background=True)

    def written() -> None:  # the test-load's verdict first: a model ORT cannot load is an error, not a figure
        if staged is not None:
            staged.wait()

    original, path = _source(model)
    if accuracy.validating:
        provider = accuracy.provider
        execution = config.execution if provider != "reference" else "plain"
    else:  # the fp32 model on ORT's CPU provider; the optimized one on the reference evaluator where quick
        provider, execution = "cpu", "plain"
    feeds, inputs_text = given
    dims, batch_one = config.dim_values, []
    if not accuracy.validating and feeds is None:  # the quick check: batch 1 where the batch is dynamic
        dims, batch_one = acc.batch_one_dims(original, config.input_shapes, config.dim_values)
        if batch_one:
            inputs_text += f" at {', '.join(f'{name}=1' for name in batch_one)} (--validate checks the planned shapes)"
    try:
        ref = acc.reference(original, feeds=feeds, source=path, provider=provider, execution=execution,
                            input_shapes=config.input_shapes, dim_values=dims, path=path)
        if not accuracy.validating and not (acc.small_enough_for_reference(original, ref.run_seconds)
                                            or acc.small_enough_for_reference(result.model)):
            provider = "reference"  # it computes fp16 nodes in fp16, which ORT's CPU provider does not
    except CampoError as exc:  # the fp32 model fails on the inputs, dynamic dims nothing pins, and the like
        written()
        if accuracy.validating:
            raise
        result.report["accuracy"] = {"skipped": str(exc)}
        warning = "warning: " if isinstance(exc, acc.ReferenceError) else ""
        accuracy.say(f"onnxcampo: {warning}accuracy check skipped: {exc}",
                     logging.WARNING if warning else logging.INFO)
        return None
    written()
    where = ("ONNX Runtime cpu (fp32) and the ONNX reference evaluator (written)" if provider == "reference"
             and not accuracy.validating else "the ONNX reference evaluator" if provider == "reference"
             else f"ONNX Runtime {provider}")
    accuracy.say(f"onnxcampo: {what}: the fp32 and the written model on {where}, {inputs_text} "
                 f"({criterion.describe()})")
    return _Run(original, ref, provider, execution, criterion, what, batch_one)


def _run_optimized(result, run: _Run, accuracy: AccuracyCheck):
    """The optimized model's outputs (on ORT's CPU provider where the reference evaluator fails
    it, in report mode); ``None`` where report mode gives up (the report says why)."""
    try:
        try:
            return _outputs(result, run, accuracy.staged)
        except CampoError as exc:
            if accuracy.validating or run.provider != "reference":
                raise
            accuracy.say(f"onnxcampo: {run.what}: {str(exc).splitlines()[0]}; running the written model on ONNX "
                         "Runtime cpu")
            run.provider = "cpu"
            return _outputs(result, run, accuracy.staged)
    except CampoError as exc:
        if accuracy.validating:
            raise
        # the optimized model is test-loaded first, and that names the fault
        result.report["accuracy"] = {"skipped": f"the written model did not run: {str(exc).splitlines()[0]}"}
        accuracy.say(f"onnxcampo: warning: accuracy check skipped: {result.report['accuracy']['skipped']}",
                     logging.WARNING)
        return None


def _outputs(result, run: _Run, staged):
    """The optimized model's outputs on the reference's feeds (``accuracy_check.run_candidate``);
    on ONNX Runtime from the file it was written to (``staged``), not serialized once more."""
    from onnxcampo.accuracy import check as acc
    from onnxcampo.runtime import feeds_for

    path = staged.path if staged is not None and staged.model is result.model else None
    if path is None or run.provider == "reference":
        if run.provider != "reference" and staged is None:
            # in memory: test-loaded in the child process first, so that an ONNX Runtime crash on it
            # is an error here, not the end of this process (result.save() test-loads it again)
            from onnxcampo.runtime.check import check_loads

            check_loads(result.model, label="the optimized model")
        return acc.run_candidate(result.model, run.ref, provider=run.provider, execution=run.execution)
    return acc.run_model(str(path), feeds_for(result.model, run.ref.feeds), provider=run.provider,
                         execution=run.execution)


def _elementwise(accuracy: AccuracyCheck, reference, outputs):
    """``rtol`` / ``atol``: the element-wise report, or ``None`` when neither is given."""
    if accuracy.rtol is None and accuracy.atol is None:
        return None
    from onnxcampo.runtime.compare import ELEMENTWISE_ATOL, ELEMENTWISE_RTOL, compare_outputs

    return compare_outputs(reference, outputs, rtol=ELEMENTWISE_RTOL if accuracy.rtol is None else accuracy.rtol,
                           atol=ELEMENTWISE_ATOL if accuracy.atol is None else accuracy.atol)


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


def validation_rows(outputs: list[dict], criterion) -> list[dict]:
    """The report's ``validation`` rows: the statistics plus the keys they always had."""
    return [{**row, "error": row.get("rel_l2", row.get("mismatch")),
             "measure": "rel_l2" if "rel_l2" in row else "mismatch", "tolerance": str(criterion),
             "max_abs_err": row.get("max_abs"), "max_rel_err": row.get("max_rel")} for row in outputs]


def _judge(model, config, result, accuracy: AccuracyCheck, run: _Run, outputs, *, optimize_s: float, inputs):
    """The verdict in the report (and one line per output); a failure goes to :func:`_failed`."""
    from onnxcampo.accuracy import check as acc

    verdict = acc.evaluate(run.ref.outputs, outputs, run.criterion, inputs=run.ref.inputs)
    elementwise = _elementwise(accuracy, run.ref.outputs, outputs)
    for line in _verdict_lines(verdict, elementwise):
        accuracy.say(f"  {run.what} {line}")
    entry = {**verdict.to_json(), "provider": run.provider,
             **({"reference_notes": run.ref.notes} if run.ref.notes else {}),
             **({"dims": {name: 1 for name in run.batch_one}} if run.batch_one else {})}
    if elementwise is not None:
        entry["elementwise"] = [{"name": d.name, "ok": bool(d.ok), "max_abs_err": d.max_abs_err,
                                 "max_rel_err": d.max_rel_err} for d in elementwise]
    if accuracy.validating:
        result.report["validation"] = validation_rows(entry["outputs"], run.criterion)
    result.report["accuracy"] = entry
    if verdict.ok and all(d.ok for d in elementwise or ()):
        return result
    return _failed(model, config, result, accuracy, run, verdict, elementwise, entry,
                   optimize_s=optimize_s, inputs=inputs)


def _failed(model, config, result, accuracy: AccuracyCheck, run: _Run, verdict, elementwise, entry, *,
            optimize_s: float, inputs):
    """A failed check: the culprits searched (validate and fix only) or what searching would take
    (report); the fixed result under fix, else the error (validate) or the warning (report)."""
    from onnxcampo.accuracy import check as acc

    criterion = run.criterion
    parts = [o.failure(criterion) for o in verdict.failed]
    parts += [f"{d.name} elements beyond --rtol/--atol (max abs {d.max_abs_err:.3g})"
              for d in elementwise or () if not d.ok]
    figures = f"outputs differ beyond the tolerance ({criterion.describe()}): {'; '.join(parts)}"
    culprits = search = None
    # the search judges by the criterion: an element-wise failure alone is not searched
    searchable = config.policy != "fp32" and not verdict.ok
    # the probes plan without tune: this optimization's time is no measure of theirs then
    probe_s = None if config.tune else optimize_s
    if searchable and accuracy.searching:
        culprits = acc.find_culprits(model, config, run.ref, criterion, result, provider=run.provider,
                                     execution=run.execution, inputs=inputs, probe_seconds=probe_s,
                                     progress=lambda line: accuracy.say(f"onnxcampo: {line}"))
        entry["culprits"] = culprits.to_json()
    elif searchable:
        fp16_count = len(acc.fp16_nodes(result))
        bound = acc.max_reoptimizations(fp16_count)
        search = (f"--validate or --fix searches the nodes responsible: a bisection of the {fp16_count} fp16 "
                  f"nodes, {acc.search_cost(bound, probe_s)}")
        entry["culprits"] = {"searched": False, "why": "the default check runs the written model once and never "
                             f"re-optimizes; {search}", "max_reoptimizations": bound,
                             "reoptimization_s": None if probe_s is None else round(probe_s, 2)}
    if accuracy.fixing and culprits is not None and culprits.ok and culprits.result is not None:
        return _fixed(accuracy, run, culprits, entry)
    advice = _advice(verdict, accuracy, culprits)
    blame = _blame(culprits)
    if accuracy.validating:
        error = ValidationError(f"{figures}{blame}; nothing written ({advice})")
        error.report = result.report  # what failed, for --report (the model itself is not written)
        raise error
    warning = f"the written model's {figures}{blame} ({advice}, or --exclude-node)"
    result.report.setdefault("notes", []).append(f"accuracy check: {warning}")
    accuracy.say(f"onnxcampo: warning: {warning}", logging.WARNING)
    if search is not None:
        accuracy.say(f"onnxcampo: accuracy check: {search}")
    return result


def _fixed(accuracy: AccuracyCheck, run: _Run, culprits, entry):
    """The optimization that keeps the culprits fp32, its report saying so."""
    fixed = culprits.result  # its plan says why the culprits are fp32 (Reason.ACCURACY_FIX)
    fixed.report["accuracy"] = {**culprits.verdict.to_json(), "provider": run.provider, "fixed": True,
                                "before": {k: v for k, v in entry.items() if k != "culprits"},
                                "culprits": culprits.to_json()}
    if accuracy.validating:
        fixed.report["validation"] = validation_rows(fixed.report["accuracy"]["outputs"], run.criterion)
    fixed.report.setdefault("notes", []).append(
        f"--fix: kept fp32 {len(culprits.nodes)} nodes so that the model passes {run.criterion.describe()}: "
        f"{', '.join(culprits.nodes)} ({culprits.verdict.summary()})")
    accuracy.say(f"onnxcampo: --fix: kept fp32 {', '.join(culprits.nodes)}; {culprits.verdict.summary()} "
                 f"({culprits.probes} re-optimizations, {culprits.seconds:.1f} s)")
    if culprits.verdict.inputs == "generated":
        fitted = ("the fix was fitted to generated inputs (standard-normal floats, smooth random images for image "
                  "inputs), not the data the model will see: give representative --inputs to fix it for those")
        fixed.report["notes"].append(f"--fix: {fitted}")
        accuracy.say(f"onnxcampo: warning: {fitted}", logging.WARNING)
    return fixed


def _advice(verdict, accuracy: AccuracyCheck, culprits) -> str:
    if verdict.ok:  # only the element-wise check failed
        return "loosen --rtol/--atol"
    needed = verdict.needed_text()
    advice = f"loosen --tolerance (--tolerance {needed} would pass)" if needed else "loosen --tolerance"
    if not accuracy.fixing and culprits is not None and culprits.nodes:
        advice += ", or --fix to keep the culprits fp32"
    return advice


def _blame(culprits) -> str:
    if culprits is None:
        return ""
    if culprits.nodes:
        return (f"; the nodes most responsible (bisection, {culprits.probes} re-optimizations): "
                f"{', '.join(culprits.nodes[:8])}{' ...' if len(culprits.nodes) > 8 else ''}")
    return f"; {culprits.note}" if culprits.note else ""
