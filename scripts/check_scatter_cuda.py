"""Check ``ai.onnxcampo::ScatterNDAdd`` on CUDA against numpy, then time it against ONNX Runtime's
``ScatterND(reduction="add")`` on the embedding-gradient shapes of BERT-base and GPT-2.

Run from the repository root on the GPU machine (needs only onnxruntime-gpu and numpy; the models
are written as protobuf bytes here, so neither onnx nor an installed onnxcampo is needed), with
the library built with CUDA (``python3 -m onnxcampo.ops.build``) or pointed at:

    export PYTHONPATH=/tmp/ortgpu:$PYTHONPATH ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so
    python3 scripts/check_scatter_cuda.py --out $OUT/scatter.json

Checks (every case on ScatterNDAdd, and on ORT's ScatterND where that runs the case): float32 and
float16, duplicate and negative indices, index tuples of 0..3 entries, slice lengths that take the
vector and the scalar paths, empty tensors, indices out of range (CUDA: clamped as ORT's CUDA
kernel clamps them; CPU: an error). The reference is np.add.at in float64; the order of the
atomic additions is not fixed, so an element that receives m updates may differ from it by
2 (m + 1) u S (u: 2^-24 for float32, 2^-11 for float16, whose running sums are float16; S: |data|
plus the sum of the |updates| it receives); an element that receives none must equal data bit for
bit. A CUDA-graph session (``enable_cuda_graph``) replays the BERT-shaped scatter three times: each
replay must give the reference (the copy of data into the output is part of the graph, so sums do
not pile up across replays).

Timing (default on for cuda): BERT-base (data [30522, 768], indices [4096, 1] of b32 s128 token
ids: [CLS], Zipf-distributed word pieces, [SEP], [PAD] to the end, so a few rows take hundreds of
updates) and GPT-2 (data [50257, 768], indices [2048, 1], Zipf), plus a worst case with every
index equal; float32; inputs and the pre-allocated output bound on the device (IO binding); ORT's
ScatterND and ScatterNDAdd interleaved in rounds in one process, in three modes: ``sync`` (ORT
synchronises after every run: launch overhead included), ``queued`` (runs queued without
synchronising, one synchronisation per block: the device's throughput) and ``graph`` (CUDA-graph
replays, one per run). Median ms per run; the timed outputs are checked against numpy too. Where
torch is installed, its profiler (CUPTI) also gives the device time of a run, kernels and the
copy of data into the output, for both variants (optional).

Prints a line per check and a table of medians, writes everything as JSON to ``--out``, exits 1
when a check of ScatterNDAdd fails (or it errs where it must run), 2 when the CUDA EP is missing.
ORT's ScatterND is checked the same way, but only reported (``warn``): it is the baseline.
``--provider cpu --quick`` runs the same code on ORT's CPU provider (tests/ops/test_scatter_script.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
DOMAIN = "ai.onnxcampo"
FLOAT, FLOAT16, INT64 = 1, 10, 7
ELEM = {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16}
UNIT = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float16): 2.0 ** -11}
TINY = 2.0 ** -126  # float32 atomics may flush subnormal sums to zero
VARIANTS = ("ScatterND", "ScatterNDAdd")  # ORT's op (reduction add), ours
MODES = ("sync", "queued", "graph")
PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def _load(name: str, relative: str):
    """A module of this repository by its path (onnxcampo need not be installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standalone = _load("_onnxcampo_standalone_sessions", "onnxcampo/runtime/standalone.py")  # the runtime door


def library_path() -> str:
    path = os.environ.get("ONNXCAMPO_OPS_LIBRARY") or str(ROOT / "onnxcampo/ops/lib/libonnxcampo_ops.so")
    if not Path(path).is_file():
        raise SystemExit(f"no custom-op library at {path}: run `python3 -m onnxcampo.ops.build` or set ONNXCAMPO_OPS_LIBRARY")
    return path


# ---- a minimal ONNX protobuf writer (ModelProto, GraphProto, NodeProto, ValueInfoProto) --------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes | str) -> bytes:  # length-delimited field
    payload = payload.encode() if isinstance(payload, str) else payload
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _value_info(name: str, elem_type: int, rank: int) -> bytes:
    dims = b"".join(_field(1, _field(2, f"{name}_{d}")) for d in range(rank))  # symbolic dims
    tensor = _int(1, elem_type) + _field(2, dims)
    return _field(1, name) + _field(2, _field(1, tensor))


def scatter_model(variant: str, dtype: np.dtype, ranks: tuple[int, int, int]) -> bytes:
    """One node, ``output = variant(data, indices, updates)``, ORT's with reduction "add"."""
    body = b"".join(_field(1, n) for n in ("data", "indices", "updates")) + _field(2, "output") + _field(3, "scatter")
    if variant == "ScatterND":
        body += _field(4, "ScatterND") + _field(5, _field(1, "reduction") + _field(4, "add") + _int(20, 3))
    else:
        body += _field(4, variant) + _field(7, DOMAIN)
    elem = ELEM[np.dtype(dtype)]
    graph = _field(1, body) + _field(2, "scatter")
    graph += _field(11, _value_info("data", elem, ranks[0])) + _field(11, _value_info("indices", INT64, ranks[1]))
    graph += _field(11, _value_info("updates", elem, ranks[2])) + _field(12, _value_info("output", elem, ranks[0]))
    opsets = _field(8, _field(1, "") + _int(2, 18)) + _field(8, _field(1, DOMAIN) + _int(2, 1))
    return _int(1, 10) + opsets + _field(7, graph)


def session(model: bytes, provider: str, *, cuda_graph: bool = False, threads: int | None = None) -> ort.InferenceSession:
    """The model's session with the library registered, through the runtime door (on cuda
    without CPU fallback: a node CUDA cannot run fails the session)."""
    return standalone.custom_op_session(model, library_path(), provider, intra_op_threads=threads, cuda_graph=cuda_graph)


# ---- the reference ---------------------------------------------------------------------------


def effective_indices(data_shape, indices: np.ndarray, provider: str) -> np.ndarray | None:
    """Index tuples [tuples, k] wrapped (negative) and, on CUDA, clamped as ORT's CUDA kernel
    does; None on the CPU when one is out of range (the kernel must fail)."""
    k = indices.shape[-1]
    tuples = indices.reshape(int(np.prod(indices.shape[:-1], dtype=np.int64)), k).astype(np.int64)
    dims = np.array(data_shape[:k], dtype=np.int64)
    bad = (tuples < -dims) | (tuples >= dims)
    if bad.any() and provider != "cuda":
        return None
    wrapped = np.where(tuples < 0, tuples + dims, tuples)
    return np.where(tuples >= dims, dims - 1, np.where(tuples < -dims, 0, wrapped))


def reference(data: np.ndarray, tuples: np.ndarray, updates: np.ndarray):
    """float64 sums, how many updates each element receives, and |data| + sum |updates|."""
    k = tuples.shape[1]
    slices = updates.reshape(len(tuples), *data.shape[k:]).astype(np.float64)
    exact = data.astype(np.float64)
    count = np.zeros(data.shape, np.int64)
    magnitude = np.abs(data.astype(np.float64))
    if len(tuples) and k == 0:
        exact = exact + slices.sum(axis=0)
        count += len(tuples)
        magnitude = magnitude + np.abs(slices).sum(axis=0)
    elif len(tuples):
        where = tuple(tuples.T)
        np.add.at(exact, where, slices)
        np.add.at(count, where, 1)
        np.add.at(magnitude, where, np.abs(slices))
    return exact, count, magnitude


def compare(out: np.ndarray, data: np.ndarray, tuples: np.ndarray, updates: np.ndarray, expected=None) -> dict:
    exact, count, magnitude = expected if expected is not None else reference(data, tuples, updates)
    report = {"shape_ok": out.shape == data.shape and out.dtype == data.dtype}
    if not report["shape_ok"]:
        return {**report, "ok": False, "got": [list(out.shape), str(out.dtype)]}
    unit = UNIT[np.dtype(data.dtype)]
    error = np.abs(out.astype(np.float64) - exact)
    allowed = 2 * (count + 1) * unit * magnitude + count * TINY
    touched = count > 0
    untouched_ok = bool(np.array_equal(out[~touched].view(np.uint8), data[~touched].view(np.uint8))) if out.size else True
    worst = float((error / np.maximum(allowed, np.finfo(np.float64).tiny))[touched].max()) if touched.any() else 0.0
    report.update(ok=bool(untouched_ok and (error <= allowed).all()), untouched_equal_data=untouched_ok,
                  max_abs_error=float(error.max()) if out.size else 0.0, worst_error_over_bound=worst,
                  max_updates_per_element=int(count.max()) if out.size else 0)
    return report


# ---- the cases -------------------------------------------------------------------------------


def random_case(rng, dtype, data_shape, k, lead):
    """Random data, indices with many duplicates (a third of them negative), updates."""
    data = (rng.standard_normal(data_shape) * 4).astype(dtype)
    dims = np.array(data_shape[:k], dtype=np.int64)
    positive = rng.integers(0, np.maximum(dims, 1), size=(*lead, k)) if k else np.zeros((*lead, 0), np.int64)
    indices = np.where(rng.random(positive.shape) < 0.33, positive - dims, positive).astype(np.int64)
    updates = (rng.standard_normal((*lead, *data_shape[k:])) * 4).astype(dtype)
    return data, indices, updates


def cases(seed: int = 0) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    shapes = [((6, 5), 1, (40,)), ((30, 16, 3), 1, (4, 8)), ((5, 4, 3), 2, (25,)), ((3, 4, 2), 3, (2, 30)),
              ((4, 3), 0, (3,)), ((7,), 1, (50,)), ((10, 7), 1, (33,)), ((10, 6), 1, (33,)),
              ((64, 768), 1, (300,)), ((1000, 768, 1), 1, (8, 64))]
    for dtype in (np.float32, np.float16):
        for data_shape, k, lead in shapes:
            data, indices, updates = random_case(rng, dtype, data_shape, k, lead)
            out.append((f"{np.dtype(dtype).name} data {list(data_shape)} k={k} tuples {list(lead)}", data, indices, updates))
    for data_shape, index_shape, update_shape in [((4, 3), (0, 1), (0, 3)), ((0, 3), (0, 1), (0, 3)),
                                                  ((4, 0), (2, 1), (2, 0)), ((4, 3), (2, 0, 1), (2, 0, 3))]:
        data = np.arange(int(np.prod(data_shape)), dtype=np.float32).reshape(data_shape)
        out.append((f"empty: data {list(data_shape)} indices {list(index_shape)}", data,
                    np.ones(index_shape, np.int64), np.ones(update_shape, np.float32)))
    for dtype in (np.float32, np.float16):
        data = np.zeros((4, 8), dtype)
        indices = np.array([[1], [4], [-5], [100], [-(2 ** 40)], [-4]])
        out.append((f"{np.dtype(dtype).name} indices out of range", data, indices,
                    (rng.standard_normal((6, 8)) * 4).astype(dtype)))
    return out


def run_plain(sessions: dict, variant: str, provider: str, data, indices, updates) -> np.ndarray:
    key = (variant, np.dtype(data.dtype).name, data.ndim, indices.ndim, updates.ndim)
    if key not in sessions:
        # ORT's CPU ScatterND splits the index tuples over its threads and races on duplicates
        # (onnxruntime 1.32: wrong sums in about a third of the runs with 2 threads): one thread
        single = provider == "cpu" and variant == "ScatterND"
        sessions[key] = session(scatter_model(variant, data.dtype, key[2:]), provider, threads=1 if single else None)
    return sessions[key].run(None, {"data": data, "indices": indices, "updates": updates})[0]


def _message(exc: BaseException) -> str:
    """The status message of an ORT error (the text after its boilerplate)."""
    text = str(exc).strip()
    last = text.splitlines()[-1] if text else type(exc).__name__
    return last.split("Status Message: ")[-1]


def check_cases(provider: str) -> list[dict]:
    sessions: dict = {}
    reports = []
    for name, data, indices, updates in cases():
        tuples = effective_indices(data.shape, indices, provider)
        for variant in VARIANTS:
            entry = {"case": name, "variant": variant}
            if variant == "ScatterND" and provider == "cpu" and data.dtype == np.float16:
                # onnxruntime 1.32's CPU ScatterND refuses float16 with reduction add, and after a
                # few such refusals the process crashes (SIGSEGV/SIGFPE; no custom op involved)
                entry.update(ok=True, skipped="ORT's CPU ScatterND has no float16 kernel for reduction add")
                reports.append(entry)
                print(f"skip {variant:12} {name}: {entry['skipped']}", flush=True)
                continue
            try:
                out = run_plain(sessions, variant, provider, data, indices, updates)
            except Exception as exc:  # noqa: BLE001 - a report, not a crash
                message = _message(exc)
                if tuples is None:  # the CPU kernels must refuse indices out of range
                    entry.update(ok="out of range" in message or "invalid indice" in message, error=message[:300])
                elif variant == "ScatterND":  # ORT's op is the baseline: it may lack a kernel (fp16 on CPU)
                    entry.update(ok=True, skipped=message[:300])
                else:
                    entry.update(ok=False, error=message[:300])
            else:
                if tuples is None:
                    entry.update(ok=False, error="ran although an index is out of range")
                else:
                    entry.update(compare(out, data, tuples, updates))
                    if variant == "ScatterND":  # the baseline: a wrong result of ORT's is reported, not failed
                        entry.update(matches_reference=entry["ok"], ok=True)
            reports.append(entry)
            status = ("FAIL" if not entry["ok"] else "skip" if "skipped" in entry
                      else "warn" if entry.get("matches_reference") is False else "ok")
            detail = entry.get("error") or entry.get("skipped") or (
                f"max error {entry['max_abs_error']:.3g} = {entry['worst_error_over_bound']:.3f} x bound, "
                f"up to {entry['max_updates_per_element']} updates per element")
            print(f"{status:4} {variant:12} {name}: {detail}", flush=True)
    return reports


# ---- BERT-base and GPT-2 embedding gradients ---------------------------------------------------


def zipf_ids(rng, count: int, vocab: int, first: int = 0, exponent: float = 1.07) -> np.ndarray:
    """Token ids with a Zipf law over ranks (a fixed shuffle of ids first..vocab-1)."""
    ranks = np.arange(1, vocab - first + 1, dtype=np.float64)
    p = ranks ** -exponent
    order = np.random.default_rng(1234).permutation(vocab - first) + first
    return order[rng.choice(len(ranks), size=count, p=p / p.sum())]


def bert_ids(rng, batch: int = 32, seq: int = 128, vocab: int = 30522) -> np.ndarray:
    """b x s token ids: [CLS] (101), word pieces, [SEP] (102), [PAD] (0) to the end."""
    ids = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        length = int(rng.integers(seq // 4, seq + 1))
        ids[row, 0], ids[row, length - 1] = 101, 102
        ids[row, 1:length - 1] = zipf_ids(rng, length - 2, vocab, first=999)
    return ids.reshape(-1, 1)


def benchmarks(quick: bool) -> list[dict]:
    rng = np.random.default_rng(5)
    if quick:  # the CPU test: small stand-ins
        specs = [("bert-like", 3000, 64, bert_ids(rng, 4, 32, 3000)), ("same-index", 3000, 64, np.full((128, 1), 7))]
    else:
        specs = [("bert-base b32 s128", 30522, 768, bert_ids(rng)),
                 ("gpt2 b16 s128", 50257, 768, zipf_ids(rng, 2048, 50257).reshape(-1, 1)),
                 ("bert-base shape, every index equal", 30522, 768, np.full((4096, 1), 1037, np.int64))]
    out = []
    for name, vocab, width, indices in specs:
        updates = (rng.standard_normal((len(indices), width)) * 1e-2).astype(np.float32)
        unique, counts = np.unique(indices, return_counts=True)
        out.append({"name": name, "data": np.zeros((vocab, width), np.float32), "indices": indices.astype(np.int64),
                    "updates": updates, "distinct_rows": int(len(unique)), "max_duplicates": int(counts.max())})
    return out


class Bound:
    """One session with its inputs and pre-allocated output bound on the device."""

    def __init__(self, variant: str, bench: dict, provider: str, mode: str):
        self.session = session(scatter_model(variant, np.float32, (2, 2, 2)), provider, cuda_graph=mode == "graph",
                               threads=1 if provider == "cpu" and variant == "ScatterND" else None)  # (see run_plain)
        device = "cuda" if provider == "cuda" else "cpu"
        self.binding = self.session.io_binding()
        self.values = {}
        for name in ("data", "indices", "updates"):
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(bench[name], device, 0)
            self.binding.bind_ortvalue_input(name, self.values[name])
        self.values["output"] = ort.OrtValue.ortvalue_from_shape_and_type(bench["data"].shape, np.float32, device, 0)
        self.binding.bind_ortvalue_output("output", self.values["output"])
        self.options = ort.RunOptions()
        if mode == "queued":
            self.options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def runs(self, count: int) -> None:
        for _ in range(count):
            self.session.run_with_iobinding(self.binding, self.options)
        self.binding.synchronize_outputs()

    def output(self) -> np.ndarray:
        return self.values["output"].numpy()


def gpu_ms_per_run(bound: Bound, runs: int = 10) -> dict | None:
    """The device time of one run (kernels and the copy of data) as CUPTI sees it through torch's
    profiler; None without torch (optional: the wall times of a run also hold ORT's host work)."""
    bound.runs(1)
    return standalone.gpu_time_per_call(lambda: bound.runs(1), runs)


def cuda_graph_check(bench: dict, provider: str) -> dict:
    """Three replays of a captured ScatterNDAdd, each equal to the reference."""
    tuples = effective_indices(bench["data"].shape, bench["indices"], provider)
    expected = reference(bench["data"], tuples, bench["updates"])
    report = {"case": bench["name"], "replays": []}
    try:
        bound = Bound("ScatterNDAdd", bench, provider, "graph")
        for _ in range(4):  # ORT runs once plainly, then captures, then replays
            bound.runs(1)
            report["replays"].append(compare(bound.output(), bench["data"], tuples, bench["updates"], expected))
        report["ok"] = all(r["ok"] for r in report["replays"])
    except Exception as exc:  # noqa: BLE001
        report.update(ok=False, error=f"{type(exc).__name__}: {_message(exc)[:300]}")
    print(f"{'ok' if report['ok'] else 'FAIL':4} CUDA graph, 4 runs of ScatterNDAdd on {bench['name']}: "
          f"{report.get('error') or [round(r['worst_error_over_bound'], 3) for r in report['replays']]}", flush=True)
    return report


def timing(provider: str, rounds: int, block: int, quick: bool) -> list[dict]:
    results = []
    modes = MODES if provider == "cuda" else ("sync", "queued")
    for bench in benchmarks(quick):
        tuples = effective_indices(bench["data"].shape, bench["indices"], provider)
        expected = reference(bench["data"], tuples, bench["updates"])
        entry = {key: bench[key] for key in ("name", "distinct_rows", "max_duplicates")}
        entry.update(data=list(bench["data"].shape), indices=list(bench["indices"].shape),
                     updates=list(bench["updates"].shape), variants={})
        bound = {}
        for variant in VARIANTS:
            for mode in modes:
                key = f"{variant}/{mode}"
                try:
                    bound[key] = Bound(variant, bench, provider, mode)
                    bound[key].runs(3)  # warm-up (and, for graph, the capture)
                except Exception as exc:  # noqa: BLE001 - ORT's op may not capture: recorded
                    entry["variants"][key] = {"error": f"{type(exc).__name__}: {_message(exc)[:300]}",
                                              "ok": variant == "ScatterND"}
        times = {key: [] for key in bound}
        for r in range(rounds):
            keys = list(bound)
            keys = keys[r % len(keys):] + keys[:r % len(keys)]  # rotate the order each round
            for key in keys:
                start = time.perf_counter()
                bound[key].runs(block)
                times[key].append(1e3 * (time.perf_counter() - start) / block)
        for key, values in times.items():
            check = compare(bound[key].output(), bench["data"], tuples, bench["updates"], expected)
            entry["variants"][key] = {"median_ms": statistics.median(values), "min_ms": min(values),
                                      "blocks_ms": [round(v, 5) for v in values], "output": check,
                                      "ok": check["ok"] or key.startswith("ScatterND/")}  # ORT's: reported only
        for mode in modes:
            standard, ours = (entry["variants"].get(f"{v}/{mode}", {}).get("median_ms") for v in VARIANTS)
            if standard and ours:
                entry.setdefault("speedup", {})[mode] = standard / ours
        if provider == "cuda":  # CUPTI's device time a run, where torch is there
            entry["gpu"] = {v: gpu_ms_per_run(bound[f"{v}/sync"]) for v in VARIANTS if f"{v}/sync" in bound}
        results.append(entry)
        print(f"\n{bench['name']}: data {entry['data']}, indices {entry['indices']} ({entry['distinct_rows']} distinct "
              f"rows, up to {entry['max_duplicates']} per row)", flush=True)
        for mode in modes:
            cells = []
            for variant in VARIANTS:
                value = entry["variants"].get(f"{variant}/{mode}", {})
                cells.append(f"{variant} {value['median_ms']:.4f} ms" if "median_ms" in value else f"{variant} error")
            speed = entry.get("speedup", {}).get(mode)
            print(f"  {mode:6} " + "   ".join(cells) + (f"   speed-up {speed:.1f}x" if speed else ""), flush=True)
        if any(entry.get("gpu", {}).values()):
            print("  device time a run (CUPTI): " + "   ".join(
                f"{v} {g['total_ms']:.4f} ms in {g['launches']:.0f} launches" if g else f"{v} -"
                for v, g in entry["gpu"].items()), flush=True)
        bad = [key for key, value in entry["variants"].items() if not value["ok"]]
        if bad:
            print(f"  FAIL: {bad}", flush=True)
        odd = [f"{key} ({value.get('error') or 'output off the reference'})" for key, value in entry["variants"].items()
               if key.startswith("ScatterND/") and ("error" in value or not value["output"]["ok"])]
        if odd:
            print(f"  warn, ORT's op: {odd}", flush=True)
    return results


def device_name() -> str | None:
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=20)
        return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cuda")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--timing", action=argparse.BooleanOptionalAction, default=None,
                        help="time ScatterND against ScatterNDAdd (default: on for cuda)")
    parser.add_argument("--rounds", type=int, default=15, help="timed blocks per variant")
    parser.add_argument("--block", type=int, default=20, help="runs per timed block")
    parser.add_argument("--quick", action="store_true", help="small stand-ins for the benchmark shapes")
    args = parser.parse_args(argv)
    if args.provider == "cuda":
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        if PROVIDERS["cuda"] not in ort.get_available_providers():
            print(f"no CUDAExecutionProvider in onnxruntime {ort.__version__} "
                  f"({ort.get_available_providers()}): install onnxruntime-gpu", file=sys.stderr)
            return 2
    print(f"onnxruntime {ort.__version__}, library {library_path()}, provider {args.provider}", flush=True)
    result = {"onnxruntime": ort.__version__, "library": library_path(), "provider": args.provider,
              "device": device_name() if args.provider == "cuda" else platform.processor() or platform.machine(),
              "python": platform.python_version(), "argv": sys.argv[1:] if argv is None else argv}
    try:
        result["checks"] = check_cases(args.provider)
        ok = all(entry["ok"] for entry in result["checks"])
        if args.provider == "cuda":
            result["cuda_graph"] = cuda_graph_check(benchmarks(args.quick)[0], args.provider)
            ok = ok and result["cuda_graph"]["ok"]
        if args.timing if args.timing is not None else args.provider == "cuda":
            result["timing"] = timing(args.provider, args.rounds, args.block, args.quick)
            ok = ok and all(v["ok"] for entry in result["timing"] for v in entry["variants"].values())
    except Exception:  # noqa: BLE001 - whatever broke goes into the JSON
        result["crash"] = traceback.format_exc()
        print(result["crash"], file=sys.stderr)
        ok = False
    result["ok"] = ok
    failed = [f"{c['variant']} {c['case']}" for c in result.get("checks", []) if not c["ok"]]
    print(f"\n{'all checks passed' if ok else 'FAILED: ' + (', '.join(failed) or 'see above')}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
