"""What the custom-op GPU check scripts share (``scripts/check_conv_nhwc_cuda.py``,
``check_max_pool_cuda.py``, ``check_update_cuda.py``): their command line, the library and the
CUDA EP they need, and the JSON report with its exit status.

    args = check_cli.parser(__doc__, rounds=3).parse_args(argv)
    library = check_cli.open_library(args)        # None: the CUDA EP is missing (said on stderr)
    session = check_cli.bound(model, library, args.provider, feeds, outputs, cuda_graph=True)
    timing = check_cli.timed({"a": a.run, "b": b.run}, args.rounds, args.runs, args.provider)
    ...                                           # checks appended to `results` (check_im2col_cuda.check)
    return check_cli.report(args, results, extra) # writes --out, prints passed/total; 0 or 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parser(doc: str, *, rounds: int = 3) -> argparse.ArgumentParser:
    """--provider, --library, --out, --rounds, --runs and --quick; a script adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the library's reference kernels (a check of this script; default cuda)")
    p.add_argument("--library", help="the custom-op library (default: the built one)")
    p.add_argument("--out", type=Path, required=True, help="JSON report to write")
    p.add_argument("--rounds", type=int, default=rounds, help=f"timing rounds (default {rounds})")
    p.add_argument("--runs", type=int, default=10, help="calls per timed block (default 10)")
    p.add_argument("--quick", action="store_true", help="small checks only")
    return p


def open_library(args: argparse.Namespace) -> str | None:
    """The custom-op library for ``args.provider`` (ORT's CUDA DLLs preloaded), or None after one
    line on stderr when onnxruntime has no CUDA provider."""
    import onnxruntime

    from onnxcampo import ops

    if args.provider == "cuda":
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            print("error: onnxruntime has no CUDA provider (install onnxruntime-gpu)", file=sys.stderr)
            return None
        if hasattr(onnxruntime, "preload_dlls"):
            onnxruntime.preload_dlls()
    return args.library or ops.check()


def bound(model, library: str, provider: str, feeds: dict, outputs: dict, *, cuda_graph: bool = False):
    """A BoundSession (inputs and outputs bound once); ``cuda_graph`` replays it on CUDA only."""
    from onnxcampo.runtime.standalone import BoundSession

    return BoundSession(model, library, provider, feeds, outputs, cuda_graph=cuda_graph and provider == "cuda")


def timed(variants: dict, rounds: int, runs: int, provider: str) -> dict:
    """``variants`` (name -> a call) timed side by side in rotation: ``{name: ms a call, ...,
    "device_ms": {name: CUPTI GPU ms a call}, "launches": {name: kernels a call}}`` (the last two
    on CUDA with torch only, None for a variant CUPTI did not see)."""
    from onnxcampo.runtime.standalone import gpu_time_per_call, time_in_rotation

    ms = time_in_rotation(variants, rounds, runs)
    device = {k: gpu_time_per_call(fn, 10) for k, fn in variants.items()} if provider == "cuda" else {}
    return {**{k: round(v, 4) for k, v in ms.items()},
            "device_ms": {k: (None if v is None else round(v["total_ms"], 4)) for k, v in device.items()},
            "launches": {k: (None if v is None else v["launches"]) for k, v in device.items()}}


def report(args: argparse.Namespace, results: list, extra: dict) -> int:
    """Writes {checks, passed, total, **extra, onnxruntime, provider} to ``args.out``, prints the
    count on stderr; 0 when every check passed, else 1."""
    import onnxruntime

    body = {"checks": results, "passed": sum(r["ok"] for r in results), "total": len(results), **extra,
            "onnxruntime": onnxruntime.__version__, "provider": args.provider}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=1, default=float) + "\n")
    print(f"{body['passed']}/{body['total']} checks passed", file=sys.stderr)
    return 0 if body["passed"] == body["total"] else 1


__all__ = ["bound", "open_library", "parser", "report", "timed"]
