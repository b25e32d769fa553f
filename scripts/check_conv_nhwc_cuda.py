"""Check ai.onnxcampo's NHWC convolutions (ConvNhwc, ConvNhwcDataGrad, ConvNhwcWeightGrad) on a GPU
and time them against the NCHW ops a step graph runs otherwise.

1. Small shapes (strides, dilation, 1x1, 7x7, odd sizes), float32 and float16: each op on CUDA
   (cuDNN, NHWC tensors, KRSC filters) against the float64 numpy reference
   (``onnxcampo.ops.conv_nhwc``), within ``--rtol`` of the largest value; then grouped and
   depthwise ConvNhwc (``group``: cudnnSetConvolutionGroupCount, a KRSC filter of Cin / group
   channels) likewise.
3. MobileNetV3 / PP-OCR depthwise shapes (float16, batch 1 and 8): ConvNhwc with ``group`` against
   ORT's NCHW Conv with ``group`` on the same numbers (transposed), then both replayed as CUDA
   graphs and timed side by side: whether cuDNN's NHWC depthwise kernels keep up with its NCHW
   ones (the layout pass converts depthwise convolutions as it does group-1 ones).
2. ResNet-50 b64's convolution shapes (float16, the stem aside: it stays NCHW): the three NHWC ops
   against ORT's Conv, ConvTranspose and the library's NCHW ConvWeightGrad on the same numbers
   (transposed), a CUDA-graph replay against the plain run; then both triples (forward, input
   gradient, weight gradient) replayed as CUDA graphs, timed side by side in rotation, and summed
   over the step's 52 convolutions.

    python3 scripts/check_conv_nhwc_cuda.py --out $OUT/checks/conv_nhwc.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import check_cli  # noqa: E402
from check_conv_grad_cuda import resnet_cout  # noqa: E402
from check_im2col_cuda import RESNET50_B64, check  # noqa: E402
from onnxcampo.ops import conv_nhwc as ref  # noqa: E402
from onnxcampo.ops import nodes  # noqa: E402

SMALL = [((2, 9, 11, 3), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 5), ((2, 8, 8, 8), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 16),
         ((1, 8, 7, 16), (1, 1), (2, 2), (1, 1), (0, 0, 0, 0), 8), ((2, 9, 9, 8), (7, 7), (2, 2), (1, 1), (3, 3, 3, 3), 8),
         ((1, 11, 10, 8), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2), 24), ((3, 5, 6, 32), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 64)]
# grouped forward cases: (N, H, W, Cin), kernel, strides, dilations, pads, Cout, group
GROUPED = [((2, 9, 11, 16), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 16, 16),
           ((1, 16, 15, 32), (3, 3), (2, 2), (1, 1), (1, 1, 1, 1), 32, 32),
           ((2, 10, 12, 24), (5, 5), (1, 1), (1, 1), (2, 2, 2, 2), 24, 24),
           ((1, 11, 10, 8), (3, 3), (1, 1), (2, 2), (2, 2, 2, 2), 8, 8),
           ((2, 8, 8, 8), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), 16, 8),  # 2 output channels per input channel
           ((3, 7, 9, 32), (3, 3), (2, 1), (1, 1), (1, 1, 1, 1), 64, 4),
           ((1, 6, 6, 48), (1, 1), (1, 1), (1, 1), (0, 0, 0, 0), 24, 3)]
# depthwise shapes of MobileNetV3-small (PP-OCR cls) and PP-LCNet (PP-OCRv4 det/rec): (label,
# NCHW input, kernel, strides, pads)
DEPTHWISE = [("c16 112x112 k3 s2", (16, 112, 112), (3, 3), (2, 2), (1, 1, 1, 1)),
             ("c72 56x56 k3 s2", (72, 56, 56), (3, 3), (2, 2), (1, 1, 1, 1)),
             ("c88 28x28 k3", (88, 28, 28), (3, 3), (1, 1), (1, 1, 1, 1)),
             ("c96 28x28 k5 s2", (96, 28, 28), (5, 5), (2, 2), (2, 2, 2, 2)),
             ("c240 14x14 k5", (240, 14, 14), (5, 5), (1, 1), (2, 2, 2, 2)),
             ("c576 7x7 k5", (576, 7, 7), (5, 5), (1, 1), (2, 2, 2, 2)),
             ("c64 80x80 k3", (64, 80, 80), (3, 3), (1, 1), (1, 1, 1, 1)),
             ("c256 20x20 k5", (256, 20, 20), (5, 5), (1, 1), (2, 2, 2, 2))]
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _model(graph_nodes, inputs: dict, outputs: dict, dtype):
    graph = helper.make_graph(graph_nodes, "conv_nhwc",
                              [helper.make_tensor_value_info(k, TYPES[dtype], list(v)) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(k, TYPES[dtype], list(v)) for k, v in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model.SerializeToString()


def nhwc_model(x_shape, kernel, strides, dilations, pads, cout, dtype):
    """y = ConvNhwc(x, w); dx = ConvNhwcDataGrad(dy, w); dw = ConvNhwcWeightGrad(x, dy)."""
    n, h, w, cin = x_shape
    ho, wo = ref.output_hw(h, w, kernel, strides, dilations, pads)
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "pads": pads}
    made = [nodes.conv_nhwc("x", "w", output="y", name="f", **attrs),
            nodes.conv_nhwc_data_grad("dy", "w", output="dx", input_spatial=(h, w), name="d", **attrs),
            nodes.conv_nhwc_weight_grad("x", "dy", output="dw", name="g", **attrs)]
    shapes = {"x": x_shape, "w": (cout, *kernel, cin), "dy": (n, ho, wo, cout)}
    outputs = {"y": (n, ho, wo, cout), "dx": x_shape, "dw": (cout, *kernel, cin)}
    return _model(made, shapes, outputs, dtype), shapes, outputs


def nchw_model(x_shape, kernel, strides, pads, cout, dtype):
    """The same three in NCHW as a step graph had them: Conv, ConvTranspose, ConvWeightGrad."""
    n, cin, h, w = x_shape
    ho, wo = ref.output_hw(h, w, kernel, strides, (1, 1), pads)
    made = [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=list(kernel), strides=list(strides), pads=list(pads)),
            helper.make_node("ConvTranspose", ["dy", "w"], ["dx"], strides=list(strides), pads=list(pads),
                             output_shape=[h, w]),
            nodes.conv_weight_grad("x", "dy", output="dw", kernel_shape=kernel, strides=strides, pads=pads, name="g")]
    shapes = {"x": x_shape, "w": (cout, cin, *kernel), "dy": (n, cout, ho, wo)}
    outputs = {"y": (n, cout, ho, wo), "dx": x_shape, "dw": (cout, cin, *kernel)}
    return _model(made, shapes, outputs, dtype), shapes, outputs


def _close(got, want, rtol) -> dict:
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max(initial=0.0)), 1e-30)
    error = float(np.abs(got - want).max(initial=0.0)) / scale
    return {"ok": bool(got.shape == want.shape and np.isfinite(got).all() and error <= rtol), "max_error_over_max": error}


PROVIDER = "cuda"


def _bound(model, library, feeds, outputs, dtype, cuda_graph=False):
    return check_cli.bound(model, library, PROVIDER, feeds, {k: (v, dtype) for k, v in outputs.items()},
                           cuda_graph=cuda_graph)


def small_checks(results, library, rng, rtol) -> None:
    for x_shape, kernel, strides, dilations, pads, cout in SMALL:
        for dtype in (np.float32, np.float16):
            def one(x_shape=x_shape, kernel=kernel, strides=strides, dilations=dilations, pads=pads, cout=cout, dtype=dtype):
                model, shapes, outputs = nhwc_model(x_shape, kernel, strides, dilations, pads, cout, dtype)
                feeds = {k: rng.standard_normal(v).astype(dtype) for k, v in shapes.items()}
                session = _bound(model, library, feeds, outputs, dtype)
                session.run()
                got = session.results()
                attrs = {"strides": strides, "dilations": dilations, "pads": pads}
                want = {"y": ref.conv_nhwc(feeds["x"], feeds["w"], **attrs),
                        "dx": ref.conv_nhwc_data_grad(feeds["dy"], feeds["w"], x_shape[1:3], **attrs),
                        "dw": ref.conv_nhwc_weight_grad(feeds["x"], feeds["dy"], kernel, **attrs)}
                parts = {k: _close(got[k], want[k], rtol) for k in want}
                return {"ok": all(p["ok"] for p in parts.values()), **parts}
            check(f"small {x_shape} k{kernel} s{strides} d{dilations} {np.dtype(dtype).name}: the three ops against numpy",
                  one, results)


def grouped_checks(results, library, rng, rtol) -> None:
    for x_shape, kernel, strides, dilations, pads, cout, group in GROUPED:
        for dtype in (np.float32, np.float16):
            def one(x_shape=x_shape, kernel=kernel, strides=strides, dilations=dilations, pads=pads, cout=cout,
                    group=group, dtype=dtype):
                n, h, w, cin = x_shape
                ho, wo = ref.output_hw(h, w, kernel, strides, dilations, pads)
                attrs = {"strides": strides, "dilations": dilations, "pads": pads}
                node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=kernel, group=group, name="f", **attrs)
                shapes = {"x": x_shape, "w": (cout, *kernel, cin // group)}
                model = _model([node], shapes, {"y": (n, ho, wo, cout)}, dtype)
                feeds = {k: rng.standard_normal(v).astype(dtype) for k, v in shapes.items()}
                session = _bound(model, library, feeds, {"y": (n, ho, wo, cout)}, dtype)
                session.run()
                part = _close(session.results()["y"], ref.conv_nhwc(feeds["x"], feeds["w"], group=group, **attrs), rtol)
                return {"ok": part["ok"], "y": part}
            check(f"grouped {x_shape} k{kernel} s{strides} d{dilations} Cout {cout} group {group} "
                  f"{np.dtype(dtype).name}: ConvNhwc against numpy", one, results)


def depthwise_checks(results, library, rng, rounds: int, runs: int) -> dict:
    """ConvNhwc[group = C] against ORT's NCHW Conv[group = C], float16, then both timed."""
    timings = []
    for label, (c, h, w), kernel, strides, pads in DEPTHWISE:
        for n in (1, 8):
            ho, wo = ref.output_hw(h, w, kernel, strides, (1, 1), pads)
            conv = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=list(kernel), strides=list(strides),
                                    pads=list(pads), group=c)
            plain = _model([conv], {"x": (n, c, h, w), "w": (c, 1, *kernel)}, {"y": (n, c, ho, wo)}, np.float16)
            node = nodes.conv_nhwc("x", "w", output="y", kernel_shape=kernel, strides=strides, pads=pads, group=c, name="f")
            channels_last = _model([node], {"x": (n, h, w, c), "w": (c, *kernel, 1)}, {"y": (n, ho, wo, c)}, np.float16)
            feeds = {"x": (0.5 * rng.standard_normal((n, c, h, w))).astype(np.float16),
                     "w": (0.5 * rng.standard_normal((c, 1, *kernel))).astype(np.float16)}
            moved = {k: v.transpose(0, 2, 3, 1).copy() for k, v in feeds.items()}

            def compare(plain=plain, channels_last=channels_last, feeds=feeds, moved=moved, n=n, c=c, ho=ho, wo=wo,
                        label=label):
                a = _bound(plain, library, feeds, {"y": (n, c, ho, wo)}, np.float16, cuda_graph=True)
                b = _bound(channels_last, library, moved, {"y": (n, ho, wo, c)}, np.float16, cuda_graph=True)
                a.run()
                b.run()
                part = _close(b.results()["y"].transpose(0, 3, 1, 2), a.results()["y"].astype(np.float64), 1e-2)
                ms = check_cli.timed({"nchw": a.run, "nhwc": b.run}, rounds, runs, PROVIDER)
                timings.append({"shape": f"n{n} {label}", "nchw_ms": ms["nchw"], "nhwc_ms": ms["nhwc"],
                                "device_ms": ms["device_ms"], "launches": ms["launches"]})
                return {"ok": part["ok"], "y": part, **ms}
            check(f"depthwise n{n} {label} float16: ConvNhwc[group] against Conv[group], replayed and timed", compare,
                  results)
    return {"shapes": timings}


def resnet_shapes():
    """(label, NCHW input shape, kernel, strides, pads, Cout, count) of ResNet-50 b64 less the stem."""
    return [(label, shape, kernel, stride, pads, resnet_cout(shape, kernel, stride), count)
            for label, shape, kernel, stride, pads, count in RESNET50_B64 if shape[1] % 8 == 0]


def resnet_checks(results, library, rng, rounds: int, runs: int) -> dict:
    from onnxcampo.runtime.standalone import time_in_rotation

    totals = {"nchw_ms": 0.0, "nhwc_ms": 0.0, "convolutions": 0, "shapes": []}
    for label, shape, kernel, strides, pads, cout, count in resnet_shapes():
        n, cin, h, w = shape
        plain, p_shapes, p_out = nchw_model(shape, kernel, strides, pads, cout, np.float16)
        channels_last, c_shapes, c_out = nhwc_model((n, h, w, cin), kernel, strides, (1, 1), pads, cout, np.float16)
        feeds = {k: (0.5 * rng.standard_normal(v)).astype(np.float16) for k, v in p_shapes.items()}
        moved = {"x": feeds["x"].transpose(0, 2, 3, 1).copy(), "w": feeds["w"].transpose(0, 2, 3, 1).copy(),
                 "dy": feeds["dy"].transpose(0, 2, 3, 1).copy()}
        entry = {}

        def compare(plain=plain, p_out=p_out, channels_last=channels_last, c_out=c_out, feeds=feeds, moved=moved):
            a = _bound(plain, library, feeds, p_out, np.float16)
            b = _bound(channels_last, library, moved, c_out, np.float16)
            a.run()
            b.run()
            got, want = b.results(), a.results()
            back = {"y": got["y"].transpose(0, 3, 1, 2), "dx": got["dx"].transpose(0, 3, 1, 2),
                    "dw": got["dw"].transpose(0, 3, 1, 2)}
            parts = {k: _close(back[k], want[k].astype(np.float64), 1e-2) for k in want}
            replayed = _bound(channels_last, library, moved, c_out, np.float16, cuda_graph=True)
            for _ in range(3):
                replayed.run()
            again = replayed.results()
            same = all(np.array_equal(again[k].view(np.uint16), got[k].view(np.uint16)) for k in got)
            entry.update(parts)
            return {"ok": all(p["ok"] for p in parts.values()) and same, "replay_bitwise_equal": same, **parts}
        check(f"ResNet-50 {label} float16: NHWC ops against Conv + ConvTranspose + ConvWeightGrad, and replayed",
              compare, results)

        def timing(plain=plain, p_out=p_out, channels_last=channels_last, c_out=c_out, feeds=feeds, moved=moved,
                   label=label, count=count):
            a = _bound(plain, library, feeds, p_out, np.float16, cuda_graph=True)
            b = _bound(channels_last, library, moved, c_out, np.float16, cuda_graph=True)
            ms = time_in_rotation({"nchw": a.run, "nhwc": b.run}, rounds, runs)
            totals["nchw_ms"] += count * ms["nchw"]
            totals["nhwc_ms"] += count * ms["nhwc"]
            totals["convolutions"] += count
            totals["shapes"].append({"shape": label, "count": count, "nchw_ms": round(ms["nchw"], 4),
                                     "nhwc_ms": round(ms["nhwc"], 4)})
            return {"ok": True, "nchw_ms": ms["nchw"], "nhwc_ms": ms["nhwc"]}
        check(f"ResNet-50 {label}: forward + input gradient + weight gradient, NCHW vs NHWC, replayed", timing, results)
    return totals


def main(argv: list[str] | None = None) -> int:
    global PROVIDER
    parser = check_cli.parser(__doc__)
    parser.add_argument("--rtol", type=float, default=4e-3, help="small checks: max |error| over max |reference|")
    args = parser.parse_args(argv)
    library = check_cli.open_library(args)
    if library is None:
        return 2
    PROVIDER = args.provider
    rng = np.random.default_rng(0)
    results: list = []
    small_checks(results, library, rng, args.rtol)
    grouped_checks(results, library, rng, args.rtol)
    depthwise = None if args.quick else depthwise_checks(results, library, rng, args.rounds, args.runs)
    totals = None if args.quick else resnet_checks(results, library, rng, args.rounds, args.runs)
    status = check_cli.report(args, results, {"resnet50_b64": totals, "depthwise": depthwise})
    if totals:
        print(f"ResNet-50 b64, {totals['convolutions']} convolutions x (forward, input gradient, weight gradient): "
              f"NCHW {totals['nchw_ms']:.3f} ms, NHWC {totals['nhwc_ms']:.3f} ms", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
