"""Seeing the plan: each node's own numbers, honest counts, doc_strings on the written nodes, and
``onnxcampo inspect`` (--nodes filters, --json, --html)."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from helpers import MM_ADD_RELU_MM, FakeCost, build_context, decide, parse, run_passes
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import estimate, optimize
from onnxcampo.cli import main, summary
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.allow_islands import AllowIslands
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear
from onnxcampo.report.plan_html import render
from onnxcampo.report.plan_view import filter_rows, node_rows, table
from onnxcampo.plan import Precision, PrecisionPlan, Reason
from onnxcampo.report import counts_headline

# policy fp16 with Exp excluded: the plan is known without a cost model; costed node by node
FIXED = ["--policy", "fp16", "--exclude-op", "Exp", "--experimental", "cost_graph=onnx", "--fuse", "none"]


def shape_and_constant_model() -> onnx.ModelProto:
    """x -> MatMul -> Add(a Constant node) -> Exp -> y, and Shape(Add) -> s: 3 float compute nodes
    (MatMul, Add, Exp), 1 shape arithmetic (Shape), 1 constant."""
    weight = numpy_helper.from_array(np.full((64, 64), 0.01, np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"], name="mm", doc_string="exported from torch"),
        helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(np.float32(0.5))),
        helper.make_node("Add", ["a", "c"], ["b"], name="add"),
        helper.make_node("Shape", ["b"], ["s"], name="shape"),
        helper.make_node("Exp", ["b"], ["y"], name="exp"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [32, 64]),
                               helper.make_tensor_value_info("s", TensorProto.INT64, [2])], [weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(shape_and_constant_model(), str(path))
    return path


def table_rows(out: str) -> list[list[str]]:
    """The nodes table's rows (after its header line, before the legend of reason codes and
    Cast shares: lines of one word and a colon first), split into columns."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("prec "))
    return [line.split() for line in lines[header + 1:] if not line.split()[0].endswith(":")]


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- each node's own numbers ------------------------------------------------------------------
def test_island_members_get_their_own_numbers_not_the_islands_sums():
    """Fake costs: 10 us fp32, 5 us fp16, 3 us a Cast. The island mm1-add-relu-mm2 was priced as a
    whole (its decisions keep the sums: 40 / 20 us, 6 us of Casts); per node each costs 10 / 5 us,
    the Cast of x to fp16 is mm1's (its fp16 reader), the Cast of y back to fp32 mm2's (its fp16
    producer), and the nodes' Casts add up to the plan's."""
    ctx = build_context(parse(MM_ADD_RELU_MM), cost=FakeCost(cast_us=3.0))
    run_passes(ctx, Classify(), AllowByCost(), DenyPropagation(), AllowIslands(), FillInferClear())
    assert ctx.plan.get("mm1").numbers == {"fp32_us": 40.0, "fp16_us": 20.0, "cast_us": 6.0, "gain_us": 14.0}
    costs = estimate.node_costs(ctx, ctx.plan)
    assert costs == {
        "mm1": {"fp32_us": 10.0, "fp16_us": 5.0, "casts": 1.0, "cast_us": 3.0},
        "add": {"fp32_us": 10.0, "fp16_us": 5.0, "casts": 0.0, "cast_us": 0.0},
        "relu": {"fp32_us": 10.0, "fp16_us": 5.0, "casts": 0.0, "cast_us": 0.0},
        "mm2": {"fp32_us": 10.0, "fp16_us": 5.0, "casts": 1.0, "cast_us": 3.0},
    }
    whole = estimate.plan_time(ctx, ctx.plan)
    assert sum(c["casts"] for c in costs.values()) == whole.casts
    assert sum(c["cast_us"] for c in costs.values()) == whole.casts_us


def test_a_cast_shared_by_fp16_readers_is_split_between_them():
    """x is read by two fp16 MatMuls through one Cast: half a Cast each; each output's Cast back
    to fp32 (graph outputs keep their dtype) is its producer's."""
    ctx = build_context(parse("""
    g (float[4,8] x) => (float[4,8] y1, float[4,8] y2) <float[8,8] w = {""" + ",".join(["0.125"] * 64) + """}> {
      [mm1] y1 = MatMul(x, w)
      [mm2] y2 = MatMul(x, w)
    }
    """), cost=FakeCost(cast_us=2.0))
    run_passes(ctx, Classify())
    decide(ctx, mm1="fp16", mm2="fp16")
    costs = estimate.node_costs(ctx, ctx.plan)
    assert costs["mm1"]["casts"] == costs["mm2"]["casts"] == 1.5
    assert costs["mm1"]["cast_us"] == 3.0


# --- honest counts ------------------------------------------------------------------------------
def test_counts_separate_float_compute_from_shape_arithmetic_and_constants():
    """fp16 with Exp excluded: 2 of the 3 float compute nodes fp16; the Shape and the Constant are
    counted apart (old keys kept), in the JSON and the headline."""
    result = optimize(shape_and_constant_model(), policy="fp16", exclude_ops=frozenset({"Exp"}),
                      fuse="none", experimental={"cost_graph": "onnx"})
    report = result.report
    assert report["node_counts"] == {"float_compute": 3, "float_compute_fp16": 2, "float_compute_fp32": 1,
                                     "shape_arithmetic": 1, "constants": 1, "views": 0}
    assert (report["nodes_fp16"], report["nodes_fp32"]) == (2, 3)
    assert "policy fp16: 2 of 3 float compute nodes fp16; 2 others (1 shape arithmetic, 1 constants) unchanged; " \
        in summary(report, None)


def test_views_are_not_counted_as_float_compute():
    """An Identity or Reshape computes nothing in either precision (ORT aliases its output): counted
    apart as a view, in the JSON and the headline."""
    from onnxcampo.report import node_counts

    plan = PrecisionPlan()
    plan.decide("mm", Precision.FP16, Reason.POLICY_FP16)
    plan.decide("view", Precision.FP16, Reason.POLICY_FP16)
    plan.decide("id", Precision.FP32, Reason.POLICY_FP32)
    counts = node_counts(plan, {"mm": "MatMul", "view": "Reshape", "id": "Identity"})
    assert (counts["float_compute"], counts["float_compute_fp16"], counts["views"]) == (1, 1, 2)
    assert counts_headline(counts) == ("1 of 1 float compute nodes fp16; 2 others (0 shape arithmetic, "
                                       "0 constants, 2 views) unchanged")


def test_headline_leaves_out_others_when_there_are_none():
    counts = {"float_compute": 10, "float_compute_fp16": 8, "float_compute_fp32": 2, "shape_arithmetic": 0,
              "constants": 0}
    assert counts_headline(counts) == "8 of 10 float compute nodes fp16"


def test_headline_of_an_old_report_keeps_the_old_words():
    old = {"policy": "campo", "nodes_fp16": 2, "nodes_fp32": 3, "casts_inserted": 0, "pads_inserted": 0,
           "initializers_converted": 0, "initializer_values_clamped": 0}
    assert summary(old, None).startswith("policy campo: 2 nodes fp16, 3 fp32; 0 Casts")


# --- doc_strings ----------------------------------------------------------------------------------
def test_every_written_node_says_what_onnxcampo_made_of_it():
    """Planned nodes: precision, reason and their own times; the exporter's text is kept, ours
    appended; inserted Casts say why they are there."""
    result = optimize(shape_and_constant_model(), policy="fp16", exclude_ops=frozenset({"Exp"}),
                      fuse="none", experimental={"cost_graph": "onnx"})
    docs = {n.name: n.doc_string for n in result.model.graph.node}
    assert all("onnxcampo: " in doc for doc in docs.values()), docs
    assert docs["mm"].startswith("exported from torch\nonnxcampo: fp16 (policy fp16); predicted fp32 ")
    assert docs["exp"].startswith("onnxcampo: fp32 (excluded by the user); predicted fp32 ")
    assert docs["shape"].startswith("onnxcampo: fp32 (no float32 tensors); predicted ")
    assert docs["x/cast_fp16"] == "onnxcampo: inserted: Cast to float16 of x (graph input); for fp16 mm"
    assert docs["b/cast_fp32"] == "onnxcampo: inserted: Cast to float32 of b (made by fp16 add); for fp32 exp"
    assert result.report["inserted_nodes"]["b/cast_fp32"]["op"] == "Cast"


# --- inspect -------------------------------------------------------------------------------------
def test_inspect_nodes_table_has_op_precision_own_numbers_and_filters(model_path, capsys):
    code, out, _ = run_cli(capsys, "inspect", model_path, *FIXED, "--nodes")
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("prec "))
    assert lines[header].split() == ["prec", "op", "fp32_us", "fp16_us", "casts", "cast_us", "name", "reason"]
    rows = [line.split() for line in lines[header + 1:header + 8]]
    assert [(r[0], r[1]) for r in rows[:5]] == [("fp16", "MatMul"), ("fp32", "Constant"), ("fp16", "Add"),
                                                  ("fp32", "Shape"), ("fp32", "Exp")]
    assert rows[0][6:] == ["mm", "policy_fp16"] and rows[4][6:] == ["exp", "user_excluded"]
    assert [r[1] for r in rows[5:]] == ["Cast", "Cast"] and all(r[0] == "inserted" for r in rows[5:])
    legend = lines[header + 8:]  # each reason code shown, in the summary's words
    assert any(line.startswith("user_excluded: ") for line in legend)
    assert any(line.startswith("policy_fp16: ") for line in legend)

    _, out, _ = run_cli(capsys, "inspect", model_path, *FIXED, "--op", "Add", "--op", "Exp")
    assert [r[1] for r in table_rows(out)] == ["Add", "Exp"]
    _, out, _ = run_cli(capsys, "inspect", model_path, *FIXED, "--precision", "fp32", "--name", "^(sh|ex)")
    assert [r[6] for r in table_rows(out)] == ["shape", "exp"]


def test_inspect_json_is_the_report_with_the_rows(model_path, capsys):
    code, out, _ = run_cli(capsys, "inspect", model_path, *FIXED, "--json", "--precision", "fp16")
    assert code == 0
    data = json.loads(out)
    assert data["node_counts"]["float_compute_fp16"] == 2 and "plan" in data and "predicted_us" in data
    assert [(n["name"], n["op"], n["precision"], n["kind"]) for n in data["nodes"]] == [
        ("mm", "MatMul", "fp16", "fp16"), ("add", "Add", "fp16", "fp16")]
    assert data["nodes"][0]["reason_text"] == "policy fp16" and data["nodes"][0]["fp32_us"] > 0


def test_inspect_bad_name_regex_is_one_line(model_path, capsys):
    code, _, err = run_cli(capsys, "inspect", model_path, *FIXED, "--name", "(")
    assert code == 2 and err.startswith("onnxcampo: error: --name '(' is no regular expression") and len(
        err.strip().splitlines()) == 1


def test_inspect_html_is_one_self_contained_page_naming_every_node(model_path, tmp_path, capsys):
    page = tmp_path / "plan.html"
    code, _, err = run_cli(capsys, "inspect", model_path, *FIXED, "--html", page)
    assert code == 0 and f"wrote {page}" in err
    text = page.read_text()
    for name in ("mm", "const", "add", "shape", "exp", "x/cast_fp16", "b/cast_fp32"):
        assert f"<title>{name}</title>" in text and f"<td>{name}</td>" in text
    assert not re.search(r"https?://|<link|\ssrc=|@import", text)
    assert "2 of 3 float compute nodes fp16; 2 others (1 shape arithmetic, 1 constants) unchanged" in text
    assert 'fill="#1f77b4"' in text and 'fill="#ff7f0e"' in text and 'fill="#d62728"' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "plan.html"]  # no temporary file left


def test_inspecting_a_model_onnxcampo_wrote_reads_its_plan_from_the_doc_strings(model_path, tmp_path, capsys):
    """The output of optimize, inspected again (nothing to plan: already optimized), is drawn as
    written: each node's precision, reason and own times from its doc_string, the inserted Casts as
    Casts; not every node "added by onnxcampo"."""
    out, page = tmp_path / "out.onnx", tmp_path / "again.html"
    assert run_cli(capsys, "optimize", model_path, out, *FIXED, "--no-accuracy-check")[0] == 0
    code, _, err = run_cli(capsys, "inspect", out, *FIXED, "--html", page)
    assert code == 0, err
    text = page.read_text()
    assert "as written (the nodes' doc_strings): 2 fp16 and 1 fp32 float compute nodes, 2 Casts" in text
    assert "plan kept: <b>none (nothing planned)</b>" in text
    for name, op, kind in (("mm", "MatMul", "fp16"), ("add", "Add", "fp16"), ("exp", "Exp", "fp32"),
                           ("x/cast_fp16", "Cast", "cast")):
        assert re.search(rf'<tr data-i="\d+" class="k-{kind}"><td>{re.escape(name)}</td><td>{op}</td>', text), name
    assert re.search(r'class="k-fp16"><td>mm</td><td>MatMul</td><td>fp16</td><td>[\d.]+</td><td>[\d.]+</td>', text)


def test_page_lays_a_diamond_out_in_layers_and_escapes_names():
    """x -> a -> (b, c) -> d: depths 0, 1, 1, 2, the chain straight down column 0; a name with
    markup is escaped in the page and in the embedded data."""
    result = optimize(parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [a] t = Relu(x)
      [b] u = Sigmoid(t)
      ["c<script>"] v = Tanh(t)
      [d] y = Add(u, v)
    }
    """), policy="fp32", fuse="none", experimental={"cost_graph": "onnx"})
    from onnxcampo.report.plan_html import columns, layout

    depth, layers = layout(list(result.model.graph.node))
    assert depth == [0, 1, 1, 2] and layers == {0: [0], 1: [1, 2], 2: [3]}
    assert columns(list(result.model.graph.node)) == {0: (0, 0), 1: (0, 1), 2: (1, 1), 3: (0, 2)}  # (column, layer)
    text = render(result.model, result.report)
    assert "<script>\"" not in text and "c&lt;script&gt;" in text and "c\\u003cscript\\u003e" in text


def test_rows_and_table_from_a_report():
    report = {"plan": {"a": {"precision": "fp16", "reason": "allow_pays", "numbers": {"gain_us": 1.0}}},
              "plan_nodes": {"a": {"op": "MatMul", "fp32_us": 2.0, "fp16_us": 1.0, "casts": 0.5, "cast_us": 0.25}},
              "inserted_nodes": {"x/cast_fp16": {"op": "Cast", "why": "Cast to float16 of x (graph input)"}}}
    rows = node_rows(report)
    assert [(r.name, r.kind) for r in rows] == [("a", "fp16"), ("x/cast_fp16", "cast")]
    assert rows[0].priced == {"gain_us": 1.0}
    assert filter_rows(rows, precision="inserted") == rows[1:]
    assert table(rows).splitlines()[1].split() == ["fp16", "MatMul", "2.00", "1.00", "0.5", "0.25", "a", "allow_pays"]
    assert table(rows).splitlines()[-1].startswith("casts: the Casts a node causes; one that several fp16 nodes read")
    whole = {**report, "plan_nodes": {"a": {**report["plan_nodes"]["a"], "casts": 1.0}}}
    assert not table(node_rows(whole)).splitlines()[-1].startswith("casts:")  # said only where a share shows


@pytest.mark.slow
def test_a_training_steps_loss_scaling_nodes_say_where_they_come_from():
    """amp on a training step: the planned nodes, the Casts and the loss scaling added after
    planning all carry an onnxcampo doc_string."""
    from onnxcampo.training import build_train_step

    step = build_train_step(parse("""
    g (float[32,64] x) => (float[32,64] y) <float[64,64] w = {""" + ",".join(["0.01"] * 4096) + """}> {
      [mm] h = MatMul(x, w)
      [relu] y = Relu(h)
    }
    """), loss="mse", optimizer="sgd", lr=0.1)
    result = optimize(step, policy="amp", experimental={"check_invariants": True})
    assert result.report["loss_scaling"]
    docs = [n.doc_string for n in result.model.graph.node]
    assert all("onnxcampo: " in doc for doc in docs)
    assert any(doc == "onnxcampo: added after planning (dynamic loss scaling)" for doc in docs)
    assert any(doc.startswith("onnxcampo: fp32 (training step: loss") for doc in docs)


def test_a_zero_time_is_explained_by_what_ort_makes_of_the_node():
    """The nodes table says why an fp16 Add costs 0.00 (ORT fuses it into the MatMul before it)
    and that the MatMul carries the fused kernel's work."""
    report = {"plan": {"mm": {"precision": "fp16", "reason": "policy_fp16"},
                       "bias": {"precision": "fp16", "reason": "policy_fp16"},
                       "gelu": {"precision": "fp16", "reason": "policy_fp16"}},
              "plan_nodes": {"mm": {"op": "MatMul", "fp32_us": 73.2, "fp16_us": 91.8, "ort": "absorbed"},
                             "bias": {"op": "Add", "fp32_us": 40.8, "fp16_us": 0.0, "ort": "carried"},
                             "gelu": {"op": "Gelu", "fp32_us": 40.8, "fp16_us": 22.9}}}
    lines = table(node_rows(report)).splitlines()[1:]
    assert lines[0].endswith("(ORT fuses its neighbours into it: the fused kernel's work is priced here)")
    assert lines[1].endswith("(ORT fuses it into a neighbour: no kernel of its own)")
    assert lines[2].endswith("policy_fp16")


def test_the_compute_graph_draws_an_edge_through_the_nodes_it_leaves_out():
    """columns(kept=...) lays out only the kept nodes; a kept node reading a left-out one sits
    below the kept nodes that one reads (MatMul -> Reshape -> Exp: Exp one layer below MatMul)."""
    from onnxcampo.report.plan_html import _producers_of, columns

    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Reshape", ["a", "shape"], ["r"], name="reshape"),
             helper.make_node("Exp", ["r"], ["y"], name="exp")]
    assert _producers_of(nodes, {0, 2}) == [[], [], [0]]
    laid = columns(nodes, {0, 2})
    assert set(laid) == {0, 2} and laid[2][1] == laid[0][1] + 1
    assert columns(nodes)[2][1] == 2  # all three drawn: three layers
