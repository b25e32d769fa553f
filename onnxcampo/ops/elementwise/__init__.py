"""``ai.onnxcampo::FusedElementwise``: a chain of elementwise ops as one kernel, its Casts folded in.

The node computes every output element by running a small register program (attribute
``program``) over the broadcast of its inputs. Registers hold float32; a value the unfused graph
holds in float16 is rounded to float16 where the graph would have rounded it (``ROUND_F16``), so
the fused node gives the unfused graph's values up to the last-bit differences of the math
library (exp, tanh, erf: CUDA's and the host's differ from ONNX Runtime's by an ulp or two).

Node:

- inputs ``x_1 .. x_n`` (1 <= n <= :data:`MAX_INPUTS`), each float32 or float16, any shapes
  that broadcast (numpy rules) to the output shape;
- outputs ``y_1 .. y_m`` (1 <= m <= :data:`MAX_OUTPUTS`), each of the broadcast shape, of the
  element type given in ``output_types`` (1 = float32, 10 = float16);
- attributes ``program`` (ints, four per instruction: ``opcode, dst, a, b``), ``registers``
  (int, <= :data:`MAX_REGISTERS`), ``constants`` (floats, read by ``CONST``; may be absent when
  unused), ``output_types`` (ints, one per output), ``input_types`` (ints, one per input,
  optional: the types the program was written for; checked by the kernels, and a node whose fp16
  inputs all arrive as fp32 (ORT's CPU provider runs fp16 nodes without fp16 neighbours so) writes
  its fp16 outputs as fp32);
- optional column sums: ``column_sums`` (ints ``[k, Q]``) gives the node one more output, last:
  the sums over rows of output ``k`` read as a row-major ``[size / Q, Q]`` array (the values as
  stored, i.e. rounded to output ``k``'s type; Q must divide its size), accumulated in float32 and
  rounded once to ``column_sums_type`` (1, the default, or 10), shaped ``column_sums_shape``
  (default ``[Q]``): what a ``BlockReduceSum`` with ``sizes [size / Q, Q, 1]`` of output ``k``
  computes (its reference, ``onnxcampo.ops.reduce.reference``), without reading it back.

Instructions (registers ``r[0 .. registers-1]``, ``i`` the output element):

======  ===========  =============================================================
opcode  name         effect
======  ===========  =============================================================
0       LOAD         ``r[dst] = float32(x_a[i broadcast])``  (``b`` unused)
1       CONST        ``r[dst] = constants[a]``
2       STORE        ``y_dst[i] = r[a]`` converted to output ``dst``'s type
3..9    ADD SUB MUL  ``r[dst] = r[a] (+ - * / pow max min) r[b]`` (float32)
        DIV POW MAX
        MIN
10..19  NEG ABS EXP  ``r[dst] = f(r[a])`` (float32); RECIP ``1/x``; SIGMOID
        LOG SQRT     ``1/(1+exp(-x))``; RELU ``max(x, 0)`` (NaN stays NaN)
        RECIP TANH
        ERF SIGMOID
        RELU
20      ROUND_F16    ``r[dst] = float32(float16(r[a]))`` (round to nearest even)
21      COPY         ``r[dst] = r[a]``
22..26  GREATER      ``r[dst] = 1.0 if r[a] (> < >= <= ==) r[b] else 0.0`` (False when
        LESS         either is NaN, as ONNX's comparisons: what ``Cast(Greater(a, b),
        GREATER_EQ.  to=float)`` gives)
        LESS_EQUAL
        EQUAL
======  ===========  =============================================================

Every output is stored exactly once; a program reads a register only after writing it; an
instruction may write a register it reads (``ADD 0, 0, 1``: operands are read first).

:func:`run` is the reference: + - * / sqrt and the float16 rounding are float32 (IEEE, one rounding
each), so kernels must match it exactly there; exp, log, tanh, erf and pow are computed in
float64 and rounded once to float32 (the correctly rounded value, the same on every machine), which
the kernels' math libraries (glibc, CUDA) meet within their documented 1-2 ulp (CUDA's powf: 4).
SIGMOID is that rounded exp followed by the float32 add and divide.

This file imports numpy only (scipy's erf when installed). The kernels: onnxcampo/ops/elementwise/elementwise.h;
docs/ops.md; tests/gpu/test_fused_elementwise_cuda.py checks the CUDA kernels against :func:`run`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import numpy as np

try:
    from scipy.special import erf as _erf64
except ImportError:  # the GPU check script loads this file where only numpy is installed
    _erf64 = np.vectorize(math.erf, otypes=[np.float64])

MAX_INPUTS = 16
MAX_OUTPUTS = 8
MAX_REGISTERS = 32
MAX_INSTRUCTIONS = 128
OP_TYPE = "FusedElementwise"


class Op(enum.IntEnum):
    LOAD = 0
    CONST = 1
    STORE = 2
    ADD = 3
    SUB = 4
    MUL = 5
    DIV = 6
    POW = 7
    MAX = 8
    MIN = 9
    NEG = 10
    ABS = 11
    EXP = 12
    LOG = 13
    SQRT = 14
    RECIP = 15
    TANH = 16
    ERF = 17
    SIGMOID = 18
    RELU = 19
    ROUND_F16 = 20
    COPY = 21
    GREATER = 22
    LESS = 23
    GREATER_EQUAL = 24
    LESS_EQUAL = 25
    EQUAL = 26


def _rounded(f):
    """``f`` computed in float64 and rounded once to float32: the float32 result nearest the
    exact one (but for rare double-rounding ties), the same on every machine. numpy's own float32
    exp and log are SIMD approximations whose last bits depend on the CPU (up to 3 ulp off on
    AVX-512), too loose a reference for kernels whose math library is within 1-2 ulp."""
    return lambda *args: f(*(np.asarray(a, np.float64) for a in args)).astype(np.float32)


_exp = _rounded(np.exp)

def _compare(fn):
    """1.0 where ``fn`` holds, else 0.0 (float32; False when an operand is NaN, as ONNX's)."""
    return lambda a, b: fn(a, b).astype(np.float32)


BINARY = {Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide, Op.POW: _rounded(np.power),
          Op.MAX: np.maximum, Op.MIN: np.minimum,
          Op.GREATER: _compare(np.greater), Op.LESS: _compare(np.less), Op.GREATER_EQUAL: _compare(np.greater_equal),
          Op.LESS_EQUAL: _compare(np.less_equal), Op.EQUAL: _compare(np.equal)}


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + _exp(-x))  # exp rounded to float32, then float32 + and /


def _relu(x: np.ndarray) -> np.ndarray:
    return np.where(x < 0, np.float32(0), x)  # NaN is not < 0: it stays


UNARY = {Op.NEG: np.negative, Op.ABS: np.abs, Op.EXP: _exp, Op.LOG: _rounded(np.log), Op.SQRT: np.sqrt,
         Op.RECIP: lambda x: np.float32(1) / x, Op.TANH: _rounded(np.tanh), Op.ERF: _rounded(_erf64),
         Op.SIGMOID: _sigmoid, Op.RELU: _relu, Op.COPY: lambda x: x,
         Op.ROUND_F16: lambda x: x.astype(np.float16).astype(np.float32)}

ONNX_FLOAT, ONNX_FLOAT16 = 1, 10
NUMPY_TYPES = {ONNX_FLOAT: np.float32, ONNX_FLOAT16: np.float16}


class ProgramError(ValueError):
    """A program the kernels would refuse (the same checks as elementwise.h's)."""


def check(program: Sequence[int], registers: int, constants: Sequence[float], inputs: int,
          output_types: Sequence[int]) -> None:
    """Raise :class:`ProgramError` unless the program is one the kernels run."""
    if len(program) % 4 or not program:
        raise ProgramError("program must be a non-empty list of 4-int instructions")
    if len(program) // 4 > MAX_INSTRUCTIONS:
        raise ProgramError(f"program has {len(program) // 4} instructions, more than {MAX_INSTRUCTIONS}")
    if not 1 <= registers <= MAX_REGISTERS:
        raise ProgramError(f"registers must be 1..{MAX_REGISTERS}, got {registers}")
    if not 1 <= inputs <= MAX_INPUTS:
        raise ProgramError(f"1..{MAX_INPUTS} inputs, got {inputs}")
    if not 1 <= len(output_types) <= MAX_OUTPUTS or any(t not in NUMPY_TYPES for t in output_types):
        raise ProgramError(f"1..{MAX_OUTPUTS} outputs of type 1 or 10, got {list(output_types)}")
    written, stored = set(), set()
    for k in range(0, len(program), 4):
        code, dst, a, b = program[k:k + 4]
        try:
            op = Op(code)
        except ValueError:
            raise ProgramError(f"instruction {k // 4}: unknown opcode {code}") from None
        reads = {Op.LOAD: (), Op.CONST: (), Op.STORE: (a,)}.get(op, (a, b) if op in BINARY else (a,))
        for r in reads:
            if r not in written:
                raise ProgramError(f"instruction {k // 4} ({op.name}) reads register {r} before any write")
        if op is Op.LOAD and not 0 <= a < inputs:
            raise ProgramError(f"instruction {k // 4}: LOAD of input {a}, the node has {inputs}")
        if op is Op.CONST and not 0 <= a < len(constants):
            raise ProgramError(f"instruction {k // 4}: CONST {a}, the node has {len(constants)} constants")
        if op is Op.STORE:
            if not 0 <= dst < len(output_types) or dst in stored:
                raise ProgramError(f"instruction {k // 4}: STORE to output {dst} (outputs {len(output_types)}, "
                                   "each stored once)")
            stored.add(dst)
        else:
            if not 0 <= dst < registers:
                raise ProgramError(f"instruction {k // 4}: register {dst} of {registers}")
            written.add(dst)
    if len(stored) != len(output_types):
        raise ProgramError(f"outputs {sorted(set(range(len(output_types))) - stored)} are never stored")


def check_column_sums(column_sums: Sequence[int], column_sums_type: int, column_sums_shape: Sequence[int] | None,
                      outputs: int) -> None:
    """Raise :class:`ProgramError` unless the column-sum attributes are ones the kernels take
    (``outputs``: the node's elementwise outputs)."""
    if len(column_sums) != 2:
        raise ProgramError(f"column_sums must hold 2 ints [output, columns], got {list(column_sums)}")
    k, q = (int(v) for v in column_sums)
    if not 0 <= k < outputs:
        raise ProgramError(f"column_sums sums output {k}, the node has {outputs} elementwise outputs")
    if q < 1:
        raise ProgramError(f"column_sums' columns must be >= 1, got {q}")
    if column_sums_type not in NUMPY_TYPES:
        raise ProgramError(f"column_sums_type must be 1 (float32) or 10 (float16), got {column_sums_type}")
    if column_sums_shape is not None and math.prod(column_sums_shape) != q:
        raise ProgramError(f"column_sums_shape {list(column_sums_shape)} holds {math.prod(column_sums_shape)} "
                           f"elements, {q} columns are summed")


JIT_THREADS, JIT_LANES = 256, 4  # the generated CUDA kernel's block and elements a thread a step
JIT_BLOCKS_PER_SM = 8


def sum_grid(n: int, columns: int, max_blocks: int) -> tuple[int, int, bool] | None:
    """``(blocks, rows, combine)``: the grid the generated CUDA kernel sums the columns of an
    output of ``n`` elements with (``ew::PlanJitSums``, ``onnxcampo/ops/elementwise/elementwise_codegen.cc``; the
    library's ``OnnxcampoJitSumGrid`` gives the same, tests/ops/test_fused_elementwise_jit.py),
    ``max_blocks`` its usual grid (8 blocks a multiprocessor); None where the kernel sums no
    columns and the op sums the stored output after it: Q not a multiple of the lanes or not
    dividing n, or partial sums as large as a float16 copy of the output (``rows * Q * 4 > n``)."""
    span = JIT_THREADS * JIT_LANES
    if columns <= 0 or columns % JIT_LANES or n <= 0 or n % columns or max_blocks < 1:
        return None
    step = columns // math.gcd(span, columns)
    wanted = min(-(-n // span), max_blocks)
    blocks = max(step, wanted // step * step)
    combine = span % columns == 0
    rows = blocks if combine else blocks * span // columns
    return (blocks, rows, combine) if rows * columns * 4 <= n else None


def run(program: Sequence[int], registers: int, constants: Sequence[float], output_types: Sequence[int],
        inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The reference semantics (numpy, float32 registers): what the CPU and CUDA kernels compute."""
    check(program, registers, constants, len(inputs), output_types)
    shape = np.broadcast_shapes(*(np.shape(x) for x in inputs))
    regs: list[np.ndarray | None] = [None] * registers
    outputs: list[np.ndarray | None] = [None] * len(output_types)
    with np.errstate(all="ignore"):
        for k in range(0, len(program), 4):
            code, dst, a, b = program[k:k + 4]
            op = Op(code)
            if op is Op.LOAD:
                regs[dst] = np.broadcast_to(np.asarray(inputs[a]).astype(np.float32), shape)
            elif op is Op.CONST:
                regs[dst] = np.broadcast_to(np.float32(constants[a]), shape)
            elif op is Op.STORE:
                outputs[dst] = np.ascontiguousarray(regs[a]).astype(NUMPY_TYPES[output_types[dst]])
            elif op in BINARY:
                regs[dst] = BINARY[op](regs[a], regs[b]).astype(np.float32)
            else:
                regs[dst] = np.asarray(UNARY[op](regs[a])).astype(np.float32)
    return [np.ascontiguousarray(np.broadcast_to(y, shape)) for y in outputs]


def reference_op():
    """``FusedElementwise`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    from onnx.reference.op_run import OpRun

    from onnxcampo.ops import reduce as block_reduce

    class FusedElementwise(OpRun):
        op_domain = "ai.onnxcampo"

        def _run(self, *inputs, program=None, registers=None, constants=None, output_types=None, input_types=None,
                 column_sums=None, column_sums_type=None, column_sums_shape=None):
            outputs = run(list(program), int(registers), list(constants or ()), list(output_types), inputs)
            if column_sums is not None:
                sum_type = ONNX_FLOAT if column_sums_type is None else int(column_sums_type)
                check_column_sums(column_sums, sum_type, column_sums_shape, len(outputs))
                summed, q = outputs[int(column_sums[0])], int(column_sums[1])
                outputs.append(block_reduce.reference(summed, [summed.size // q, q, 1], sum_type, column_sums_shape))
            return tuple(outputs)

    return FusedElementwise


__all__ = ["MAX_INPUTS", "MAX_INSTRUCTIONS", "MAX_OUTPUTS", "MAX_REGISTERS", "OP_TYPE", "Op", "ProgramError",
           "check", "check_column_sums", "reference_op", "run", "sum_grid"]
