"""Check ai.onnxcampo::Im2Col on a GPU and time it against today's Slice + Concat im2col.

Run on a CUDA machine (onnxruntime-gpu, numpy and this repository installed; the custom-op
library built with CUDA kernels, ``python -m onnxcampo.ops.build``; torch, when present, adds
CUPTI kernel times), e.g. on the H200 with onnxruntime-gpu in /tmp/ortgpu (docs/ops.md):

    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/oc .
    export PYTHONPATH=/tmp/oc:/tmp/ortgpu ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so
    python3 scripts/check_im2col_cuda.py --out results.json [--rounds 10] [--block-ms 20] [--no-large]

Checks (CUDA EP, IO binding, outputs compared bit for bit):

- small cases, float32 and float16: strides 1/2, dilation 2, asymmetric pads, 1x1, 7x7 stride 2,
  a 3x5 kernel on a non-square image, an empty batch: the CUDA kernel against the numpy
  reference (:func:`reference_im2col`, the formula element by element) and against the CPU kernel;
- every timed ResNet-50 b64 shape (float16): Im2Col against today's subgraph on the GPU and
  against :func:`tap_im2col` (numpy, one strided slice per tap);
- a CUDA-graph session (capture, then replays) equal to the plain run;
- unless ``--no-large``: an output of more than 2^31 elements (the kernel's int64 path; [1, 16,
  4096, 4096] float16, 3x3: 2.4 G elements, 4.8 GB), checked at 2 M sampled positions and over
  its last 1 M elements.

Timing: each im2col of a ResNet-50 b64 224x224 training step (torchvision layout: the stem's 7x7
stride 2, the 3x3 convs, the stride-2 3x3 and 1x1 downsample convs, and the 1x1 stride-1 convs,
whose im2col is a transpose), float16 as a campo plan runs it, as two single-subgraph sessions
timed in rotation in one process (``onnxcampo.runtime.timing.time_in_rotation``: blocks of at
least --block-ms, medians over --rounds blocks), input and output bound on the device:

- ``slice_concat``: the subgraph simplify rule 1 emits without the custom ops: Pad (when padded),
  Transpose [1, 0, 2, 3], one strided Slice per tap, Concats of at most 32 inputs; its output
  [Cin, kh*kw*N, Ho, Wo] is the column matrix's memory (the Gemm reads it through a Reshape);
- ``im2col``: one Im2Col node reading x.

Per shape: wall ms per run of each variant, the speed-up, CUPTI kernel ms and launches per run
(with torch), Im2Col's bytes moved and GB/s; ``resnet50_b64`` sums each variant over the step's
53 Conv weight gradients (count x median). JSON to stdout and --out. Exit 1 on any mismatch or
error, 2 when the CUDA EP or the library's CUDA kernels are missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ops
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session
from onnxcampo.runtime.timing import BoundRunner, time_in_rotation
from onnxcampo.training.simplify import MAX_CONCAT_INPUTS

# (name, x shape [N, C, H, W], kernel, stride, pads [top, left, bottom, right], convs of ResNet-50 with it)
RESNET50_B64 = [
    ("stem 7x7/2", (64, 3, 224, 224), (7, 7), (2, 2), (3, 3, 3, 3), 1),
    ("3x3 c64 56", (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1), 3),
    ("3x3 c128 28", (64, 128, 28, 28), (3, 3), (1, 1), (1, 1, 1, 1), 3),
    ("3x3 c256 14", (64, 256, 14, 14), (3, 3), (1, 1), (1, 1, 1, 1), 5),
    ("3x3 c512 7", (64, 512, 7, 7), (3, 3), (1, 1), (1, 1, 1, 1), 2),
    ("3x3/2 c128 56", (64, 128, 56, 56), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("3x3/2 c256 28", (64, 256, 28, 28), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("3x3/2 c512 14", (64, 512, 14, 14), (3, 3), (2, 2), (1, 1, 1, 1), 1),
    ("1x1/2 c256 56", (64, 256, 56, 56), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1/2 c512 28", (64, 512, 28, 28), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1/2 c1024 14", (64, 1024, 14, 14), (1, 1), (2, 2), (0, 0, 0, 0), 1),
    ("1x1 c64 56", (64, 64, 56, 56), (1, 1), (1, 1), (0, 0, 0, 0), 5),
    ("1x1 c256 56", (64, 256, 56, 56), (1, 1), (1, 1), (0, 0, 0, 0), 3),
    ("1x1 c128 28", (64, 128, 28, 28), (1, 1), (1, 1), (0, 0, 0, 0), 4),
    ("1x1 c512 28", (64, 512, 28, 28), (1, 1), (1, 1), (0, 0, 0, 0), 4),
    ("1x1 c256 14", (64, 256, 14, 14), (1, 1), (1, 1), (0, 0, 0, 0), 6),
    ("1x1 c1024 14", (64, 1024, 14, 14), (1, 1), (1, 1), (0, 0, 0, 0), 6),
    ("1x1 c512 7", (64, 512, 7, 7), (1, 1), (1, 1), (0, 0, 0, 0), 3),
    ("1x1 c2048 7", (64, 2048, 7, 7), (1, 1), (1, 1), (0, 0, 0, 0), 2),
]
assert sum(case[-1] for case in RESNET50_B64) == 53

# (x shape, kernel, stride, dilation, pads): the kernel tests' shapes
SMALL_CASES = [
    ((2, 3, 9, 11), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1)),
    ((2, 3, 9, 11), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2)),
    ((2, 3, 9, 11), (3, 3), (2, 1), (1, 2), (0, 2, 1, 3)),
    ((2, 3, 16, 13), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3)),
    ((3, 5, 9, 11), (3, 5), (1, 2), (2, 1), (1, 0, 2, 2)),
    ((2, 4, 8, 6), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((2, 4, 9, 7), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0)),
    ((1, 1, 5, 5), (5, 5), (1, 1), (1, 1), (0, 0, 0, 0)),
    ((0, 3, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
    ((4, 33, 31, 29), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),  # several CPU tasks
]


# --------------------------------------------------------------------------------------------
# references
# --------------------------------------------------------------------------------------------

def output_hw(shape, kernel, stride, dilation, pads) -> tuple[int, int]:
    _, _, h, w = shape
    ho = (h + pads[0] + pads[2] - ((kernel[0] - 1) * dilation[0] + 1)) // stride[0] + 1
    wo = (w + pads[1] + pads[3] - ((kernel[1] - 1) * dilation[1] + 1)) // stride[1] + 1
    return ho, wo


def reference_im2col(x: np.ndarray, kernel, stride=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """columns[(c*kh + i)*kw + j, (n*Ho + oh)*Wo + ow] = x[n, c, oh*sh + i*dh - pt, ow*sw + j*dw - pl],
    0 outside x: the op's formula, element by element (index arrays; small inputs)."""
    n, c, h, w = x.shape
    ho, wo = output_hw(x.shape, kernel, stride, dilation, pads)
    ci, ii, ji, ni, ohi, owi = np.ix_(range(c), range(kernel[0]), range(kernel[1]), range(n), range(ho), range(wo))
    rows = ohi * stride[0] + ii * dilation[0] - pads[0]
    cols = owi * stride[1] + ji * dilation[1] - pads[1]
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    values = x[ni, ci, np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)]
    out = np.where(inside, values, np.zeros((), x.dtype)).astype(x.dtype)
    return out.reshape(c * kernel[0] * kernel[1], n * ho * wo)


def tap_im2col(x: np.ndarray, kernel, stride=(1, 1), dilation=(1, 1), pads=(0, 0, 0, 0)) -> np.ndarray:
    """The same matrix as today's graph builds it: the padded, transposed input sliced once per
    tap, the taps stacked ([Cin, kh, kw, N, Ho, Wo]); memory-light for large inputs."""
    n, c, _, _ = x.shape
    ho, wo = output_hw(x.shape, kernel, stride, dilation, pads)
    padded = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    out = np.empty((c, kernel[0], kernel[1], n, ho, wo), x.dtype)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dilation[0], j * dilation[1]
            tap = padded[:, :, top:top + (ho - 1) * stride[0] + 1:stride[0], left:left + (wo - 1) * stride[1] + 1:stride[1]]
            out[:, i, j] = tap.transpose(1, 0, 2, 3)
    return out.reshape(c * kernel[0] * kernel[1], n * ho * wo)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------

def _model(graph_nodes, x_shape, dtype, out_name, out_shape, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(graph_nodes, "im2col", [helper.make_tensor_value_info("x", dtype, list(x_shape))],
                              [helper.make_tensor_value_info(out_name, dtype, list(out_shape))], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def im2col_model(x_shape, kernel, stride, dilation, pads, dtype) -> onnx.ModelProto:
    rows, columns = nodes.im2col_shape(x_shape, kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads)
    node = nodes.im2col("x", output="columns", kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads,
                        name="im2col")
    return _model([node], x_shape, dtype, "columns", (rows, columns))


def slice_concat_model(x_shape, kernel, stride, pads, dtype) -> onnx.ModelProto:
    """Today's emission (onnxcampo/training/simplify.py, ``_emit_weight_gradient``) with the
    forward Conv's Pad and Transpose before it; dilation 1 (ResNet)."""
    n, c, h, w = x_shape
    ho, wo = output_hw(x_shape, kernel, stride, (1, 1), pads)
    graph_nodes, inits = [], []

    def const(name, values):
        inits.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    source = "x"
    if any(pads):
        graph_nodes.append(helper.make_node("Pad", ["x", const("pads", [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]])],
                                            ["padded"], mode="constant"))
        source = "padded"
    graph_nodes.append(helper.make_node("Transpose", [source], ["images"], perm=[1, 0, 2, 3]))
    hp, wp = h + pads[0] + pads[2], w + pads[1] + pads[3]
    if tuple(kernel) == (1, 1) and tuple(stride) == (1, 1) and (ho, wo) == (hp, wp):
        taps = ["images"]
    else:
        taps = []
        const("axes", [2, 3])
        const("steps", list(stride))
        for a in range(kernel[0]):
            for b in range(kernel[1]):
                starts = [a, b]
                ends = [a + (ho - 1) * stride[0] + 1, b + (wo - 1) * stride[1] + 1]
                tap = f"tap_{a}_{b}"
                graph_nodes.append(helper.make_node("Slice", ["images", const(f"{tap}/starts", starts),
                                                              const(f"{tap}/ends", ends), "axes", "steps"], [tap]))
                taps.append(tap)
    level = 0
    while len(taps) > MAX_CONCAT_INPUTS:
        groups = [taps[i:i + MAX_CONCAT_INPUTS] for i in range(0, len(taps), MAX_CONCAT_INPUTS)]
        taps = []
        for k, group in enumerate(groups):
            if len(group) == 1:
                taps.append(group[0])
                continue
            part = f"part_{level}_{k}"
            graph_nodes.append(helper.make_node("Concat", group, [part], axis=1))
            taps.append(part)
        level += 1
    out_shape = (c, kernel[0] * kernel[1] * n, ho, wo)
    if len(taps) > 1:
        graph_nodes.append(helper.make_node("Concat", taps, ["columns"], axis=1))
    else:  # one tap (the Transpose itself for a 1x1 stride-1 Conv): it is the graph output
        graph_nodes[-1].output[0] = "columns"
    return _model(graph_nodes, x_shape, dtype, "columns", out_shape, inits)


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def _run(model, x, provider="cuda", cuda_graph=False, replays=0) -> np.ndarray:
    session = make_session(model, provider=provider, cuda_graph=cuda_graph)
    runner = BoundRunner(session, {"x": x}, "cuda" if provider == "cuda" else "cpu", cuda_graph=cuda_graph)
    runner()
    for _ in range(replays):
        runner()
    return runner.outputs()["columns"]


def _same(got: np.ndarray, want: np.ndarray) -> dict:
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if got.shape != want.shape:
        return {"ok": False, "why": f"{got.size} elements, expected {want.size}"}
    if got.dtype != want.dtype:
        return {"ok": False, "why": f"dtype {got.dtype}, expected {want.dtype}"}
    bits = f"u{got.dtype.itemsize}"
    differ = int(np.count_nonzero(got.view(bits) != want.view(bits)))  # bit for bit (NaN payloads, -0)
    return {"ok": differ == 0, "elements": int(got.size), "differ": differ}


def check(label: str, fn, results: list) -> bool:
    start = time.perf_counter()
    try:
        entry = fn()
    except Exception as exc:  # noqa: BLE001 - every check reports, none ends the run
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
    entry = {"check": label, **entry, "s": round(time.perf_counter() - start, 2)}
    results.append(entry)
    status = "ok  " if entry["ok"] else "FAIL"
    print(f"{status} {label}: {entry.get('error') or entry.get('why') or ''}", file=sys.stderr, flush=True)
    return entry["ok"]


def small_checks(results: list, rng) -> None:
    for shape, kernel, stride, dilation, pads in SMALL_CASES:
        for dtype, onnx_type in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
            def one(shape=shape, kernel=kernel, stride=stride, dilation=dilation, pads=pads, dtype=dtype, onnx_type=onnx_type):
                x = rng.standard_normal(shape).astype(dtype)
                model = im2col_model(shape, kernel, stride, dilation, pads, onnx_type)
                want = reference_im2col(x, kernel, stride, dilation, pads)
                cuda, cpu = _run(model, x), _run(model, x, provider="cpu")
                vs_numpy, vs_cpu = _same(cuda, want), _same(cuda, cpu)
                return {"ok": vs_numpy["ok"] and vs_cpu["ok"] and cuda.shape == want.shape,
                        "shape": list(cuda.shape), "vs_numpy": vs_numpy, "vs_cpu": vs_cpu}
            check(f"{np.dtype(dtype).name} x{list(shape)} k{list(kernel)} s{list(stride)} d{list(dilation)} "
                  f"p{list(pads)}", one, results)


def resnet_checks(results: list, rng) -> None:
    for name, shape, kernel, stride, pads, _ in RESNET50_B64:
        def one(shape=shape, kernel=kernel, stride=stride, pads=pads):
            x = rng.standard_normal(shape).astype(np.float16)
            new = _run(im2col_model(shape, kernel, stride, (1, 1), pads, TensorProto.FLOAT16), x)
            old = _run(slice_concat_model(shape, kernel, stride, pads, TensorProto.FLOAT16), x)
            vs_graph, vs_numpy = _same(new, old), _same(new, tap_im2col(x, kernel, stride, (1, 1), pads))
            return {"ok": vs_graph["ok"] and vs_numpy["ok"], "vs_slice_concat": vs_graph, "vs_numpy": vs_numpy}
        check(f"float16 {name} {list(shape)} vs today's subgraph and numpy", one, results)

    def graph():
        shape, kernel, stride, pads = (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1)
        x = rng.standard_normal(shape).astype(np.float16)
        model = im2col_model(shape, kernel, stride, (1, 1), pads, TensorProto.FLOAT16)
        replayed = _run(model, x, cuda_graph=True, replays=3)
        return {"ok": _same(replayed, _run(model, x))["ok"], "vs_plain": _same(replayed, _run(model, x))}
    check("CUDA graph: capture and 3 replays equal the plain run ([64, 64, 56, 56] float16 3x3)", graph, results)


def large_check(results: list, rng) -> None:
    def one():
        shape, kernel, stride, dilation, pads = (1, 16, 4096, 4096), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)
        x = rng.standard_normal(shape).astype(np.float16)
        rows, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, dilations=dilation, pads=pads)
        total = rows * columns
        got = _run(im2col_model(shape, kernel, stride, dilation, pads, TensorProto.FLOAT16), x).reshape(-1)
        flat = np.concatenate([rng.integers(0, total, 2_000_000), np.arange(total - 1_000_000, total)])
        row, col = flat // columns, flat % columns
        ho, wo = output_hw(shape, kernel, stride, dilation, pads)
        ow, oh, n = col % wo, (col // wo) % ho, col // (wo * ho)
        j, i, c = row % kernel[1], (row // kernel[1]) % kernel[0], row // (kernel[0] * kernel[1])
        h, w = oh * stride[0] + i * dilation[0] - pads[0], ow * stride[1] + j * dilation[1] - pads[1]
        inside = (h >= 0) & (h < shape[2]) & (w >= 0) & (w < shape[3])
        want = np.where(inside, x[n, c, np.clip(h, 0, shape[2] - 1), np.clip(w, 0, shape[3] - 1)], np.float16(0))
        differ = int(np.count_nonzero(got[flat].view(np.uint16) != want.view(np.uint16)))
        return {"ok": got.size == total and differ == 0, "elements": int(total), "checked": int(flat.size),
                "differ": differ}
    check("float16 [1, 16, 4096, 4096] 3x3: 2.4 G output elements (int64 kernel), sampled", one, results)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------

def _cupti(fn, runs: int):
    try:
        from benchkit import measure as bench_measure  # scripts/benchkit; torch's CUPTI
    except Exception:  # noqa: BLE001
        return None
    kernels = bench_measure.cupti_kernels(fn, runs)
    if not kernels:
        return None
    return {"kernel_ms": round(sum(ms for _, ms, _ in kernels), 5), "launches": round(sum(c for _, _, c in kernels), 1),
            "top": [(name[:100], round(ms, 5), round(count, 1)) for name, ms, count in kernels[:4]]}


def timing(args, rng) -> tuple[list, dict]:
    rows = []
    totals = {"slice_concat_ms": 0.0, "im2col_ms": 0.0, "slice_concat_kernel_ms": 0.0, "im2col_kernel_ms": 0.0,
              "slice_concat_launches": 0.0, "im2col_launches": 0.0}
    cupti_complete = True
    for name, shape, kernel, stride, pads, count in RESNET50_B64:
        x = rng.standard_normal(shape).astype(np.float16)
        models = {"slice_concat": slice_concat_model(shape, kernel, stride, pads, TensorProto.FLOAT16),
                  "im2col": im2col_model(shape, kernel, stride, (1, 1), pads, TensorProto.FLOAT16)}
        runners = {key: BoundRunner(make_session(model, provider="cuda"), {"x": x}, "cuda") for key, model in models.items()}
        times = time_in_rotation(runners, rounds=args.rounds, block_ms=args.block_ms)
        rows_, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, pads=pads)
        moved = 2 * (rows_ * columns + int(np.prod(shape)))  # float16: written once, x read (at least) once
        row = {"conv": name, "x": list(shape), "kernel": list(kernel), "stride": list(stride), "pads": list(pads),
               "count": count, "columns": [rows_, columns],
               "nodes": {key: len(model.graph.node) for key, model in models.items()}}
        for key, timed in times.items():
            row[f"{key}_ms"] = timed.median_ms
            row[f"{key}_blocks_ms"] = list(timed.blocks_ms)
            if timed.error:
                row[f"{key}_error"] = timed.error
        if row.get("im2col_ms") and row.get("slice_concat_ms"):
            row["speedup"] = round(row["slice_concat_ms"] / row["im2col_ms"], 3)
            row["im2col_gbps"] = round(moved / (row["im2col_ms"] * 1e-3) / 1e9, 1)
            totals["slice_concat_ms"] += count * row["slice_concat_ms"]
            totals["im2col_ms"] += count * row["im2col_ms"]
        for key, runner in runners.items():
            found = _cupti(runner, 20) if not args.no_cupti else None
            row[f"{key}_cupti"] = found
            if found:
                totals[f"{key}_kernel_ms"] += count * found["kernel_ms"]
                totals[f"{key}_launches"] += count * found["launches"]
            else:
                cupti_complete = False
        rows.append(row)
        print(f"     {name:16s} slice+concat {row.get('slice_concat_ms') or float('nan'):8.4f} ms   "
              f"im2col {row.get('im2col_ms') or float('nan'):8.4f} ms   x{row.get('speedup', float('nan')):.2f}",
              file=sys.stderr, flush=True)
        del runners
    totals = {k: round(v, 4) for k, v in totals.items()}
    if not cupti_complete:
        totals = {k: v for k, v in totals.items() if "kernel" not in k and "launches" not in k}
    return rows, totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--rounds", type=int, default=10, help="timed blocks per variant (medians over them)")
    parser.add_argument("--block-ms", type=float, default=20.0, help="a timed block lasts at least this long")
    parser.add_argument("--no-large", action="store_true", help="skip the 2.4 G-element check (int64 kernel)")
    parser.add_argument("--no-timing", action="store_true", help="checks only")
    parser.add_argument("--no-cupti", action="store_true", help="no CUPTI kernel times (torch's profiler)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: run on a CUDA machine", file=sys.stderr)
        return 2
    info = ops.build_info()
    if "cuda" not in info.get("kernels", ""):
        print(f"the custom-op library {ops.library_path()} has no CUDA kernels ({info}); build it where nvcc is",
              file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    results: dict = {"onnxruntime": ort.__version__, "library": ops.library_path(), "build_info": info,
                     "argv": sys.argv[1:], "checks": []}
    try:
        import torch

        results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        results["device"] = None
    small_checks(results["checks"], rng)
    resnet_checks(results["checks"], rng)
    if not args.no_large:
        large_check(results["checks"], rng)
    if not args.no_timing:
        try:
            results["timing"], results["resnet50_b64"] = timing(args, rng)
        except Exception as exc:  # noqa: BLE001
            results["timing_error"] = f"{type(exc).__name__}: {exc}"
            results["timing_trace"] = traceback.format_exc(limit=6)
    failed = [c["check"] for c in results["checks"] if not c["ok"]]
    results["ok"] = not failed and "timing_error" not in results
    results["failed"] = failed
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(f"{len(results['checks']) - len(failed)} of {len(results['checks'])} checks passed"
          + (f"; resnet50 b64 im2col total: slice+concat {results['resnet50_b64'].get('slice_concat_ms')} ms, "
             f"Im2Col {results['resnet50_b64'].get('im2col_ms')} ms" if results.get("resnet50_b64") else ""),
          file=sys.stderr)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
