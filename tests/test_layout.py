"""onnxcampo.layout (``channels_last``): the convolutions as ai.onnxcampo's NHWC ops, their
activations channels-last, the same numbers as the NCHW graph.

The equality checks run on ORT's CPU provider in float32 (the library's CPU reference kernels:
they check the rewrite's wiring, axes and permuted constants; cuDNN's kernels are checked on a GPU
by scripts/check_conv_nhwc_cuda.py). The small CNN (tests/training/test_simplify.py) has every
convolution shape a ResNet meets: a 3-channel 7x7 stride-2 stem (kept NCHW), MaxPool, residual
Adds, stride-2 3x3 and 1x1 convolutions, a 3x5 kernel, a dilated 3x3, a Conv without bias, then
GlobalAveragePool, Flatten and Gemm.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from onnxcampo import ir
from onnxcampo.layout import _reshaped_channel, physical_shape, to_channels_last, to_logical_perm, to_physical_perm
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
        result = optimize(step, policy="fp16", channels_last=True, channels_last_stem=stem, fuse_elementwise=True,
                          fuse_reductions=True)
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
    decided by its predicted cost where the kernels are (``tests/test_rewrite_decisions.py``),
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
