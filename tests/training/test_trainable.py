"""Which initializers a step graph trains (onnxcampo.training.trainable), and real corpus models
building into step graphs that train."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.errors import UnsupportedModelError
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec
from onnxcampo.training.trainable import select_trainable

RNG = np.random.default_rng(0)


def _const(name: str, shape, scale: float = 0.3) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes, inits, x_shape, y_shape, y="y") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, y_shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def conv_bn_resize() -> onnx.ModelProto:
    """Conv -> BatchNorm (running statistics) -> Relu -> depthwise Conv -> Resize x2 (scales a
    float initializer) -> Add a [1] constant -> Reshape to a shape stored as floats -> y."""
    nodes = [
        helper.make_node("Conv", ["x", "conv.w", "conv.b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["n"]),
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("Conv", ["r", "dw.w", "dw.b"], ["d"], group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["d", "", "resize.scales"], ["u"], mode="nearest"),
        helper.make_node("Add", ["u", "eps"], ["e"]),
        # a float constant that only shapes the result (through an integer Cast)
        helper.make_node("Cast", ["shape.f"], ["shape.i"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["e", "shape.i"], ["y"]),
    ]
    inits = [
        _const("conv.w", (4, 2, 3, 3)), _const("conv.b", (4,)),
        _const("bn.scale", (4,)), _const("bn.bias", (4,)),
        numpy_helper.from_array(np.zeros(4, np.float32), "bn.mean"),
        numpy_helper.from_array(np.ones(4, np.float32), "bn.var"),
        _const("dw.w", (4, 1, 3, 3)), _const("dw.b", (4,)),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "resize.scales"),
        numpy_helper.from_array(np.array([1e-3], np.float32), "eps"),
        numpy_helper.from_array(np.array([2, -1], np.float32), "shape.f"),
    ]
    return _model(nodes, inits, [2, 2, 4, 4], [2, 256])


def test_only_real_weights_are_lifted():
    """BN statistics, Resize scales, a one-element formula constant, a float shape and a
    grouped Conv weight stay constants; Conv/BN parameters and the depthwise bias train."""
    selection = select_trainable(conv_bn_resize())
    assert set(selection.weights) == {"conv.w", "conv.b", "bn.scale", "bn.bias", "dw.b"}
    assert selection.frozen == {
        "bn.mean": "statistics", "bn.var": "statistics", "dw.w": "grouped-conv",
        "resize.scales": "configuration", "eps": "formula-constant", "shape.f": "no-gradient-path",
    }


def test_step_graph_freezes_them_and_trains(caplog):
    forward = conv_bn_resize()
    with caplog.at_level(logging.WARNING, logger="onnxcampo.training.trainable"):
        step = build_train_step(forward, loss="mse", optimizer="adamw", lr=0.01)
    assert "grouped Conv" in caplog.text and "dw.w" in caplog.text
    spec = step_spec(step)
    assert set(spec.weights) == {"conv.w", "conv.b", "bn.scale", "bn.bias", "dw.b"}
    constants = {t.name for t in step.graph.initializer}
    assert {"bn.mean", "bn.var", "dw.w", "resize.scales", "eps"} <= constants
    x = RNG.standard_normal((2, 2, 4, 4)).astype(np.float32)
    target = RNG.standard_normal((2, 256)).astype(np.float32)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    losses = [trainer.step({"x": x, "labels": target}) for _ in range(30)]
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0]
    state = trainer.state_dict()
    assert "bn.mean" not in state and "dw.w" not in state


def test_conv_transpose_weight_frozen_bias_trained():
    nodes = [helper.make_node("ConvTranspose", ["x", "up.w", "up.b"], ["y"], strides=[2, 2])]
    forward = _model(nodes, [_const("up.w", (2, 3, 2, 2)), _const("up.b", (3,))], [1, 2, 4, 4], [1, 3, 8, 8])
    selection = select_trainable(forward)
    assert selection.weights == ("up.b",) and selection.frozen == {"up.w": "conv-transpose"}
    assert step_spec(build_train_step(forward, loss="mse")).weights == ("up.b",)


def test_one_element_layer_bias_trains():
    """A [1] bias of a one-unit Conv head is a weight, not a formula constant."""
    nodes = [helper.make_node("Conv", ["x", "head.w", "head.b"], ["y"])]
    forward = _model(nodes, [_const("head.w", (1, 2, 1, 1)), _const("head.b", (1,))], [1, 2, 3, 3], [1, 1, 3, 3])
    assert set(select_trainable(forward).weights) == {"head.w", "head.b"}


def test_constant_node_weights_train():
    """Paddle exports hold weights in Constant nodes; they are trained like initializers."""
    nodes = [helper.make_node("Constant", [], ["w"], value=_const("w", (3, 2))),
             helper.make_node("MatMul", ["x", "w"], ["y"])]
    forward = _model(nodes, [], [4, 3], [4, 2])
    step = build_train_step(forward, loss="mse", optimizer="sgd", lr=0.1)
    assert step_spec(step).weights == ("w",)
    trainer = Trainer(step, weights=initial_weights(forward, step))
    x, target = RNG.standard_normal((4, 3)).astype(np.float32), RNG.standard_normal((4, 2)).astype(np.float32)
    losses = [trainer.step({"x": x, "labels": target}) for _ in range(10)]
    assert losses[-1] < losses[0]
    exported = trainer.export(forward)
    value = numpy_helper.to_array(exported.graph.node[0].attribute[0].t)
    np.testing.assert_allclose(value, trainer.state_dict()["w"])


def test_training_mode_batchnorm_trains_with_its_running_statistics_as_state():
    """Refused before issue 18; now its statistics are step state (tests/training/test_train_mode.py)."""
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], training_mode=1)]
    inits = [_const("s", (2,)), _const("b", (2,)), _const("m", (2,)),
             numpy_helper.from_array(np.ones(2, np.float32), "v")]
    forward = _model(nodes, inits, [2, 2, 3, 3], [2, 2, 3, 3])
    spec = step_spec(build_train_step(forward))
    assert spec.weights == ("s", "b") and {"m.running_mean", "v.running_var"} <= set(spec.state)


def test_training_batchnorm_with_statistics_in_graph_inputs_is_refused_in_one_line():
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], training_mode=1)]
    forward = _model(nodes, [_const("s", (2,)), _const("b", (2,))], [2, 2, 3, 3], [2, 2, 3, 3])
    forward.graph.input.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "mv")
    with pytest.raises(UnsupportedModelError, match="is not an initializer") as info:
        build_train_step(forward)
    assert "\n" not in str(info.value)


def test_inference_dropout_is_fine():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Dropout", ["h"], ["y"])]
    forward = _model(nodes, [_const("w", (3, 2))], [4, 3], [4, 2])
    assert step_spec(build_train_step(forward)).weights == ("w",)


# --- real models (the corpus cache the other corpus tests use) ----------------------------


def _corpus_model(key: str) -> onnx.ModelProto:
    from onnxcampo.benchmarks import corpus

    try:
        return corpus.load(corpus.get(key)), corpus.get(key)
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")


@pytest.mark.corpus
def test_silero_vad_v6_builds_and_trains():
    """faster-whisper's VAD (STFT Conv, LSTM, opset 18): a step graph whose loss falls."""
    forward, entry = _corpus_model("silero_vad_v6_fw")
    step = build_train_step(forward, loss="mse", optimizer="adamw", lr=3e-4, input_shapes=entry.input_shapes)
    spec = step_spec(step)
    assert len(spec.weights) == 14 and set(spec.batch) == {"input", "h", "c", "labels"}
    rng = np.random.default_rng(0)
    batch = {"input": rng.standard_normal((8, 576)).astype(np.float32), "h": np.zeros((1, 1, 128), np.float32),
             "c": np.zeros((1, 1, 128), np.float32), "labels": rng.random(8).astype(np.float32)}
    trainer = Trainer(step, weights=initial_weights(forward, step))
    losses = [trainer.step(batch) for _ in range(8)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.corpus
def test_ddddocr_det_freezes_resize_scales():
    """The YOLO-style detector (opset 11): Resize roi/scales stay constants, so onnx-ad can
    differentiate it; every Conv weight trains."""
    forward, entry = _corpus_model("ddddocr_det")
    selection = select_trainable(forward)
    resize_inputs = {n.input[i] for n in forward.graph.node if n.op_type == "Resize" for i in (1, 2)}
    assert resize_inputs <= set(selection.frozen)
    conv_weights = {n.input[1] for n in forward.graph.node if n.op_type == "Conv"}
    assert conv_weights <= set(selection.weights)


def test_command_line_reports_what_it_froze(tmp_path, capsys):
    from onnxcampo.cli import main

    forward, step = tmp_path / "fwd.onnx", tmp_path / "step.onnx"
    onnx.save(conv_bn_resize(), str(forward))
    assert main(["train-graph", str(forward), str(step), "--optimizer", "adamw"]) == 0
    err = capsys.readouterr().err
    assert "5 weights trainable (88 values); frozen: 1 configuration, 1 formula-constant, 1 grouped-conv" in err
    nodes = [helper.make_node("MaxPool", ["h"], ["y"], kernel_shape=[2, 2], auto_pad="SAME_UPPER"),
             helper.make_node("Mul", ["x", "w"], ["h"])]
    bad = _model(nodes[::-1], [_const("w", (1, 1, 4, 4))], [1, 1, 4, 4], [1, 1, 2, 2])
    onnx.save(bad, str(forward))
    assert main(["train-graph", str(forward), str(tmp_path / "bad.onnx")]) == 2
    err = capsys.readouterr().err.strip()
    assert "SAME_UPPER" in err and len(err.splitlines()) == 1


# --- what exporters do to parameters ------------------------------------------------------------
def _token_model(*, head=None, mask=None, position=None, shared_scale=False) -> onnx.ModelProto:
    """ids [2, 8] -> Gather(embedding [50, 16]) (+ position [1, 8, 16]) -> 4 LayerNorms -> scores
    (+ mask) -> MatMul(head [16, 50]) -> logits [2, 8, 50]."""
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((50, 16)).astype(np.float32)
    inits = {"embedding": embedding, "head": embedding.T.copy() if head is None else head}
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["h0"])]
    last = "h0"
    if position is not None:
        inits["position"] = position
        nodes.append(helper.make_node("Add", [last, "position"], ["hp"]))
        last = "hp"
    for k in range(4):
        scale = "ln.scale" if shared_scale else f"ln{k}.scale"
        inits[scale] = np.ones(16, np.float32)
        inits[f"ln{k}.bias"] = rng.standard_normal(16).astype(np.float32) * 0.1
        nodes.append(helper.make_node("LayerNormalization", [last, scale, f"ln{k}.bias"], [f"n{k}"], axis=-1))
        last = f"n{k}"
    nodes.append(helper.make_node("MatMul", [last, "head"], ["raw"]))
    if mask is not None:
        inits["mask"] = mask
        nodes.append(helper.make_node("Add", ["raw", "mask"], ["logits"]))
    else:
        nodes.append(helper.make_node("Identity", ["raw"], ["logits"]))
    graph = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 8, 50])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_a_head_written_as_the_embedding_transposed_is_tied_to_it():
    from onnxcampo.training import Trainer, build_train_step

    step = build_train_step(_token_model(), loss="mse", optimizer="sgd", lr=0.1)
    assert "embedding" in step_spec(step).weights and "head" not in step_spec(step).weights
    assert any(n.op_type == "Transpose" and list(n.input) == ["embedding"] and list(n.output) == ["head"]
               for n in step.graph.node)
    # it trains as the tied module does: the same as a forward whose head is Transpose(embedding)
    tied = _token_model()
    tied.graph.initializer.remove(next(t for t in tied.graph.initializer if t.name == "head"))
    tied.graph.node.insert(0, helper.make_node("Transpose", ["embedding"], ["head"], perm=[1, 0]))
    rng = np.random.default_rng(1)
    batch = {"ids": rng.integers(0, 50, (2, 8)), "labels": rng.standard_normal((2, 8, 50)).astype(np.float32)}
    trainers = [Trainer(s, provider="cpu") for s in (step, build_train_step(tied, loss="mse", optimizer="sgd", lr=0.1))]
    losses = [[t.step(batch) for _ in range(3)] for t in trainers]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[0][2] < losses[0][0]
    np.testing.assert_allclose(trainers[0].state_dict()["embedding"], trainers[1].state_dict()["embedding"], rtol=1e-6)


def test_an_untied_head_of_the_same_shape_stays_a_weight_of_its_own():
    head = np.random.default_rng(5).standard_normal((16, 50)).astype(np.float32)
    selection = select_trainable(_token_model(head=head))
    assert {"embedding", "head"} <= set(selection.weights)


def test_a_folded_attention_mask_is_not_trained_and_is_warned_about(caplog):
    mask = np.zeros((1, 8, 50), np.float32)
    mask[..., 25:] = -np.inf
    with caplog.at_level(logging.WARNING):
        selection = select_trainable(_token_model(mask=mask))
    assert selection.frozen["mask"] == "mask"
    assert "onnxcampo.training.export" in caplog.text and "mask" in caplog.text


def test_a_position_embedding_folded_for_the_input_shape_is_not_trained(caplog):
    position = np.random.default_rng(2).standard_normal((1, 8, 16)).astype(np.float32)
    with caplog.at_level(logging.WARNING):
        selection = select_trainable(_token_model(position=position))
    assert selection.frozen["position"] == "folded-input"
    assert "position" in caplog.text


def test_a_parameter_many_layers_share_is_warned_about(caplog):
    from onnxcampo.training import build_train_step

    with caplog.at_level(logging.WARNING):
        build_train_step(_token_model(shared_scale=True), loss="mse", optimizer="sgd")
    assert "ln.scale is the parameter of 4 LayerNormalization nodes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build_train_step(_token_model(), loss="mse", optimizer="sgd")
    assert "parameter of" not in caplog.text


def test_the_summary_counts_the_values_trained():
    selection = select_trainable(_token_model())
    assert selection.summary().startswith(f"{len(selection.weights)} weights trainable (")
    assert selection.values == 50 * 16 * 2 + 4 * 16 * 2
