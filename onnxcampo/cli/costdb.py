"""``onnxcampo costdb calibrate | measure | fit | fit-step-dispatch | fit-fused-elementwise | eval``:
a GPU's cost database measured, fitted and evaluated (:mod:`onnxcampo.costdb`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxcampo.cli.options import add_provider_option, examples
from onnxcampo.errors import ConfigError

EPILOGS = {
    "costdb": examples("onnxcampo costdb calibrate", "onnxcampo costdb measure --out samples.jsonl --budget-s 540",
                       "onnxcampo costdb fit samples.jsonl db.json",
                       "onnxcampo costdb eval db.json samples.jsonl --report eval.md"),
    "calibrate": examples("onnxcampo costdb calibrate", "onnxcampo costdb calibrate --budget-s 300   # run again to finish",
                          "onnxcampo costdb calibrate --where"),
    "measure": examples("onnxcampo costdb measure --out samples.jsonl --budget-s 540 --seed 0"),
    "fit": examples("onnxcampo costdb fit samples.jsonl costdb/data/nvidia-h200.json --holdout 0.2"),
    "fit-fused-elementwise": examples(
        "onnxcampo costdb fit-fused-elementwise fused_elementwise_costs.json costdb/data/nvidia-h200.json"),
    "fit-step-dispatch": examples("onnxcampo costdb fit-step-dispatch docs/benchmarks/raw/h200.jsonl db.json"),
    "eval": examples("onnxcampo costdb eval db.json samples.jsonl --report eval.md --png eval.png"),
}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    """``costdb`` and its subcommands; returns the subcommands (the parsers that take options)."""
    cost = sub.add_parser("costdb", epilog=EPILOGS["costdb"], help="measure, fit and evaluate a GPU cost database")
    cost_sub = cost.add_subparsers(dest="costdb_command", required=True)
    calibrate = cost_sub.add_parser(
        "calibrate", epilog=EPILOGS["calibrate"], help="measure and fit a cost database for this machine's GPU (about 10 minutes; resumable); "
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
    measure = cost_sub.add_parser("measure", epilog=EPILOGS["measure"], help="time single-op models on ONNX Runtime (appends, resumable)")
    measure.add_argument("--out", type=Path, required=True, metavar="SAMPLES.jsonl", help="samples file (JSON lines); existing samples are kept")
    add_provider_option(measure, "cuda")
    measure.add_argument("--budget-s", type=float, default=540.0, metavar="S",
                         help="stop after this many seconds (default 540); the next run resumes")
    measure.add_argument("--limit", type=int, metavar="N", help="measure at most this many samples")
    measure.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the random part of the shape grid (default 0)")
    fit = cost_sub.add_parser("fit", epilog=EPILOGS["fit"], help="fit a database from samples")
    fit.add_argument("samples", type=Path, help="samples file (JSON lines, from costdb measure)")
    fit.add_argument("out", type=Path, help="database JSON to write (e.g. costdb/data/nvidia-h200.json)")
    fit.add_argument("--holdout", type=float, default=0.2, metavar="SHARE",
                     help="share of each op type's cases held out of the fit and measured (default 0.2)")
    fit.add_argument("--min-samples", type=int, default=8, metavar="N",
                     help="op types with fewer paired fp32/fp16 cases are not fitted: the analytic model predicts "
                          "them (default 8)")
    step_dispatch = _database_update(
        cost_sub, "fit-step-dispatch", "add the per-node host time of whole models and training steps, from benchmark "
                                       "rows (fp32 against fp32-graph), to a database",
        "bench_rows", "the benchmark suite's rows (python -m onnxcampo.benchmarks run; e.g. docs/benchmarks/raw/h200.jsonl)")
    step_dispatch.add_argument("--launches", type=Path, metavar="FILE.jsonl",
                               help="ORT launch counts for fp32 rows measured before the benchmark recorded them "
                                    "(python -m onnxcampo.benchmarks graph-factors --launches-out)")
    fused_cost = _database_update(
        cost_sub, "fit-fused-elementwise", "add the FusedElementwise kernel's cost (bytes/us and fixed us, fitted by "
                                           "python -m onnxcampo.benchmarks fused-elementwise-costs on the GPU) to a "
                                           "database",
        "measured", "the measurement script's --out JSON")
    evaluate = cost_sub.add_parser("eval", epilog=EPILOGS["eval"], help="accuracy of a database on its held-out samples")
    evaluate.add_argument("database", type=Path, help="database JSON (from costdb fit)")
    evaluate.add_argument("samples", type=Path, help="the samples file it was fitted from (its held-out cases are used)")
    evaluate.add_argument("--report", type=Path, metavar="FILE.md", help="markdown report to write")
    evaluate.add_argument("--png", type=Path, metavar="FILE.png", help="predicted-vs-measured plot to write (needs matplotlib)")
    return [calibrate, measure, fit, step_dispatch, fused_cost, evaluate]


def _database_update(cost_sub, name: str, text: str, source: str, source_text: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` (help ``text``) that adds what the file ``source`` holds to a
    database JSON: its two positionals, ``source`` and the database, updated in place."""
    update = cost_sub.add_parser(name, epilog=EPILOGS[name], help=text)
    update.add_argument(source, type=Path, help=source_text)
    update.add_argument("database", type=Path, help="database JSON to update (e.g. costdb/data/nvidia-h200.json)")
    return update


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


def run(args: argparse.Namespace) -> int:
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

