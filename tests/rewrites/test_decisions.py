"""The model-file rewrites left None on an inference model (``fuse_elementwise``,
``fuse_reductions``, ``channels_last``): where the library's CUDA kernels run (faked here: this
machine has no GPU), each is decided by its predicted cost on the kept plan
(``pipeline.decide_rewrites``, each rewrite's ``predict()``: with it against without it, in the
configured execution mode, kept when ``min_gain`` faster); where they do not, off with one line
saying why; an explicit option wins. Cost models are fakes, so each test states its numbers."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
from helpers import FakeCost, build_context, init, make_model, parse, tensor_vi, weight

import onnxcampo
from onnxcampo import estimate, ops, pipeline
from onnxcampo.costdb.model import FusedKernelCost
from onnxcampo.plan import Precision, PrecisionPlan, Reason
from onnxcampo.report import summary
from onnxcampo.rewrites import layout
from onnxcampo.runtime import make_session
from training.test_simplify import small_cnn

pytestmark = pytest.mark.usefixtures("library")

CHAIN = """
g (float[64,1000] x) => (float[64,1000] y) {
  [add] a = Add(x, x)
  [mul] b = Mul(a, a)
  [tanh] c = Tanh(b)
  [neg] y = Neg(c)
}
"""


class ChainCost(FakeCost):
    """Every op 10 us; a Cast (and so a layout pass over a tensor) 1 us plus 1 us per 1000 elements;
    the fused kernel ``fixed_us`` plus 1e6 bytes a microsecond; no host time (``dispatch_us`` 0)."""

    def __init__(self, fixed_us: float = 1.0, **options) -> None:
        super().__init__(**options)
        self.fixed_us = fixed_us

    def cast_time(self, elements: int) -> float:
        return 1.0 + elements / 1000

    def fused_kernel(self) -> FusedKernelCost:
        return FusedKernelCost(bytes_per_us=1e6, fixed_us=self.fixed_us, measured=True)


@pytest.fixture
def kernels_here(monkeypatch):
    """As if the models written here ran the library's CUDA kernels and NVRTC."""
    monkeypatch.setattr(ops, "cuda_kernels_here", lambda: True)
    monkeypatch.setattr(ops, "generated_kernels_here", lambda: True)


def _with_cost(monkeypatch, cost) -> None:
    monkeypatch.setattr(pipeline, "load_cost_model", lambda device_db=None: cost)


def _optimize(model, **options):
    return onnxcampo.optimize(model, experimental={"cost_graph": "onnx"}, **options)


def _close_on_ort(written, model, feeds, rtol):
    """Wiring: the written model loads with the library on ORT's CPU and computes the input's values."""
    want = make_session(model).run(None, feeds)[0]
    got = make_session(written).run(None, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=rtol, atol=rtol * float(np.abs(want).max()))


def test_the_elementwise_fusion_is_kept_where_it_is_predicted_to_pay(kernels_here, monkeypatch):
    """Four 10 us kernels against one fused kernel of 1 us plus 0.5 us of bytes: on, by prediction,
    the report carrying both totals; the written model computes the chain's values (ORT CPU)."""
    _with_cost(monkeypatch, ChainCost())
    model = parse(CHAIN)
    result = _optimize(model)
    decision = result.report["rewrites"]["fuse_elementwise"]
    assert decision["on"] is True and decision["by"] == "prediction"
    assert decision["predicted_with_us"] < decision["predicted_without_us"] - 30
    assert Counter(n.op_type for n in result.model.graph.node)["FusedElementwise"] == 1
    feeds = {"x": np.random.default_rng(0).standard_normal((64, 1000)).astype(np.float32)}
    _close_on_ort(result.model, model, feeds, 1e-5)
    assert "fuse-elementwise on (predicted" in summary(result.report, None)


def test_a_chain_of_dynamic_shapes_is_predicted_as_the_written_model_runs(kernels_here, monkeypatch):
    """The same chain with a dynamic batch pinned by ``dim_values``: the pin sizes the costs, the
    written model keeps the dynamic batch, and the fusion fuses static shapes only, so nothing is
    predicted to change and the fusion stays off."""
    _with_cost(monkeypatch, ChainCost())
    result = _optimize(parse(CHAIN.replace("[64,1000]", "[N,1000]")), dim_values={"N": 64})
    decision = result.report["rewrites"]["fuse_elementwise"]
    assert decision["on"] is False and decision["predicted_with_us"] == decision["predicted_without_us"]
    assert "FusedElementwise" not in {n.op_type for n in result.model.graph.node}
    assert decision["why"].endswith("it acts on static shapes only, and x keeps dynamic dims in the written model")


def test_static_shapes_writes_the_pinned_dims_and_the_fusion_then_applies(kernels_here, monkeypatch):
    """``experimental static_shapes``: the dynamic batch is written fixed at its pin, so the
    fusion, which acts on static shapes, is predicted and kept; the input model is untouched."""
    _with_cost(monkeypatch, ChainCost())
    model = parse(CHAIN.replace("[64,1000]", "[N,1000]"))
    before = model.SerializeToString()
    result = onnxcampo.optimize(model, dim_values={"N": 64}, experimental={"cost_graph": "onnx", "static_shapes": True})
    assert result.report["rewrites"]["fuse_elementwise"]["on"] is True
    assert [d.dim_value for d in result.model.graph.input[0].type.tensor_type.shape.dim] == [64, 1000]
    assert "FusedElementwise" in {n.op_type for n in result.model.graph.node}
    assert model.SerializeToString() == before


def test_dynamic_dims_that_keep_every_rewrite_off_are_said_once_with_the_way_out(kernels_here, monkeypatch, caplog):
    """One warning names the dynamic input and ORT's tool that fixes its dims; the static chain,
    where the fusion pays, gets none."""
    _with_cost(monkeypatch, ChainCost())
    with caplog.at_level(logging.WARNING, logger="onnxcampo.pipeline"):
        _optimize(parse(CHAIN.replace("[64,1000]", "[N,1000]")), dim_values={"N": 64})
    said = [r.getMessage() for r in caplog.records if "static shapes only" in r.getMessage()]
    assert len(said) == 1 and "input x has dynamic dims" in said[0]
    assert "onnxruntime.tools.make_dynamic_shape_fixed" in said[0] and "'static_shapes': True" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onnxcampo.pipeline"):
        _optimize(parse(CHAIN))
    assert not [r for r in caplog.records if "static shapes only" in r.getMessage()]


def test_the_elementwise_fusion_stays_off_where_its_kernel_is_predicted_to_cost_more(kernels_here, monkeypatch):
    """The same chain with a fused kernel of 100 us fixed cost (a launch that costs more than the
    four it replaces): off, by prediction."""
    _with_cost(monkeypatch, ChainCost(fixed_us=100.0))
    result = _optimize(parse(CHAIN))
    decision = result.report["rewrites"]["fuse_elementwise"]
    assert decision["on"] is False and decision["by"] == "prediction"
    assert decision["predicted_with_us"] > decision["predicted_without_us"]
    assert "FusedElementwise" not in {n.op_type for n in result.model.graph.node}


def test_a_gain_below_min_gain_keeps_the_rewrite_off(kernels_here, monkeypatch):
    """Predicted 1.5 us against 40 (96 % faster): on at min_gain 0.5, off at 0.99."""
    _with_cost(monkeypatch, ChainCost())
    assert _optimize(parse(CHAIN), min_gain=0.5).report["rewrites"]["fuse_elementwise"]["on"] is True
    kept = _optimize(parse(CHAIN), min_gain=0.99).report["rewrites"]["fuse_elementwise"]
    assert kept["on"] is False and "less than min_gain" in kept["why"]


def test_nothing_to_fold_keeps_the_reductions_off(kernels_here, monkeypatch):
    """``fuse_reductions`` folds the Casts a ReduceSum reads: a graph without them is predicted the
    same with and without it, so it stays off."""
    _with_cost(monkeypatch, ChainCost())
    decision = _optimize(parse(CHAIN)).report["rewrites"]["fuse_reductions"]
    assert decision["on"] is False and decision["by"] == "prediction"
    assert decision["predicted_with_us"] == decision["predicted_without_us"]


def test_an_explicit_option_wins_over_the_prediction(kernels_here, monkeypatch):
    _with_cost(monkeypatch, ChainCost())
    off = _optimize(parse(CHAIN), fuse_elementwise=False).report["rewrites"]["fuse_elementwise"]
    assert off == {"on": False, "by": "user", "why": ""}
    _with_cost(monkeypatch, ChainCost(fixed_us=100.0))
    on = _optimize(parse(CHAIN), fuse_elementwise=True)
    assert on.report["rewrites"]["fuse_elementwise"]["by"] == "user"
    assert "FusedElementwise" in {n.op_type for n in on.model.graph.node}


@pytest.mark.parametrize("gpu, level", [(None, logging.INFO), ("NVIDIA H100 80GB HBM3", logging.WARNING)],
                         ids=["cpu-machine", "gpu-machine"])
def test_without_the_cuda_kernels_the_rewrites_stay_off_and_one_line_says_why(monkeypatch, caplog, gpu, level):
    """Not faked: this machine's onnxruntime has no CUDA provider. One line names the three options
    and why: a warning where a GPU is detected (speed was expected), an info line elsewhere."""
    from onnxcampo.costdb import select

    _with_cost(monkeypatch, ChainCost())
    monkeypatch.setattr(select, "detected_gpu", lambda: gpu)
    with caplog.at_level(logging.INFO, logger="onnxcampo"):
        result = _optimize(parse(CHAIN))
    why = ops.missing_cuda_kernels()
    assert why and "CUDA execution provider" in why
    lines = [r for r in caplog.records if why in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == level
    assert all(name in lines[0].getMessage() for name in pipeline.REWRITES)
    assert all(entry == {"on": False, "by": "unavailable", "why": why} for entry in result.report["rewrites"].values())
    assert "FusedElementwise" not in {n.op_type for n in result.model.graph.node}
    assert f"fuse-elementwise off (unavailable: {why})" in summary(result.report, None)


def test_without_nvrtc_only_the_elementwise_fusion_is_unavailable(monkeypatch):
    _with_cost(monkeypatch, ChainCost())
    monkeypatch.setattr(ops, "cuda_kernels_here", lambda: True)
    monkeypatch.setattr(ops, "generated_kernels_here", lambda: False)
    rewrites = _optimize(parse(CHAIN)).report["rewrites"]
    assert rewrites["fuse_elementwise"]["by"] == "unavailable"
    assert rewrites["channels_last"]["by"] == rewrites["fuse_reductions"]["by"] == "prediction"


class ConvCost(ChainCost):
    """Convolutions 200 us in fp32 and 100 us in fp16 (cuDNN's layout transforms included), other
    ops 10 us; a pass over a tensor 1 us plus 1 us per 1000 elements; a launch 20 us of host time
    hidden behind the GPU's work (the larger of the two counts)."""

    def __init__(self) -> None:
        super().__init__(op_us={"Conv": 200.0})

    def dispatch_us(self, training: bool = False) -> float:
        return 20.0


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["cuda-graph", "plain"])
def test_channels_last_is_decided_by_its_predicted_cost_on_a_small_conv_net(kernels_here, monkeypatch, execution):
    """The fp16 plan of a small CNN, 8 convolutions channels-last-able. Replayed (no host time)
    their layout transforms go and channels-last is on; run plainly each NHWC convolution's
    cuDNN call costs ``CONV_NHWC_HOST_US`` of host time, more than the transforms save, and it stays
    off. The written model computes the fp32 model's logits (ORT CPU, float16 tolerance)."""
    _with_cost(monkeypatch, ConvCost())
    forward = small_cnn(width=2)
    result = _optimize(forward, policy="fp16", execution=execution, fuse_elementwise=False, fuse_reductions=False)
    decision = result.report["rewrites"]["channels_last"]
    assert decision["by"] == "prediction"
    convs = Counter(n.op_type for n in result.model.graph.node)["ConvNhwc"]
    if execution == "cuda-graph":
        assert decision["on"] is True and decision["predicted_with_us"] < decision["predicted_without_us"]
        assert convs == 8 and result.report["channels_last"]["convolutions"] == 8
        feeds = {"x": np.random.default_rng(3).standard_normal((3, 3, 30, 38)).astype(np.float32)}
        _close_on_ort(result.model, forward, feeds, 2e-2)
    else:
        assert decision["on"] is False and decision["predicted_with_us"] > decision["predicted_without_us"]
        assert convs == 0


def _fp16_plan(planning) -> PrecisionPlan:
    plan = PrecisionPlan()
    for node in planning.nodes:
        plan.decide(node.name, Precision.FP16, Reason.POLICY_FP16)
    return plan


def _conv_relu():
    """A float16-able Conv [1, 8, 16, 16] -> [1, 8, 16, 16] with a bias, read by a Relu."""
    from onnx import helper

    return make_model([helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                       helper.make_node("Relu", ["c"], ["y"], name="relu")],
                      [tensor_vi("x", [1, 8, 16, 16])], [tensor_vi("y", [1, 8, 16, 16])],
                      [weight("w", [8, 8, 3, 3]), init("b", np.zeros(8, np.float32))])


def test_the_layout_change_prices_what_the_layout_pass_does():
    """One float16 Conv [1, 8, 16, 16] -> [1, 8, 16, 16] (2048 elements each side) with a bias,
    read by a Relu: its two layout transforms go (2 x 3.048 us, under half its 100 us) with their
    two launches; the graph input's Transpose in and the output's Transpose out are passes of
    their own (3.048 us, a launch each); the bias Add is a launch (its pass was the Conv's), none
    with the elementwise fusion (it joins the ReLU's kernel, as the bias does NCHW).
    Costed fusion-blind, a float32 plan changes nothing: float32 convolutions stay NCHW."""
    model = _conv_relu()
    planning = build_context(model, cost=ConvCost(), channels_last=True)
    plan = _fp16_plan(planning)
    change = layout.layout_change(planning, plan.precision)
    transforms = 2 * (1.0 + 2048 / 1000)
    passes = 2 * (1.0 + 2048 / 1000)  # the Transposes at the graph's input and output
    assert change.convolutions == change.nhwc_calls == 1
    assert change.gpu_us == pytest.approx(-transforms + passes)
    assert change.conv_launches == -1 and change.launches == -2 + 2 + 1
    planning.config = planning.config.replace(fuse_elementwise=True)  # the bias joins its readers' fused kernel
    assert layout.layout_change(planning, plan.precision).launches == -2 + 2
    planning.config = planning.config.replace(fuse_elementwise=False)
    prediction = layout.predict(planning, plan)
    assert prediction.with_us == pytest.approx(estimate.plan_time(planning, plan).total_us)  # costed channels-last
    fp32 = PrecisionPlan()
    for node in planning.nodes:
        fp32.decide(node.name, Precision.FP32, Reason.POLICY_FP32)
    assert layout.layout_change(planning, fp32.precision) == layout.LayoutChange()


def test_the_layout_change_takes_back_a_measured_fp16_conv_call():
    """Where the database prices a float16 NCHW Conv call whole (``conv_fp16``), the layout change
    takes back that call (no convolution launch, no transform launches) for the NHWC call."""
    class MeasuredCall(ConvCost):
        def library_launch_us(self, kind):
            return 30.0 if kind == "conv_fp16" else None

    model = _conv_relu()
    planning = build_context(model, cost=MeasuredCall(), channels_last=True)
    plan = _fp16_plan(planning)
    change = layout.layout_change(planning, plan.precision)
    assert change.convolutions == change.nhwc_calls == 1
    assert change.fp16_conv_calls == -1 and change.conv_launches == 0 and change.launches == 2 + 1
    with_layout = estimate.plan_time(planning, plan)
    # the NHWC call, the Relu, the two Transposes and the bias Add, besides the plan's Casts
    assert with_layout.launched - with_layout.casts == 1 + 1 + 2 + 1


def test_the_summary_says_the_decisions_in_one_line():
    from onnxcampo.report import rewrites_line

    why = "this onnxruntime has no CUDA execution provider"
    off = {name: {"on": False, "by": "unavailable", "why": why} for name in pipeline.REWRITES}
    assert rewrites_line(off) == f"rewrites: channels-last, fuse-reductions and fuse-elementwise off (unavailable: {why})"
    mixed = {"channels_last": {"on": True, "by": "prediction", "why": "", "predicted_with_us": 1.0,
                               "predicted_without_us": 2.0},
             "fuse_reductions": {"on": False, "by": "user", "why": ""},
             "fuse_elementwise": {"on": True, "by": "default", "why": ""}}
    assert rewrites_line(mixed) == ("rewrites: channels-last on (predicted 1.0 us with it, 2.0 without), "
                                    "fuse-reductions off (user), fuse-elementwise on (default)")
    assert rewrites_line({name: {"on": False, "by": "user", "why": ""} for name in pipeline.REWRITES}) is None
