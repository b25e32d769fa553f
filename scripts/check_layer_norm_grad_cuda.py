"""Check ``ai.onnxcampo::LayerNormGrad`` and ``SoftmaxGrad`` on CUDA against the numpy references,
then time them against the unfused backward of a step graph (BERT-base's layer norm ``[4096,
768]``, GPT-2's attention softmax ``[8 * 12 * 256, 256]``, float16).

Run from the repository root on the GPU machine (onnxruntime-gpu, numpy and onnx; onnxcampo need
not be installed), with the library built with CUDA or pointed at:

    export PYTHONPATH=/tmp/ortgpu:$PYTHONPATH ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so
    python3 scripts/check_layer_norm_grad_cuda.py --out $OUT/layer_norm_grad.json

Checks: float32 and float16 tensors (mixed), with and without ``acc``, row lengths 1 to 4096 (one
warp to 1024 threads a row), plain and replayed as a CUDA graph; dx within float32 rounding of the
reference (float16 outputs: one float16 rounding, relative to the row's largest value). Timing
(cuda): the op against the unfused graph (Mul, ReduceMean, Sub, Mul, ReduceMean, Mul, Sub, Mul,
Sum, as ORT runs them, all float16; SoftmaxGrad: Mul, ReduceSum, Sub, Mul, Mul), interleaved in
rounds, bound on the device, replayed and plain; median ms a run and CUPTI device time where torch
is installed.

Prints a line per check, writes JSON to ``--out``; exit 1 when a check fails, 2 when the CUDA EP
is missing. ``--provider cpu --quick`` runs the checks on ORT's CPU provider
(tests/ops/test_layer_norm_grad.py runs it).
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
ln = _load("_onnxcampo_layer_norm", "onnxcampo/ops/layer_norm.py")  # the numpy references
sm = _load("_onnxcampo_softmax", "onnxcampo/ops/softmax.py")
DOMAIN = "ai.onnxcampo"
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}
NAMES = ("dy", "xhat", "invstd", "gamma", "acc")


def _shapes(rows, cols):
    return {"dy": [rows, cols], "xhat": [rows, cols], "invstd": [rows, 1], "gamma": [cols], "acc": [rows, cols]}


def _fused_model(types: dict, rows: int, cols: int, out_type: int, acc: bool) -> bytes:
    names = list(NAMES if acc else NAMES[:4])
    shapes = _shapes(rows, cols)
    node = helper.make_node("LayerNormGrad", names, ["dx"], domain=DOMAIN, output_type=out_type)
    graph = helper.make_graph([node], "lngrad", [helper.make_tensor_value_info(n, types[n], shapes[n]) for n in names],
                              [helper.make_tensor_value_info("dx", out_type, [rows, cols])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString()


def _unfused_model(rows: int, cols: int) -> bytes:
    """The step graph's layer-norm input gradient, every node float16 (the campo plan's)."""
    nodes = [helper.make_node("Mul", ["dy", "gamma"], ["p"]),
             helper.make_node("ReduceMean", ["p"], ["a"], axes=[-1], keepdims=1),
             helper.make_node("Sub", ["p", "a"], ["d1"]),
             helper.make_node("Mul", ["xhat", "p"], ["q"]),
             helper.make_node("ReduceMean", ["q"], ["b"], axes=[-1], keepdims=1),
             helper.make_node("Mul", ["xhat", "b"], ["m"]),
             helper.make_node("Sub", ["d1", "m"], ["d2"]),
             helper.make_node("Mul", ["invstd", "d2"], ["d"]),
             helper.make_node("Sum", ["acc", "d"], ["dx"])]
    shapes = _shapes(rows, cols)
    graph = helper.make_graph(nodes, "unfused", [helper.make_tensor_value_info(n, F16, shapes[n]) for n in NAMES],
                              [helper.make_tensor_value_info("dx", F16, [rows, cols])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def Bound(model: bytes, feeds: dict, out: tuple, library: str, provider: str, graph: bool):
    """dx preallocated and everything bound on the device (fixed addresses, as a replayed graph needs)."""
    return standalone.BoundSession(model, library, provider, feeds, {"dx": out}, cuda_graph=graph)


def _feeds(types: dict, rows: int, cols: int, acc: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    shapes = _shapes(rows, cols)
    feeds = {n: rng.standard_normal(shapes[n]).astype(NUMPY[types[n]]) for n in (NAMES if acc else NAMES[:4])}
    feeds["invstd"] = (np.abs(feeds["invstd"].astype(np.float32)) + 0.5).astype(NUMPY[types["invstd"]])
    return feeds


def _cases(quick: bool):
    """(types of dy, xhat, invstd, gamma, acc; output type; rows; cols; acc given)."""
    half, full = dict.fromkeys(NAMES, F16), dict.fromkeys(NAMES, F32)
    mixed = {"dy": F16, "xhat": F16, "invstd": F32, "gamma": F16, "acc": F32}
    cases = [(full, F32, 3, 1, True), (full, F32, 5, 33, False), (half, F16, 7, 768, True), (mixed, F32, 4, 100, True),
             (half, F32, 2, 4096, False)]
    if not quick:
        cases += [(half, F16, 4096, 768, True), (mixed, F16, 2048, 768, True), (full, F32, 512, 3072, False)]
    return cases


def check(library: str, provider: str, quick: bool) -> list[dict]:
    rows_out = []
    for k, (types, out_type, rows, cols, acc) in enumerate(_cases(quick)):
        feeds = _feeds(types, rows, cols, acc, k)
        want = ln.reference(feeds["dy"], feeds["xhat"], feeds["invstd"], feeds["gamma"], feeds.get("acc"),
                            output_type=out_type).astype(np.float64)
        model = _fused_model(types, rows, cols, out_type, acc)
        for graph in ((False, True) if provider == "cuda" else (False,)):
            bound = Bound(model, feeds, ((rows, cols), NUMPY[out_type]), library, provider, graph)
            for _ in range(3 if graph else 1):
                bound.run()
            got = bound.results()["dx"].astype(np.float64)
            scale = np.maximum(1.0, np.abs(want).max(axis=1, keepdims=True))
            error = float(np.max(np.abs(got - want) / scale))
            tol = 2.0 ** -10 if out_type == F16 else 2e-6
            rows_out.append({"check": f"{provider}{' graph' if graph else ''}: [{rows}, {cols}] "
                                      f"{'/'.join(np.dtype(NUMPY[types[n]]).name for n in NAMES[:4])}"
                                      f"{' + acc' if acc else ''} -> {np.dtype(NUMPY[out_type]).name}",
                             "ok": error <= tol, "error": error})
    return rows_out


def _softmax_model(types, rows, cols, out_type, scale, fused: bool) -> bytes:
    if fused:
        nodes = [helper.make_node("SoftmaxGrad", ["dy", "y"], ["dx"], domain=DOMAIN, cols=cols, scale=scale,
                                  output_type=out_type)]
        inits = []
    else:  # the step graph's backward of Softmax, then the attention's scale
        nodes = [helper.make_node("Mul", ["y", "dy"], ["p"]), helper.make_node("ReduceSum", ["p", "axes"], ["t"], keepdims=1),
                 helper.make_node("Sub", ["dy", "t"], ["s"]), helper.make_node("Mul", ["y", "s"], ["d"]),
                 helper.make_node("Mul", ["d", "scale"], ["dx"])]
        inits = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                 numpy_helper.from_array(np.array([scale], NUMPY[out_type]), "scale")]
    graph = helper.make_graph(nodes, "softmax_grad", [helper.make_tensor_value_info("dy", types[0], [rows, cols]),
                                                      helper.make_tensor_value_info("y", types[1], [rows, cols])],
                              [helper.make_tensor_value_info("dx", out_type, [rows, cols])], inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(DOMAIN, 1)] if fused else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _softmax_feeds(types, rows, cols, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, cols)) * 2
    y = np.exp(logits - logits.max(axis=1, keepdims=True))
    y /= y.sum(axis=1, keepdims=True)
    return {"dy": rng.standard_normal((rows, cols)).astype(NUMPY[types[0]]), "y": y.astype(NUMPY[types[1]])}


def check_softmax(library: str, provider: str, quick: bool) -> list[dict]:
    cases = [((F32, F32), F32, 5, 1, 1.0), ((F16, F16), F16, 7, 128, 0.125), ((F32, F16), F32, 3, 1000, 0.5)]
    if not quick:
        cases += [((F16, F16), F16, 24576, 256, 0.125), ((F16, F16), F16, 49152, 128, 0.125)]
    rows_out = []
    for k, (types, out_type, rows, cols, scale) in enumerate(cases):
        feeds = _softmax_feeds(types, rows, cols, k)
        want = sm.reference(feeds["dy"], feeds["y"], cols=cols, scale=scale, output_type=out_type).astype(np.float64)
        model = _softmax_model(types, rows, cols, out_type, scale, True)
        for graph in ((False, True) if provider == "cuda" else (False,)):
            bound = Bound(model, feeds, ((rows, cols), NUMPY[out_type]), library, provider, graph)
            for _ in range(3 if graph else 1):
                bound.run()
            got = bound.results()["dx"].astype(np.float64)
            scale_of = np.maximum(1e-3, np.abs(want).max(axis=1, keepdims=True))
            error = float(np.max(np.abs(got - want) / scale_of))
            tol = 2.0 ** -10 if out_type == F16 else 2e-6
            rows_out.append({"check": f"{provider}{' graph' if graph else ''}: SoftmaxGrad [{rows}, {cols}] "
                                      f"{np.dtype(NUMPY[types[0]]).name}/{np.dtype(NUMPY[types[1]]).name} scale {scale}"
                                      f" -> {np.dtype(NUMPY[out_type]).name}", "ok": error <= tol, "error": error})
    return rows_out


def time_softmax(library: str, rounds: int) -> dict:
    rows, cols = 8 * 12 * 256, 256
    feeds = _softmax_feeds((F16, F16), rows, cols, 98)
    out = ((rows, cols), np.float16)
    variants = {}
    for graph in (True, False):
        suffix = "-graph" if graph else ""
        for fused in (True, False):
            model = _softmax_model((F16, F16), rows, cols, F16, 0.125, fused)
            variants[f"{'fused' if fused else 'unfused'}{suffix}"] = Bound(model, feeds, out, library, "cuda", graph)
    ms = standalone.time_in_rotation({key: bound.run for key, bound in variants.items()}, rounds, 20)
    print(f"  GPT-2 attention softmax [{rows}, {cols}] float16: fused {ms['fused-graph']:.4f} ms replayed, unfused "
          f"{ms['unfused-graph']:.4f}", flush=True)
    return {"shape": [rows, cols], "dtype": "float16", "ms": ms}




def time_bert(library: str, rounds: int) -> dict:
    rows, cols = 4096, 768
    types = dict.fromkeys(NAMES, F16)
    feeds = _feeds(types, rows, cols, True, 99)
    out = ((rows, cols), np.float16)
    variants = {}
    for graph in (True, False):
        suffix = "-graph" if graph else ""
        variants[f"fused{suffix}"] = Bound(_fused_model(types, rows, cols, F16, True), feeds, out, library, "cuda", graph)
        variants[f"unfused{suffix}"] = Bound(_unfused_model(rows, cols), feeds, out, library, "cuda", graph)
    ms = standalone.time_in_rotation({key: bound.run for key, bound in variants.items()}, rounds, 20)
    difference = float(np.max(np.abs(variants["fused-graph"].results()["dx"].astype(np.float64)
                                     - variants["unfused-graph"].results()["dx"].astype(np.float64))))
    entry = {"shape": [rows, cols], "dtype": "float16", "ms": ms, "max_abs_difference": difference}
    gpu = {}
    for kind in ("fused", "unfused"):
        measured = standalone.gpu_time_per_call(variants[kind].run, 10)
        if measured is not None:
            gpu[kind] = {"total_ms": measured["total_ms"], "launches": measured["launches"]}
    entry["gpu"] = gpu or None
    print(f"  BERT layer norm [{rows}, {cols}] float16: fused {ms['fused-graph']:.4f} ms replayed ({ms['fused']:.4f} "
          f"plain), unfused {ms['unfused-graph']:.4f} ({ms['unfused']:.4f})"
          + (f"; GPU {gpu['fused']['total_ms']:.4f} vs {gpu['unfused']['total_ms']:.4f} ms" if len(gpu) == 2 else "")
          + f"; max |difference| {difference:.2e}", flush=True)
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
    rows = check(library, args.provider, args.quick) + check_softmax(library, args.provider, args.quick)
    for row in rows:
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']} (error {row['error']:.1e})")
    report = {"command": " ".join(["python3", "scripts/check_layer_norm_grad_cuda.py", *(argv or sys.argv[1:])]),
              "onnxruntime": ort.__version__, "checks": rows}
    if args.provider == "cuda" and not args.quick:
        report["timing"] = time_bert(library, args.rounds)
        report["timing_softmax"] = time_softmax(library, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(not row["ok"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
