"""Check ai.onnxcampo::NchwToNhwc on a GPU and time it against the three ORT nodes it replaces.

1. Shapes of a stem's image and filter and odd ones, float32 / float16 in and out, channels padded
   or not: the op on CUDA against the numpy reference (``onnxcampo.ops.conv_nhwc.nchw_to_nhwc``),
   bit for bit (NaN, inf, signed zeros, subnormals, float16 overflow among the values), plain and
   replayed as a CUDA graph.
2. ResNet-50 b64's image [64, 3, 224, 224] float32 -> [64, 224, 224, 4] float16: the op against
   ORT's Transpose, Cast and Pad (what a channels-last step ran before), both replayed as CUDA
   graphs, timed side by side in rotation (ms a call; CUPTI GPU time when torch is there).

    python3 scripts/check_to_nhwc_cuda.py --out $OUT/checks/to_nhwc.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import check_cli  # noqa: E402
from check_im2col_cuda import check  # noqa: E402
from onnxcampo.ops import conv_nhwc as ref  # noqa: E402
from onnxcampo.ops import nodes  # noqa: E402

TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
# (x shape, x dtype, to, channels)
SMALL = [((2, 3, 9, 11), np.float32, TensorProto.FLOAT16, 4), ((2, 3, 9, 11), np.float32, TensorProto.FLOAT16, 8),
         ((64, 3, 7, 7), np.float16, TensorProto.FLOAT16, 4), ((3, 3, 5, 5), np.float32, TensorProto.FLOAT, 4),
         ((2, 5, 3, 7), np.float32, TensorProto.FLOAT16, 7), ((2, 6, 3, 3), np.float16, TensorProto.FLOAT16, None),
         ((1, 2, 3, 2, 5), np.float16, TensorProto.FLOAT, 3), ((1, 3, 1, 1), np.float32, TensorProto.FLOAT16, 4)]
IMAGE = (64, 3, 224, 224)
PROVIDER = "cuda"


def _model(graph_nodes, x_shape, x_type, y_shape, y_type, initializers=()) -> bytes:
    graph = helper.make_graph(graph_nodes, "to_nhwc", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info("y", y_type, list(y_shape))], initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model.SerializeToString()


def op_model(x_shape, x_dtype, to, channels):
    y_shape = (x_shape[0], *x_shape[2:], channels or x_shape[1])
    node = nodes.nchw_to_nhwc("x", output="y", to=to, channels=channels, name="t")
    return _model([node], x_shape, TYPES[np.dtype(x_dtype)], y_shape, to), y_shape


def ort_model(x_shape, channels):
    """Transpose, Cast to float16 and Pad of the channels: the chain the op replaces."""
    n, c, h, w = x_shape
    made = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1]),
            helper.make_node("Cast", ["t"], ["h"], to=TensorProto.FLOAT16),
            helper.make_node("Pad", ["h", "pads"], ["y"], mode="constant")]
    pads = helper.make_tensor("pads", TensorProto.INT64, [8], [0, 0, 0, 0, 0, 0, 0, channels - c])
    return _model(made, x_shape, TensorProto.FLOAT, (n, h, w, channels), TensorProto.FLOAT16, [pads])


def _bound(model, library, feeds, outputs, cuda_graph=False):
    return check_cli.bound(model, library, PROVIDER, feeds, outputs, cuda_graph=cuda_graph)


def _values(shape, dtype, rng) -> np.ndarray:
    x = (rng.standard_normal(shape) * 300).astype(dtype)
    specials = [np.nan, np.inf, -np.inf, -0.0, 1e-7, 70000.0, 65520.0, 2.0 ** -25]
    x.flat[:min(len(specials), x.size)] = np.array(specials[:x.size], np.float64).astype(dtype)
    return x


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    """Bit for bit, but any NaN matches any NaN (CUDA's conversions write the canonical NaN,
    numpy keeps the payload)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = np.isnan(want)
    return bool(np.array_equal(np.isnan(got), nan) and got[~nan].tobytes() == want[~nan].tobytes())


def small_checks(results, library, rng) -> None:
    for x_shape, x_dtype, to, channels in SMALL:
        def one(x_shape=x_shape, x_dtype=x_dtype, to=to, channels=channels):
            x = _values(x_shape, x_dtype, rng)
            model, y_shape = op_model(x_shape, x_dtype, to, channels)
            want = ref.nchw_to_nhwc(x, to, channels)
            plain = _bound(model, library, {"x": x}, {"y": (y_shape, NUMPY[to])})
            plain.run()
            entry = {"ok": _same(plain.results()["y"], want)}
            if PROVIDER == "cuda":
                replayed = _bound(model, library, {"x": x}, {"y": (y_shape, NUMPY[to])}, cuda_graph=True)
                for _ in range(3):
                    replayed.run()
                entry["replay_bitwise_equal"] = _same(replayed.results()["y"], want)
                entry["ok"] = entry["ok"] and entry["replay_bitwise_equal"]
            return entry
        check(f"{list(x_shape)} {np.dtype(x_dtype).name} -> {np.dtype(NUMPY[to]).name} channels {channels}: "
              "against numpy, bit for bit", one, results)


def image_checks(results, library, rng, rounds: int, runs: int) -> dict:
    x = rng.standard_normal(IMAGE).astype(np.float32)
    y_shape = (IMAGE[0], *IMAGE[2:], 4)
    timing: dict = {}

    def timed():
        graph = PROVIDER == "cuda"
        ours = _bound(op_model(IMAGE, np.float32, TensorProto.FLOAT16, 4)[0], library, {"x": x},
                      {"y": (y_shape, np.float16)}, cuda_graph=graph)
        theirs = _bound(ort_model(IMAGE, 4), library, {"x": x}, {"y": (y_shape, np.float16)}, cuda_graph=graph)
        timing.update(check_cli.timed({"nchw_to_nhwc": ours.run, "transpose_cast_pad": theirs.run}, rounds, runs,
                                      PROVIDER))
        same = _same(ours.results()["y"], theirs.results()["y"])
        return {"ok": same, "same_bits_as_ort": same, "device_ms": timing["device_ms"]}
    check("ResNet-50 b64 image float32 NCHW -> float16 NHWC padded to 4: NchwToNhwc against ORT's Transpose, Cast "
          "and Pad, replayed, in rotation", timed, results)
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
    timing = None if args.quick else image_checks(results, library, rng, args.rounds, args.runs)
    status = check_cli.report(args, results, {"image_b64": timing})
    if timing and "nchw_to_nhwc" in timing:
        print(f"ResNet-50 b64 image, ms a call: NchwToNhwc {timing['nchw_to_nhwc']:.4f}, Transpose + Cast + Pad "
              f"{timing['transpose_cast_pad']:.4f}; GPU {timing['device_ms']}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
