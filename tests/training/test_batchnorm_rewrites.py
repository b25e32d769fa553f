"""Training-mode BatchNorm steps with the rewrites the GPU takes by default (channels-last,
the fused elementwise chains and block reductions) forced on, on the CPU through the custom-op
library's CPU kernels: the written step keeps its starting weights and running statistics, the
Trainer starts from them with or without weights given, and the steps compute what the step
graph as built does (ORT's CPU provider: a wiring check; fp16 numerics are the GPU's)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, optimize
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training.step import INITIAL_PREFIX

N, C, SIZE, CLASSES = 8, 16, 16, 10
FORCED = {"channels_last": True, "fuse_elementwise": True, "fuse_reductions": True}


def _bn(name: str, x: str, y: str) -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", [x, *(f"{name}.{p}" for p in ("weight", "bias", "running_mean",
                                                                               "running_var"))], [y], name=name)


def _cnn(name: str, seed: int, convs: dict[str, tuple[tuple[int, ...], float]], norms: tuple[str, ...],
         body: list[onnx.NodeProto]) -> onnx.ModelProto:
    """x [8, 3, 16, 16] -> ``body`` (ending in ``s``) -> Relu -> GlobalAveragePool -> Gemm -> 10
    logits; the convolutions' weights normal of the given shapes and scales, fresh BatchNorms
    named ``norms``."""
    rng = np.random.default_rng(seed)
    weights = {f"{conv}.weight": rng.standard_normal(shape) * scale for conv, (shape, scale) in convs.items()}
    weights |= {"fc.weight": rng.standard_normal((CLASSES, C)) * 0.2, "fc.bias": np.zeros(CLASSES)}
    for bn in norms:
        weights |= {f"{bn}.weight": np.ones(C), f"{bn}.bias": np.zeros(C),
                    f"{bn}.running_mean": np.zeros(C), f"{bn}.running_var": np.ones(C)}
    nodes = [*body, helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [N, CLASSES])],
                              [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def resnet_block() -> onnx.ModelProto:
    """x [8, 3, 16, 16] -> Conv 3x3 -> BatchNorm -> Relu -> MaxPool 3x3/2 -> Conv 3x3 -> BatchNorm,
    + the pool's output (a residual) -> Relu -> GlobalAveragePool -> Gemm -> 10 logits: a ResNet's
    stem and first block as torch exports them in eval mode."""
    body = [helper.make_node("Conv", ["x", "conv1.weight"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
            _bn("bn1", "c1", "b1"), helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
            helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                             name="pool"),
            helper.make_node("Conv", ["p1", "conv2.weight"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
            _bn("bn2", "c2", "b2"), helper.make_node("Add", ["b2", "p1"], ["s"], name="residual")]
    return _cnn("resnet_block", 0, {"conv1": ((C, 3, 3, 3), 0.2), "conv2": ((C, C, 3, 3), 0.1)}, ("bn1", "bn2"), body)


def batches(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((N, 3, SIZE, SIZE)).astype(np.float32),
             "labels": rng.integers(0, CLASSES, N).astype(np.int64)} for _ in range(count)]


@pytest.fixture(scope="module")
def steps() -> dict[str, onnx.ModelProto]:
    step = build_train_step(resnet_block(), loss="cross_entropy", optimizer="momentum", lr=0.05, train_mode=True)
    return {"built": step, **{policy: optimize(step, policy=policy, accuracy="off", **FORCED).model
                              for policy in ("fp16", "campo")}}


@pytest.mark.parametrize("policy", ["fp16", "campo"])
def test_the_rewritten_step_keeps_every_starting_value(steps, policy, library):
    built, written = steps["built"], steps[policy]
    starts = {t.name for t in built.graph.initializer if t.name.startswith(INITIAL_PREFIX)}
    assert any(name.endswith("running_mean") for name in starts) and any(name.endswith("conv1.weight") for name in starts)
    assert starts <= {t.name for t in written.graph.initializer}
    if policy == "fp16":  # the rewrites did run (campo may keep fp32 convolutions NCHW)
        assert {"ConvNhwc", "MaxPoolNhwc", "FusedElementwise"} <= {n.op_type for n in written.graph.node}


@pytest.mark.parametrize("policy", ["fp16", "campo"])
def test_no_initializer_is_left_unread(steps, policy, library):
    graph = steps[policy].graph
    read = {i for n in graph.node for i in n.input} | {i.name for i in graph.input}
    unread = [t.name for t in graph.initializer if t.name not in read and not t.name.startswith(INITIAL_PREFIX)]
    assert unread == []


@pytest.mark.parametrize("policy", ["fp16", "campo"])
@pytest.mark.parametrize("given", [False, True], ids=["stored", "given"])
def test_the_rewritten_step_trains_as_the_built_one(steps, policy, given, library):
    """Starting from the stored values, or from the forward's weights: the same losses and running
    statistics as the step graph as built, step by step."""
    data = batches(4)
    weights = initial_weights(resnet_block(), steps[policy]) if given else None
    reference, trainer = Trainer(steps["built"], provider="cpu"), Trainer(steps[policy], provider="cpu", weights=weights)
    for batch in data:
        np.testing.assert_allclose(trainer.step(batch), reference.step(batch), rtol=2e-3)
    got, want = trainer.state_dict(), reference.state_dict()
    assert {name for name in want if "running" in name} == {"bn1.running_mean", "bn1.running_var",
                                                              "bn2.running_mean", "bn2.running_var"}
    for name in want:
        # fp16 gradients (the library's CPU kernels round as the GPU's do, ORT's CPU ops do not): the
        # stem filter's momentum is 2-4 % off its largest value after 4 steps; a layout mistake is 100 %
        scale = float(np.abs(want[name]).max()) or 1.0
        bound = 0.01 if "running" in name else 0.06
        assert float(np.abs(got[name] - want[name]).max()) <= bound * scale, name


def test_the_gradient_is_the_closed_form_and_every_reduction_one_block_kernel(steps, library):
    """The built step: no placeholder left; per BatchNorm two means forward (the statistics) and two
    sums backward (dB and dscale, the closed form); with the GPU's rewrites every one of them is a
    BlockReduceSum, none of ONNX Runtime's reduction kernels is left on an image-sized tensor."""
    built = steps["built"]
    info, _ = ir.infer_tensor_info(built)
    reductions = [n for n in built.graph.node if n.op_type.startswith("Reduce")]
    # simplify writes a sum over N, H, W as a sum over [N, C, H*W]'s last axis, then one over N
    of_images = Counter(n.op_type for n in reductions if info[n.input[0]].shape[:2] == (N, C)
                        and len(info[n.input[0]].shape) >= 3)
    assert "BatchNormTraining" not in {n.op_type for n in built.graph.node}
    assert of_images == {"ReduceMean": 4, "ReduceSum": 4}  # 2 BatchNorms x (2 forward + 2 backward)
    of_loss = len(reductions) - 4 - 2 * 4  # the cross-entropy's own, over [N, classes]
    for policy in ("fp16", "campo"):
        written = Counter(n.op_type for n in steps[policy].graph.node)
        assert written["ReduceSum"] + written["ReduceMean"] <= of_loss and written["BlockReduceSum"], (policy, written)


def test_a_step_without_the_library_names_no_custom_domain():
    step = build_train_step(resnet_block(), loss="cross_entropy", optimizer="sgd", train_mode=True, fused=False)
    assert {o.domain for o in step.opset_import} <= {"", "ai.onnx"}
    assert not any(n.domain for n in step.graph.node)


def _trains_alike(fused: onnx.ModelProto, plain: onnx.ModelProto) -> None:
    """Three steps of both: the same losses (rtol 1e-4) and state (1e-3 of each tensor's largest value)."""
    reference, trainer = Trainer(plain, queued=False), Trainer(fused, queued=False)
    for batch in batches(3):
        np.testing.assert_allclose(float(trainer.step(batch)), float(reference.step(batch)), rtol=1e-4)
    got, want = trainer.state_dict(), reference.state_dict()
    for name in want:
        scale = float(np.abs(want[name]).max()) or 1.0
        assert float(np.abs(got[name] - want[name]).max()) <= 1e-3 * scale, name


@pytest.mark.parametrize("policy", ["fp32", "amp"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_batchnorm_sums_make_each_pair_of_sums_one_pass_and_train_the_same(policy, channels_last, library):
    """--experimental batchnorm_sums: per BatchNorm one BatchNormStats (forward) and one
    BatchNormGradSums (backward) in place of four BlockReduceSums, the squares and the products;
    the steps' losses and state equal the same optimization without it (ORT's CPU provider with the
    library's CPU kernels: a wiring check; the CUDA kernels are tests/gpu/test_batch_norm_cuda.py's)."""
    step = build_train_step(resnet_block(), loss="cross_entropy", optimizer="momentum", lr=0.05, train_mode=True)
    options = dict(policy=policy, accuracy="off", channels_last=channels_last, fuse_elementwise=True,
                   fuse_reductions=True)
    plain = optimize(step, **options)
    fused = optimize(step, **options, experimental={"batchnorm_sums": True})
    ops = Counter(n.op_type for n in fused.model.graph.node)
    assert (ops["BatchNormStats"], ops["BatchNormGradSums"]) == (2, 2)
    summary = fused.report["fuse_reductions"]["batchnorm_sums"]
    assert (summary["stats"], summary["grad_sums"]) == (2, 2) and summary["nodes_replaced"] >= 10
    assert "BatchNormStats" not in {n.op_type for n in plain.model.graph.node}
    _trains_alike(fused.model, plain.model)


def test_batchnorm_sums_leave_float16_sums(library):
    """The all-float16 plan's backward sums are float16 (the op writes float32): left as they are;
    its forward statistics (float32 block sums, reductions rule 8) are fused."""
    step = build_train_step(resnet_block(), loss="cross_entropy", optimizer="momentum", lr=0.05, train_mode=True)
    fused = optimize(step, policy="fp16", accuracy="off", fuse_elementwise=True, fuse_reductions=True,
                     experimental={"batchnorm_sums": True})
    ops = Counter(n.op_type for n in fused.model.graph.node)
    assert (ops["BatchNormStats"], ops["BatchNormGradSums"]) == (2, 0)


def shortcut_block() -> onnx.ModelProto:
    """x -> Conv -> BatchNorm -> Relu, then Conv -> BatchNorm plus a 1x1 Conv -> BatchNorm shortcut
    (a ResNet stage's first block), Relu -> GlobalAveragePool -> Gemm: the two last BatchNorms
    share their output's gradient, so its sum (reductions rule 6)."""
    body = [helper.make_node("Conv", ["x", "conv1.weight"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
            _bn("bn1", "c1", "b1"), helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
            helper.make_node("Conv", ["r1", "conv2.weight"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
            _bn("bn2", "c2", "b2"), helper.make_node("Conv", ["r1", "down.weight"], ["c3"], name="down"),
            _bn("bn3", "c3", "b3"), helper.make_node("Add", ["b2", "b3"], ["s"], name="residual")]
    return _cnn("shortcut_block", 2, {"conv1": ((C, 3, 3, 3), 0.2), "conv2": ((C, C, 3, 3), 0.1),
                                      "down": ((C, C, 1, 1), 0.2)}, ("bn1", "bn2", "bn3"), body)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_batchnorm_sums_of_two_batchnorms_on_one_gradient(channels_last, library):
    """Rule 2b: the shortcut's BatchNorm and the block's last one share dy's sum; both still get
    their BatchNormGradSums (one writing a sum of dy nothing reads); the step trains as without."""
    step = build_train_step(shortcut_block(), loss="cross_entropy", optimizer="momentum", lr=0.05, train_mode=True)
    options = dict(policy="fp32", accuracy="off", channels_last=channels_last, fuse_elementwise=True,
                   fuse_reductions=True)
    plain = optimize(step, **options)
    fused = optimize(step, **options, experimental={"batchnorm_sums": True})
    ops = Counter(n.op_type for n in fused.model.graph.node)
    assert (ops["BatchNormStats"], ops["BatchNormGradSums"]) == (3, 3)
    _trains_alike(fused.model, plain.model)
