"""The measurement harness on ONNX Runtime CPU with a tiny grid: samples, resume, fit."""

from __future__ import annotations

import json
import math

import onnx
import pytest

from onnxcampo.costdb import measure
from onnxcampo.costdb.chains import ChainCase
from onnxcampo.costdb.features import cost_key
from onnxcampo.costdb.fit import fit_database, load_samples
from onnxcampo.costdb.regression import RegressionCostModel


def tiny_grid():
    cases = []
    for n in (1000, 4000, 16000, 64000, 256000):
        cases.append(measure.Case("Cast", ((n,),), tag="to_fp16"))
        cases.append(measure.Case("Cast", ((n,),), tag="to_fp32"))
        cases.append(measure.Case("Add", ((n // 100, 100), (n // 100, 100))))
    for m, k, n in ((16, 16, 16), (32, 64, 24), (64, 63, 65)):
        cases.append(measure.Case("MatMul", ((m, k), (k, n)), weights=(1,)))
    return cases


@pytest.mark.slow
def test_every_grid_model_is_valid():
    small = [c for c in measure.default_grid() if max(math.prod(s) for s in c.input_shapes) <= 1 << 20]
    for case in small[::3]:
        for precision, _ in measure.precisions_of(case):
            model, feeds = measure.build_model(case, precision)
            onnx.checker.check_model(model)
            assert all(d > 0 for d in measure.output_shapes(model)[0])
            assert set(feeds) == {i.name for i in model.graph.input}


@pytest.mark.slow
def test_measure_appends_resumes_and_fits(tmp_path):
    out = tmp_path / "samples.jsonl"
    grid = tiny_grid()
    chains = [ChainCase("matmul_bias", (16, 16, 8)), ChainCase("bias_gelu", (16, 24))]
    first = measure.measure(out, provider="cpu", budget_s=120, cases=grid, chains=chains)
    expected = sum(len(measure.precisions_of(c)) for c in grid) + 2 * len(chains)
    assert first == expected
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len({r["key"] for r in rows}) == expected
    cast = next(r for r in rows if r["op_type"] == "Cast")
    assert cast["precision"] in ("to_fp16", "to_fp32") and cast["elements"] > 0
    matmul = next(r for r in rows if r["op_type"] == "MatMul" and r["tf32"] is False)
    assert matmul["weights"] == [1] and matmul["output_shapes"] == [[16, 16]]
    assert all(r["wall_us"] > 0 and r["runs"] >= 30 for r in rows if "chain" not in r)
    assert all(math.isfinite(r["time_us"]) and len(r["parts_us"]) == len(r["part_ops"]) for r in rows if "chain" in r)
    chain = next(r for r in rows if r.get("chain") == "bias_gelu")
    assert chain["part_ops"] == ["Add", "Div", "Erf", "Add", "Mul", "Mul"] and len(chain["parts_us"]) == 6
    assert measure.measure(out, provider="cpu", budget_s=60, cases=grid, chains=chains) == 0  # resumes: nothing left
    database = fit_database(load_samples(out), min_samples=4)
    assert set(database["chains"]) == {"matmul_bias", "bias_gelu"}
    assert database["chains"]["matmul_bias"]["samples"] == 2 and database["chains"]["bias_gelu"]["fp32"] > 0
    assert 0 < database["cast"]["r"] and database["cast"]["C_I"] > -1
    model = RegressionCostModel(database)
    assert model.cast_time(10**6) > model.cast_time(10**3)


def smallest_fused_cases():
    """The smallest case of each fused op (and attention variant) of the grid."""
    chosen = {}
    for case in sorted(measure.fused_cases(), key=lambda c: sum(math.prod(s) for s in c.input_shapes)):
        chosen.setdefault((case.op_type, case.tag), case)
    return list(chosen.values())


@pytest.mark.slow
def test_fused_op_cases_run_on_ort_cpu_with_their_declared_outputs_and_fit(tmp_path):
    # Wiring on ORT CPU (times there say nothing of the GPU): every com.microsoft op of the grid
    # builds, runs in both precisions, gives the shapes its case declares, and its samples have
    # known features, so the fit gives each op type an entry like any other.
    cases = smallest_fused_cases()
    assert {c.op_type for c in cases} >= {"Attention", "MultiHeadAttention", "SkipLayerNormalization",
                                          "BiasGelu", "FastGelu", "FusedMatMul", "EmbedLayerNormalization"}
    out = tmp_path / "fused.jsonl"
    assert measure.measure(out, provider="cpu", budget_s=300, cases=cases, chains=[]) == 2 * len(cases)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r["key"] for r in rows if "error" in r]
    for row in rows:
        case = next(c for c in cases if c.key == row["case"])
        assert row["domain"] == "com.microsoft"
        assert row["output_shapes"] == [list(o[0]) for o in case.outputs if o is not None]
    passing_on = next(r for r in rows if r["op_type"] == "SkipLayerNormalization" and r["case"].endswith("fused-sum"))
    assert len(passing_on["output_shapes"]) == 2 and passing_on["float_outputs"] == [True, True]
    embed = next(r for r in rows if r["op_type"] == "EmbedLayerNormalization")
    assert embed["float_inputs"][:2] == [False, False] and embed["float_outputs"] == [True, False]
    from onnxcampo.costdb.fit import collect

    paired = collect(rows)
    # fitted under their cost names: com.microsoft's Gelu and Attention apart from ONNX's own
    assert sorted(c.op_type for c in paired.cases) == sorted(cost_key(c.op_type, c.domain) for c in cases)
    assert all(c.features.known and c.features.flops > 0 for c in paired.cases)
    assert {c.op_type for c in paired.cases if c.features.gemm} == {"com.microsoft.Attention", "MultiHeadAttention",
                                                                    "FusedMatMul"}
    assert "com.microsoft.Gelu" in {c.op_type for c in paired.cases}


def test_the_grid_has_enough_cases_of_each_fused_op_for_an_entry():
    counts = {}
    for case in measure.default_grid():
        if case.domain == "com.microsoft":
            counts[case.op_type] = counts.get(case.op_type, 0) + 1
    assert min(counts.values()) >= 8 and len(counts) == 10, counts  # fit_database min_samples
