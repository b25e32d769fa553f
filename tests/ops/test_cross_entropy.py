"""SoftmaxCrossEntropy / SoftmaxCrossEntropyGrad and the loss fusion of ``--fuse-reductions``.

The CPU kernels against the numpy reference (float64) on ONNX Runtime's CPU provider: float32 and
float16 logits and outputs, padded rows, labels counted from the end and out of range, one scale
or one per row. The rewrite (``onnxcampo.loss_fusion``) on training steps built by
``build_train_step``: the fused step against the unfused one on ORT CPU (wiring, within float32
rounding) and with the ONNX reference evaluator for a mixed-precision plan (float16 numerics)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxcampo
from onnxcampo import ir
from onnxcampo.loss_fusion import fuse_softmax_cross_entropy
from onnxcampo.ops import cross_entropy as ce
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step

from reference import check_script_passes_on_the_cpu

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}


def _op_model(x_type, out_type, x_shape, classes, scale_shape):
    rows = list(x_shape[:-1])
    forward = op_nodes.softmax_cross_entropy("x", "labels", picked="picked", lse="lse", classes=classes,
                                             output_type=out_type, name="forward")
    grad = op_nodes.softmax_cross_entropy_grad("x", "lse", "labels", "scale", output="dx", classes=classes,
                                               output_type=out_type, name="grad")
    # a Reshape after each output: ORT needs their types and ranks from the ops' shape inference
    shape = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    after = [helper.make_node("Reshape", [name, "flat"], [f"{name}_flat"]) for name in ("picked", "lse", "dx")]
    graph = helper.make_graph(
        [forward, grad, *after], "xent",
        [helper.make_tensor_value_info("x", x_type, list(x_shape)),
         helper.make_tensor_value_info("labels", TensorProto.INT64, rows),
         helper.make_tensor_value_info("scale", F32, list(scale_shape))],
        [helper.make_tensor_value_info(f"{n}_flat", t, None) for n, t in (("picked", out_type), ("lse", F32),
                                                                           ("dx", out_type))], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    op_nodes.import_domain(model)
    return model


@pytest.mark.parametrize("x_type, out_type, width, classes, per_row", [
    (F32, F32, 7, None, False), (F16, F16, 12, 9, True), (F16, F32, 3001, 2999, True), (F32, F16, 40, 33, False)])
def test_the_cpu_kernels_match_numpy(library, x_type, out_type, width, classes, per_row):
    rng = np.random.default_rng(width)
    c = width if classes is None else classes
    x = (rng.standard_normal((3, 5, width)) * 4).astype(NUMPY[x_type])
    x[..., c:] = 1e4 if x_type == F32 else 6e4  # padding columns: never read
    labels = rng.integers(-c - 2, c + 2, size=(3, 5)).astype(np.int64)
    labels[0, :3] = [-1, c, -c - 1]  # counted from the end, just past the end, before the start
    scale = rng.standard_normal((3, 5, 1)).astype(np.float32) if per_row else np.float32([0.25])
    out = run(make_session(_op_model(x_type, out_type, x.shape, classes, scale.shape)),
              {"x": x, "labels": labels, "scale": scale})
    picked, lse = ce.forward(x, labels, classes=classes, output_type=out_type)
    dx = ce.grad(x, lse, labels, scale, classes=classes, output_type=out_type)
    assert out["picked_flat"].dtype == NUMPY[out_type] and out["dx_flat"].size == 15 * c
    assert picked.reshape(-1)[1] == 0 and picked.reshape(-1)[2] == 0  # the invalid labels
    tol = 2.0 ** -10 if out_type == F16 else 2e-6
    np.testing.assert_allclose(out["lse_flat"], lse.reshape(-1), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(out["picked_flat"].astype(np.float64), picked.reshape(-1).astype(np.float64),
                               rtol=tol, atol=tol * 16)
    np.testing.assert_allclose(out["dx_flat"].astype(np.float64), dx.reshape(-1).astype(np.float64), rtol=tol,
                               atol=tol)
    # the gradient rows of valid labels add up to zero (the softmax sums to one)
    rows = dx.reshape(15, c).astype(np.float64)
    valid = (picked.reshape(-1) != 0)
    np.testing.assert_allclose(rows[valid].sum(axis=1), 0.0, atol=1e-2 if out_type == F16 else 1e-5)


def _classifier(classes=10, pad_to=None):
    """A linear classifier [4, 3, 16] -> [4, 3, classes]; with ``pad_to`` its weight is wider and a
    Slice cuts the logits (the shape the padding pass gives an LM head)."""
    rng = np.random.default_rng(3)
    width = pad_to or classes
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "V"], ["wide" if pad_to else "logits"])]
    inits = [numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype(np.float32), "W"),
             numpy_helper.from_array((rng.standard_normal((32, width)) * 0.3).astype(np.float32), "V")]
    if pad_to:
        for name, value in (("s0", [0]), ("s1", [classes]), ("s2", [-1])):
            inits.append(numpy_helper.from_array(np.array(value, np.int64), name))
        nodes.append(helper.make_node("Slice", ["wide", "s0", "s1", "s2"], ["logits"]))
    graph = helper.make_graph(nodes, "classifier", [helper.make_tensor_value_info("x", F32, [4, 3, 16])],
                              [helper.make_tensor_value_info("logits", F32, [4, 3, classes])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _feeds(step, classes, seed=0):
    """x and labels at random, the weights their starting values, their momenta zero, lr 0.1 and
    (mixed-precision steps) a loss scale of 1024."""
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((4, 3, 16)).astype(np.float32),
             "labels": rng.integers(0, classes, size=(4, 3)).astype(np.int64)}
    initial = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer}
    for value in step.graph.input:
        name = value.name
        if name in feeds:
            continue
        if f"onnxcampo.initial/{name}" in initial:
            feeds[name] = initial[f"onnxcampo.initial/{name}"]
        elif name == "lr":
            feeds[name] = np.array(0.1, np.float32)
        elif name == "loss_scale":
            feeds[name] = np.array(1024.0, np.float32)
        else:
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            feeds[name] = np.zeros(dims, onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
    return feeds


def _fused(step):
    fused = onnx.ModelProto()
    fused.CopyFrom(step)
    return fused, fuse_softmax_cross_entropy(fused)


@pytest.mark.parametrize("pad_to", [None, 16], ids=["plain", "padded-logits"])
def test_a_cross_entropy_step_fuses_and_gives_the_unfused_values_on_ort_cpu(library, pad_to):
    step = build_train_step(_classifier(pad_to=pad_to), loss="cross_entropy", optimizer="momentum")
    fused, result = _fused(step)
    onnx.checker.check_model(fused)
    assert (result.forward, result.backward, result.slices) == (1, 1, 1 if pad_to else 0)
    ops = [n.op_type for n in fused.graph.node]
    assert not {"LogSoftmax", "OneHot", "Exp"} & set(ops)
    forward = next(n for n in fused.graph.node if n.op_type == ce.FORWARD)
    assert forward.input[0] == ("wide" if pad_to else "logits")  # read past the Slice
    assert "Slice" not in ops  # the prediction's Slice goes; evaluation slices it back (metadata)
    recorded = ir.metadata(fused, ir.PREDICTION_SLICE_KEY)
    assert (json.loads(recorded) == {"input": "wide", "columns": 10}) if pad_to else recorded is None
    feeds = _feeds(step, 10)
    a, b = make_session(step), make_session(fused)
    want, got = run(a, feeds), run(b, feeds)
    assert list(want) == list(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=2e-6, err_msg=name)


def test_a_mixed_precision_plan_folds_the_logits_cast_with_the_values_of_the_reference_evaluator(library):
    """The fp16 plan's LM-head MatMul writes float16 logits that a Cast widens for the fp32 loss:
    the fused op reads the float16 logits (exact). Float16 numerics: the ONNX reference evaluator."""
    step = build_train_step(_classifier(), loss="cross_entropy", optimizer="momentum", fused=False)  # standard ops
    planned = onnxcampo.optimize(step, policy="fp16", fuse_reductions=False, fuse_elementwise=False).model
    fused, result = _fused(planned)
    assert (result.forward, result.backward, result.casts) == (1, 1, 1)
    forward = next(n for n in fused.graph.node if n.op_type == ce.FORWARD)
    info, _ = ir.infer_tensor_info(fused)
    assert info[forward.input[0]].dtype == F16
    feeds = _feeds(planned, 10)
    want = ReferenceEvaluator(planned).run(None, feeds)
    got = ReferenceEvaluator(fused, new_ops=ce.reference_ops()).run(None, feeds)
    for name, w, g in zip([o.name for o in planned.graph.output], want, got):
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-5, atol=1e-6, err_msg=name)
    make_session(fused)  # and it loads on ORT (the fused ops' outputs typed by their inference)


def test_the_optimize_pass_reports_the_loss_fusion(library):
    step = build_train_step(_classifier(), loss="cross_entropy", optimizer="momentum")
    result = onnxcampo.optimize(step, policy="campo", fuse_reductions=True, fuse_elementwise=False)
    loss = result.report["fuse_reductions"]["loss"]
    assert loss["softmax_cross_entropy"] == 1 and loss["softmax_cross_entropy_grad"] == 1
    assert loss["nodes_replaced"] >= 10
    off = onnxcampo.optimize(step, policy="campo", fuse_reductions=False, fuse_elementwise=False)
    assert ce.FORWARD not in {n.op_type for n in off.model.graph.node}


def test_a_log_softmax_read_elsewhere_or_another_loss_is_left_alone(library):
    step = build_train_step(_classifier(), loss="cross_entropy", optimizer="momentum")
    exposed = onnx.ModelProto()
    exposed.CopyFrom(step)
    exposed.graph.output.append(helper.make_tensor_value_info("loss/logp", F32, [4, 3, 10]))
    assert fuse_softmax_cross_entropy(exposed).forward == 0
    mse = build_train_step(_classifier(), loss="mse", optimizer="momentum")
    assert fuse_softmax_cross_entropy(mse).forward == 0


def test_the_cuda_check_script_passes_on_the_cpu(library, tmp_path):
    """scripts/check_cross_entropy_cuda.py (run on the GPU machine) on the CPU provider."""
    check_script_passes_on_the_cpu("check_cross_entropy_cuda.py", library, tmp_path)


@pytest.mark.parametrize("policy", ["fp16", "campo"])
def test_planned_steps_with_every_fusion_run_on_ort_cpu_with_the_unfused_values(library, policy):
    """Wiring on ORT CPU (which computes float16 nodes in float32): the planned step with both
    fusions against the planned step without, the padded logits included."""
    step = build_train_step(_classifier(pad_to=16), loss="cross_entropy", optimizer="momentum")
    fused = onnxcampo.optimize(step, policy=policy, fuse_reductions=True, fuse_elementwise=True)
    plain = onnxcampo.optimize(step, policy=policy, fuse_reductions=False, fuse_elementwise=False)
    assert fused.report["fuse_reductions"]["loss"]["softmax_cross_entropy_grad"] == 1
    feeds = _feeds(fused.model, 10)
    want, got = run(make_session(plain.model), feeds), run(make_session(fused.model), feeds)
    for name in want:
        np.testing.assert_allclose(got[name].astype(np.float64), want[name].astype(np.float64), rtol=2e-3, atol=2e-3,
                                   err_msg=name)


def test_evaluation_of_a_fused_step_gives_the_unfused_loss_and_prediction(library):
    """Trainer.evaluate's graph (the step pruned to the prediction and the loss) keeps the fused
    forward op and gets back the padded head's Slice that the prediction needs."""
    from onnxcampo.training.evaluate import eval_model

    step = build_train_step(_classifier(pad_to=16), loss="cross_entropy", optimizer="momentum")
    fused, result = _fused(step)
    assert result.forward == 1
    feeds = _feeds(step, 10)
    outputs = {}
    for model in (step, fused):
        evaluation = eval_model(model, with_loss=True)
        names = {i.name for i in evaluation.graph.input}
        outputs[id(model)] = run(make_session(evaluation), {k: v for k, v in feeds.items() if k in names})
    want, got = outputs[id(step)], outputs[id(fused)]
    evaluated = {n.op_type for n in eval_model(fused, with_loss=True).graph.node}
    assert ce.FORWARD in evaluated and "Slice" in evaluated
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=2e-6, err_msg=name)
