"""Check ``ai.onnxcampo::BlockReduceSum`` on CUDA against numpy float64 sums, then time it against
ONNX Runtime's ReduceSum on the training steps' shapes. Run from the repository root on the GPU
machine, with the library built with CUDA (``python -m onnxcampo.ops.build``, or
``$ONNXCAMPO_OPS_LIBRARY``):

    export PYTHONPATH=/tmp/ortgpu:$PYTHONPATH   # onnxruntime-gpu (../shared/device/README.md)
    python3 scripts/check_reduce_cuda.py --out $OUT/reduce_cuda.json

Needs onnxruntime(-gpu), onnx and numpy, no onnxcampo install: the sessions come from
``onnxcampo/runtime/standalone.py`` (the runtime door for scripts, loaded by its path; on CUDA
with the CPU fallback off), the models from onnx.helper. torch is optional (its profiler gives
CUPTI kernel times).

Checks (every case on its own session; exit 1 when any fails):

- integer-valued inputs (|x| <= 8), whose float32 sums are exact in any order: the output must
  equal the float64 sum (float32 output) or that sum rounded once to float16, for float16 and
  float32 inputs and outputs, on shapes that take each kernel and vector width (R == 1, P == 1,
  long and short rows, odd sizes, empty tensors, a Q of 100003);
- normal random inputs: within the float32 bound ``P*R * 2^-24 * sum|x|`` of the float64 sum and
  within ``rtol 1e-4`` (what random terms give), and two runs equal bit for bit;
- the same node replayed as a CUDA graph (``enable_cuda_graph``: the workspace comes from ORT's
  arena while the graph is captured) gives the plain run's bits;
- on the timed shapes, ORT's ReduceSum variants and BlockReduceSum agree within float32 rounding
  (float16 outputs: one float16 step).

Timing (``--provider cuda``): per shape, ORT's ReduceSum float16 -> float16, float32 -> float32
and Cast float16 -> float32 + ReduceSum (for ``[N, C, HW]`` shapes the ReduceSum pair over HW then
N that onnxcampo's simplify rule 7 writes, and the single ReduceSum over (0, 2) as well) against
BlockReduceSum float16 -> float16, float32 -> float32 and float16 -> float32. Each variant is one
model of ``--copies`` independent copies (distinct inputs, so that they are read from memory, not
from the 50 MB L2), inputs and outputs bound on the device (IO binding); the variants are timed
in turn, ``--rounds`` rounds, in one process; medians per copy:

- ``graph_us``: the model replayed as a CUDA graph, wall time per replay / copies: GPU time with
  no host launch cost, the figure to compare; ``gb_s`` is the bytes read at that time;
- ``wall_us``: plain runs (node by node), wall time per run / copies: ORT's per-node host cost
  included;
- ``cupti``: with torch, the GPU kernels of a few plain runs through ``torch.profiler`` (kernel
  names, launches and GPU us per copy).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, relative: str):
    """A module of this repository by its path (onnxcampo need not be installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standalone = _load("_onnxcampo_standalone_sessions", "onnxcampo/runtime/standalone.py")  # the runtime door
DOMAIN = "ai.onnxcampo"
FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {FLOAT: np.float32, FLOAT16: np.float16}
NAME = {FLOAT: "f32", FLOAT16: "f16"}

# (label, tensor shape, reduced axes): BERT-base b32 s128 and GPT-2 b8 s256 bias / LayerNorm-scale
# gradients, ResNet-50 b64 Conv-bias gradients
TIMED = [
    ("bert-768", (4096, 768), (0,)),
    ("bert-3072", (4096, 3072), (0,)),
    ("gpt2-768", (2048, 768), (0,)),
    ("gpt2-3072", (2048, 3072), (0,)),
    ("resnet-256x56x56", (64, 256, 56 * 56), (0, 2)),
    ("resnet-2048x7x7", (64, 2048, 49), (0, 2)),
    ("resnet-64x112x112", (64, 64, 112 * 112), (0, 2)),
]
QUICK_TIMED = [("rows", (64, 48), (0,)), ("blocks", (4, 8, 49), (0, 2))]

CHECKED = [  # (P, Q, R)
    (4096, 768, 1), (4096, 3072, 1), (2048, 768, 1), (64, 256, 3136), (64, 2048, 49), (64, 64, 12544),
    (1, 1, 1), (5, 3, 1), (33, 70, 1), (7, 13, 1), (3, 100003, 1), (100000, 3, 1), (8192, 1, 1),
    (1, 5, 9), (1, 768, 4096), (1, 64, 77), (1, 2, 1000000), (4, 16, 49), (3, 7, 12544), (2, 9, 196),
    (6, 5, 3), (2, 70001, 2), (130, 6, 8), (64, 512, 196), (64, 1024, 196), (64, 512, 784),
    (0, 4, 3), (3, 0, 5), (2, 3, 0),
]
QUICK_CHECKED = [(33, 70, 1), (1, 64, 77), (4, 16, 49), (2, 9, 196), (6, 5, 3), (0, 4, 3), (3, 0, 5)]


def library_path(given: str | None) -> str:
    path = given or os.environ.get("ONNXCAMPO_OPS_LIBRARY") or str(ROOT / "onnxcampo/ops/lib/libonnxcampo_ops.so")
    if not Path(path).is_file():
        raise SystemExit(f"no custom-op library at {path}: run `python3 -m onnxcampo.ops.build` or set "
                         "ONNXCAMPO_OPS_LIBRARY")
    return path


def build_info(path: str) -> str:
    lib = ctypes.CDLL(path)
    lib.OnnxcampoOpsBuildInfo.restype = ctypes.c_char_p
    return lib.OnnxcampoOpsBuildInfo().decode()


def cuda_plan(path: str, p: int, q: int, r: int, half: bool, sms: int = 132) -> dict:
    """The launch plan the library makes for a 256-byte aligned input on a device of ``sms`` SMs."""
    fields = ("kind", "vec", "tx", "ty", "blocks_x", "chunks", "rows", "lanes", "items", "p_chunks", "p_len",
              "r_chunks", "r_len", "blocks", "partials", "workspace_bytes")
    fn = ctypes.CDLL(path).OnnxcampoBlockReducePlan
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int] * 4 + [ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 16)()
    fn(p, q, r, int(half), 16, sms, 1, out)
    return {k: int(v) for k, v in zip(fields, out)}


# ---- models -----------------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString()


def _value(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, list(shape))


def block_nodes(x: str, y: str, sizes, out_type: int, out_shape, tag: str):
    return [helper.make_node("BlockReduceSum", [x], [y], name=f"block{tag}", domain=DOMAIN, sizes=list(sizes),
                             output_type=int(out_type), output_shape=list(out_shape))]


def ort_nodes(x: str, y: str, shape, axes, in_type: int, out_type: int, tag: str, pair: bool):
    """ORT's reduction of ``x`` (a Cast to float32 first when ``in_type`` is float16 and
    ``out_type`` float32): one ReduceSum over ``axes``, or with ``pair`` (3-D, axes (0, 2)) the
    ReduceSum over axis 2 then over axis 0 that simplify rule 7 writes."""
    nodes, inits = [], []
    source = x
    if in_type != out_type:
        nodes.append(helper.make_node("Cast", [x], [f"c{tag}"], name=f"cast{tag}", to=int(out_type)))
        source = f"c{tag}"
    if pair:
        inits += [numpy_helper.from_array(np.array([2], np.int64), f"a2{tag}"),
                  numpy_helper.from_array(np.array([0], np.int64), f"a0{tag}")]
        nodes.append(helper.make_node("ReduceSum", [source, f"a2{tag}"], [f"m{tag}"], name=f"sum2{tag}", keepdims=0))
        nodes.append(helper.make_node("ReduceSum", [f"m{tag}", f"a0{tag}"], [y], name=f"sum0{tag}", keepdims=0))
    else:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"a{tag}"))
        nodes.append(helper.make_node("ReduceSum", [source, f"a{tag}"], [y], name=f"sum{tag}", keepdims=0))
    return nodes, inits


def sizes_of(shape, axes):
    """(P, Q, R) of a reduction over a leading and/or trailing block."""
    kept = [i for i in range(len(shape)) if i not in axes]
    p = int(np.prod(shape[:kept[0]])) if kept else int(np.prod(shape))
    q = int(np.prod([shape[i] for i in kept]))
    r = int(np.prod(shape[kept[-1] + 1:])) if kept else 1
    return p, q, r


# ---- sessions ---------------------------------------------------------------------------------


class Runtime:
    def __init__(self, provider: str, library: str, device_id: int = 0):
        self.provider, self.library, self.device_id = provider, library, device_id
        self.device = "cuda" if provider == "cuda" else "cpu"

    def session(self, model: bytes, *, graph: bool = False) -> ort.InferenceSession:
        """A session through the runtime door for scripts (``onnxcampo/runtime/standalone.py``)."""
        return standalone.custom_op_session(model, self.library, self.provider, cuda_graph=graph)

    def value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device, self.device_id)

    def empty(self, shape, elem_type: int) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), NP[elem_type], self.device, self.device_id)

    def binding(self, session, inputs: dict[str, ort.OrtValue], outputs: dict[str, ort.OrtValue]):
        bound = session.io_binding()
        for name, value in inputs.items():
            bound.bind_ortvalue_input(name, value)
        for name, value in outputs.items():
            bound.bind_ortvalue_output(name, value)
        return bound


# ---- correctness ------------------------------------------------------------------------------


def check_case(rt: Runtime, p: int, q: int, r: int, in_type: int, out_type: int, seed: int) -> dict:
    count = p * q * r
    model = _model(block_nodes("x", "y", (p, q, r), out_type, [q], ""), [_value("x", in_type, [count])],
                   [_value("y", out_type, [q])])
    row = {"sizes": [p, q, r], "x": NAME[in_type], "y": NAME[out_type], "ok": False}
    rng = np.random.default_rng(seed)
    try:
        plain = rt.session(model)
        out = rt.empty([q], out_type)

        def run(session, x_value):
            session.run_with_iobinding(rt.binding(session, {"x": x_value}, {"y": out}))
            return out.numpy().copy()

        # exact: integers
        x = rng.integers(-8, 9, size=count).astype(NP[in_type])
        want = x.astype(np.float64).reshape(p, q, r).sum(axis=(0, 2)).astype(NP[out_type])
        got = run(plain, rt.value(x))
        row["exact_mismatches"] = int(np.sum(~((got == want) | (np.isnan(got) & np.isnan(want)))))
        # random: float32 accuracy, reproducible bits
        x = (rng.standard_normal(count) * 3).astype(NP[in_type])
        x_value = rt.value(x)
        first, second = run(plain, x_value), run(plain, x_value)
        exact = x.astype(np.float64).reshape(p, q, r)
        total = exact.sum(axis=(0, 2))
        error = np.abs(first.astype(np.float64) - total)
        bound = p * r * 2.0 ** -24 * np.abs(exact).sum(axis=(0, 2))
        if out_type == FLOAT16:
            bound = bound + np.abs(total) * 2.0 ** -11 + 2.0 ** -25
        row["bound_violations"] = int(np.sum(error > bound))
        tolerance = (2.0 ** -10 if out_type == FLOAT16 else 1e-4) * np.abs(total) + 1e-3 * np.sqrt(max(p * r, 1))
        row["max_error"] = float(error.max(initial=0.0))
        row["tolerance_violations"] = int(np.sum(error > tolerance))
        row["reproducible"] = bool(np.array_equal(first.view(np.uint8), second.view(np.uint8)))
        ok = row["exact_mismatches"] == 0 and row["bound_violations"] == 0 and row["tolerance_violations"] == 0 \
            and row["reproducible"]
        if rt.provider == "cuda" and count > 0 and q > 0:  # the same bits replayed as a CUDA graph
            graph = rt.session(model, graph=True)
            bound_graph = rt.binding(graph, {"x": x_value}, {"y": out})
            for _ in range(3):  # warm-up runs, the capture, replays
                graph.run_with_iobinding(bound_graph)
            replayed = out.numpy().copy()
            row["cuda_graph_equal"] = bool(np.array_equal(replayed.view(np.uint8), first.view(np.uint8)))
            ok = ok and row["cuda_graph_equal"]
            del graph
        row["ok"] = bool(ok)
    except Exception as exc:  # noqa: BLE001 - recorded as a failed case
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    return row


# ---- timing -----------------------------------------------------------------------------------


def variants(shape, axes):
    """(name, kind, in type, out type, pair) of the timed variants of one shape."""
    three = len(shape) == 3
    out = []
    for in_type, out_type in ((FLOAT16, FLOAT16), (FLOAT, FLOAT), (FLOAT16, FLOAT)):
        label = f"{NAME[in_type]}_{NAME[out_type]}"
        out.append((f"ort_{label}" + ("_pair" if three else ""), "ort", in_type, out_type, three))
        if three:
            out.append((f"ort_{label}_single", "ort", in_type, out_type, False))
        out.append((f"block_{label}", "block", in_type, out_type, False))
    return out


def timed_model(kind, shape, axes, in_type, out_type, pair, copies):
    p, q, r = sizes_of(shape, axes)
    nodes, inits, inputs, outputs = [], [], [], []
    for k in range(copies):
        x, y = f"x{k}", f"y{k}"
        inputs.append(_value(x, in_type, shape))
        outputs.append(_value(y, out_type, [q]))
        if kind == "block":
            nodes += block_nodes(x, y, (p, q, r), out_type, [q], str(k))
        else:
            more, constants = ort_nodes(x, y, shape, list(axes), in_type, out_type, str(k), pair)
            nodes += more
            inits += constants
    return _model(nodes, inputs, outputs, inits)


def time_shape(rt: Runtime, label, shape, axes, args, library) -> dict:
    p, q, r = sizes_of(shape, axes)
    rng = np.random.default_rng(7)
    base = (rng.standard_normal(shape) * 0.25).astype(np.float32)
    inputs = {}  # the same values in both types, one distinct copy per model input
    for elem_type in (FLOAT, FLOAT16):
        inputs[elem_type] = [rt.value((base + np.float32(k) * np.float32(2.0 ** -8)).astype(NP[elem_type]))
                             for k in range(args.copies)]
    entry = {"shape": list(shape), "axes": list(axes), "sizes": [p, q, r], "copies": args.copies,
             "plan_f16": cuda_plan(library, p, q, r, True), "plan_f32": cuda_plan(library, p, q, r, False),
             "variants": {}}
    runs = {}
    for name, kind, in_type, out_type, pair in variants(shape, axes):
        model = timed_model(kind, shape, axes, in_type, out_type, pair, args.copies)
        feeds = {f"x{k}": inputs[in_type][k] for k in range(args.copies)}
        outs = {f"y{k}": rt.empty([q], out_type) for k in range(args.copies)}
        item = {"in": NAME[in_type], "out": NAME[out_type], "bytes_read": int(base.size * np.dtype(NP[in_type]).itemsize)}
        try:
            plain = rt.session(model)
            bound = rt.binding(plain, feeds, outs)
            for _ in range(3):
                plain.run_with_iobinding(bound)
            graph = graph_bound = None
            if rt.provider == "cuda":
                try:
                    graph = rt.session(model, graph=True)
                    graph_outs = {f"y{k}": rt.empty([q], out_type) for k in range(args.copies)}
                    graph_bound = rt.binding(graph, feeds, graph_outs)
                    for _ in range(3):
                        graph.run_with_iobinding(graph_bound)
                except Exception as exc:  # noqa: BLE001
                    item["graph_error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
                    graph = None
            runs[name] = (plain, bound, graph, graph_bound, outs)
            item["output"] = outs["y0"].numpy().astype(np.float64)
        except Exception as exc:  # noqa: BLE001
            item["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
        entry["variants"][name] = item
    wall = {name: [] for name in runs}
    replay = {name: [] for name in runs if runs[name][2] is not None}
    for _ in range(args.rounds):  # the variants in turn, each round
        for name, (plain, bound, graph, graph_bound, _) in runs.items():
            start = time.perf_counter()
            for _ in range(args.reps):
                plain.run_with_iobinding(bound)
            wall[name].append((time.perf_counter() - start) / args.reps / args.copies * 1e6)
            if graph is not None:
                start = time.perf_counter()
                for _ in range(args.reps):
                    graph.run_with_iobinding(graph_bound)
                replay[name].append((time.perf_counter() - start) / args.reps / args.copies * 1e6)
    for name, (plain, bound, graph, _, _) in runs.items():
        item = entry["variants"][name]
        item["wall_us"] = round(statistics.median(wall[name]), 3)
        if name in replay:
            item["graph_us"] = round(statistics.median(replay[name]), 3)
            item["gb_s"] = round(item["bytes_read"] / item["graph_us"] / 1e3, 1)
        if rt.provider == "cuda" and args.cupti:
            kernels = standalone.cuda_kernel_times(lambda: plain.run_with_iobinding(bound), 5)
            if kernels:
                item["cupti_us"] = round(sum(us for _, us, _ in kernels) / args.copies, 3)
                item["cupti_kernels"] = [(k[:100], round(us / args.copies, 3), round(n / args.copies, 2))
                                         for k, us, n in kernels[:4]]
    # agreement: every variant against the float64 sum of the float16 input values (the float32
    # variants read the float32 values: compared with their own sums)
    exact = {FLOAT: inputs[FLOAT][0].numpy().astype(np.float64).reshape(p, q, r).sum(axis=(0, 2)),
             FLOAT16: inputs[FLOAT16][0].numpy().astype(np.float64).reshape(p, q, r).sum(axis=(0, 2))}
    scale = {t: float(np.abs(inputs[t][0].numpy().astype(np.float64)).reshape(p, q, r).sum(axis=(0, 2)).max())
             for t in exact}
    for name, item in entry["variants"].items():
        out = item.pop("output", None)
        if out is None:
            continue
        in_type = FLOAT16 if item["in"] == "f16" else FLOAT
        error = np.abs(out - exact[in_type]) / max(scale[in_type], 1e-30)
        item["max_rel_error"] = float(error.max())
        limit = 2.0 ** -10 if item["out"] == "f16" else 1e-4  # one float16 step / float32 sums of p*r terms
        item["agrees"] = bool(item["max_rel_error"] <= limit)
    speedups = {}
    for name, item in entry["variants"].items():
        if not name.startswith("block_"):
            continue
        label = name.removeprefix("block_")
        for other, base_item in entry["variants"].items():
            if other.startswith(f"ort_{label}"):
                key = "graph_us" if "graph_us" in item and "graph_us" in base_item else "wall_us"
                if key in base_item and key in item and item[key] > 0:
                    speedups[f"{other} / {name}"] = {key: round(base_item[key] / item[key], 2)}
    entry["speedups"] = speedups
    return entry


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--library", help="the custom-op library (default: $ONNXCAMPO_OPS_LIBRARY, else the built one)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (default 7)")
    parser.add_argument("--reps", type=int, default=20, help="runs per variant per round (default 20)")
    parser.add_argument("--copies", type=int, default=8, help="independent copies of the reduction per timed model")
    parser.add_argument("--no-timing", action="store_true", help="checks only")
    parser.add_argument("--no-cupti", dest="cupti", action="store_false", help="no torch.profiler kernel times")
    parser.add_argument("--quick", action="store_true", help="small shapes only (the plumbing, e.g. on the CPU)")
    args = parser.parse_args(argv)
    library = library_path(args.library)
    info = build_info(library)
    if args.provider == "cuda":
        if hasattr(ort, "preload_dlls"):  # onnxruntime-gpu finds pip's CUDA libraries (ORT >= 1.21)
            ort.preload_dlls()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print("the CUDA execution provider is not available in this onnxruntime", file=sys.stderr)
            return 2
        if "cuda" not in info:
            print(f"the library {library} has no CUDA kernels ({info}); build it with nvcc", file=sys.stderr)
            return 2
    rt = Runtime(args.provider, library)
    results = {"provider": args.provider, "onnxruntime": ort.__version__, "library": library, "build": info,
               "host": platform.node(), "numpy": np.__version__, "checks": [], "timing": []}
    failed = 0
    cases = QUICK_CHECKED if args.quick else CHECKED
    seed = 0
    for p, q, r in cases:
        for in_type in (FLOAT16, FLOAT):
            for out_type in (FLOAT16, FLOAT):
                seed += 1
                row = check_case(rt, p, q, r, in_type, out_type, seed)
                results["checks"].append(row)
                if not row["ok"]:
                    failed += 1
                    print(f"FAIL check {row}", file=sys.stderr)
    print(f"checks: {len(results['checks']) - failed} of {len(results['checks'])} passed", file=sys.stderr)
    if not args.no_timing:
        for label, shape, axes in (QUICK_TIMED if args.quick else TIMED):
            try:
                entry = time_shape(rt, label, shape, axes, args, library)
            except Exception:  # noqa: BLE001
                entry = {"error": traceback.format_exc(limit=3)}
                failed += 1
            entry["label"] = label
            results["timing"].append(entry)
            for name, item in entry.get("variants", {}).items():
                bad = "error" in item or not item.get("agrees", False) or (
                    name.startswith("block_") and args.provider == "cuda" and "graph_error" in item)
                if bad:
                    failed += 1
                print(f"{label:20s} {name:26s} graph {item.get('graph_us', float('nan')):9.2f} us  wall "
                      f"{item.get('wall_us', float('nan')):9.2f} us  cupti {item.get('cupti_us', float('nan')):9.2f} us"
                      f"  {item.get('gb_s', float('nan')):7.1f} GB/s  rel err {item.get('max_rel_error', float('nan')):.2e}"
                      + ("" if not bad else f"  FAIL {item.get('error') or item.get('graph_error') or 'disagrees'}"),
                      file=sys.stderr)
    results["failed"] = failed
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(f"{'FAILED' if failed else 'ok'}: {failed} failures" + (f"; results in {args.out}" if args.out else ""),
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
