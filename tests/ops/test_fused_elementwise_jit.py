"""FusedElementwise's generated CUDA kernels (csrc/elementwise_codegen.cc, onnxcampo.ops.jit):
the source the library writes for each program and layout, read through its C hook (the CPU
library carries the code generator), and, where NVRTC is installed (the nvidia-cuda-nvrtc
wheel), compiled for sm_80 and sm_90 with the library's options. Running them needs a GPU:
scripts/check_fused_elementwise_cuda.py checks every case there against the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest

import check_fused_elementwise_cuda as cases
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import jit, library_path
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
        assert source.count(f'extern "C" __global__') == 1, case.name
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
