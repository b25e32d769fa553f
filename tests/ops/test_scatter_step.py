"""Step graphs of a model with embedding lookups: with fused ops, onnx-ad's Gather adjoints
(ScatterND, reduction "add") become ScatterNDAdd, the step trains like the standard-op step, and
``onnxcampo optimize`` plans and writes it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import cli, ops, optimize
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec

VOCAB, SEQ, BATCH, WIDTH, CLASSES = 13, 6, 4, 8, 3
_RNG = np.random.default_rng(11)
IDS = _RNG.integers(0, 5, (BATCH, SEQ)).astype(np.int64)  # 24 lookups of 5 rows: many duplicates
TARGET = _RNG.standard_normal((BATCH, SEQ, CLASSES)).astype(np.float32)
LABELS = _RNG.integers(0, CLASSES, (BATCH, SEQ)).astype(np.int64)


def embedding_model() -> onnx.ModelProto:
    """Word embedding (ids) plus position embedding (constant positions), then a projection."""
    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["words"], axis=0),
         helper.make_node("Gather", ["positions", "position_ids"], ["where"], axis=0),
         helper.make_node("Add", ["words", "where"], ["embedded"]),
         helper.make_node("MatMul", ["embedded", "w"], ["y"])],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH, SEQ])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, CLASSES])],
        [numpy_helper.from_array((rng.standard_normal((VOCAB, WIDTH)) * 0.5).astype(np.float32), "table"),
         numpy_helper.from_array((rng.standard_normal((SEQ, WIDTH)) * 0.5).astype(np.float32), "positions"),
         numpy_helper.from_array(np.arange(SEQ, dtype=np.int64), "position_ids"),
         numpy_helper.from_array((rng.standard_normal((WIDTH, CLASSES)) * 0.3).astype(np.float32), "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def scatters(step: onnx.ModelProto) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in step.graph.node if "Scatter" in n.op_type]


def train(step: onnx.ModelProto, loss: str, steps: int = 4):
    trainer = Trainer(step, weights=initial_weights(embedding_model(), step))
    labels = TARGET if loss == "mse" else LABELS
    losses = [trainer.step({"ids": IDS, "labels": labels}) for _ in range(steps)]
    return losses, trainer.state_dict()


def test_fused_step_has_scatter_nd_add_in_place_of_the_gather_adjoints(library):
    fused = build_train_step(embedding_model(), optimizer="adamw", fused=True)
    plain = build_train_step(embedding_model(), optimizer="adamw", fused=False)
    assert scatters(plain) == [("", "ScatterND")] * 2
    assert scatters(fused) == [(ops.DOMAIN, "ScatterNDAdd")] * 2
    assert [i.name for i in fused.graph.input] == [i.name for i in plain.graph.input]
    assert [o.name for o in fused.graph.output] == [o.name for o in plain.graph.output]
    assert step_spec(fused) == step_spec(plain)
    declared = {v.name: v.type.tensor_type for v in fused.graph.value_info}
    for node in (n for n in fused.graph.node if n.op_type == "ScatterNDAdd"):
        assert declared[node.output[0]].elem_type == TensorProto.FLOAT  # what shape inference cannot give it
        assert [d.dim_value for d in declared[node.output[0]].shape.dim][:2] in ([VOCAB, WIDTH], [SEQ, WIDTH])
    onnx.checker.check_model(fused, full_check=True)


@pytest.mark.parametrize("optimizer, loss", [("sgd", "mse"), ("adamw", "cross_entropy")])
def test_fused_step_trains_like_the_standard_step(library, optimizer, loss):
    """Losses and every weight after 4 steps, fused against standard ops on ORT CPU: a check of the
    wiring. ORT's CPU ScatterND and the CPU kernel both add in index order here, so they agree
    (the calls are small enough for ORT to run its ScatterND on one thread: on larger ones its
    threads race on duplicate indices)."""
    fused, plain = (build_train_step(embedding_model(), loss=loss, optimizer=optimizer, lr=0.05, fused=f)
                    for f in (True, False))
    fused_losses, fused_state = train(fused, loss)
    losses, state = train(plain, loss)
    np.testing.assert_allclose(fused_losses, losses, rtol=1e-6)
    assert fused_losses[-1] < fused_losses[0]
    assert fused_state.keys() == state.keys()
    for name, value in state.items():
        np.testing.assert_allclose(fused_state[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_optimize_keeps_scatter_nd_add_fp32_and_the_step_trains(library, tmp_path):
    """amp makes the projection's gradient fp16: the scatter stays fp32 (an accumulating scatter),
    with a Cast in front; `onnxcampo optimize` writes a model the Trainer runs (ORT CPU: wiring)."""
    step = build_train_step(embedding_model(), loss="mse", optimizer="adamw", lr=0.05, fused=True)
    result = optimize(step, policy="amp")
    names = [n.name for n in step.graph.node if n.op_type == "ScatterNDAdd"]
    assert [result.report["plan"][name] for name in names] == \
        [{"precision": "fp32", "reason": "accumulating_scatter"}] * 2
    producers = {o: n for n in result.model.graph.node for o in n.output}
    fed = [producers[n.input[2]].op_type for n in result.model.graph.node if n.op_type == "ScatterNDAdd"]
    assert "Cast" in fed  # the word embedding's updates come from an fp16 MatMul
    onnx.save(step, tmp_path / "step.onnx")
    assert cli.main(["optimize", str(tmp_path / "step.onnx"), str(tmp_path / "amp.onnx"), "--policy", "amp"]) == 0
    amp = onnx.load(tmp_path / "amp.onnx")
    assert scatters(amp) == [(ops.DOMAIN, "ScatterNDAdd")] * 2
    amp_losses, _ = train(amp, "mse", steps=6)
    fp32_losses, _ = train(step, "mse", steps=6)
    assert np.isfinite(amp_losses).all() and amp_losses[-1] < amp_losses[0]
    np.testing.assert_allclose(amp_losses, fp32_losses, rtol=0.02)
