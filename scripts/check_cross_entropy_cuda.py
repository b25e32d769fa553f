"""Check ``ai.onnxcampo::SoftmaxCrossEntropy`` and ``SoftmaxCrossEntropyGrad`` on CUDA against the
numpy reference, then time them against the unfused loss graph ``train-graph`` writes (GPT-2's
``[2048, 50257]`` logits).

Run from the repository root on the GPU machine (onnxruntime-gpu, numpy and onnx; onnxcampo need
not be installed), with the library built with CUDA or pointed at:

    export PYTHONPATH=/tmp/ortgpu:$PYTHONPATH ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so
    python3 scripts/check_cross_entropy_cuda.py --out $OUT/cross_entropy.json

Checks: float32 and float16 logits, float32 and float16 outputs, padded rows (``classes`` <
width), the gradient written in padded rows (``output_columns``: zeros after the classes, as loss
fusion rule 5 writes GPT-2's), labels counted from the end and out of range, one scale or one per row; class counts from
1 to 50257 (one warp to 1024 threads a row), in a plain session and replayed as a CUDA graph.
``lse`` within 2e-6 relative, ``picked`` and ``dx`` within float32 rounding of the reference
(float16 outputs: one float16 rounding). Timing (cuda): the fused pair against the unfused graph
(Cast, LogSoftmax, OneHot, Mul, ReduceSum; Expand, Mul, ReduceSum, Exp, Mul, Sub) on float16
logits ``[2048, 50257]``, interleaved in rounds, bound on the device, replayed and plain; median
ms a run, the values compared, and the device time per run (CUPTI) where torch is installed.

Prints a line per check and a table, writes JSON to ``--out``; exit 1 when a check fails, 2 when
the CUDA EP is missing. ``--provider cpu --quick`` runs the checks on ORT's CPU provider
(tests/ops/test_cross_entropy.py runs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standalone = _load("_onnxcampo_standalone_sessions", "onnxcampo/runtime/standalone.py")  # no onnxcampo needed
ce = _load("_onnxcampo_cross_entropy", "onnxcampo/ops/cross_entropy.py")  # the numpy reference
DOMAIN = "ai.onnxcampo"
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}


def _fused_model(x_type, out_type, rows, width, classes, scale_rows, columns=None) -> bytes:
    attrs = {"output_type": out_type}
    if classes != width:
        attrs["classes"] = classes
    padded = {} if columns is None else {"output_columns": columns}
    nodes = [helper.make_node("SoftmaxCrossEntropy", ["x", "labels"], ["picked", "lse"], domain=DOMAIN, **attrs),
             helper.make_node("SoftmaxCrossEntropyGrad", ["x", "lse", "labels", "scale"], ["dx"], domain=DOMAIN,
                              output_shape=[rows, columns or classes], **attrs, **padded)]
    graph = helper.make_graph(nodes, "xent", [
        helper.make_tensor_value_info("x", x_type, [rows, width]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, [rows]),
        helper.make_tensor_value_info("scale", F32, [scale_rows, 1])], [
        helper.make_tensor_value_info("picked", out_type, [rows]), helper.make_tensor_value_info("lse", F32, [rows]),
        helper.make_tensor_value_info("dx", out_type, [rows, columns or classes])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString()


def _unfused_model(rows, classes) -> bytes:
    """The loss and its gradient as the step graph computes them, float16 logits widened first."""
    inits = [numpy_helper.from_array(np.array(classes, np.int64), "depth"),
             numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "values"),
             numpy_helper.from_array(np.array([-1], np.int64), "axis"),
             numpy_helper.from_array(np.array([rows, classes], np.int64), "full")]
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=F32),
             helper.make_node("LogSoftmax", ["xf"], ["logp"], axis=-1),
             helper.make_node("OneHot", ["labels", "depth", "values"], ["onehot"], axis=-1),
             helper.make_node("Mul", ["onehot", "logp"], ["p"]),
             helper.make_node("ReduceSum", ["p", "axis"], ["picked"], keepdims=0),
             helper.make_node("Expand", ["scale", "full"], ["a"]),
             helper.make_node("Mul", ["a", "onehot"], ["g"]),
             helper.make_node("ReduceSum", ["g", "axis"], ["t"], keepdims=1),
             helper.make_node("Exp", ["logp"], ["e"]),
             helper.make_node("Mul", ["e", "t"], ["m"]),
             helper.make_node("Sub", ["g", "m"], ["dx"])]
    graph = helper.make_graph(nodes, "loss", [
        helper.make_tensor_value_info("x", F16, [rows, classes]),
        helper.make_tensor_value_info("labels", TensorProto.INT64, [rows]),
        helper.make_tensor_value_info("scale", F32, [rows, 1])], [
        helper.make_tensor_value_info("picked", F32, [rows]), helper.make_tensor_value_info("dx", F32, [rows, classes])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def Bound(model: bytes, feeds: dict, outputs: dict, library: str, provider: str, graph: bool):
    """Inputs and outputs bound on the device (fixed addresses, as a replayed graph needs)."""
    return standalone.BoundSession(model, library, provider, feeds, outputs, cuda_graph=graph)


def _cases(quick: bool):
    """(x type, output type, rows, width, classes, scale per row, output columns or None)."""
    cases = [(F32, F32, 5, 1, 1, False, None), (F32, F32, 7, 33, 33, True, None), (F16, F16, 6, 40, 37, True, None),
             (F16, F32, 9, 4100, 4097, True, None), (F32, F16, 3, 1000, 1000, False, None),
             (F32, F16, 9, 40, 37, True, 40), (F16, F16, 4, 37, 37, False, 48)]
    if not quick:
        cases += [(F16, F32, 64, 1000, 1000, False, None), (F32, F32, 32, 2, 2, False, None),
                  (F16, F32, 2048, 50264, 50257, True, None), (F32, F32, 256, 50257, 50257, True, None),
                  (F32, F16, 2048, 50264, 50257, True, 50264)]  # GPT-2's, as loss fusion rule 5 writes it
    return cases


def _inputs(x_type, rows, width, classes, per_row, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, width)) * 3).astype(NUMPY[x_type])
    x[:, classes:] = 3e4  # padding: never read
    labels = rng.integers(0, classes, size=rows).astype(np.int64)
    specials = [-1, classes, -classes - 1, -classes][:rows]
    labels[:len(specials)] = specials  # from the end, past the end, before the start, the first from the end
    scale = rng.standard_normal((rows if per_row else 1, 1)).astype(np.float32)
    return {"x": x, "labels": labels, "scale": scale}


def check(library: str, provider: str, quick: bool) -> list[dict]:
    rows_out = []
    for k, (x_type, out_type, rows, width, classes, per_row, columns) in enumerate(_cases(quick)):
        feeds = _inputs(x_type, rows, width, classes, per_row, k)
        picked, lse = ce.forward(feeds["x"], feeds["labels"], classes=classes, output_type=out_type)
        dx = ce.grad(feeds["x"], lse, feeds["labels"], feeds["scale"], classes=classes, output_type=out_type,
                     output_columns=columns)
        model = _fused_model(x_type, out_type, rows, width, classes, feeds["scale"].shape[0], columns)
        outputs = {"picked": ((rows,), NUMPY[out_type]), "lse": ((rows,), np.float32),
                   "dx": ((rows, columns or classes), NUMPY[out_type])}
        for graph in ((False, True) if provider == "cuda" else (False,)):
            bound = Bound(model, feeds, outputs, library, provider, graph)
            for _ in range(3 if graph else 1):
                bound.run()
            got = bound.results()
            tol = 2.0 ** -10 if out_type == F16 else 4e-6
            errors = {
                "lse": float(np.max(np.abs(got["lse"] - lse) / np.maximum(1.0, np.abs(lse)))),
                "picked": float(np.max(np.abs(got["picked"].astype(np.float64) - picked) /
                                       np.maximum(1.0, np.abs(picked.astype(np.float64))))),
                "dx": float(np.max(np.abs(got["dx"].astype(np.float64) - dx.astype(np.float64)))
                            / max(1.0, float(np.abs(feeds["scale"]).max()))),
            }
            padding_zero = bool(np.all(got["dx"][:, classes:] == 0))  # zeros, sign bits included
            padding_zero = padding_zero and not np.signbit(got["dx"][:, classes:]).any()
            ok = errors["lse"] <= 2e-6 and errors["picked"] <= tol * 4 and errors["dx"] <= tol and padding_zero
            rows_out.append({"check": f"{provider}{' graph' if graph else ''}: x {np.dtype(NUMPY[x_type]).name} "
                                      f"[{rows}, {width}] classes {classes}, output {np.dtype(NUMPY[out_type]).name}"
                                      + (f" in rows of {columns}" if columns else "")
                                      + f", scale {'per row' if per_row else 'one'}", "ok": ok, "errors": errors})
    return rows_out




def time_gpt2(library: str, rounds: int) -> dict:
    rows, classes = 2048, 50257
    feeds = _inputs(F16, rows, classes, classes, True, 99)
    outputs = {"picked": ((rows,), np.float32), "dx": ((rows, classes), np.float32)}
    variants = {}
    for graph in (True, False):
        suffix = "-graph" if graph else ""
        variants[f"fused{suffix}"] = Bound(_fused_model(F16, F32, rows, classes, classes, rows), feeds,
                                           {**outputs, "lse": ((rows,), np.float32)}, library, "cuda", graph)
        variants[f"unfused{suffix}"] = Bound(_unfused_model(rows, classes), feeds, outputs, library, "cuda", graph)
    ms = standalone.time_in_rotation({key: bound.run for key, bound in variants.items()}, rounds, 10)
    fused, unfused = variants["fused-graph"].results(), variants["unfused-graph"].results()
    entry = {"shape": [rows, classes], "x": "float16", "ms": ms,
             "max_abs_difference": {k: float(np.max(np.abs(fused[k] - unfused[k]))) for k in ("picked", "dx")}}
    gpu = {}
    for kind in ("fused", "unfused"):
        measured = standalone.gpu_time_per_call(variants[kind].run, 10)
        if measured is not None:
            gpu[kind] = {"total_ms": measured["total_ms"], "launches": measured["launches"]}
    entry["gpu"] = gpu or None
    print(f"  GPT-2 loss [{rows}, {classes}] float16: fused {ms['fused-graph']:.3f} ms replayed ({ms['fused']:.3f} "
          f"plain), unfused {ms['unfused-graph']:.3f} ({ms['unfused']:.3f})"
          + (f"; GPU {gpu['fused']['total_ms']:.3f} vs {gpu['unfused']['total_ms']:.3f} ms" if len(gpu) == 2 else "")
          + f"; max |difference| picked {entry['max_abs_difference']['picked']:.2e}, dx "
            f"{entry['max_abs_difference']['dx']:.2e}", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small cases only, no timing")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds (default 5)")
    parser.add_argument("--library", help="the custom-op library (default $ONNXCAMPO_OPS_LIBRARY or the built one)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args(argv)
    library = args.library or os.environ.get("ONNXCAMPO_OPS_LIBRARY") or str(ROOT / "onnxcampo/ops/lib/libonnxcampo_ops.so")
    if not Path(library).is_file():
        print(f"error: no custom-op library at {library}: run `python3 -m onnxcampo.ops.build`", file=sys.stderr)
        return 2
    if args.provider == "cuda":
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print("error: --provider cuda needs onnxruntime-gpu with the CUDA execution provider", file=sys.stderr)
            return 2
    rows = check(library, args.provider, args.quick)
    for row in rows:
        errors = ", ".join(f"{k} {v:.1e}" for k, v in row["errors"].items())
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']} ({errors})")
    report = {"command": " ".join(["python3", "scripts/check_cross_entropy_cuda.py", *(argv or sys.argv[1:])]),
              "onnxruntime": ort.__version__, "checks": rows}
    if args.provider == "cuda" and not args.quick:
        report["timing"] = time_gpt2(library, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(not row["ok"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
