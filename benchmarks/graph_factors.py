"""How far single-op times carry into whole graphs: the cost model's GPU time of each benchmark
model's fp32 plan, by op class, against the model replayed as a CUDA graph on the H200.

    python -m onnxcampo.benchmarks graph-factors docs/benchmarks/raw/h200.jsonl --corpus-dir .benchcorpus \
        --out docs/benchmarks/costdb/graph-factors-h200

A replayed run (``fp32-graph`` rows) has no host term: what is left is the GPU's work and one
replay (``run_overhead``). For the models that can be built here (``odd_mlp``, ``odd_cnn`` and the
corpus models; the torch exports need the GPU machine), the fp32 plan's predicted GPU time is split
into convolutions, other Tensor Core products (MatMul/Gemm and fused products) and everything else,
on the graph ORT executes, and ``measured - run_us = sum_c k_c * predicted_c`` is fitted by
non-negative least squares (``k_c``: how much longer class ``c`` runs inside a graph than the
single-op database says). Each model's error is given leaving it out, next to the error with
``k = 1``. Nothing is written to the database: the figures say whether per-class factors would
carry, and by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

CLASSES = ("conv", "product", "other")


def op_class(ctx, node) -> str:
    from onnxcampo import oplists

    if node.op in oplists.NCHW_FP16_LAYOUT_OPS:
        return "conv"
    return "product" if ctx.categories.get(node.name) is oplists.Category.ALLOW else "other"


def predicted_by_class(path: Path, database: Path) -> dict[str, float]:
    """The fp32 plan's node times (us) by class on ORT's executed graph, planned for replay."""
    import onnx

    from onnxcampo import api, estimate
    from onnxcampo import ir
    from onnxcampo.config import OptimizeConfig
    from onnxcampo.context import GraphContext, Planning
    from onnxcampo.costdb.select import load_cost_model
    from onnxcampo.plan import Precision, PrecisionPlan, Reason

    model = onnx.load(str(path))
    ir.name_nodes(model)
    config = OptimizeConfig(device_db=database, execution="cuda-graph")
    info, unresolved = ir.infer_tensor_info(model)
    ctx = Planning(GraphContext.build(model, path, config, load_cost_model(database), info, unresolved))
    api.read_executed_graph(ctx)
    plan = PrecisionPlan()
    for node in ctx.nodes:
        plan.decide(node.name, Precision.FP32, Reason.POLICY_FP32)
    totals = dict.fromkeys(CLASSES, 0.0)
    for node in ctx.nodes:
        totals[op_class(ctx, node)] += estimate.node_time(ctx, node, Precision.FP32, plan.precision)
    totals["run_us"] = ctx.cost.run_us()
    ctx.config = config.replace(execution="plain")  # the same plan launched node by node
    plain = estimate.plan_time(ctx, plan)
    totals["plain_us"] = plain.total_us
    totals["launches"] = plain.launched
    conv = sum(estimate.host_launches(ctx, node, plan.precision)[0] for node in ctx.nodes)
    totals["launch_classes"] = {"conv": conv, "other": plain.launched - conv}
    return totals


def fit(samples: list[dict]) -> np.ndarray:
    from scipy.optimize import nnls

    design = np.array([[s["predicted"][c] for c in CLASSES] for s in samples])
    target = np.array([s["gpu_us"] for s in samples])
    used = design.any(axis=0)
    factors = np.ones(len(CLASSES))
    if used.any():
        factors[used] = nnls(design[:, used], target)[0]
    return factors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=Path)
    parser.add_argument("--corpus-dir", type=Path, default=Path(".benchcorpus"))
    parser.add_argument("--database", type=Path, default=Path("costdb/data/nvidia-h200.json"))
    parser.add_argument("--out", type=Path, required=True, help="output stem: STEM.md and STEM.json")
    parser.add_argument("--launches-out", type=Path,
                        help="also write each model's launches by class (ORT's CPU stand-in) as JSON lines, for "
                             "`onnxcampo costdb fit-step-dispatch --launches`")
    args = parser.parse_args(argv)
    import os

    os.environ["ONNXCAMPO_CACHE"] = str(args.corpus_dir.resolve())  # as the run subcommand's --corpus-dir
    from onnxcampo.benchmarks import models as bench_models

    from onnxcampo.ir.io import write_text_atomically

    rows, plain_rows = {}, {}
    for line in args.rows.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if row and row.get("mode") == "inference" and row.get("status") == "ok" and row.get("policy") == "fp32-graph":
            rows[(row["model"], row["batch"])] = row
        elif row and row.get("mode") == "inference" and row.get("status") == "ok" and row.get("policy") == "fp32":
            plain_rows[(row["model"], row["batch"])] = row
    samples = []
    for (model, batch), row in sorted(rows.items()):
        spec = bench_models.MODELS.get(model)
        if spec is None or spec.needs_torch:
            continue
        try:
            built = spec.build(batch)
        except Exception as exc:  # noqa: BLE001 - a model not buildable here is left out, said so
            print(f"{model} b{batch}: not built here ({exc.__class__.__name__}: {str(exc)[:100]})", file=sys.stderr)
            continue
        predicted = predicted_by_class(built.path, args.database)
        gpu_us = 1e3 * row["ms"] - predicted["run_us"]
        if gpu_us <= 0.1 * predicted["run_us"]:
            print(f"{model} b{batch}: replayed {row['ms']:.3f} ms, within the replay's fixed cost: left out", flush=True)
            continue
        plain = plain_rows.get((model, batch))
        samples.append({"model": f"{model} b{batch}", "measured_ms": round(row["ms"], 4), "gpu_us": round(gpu_us, 1),
                        "predicted": {c: round(predicted[c], 1) for c in CLASSES},
                        "plain_measured_ms": round(plain["ms"], 4) if plain else None,
                        "plain_predicted_ms": round(predicted["plain_us"] / 1e3, 4),
                        "plain_error": round(predicted["plain_us"] / 1e3 / plain["ms"] - 1, 4) if plain else None,
                        "launches": predicted["launches"], "launch_classes": predicted["launch_classes"],
                        "host_us_per_launch": round(1e3 * (plain["ms"] - row["ms"]) / predicted["launches"], 3)
                        if plain and predicted["launches"] else None})
        print(f"{model} b{batch}: replayed {row['ms']:.3f} ms, predicted GPU "
              + ", ".join(f"{c} {predicted[c]:.0f}" for c in CLASSES) + " us", flush=True)
    if len(samples) < 2:
        print("error: fewer than two models with fp32-graph rows could be built here", file=sys.stderr)
        return 2
    factors = fit(samples)
    for sample in samples:
        rest = [s for s in samples if s is not sample]
        held = fit(rest)
        raw = sum(sample["predicted"].values())
        scaled = sum(k * sample["predicted"][c] for k, c in zip(held, CLASSES))
        sample["error_unscaled"] = round(raw / sample["gpu_us"] - 1, 4) if sample["gpu_us"] else None
        sample["error_left_out"] = round(scaled / sample["gpu_us"] - 1, 4) if sample["gpu_us"] else None
    result = {"factors": {c: round(float(k), 3) for c, k in zip(CLASSES, factors)}, "samples": samples,
              "mape_unscaled": round(statistics.mean(abs(s["error_unscaled"]) for s in samples), 4),
              "mape_left_out": round(statistics.mean(abs(s["error_left_out"]) for s in samples), 4),
              "mape_plain": round(statistics.mean(abs(s["plain_error"]) for s in samples if s["plain_error"] is not None), 4)}
    command = "python -m onnxcampo.benchmarks graph-factors " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Single-op times inside whole graphs (H200, generated)", "", f"`{command}`", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "",
             "Fitted factors: " + ", ".join(f"{c} {k}" for c, k in result["factors"].items())
             + f". MAPE of the replayed GPU time: {100 * result['mape_unscaled']:.1f} % with the database as it is, "
             f"{100 * result['mape_left_out']:.1f} % with factors fitted leaving the model out.", "",
             f"The same fp32 plans launched node by node (the database's additive host term, fitted on BERT, "
             f"GPT-2 and ResNet-50: none of these models) against their `fp32` rows: MAPE "
             f"{100 * result['mape_plain']:.1f} %.", "",
             "| model | replayed ms | predicted conv us | products us | other us | error as is | error, left out "
             "| plain ms | predicted plain ms | error | launches | measured host us a launch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in samples:
        p = s["predicted"]
        plain = (f"{s['plain_measured_ms']:.3f} | {s['plain_predicted_ms']:.3f} | {100 * s['plain_error']:+.1f} % | "
                 f"{s['launches']} | {s['host_us_per_launch']:.2f}"
                 if s["plain_error"] is not None else "- | - | - | - | -")
        lines.append(f"| {s['model']} | {s['measured_ms']:.3f} | {p['conv']:.0f} | {p['product']:.0f} | {p['other']:.0f} | "
                     f"{100 * s['error_unscaled']:+.1f} % | {100 * s['error_left_out']:+.1f} % | {plain} |")
    if args.launches_out:
        write_text_atomically(args.launches_out, "".join(
            json.dumps({"model": s["model"].rsplit(" b", 1)[0], "batch": int(s["model"].rsplit(" b", 1)[1]),
                        "ort_launches": s["launch_classes"], "ort_provider": "cpu stand-in (onnxcampo.runtime.optimized)"})
            + "\n" for s in samples))
    write_text_atomically(args.out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    write_text_atomically(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
