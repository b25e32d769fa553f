"""``ai.onnxcampo::FusedElementwise`` on CUDA (tests/gpu/conftest.py: skipped without a GPU).

1. Every case of ``tests/cases/fused_elementwise.py`` (every opcode on special values,
   broadcasting, float16 rounding, a mixed-precision graph's chains, column sums) on each CUDA
   kernel: the generated one, NVRTC-compiled per program (the library's default), and the
   interpreter, its fallback; each output within the case's CUDA tolerance of the numpy
   reference. A generated run that fell back to the interpreter fails.
2. Timed side by side, figures to the results sink: each benchmark's fused node (each kernel)
   against its unfused ONNX chain (Casts at the edges where a mixed-precision graph has them),
   with the largest ulp distance between them and to the reference; a ReLU backward writing the
   column sums of its output against the same node followed by a ``BlockReduceSum`` (ResNet-50's
   and BERT's bias-gradient shapes), whose outputs must agree.
"""

from __future__ import annotations

import numpy as np
import pytest

from cases import fused_elementwise as fe
from onnxcampo import ops
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import nodes
from onnxcampo.ops.elementwise import jit

CASES = {case.name: case for case in fe.all_cases()}
FLOAT, FLOAT16 = fe.FLOAT, fe.FLOAT16


@pytest.mark.parametrize("kernel", fe.KERNELS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_case_matches_the_reference(request, device, kernel, name):
    if kernel == "generated":
        request.getfixturevalue("generated_kernels")
    case = CASES[name]
    before = jit.kernel_stats(ops.library_path())
    with fe.kernel(kernel):
        session = device.session(case.model())
    outputs = session.run(None, case.feeds())
    report = fe.compare(case, outputs, device.name)
    assert report["ok"], report
    if device.cuda and kernel == "generated":
        after = jit.kernel_stats(ops.library_path())
        assert after["interpreter"] == before["interpreter"], "the generated kernel fell back to the interpreter " \
                                                              "(the library says why on stderr)"


def _bytes(arrays, shape, types) -> int:
    return sum(a.nbytes for a in arrays) + sum(int(np.prod(shape)) * (2 if t == FLOAT16 else 4) for t in types)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(fe.BENCHMARKS))
def test_the_fused_node_timed_against_its_unfused_chain(device, generated_kernels, results, name):
    kinds = fe.KERNELS if device.cuda else ("generated",)
    kind, rows, cols, build, registers, types = fe.BENCHMARKS[name]
    inputs = fe.chain_inputs(kind, rows, cols)
    feeds = {f"x{k}": a for k, a in enumerate(inputs)}
    program, constants = build()
    runners = {}
    for kernel in kinds:  # "fused" runs the default kernel (generated on CUDA), "fused-<kernel>" the others
        with fe.kernel(kernel):
            runners["fused" if kernel == "generated" else f"fused-{kernel}"] = device.bound(
                fe.fused_model(program, registers, constants, types, inputs), feeds)
    runners["unfused"] = device.bound(fe.unfused_model(kind, inputs), feeds)
    figures = device.time(runners, rounds=7)
    fused, unfused = runners["fused"].outputs(), runners["unfused"].outputs()
    names = [f"y{k}" for k in range(len(types))]
    reference = ew.run(program, registers, constants, types, inputs)
    agreement = [int(fe.ulp_distance(fused[n], unfused[n]).max()) for n in names]
    to_reference = [int(fe.ulp_distance(fused[n], want).max()) for n, want in zip(names, reference)]
    moved = _bytes(inputs, (rows, cols), types)
    results.record(shape=[rows, cols], timing=figures, bytes_moved=moved,
                   speedup={k: figures["unfused"]["ms"] / figures[k]["ms"] for k in runners if k != "unfused"},
                   fused_GBps=moved / figures["fused"]["ms"] / 1e6, max_ulp_fused_vs_unfused=agreement,
                   max_ulp_fused_vs_reference=to_reference)


@pytest.mark.slow
@pytest.mark.parametrize("rows, columns", fe.SUM_SHAPES, ids=[f"{r}x{q}" for r, q in fe.SUM_SHAPES])
def test_column_sums_timed_against_a_block_reduce_sum(device, generated_kernels, results, rows, columns):
    """``dy * (x > 0)`` (float16) writing the column sums of its output (``column_sums``) against
    the same node without them and a ``BlockReduceSum`` of its output (what
    ``--no-fuse-column-sums`` runs): the same elementwise outputs bit for bit, both sums within
    float32 rounding of the exact ones."""
    program, constants = fe.relu_backward_program()
    rng = np.random.default_rng(rows + columns)
    inputs = [rng.standard_normal((rows, columns)).astype(np.float16) for _ in range(2)]
    feeds = {f"x{k}": a for k, a in enumerate(inputs)}
    summed = fe.fused_model(program, 5, constants, [FLOAT16, FLOAT16], inputs, sums=(0, columns, FLOAT))
    reduce = nodes.block_reduce_sum("y0", output="sums", sizes=[rows, columns, 1], output_type=FLOAT, name="sum")
    apart = fe.fused_model(program, 5, constants, [FLOAT16, FLOAT16], inputs,
                           extra=[(reduce, ("sums", FLOAT, [columns]))])
    runners = {"column_sums": device.bound(summed, feeds), "block_reduce_sum": device.bound(apart, feeds)}
    figures = device.time(runners, rounds=7)
    got = {k: runner.outputs() for k, runner in runners.items()}
    stored = got["block_reduce_sum"]["y0"]
    exact = stored.astype(np.float64).reshape(-1, columns).sum(axis=0)
    bound = fe.sum_bound(stored, columns, FLOAT)
    errors = {k: float(np.abs(out["sums"].astype(np.float64) - exact).max()) for k, out in got.items()}
    results.record(shape=[rows, columns], timing=figures, max_error=errors,
                   speedup=figures["block_reduce_sum"]["ms"] / figures["column_sums"]["ms"])
    for name in ("y0", "y1"):
        np.testing.assert_array_equal(got["column_sums"][name].view(np.uint16),
                                      got["block_reduce_sum"][name].view(np.uint16))
    for key, out in got.items():
        assert np.all(np.abs(out["sums"].astype(np.float64) - exact) <= bound), key
