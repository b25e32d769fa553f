"""The accuracy criterion (onnxcampo.accuracy) and its runs (onnxcampo.accuracy.check, the CLI):
statistics on made-up arrays, the tolerance that would pass, the fp32 model failing on its
inputs, the bisection finding a planted culprit within its stated bound, --fix, the default
accuracy check (reports, never re-optimizes)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from onnxcampo.accuracy import check as acc
from onnxcampo.accuracy import DEFAULT_CRITERION, Criterion, evaluate, output_stats
from onnxcampo.api import optimize
from onnxcampo.cli import main
from onnxcampo.errors import ConfigError


# ---- statistics ------------------------------------------------------------------------------


def test_each_statistic_on_made_up_arrays():
    ref = np.array([1.0, -2.0, 4.0, 0.0, 8.0], np.float32)
    out = np.array([1.1, -2.0, 4.0, 0.5, 8.0], np.float32)
    s = output_stats("y", ref, out).values
    diff = np.array([0.1, 0.0, 0.0, 0.5, 0.0])
    assert s["max_abs"] == pytest.approx(0.5) and s["mean_abs"] == pytest.approx(diff.mean(), rel=1e-6)
    assert s["median_abs"] == pytest.approx(0.0, abs=1e-7)
    assert s["p99_abs"] == pytest.approx(np.percentile(diff, 99), rel=1e-5)
    # relative errors where |r| > 1e-6 max|r|: the zero is left out
    rel = np.array([0.1, 0.0, 0.0, 0.0])
    assert s["max_rel"] == pytest.approx(0.1, rel=1e-5) and s["mean_rel"] == pytest.approx(rel.mean(), rel=1e-5)
    assert s["median_rel"] == pytest.approx(0.0, abs=1e-7)
    assert s["rel_l2"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(ref), rel=1e-5)


def test_non_finite_values_reference_left_out_candidate_infinite_integers_by_share():
    ref = np.array([1.0, np.nan, 3.0, 4.0], np.float32)
    left_out = output_stats("y", ref, np.array([1.0, 7.0, 3.0, 4.0], np.float32))
    assert left_out.values["rel_l2"] == 0.0 and left_out.reference_nonfinite == 1 and left_out.compared == 3
    overflow = output_stats("y", ref, np.array([1.0, 2.0, np.inf, 4.0], np.float16))
    assert overflow.values["rel_l2"] == math.inf and overflow.candidate_nonfinite == 1
    ids = output_stats("ids", np.array([1, 2, 3, 4]), np.array([1, 2, 3, 0]))
    assert ids.values == {"mismatch": 0.25}
    assert output_stats("y", ref, None).broken and output_stats("y", ref, ref[:2]).broken
    nothing = output_stats("y", np.full(3, np.nan, np.float32), np.zeros(3, np.float32))
    assert nothing.kind == "none" and evaluate({"y": np.full(3, np.nan)}, {"y": np.zeros(3)}).ok  # cannot judge


def test_the_default_passes_fp16_rounding_and_fails_an_fp16_overflow():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 64)).astype(np.float32)
    rounded = ref.astype(np.float16)  # 2^-11 relative rounding: rel L2 ~3e-4
    assert evaluate({"y": ref}, {"y": rounded}).ok
    noisy = (ref + 0.05 * rng.standard_normal(ref.shape)).astype(np.float32)  # 5 % noise
    verdict = evaluate({"y": ref}, {"y": noisy})
    assert not verdict.ok and verdict.failed[0].failed == ("rel_l2",)
    assert not evaluate({"y": ref}, {"y": np.where(ref > 2, np.inf, ref)}).ok


def test_the_tolerance_that_would_pass():
    ref = {"a": np.array([3.0, 4.0], np.float32), "b": np.array([1.0, 1.0], np.float32)}
    out = {"a": np.array([3.0, 4.5], np.float32), "b": np.array([1.0, 1.02], np.float32)}
    verdict = evaluate(ref, out, "rel_l2=0.01,max_abs=0.1")
    assert [o.name for o in verdict.failed] == ["a", "b"]  # a: both bounds; b: rel L2 0.0141
    assert verdict.needed() == {"rel_l2": pytest.approx(0.1), "max_abs": pytest.approx(0.5)}
    assert verdict.needed_text() == "rel_l2=0.1,max_abs=0.5"
    assert evaluate(ref, out, Criterion.parse(verdict.needed_text())).ok
    assert evaluate(ref, out, "0.15").ok and not evaluate(ref, out, 0.05).ok


def test_criterion_text_and_its_errors():
    assert Criterion.parse(None) is DEFAULT_CRITERION
    assert str(DEFAULT_CRITERION) == "rel_l2=0.01,mismatch=0.01"
    assert Criterion.parse("0.02").bounds == {"rel_l2": 0.02}
    both = Criterion.parse("p99_abs=1e-3,max_rel=0.5,mismatch=0")
    assert both.bounds == {"p99_abs": 1e-3, "max_rel": 0.5} and both.mismatch == 0.0
    assert Criterion.parse("mismatch=0").bounds == {"rel_l2": 0.01}
    for bad, message in [("rel=0.1", "unknown accuracy statistic"), ("rel_l2=x", "not a number"),
                         ("rel_l2=-1", "must be a number >= 0"), ("mismatch=2", "share in"), (",", "expected")]:
        with pytest.raises(ConfigError, match=message):
            Criterion.parse(bad)


def test_verdict_lines_say_the_figures_and_the_bound():
    verdict = evaluate({"y": np.array([3.0, 4.0], np.float32)}, {"y": np.array([3.0, 4.5], np.float32)})
    line = verdict.outputs[0].line(verdict.criterion)
    assert line.startswith("y: rel L2 0.1, max abs 0.5, p99 abs 0.495, max rel 0.125") and line.endswith(
        "FAIL (rel L2 > 0.01)")
    assert verdict.summary() == "fails rel L2 <= 0.01: y rel L2 0.1 > 0.01"
    row = verdict.to_json()
    assert row["criterion"] == "rel_l2=0.01,mismatch=0.01" and row["needed_tolerance"] == "rel_l2=0.1"
    assert row["outputs"][0]["failed"] == ["rel_l2"] and row["outputs"][0]["rel_l2"] == pytest.approx(0.1)
    json.dumps(evaluate({"y": np.ones(2)}, {"y": np.array([1.0, np.inf])}).to_json())  # inf written as "inf"


# ---- models ----------------------------------------------------------------------------------


def planted(width: int = 16, depth: int = 4, culprit: int = 2) -> onnx.ModelProto:
    """MatMul -> Relu layers; after layer ``culprit`` its output is multiplied by 400 twice (up to
    160000, beyond fp16's 65504) and divided back: in fp16 the second Mul overflows to inf."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(depth):
        inits.append(nh.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), f"w{i}"))
        nodes.append(h.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"))
        x = f"mm{i}"
        if i == culprit:
            inits += [nh.from_array(np.array(400.0, np.float32), "big"),
                      nh.from_array(np.array(1 / 160000.0, np.float32), "small")]
            nodes += [h.make_node("Mul", [x, "big"], ["up1"], name="scale_up1"),
                      h.make_node("Mul", ["up1", "big"], ["up2"], name="scale_up2"),
                      h.make_node("Mul", ["up2", "small"], ["down"], name="scale_down")]
            x = "down"
        nodes.append(h.make_node("Relu", [x], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    graph = h.make_graph(nodes, "planted", [h.make_tensor_value_info("x", T.FLOAT, [8, width])],
                         [h.make_tensor_value_info(x, T.FLOAT, [8, width])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_the_bisection_finds_the_planted_culprit_and_keeping_it_fp32_passes():
    """fp16 everywhere overflows in scale_up2's output (read by scale_down): the reference
    evaluator sees it (ORT's CPU provider computes the fp16 Muls in fp32 and hides it); keeping
    those two fp32 passes."""
    model = planted()
    first = optimize(model, policy="fp16")
    ref = acc.reference(model, source="planted.onnx", provider="reference")
    assert ref.inputs == "generated"
    verdict = acc.check(first.model, ref, provider="reference")
    assert not verdict.ok and verdict.outputs[0].stats.candidate_nonfinite > 0
    lines = []
    found = acc.find_culprits(model, first_config(), ref, None, first, provider="reference", progress=lines.append)
    assert found.ok and set(found.nodes) == {"scale_up2", "scale_down"}
    # 4 MatMul, 4 Relu, 3 Mul; the bound: 2 + 8 rounds x (ceil(log2 11) + 1)
    assert found.probes <= 16 and lines[0] == ("searching the nodes responsible: 11 fp16 nodes, bisecting in graph "
                                               "order (at most 42 re-optimizations)")
    assert any("culprit 1:" in line for line in lines)
    assert acc.check(found.result.model, ref, provider="reference").ok
    plan = found.result.report["plan"]
    assert plan["scale_up2"]["precision"] == "fp32" and plan["matmul0"]["precision"] == "fp16"


def first_config():
    from onnxcampo.config import OptimizeConfig

    return OptimizeConfig(policy="fp16")


def test_a_search_out_of_budget_keeps_the_nodes_before_the_culprits_fp32_too():
    model = planted()
    first = optimize(model, policy="fp16")
    ref = acc.reference(model, provider="reference")
    found = acc.find_culprits(model, first_config(), ref, None, first, provider="reference", max_probes=5)
    assert found.ok and "search stopped after 0 culprits, 3 re-optimizations" in found.note
    assert {"scale_up2", "scale_down"} <= set(found.nodes) and len(found.nodes) < 11  # probes: 11, 5, 8 nodes


@pytest.mark.parametrize("max_probes", [1, 4, 5, 6, 64])
def test_a_search_makes_no_more_re_optimizations_than_it_says_up_front(max_probes):
    """The bound said before the search starts holds however the budget falls: with 5, the
    bisection's fifth probe finds a culprit and two more probes follow it unless they are counted."""
    model = planted()
    first = optimize(model, policy="fp16")
    ref = acc.reference(model, provider="reference")
    lines = []
    found = acc.find_culprits(model, first_config(), ref, None, first, provider="reference", max_probes=max_probes,
                              progress=lines.append, probe_seconds=0.25)
    bound = acc.max_reoptimizations(11, max_probes=max_probes)
    assert bound == min(max_probes, 42)
    assert lines[0].endswith(f"(at most {bound} re-optimizations, about 0.25 s each)")
    assert sum(line.startswith("  bisect probe") for line in lines) == found.probes <= bound
    assert found.ok  # whatever the budget, the model returned passes


def test_the_bound_of_the_search():
    assert [acc.max_reoptimizations(n) for n in (0, 1, 2, 11, 16, 17)] == [0, 10, 18, 42, 42, 50]
    assert acc.max_reoptimizations(1000) == acc.MAX_PROBES == 64
    assert acc.search_cost(42, 13.52) == "at most 42 re-optimizations, about 14 s each"
    assert acc.search_cost(42, 0.0531) == "at most 42 re-optimizations, about 0.053 s each"


def test_a_search_with_no_fp16_node_says_the_difference_comes_from_elsewhere():
    model = planted()
    result = optimize(model, policy="fp32")
    ref = acc.reference(model, provider="reference")
    found = acc.find_culprits(model, first_config().replace(policy="fp32"), ref, None, result, provider="reference")
    assert not found.ok and found.nodes == [] and "no fp16 node" in found.note


def mask_divides(nan: bool = True) -> onnx.ModelProto:
    """y = x / (mask - 1): NaN/inf where the mask is 1 (as random masks of ones give)."""
    one = nh.from_array(np.array(1.0 if nan else 5.0, np.float32), "one")
    nodes = [h.make_node("Cast", ["attention_mask"], ["m"], to=T.FLOAT), h.make_node("Sub", ["m", "one"], ["d"]),
             h.make_node("Div", ["x", "d"], ["q"]), h.make_node("Sub", ["q", "q"], ["y"])]
    graph = h.make_graph(nodes, "mask", [h.make_tensor_value_info("x", T.FLOAT, [4]),
                                         h.make_tensor_value_info("attention_mask", T.INT64, [4])],
                         [h.make_tensor_value_info("y", T.FLOAT, [4])], [one])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_an_fp32_model_that_fails_or_gives_nan_on_generated_inputs_is_named():
    with pytest.raises(acc.ReferenceError, match=r"the fp32 model m\.onnx gives no finite output value on generated "
                                                 r"inputs .*; give --inputs"):
        acc.reference(mask_divides(), source="m.onnx")
    reshape = h.make_node("Reshape", ["x", "shape"], ["x2"])
    failing = h.make_model(h.make_graph([reshape], "r", [h.make_tensor_value_info("x", T.FLOAT, [4])],
                                        [h.make_tensor_value_info("x2", T.FLOAT, None)],
                                        [nh.from_array(np.array([3], np.int64), "shape")]),
                           opset_imports=[h.make_opsetid("", 17)])
    with pytest.raises(acc.ReferenceError, match=r"the fp32 model f\.onnx fails on generated inputs: .*; give --inputs"):
        acc.reference(failing, source="f.onnx")
    with pytest.raises(acc.ReferenceError, match="fails on the given inputs: .*; give other --inputs"):
        acc.reference(failing, feeds={"x": np.ones(4, np.float32)}, source="f.onnx")


# ---- the command line ------------------------------------------------------------------------


@pytest.fixture
def planted_file(tmp_path):
    path = tmp_path / "planted.onnx"
    onnx.save(planted(), path)
    return path


def test_cli_accuracy_check_reports_once_and_says_how_to_search(planted_file, tmp_path, capsys, monkeypatch):
    """The default check runs the written model once: a failure is a warning with the figures and
    the criterion, the model is written, nothing is re-optimized, and one line says what
    --validate's or --fix's search would take."""
    import onnxcampo.api

    def no_search(*args, **kwargs):
        raise AssertionError("the default accuracy check searched the culprits")

    optimizations = []
    real_optimize = onnxcampo.api.optimize
    monkeypatch.setattr(acc, "find_culprits", no_search)
    monkeypatch.setattr(onnxcampo.api, "optimize",
                        lambda *args, **kwargs: optimizations.append(1) or real_optimize(*args, **kwargs))
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert len(optimizations) == 1  # never re-optimizes
    assert ("accuracy check: the fp32 and the written model on ONNX Runtime cpu (fp32) and the ONNX reference "
            "evaluator (written), generated inputs") in err
    assert "  accuracy check r3: rel L2 inf" in err and "FAIL (rel L2 > 0.01)" in err
    assert "bisect probe" not in err and "searching the nodes responsible" not in err
    assert ("warning: the written model's outputs differ beyond the tolerance (rel L2 <= 0.01): r3 rel L2 inf > 0.01 "
            "(70 non-finite values) (loosen --tolerance, or --exclude-node)") in err
    hint = next(line for line in err.splitlines() if "searches the nodes responsible" in line)
    assert hint.startswith("onnxcampo: accuracy check: --validate or --fix searches the nodes responsible: a "
                           "bisection of the 11 fp16 nodes, at most 42 re-optimizations, about ")
    assert hint.endswith(" s each")
    assert out.exists()  # a warning: written anyway
    written = json.loads(report.read_text())
    assert written["accuracy"]["ok"] is False
    culprits = written["accuracy"]["culprits"]
    assert culprits["searched"] is False and culprits["max_reoptimizations"] == 42
    assert culprits["why"].startswith("the default check runs the written model once and never re-optimizes; "
                                      "--validate or --fix searches")
    assert culprits["reoptimization_s"] >= 0
    assert any(note.startswith("accuracy check: the written model's outputs differ") for note in written["notes"])


def test_cli_fix_keeps_the_culprits_fp32_and_writes_the_model_that_passes(planted_file, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--fix", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()
    opening = next(i for i, line in enumerate(lines) if "searching the nodes responsible" in line)
    assert lines[opening].startswith("onnxcampo: searching the nodes responsible: 11 fp16 nodes, bisecting in graph "
                                     "order (at most 42 re-optimizations, about ")
    assert lines[opening].endswith(" s each)")
    assert opening < next(i for i, line in enumerate(lines) if "bisect probe 1:" in line)  # said before it starts
    assert "--fix: kept fp32 scale_" in err and "passes rel L2 <= 0.01" in err
    # generated inputs: the fix says what it was fitted to
    assert "onnxcampo: warning: the fix was fitted to generated inputs (standard-normal floats, smooth random images" in err
    written = json.loads(report.read_text())
    assert any("fitted to generated inputs" in note for note in written["notes"])
    assert written["accuracy"]["ok"] is True and written["accuracy"]["fixed"] is True
    assert written["accuracy"]["before"]["ok"] is False
    assert written["plan"]["scale_up2"]["precision"] == "fp32"
    ref = acc.reference(onnx.load(planted_file), provider="reference")
    assert acc.check(onnx.load(out), ref, provider="reference").ok


def test_cli_validate_fails_names_the_culprits_and_writes_nothing(planted_file, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate",
                 "--provider", "reference"]) == 1
    err = capsys.readouterr().err
    assert "  validate r3: rel L2 inf" in err
    assert "error: outputs differ beyond the tolerance (rel L2 <= 0.01): r3 rel L2 inf > 0.01" in err
    assert "scale_up2" in err
    assert "nothing written" in err and not out.exists()
    assert "searching the nodes responsible: 11 fp16 nodes, bisecting in graph order (at most 42 " in err
    report = tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--provider",
                 "reference", "--fix", "--report", str(report)]) == 0 and out.exists()
    written = json.loads(report.read_text())
    assert all(row["ok"] for row in written["validation"])  # the rows of the model written, the fixed one
    assert written["accuracy"]["fixed"] and written["accuracy"]["provider"] == "reference"


def test_cli_validate_on_ort_cpu_passes_what_cpu_computes_and_prints_the_statistics(planted_file, tmp_path, capsys):
    """ORT's CPU provider runs the fp16 Muls in fp32 between Casts it removes: no overflow there.
    The line gives the bounded statistic first, then max/p99 of the absolute and relative errors."""
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--tolerance",
                 "rel_l2=0.01,p99_abs=0.1", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert "validate: the fp32 and the written model on ONNX Runtime cpu, generated inputs (rel L2 <= 0.01, " \
           "p99 abs <= 0.1)" in err
    line = next(line for line in err.splitlines() if line.startswith("  validate r3:"))
    assert line.startswith("  validate r3: rel L2 ") and ", p99 abs " in line and ", max rel " in line
    assert line.endswith(" ok (rel L2 <= 0.01, p99 abs <= 0.1)")  # the verdict names what it judged
    rows = json.loads(report.read_text())["validation"]
    assert rows[0]["ok"] and rows[0]["measure"] == "rel_l2" and rows[0]["tolerance"] == "rel_l2=0.01,p99_abs=0.1,mismatch=0.01"
    assert {"mean_abs", "median_abs", "p99_abs", "max_abs", "mean_rel", "median_rel", "p99_rel", "max_rel",
            "rel_l2"} <= set(rows[0])


def test_cli_fp32_failing_on_generated_inputs_is_an_input_problem(tmp_path, capsys):
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(mask_divides(), src)
    assert main(["optimize", str(src), str(out), "--policy", "fp16", "--validate"]) == 2
    err = capsys.readouterr().err
    assert f"error: the fp32 model {src} gives no finite output value on generated inputs" in err
    assert "give --inputs" in err and not out.exists()
    np.savez(tmp_path / "in.npz", x=np.ones(4, np.float32), attention_mask=np.zeros(4, np.int64))
    assert main(["optimize", str(src), str(out), "--policy", "fp16", "--validate", "--inputs",
                 str(tmp_path / "in.npz")]) == 0
    assert "validate: the fp32 and the written model on ONNX Runtime cpu, the inputs of" in capsys.readouterr().err
    # the default check only warns and writes the model
    assert main(["optimize", str(src), str(out), "--policy", "fp16"]) == 0
    assert "warning: accuracy check skipped: the fp32 model" in capsys.readouterr().err


def test_cli_a_warning_the_probes_repeat_is_printed_once(planted_file, tmp_path, capsys):
    """Every probe of --fix's search re-optimizes, and calibrating on generated inputs warns each
    time: stderr shows the warning once, the log file keeps every record."""
    out, log = tmp_path / "out.onnx", tmp_path / "run.log"
    warning = "WARNING onnxcampo.api: calibrating on random inputs"
    try:
        assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--activation-limit", "1e9",
                     "--fix", "--log-file", str(log)]) == 0
        err = capsys.readouterr().err
        assert "bisect probe 2:" in err and err.count("onnxcampo: warning: calibrating on random inputs") == 1
        assert log.read_text().count(warning) > 2  # the log file keeps level, logger and time
    finally:
        logging.getLogger().handlers.clear()  # the file handler, closed with the test's folder


def test_cli_no_accuracy_check_runs_nothing(planted_file, tmp_path, capsys):
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--no-accuracy-check",
                 "--report", str(report)]) == 0
    assert "accuracy check" not in capsys.readouterr().err and "accuracy" not in json.loads(report.read_text())
    assert main(["optimize", str(planted_file), str(out), "--fix", "--no-accuracy-check"]) == 2
    assert "--fix acts on a failed accuracy check" in capsys.readouterr().err
    assert main(["optimize", str(planted_file), str(out), "--tolerance", "rel=1"]) == 2
    assert "unknown accuracy statistic 'rel'" in capsys.readouterr().err


@pytest.mark.corpus
def test_silero_vad_runs_on_generated_inputs_with_its_sample_rate():
    """silero VAD refuses a random sample rate (its If branches check sr): a generated ``sr`` is
    16000, so the fp32 model runs and its outputs are finite."""
    from onnxcampo.benchmarks import corpus

    entry = corpus.get("silero_vad")
    try:
        path = corpus.fetch(entry)
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")
    model = onnx.load(str(path))
    shapes = {name: tuple(dims) for name, dims in entry.input_shapes.items() if name != "sr"}
    ref = acc.reference(model, source=path, input_shapes=shapes)
    assert int(ref.feeds["sr"]) == 16000 and not ref.notes
    assert all(np.isfinite(value).all() for value in ref.outputs.values())


def test_the_default_check_runs_at_batch_one_where_the_batch_is_dynamic():
    """batch_one_dims: a symbolic leading dim of a graph input goes to 1, unless --input-shape
    pins that input; other dims keep their values."""
    from onnx import TensorProto, helper

    from onnxcampo.accuracy.check import batch_one_dims

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])])
    model = helper.make_model(graph)
    assert batch_one_dims(model, {}, {"batch": 32, "seq": 128}) == ({"batch": 1, "seq": 128}, ["batch"])
    assert batch_one_dims(model, {"x": (32, 128)}, {}) == ({}, [])
    assert batch_one_dims(model, {}, {"batch": 1, "seq": 128}) == ({"batch": 1, "seq": 128}, [])


def test_the_reference_runs_from_the_file_and_falls_back_to_the_proto(tmp_path):
    """reference(path=...): ONNX Runtime reads the file itself (no second serialization); where it
    cannot (here: no such file), the proto as read decides; the outputs are the same."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    from onnxcampo.accuracy.check import reference

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    from_file = reference(model, path=path)
    from_proto = reference(model, path=tmp_path / "missing.onnx")
    np.testing.assert_array_equal(from_file.outputs["y"], from_proto.outputs["y"])
    np.testing.assert_array_equal(from_file.outputs["y"], np.maximum(from_file.feeds["x"], 0))


# ---- the Python API: optimize(..., accuracy=...) ---------------------------------------------


def test_optimize_reports_accuracy_by_default_and_never_searches(monkeypatch, caplog):
    """accuracy="report", the default: checked once in memory, the verdict in the report, a
    failure a warning and a note, nothing re-optimized."""
    def no_search(*args, **kwargs):
        raise AssertionError("the default accuracy check searched the culprits")

    monkeypatch.setattr(acc, "find_culprits", no_search)
    with caplog.at_level(logging.INFO, logger="onnxcampo.accuracy"):
        result = optimize(planted(), policy="fp16")
    entry = result.report["accuracy"]
    assert entry["ok"] is False and entry["provider"] == "reference"  # small: the reference evaluator sees fp16
    assert entry["culprits"]["searched"] is False and entry["culprits"]["max_reoptimizations"] == 42
    assert any(note.startswith("accuracy check: the written model's outputs differ") for note in result.report["notes"])
    assert "validation" not in result.report
    assert any(r.levelno == logging.WARNING and "outputs differ beyond the tolerance" in r.getMessage()
               for r in caplog.records)
    passing = optimize(planted(culprit=99), policy="fp16")  # no overflow: fp16 is as good as fp32 here
    assert passing.report["accuracy"]["ok"] is True and "culprits" not in passing.report["accuracy"]


def test_optimize_accuracy_off_skips_the_check(monkeypatch):
    monkeypatch.setattr(acc, "reference", lambda *a, **k: pytest.fail("accuracy='off' ran the check"))
    result = optimize(planted(), policy="fp16", accuracy="off")
    assert "accuracy" not in result.report


def test_optimize_says_why_the_check_is_skipped():
    result = optimize(planted(), policy="fp32")
    assert result.report["accuracy"] == {"skipped": "nothing converted"}


def test_optimize_validate_raises_on_a_failing_model_and_names_the_culprits():
    from onnxcampo.errors import ValidationError
    from onnxcampo.accuracy.guard import AccuracyCheck

    with pytest.raises(ValidationError, match=r"outputs differ beyond the tolerance .*scale_up2"):
        optimize(planted(), policy="fp16", accuracy=AccuracyCheck("validate", provider="reference"))
    # ORT's CPU provider runs the fp16 Muls in fp32: validate there passes, with the validation rows
    result = optimize(planted(), policy="fp16", accuracy="validate")
    assert result.report["accuracy"]["ok"] is True and result.report["validation"][0]["ok"]
    with pytest.raises(ValidationError, match="outputs differ beyond the tolerance"):
        optimize(planted(culprit=99), policy="fp16", accuracy=AccuracyCheck("validate", tolerance="rel_l2=1e-9"))


def test_optimize_fix_returns_the_model_that_keeps_the_culprits_fp32():
    result = optimize(planted(), policy="fp16", accuracy="fix")
    entry = result.report["accuracy"]
    assert entry["ok"] is True and entry["fixed"] is True and entry["before"]["ok"] is False
    assert result.report["plan"]["scale_up2"]["precision"] == "fp32"
    # labelled as the fix's, not as the user's exclusion: plan, counts and the written node
    assert result.report["plan"]["scale_up2"]["reason"] == "accuracy_fix"
    assert not any("excluded by the user" in reason for reason in result.report["reasons"])
    node = next(n for n in result.model.graph.node if n.name == "scale_up2")
    assert "accuracy check's fix" in node.doc_string and "excluded by the user" not in node.doc_string


@pytest.mark.parametrize("accuracy", ["strict", "", None, True])
def test_optimize_rejects_an_unknown_accuracy_mode(accuracy):
    with pytest.raises(ValueError, match="expected one of 'report', 'validate', 'fix', 'off'"):
        optimize(planted(), accuracy=accuracy)


def test_the_size_that_skips_the_report_check_counts_external_data(tmp_path, monkeypatch):
    """A model whose weights are in an external file is as large as file and data together: the
    report-mode check's size rule sees the data too (a 4 GiB model's .onnx is a few kB)."""
    from onnxcampo.accuracy import guard
    from onnxcampo.examples.training_mlp import mlp as small_mlp

    path = tmp_path / "m.onnx"
    onnx.save_model(small_mlp(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.weights", size_threshold=0)
    data = (tmp_path / "m.weights").stat().st_size
    assert data > 0 and guard._model_bytes(path) == path.stat().st_size + data
    monkeypatch.setattr(guard, "GUARD_MAX_BYTES", path.stat().st_size + data // 2)
    assert guard._model_bytes(path) > guard.GUARD_MAX_BYTES  # past the limit only with its data


def test_cli_a_failed_validation_still_writes_the_report_that_reproduces_the_run(planted_file, tmp_path, capsys):
    """The model is not written, the report is: the failed check's figures, the culprits, the
    options and the command line that ran, the report's schema version."""
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    argv = ["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--provider", "reference",
            "--report", str(report)]
    assert main(argv) == 1 and not out.exists()
    written = json.loads(report.read_text())
    assert written["accuracy"]["ok"] is False and "scale_up2" in json.dumps(written["accuracy"]["culprits"])
    assert written["options"]["policy"] == "fp16" and written["schema_version"] >= 2
    assert written["command_line"].startswith("onnxcampo optimize ") and "--validate" in written["command_line"]


def test_the_api_report_names_its_options_and_no_command_line():
    report = optimize(planted(), policy="fp16", accuracy="off").report
    assert report["options"]["policy"] == "fp16" and "command_line" not in report


def test_a_failing_output_says_where_its_largest_error_is():
    """As Polygraphy does: the index of the largest absolute error and the two values there (the
    first non-finite value of the candidate when it has one), in the line and the JSON."""
    ref = np.zeros((2, 3), np.float32)
    got = ref.copy()
    got[1, 2], got[0, 1] = 0.5, 0.1
    verdict = evaluate({"y": ref + 1}, {"y": got + 1})
    line = verdict.outputs[0].line(verdict.criterion)
    assert "largest error at [1, 2]: 1 (reference) against 1.5" in line and line.endswith("FAIL (rel L2 > 0.01)")
    row = verdict.to_json()["outputs"][0]
    assert row["worst_at"] == [1, 2] and row["worst_reference"] == 1.0 and row["worst_candidate"] == 1.5
    got[0, 0] = np.inf
    assert evaluate({"y": ref + 1}, {"y": got + 1}).to_json()["outputs"][0]["worst_at"] == [0, 0]
    close = evaluate({"y": ref + 1}, {"y": ref + 1})
    assert "largest error" not in close.outputs[0].line(close.criterion)  # said where it fails only


def test_a_fix_on_given_inputs_does_not_warn_about_generated_ones():
    from onnxcampo.accuracy.guard import AccuracyCheck

    model = planted()
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": np.random.default_rng(5).standard_normal(shape).astype(np.float32)}
    result = optimize(model, policy="fp16", accuracy=AccuracyCheck("fix", inputs=feeds))
    assert result.report["accuracy"]["fixed"] is True
    assert not any("fitted to generated inputs" in note for note in result.report.get("notes", []))


# --- per-output criteria -------------------------------------------------------------------------
def test_an_output_judged_by_its_own_bounds():
    """``logits:rel_l2=0.05`` loosens logits alone; the other output keeps the global bound."""
    ref = {"logits": np.ones(100, np.float32), "boxes": np.ones(100, np.float32)}
    off = {"logits": np.full(100, 1.03, np.float32), "boxes": np.full(100, 1.03, np.float32)}
    assert not evaluate(ref, off, "rel_l2=0.01").ok
    verdict = evaluate(ref, off, "rel_l2=0.01,logits:rel_l2=0.05")
    assert [o.ok for o in verdict.outputs] == [True, False]
    assert "FAIL (rel L2 > 0.01)" in verdict.outputs[1].line(verdict.criterion)
    assert "ok (rel L2 <= 0.05)" in verdict.outputs[0].line(verdict.criterion)
    assert evaluate(ref, off, "0.01,logits:0.05,boxes:max_abs=0.05").ok


def test_per_output_text_round_trips_and_output_names_may_hold_colons():
    criterion = Criterion.parse("rel_l2=0.02,out:0:max_abs=1,ids:mismatch=0.5")
    assert set(criterion.outputs) == {"out:0", "ids"}
    assert criterion.of("out:0").bounds == {"max_abs": 1.0} and criterion.of("other") is criterion
    assert criterion.of("ids").mismatch == 0.5 and criterion.of("ids").bounds == {"rel_l2": 0.02}
    assert Criterion.parse(str(criterion)) == criterion
    assert criterion.describe() == "rel L2 <= 0.02; out:0: max abs <= 1; ids: rel L2 <= 0.02, share differing <= 0.5"


def test_a_per_output_bound_on_no_output_is_one_clear_error():
    with pytest.raises(ConfigError, match="'logit', which is no output of the model; its outputs: logits"):
        evaluate({"logits": np.ones(3, np.float32)}, {"logits": np.ones(3, np.float32)}, "logit:0.05")


# --- input sets: a folder of .npz, Polygraphy JSON -----------------------------------------------
def polygraphy_json(path, sets) -> None:
    """Feed sets as ``polygraphy run --save-inputs`` writes them (numpy.save bytes, base64)."""
    import base64
    import io

    def encoded(array):
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        return {"array": base64.b64encode(buffer.getvalue()).decode(), "polygraphy_class": "ndarray"}

    path.write_text(json.dumps([{name: encoded(value) for name, value in feeds.items()} for feeds in sets]))


def test_validate_runs_every_input_set_until_one_fails_and_judges_that_one(planted_file, tmp_path, capsys):
    """planted() overflows in fp16 on standard-normal inputs, not on tiny ones: a folder with a
    tiny .npz and a Polygraphy JSON of one tiny and one normal set fails on the normal one."""
    rng = np.random.default_rng(3)
    tiny = [{"x": (rng.standard_normal((8, 16)) * 1e-3).astype(np.float32)} for _ in range(2)]
    normal = {"x": rng.standard_normal((8, 16)).astype(np.float32)}
    folder = tmp_path / "inputs"
    folder.mkdir()
    np.savez(folder / "a.npz", **tiny[0])
    polygraphy_json(folder / "b.json", [tiny[1], normal])
    (folder / "notes.txt").write_text("not inputs")  # other files are left alone
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--provider", "reference",
                 "--inputs", str(folder), "--report", str(report)]) == 1
    err = capsys.readouterr().err
    assert "3 of 3 input sets checked, b.json set 1 fails: it is judged below" in err
    assert "the inputs of b.json set 1" in err and not out.exists()
    polygraphy_json(folder / "b.json", [tiny[1]])
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--provider", "reference",
                 "--inputs", str(folder), "--report", str(report)]) == 0
    assert "2 of 2 input sets checked, every one passes" in capsys.readouterr().err
    assert json.loads(report.read_text())["input_sets"] == {"count": 2, "checked": 2, "failed": []}


@pytest.mark.parametrize("content, message", [
    (None, "holds no .npz or Polygraphy .json file"),
    ("{not json", "is not readable JSON"),
    ('[{"x": [1, 2]}]', "x is not an array as Polygraphy writes one"),
    ('[{"y": {"array": "", "polygraphy_class": "ndarray"}}]', "cannot be read"),
])
def test_input_sets_that_cannot_be_read_are_one_line(planted_file, tmp_path, capsys, content, message):
    folder = tmp_path / "inputs"
    folder.mkdir()
    if content is not None:
        (folder / "sets.json").write_text(content)
    out = tmp_path / "out.onnx"
    assert main(["optimize", str(planted_file), str(out), "--policy", "fp16", "--validate", "--inputs",
                 str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0] and not out.exists()


def test_a_polygraphy_set_with_a_wrong_input_name_names_the_set(planted_file, tmp_path, capsys):
    sets = tmp_path / "sets.json"
    polygraphy_json(sets, [{"x": np.zeros((8, 16), np.float32)}, {"z": np.zeros((8, 16), np.float32)}])
    assert main(["optimize", str(planted_file), str(tmp_path / "o.onnx"), "--policy", "fp16", "--validate",
                 "--inputs", str(sets)]) == 2
    assert "(set 1): unknown input name(s) ['z']" in capsys.readouterr().err


def test_fix_is_fitted_on_the_failing_set_and_judged_on_every_set(planted_file, tmp_path, capsys):
    """--fix keeps fp32 what the first failing set needs, then runs every set: a set the fix does
    not cover (inputs 1e5 times larger: the first MatMul overflows fp16) is a warning under --fix
    and an error under --validate --fix (nothing written)."""
    rng = np.random.default_rng(4)
    normal = rng.standard_normal((8, 16)).astype(np.float32)
    folder = tmp_path / "inputs"
    folder.mkdir()
    np.savez(folder / "a.npz", x=normal * 1e-3)
    np.savez(folder / "b.npz", x=normal)
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    args = ["optimize", str(planted_file), str(out), "--policy", "fp16", "--provider", "reference",
            "--inputs", str(folder), "--report", str(report)]
    assert main([*args, "--fix"]) == 0
    assert "--fix: fitted on b.npz; every one of the 2 input sets passes" in capsys.readouterr().err
    assert json.loads(report.read_text())["input_sets"] == {"count": 2, "fitted_on": "b.npz", "failed": []}
    np.savez(folder / "c.npz", x=normal * 1e5)
    assert main([*args, "--fix"]) == 0
    err = capsys.readouterr().err
    assert "warning: --fix kept fp32 what b.npz needs, but 1 of the 3 input sets still fail: c.npz" in err
    out.unlink()
    assert main([*args, "--validate", "--fix"]) == 1
    assert "still fail: c.npz; nothing written" in capsys.readouterr().err and not out.exists()


def test_a_model_the_reference_evaluator_computes_wrongly_is_checked_on_ort(tmp_path, capsys):
    """LpNormalization p=1: the ONNX reference evaluator's is wrong (ORT's is exact), so the
    default check runs the written model on ORT's CPU provider and the fp16 model passes."""
    graph = h.make_graph([h.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                          h.make_node("LpNormalization", ["m"], ["y"], name="lp", axis=-1, p=1)], "g",
                         [h.make_tensor_value_info("x", T.FLOAT, [8, 16])], [h.make_tensor_value_info("y", T.FLOAT, [8, 16])],
                         [nh.from_array(np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32), "w")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    assert acc.small_enough_for_reference(model) == ("an LpNormalization with p=1, which the ONNX reference "
                                                     "evaluator computes wrongly")
    result = optimize(model, policy="fp16")
    assert result.report["accuracy"]["ok"] is True
