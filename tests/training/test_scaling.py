"""Training steps under mixed precision: fp32 loss and update, dynamic loss scaling."""

from __future__ import annotations

import re

import json

import numpy as np
import onnx
import pytest

from onnxcampo.api import optimize
from onnxcampo.examples.training_mlp import wide_mlp
from onnxcampo.cli import main
from onnxcampo.plan import Precision, Reason
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec
from onnxcampo.training.scaling import (
    CLEAN_STEPS, LOSS_SCALE, add_loss_scaling, fp32_nodes, has_loss_scaling, initial_state, overhead,
)

from test_step import B1, CLASSES, TARGET, W1, W2, X, mlp

LABELS = {"mse": TARGET, "cross_entropy": CLASSES}


@pytest.fixture(params=[False, True], ids=["standard-ops", "fused-ops"])
def fused(request):
    """Step graphs with the update in standard ops, and with the custom-op library's fused ops
    (then loss scaling unscales with one UnscaleCheckFinite)."""
    return request.param


def feeds(step: onnx.ModelProto, loss: str, *, x=X, scale=None, clean=0.0) -> dict[str, np.ndarray]:
    values = {"x": x, "labels": LABELS[loss], "lr": np.array(0.1, np.float32), "w1": W1, "b1": B1, "w2": W2}
    for name in step_spec(step).state:
        shape = [d.dim_value for i in step.graph.input if i.name == name for d in i.type.tensor_type.shape.dim]
        values[name] = np.full(shape, 0.5, np.float32)  # non-zero state, so "unchanged" means something
    if scale is not None:
        values[LOSS_SCALE] = np.array(scale, np.float32)
        values[CLEAN_STEPS] = np.array(clean, np.float32)
    return values


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
@pytest.mark.parametrize("policy", ["amp", "campo", "fp16"])
def test_loss_and_update_stay_fp32(loss, policy, fused):
    """The loss, its gradient and the optimizer update are fp32 under every mixed policy, while the
    model's own matrix products (forward and backward) are fp16 under amp/fp16."""
    step = build_train_step(mlp(), loss=loss, optimizer="adamw", fused=fused)
    result = optimize(step, policy=policy, experimental={"pad_tensor_cores": False})
    forced = fp32_nodes(step)
    names = {n.name for n in step.graph.node}
    assert {n for n in names if n.startswith(("loss/", "update/")) or "/adam/" in n} <= forced
    for name in forced:
        assert result.plan.precision(name) is Precision.FP32
    if policy != "campo":  # campo may keep this tiny MLP fp32: the casts cost more than they save
        fp16_matmuls = [n.name for n in step.graph.node if n.op_type == "MatMul"
                        and result.plan.precision(n.name) is Precision.FP16]
        assert len(fp16_matmuls) >= 4  # forward and backward
        assert result.report["loss_scaling"] and has_loss_scaling(result.model)
    assert any(result.plan.get(n).reason is Reason.TRAINING_FP32 for n in forced)
    onnx.checker.check_model(result.model, full_check=True)
    io = {i.name: i.type.tensor_type.elem_type for i in (*step.graph.input, *step.graph.output)}
    assert all(io[i.name] == i.type.tensor_type.elem_type for i in result.model.graph.input if i.name in io)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_scaled_step_equals_the_unscaled_one(optimizer, loss, fused):
    """Seeding the backward pass with S and unscaling by 1/S gives the same update; a clean step
    keeps the scale and counts one clean step."""
    plain = build_train_step(mlp(), loss=loss, optimizer=optimizer, fused=fused)
    scaled = build_train_step(mlp(), loss=loss, optimizer=optimizer, fused=fused)
    add_loss_scaling(scaled, init_scale=1024.0, growth_interval=100)
    onnx.checker.check_model(scaled, full_check=True)
    expected = run(make_session(plain), feeds(plain, loss))
    got = run(make_session(scaled), feeds(scaled, loss, scale=1024.0, clean=4.0))
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    assert got[LOSS_SCALE + ".updated"] == 1024.0
    assert got[CLEAN_STEPS + ".updated"] == 5.0
    assert initial_state(scaled) == {LOSS_SCALE: 1024.0}


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
def test_non_finite_gradient_skips_the_step_and_halves_the_scale(optimizer, bad, fused):
    step = build_train_step(mlp(), loss="mse", optimizer=optimizer, fused=fused)
    add_loss_scaling(step, init_scale=256.0, growth_interval=100)
    x = X.copy()
    x[3, 2] = bad
    inputs = feeds(step, "mse", x=x, scale=256.0, clean=7.0)
    out = run(make_session(step), inputs)
    spec = step_spec(step)
    for name in (*spec.weights, *(s for s in spec.state if s not in (LOSS_SCALE, CLEAN_STEPS))):
        np.testing.assert_array_equal(out[name + ".updated"], inputs[name], err_msg=name)
    assert out[LOSS_SCALE + ".updated"] == 128.0
    assert out[CLEAN_STEPS + ".updated"] == 0.0


def test_fp16_overflow_is_caught_and_the_scale_comes_down(fused):
    """An amp step started with a scale so large that the fp16 backward pass overflows: those
    steps change no weight and halve the scale until the gradients fit, then training proceeds."""
    step = build_train_step(mlp(), loss="mse", optimizer="sgd", lr=0.1, fused=fused)
    amp = optimize(step, policy="amp").model
    for prop in amp.metadata_props:
        if prop.key == "onnxcampo.initial_state":
            prop.value = json.dumps({LOSS_SCALE: 2.0 ** 30})
    trainer = Trainer(amp, weights=initial_weights(mlp(), amp))
    before = trainer.state_dict()["w1"]
    trainer.step({"x": X, "labels": TARGET})
    assert trainer.loss_scale == 2.0 ** 29
    np.testing.assert_array_equal(trainer.state_dict()["w1"], before)
    losses = [trainer.step({"x": X, "labels": TARGET}) for _ in range(40)]
    assert 2.0 ** 10 <= trainer.loss_scale <= 2.0 ** 20
    assert losses[-1] < 0.8 * losses[0]


def test_scale_doubles_after_growth_interval_clean_steps(fused):
    step = build_train_step(mlp(), loss="mse", optimizer="sgd", fused=fused)
    add_loss_scaling(step, init_scale=8.0, growth_interval=3)
    trainer = Trainer(step, weights=initial_weights(mlp(), step))
    scales = []
    for _ in range(7):
        trainer.step({"x": X, "labels": TARGET})
        scales.append(trainer.loss_scale)
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_fp32_policy_and_opt_out_add_no_loss_scaling():
    step = build_train_step(mlp(), loss="mse", optimizer="sgd")
    assert not optimize(step, policy="fp32").report["loss_scaling"]
    result = optimize(step, policy="amp", loss_scaling=False)
    assert not has_loss_scaling(result.model) and not result.report["loss_scaling"]
    assert Trainer(step, weights=initial_weights(mlp(), step)).loss_scale is None


@pytest.mark.slow
def test_amp_step_trains_like_fp32_with_loss_scaling(fused):
    """An amp step (fp16 forward/backward, scaled) lowers the loss like the fp32 step on ORT CPU:
    a wiring check of the scaled step (ORT's CPU provider hides fp16 rounding; fp16 numerics are
    checked with the reference evaluator in ``test_fp16_weight_gradient_sums_keep_the_gradients``)."""
    forward = mlp()
    step = build_train_step(forward, loss="cross_entropy", optimizer="adamw", lr=0.01, fused=fused)
    amp = optimize(step, policy="amp").model
    ops_used = {n.op_type for n in amp.graph.node if n.domain == "ai.onnxcampo"}
    assert ops_used == ({"CheckFinite", "MultiTensorAdamW"} if fused else set())
    curves = {}
    for name, model in (("fp32", step), ("amp", amp)):
        trainer = Trainer(model, weights=initial_weights(forward, model))
        curves[name] = [trainer.step({"x": X, "labels": CLASSES}) for _ in range(40)]
    assert curves["amp"][-1] < 0.5 * curves["amp"][0]
    assert curves["amp"][-1] == pytest.approx(curves["fp32"][-1], rel=0.02)


@pytest.mark.slow
def test_train_command_logs_the_loss_scale(tmp_path):
    forward = tmp_path / "mlp.onnx"
    onnx.save(mlp(), forward)
    step_path, amp_path = tmp_path / "step.onnx", tmp_path / "amp.onnx"
    assert main(["train-graph", str(forward), str(step_path), "--loss", "mse"]) == 0
    assert main(["optimize", str(step_path), str(amp_path), "--policy", "amp"]) == 0
    np.savez(tmp_path / "data.npz", x=X, labels=TARGET)
    log = tmp_path / "log.jsonl"
    assert main(["train", str(amp_path), "--forward", str(forward), "--data", str(tmp_path / "data.npz"),
                 "--steps", "5", "--log", str(log)]) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert all(line["loss_scale"] == 65536.0 for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_overhead_counts_what_loss_scaling_adds_and_plans_pay_it(optimizer, fused):
    """overhead() predicts the nodes add_loss_scaling inserts (standard ops: Mul, ReduceSum and a
    Where per tensor; fused: one CheckFinite, a read of every gradient, half a Cast's pass: the
    update unscales), and the plan comparison charges them to the
    mixed plans of a training step, not to fp32."""
    from onnxcampo import ir

    step = build_train_step(mlp(), loss="cross_entropy", optimizer=optimizer, fused=fused)
    info, _ = ir.infer_tensor_info(step)
    cost = overhead(step, lambda name: info[name].numel if name in info else None)
    scaled = onnx.ModelProto()
    scaled.CopyFrom(step)
    add_loss_scaling(scaled)
    assert len(scaled.graph.node) - len(step.graph.node) == cost.nodes
    weights = sum(info[w].numel for w in step_spec(step).weights)
    assert (cost.elements == weights // 2 if fused else cost.elements >= 2 * weights) and (cost.nodes > 20) == (not fused)
    result = optimize(step, policy="amp")
    amp, fp32 = result.report["predicted_us"]["amp"], result.report["predicted_us"]["fp32"]
    # besides its own nodes, scaling keeps live the loss gradient's seed, which ORT folds in fp32
    from helpers import build_context

    from onnxcampo.api import read_executed_graph

    ctx = build_context(step)
    ctx.loss_scaling = cost
    read_executed_graph(ctx)
    from onnxcampo.oplists import ALIASED

    ops = {node.name: node.op_type for node in step.graph.node}
    unfolded = sum(status == "absorbed" and ctx.ort_status.get(name) != status and ops[name] not in ALIASED
                   for name, status in ctx.ort_status_fp32.items())
    assert amp["launched_nodes"] - amp["casts"] - fp32["launched_nodes"] == cost.nodes + unfolded
    # what the plan comparison counts is what runs: the kernels of ORT's own optimized graph of the
    # written fp32 step (aliased ops launch none). Only fp32 is compared: ORT's CPU provider wraps
    # fp16 nodes in Casts of its own, which breaks fusions the CUDA EP makes.
    from onnxcampo.oplists import ALIASED
    from onnxcampo.runtime.optimized import executed_graph

    written = optimize(step, policy="fp32").model
    executed = executed_graph(written)
    kernels = sum(count for op, count in executed.op_counts.items() if op.partition(":")[2] not in ALIASED)
    assert fp32["launched_nodes"] == kernels


def _dtype_read_by(model: onnx.ModelProto, node_name: str) -> int:
    """The element type of the first input of ``node_name`` in ``model`` (shape inference)."""
    from onnxcampo import ir

    info, _ = ir.infer_tensor_info(model)
    node = next(n for n in model.graph.node if n.name == node_name)
    return info[node.input[0]].dtype


@pytest.mark.slow
def test_weight_gradient_sums_read_fp16_under_campo_with_loss_scaling():
    """The bias gradients' ReduceSums (a sum of dy over the batch rows) read campo's fp16 dy as it
    is, so the Cast to fp32 is on the bias-sized result, not on dy; without loss scaling (nothing
    would catch an overflow) and under amp (TensorFlow's lists, the baseline) they stay fp32."""
    from onnx import TensorProto

    from onnxcampo.training.scaling import gradient_sums

    step = build_train_step(wide_mlp(), loss="cross_entropy", optimizer="sgd", fused=False)
    sums = gradient_sums(step)
    by_name = {n.name: n for n in step.graph.node}
    assert len(sums) == 2 and all(by_name[n].op_type == "ReduceSum" for n in sums)
    # every other ReduceSum of the step is no weight gradient's
    assert not sums & {n.name for n in step.graph.node if n.op_type != "ReduceSum"}

    # the products fp16 whatever this machine's cost model says (the H200's makes them fp16 on its own)
    fp16_products = {"include_ops": {"MatMul"}, "experimental": {"pad_tensor_cores": False}}
    campo = optimize(step, policy="campo", **fp16_products)
    # b2's gradient sums the loss gradient (the logits'): part of the loss, fp32 under every policy
    loss_side = sums & fp32_nodes(step)
    assert len(loss_side) == 1 and campo.plan.get(next(iter(loss_side))).reason is Reason.TRAINING_FP32
    sums -= loss_side
    for name in sums:  # b1's
        assert campo.plan.precision(name) is Precision.FP16, name
        assert _dtype_read_by(campo.model, name) == TensorProto.FLOAT16
    unscaled = optimize(step, policy="campo", loss_scaling=False, **fp16_products)
    amp = optimize(step, policy="amp", **fp16_products)
    for result in (unscaled, amp):
        for name in sums:
            assert result.plan.precision(name) is Precision.FP32
            assert result.plan.get(name).reason is Reason.DENY_LIST
    # the same plan but for those sums: the Cast to fp32 moved from dy (rows x width) to the result
    assert _cast_elements(campo.model) == _cast_elements(unscaled.model) - 256 * 512 + 512


def _cast_elements(model: onnx.ModelProto) -> int:
    """Elements all the Casts of ``model`` convert (shape inference)."""
    from onnxcampo import ir

    info, _ = ir.infer_tensor_info(model)
    return sum(info[n.output[0]].numel for n in model.graph.node if n.op_type == "Cast")


def _wide_mlp_step_with_fp16_sums(*, lr: float, fused: bool):
    """A wide MLP, its SGD cross-entropy step and the step's campo result with the gradient sums
    fp16 (asserted): forced so (whether they pay at this size is a tie in the analytic model), the
    tests being about how fp16 sums train, not about when they pay."""
    from onnxcampo.training.scaling import gradient_sums

    forward = wide_mlp(rows=64, width=128)
    step = build_train_step(forward, loss="cross_entropy", optimizer="sgd", lr=lr, fused=fused)
    sums = tuple(re.escape(name) + "$" for name in gradient_sums(step))
    campo = optimize(step, policy="campo", experimental={"pad_tensor_cores": False}, include_ops={"MatMul"},
                     include_nodes=sums)
    assert any(campo.plan.precision(n) is Precision.FP16 for n in gradient_sums(step))
    return forward, step, campo


def test_fp16_weight_gradient_sums_keep_the_gradients():
    """fp16 numerics (ONNX reference evaluator): the campo step's bias gradients, summed from fp16
    dy, are within fp16's rounding of the fp32 step's."""
    forward, step, campo = _wide_mlp_step_with_fp16_sums(lr=1.0, fused=False)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    labels = rng.integers(0, 64, 64).astype(np.int64)
    weights = initial_weights(forward, step)
    base = {"x": x, "labels": labels, "lr": np.array(1.0, np.float32), **weights}
    for name in step_spec(step).state:
        shape = [d.dim_value for i in step.graph.input if i.name == name for d in i.type.tensor_type.shape.dim]
        base[name] = np.zeros(shape, np.float32)
    from onnx.reference import ReferenceEvaluator

    def gradients(model, extra):
        names = [o.name for o in model.graph.output]
        feeds = {**base, **extra}
        feeds = {i.name: feeds[i.name] for i in model.graph.input}
        out = dict(zip(names, ReferenceEvaluator(model).run(None, feeds)))
        return {w: (base[w] - out[w + ".updated"]) for w in ("b1", "b2")}

    want = gradients(step, {})
    got = gradients(campo.model, {LOSS_SCALE: np.array(1024.0, np.float32), CLEAN_STEPS: np.array(0.0, np.float32)})
    for name in want:
        scale = float(np.abs(want[name]).max())
        assert np.abs(got[name] - want[name]).max() <= 1e-2 * scale, name


@pytest.mark.slow
def test_gradient_sums_in_stages_are_found_whole():
    """simplify's rule 7 sums a Conv bias gradient in two ReduceSums (columns, then rows): both
    belong to the weight gradient, so both may read fp16; the loss's own sum does not."""
    from test_simplify import small_cnn

    from onnxcampo.training.scaling import gradient_sums

    step = build_train_step(small_cnn(), loss="cross_entropy", optimizer="sgd", fused=False)
    sums = gradient_sums(step)
    by_name = {n.name: n for n in step.graph.node}
    staged = [n for n in sums if by_name[n].name.startswith("simplify/reduce_sum")]
    assert len(staged) >= 2 * 7  # the seven biased Convs, two stages each
    assert "loss/sum" in by_name and "loss/sum" not in sums


@pytest.mark.slow
def test_campo_step_with_fp16_gradient_sums_trains_like_fp32(fused):
    """On ORT (CPU): the campo step whose bias gradients are summed from fp16 dy, with the fused
    unscale reading them as they are or the standard ops casting them, follows fp32's loss curve.
    A wiring check (ORT's CPU provider hides fp16 rounding): the sums' fp16 numerics are checked
    with the reference evaluator in ``test_fp16_weight_gradient_sums_keep_the_gradients``."""
    forward, step, campo = _wide_mlp_step_with_fp16_sums(lr=0.05, fused=fused)
    rng = np.random.default_rng(5)
    batch = {"x": rng.standard_normal((64, 128)).astype(np.float32), "labels": rng.integers(0, 64, 64).astype(np.int64)}
    curves = {}
    for name, model in (("fp32", step), ("campo", campo.model)):
        trainer = Trainer(model, weights=initial_weights(forward, model))
        curves[name] = [trainer.step(batch) for _ in range(30)]
    assert curves["campo"][-1] < 0.5 * curves["campo"][0]
    assert curves["campo"][-1] == pytest.approx(curves["fp32"][-1], rel=0.02)


@pytest.mark.parametrize("optimizer", ["momentum", "sgd", "adamw"])
def test_the_fused_update_unscales_the_gradients_it_reads(optimizer):
    """With the fused ops the update reads the scaled gradients and inv_scale (unscale=1) and a
    CheckFinite over the same gradients makes found_inf: no UnscaleCheckFinite writes float32
    copies for it. Then the step trains like the fp32 one on ORT CPU (a wiring check)."""
    forward = mlp()
    step = build_train_step(forward, loss="cross_entropy", optimizer=optimizer, lr=0.05, fused=True)
    amp = optimize(step, policy="amp").model
    ops = [n.op_type for n in amp.graph.node]
    assert "UnscaleCheckFinite" not in ops and ops.count("CheckFinite") == 1
    check = next(n for n in amp.graph.node if n.op_type == "CheckFinite")
    update = next(n for n in amp.graph.node if n.op_type.startswith("MultiTensor") and n.op_type != "MultiTensorCast")
    assert onnx.helper.get_attribute_value(next(a for a in update.attribute if a.name == "unscale")) == 1
    first = 3 if optimizer == "adamw" else 2
    assert update.input[first] == "loss_scale/inverse" and update.input[first - 1] == check.output[0] == "found_inf"
    n = len(check.input)
    assert list(update.input[first + 1 + n:first + 1 + 2 * n]) == list(check.input)
    trainer32 = Trainer(step, weights=initial_weights(forward, step))
    trainer16 = Trainer(amp, weights=initial_weights(forward, amp))
    fp32 = [trainer32.step({"x": X, "labels": CLASSES}) for _ in range(30)]
    mixed = [trainer16.step({"x": X, "labels": CLASSES}) for _ in range(30)]
    assert mixed[-1] < 0.8 * mixed[0] and mixed[-1] == pytest.approx(fp32[-1], rel=0.02)


def test_an_unscaled_gradient_read_by_another_node_keeps_unscale_check_finite():
    """The update unscales only where it alone reads every unscaled gradient; a model where
    another node reads one keeps the update as it was (and so UnscaleCheckFinite)."""
    from onnxcampo.training import scaling

    sgd = onnx.helper.make_node("MultiTensorSGD", ["lr", "found_inf", "w", "u"], ["w.updated"], domain="ai.onnxcampo")
    neg = onnx.helper.make_node("Neg", ["u"], ["n"])
    model = onnx.helper.make_model(onnx.helper.make_graph([sgd, neg], "g", [], []))
    update = model.graph.node[0]  # the graph's own node (make_graph copies)
    assert not scaling._update_unscales(model, [update], {"u": "g"}, "inv")
    assert list(update.input) == ["lr", "found_inf", "w", "u"]
    del model.graph.node[1]  # without the Neg: the update unscales
    assert scaling._update_unscales(model, [update], {"u": "g"}, "inv")
    assert list(update.input) == ["lr", "found_inf", "inv", "w", "g"]
    assert onnx.helper.get_attribute_value(update.attribute[-1]) == 1


def test_fp16_gemm_weight_gradients_reach_the_unscale_in_fp16():
    """A weight gradient computed as one fp16 Gemm (simplify rule 1b) and reshaped to the weight's
    dims is reshaped in fp16 and unscaled from fp16: no Cast to fp32 in front of the check and the
    update that unscales (CheckFinite, MultiTensorSGD unscale=1).
    The step still trains like the fp32 one on ORT CPU (a wiring check: ORT CPU hides fp16 rounding)."""
    from test_simplify import sequence_mlp

    forward = sequence_mlp()
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", lr=0.05, fused=True)
    # the gradients' final Reshapes kept fp32 (campo does so on BERT: "clear op, fp16 does not
    # pay"): the plan puts the Cast to fp32 in front of them
    mixed = optimize(step, policy="fp16", exclude_nodes=("/squeeze$",)).model
    made = {o: n for n in mixed.graph.node for o in n.output}
    check = next(n for n in mixed.graph.node if n.op_type == "CheckFinite")
    sources = [made[name] for name in check.input]
    assert sources and all(n.op_type == "Reshape" for n in sources)
    assert all(made[n.input[0]].op_type == "Gemm" for n in sources if made[n.input[0]].op_type != "ReduceSum")
    assert not any(made[n.input[0]].op_type == "Cast" for n in sources)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 6, 8)).astype(np.float32), "labels": rng.integers(0, 3, 4).astype(np.int64)}
    losses = {}
    for name, model in (("fp32", step), ("fp16", mixed)):
        trainer = Trainer(model, weights=initial_weights(forward, model))
        losses[name] = [trainer.step(batch) for _ in range(20)]
    assert losses["fp16"][-1] == pytest.approx(losses["fp32"][-1], rel=0.02)


def test_campo_prices_the_cast_the_fused_unscale_saves():
    """A gradient the fused unscale reads as it is made needs no Cast when it is made in fp16
    (``estimate.casts_time``): campo's pricing of each weight gradient's final Reshape sees that
    Cast go, so the Reshapes run fp16 (clear by cost, gain = the Cast's time) and the unscale
    reads them with no Cast in front; before, each Reshape priced a tie and stayed fp32."""
    from test_simplify import sequence_mlp

    step = build_train_step(sequence_mlp(), loss="cross_entropy", optimizer="momentum", lr=0.05, fused=True)
    result = optimize(step, policy="campo", include_ops={"Gemm"}, experimental={"pad_tensor_cores": False})
    for name in ("w1/squeeze", "w2/squeeze"):
        decision = result.plan.get(name)
        assert decision.precision is Precision.FP16 and decision.reason is Reason.CLEAR_PAYS, name
        assert decision.numbers["gain_us"] == pytest.approx(-decision.numbers["cast_us"]) and decision.numbers["gain_us"] > 0
    made = {o: n for n in result.model.graph.node for o in n.output}
    check = next(n for n in result.model.graph.node if n.op_type == "CheckFinite")
    weight_grads = [made[name] for name in check.input if made[made[name].input[0]].op_type == "Gemm"]
    assert len(weight_grads) == 2 and all(_dtype_read_by(result.model, n.name) == onnx.TensorProto.FLOAT16
                                          for n in weight_grads)
