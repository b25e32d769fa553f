"""``ai.onnxcampo::FusedElementwise``'s cases against the numpy reference
(:func:`onnxcampo.ops.elementwise.run`): every opcode on special values, broadcasting, float16
rounding, chains of a mixed-precision graph, column sums; the tolerance of each output; the
unfused ONNX chains the fused node replaces, for timing them side by side.

``tests/ops/test_fused_elementwise.py`` runs every case on the CPU kernel,
``tests/gpu/test_fused_elementwise_cuda.py`` on each CUDA kernel (the generated one, NVRTC-compiled
per program, and the interpreter, its fallback).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import nodes
from onnxcampo.ops.elementwise import jit
from onnxcampo.ops import reduce as block_reduce
from onnxcampo.ops.elementwise import Op
from onnxcampo.runtime import make_session

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {FLOAT: np.float32, FLOAT16: np.float16}
KERNELS = ("generated", "interpreter")  # FusedElementwise's CUDA kernels ($ONNXCAMPO_EW_KERNEL)


def elem_type(array: np.ndarray) -> int:
    return {np.dtype(np.float32): FLOAT, np.dtype(np.float16): FLOAT16}[array.dtype]


def _model(graph_nodes, inputs, outputs, *, custom: bool = True) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(graph_nodes, "g", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    if custom:
        nodes.import_domain(model)
    return model


def fused_model(program, registers, constants, output_types, inputs: list[np.ndarray], *, sums=None,
                declare: bool = True, extra=()) -> onnx.ModelProto:
    """One FusedElementwise node over ``x0..`` writing ``y0..`` (and ``sums``, its column sums, when
    ``sums`` is ``(output, columns, type)``); ``declare``: the outputs' types and shapes in the
    graph, else their names alone (ORT learns them from the op); ``extra``: nodes after it, their
    outputs ``(name, type, shape)`` graph outputs too."""
    names = [f"x{k}" for k in range(len(inputs))]
    outs = [f"y{k}" for k in range(len(output_types))]
    shape = list(np.broadcast_shapes(*(a.shape for a in inputs)))
    types, shapes = list(output_types), [shape] * len(outs)
    column_sums = None
    if sums is not None:
        outs.append("sums")
        types.append(sums[2])
        shapes.append([sums[1]])
        column_sums = [int(sums[0]), int(sums[1])]
    fused = nodes.fused_elementwise(names, outs, program=program, registers=registers, constants=constants,
                                    output_types=output_types, column_sums=column_sums,
                                    column_sums_type=sums[2] if sums else FLOAT, name="fused")
    values = [helper.make_tensor_value_info(n, elem_type(a), list(a.shape)) for n, a in zip(names, inputs)]
    declared = [helper.make_tensor_value_info(o, t, d) if declare else onnx.ValueInfoProto(name=o)
                for o, t, d in zip(outs, types, shapes)]
    more = [node for node, _ in extra]
    declared += [helper.make_tensor_value_info(*output) for _, output in extra]
    return _model([fused, *more], values, declared)


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

    def model(self, declare: bool = True) -> onnx.ModelProto:
        return fused_model(self.program, self.registers, self.constants, self.output_types, self.inputs,
                           sums=self.sums, declare=declare)

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
        second = (op, 5, 0, 4) if op in BINARY_OPS else (op, 5, 4, 0)
        if op in BINARY_OPS:
            first = [(op, 2, 0, 1), (op, 3, 1, 0)]
        else:
            first = [(op, 2, 0, 0), (op, 3, 1, 0)]
        program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), *first, (Op.CONST, 4, 0, 0), second,
                           (Op.STORE, 0, 2, 0), (Op.STORE, 1, 2, 0), (Op.STORE, 2, 3, 0), (Op.STORE, 3, 5, 0))
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
    finite = np.unique(np.sort(halves[np.isfinite(halves)].astype(np.float64)))
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


SQRT2 = math.sqrt(2.0)


def gelu_program() -> tuple[list[int], list[float]]:
    """Cast(x + b -> fp32) then x * 0.5 * (1 + erf(x / sqrt(2))) in float32, Cast to fp16 (in the
    unfused graph's operation order: Div, Erf, Add, Mul, Mul)."""
    program = _program((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.ADD, 0, 0, 1), (Op.ROUND_F16, 0, 0, 0),
                       (Op.CONST, 1, 0, 0), (Op.DIV, 2, 0, 1), (Op.ERF, 2, 2, 0), (Op.CONST, 3, 1, 0),
                       (Op.ADD, 2, 2, 3), (Op.MUL, 2, 0, 2), (Op.CONST, 3, 2, 0), (Op.MUL, 2, 2, 3),
                       (Op.STORE, 0, 2, 0))
    return program, [SQRT2, 1.0, 0.5]


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
    """``{"case", "ok", "outputs": [per output: ok, max ulp or error, ...]}``: ``outputs`` against
    the reference within the case's tolerance on ``provider`` ("cpu" or "cuda")."""
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


# ---- sessions ----------------------------------------------------------------------------------


@contextlib.contextmanager
def kernel(name: str):
    """Sessions made inside run FusedElementwise's ``name`` CUDA kernel (the library reads
    ``$ONNXCAMPO_EW_KERNEL`` when a session creates the kernel, so sessions of each kind live side
    by side in one process)."""
    saved = os.environ.get(jit.KERNEL_ENV_VAR)
    os.environ[jit.KERNEL_ENV_VAR] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(jit.KERNEL_ENV_VAR, None)
        else:
            os.environ[jit.KERNEL_ENV_VAR] = saved


def run_case(case: Case, provider: str = "cpu", *, threads: int | None = None, declare: bool = True) -> list[np.ndarray]:
    """The case's outputs on ``provider`` (a plain session, not bound)."""
    session = make_session(case.model(declare), provider=provider, intra_op_threads=threads)
    return session.run(None, case.feeds())


# ---- the unfused chains, for timing ---------------------------------------------------------------


def unfused_model(kind: str, inputs: list[np.ndarray]) -> onnx.ModelProto:
    """The standard-op chain a mixed-precision graph holds for each benchmark."""
    names = [f"x{k}" for k in range(len(inputs))]
    ins = [helper.make_tensor_value_info(n, elem_type(a), list(a.shape)) for n, a in zip(names, inputs)]
    shape = list(inputs[0].shape)

    def c(name, value):  # a float32 scalar
        return helper.make_node("Constant", [], [name], value_float=float(value))

    if kind == "gelu":
        graph_nodes = [helper.make_node("Add", ["x0", "x1"], ["s"]), helper.make_node("Cast", ["s"], ["h"], to=FLOAT),
                       c("k", SQRT2), helper.make_node("Div", ["h", "k"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                       c("one", 1.0), helper.make_node("Add", ["e", "one"], ["p"]),
                       helper.make_node("Mul", ["h", "p"], ["m"]), c("half", 0.5),
                       helper.make_node("Mul", ["m", "half"], ["g"]), helper.make_node("Cast", ["g"], ["y0"], to=FLOAT16)]
        outs = [helper.make_tensor_value_info("y0", FLOAT16, shape)]
    elif kind == "layernorm_backward":
        graph_nodes = [helper.make_node("Cast", ["x0"], ["dy"], to=FLOAT), helper.make_node("Mul", ["dy", "x1"], ["a"]),
                       helper.make_node("Sub", ["a", "x4"], ["b"]), helper.make_node("Mul", ["x2", "x5"], ["c"]),
                       helper.make_node("Sub", ["b", "c"], ["d"]), helper.make_node("Mul", ["x3", "d"], ["dx"]),
                       helper.make_node("Cast", ["dx"], ["y0"], to=FLOAT16), helper.make_node("Mul", ["dy", "x2"], ["y1"])]
        outs = [helper.make_tensor_value_info("y0", FLOAT16, shape), helper.make_tensor_value_info("y1", FLOAT, shape)]
    else:
        graph_nodes = [helper.make_node("Cast", ["x0"], ["h"], to=FLOAT16), helper.make_node("Mul", ["h", "x1"], ["y0"])]
        outs = [helper.make_tensor_value_info("y0", FLOAT16, shape)]
    return _model(graph_nodes, ins, outs, custom=False)


BENCHMARKS = {  # name: (kind, rows, cols, program builder, registers, output types)
    "bert_bias_gelu_erf_4096x3072": ("gelu", 32 * 128, 3072, gelu_program, 4, [FLOAT16]),
    "layernorm_backward_4096x768": ("layernorm_backward", 32 * 128, 768, layernorm_backward_program, 8, [FLOAT16, FLOAT]),
    "cast_fp32_fp16_mul_4096x3072": ("cast_mul", 32 * 128, 3072, cast_mul_program, 3, [FLOAT16]),
}

# [rows, columns] of the bias gradients the column sums replace a BlockReduceSum of: ResNet-50 b64
# channels-last (the stem, stage 1's two widths, stage 4's output) and BERT-base b32 s128
SUM_SHAPES = [(802816, 64), (200704, 256), (200704, 64), (3136, 2048), (4096, 768)]
