"""Does an ONNX Runtime CUDA EP option change a benchmark variant's speed? Time it both ways.

    python -m onnxcampo.benchmarks probe-options --model resnet50 --batch 64 --mode inference,training \\
        --policies fp32,amp,campo --options '{}' '{"prefer_nhwc": "1"}' \\
        '{"cudnn_conv_algo_search": "HEURISTIC"}' --provider cuda --wheels /tmp/bw --out probe.json

Builds the model and each policy's variant as ``benchmarks/runner.py`` does (same cache; training:
the same step graphs), then times every (policy, option set) pair in ``--sessions`` fresh
sessions, one session alive at a time, the option sets in a rotating order per round so that
drift between the first and the last does not favour one (a line per session as it ends; ``--out``
is rewritten after each policy, so a run cut short keeps what it measured): inference the median of 7 blocks of
>= 50 ms (IO binding), training 5 blocks of 10 steps (the Trainer's binding scheme). Prints ms per
run and the ratio to the first option set; ``--out`` keeps it as JSON. A set ORT rejects (an
unknown option, a layout it cannot run) is reported with ORT's message. The options come on top
of what the benchmark sets (``use_tf32`` per policy). What is worth probing on the H200:
``prefer_nhwc`` (cuDNN's fp16 convolutions run NHWC natively), ``cudnn_conv_algo_search``
(EXHAUSTIVE by default: the session-to-session variance of conv nets),
``cudnn_conv_use_max_workspace``, ``enable_skip_layer_norm_strict_mode``; and, for the host-bound
batch-1 runs, session settings given with a ``session.`` prefix: ``session.intra_op_num_threads``
(a ``SessionOptions`` attribute) or ``session.intra_op.allow_spinning`` (a config entry).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from onnxcampo.benchmarks import measure as m
from onnxcampo.benchmarks import policies as pol
from onnxcampo.benchmarks import runner as bench
from onnxcampo import ir


def option_sets(texts: list[str]) -> list[dict[str, str]]:
    """Each ``--options`` argument is a JSON object of CUDA EP options (values as strings)."""
    sets = []
    for text in texts:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"--options {text!r}: not a JSON object")
        sets.append({str(k): str(v) for k, v in value.items()})
    return sets


def _label(options: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in options.items()) or "default"


def _split(options: dict[str, str], provider: str) -> tuple[dict[str, str] | None, dict[str, str]]:
    """(CUDA EP options, session settings) of an option set: ``session.*`` keys are session
    settings; the CPU provider gets no CUDA EP options (main says it ignores them)."""
    session = {k: v for k, v in options.items() if k.startswith("session.")}
    cuda = {k: v for k, v in options.items() if not k.startswith("session.")}
    return (cuda if provider == "cuda" else None), session


def _timer(group: bench.Group, policy: str, path: Path, options: dict[str, str]):
    """A function that makes one session of the variant with ``options`` and returns its blocks."""
    s = group.settings
    tf32 = pol.tf32_of(policy)
    cuda_options, session_config = _split(options, s.provider)
    if group.mode == "inference":
        def run() -> list[float]:
            runner = m.bound(path, group.built.feeds, provider=s.provider, tf32=tf32, cuda_options=cuda_options,
                             session_config=session_config)
            runner()
            per_block = bench.runs_for_block(runner, s.block_ms)
            return m.timed_blocks(runner, warmup=s.inference_warmup, blocks=s.inference_blocks, per_block=per_block)
    else:
        weights = group.step_weights()
        batch = {**group.built.feeds, "labels": group.built.labels}

        def run() -> list[float]:
            runner = m.StepRunner(path, weights=weights, batch=batch, provider=s.provider, tf32=tf32,
                                  cuda_options=cuda_options, session_config=session_config)
            return m.timed_blocks(runner, warmup=s.train_warmup, blocks=s.train_blocks, per_block=s.train_per_block)
    return run


def probe(group: bench.Group, policies: list[str], sets: list[dict[str, str]], sessions: int,
          done=lambda policy, out: None) -> dict[str, Any]:
    """ms per run of every (policy, option set), the median of all blocks of ``sessions`` sessions.
    Prints a line per session as it ends; ``done(policy, out)`` is called after each policy (the
    caller saves what is measured so far: a run cut short keeps it)."""
    out: dict[str, Any] = {}
    for policy in policies:
        started = time.perf_counter()
        print(f"  {policy}: building the variant", flush=True)
        entry: dict[str, Any] = {}
        try:
            if group.mode == "inference":
                target = group.work / f"{group.built.path.stem}-{policy}.onnx"
                path, _ = pol.make_variant(policy, group.built.path, target, group.built.feeds, group.shapes,
                                           provider=group.settings.provider)
            else:
                path, _ = bench.training_variant(group, policy)
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be built is a line of the report
            out[policy] = {"error": f"{exc.__class__.__name__}: {str(exc)[:300]}"}
            done(policy, out)
            continue
        print(f"  {policy}: built ({time.perf_counter() - started:.0f} s)", flush=True)
        blocks: dict[str, list[float]] = {_label(o): [] for o in sets}
        errors: dict[str, str] = {}
        for turn in range(sessions):
            shift = turn % len(sets)
            for options in sets[shift:] + sets[:shift]:
                label = _label(options)
                if label in errors:
                    continue
                began = time.perf_counter()
                try:
                    timed = _timer(group, policy, Path(path), options)()
                    blocks[label] += timed
                    shown = f"{statistics.median(timed):.3f} ms"
                except Exception as exc:  # noqa: BLE001 - ORT rejecting an option is a finding
                    errors[label] = f"{exc.__class__.__name__}: {str(exc)[:300]}"
                    shown = "failed"
                print(f"    session {turn + 1}/{sessions} {label}: {shown} ({time.perf_counter() - began:.0f} s)",
                      flush=True)
                gc.collect()
        base = statistics.median(blocks[_label(sets[0])]) if blocks[_label(sets[0])] else None
        for options in sets:
            label = _label(options)
            if label in errors:
                entry[label] = {"error": errors[label]}
                continue
            ms = statistics.median(blocks[label])
            entry[label] = {"ms": ms, "ms_blocks": blocks[label], "vs_first": base / ms if base else None}
        out[policy] = entry
        if group.mode == "inference" and Path(path) != group.built.path:
            pol.cleanup(Path(path), group.built.path)
        done(policy, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a benchmark model (benchmarks/runner.py --list shows them)")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--mode", default="inference", help="inference, training or both (comma-separated)")
    p.add_argument("--policies", default="fp32,amp,campo")
    p.add_argument("--options", nargs="+", default=["{}", '{"prefer_nhwc": "1"}'], metavar="JSON",
                   help="CUDA EP option sets to compare, the first is the baseline (default: {} and prefer_nhwc)")
    p.add_argument("--sessions", type=int, default=2, help="fresh sessions per pair (default 2)")
    p.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="the benchmark's quick settings (a smoke test)")
    p.add_argument("--corpus-dir", type=Path, default=None)
    p.add_argument("--wheels", type=Path, default=bench.ROOT / ".benchwheels")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        sets = option_sets(args.options)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    modes = [x for x in args.mode.split(",") if x]
    if args.model not in bench.bench_models.MODELS or any(x not in bench.MODES for x in modes) or args.sessions < 1:
        print(f"error: unknown model {args.model!r} or mode {args.mode!r}, or --sessions < 1", file=sys.stderr)
        return 2
    if args.corpus_dir is not None:
        import os

        os.environ["ONNXCAMPO_CACHE"] = str(args.corpus_dir.resolve())
        os.environ["ONNXCAMPO_CORPUS_OFFLINE"] = "1"
    problem = bench.check_provider(args.provider)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.provider == "cpu":
        print("note: the CPU provider ignores CUDA EP options (session.* settings apply)")
    pol.install_wheels(args.wheels)
    settings = bench.Settings.make(args.provider, args.quick, False, ())
    policies = [x for x in args.policies.split(",") if x]
    result: dict[str, Any] = {"model": args.model, "batch": args.batch, "provider": args.provider,
                              "options": [_label(o) for o in sets], "versions": pol.package_versions(), "modes": {}}

    def save(mode: str, out: dict[str, Any]) -> None:
        result["modes"][mode] = out
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            ir.write_text_atomically(args.out, json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="onnxcampo-probe-") as tmp:
        for mode in modes:
            started = time.perf_counter()
            print(f"{args.model} b{args.batch} {mode}: building the model", flush=True)
            group = bench.Group(args.model, args.batch, mode, settings, Path(tmp))
            result["modes"][mode] = probe(group, policies, sets, args.sessions,
                                          done=lambda policy, out, mode=mode: save(mode, out))
            print(f"{args.model} b{args.batch} {mode} ({time.perf_counter() - started:.0f} s)")
            for policy, entry in result["modes"][mode].items():
                if "error" in entry:
                    print(f"  {policy:14s} failed: {entry['error'][:150]}")
                    continue
                for label, cell in entry.items():
                    shown = (f"{cell['ms']:9.3f} ms  {cell['vs_first']:.2f}x" if "ms" in cell
                             else f"failed: {cell['error'][:150]}")
                    print(f"  {policy:14s} {label:40s} {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
