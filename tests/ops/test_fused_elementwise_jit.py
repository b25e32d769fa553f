"""FusedElementwise's generated CUDA kernels (onnxcampo/ops/elementwise/elementwise_codegen.cc, onnxcampo.ops.elementwise.jit):
the source the library writes for each program and layout, read through its C hook (the CPU
library carries the code generator), and, where NVRTC is installed (the nvidia-cuda-nvrtc
wheel), compiled for sm_80 and sm_90 with the library's options. Running them needs a GPU:
tests/gpu/test_fused_elementwise_cuda.py runs every case there against the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cases import fused_elementwise as cases
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import library_path
from onnxcampo.ops.elementwise import jit
from onnxcampo.ops.elementwise import Op

pytestmark = pytest.mark.usefixtures("library")  # fails (never skips) without the built library


def _source(case: cases.Case, literal: bool = True) -> str:
    types = [cases.elem_type(a) for a in case.inputs]
    return jit.generated_source(library_path(), case.program, case.registers, case.constants, case.output_types,
                                types, [a.shape for a in case.inputs], literal,
                                case.sums[:2] if case.sums else None)


def test_every_case_has_a_source_with_one_kernel_and_its_constants():
    for case in cases.all_cases():
        source = _source(case)
        assert source.count('extern "C" __global__') == 1, case.name
        assert jit.KERNEL_NAME in source
        assert source == _source(case), "the source is deterministic"
        for k in range(0, len(case.program), 4):
            if case.program[k] == Op.CONST:  # an exact bit pattern, whatever the value
                bits = int(np.float32(case.constants[case.program[k + 2]]).view(np.uint32))
                assert f"__int_as_float(0x{bits:08x})" in source, case.name


def test_types_kinds_and_shapes_shape_the_source():
    program = [Op.LOAD, 0, 0, 0, Op.LOAD, 1, 1, 0, Op.MUL, 0, 0, 1, Op.STORE, 0, 0, 0]
    lib = library_path()

    def source(types, shapes, out=(10,), literal=True):
        text = jit.generated_source(lib, program, 2, [], list(out), types, shapes, literal)
        return text[text.index("extern"):]  # the kernel, after the prelude's helpers

    half = source([10, 10], [(64, 768), (64, 768)])
    assert "const uint2 v = *(const uint2*)((const u16*)p.in[0]" in half and "h2f(" in half and "f2h(" in half
    full32 = source([1, 1], [(64, 768), (64, 768)], out=(1,))
    assert "float4" in full32 and "h2f(" not in full32 and "f2h(" not in full32
    scalar = source([1, 1], [(64, 768), (1,)], out=(1,))
    assert "const float s1 = " in scalar and "x1[" not in scalar  # read once per thread
    bias = source([1, 1], [(64, 768), (768,)], out=(1,))
    assert "768LL" in bias and "c1" in bias  # the collapsed shape's sizes as literals
    generic = source([1, 1], [(64, 768), (768,)], out=(1,), literal=False)
    assert "768LL" not in generic and "p.dim[1]" in generic
    assert source([1, 1], [(64, 768), (64, 768)], out=(1,), literal=False) == full32  # no shape in it


def test_the_library_refuses_what_check_refuses():
    lib = library_path()
    with pytest.raises(ValueError, match="reads register 3 before any write"):
        jit.generated_source(lib, [Op.LOAD, 0, 0, 0, Op.ADD, 1, 0, 3, Op.STORE, 0, 1, 0], 4, [], [1], [1], [(4,)])
    with pytest.raises(ValueError, match="do not broadcast"):
        jit.generated_source(lib, [Op.LOAD, 0, 0, 0, Op.LOAD, 1, 1, 0, Op.ADD, 0, 0, 1, Op.STORE, 0, 0, 0], 2, [],
                             [1], [1, 1], [(3,), (4,)])
    with pytest.raises(ew.ProgramError, match="reads register 3"):  # the same rule in the spec
        ew.check([Op.LOAD, 0, 0, 0, Op.ADD, 1, 0, 3, Op.STORE, 0, 1, 0], 4, [], 1, [1])


def test_kernel_stats_read_the_library():
    stats = jit.kernel_stats(library_path())
    assert stats == {} or set(stats) == {"generated", "interpreter", "compiled", "cached"}


def test_nvrtc_lookup_honours_the_environment(monkeypatch, tmp_path):
    fake = tmp_path / "libnvrtc.so.13"
    fake.write_bytes(b"")
    monkeypatch.setenv(jit.ENV_VAR, str(fake))
    assert jit.nvrtc_library() == str(fake) == jit.export_nvrtc()
    monkeypatch.setenv(jit.ENV_VAR, str(tmp_path / "missing.so"))
    assert jit.nvrtc_library() is None


@pytest.mark.skipif(jit.nvrtc_library() is None, reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
@pytest.mark.slow  # ~0.1 s a compile
@pytest.mark.parametrize("arch", [80, 90])
def test_every_source_compiles_with_nvrtc(arch):
    for case in cases.all_cases():
        for literal in (True, False):
            cubin = jit.compile_source(_source(case, literal), arch)
            assert cubin[:4] == b"\x7fELF", case.name


@pytest.mark.skipif(jit.nvrtc_library() is None, reason="NVRTC not installed (pip install nvidia-cuda-nvrtc)")
def test_nvrtc_errors_carry_the_log():
    with pytest.raises(jit.NvrtcError, match=re.escape("sm_90")):
        jit.compile_source('extern "C" __global__ void k() { undefined_thing(); }', 90)


# ---- column sums: the grid and where each thread's partial sums go ----------------------------

THREADS, LANES = ew.JIT_THREADS, ew.JIT_LANES  # onnxcampo/ops/elementwise/elementwise_jit.h: kJitThreads, kJitLanes


def _sum_grid(n: int, q: int, max_blocks: int):
    import ctypes

    fn = ctypes.CDLL(library_path()).OnnxcampoJitSumGrid
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    out = (ctypes.c_int64 * 3)()
    return (int(out[0]), int(out[1]), bool(out[2])) if fn(n, q, max_blocks, out) else None


def _partials(values: np.ndarray, q: int, blocks: int, rows: int, combine: bool) -> np.ndarray:
    """What the generated kernel writes to its partials for ``values`` (the stored output, flat):
    thread t of the grid-stride loop adds element e = 4 * (t + i * threads) + j into acc[j]; with
    ``combine`` block b adds part[r * q + c] over r into row b, else thread t writes acc at 4 * t."""
    span = THREADS * LANES
    threads = blocks * THREADS
    acc = np.zeros((threads, LANES), np.float64)
    e = np.arange(values.size)
    np.add.at(acc, ((e // LANES) % threads, e % LANES), values)
    if not combine:
        return acc.reshape(rows, q)
    part = acc.reshape(blocks, span)
    return part.reshape(blocks, span // q, q).sum(axis=1)


@pytest.mark.parametrize("n_rows, q, max_blocks", [
    (8192, 64, 1056), (4096, 256, 1056), (3136, 2048, 1056), (4096, 768, 1056), (200704, 64, 132 * 8),
    (13, 64, 1056), (100, 1024, 16), (50, 3072, 8), (4096, 768, 7),
])
def test_the_sum_grid_keeps_each_thread_in_its_columns(n_rows, q, max_blocks):
    """PlanJitSums: the grid's stride is a multiple of Q (so a thread's columns never change), the
    partials [rows, Q] the kernel writes (emulated here) sum to the output's column sums, and they
    take fewer bytes than the output they replace reading."""
    n = n_rows * q
    grid = _sum_grid(n, q, max_blocks)
    assert grid == ew.sum_grid(n, q, max_blocks)  # the Python mirror the cost model reads
    if grid is None:
        step = q // np.gcd(q, THREADS * LANES)  # refused only when the partials would not pay
        blocks = max(step, min(-(-n // (THREADS * LANES)), max_blocks) // step * step)
        rows = blocks if (THREADS * LANES) % q == 0 else blocks * THREADS * LANES // q
        assert rows * q * 4 > n
        return
    blocks, rows, combine = grid
    assert blocks * THREADS * LANES % q == 0 and combine == ((THREADS * LANES) % q == 0)
    assert rows == (blocks if combine else blocks * THREADS * LANES // q) and rows * q * 4 <= n
    values = np.random.default_rng(n_rows + q).integers(-8, 9, n).astype(np.float64)
    partials = _partials(values, q, blocks, rows, combine)
    np.testing.assert_array_equal(partials.sum(axis=0), values.reshape(-1, q).sum(axis=0))


@pytest.mark.parametrize("n, q", [(6 * 10, 6), (4 * 10, 0), (4 * 10 + 4, 8), (0, 4)])
def test_the_sum_grid_refuses_columns_it_cannot_keep(n, q):
    """Q not a multiple of the 4 lanes, Q not dividing n, an empty output: no grid (the op sums
    the stored output instead)."""
    assert _sum_grid(n, q, 1056) is None and ew.sum_grid(n, q, 1056) is None
