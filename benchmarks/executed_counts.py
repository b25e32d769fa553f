"""How well ORT's CPU provider at the extended level stands in for the CUDA EP's graph optimizations:
the nodes each leaves of the same models (what ``optimize``'s experimental ``cost_graph="ort"`` reads).

    python -m onnxcampo.benchmarks executed-counts MODEL.onnx [...] --json out.json

Run it where onnxruntime-gpu is installed: per model, the node count of the ONNX graph, of ORT's
optimized graph on the CPU provider (extended level, as ``optimize`` reads it) and on the CUDA EP
(all levels, as a CUDA session runs it), and the ops whose counts differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx

from onnxcampo.errors import CampoError
from onnxcampo.ir.io import write_text_atomically
from onnxcampo.runtime.optimized import executed_graph


def counts(path: Path) -> dict:
    model = onnx.load(str(path))
    out = {"model": path.name, "onnx_nodes": len(model.graph.node)}
    graphs = {}
    for provider, level in (("cpu", "extended"), ("cuda", "all")):
        try:
            graphs[provider] = executed_graph(model, provider=provider, level=level)
            out[f"{provider}_nodes"] = graphs[provider].nodes
            out[f"{provider}_launches"] = graphs[provider].launches()
        except CampoError as exc:
            out[f"{provider}_error"] = str(exc)[:200]
    if len(graphs) == 2:
        cpu, cuda = graphs["cpu"].op_counts, graphs["cuda"].op_counts
        out["differs"] = {op: {"cpu": cpu.get(op, 0), "cuda": cuda.get(op, 0)}
                          for op in sorted(set(cpu) | set(cuda)) if cpu.get(op, 0) != cuda.get(op, 0)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--json", type=Path, help="write the rows here (atomically)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.models if not p.is_file()]
    if missing:
        print(f"error: no such model: {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = []
    for path in args.models:
        row = counts(path)
        rows.append(row)
        print(f"{row['model']}: onnx {row['onnx_nodes']}, ORT cpu/extended {row.get('cpu_nodes', row.get('cpu_error'))}, "
              f"ORT cuda/all {row.get('cuda_nodes', row.get('cuda_error'))}; differs: {row.get('differs')}", flush=True)
    if args.json:
        write_text_atomically(args.json, json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
