"""Training steps of one benchmark model timed side by side, in rotation, in one process.

    python3 -P -m onnxcampo.benchmarks rotate --model resnet50 --wheels /tmp/bw \
        --policies campo-fused-cl-graph,campo-fused-cl-nostem-graph,torch-compile-graph-amp-cl \
        --rounds 7 --out rotation.json

``benchmarks/runner.py`` times a model's training variants one after another; a comparison of two
variants a few percent apart then also compares the minutes between them (the host's clock, the
GPU's temperature). Here every variant (onnxcampo's step graphs as the benchmark makes them, the
PyTorch anchors of ``onnxcampo.benchmarks.torch_twins``) is built first and stays alive, then each round times
one block of steps of every variant, starting one further along each round
(``onnxcampo.runtime.timing.time_in_rotation``). A step is one call: on both sides the step is
queued on the GPU and its loss read back every ``--read-every`` steps (default 10, as a tuned
PyTorch loop logs; 1 waits for every step), and each block ends waiting for the steps it queued.

Prints the median ms a step of each variant and its ratio to the first; ``--out`` keeps the
blocks, losses and each variant's planning report as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

from onnxcampo.benchmarks import measure as m
from onnxcampo.benchmarks import models as bench_models
from onnxcampo.benchmarks import policies as pol
from onnxcampo.benchmarks.runner import Group, Settings, check_provider, training_variant


def make_runs(group: Group, policies: list[str], provider: str, read_every: int = 1) -> tuple[dict, dict]:
    """policy -> a callable running one step, and policy -> what is known of it before timing."""
    runs, info = {}, {}
    batch = {**group.built.feeds, "labels": group.built.labels}
    for policy in policies:
        start = time.perf_counter()
        try:
            runs[policy], info[policy] = make_run(group, policy, provider, batch, read_every)
        except Exception as exc:  # noqa: BLE001 - one variant that cannot be made must not end the others
            info[policy] = {"error": f"{exc.__class__.__name__}: {str(exc)[:400]}"}
            print(f"{policy}: not made ({info[policy]['error']})", flush=True)
            continue
        info[policy]["prepare_s"] = round(time.perf_counter() - start, 2)
        print(f"{policy}: ready ({info[policy]['prepare_s']} s)", flush=True)
    return runs, info


def make_run(group: Group, policy: str, provider: str, batch: dict, read_every: int = 1) -> tuple[object, dict]:
    """One variant's step callable and what is known of it."""
    if policy in pol.TORCH_POLICIES:
        from onnxcampo.benchmarks.torch_twins import TorchStep

        return (TorchStep(group.built, policy, provider=provider, lr=group.built.lr, read_every=read_every),
                {"kind": "torch", "read_every": read_every})
    if policy not in pol.TRAINING_POLICIES:
        raise pol.Unavailable(f"{policy} is not a training policy")
    path, made = training_variant(group, policy)
    runner = m.StepRunner(path, weights=group.step_weights(), batch=batch, provider=provider,
                          tf32=pol.tf32_of(policy), cuda_graph=policy in pol.GRAPH_POLICIES,
                          cuda_options=pol.cuda_options_of(policy), read_every=read_every)
    return runner, {"kind": "onnxcampo", "read_every": read_every, **{k: made[k] for k in ("chosen_plan", "predicted_plan_us", "channels_last",
                                                                 "nodes_fp16", "casts_inserted") if k in made}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50", help="a benchmark model with a training batch (default resnet50)")
    p.add_argument("--policies", required=True, help="comma-separated training policies (onnxcampo's and torch-*)")
    p.add_argument("--rounds", type=int, default=7, help="blocks per variant, one a round (default 7)")
    p.add_argument("--read-every", type=int, default=10, metavar="N",
                   help="both sides read the loss every N steps, the steps between queued (default 10; 1: every step)")
    p.add_argument("--block-ms", type=float, default=200.0, help="a block lasts at least this long (default 200)")
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="the model's small twin (a smoke test)")
    p.add_argument("--wheels", type=Path, default=None, help="anchor wheels (bench_wheels.sh), for the torch twins")
    p.add_argument("--split", default="", help="comma-separated policies whose GPU time (CUPTI, through torch.profiler) "
                   "is split by kernel class after the timing, as the run subcommand's breakdown does")
    p.add_argument("--split-runs", type=int, default=5, help="steps the split averages over (default 5)")
    p.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problem = check_provider(args.provider)
    if problem:
        print(f"rotate_training: {problem}", file=sys.stderr)
        return 2
    spec = bench_models.MODELS.get(args.model)
    if spec is None or spec.train_batch is None:
        print(f"rotate_training: {args.model!r} is not a benchmark model with a training batch", file=sys.stderr)
        return 2
    policies = [x for x in args.policies.split(",") if x]
    if args.wheels is not None:
        pol.install_wheels(args.wheels)
    from onnxcampo.benchmarks.torch_twins import versions
    from onnxcampo.runtime.timing import time_in_rotation

    settings = Settings.make(args.provider, args.quick, False, ())
    with tempfile.TemporaryDirectory(prefix="rotate-") as work:
        group = Group(args.model, spec.train_batch, "training", settings, Path(work))
        runs, info = make_runs(group, policies, args.provider, args.read_every)
        if not runs:
            print("rotate_training: no variant could be made", file=sys.stderr)
            return 1
        times = time_in_rotation(runs, rounds=args.rounds, block_ms=args.block_ms)
        splits = {}
        for policy in [x for x in args.split.split(",") if x]:
            if policy in runs and times[policy].error is None:  # after every timing: the profiler may slow what follows
                kernels = m.cupti_kernels(runs[policy], args.split_runs)
                splits[policy] = None if kernels is None else m.gpu_split(kernels, top=80)
    first = next((times[p].median_ms for p in policies if p in times and times[p].error is None), float("nan"))
    rows = {}
    for policy in policies:
        if policy not in runs:
            rows[policy] = info[policy]
            print(f"{policy:32s} not made: {info[policy]['error']}")
            continue
        timed = times[policy]
        runner = runs[policy]
        losses = getattr(runner, "losses", None)
        row = {**info[policy], **timed.to_json()}
        if losses:
            row.update(loss_first=losses[0], loss_last=losses[-1], steps=len(losses),
                       finite=all(math.isfinite(x) for x in losses))
        elif policy in pol.TORCH_POLICIES and timed.error is None:
            row.update(loss_last=float(runner.step().detach()), **runner.info())
        if policy in splits:
            row["gpu"] = splits[policy]
        rows[policy] = row
        ms = timed.median_ms if timed.error is None else float("nan")
        print(f"{policy:32s} {ms:8.3f} ms a step  {first / ms if timed.error is None else float('nan'):6.3f}x the first"
              + (f"  ({timed.error})" if timed.error else ""))
        if row.get("gpu"):
            print(f"{'':32s} GPU {row['gpu']['total_ms']:.3f} ms: " + ", ".join(
                f"{k} {v:.3f}" for k, v in list(row["gpu"]["by_class_ms"].items())[:8]))
    result = {"model": args.model, "batch": spec.train_batch, "provider": args.provider, "rounds": args.rounds,
              "read_every": args.read_every,
              "block_ms": args.block_ms, "command": " ".join(["python -m onnxcampo.benchmarks rotate", *(argv or sys.argv[1:])]),
              "versions": {**pol.package_versions(), **versions()}, "policies": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
