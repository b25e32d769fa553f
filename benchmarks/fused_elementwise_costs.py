"""Measure what one ``ai.onnxcampo::FusedElementwise`` kernel costs on this GPU and fit the cost
model's ``fused_elementwise`` entry: ``us = fixed_us + bytes / bytes_per_us`` (bytes read plus
bytes written by the kernel). Run from the repository root on the GPU machine, after building the
library with CUDA:

    python3 -m onnxcampo.ops.build && python3 -P -m onnxcampo.benchmarks fused-elementwise-costs --out fe.json

The sweep: 2^16..2^25 elements, 1-4 inputs (their sum), every input float32 or every input
float16, the output float32 or float16. Each case is timed with inputs and outputs bound on the
device (``onnxcampo.runtime.timing.BoundRunner``), median ms of ``--rounds`` blocks of ``--block`` runs;
with torch present, the GPU kernel time per run (CUPTI) too, and the fit is made on kernel times
(the planner counts the host's launches apart: ``CostModel.launch_us``); without torch on the wall
times, which then hold ORT's per-run host cost in ``fixed_us`` (the JSON says which).

The JSON's ``fused_elementwise`` object merges into a cost database with
``onnxcampo costdb fit-fused-elementwise fe.json costdb/data/nvidia-h200.json``
(``onnxcampo.costdb.fit.merge_fused_elementwise``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxcampo.benchmarks.custom_ops import wall_ms
from onnxcampo.ops import library_path, nodes
from onnxcampo.ops.elementwise import jit
from onnxcampo.ops.elementwise import Op
from onnxcampo.runtime import make_session
from onnxcampo.runtime.standalone import gpu_time_per_call
from onnxcampo.runtime.timing import BoundRunner

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def sum_program(inputs: int, out_type: int) -> list[int]:
    """y = x0 + x1 + ... (one LOAD per input, an ADD per further input, a rounding for fp16 out)."""
    rows = [(Op.LOAD, 0, 0, 0)]
    for k in range(1, inputs):
        rows += [(Op.LOAD, 1, k, 0), (Op.ADD, 0, 0, 1)]
    if out_type == FLOAT16:
        rows.append((Op.ROUND_F16, 0, 0, 0))
    rows.append((Op.STORE, 0, 0, 0))
    return [int(v) for row in rows for v in row]


def case_model(elements: int, inputs: int, in_type: int, out_type: int):
    """The model of one case (a FusedElementwise node summing ``inputs`` inputs) and its inputs."""
    rng = np.random.default_rng(elements + inputs)
    arrays = [rng.standard_normal(elements).astype(NUMPY[in_type]) for _ in range(inputs)]
    names = [f"x{k}" for k in range(inputs)]
    fused = nodes.fused_elementwise(names, ["y0"], program=sum_program(inputs, out_type), registers=2,
                                    output_types=[out_type], name="fused")
    graph = helper.make_graph([fused], "g", [helper.make_tensor_value_info(n, in_type, [elements]) for n in names],
                              [helper.make_tensor_value_info("y0", out_type, [elements])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model, arrays


def measure(provider: str, rounds: int, block: int, sizes: list[int]) -> list[dict]:
    rows = []
    for log2 in sizes:
        elements = 2 ** log2
        for inputs in range(1, 5):
            for in_type in (FLOAT, FLOAT16):
                for out_type in (FLOAT, FLOAT16):
                    model, arrays = case_model(elements, inputs, in_type, out_type)
                    device = "cuda" if provider == "cuda" else "cpu"
                    bound = BoundRunner(make_session(model, provider=provider),
                                        {f"x{k}": a for k, a in enumerate(arrays)}, device)
                    for _ in range(3):
                        bound()
                    wall = wall_ms(bound, 0, block, rounds)
                    gpu = gpu_time_per_call(bound.launch, 10) if provider == "cuda" else None
                    moved = sum(a.nbytes for a in arrays) + elements * (2 if out_type == FLOAT16 else 4)
                    row = {"elements": elements, "inputs": inputs, "in": "fp16" if in_type == FLOAT16 else "fp32",
                           "out": "fp16" if out_type == FLOAT16 else "fp32", "bytes": moved,
                           "wall_ms": wall,
                           "kernel_ms": gpu["total_ms"] if gpu else None}
                    rows.append(row)
                    print(f"2^{log2:2d} x{inputs} {row['in']}->{row['out']}: {row['wall_ms']:.4f} ms wall"
                          + (f", {row['kernel_ms']:.4f} ms kernel" if gpu else "") + f", {moved / 1e6:.1f} MB", flush=True)
    return rows


def fit(rows: list[dict], key: str) -> dict:
    """Least squares of ``us = fixed_us + bytes / bytes_per_us`` over the rows' ``key`` times."""
    points = [(r["bytes"], r[key] * 1e3) for r in rows if r.get(key) is not None]
    x = np.array([p[0] for p in points], np.float64)
    y = np.array([p[1] for p in points], np.float64)
    a = np.stack([np.ones_like(x), x], axis=1)
    (fixed, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    predicted = a @ np.array([fixed, slope])
    mape = float(np.mean(np.abs(predicted - y) / np.maximum(y, 1e-9)))
    return {"bytes_per_us": float(1.0 / slope) if slope > 0 else None, "fixed_us": float(fixed),
            "samples": len(points), "mape": round(mape, 4), "time": key}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows and the fit as JSON here")
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--min-log2", type=int, default=16)
    parser.add_argument("--max-log2", type=int, default=25)
    args = parser.parse_args(argv)
    print(f"onnxruntime {ort.__version__}, library {library_path()}, provider {args.provider}, NVRTC "
          f"{jit.export_nvrtc()}", flush=True)
    rows = measure(args.provider, args.rounds, args.block, list(range(args.min_log2, args.max_log2 + 1)))
    kernel = any(r["kernel_ms"] is not None for r in rows)
    chosen = fit(rows, "kernel_ms" if kernel else "wall_ms")
    fits = {"kernel_ms": chosen} if kernel else {}
    fits["wall_ms"] = fit(rows, "wall_ms")
    if not chosen["bytes_per_us"]:
        print("fit failed: no positive bytes/us slope", flush=True)
        return 1
    for key, value in fits.items():
        print(f"fit on {key}: {value['bytes_per_us'] or float('nan'):.0f} bytes/us "
              f"({(value['bytes_per_us'] or 0) / 1e6:.2f} TB/s), fixed {value['fixed_us']:.2f} us, "
              f"MAPE {100 * value['mape']:.1f} % over {value['samples']} cases", flush=True)
    entry = {"bytes_per_us": round(chosen["bytes_per_us"], 1), "fixed_us": round(max(chosen["fixed_us"], 0.0), 3),
             "samples": chosen["samples"], "mape": chosen["mape"], "time": chosen["time"], "measured": True,
             "source": "benchmarks/fused_elementwise_costs.py", "date": time.strftime("%Y-%m-%d"),
             "onnxruntime": ort.__version__, "host": platform.node()}
    if args.out:
        args.out.write_text(json.dumps({"fused_elementwise": entry, "fits": fits, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
