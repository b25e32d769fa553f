"""The written model (``onnxcampo.ir.export``): If/Loop/Scan bodies that nothing changed are
written as they were read, so the outer weights they read stay once in the outer graph instead of
being copied into every branch (graphsurgeon's export copies them: silero_vad grew 1.41x)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
import pytest
from helpers import init, make_model, tensor_vi, weight
from onnx import TensorProto, helper

from onnxcampo import OptimizeConfig, optimize
from onnxcampo.ir.export import export_model, to_graphsurgeon

W_SHAPE = (64, 64)


def _if_model(*, outer_reader: bool) -> onnx.ModelProto:
    """``y = If(c) then MatMul(x, W) else MatMul(x, W) * 2``: both branches read the outer
    initializer W; with ``outer_reader`` a MatMul outside the If reads it too."""
    then_branch = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="then_mm")], "then", [],
                                    [tensor_vi("t", [8, 64])])
    else_branch = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["e0"], name="else_mm"),
                                     helper.make_node("Mul", ["e0", "two"], ["e"], name="else_mul")], "else", [],
                                    [tensor_vi("e", [8, 64])], [init("two", np.float32(2.0))])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_branch, else_branch=else_branch)]
    outputs = [tensor_vi("y", [8, 64])]
    if outer_reader:
        nodes.append(helper.make_node("MatMul", ["x", "W"], ["z"], name="outer_mm"))
        outputs.append(tensor_vi("z", [8, 64]))
    model = make_model(nodes, [tensor_vi("c", [], TensorProto.BOOL), tensor_vi("x", [8, 64])], outputs,
                       [weight("W", W_SHAPE)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _initializers(graph: onnx.GraphProto, where: str = "main") -> dict[str, list[str]]:
    found = {where: sorted(t.name for t in graph.initializer)}
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found.update(_initializers(attr.g, f"{node.name}.{attr.name}"))
    return found


def _run(model: onnx.ModelProto, cond: bool) -> list[np.ndarray]:
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"c": np.array(cond), "x": x})


@pytest.mark.parametrize("in_place", [False, True])
def test_export_writes_an_unchanged_body_as_read(in_place):
    """Nothing edited -> each branch as read (``two`` its own initializer), W once, outside."""
    model = _if_model(outer_reader=False)
    expected = onnx.ModelProto.FromString(model.SerializeToString())
    out = export_model(to_graphsurgeon(model), model, {}, {}, in_place=in_place)
    assert _initializers(out.graph) == {"main": ["W"], "if.then_branch": [], "if.else_branch": ["two"]}
    assert out.graph.node[0] == expected.graph.node[0]
    onnx.checker.check_model(out, full_check=True)


def test_export_writes_a_changed_body_with_what_it_reads():
    """A body edited in the graph (its Mul now by 3) -> exported by graphsurgeon, with the outer
    W it reads copied in; the unchanged branch as read, so W stays in the outer graph too."""
    model = _if_model(outer_reader=False)
    graph = to_graphsurgeon(model)
    body = graph.nodes[0].attrs["else_branch"]
    mul = next(node for node in body.nodes if node.op == "Mul")
    mul.inputs[1] = gs.Constant("three", np.array(3.0, dtype=np.float32))
    out = export_model(graph, model, {}, {})
    placed = _initializers(out.graph)
    assert placed == {"main": ["W"], "if.then_branch": [], "if.else_branch": ["W", "three"]}
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.slow
@pytest.mark.parametrize("outer_reader", [False, True], ids=["read-only-by-the-bodies", "read-outside-too"])
@pytest.mark.parametrize("policy", ["campo", "fp32", "fp16"])
def test_unchanged_if_bodies_are_written_as_read_and_outer_weights_stay_once(outer_reader, policy):
    """Before -> expected: W in the outer graph, branches without initializers but their own
    ``two``; after any policy the same, whatever became fp16 outside; the outputs unchanged."""
    model = _if_model(outer_reader=outer_reader)
    W = onnx.numpy_helper.to_array(model.graph.initializer[0])
    result = optimize(model, config=OptimizeConfig(policy=policy, experimental={"compare_plans": False}))
    out = result.model
    placed = _initializers(out.graph)
    assert "W" in placed["main"]
    assert placed["if.then_branch"] == [] and placed["if.else_branch"] == ["two"]
    assert out.ByteSize() < model.ByteSize() + W.nbytes  # no second float32 W (an fp16 one for outer_mm is fine)
    onnx.checker.check_model(out, full_check=True)
    for cond in (True, False):
        ours, reference = _run(out, cond), _run(model, cond)
        for got, want in zip(ours, reference):
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=2e-2)
