"""Check ``ai.onnxcampo::MultiTensorCast`` on CUDA against numpy bit for bit, then time it against
one ONNX Runtime ``Cast`` per tensor on the weights of GPT-2 small, BERT-base and ResNet-50.

Run from the repository root on the GPU machine (onnxruntime-gpu, numpy and onnx; onnxcampo need
not be installed), with the library built with CUDA or pointed at:

    export PYTHONPATH=/tmp/ortgpu:$PYTHONPATH ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so
    python3 scripts/check_multi_tensor_cast_cuda.py --out $OUT/multi_tensor_cast.json

Checks: float16 rounding of every kind (ties to even, the largest float16 and overflow to inf,
subnormals and underflow, signed zeros, inf, NaN) and tensors of 1 to 10^6 + 3 elements in one call
(the CUDA kernel's vector path on 16-byte aligned tensors, its element path on their last elements),
in a plain session and replayed as a CUDA graph; the outputs must equal ``numpy.astype(float16)``
bit for bit (NaN: any NaN). Timing (cuda): each weight set (the shapes of the model's float32
parameters) cast by one MultiTensorCast and by one Cast node per tensor, interleaved in rounds,
inputs and outputs bound on the device, CUDA-graph replays (what the Trainer runs) and plain runs;
median ms per run, and the device time a run as CUPTI sees it where torch is installed.

Prints a line per check and a table, writes JSON to ``--out``; exit 1 when a check fails, 2 when
the CUDA EP is missing. ``--provider cpu --quick`` runs the checks on ORT's CPU provider
(tests/ops/test_multi_tensor_cast.py runs it).
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
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("_onnxcampo_standalone_sessions", ROOT / "onnxcampo/runtime/standalone.py")
standalone = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standalone)  # the runtime door for scripts (onnxcampo need not be installed)
DOMAIN = "ai.onnxcampo"

SPECIALS = np.array([0.0, -0.0, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 65504.0, 65519.99, 65520.0, -7e4,
                     2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 6e-8, 1e-30, np.inf, -np.inf, np.nan], np.float32)


def weight_sets() -> dict[str, list[tuple[int, ...]]]:
    """The float32 parameter shapes of the three benchmark models (the Casts a campo step runs)."""
    gpt2 = [(50257, 768), (1024, 768)]
    for _ in range(12):
        gpt2 += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,),
                 (3072, 768), (768,)]
    gpt2 += [(768,), (768,), (768, 50257)]
    bert = [(30522, 768), (512, 768), (2, 768), (768,), (768,)]
    for _ in range(12):
        bert += [(768, 768), (768,)] * 4 + [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
    bert += [(768, 768), (768,), (768, 2), (2,)]
    resnet = [(64, 3, 7, 7), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            resnet += [(planes, inplanes, 1, 1), (planes,), (planes, planes, 3, 3), (planes,), (planes * 4, planes, 1, 1),
                       (planes * 4,)]
            if b == 0:
                resnet += [(planes * 4, inplanes, 1, 1), (planes * 4,)]
            inplanes = planes * 4
    resnet += [(1000, 2048), (1000,)]
    return {"gpt2": gpt2, "bert": bert, "resnet50": resnet}


def _model(shapes, *, separate: bool) -> bytes:
    xs, ys = [f"x{k}" for k in range(len(shapes))], [f"y{k}" for k in range(len(shapes))]
    if separate:
        nodes = [helper.make_node("Cast", [x], [y], to=TensorProto.FLOAT16) for x, y in zip(xs, ys)]
    else:
        nodes = [helper.make_node("MultiTensorCast", xs, ys, domain=DOMAIN)]
    graph = helper.make_graph(nodes, "casts", [helper.make_tensor_value_info(x, TensorProto.FLOAT, s) for x, s in zip(xs, shapes)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT16, s) for y, s in zip(ys, shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    return model.SerializeToString()


class Bound:
    """A session with its inputs and outputs bound on the device (fixed addresses, as a replayed
    graph needs)."""

    def __init__(self, model: bytes, arrays: list[np.ndarray], library: str, provider: str, graph: bool):
        device = "cuda" if provider == "cuda" else "cpu"
        self.session = standalone.custom_op_session(model, library, provider, cuda_graph=graph)
        self.inputs = [ort.OrtValue.ortvalue_from_numpy(a, device, 0) for a in arrays]
        self.outputs = [ort.OrtValue.ortvalue_from_shape_and_type(list(a.shape), np.float16, device, 0) for a in arrays]
        self.binding = self.session.io_binding()
        for k, (x, y) in enumerate(zip(self.inputs, self.outputs)):
            self.binding.bind_ortvalue_input(f"x{k}", x)
            self.binding.bind_ortvalue_output(f"y{k}", y)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def results(self) -> list[np.ndarray]:
        return [y.numpy() for y in self.outputs]


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    nan = np.isnan(want)
    return got.shape == want.shape and bool(np.array_equal(np.isnan(got), nan)) and bool(
        np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16)))


def check(library: str, provider: str, quick: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    sizes = [1, 7, 8, 9, 4099] if quick else [1, 7, 8, 9, 4099, 8192, 8193, 100_003, 1_000_003]
    arrays = [SPECIALS] + [(rng.standard_normal(n) * rng.choice([1e-6, 1.0, 3e4])).astype(np.float32) for n in sizes]
    with np.errstate(over="ignore"):
        want = [a.astype(np.float16) for a in arrays]
    model = _model([a.shape for a in arrays], separate=False)
    rows = []
    for graph in ((False, True) if provider == "cuda" else (False,)):
        bound = Bound(model, arrays, library, provider, graph)
        for _ in range(3 if graph else 1):  # a replayed graph must give the same values each time
            bound.run()
        got = bound.results()
        bad = [int(a.size) for a, g, w in zip(arrays, got, want) if not _same(g, w)]
        rows.append({"check": f"{provider}{' graph' if graph else ''}: {len(arrays)} tensors of "
                              f"{min(a.size for a in arrays)}..{max(a.size for a in arrays)} elements equal numpy's "
                              "float16 bit for bit", "ok": not bad, "mismatched_sizes": bad})
    return rows


def time_sets(library: str, rounds: int) -> dict:
    out = {}
    for label, shapes in weight_sets().items():
        rng = np.random.default_rng(1)
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        variants = {(kind, graph): Bound(_model(shapes, separate=kind == "casts"), arrays, library, "cuda", graph)
                    for kind in ("multi", "casts") for graph in (True, False)}
        ms = standalone.time_in_rotation({key: bound.run for key, bound in variants.items()}, rounds, 20)
        entry = {"tensors": len(shapes), "elements": int(sum(int(np.prod(s)) for s in shapes)),
                 "ms": {f"{kind}{'-graph' if graph else ''}": v for (kind, graph), v in ms.items()}}
        gpu = {}
        for kind in ("multi", "casts"):
            measured = standalone.gpu_time_per_call(variants[(kind, False)].run, 10)
            if measured is not None:
                gpu[kind] = {"total_ms": measured["total_ms"], "launches": measured["launches"]}
        entry["gpu"] = gpu or None
        same = all(_same(a, b) for a, b in zip(variants[("multi", True)].results(), variants[("casts", True)].results()))
        entry["same_values"] = same
        out[label] = entry
        ms = entry["ms"]
        print(f"  {label:9s} {len(shapes):4d} tensors: MultiTensorCast {ms['multi-graph']:.3f} ms replayed "
              f"({ms['multi']:.3f} plain), a Cast each {ms['casts-graph']:.3f} ({ms['casts']:.3f})"
              + (f"; GPU {gpu['multi']['total_ms']:.3f} vs {gpu['casts']['total_ms']:.3f} ms" if len(gpu) == 2 else ""),
              flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="smaller tensors, no timing")
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
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']}" + (f": {row['mismatched_sizes']}" if not row["ok"] else ""))
    report = {"command": " ".join(["python3", "scripts/check_multi_tensor_cast_cuda.py", *(argv or sys.argv[1:])]),
              "onnxruntime": ort.__version__, "checks": rows}
    if args.provider == "cuda" and not args.quick:
        report["timing"] = time_sets(library, args.rounds)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    failed = [row for row in rows if not row["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
