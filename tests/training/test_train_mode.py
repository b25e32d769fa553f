"""Training-mode BatchNormalization and Dropout in step graphs (onnxcampo.training.train_mode):
batch statistics and their gradient, running statistics as state, the seeded dropout mask,
evaluation on the running statistics, against numpy references on ORT CPU."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.cli import main
from onnxcampo.errors import ConfigError, UnsupportedModelError
from onnxcampo.runtime import make_session, run
from onnxcampo.training import Trainer, build_train_step, step_spec
from onnxcampo.training.evaluate import eval_model
from onnxcampo.training.train_mode import DROPOUT_SEED, TRAIN_FLAG, dropout_mask, running_stats

N, CIN, C, H, W = 4, 3, 2, 3, 3
EPS, MOMENTUM = 1e-5, 0.9
RNG = np.random.default_rng(7)
X = RNG.normal(size=(N, CIN, H, W)).astype(np.float32)
X2 = (RNG.normal(size=(N, CIN, H, W)) * 2 + 0.5).astype(np.float32)
LABELS = RNG.normal(size=(N, C)).astype(np.float32)
PARAMS = {
    "conv.w": (RNG.normal(size=(C, CIN, 1, 1)) * 0.7).astype(np.float32),
    "conv.b": RNG.normal(size=C).astype(np.float32),
    "bn.weight": (1 + 0.2 * RNG.normal(size=C)).astype(np.float32),
    "bn.bias": (0.1 * RNG.normal(size=C)).astype(np.float32),
}
RUNNING = {"bn.running_mean": (0.1 * RNG.normal(size=C)).astype(np.float32),
           "bn.running_var": (1 + RNG.random(C)).astype(np.float32)}


def conv_bn(*, training_mode: int = 0, mean: str = "bn.running_mean", var: str = "bn.running_var",
            opset: int = 17) -> onnx.ModelProto:
    """Conv 1x1 -> BatchNormalization -> Tanh -> mean over H, W: a prediction [N, C]."""
    outputs = ["y", "y.mean", "y.var"] if training_mode else ["y"]
    reduce = (helper.make_node("ReduceMean", ["t", "axes"], ["out"], keepdims=0) if opset >= 18
              else helper.make_node("ReduceMean", ["t"], ["out"], axes=[2, 3], keepdims=0))
    nodes = [
        helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", mean, var], outputs, name="bn",
                         epsilon=EPS, momentum=MOMENTUM, **({"training_mode": 1} if training_mode else {})),
        helper.make_node("Tanh", ["y"], ["t"], name="tanh"),
        reduce,
    ]
    initializers = [numpy_helper.from_array(v, k) for k, v in PARAMS.items()]
    initializers += [numpy_helper.from_array(RUNNING["bn.running_mean"], mean),
                     numpy_helper.from_array(RUNNING["bn.running_var"], var)]
    if opset >= 18:
        initializers.append(numpy_helper.from_array(np.array([2, 3], np.int64), "axes"))
    graph = helper.make_graph(nodes, "conv_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, CIN, H, W])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, C])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def reference(params: dict[str, np.ndarray], x: np.ndarray, labels: np.ndarray):
    """float64 numpy: the training forward (batch statistics), the mse loss, the batch mean and
    biased variance the running statistics take."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    c = np.einsum("nchw,oc->nohw", x.astype(np.float64), p["conv.w"][:, :, 0, 0]) + p["conv.b"][None, :, None, None]
    mean = c.mean(axis=(0, 2, 3))
    var = c.var(axis=(0, 2, 3))
    y = (c - mean[None, :, None, None]) / np.sqrt(var[None, :, None, None] + EPS)
    y = y * p["bn.weight"][None, :, None, None] + p["bn.bias"][None, :, None, None]
    out = np.tanh(y).mean(axis=(2, 3))
    return float(np.mean((out - labels) ** 2)), mean, var


def finite_differences(params, x, labels, h=1e-6):
    grads = {}
    for name, value in params.items():
        grad = np.zeros(value.shape)
        for index in np.ndindex(value.shape):
            up, down = dict(params), dict(params)
            up[name] = value.astype(np.float64).copy()
            down[name] = value.astype(np.float64).copy()
            up[name][index] += h
            down[name][index] -= h
            grad[index] = (reference(up, x, labels)[0] - reference(down, x, labels)[0]) / (2 * h)
        grads[name] = grad
    return grads


def eval_reference(params, running, x):
    p = {k: v.astype(np.float64) for k, v in params.items()}
    c = np.einsum("nchw,oc->nohw", x.astype(np.float64), p["conv.w"][:, :, 0, 0]) + p["conv.b"][None, :, None, None]
    m, v = (running[k].astype(np.float64)[None, :, None, None] for k in ("bn.running_mean", "bn.running_var"))
    y = (c - m) / np.sqrt(v + EPS) * p["bn.weight"][None, :, None, None] + p["bn.bias"][None, :, None, None]
    return np.tanh(y).mean(axis=(2, 3))


def feeds(step: onnx.ModelProto, x=X, **extra) -> dict[str, np.ndarray]:
    values = {"x": x, "labels": LABELS, "lr": np.array(1.0, np.float32), **PARAMS, **RUNNING, **extra}
    return {i.name: values[i.name] for i in step.graph.input}


@pytest.mark.parametrize("simplify", [True, False])
@pytest.mark.parametrize("opset", [17, 18])
def test_batchnorm_training_forward_and_gradient_match_numpy(simplify, opset):
    """train_mode=True on an eval-mode export: the loss is the one of batch statistics, and one
    SGD step (lr 1) moves each weight by its gradient through the statistics (finite differences
    of the float64 numpy forward; the conv bias, which the batch mean removes, gets none)."""
    step = build_train_step(conv_bn(opset=opset), loss="mse", optimizer="sgd", train_mode=True, fused=False,
                            simplify=simplify)
    out = run(make_session(step), feeds(step))
    loss, _, _ = reference(PARAMS, X, LABELS)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    expected = finite_differences(PARAMS, X, LABELS)
    for name, value in PARAMS.items():
        np.testing.assert_allclose(value - out[name + ".updated"], expected[name], rtol=2e-3, atol=2e-6)
    np.testing.assert_allclose(PARAMS["conv.b"] - out["conv.b.updated"], 0.0, atol=1e-6)


@pytest.mark.parametrize("running_var", ["unbiased", "biased"])
def test_running_statistics_follow_onnx_momentum_over_two_steps(running_var):
    """running = running * momentum + batch * (1 - momentum), the variance unbiased (n/(n-1),
    PyTorch) or biased (ONNX); two steps on two batches with lr 0, so the batch statistics are
    numpy's of the fixed conv output."""
    step = build_train_step(conv_bn(), loss="mse", optimizer="sgd", lr=0.0, train_mode=True, running_var=running_var)
    trainer = Trainer(step)
    running = {k: v.astype(np.float64) for k, v in RUNNING.items()}
    n = N * H * W
    for x in (X, X2):
        trainer.step({"x": x, "labels": LABELS})
        _, mean, var = reference(PARAMS, x, LABELS)
        if running_var == "unbiased":
            var = var * n / (n - 1)
        running = {"bn.running_mean": running["bn.running_mean"] * MOMENTUM + mean * (1 - MOMENTUM),
                   "bn.running_var": running["bn.running_var"] * MOMENTUM + var * (1 - MOMENTUM)}
    state = trainer.state_dict()
    for name, value in running.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5)


def test_evaluate_uses_the_running_statistics_and_state_dict_holds_them():
    """After two steps, evaluate() is the inference forward on the trained weights and the
    running statistics (no batch statistics); state_dict() names them as the forward did."""
    step = build_train_step(conv_bn(), loss="mse", optimizer="momentum", lr=0.1, train_mode=True)
    spec = step_spec(step)
    assert set(spec.weights) == set(PARAMS)
    assert {"bn.running_mean", "bn.running_var"} <= set(spec.state)
    trainer = Trainer(step)
    for x in (X, X2):
        trainer.step({"x": x, "labels": LABELS})
    state = trainer.state_dict()
    assert not np.allclose(state["bn.running_mean"], RUNNING["bn.running_mean"])
    params = {k: state[k] for k in PARAMS}
    running = {k: state[k] for k in RUNNING}
    prediction = trainer.evaluate({"x": X})["out"]
    np.testing.assert_allclose(prediction, eval_reference(params, running, X), rtol=1e-4, atol=1e-6)
    with_loss = trainer.evaluate({"x": X, "labels": LABELS})
    assert with_loss["loss"] == pytest.approx(np.mean((eval_reference(params, running, X) - LABELS) ** 2), rel=1e-4)
    ops = [n.op_type for n in eval_model(trainer.model, with_loss=False).graph.node]
    assert "Where" not in ops and ops.count("ReduceMean") == 1  # the model's own, over H and W
    assert [n for n in trainer.model.graph.node if n.op_type == "Where" and TRAIN_FLAG in n.input]  # for evaluate


def test_the_step_session_runs_the_train_mode_switches_resolved(monkeypatch):
    """The Trainer's step session runs the step with each ``Where(onnxcampo.train_mode, a, b)`` an
    ``Identity(a)`` (no kernel a step per BatchNorm and Dropout); its evaluation still switches."""
    from onnxcampo.training import trainer as trainer_module

    made = []
    real = trainer_module.make_session
    monkeypatch.setattr(trainer_module, "make_session", lambda model, **kw: made.append(model) or real(model, **kw))
    trainer = Trainer(build_train_step(conv_bn(), loss="mse", optimizer="momentum", lr=0.1, train_mode=True))
    switches = [n for n in made[0].graph.node if n.op_type == "Where" and TRAIN_FLAG in n.input]
    assert switches == [] and any(n.op_type == "Identity" for n in made[0].graph.node)
    assert TRAIN_FLAG not in {t.name for t in made[0].graph.initializer}  # read by nothing: ORT would warn
    trainer.step({"x": X, "labels": LABELS})
    prediction = trainer.evaluate({"x": X})["out"]
    state = trainer.state_dict()
    reference = eval_reference({k: state[k] for k in PARAMS}, {k: state[k] for k in RUNNING}, X)
    np.testing.assert_allclose(prediction, reference, rtol=1e-4, atol=1e-6)


def test_evaluate_reads_the_flag_as_false_where_no_where_reads_it():
    """A node other than Where reading onnxcampo.train_mode (as if an optimizer had fused the
    Where) reads false in evaluation: still the running statistics."""
    step = build_train_step(conv_bn(), loss="mse", optimizer="sgd", train_mode=True, fused=False)
    where = next(n for n in step.graph.node if n.op_type == "Where" and n.input[0] == TRAIN_FLAG)
    where.input[0] = "flag_copy"
    step.graph.node.insert(0, helper.make_node("Identity", [TRAIN_FLAG], ["flag_copy"], name="flag_copy"))
    model = eval_model(step, with_loss=False)
    values = {"x": X, **PARAMS, **RUNNING}
    prediction = run(make_session(model), {i.name: values[i.name] for i in model.graph.input})["out"]
    np.testing.assert_allclose(prediction, eval_reference(PARAMS, RUNNING, X), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_export_writes_back_the_running_statistics_and_checkpoints_keep_them(tmp_path):
    forward = conv_bn()
    trainer = Trainer(build_train_step(forward, loss="mse", optimizer="sgd", lr=0.05, train_mode=True))
    trainer.step({"x": X, "labels": LABELS})
    exported = {t.name: numpy_helper.to_array(t) for t in trainer.export(forward).graph.initializer}
    state = trainer.state_dict()
    for name in (*PARAMS, *RUNNING):
        np.testing.assert_array_equal(exported[name], state[name])
    trainer.save_checkpoint(tmp_path / "run.npz")
    with np.load(tmp_path / "run.npz") as saved:
        assert {"bn.running_mean", "bn.running_var"} <= set(saved.files)
    again = Trainer(build_train_step(forward, loss="mse", optimizer="sgd", lr=0.05, train_mode=True))
    again.load_checkpoint(tmp_path / "run.npz")
    assert again.step({"x": X2, "labels": LABELS}) == trainer.step({"x": X2, "labels": LABELS})


def test_state_takes_the_initializer_name_or_a_running_suffix():
    """Running statistics named without mean/var get '.running_mean' / '.running_var'."""
    step = build_train_step(conv_bn(mean="m", var="v"), loss="mse", train_mode=True)
    assert running_stats(step) == {"m.running_mean": "m", "v.running_var": "v"}
    assert {"m.running_mean", "v.running_var"} <= set(step_spec(step).state)
    assert set(step_spec(step).weights) == set(PARAMS)


def test_training_mode_export_trains_as_exported_and_train_mode_false_freezes_it():
    """A BatchNormalization exported with training_mode=1 (three outputs) trains by default;
    train_mode=False runs it on the frozen statistics, as an eval-mode export does by default."""
    trained = build_train_step(conv_bn(training_mode=1), loss="mse", optimizer="sgd", fused=False)
    assert running_stats(trained) and TRAIN_FLAG in {t.name for t in trained.graph.initializer}
    out = run(make_session(trained), feeds(trained))
    assert out["loss"] == pytest.approx(reference(PARAMS, X, LABELS)[0], rel=1e-5)
    for model, mode in ((conv_bn(training_mode=1), False), (conv_bn(), None)):
        frozen = build_train_step(model, loss="mse", optimizer="sgd", fused=False, train_mode=mode)
        assert not running_stats(frozen)
        assert {"bn.running_mean", "bn.running_var"} <= {t.name for t in frozen.graph.initializer}
        value = run(make_session(frozen), feeds(frozen))["loss"]
        assert value == pytest.approx(np.mean((eval_reference(PARAMS, RUNNING, X) - LABELS) ** 2), rel=1e-5)


def test_batchnorm_over_features_rank_2():
    """BatchNorm1d on [N, C] (statistics over the batch axis alone): loss and gradients of
    MatMul -> BatchNormalization -> Tanh against numpy finite differences."""
    f = 5
    x = RNG.normal(size=(N, f)).astype(np.float32)
    params = {"w": RNG.normal(size=(f, C)).astype(np.float32), "s": (1 + 0.3 * RNG.normal(size=C)).astype(np.float32),
              "b": (0.2 * RNG.normal(size=C)).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("BatchNormalization", ["h", "s", "b", "mean", "var"], ["y"], epsilon=EPS),
         helper.make_node("Tanh", ["y"], ["out"])],
        "bn1d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, f])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, C])],
        [numpy_helper.from_array(v, k) for k, v in params.items()]
        + [numpy_helper.from_array(np.zeros(C, np.float32), "mean"), numpy_helper.from_array(np.ones(C, np.float32), "var")])
    step = build_train_step(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), loss="mse",
                            optimizer="sgd", train_mode=True, fused=False)

    def loss(p):
        h = x.astype(np.float64) @ p["w"]
        y = (h - h.mean(axis=0)) / np.sqrt(h.var(axis=0) + EPS) * p["s"] + p["b"]
        return np.mean((np.tanh(y) - LABELS) ** 2)

    values = {"x": x, "labels": LABELS, "lr": np.array(1.0, np.float32), "mean": np.zeros(C, np.float32),
              "var": np.ones(C, np.float32), **params}
    out = run(make_session(step), {i.name: values[i.name] for i in step.graph.input})
    p64 = {k: v.astype(np.float64) for k, v in params.items()}
    assert out["loss"] == pytest.approx(loss(p64), rel=1e-5)
    for name, value in p64.items():
        expected = np.zeros(value.shape)
        for index in np.ndindex(value.shape):
            up, down = {**p64, name: value.copy()}, {**p64, name: value.copy()}
            up[name][index] += 1e-6
            down[name][index] -= 1e-6
            expected[index] = (loss(up) - loss(down)) / 2e-6
        np.testing.assert_allclose(params[name] - out[name + ".updated"], expected, rtol=2e-3, atol=2e-6)
    np.testing.assert_allclose(out["mean.updated"], 0.1 * (x @ params["w"]).mean(axis=0), rtol=1e-4, atol=1e-6)


def test_bad_running_var_and_seed_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="running_var must be one of unbiased, biased"):
        build_train_step(conv_bn(), train_mode=True, running_var="sample")
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\^24\)"):
        Trainer(build_train_step(mlp_dropout(True)), seed=-1)


def test_one_value_per_channel_is_refused():
    model = conv_bn()
    del model.graph.input[:]
    model.graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CIN, 1, 1]))
    with pytest.raises(UnsupportedModelError, match="no batch variance"):
        build_train_step(model, loss="mse", train_mode=True)


# --- Dropout -------------------------------------------------------------------------------------

F, K, RATIO = 40, 3, 0.4
XD = RNG.normal(size=(N, F)).astype(np.float32)
WD = RNG.normal(size=(F, K)).astype(np.float32)
LABELS_D = RNG.normal(size=(N, K)).astype(np.float32)


def mlp_dropout(training: bool | None = None) -> onnx.ModelProto:
    """x -> Dropout(0.4) -> MatMul w: training None: no training_mode input."""
    inputs = ["x", "ratio"] + (["training"] if training is not None else [])
    initializers = [numpy_helper.from_array(WD, "w"), numpy_helper.from_array(np.array(RATIO, np.float32), "ratio")]
    if training is not None:
        initializers.append(numpy_helper.from_array(np.array(training), "training"))
    graph = helper.make_graph(
        [helper.make_node("Dropout", inputs, ["d"], name="dropout"), helper.make_node("MatMul", ["d", "w"], ["out"])],
        "mlp_dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, K])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def dropout_reference(seed: int):
    keep = dropout_mask(seed, 0, N * F, RATIO).reshape(N, F)
    dropped = XD.astype(np.float64) * keep / (1 - RATIO)
    out = dropped @ WD
    return float(np.mean((out - LABELS_D) ** 2)), dropped.T @ (2 * (out - LABELS_D) / out.size)


@pytest.mark.parametrize("seed", [0, 5])
def test_dropout_step_applies_the_seeded_mask(seed):
    """The step drops what dropout_mask(seed) drops and scales the rest by 1/(1 - ratio): loss
    and gradient equal numpy's; dropout_seed.updated is the seed plus one."""
    step = build_train_step(mlp_dropout(True), loss="mse", optimizer="sgd", fused=False)
    values = {"x": XD, "labels": LABELS_D, "w": WD, "lr": np.array(1.0, np.float32),
              DROPOUT_SEED: np.array(seed, np.float32)}
    out = run(make_session(step), {i.name: values[i.name] for i in step.graph.input})
    loss, grad = dropout_reference(seed)
    assert out["loss"] == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(WD - out["w.updated"], grad, rtol=1e-4, atol=1e-6)
    assert out[DROPOUT_SEED + ".updated"] == seed + 1


def test_each_dropout_draws_its_own_stream():
    """Two Dropouts in a row: the second drops what dropout_mask(seed, 1) drops."""
    graph = helper.make_graph(
        [helper.make_node("Dropout", ["x", "ratio", "training"], ["d1"]),
         helper.make_node("Dropout", ["d1", "ratio", "training"], ["d2"]),
         helper.make_node("MatMul", ["d2", "w"], ["out"])],
        "two_dropouts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, F])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [N, K])],
        [numpy_helper.from_array(WD, "w"), numpy_helper.from_array(np.array(RATIO, np.float32), "ratio"),
         numpy_helper.from_array(np.array(True), "training")])
    step = build_train_step(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), loss="mse",
                            optimizer="sgd", fused=False)
    values = {"x": XD, "labels": LABELS_D, "w": WD, "lr": np.array(1.0, np.float32), DROPOUT_SEED: np.array(2, np.float32)}
    out = run(make_session(step), {i.name: values[i.name] for i in step.graph.input})
    keep = dropout_mask(2, 0, N * F, RATIO) & dropout_mask(2, 1, N * F, RATIO)
    dropped = XD.astype(np.float64) * keep.reshape(N, F) / (1 - RATIO) ** 2
    assert out["loss"] == pytest.approx(np.mean((dropped @ WD - LABELS_D) ** 2), rel=1e-5)


def test_dropout_mask_statistics():
    """Kept share 1 - ratio; masks of other seeds and other nodes, and neighbouring elements,
    uncorrelated; the same seed draws the same mask."""
    count = 200_000
    mask = dropout_mask(3, 0, count, 0.3).astype(np.float64)
    assert mask.mean() == pytest.approx(0.7, abs=0.005)
    for other in (dropout_mask(4, 0, count, 0.3), dropout_mask(3, 1, count, 0.3)):
        assert abs(np.corrcoef(mask, other)[0, 1]) < 0.01
    assert max(abs(np.corrcoef(mask[:-lag], mask[lag:])[0, 1]) for lag in (1, 2, 3, 7, 64, 1000)) < 0.01
    np.testing.assert_array_equal(dropout_mask(3, 0, count, 0.3), dropout_mask(3, 0, count, 0.3))


def test_trainer_dropout_is_reproducible_by_its_seed_and_evaluates_without_it():
    step = build_train_step(mlp_dropout(), loss="mse", optimizer="sgd", lr=0.01, train_mode=True)
    batch = {"x": XD, "labels": LABELS_D}

    def losses(seed):
        trainer = Trainer(step, seed=seed)
        return [trainer.step(batch) for _ in range(4)], trainer

    first, trainer = losses(0)
    again, _ = losses(0)
    other, _ = losses(1)
    assert first == again and first != other
    assert len(set(first)) == 4  # a new mask each step
    state = trainer.state_dict()
    assert state[DROPOUT_SEED] == 4
    np.testing.assert_allclose(trainer.evaluate(batch)["out"], XD @ state["w"], rtol=1e-5, atol=1e-6)


def test_dropout_train_mode_choices():
    """No training_mode input: inference by default, trains with train_mode=True; a constant
    true input trains by default, not with train_mode=False."""
    assert DROPOUT_SEED not in step_spec(build_train_step(mlp_dropout(), loss="mse")).state
    assert DROPOUT_SEED in step_spec(build_train_step(mlp_dropout(), loss="mse", train_mode=True)).state
    assert DROPOUT_SEED in step_spec(build_train_step(mlp_dropout(True), loss="mse")).state
    assert DROPOUT_SEED not in step_spec(build_train_step(mlp_dropout(True), loss="mse", train_mode=False)).state
    assert DROPOUT_SEED not in step_spec(build_train_step(mlp_dropout(False), loss="mse")).state


def test_dropout_ratio_and_training_mode_in_constant_nodes():
    """PyTorch's training-mode exports hold the ratio and training_mode in Constant nodes."""
    model = mlp_dropout(True)
    for name in ("ratio", "training"):
        tensor = next(t for t in model.graph.initializer if t.name == name)
        model.graph.initializer.remove(tensor)
        model.graph.node.insert(0, helper.make_node("Constant", [], [name], value=tensor))
    step = build_train_step(model, loss="mse", optimizer="sgd", fused=False)
    values = {"x": XD, "labels": LABELS_D, "w": WD, "lr": np.array(1.0, np.float32), DROPOUT_SEED: np.array(0, np.float32)}
    out = run(make_session(step), {i.name: values[i.name] for i in step.graph.input})
    assert out["loss"] == pytest.approx(dropout_reference(0)[0], rel=1e-5)


# --- command line --------------------------------------------------------------------------------

@pytest.mark.slow
def test_train_graph_train_mode_command(tmp_path, capsys):
    forward, step, data = tmp_path / "fwd.onnx", tmp_path / "step.onnx", tmp_path / "data.npz"
    onnx.save(conv_bn(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--train-mode", "--bn-running-var", "biased"]) == 0
    assert "training mode: 1 BatchNormalization with batch statistics" in capsys.readouterr().err
    model = onnx.load(str(step))
    assert json.loads(next(p.value for p in model.metadata_props if p.key == "onnxcampo.running_stats")) == {
        "bn.running_mean": "bn.running_mean", "bn.running_var": "bn.running_var"}
    np.savez(data, x=X, labels=LABELS)
    out = tmp_path / "trained.onnx"
    assert main(["train", str(step), "--data", str(data), "--steps", "2", "--forward", str(forward),
                 "--out", str(out), "--seed", "3"]) == 0
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert not np.allclose(trained["bn.running_mean"], RUNNING["bn.running_mean"])
    assert main(["train-graph", str(forward), str(tmp_path / "plain.onnx")]) == 0
    assert "training mode" not in capsys.readouterr().err
    assert not running_stats(onnx.load(str(tmp_path / "plain.onnx")))


# --- PyTorch ---------------------------------------------------------------------------------------

def test_one_step_matches_torch_in_train_mode(tmp_path):
    """Conv + BatchNorm + ReLU exported in training mode: one SGD step gives torch's loss,
    updated weights and running statistics (torch updates running_var with the unbiased variance)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    x = torch.randn(6, 3, 5, 5)
    labels = torch.randn(6, 4)
    path = tmp_path / "conv_bn.onnx"
    model.train()
    torch.onnx.export(model, (x,), str(path), training=torch.onnx.TrainingMode.TRAINING, opset_version=17,
                      do_constant_folding=False, input_names=["x"], output_names=["out"], dynamo=False)
    step = build_train_step(str(path), loss="mse", optimizer="sgd", lr=0.1, fused=False)
    trainer = Trainer(step)
    loss = trainer.step({"x": x.numpy(), "labels": labels.numpy()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = torch.nn.functional.mse_loss(model(x), labels)
    expected.backward()
    optimizer.step()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-5)
    state = trainer.state_dict()
    for name, value in model.state_dict().items():
        if name in state:
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert {"1.running_mean", "1.running_var", "0.weight", "1.weight"} <= set(state)


def test_torch_training_export_with_dropout_evaluates_as_torch_eval(tmp_path):
    """A training-mode export keeps its Dropout (ratio and training_mode in Constant nodes): the
    step trains it from dropout_seed, and evaluate() is torch's eval-mode forward."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Dropout(0.5), torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 2))
    x = torch.randn(6, 3, 5, 5)
    path = tmp_path / "conv_bn_dropout.onnx"
    torch.onnx.export(model.train(), (x,), str(path), training=torch.onnx.TrainingMode.TRAINING, opset_version=17,
                      do_constant_folding=False, input_names=["x"], output_names=["out"], dynamo=False)
    step = build_train_step(str(path), loss="mse", optimizer="sgd", lr=0.01)
    assert {DROPOUT_SEED, "1.running_mean", "1.running_var"} <= set(step_spec(step).state)
    trainer = Trainer(step)
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    np.testing.assert_allclose(trainer.evaluate({"x": x.numpy()})["out"], expected, rtol=1e-4, atol=1e-5)
    assert np.isfinite(trainer.step({"x": x.numpy(), "labels": np.zeros((6, 2), np.float32)}))


# --- mixed precision -------------------------------------------------------------------------------

@pytest.mark.slow
def test_amp_optimized_train_mode_step_keeps_the_running_statistics_fp32_state():
    """onnxcampo optimize (amp) on a train-mode step: the running statistics stay fp32 state
    inputs, are updated each step, and evaluation still takes the inference branch."""
    import onnxcampo

    step = build_train_step(conv_bn(), loss="mse", optimizer="momentum", lr=0.05, train_mode=True)
    optimized = onnxcampo.optimize(step, policy="amp", experimental={"check_invariants": True}).model
    inputs = {i.name: i.type.tensor_type.elem_type for i in optimized.graph.input}
    assert inputs["bn.running_mean"] == inputs["bn.running_var"] == TensorProto.FLOAT
    trainer = Trainer(optimized)
    losses = [trainer.step({"x": x, "labels": LABELS}) for x in (X, X2) * 5]
    assert np.isfinite(losses).all()
    state = trainer.state_dict()
    assert not np.allclose(state["bn.running_var"], RUNNING["bn.running_var"])
    params, running = {k: state[k] for k in PARAMS}, {k: state[k] for k in RUNNING}
    np.testing.assert_allclose(trainer.evaluate({"x": X})["out"], eval_reference(params, running, X), rtol=2e-2, atol=2e-3)


def test_the_fusion_keeps_the_prediction_that_evaluate_prunes_to():
    """fp16 plan + --fuse-elementwise: the classifier's Gemm bias joins the Cast the loss reads,
    so the prediction would live only inside a fused kernel; the pass keeps it (metadata
    onnxcampo.prediction is an interface name) and evaluate still finds it (found on the H200,
    where the fusions are on by default)."""
    from cases import training as script
    from onnxcampo import optimize
    from onnxcampo.ops import elementwise as ew

    step = build_train_step(script.cnn(), loss="cross_entropy", optimizer="adamw", lr=1e-2, train_mode=True)
    fused = optimize(step, policy="fp16", fuse_elementwise=True).model
    assert any(n.op_type == ew.OP_TYPE for n in fused.graph.node)
    trainer = Trainer(fused, provider="cpu", seed=0)
    batch = script.batches(1)[0]
    trainer.step(batch)
    out = trainer.evaluate(batch)
    assert out["logits"].shape == (script.N, script.CLASSES) and np.isfinite(out["loss"])
