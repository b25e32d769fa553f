"""Check ai.onnxcampo::ConvWeightGrad (cuDNN's backward filter) on a GPU and time it against the
Gemm over Im2Col that simplify rule 1 emits otherwise.

Run on a CUDA machine like scripts/check_im2col_cuda.py (onnxruntime-gpu, numpy, this repository
installed, the custom-op library built with CUDA kernels; torch, when present, adds CUPTI times):

    python3 scripts/check_conv_grad_cuda.py --out results.json [--rounds 10] [--block-ms 20]

Checks (CUDA EP, IO binding): the small cases of check_im2col_cuda.py whose pads cuDNN's
symmetric padding serves, float32 (TF32, as ORT's Conv) and float16, against a float64 numpy
reference (the im2col matrix times dy) and against the CPU kernel, within ``--rtol`` of the
largest reference value (float16 outputs: one rounding; TF32 products: 10-bit mantissas); every
ResNet-50 b64 weight-gradient shape in float16 against the Im2Col + Gemm subgraph; a CUDA-graph
session (capture, replays) equal to the plain run.

Timing: each Conv weight gradient of a ResNet-50 b64 step (check_im2col_cuda.RESNET50_B64),
float16, the two variants as single-subgraph sessions timed in rotation in one process
(``time_in_rotation``), x and dy bound on the device: ``im2col_gemm`` (Im2Col(x), dy reshaped to
[Cout, N*Ho*Wo] after the Transpose to channels-first, Gemm transB=1: what the step graph
runs without ConvWeightGrad; session 11's first run left the Transpose out, so its Im2Col + Gemm
was a wrong reference for N > 1 and its times lack the Transpose) and
``conv_weight_grad``; per shape the median ms and speed-up, summed over the step's 53 convs
(count x median). JSON to stdout and --out; exit 1 on a mismatch or error.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from check_im2col_cuda import RESNET50_B64, SMALL_CASES, _cupti, check, output_hw, reference_im2col
from onnxcampo import ops
from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session
from onnxcampo.runtime.timing import BoundRunner, time_in_rotation


def cudnn_fits(shape, kernel, stride, dilation, pads) -> bool:
    """cuDNN pads top/left on both sides: the same (Ho, Wo) as the op's pads (simplify's test)."""
    ho, wo = output_hw(shape, kernel, stride, dilation, pads)
    for size, begin, k, d, s, o in zip(shape[2:], pads[:2], kernel, dilation, stride, (ho, wo)):
        if (size + 2 * begin - ((k - 1) * d + 1)) // s + 1 != o:
            return False
    return True


def dy_shape(shape, kernel, stride, dilation, pads, cout):
    ho, wo = output_hw(shape, kernel, stride, dilation, pads)
    return (shape[0], cout, ho, wo)


def _model(graph_nodes, shape, dy, dtype, out_shape, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(graph_nodes, "conv_weight_grad",
                              [helper.make_tensor_value_info("x", dtype, list(shape)),
                               helper.make_tensor_value_info("dy", dtype, list(dy))],
                              [helper.make_tensor_value_info("dw", dtype, list(out_shape))], value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def op_model(shape, kernel, stride, dilation, pads, cout, dtype) -> onnx.ModelProto:
    node = nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=kernel, strides=stride, dilations=dilation,
                                  pads=pads, name="conv_weight_grad")
    return _model([node], shape, dy_shape(shape, kernel, stride, dilation, pads, cout), dtype,
                  (cout, shape[1], *kernel))


def im2col_gemm_model(shape, kernel, stride, pads, cout, dtype) -> onnx.ModelProto:
    rows, columns = nodes.im2col_shape(shape, kernel_shape=kernel, strides=stride, pads=pads)
    dy = dy_shape(shape, kernel, stride, (1, 1), pads, cout)
    graph_nodes = [
        nodes.im2col("x", output="columns", kernel_shape=kernel, strides=stride, pads=pads, name="im2col"),
        helper.make_node("Transpose", ["dy"], ["dy_cnhw"], perm=[1, 0, 2, 3]),  # channels first, as the step graph's
        helper.make_node("Constant", [], ["dy_shape"], value=helper.make_tensor("s", TensorProto.INT64, [2], [cout, columns])),
        helper.make_node("Reshape", ["dy_cnhw", "dy_shape"], ["dy2"]),
        helper.make_node("Gemm", ["dy2", "columns"], ["product"], transB=1),
        helper.make_node("Constant", [], ["w_shape"],
                         value=helper.make_tensor("w", TensorProto.INT64, [4], [cout, shape[1], *kernel])),
        helper.make_node("Reshape", ["product", "w_shape"], ["dw"]),
    ]
    info = [helper.make_tensor_value_info("columns", dtype, [rows, columns])]
    return _model(graph_nodes, shape, dy, dtype, (cout, shape[1], *kernel), info)


def reference(x, dy, kernel, stride, dilation, pads) -> np.ndarray:
    columns = reference_im2col(x.astype(np.float64), kernel, stride, dilation, pads)  # [Cin*kh*kw, N*Ho*Wo]
    cout = dy.shape[1]
    d = dy.astype(np.float64).transpose(1, 0, 2, 3).reshape(cout, -1)
    return (d @ columns.T).reshape(cout, x.shape[1], *kernel)


def _run(model, feeds, provider="cuda", cuda_graph=False, replays=0) -> np.ndarray:
    session = make_session(model, provider=provider, cuda_graph=cuda_graph)
    runner = BoundRunner(session, feeds, "cuda" if provider == "cuda" else "cpu", cuda_graph=cuda_graph)
    runner()
    for _ in range(replays):
        runner()
    return runner.outputs()["dw"]


def _close(got, want, rtol) -> dict:
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max()), 1e-30)
    error = float(np.abs(got - want).max()) / scale
    return {"ok": bool(got.shape == want.shape and np.isfinite(got).all() and error <= rtol),
            "max_error_over_max_ref": error}


def small_checks(results, rng, rtol) -> None:
    for shape, kernel, stride, dilation, pads in SMALL_CASES:
        if not cudnn_fits(shape, kernel, stride, dilation, pads):
            continue
        for dtype, onnx_type in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
            def one(shape=shape, kernel=kernel, stride=stride, dilation=dilation, pads=pads, dtype=dtype,
                    onnx_type=onnx_type):
                cout = 5
                x = rng.standard_normal(shape).astype(dtype)
                dy = rng.standard_normal(dy_shape(shape, kernel, stride, dilation, pads, cout)).astype(dtype)
                model = op_model(shape, kernel, stride, dilation, pads, cout, onnx_type)
                want = reference(x, dy, kernel, stride, dilation, pads)
                cuda, cpu = _run(model, {"x": x, "dy": dy}), _run(model, {"x": x, "dy": dy}, provider="cpu")
                vs_numpy, vs_cpu = _close(cuda, want, rtol), _close(cuda, cpu.astype(np.float64), rtol)
                if shape[0] == 0:  # an empty sum: zeros exactly
                    vs_numpy = {"ok": bool(np.all(cuda == 0)), "zeros": True}
                return {"ok": vs_numpy["ok"] and vs_cpu["ok"], "vs_numpy": vs_numpy, "vs_cpu": vs_cpu}
            check(f"{np.dtype(dtype).name} x{list(shape)} k{list(kernel)} s{list(stride)} d{list(dilation)} "
                  f"p{list(pads)}", one, results)


def resnet_checks(results, rng, rtol) -> None:
    for name, shape, kernel, stride, pads, _ in RESNET50_B64:
        def one(shape=shape, kernel=kernel, stride=stride, pads=pads):
            cout = 64
            x = rng.standard_normal(shape).astype(np.float16)
            dy = rng.standard_normal(dy_shape(shape, kernel, stride, (1, 1), pads, cout)).astype(np.float16)
            feeds = {"x": x, "dy": dy}
            new = _run(op_model(shape, kernel, stride, (1, 1), pads, cout, TensorProto.FLOAT16), feeds)
            old = _run(im2col_gemm_model(shape, kernel, stride, pads, cout, TensorProto.FLOAT16), feeds)
            result = {"vs_im2col_gemm": _close(new, old.astype(np.float64), rtol)}
            if shape[1] * math.prod(kernel) * shape[0] * math.prod(output_hw(shape, kernel, stride, (1, 1), pads)) <= 6e7:
                # small enough for the float64 im2col matrix: the exact sums too
                result["vs_numpy"] = _close(new, reference(x, dy, kernel, stride, (1, 1), pads), rtol)
            result["ok"] = all(part["ok"] for part in result.values())
            return result
        check(f"float16 {name} {list(shape)} vs Im2Col + Gemm", one, results)

    def graph():
        shape, kernel, stride, pads, cout = (64, 64, 56, 56), (3, 3), (1, 1), (1, 1, 1, 1), 64
        feeds = {"x": rng.standard_normal(shape).astype(np.float16),
                 "dy": rng.standard_normal(dy_shape(shape, kernel, stride, (1, 1), pads, cout)).astype(np.float16)}
        model = op_model(shape, kernel, stride, (1, 1), pads, cout, TensorProto.FLOAT16)
        replayed, plain = _run(model, feeds, cuda_graph=True, replays=3), _run(model, feeds)
        same = bool(np.array_equal(replayed.view(np.uint16), plain.view(np.uint16)))
        return {"ok": same, "bitwise_equal": same}
    check("CUDA graph: capture and 3 replays equal the plain run ([64, 64, 56, 56] float16 3x3)", graph, results)


def resnet_cout(shape, kernel, stride) -> int:
    """The output channels of the torchvision ResNet-50 Conv with this input: the stem 64, a
    bottleneck's 3x3 keeps its width, the downsample 1x1/2 doubles, a 1x1/1 expands a stage's
    width (64, 128, 256, 512 at 56, 28, 14, 7 pixels) 4x and reduces anything wider 4x."""
    cin = shape[1]
    if kernel == (7, 7):
        return 64
    if kernel == (3, 3):
        return cin
    if stride == (2, 2):
        return 2 * cin
    width = {56: 64, 28: 128, 14: 256, 7: 512}[shape[2]]
    return 4 * cin if cin == width else cin // 4


def timing(args, rng) -> tuple[list, dict]:
    rows, totals = [], {"im2col_gemm_ms": 0.0, "conv_weight_grad_ms": 0.0}
    for name, shape, kernel, stride, pads, count in RESNET50_B64:
        cout = resnet_cout(shape, kernel, stride)
        feeds = {"x": rng.standard_normal(shape).astype(np.float16),
                 "dy": rng.standard_normal(dy_shape(shape, kernel, stride, (1, 1), pads, cout)).astype(np.float16)}
        models = {"im2col_gemm": im2col_gemm_model(shape, kernel, stride, pads, cout, TensorProto.FLOAT16),
                  "conv_weight_grad": op_model(shape, kernel, stride, (1, 1), pads, cout, TensorProto.FLOAT16)}
        runners = {key: BoundRunner(make_session(m, provider="cuda"), feeds, "cuda") for key, m in models.items()}
        times = time_in_rotation(runners, rounds=args.rounds, block_ms=args.block_ms)
        row = {"conv": name, "x": list(shape), "cout": cout, "kernel": list(kernel), "stride": list(stride),
               "pads": list(pads), "count": count}
        for key, timed in times.items():
            row[f"{key}_ms"] = timed.median_ms
            row[f"{key}_blocks_ms"] = list(timed.blocks_ms)
            if timed.error:
                row[f"{key}_error"] = timed.error
            elif timed.median_ms is not None:
                totals[f"{key}_ms"] += count * timed.median_ms
            if not args.no_cupti:
                row[f"{key}_cupti"] = _cupti(runners[key], 20)
        if row.get("conv_weight_grad_ms") and row.get("im2col_gemm_ms"):
            row["speedup"] = round(row["im2col_gemm_ms"] / row["conv_weight_grad_ms"], 3)
        rows.append(row)
        print(f"     {name:16s} im2col+gemm {row.get('im2col_gemm_ms') or float('nan'):8.4f} ms   "
              f"conv_weight_grad {row.get('conv_weight_grad_ms') or float('nan'):8.4f} ms   "
              f"x{row.get('speedup', float('nan')):.2f}", file=sys.stderr, flush=True)
        del runners
    return rows, {k: round(v, 4) for k, v in totals.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--rounds", type=int, default=10, help="timed blocks per variant (medians over them)")
    parser.add_argument("--block-ms", type=float, default=20.0, help="a timed block lasts at least this long")
    parser.add_argument("--rtol", type=float, default=4e-3, help="largest error allowed, relative to the largest value")
    parser.add_argument("--no-timing", action="store_true", help="checks only")
    parser.add_argument("--no-cupti", action="store_true", help="no CUPTI kernel times (torch's profiler)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    if "CUDAExecutionProvider" not in ort.get_available_providers() or ops.build_info()["kernels"] != "cpu+cuda":
        print("error: needs the CUDA execution provider and the library's CUDA kernels", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    results: list = []
    small_checks(results, rng, args.rtol)
    resnet_checks(results, rng, args.rtol)
    report = {"checks": results, "failed": [r["check"] for r in results if not r["ok"]], "rtol": args.rtol}
    if not args.no_timing:
        report["timing"], report["resnet50_b64"] = timing(args, rng)
        print(f"resnet50 b64 weight gradients: Im2Col+Gemm {report['resnet50_b64']['im2col_gemm_ms']:.3f} ms, "
              f"ConvWeightGrad {report['resnet50_b64']['conv_weight_grad_ms']:.3f} ms", file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"{len(results) - len(report['failed'])} of {len(results)} checks passed", file=sys.stderr)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
