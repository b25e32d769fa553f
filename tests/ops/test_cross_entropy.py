"""SoftmaxCrossEntropy / SoftmaxCrossEntropyGrad and the loss fusion of ``--fuse-reductions``.

The CPU kernels against the numpy reference (float64) on ONNX Runtime's CPU provider: float32 and
float16 logits and outputs, padded rows, labels counted from the end and out of range, one scale
or one per row. The rewrite (``onnxcampo.rewrites.loss``) on training steps built by
``build_train_step``: the fused step against the unfused one on ORT CPU (wiring, within float32
rounding) and with the ONNX reference evaluator for a mixed-precision plan (float16 numerics)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from helpers import step_feeds

import onnxcampo
from onnxcampo import ir
from onnxcampo.rewrites.loss import fuse_softmax_cross_entropy
from onnxcampo.ops import xent as ce
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session, run
from onnxcampo.training import build_train_step


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
    batch = {"x": rng.standard_normal((4, 3, 16)).astype(np.float32),
             "labels": rng.integers(0, classes, size=(4, 3)).astype(np.int64)}
    return step_feeds(step, batch, lr=0.1)


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


def _gradient_then(paths: str, dx_shape=(4, 3, 10, 1), padded=16):
    """SoftmaxCrossEntropyGrad (float32, x [4, 3, 16] with 10 classes) followed by ``paths`` (ONNX
    text reading ``dx``): the shape rule 5 sees after a plan's Casts and the padding pass's Pads."""
    text = f"""
    <ir_version: 8, opset_import: ["" : 17, "ai.onnxcampo" : 1]>
    g (float[4,3,{padded}] x, float[4,3] lse, int64[4,3] labels, float[1] scale, float16[{padded},32] w,
       float16[12,32] a) => (float16[12,32] dxw, float16[32,{padded}] dw) {{
      dx = ai.onnxcampo.SoftmaxCrossEntropyGrad <classes = 10, output_type = 1,
                                                 output_shape = [{", ".join(map(str, dx_shape))}]> (x, lse, labels, scale)
      {paths}
    }}"""
    model = onnx.parser.parse_model(text)
    for name, values in (("s1", [1, 4, 3, 10]), ("s2", [12, 10]), ("pads4", [0, 0, 0, 0, 0, 0, 0, padded - 10]),
                         ("pads2", [0, 0, 0, padded - 10])):
        model.graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))
    ir.name_nodes(model)
    return model


GPT2_LIKE = """
      seed = Reshape(dx, s1)
      seed16 = Cast <to = 10> (seed)
      seed_padded = Pad(seed16, pads4)
      m = MatMul(seed_padded, w)
      dxw = Reshape(m, s2m)
      rows = Reshape(seed, s2)
      rows16 = Cast <to = 10> (rows)
      rows_padded = Pad(rows16, pads2)
      dw = Gemm <transA = 1> (a, rows_padded)"""


def _fold(model):
    from onnxcampo.rewrites.loss import LossFusionResult, _fold_gradient_casts_and_pads

    model.graph.initializer.append(numpy_helper.from_array(np.array([12, 32], np.int64), "s2m"))
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    info, _ = ir.infer_tensor_info(folded)
    result = LossFusionResult()
    grad = next(n for n in folded.graph.node if n.op_type == ce.GRAD)
    _fold_gradient_casts_and_pads(folded, grad, info, result)
    return folded, result


def _gradient_feeds(seed=1):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((4, 3, 16)) * 3).astype(np.float32)
    lse = np.log(np.exp(x[..., :10].astype(np.float64)).sum(-1)).astype(np.float32)
    return {"x": x, "lse": lse, "labels": rng.integers(0, 10, (4, 3)).astype(np.int64),
            "scale": np.float32([512.0]), "w": rng.standard_normal((16, 32)).astype(np.float16),
            "a": rng.standard_normal((12, 32)).astype(np.float16)}


def test_rule_5_writes_the_padded_float16_gradient_and_the_casts_and_pads_go():
    """The LM head's backward as the plan and the padding pass leave it (GPT-2: dx [8, 256, 50257,
    1] float32, a Reshape, two Casts to float16 and two Pads of the class axis to 50264, for the
    dX MatMul's K and the weight gradient Gemm's N): the op writes float16 rows of 16, the Casts and
    Pads go, and every output is the same bits (reference evaluator)."""
    model = _gradient_then(GPT2_LIKE)
    folded, result = _fold(model)
    onnx.checker.check_model(folded)
    ops = [n.op_type for n in folded.graph.node]
    assert "Cast" not in ops and "Pad" not in ops and (result.gradient_casts, result.gradient_pads) == (2, 2)
    grad = next(n for n in folded.graph.node if n.op_type == ce.GRAD)
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    assert attrs["output_type"] == F16 and attrs["output_columns"] == 16 and attrs["output_shape"] == [4, 3, 16, 1]
    info, _ = ir.infer_tensor_info(folded)
    assert info["seed"].dtype == F16 and tuple(info["seed"].shape) == (1, 4, 3, 16)
    assert tuple(info["rows"].shape) == (12, 16)
    assert {"s1", "s2"}.isdisjoint({t.name for t in folded.graph.initializer})  # the old shapes went
    feeds = _gradient_feeds()
    want = ReferenceEvaluator(model, new_ops=ce.reference_ops()).run(None, feeds)
    got = ReferenceEvaluator(folded, new_ops=ce.reference_ops()).run(None, feeds)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and np.array_equal(w.view(np.uint16), g.view(np.uint16))


def test_rule_5_folds_the_casts_alone_when_nothing_pads():
    paths = GPT2_LIKE.replace("seed_padded = Pad(seed16, pads4)\n      m = MatMul(seed_padded, w)",
                              "m = MatMul(seed16, w)")
    paths = paths.replace("rows_padded = Pad(rows16, pads2)\n      dw = Gemm <transA = 1> (a, rows_padded)",
                          "dw = Gemm <transA = 1> (a, rows16)")
    assert "Pad" not in paths  # GPT2_LIKE without its Pads
    model = _gradient_then(paths, padded=10)
    folded, result = _fold(model)
    assert (result.gradient_casts, result.gradient_pads) == (2, 0)
    grad = next(n for n in folded.graph.node if n.op_type == ce.GRAD)
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    assert attrs["output_type"] == F16 and "output_columns" not in attrs
    feeds = _gradient_feeds()
    feeds["x"], feeds["w"] = feeds["x"][..., :10].copy(), feeds["w"][:10].copy()
    want = ReferenceEvaluator(model, new_ops=ce.reference_ops()).run(None, feeds)
    got = ReferenceEvaluator(folded, new_ops=ce.reference_ops()).run(None, feeds)
    for w, g in zip(want, got):
        assert np.array_equal(w.view(np.uint16), g.view(np.uint16))


@pytest.mark.parametrize("change", ["float32 reader", "two widths", "pad before the classes", "no cast"])
def test_rule_5_leaves_other_gradients_alone(change):
    """A path without the Cast keeps everything; Pads of two widths or of another axis keep the
    Pads (the Casts still go)."""
    paths = GPT2_LIKE
    if change == "float32 reader":  # a path without the Cast to float16
        paths = paths.replace("rows16 = Cast <to = 10> (rows)\n      rows_padded = Pad(rows16, pads2)",
                              "rows_padded = Pad(rows, pads2)").replace("(a, rows_padded)", "(a32, rows_padded)")
        paths += "\n      a32 = Cast <to = 1> (a)"
    elif change == "two widths":
        paths = paths.replace("Pad(rows16, pads2)", "Pad(rows16, pads2b)")
    elif change == "pad before the classes":
        paths = paths.replace("Pad(rows16, pads2)", "Pad(rows16, pads2c)")
    else:
        paths = paths.replace("Cast <to = 10> (seed)", "Identity(seed)").replace("Cast <to = 10> (rows)",
                                                                                  "Identity(rows)")
    model = _gradient_then(paths)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0, 0, 0, 8], np.int64), "pads2b"),
                                    numpy_helper.from_array(np.array([0, 0, 2, 4], np.int64), "pads2c")])
    folded, result = _fold(model)
    if change in ("two widths", "pad before the classes"):  # the Casts go, the Pads stay
        assert (result.gradient_casts, result.gradient_pads) == (2, 0)
        assert [n.op_type for n in folded.graph.node] == [n.op_type for n in model.graph.node if n.op_type != "Cast"]
        return
    assert (result.gradient_casts, result.gradient_pads) == (0, 0)
    assert [n.op_type for n in folded.graph.node] == [n.op_type for n in model.graph.node]


def test_the_gradient_kernel_pads_its_rows_on_the_cpu(library):
    """output_columns on ORT's CPU provider: the first classes columns as without it, zeros after."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((6, 13)) * 3).astype(np.float32)
    labels = rng.integers(0, 11, 6).astype(np.int64)
    lse = np.log(np.exp(x[:, :11].astype(np.float64)).sum(-1)).astype(np.float32)
    outputs = {}
    for columns in (None, 16):
        node = op_nodes.softmax_cross_entropy_grad("x", "lse", "labels", "scale", output="dx", classes=11,
                                                   output_type=F16, output_columns=columns, name="grad")
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F32, [6, 13]),
                                                helper.make_tensor_value_info("lse", F32, [6]),
                                                helper.make_tensor_value_info("labels", TensorProto.INT64, [6]),
                                                helper.make_tensor_value_info("scale", F32, [1])],
                                  [helper.make_tensor_value_info("dx", F16, [6, columns or 11])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        op_nodes.import_domain(model)
        outputs[columns] = run(make_session(model), {"x": x, "lse": lse, "labels": labels,
                                                     "scale": np.float32([2.0])})["dx"]
    assert outputs[16].shape == (6, 16) and not outputs[16][:, 11:].any()
    np.testing.assert_array_equal(outputs[16][:, :11].view(np.uint16), outputs[None].view(np.uint16))
    want = ce.grad(x, lse, labels, np.float32([2.0]), classes=11, output_type=F16, output_columns=16)
    np.testing.assert_allclose(outputs[16].astype(np.float32), want.astype(np.float32), rtol=2 ** -10, atol=2 ** -14)


def test_rule_5_with_another_reader_unpadded_folds_the_casts_and_keeps_the_pad():
    """One path ends at a node that is not a MatMul over the classes (a Relu here), the other at
    a Pad of N: the op writes float16 rows of C, both Casts go and the Pad stays (reading the
    float16 view); the same bits."""
    paths = GPT2_LIKE.replace("seed_padded = Pad(seed16, pads4)\n      m = MatMul(seed_padded, w)",
                              "r = Relu(seed16)\n      m = MatMul(r, w10)")
    model = _gradient_then(paths)
    model.graph.input.append(helper.make_tensor_value_info("w10", F16, [10, 32]))
    folded, result = _fold(model)
    assert (result.gradient_casts, result.gradient_pads, result.gradient_matmuls) == (2, 0, 0)
    assert [n.op_type for n in folded.graph.node].count("Pad") == 1
    grad = next(n for n in folded.graph.node if n.op_type == ce.GRAD)
    attrs = {a.name: helper.get_attribute_value(a) for a in grad.attribute}
    assert attrs["output_type"] == F16 and "output_columns" not in attrs
    feeds = _gradient_feeds()
    feeds["w10"] = feeds["w"][:10].copy()
    want = ReferenceEvaluator(model, new_ops=ce.reference_ops()).run(None, feeds)
    got = ReferenceEvaluator(folded, new_ops=ce.reference_ops()).run(None, feeds)
    for w, g in zip(want, got):
        assert np.array_equal(w.view(np.uint16), g.view(np.uint16))


def test_rule_5b_pads_the_b_of_a_matmul_whose_k_is_the_classes():
    """GPT-2 as the H200 plan leaves it: the dX MatMul reads the gradient unpadded (K = classes),
    the weight gradient's Gemm through a Pad of N. The MatMul's B gets zero rows to the Pad's
    width, so the op writes padded float16 rows, the Casts and the Pad go, and K is aligned; the
    values are the unfused ones (zeros add nothing; the reference evaluator sums in another order)."""
    paths = GPT2_LIKE.replace("seed_padded = Pad(seed16, pads4)\n      m = MatMul(seed_padded, w)",
                              "m = MatMul(seed16, w10)")
    model = _gradient_then(paths)
    model.graph.input.append(helper.make_tensor_value_info("w10", F16, [10, 32]))
    folded, result = _fold(model)
    onnx.checker.check_model(folded)
    assert (result.gradient_casts, result.gradient_pads, result.gradient_matmuls) == (2, 1, 1)
    ops = [n.op_type for n in folded.graph.node]
    assert "Cast" not in ops and ops.count("Pad") == 1  # the one on the MatMul's B
    pad = next(n for n in folded.graph.node if n.op_type == "Pad")
    assert pad.input[0] == "w10" and ops.index("Pad") < ops.index("MatMul")
    grad = next(n for n in folded.graph.node if n.op_type == ce.GRAD)
    assert {a.name: helper.get_attribute_value(a) for a in grad.attribute}["output_columns"] == 16
    feeds = _gradient_feeds()
    feeds["w10"] = feeds["w"][:10].copy()
    want = ReferenceEvaluator(model, new_ops=ce.reference_ops()).run(None, feeds)
    got = ReferenceEvaluator(folded, new_ops=ce.reference_ops()).run(None, feeds)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2 ** -9, atol=2 ** -9)


def test_rule_5b_reads_the_forward_pad_of_a_transposed_weight_instead_of_adding_a_pad():
    """GPT-2's dX MatMul reads B = Transpose(W16) where the LM head's forward already pads W16 [32,
    10] to [32, 16]: the Transpose reads that padded weight and no Pad is added."""
    paths = GPT2_LIKE.replace("seed_padded = Pad(seed16, pads4)\n      m = MatMul(seed_padded, w)",
                              "wt = Transpose <perm = [1, 0]> (wf)\n      m = MatMul(seed16, wt)\n"
                              "      wf_padded = Pad(wf, pads2)\n      fwd = MatMul(a, wf_padded)")
    model = _gradient_then(paths)
    model.graph.input.append(helper.make_tensor_value_info("wf", F16, [32, 10]))
    model.graph.output.append(helper.make_tensor_value_info("fwd", F16, [12, 16]))
    folded, result = _fold(model)
    onnx.checker.check_model(folded)
    assert (result.gradient_casts, result.gradient_pads, result.gradient_matmuls, result.gradient_transposes) == \
        (2, 1, 1, 1)
    ops = [n.op_type for n in folded.graph.node]
    assert ops.count("Pad") == 1  # the forward's, no other
    transpose = next(n for n in folded.graph.node if n.op_type == "Transpose")
    assert transpose.input[0] == "wf_padded" and ops.index("Pad") < ops.index("Transpose")
    info, _ = ir.infer_tensor_info(folded)
    assert tuple(info["wt"].shape) == (16, 32)
    feeds = _gradient_feeds()
    feeds["wf"] = feeds["w"][:10].T.copy()
    want = ReferenceEvaluator(model, new_ops=ce.reference_ops()).run(None, feeds)
    got = ReferenceEvaluator(folded, new_ops=ce.reference_ops()).run(None, feeds)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=2 ** -9, atol=2 ** -9)
