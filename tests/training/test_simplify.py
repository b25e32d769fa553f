"""simplify_backward: the same gradients from a smaller, cheaper backward graph (CPU).

Policy under test (``onnxcampo/training/simplify.py``): onnx-ad's Conv weight gradient (a Conv
with an output-sized kernel) becomes one Gemm over an im2col of strided Slices; Expands to the
same shape, Transposes that only move the size-1 seed axis, Reshape chains and whole-tensor
Slices go; graph outputs are never renamed away. The loss and every gradient stay equal to the
graph as emitted (float-level differences from the order of additions only).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.errors import ConfigError
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.runtime import make_session
from onnxcampo.training import Trainer, build_train_step, initial_weights, step_spec
from onnxcampo.training.simplify import simplify_backward

RNG = np.random.default_rng(0)



def _applied(losses: list[float]) -> list[float]:
    """The losses of the steps dynamic loss scaling applied: a skipped step (an overflow halves the
    scale) leaves the weights as they were, so the next loss repeats the last one exactly. Skips
    come first (the scale halves from 2^16) but may follow an applied step too."""
    return [loss for k, loss in enumerate(losses) if k == 0 or loss != losses[k - 1]]

def _conv(nodes, inits, x, cin, cout, kernel, stride, pads, tag, dilation=1):
    w = (RNG.standard_normal((cout, cin, *kernel)) * np.sqrt(2.0 / (cin * np.prod(kernel)))).astype(np.float32)
    b = (0.1 * RNG.standard_normal(cout)).astype(np.float32)
    inits += [numpy_helper.from_array(w, f"{tag}.w"), numpy_helper.from_array(b, f"{tag}.b")]
    nodes.append(helper.make_node("Conv", [x, f"{tag}.w", f"{tag}.b"], [tag], name=tag, kernel_shape=list(kernel),
                                  strides=[stride, stride], pads=pads, dilations=[dilation, dilation]))
    return tag


def _relu(nodes, x):
    nodes.append(helper.make_node("Relu", [x], [x + "/relu"], name=x + "/relu"))
    return x + "/relu"


def small_cnn(batch: int = 3, width: int = 1) -> onnx.ModelProto:
    """Every Conv shape the rewrite meets: a 7x7 stride-2 stem (the dilated, cropped case), MaxPool
    3x3/2, a residual block (1x1, 3x3, 1x1 and Add), a stride-2 block with a 1x1 stride-2
    downsample, a non-square 3x5 kernel, a dilated 3x3 and a 1x1 Conv without bias on a
    non-square image; then GlobalAveragePool, Flatten, Gemm. ``width`` multiplies the channels."""
    nodes, inits = [], []
    c4, c8, c16 = 4 * width, 8 * width, 16 * width
    x = _relu(nodes, _conv(nodes, inits, "x", 3, c8, (7, 7), 2, [3, 3, 3, 3], "stem"))
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    y = _relu(nodes, _conv(nodes, inits, "pool", c8, c4, (1, 1), 1, [0, 0, 0, 0], "b1.c1"))
    y = _relu(nodes, _conv(nodes, inits, y, c4, c4, (3, 3), 1, [1, 1, 1, 1], "b1.c2"))
    y = _conv(nodes, inits, y, c4, c8, (1, 1), 1, [0, 0, 0, 0], "b1.c3")
    nodes.append(helper.make_node("Add", [y, "pool"], ["b1.sum"]))
    x = _relu(nodes, "b1.sum")
    y = _relu(nodes, _conv(nodes, inits, x, c8, c8, (3, 3), 2, [1, 1, 1, 1], "b2.c1"))
    y = _conv(nodes, inits, y, c8, c16, (3, 5), 1, [1, 2, 1, 2], "b2.c2")
    short = _conv(nodes, inits, x, c8, c16, (1, 1), 2, [0, 0, 0, 0], "b2.down")
    nodes.append(helper.make_node("Add", [y, short], ["b2.sum"]))
    x = _relu(nodes, "b2.sum")
    x = _relu(nodes, _conv(nodes, inits, x, c16, c16, (3, 3), 1, [2, 2, 2, 2], "dilated", dilation=2))
    w = (RNG.standard_normal((12, c16, 1, 1)) * 0.3).astype(np.float32)
    inits.append(numpy_helper.from_array(w, "nobias.w"))
    nodes.append(helper.make_node("Conv", [x, "nobias.w"], ["nobias"], kernel_shape=[1, 1]))
    nodes.append(helper.make_node("GlobalAveragePool", ["nobias"], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], axis=1))
    fc = (RNG.standard_normal((5, 12)) * 0.3).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc.w"), numpy_helper.from_array(np.zeros(5, np.float32), "fc.b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 30, 38])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def mlp() -> onnx.ModelProto:
    w1 = (RNG.standard_normal((8, 16)) * 0.3).astype(np.float32)
    w2 = (RNG.standard_normal((3, 16)) * 0.3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["h2"]),
         helper.make_node("Relu", ["h2"], ["a"]), helper.make_node("Gemm", ["a", "w2"], ["y"], transB=1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 3])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.full(16, 0.1, np.float32), "b1"),
         numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _feeds(step: onnx.ModelProto, forward: onnx.ModelProto, classes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in step.graph.input}
    spec = step_spec(step)
    feeds = {name: rng.integers(0, classes, declared[name]).astype(np.int64) if name == "labels"
             else rng.standard_normal(declared[name]).astype(np.float32) for name in spec.batch}
    feeds.update(initial_weights(forward, step))
    feeds["lr"] = np.array(1.0, np.float32)
    return feeds


def _gradients(forward: onnx.ModelProto, classes: int, *, simplify: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The loss and every gradient, read off one SGD step with lr = 1 (grad = w - w.updated)."""
    step = build_train_step(forward, loss="cross_entropy", optimizer="sgd", fused=False, simplify=simplify)
    feeds = _feeds(step, forward, classes)
    names = [o.name for o in step.graph.output]
    values = dict(zip(names, make_session(step).run(names, feeds)))
    grads = {n[: -len(".updated")]: feeds[n[: -len(".updated")]] - v for n, v in values.items() if n.endswith(".updated")}
    return step, {"loss": values["loss"], **grads}


def _assert_same(got: dict, expected: dict, tolerance: float) -> None:
    assert set(got) == set(expected)
    for name, value in expected.items():
        scale = float(np.abs(value).max()) or 1.0
        assert np.abs(got[name] - value).max() <= tolerance * scale, name


@pytest.mark.slow
@pytest.mark.parametrize("model, classes", [(mlp, 3), (small_cnn, 5)], ids=["mlp", "cnn"])
def test_same_loss_and_gradients_from_fewer_nodes(model, classes):
    forward = model()
    plain, expected = _gradients(forward, classes, simplify=False)
    simple, got = _gradients(forward, classes, simplify=True)
    _assert_same(got, expected, 1e-5)
    taps = sum(n.name.startswith("simplify/tap") for n in simple.graph.node)  # im2col: one Slice per kernel tap
    assert len(simple.graph.node) - taps < len(plain.graph.node)
    ops, before = Counter(n.op_type for n in simple.graph.node), Counter(n.op_type for n in plain.graph.node)
    assert ops["Transpose"] < before["Transpose"] and ops["Expand"] < before["Expand"]
    # each gradient's Reshape -> Identity -> Squeeze (seed axis off) is one Reshape; no Unsqueeze left
    assert ops["Identity"] == 0 and ops["Squeeze"] == 0 and ops["Unsqueeze"] == 0
    assert before["Identity"] > 0 and before["Squeeze"] > 0
    # the 7x7 stem's 49 taps: Concats of at most 32 inputs (ORT's limit inside a CUDA graph)
    assert max((len(n.input) for n in simple.graph.node if n.op_type == "Concat"), default=0) <= 32
    if model is small_cnn:
        assert taps >= 49 and any(n.name.startswith("simplify/im2col_part") for n in simple.graph.node)


@pytest.mark.slow
def test_every_conv_weight_gradient_becomes_a_gemm():
    """Before: one extra Conv per trainable Conv weight (the swapped-operand weight gradient).
    After: only the forward Convs are left, and one Gemm per Conv weight (plus the fc's adjoint
    MatMuls, unchanged)."""
    forward = small_cnn()
    convs = sum(n.op_type == "Conv" for n in forward.graph.node)
    plain, _ = _gradients(forward, 5, simplify=False)
    simple, _ = _gradients(forward, 5, simplify=True)
    assert sum(n.op_type == "Conv" for n in plain.graph.node) == 2 * convs
    assert sum(n.op_type == "Conv" for n in simple.graph.node) == convs
    assert sum(n.op_type == "Gemm" for n in simple.graph.node) == convs + 1  # + the forward fc
    onnx.checker.check_model(simple)


@pytest.mark.slow
def test_training_with_simplified_steps_follows_the_same_curve():
    """Ten AdamW steps on the CNN: the two loss curves agree (the update reads the gradients
    through Adam's normalisation, so float-level differences stay float-level)."""
    forward = small_cnn()
    curves = []
    batch = None
    for simplify in (False, True):
        step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", lr=0.01, simplify=simplify)
        batch = batch or {k: v for k, v in _feeds(step, forward, 5).items() if k in step_spec(step).batch}
        trainer = Trainer(step, weights=initial_weights(forward, step))
        curves.append([trainer.step(batch) for _ in range(10)])
    assert curves[1][-1] < curves[1][0]
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-4)


def test_graph_outputs_are_never_aliased_away():
    """An Expand to its input's own shape is dropped, except when its output is a graph output."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["inner"]), helper.make_node("Relu", ["inner"], ["y"]),
         helper.make_node("Expand", ["y", "shape"], ["out"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "shape")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    counts = simplify_backward(model)
    assert counts["same-shape Expand"] == 1
    assert [n.op_type for n in model.graph.node] == ["Relu", "Expand"]
    assert model.graph.node[0].input[0] == "x" and model.graph.node[1].output[0] == "out"


def test_unit_axis_transposes_become_reshapes_and_pairs_compose():
    """Transpose [2,3,1] -> [1,2,3] moves only the size-1 axis: a Reshape; two Transposes in a row
    are one; a Reshape of a Reshape is one; the values do not change."""
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t1"], perm=[2, 0, 1]),           # [1, 2, 3]: a Reshape
         helper.make_node("Reshape", ["t1", "flat"], ["r1"]),                     # [2, 3]
         helper.make_node("Transpose", ["r1"], ["t2"], perm=[1, 0]),
         helper.make_node("Transpose", ["t2"], ["t3"], perm=[1, 0]),              # identity with t2
         helper.make_node("Relu", ["t3"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "flat")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = RNG.standard_normal((2, 3, 1)).astype(np.float32)
    expected = make_session(model.SerializeToString()).run(None, {"x": x})[0]
    simplify_backward(model)
    assert [n.op_type for n in model.graph.node] == ["Reshape", "Relu"]
    np.testing.assert_array_equal(make_session(model.SerializeToString()).run(None, {"x": x})[0], expected)

@pytest.mark.slow
def test_second_pass_names_are_fresh_and_the_seed_survives():
    """The alias pass after the update is added runs on a graph the first pass already named
    into: its names must not collide, and the seed (an initializer loss scaling replaces) stays."""
    from onnxcampo.training.scaling import SEED_KEY

    step = build_train_step(small_cnn(), loss="cross_entropy", optimizer="momentum", fused=False)
    onnx.checker.check_model(step, full_check=True)
    seed = next(p.value for p in step.metadata_props if p.key == SEED_KEY)
    assert seed in {t.name for t in step.graph.initializer}
    assert any(seed in n.input for n in step.graph.node)
    with pytest.raises(ValueError, match="unknown simplify rules"):
        from onnxcampo.training.simplify import simplify_backward

        simplify_backward(step, rules=["no such rule"])


@pytest.mark.slow
def test_the_prediction_survives_when_the_forward_model_ends_in_an_identity():
    """The loss region (kept fp32 by optimize) is found from the prediction's name: a forward
    model that ends in Identity (exporters write one; the benchmark's cut classifiers do) must
    keep that tensor, or a mixed plan puts the loss and its gradient in fp16."""
    from onnxcampo.api import optimize
    from onnxcampo.training.scaling import PREDICTION_KEY, fp32_nodes

    forward = mlp()
    out = forward.graph.output[0]
    inner = out.name + "_pre"
    for node in forward.graph.node:
        node.output[:] = [inner if o == out.name else o for o in node.output]
    forward.graph.node.append(helper.make_node("Identity", [inner], [out.name], name="final_identity"))
    plain = build_train_step(forward, loss="cross_entropy", optimizer="sgd", fused=False, simplify=False)
    simple = build_train_step(forward, loss="cross_entropy", optimizer="sgd", fused=False, simplify=True)
    prediction = next(p.value for p in simple.metadata_props if p.key == PREDICTION_KEY)
    assert any(prediction in n.output for n in simple.graph.node)
    loss_ops = sorted(n.op_type for n in simple.graph.node if n.name in fp32_nodes(simple) and n.name.startswith("loss/"))
    assert loss_ops == sorted(n.op_type for n in plain.graph.node if n.name in fp32_nodes(plain)
                              and n.name.startswith("loss/"))
    plan = optimize(simple, policy="fp16").plan
    assert all(not plan.is_fp16(n.name) for n in simple.graph.node if n.name.startswith("loss/"))


def _reduce_model(shape, axes, keepdims: int, opset: int = 17) -> onnx.ModelProto:
    """One ReduceSum (axes as an input from opset 13, as an attribute before) feeding a Relu."""
    if opset >= 13:
        node = helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=keepdims)
        inits = [numpy_helper.from_array(np.array(axes, np.int64), "axes")]
    else:
        node = helper.make_node("ReduceSum", ["x"], ["s"], keepdims=keepdims, axes=list(axes))
        inits = []
    graph = helper.make_graph([node, helper.make_node("Relu", ["s"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _reduced_axes(model: onnx.ModelProto) -> list[tuple[tuple[int, ...], list[int]]]:
    """(input shape, axes) of every ReduceSum, from shape inference."""
    from onnxcampo import ir

    info, _ = ir.infer_tensor_info(model)
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        if node.op_type == "ReduceSum":
            axes = consts[node.input[1]] if len(node.input) > 1 else next(
                helper.get_attribute_value(a) for a in node.attribute if a.name == "axes")
            rank = len(info[node.input[0]].shape)
            found.append((tuple(info[node.input[0]].shape), sorted(int(a) % rank for a in np.reshape(axes, -1))))
    return found


def _is_matrix_block(shape, axes) -> bool:
    """ORT CUDA's fast ReduceSum: size-1 dims set aside, one block of axes from the first or to the
    last dim, not both (``get_applicable_matrix_reduction``)."""
    kept = [axis for axis, dim in enumerate(shape) if dim != 1]
    reduced = [i for i, axis in enumerate(kept) if axis in axes]
    return not reduced or (reduced == list(range(reduced[0], reduced[-1] + 1))
                           and (reduced[0] == 0) != (reduced[-1] == len(kept) - 1))


@pytest.mark.parametrize("shape, axes, keepdims, opset, expected", [
    # a Conv bias gradient: [N, C, H, W, seed] over (0, 2, 3) -> rows of [N*C, H*W], then [N, C]
    ((4, 5, 3, 2, 1), [0, 2, 3], 0, 17, [((4, 5, 6), [2]), ((4, 5), [0])]),
    ((4, 5, 3, 2, 1), [0, 2, 3], 1, 17, [((4, 5, 6), [2]), ((4, 5), [0])]),
    ((4, 5, 3, 2, 1), [0, -3, 3], 0, 11, [((4, 5, 6), [2]), ((4, 5), [0])]),   # axes as an attribute
    ((1, 4, 1, 5, 3), [1, 4], 1, 17, [((4, 5, 3), [2]), ((4, 5), [0])]),   # size-1 axes set aside
    ((3, 6, 7), [0, 2], 0, 17, [((3, 6, 7), [2]), ((3, 6), [0])]),
])
def test_reductions_become_matrix_rows_and_columns(shape, axes, keepdims, opset, expected):
    """A ReduceSum ORT would hand to cuDNN's general reduction becomes the row and column sums it
    runs fast (rule 7); shapes and values (up to the order of additions) are those of the original."""
    model = _reduce_model(shape, axes, keepdims, opset)
    x = RNG.standard_normal(shape).astype(np.float32)
    want = make_session(model.SerializeToString()).run(None, {"x": x})[0]
    counts = simplify_backward(model)
    assert counts["ReduceSum as matrix reductions"] == 1
    assert _reduced_axes(model) == expected
    assert all(_is_matrix_block(s, a) for s, a in _reduced_axes(model))
    got = make_session(model.SerializeToString()).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.maximum(x.sum(axis=tuple(axes), keepdims=bool(keepdims)), 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, axes", [
    ((4, 5, 3), [0]),          # already rows of a matrix
    ((4, 5, 3), [1, 2]),       # already columns
    ((4, 5, 3), [1]),          # a middle axis: no matrix without a transpose
    ((4, 5, 3), [0, 1, 2]),    # everything: nothing kept
    ((4, 1, 3), [0, 2]),       # nothing kept once size-1 axes are set aside
    ((4, 5, 3, 2, 1), [2, 3]),  # columns once the size-1 seed axis is set aside (as ORT does)
    ((1, 6, 1, 7), [0, 3]),    # the same
])
def test_reductions_left_alone(shape, axes):
    model = _reduce_model(shape, axes, 1)
    before = model.graph.SerializeToString()
    assert simplify_backward(model)["ReduceSum as matrix reductions"] == 0
    assert model.graph.SerializeToString() == before


@pytest.mark.slow
def test_every_reduction_of_a_cnn_step_is_a_matrix_reduction():
    """The Conv bias gradients of a training step ([N, C, H, W, seed] over (0, 2, 3)) and every
    other ReduceSum of the simplified step run on ORT's row or column kernels."""
    plain = build_train_step(small_cnn(), loss="cross_entropy", optimizer="sgd", fused=False, simplify=False)
    simple = build_train_step(small_cnn(), loss="cross_entropy", optimizer="sgd", fused=False)
    assert sum(not _is_matrix_block(s, a) for s, a in _reduced_axes(plain)) >= 7   # the 7 Conv biases
    assert all(_is_matrix_block(s, a) for s, a in _reduced_axes(simple))


def sequence_mlp() -> onnx.ModelProto:
    """A transformer's feed-forward block on [batch, sequence, features] (x W with a 3-D x), mean
    over the sequence: each weight's gradient is a sum over the batch of per-sample products."""
    w1 = (RNG.standard_normal((8, 16)) * 0.3).astype(np.float32)
    w2 = (RNG.standard_normal((16, 3)) * 0.3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["h2"]),
         helper.make_node("Relu", ["h2"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["t"]),
         helper.make_node("ReduceMean", ["t"], ["y"], axes=[1], keepdims=0)],
        "sequence_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.full(16, 0.1, np.float32), "b1"),
         numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_batched_matmul_weight_gradient_becomes_one_gemm():
    """Before: per-sample products [batch, K, N] summed over the batch (a ReduceSum of a MatMul);
    after: one Gemm over batch x sequence rows per weight, the same gradients."""
    forward = sequence_mlp()
    plain, expected = _gradients(forward, 3, simplify=False)
    simple, got = _gradients(forward, 3, simplify=True)
    _assert_same(got, expected, 1e-5)

    def summed_products(model):  # ReduceSums of a MatMul's product, through data movement
        made = {o: n for n in model.graph.node for o in n.output}

        def source(name):
            node = made.get(name)
            while node is not None and node.op_type in ("Reshape", "Transpose"):
                node = made.get(node.input[0])
            return node.op_type if node is not None else None
        return sum(n.op_type == "ReduceSum" and source(n.input[0]) == "MatMul" for n in model.graph.node)

    assert summed_products(plain) == 2 and summed_products(simple) == 0
    gemms = [n for n in simple.graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 2 and all(any(a.name == "transA" and a.i == 1 for a in n.attribute) for n in gemms)
    counts = simplify_backward(build_train_step(forward, loss="cross_entropy", optimizer="sgd", fused=False,
                                                simplify=False))
    assert counts["matmul weight gradient as Gemm"] == 2


def _fused_gradients(forward: onnx.ModelProto, classes: int, *, fused: bool, conv_weight_grad: str = "gemm"):
    """:func:`_gradients` of the simplified step with or without the ai.onnxcampo ops."""
    step = build_train_step(forward, loss="cross_entropy", optimizer="sgd", fused=fused,
                            conv_weight_grad=conv_weight_grad)
    feeds = _feeds(step, forward, classes)
    names = [o.name for o in step.graph.output]
    values = dict(zip(names, make_session(step).run(names, feeds)))
    grads = {n[: -len(".updated")]: feeds[n[: -len(".updated")]] - v for n, v in values.items() if n.endswith(".updated")}
    return step, {"loss": values["loss"], **grads}


def _needs_ops():
    from onnxcampo import ops

    if not ops.available():
        pytest.skip(f"custom-op library not built ({ops.BUILD_COMMAND})")


@pytest.mark.slow
def test_fused_steps_build_each_im2col_with_one_op_from_the_conv_input():
    """With the fused ops, rule 1 reads each forward Conv's input through one ai.onnxcampo::Im2Col
    (no Pad, Transpose, Slice or Concat left for it): the same loss and gradients as the
    standard-op im2col (the Gemm reads the same matrix)."""
    _needs_ops()
    forward = small_cnn()
    plain, expected = _fused_gradients(forward, 5, fused=False)
    fused, got = _fused_gradients(forward, 5, fused=True)
    _assert_same(got, expected, 1e-5)
    before, after = Counter(n.op_type for n in plain.graph.node), Counter(n.op_type for n in fused.graph.node)
    assert before["Slice"] >= 49 + 9 and before["Concat"] >= 3 and before["Pad"] > 0
    assert after["Slice"] == after["Concat"] == after["Pad"] == 0
    assert not any(n.name.startswith(("simplify/tap", "simplify/im2col")) for n in fused.graph.node)
    convs = [n for n in forward.graph.node if n.op_type == "Conv"]
    im2cols = [n for n in fused.graph.node if n.op_type == "Im2Col"]
    assert len(im2cols) == len(convs) and all(n.domain == "ai.onnxcampo" for n in im2cols)
    assert after["Transpose"] == before["Transpose"] - len(convs)  # the images' Transposes (dy's stay)
    readers = {name: [n for n in fused.graph.node if name in n.input] for name in (n.output[0] for n in im2cols)}
    assert all([r.op_type for r in users] == ["Gemm"] for users in readers.values())
    from onnxcampo.ir import infer_tensor_info
    from onnxcampo.ir.edit import attribute

    shapes = {name: entry.shape for name, entry in infer_tensor_info(forward)[0].items()}
    wanted = {}  # forward Conv input -> what Im2Col must give the Gemm: the attributes, [Cin*kh*kw, N*Ho*Wo]
    for conv in convs:
        n, cin = shapes[conv.input[0]][:2]
        kernel, (ho, wo) = tuple(attribute(conv, "kernel_shape")), shapes[conv.output[0]][2:]
        wanted.setdefault(conv.input[0], set()).add((kernel, tuple(attribute(conv, "strides", [1, 1])),
                                                     tuple(attribute(conv, "dilations", [1, 1])),
                                                     (cin * kernel[0] * kernel[1], n * ho * wo)))
    for node in im2cols:
        kernel = tuple(attribute(node, "kernel_shape"))
        shape = op_nodes.im2col_shape(shapes[node.input[0]], kernel_shape=kernel, strides=attribute(node, "strides"),
                                   dilations=attribute(node, "dilations"), pads=attribute(node, "pads"))
        assert (kernel, tuple(attribute(node, "strides")), tuple(attribute(node, "dilations")), shape) \
            in wanted[node.input[0]], node.name
    onnx.checker.check_model(fused)


@pytest.mark.slow
def test_conv_weight_grad_op_replaces_im2col_and_gemm():
    """conv_weight_grad="cudnn": each Conv weight gradient whose pads cuDNN serves is one
    ai.onnxcampo::ConvWeightGrad(x, dy) (no Im2Col, no Gemm, dy's Transpose gone): the same loss
    and gradients as the standard ops; the op goes fp16 under the fp16 policy and the written step
    loads and trains on ORT's CPU (its CPU kernel)."""
    from onnxcampo.api import optimize

    _needs_ops()
    forward = small_cnn()
    plain, expected = _fused_gradients(forward, 5, fused=False)
    step, got = _fused_gradients(forward, 5, fused=True, conv_weight_grad="cudnn")
    _assert_same(got, expected, 1e-5)
    convs = [n for n in forward.graph.node if n.op_type == "Conv"]
    ops_ = Counter(n.op_type for n in step.graph.node)
    assert ops_["ConvWeightGrad"] == len(convs) and ops_["Im2Col"] == 0
    assert ops_["Transpose"] < Counter(n.op_type for n in plain.graph.node)["Transpose"] - len(convs)
    result = optimize(step, policy="fp16")
    grads = [n for n in step.graph.node if n.op_type == "ConvWeightGrad"]
    assert all(result.plan.is_fp16(n.name) for n in grads)
    batch = {k: v for k, v in _feeds(step, forward, 5).items() if k in step_spec(step).batch}
    curves = {}
    for name, model in (("fp32", step), ("fp16", result.model)):
        trainer = Trainer(model, weights=initial_weights(forward, model))
        curves[name] = [trainer.step(batch) for _ in range(12)]
    applied = _applied(curves["fp16"])  # dynamic loss scaling skips some steps
    assert len(curves["fp16"]) - len(applied) < 6 and curves["fp16"][-1] < 0.5 * curves["fp16"][0]
    np.testing.assert_allclose(applied, curves["fp32"][:len(applied)], rtol=0.05, atol=1e-4 * curves["fp32"][0])
    with pytest.raises(ConfigError, match="unknown conv_weight_grad 'direct'"):
        build_train_step(forward, loss="cross_entropy", conv_weight_grad="direct")


def test_the_default_conv_weight_gradient_follows_the_host(tmp_path, monkeypatch):
    """conv_weight_grad=None (train-graph's --conv-weight-grad auto): ConvWeightGrad where the
    step's ops will run on CUDA (onnxruntime's CUDA provider and the library's CUDA kernels), the
    Gemm over Im2Col elsewhere; without the fused ops always standard ops."""
    from onnxcampo import ops
    from onnxcampo.cli import main

    _needs_ops()
    forward = small_cnn()
    for here, op in ((True, "ConvWeightGrad"), (False, "Im2Col")):
        monkeypatch.setattr(ops, "cuda_kernels_here", lambda here=here: here)
        found = Counter(n.op_type for n in build_train_step(forward, loss="cross_entropy").graph.node)
        assert found[op] > 0 and found["Im2Col" if here else "ConvWeightGrad"] == 0
        plain = Counter(n.op_type for n in build_train_step(forward, loss="cross_entropy", fused=False).graph.node)
        assert plain["ConvWeightGrad"] == plain["Im2Col"] == 0
        forward_path, out = tmp_path / "cnn.onnx", tmp_path / f"auto-{here}.onnx"
        onnx.save(forward, forward_path)
        assert main(["train-graph", str(forward_path), str(out), "--loss", "cross_entropy"]) == 0
        assert Counter(n.op_type for n in onnx.load(out).graph.node)[op] > 0
    import onnxruntime as ort

    expected = "CUDAExecutionProvider" in ort.get_available_providers() and ops.build_info()["kernels"] == "cpu+cuda"
    monkeypatch.undo()
    assert ops.cuda_kernels_here() == expected


def test_train_graph_cli_chooses_the_conv_weight_gradient(tmp_path):
    from onnxcampo.cli import main

    _needs_ops()
    forward_path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), forward_path)
    for choice, op in (("cudnn", "ConvWeightGrad"), ("gemm", "Im2Col")):
        out = tmp_path / f"{choice}.onnx"
        assert main(["train-graph", str(forward_path), str(out), "--loss", "cross_entropy",
                     "--conv-weight-grad", choice]) == 0
        found = Counter(n.op_type for n in onnx.load(out).graph.node)
        assert found[op] > 0 and found["ConvWeightGrad" if choice == "gemm" else "Im2Col"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fp16", "amp"])
def test_im2col_goes_fp16_with_its_gemm(policy, tmp_path):
    """Im2Col is a clear op whose output has its input's type: under fp16 and amp it runs fp16
    together with the weight-gradient Gemm (no Cast between them, its declared type retyped); the
    written step (``onnxcampo optimize``) trains like the fp32 one on ORT's CPU."""
    from onnxcampo.api import optimize
    from onnxcampo.cli import main

    _needs_ops()
    forward = small_cnn()
    step = build_train_step(forward, loss="cross_entropy", optimizer="adamw", lr=0.01, fused=True,
                            conv_weight_grad="gemm")
    result = optimize(step, policy=policy)
    im2cols = [n for n in step.graph.node if n.op_type == "Im2Col"]
    readers = {i: n for n in step.graph.node for i in n.input}
    assert im2cols and all(result.plan.is_fp16(n.name) and result.plan.is_fp16(readers[n.output[0]].name) for n in im2cols)
    model = result.model
    written = [n for n in model.graph.node if n.op_type == "Im2Col"]
    declared = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    assert len(written) == len(im2cols)
    assert all(declared[n.output[0]] == TensorProto.FLOAT16 for n in written)
    assert not any(readers_of.op_type == "Cast" for n in written for readers_of in model.graph.node
                   if n.output[0] in readers_of.input)
    step_path, out_path = tmp_path / "step.onnx", tmp_path / f"{policy}.onnx"
    onnx.save(step, step_path)
    assert main(["optimize", str(step_path), str(out_path), "--policy", policy]) == 0
    saved = onnx.load(out_path)
    assert sum(n.op_type == "Im2Col" for n in saved.graph.node) == len(im2cols)
    batch = {k: v for k, v in _feeds(step, forward, 5).items() if k in step_spec(step).batch}
    curves = {}
    for name, graph in (("fp32", step), (policy, saved)):
        trainer = Trainer(graph, weights=initial_weights(forward, graph))
        curves[name] = [trainer.step(batch) for _ in range(12)]
    applied = _applied(curves[policy])  # dynamic loss scaling skips some steps
    assert len(curves[policy]) - len(applied) < 6 and curves[policy][-1] < 0.5 * curves[policy][0]
    # near zero the curves are sums of a few rounded terms, and ORT CPU's threads may add them in
    # another order from run to run: relative closeness down to 1e-4 of the first loss
    np.testing.assert_allclose(applied, curves["fp32"][:len(applied)], rtol=0.05, atol=1e-4 * curves["fp32"][0])


@pytest.mark.slow
def test_elementwise_of_reshapes_moves_the_reshape_after_the_op():
    """Rule 7b: Mul(Reshape(a), Reshape(b)) of same-shape a, b -> Reshape(Mul(a, b)), the same
    values; on a CNN step it takes the seed axis off each ReLU's backward mask product."""
    model = onnx.parser.parse_model('''<ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] a, float[2,3] b) => (float[2,3,1] y) {
      s = Constant <value = int64[3] {2, 3, 1}> ()
      ra = Reshape(a, s)
      rb = Reshape(b, s)
      y = Mul(ra, rb)
    }''')
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": rng.standard_normal((2, 3)).astype(np.float32)}
    want = make_session(model).run(None, feeds)[0]
    counts = simplify_backward(model)
    assert counts["elementwise of Reshapes"] == 1
    ops_ = [n.op_type for n in model.graph.node]
    assert ops_.index("Mul") < ops_.index("Reshape") and ops_.count("Reshape") == 1
    np.testing.assert_array_equal(make_session(model).run(None, feeds)[0], want)
    step = build_train_step(small_cnn(), loss="cross_entropy", optimizer="sgd", fused=False, simplify=False)
    assert simplify_backward(step)["elementwise of Reshapes"] >= 5  # one per ReLU mask product at least


# --- rule 8: LayerNorm statistics from the forward node -----------------------------------------

LN_RULE = ["LayerNorm statistics from the forward"]


def _layernorm_recompute(epsilon_used: float = 1e-5) -> onnx.ModelProto:
    """A LayerNormalization (epsilon 1e-5) and the statistics onnx-ad's adjoint recomputes from its
    input: mean, x - mean, 1 / sqrt(mean((x - mean)^2) + epsilon_used), read by outputs."""
    model = onnx.parser.parse_model(f"""
    <ir_version: 9, opset_import: ["" : 17]>
    g (float[4,6,8] x, float[8] s, float[8] b) => (float[4,6,8] y, float[4,6,8] xhat) {{
      y = LayerNormalization <axis = -1, epsilon = 0.00001> (x, s, b)
      mean = ReduceMean <axes = [2], keepdims = 1> (x)
      d = Sub(x, mean)
      sq = Mul(d, d)
      var = ReduceMean <axes = [2], keepdims = 1> (sq)
      eps = Constant <value = float {{{epsilon_used}}}> ()
      ve = Add(var, eps)
      root = Sqrt(ve)
      invstd = Reciprocal(root)
      xhat = Mul(d, invstd)
    }}
    """)
    from onnxcampo import ir

    ir.name_nodes(model)
    return model


def test_the_adjoint_reads_the_layernorms_own_mean_and_inverse_deviation():
    """The recompute goes; the LayerNormalization gets its Mean and InvStdDev outputs, which the
    adjoint reads; the values are the same (ORT's float32 statistics, summed in another order)."""
    from onnx.reference import ReferenceEvaluator

    model = _layernorm_recompute()
    x = RNG.standard_normal((4, 6, 8)).astype(np.float32) * 3 + 1
    feeds = {"x": x, "s": np.ones(8, np.float32), "b": np.zeros(8, np.float32)}
    want = ReferenceEvaluator(model).run(None, feeds)
    counts = simplify_backward(model, rules=LN_RULE)
    assert counts["LayerNorm statistics from the forward"] == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("ReduceMean") == 0 and "Sqrt" not in ops and "Reciprocal" not in ops
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    assert len(ln.output) == 3 and all(ln.output)
    got = ReferenceEvaluator(model).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    session = make_session(model, provider="cpu")  # ORT's CPU LayerNormalization writes them too
    np.testing.assert_allclose(session.run(None, feeds)[1], want[1], rtol=1e-4, atol=1e-5)


def test_another_epsilon_or_a_used_statistic_output_leaves_the_recompute():
    model = _layernorm_recompute(epsilon_used=1e-6)
    assert simplify_backward(model, rules=LN_RULE)["LayerNorm statistics from the forward"] == 0
    assert [n.op_type for n in model.graph.node].count("ReduceMean") == 2
    model = _layernorm_recompute()
    ln = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    ln.output.extend(["m", ""])  # the node's Mean already goes somewhere (a training-mode export)
    model.graph.output.append(helper.make_tensor_value_info("m", TensorProto.FLOAT, [4, 6, 1]))
    assert simplify_backward(model, rules=LN_RULE)["LayerNorm statistics from the forward"] == 0


def _mlp_layernorm() -> onnx.ModelProto:
    inits = [numpy_helper.from_array(RNG.standard_normal((16, 32)).astype(np.float32) * 0.3, "w"),
             numpy_helper.from_array((1 + 0.1 * RNG.standard_normal(32)).astype(np.float32), "g"),
             numpy_helper.from_array((0.1 * RNG.standard_normal(32)).astype(np.float32), "b"),
             numpy_helper.from_array(RNG.standard_normal((32, 4)).astype(np.float32) * 0.3, "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["n"], name="ln", axis=-1, epsilon=1e-5),
             helper.make_node("MatMul", ["n", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 5, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 5, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_a_layernorm_step_trains_as_without_the_rule_and_in_fp16():
    """On onnx-ad's own adjoint: the simplified step has two ReduceMeans fewer per LayerNorm, and
    its losses and weights follow the unsimplified step's; its fp16 plan (the LayerNorm fp16, its
    statistics float32) loads and trains on ORT's CPU (a wiring check)."""
    from onnxcampo.api import optimize

    forward = _mlp_layernorm()
    step = build_train_step(forward, loss="mse", optimizer="sgd", lr=0.1)
    plain = build_train_step(forward, loss="mse", optimizer="sgd", lr=0.1, simplify=False)
    ln = next(n for n in step.graph.node if n.op_type == "LayerNormalization")
    assert len(ln.output) == 3 and all(ln.output)
    means = [Counter(n.op_type for n in m.graph.node)["ReduceMean"] for m in (step, plain)]
    assert means[0] <= means[1] - 2
    x = RNG.standard_normal((8, 5, 16)).astype(np.float32)
    batch = {"x": x, "labels": RNG.standard_normal((8, 5, 4)).astype(np.float32)}
    a, b = Trainer(step, weights=initial_weights(forward, step)), Trainer(plain, weights=initial_weights(forward, plain))
    losses = [(a.step(batch), b.step(batch)) for _ in range(6)]
    np.testing.assert_allclose([p for p, _ in losses], [q for _, q in losses], rtol=1e-5)
    sa, sb = a.state_dict(), b.state_dict()
    for name in ("w", "g", "b", "w2"):
        np.testing.assert_allclose(sa[name], sb[name], rtol=1e-4, atol=1e-6)
    half = optimize(step, policy="fp16")
    assert half.plan.is_fp16(ln.name)
    trainer = Trainer(half.model, weights=initial_weights(forward, half.model))
    curve = [trainer.step(batch) for _ in range(6)]
    assert all(np.isfinite(curve)) and curve[-1] < 0.6 * curve[0]


# --- rule 9: a ReLU's mask from its output --------------------------------------------------------

RELU_RULE = ["ReLU mask from the output"]


def _relu_mask_step(signature: str, *, constants: str, rest: str, rules: list[str], dy_shape, **feeds):
    """``y = Relu(x)``, the constants zero and ``constants``, and the backward mask
    ``mf = Cast(Greater(x, zero))`` followed by ``rest`` (ONNX text); x at random with 0, -0 and NaN in its first row, dy at random, and ``feeds``. Runs
    ``rules`` and checks that the outputs stay the same (reference evaluator); returns the model
    and the rules' counts."""
    from onnx.reference import ReferenceEvaluator

    from onnxcampo import ir

    model = onnx.parser.parse_model(f"""
    <ir_version: 9, opset_import: ["" : 17]>
    g {signature} {{
      y = Relu(x)
      zero = Constant <value = float {{0.0}}> (){constants}
      m = Greater(x, zero)
      mf = Cast <to = 1> (m){rest}
    }}
    """)
    ir.name_nodes(model)
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    x[0, :3] = [0.0, -0.0, np.nan]
    feeds = {"x": x, "dy": RNG.standard_normal(dy_shape).astype(np.float32), **feeds}
    want = ReferenceEvaluator(model).run(None, feeds)
    counts = simplify_backward(model, rules=rules)
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True))
    got = ReferenceEvaluator(model).run(None, feeds)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(b, a)
    return model, counts


def test_the_relu_mask_reads_the_relus_output_with_the_same_values():
    """Greater(x, 0) -> Greater(Relu(x), 0): the same mask (x > 0 exactly when Relu(x) > 0; NaN
    false both), and x is no longer read after the forward; a comparison with another constant,
    or an x without a Relu, stays."""
    model, counts = _relu_mask_step(
        "(float[4,6] x, float[4,6] dy, float[4,6] z) => (float[4,6] dx, bool[4,6] other, bool[4,6] plain)",
        constants="""
      half = Constant <value = float {0.5}> ()""",
        rest="""
      g1 = Mul(dy, mf)
      dx = Mul(g1, y)
      other = Greater(x, half)
      plain = Greater(z, zero)""",
        rules=RELU_RULE, dy_shape=(4, 6), z=RNG.standard_normal((4, 6)).astype(np.float32))
    assert counts["ReLU mask from the output"] == 1
    greater = {n.output[0]: list(n.input) for n in model.graph.node if n.op_type == "Greater"}
    assert greater["m"][0] == "y" and greater["other"][0] == "x" and greater["plain"][0] == "z"


RELU_RESHAPE_RULES = ["ReLU mask from the output", "ReLU mask's Reshape first"]


def test_a_relu_masks_reshape_moves_to_the_relus_output_with_the_same_values():
    """Rule 9b: Reshape(Cast(Greater(y, 0))) -> Cast(Greater(Reshape(y), 0)), the mask reshaped
    to the seed-axis shape of the gradient it gates before it is computed; the same values. A
    mask read by anything else besides the Reshape stays."""
    model, counts = _relu_mask_step(
        "(float[4,6] x, float[4,6,1] dy) => (float[4,6,1] dx, float[4,6] kept)",
        constants="""
      seed = Constant <value = int64[3] {4, 6, 1}> ()""",
        rest="""
      mr = Reshape(mf, seed)
      dx = Mul(dy, mr)
      m2 = Greater(y, zero)
      mf2 = Cast <to = 1> (m2)
      mr2 = Reshape(mf2, seed)
      g2 = Mul(dy, mr2)
      back = Reshape(g2, seed)
      kept = Add(mf2, y)""",
        rules=RELU_RESHAPE_RULES, dy_shape=(4, 6, 1))
    assert counts["ReLU mask's Reshape first"] == 1  # mf2 is read by the Add too: its Reshape stays
    by_output = {n.output[0]: n for n in model.graph.node}
    assert by_output["mr"].op_type == "Cast" and by_output["mr"].input[0] in by_output
    greater = by_output[by_output["mr"].input[0]]
    assert greater.op_type == "Greater" and by_output[greater.input[0]].op_type == "Reshape"
    assert by_output[greater.input[0]].input[0] == "y"
