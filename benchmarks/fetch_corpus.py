"""Fetch the real-model corpus (``corpus``) into the cache and describe each model.

    python -m onnxcampo.benchmarks fetch-corpus            # fetch all: path, size, opset, nodes, ops
    python -m onnxcampo.benchmarks fetch-corpus --list     # list the entries, no network
    python -m onnxcampo.benchmarks fetch-corpus --quiet    # fetch all, print only failures and a summary
    python -m onnxcampo.benchmarks fetch-corpus ppocr_det magika

``python scripts/fetch_corpus.py`` runs the same (the set-up command of README.md and .ci/run).

Exit status 1 if any model could not be fetched (the others are still fetched).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from onnxcampo.benchmarks import corpus


def _list(models) -> None:
    for m in models:
        state = "cached" if corpus.cached_path(m).is_file() else "missing"
        pins = ", ".join(f"{k}={list(v)}" for k, v in m.input_shapes.items())
        fixed = f"  fixed: {m.fixed_inputs}" if m.fixed_inputs else ""
        print(f"{m.key:18s} {m.requirement:28s} {state:7s} {m.member}")
        print(f"{'':18s} pins: {pins}{fixed}")


def _describe(m, path: Path) -> str:
    proto = corpus.load(m, load_external_data=False)
    size = sum(p.stat().st_size for p in corpus.model_files(path, proto))
    opsets = ", ".join(f"{o.domain or 'ai.onnx'}:{o.version}" for o in proto.opset_import)
    counts = corpus.op_counts(proto)
    ops = " ".join(f"{op}:{n}" for op, n in counts.most_common())
    return (
        f"{m.key}: {path}\n"
        f"  size {size / 1e6:.1f} MB | IR {proto.ir_version} | opsets {opsets} | "
        f"nodes {len(proto.graph.node)} top-level, {sum(counts.values())} with subgraphs\n"
        f"  ops {ops}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("keys", nargs="*", help="corpus keys (default: all)")
    ap.add_argument("--list", action="store_true", help="list the corpus entries and exit")
    ap.add_argument(
        "-q", "--quiet", action="store_true", help="print only failures and the summary line"
    )
    args = ap.parse_args(argv)
    try:
        models = [corpus.get(k) for k in args.keys] if args.keys else list(corpus.CORPUS)
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    if args.list:
        _list(models)
        return 0
    if not args.quiet:
        print(f"cache: {corpus.cache_root()}")
    failed = 0
    t0 = time.perf_counter()
    for m in models:
        try:
            path = corpus.fetch(m)
        except corpus.CorpusUnavailable as e:
            print(f"{m.key}: UNAVAILABLE: {e}", file=sys.stderr)
            failed += 1
            continue
        if not args.quiet:
            print(_describe(m, path))
    print(
        f"corpus: {len(models) - failed}/{len(models)} models ready in "
        f"{time.perf_counter() - t0:.1f} s ({corpus.cache_root()})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
