"""End-to-end check on a GPU machine: every policy's model runs on the CUDA EP, matches fp32,
and how fast it is; ``--profile cuda`` (measured fp32 node times) works.

Models: the bundled MLP block (16384 rows), and BERT-base (b32 s128) and GPT-2 small (b8 s256)
built from their configs with random weights and exported with torch on the GPU machine (no
network needed). Latency: median over runs with IO binding, TF32 on (ORT's default).

    python scripts/gpu_check.py --out results/          # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnx

import onnxcampo
from onnxcampo.profile import measure_latency
from onnxcampo.runtime import available_providers, compare_outputs, make_session, run

from benchkit.models import export_hf  # shared with scripts/bench.py

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("fp32", "amp", "fp16", "campo")


def example_model():
    model = onnx.load(str(ROOT / "onnxcampo" / "examples" / "mlp_block.onnx"))
    x = np.random.default_rng(0).standard_normal((16384, 256)).astype(np.float32)
    return "mlp_block b16384", model, {"x": x}, {"x": (16384, 256)}


def bert(tmp: Path):
    from transformers import BertConfig, BertModel

    model, feeds, shapes = export_hf("bert", lambda: BertModel(BertConfig()), 32, 128, 30522, tmp)
    return "bert-base b32 s128", model, feeds, shapes


def gpt2(tmp: Path):
    from transformers import GPT2Config, GPT2Model

    model, feeds, shapes = export_hf("gpt2", lambda: GPT2Model(GPT2Config()), 8, 256, 50257, tmp)
    return "gpt2-small b8 s256", model, feeds, shapes


def _fp32_op_types(model: onnx.ModelProto, plan: dict) -> dict[str, int]:
    """Op types of float nodes the plan kept fp32, most frequent first (what costs Casts)."""
    from collections import Counter

    ops = {n.name: n.op_type for n in model.graph.node}
    counts = Counter(ops.get(name, "?") for name, entry in plan.items()
                     if entry["precision"] == "fp32" and entry["reason"] not in ("no_float", "constant", "neutral"))
    return dict(counts.most_common(8))


def _optimize(model, shapes, options):
    """optimize(); with ``analytic`` the shipped GPU database is switched off for the call."""
    import os

    from onnxcampo.costdb import select

    analytic = options.pop("analytic", False)
    saved = os.environ.get("ONNXCAMPO_DEVICE")
    if analytic:
        os.environ["ONNXCAMPO_DEVICE"] = "none"
    select.detected_gpu.cache_clear()
    try:
        return onnxcampo.optimize(model, input_shapes=shapes, **options)
    finally:
        if saved is None:
            os.environ.pop("ONNXCAMPO_DEVICE", None)
        else:
            os.environ["ONNXCAMPO_DEVICE"] = saved
        select.detected_gpu.cache_clear()


def check(name, model, feeds, shapes, rows, *, profile_cuda: bool) -> None:
    reference = run(make_session(model, provider="cuda"), feeds)
    variants = [(policy, {"policy": policy}) for policy in POLICIES]
    variants.append(("campo (analytic model)", {"policy": "campo", "analytic": True}))
    if profile_cuda:
        variants.append(("campo --profile cuda", {"policy": "campo", "profile": "cuda"}))
    for label, options in variants:
        row = {"model": name, "variant": label}
        try:
            start = time.perf_counter()
            result = _optimize(model, shapes, dict(options))
            row["optimize_s"] = round(time.perf_counter() - start, 2)
            out = run(make_session(result.model, provider="cuda"), feeds)
            diffs = compare_outputs(reference, out, rtol=0.02, atol=1e-2)
            row["max_rel_err"] = max(float(d.max_rel_err) for d in diffs)
            row["max_abs_err"] = max(float(d.max_abs_err) for d in diffs)
            latency = measure_latency(result.model, provider="cuda", feeds=feeds, warmup=20, runs=100)
            row.update(latency_ms=round(latency.median_ms, 3), p10_ms=round(latency.p10_ms, 3),
                       p90_ms=round(latency.p90_ms, 3), casts=result.report.get("casts_inserted"),
                       pads=result.report.get("pads_inserted"), nodes_fp16=result.report.get("nodes_fp16"),
                       predicted_us={k: v["total_us"] for k, v in result.report.get("predicted_us", {}).items()},
                       chosen_plan=result.report.get("chosen_plan"),
                       fp32_ops=_fp32_op_types(model, result.report.get("plan", {})),
                       cost_model=result.report.get("cost_model", {}).get("name"))
        except Exception as exc:  # noqa: BLE001 - record and go on to the next variant
            row["error"] = f"{exc.__class__.__name__}: {exc}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-hf", action="store_true", help="only the bundled example")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    import onnxruntime as ort

    rows: list[dict] = []
    meta = {"onnxruntime": ort.__version__, "providers": available_providers(), "tf32": True}
    try:
        import torch

        meta["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    builders = [lambda tmp: example_model()]
    if not args.skip_hf:
        builders += [bert, gpt2]
    for build in builders:
        try:
            name, model, feeds, shapes = build(args.out)
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": getattr(build, "__name__", "?"), "error": f"build failed: {exc}"})
            traceback.print_exc()
            continue
        check(name, model, feeds, shapes, rows, profile_cuda=True)
        for leftover in args.out.glob("*.onnx"):
            leftover.unlink()
    (args.out / "gpu_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
