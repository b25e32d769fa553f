"""How much of the host's launch time a plain run adds to the GPU's work, fitted from whole runs.

    python -m onnxcampo.benchmarks host-overlap ROWS.jsonl --device-db DB.json --out PREFIX [--update]

A plain run launches node by node: the host issues kernel after kernel while the GPU runs them,
so the run takes at least the larger of the two, and the smaller adds only where one waits for
the other (the host on a queue of large kernels, the GPU on a stream of small launches). The
plan's predicted time of a plain run is ``max(gpu, host) + overlap * min(gpu, host)`` plus the
run's fixed cost (:func:`onnxcampo.estimate.plan_time`); this fits ``overlap``.

For each model and batch of ``ROWS.jsonl`` (the benchmark's inference rows) with a measured fp16
or fp32 plain row, the model is planned again here with ``--device-db`` (the rewrites off, as the
rows ran) and the plan's predicted GPU work, host launches and run cost are read from its report;
the measured time is the row's. ``overlap`` is the grid value (0, 0.05, ..., 1) with the least
mean absolute percentage error, and it is judged leaving each model out in turn: the share fitted
on the other models, its error on the one left out. The torch-exported models need torch and
transformers here; the corpus models, the corpus (``fetch-corpus``).

``--out PREFIX`` writes ``PREFIX.json`` (the rows and the fit) and ``PREFIX.md`` (the table, the
command); ``--update`` writes the share into the database's ``host_launch.inference.overlap``,
with its evidence beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GRID = [k / 20 for k in range(21)]
PLANS = (("fp16", "fp16"), ("fp32", "fp32"))  # (the plan in campo's report, the measured row's policy)


def predicted(split: dict, overlap: float) -> float:
    """The predicted ms of a plain run of ``split`` (gpu_us, host_us, run_us) under ``overlap``."""
    gpu, host = split["gpu_us"], split["host_us"]
    return (max(gpu, host) + overlap * min(gpu, host) + split["run_us"]) / 1000


def mape(rows: list[dict], overlap: float) -> float:
    return 100 * sum(abs(predicted(r, overlap) - r["ms"]) / r["ms"] for r in rows) / len(rows) if rows else 0.0


def fit(rows: list[dict]) -> dict:
    """The share with the least error on ``rows``, each model's share and error when it is left
    out, and the errors of the two fixed rules (additive, the larger alone)."""
    best = min(GRID, key=lambda share: mape(rows, share))
    left_out, errors = {}, []
    for model in sorted({r["model"] for r in rows}):
        others = [r for r in rows if r["model"] != model]
        held = [r for r in rows if r["model"] == model]
        share = min(GRID, key=lambda s: mape(others, s)) if others else best
        left_out[model] = {"overlap": share, "mape": round(mape(held, share), 1), "rows": len(held)}
        errors += [abs(predicted(r, share) - r["ms"]) / r["ms"] for r in held]
    return {"overlap": best, "mape": round(mape(rows, best), 1),
            "left_out_mape": round(100 * sum(errors) / len(errors), 1) if errors else None, "left_out": left_out,
            "additive_mape": round(mape(rows, 1.0), 1), "larger_alone_mape": round(mape(rows, 0.0), 1),
            "rows": len(rows)}


def splits(rows_path: Path, device_db: Path) -> list[dict]:
    """One row per measured plain fp16/fp32 run of ``rows_path``: the measured ms and the plan's
    predicted GPU work, host launches and run cost under ``device_db``."""
    import onnxcampo
    from onnxcampo.benchmarks import models as bench_models

    measured = {}
    for line in rows_path.read_text().splitlines():
        row = json.loads(line)
        if row.get("status") == "ok" and row.get("mode", "inference") == "inference" and row.get("ms"):
            measured[(row["model"], row["batch"], row["policy"])] = row["ms"]
    out = []
    for model, batch in sorted({(m, b) for m, b, p in measured if p in dict(PLANS).values()}):
        if model not in bench_models.MODELS:
            continue
        try:
            built = bench_models.MODELS[model].build(batch)
            report = onnxcampo.optimize(str(built.path), policy="fp16", device_db=device_db,
                                        input_shapes=built.input_shapes, accuracy="off", fuse_elementwise=False,
                                        fuse_reductions=False, channels_last=False).report
        except Exception as exc:  # noqa: BLE001 - a model that cannot be built here is left out, said
            print(f"{model} b{batch}: left out ({type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
            continue
        for plan, policy in PLANS:
            entry = (report.get("predicted_us") or {}).get(plan)
            if entry is None or (model, batch, policy) not in measured:
                continue
            out.append({"model": model, "batch": batch, "plan": plan, "ms": measured[(model, batch, policy)],
                        "gpu_us": entry["nodes_us"] + entry["casts_us"], "host_us": entry["dispatch_us"],
                        "run_us": entry["run_us"]})
    return out


def markdown(result: dict, command: str) -> str:
    f = result["fit"]
    lines = ["# Host launches against the GPU's work in plain runs (generated)", "", f"`{command}`", "",
             f"Fitted share of the smaller of GPU work and host launches that a plain run adds: **{f['overlap']}** "
             f"(MAPE {f['mape']} % over {f['rows']} runs; fitted leaving each model out: {f['left_out_mape']} %). "
             f"Both added (the share 1): {f['additive_mape']} %; the larger alone (0): {f['larger_alone_mape']} %.", "",
             "| model left out | share fitted on the others | its MAPE | runs |", "|---|---:|---:|---:|"]
    lines += [f"| {m} | {e['overlap']} | {e['mape']} % | {e['rows']} |" for m, e in f["left_out"].items()]
    lines += ["", "| model | batch | plan | measured ms | GPU us | host us | predicted ms |", "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['batch']} | {r['plan']} | {r['ms']:.3f} | {r['gpu_us']:.0f} | {r['host_us']:.0f} | "
              f"{predicted(r, f['overlap']):.3f} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rows", type=Path, help="the benchmark's inference rows (.jsonl)")
    p.add_argument("--device-db", type=Path, required=True, help="the cost database the plans are costed with")
    p.add_argument("--out", type=Path, required=True, help="PREFIX of the .json and .md written")
    p.add_argument("--update", action="store_true", help="write the fitted share into --device-db")
    args = p.parse_args(argv)
    rows = splits(args.rows, args.device_db)
    if not rows:
        p.error(f"{args.rows}: no measured fp16 or fp32 plain run of a model that can be built here")
    command = "python -m onnxcampo.benchmarks host-overlap " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command, "device_db": str(args.device_db), "rows": rows, "fit": fit(rows)}
    from onnxcampo.ir import write_text_atomically

    write_text_atomically(args.out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    write_text_atomically(args.out.with_suffix(".md"), markdown(result, command))
    print(markdown(result, command))
    if args.update:
        database = json.loads(args.device_db.read_text())
        inference = database.setdefault("host_launch", {}).setdefault("inference", {})
        inference["overlap"] = result["fit"]["overlap"]
        inference["overlap_fit"] = {k: result["fit"][k] for k in ("mape", "left_out_mape", "additive_mape",
                                                                  "larger_alone_mape", "rows")}
        write_text_atomically(args.device_db, json.dumps(database, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
