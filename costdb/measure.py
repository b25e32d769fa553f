"""Measurement harness for the cost database: single-op models timed on ONNX Runtime.

For every case of the grid (op type, shapes, attributes) a one-node model is built in fp32 and in
fp16 and timed through IO binding with inputs and outputs on the device (outputs pre-allocated,
so no host copies and no allocations are timed). ``time_us`` is the median wall time of a run
minus the median wall time of an empty model (one tiny Identity) measured in the same process:
the session's fixed per-run cost, which every node of a real graph shares. fp32 GEMMs and
convolutions are measured with TF32 on (ORT's default, what the database is for) and off
(recorded, not used by default). Casts are measured in both directions from 1e3 to 1e8
elements, Pad and Slice (the padding pass's cost) over the same range. Short chains that ONNX
Runtime may fuse are timed whole and node by node (:mod:`onnxcampo.costdb.chains`).

Samples are appended as JSON lines; a case already in the file is skipped, so a run that stops
(``--budget-s``) resumes where it stopped. Each sample carries the device and versions.

    python -m onnxcampo costdb measure --out costdb/data/raw/nvidia-h200.jsonl --budget-s 540
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.costdb.chains import ChainCase, build_chain, chain_cases

log = logging.getLogger(__name__)

_OPSET = 17
_IR = 8


@dataclass(frozen=True)
class Case:
    """One op at one set of shapes; ``weights`` are input indices given as initializers."""

    op_type: str
    input_shapes: tuple[tuple[int, ...], ...]
    attrs: tuple[tuple[str, object], ...] = ()
    weights: tuple[int, ...] = ()
    tag: str = ""
    domain: str = ""
    # Integer inputs (index -> the value every element holds: ids, lengths), int32 as ORT's
    # contrib ops take them; the features count float tensors only.
    int_inputs: tuple[tuple[int, int], ...] = ()
    # (shape, is_float) of each output where ONNX shape inference knows no schema (com.microsoft);
    # None: an optional output left out.
    outputs: tuple[tuple[tuple[int, ...], bool] | None, ...] = ()

    @property
    def key(self) -> str:
        shapes = ",".join("x".join(map(str, s)) for s in self.input_shapes)
        attrs = ";".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.op_type}|in={shapes}|attrs={attrs}{'|' + self.tag if self.tag else ''}"


# --- the grid --------------------------------------------------------------------------------

_GEMM_MNK = [
    # BERT-base / GPT-2 projections and FFNs (rows = batch x sequence)
    (4096, 768, 768), (4096, 768, 3072), (4096, 3072, 768), (2048, 768, 2304), (2048, 768, 50257),
    (512, 768, 768), (512, 768, 3072), (128, 768, 768), (16384, 768, 768), (16384, 3072, 768),
    # ResNet/classifier heads and small layers
    (64, 2048, 1000), (64, 2048, 1001), (256, 2048, 1001), (1, 2048, 1000), (32, 512, 10),
    # the DESIGN's measured points
    (512, 768, 768), (64, 64, 64), (256, 2048, 1001), (4095, 1023, 1001), (4096, 1024, 1008),
    (8192, 1024, 1024), (8192, 1023, 1023), (8192, 4096, 4096), (8192, 4095, 4095),
]


def _random_gemms(rng: np.random.Generator, count: int) -> list[tuple[int, int, int]]:
    shapes = []
    for _ in range(count):
        m = int(2 ** rng.uniform(4, 14.5))
        k = int(2 ** rng.uniform(5, 12.5))
        n = int(2 ** rng.uniform(3, 12.5))
        if rng.random() < 0.5:  # half of them aligned to 8
            k, n = max(8, k // 8 * 8), max(8, n // 8 * 8)
        shapes.append((m, k, n))
    return shapes


def _conv_cases(rng: np.random.Generator) -> list[Case]:
    cases = []
    resnet = [  # (batch, c_in, hw, c_out, k, stride)
        (64, 3, 224, 64, 7, 2), (64, 64, 56, 64, 3, 1), (64, 64, 56, 256, 1, 1), (64, 256, 56, 64, 1, 1),
        (64, 128, 28, 128, 3, 1), (64, 256, 14, 256, 3, 1), (64, 512, 7, 512, 3, 1), (64, 1024, 14, 256, 1, 1),
        (1, 3, 224, 64, 7, 2), (1, 64, 56, 64, 3, 1), (8, 256, 14, 256, 3, 1), (16, 96, 32, 96, 3, 1),
    ]
    for _ in range(90):
        c_in = int(rng.choice([3, 5, 16, 24, 32, 48, 63, 64, 96, 100, 128, 255, 256]))
        c_out = int(rng.choice([8, 16, 30, 32, 64, 96, 127, 128, 256, 500, 512]))
        resnet.append((int(rng.choice([1, 8, 32, 64])), c_in, int(rng.choice([7, 14, 28, 56])), c_out,
                       int(rng.choice([1, 3])), 1))
    for batch, c_in, hw, c_out, k, stride in resnet:
        pad = k // 2
        cases.append(Case("Conv", ((batch, c_in, hw, hw), (c_out, c_in, k, k)),
                          (("pads", (pad,) * 4), ("strides", (stride, stride))), weights=(1,)))
    return cases


def _elementwise_sizes() -> list[int]:
    return [int(10 ** e) for e in np.arange(3.0, 8.01, 0.25)]


def _shape_of(elements: int, last: int = 768) -> tuple[int, int]:
    rows = max(1, elements // last)
    return (rows, last)


# Real-model shapes (scripts/harvest_shapes.py) and the op types taken from them.
HARVESTED = Path(__file__).resolve().parent / "data" / "raw" / "harvested-cases.json"
HARVEST_OPS = frozenset({"MatMul", "Gemm", "Conv", "Add", "Mul", "Sub", "Div", "Relu", "Sigmoid", "Tanh",
                         "Erf", "Sqrt", "Softmax", "ReduceMean", "LayerNormalization", "Transpose"})


def _round8(value: int) -> int:
    return -(-value // 8) * 8


def harvested_cases() -> list[Case]:
    """Cases of real models, plus the padded twin of each unaligned MatMul/Gemm/Conv (the shape
    the padding pass would run), so that padding decisions are fitted on pairs."""
    if not HARVESTED.is_file():
        return []
    cases = []
    for row in json.loads(HARVESTED.read_text()):
        shapes = tuple(tuple(s) for s in row["input_shapes"])
        attrs = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in row["attrs"].items()))
        op = row["op_type"]
        if op == "Conv" and dict(attrs).get("group", 1) != 1:
            continue
        weights = tuple(i for i in row["weights"] if i > 0)
        cases.append(Case(op, shapes, attrs, weights=weights, tag="harvested"))
        twin = _padded_twin(op, shapes, dict(attrs))
        if twin is not None:
            cases.append(Case(op, twin, attrs, weights=weights, tag="padded"))
    return cases


def _padded_twin(op: str, shapes, attrs) -> tuple[tuple[int, ...], ...] | None:
    if op == "MatMul" and len(shapes) == 2 and len(shapes[1]) == 2:
        (*lead, k), (_, n) = shapes[0], shapes[1]
        k2, n2 = _round8(k), _round8(n)
        if (k2, n2) != (k, n):
            return ((*lead, k2), (k2, n2))
    if op == "Gemm" and len(shapes) >= 2 and not attrs.get("transA", 0):
        (m, k), (r, c) = shapes[0], shapes[1]
        k2 = _round8(k)
        n = r if attrs.get("transB", 0) else c
        n2 = _round8(n)
        if (k2, n2) != (k, n):
            weight = (n2, k2) if attrs.get("transB", 0) else (k2, n2)
            bias = ((n2,),) if len(shapes) > 2 and shapes[2] == (n,) else shapes[2:]
            return ((m, k2), weight, *bias)
    if op == "Conv" and len(shapes) >= 2:
        x, w = shapes[0], shapes[1]
        c_in, c_out = _round8(w[1]), _round8(w[0])
        if (c_in, c_out) != (w[1], w[0]):
            bias = ((c_out,),) if len(shapes) > 2 else ()
            return ((x[0], c_in, *x[2:]), (c_out, c_in, *w[2:]), *bias)
    return None


# The com.microsoft ops of fused transformer graphs (ORT's transformers optimizer, ORT's CUDA
# graph transformers), at the token counts and widths of the models they come from: BERT-base and
# GPT-2 (768), MiniLM (384), BERT-large (1024). (batch, sequence) pairs of the attention cases.
_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_ATTENTION_BS = ((1, 128), (8, 128), (32, 128), (64, 128), (1, 256), (2, 256), (8, 256), (16, 256),
                 (1, 512), (4, 512))
MS = "com.microsoft"


def _ms(op: str, shapes, *, weights=(), attrs=(), ints=(), outputs=None, tag="fused") -> Case:
    """A com.microsoft case whose first output has the shape of its first input unless given."""
    outputs = outputs if outputs is not None else ((tuple(shapes[0]), True),)
    return Case(op, tuple(tuple(s) for s in shapes), tuple(attrs), weights=tuple(weights), tag=tag, domain=MS,
                int_inputs=tuple(ints), outputs=tuple(outputs))


def fused_cases() -> list[Case]:
    """Cases of the fused ops, which the regression fits like any op type (and the ``measured``
    table holds at exactly these shapes)."""
    cases = []
    widths = [(t, 768) for t in _TOKENS] + [(t, 384) for t in (2048, 8192)] + [(t, 1024) for t in (512, 4096)]
    for tokens, hidden in widths:
        x = (tokens // 128, 128, hidden)
        h = (hidden,)
        eps = (("epsilon", 1e-12),)
        # alone, and passing on the sum (output 3) as the residual stream, as ORT's fusions leave them
        for outputs, tag in ((None, "fused"), (((x, True), None, None, (x, True)), "fused-sum")):
            cases.append(_ms("SkipLayerNormalization", [x, x, h, h, h], weights=(2, 3, 4), attrs=eps,
                             outputs=outputs, tag=tag))
            cases.append(_ms("SkipSimplifiedLayerNormalization", [x, x, h], weights=(2,), attrs=eps,
                             outputs=outputs, tag=tag))
        wide = (tokens // 128, 128, 4 * hidden)
        cases.append(_ms("BiasGelu", [wide, (4 * hidden,)], weights=(1,)))
        cases.append(_ms("FastGelu", [wide, (4 * hidden,)], weights=(1,)))
        cases.append(_ms("Gelu", [wide]))
        cases.append(_ms("QuickGelu", [wide], attrs=(("alpha", 1.702),)))
        cases.append(_ms("FusedMatMul", [x, (hidden, hidden)], weights=(1,), attrs=(("alpha", 1.0),),
                         outputs=((x, True),)))
    for batch, seq in _ATTENTION_BS:
        for hidden, heads in ((768, 12), (384, 12), (1024, 16)):
            if hidden != 768 and (batch, seq) not in ((32, 128), (64, 128), (8, 256)):
                continue
            x, dim = (batch, seq, hidden), hidden // heads
            bert = _ms("Attention", [x, (hidden, 3 * hidden), (3 * hidden,), (batch,)], weights=(1, 2),
                       attrs=(("num_heads", heads),), ints=((3, seq),), outputs=((x, True),))
            gpt2 = _ms("Attention", [x, (hidden, 3 * hidden), (3 * hidden,)], weights=(1, 2),
                       attrs=(("num_heads", heads), ("unidirectional", 1)), outputs=((x, True),), tag="fused-causal")
            mha = _ms("MultiHeadAttention", [x, x, x], attrs=(("num_heads", heads),), outputs=((x, True),))
            scores = (batch, heads, seq, seq)
            qk = _ms("FusedMatMul", [(batch, heads, seq, dim), (batch, heads, seq, dim)],
                     attrs=(("alpha", dim ** -0.5), ("transB", 1)), outputs=((scores, True),))
            cases += [bert, gpt2, mha, qk]
        # BERT-base's embeddings: word, position and segment tables of width 768
        cases.append(_ms("EmbedLayerNormalization",
                         [(batch, seq), (batch, seq), (30522, 768), (512, 768), (2, 768), (768,), (768,)],
                         weights=(2, 3, 4, 5, 6), attrs=(("epsilon", 1e-12),), ints=((0, 1), (1, 0)),
                         outputs=(((batch, seq, 768), True), ((batch,), False))))
    return cases


def default_grid(seed: int = 0) -> list[Case]:
    """Every case the database is fitted on (deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    for m, k, n in dict.fromkeys(_GEMM_MNK + _random_gemms(rng, 240)):
        cases.append(Case("MatMul", ((m, k), (k, n)), weights=(1,)))
    for m, k, n in _random_gemms(rng, 60) + [(4096, 768, 768), (64, 2048, 1001)]:
        cases.append(Case("Gemm", ((m, k), (n, k), (n,)), (("transB", 1),), weights=(1, 2)))
    for batch, heads, seq, dim in [(32, 12, 128, 64), (8, 12, 256, 64), (8, 12, 256, 256), (4, 16, 512, 64)]:
        cases.append(Case("MatMul", ((batch, heads, seq, dim), (batch, heads, dim, seq)), tag="attention"))
    cases += _conv_cases(rng)
    for elements in _elementwise_sizes():
        shape = _shape_of(elements)
        for op in ("Add", "Mul", "Sub", "Div"):
            cases.append(Case(op, (shape, shape)))
        for op in ("Relu", "Sigmoid", "Tanh", "Erf", "Sqrt"):
            cases.append(Case(op, (shape,)))
        cases.append(Case("Softmax", (shape,), (("axis", -1),)))
        cases.append(Case("ReduceMean", (shape,), (("axes", (-1,)), ("keepdims", 1))))
        cases.append(Case("LayerNormalization", (shape, (shape[-1],), (shape[-1],)), (("axis", -1),), weights=(1, 2)))
        cases.append(Case("Transpose", ((shape[0], 12, 64),), (("perm", (1, 0, 2)),)))
        cases.append(Case("Cast", ((elements,),), tag="to_fp16"))
        cases.append(Case("Cast", ((elements,),), tag="to_fp32"))
        cases.append(Case("Pad", ((max(1, elements // 1001), 1001),), tag="pad_to_1008"))
        cases.append(Case("Slice", ((max(1, elements // 1008), 1008),), tag="slice_to_1001"))
    cases += fused_cases()
    known = {c.key for c in cases}
    cases += [c for c in harvested_cases() if c.key not in known]
    return cases


# --- building one-node models ------------------------------------------------------------------

def _np_dtype(precision: str):
    return np.float16 if precision == "fp16" else np.float32


def _onnx_dtype(precision: str) -> int:
    return TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT


_RANDOM = np.zeros(0, np.float32)


def _values(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Positive values in [0.05, 0.15) (valid for Sqrt, no denormals), sliced from one random
    buffer: drawing 1e8 fresh normals per model took most of a run's time."""
    global _RANDOM
    count = math.prod(shape)
    if _RANDOM.size < count:
        _RANDOM = (np.random.default_rng(0).random(max(count, 1 << 20), dtype=np.float32) * 0.1 + 0.05)
    return _RANDOM[:count].astype(dtype).reshape(shape)


def build_model(case: Case, precision: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The one-node model of ``case`` in ``precision`` and feeds for its graph inputs.

    Cast cases: ``precision`` is the source type ("fp32" for to_fp16). Pad/Slice run in fp16
    (the padding pass pads fp16 tensors).
    """
    elem = _onnx_dtype(precision)
    np_dtype = _np_dtype(precision)
    inputs, initializers, feeds, names = [], [], {}, []
    int_values = dict(case.int_inputs)
    for index, shape in enumerate(case.input_shapes):
        name = f"in{index}"
        names.append(name)
        if index in int_values:
            data = np.full(shape, int_values[index], np.int32)
            if index in case.weights:
                initializers.append(numpy_helper.from_array(data, name))
            else:
                inputs.append(helper.make_tensor_value_info(name, TensorProto.INT32, list(shape)))
                feeds[name] = data
            continue
        data = _values(shape, np_dtype)
        if index in case.weights:
            initializers.append(numpy_helper.from_array(data, name))
        else:
            inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
            feeds[name] = data
    attrs = dict(case.attrs)
    out_elem = elem
    if case.op_type == "Cast":
        out_elem = TensorProto.FLOAT16 if case.tag == "to_fp16" else TensorProto.FLOAT
        attrs["to"] = out_elem
    if case.op_type == "Pad":
        rows, cols = case.input_shapes[0]
        pads = numpy_helper.from_array(np.array([0, 0, 0, 1008 - cols], np.int64), "pads")
        initializers.append(pads)
        names.append("pads")
    if case.op_type == "Slice":
        for name, value in (("starts", 0), ("ends", 1001), ("axes", 1)):
            initializers.append(numpy_helper.from_array(np.array([value], np.int64), name))
            names.append(name)
    if case.op_type == "ReduceMean" and "axes" in attrs:  # opset 17: axes is an attribute
        pass
    if case.outputs:  # a schema ONNX shape inference does not know: the case declares its outputs
        outs = [("out" if i == 0 else f"out{i}") if o is not None else "" for i, o in enumerate(case.outputs)]
        node = helper.make_node(case.op_type, names, outs, name="op", domain=case.domain or None, **attrs)
        values = [helper.make_tensor_value_info(name, elem if o[1] else TensorProto.INT32, list(o[0]))
                  for name, o in zip(outs, case.outputs) if o is not None]
        graph = helper.make_graph([node], case.op_type, inputs, values, initializers)
        opsets = [helper.make_opsetid("", _OPSET)] + ([helper.make_opsetid(case.domain, 1)] if case.domain else [])
        return helper.make_model(graph, opset_imports=opsets, ir_version=_IR), feeds
    node = helper.make_node(case.op_type, names, ["out"], name="op", **attrs)
    graph = helper.make_graph([node], case.op_type, inputs,
                              [helper.make_tensor_value_info("out", out_elem, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR)
    # Output shape from inference on a copy whose weights are typed inputs (no data to serialize).
    typing = helper.make_graph([node], case.op_type, [*inputs, *(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers if t.dims or t.data_type != TensorProto.INT64
    )], [helper.make_tensor_value_info("out", out_elem, None)],
        [t for t in initializers if t.data_type == TensorProto.INT64])
    inferred = onnx.shape_inference.infer_shapes(
        helper.make_model(typing, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR),
        strict_mode=True, data_prop=True)
    del model.graph.output[:]
    model.graph.output.extend(inferred.graph.output)
    return model, feeds


def output_shapes(model: onnx.ModelProto) -> list[list[int]]:
    return [[d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output]


def precisions_of(case: Case) -> list[tuple[str, bool]]:
    """(precision, tf32) pairs to measure for a case."""
    if case.op_type == "Cast":
        return [("fp32" if case.tag == "to_fp16" else "fp16", True)]
    if case.op_type in ("Pad", "Slice"):
        return [("fp16", True)]
    pairs = [("fp32", True), ("fp16", True)]
    if case.op_type in ("MatMul", "Gemm", "Conv"):
        pairs.append(("fp32", False))
    return pairs


def sample_key(case: Case, precision: str, tf32: bool) -> str:
    return f"{case.key}|{precision}|tf32={int(tf32)}"


# --- timing ------------------------------------------------------------------------------------

class Timer:
    """Sessions on one provider (:func:`onnxcampo.runtime.make_session`); times a model's runs
    through IO binding (:class:`onnxcampo.runtime.timing.BoundRunner`)."""

    def __init__(self, provider: str, *, warmup: int = 5, runs: int = 30, min_seconds: float = 0.05) -> None:
        from onnxcampo import runtime

        self.provider = provider
        self.warmup, self.runs, self.min_seconds = warmup, runs, min_seconds
        if provider == "cuda":
            runtime.preload_cuda_dlls()  # before torch's profiler (the kernel clock) loads its CUDA libraries
        self.kernel_clock = _cupti_clock() if provider == "cuda" else None
        self.baseline_us = self._empty_model_us()

    def time_us(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, tf32: bool = True) -> dict[str, float]:
        from onnxcampo.runtime import make_session
        from onnxcampo.runtime.timing import BoundRunner

        session = make_session(model, provider=self.provider, tf32=tf32, log_severity=3)
        runner = BoundRunner(session, feeds, self.provider)
        runner()  # allocates the outputs, bound from then on
        for _ in range(self.warmup):
            runner()
        times = []
        start = time.perf_counter()
        while len(times) < self.runs or (time.perf_counter() - start < self.min_seconds and len(times) < 20 * self.runs):
            times.append(runner() * 1e6)
        array = np.array(times)
        result = {"wall_us": float(np.median(array)), "p10_us": float(np.percentile(array, 10)),
                  "p90_us": float(np.percentile(array, 90)), "runs": len(times)}
        if self.kernel_clock is not None:
            result.update(self.kernel_clock(runner))
        return result

    def _empty_model_us(self) -> float:
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name="op")], "empty",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR)
        return self.time_us(model, {"x": np.zeros(1, np.float32)})["wall_us"]


def _cupti_clock(runs: int = 10):
    """GPU kernel time per run, seen by CUPTI through ``torch.profiler`` (it sees every kernel
    in the process, ONNX Runtime's included), or None without torch. Wall time minus an empty
    model's is too noisy for kernels of a few microseconds; kernel time is what differs between
    fp16 and fp32 in a GPU-bound graph."""
    try:
        import tempfile

        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None

    def clock(run_once) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(runs):
                    run_once()
            prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text()).get("traceEvents", [])
        gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
        kernels = sum(1 for e in gpu if e.get("cat") == "kernel")
        return {"kernel_us": sum(float(e["dur"]) for e in gpu) / runs, "kernels": kernels / runs}

    return clock


# --- the run -----------------------------------------------------------------------------------

def _done_keys(path: Path) -> set[str]:
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        if line.strip():
            keys.add(json.loads(line)["key"])
    return keys


def _device_facts(provider: str) -> dict[str, str]:
    import onnxruntime as ort

    facts = {"device": "cpu", "compute_capability": "", "ort_version": ort.__version__, "cuda_version": "",
             "date": dt.date.today().isoformat(), "provider": provider}
    if provider == "cuda":
        try:
            import subprocess

            out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
            name, capability = (part.strip() for part in out.split(","))
            facts.update(device=name, compute_capability=capability)
        except Exception:  # noqa: BLE001 - facts are best effort
            facts["device"] = "unknown GPU"
        facts["cuda_version"] = os.environ.get("CUDA_VERSION", "")
    return facts


def iter_samples(cases: list[Case], timer: Timer, facts: dict, done: set[str]) -> Iterator[dict]:
    for case in cases:
        for precision, tf32 in precisions_of(case):
            key = sample_key(case, precision, tf32)
            if key in done:
                continue
            model, feeds = build_model(case, precision)
            try:
                timing = timer.time_us(model, feeds, tf32=tf32)
            except Exception as exc:  # noqa: BLE001 - an op ORT cannot run here: record, go on
                log.warning("%s: %s", key, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                yield {"key": key, "case": case.key, "op_type": case.op_type, "precision": precision,
                       "error": f"{type(exc).__name__}: {exc}"[:500], **facts}
                continue
            elements = math.prod(case.input_shapes[0]) if case.op_type in ("Cast",) else None
            sample = {
                "key": key, "case": case.key, "op_type": case.op_type, "domain": case.domain,
                "attrs": {k: list(v) if isinstance(v, tuple) else v for k, v in case.attrs},
                "input_shapes": [list(s) for s in case.input_shapes],
                "output_shapes": output_shapes(model),
                "float_inputs": [i not in dict(case.int_inputs) for i in range(len(case.input_shapes))],
                "float_outputs": [o[1] for o in case.outputs if o is not None] if case.outputs else [True],
                "weights": list(case.weights),
                "precision": case.tag if case.op_type == "Cast" else precision, "tf32": tf32,
                "padded": case.op_type in ("Pad", "Slice"),
                # GPU kernel time when CUPTI sees it, else wall time minus the empty model's.
                "time_us": timing.get("kernel_us", timing["wall_us"] - timer.baseline_us),
                "wall_time_us": timing["wall_us"] - timer.baseline_us, "baseline_us": timer.baseline_us, **timing,
                **facts,
            }
            if case.op_type in ("Cast", "Pad", "Slice"):
                sample["elements"] = elements or math.prod(sample["output_shapes"][0])
            yield sample


def iter_chain_samples(cases: list[ChainCase], timer: Timer, facts: dict, done: set[str]) -> Iterator[dict]:
    """Each chain timed whole and node by node (see :mod:`onnxcampo.costdb.chains`)."""
    for case in cases:
        for precision in ("fp32", "fp16"):
            key = f"{case.key}|{precision}|tf32=1"
            if key in done:
                continue
            (model, feeds), parts = build_chain(case, precision, _values)
            try:
                whole = timer.time_us(model, feeds)
                part_times = [timer.time_us(m, f) for _, m, f in parts]
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                yield {"key": key, "case": case.key, "op_type": "chain", "chain": case.pattern,
                       "precision": precision, "error": f"{type(exc).__name__}: {exc}"[:500], **facts}
                continue

            def kernel(t: dict) -> float:
                return t.get("kernel_us", t["wall_us"] - timer.baseline_us)

            yield {"key": key, "case": case.key, "op_type": "chain", "chain": case.pattern, "dims": list(case.dims),
                   "precision": precision, "tf32": True, "time_us": kernel(whole),
                   "parts_us": [kernel(t) for t in part_times], "part_ops": [op for op, _, _ in parts],
                   "wall_time_us": whole["wall_us"] - timer.baseline_us, "kernels": whole.get("kernels"),
                   "part_kernels": [t.get("kernels") for t in part_times], **facts}


def measure(out: Path, *, provider: str = "cuda", budget_s: float = 540.0, seed: int = 0,
            limit: int | None = None, cases: list[Case] | None = None,
            chains: list[ChainCase] | None = None) -> int:
    """Append samples to ``out`` until the grid (single ops, then chains) is done or
    ``budget_s`` is spent; returns the number of new samples. Progress goes to stderr."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = cases if cases is not None else default_grid(seed)
    chains = chains if chains is not None else chain_cases()
    done = _done_keys(out)
    todo = sum(1 for c in cases for p, t in precisions_of(c) if sample_key(c, p, t) not in done)
    todo += sum(1 for c in chains for p in ("fp32", "fp16") if f"{c.key}|{p}|tf32=1" not in done)
    if limit is not None:
        todo = min(todo, limit)
    timer = Timer(provider)
    facts = _device_facts(provider)
    start = time.perf_counter()
    count = 0
    with out.open("a") as sink:
        samples = itertools.chain(iter_samples(cases, timer, facts, done),
                                  iter_chain_samples(chains, timer, facts, done))
        for sample in samples:
            sink.write(json.dumps(sample) + "\n")
            sink.flush()
            count += 1
            elapsed = time.perf_counter() - start
            if count % 20 == 0 or count == todo:
                eta = elapsed / count * (todo - count)
                print(f"\rmeasured {count}/{todo} samples, {elapsed:.0f} s, about {eta:.0f} s left   ",
                      end="", file=sys.stderr, flush=True)
            if count >= todo or elapsed > budget_s:
                break
    print(file=sys.stderr)
    left = todo - count
    log.warning("measured %d samples on %s (%s); %d left in the grid%s", count, facts["device"], provider, left,
                ": run again to resume" if left else "")
    return count
