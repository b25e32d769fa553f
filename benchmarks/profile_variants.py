"""Where one benchmark model's inference time goes under several policies: kernel time per op type.

    python -m onnxcampo.benchmarks profile-variants --model gpt2 --batch 1 --policies fp32,ort-fp16,fp16,campo \
        --provider cuda --wheels /tmp/bw --out profile.json

Builds the model as ``benchmarks/runner.py`` does (same cache), makes each policy's variant, times it
(IO binding, median of 7 blocks) and profiles 10 runs with ORT's profiler (graph optimizations
on: the kernels users get). Prints, per op type (with the dtype of its first input), the kernel
time per run and the kernel count under every policy, largest first, then the wall time and the
kernel-time sum; ``--out`` keeps the same as JSON. Used to find why two variants that look alike
(same Casts) run at different speeds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from onnxcampo.benchmarks import measure as m
from onnxcampo.benchmarks import models as bench_models
from onnxcampo.benchmarks import policies as pol


def op_times(trace: str) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """Kernel us per run and kernels per run by "OpType dtype" (first input's dtype), and kernel us
    per run by node (the executed graph's node names: ORT's fusions keep their first node's)."""
    events, runs = m.kernel_events(trace)
    us, count, nodes = defaultdict(float), defaultdict(int), defaultdict(float)
    for event in events:
        args = event.get("args", {})
        first = m.first_shape(args.get("input_type_shape"))
        key = f"{args.get('op_name', '?')} {first[0] if first else ''}".strip()
        us[key] += float(event.get("dur", 0)) / runs
        count[key] += 1
        nodes[str(event.get("name", "?")).removesuffix("_kernel_time")] += float(event.get("dur", 0)) / runs
    return dict(us), {k: round(v / runs) for k, v in count.items()}, dict(nodes)


def profile(model: str, batch: int, policies: list[str], provider: str, directory: Path) -> dict:
    built = bench_models.MODELS[model].build(batch)
    out = {"model": model, "batch": batch, "provider": provider, "policies": {}}
    for policy in policies:
        target = directory / f"{built.path.stem}-{policy}.onnx"
        try:
            path, info = pol.make_variant(policy, built.path, target, built.feeds, built.input_shapes, provider=provider)
            runner = m.bound(path, built.feeds, provider=provider, tf32=pol.tf32_of(policy))
            blocks = m.timed_blocks(runner, warmup=10, blocks=7, per_block=20)
            us, count, nodes = op_times(m.profile_runs(path, built.feeds, provider=provider, directory=directory,
                                                       tf32=pol.tf32_of(policy)))
            out["policies"][policy] = {"ms": m.median(blocks), "kernel_us": round(sum(us.values()), 1),
                                       "op_us": {k: round(v, 2) for k, v in us.items()}, "op_count": count,
                                       "node_us": {k: round(v, 2) for k, v in nodes.items()},
                                       "chosen_plan": info.get("chosen_plan"),
                                       "predicted_us": info.get("predicted_plan_us"), "rewrites": info.get("rewrites")}
        except Exception as exc:  # noqa: BLE001 - a failed variant is reported, the others still run
            out["policies"][policy] = {"error": f"{exc.__class__.__name__}: {str(exc)[:300]}"}
        finally:
            pol.cleanup(target, built.path)
    return out


def table(result: dict, top: int) -> list[str]:
    done = {p: r for p, r in result["policies"].items() if "op_us" in r}
    keys = sorted({k for r in done.values() for k in r["op_us"]}, key=lambda k: -max(r["op_us"].get(k, 0) for r in done.values()))
    lines = ["| op (first input dtype) | " + " | ".join(f"{p} us (n)" for p in done) + " |",
             "|---|" + "---:|" * len(done)]
    for key in keys[:top]:
        cells = [f"{r['op_us'].get(key, 0):.1f} ({r['op_count'].get(key, 0)})" for r in done.values()]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| **kernel sum** | " + " | ".join(f"{r['kernel_us']:.0f}" for r in done.values()) + " |")
    lines.append("| **wall ms** | " + " | ".join(f"{r['ms']:.3f}" for r in done.values()) + " |")
    for policy, r in result["policies"].items():
        if "error" in r:
            lines.append(f"\n{policy} failed: {r['error']}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(bench_models.MODELS))
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--policies", default="fp32,ort-fp16,fp16,amp,campo")
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--wheels", type=Path, help="folder with the anchors' wheels (as run --wheels)")
    p.add_argument("--top", type=int, default=25, help="op types shown (default 25)")
    p.add_argument("--out", type=Path, help="JSON file to write")
    args = p.parse_args(argv)
    replayed = [policy for policy in args.policies.split(",") if policy in pol.GRAPH_POLICIES]
    if replayed:
        p.error(f"{', '.join(replayed)}: a replayed CUDA graph has no per-kernel profile; profile its base policy")
    if args.wheels:
        pol.install_wheels(args.wheels)
    with tempfile.TemporaryDirectory(prefix="onnxcampo-profile-") as tmp:
        result = profile(args.model, args.batch, args.policies.split(","), args.provider, Path(tmp))
    print("\n".join(table(result, args.top)))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
