"""Check ``ai.onnxcampo::FusedElementwise`` on an execution provider against the numpy reference
(``onnxcampo/ops/elementwise.py``'s ``run``), then time it against the equivalent unfused ONNX
chains. Run from the repository root on the GPU machine, after building the library with CUDA:

    python3 -m onnxcampo.ops.build && python3 scripts/check_fused_elementwise_cuda.py --out r.json
    ONNXCAMPO_OPS_LIBRARY=/path/libonnxcampo_ops.so python3 scripts/check_fused_elementwise_cuda.py --out r.json

Needs only onnxruntime(-gpu) and numpy (no onnx, no scipy, no onnxcampo install): the models are
written as protobuf bytes here and the reference is loaded from its file. Prints the largest ulp
error of every output of every case, writes everything as JSON to ``--out``, and exits 1 when a
case is off by more than its tolerance (or fails to run). ``--provider cpu`` runs the same cases
on the CPU kernel (tests/ops/test_fused_elementwise.py does that too).

On CUDA every case runs on each kernel of ``--kernels`` (default both: the generated kernel,
NVRTC-compiled per program, which is the library's default, and the interpreter, its fallback),
and the run fails when a generated kernel fell back to the interpreter.

Timing (``--timing``, default on for cuda): a ReLU backward with the column sums of its output
(``column_sums``) against the same node and a ``BlockReduceSum`` (ResNet-50's and BERT's bias
gradient shapes); each benchmark's fused node (each kernel) against its unfused ONNX
chain (Casts at the edges where a mixed-precision graph has them), inputs and pre-allocated
outputs bound on the device (IO binding), the variants interleaved in rounds in one process;
median ms per run. The outputs of fused and unfused are compared too (max ulp; erf/exp come from
different math code, so a few ulp are expected there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
DOMAIN = "ai.onnxcampo"
FLOAT, FLOAT16 = 1, 10
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}


def _load(name: str, relative: str):
    """A module of this repository by its path (onnxcampo need not be installed)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ew = _load("_fused_elementwise_reference", "onnxcampo/ops/elementwise.py")
block_reduce = _load("_block_reduce_reference", "onnxcampo/ops/reduce.py")  # what column sums compute
jit = _load("_fused_elementwise_jit", "onnxcampo/ops/jit.py")  # NVRTC for the generated kernels
standalone = _load("_onnxcampo_standalone_sessions", "onnxcampo/runtime/standalone.py")  # the runtime door
Op = ew.Op


def library_path() -> str:
    path = os.environ.get("ONNXCAMPO_OPS_LIBRARY") or str(ROOT / "onnxcampo/ops/lib/libonnxcampo_ops.so")
    if not Path(path).is_file():
        raise SystemExit(f"no custom-op library at {path}: run `python3 -m onnxcampo.ops.build` or set ONNXCAMPO_OPS_LIBRARY")
    return path


# ---- a minimal ONNX protobuf writer (ModelProto, GraphProto, NodeProto, ValueInfoProto) --------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _int(number: int, value: int) -> bytes:
    return _key(number, 0) + _varint(value)


def _bytes(number: int, payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode()
    return _key(number, 2) + _varint(len(payload)) + payload


def attribute(name: str, value) -> bytes:
    """AttributeProto: int (INT=2), float (FLOAT=1), list of ints (INTS=7) or floats (FLOATS=6)."""
    body = _bytes(1, name)
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, (int, np.integer)) for v in value):
            body += _bytes(8, b"".join(_varint(int(v)) for v in value)) + _int(20, 7)
        else:
            body += _bytes(7, struct.pack(f"<{len(value)}f", *[float(v) for v in value])) + _int(20, 6)
    elif isinstance(value, (int, np.integer)):
        body += _int(3, int(value)) + _int(20, 2)
    else:
        body += _key(2, 5) + struct.pack("<f", float(value)) + _int(20, 1)
    return body


def node(op_type: str, inputs, outputs, *, name: str = "", domain: str = "", **attributes) -> bytes:
    body = b"".join(_bytes(1, i) for i in inputs) + b"".join(_bytes(2, o) for o in outputs)
    body += _bytes(3, name) + _bytes(4, op_type) + (_bytes(7, domain) if domain else b"")
    return body + b"".join(_bytes(5, attribute(k, v)) for k, v in attributes.items())


def value_info(name: str, elem_type: int | None, shape=None) -> bytes:
    """ValueInfoProto; elem_type None: name only; shape None: no shape; dims int or str."""
    if elem_type is None:
        return _bytes(1, name)
    tensor = _int(1, elem_type)
    if shape is not None:
        dims = b"".join(_bytes(1, _int(1, d) if isinstance(d, (int, np.integer)) else _bytes(2, d)) for d in shape)
        tensor += _bytes(2, dims)
    return _bytes(1, name) + _bytes(2, _bytes(1, tensor))


def model(nodes, inputs, outputs, value_infos=(), opsets=(("", 17), (DOMAIN, 1)), ir_version: int = 10) -> bytes:
    graph = b"".join(_bytes(1, n) for n in nodes) + _bytes(2, "g")
    graph += b"".join(_bytes(11, v) for v in inputs) + b"".join(_bytes(12, v) for v in outputs)
    graph += b"".join(_bytes(13, v) for v in value_infos)
    opset_bytes = b"".join(_bytes(8, _bytes(1, d) + _int(2, v)) for d, v in opsets)
    return _int(1, ir_version) + opset_bytes + _bytes(7, graph)


def fused_node(program, registers, constants, output_types, inputs, outputs, name="fused", sums=None) -> bytes:
    """``sums``: ``(output, columns, type)``, the node's column_sums (its last output)."""
    attributes = {"program": [int(v) for v in program], "registers": int(registers),
                  "output_types": [int(t) for t in output_types]}
    if len(constants):
        attributes["constants"] = [float(c) for c in constants]
    if sums is not None:
        attributes["column_sums"] = [int(sums[0]), int(sums[1])]
        attributes["column_sums_type"] = int(sums[2])
    return node("FusedElementwise", inputs, outputs, name=name, domain=DOMAIN, **attributes)


def elem_type(array: np.ndarray) -> int:
    return {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16}[array.dtype]


# ---- the cases -------------------------------------------------------------------------------


@dataclass
class Case:
    """A program, its inputs, and the largest error allowed per output: ``ulp`` (in the
    output's own type) by provider, or, for outputs whose error the program amplifies
    (cancellation after erf), an absolute error ``atol`` times max(1, |reference|). ``sums``:
    ``(output, columns, type)``, the node's column sums (one more output, last), within the
    float32 bound of a sum in any order (:func:`sum_bound`)."""

    name: str
    program: list[int]
    registers: int
    constants: list[float]
    output_types: list[int]
    inputs: list[np.ndarray]
    ulp: dict[str, int] = field(default_factory=lambda: {"cpu": 0, "cuda": 0})
    atol: float = 0.0
    sums: tuple[int, int, int] | None = None

    def reference(self) -> list[np.ndarray]:
        outputs = ew.run(self.program, self.registers, self.constants, self.output_types, self.inputs)
        if self.sums is not None:
            k, q, sum_type = self.sums
            outputs.append(block_reduce.reference(outputs[k], [outputs[k].size // q, q, 1], sum_type))
        return outputs

    def model(self, declare: bool = True) -> bytes:
        names = [f"x{k}" for k in range(len(self.inputs))]
        outs = [f"y{k}" for k in range(len(self.output_types))]
        types, shape = list(self.output_types), list(np.broadcast_shapes(*(a.shape for a in self.inputs)))
        shapes = [shape] * len(outs)
        if self.sums is not None:
            outs.append("sums")
            types.append(self.sums[2])
            shapes.append([self.sums[1]])
        fused = fused_node(self.program, self.registers, self.constants, self.output_types, names, outs,
                           sums=self.sums)
        ins = [value_info(n, elem_type(a), list(a.shape)) for n, a in zip(names, self.inputs)]
        outputs = [value_info(o, t, d) if declare else value_info(o, None) for o, t, d in zip(outs, types, shapes)]
        return model([fused], ins, outputs)

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"x{k}": a for k, a in enumerate(self.inputs)}


def _program(*rows) -> list[int]:
    return [int(v) for row in rows for v in row]


SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 6e-8, 65504.0, 65520.0, 1e30, -1e30, 1.0,
                    -1.0, 0.5, 3.0, -2.0, 2.0 ** -14, 2.0 ** -24, 2.0 ** -25], np.float64)

COMPARE_OPS = [Op.GREATER, Op.LESS, Op.GREATER_EQUAL, Op.LESS_EQUAL, Op.EQUAL]
BINARY_OPS = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAX, Op.MIN, *COMPARE_OPS]
UNARY_OPS = [Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.RECIP, Op.TANH, Op.ERF, Op.SIGMOID, Op.RELU, Op.ROUND_F16,
             Op.COPY]
# Largest fp32 ulp error of one operation: glibc on the CPU, CUDA's documented bounds on the GPU
# (CUDA C Programming Guide, mathematical functions without --use_fast_math); SIGMOID is expf
# then an add and a divide, so one more.
TRANSCENDENTAL = {Op.EXP: (2, 2), Op.LOG: (2, 1), Op.TANH: (2, 2), Op.ERF: (2, 2), Op.SIGMOID: (2, 3),
                  Op.POW: (2, 4)}


def _values(rng, op: Op, n: int, second: bool = False) -> np.ndarray:
    x = rng.standard_normal(n) * 4
    if op is Op.POW:
        x = rng.uniform(-3, 3, n) if second else np.abs(x)
        if second:
            x[: n // 4] = np.round(x[: n // 4])  # integer exponents (negative bases give numbers)
        else:
            x[: n // 8] *= -1
    elif op in (Op.EXP, Op.SIGMOID):
        x = rng.uniform(-100, 100, n)
    elif op in (Op.LOG, Op.SQRT):
        x = np.exp(rng.uniform(-80, 80, n))
    x[: len(SPECIAL)] = SPECIAL if not second else SPECIAL[::-1]
    return x


def opcode_cases(n: int = 4099, seed: int = 0) -> list[Case]:
    """Every opcode on float32 and float16 inputs, stored as float32 and float16 (STORE's
    rounding), special values included; LOAD, CONST and STORE in every program."""
    rng = np.random.default_rng(seed)
    cases = []
    for op in BINARY_OPS + UNARY_OPS:
        with np.errstate(over="ignore"):  # beyond float16: inf, wanted
            a = _values(rng, op, n).astype(np.float32)
            b = _values(rng, op, n, second=True).astype(np.float16)
        if op in COMPARE_OPS:  # a third of the pairs equal (values float16 holds), the constant too
            a[len(SPECIAL)::3] = a[len(SPECIAL)::3].astype(np.float16)
            b[len(SPECIAL)::3] = a[len(SPECIAL)::3]
            a[-1] = 0.75
        cpu, cuda = TRANSCENDENTAL.get(op, (0, 0))
        if op in BINARY_OPS:
            program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (op, 2, 0, 1), (op, 3, 1, 0), (Op.CONST, 4, 0, 0),
                               (op, 5, 0, 4), (Op.STORE, 0, 2, 0), (Op.STORE, 1, 2, 0), (Op.STORE, 2, 3, 0),
                               (Op.STORE, 3, 5, 0))
        else:
            program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (op, 2, 0, 0), (op, 3, 1, 0), (Op.CONST, 4, 0, 0),
                               (op, 5, 4, 0), (Op.STORE, 0, 2, 0), (Op.STORE, 1, 2, 0), (Op.STORE, 2, 3, 0),
                               (Op.STORE, 3, 5, 0))
        # outputs: op(a) as fp32 and fp16, op on the fp16 input (fp32), op with a constant (fp16)
        cases.append(Case(f"op_{op.name}", program, 6, [0.75], [FLOAT, FLOAT16, FLOAT, FLOAT16], [a, b],
                          ulp={"cpu": cpu, "cuda": cuda, "fp16": 1 if cpu else 0}))
    return cases


def broadcast_cases(seed: int = 1) -> list[Case]:
    """Exact float32 arithmetic over broadcast shapes: the results must equal the reference."""
    rng = np.random.default_rng(seed)

    def r(shape, dtype):
        return np.asarray(rng.standard_normal(shape) * 3).astype(dtype)

    chain = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.ADD, 2, 0, 1), (Op.RELU, 3, 2, 0),
                     (Op.MUL, 4, 2, 1), (Op.STORE, 0, 3, 0), (Op.STORE, 1, 4, 0))
    cases = [
        Case("bias_C", chain, 5, [], [FLOAT16, FLOAT], [r((96, 384), np.float16), r((384,), np.float32)]),
        Case("scalar", chain, 5, [], [FLOAT, FLOAT16], [r((7, 9, 11), np.float32), r((), np.float16)]),
        Case("N1W_vs_NCW", chain, 5, [], [FLOAT16, FLOAT16], [r((4, 6, 50), np.float16), r((4, 1, 50), np.float32)]),
        Case("NCW_vs_N1W_first_small", chain, 5, [], [FLOAT, FLOAT16], [r((4, 1, 50), np.float32), r((4, 6, 50), np.float16)]),
        Case("outer_product", chain, 5, [], [FLOAT, FLOAT], [r((33, 1), np.float32), r((1, 47), np.float16)]),
        Case("large_strided", chain, 5, [], [FLOAT16, FLOAT], [r((3, 5, 70001), np.float16), r((5, 1), np.float32)]),
        Case("zero_size", chain, 5, [], [FLOAT16, FLOAT], [r((0, 3), np.float16), r((3,), np.float32)]),
        Case("zero_size_broadcast", chain, 5, [], [FLOAT, FLOAT16], [r((2, 0), np.float32), r((1,), np.float16)]),
    ]
    rank5 = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.LOAD, 2, 2, 0), (Op.LOAD, 3, 3, 0),
                     (Op.MUL, 4, 0, 1), (Op.SUB, 4, 4, 2), (Op.DIV, 5, 4, 3), (Op.ROUND_F16, 6, 5, 0),
                     (Op.STORE, 0, 5, 0), (Op.STORE, 1, 6, 0), (Op.STORE, 2, 4, 0))
    cases.append(Case("rank5", rank5, 7, [], [FLOAT, FLOAT, FLOAT16],
                      [r((2, 1, 3, 1, 5), np.float32), r((1, 4, 1, 6, 1), np.float16), r((5,), np.float32),
                       (np.abs(r((1,), np.float32)) + 0.5).astype(np.float32)]))
    return cases


def rounding_cases() -> list[Case]:
    """float16 rounding where the unfused graph rounds: ROUND_F16 between float32 operations,
    and the conversions themselves over every float16 value, the midpoints between neighbours
    (ties to even), their float32 neighbours, subnormals and the overflow threshold."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(halves[np.isfinite(halves)].astype(np.float64))
    finite = np.unique(finite)
    mid = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
    near = np.concatenate([mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf)),
                           np.array([65519.996, 65520.0, 65520.004, 1e-8, -1e-8, 2.0 ** -25, 2.0 ** -26 * 3, 7e4,
                                     np.inf, -np.inf, np.nan], np.float32)]).astype(np.float32)
    convert = _program((Op.LOAD, 0, 0, 0), (Op.ROUND_F16, 1, 0, 0), (Op.STORE, 0, 0, 0), (Op.STORE, 1, 1, 0))
    program = _program((Op.LOAD, 0, 0, 0), (Op.ROUND_F16, 1, 0, 0), (Op.CONST, 2, 0, 0), (Op.MUL, 3, 1, 2),
                       (Op.MUL, 4, 0, 2), (Op.STORE, 0, 3, 0), (Op.STORE, 1, 4, 0))
    return [
        Case("f32_to_f16_ties", convert, 2, [], [FLOAT16, FLOAT], [near]),
        Case("every_f16_value", convert, 2, [], [FLOAT, FLOAT16], [halves.copy()]),
        Case("round_f16_visible", program, 5, [2.0], [FLOAT, FLOAT],
             [np.array([1 + 2.0 ** -12, 3.0, 1 + 2.0 ** -11 + 2.0 ** -12, 65519.0], np.float32)]),
    ]


SQRT1_2 = math.sqrt(2.0)


def gelu_program() -> tuple[list[int], list[float]]:
    """Cast(x + b -> fp32) then x * 0.5 * (1 + erf(x / sqrt(2))) in float32, Cast to fp16 (in the
    unfused graph's operation order: Div, Erf, Add, Mul, Mul)."""
    program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.ADD, 0, 0, 1), (Op.ROUND_F16, 0, 0, 0),
                       (Op.CONST, 1, 0, 0), (Op.DIV, 2, 0, 1), (Op.ERF, 2, 2, 0), (Op.CONST, 3, 1, 0),
                       (Op.ADD, 2, 2, 3), (Op.MUL, 2, 0, 2), (Op.CONST, 3, 2, 0), (Op.MUL, 2, 2, 3),
                       (Op.STORE, 0, 2, 0))
    return program, [SQRT1_2, 1.0, 0.5]


def layernorm_backward_program() -> tuple[list[int], list[float]]:
    """dx = rstd * (dy*gamma - mean1 - xhat * mean2) (fp16 out) and dy * xhat (fp32, for dgamma):
    inputs dy fp16 [N, C], gamma fp32 [C], xhat fp32 [N, C], rstd, mean1, mean2 fp32 [N, 1]."""
    program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.MUL, 2, 0, 1), (Op.LOAD, 3, 3, 0),
                       (Op.LOAD, 4, 4, 0), (Op.SUB, 2, 2, 4), (Op.LOAD, 5, 2, 0), (Op.LOAD, 4, 5, 0),
                       (Op.MUL, 6, 5, 4), (Op.SUB, 2, 2, 6), (Op.MUL, 2, 3, 2), (Op.STORE, 0, 2, 0),
                       (Op.MUL, 7, 0, 5), (Op.STORE, 1, 7, 0))
    return program, []


def cast_mul_program() -> tuple[list[int], list[float]]:
    """Cast(x fp32 -> fp16) * s (fp16 Mul: one rounding of the exact product)."""
    return _program((Op.LOAD, 0, 0, 0), (Op.ROUND_F16, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.MUL, 2, 0, 1),
                    (Op.STORE, 0, 2, 0)), []


def chain_inputs(kind: str, rows: int, cols: int, seed: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "gelu":
        return [(rng.standard_normal((rows, cols)) * 2).astype(np.float16), (rng.standard_normal(cols) * 0.1).astype(np.float16)]
    if kind == "layernorm_backward":
        return [rng.standard_normal((rows, cols)).astype(np.float16), rng.standard_normal(cols).astype(np.float32),
                rng.standard_normal((rows, cols)).astype(np.float32), rng.uniform(0.5, 2, (rows, 1)).astype(np.float32),
                rng.standard_normal((rows, 1)).astype(np.float32) * 0.1, rng.standard_normal((rows, 1)).astype(np.float32) * 0.1]
    return [(rng.standard_normal((rows, cols)) * 100).astype(np.float32), rng.uniform(0.5, 2, cols).astype(np.float16)]


def chain_cases() -> list[Case]:
    program, constants = gelu_program()
    gelu = Case("gelu_erf", program, 4, constants, [FLOAT16], chain_inputs("gelu", 64, 384),
                ulp={"cpu": 1, "cuda": 1}, atol=2.0 ** -20)
    program, constants = layernorm_backward_program()
    ln = Case("layernorm_backward", program, 8, constants, [FLOAT16, FLOAT], chain_inputs("layernorm_backward", 64, 384))
    program, constants = cast_mul_program()
    cm = Case("cast_mul", program, 3, constants, [FLOAT16], chain_inputs("cast_mul", 64, 384))
    return [gelu, ln, cm]


def relu_backward_program() -> tuple[list[int], list[float]]:
    """dy * (x > 0): a ReLU's backward, what a bias gradient sums (stored float16 or float32)."""
    return _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.CONST, 2, 0, 0), (Op.GREATER, 3, 1, 2),
                    (Op.MUL, 4, 0, 3), (Op.STORE, 0, 4, 0), (Op.STORE, 1, 3, 0)), [0.0]


def column_sum_cases(seed: int = 3) -> list[Case]:
    """Column sums of a stored output (column_sums): columns that divide a block's span (the
    block adds its threads' sums), that a block's span divides, that do neither, that are no
    multiple of the lanes (the stored output summed after the kernel), float16 and float32
    outputs and sums, rows from a few to enough for every block of the device, and a
    non-finite value (NaN and inf stay in their columns)."""
    rng = np.random.default_rng(seed)
    program, constants = relu_backward_program()
    cases = []
    for rows, q, out_type, sum_type in [(8192, 64, FLOAT16, FLOAT), (4096, 256, FLOAT16, FLOAT16), (3136, 2048, FLOAT16, FLOAT),
                                        (4096, 768, FLOAT16, FLOAT), (300, 3072, FLOAT, FLOAT), (64, 64, FLOAT16, FLOAT),
                                        (50000, 6, FLOAT16, FLOAT), (3, 20, FLOAT, FLOAT16)]:
        dy = rng.standard_normal((rows, q)).astype(np.float16)
        x = rng.standard_normal((rows, q)).astype(np.float16)
        cases.append(Case(f"column_sums_{rows}x{q}_{'f16' if out_type == FLOAT16 else 'f32'}_to_"
                          f"{'f16' if sum_type == FLOAT16 else 'f32'}", program, 5, constants, [out_type, FLOAT16],
                          [dy, x], sums=(0, q, sum_type)))
    dy = rng.standard_normal((2048, 128)).astype(np.float16)
    dy[5, 7], dy[100, 9], dy[9, 9] = np.nan, np.inf, np.inf
    x = np.abs(rng.standard_normal((2048, 128))).astype(np.float16)
    cases.append(Case("column_sums_non_finite", program, 5, constants, [FLOAT16, FLOAT16], [dy, x],
                      sums=(0, 128, FLOAT)))
    return cases


def all_cases() -> list[Case]:
    return opcode_cases() + broadcast_cases() + rounding_cases() + chain_cases() + column_sum_cases()


# ---- comparing -------------------------------------------------------------------------------


def ulp_distance(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """|ordered bits difference| per element (float32 or float16); NaN vs NaN is 0, NaN vs a
    number 2^40."""
    bits, mask = (np.int32, 0x7FFFFFFF) if actual.dtype == np.float32 else (np.int16, 0x7FFF)
    a = actual.view(bits).astype(np.int64)
    e = expected.astype(actual.dtype).view(bits).astype(np.int64)
    a = np.where(a < 0, -(a & mask), a)
    e = np.where(e < 0, -(e & mask), e)
    distance = np.abs(a - e)
    nan_a, nan_e = np.isnan(actual), np.isnan(expected)
    distance = np.where(nan_a & nan_e, 0, distance)
    return np.where(nan_a ^ nan_e, 1 << 40, distance)


def sum_bound(summed: np.ndarray, columns: int, sum_type: int) -> np.ndarray:
    """Per column, how far a float32 sum of the column in any order may be from the exact one:
    (rows - 1) float32 unit roundoffs of the sum of magnitudes (and half a float16 ulp of the sum
    for float16 sums), plus a float32 ulp."""
    values = summed.reshape(-1, columns).astype(np.float64)
    magnitude = np.abs(values).sum(axis=0)
    bound = (values.shape[0] - 1) * 2.0 ** -24 * magnitude + np.spacing(np.float32(magnitude)).astype(np.float64)
    if sum_type == FLOAT16:
        bound += np.abs(values.sum(axis=0)) * 2.0 ** -11 + 2.0 ** -24
    return bound


def compare(case: Case, outputs: list[np.ndarray], provider: str) -> dict:
    expected = case.reference()
    report = {"case": case.name, "outputs": [], "ok": True}
    for k, (got, want) in enumerate(zip(outputs, expected)):
        entry = {"dtype": str(want.dtype), "shape": list(want.shape)}
        if got.dtype != want.dtype or got.shape != want.shape:
            entry.update(ok=False, error=f"got {got.dtype}{list(got.shape)}")
        elif case.sums is not None and k == len(case.output_types):
            exact = expected[case.sums[0]].reshape(-1, case.sums[1]).astype(np.float64).sum(axis=0)
            with np.errstate(invalid="ignore"):  # inf - inf: NaN, judged below
                error = np.abs(got.astype(np.float64) - exact)
                over = ~(error <= sum_bound(expected[case.sums[0]], case.sums[1], case.sums[2]))
            over &= ~(np.isnan(got) & np.isnan(exact)) & ~(np.isinf(got) & (got == exact))
            entry.update(ok=not over.any(), max_error=float(np.nanmax(np.where(np.isfinite(error), error, 0))),
                         bad=int(over.sum()))
        elif got.size == 0:
            entry.update(ok=True, max_ulp=0)
        else:
            distance = ulp_distance(got, want)
            limit = case.ulp.get("fp16", case.ulp[provider]) if want.dtype == np.float16 else case.ulp[provider]
            over = distance > limit
            if case.atol:
                with np.errstate(invalid="ignore"):
                    over &= ~(np.abs(got.astype(np.float64) - want) <= case.atol * np.maximum(1.0, np.abs(want.astype(np.float64))))
            entry.update(ok=not over.any(), max_ulp=int(distance.max()), limit_ulp=int(limit), bad=int(over.sum()))
            if over.any():
                i = int(np.flatnonzero(over.ravel())[0])
                entry["first_bad"] = {"index": i, "got": float(got.ravel()[i]), "want": float(want.ravel()[i]),
                                      "inputs": [float(x.ravel()[i % x.size]) if x.size else None for x in case.inputs]}
        report["outputs"].append(entry)
        report["ok"] = report["ok"] and entry["ok"]
    return report


# ---- sessions --------------------------------------------------------------------------------

PROVIDERS = standalone.PROVIDERS


# The CUDA kernels of FusedElementwise (the library reads $ONNXCAMPO_EW_KERNEL when a session
# creates the kernel, so sessions of each kind live side by side in this process).
KERNELS = ("generated", "interpreter")


def session(model_bytes: bytes, provider: str, threads: int | None = None,
            kernel: str = "generated") -> ort.InferenceSession:
    saved = os.environ.get(jit.KERNEL_ENV_VAR)
    os.environ[jit.KERNEL_ENV_VAR] = kernel
    try:
        return standalone.custom_op_session(model_bytes, library_path(), provider, intra_op_threads=threads)
    finally:
        if saved is None:
            os.environ.pop(jit.KERNEL_ENV_VAR, None)
        else:
            os.environ[jit.KERNEL_ENV_VAR] = saved


def run_case(case: Case, provider: str, threads: int | None = None, declare: bool = True,
             kernel: str = "generated") -> list[np.ndarray]:
    return session(case.model(declare), provider, threads, kernel).run(None, case.feeds())


def check(provider: str, kernels: tuple[str, ...] = ("generated",)) -> list[dict]:
    reports = []
    for kernel in kernels:
        for case in all_cases():
            try:
                report = compare(case, run_case(case, provider, kernel=kernel), provider)
            except Exception as exc:  # a case that does not run is a failure, the others still run
                report = {"case": case.name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if provider == "cuda":
                report["kernel"] = kernel
                report["case"] = f"{case.name}[{kernel}]"
            reports.append(report)
            ulps = ", ".join(f"{o['dtype']} {o.get('max_ulp', o.get('max_error', '-'))}" + ("" if o["ok"] else " FAIL")
                             for o in report.get("outputs", []))
            print(f"{'ok  ' if report['ok'] else 'FAIL'} {report['case']:40s} max ulp: {ulps or report.get('error')}",
                  flush=True)
    return reports


# ---- the unfused chains and timing -------------------------------------------------------------


def unfused_model(kind: str, inputs: list[np.ndarray]) -> bytes:
    """The standard-op chain a mixed-precision graph holds for each benchmark."""
    names = [f"x{k}" for k in range(len(inputs))]
    ins = [value_info(n, elem_type(a), list(a.shape)) for n, a in zip(names, inputs)]
    c = lambda name, value: node("Constant", [], [name], value_float=float(value))  # noqa: E731  (float32 scalar)
    if kind == "gelu":
        nodes = [node("Add", ["x0", "x1"], ["s"]), node("Cast", ["s"], ["h"], to=FLOAT), c("k", SQRT1_2),
                 node("Div", ["h", "k"], ["d"]), node("Erf", ["d"], ["e"]), c("one", 1.0), node("Add", ["e", "one"], ["p"]),
                 node("Mul", ["h", "p"], ["m"]), c("half", 0.5), node("Mul", ["m", "half"], ["g"]),
                 node("Cast", ["g"], ["y0"], to=FLOAT16)]
        outs = [value_info("y0", FLOAT16, list(inputs[0].shape))]
    elif kind == "layernorm_backward":
        nodes = [node("Cast", ["x0"], ["dy"], to=FLOAT), node("Mul", ["dy", "x1"], ["a"]), node("Sub", ["a", "x4"], ["b"]),
                 node("Mul", ["x2", "x5"], ["c"]), node("Sub", ["b", "c"], ["d"]), node("Mul", ["x3", "d"], ["dx"]),
                 node("Cast", ["dx"], ["y0"], to=FLOAT16), node("Mul", ["dy", "x2"], ["y1"])]
        outs = [value_info("y0", FLOAT16, list(inputs[0].shape)), value_info("y1", FLOAT, list(inputs[0].shape))]
    else:
        nodes = [node("Cast", ["x0"], ["h"], to=FLOAT16), node("Mul", ["h", "x1"], ["y0"])]
        outs = [value_info("y0", FLOAT16, list(inputs[0].shape))]
    return model(nodes, ins, outs, opsets=(("", 17),))


BENCHMARKS = {  # name: (kind, rows, cols, program builder, registers)
    "bert_bias_gelu_erf_4096x3072": ("gelu", 32 * 128, 3072, gelu_program, 4),
    "layernorm_backward_4096x768": ("layernorm_backward", 32 * 128, 768, layernorm_backward_program, 8),
    "cast_fp32_fp16_mul_4096x3072": ("cast_mul", 32 * 128, 3072, cast_mul_program, 3),
}


class Bound:
    """A session with its inputs and pre-allocated outputs bound on the device."""

    def __init__(self, model_bytes: bytes, inputs: list[np.ndarray], provider: str, kernel: str = "generated"):
        self.session = session(model_bytes, provider, kernel=kernel)
        device = "cuda" if provider == "cuda" else "cpu"
        self.binding = self.session.io_binding()
        self.inputs = [ort.OrtValue.ortvalue_from_numpy(a, device, 0) for a in inputs]
        for meta, value in zip(self.session.get_inputs(), self.inputs):
            self.binding.bind_ortvalue_input(meta.name, value)
        self.outputs = []
        for meta in self.session.get_outputs():
            dtype = np.float16 if meta.type == "tensor(float16)" else np.float32
            known = meta.shape and all(isinstance(d, int) for d in meta.shape)
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(meta.shape if known else inputs[0].shape), dtype,
                                                              device, 0)
            self.binding.bind_ortvalue_output(meta.name, value)
            self.outputs.append(value)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def sync(self) -> None:
        self.binding.synchronize_outputs()

    def results(self) -> list[np.ndarray]:
        self.sync()
        return [v.numpy() for v in self.outputs]


def interleaved(variants: dict[str, "Bound"], rounds: int, block: int) -> dict[str, list[float]]:
    """ms a run of each variant, a block of ``block`` runs each round, the variants in turn within
    a round (after 3 warm-up runs each): one list of ``rounds`` block means per variant."""
    for v in variants.values():
        for _ in range(3):
            v.run()
        v.sync()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for key, v in variants.items():
            v.sync()
            start = time.perf_counter()
            for _ in range(block):
                v.run()
            v.sync()  # waits for the device
            times[key].append((time.perf_counter() - start) * 1e3 / block)
    return times


def gpu_ms_per_run(bound: "Bound", runs: int = 10) -> dict | None:
    """The GPU kernel time of one run and its launches, as CUPTI sees them through torch's profiler
    (None without torch): the wall time of a run also holds the host's work per node."""
    bound.sync()
    return standalone.gpu_time_per_call(bound.run, runs)


def timing(provider: str, rounds: int, block: int, kernels: tuple[str, ...] = ("generated",)) -> list[dict]:
    results = []
    for name, (kind, rows, cols, build, registers) in BENCHMARKS.items():
        inputs = chain_inputs(kind, rows, cols)
        program, constants = build()
        types = [FLOAT16, FLOAT] if kind == "layernorm_backward" else [FLOAT16]
        names = [f"x{k}" for k in range(len(inputs))]
        outs = [f"y{k}" for k in range(len(types))]
        fused_bytes = model([fused_node(program, registers, constants, types, names, outs)],
                            [value_info(n, elem_type(a), list(a.shape)) for n, a in zip(names, inputs)],
                            [value_info(o, t, [rows, cols]) for o, t in zip(outs, types)])
        # "fused" is the default kernel (generated on CUDA), "fused-<kernel>" the others asked for
        variants = {("fused" if kernel == "generated" else f"fused-{kernel}"): Bound(fused_bytes, inputs, provider, kernel)
                    for kernel in (kernels if provider == "cuda" else ("generated",))}
        variants["unfused"] = Bound(unfused_model(kind, inputs), inputs, provider)
        times = interleaved(variants, rounds, block)
        fused_out, unfused_out = variants["fused"].results(), variants["unfused"].results()
        agreement = [int(ulp_distance(f, u).max()) for f, u in zip(fused_out, unfused_out)]
        reference = ew.run(program, registers, constants, types, inputs)
        ref_ulp = [int(ulp_distance(f, r).max()) for f, r in zip(fused_out, reference)]
        medians = {k: statistics.median(t) for k, t in times.items()}
        gpu = {key: gpu_ms_per_run(v) for key, v in variants.items()} if provider == "cuda" else {}
        moved = sum(a.nbytes for a in inputs) + sum(rows * cols * (2 if t == FLOAT16 else 4) for t in types)
        fused = [k for k in variants if k != "unfused"]
        entry = {"benchmark": name, "shape": [rows, cols], "median_ms": medians, "all_ms": times,
                 "speedup": medians["unfused"] / medians[fused[0]], "fused_GBps": moved / medians[fused[0]] / 1e6,
                 "speedup_by_kernel": {k: medians["unfused"] / medians[k] for k in fused},
                 "max_ulp_fused_vs_unfused": agreement, "max_ulp_fused_vs_reference": ref_ulp,
                 "gpu_kernels_ms": gpu}
        results.append(entry)
        print(f"{name:34s} " + "  ".join(f"{k} {medians[k]:.4f} ms" for k in fused) +
              f"  unfused {medians['unfused']:.4f} ms  speed-up {entry['speedup']:.2f}x  "
              f"{fused[0]} {entry['fused_GBps']:.0f} GB/s  "
              f"ulp fused-unfused {agreement} fused-reference {ref_ulp}", flush=True)
        if gpu:
            print("    GPU kernel time a run (CUPTI): " + ", ".join(
                f"{key} {value['total_ms']:.4f} ms in {value['launches']:.0f} launches" if value else f"{key} -"
                for key, value in gpu.items()), flush=True)
    return results


# [rows, columns] of the bias gradients the column sums replace a BlockReduceSum of: ResNet-50 b64
# channels-last (the stem, stage 1's two widths, stage 4's output) and BERT-base b32 s128
SUM_SHAPES = [(802816, 64), (200704, 256), (200704, 64), (3136, 2048), (4096, 768)]


def sum_timing(provider: str, rounds: int, block: int) -> list[dict]:
    """A ReLU's backward (``dy * (x > 0)``, float16) with the column sums of its output as the
    node's ``column_sums`` against the same node without them followed by a ``BlockReduceSum`` of
    its output (what ``--no-fuse-column-sums`` runs), interleaved in rounds in one process; the
    sums of the two compared (within float32 rounding)."""
    program, constants = relu_backward_program()
    results = []
    for rows, q in SUM_SHAPES:
        rng = np.random.default_rng(rows + q)
        inputs = [rng.standard_normal((rows, q)).astype(np.float16), rng.standard_normal((rows, q)).astype(np.float16)]
        ins = [value_info(f"x{k}", FLOAT16, [rows, q]) for k in range(2)]
        outs = [value_info("y0", FLOAT16, [rows, q]), value_info("y1", FLOAT16, [rows, q])]
        summed = model([fused_node(program, 5, constants, [FLOAT16, FLOAT16], ["x0", "x1"], ["y0", "y1", "sums"],
                                   sums=(0, q, FLOAT))], ins, outs + [value_info("sums", FLOAT, [q])])
        apart = model([fused_node(program, 5, constants, [FLOAT16, FLOAT16], ["x0", "x1"], ["y0", "y1"]),
                       node("BlockReduceSum", ["y0"], ["sums"], domain=DOMAIN, sizes=[rows, q, 1], output_type=FLOAT)],
                      ins, outs + [value_info("sums", FLOAT, [q])])
        variants = {"column_sums": Bound(summed, inputs, provider), "block_reduce_sum": Bound(apart, inputs, provider)}
        times = interleaved(variants, rounds, block)
        got = {k: v.results() for k, v in variants.items()}
        want = block_reduce.reference(got["block_reduce_sum"][0], [rows, q, 1])
        bound = sum_bound(got["block_reduce_sum"][0], q, FLOAT)
        errors = {k: float(np.max(np.abs(r[2].astype(np.float64) - want))) for k, r in got.items()}
        ok = all(bool(np.all(np.abs(r[2].astype(np.float64) - want) <= bound)) for r in got.values())
        ok = ok and all(np.array_equal(got["column_sums"][i], got["block_reduce_sum"][i]) for i in (0, 1))
        medians = {k: statistics.median(t) for k, t in times.items()}
        gpu = {key: gpu_ms_per_run(v) for key, v in variants.items()} if provider == "cuda" else {}
        entry = {"shape": [rows, q], "median_ms": medians, "all_ms": times, "ok": ok, "max_error": errors,
                 "speedup": medians["block_reduce_sum"] / medians["column_sums"], "gpu_kernels_ms": gpu}
        results.append(entry)
        print(f"relu_backward + column sums {rows}x{q}: column_sums {medians['column_sums']:.4f} ms  "
              f"+BlockReduceSum {medians['block_reduce_sum']:.4f} ms  speed-up {entry['speedup']:.2f}x  "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)
        if gpu:
            print("    GPU kernel time a run (CUPTI): " + ", ".join(
                f"{key} {value['total_ms']:.4f} ms in {value['launches']:.0f} launches" if value else f"{key} -"
                for key, value in gpu.items()), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cuda")
    parser.add_argument("--timing", dest="timing", action="store_true", default=None, help="time fused against unfused")
    parser.add_argument("--no-timing", dest="timing", action="store_false")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds (each times a block of every variant)")
    parser.add_argument("--block", type=int, default=20, help="runs per timed block")
    parser.add_argument("--kernels", default="generated,interpreter",
                        help="CUDA kernels to check and time, comma-separated, of " + ", ".join(KERNELS))
    args = parser.parse_args(argv)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not kernels or any(k not in KERNELS for k in kernels):
        parser.error(f"--kernels takes a comma-separated list of {', '.join(KERNELS)}")
    if args.provider == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    nvrtc = jit.export_nvrtc()
    print(f"onnxruntime {ort.__version__}, library {library_path()}, provider {args.provider}, NVRTC {nvrtc}",
          flush=True)
    reports = check(args.provider, kernels if args.provider == "cuda" else ("generated",))
    failed = [r["case"] for r in reports if not r["ok"]]
    stats = jit.kernel_stats(library_path()) if args.provider == "cuda" else {}
    if stats:
        print("generated kernels: " + ", ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
        if "generated" in kernels and stats["interpreter"]:
            failed.append("generated kernels fell back to the interpreter (see stderr)")
    result = {"onnxruntime": ort.__version__, "library": library_path(), "provider": args.provider, "nvrtc": nvrtc,
              "host": platform.node(), "checks": reports, "failed": failed, "kernel_stats": stats}
    if args.timing if args.timing is not None else args.provider == "cuda":
        try:
            result["timing"] = timing(args.provider, args.rounds, args.block, kernels)
            result["sum_timing"] = sum_timing(args.provider, args.rounds, args.block)
            if not all(entry["ok"] for entry in result["sum_timing"]):
                failed.append("column sums timed against BlockReduceSum disagree")
        except Exception as exc:
            result["timing_error"] = f"{type(exc).__name__}: {exc}"
            print(f"timing failed: {result['timing_error']}", flush=True)
    print(f"{len(reports) - len(failed)} of {len(reports)} cases within tolerance" + (f"; failed: {failed}" if failed else ""))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failed or "timing_error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
