"""Check ai.onnxcampo's channels-last max pooling (MaxPoolNhwc, MaxPoolNhwcGrad) on a GPU and time it
against the NCHW MaxPool a step graph ran before.

1. Small shapes (ResNet's stem pool, 2x2 stride 2, 3x3 stride 1, asymmetric pads, 3 channels, an
   empty batch), float32 and float16: both ops on CUDA against the numpy reference
   (``onnxcampo.ops.max_pool``): y and argmax exact, dx bit for bit the float32 sums in the op's
   order (``max_pool_nhwc_grad_float32``), and a CUDA-graph replay bit for bit the plain run.
2. ResNet-50 b64's stem pool, x [64, 112, 112, 64] float16 after a ReLU (many ties): the same
   checks, then MaxPoolNhwc + MaxPoolNhwcGrad replayed as a CUDA graph, timed in rotation against
   ORT's NCHW MaxPool with its Indices output on [64, 64, 112, 112] float16 (the forward the step
   graph ran), and against that MaxPool plus onnx-ad's adjoint as the step graph ran it (zeros,
   dy cast to float32, ScatterND with reduction "add": the float32 scatter-add classify 7b keeps).

    python3 scripts/check_max_pool_cuda.py --out $OUT/checks/max_pool.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import check_cli  # noqa: E402
from check_im2col_cuda import check  # noqa: E402
from onnxcampo.ops import max_pool as ref  # noqa: E402
from onnxcampo.ops import nodes  # noqa: E402

# (N, H, W, C), kernel, strides, pads (tests/ops/test_max_pool.py's cases)
SMALL = [((2, 9, 11, 8), (3, 3), (2, 2), (1, 1, 1, 1)), ((2, 8, 10, 8), (2, 2), (2, 2), (0, 0, 0, 0)),
         ((1, 7, 6, 8), (3, 3), (1, 1), (1, 1, 1, 1)), ((2, 7, 9, 8), (3, 2), (2, 1), (2, 0, 1, 1)),
         ((2, 9, 11, 3), (3, 3), (2, 2), (1, 1, 1, 1)), ((0, 5, 5, 8), (3, 3), (2, 2), (1, 1, 1, 1))]
STEM = ((64, 112, 112, 64), (3, 3), (2, 2), (1, 1, 1, 1))  # ResNet-50 b64's stem pool
TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}
PROVIDER = "cuda"


def _model(graph_nodes, inputs: dict, outputs: dict) -> bytes:
    """inputs / outputs: name -> (ONNX type, shape)."""
    graph = helper.make_graph(graph_nodes, "max_pool",
                              [helper.make_tensor_value_info(k, t, list(s)) for k, (t, s) in inputs.items()],
                              [helper.make_tensor_value_info(k, t, list(s)) for k, (t, s) in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model.SerializeToString()


def nhwc_model(x_shape, kernel, strides, pads, dtype):
    """(y, argmax) = MaxPoolNhwc(x); dx = MaxPoolNhwcGrad(dy, argmax): the forward's argmax feeds the
    gradient, as in a step graph. Returns (model, input shapes, outputs: name -> (shape, dtype))."""
    n, h, w, c = x_shape
    ho, wo = ref.pool_output_hw(h, w, kernel, strides, pads)
    attrs = {"kernel_shape": kernel, "strides": strides, "pads": pads}
    made = [nodes.max_pool_nhwc("x", output="y", argmax="argmax", name="pool", **attrs),
            nodes.max_pool_nhwc_grad("dy", "argmax", output="dx", input_spatial=(h, w), name="grad", **attrs)]
    t = TYPES[dtype]
    shapes = {"x": x_shape, "dy": (n, ho, wo, c)}
    outputs = {"y": ((n, ho, wo, c), dtype), "argmax": ((n, ho, wo, c), np.uint8), "dx": (x_shape, dtype)}
    model = _model(made, {"x": (t, x_shape), "dy": (t, shapes["dy"])},
                   {"y": (t, outputs["y"][0]), "argmax": (TensorProto.UINT8, outputs["argmax"][0]), "dx": (t, x_shape)})
    return model, shapes, outputs


def nchw_models(x_shape, kernel, strides, pads):
    """float16 NCHW models of x [N, C, H, W]: ORT's MaxPool with Indices (the forward), and that
    MaxPool plus onnx-ad's adjoint as the step graph ran it (float32 zeros, dy cast to float32,
    ScatterND reduction "add" at the Indices)."""
    n, c, h, w = x_shape
    ho, wo = ref.pool_output_hw(h, w, kernel, strides, pads)
    y_shape = (n, c, ho, wo)
    pool = helper.make_node("MaxPool", ["x"], ["y", "indices"], kernel_shape=list(kernel), strides=list(strides),
                            pads=list(pads))
    forward = _model([pool], {"x": (TensorProto.FLOAT16, x_shape)},
                     {"y": (TensorProto.FLOAT16, y_shape), "indices": (TensorProto.INT64, y_shape)})
    numel = n * c * h * w
    step_nodes = [
        pool,
        helper.make_node("ConstantOfShape", ["numel"], ["zeros"],
                         value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])),
        helper.make_node("Unsqueeze", ["indices", "last"], ["where"]),
        helper.make_node("Cast", ["dy"], ["dy32"], to=TensorProto.FLOAT),
        helper.make_node("ScatterND", ["zeros", "where", "dy32"], ["flat"], reduction="add"),
        helper.make_node("Reshape", ["flat", "x_shape"], ["dx"]),
    ]
    graph = helper.make_graph(
        step_nodes, "nchw_step",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, list(x_shape)),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT16, list(y_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, list(y_shape)),
         helper.make_tensor_value_info("dx", TensorProto.FLOAT, list(x_shape))],
        initializer=[helper.make_tensor("numel", TensorProto.INT64, [1], [numel]),
                     helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
                     helper.make_tensor("x_shape", TensorProto.INT64, [4], list(x_shape))])
    step = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
    return forward, step, y_shape


def _bound(model, library, feeds, outputs, cuda_graph=False):
    return check_cli.bound(model, library, PROVIDER, feeds, outputs, cuda_graph=cuda_graph)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[a.dtype.itemsize])


def _same(got: np.ndarray, want: np.ndarray) -> dict:
    """Bit for bit; the count of elements that differ."""
    ok = got.shape == want.shape and got.dtype == want.dtype and np.array_equal(_bits(got), _bits(want))
    return {"ok": bool(ok), "differ": None if got.shape != want.shape else int((_bits(got) != _bits(want)).sum())}


def _inputs(x_shape, kernel, strides, pads, dtype, rng, relu=False):
    x = rng.standard_normal(x_shape).astype(dtype)
    if relu:
        x = np.maximum(x, 0).astype(dtype)
    n, h, w, c = x_shape
    dy = rng.standard_normal((n, *ref.pool_output_hw(h, w, kernel, strides, pads), c)).astype(dtype)
    return {"x": x, "dy": dy}


def _against_numpy(x_shape, kernel, strides, pads, dtype, feeds, library, replay: bool) -> dict:
    """Both ops against numpy; with `replay`, a CUDA-graph session replayed 3 times against the plain run."""
    model, _, outputs = nhwc_model(x_shape, kernel, strides, pads, dtype)
    session = _bound(model, library, feeds, outputs)
    session.run()
    got = session.results()
    want_y, want_argmax = ref.max_pool_nhwc(feeds["x"], kernel, strides, pads)
    # the gradient reads the op's own argmax: the numpy gradient of the same selection
    want_dx = ref.max_pool_nhwc_grad_float32(feeds["dy"], got["argmax"], x_shape[1:3], kernel, strides, pads)
    parts = {"y": _same(got["y"], want_y), "argmax": _same(got["argmax"], want_argmax), "dx": _same(got["dx"], want_dx)}
    entry = {"ok": all(p["ok"] for p in parts.values()), **parts}
    if replay:
        replayed = _bound(model, library, feeds, outputs, cuda_graph=True)
        for _ in range(3):
            replayed.run()
        again = replayed.results()
        same = all(np.array_equal(_bits(again[k]), _bits(got[k])) for k in got)
        entry.update(ok=entry["ok"] and same, replay_bitwise_equal=same)
    return entry


def small_checks(results, library, rng) -> None:
    for x_shape, kernel, strides, pads in SMALL:
        for dtype in (np.float32, np.float16):
            def one(x_shape=x_shape, kernel=kernel, strides=strides, pads=pads, dtype=dtype):
                feeds = _inputs(x_shape, kernel, strides, pads, dtype, rng)
                return _against_numpy(x_shape, kernel, strides, pads, dtype, feeds, library, PROVIDER == "cuda")
            check(f"small {x_shape} k{kernel} s{strides} p{pads} {np.dtype(dtype).name}: both ops against numpy",
                  one, results)


def stem_checks(results, library, rng, rounds: int, runs: int) -> dict:
    x_shape, kernel, strides, pads = STEM
    feeds = _inputs(x_shape, kernel, strides, pads, np.float16, rng, relu=True)
    check(f"ResNet-50 b64 stem pool x{list(x_shape)} float16 (ReLU'd: ties): both ops against numpy, and replayed",
          lambda: _against_numpy(x_shape, kernel, strides, pads, np.float16, feeds, library, PROVIDER == "cuda"), results)
    timing = {}

    def timed():
        graph = PROVIDER == "cuda"
        model, _, outputs = nhwc_model(x_shape, kernel, strides, pads, np.float16)
        nhwc = _bound(model, library, feeds, outputs, cuda_graph=graph)
        n, h, w, c = x_shape
        forward, step, y_shape = nchw_models((n, c, h, w), kernel, strides, pads)
        x_nchw = feeds["x"].transpose(0, 3, 1, 2).copy()
        dy_nchw = feeds["dy"].transpose(0, 3, 1, 2).copy()
        pool = _bound(forward, library, {"x": x_nchw}, {"y": (y_shape, np.float16), "indices": (y_shape, np.int64)},
                      cuda_graph=graph)
        stepped = _bound(step, library, {"x": x_nchw, "dy": dy_nchw},
                         {"y": (y_shape, np.float16), "dx": ((n, c, h, w), np.float32)}, cuda_graph=graph)
        timing.update(check_cli.timed({"nhwc_pool_and_grad": nhwc.run, "nchw_max_pool_indices": pool.run,
                                       "nchw_pool_and_scatter_add": stepped.run}, rounds, runs, PROVIDER))
        # reported, not checked: the NCHW step's float32 gradient against the op's float16 one
        # (ORT's MaxPool breaks a tie as it likes; where it takes the first maximum too, only the
        # float16 rounding differs: <= 2^-11 of the largest value)
        nhwc.run()
        stepped.run()
        ours = nhwc.results()["dx"].astype(np.float32)
        theirs = stepped.results()["dx"].transpose(0, 2, 3, 1)
        timing["dx_vs_nchw_step_max_error_over_max"] = float(np.abs(ours - theirs).max(initial=0.0) /
                                                             max(float(np.abs(theirs).max(initial=0.0)), 1e-30))
        return {"ok": True, "device_ms": timing["device_ms"],
                "dx_vs_nchw_step_max_error_over_max": timing["dx_vs_nchw_step_max_error_over_max"]}
    check("ResNet-50 b64 stem pool float16: MaxPoolNhwc + MaxPoolNhwcGrad against the NCHW MaxPool (Indices) "
          "and MaxPool + scatter-add, replayed, in rotation", timed, results)
    return timing


def main(argv: list[str] | None = None) -> int:
    global PROVIDER
    args = check_cli.parser(__doc__).parse_args(argv)
    library = check_cli.open_library(args)
    if library is None:
        return 2
    PROVIDER = args.provider
    rng = np.random.default_rng(0)
    results: list = []
    small_checks(results, library, rng)
    timing = None if args.quick else stem_checks(results, library, rng, args.rounds, args.runs)
    status = check_cli.report(args, results, {"stem_b64": timing})
    if timing and "nhwc_pool_and_grad" in timing:
        print(f"ResNet-50 b64 stem pool, ms a call: MaxPoolNhwc + MaxPoolNhwcGrad {timing['nhwc_pool_and_grad']:.4f}, "
              f"NCHW MaxPool with Indices {timing['nchw_max_pool_indices']:.4f}, NCHW MaxPool + scatter-add "
              f"{timing['nchw_pool_and_scatter_add']:.4f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
