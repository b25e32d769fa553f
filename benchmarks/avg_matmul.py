"""Time AvgMatMulInteger (16-bit tree averaging) against 32-bit accumulation on the CPU.

    python -m onnxcampo.benchmarks avg-matmul [--quick] [--out docs/benchmarks/avg-matmul/avg-matmul-bench]

Three uint8 x uint8 matmuls, each a one-node ONNX Runtime session (same call overhead):
``ai.onnxcampo::AvgMatMulInteger`` (ours, 16-bit lanes), ``ai.onnxcampo::ExactMatMulInteger``
(ours, int32 accumulation with _mm256_madd_epi16, the same tiles and packing) and ONNX Runtime's
``MatMulInteger`` (MLAS), single-threaded and with the default thread pool. Shapes: cubes and
transformer-ish / ddddocr shapes. Also the seed's accuracy table: relative RMSE of the tree
against the exact product on N(128, sigma) inputs. Writes ``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxcampo import ops
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session

from onnxcampo.benchmarks import ROOT
CUBES = [64, 128, 256, 512, 1024]
SHAPES = [(128, 768, 768), (128, 768, 3072), (128, 3072, 768), (20, 1024, 8210), (1, 1024, 8210)]
KERNELS = ("avg", "exact", "ort")


def model(kind: str) -> onnx.ModelProto:
    u8 = TensorProto.UINT8
    if kind == "ort":
        node, out_type = helper.make_node("MatMulInteger", ["A", "B"], ["Y"]), TensorProto.INT32
    else:
        node, out_type = nodes.avg_matmul_integer("A", "B", output="Y", name="mm", exact=kind == "exact"), TensorProto.FLOAT
    graph = helper.make_graph([node], "bench", [helper.make_tensor_value_info("A", u8, ["M", "K"]),
                                                helper.make_tensor_value_info("B", u8, ["K", "N"])],
                              [helper.make_tensor_value_info("Y", out_type, ["M", "N"])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    nodes.import_domain(m)
    return m


def session(kind: str, threads: int) -> ort.InferenceSession:
    """A CPU session of the one-node model (onnxcampo's library registered), ``threads`` intra-op threads (0: ORT's default)."""
    return make_session(model(kind), provider="cpu", intra_op_threads=threads)


def time_ms(sess: ort.InferenceSession, feeds: dict, budget_s: float) -> float:
    sess.run(None, feeds)
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def rmse_table(rng) -> list[dict]:
    sess = session("avg", 0)
    rows = []
    for k in (64, 256, 1024, 4096):
        for sigma in (5, 10, 20, 40):
            a = np.clip(np.rint(rng.normal(128, sigma, (64, k))), 0, 255).astype(np.uint8)
            b = np.clip(np.rint(rng.normal(128, sigma, (k, 64))), 0, 255).astype(np.uint8)
            approx = sess.run(None, {"A": a, "B": b})[0].astype(np.float64)
            exact = (a.astype(np.int64) @ b.astype(np.int64)).astype(np.float64)
            error = exact - approx
            rows.append({"K": k, "sigma": sigma, "rel_rmse_pct": 100 * float(np.sqrt(np.mean(error ** 2)) / np.mean(exact)),
                         "mean_error": float(error.mean()), "max_error": float(error.max()),
                         "bound": sum(s * (s.bit_length() - 1) // 2 for s in [1 << b for b in range(k.bit_length()) if k >> b & 1])})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cubes up to 512, fewer repeats")
    parser.add_argument("--budget-s", type=float, default=0.6, help="seconds of repeats per measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "avg-matmul" / "avg-matmul-bench")
    args = parser.parse_args(argv)
    ops.check()
    shapes = [(n, n, n) for n in CUBES if not args.quick or n <= 512] + SHAPES
    threads = {"1 thread": 1, f"default ({os.cpu_count()} cores)": 0}
    sessions = {(kind, label): session(kind, t) for kind in KERNELS for label, t in threads.items()}
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in shapes:
        feeds = {"A": rng.integers(0, 256, (m, k), dtype=np.uint8), "B": rng.integers(0, 256, (k, n), dtype=np.uint8)}
        row = {"M": m, "K": k, "N": n}
        for (kind, label), sess in sessions.items():
            row[f"{kind} / {label}"] = time_ms(sess, feeds, args.budget_s / (2 if args.quick else 1))
        rows.append(row)
        print(" ".join(f"{key}={value:.3f}" if isinstance(value, float) else f"{key}={value}" for key, value in row.items()),
              file=sys.stderr)
    accuracy = rmse_table(rng)
    info = {"machine": platform.processor() or platform.machine(), "cpu": _cpu_name(), "cores": os.cpu_count(),
            "onnxruntime": ort.__version__, "kernel": ops.build_info().get("matmul_u8"),
            "note": "shared machine: other jobs ran at the same time; medians of repeated runs"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"info": info, "timings_ms": rows, "accuracy": accuracy}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(info, rows, accuracy, list(threads)))
    print(markdown(info, rows, accuracy, list(threads)))
    return 0


def markdown(info, rows, accuracy, labels) -> str:
    lines = ["# AvgMatMulInteger: benchmark", "",
             f"Written by `benchmarks/avg_matmul.py`. {info['cpu']}, {info['cores']} cores, onnxruntime "
             f"{info['onnxruntime']}, kernel `{info['kernel']}`. {info['note']}.", "",
             "Median milliseconds per call of one-node sessions; uint8 inputs uniform in [0, 255], no zero points. "
             "`avg`: AvgMatMulInteger (16-bit tree); `exact`: ExactMatMulInteger (int32 accumulation, same tiles); "
             "`ort`: ONNX Runtime's MatMulInteger (MLAS). Speed-up = exact / avg (> 1: the tree is faster).", ""]
    for label in labels:
        lines += [f"## {label}", "", "| M x K x N | avg ms | exact ms | ort ms | exact / avg | ort / avg |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in rows:
            avg, exact, ort_ = (row[f"{kind} / {label}"] for kind in KERNELS)
            lines.append(f"| {row['M']} x {row['K']} x {row['N']} | {avg:.3f} | {exact:.3f} | {ort_:.3f} | "
                         f"{exact / avg:.2f} | {ort_ / avg:.2f} |")
        lines.append("")
    lines += ["## Accuracy (the seed's table)", "",
              "A [64, K] and B [K, 64] from N(128, sigma), rounded and clipped to uint8, no zero points. Relative "
              "RMSE = RMSE / mean of the exact product; errors in units of the integer sum; bound = "
              "docs/avg-matmul.md.", "",
              "| K | sigma | rel. RMSE % | mean error | max error | bound |", "|---:|---:|---:|---:|---:|---:|"]
    for row in accuracy:
        lines.append(f"| {row['K']} | {row['sigma']} | {row['rel_rmse_pct']:.5f} | {row['mean_error']:.1f} | "
                     f"{row['max_error']:.0f} | {row['bound']} |")
    return "\n".join(lines) + "\n"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
