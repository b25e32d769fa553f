"""Harvest the op shapes of real models into the cost-database grid.

Runs shape inference on the corpus models (onnxcampo/corpus.py, pinned shapes) and on BERT-base /
GPT-2 exports when given, and writes every distinct (op, input shapes, attributes) of the op
types the harness measures to ``costdb/data/raw/harvested-cases.json`` (committed: the GPU machine
has no network and no corpus). ``costdb.measure.default_grid`` adds them, each unaligned GEMM
with its padded twin, so padding decisions are measured on real shapes.

    python scripts/harvest_shapes.py [extra.onnx:name=d0,d1,... ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
from onnxcampo import ir
from onnxcampo.costdb.measure import HARVEST_OPS, HARVESTED

MAX_ELEMENTS = 1 << 27  # what one sample may allocate on the GPU, per input


def harvest(model: onnx.ModelProto, shapes: dict) -> list[dict]:
    info, _ = ir.infer_tensor_info(model, input_shapes=shapes)
    constants = {t.name for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type not in HARVEST_OPS or node.domain not in ("", "ai.onnx"):
            continue
        inputs = [info.get(name) for name in node.input if name]
        if not inputs or any(i is None or i.shape is None or None in i.shape or not i.is_float for i in inputs):
            continue
        input_shapes = [list(i.shape) for i in inputs]
        if any(len(s) == 0 or max(1, __import__("math").prod(s)) > MAX_ELEMENTS for s in input_shapes):
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in attrs.items()
                 if isinstance(v, (int, float, list, tuple)) and not isinstance(v, bytes)}
        weights = [i for i, name in enumerate(node.input) if name in constants]
        found.append({"op_type": node.op_type, "input_shapes": input_shapes, "attrs": attrs, "weights": weights})
    return found


def main(argv: list[str]) -> int:
    from onnxcampo.benchmarks import corpus

    cases: dict[str, dict] = {}
    sources = [(entry.key, corpus.load(entry), dict(entry.input_shapes)) for entry in corpus.CORPUS]
    for spec in argv:
        path, _, pins = spec.partition(":")
        shapes = {}
        for pin in filter(None, pins.split(";")):
            name, _, dims = pin.partition("=")
            shapes[name] = tuple(int(d) for d in dims.split(","))
        sources.append((Path(path).stem, onnx.load(path, load_external_data=False), shapes))
    for key, model, shapes in sources:
        try:
            rows = harvest(model, shapes)
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{key}: skipped ({exc})", file=sys.stderr)
            continue
        for row in rows:
            cases.setdefault(json.dumps(row, sort_keys=True), {**row, "model": key})
        print(f"{key}: {len(rows)} nodes, {len(cases)} distinct cases so far", file=sys.stderr)
    HARVESTED.parent.mkdir(parents=True, exist_ok=True)
    HARVESTED.write_text(json.dumps(sorted(cases.values(), key=lambda c: (c["op_type"], c["model"])), indent=0) + "\n")
    print(f"wrote {HARVESTED} ({len(cases)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
