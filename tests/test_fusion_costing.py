"""Fusion-aware costing (``onnxcampo.estimate``, the experimental ``plan_for_fusion``): with ``--fuse-elementwise``
a Cast inside a predicted FusedElementwise group costs nothing, one at its edge the bytes it
changes there, and a fused elementwise op its share of the group's kernel; the fusion-blind plan
(``plan_for_fusion=False``) is costed as if no fusion ran."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import BIAS_GRADIENT, W_INIT, FakeCost, build_context, decide, parse

from onnxcampo import estimate, pipeline
from onnxcampo.cli import config_from_args
from onnxcampo.cli import build_parser
from onnxcampo.config import OptimizeConfig
from onnxcampo.context import Planning
from onnxcampo.costdb.model import DEFAULT_FUSED_KERNEL, FusedKernelCost
from onnxcampo.plan import Precision
from onnxcampo.rewrites import elementwise, loss


class MemoryCost(FakeCost):
    """A Cast costs 1 us to launch plus 3 us of memory time per 1000 elements; the fused kernel
    moves 1000 bytes a microsecond after a fixed 1 us."""

    def cast_time(self, elements: int) -> float:
        return 1.0 + 3.0 * elements / 1000

    def fused_kernel(self) -> FusedKernelCost:
        return FusedKernelCost(bytes_per_us=1000.0, fixed_us=1.0, measured=True)


CHAIN = """
g (float[1000] x, float[1000,1000] w) => (float[1000] y) {
  [add] a = Add(x, x)
  [mul] b = Mul(a, a)
  [tanh] c = Tanh(b)
  [neg] d = Neg(c)
  [mm] y = MatMul(d, w)
}
"""


def _ctx(text=CHAIN, **options):
    return build_context(parse(text), cost=MemoryCost(), fuse_elementwise=True, **options)


def _nodes(planning):
    return {n.name: n for n in planning.nodes}


def test_the_predicted_group_holds_the_elementwise_chain_and_not_the_matmul():
    planning = _ctx()
    groups = elementwise.predicted_groups(planning)
    assert set(groups) == {"add", "mul", "tanh", "neg"}
    assert len({m.group for m in groups.values()}) == 1
    assert [name for name, m in groups.items() if m.leader] == ["add"]
    # x is read once (by add); only neg's output leaves the group
    assert groups["add"].read_elements == 1000 and groups["neg"].written_elements == 1000
    assert groups["mul"].read_elements == 0 and groups["mul"].written_elements == 0


def test_a_cast_inside_a_fused_group_costs_nothing():
    planning = _ctx()
    decide(planning, add="fp32", mul="fp16", tanh="fp32", neg="fp32", mm="fp32")
    n = _nodes(planning)
    tensors = [n["mul"].inputs[0], n["mul"].outputs[0]]  # a (fp32 -> fp16) and b (fp16 -> fp32)
    assert estimate.casts_time(planning, tensors, planning.plan.precision) == (0.0, 0)
    blind = _ctx(experimental={"plan_for_fusion": False})
    decide(blind, add="fp32", mul="fp16", tanh="fp32", neg="fp32", mm="fp32")
    m = _nodes(blind)
    assert estimate.casts_time(blind, [m["mul"].inputs[0], m["mul"].outputs[0]], blind.plan.precision) == (8.0, 2)


def test_a_cast_at_a_group_edge_costs_the_bytes_it_changes_there():
    """d leaves the group for an fp16 MatMul only: the kernel writes it in fp16 instead of fp32,
    2 bytes less an element; x enters an fp16 group as fp32: 2 bytes more an element."""
    planning = _ctx()
    decide(planning, add="fp32", mul="fp32", tanh="fp32", neg="fp32", mm="fp16")
    n = _nodes(planning)
    cast_us, casts = estimate.casts_time(planning, [n["mm"].inputs[0]], planning.plan.precision)
    assert casts == 0 and cast_us == pytest.approx(1000 * (2 - 4) / 1000.0)
    fp16 = _ctx()
    decide(fp16, add="fp16", mul="fp16", tanh="fp16", neg="fp16", mm="fp16")
    x = _nodes(fp16)["add"].inputs[0]
    assert estimate.casts_time(fp16, [x], fp16.plan.precision) == (pytest.approx(1000 * (4 - 2) / 1000.0), 0)


def test_a_cast_of_a_group_output_that_is_read_in_both_types_is_an_extra_write():
    text = CHAIN.replace("=> (float[1000] y)", "=> (float[1000] y, float[1000] d)")
    planning = _ctx(text)
    decide(planning, add="fp32", mul="fp32", tanh="fp32", neg="fp32", mm="fp16")
    d = _nodes(planning)["mm"].inputs[0]  # a graph output too: kept fp32, written fp16 as well
    assert estimate.casts_time(planning, [d], planning.plan.precision) == (pytest.approx(1000 * 2 / 1000.0), 0)


def test_interior_fused_ops_gain_nothing_from_fp16_and_the_group_launches_once():
    planning = _ctx()
    decide(planning, add="fp32", tanh="fp32", neg="fp32", mm="fp32")
    mul = _nodes(planning)["mul"]
    numbers = estimate.delta(planning, planning.plan, [mul])
    assert numbers["fp32_us"] == numbers["fp16_us"] == pytest.approx(1.0 / 4)  # its share of the fixed cost
    assert numbers["gain_us"] == pytest.approx(0.0)
    decide(planning, mul="fp32")
    fused = estimate.plan_time(planning, planning.plan)
    assert fused.launched == 2  # the group's kernel and the MatMul
    blind = _ctx(experimental={"plan_for_fusion": False})
    decide(blind, add="fp32", mul="fp32", tanh="fp32", neg="fp32", mm="fp32")
    unfused = estimate.plan_time(blind, blind.plan)
    assert unfused.launched == 5 and unfused.nodes_us == 50.0
    # the group: 1 us fixed + (x read, d written) 8000 bytes at 1000 bytes/us; the MatMul 10 us
    assert fused.nodes_us == pytest.approx(1.0 + 8.0 + 10.0)


SANDWICH = f"""
g (float[125,8] x) => (float[125,8] y) <{W_INIT}> {{
  [relu] r = Relu(x)
  [neg] n = Neg(r)
  [mm] m = MatMul(n, w)
  [relu2] s = Relu(m)
  [neg2] y = Neg(s)
}}
"""


def test_fusion_aware_planning_makes_a_cheaper_choice_than_the_fusion_blind_plan():
    """A MatMul between fp32 elementwise chains: its two Casts (4 us each unfused) cost more than
    fp16 saves (5 us), so the blind plan keeps it fp32; fused, the Casts fold into the chains'
    kernels (which then move fewer bytes) and the fp16 MatMul pays."""
    plans = {}
    for aware in (True, False):
        planning = build_context(parse(SANDWICH), cost=MemoryCost(), fuse_elementwise=True,
                                 exclude_ops=frozenset({"Relu", "Neg"}),
                                 experimental={"plan_for_fusion": aware, "pad_tensor_cores": False})
        chosen = pipeline.plan_policies(planning.ctx)
        plans[aware] = (planning.ctx, chosen.plans["campo"], chosen.times["campo"])
    aware_ctx, aware_plan, aware_time = plans[True]
    blind_ctx, blind_plan, blind_time = plans[False]
    assert aware_plan.precision("mm") is Precision.FP16
    assert blind_plan.precision("mm") is Precision.FP32
    # under the fusion-aware costing (how the fused model runs) the aware plan is the cheaper one
    blind_as_run = estimate.plan_time(Planning(aware_ctx, blind_plan), blind_plan)
    assert aware_time.total_us < blind_as_run.total_us
    assert blind_time.total_us == pytest.approx(estimate.plan_time(Planning(blind_ctx, blind_plan), blind_plan).total_us)


def test_plan_for_fusion_off_costs_like_no_fusion():
    for aware in (True, False):
        planning = _ctx(experimental={"plan_for_fusion": aware})
        decide(planning, add="fp16", mul="fp32", tanh="fp16", neg="fp32", mm="fp16")
        off = build_context(parse(CHAIN), cost=MemoryCost())
        decide(off, add="fp16", mul="fp32", tanh="fp16", neg="fp32", mm="fp16")
        same = estimate.plan_time(planning, planning.plan) == estimate.plan_time(off, off.plan)
        assert same is (not aware)


def test_plan_for_fusion_is_on_by_default_and_off_as_an_experimental_option():
    assert OptimizeConfig().experimental.plan_for_fusion is True
    parser = build_parser()
    args = parser.parse_args(["optimize", "m.onnx", "o.onnx", "--fuse-elementwise",
                              "--experimental", "plan_for_fusion=false"])
    config = config_from_args(args)
    assert config.experimental.plan_for_fusion is False and config.fuse_elementwise is True
    assert config_from_args(parser.parse_args(["optimize", "m.onnx", "o.onnx"])).experimental.plan_for_fusion is True


def test_the_fused_kernel_cost_comes_from_the_database_or_the_documented_default(tmp_path):
    from onnxcampo.costdb.fit import merge_fused_elementwise
    from onnxcampo.costdb.regression import RegressionCostModel

    database = {"schema_version": 1, "device": {"name": "test"}, "cast": {"C_I": 1.0, "r": 0.0}, "ops": {}}
    assert RegressionCostModel(database).fused_kernel() == DEFAULT_FUSED_KERNEL
    assert DEFAULT_FUSED_KERNEL.measured is False
    db = tmp_path / "db.json"
    db.write_text(json.dumps(database))
    fit = tmp_path / "fe.json"
    fit.write_text(json.dumps({"fused_elementwise": {"bytes_per_us": 3.0e6, "fixed_us": 2.5, "measured": True}}))
    merge_fused_elementwise(db, fit)
    kernel = RegressionCostModel(json.loads(db.read_text())).fused_kernel()
    assert kernel == FusedKernelCost(3.0e6, 2.5, measured=True)
    assert kernel.time_us(3.0e6) == pytest.approx(3.5)


def test_costdb_fit_fused_elementwise_writes_the_entry(tmp_path):
    from onnxcampo.cli import main

    database = {"schema_version": 1, "device": {"name": "test"}, "cast": {"C_I": 1.0, "r": 0.0}, "ops": {}}
    db = tmp_path / "db.json"
    db.write_text(json.dumps(database))
    fit = tmp_path / "fe.json"
    fit.write_text(json.dumps({"fused_elementwise": {"bytes_per_us": 3.0e6, "fixed_us": 2.5}}))
    assert main(["costdb", "fit-fused-elementwise", str(fit), str(db)]) == 0
    assert json.loads(db.read_text())["fused_elementwise"]["bytes_per_us"] == 3.0e6
    fit.write_text(json.dumps({"fused_elementwise": {"bytes_per_us": -1, "fixed_us": 2.5}}))
    assert main(["costdb", "fit-fused-elementwise", str(fit), str(db)]) != 0


def test_the_measurement_script_sweeps_fits_and_writes_a_mergeable_entry(tmp_path):
    """On the CPU provider, two small sizes: the sweep's cases run, the fit and its JSON come out."""
    try:
        from onnxcampo.ops import library_path

        library_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"custom-op library not built: {exc}")
    from onnxcampo.benchmarks import fused_elementwise_costs as script

    line = [(1000 * k, 1.0 + 1000 * k / 2.0e6) for k in (1, 2, 4, 8)]  # us = 1 + bytes / 2e6
    fitted = script.fit([{"bytes": b, "wall_ms": us / 1e3} for b, us in line], "wall_ms")
    assert fitted["bytes_per_us"] == pytest.approx(2.0e6) and fitted["fixed_us"] == pytest.approx(1.0)
    out = tmp_path / "fe.json"
    assert script.main(["--provider", "cpu", "--min-log2", "10", "--max-log2", "11", "--rounds", "1", "--block", "1",
                        "--out", str(out)]) in (0, 1)  # a CPU fit may come out without a positive slope
    written = json.loads(out.read_text()) if out.is_file() else None
    if written is not None:
        assert len(written["rows"]) == 2 * 4 * 2 * 2 and written["fused_elementwise"]["time"] == "wall_ms"


def test_the_cast_after_the_loss_gradient_costs_nothing_when_the_loss_fusion_writes_float16():
    """Loss fusion rule 5: SoftmaxCrossEntropyGrad writes the float16 its fp16 readers want, so with
    ``fuse_reductions`` the plan prices no Cast after onnx-ad's gradient ``Sub``; without it, the
    Cast costs its pass; with an fp32 reader past the views it costs too (rule 5 does not apply)."""
    from onnxcampo.training import build_train_step, scaling

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "ops"))
    from test_cross_entropy import _classifier

    step = build_train_step(_classifier(), loss="cross_entropy", optimizer="momentum", fused=False)
    kept = scaling.fp32_nodes(step)
    times = {}
    for reducing in (True, False):
        planning = build_context(step, cost=MemoryCost(), fuse_reductions=reducing, fuse_elementwise=False)
        for node in planning.nodes:
            decide(planning, **{node.name: "fp32" if node.name in kept else "fp16"})
        subs = [n for n in planning.nodes if n.op == "Sub" and loss.gradient_written_fp16(
            planning, n.outputs[0], lambda name: Precision.FP16)]
        (gradient,) = [n.outputs[0] for n in subs]
        boundary = gradient  # where the plan puts the Cast: the Sub's output or a view's after it
        while not estimate.tensor_casts(planning, boundary, planning.plan.precision):
            boundary = next(u.node for u in planning.uses(boundary)).outputs[0]
        times[reducing] = estimate.casts_time(planning, [boundary], planning.plan.precision)
        if reducing:
            reader = next(u.node for u in planning.uses(gradient))
            while reader.op in ("Reshape", "Squeeze", "Unsqueeze", "Identity"):
                reader = next(u.node for u in planning.uses(reader.outputs[0]))
            mixed = lambda name: Precision.FP32 if name == reader.name else planning.plan.precision(name)  # noqa: E731
            assert not loss.gradient_written_fp16(planning, boundary, mixed)
    assert times[True] == (0.0, 0) and times[False][0] > 0 and times[False][1] >= 1


@pytest.mark.parametrize("column_sums", [True, False])
def test_a_bias_gradient_summed_in_the_kernel_that_writes_it_costs_its_finishing_launch(column_sums):
    """Elementwise fusion rule 4: with both fusions, a ReduceSum over the leading axes of a value a
    predicted group writes is summed by that group's kernel; it costs the fused kernel's fixed
    cost (the partials' finishing launch), else what it costs alone. Rows summed (trailing axes)
    are no column sums."""
    text = BIAS_GRADIENT.replace("float[32] db", "float[32] db, float[64] rows").replace(
        "}\n", "  [last] last = Constant <value = int64[1] {1}> ()\n  [rows] rows = ReduceSum <keepdims = 0> (g, last)\n}\n", 1)
    planning = build_context(parse(text), cost=MemoryCost(), fuse_elementwise=True, fuse_reductions=True,
                             experimental={"fuse_column_sums": column_sums})
    nodes = _nodes(planning)
    assert elementwise.summed_in_kernel(planning, nodes["sum"]) is column_sums
    assert not elementwise.summed_in_kernel(planning, nodes["rows"])
    fp32 = estimate.node_time(planning, nodes["sum"], Precision.FP32)
    if column_sums:
        assert fp32 == MemoryCost().fused_kernel().fixed_us
    else:
        assert fp32 == planning.fp32_us["sum"] > 0


def test_a_mean_over_the_leading_axes_of_a_fused_output_is_summed_in_its_kernel_too():
    """A ReduceMean (a BatchNorm's statistics) is a BlockReduceSum and a Mul by 1/n once written
    (reductions rule 7): over the leading axes of a value a predicted group writes, its kernel
    sums it as it does a ReduceSum's."""
    text = BIAS_GRADIENT.replace("[sum] db = ReduceSum <keepdims = 0> (g, axes)",
                                 "[sum] db = ReduceMean <axes = [0], keepdims = 0> (g)")
    planning = build_context(parse(text), cost=MemoryCost(), fuse_elementwise=True, fuse_reductions=True)
    assert elementwise.summed_in_kernel(planning, _nodes(planning)["sum"])


def test_a_column_sum_the_kernel_cannot_take_costs_what_it_costs_alone():
    """Columns that are no multiple of the kernel's 4 lanes (or partials as large as the output:
    BERT's [4096, 768]) leave the sum to BlockReduceSum over the stored output: priced as before."""
    text = BIAS_GRADIENT.replace("[64,32]", "[64,6]").replace("[32,32]", "[6,6]").replace("float[32] db", "float[6] db")
    planning = build_context(parse(text), cost=MemoryCost(), fuse_elementwise=True, fuse_reductions=True)
    node = _nodes(planning)["sum"]
    assert not elementwise.summed_in_kernel(planning, node)
    assert estimate.node_time(planning, node, Precision.FP32) == planning.fp32_us["sum"]
    from onnxcampo.ops import elementwise as ew

    assert ew.sum_grid(4096 * 768, 768, ew.JIT_BLOCKS_PER_SM * 132) is None  # BERT's bias gradients
