"""Mutating pass ``pad_tensor_cores``: zero-pad fp16 GEMM dims to multiples of 8 where it pays.

The fake cost model: a GEMM takes 100 us in fp32, 25 us in fp16 on Tensor Cores (aligned dims,
4x) and 80 us in fp16 unaligned (1.25x); one Pad or Slice takes ``pad_us``. Padding therefore
pays (25 + Pad/Slice < 80) unless ``pad_us`` is large. Numerics are checked with ONNX's
reference evaluator, which computes fp16 ops in fp16.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import (
    FLOAT,
    FakeCost,
    build_context,
    decide,
    export,
    init,
    initializer,
    make_model,
    node,
    ops,
    producer,
    reference_run,
    run_passes,
    tensor_vi,
)
from onnx import helper

from onnxcampo import OptimizeConfig, optimize
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.insert_casts import InsertCasts
from onnxcampo.passes.pad_tensor_cores import PadTensorCores
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, Reason

GEMM_US = {"MatMul": 100.0, "Gemm": 100.0, "Conv": 100.0, "ConvTranspose": 100.0}


def cost(pad_us=1.0):
    return FakeCost(op_us=GEMM_US, speedup=4.0, unaligned_speedup=1.25, pad_us=pad_us, cast_us=1.0)


def rng_array(shape, seed, scale=0.1):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def matmul_model(m, k, n, *, seed=0):
    w = rng_array((k, n), seed)
    return make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [tensor_vi("x", [m, k])], [tensor_vi("y", [m, n])], [init("w", w)],
    ), w


def slice_spec(model, rank):
    """(starts, ends, axes) of the graph's one Slice, axes made non-negative."""
    (slice_,) = [n for n in model.graph.node if n.op_type == "Slice"]
    starts, ends, axes = (initializer(model, name).tolist() for name in slice_.input[1:4])
    return starts, ends, [a % rank for a in axes]


def run(model, *, fp16=("mm",), pad=True, pad_us=1.0, **options):
    """Classify, the given nodes fp16 and the rest fp32, InsertCasts, then (optionally) the
    padding pass, as ``optimize`` orders them."""
    ctx = build_context(model, cost=cost(pad_us), **options)
    run_passes(ctx, Classify())
    decide(ctx, **{name: "fp16" for name in fp16 if not ctx.plan.is_decided(name)})
    passes = [UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32), InsertCasts()]
    if pad:
        passes.append(PadTensorCores())
    results = run_passes(ctx, *passes)
    return ctx, export(ctx), results[-1]


@pytest.mark.slow
def test_matmul_k_and_n_padded_and_identical():
    """Rule 1: ``x[16,1001] @ w[1001,1001]`` in fp16: x gets a Pad to K=1008 on its last axis,
    w is padded offline with zeros to [1008,1008], the result is sliced back to N=1001. The
    padded graph gives exactly the unpadded fp16 graph's output."""
    model, w = matmul_model(16, 1001, 1001)
    ctx, padded, result = run(model)
    assert result.counts == {"nodes": 1, "pad_slice_nodes": 2}
    assert ops(padded) == ["Cast", "Pad", "MatMul", "Slice", "Cast"]
    mm = node(padded, "mm")
    weight = initializer(padded, mm.input[1])
    assert weight.shape == (1008, 1008) and weight.dtype == np.float16
    np.testing.assert_array_equal(weight[:1001, :1001], w.astype(np.float16))
    assert not weight[1001:, :].any() and not weight[:, 1001:].any()
    pad = producer(padded, mm.input[0])
    assert pad.op_type == "Pad" and initializer(padded, pad.input[1]).tolist() == [0, 0, 0, 7]
    assert slice_spec(padded, 2) == ([0], [1001], [1])
    assert [o.name for o in padded.graph.output] == ["y"]

    _, unpadded, _ = run(model, pad=False)
    x = rng_array((16, 1001), 1, scale=1.0)
    (got,) = reference_run(padded, {"x": x})
    (want,) = reference_run(unpadded, {"x": x})
    assert got.shape == (16, 1001) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_only_k_unaligned_gets_pad_no_slice():
    """Rule 1: K=1001, N=64: a Pad on x and a padded weight [1008,64], no Slice."""
    model, _ = matmul_model(16, 1001, 64)
    _, padded, result = run(model)
    assert ops(padded) == ["Cast", "Pad", "MatMul", "Cast"]
    assert result.counts["pad_slice_nodes"] == 1


def test_only_n_unaligned_gets_slice_no_pad():
    """Rule 1: K=64, N=1001: a padded weight [64,1008] and a Slice of the result, no Pad."""
    model, _ = matmul_model(16, 64, 1001)
    _, padded, _ = run(model)
    assert ops(padded) == ["Cast", "MatMul", "Slice", "Cast"]
    assert initializer(padded, node(padded, "mm").input[1]).shape == (64, 1008)


def test_m_is_never_padded():
    """Rule 1: M=1001 with K and N aligned: nothing to pad (M is no leading dimension)."""
    model, _ = matmul_model(1001, 64, 64)
    _, padded, result = run(model, pad_us=0.0)
    assert result.counts == {"nodes": 0, "pad_slice_nodes": 0}
    assert ops(padded) == ["Cast", "MatMul", "Cast"]


@pytest.mark.parametrize("k, n", [(1024, 1024), (64, 8), (8, 1000)])
def test_aligned_shapes_never_padded(k, n):
    """Rule 3: K and N multiples of 8 are never touched, even with free Pads."""
    model, w = matmul_model(16, k, n)
    ctx, padded, result = run(model, pad_us=0.0)
    assert not result.changed and result.counts["pad_slice_nodes"] == 0
    assert ops(padded) == ["Cast", "MatMul", "Cast"]
    assert initializer(padded, "w").shape == (k, n)


def test_not_padded_when_it_does_not_pay():
    """Rule 3: Pad and Slice at 50 us each: 25 + 100 > 80 us unpadded: nothing is padded."""
    model, _ = matmul_model(16, 1001, 1001)
    ctx, padded, result = run(model, pad_us=50.0)
    assert result.counts == {"nodes": 0, "pad_slice_nodes": 0}
    assert ops(padded) == ["Cast", "MatMul", "Cast"]
    assert initializer(padded, "w").shape == (1001, 1001)


def test_fp32_nodes_never_padded():
    """Only fp16 nodes are padded: the same MatMul planned fp32 is left alone."""
    model, _ = matmul_model(16, 1001, 1001)
    _, padded, result = run(model, fp16=(), pad_us=0.0)
    assert ops(padded) == ["MatMul"] and result.counts["nodes"] == 0


def test_a_weight_computed_in_the_graph_is_padded_by_a_pad_node_with_the_same_values():
    """Rule 1 with a weight that is no constant (a training step's weights and the gradients its
    backward multiplies): ``a[16,1001] @ b[1001,1001]`` gets a Pad on a's last axis, a Pad of b on
    both axes each run and a Slice of the result; the values equal the unpadded fp16 graph's."""
    model = make_model(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        [tensor_vi("a", [16, 1001]), tensor_vi("b", [1001, 1001])], [tensor_vi("y", [16, 1001])],
    )
    ctx, padded, result = run(model, pad_us=0.0)
    assert result.counts == {"nodes": 1, "pad_slice_nodes": 3}
    mm = node(padded, "mm")
    pad_b = producer(padded, mm.input[1])
    assert pad_b.op_type == "Pad" and initializer(padded, pad_b.input[1]).tolist() == [0, 0, 7, 7]
    assert "each run" in ctx.inserted[pad_b.name]["why"]
    assert slice_spec(padded, 2) == ([0], [1001], [1])
    _, unpadded, _ = run(model, pad=False)
    feeds = {"a": rng_array((16, 1001), 1, scale=1.0), "b": rng_array((1001, 1001), 2)}
    np.testing.assert_array_equal(reference_run(padded, feeds)[0], reference_run(unpadded, feeds)[0])


@pytest.mark.slow
def test_batched_matmul_pad_on_last_axis():
    """Rule 1 with a 3-D activation ``x[2,16,1001]``: the Pad widens the last axis only and the
    Slice cuts axis 2 (the output's last); the result equals the unpadded one."""
    w = rng_array((1001, 1001), 0)
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [tensor_vi("x", [2, 16, 1001])], [tensor_vi("y", [2, 16, 1001])], [init("w", w)],
    )
    _, padded, _ = run(model)
    pad = producer(padded, node(padded, "mm").input[0])
    assert initializer(padded, pad.input[1]).tolist() == [0, 0, 0, 0, 0, 7]
    assert slice_spec(padded, 3) == ([0], [1001], [2])
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((2, 16, 1001), 3, scale=1.0)
    np.testing.assert_array_equal(reference_run(padded, {"x": x})[0], reference_run(unpadded, {"x": x})[0])


@pytest.mark.slow
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_with_bias_padded_and_identical(trans_b):
    """Rule 1 for Gemm (transA=0, 1-D bias): weight padded on its K and N axes (as laid out by
    transB), bias padded with zeros to N=1008, result sliced back; identical output."""
    k, n = 1001, 1001
    w = rng_array((n, k) if trans_b else (k, n), 0)
    b = rng_array((n,), 1)
    model = make_model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="mm", transB=trans_b)],
        [tensor_vi("x", [16, k])], [tensor_vi("y", [16, n])], [init("w", w), init("b", b)],
    )
    _, padded, _ = run(model)
    gemm = node(padded, "mm")
    assert initializer(padded, gemm.input[1]).shape == (1008, 1008)
    bias = initializer(padded, gemm.input[2])
    assert bias.shape == (1008,) and not bias[1001:].any()
    assert ops(padded) == ["Cast", "Pad", "Gemm", "Slice", "Cast"]
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((16, k), 2, scale=1.0)
    np.testing.assert_array_equal(reference_run(padded, {"x": x})[0], reference_run(unpadded, {"x": x})[0])


def test_gemm_trans_a_padded_only_when_m_is_aligned_and_a_2d_bias_never():
    """Rule 1 conditions: Gemm with transA=1 (A stored [K, M], as a training step's weight
    gradient ``x^T @ dy``) pads K on A's axis 0 when M, A's row stride, is aligned; with M
    unaligned, or with a 2-D bias, the Gemm is left unpadded."""
    w = rng_array((1001, 1001), 0)

    def trans_a(m):
        return make_model(
            [helper.make_node("Gemm", ["x", "w"], ["y"], name="mm", transA=1)],
            [tensor_vi("x", [1001, m])], [tensor_vi("y", [m, 1001])], [init("w", w)],
        )

    model = trans_a(16)
    _, padded, result = run(model, pad_us=0.0)
    assert result.counts["nodes"] == 1
    pad = producer(padded, node(padded, "mm").input[0])
    assert pad.op_type == "Pad" and initializer(padded, pad.input[1]).tolist() == [0, 0, 7, 0]
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((1001, 16), 3, scale=1.0)
    np.testing.assert_array_equal(reference_run(padded, {"x": x})[0], reference_run(unpadded, {"x": x})[0])
    bias_2d = make_model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="mm")],
        [tensor_vi("x", [16, 1001])], [tensor_vi("y", [16, 1001])], [init("w", w), init("b", rng_array((16, 1001), 1))],
    )
    for model in (trans_a(15), bias_2d):
        _, padded, result = run(model, pad_us=0.0)
        assert result.counts["nodes"] == 0 and "Pad" not in ops(padded) and "Slice" not in ops(padded)


def conv_model(c_in, c_out, *, group=1, bias=True, op="Conv"):
    w_shape = (c_in, c_out // group, 3, 3) if op == "ConvTranspose" else (c_out, c_in // group, 3, 3)
    inits = [init("w", rng_array(w_shape, 0))]
    inputs = ["x", "w"]
    if bias:
        inits.append(init("b", rng_array((c_out,), 1)))
        inputs.append("b")
    out_hw = [8, 8] if op == "Conv" else [12, 12]
    return make_model(
        [helper.make_node(op, inputs, ["y"], name="mm", group=group, pads=[1, 1, 1, 1] if op == "Conv" else [1, 1, 1, 1])],
        [tensor_vi("x", [1, c_in, 8, 8] if op == "Conv" else [1, c_in, 12, 12])],
        [tensor_vi("y", [1, c_out, *out_hw])], inits,
    )


def _channels_padded(op: str, side: int):
    """``conv_model(5, 7, op=op)`` through the pass: one node padded (a Pad and a Slice), the
    weight [8, 8, 3, 3], and the same output as the unpadded plan's (reference evaluator, x of
    [1, 5, side, side]); returns the padded model, its ``op`` node, its weight and its output."""
    model = conv_model(5, 7, op=op)
    _, padded, result = run(model)
    assert result.counts == {"nodes": 1, "pad_slice_nodes": 2}
    assert ops(padded) == ["Cast", "Pad", op, "Slice", "Cast"]
    conv = node(padded, "mm")
    weight = initializer(padded, conv.input[1])
    assert weight.shape == (8, 8, 3, 3)
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((1, 5, side, side), 2, scale=1.0)
    (got,), (want,) = reference_run(padded, {"x": x}), reference_run(unpadded, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    return padded, conv, weight, got


def test_conv_channels_padded_and_identical():
    """Rule 2: Conv (group=1) with 5 input and 7 output channels: X gets a Pad on axis 1 to 8
    channels, the weight [7,5,3,3] becomes [8,8,3,3] with zero rows and columns, the bias gets a
    zero, Y is sliced back to 7 channels on axis 1; identical output."""
    padded, conv, weight, got = _channels_padded("Conv", 8)
    assert not weight[7:].any() and not weight[:, 5:].any()
    bias = initializer(padded, conv.input[2])
    assert bias.shape == (8,) and bias[7] == 0
    pad = producer(padded, conv.input[0])
    assert initializer(padded, pad.input[1]).tolist() == [0, 0, 0, 0, 0, 3, 0, 0]
    assert slice_spec(padded, 4) == ([0], [7], [1])
    assert got.shape == (1, 7, 8, 8)


def test_conv_without_bias_padded():
    """Rule 2 without a bias: only X, the weight and Y change."""
    model = conv_model(5, 7, bias=False)
    _, padded, _ = run(model)
    assert ops(padded) == ["Cast", "Pad", "Conv", "Slice", "Cast"]
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((1, 5, 8, 8), 2, scale=1.0)
    np.testing.assert_array_equal(reference_run(padded, {"x": x})[0], reference_run(unpadded, {"x": x})[0])


def test_grouped_conv_not_padded():
    """Grouped Conv is left unpadded, even with free Pads."""
    _, padded, result = run(conv_model(6, 6, group=3), pad_us=0.0)
    assert result.counts["nodes"] == 0 and "Pad" not in ops(padded)


@pytest.mark.slow
def test_conv_transpose_channels_padded_and_identical():
    """Rule 2: ConvTranspose (group=1) with weight [5,7,3,3] (C_in=5, C_out=7): X padded to 8
    channels, the weight to [8,8,3,3] with zero slices, the bias gets a zero, Y is sliced back
    to 7 channels; identical output."""
    _, _, weight, _ = _channels_padded("ConvTranspose", 12)
    assert not weight[5:].any() and not weight[:, 7:].any()


@pytest.mark.slow
def test_optimize_campo_pads_and_reports():
    """End to end with the analytic H200 model: a 2048x1001x1001 fp16 MatMul is padded,
    ``report["pads_inserted"]`` says 2 and ORT CPU runs the result close to the original (a
    wiring check: ORT's CPU provider hides fp16 rounding; the padding's numerics are checked
    exactly with the reference evaluator above); the experimental ``pad_tensor_cores=False`` pads
    nothing."""
    from helpers import ort_run

    model, _ = matmul_model(2048, 1001, 1001)
    config = OptimizeConfig(include_ops=frozenset({"MatMul"}))
    on = optimize(model, config=config, experimental={"check_invariants": True}, accuracy="off")  # compared below
    assert on.report["pads_inserted"] == 2 and "Pad" in ops(on.model) and "Slice" in ops(on.model)
    off = optimize(model, config=config.with_experimental(pad_tensor_cores=False),
                   experimental={"check_invariants": True}, accuracy="off")
    assert off.report["experimental"] == {"pad_tensor_cores": False, "check_invariants": True}
    assert off.report["pads_inserted"] == 0 and ops(off.model) == ["Cast", "MatMul", "Cast"]
    x = rng_array((2048, 1001), 4, scale=1.0)
    (want,) = ort_run(model, {"x": x})
    (got,) = ort_run(on.model, {"x": x})
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
    assert onnx.checker.check_model(on.model, full_check=True) is None
    assert {o.name: o.type.tensor_type.elem_type for o in on.model.graph.output} == {"y": FLOAT}


@pytest.mark.slow
def test_gemm_with_broadcast_scalar_bias():
    """Rule 1: a Gemm with a 1-D bias of shape [1] (broadcast over N) is padded correctly (or
    left unpadded): its output equals the unpadded one."""
    w = rng_array((1001, 1001), 0)
    model = make_model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="mm")],
        [tensor_vi("x", [16, 1001])], [tensor_vi("y", [16, 1001])],
        [init("w", w), init("b", np.array([0.5], np.float32))],
    )
    _, padded, _ = run(model)
    _, unpadded, _ = run(model, pad=False)
    x = rng_array((16, 1001), 2, scale=1.0)
    np.testing.assert_array_equal(reference_run(padded, {"x": x})[0], reference_run(unpadded, {"x": x})[0])


def test_pad_and_slice_say_why_they_are_there():
    """Every Pad and Slice the pass adds is recorded with the node it serves, the dims and the
    predicted times (``ctx.inserted``: the report's inserted_nodes and the node's doc_string)."""
    model, _ = matmul_model(16, 1001, 1001)
    ctx, _, _ = run(model)
    pads = {name: entry for name, entry in ctx.inserted.items() if entry["op"] in ("Pad", "Slice")}
    assert sorted(entry["op"] for entry in pads.values()) == ["Pad", "Slice"]
    assert pads["mm/pad_k"]["why"] == ("zero-pads x/fp16 from 1001 to 1008 along the reduced axis of fp16 MatMul mm "
                                       "for Tensor Cores: predicted 27.00 us padded (Pad/Slice included) against "
                                       "80.00 us unpadded")
    assert "padded from 1001 to 1008 for Tensor Cores, back to 1001" in pads["mm/slice_n"]["why"]
