"""The benchmark's fusion-plan variants: ``campo-fused-blind-graph`` (campo-fused-graph's fusions
and replay, the plan made fusion-blind) and ``fp16-fused-graph`` (the all-fp16 plan, fused and
replayed), their rows' predicted plan times, and the report's side-by-side table."""

from __future__ import annotations

import onnx
import pytest
from onnxcampo.benchmarks import policies as bench_policies
from onnxcampo.benchmarks import report as bench_report
from helpers import parse

from onnxcampo.ops import library_path

MODEL = """
g (float[64,256] x, float[256,256] w) => (float[64,256] y) {
  [mm] m = MatMul(x, w)
  [add] a = Add(m, m)
  [tanh] t = Tanh(a)
  [mul] y = Mul(t, a)
}
"""


def test_the_fusion_plan_variants_are_graph_policies_with_both_fusions():
    for policy in ("campo-fused-blind-graph", "fp16-fused-graph"):
        assert policy in bench_policies.GRAPH_POLICIES and policy in bench_policies.INFERENCE_POLICIES
        assert policy in bench_policies.TRAINING_POLICIES
        options = bench_policies.ONNXCAMPO[policy]
        assert options["execution"] == "cuda-graph" and options["fuse_elementwise"] and options["fuse_reductions"]
        assert bench_policies.graph_base(policy) == policy  # planned for the replay, not a replay of another
    assert bench_policies.ONNXCAMPO["campo-fused-blind-graph"]["experimental"]["plan_for_fusion"] is False
    assert bench_policies.ONNXCAMPO["fp16-fused-graph"]["policy"] == "fp16"
    assert "experimental" not in bench_policies.ONNXCAMPO["campo-fused-graph"]  # fusion-aware, the default


@pytest.mark.parametrize("policy", ["campo-fused-graph", "campo-fused-blind-graph", "fp16-fused-graph"])
def test_a_fusion_plan_variant_records_its_predicted_plan_time(tmp_path, policy):
    try:
        library_path()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"custom-op library not built: {exc}")
    source = tmp_path / "m.onnx"
    onnx.save(parse(MODEL), source)
    _, info = bench_policies.make_variant(policy, source, tmp_path / f"{policy}.onnx", {}, {}, provider="cpu")
    plan = bench_policies.ONNXCAMPO[policy]["policy"]
    assert info["predicted_plan_us"] == info["predicted_us"][plan] > 0
    assert info["plan_for_fusion"] is (policy != "campo-fused-blind-graph")
    both = info["predicted_fusion"]
    assert both["planned_for_fusion"] is info["plan_for_fusion"]
    assert both["fusion_aware_us" if info["plan_for_fusion"] else "fusion_blind_us"] == pytest.approx(
        info["predicted_plan_us"], abs=1e-3)


def _row(policy, ms, predicted_us):
    return {"model": "bert", "batch": 8, "mode": "training", "policy": policy, "status": "ok", "ms": ms,
            "throughput": 8 / ms * 1e3, "predicted_plan_us": predicted_us, "key": policy}


def test_the_report_sets_the_fusion_aware_and_blind_plans_side_by_side():
    rows = [_row("campo-fused-graph", 11.5, 10_800.0), _row("campo-fused-blind-graph", 12.0, 12_400.0),
            _row("fp32", 30.0, None)]
    lines = bench_report.fusion_plan_comparison(rows)
    assert len(lines) == 3
    assert lines[2].startswith("| bert | training | 8 | 10.80 / 11.50 | 12.40 / 12.00 | – / – | 1.04x")
    assert bench_report.fusion_plan_comparison(rows[:1] + rows[2:]) == []  # the blind row missing: no table


@pytest.mark.slow
def test_the_cudnn_variant_trains_on_a_step_with_conv_weight_grad(tmp_path, monkeypatch):
    """campo-fused-cudnn-graph (training only): campo-fused-graph on a step graph of its own,
    built with conv_weight_grad="cudnn" (every Conv weight gradient one ConvWeightGrad), cached
    apart from the group's step."""
    from onnxcampo.benchmarks import runner as bench

    try:
        library_path()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"custom-op library not built: {exc}")
    assert "campo-fused-cudnn-graph" in bench_policies.TRAINING_POLICIES
    assert "campo-fused-cudnn-graph" not in bench_policies.INFERENCE_POLICIES
    monkeypatch.setenv("ONNXCAMPO_BENCH_CACHE", str(tmp_path / "cache"))
    (tmp_path / "w").mkdir()
    group = bench.Group("odd_cnn", 4, "training", bench.Settings.make("cpu", True, False, ()), tmp_path / "w")
    plain, cudnn = group.step_graph(), group.step_graph(**bench_policies.STEP_OPTIONS["campo-fused-cudnn-graph"])
    assert plain != cudnn
    ops = {path: {n.op_type for n in onnx.load(str(path)).graph.node} for path in (plain, cudnn)}
    assert "ConvWeightGrad" in ops[cudnn] and "ConvWeightGrad" not in ops[plain]
    path, _ = bench.training_variant(group, "campo-fused-cudnn-graph")
    assert "ConvWeightGrad" in {n.op_type for n in onnx.load(str(path)).graph.node}


def test_the_nhwc_variant_is_campo_fused_graph_in_a_session_that_prefers_nhwc():
    """campo-fused-nhwc-graph (training only): campo-fused-graph's optimize options, its session
    with the CUDA EP's prefer_nhwc; no other policy adds CUDA options."""
    assert "campo-fused-nhwc-graph" in bench_policies.TRAINING_POLICIES
    assert "campo-fused-nhwc-graph" not in bench_policies.INFERENCE_POLICIES
    assert bench_policies.ONNXCAMPO["campo-fused-nhwc-graph"] == bench_policies.ONNXCAMPO["campo-fused-graph"]
    assert bench_policies.cuda_options_of("campo-fused-nhwc-graph") == {"prefer_nhwc": "1"}
    assert all(bench_policies.cuda_options_of(p) is None for p in bench_policies.TRAINING_POLICIES
               if p != "campo-fused-nhwc-graph")
