"""Plans are costed on the graph ONNX Runtime executes, in the mode it executes (issue 15).

ORT's own optimized graph (CPU provider, extended level) says which nodes it absorbs into fused
neighbours; aliased ops (Reshape, ...) cost nothing; a Cast between two fused nodes breaks the
fusion; under CUDA-graph replay no launch costs host time. Times come from a fake cost model
(10 us a node, 1 us a Cast, 5 us host time a launch, 20 us a run) so each expected total can be
read off the graph.
"""

from __future__ import annotations

import logging
import os
import tempfile

import numpy as np
import onnx
import pytest
from helpers import W_INIT, FakeCost, build_context, decide, make_model, parse, tensor_vi, weight
from onnx import helper

from onnxcampo import api, estimate, optimize
from onnxcampo.plan import PrecisionPlan
from onnxcampo.runtime.optimized import executed_graph


class HostCost(FakeCost):
    """FakeCost plus host time: 5 us a launch (10 us for a convolution), 20 us a run."""

    def launch_us(self, op_class: str = "other", training: bool = False) -> float:
        return 10.0 if op_class == "conv" else 5.0

    def run_us(self) -> float:
        return 20.0


def conv_bn() -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Abs: ORT folds the BatchNormalization into the Conv (Abs is
    no activation ORT fuses into a Conv)."""
    rng = np.random.default_rng(0)
    inits = [weight("w", (8, 8, 3, 3)),
             *(onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), name)
               for name in ("scale", "bias", "mean", "var"))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["b"], name="bn"),
             helper.make_node("Abs", ["b"], ["y"], name="abs")]
    return make_model(nodes, [tensor_vi("x", (2, 8, 16, 16))], [tensor_vi("y", (2, 8, 16, 16))], inits)


MATMUL_BIAS = f"""
g (float[8,8] x) => (float[8,8] y) <{W_INIT}, float[8] b = {{0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5}}, int64[2] shp = {{8,8}}> {{
  [mm] m = MatMul(x, w)
  [bias] a = Add(m, b)
  [rs] r = Reshape(a, shp)
  [act] y = Tanh(r)
}}
"""


def context(model, **options):
    ctx = build_context(model, cost=HostCost(), **options)
    api.read_executed_graph(ctx)
    return ctx


def plan_of(ctx, **precisions) -> PrecisionPlan:
    """A plan deciding every node: fp32 unless named."""
    ctx.plan = PrecisionPlan()
    decide(ctx, **{node.name: precisions.get(node.name, "fp32") for node in ctx.nodes})
    return ctx.plan


def test_ort_folds_the_batch_norm_into_the_conv():
    """The executed graph: the Conv is absorbed (its output is gone), the BatchNormalization's
    output is made by the fused Conv (carried); ORT runs 2 of the 3 nodes."""
    model = conv_bn()
    onnx.checker.check_model(model)
    executed = executed_graph(model)
    assert executed.node_status(model) == {"conv": "absorbed", "bn": "carried"}
    assert executed.nodes == 2


def test_fused_conv_costs_one_launch_and_the_conv_time():
    """fp32 plan: the Conv's 10 us (its work is the fused node's), nothing for the folded
    BatchNormalization, 10 us for Abs; launches: the fused conv (10 us host) and Abs (5 us)."""
    ctx = context(conv_bn())
    time = estimate.plan_time(ctx, plan_of(ctx))
    assert (time.nodes_us, time.launched, time.dispatch_us) == (20.0, 2, 15.0)
    assert time.total_us == 20.0 + 20.0  # max(GPU 20, host 15) + the run


def test_a_cast_breaks_the_fusion():
    """MatMul fp16, its bias Add fp32: the Cast between them keeps ORT from fusing them into a
    Gemm, so the Add costs its own 10 us and launch again."""
    ctx = context(parse(MATMUL_BIAS))
    assert ctx.ort_status == {"mm": "absorbed", "bias": "carried"}
    fused = estimate.plan_time(ctx, plan_of(ctx))
    broken = estimate.plan_time(ctx, plan_of(ctx, mm="fp16"))
    assert fused.nodes_us == 10.0 + 10.0  # the Gemm (MatMul's time) and Tanh; Reshape is aliased
    assert broken.nodes_us == 5.0 + 10.0 + 10.0  # fp16 MatMul, the Add alone, Tanh
    assert (fused.launched, broken.launched) == (2, 3 + broken.casts)


def test_aliased_ops_cost_nothing_even_unfused():
    """cost_graph="onnx" (no ORT graph): MatMul and Add are separate kernels, the Reshape is
    still free (ORT aliases it whatever the fusions)."""
    ctx = build_context(parse(MATMUL_BIAS), cost=HostCost(), experimental={"cost_graph": "onnx"})
    time = estimate.plan_time(ctx, plan_of(ctx))
    assert (time.nodes_us, time.launched) == (30.0, 3)


def test_cuda_graph_replay_has_no_host_term():
    """Replayed, a plan costs its GPU work plus one run: 3 launches of 5 us no longer bound it."""
    text = """
    g (float[2,2] x) => (float[2,2] y) {
      [a] t1 = Tanh(x)
      [b] t2 = Tanh(t1)
      [c] y = Tanh(t2)
    }
    """
    cost = HostCost(default_us=1.0)
    plain = build_context(parse(text), cost=cost)
    replayed = build_context(parse(text), cost=cost, execution="cuda-graph")
    plain_time = estimate.plan_time(plain, plan_of(plain))
    replay_time = estimate.plan_time(replayed, plan_of(replayed))
    assert (plain_time.total_us, plain_time.dispatch_us) == (15.0 + 20.0, 15.0)
    assert (replay_time.total_us, replay_time.dispatch_us, replay_time.execution) == (3.0 + 20.0, 0.0, "cuda-graph")


def test_fp16_conv_launches_cudnn_layout_transforms():
    """An fp16 NCHW Conv costs the host two more launches (cuDNN's layout transforms) besides
    its own; the fp32 Conv does not."""
    ctx = context(conv_bn())
    fp32 = estimate.plan_time(ctx, plan_of(ctx))
    fp16 = estimate.plan_time(ctx, plan_of(ctx, conv="fp16", bn="fp16", abs="fp16"))
    assert fp16.launched - fp16.casts == fp32.launched + 2


def test_a_measured_fp16_conv_call_is_priced_whole():
    """Where the database measured float16 NCHW convolution calls whole (``conv_fp16``, layout
    transforms included), such a Conv is one call at that price, not a convolution launch and two
    other launches; under CUDA-graph replay it costs no host time either way."""
    class MeasuredFp16Conv(HostCost):
        def library_launch_us(self, kind: str) -> float | None:
            return 30.0 if kind == "conv_fp16" else None

    fp16 = dict(conv="fp16", bn="fp16", abs="fp16")
    ctx = context(conv_bn())
    two_launches = estimate.plan_time(ctx, plan_of(ctx, **fp16))
    measured = build_context(conv_bn(), cost=MeasuredFp16Conv())
    api.read_executed_graph(measured)
    whole = estimate.plan_time(measured, plan_of(measured, **fp16))
    assert whole.launched == two_launches.launched - 2
    assert whole.dispatch_us == pytest.approx(two_launches.dispatch_us - 10.0 - 2 * 5.0 + 30.0)
    fp32 = estimate.plan_time(measured, plan_of(measured))
    assert fp32.dispatch_us == estimate.plan_time(ctx, plan_of(ctx)).dispatch_us  # an fp32 Conv: unchanged
    replayed = build_context(conv_bn(), cost=MeasuredFp16Conv(), execution="cuda-graph")
    api.read_executed_graph(replayed)
    assert estimate.plan_time(replayed, plan_of(replayed, **fp16)).dispatch_us == 0.0


def test_report_names_the_execution_and_the_cost_graph():
    result = optimize(parse(MATMUL_BIAS), execution="cuda-graph")
    assert (result.report["execution"], result.report["cost_graph"], result.report["ort_nodes"]) == ("cuda-graph", "ort", 3)
    assert {plan["execution"] for plan in result.report["predicted_us"].values()} == {"cuda-graph"}
    onnx_costed = optimize(parse(MATMUL_BIAS), experimental={"cost_graph": "onnx"})
    assert (onnx_costed.report["cost_graph"], onnx_costed.report["ort_nodes"]) == ("onnx", None)


def test_a_model_ort_cannot_load_is_costed_node_by_node(caplog):
    """A node of an unknown domain: ORT cannot build its graph here; the plan is costed on every
    ONNX node, with a log line saying why."""
    text = """
    <ir_version: 10, opset_import: ["" : 17, "x.unknown" : 1]>
    g (float[4,4] x) => (float[4,4] y) {
      [t] a = Tanh(x)
      [u] y = x.unknown.Mystery(a)
    }
    """
    model = onnx.parser.parse_model(text)
    with caplog.at_level(logging.INFO, logger="onnxcampo.api"):
        ctx = context(model)
    assert ctx.ort_status == {} and ctx.ort_nodes is None
    assert "costing every ONNX node" in caplog.text


@pytest.mark.parametrize("execution", ["plain", "cuda-graph"])
def test_config_rejects_unknown_modes(execution):
    from onnxcampo.config import OptimizeConfig
    from onnxcampo.errors import ConfigError

    OptimizeConfig(execution=execution)
    with pytest.raises(ConfigError, match="unknown execution mode"):
        OptimizeConfig(execution=execution + "x")
    with pytest.raises(ConfigError, match="unknown cost graph"):
        OptimizeConfig(experimental={"cost_graph": "tensorrt"})


def test_the_cpu_stand_in_leaves_conv_and_relu_apart_as_the_cuda_ep_does():
    """The CUDA EP runs Conv and Relu as two kernels (H200, onnxruntime-gpu 1.31.1: ResNet-50 keeps
    122 nodes), where the CPU provider's ConvActivationFusion makes one FusedConv: the stand-in
    runs without that fusion."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = make_model(nodes, [tensor_vi("x", (1, 8, 8, 8))], [tensor_vi("y", (1, 8, 8, 8))], [weight("w", (8, 8, 3, 3))])
    executed = executed_graph(model)
    assert executed.node_status(model) == {} and executed.launches() == {"conv": 1, "other": 1}


def test_launches_add_to_the_gpu_work_where_the_database_says_so():
    """host_adds (fitted from whole H200 runs: each launch costs on top of the replayed run): the
    plain total is the GPU's work plus the launches plus the run, not the larger of the two."""
    class AddingCost(HostCost):
        def host_adds(self, training: bool = False) -> bool:
            return True

    ctx = build_context(parse(MATMUL_BIAS), cost=AddingCost(), experimental={"cost_graph": "onnx"})
    time = estimate.plan_time(ctx, plan_of(ctx))
    assert (time.nodes_us, time.dispatch_us, time.total_us) == (30.0, 15.0, 30.0 + 15.0 + 20.0)


def test_a_fitted_overlap_adds_that_share_of_the_smaller_to_the_larger():
    """host_overlap (a share fitted from whole runs): the plain total is the larger of the GPU's
    work and the launches plus that share of the smaller, plus the run; 1 and 0 are the two rules."""
    class OverlapCost(HostCost):
        def host_overlap(self, training: bool = False) -> float:
            return 0.4

    ctx = build_context(parse(MATMUL_BIAS), cost=OverlapCost(), experimental={"cost_graph": "onnx"})
    time = estimate.plan_time(ctx, plan_of(ctx))
    assert (time.nodes_us, time.dispatch_us) == (30.0, 15.0)
    assert time.total_us == 30.0 + 0.4 * 15.0 + 20.0


def test_a_database_overlap_share_is_read_and_bounded(tmp_path):
    from onnxcampo.costdb.regression import RegressionCostModel

    model = object.__new__(RegressionCostModel)
    model.database = {"host_launch": {"inference": {"host": "additive", "overlap": 0.45}}}
    assert model.host_overlap() == 0.45
    model.database = {"host_launch": {"inference": {"host": "additive", "overlap": 1.7}}}  # out of [0, 1]: ignored
    assert model.host_overlap() == 1.0
    model.database = {"host_launch": {"inference": {}}}
    assert model.host_overlap() == 0.0


def test_cpu_only_gemm_activation_fusion_is_not_taken_for_the_cuda_eps():
    """ORT fuses MatMul + bias + Sigmoid into FusedGemm on its CPU provider only (no CUDA kernel):
    the stand-in leaves the Sigmoid a kernel of its own, as the CUDA EP runs it."""
    text = MATMUL_BIAS.replace("[act] y = Tanh(r)", "[act] y = Sigmoid(r)")
    ctx = context(parse(text))
    assert ctx.ort_status == {"mm": "absorbed", "bias": "carried"}
    assert estimate.plan_time(ctx, plan_of(ctx)).launched == 2  # the Gemm and the Sigmoid


def test_a_3d_bias_add_passed_on_by_a_reshape_is_the_gemms():
    """MatMul + Add on 3-D inputs: ORT writes Reshape -> Gemm -> Reshape, so the Add's output is
    made by a Reshape passing on the Gemm's: the Add is carried by the product, not a kernel."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Tanh", ["a"], ["y"], name="act")]
    bias = onnx.numpy_helper.from_array(np.full(16, 0.5, np.float32), "b")
    model = make_model(nodes, [tensor_vi("x", (2, 4, 8))], [tensor_vi("y", (2, 4, 16))], [weight("w", (8, 16)), bias])
    assert executed_graph(model).node_status(model) == {"mm": "absorbed", "add": "carried"}


def test_a_cast_does_not_bring_back_a_node_ort_eliminates():
    """Dropout at inference is removed whatever follows it: an fp16 MatMul after it (a Cast on
    the Dropout's output) leaves it free."""
    text = f"""
    g (float[8,8] x) => (float[8,8] y) <{W_INIT}> {{
      [act] e = Tanh(x)
      [drop] d = Dropout(e)
      [mm] y = MatMul(d, w)
    }}
    """
    ctx = context(parse(text))
    assert ctx.ort_status.get("drop") == "absorbed"
    time = estimate.plan_time(ctx, plan_of(ctx, mm="fp16"))
    assert time.nodes_us == 10.0 + 5.0  # Tanh and the fp16 MatMul; the Dropout is gone
    assert time.launched == 2 + time.casts


def test_ort_generated_tensor_names_do_not_make_a_node_look_absorbed():
    """A Sigmoid whose output is named like ORT's fusions name theirs (``splits``): the executed
    graph is read from a renamed copy, and the Sigmoid still runs."""
    text = f"""
    g (float[8,8] x) => (float[8,8] y) <{W_INIT}> {{
      [sig] splits = Sigmoid(x)
      [mm] y = MatMul(splits, w)
    }}
    """
    ctx = context(parse(text))
    assert "sig" not in ctx.ort_status and estimate.plan_time(ctx, plan_of(ctx)).launched == 2


def test_a_measured_chain_factor_prices_the_fused_chain():
    """A chain the database measured (matmul_bias at 0.5 of its parts) costs its members' alone
    times times the factor, fused or not; the launches follow ORT's graph (one Gemm)."""
    class ChainCost(HostCost):
        def chain_factor(self, pattern: str, precision: str) -> float:
            return 0.5 if pattern == "matmul_bias" else 1.0

    ctx = build_context(parse(MATMUL_BIAS), cost=ChainCost())
    api.read_executed_graph(ctx)
    time = estimate.plan_time(ctx, plan_of(ctx))
    assert (time.nodes_us, time.launched) == (0.5 * (10.0 + 10.0) + 10.0, 2)


LAYER_NORM = """
g (float[4,8] x) => (float[4,8] y) <float[8] scale = {1.0,1.0,1.0,1.0,1.0,1.0,1.0,1.0},
                                    float[8] bias = {0.0,0.0,0.0,0.0,0.0,0.0,0.0,0.0},
                                    float two = {2.0}, float eps = {0.00001}> {
  [mean] m = ReduceMean<axes=[-1]>(x)
  [sub] d = Sub(x, m)
  [pow] p = Pow(d, two)
  [var] v = ReduceMean<axes=[-1]>(p)
  [add_eps] e = Add(v, eps)
  [sqrt] r = Sqrt(e)
  [div] n = Div(d, r)
  [mul] s = Mul(n, scale)
  [add] y = Add(s, bias)
}
"""


def test_a_cast_anywhere_in_a_fused_group_breaks_the_whole_group():
    """The LayerNorm sub-graph ORT fuses into one LayerNormalization: fused, it launches once; a
    plan that keeps Pow fp32 among fp16 neighbours puts Casts inside it, and all nine nodes run as
    they are (not only the two next to the Casts)."""
    ctx = context(parse(LAYER_NORM))
    assert len(ctx.ort_status) == 9
    fused = estimate.plan_time(ctx, plan_of(ctx))
    assert (fused.launched, fused.nodes_us) == (1, 10.0)  # the node carrying the fused kernel
    fp16 = {n.name: "fp16" for n in ctx.nodes if n.name != "pow"}
    broken = estimate.plan_time(ctx, plan_of(ctx, **fp16))
    assert broken.launched - broken.casts == 9
    assert broken.nodes_us == 10.0 + 8 * 5.0  # Pow fp32, the other eight fp16 (2x faster)


class MemoryCost(FakeCost):
    """A Cast costs 1 us to launch plus 3 us of memory time per 1000 elements."""

    def cast_time(self, elements: int) -> float:
        return 1.0 + 3.0 * elements / 1000


def test_with_fuse_elementwise_a_cast_next_to_a_fused_op_costs_its_memory_share_and_no_launch():
    model = parse("""
    g (float[1000] x, float[1000,1000] w) => (float[1000] y, float[1000] z) {
      [relu] r = Relu(x)
      [mm] m = MatMul(r, w)
      [neg] y = Neg(m)
      [mm2] z = MatMul(m, w)
    }
    """)
    for fused in (False, True):
        planning = build_context(model, cost=MemoryCost(), fuse_elementwise=fused)
        decide(planning, mm="fp16")
        plan = planning.plan
        nodes = {n.name: n for n in planning.nodes}
        x_cast = estimate.casts_time(planning, [nodes["mm"].inputs[0]], plan.precision)  # Relu -> Cast
        m_cast = estimate.casts_time(planning, [nodes["mm"].outputs[0]], plan.precision)  # Neg and mm2 read it
        if not fused:
            assert x_cast == (4.0, 1) and m_cast == (4.0, 1)
        else:  # Relu's chain writes the fp16 copy; m's readers include a MatMul: a Cast of its own
            assert x_cast == (pytest.approx(1.0), 0) and m_cast == (4.0, 1)


def test_with_fuse_reductions_a_cast_read_only_by_reduce_sums_costs_nothing():
    model = parse("""
    g (float[64,64] x, float[64,64] w) => (float[64] y) {
      [mm] m = MatMul(x, w)
      [sum] y = ReduceSum <keepdims = 0, axes = [0]> (m)
    }
    """.replace("<keepdims = 0, axes = [0]> (m)", "<keepdims = 0> (m, axes)").replace(
        "[mm] m = MatMul(x, w)", "axes = Constant <value = int64[1] {0}> ()\n      [mm] m = MatMul(x, w)"))
    for fused in (False, True):
        planning = build_context(model, cost=MemoryCost(), fuse_reductions=fused)
        decide(planning, mm="fp16")
        nodes = {n.name: n for n in planning.nodes}
        cast = estimate.casts_time(planning, [nodes["mm"].outputs[0]], planning.plan.precision)
        assert cast == ((0.0, 0) if fused else (pytest.approx(1.0 + 3.0 * 64 * 64 / 1000), 1))


# --- the session's weights from memory ----------------------------------------------------------
def whole_model_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """What ORT writes for a session of the whole model, serialized with its weights, as
    executed_graph asks it (extended level, CPU-only fusions off)."""
    from onnxcampo.runtime import make_session
    from onnxcampo.runtime.optimized import CPU_ONLY_FUSIONS

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "optimized.onnx")
        make_session(model, optimization_level="extended", intra_op_threads=1, log_severity=3,
                     disabled_optimizers=CPU_ONLY_FUSIONS,
                     session_config={"session.optimized_model_filepath": path,
                                     "session.optimized_model_external_initializers_file_name": "optimized.onnx.data",
                                     "session.optimized_model_external_initializers_min_size_in_bytes": "64"})
        return onnx.load(path, load_external_data=False)


def weight_folding() -> onnx.ModelProto:
    """A weight transposed and scaled by a constant before its MatMul, then a bias: ORT folds the
    Transpose and the Mul into a new weight (constant folding reads the weight's values)."""
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t"),
             helper.make_node("Mul", ["wt", "two"], ["ws"], name="s"),
             helper.make_node("MatMul", ["x", "ws"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="act")]
    inits = [weight("w", (64, 64)), onnx.numpy_helper.from_array(np.array([2.0], np.float32), "two"),
             onnx.numpy_helper.from_array(np.full(64, 0.5, np.float32), "b")]
    return make_model(nodes, [tensor_vi("x", (8, 64))], [tensor_vi("y", (8, 64))], inits)


def bert_layer():
    from cases.transformer import bert_layer as layer

    return layer()


@pytest.mark.parametrize("build", [conv_bn, weight_folding, bert_layer],
                         ids=["conv-bn", "weight-folding", "bert-layer"])
def test_the_session_without_serialized_weights_optimizes_the_graph_alike(build, monkeypatch):
    """executed_graph hands ORT a copy without the large initializers and their data from memory:
    the graph ORT writes is node for node the one a session of the whole model writes (batch-norm
    folding and constant folding read the weights' values)."""
    from onnxcampo import ir

    model = build()
    assert ir.without_weights(model, location="memory")[1]  # weights large enough to be held out
    written = []
    real_load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda *args, **kwargs: written.append(real_load(*args, **kwargs)) or written[-1])
    before = model.SerializeToString()
    executed_graph(model)
    assert model.SerializeToString() == before
    monkeypatch.setattr(onnx, "load", real_load)
    whole = whole_model_graph(model)
    assert list(written[-1].graph.node) == list(whole.graph.node)
    assert [(t.name, list(t.dims), t.data_type) for t in written[-1].graph.initializer] == [
        (t.name, list(t.dims), t.data_type) for t in whole.graph.initializer]


def test_weights_named_like_ort_fusion_outputs_reach_the_session_renamed():
    """read_executed_graph renames tensors named like ORT's fusion outputs in its copy: a large
    weight so named is handed to ORT under its new name, and the MatMul + bias still fuse."""
    nodes = [helper.make_node("MatMul", ["x", "splits"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b"], ["a"], name="add"),
             helper.make_node("Tanh", ["a"], ["y"], name="act")]
    bias = onnx.numpy_helper.from_array(np.full(64, 0.5, np.float32), "b")
    model = make_model(nodes, [tensor_vi("x", (8, 64))], [tensor_vi("y", (8, 64))], [weight("splits", (64, 64)), bias])
    ctx = context(model)
    assert ctx.ort_status == {"mm": "absorbed", "add": "carried"}
