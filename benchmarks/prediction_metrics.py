"""Whole-graph prediction metrics from benchmark rows: how far the cost model's plan times are from
the measured runs, and how much slower the plan it predicts fastest ran than the measured fastest.

    python -m onnxcampo.benchmarks prediction-metrics docs/benchmarks/raw/h200.jsonl --out docs/benchmarks/costdb/prediction-h200

Each onnxcampo row of the benchmark suite (``run``) (``amp``, ``fp16``, ``campo``, their ``-graph``
variants planned for CUDA-graph replay) carries the prediction of every plan its ``optimize``
compared (``predicted_us``: the policy's own, ``fp32`` and ``amp``), in the mode it was planned for
(``execution``). A prediction is paired with the row measured for that plan in that mode in the
same (model, batch) group: ``fp32`` with ``fp32`` (plain) or ``fp32-graph`` (replay), ``fp16`` with
``fp16`` / ``fp16-graph``, ``campo`` with ``campo`` / ``campo-graph``, ``amp`` with ``amp``. Only
rows measured since ``--since`` (the cost model they were planned with) count.

Metrics: the mean absolute percentage error by model and mode, for the fp32
and all-fp16 plans at batch 1 and at the large batch; the ranking regret of a group, the measured
time of the plan predicted fastest over the measured fastest of the plans predicted there, minus 1;
the share of groups whose regret is within 2 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from onnxcampo.ir.io import write_text_atomically

# the measured policy of a plan, by the mode the prediction was made for
MEASURED = {"plain": {"fp32": "fp32", "fp16": "fp16", "campo": "campo", "amp": "amp"},
            "cuda-graph": {"fp32": "fp32-graph", "fp16": "fp16-graph", "campo": "campo-graph"}}
REGRET_OK = 0.02
TARGETS = {"large": 0.10, "b1": 0.15, "cuda-graph": 0.15}


def load_rows(path: Path, since: str | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest = {}
    for row in rows:
        if row.get("status") == "ok" and (since is None or row.get("time", "") >= since):
            latest[row["key"]] = row  # the newest row of a key wins
    return list(latest.values())


def pairs(rows: list[dict]) -> list[dict]:
    """(predicted, measured) per plan, mode and (model, batch) group."""
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        if row.get("mode") == "inference":
            groups[(row["model"], row["batch"])][row["policy"]] = row
    found = []
    for (model, batch), by_policy in sorted(groups.items(), key=str):
        predictions: dict[tuple[str, str], list[float]] = defaultdict(list)
        for row in by_policy.values():
            mode = row.get("execution")
            for plan, us in (row.get("predicted_us") or {}).items():
                if mode in MEASURED and isinstance(us, (int, float)):
                    predictions[(mode, plan)].append(us)
        for (mode, plan), values in sorted(predictions.items()):
            measured = by_policy.get(MEASURED[mode].get(plan, ""))
            if measured is None:
                continue
            predicted_ms = statistics.median(values) / 1e3
            found.append({"model": model, "batch": batch, "mode": mode, "plan": plan,
                          "predicted_ms": round(predicted_ms, 4), "measured_ms": round(measured["ms"], 4),
                          "error": round(predicted_ms / measured["ms"] - 1, 4)})
    return found


def regrets(found: list[dict]) -> list[dict]:
    by_group: dict[tuple, list[dict]] = defaultdict(list)
    for pair in found:
        by_group[(pair["model"], pair["batch"], pair["mode"])].append(pair)
    out = []
    for (model, batch, mode), plans in sorted(by_group.items(), key=str):
        if len(plans) < 2:
            continue
        predicted_best = min(plans, key=lambda p: p["predicted_ms"])
        measured_best = min(plans, key=lambda p: p["measured_ms"])
        regret = predicted_best["measured_ms"] / measured_best["measured_ms"] - 1
        out.append({"model": model, "batch": batch, "mode": mode, "plans": len(plans),
                    "predicted_best": predicted_best["plan"], "measured_best": measured_best["plan"],
                    "regret": round(regret, 4)})
    return out


def _class(pair: dict) -> str:
    if pair["mode"] == "cuda-graph":
        return "cuda-graph"
    return "b1" if pair["batch"] == 1 else "large"


def summary(found: list[dict], regret_rows: list[dict]) -> dict:
    mape: dict[str, dict] = {}
    for cls in TARGETS:
        chosen = [abs(p["error"]) for p in found if _class(p) == cls and p["plan"] in ("fp32", "fp16")]
        mape[cls] = {"mape": round(statistics.mean(chosen), 4) if chosen else None, "pairs": len(chosen),
                     "target": TARGETS[cls],
                     "met": (statistics.mean(chosen) <= TARGETS[cls]) if chosen else None}
    by_model: dict[str, list[float]] = defaultdict(list)
    for pair in found:
        by_model[f"{pair['model']} ({pair['mode']})"].append(abs(pair["error"]))
    within = [r for r in regret_rows if r["regret"] <= REGRET_OK]
    share = len(within) / len(regret_rows) if regret_rows else None
    return {"mape_fp32_fp16": mape,
            "mape_by_model": {key: round(statistics.mean(v), 4) for key, v in sorted(by_model.items())},
            "regret": {"groups": len(regret_rows), "within_2pct": len(within),
                       "share": round(share, 4) if share is not None else None, "target": 0.95,
                       "met": share >= 0.95 if share is not None else None}}


def markdown(result: dict, command: str, gpu: str | None = None) -> str:
    s = result["summary"]
    lines = [f"# Whole-graph predictions against {gpu or 'GPU'} runs (generated)", "",
             f"`{command}`", "",
             "Predicted plan times (`optimize`'s `predicted_us`, in the mode the plan was made for) against the "
             "runs of the same plans in the same benchmark (`benchmarks/prediction_metrics.py` says how they are "
             "paired).", "", "## Targets", "",
             "| what | value | target | met |", "|---|---:|---:|---|"]
    for cls, entry in s["mape_fp32_fp16"].items():
        value = "-" if entry["mape"] is None else f"{100 * entry['mape']:.1f} % ({entry['pairs']} pairs)"
        met = {True: "met", False: "not met", None: "not measured"}[entry["met"]]
        lines.append(f"| MAPE fp32 and all-fp16 plans, {cls} | {value} | <= {100 * entry['target']:.0f} % | {met} |")
    r = s["regret"]
    value = "-" if r["share"] is None else f"{r['within_2pct']} of {r['groups']} groups"
    met = {True: "met", False: "not met", None: "not measured"}[r["met"]]
    lines += [f"| predicted-best plan within 2 % of the measured best | {value} | >= 95 % | {met} |", "",
              "## Every pair", "", "| model | batch | mode | plan | predicted ms | measured ms | error |",
              "|---|---:|---|---|---:|---:|---:|"]
    for p in result["pairs"]:
        lines.append(f"| {p['model']} | {p['batch']} | {p['mode']} | {p['plan']} | {p['predicted_ms']:.3f} | "
                     f"{p['measured_ms']:.3f} | {100 * p['error']:+.1f} % |")
    lines += ["", "## Ranking regret", "", "| model | batch | mode | plans | predicted best | measured best | regret |",
              "|---|---:|---|---:|---|---|---:|"]
    for r in result["regret"]:
        lines.append(f"| {r['model']} | {r['batch']} | {r['mode']} | {r['plans']} | {r['predicted_best']} | "
                     f"{r['measured_best']} | {100 * r['regret']:.1f} % |")
    lines += ["", "## MAPE by model and mode (every plan)", "", "| model (mode) | MAPE |", "|---|---:|"]
    lines += [f"| {key} | {100 * value:.1f} % |" for key, value in s["mape_by_model"].items()]
    return "\n".join(lines) + "\n"


def _gpu_of(rows: Path) -> str | None:
    """The GPU the rows were measured on, from the runs file beside them (``<name>.runs.jsonl``)."""
    runs = rows.with_name(rows.name.removesuffix(".jsonl") + ".runs.jsonl")
    try:
        for line in runs.read_text(encoding="utf-8").splitlines():
            gpu = json.loads(line).get("versions", {}).get("gpu") if line.strip() else None
            if gpu:
                return gpu
    except (OSError, ValueError, AttributeError):
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path, help="benchmark rows (JSON lines of the run subcommand)")
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes STEM.md and STEM.json")
    parser.add_argument("--since", help="only rows measured at or after this ISO time")
    args = parser.parse_args(argv)
    if not args.rows.is_file():
        print(f"error: {args.rows} does not exist", file=sys.stderr)
        return 2
    found = pairs(load_rows(args.rows, args.since))
    regret_rows = regrets(found)
    result = {"pairs": found, "regret": regret_rows, "summary": summary(found, regret_rows)}
    command = "python -m onnxcampo.benchmarks prediction-metrics " + " ".join(argv if argv is not None else sys.argv[1:])
    write_text_atomically(args.out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    write_text_atomically(args.out.with_suffix(".md"), markdown(result, command, _gpu_of(args.rows)))
    print(f"{len(found)} pairs, {len(regret_rows)} groups: {json.dumps(result['summary']['mape_fp32_fp16'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
