"""LayerNormGrad and the layer-norm fusion of ``--fuse-reductions``.

The CPU kernel against the numpy reference (float64) on ONNX Runtime's CPU provider, float16 and
float32 tensors mixed, with and without the residual ``acc``; the rewrite
(``onnxcampo.rewrites.norm``) on training steps of a small transformer block built by
``build_train_step``: fused against unfused on ORT CPU (wiring, within float32 rounding) and, for
the fp16 plan, with the ONNX reference evaluator (float16 numerics)."""

from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from helpers import step_feeds

import onnxcampo
from onnxcampo.rewrites.norm import fuse_layer_norm_grad
from onnxcampo.ops.norm import layer_norm as ln
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step


F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}


@pytest.mark.parametrize("types, acc", [((F32,) * 5, True), ((F16,) * 5, True), ((F16, F16, F32, F16, F32), False),
                                        ((F32, F16, F16, F32, F16), True)])
def test_the_cpu_kernel_matches_numpy(library, types, acc):
    rng = np.random.default_rng(len(types) + acc)
    shapes = [(4, 5, 96, 1), (4, 5, 96, 1), (4, 5, 1, 1), (96, 1), (4, 5, 96, 1)]
    values = [rng.standard_normal(s).astype(NUMPY[t]) for s, t in zip(shapes, types)]
    values[2] = (np.abs(values[2]) + 0.5).astype(values[2].dtype)
    names = ["dy", "xhat", "invstd", "gamma", "acc"][:5 if acc else 4]
    out_type = types[4]
    node = op_nodes.layer_norm_grad(*names[:4], acc="acc" if acc else None, output="dx", output_type=out_type,
                                    name="grad")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, list(v.shape))
                                            for n, t, v in zip(names, types, values)],
                              [helper.make_tensor_value_info("dx", out_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    op_nodes.import_domain(model)
    got = run(make_session(model), dict(zip(names, values)))["dx"]
    want = ln.reference(*values[:4], values[4] if acc else None, output_type=out_type)
    assert got.dtype == NUMPY[out_type] and got.shape == (4, 5, 96, 1)
    tol = 2.0 ** -10 if out_type == F16 else 2e-6
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * scale)


def _block():
    """A pre-norm residual block: a = MatMul(x); r = a + MatMul(LayerNormalization(a)); y =
    LayerNormalization(r). The first norm's input gradient meets the residual stream's in a Sum."""
    rng = np.random.default_rng(5)

    def init(name, shape, scale=0.2, shift=0.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale + shift).astype(np.float32), name)

    nodes = [helper.make_node("MatMul", ["x", "W0"], ["a"]),
             helper.make_node("LayerNormalization", ["a", "g1", "b1"], ["n1"], axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n1", "W1"], ["h"]), helper.make_node("Add", ["a", "h"], ["r"]),
             helper.make_node("LayerNormalization", ["r", "g2", "b2"], ["y"], axis=-1, epsilon=1e-5)]
    inits = [init("W0", [32, 32]), init("W1", [32, 32]), init("g1", [32], 0.1, 1.0), init("b1", [32], 0.1),
             init("g2", [32], 0.1, 1.0), init("b2", [32], 0.1)]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", F32, [4, 8, 32])],
                              [helper.make_tensor_value_info("y", F32, [4, 8, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(step, seed=0):
    """x and labels (mse targets) at random, the rest as :func:`helpers.step_feeds` gives them (lr 0.05)."""
    rng = np.random.default_rng(seed)
    batch = {value.name: rng.standard_normal([d.dim_value for d in value.type.tensor_type.shape.dim]).astype(np.float32)
             for value in step.graph.input if value.name in ("x", "labels")}
    return step_feeds(step, batch, lr=0.05)


def _fused(model):
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    return fused, fuse_layer_norm_grad(fused)


def test_a_training_step_fuses_its_layer_norm_gradients_with_the_unfused_values_on_ort_cpu(library):
    step = build_train_step(_block(), loss="mse", optimizer="momentum")
    fused, result = _fused(step)
    onnx.checker.check_model(fused)
    assert result.fused == 2 and result.sums == 1  # the first layer norm's gradient meets the residual's
    ops = [n.op_type for n in fused.graph.node]
    before = [n.op_type for n in step.graph.node]
    assert ops.count("LayerNormGrad") == 2 and before.count("ReduceMean") - ops.count("ReduceMean") == 4  # the loss's stays
    feeds = _feeds(step)
    want, got = run(make_session(step), feeds), run(make_session(fused), feeds)
    assert list(want) == list(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=3e-6, atol=3e-6, err_msg=name)


def test_the_fp16_plan_fuses_with_the_values_of_the_reference_evaluator(library):
    """Float16 numerics: the planned step with the ONNX reference evaluator, unfused against fused
    (the fused op rounds once where the plan rounds each node to float16)."""
    step = build_train_step(_block(), loss="mse", optimizer="momentum", fused=False)  # standard ops
    planned = onnxcampo.optimize(step, policy="fp16", fuse_reductions=False, fuse_elementwise=False).model
    fused, result = _fused(planned)
    assert result.fused == 2
    feeds = _feeds(planned, 1)
    want = ReferenceEvaluator(planned).run(None, feeds)
    got = ReferenceEvaluator(fused, new_ops=[ln.reference_op()]).run(None, feeds)
    for name, w, g in zip([o.name for o in planned.graph.output], want, got):
        w64, g64 = w.astype(np.float64), g.astype(np.float64)
        np.testing.assert_allclose(g64, w64, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(w64).max())), err_msg=name)
    make_session(fused)  # loads on ORT


def test_optimize_reports_the_layer_norm_fusion(library):
    step = build_train_step(_block(), loss="mse", optimizer="momentum")
    result = onnxcampo.optimize(step, policy="campo", fuse_reductions=True, fuse_elementwise=True)
    norms = result.report["fuse_reductions"]["layer_norms"]
    assert norms["layer_norm_grad"] == 2 and norms["sums_folded"] == 1 and norms["nodes_replaced"] >= 17
    make_session(result.model)


def test_a_changed_pattern_is_left_alone(library):
    step = build_train_step(_block(), loss="mse", optimizer="momentum")
    exposed = onnx.ModelProto()
    exposed.CopyFrom(step)
    mean = next(n for n in exposed.graph.node if n.op_type == "ReduceMean" and not n.name.startswith("loss"))
    exposed.graph.output.append(helper.make_tensor_value_info(mean.output[0], F32, None))  # a mean read outside
    assert fuse_layer_norm_grad(exposed).fused == 1
    inference = _block()
    assert fuse_layer_norm_grad(inference).fused == 0


@pytest.mark.parametrize("dy_type, y_type, out_type, scale", [(F32, F32, F32, 1.0), (F16, F16, F16, 0.125),
                                                               (F32, F16, F16, 0.5)])
def test_the_softmax_grad_cpu_kernel_matches_numpy(library, dy_type, y_type, out_type, scale):
    from onnxcampo.ops.norm import softmax as sm

    rng = np.random.default_rng(7)
    dy = rng.standard_normal((3, 4, 50, 1)).astype(NUMPY[dy_type])
    logits = rng.standard_normal((3, 4, 50, 1))
    y = (np.exp(logits) / np.exp(logits).sum(axis=2, keepdims=True)).astype(NUMPY[y_type])
    node = op_nodes.softmax_grad("dy", "y", output="dx", cols=50, scale=scale, output_type=out_type, name="sg")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("dy", dy_type, list(dy.shape)),
                                            helper.make_tensor_value_info("y", y_type, list(y.shape))],
                              [helper.make_tensor_value_info("dx", out_type, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    op_nodes.import_domain(model)
    got = run(make_session(model), {"dy": dy, "y": y})["dx"]
    want = sm.reference(dy, y, cols=50, scale=scale, output_type=out_type)
    assert got.dtype == NUMPY[out_type] and got.shape == dy.shape
    tol = 2.0 ** -10 if out_type == F16 else 2e-6
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def _attention():
    """x [2, 6, 16]: scores = MatMul(q, k^T) * 0.25, Softmax over the last axis, MatMul with v."""
    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), n) for n in ("Wq", "Wk")]
    inits.append(numpy_helper.from_array(np.array(0.25, np.float32), "scale"))
    nodes = [helper.make_node("MatMul", ["x", "Wq"], ["q"]), helper.make_node("MatMul", ["x", "Wk"], ["k"]),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["ss"]), helper.make_node("Softmax", ["ss"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "x"], ["y"])]
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", F32, [2, 6, 16])],
                              [helper.make_tensor_value_info("y", F32, [2, 6, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_softmax_gradient_fuses_with_the_unfused_values_on_ort_cpu(library):
    step = build_train_step(_attention(), loss="mse", optimizer="momentum")
    fused, result = _fused(step)
    onnx.checker.check_model(fused)
    assert result.softmax == 1 and result.fused == 0
    assert "SoftmaxGrad" in [n.op_type for n in fused.graph.node]
    feeds = _feeds(step)
    want, got = run(make_session(step), feeds), run(make_session(fused), feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=3e-6, atol=3e-6, err_msg=name)


def test_the_option_off_leaves_the_row_gradients_unfused(library):
    step = build_train_step(_block(), loss="mse", optimizer="momentum")
    off = onnxcampo.optimize(step, policy="campo", fuse_reductions=True, fuse_elementwise=False,
                             experimental={"fuse_row_gradients": False})
    assert off.report["fuse_reductions"]["layer_norms"]["layer_norm_grad"] == 0
    assert "LayerNormGrad" not in {n.op_type for n in off.model.graph.node}


@pytest.mark.parametrize("policy", ["fp16", "campo"])
def test_planned_steps_with_the_row_gradients_fused_run_on_ort_cpu_with_the_unfused_values(library, policy):
    """Wiring on ORT CPU (which computes float16 nodes in float32): a planned block step with
    LayerNormGrad against the planned step without."""
    step = build_train_step(_block(), loss="mse", optimizer="momentum")
    fused = onnxcampo.optimize(step, policy=policy, fuse_reductions=True, fuse_elementwise=False)
    plain = onnxcampo.optimize(step, policy=policy, fuse_reductions=False, fuse_elementwise=False)
    assert fused.report["fuse_reductions"]["layer_norms"]["layer_norm_grad"] == 2
    feeds = _feeds(fused.model)
    want, got = run(make_session(plain.model), feeds), run(make_session(fused.model), feeds)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64), rtol=2e-3, atol=2e-3,
                                   err_msg=name)
