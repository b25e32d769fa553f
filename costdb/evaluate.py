"""How good a cost database is: prediction errors and wrong fp16/fp32 decisions on measured cases.

For each op case (measured in both precisions, see :func:`onnxcampo.costdb.fit.collect`):

1. ``pred32`` = the database's fp32 time; ``pred16`` = its fp16 time given the *measured* fp32
   time (what the optimizer predicts after profiling the graph). Errors are relative to the
   measured times; MAPE is their mean (a fraction: 0.06 is 6 %).
2. Cast cost of running the op in fp16: one Cast per float activation input and per float output,
   ``cast_time(elements)`` each from the database's cast model. Constant weights are converted
   offline and cost nothing: the input indices a row lists in ``"weights"``, else input 1 of
   MatMul, inputs 1-2 of Gemm/Conv and LayerNormalization (``fit.WEIGHT_INPUTS``).
3. Predicted choice: fp16 when ``pred16 + casts < t32``; measured choice: fp16 when
   ``t16 + casts < t32`` (same predicted cast cost). A decision is wrong when the two differ and
   the measured sides differ by more than ``noise`` (``|a - b| / min(a, b)``): a choice between
   two sides within measurement noise is never wrong. The same is reported with predicted fp32
   times (``wrong_rate_predicted_t32``: the optimizer without profiling).
4. With ``holdout_only`` only the database's ``holdout_cases`` of fitted op types are evaluated
   (cases the models never saw). Op types the database lacks (analytic fallback) are evaluated on
   all their cases and reported apart (``fallback``), not in ``overall``.

5. The boundary decision (``boundary``, next to the per-op one above): in a graph a Cast sits only
   where an fp16 region meets an fp32 one, and a Tensor Core product inside an fp16 region pays
   none; so for allow-list ops (``oplists.ALLOW``) the decision is fp16 when ``t16 < t32`` (the
   cast-free side, predicted ``pred16 < t32``), and the metric is time-weighted: the time the wrong
   decisions lose (``|t16 - t32|``) over the fp32 time of all the cases (``lost_share``), besides
   the count.

Targets (Campo: 5.8 % mean error): fp16 MAPE <= 6 %, wrong decisions <= 1.5 %.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from onnxcampo.costdb.fit import SampleSet, collect
from onnxcampo.costdb.regression import RegressionCostModel, validate_database
from onnxcampo.errors import CostModelError

log = logging.getLogger(__name__)

TARGET_MAPE = 0.06
TARGET_WRONG_DECISIONS = 0.015
WORST_CASES = 10


def evaluate(database: dict, samples: list[dict], *, noise: float = 0.05, holdout_only: bool = True) -> dict:
    """Errors and decisions of ``database`` on ``samples`` (see the module docstring)."""
    validate_database(database, "database")
    return evaluate_cases(database, collect(samples), noise=noise, holdout_only=holdout_only)


def evaluate_cases(database: dict, data: SampleSet, *, noise: float = 0.05, holdout_only: bool = True) -> dict:
    # The models alone: the measured-shape table would answer fitted shapes exactly.
    model = RegressionCostModel({key: value for key, value in database.items() if key != "measured"})
    fitted = set(database["ops"])
    keys: set[str] = set()
    if holdout_only:
        if "holdout_cases" not in database:
            raise CostModelError("database has no 'holdout_cases' (not written by fit_database); "
                                 "evaluate it with holdout_only=False")
        keys = set(database["holdout_cases"])
    records, totals = [], defaultdict(int)
    for case in data.cases:
        totals[case.op_type] += 1
        is_fitted = case.op_type in fitted
        if is_fitted and holdout_only and case.key not in keys:
            continue
        records.append(_record(model, case, is_fitted, noise))
    missing = len(keys - {c.key for c in data.cases})
    if missing:
        log.warning("%d held-out cases of the database are not in the samples", missing)

    by_op: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_op[record["op_type"]].append(record)
    ops = {}
    for op_type in sorted(totals):
        ops[op_type] = {
            "model": "regression" if op_type in fitted else "analytic",
            "samples": totals[op_type],
            **_aggregate(by_op.get(op_type, [])),
        }
    overall = _aggregate([r for r in records if r["fitted"]])
    fallback_records = [r for r in records if not r["fitted"]]
    # the targets concern fitted ops; the fallback ops have their own line
    pool = [r for r in records if r["fitted"]] or records
    worst = sorted(pool, key=lambda r: abs(r["error_fp16"]), reverse=True)[:WORST_CASES]
    return {
        "device": database["device"],
        "holdout_only": holdout_only,
        "noise": noise,
        "targets": {"mape": TARGET_MAPE, "wrong_decision_rate": TARGET_WRONG_DECISIONS},
        "verdict": {
            "mape": _verdict(overall["mape_fp16"], TARGET_MAPE),
            "wrong_decision_rate": _verdict(overall["wrong_rate"], TARGET_WRONG_DECISIONS),
        },
        "overall": overall,
        "boundary": _boundary_aggregate([r for r in records if r["fitted"]]),
        "fallback": _aggregate(fallback_records) if fallback_records else None,
        "ops": ops,
        "cast": _size_model_errors(model.cast_time, [(e, t) for _, e, t in data.cast_rows]),
        "cast_by_direction": {
            d: _size_model_errors(model.cast_time, [(e, t) for dd, e, t in data.cast_rows if dd == d])
            for d in sorted({d for d, _, _ in data.cast_rows})
        },
        "pad": _size_model_errors(None, [(e, t) for _, e, t in data.pad_rows],
                                  [model.pad_time(e, op) for op, e, _ in data.pad_rows]),
        "holdout_missing": missing,
        "chains": _chains(database, data),
        "tf32_off": _tf32_off(data),
        "worst": worst,
        "cases": records,
    }


def _record(model: RegressionCostModel, case, fitted: bool, noise: float) -> dict:
    f = case.features
    pred32 = model.fp32_time(f)
    pred16 = model.fp16_time(f, case.t32)
    pred16_blind = model.fp16_time(f, pred32)
    casts = sum(model.cast_time(n) for n in (*case.cast_inputs, *case.cast_outputs))
    measured16 = case.t16 + casts
    measured_fp16 = measured16 < case.t32
    gap = abs(measured16 - case.t32) / min(measured16, case.t32)
    predicted_fp16 = pred16 + casts < case.t32
    blind_fp16 = pred16_blind + casts < pred32
    return {
        "case": case.key,
        "op_type": case.op_type,
        "fitted": fitted,
        "aligned": case.aligned,
        "t32": case.t32,
        "t16": case.t16,
        "pred32": pred32,
        "pred16": pred16,
        "casts": casts,
        "error_fp16": (pred16 - case.t16) / case.t16,
        "error_fp32": (pred32 - case.t32) / case.t32,
        "predicted_choice": "fp16" if predicted_fp16 else "fp32",
        "measured_choice": "fp16" if measured_fp16 else "fp32",
        "gap": gap,
        "wrong": predicted_fp16 != measured_fp16 and gap > noise,
        "wrong_predicted_t32": blind_fp16 != measured_fp16 and gap > noise,
        "lost_us": abs(measured16 - case.t32) if predicted_fp16 != measured_fp16 else 0.0,
        **_boundary(case, pred16, noise),
    }


def _boundary(case, pred16: float, noise: float) -> dict:
    """The decision inside an fp16 region (no Cast) for allow-list ops: ``boundary_wrong`` and the
    time it loses; None for other ops."""
    from onnxcampo import oplists

    if oplists.category_of(case.op_type) is not oplists.Category.ALLOW:
        return {"boundary_wrong": None, "boundary_lost_us": 0.0}
    measured = case.t16 < case.t32
    predicted = pred16 < case.t32
    gap = abs(case.t16 - case.t32) / min(case.t16, case.t32)
    wrong = predicted != measured and gap > noise
    return {"boundary_wrong": wrong, "boundary_lost_us": abs(case.t16 - case.t32) if wrong else 0.0}


def _boundary_aggregate(records: Sequence[dict]) -> dict | None:
    chosen = [r for r in records if r.get("boundary_wrong") is not None]
    if not chosen:
        return None
    wrong = sum(r["boundary_wrong"] for r in chosen)
    lost = sum(r["boundary_lost_us"] for r in chosen)
    total = sum(r["t32"] for r in chosen)
    return {"cases": len(chosen), "wrong": wrong, "wrong_rate": wrong / len(chosen),
            "lost_us": float(lost), "lost_share": float(lost / total) if total else None,
            "per_op_wrong_rate": (sum(r["wrong"] for r in chosen) / len(chosen)),
            "per_op_lost_share": (float(sum(r["lost_us"] for r in chosen if r["wrong"]) / total) if total else None)}


def _aggregate(records: Sequence[dict]) -> dict:
    n = len(records)
    if not n:
        return {"cases": 0, "mape_fp16": None, "mape_fp32": None, "wrong": 0, "wrong_rate": None,
                "wrong_predicted_t32": 0, "wrong_rate_predicted_t32": None, "fp16_pays": 0, "lost_us": 0.0}
    wrong = sum(r["wrong"] for r in records)
    blind = sum(r["wrong_predicted_t32"] for r in records)
    return {
        "cases": n,
        "mape_fp16": float(np.mean([abs(r["error_fp16"]) for r in records])),
        "mape_fp32": float(np.mean([abs(r["error_fp32"]) for r in records])),
        "wrong": wrong,
        "wrong_rate": wrong / n,
        "wrong_predicted_t32": blind,
        "wrong_rate_predicted_t32": blind / n,
        "fp16_pays": sum(r["measured_choice"] == "fp16" for r in records),
        "lost_us": float(sum(r["lost_us"] for r in records if r["wrong"])),
    }


def _size_model_errors(predict, rows: Sequence[tuple[int, float]], predicted: Sequence[float] | None = None) -> dict | None:
    if not rows:
        return None
    predicted = predicted if predicted is not None else [predict(e) for e, _ in rows]
    errors = [abs(p - t) / t for p, (_, t) in zip(predicted, rows)]
    return {"rows": len(rows), "mape": float(np.mean(errors)), "max_error": float(np.max(errors))}


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "not measured"
    if value <= target:
        return "met"
    return f"missed by {100 * (value - target):.1f} points"


# --------------------------------------------------------------------------------------------
# Report


def _pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f} %"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|")


def _us(value: float) -> str:
    return f"{value:.4g}"


def _chains(database: dict, data: SampleSet) -> dict:
    """Per chain pattern: the fitted factors and what the rows measured (chain / sum of parts)."""
    from onnxcampo.costdb.chains import fit_chains

    measured = fit_chains(data.chain_rows)
    return {pattern: {"fitted": database.get("chains", {}).get(pattern), "measured": numbers}
            for pattern, numbers in measured.items()}


def _tf32_off(data: SampleSet) -> dict:
    """Per op: median of fp32 time with TF32 off over fp32 time with TF32 on (recorded, unused)."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for case in data.cases:
        off = data.tf32_off.get(case.key)
        if off is not None and case.t32 > 0:
            ratios[case.op_type].append(off / case.t32)
    return {op: {"median": statistics.median(r), "cases": len(r)} for op, r in sorted(ratios.items())}


def _section(title: str, *lines: str) -> list[str]:
    """The lines of a Markdown section: a blank line, the ``## title`` heading, a blank line, ``lines``."""
    return ["", f"## {title}", "", *lines]


def _chains_section(chains: dict) -> list[str]:
    """The measured factor of each fusable chain, a table (no lines without chains)."""
    if not chains:
        return []
    rows = []
    for pattern, entry in chains.items():
        numbers = entry["measured"]
        ranges = numbers.get("range", {})
        rows.append(f"| {pattern} | {numbers.get('fp32', 'n/a')} | {numbers.get('fp16', 'n/a')} "
                    f"| {numbers['samples']} | {ranges.get('fp32', '')} | {ranges.get('fp16', '')} |")
    return _section("Fusable chains",
                    "Chain time over the sum of its nodes' times measured alone (median over shapes; "
                    "`onnxcampo.costdb.chains`). The optimizer scales a chain's nodes by it when they share "
                    "a precision.", "",
                    "| pattern | fp32 | fp16 | samples | fp32 range | fp16 range |", "|---|---|---|---|---|---|", *rows)


def _tf32_section(tf32: dict) -> list[str]:
    """Per op, the recorded fp32 time with TF32 off over the time with it (no lines without records)."""
    if not tf32:
        return []
    return _section("fp32 with TF32 off (recorded, not used)",
                    "Median of fp32 time with `use_tf32=0` over fp32 time with TF32 (ORT's default): "
                    + "; ".join(f"{op} x{v['median']:.2f} ({v['cases']} cases)" for op, v in tf32.items()) + ".")


def markdown(result: dict) -> str:
    device = result["device"]
    overall = result["overall"]
    lines = [f"# Cost database evaluation: {device.get('name')}", ""]
    details = ", ".join(f"{k} {device[k]}" for k in ("compute_capability", "ort_version", "cuda_version", "date")
                        if device.get(k))
    if details:
        lines += [f"Device: {details}.", ""]
    scope = "held-out cases (never seen by the fit)" if result["holdout_only"] else "all cases (training included)"
    lines += [
        f"Evaluated on {scope}. fp16 predictions are given the measured fp32 time, as after profiling. "
        f"A decision (fp16 when fp16 + casts < fp32) is wrong when it picks the measured-slower side "
        f"by more than {_pct(result['noise'], 0)}.",
        "",
        "## Targets",
        "",
        "| target | value | goal | verdict |",
        "|---|---|---|---|",
        f"| fp16 MAPE | {_pct(overall['mape_fp16'])} | <= {_pct(result['targets']['mape'], 0)} "
        f"| {result['verdict']['mape']} |",
        f"| wrong fp16/fp32 decisions | {_pct(overall['wrong_rate'])} | "
        f"<= {_pct(result['targets']['wrong_decision_rate'])} | {result['verdict']['wrong_decision_rate']} |",
        "",
        f"Overall ({overall['cases']} cases of fitted ops): MAPE fp16 {_pct(overall['mape_fp16'])}, "
        f"fp32 {_pct(overall['mape_fp32'])}; wrong decisions {overall['wrong']}/{overall['cases']} "
        f"({_pct(overall['wrong_rate'])}, {overall['lost_us']:.1f} us lost); with predicted fp32 times "
        f"(no profiling) {overall['wrong_predicted_t32']}/{overall['cases']} "
        f"({_pct(overall['wrong_rate_predicted_t32'])}). fp16 pays in {overall['fp16_pays']} of them.",
    ]
    boundary = result.get("boundary")
    if boundary:
        lines += _section("The decision at region boundaries (allow-list ops)",
                          "In a graph a Cast sits only where an fp16 region meets an fp32 one; a product inside "
                          "an fp16 region pays none. So the decision is also judged cast-free, fp16 when fp16 < "
                          "fp32, and by the time it loses (wrong decisions' |fp16 - fp32| over the cases' fp32 "
                          "time), next to the per-op decision above that charges every input and output a Cast:", "",
                          "| decision | cases | wrong | time lost |", "|---|---:|---:|---:|",
                          f"| per op (a Cast on every activation input and output) | {boundary['cases']} | "
                          f"{_pct(boundary['per_op_wrong_rate'])} | {_pct(boundary['per_op_lost_share'])} |",
                          f"| at region boundaries (inside an fp16 region: no Cast) | {boundary['cases']} | "
                          f"{boundary['wrong']} ({_pct(boundary['wrong_rate'])}) | {_pct(boundary['lost_share'])} |")
    if result.get("holdout_missing"):
        lines += ["", f"{result['holdout_missing']} held-out cases of the database are missing from these samples."]
    lines += _section("Per op",
                      "| op | model | samples | evaluated | MAPE fp16 | MAPE fp32 | wrong decisions "
                      "| wrong, predicted fp32 |",
                      "|---|---|---|---|---|---|---|---|")
    for op_type, row in result["ops"].items():
        lines.append(
            f"| {op_type} | {row['model']} | {row['samples']} | {row['cases']} | {_pct(row['mape_fp16'])} "
            f"| {_pct(row['mape_fp32'])} | {row['wrong']} ({_pct(row['wrong_rate'])}) "
            f"| {row['wrong_predicted_t32']} ({_pct(row['wrong_rate_predicted_t32'])}) |")
    fallback = result.get("fallback")
    if fallback:
        lines += ["", f"Analytic fallback ops (too few samples to fit; all {fallback['cases']} cases evaluated, "
                      f"not in the overall numbers): MAPE fp16 {_pct(fallback['mape_fp16'])}, "
                      f"fp32 {_pct(fallback['mape_fp32'])}, wrong decisions {fallback['wrong']} "
                      f"({_pct(fallback['wrong_rate'])})."]
    lines += _section("Cast and pad")
    for name, key in (("Cast (both directions)", "cast"), ("Pad/Slice", "pad")):
        numbers = result.get(key)
        if numbers:
            lines.append(f"- {name}: in-sample MAPE {_pct(numbers['mape'])} over {numbers['rows']} rows "
                         f"(worst {_pct(numbers['max_error'])}).")
        else:
            lines.append(f"- {name}: no rows.")
    for direction, numbers in (result.get("cast_by_direction") or {}).items():
        if numbers:
            lines.append(f"- Cast {direction} with the pooled model: MAPE {_pct(numbers['mape'])} "
                         f"over {numbers['rows']} rows.")
    lines += _chains_section(result.get("chains") or {})
    lines += _tf32_section(result.get("tf32_off") or {})
    lines += _section(f"Worst cases (top {WORST_CASES} by fp16 error, fitted ops)",
                      "| case | op | aligned | t32 us | t16 us | predicted t16 us | error fp16 | casts us "
                      "| predicted / measured choice | gap | decision |",
                      "|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["worst"]:
        decision = "wrong" if r["wrong"] else ("within noise" if r["predicted_choice"] != r["measured_choice"] else "ok")
        lines.append(
            f"| {_cell(r['case'])} | {r['op_type']} | {'yes' if r['aligned'] else 'no'} | {_us(r['t32'])} "
            f"| {_us(r['t16'])} | {_us(r['pred16'])} | {100 * r['error_fp16']:+.1f} % | {_us(r['casts'])} "
            f"| {r['predicted_choice']} / {r['measured_choice']} | {_pct(r['gap'])} | {decision} |")
    if not result["worst"]:
        lines.append("| (no cases) | | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def write_report(result: dict, markdown_path: str | Path, png_path: str | Path | None = None) -> dict:
    """Write the Markdown report and, when matplotlib is importable, the predicted-vs-measured plot.

    Returns ``{"markdown": path, "png": path or None, "png_skipped": reason or None}``.
    """
    markdown_path = Path(markdown_path)
    text = markdown(result)
    written = {"markdown": str(markdown_path), "png": None, "png_skipped": None}
    if png_path is not None:
        try:
            _plot(result, Path(png_path))
            written["png"] = str(png_path)
            text += f"\n![predicted vs measured fp16 time]({Path(png_path).name})\n"
        except ImportError:
            written["png_skipped"] = "matplotlib is not installed; no plot written"
            text += "\n(No plot: matplotlib is not installed.)\n"
            log.warning("matplotlib is not installed: %s not written", png_path)
    markdown_path.write_text(text)
    return written


def _plot(result: dict, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    by_op: dict[str, list[dict]] = defaultdict(list)
    for record in result["cases"]:
        by_op[record["op_type"]].append(record)
    low, high = np.inf, 0.0
    for op_type, records in sorted(by_op.items()):
        measured = np.array([r["t16"] for r in records])
        predicted = np.maximum([r["pred16"] for r in records], 1e-3)
        low, high = min(low, measured.min(), predicted.min()), max(high, measured.max(), predicted.max())
        label = op_type if records[0]["fitted"] else f"{op_type} (analytic)"
        ax.scatter(measured, predicted, s=12, alpha=0.7, label=label)
    if high > 0:
        line = np.array([low / 1.2, high * 1.2])
        ax.plot(line, line, "k--", linewidth=0.8, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured fp16 time (us)")
    ax.set_ylabel("predicted fp16 time (us)")
    overall = result["overall"]
    ax.set_title(f"{result['device'].get('name')}: fp16 MAPE {_pct(overall['mape_fp16'])}, "
                 f"wrong decisions {_pct(overall['wrong_rate'])}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
