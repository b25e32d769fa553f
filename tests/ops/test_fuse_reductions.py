"""--fuse-reductions on ONNX Runtime's CPU provider, with the library's BlockReduceSum kernel.

These check the wiring (the fused model loads, its outputs are the unfused model's, names, types
and shapes included) within float32 rounding: the CPU kernel adds in another order than ORT's
ReduceSum. Where the unfused graph rounds to float16 in between, the fused values are compared
with numpy instead. The float16 numerics of the kernel itself: tests/ops/test_block_reduce.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import add_ints as _ints, copy_model, float16_sum_read_as_float32, fused_first_output_on_ort
from helpers import named_model as _model

import onnxcampo
from onnxcampo.rewrites.reductions import fuse_reductions
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step


def _random_feeds(session, seed=0):
    rng = np.random.default_rng(seed)
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(bool)": np.bool_}
    feeds = {}
    for value in session.get_inputs():
        dtype = types[value.type]
        shape = [d if isinstance(d, int) else 1 for d in value.shape]
        if dtype in (np.float32, np.float16):
            feeds[value.name] = np.asarray(rng.standard_normal(shape) * 0.5).astype(dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype)
    return feeds


def _close(want, got, names, half_sums=False):
    """Equal up to float32 rounding (float16 rounding for float16 outputs, and everywhere with
    ``half_sums``: a sum the graph rounds to float16 may land one float16 step away when added in
    another order, and the step's later values follow it)."""
    for name in names:
        a, b = want[name], got[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype.kind != "f":
            np.testing.assert_array_equal(a, b, err_msg=name)
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        eps = 2.0 ** -9 if a.dtype == np.float16 or half_sums else 2.0 ** -20
        np.testing.assert_allclose(b64, a64, rtol=eps, atol=eps * max(1.0, float(np.abs(a64).max(initial=0))),
                                   err_msg=name)


def test_a_graph_of_reductions_gives_the_unfused_values_on_ort_cpu(library):
    model = _model("""
    g (float16[32,16,24] dy, float[4,6,7,5] dc, float[64,10] x) => (float[24] db, float[6] dcb, float16[10] s16) {
      d32 = Cast <to = 1> (dy)
      db = ReduceSum <keepdims = 0> (d32, rows)
      dcb = ReduceSum <keepdims = 0> (dc, conv)
      s = ReduceSum <keepdims = 0> (x, first)
      s16 = Cast <to = 10> (s)
    }""")
    _ints(model, "rows", [0, 1])
    _ints(model, "conv", [0, 2, 3])
    _ints(model, "first", [0])
    fused = copy_model(model)
    result = fuse_reductions(fused)
    assert result.fused == 3 and result.casts == 2
    plain, custom = make_session(model, provider="cpu"), make_session(fused, provider="cpu")
    feeds = _random_feeds(plain)
    _close(run(plain, feeds), run(custom, feeds), ["db", "dcb", "s16"])


def test_a_float16_reduction_read_as_float32_is_the_float32_sum(library):
    model = float16_sum_read_as_float32(512, 8)
    fuse_reductions(model)
    h = (np.random.default_rng(3).standard_normal((512, 8)) * 40).astype(np.float16)
    got = run(make_session(model, provider="cpu"), {"h": h})["z"]
    np.testing.assert_allclose(got, h.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-3)


def _forward_models():
    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    # a transformer block's linear layers, bias, scale and shift: batched [B, S, H] activations
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Add", ["h1", "b1"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["h3"]), helper.make_node("MatMul", ["h3", "W2"], ["h4"]),
             helper.make_node("Add", ["h4", "b2"], ["h5"]), helper.make_node("Mul", ["h5", "g"], ["h6"]),
             helper.make_node("Add", ["h6", "be"], ["y"])]
    inits = [init("W1", [32, 64]), init("b1", [64]), init("W2", [64, 32]), init("b2", [32]), init("g", [32]),
             init("be", [32])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8, 32])], inits)
    yield "linear", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    # Convs with biases: their gradients sum [N, C, H*W] over N and H*W (simplify's rule 7 pairs)
    nodes = [helper.make_node("Conv", ["x", "CW", "CB"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["c2"]), helper.make_node("Conv", ["c2", "CW2", "CB2"], ["y"])]
    inits = [init("CW", [8, 4, 3, 3]), init("CB", [8]), init("CW2", [4, 8, 1, 1]), init("CB2", [4])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8, 8])], inits)
    yield "conv", helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("elementwise", [False, True], ids=["reductions", "all-fusions"])
@pytest.mark.parametrize("policy", ["fp16", "campo"])
def test_training_steps_with_fused_reductions_match_the_unfused_steps(library, policy, elementwise):
    for label, forward in _forward_models():
        step = build_train_step(forward, optimizer="adamw")
        plain = onnxcampo.optimize(step, policy=policy)
        fused = onnxcampo.optimize(step, policy=policy, fuse_reductions=True, fuse_elementwise=elementwise)
        report = fused.report["fuse_reductions"]
        assert report["fused_nodes"] >= 2 and report["reduce_sums_replaced"] >= 4, (label, report)
        ops = [n.op_type for n in fused.model.graph.node]
        assert "BlockReduceSum" in ops and ops.count("ReduceSum") < [n.op_type for n in plain.model.graph.node].count(
            "ReduceSum"), label
        a, b = make_session(plain.model, provider="cpu"), make_session(fused.model, provider="cpu")
        assert [o.name for o in a.get_outputs()] == [o.name for o in b.get_outputs()]
        feeds = _random_feeds(a)
        if "loss_scale" in feeds:
            feeds["loss_scale"] = np.full(feeds["loss_scale"].shape, 1024.0, np.float32)
        _close(run(a, feeds), run(b, feeds), [o.name for o in a.get_outputs()], half_sums=policy == "fp16")


def test_an_fp16_reduction_between_ops_ort_cpu_runs_in_fp32_loads_and_runs_there():
    """ORT's CPU provider runs an fp16 node whose neighbours have no fp16 CPU kernels in fp32 (its
    InsertCastTransformer); BlockReduceSum, told its input's planned type, then writes its fp16
    output as fp32. A wiring check on ORT CPU: the values match the unfused model's."""
    model = _model("""
    g (float16[64,8] x) => (float16[8] y) {
      s = Softmax <axis = -1> (x)
      axes = Constant <value = int64[1] {0}> ()
      r = ReduceSum <keepdims = 0> (s, axes)
      y = Softmax <axis = -1> (r)
    }
    """)
    feeds = {"x": np.random.default_rng(6).standard_normal((64, 8)).astype(np.float16)}
    result, want, got = fused_first_output_on_ort(model, fuse_reductions, feeds)
    assert result.fused == 1
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), atol=2e-3)


@pytest.mark.parametrize("cuda, nvrtc", [(True, True), (True, False), (False, True)])
def test_the_fusions_default_to_on_for_training_steps_where_the_cuda_kernels_run(library, monkeypatch, cuda, nvrtc):
    """fuse_elementwise / fuse_reductions None (the default): a training step built with the fused
    ops gets BlockReduceSum where the library's CUDA kernels run here and FusedElementwise where
    NVRTC is there too (the machine's facts faked: this one has no GPU); a step built with
    standard ops never; an explicit False wins; an inference model's are decided by their
    predicted cost where the kernels run (``tests/rewrites/test_decisions.py``), else off.
    The written step loads on ORT's CPU (wiring)."""
    from onnxcampo import ops

    monkeypatch.setattr(ops, "cuda_kernels_here", lambda: cuda)
    monkeypatch.setattr(ops, "generated_kernels_here", lambda: cuda and nvrtc)
    label, forward = next(iter(_forward_models()))
    step = build_train_step(forward, optimizer="adamw")
    result = onnxcampo.optimize(step, policy="campo")
    found = {n.op_type for n in result.model.graph.node}
    assert ("BlockReduceSum" in found) == cuda, label
    assert ("FusedElementwise" in found) == (cuda and nvrtc), label
    assert result.report["rewrites"]["fuse_reductions"]["by"] == ("default" if cuda else "unavailable")
    make_session(result.model, provider="cpu")
    off = onnxcampo.optimize(step, policy="campo", fuse_elementwise=False, fuse_reductions=False)
    assert not {"BlockReduceSum", "FusedElementwise"} & {n.op_type for n in off.model.graph.node}
    inference = onnxcampo.optimize(forward, policy="campo")
    decided = inference.report["rewrites"]
    assert decided["fuse_reductions"]["by"] == ("prediction" if cuda else "unavailable")
    assert decided["fuse_elementwise"]["by"] == ("prediction" if cuda and nvrtc else "unavailable")
    written = {n.op_type for n in inference.model.graph.node}
    assert ("FusedElementwise" in written) == decided["fuse_elementwise"]["on"]
    assert ("BlockReduceSum" in written) <= decided["fuse_reductions"]["on"]
    standard = build_train_step(forward, optimizer="adamw", fused=False)  # built to run without the library
    kept = onnxcampo.optimize(standard, policy="campo")
    assert not {"BlockReduceSum", "FusedElementwise"} & {n.op_type for n in kept.model.graph.node}
    assert {entry["by"] for entry in kept.report["rewrites"].values()} == {"default"}
