"""``--fuse``: ONNX Runtime's transformers optimizer before planning (``onnxcampo.rewrites.transformer``).

Most graphs are built in code: a BERT-like encoder layer (embedding Add, decomposed LayerNorm,
Q/K/V projections split into heads, scaled and masked Softmax attention, output projection,
residual Adds, erf-Gelu FFN) with hidden size 64, 4 heads, sequence 8. The exports in
``tests/fixtures/transformers/`` are tiny transformers models as torch.onnx writes them (both
exporters, SDPA and eager attention; ``scripts/make_transformer_fixtures.py``), so that
detection is tested on real exports without torch.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo.rewrites import transformer
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import UnsupportedModelError, command_line
from onnxcampo.runtime import make_session, run

from cases.transformer import BATCH, FFN, HIDDEN, SEQ, bert_layer


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
         helper.make_node("Relu", ["h"], ["a"], name="relu"),
         helper.make_node("MatMul", ["a", "w2"], ["y"], name="mm2")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
        [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), name) for name in ("w1", "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def feeds(batch=BATCH, seq=SEQ, hidden=HIDDEN) -> dict[str, np.ndarray]:
    """Random embeddings; the second row is left-padded (a mask index would get it wrong)."""
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[1, : seq // 2] = 0
    embeddings = np.random.default_rng(1).standard_normal((batch, seq, hidden)).astype(np.float32)
    return {"embeddings": embeddings, "attention_mask": mask}


def ops_of(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(n.domain, n.op_type) for n in model.graph.node}


# --- detection --------------------------------------------------------------------------------
def test_a_bert_layer_is_detected_with_its_heads_and_hidden_size():
    """Layer norm pattern + attention Softmax + erf Gelu, no causal mask -> bert; hidden size
    from the layer norms' scale, heads from the Reshape to [B, S, heads, head size]."""
    for hidden, heads in ((64, 4), (96, 6)):
        detection = transformer.detect(bert_layer(hidden=hidden, heads=heads))
        assert (detection.model_type, detection.num_heads, detection.hidden_size) == ("bert", heads, hidden)
    assert detection.reason == "layer norms, attention Softmax, Gelu and no causal mask"


@pytest.mark.parametrize("variant, model_type", [
    ({"norm": "op"}, "bert"), ({"norm": "reciprocal"}, "bert"), ({"nan_guard": True}, "bert"),
    ({"activation": "tanh"}, "gpt2")], ids=["LayerNormalization", "Reciprocal-norm", "SDPA-NaN-guard", "tanh-Gelu"])
def test_other_spellings_of_the_layer_are_recognised_too(variant, model_type):
    """Rule 3: the LayerNormalization op and the norm's Mul-by-Reciprocal form count as layer
    norms; SDPA's Where(IsNaN(p), 0, p) between the Softmax and probs.V still makes attention;
    the tanh GELU alone (GPT-2's; BERT's is the erf form) makes a layer without a causal mask
    GPT-2-like (case e)."""
    detection = transformer.detect(bert_layer(**variant))
    assert (detection.model_type, detection.num_heads, detection.hidden_size) == (model_type, 4, 64)
    assert ("tanh GELU" in detection.reason) == (model_type == "gpt2")


def test_a_causal_mask_makes_it_gpt2_like():
    """The same layer with a lower-triangular mask constant on the scores is a decoder; ORT's
    gpt2 fusions keep what it computes (the masked attention is not fused into an unmasked one)."""
    model = bert_layer(causal=True)
    assert transformer.detect(model).model_type == "gpt2"
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert report["model_type"] == "gpt2" and report["ops"]["SkipLayerNormalization"] == 2
    np.testing.assert_allclose(run(make_session(fused), feeds())["hidden_states"],
                               run(make_session(model), feeds())["hidden_states"], rtol=1e-4, atol=1e-4)


def test_a_graph_without_attention_is_left_untouched_silently(caplog):
    """Case a: no Softmax between MatMuls: the reason in the report, an info line, no warning."""
    model = mlp()
    with caplog.at_level(logging.INFO, logger="onnxcampo.rewrites.transformer"):
        fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report == {"mode": "auto", "model_type": None,
                      "reason": "not a transformer: no attention Softmax between MatMuls of activations"}
    assert [r.levelname for r in caplog.records] == ["INFO"]


@pytest.mark.parametrize("variant, missing", [
    ({"norm": "none"}, "attention, but no layer norm (LayerNormalization or its pattern)"),
    ({"activation": "relu"}, "attention and layer norms, but no Gelu (the op, its erf or tanh form)")],
    ids=["no-layer-norm", "no-Gelu"])
def test_a_graph_with_attention_it_declines_gets_one_warning_saying_how_to_force_it(variant, missing, caplog):
    """Cases b and c: a graph with attention that is not fused says why on one line, and names
    the options that force the fusion (as flags on the command line, as keywords from Python)."""
    model = bert_layer(**variant)
    detection = transformer.detect(model)
    assert detection.model_type is None and detection.attention and detection.reason.endswith(missing)
    with caplog.at_level(logging.INFO, logger="onnxcampo.rewrites.transformer"):
        fused, report = transformer.fuse_transformer(model, OptimizeConfig())
        with command_line():
            transformer.fuse_transformer(model, OptimizeConfig())
    assert fused is model and report["reason"] == detection.reason
    api, cli = [r.getMessage() for r in caplog.records]
    assert api == f"fuse: not fused: {detection.reason}; fuse='bert' or fuse='gpt2' fuses it as that model type"
    assert cli == f"fuse: not fused: {detection.reason}; --fuse bert or --fuse gpt2 fuses it as that model type"
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"] and "\n" not in cli


def test_training_steps_and_fused_graphs_are_never_fused():
    """Whatever the mode: a train-graph step, and a graph that already has ORT's fused ops."""
    step = bert_layer()
    step.metadata_props.add(key="onnxcampo.train_step", value="1")
    fused, report = transformer.fuse_transformer(step, OptimizeConfig(fuse="bert"))
    assert fused is step and report["reason"].startswith("a training-step graph")
    already, _ = transformer.fuse_transformer(bert_layer(), OptimizeConfig())
    again, report = transformer.fuse_transformer(already, OptimizeConfig(fuse="bert"))
    assert again is already and report["reason"].startswith("already fused (1 Attention, 1 BiasGelu")


@pytest.mark.slow
def test_the_command_line_prints_the_decline_once_on_stderr(tmp_path, capsys):
    """``onnxcampo optimize`` on a layer with attention but no GELU: one stderr line, with flags."""
    from onnxcampo.cli import main

    onnx.save(bert_layer(activation="relu"), tmp_path / "m.onnx")
    assert main(["optimize", str(tmp_path / "m.onnx"), str(tmp_path / "o.onnx")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "fuse: not fused" in line]
    assert lines == ["onnxcampo: warning: fuse: not fused: not BERT- or GPT-2-like: attention and layer norms, "
                     "but no Gelu (the op, its erf or tanh form); --fuse bert or --fuse gpt2 fuses it as that "
                     "model type"]


# --- fusing -----------------------------------------------------------------------------------
def test_auto_fuses_a_bert_layer_into_ort_ops_and_keeps_the_model_valid():
    """SkipLayerNormalization and the Gelu family appear; IR version and opsets are the input's,
    com.microsoft is declared, the graph passes the checker; the input is not modified."""
    model = bert_layer()
    before = model.SerializeToString()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert model.SerializeToString() == before
    assert report["model_type"] == "bert" and (report["num_heads"], report["hidden_size"]) == (4, 64)
    assert report["ops"]["SkipLayerNormalization"] == 2
    assert report["ops"]["BiasGelu"] == 1
    assert set(report["ops"]) == {"Attention", "BiasGelu", "LayerNormalization", "SkipLayerNormalization"}
    assert ("com.microsoft", "SkipLayerNormalization") in ops_of(fused)
    assert ("", "Erf") not in ops_of(fused)
    assert fused.ir_version == 10
    assert {(o.domain, o.version) for o in fused.opset_import} == {("", 17), ("com.microsoft", 1)}
    onnx.checker.check_model(fused)
    assert len({n.name for n in fused.graph.node}) == len(fused.graph.node)


def test_fused_layer_computes_what_the_unfused_one_does():
    """Wiring check on ORT CPU, in fp32: the fused kernels get the right inputs (the raw mask
    keeps a left-padded row right); it says nothing about fp16 numerics."""
    model = bert_layer()
    fused, _ = transformer.fuse_transformer(model, OptimizeConfig())
    expected = run(make_session(model), feeds())["hidden_states"]
    got = run(make_session(fused), feeds())["hidden_states"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_forced_mode_takes_the_given_sizes():
    _, report = transformer.fuse_transformer(bert_layer(), OptimizeConfig(fuse="bert", num_heads=4, hidden_size=64))
    assert (report["mode"], report["model_type"], report["num_heads"], report["hidden_size"]) == ("bert", "bert", 4, 64)


def test_sizes_that_do_not_go_together_are_left_to_ort_to_detect():
    """ORT's optimizer asserts heads and hidden size both given (heads dividing the size) or
    neither: heads that do not divide the hidden size (or a hidden size without heads, where no
    head split is read) go as neither, and the graph is still fused."""
    _, report = transformer.fuse_transformer(bert_layer(), OptimizeConfig(fuse="bert", num_heads=3, hidden_size=64))
    assert (report["num_heads"], report["hidden_size"]) == (0, 0) and report["ops"]


def test_fused_ops_get_shapes_for_planning_only():
    """ONNX inference stops at com.microsoft ops: the fused outputs get marked value infos,
    which clean_export drops."""
    fused, _ = transformer.fuse_transformer(bert_layer(), OptimizeConfig())
    planning = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in fused.graph.value_info if vi.doc_string == transformer.PLANNING_SHAPE}
    assert planning["attn/merge"] == [BATCH, SEQ, HIDDEN]  # the Attention op's output
    assert planning["gelu/out"] == [BATCH, SEQ, FFN]
    transformer.clean_export(fused)
    assert not [vi for vi in fused.graph.value_info if vi.doc_string == transformer.PLANNING_SHAPE]


def test_an_unsorted_graph_is_sorted():
    model = bert_layer()
    reversed_nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(reversed_nodes)
    assert transformer.toposort_model(model) is True
    onnx.checker.check_model(model)  # the checker rejects unsorted graphs
    assert transformer.toposort_model(model) is False


def test_an_optimizer_failure_leaves_auto_unfused_and_fails_a_forced_mode(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("pattern matcher fell over")

    monkeypatch.setattr(transformer, "_run_optimizer", broken)
    model = bert_layer()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report["reason"] == "ONNX Runtime's transformers optimizer failed (RuntimeError: pattern matcher fell over)"
    with pytest.raises(UnsupportedModelError, match="fuse='bert': .*fuse='none'"):
        transformer.fuse_transformer(model, OptimizeConfig(fuse="bert"))


def test_an_optimizer_that_changes_the_graph_inputs_is_not_kept(monkeypatch):
    real = transformer._run_optimizer

    def renaming(*args, **kwargs):
        fused = real(*args, **kwargs)
        fused.graph.input[1].type.tensor_type.elem_type = TensorProto.INT32
        return fused

    monkeypatch.setattr(transformer, "_run_optimizer", renaming)
    model = bert_layer()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report["reason"] == "ONNX Runtime's transformers optimizer changed graph input 'attention_mask'"


# --- in place, and ORT's shape inference on weightless copies ------------------------------------
def in_place_layers():
    return {"bert": bert_layer(), "gpt2": bert_layer(causal=True), "layer-norm-op": bert_layer(norm="op")}


@pytest.mark.parametrize("name", sorted(in_place_layers()))
def test_fusing_in_place_and_on_weightless_shape_copies_gives_what_ort_alone_gives(name, monkeypatch):
    """The pipeline's mode: ORT's optimizer fuses the model itself (``in_place``: the fused model
    returned is the model), its symbolic shape inference running on copies without the weights'
    data (values read from the model itself): byte for byte the graph that fusing a copy with
    ORT's own shape inference gives (Attention's fusion reads and concatenates the Q, K, V weights)."""
    skeletons = []
    real_skeleton = transformer.ir.skeleton
    monkeypatch.setattr(transformer.ir, "skeleton",
                        lambda *args, **kwargs: skeletons.append(1) or real_skeleton(*args, **kwargs))
    model = in_place_layers()[name]
    fused, report = transformer.fuse_transformer(model, OptimizeConfig(), in_place=True)
    assert fused is model and report["ops"] and len(skeletons) > 1  # planning shapes' one, and ORT's runs
    monkeypatch.setattr(transformer, "_shape_inference_on_weightless_copies", contextlib.nullcontext)
    plain, plain_report = transformer.fuse_transformer(in_place_layers()[name], OptimizeConfig())
    assert report["ops"] == plain_report["ops"]
    assert fused.SerializeToString() == plain.SerializeToString()


def test_a_failure_midway_in_place_puts_the_model_back_as_it_was(monkeypatch):
    """``in_place``: ORT's optimizer fails after its layer norm, attention and Gelu fusions have
    changed the graph and dropped the Q, K, V weights: the model is put back byte for byte and
    planned unfused."""
    import onnxruntime.transformers.optimizer  # noqa: F401 - puts ORT's modules under their top-level names
    from onnx_model_bert import BertOnnxModel  # the class ORT's optimizer uses

    seen = {}

    def broken(self, *args, **kwargs):
        seen["initializers"] = {t.name for t in self.model.graph.initializer}
        seen["ops"] = {n.op_type for n in self.model.graph.node}
        raise RuntimeError("bias fusion fell over")

    monkeypatch.setattr(BertOnnxModel, "fuse_add_bias_skip_layer_norm", broken)
    model = bert_layer()
    before = model.SerializeToString()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig(), in_place=True)
    assert "q/w" not in seen["initializers"] and {"Attention", "SkipLayerNormalization"} <= seen["ops"]
    assert fused is model and model.SerializeToString() == before
    assert report["reason"] == "ONNX Runtime's transformers optimizer failed (RuntimeError: bias fusion fell over)"


def test_an_in_place_fusion_that_is_not_kept_puts_the_model_back(monkeypatch):
    """``in_place``: a fusion that changed the graph's inputs, or that ONNX refuses (opset 14's
    LayerNormalization), is not kept, and the model is as it was."""
    real = transformer._run_optimizer

    def retyping(*args, **kwargs):
        fused = real(*args, **kwargs)
        fused.graph.input[1].type.tensor_type.elem_type = TensorProto.INT32
        return fused

    model = bert_layer()
    before = model.SerializeToString()
    with monkeypatch.context() as patch:
        patch.setattr(transformer, "_run_optimizer", retyping)
        fused, report = transformer.fuse_transformer(model, OptimizeConfig(), in_place=True)
    assert fused is model and model.SerializeToString() == before and "changed graph input" in report["reason"]
    for entry in model.opset_import:
        entry.version = 14 if entry.domain in ("", "ai.onnx") else entry.version
    before = model.SerializeToString()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig(), in_place=True)
    assert fused is model and model.SerializeToString() == before and "invalid ONNX graph" in report["reason"]


# --- end to end -------------------------------------------------------------------------------
def test_fuse_none_plans_the_graph_as_it_is():
    result = onnxcampo.optimize(bert_layer(), fuse="none")
    assert result.report["fuse"] == {"mode": "none", "model_type": None, "reason": "--fuse none"}
    assert not {domain for domain, _ in ops_of(result.model)} - {""}


@pytest.mark.slow
def test_optimize_plans_the_fused_graph_and_writes_a_model_ort_loads(tmp_path):
    """optimize() end to end on a layer big enough for fp16 to pay: campo plans the fused ops
    with their sizes (none is 'unknown shape'), and the written model loads and computes the
    layer on ORT CPU (wiring check; CPU runs fp16 nodes through casts)."""
    shape = {"batch": 8, "seq": 128, "hidden": 256, "heads": 4, "ffn": 1024}
    model = bert_layer(**shape)
    result = onnxcampo.optimize(model, experimental={"check_invariants": True})
    report = result.report
    assert report["fuse"]["model_type"] == "bert" and report["fuse"]["ops"]["SkipLayerNormalization"] == 2
    plan = report["plan"]
    fused_nodes = [n.name for n in result.model.graph.node if n.domain == "com.microsoft"]
    assert fused_nodes and all(plan[name]["reason"] != "unknown_shape" for name in fused_nodes)
    assert report["nodes_fp16"] > 0
    assert not [vi for vi in result.model.graph.value_info if vi.doc_string == transformer.PLANNING_SHAPE]
    out = tmp_path / "bert.campo.onnx"
    result.save(out)
    inputs = feeds(shape["batch"], shape["seq"], shape["hidden"])
    expected = run(make_session(model), inputs)["hidden_states"]
    got = run(make_session(out), inputs)["hidden_states"]
    np.testing.assert_allclose(got, expected, rtol=0.05, atol=0.05)


@pytest.mark.slow
def test_tune_fuses_once_and_every_candidate_plans_the_fused_graph(monkeypatch):
    """--tune runs ORT's optimizer once (not once per candidate) and reports its fusion."""
    calls = []
    original = transformer._run_optimizer
    monkeypatch.setattr(transformer, "_run_optimizer", lambda *args: calls.append(args) or original(*args))
    result = onnxcampo.optimize(bert_layer(), tune="cpu")
    assert len(calls) == 1 and result.report["fuse"]["ops"]
    assert set(result.report["tuning"]["candidates"]) >= {"fp32", "amp", "campo", "fp16"}


def test_a_fused_graph_onnx_refuses_is_not_kept():
    """At opset 14 ORT's optimizer writes LayerNormalization in the default domain (ONNX's from
    opset 17): auto leaves the graph unfused with the reason; a forced mode says so."""
    model = bert_layer()
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = 14
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert report["model_type"] is None and "invalid ONNX graph" in report["reason"] and fused is model
    with pytest.raises(UnsupportedModelError, match="invalid ONNX graph"):
        transformer.fuse_transformer(model, OptimizeConfig(fuse="bert"))


# --- exports of transformers models (tests/fixtures/transformers) -----------------------------
FIXTURES = Path(__file__).parents[1] / "fixtures" / "transformers"
# model: (model type, heads, hidden size, layers), as scripts/make_transformer_fixtures.py builds it
MODELS = {"bert": ("bert", 4, 32, 2), "roberta": ("bert", 2, 32, 2), "minilm": ("bert", 3, 24, 3),
          "gpt2": ("gpt2", 4, 32, 2), "gpt2_lm": ("gpt2", 4, 32, 2)}
EXPORTS = [f"{model}_{attention}_{exporter}"
           for model, attentions in (("bert", ("sdpa", "eager")), ("roberta", ("sdpa",)), ("minilm", ("sdpa",)),
                                     ("gpt2", ("sdpa", "eager")), ("gpt2_lm", ("sdpa",)))
           for attention in attentions for exporter in ("dynamo", "torchscript")]


def model_of(export: str) -> tuple[str, int, int, int]:
    return MODELS[export.rsplit("_", 2)[0]]


def export_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Token ids, a mask whose second row is right-padded (as tokenizers pad), segment 0."""
    ids = np.random.default_rng(0).integers(3, 100, (2, 16))
    mask = np.ones((2, 16), dtype=np.int64)
    mask[1, 8:] = 0
    given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    return {vi.name: given[vi.name] for vi in model.graph.input}


def test_the_fixtures_are_the_exports_listed():
    assert sorted(path.stem for path in FIXTURES.glob("*.onnx")) == sorted(EXPORTS)


@pytest.mark.parametrize("export", EXPORTS)
def test_exports_of_transformers_models_are_detected_with_their_type_and_sizes(export):
    """Rule 3 on what torch.onnx writes for transformers' models: attention through SDPA's NaN
    guard, LayerNormalization, the erf or tanh GELU, GPT-2's causal mask as a comparison of
    Range-derived positions; heads from the head split ``[B, S, -1, head size]`` (rule 5)."""
    model_type, heads, hidden, _ = model_of(export)
    detection = transformer.detect(onnx.load(FIXTURES / f"{export}.onnx"))
    assert (detection.model_type, detection.num_heads, detection.hidden_size) == (model_type, heads, hidden)
    mask = "a causal mask" if model_type == "gpt2" else "no causal mask"
    assert detection.reason == f"layer norms, attention Softmax, Gelu and {mask}"


@pytest.mark.slow
@pytest.mark.parametrize("export", EXPORTS)
def test_exports_are_fused_into_what_ort_makes_of_them_and_compute_the_same(export):
    """What ORT's transformers optimizer (ONNX Runtime 1.32, opt_level 0) makes of these exports:
    every layer norm but the embeddings' becomes a SkipLayerNormalization (two a layer), each
    FFN's bias and GELU a BiasGelu (erf) or FastGelu (tanh). Its attention fusion matches only
    BERT's eager attention as the TorchScript exporter writes it (Attention, the embeddings then
    an EmbedLayerNormalization); every other attention (SDPA's, the dynamo exporter's, GPT-2's)
    becomes one MultiHeadAttention (``onnxcampo.rewrites.attention``). Wiring check on ORT CPU
    in fp32, with a right-padded row, the projections' weights tripled so that the attention is
    sharp (the fused nodes' scale, mask or head split wrong would show)."""
    model_type, heads, hidden, layers = model_of(export)
    model = sharpened(onnx.load(FIXTURES / f"{export}.onnx"))
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    expected = {"SkipLayerNormalization": 2 * layers, "FastGelu" if model_type == "gpt2" else "BiasGelu": layers}
    if export == "bert_eager_torchscript":
        expected |= {"Attention": layers, "EmbedLayerNormalization": 1}
    else:
        expected |= {"MultiHeadAttention": layers}
    assert (report["model_type"], report["num_heads"], report["hidden_size"]) == (model_type, heads, hidden)
    assert report["ops"] == dict(sorted(expected.items()))
    inputs, output = export_feeds(model), model.graph.output[0].name
    np.testing.assert_allclose(run(make_session(fused), inputs)[output], run(make_session(model), inputs)[output],
                               rtol=1e-4, atol=1e-5)


def sharpened(model: onnx.ModelProto) -> onnx.ModelProto:
    """The weights that MatMuls read (the projections) tripled: sharper attention."""
    weights = {n.input[1] for n in model.graph.node if n.op_type in ("MatMul", "Gemm")}
    for tensor in model.graph.initializer:
        if tensor.name in weights:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * 3, tensor.name))
    return model


def test_the_attention_fusion_is_what_the_unfused_graph_computes_not_something_near():
    """The check above can fail: a fused attention with its scale 1.5x off misses it by far."""
    model = sharpened(onnx.load(FIXTURES / "bert_sdpa_dynamo.onnx"))
    fused, _ = transformer.fuse_transformer(model, OptimizeConfig())
    for node in fused.graph.node:
        if node.op_type == "MultiHeadAttention":
            next(a for a in node.attribute if a.name == "scale").f *= 1.5
    inputs, output = export_feeds(model), model.graph.output[0].name
    error = np.abs(run(make_session(fused), inputs)[output] - run(make_session(model), inputs)[output]).max()
    assert error > 1e-2


def test_attention_fusion_off_leaves_the_attention_as_exported():
    model = onnx.load(FIXTURES / "bert_sdpa_torchscript.onnx")
    fused, report = transformer.fuse_transformer(model, OptimizeConfig(experimental={"attention_fusion": False}))
    assert "MultiHeadAttention" not in report["ops"]
    assert any(n.op_type == "Softmax" for n in fused.graph.node)


@pytest.mark.slow
@pytest.mark.parametrize("export", EXPORTS)
def test_exports_fuse_alike_on_weightless_shape_copies(export, monkeypatch):
    """The same equality on the transformers exports (two exporters, SDPA and eager attention,
    BERT's Attention and EmbedLayerNormalization fusions)."""
    fused, _ = transformer.fuse_transformer(onnx.load(FIXTURES / f"{export}.onnx"), OptimizeConfig(), in_place=True)
    monkeypatch.setattr(transformer, "_shape_inference_on_weightless_copies", contextlib.nullcontext)
    plain, _ = transformer.fuse_transformer(onnx.load(FIXTURES / f"{export}.onnx"), OptimizeConfig())
    assert fused.SerializeToString() == plain.SerializeToString()


@pytest.mark.slow
def test_exports_made_now_are_detected_too(tmp_path, monkeypatch):
    """The generator run with the torch and transformers installed here (skipped without them):
    what they export now is recognised as the committed fixtures are."""
    for package in ("torch", "transformers", "onnxscript"):
        pytest.importorskip(package)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    import make_transformer_fixtures

    for path in make_transformer_fixtures.write_fixtures(tmp_path):
        model_type, heads, hidden, _ = model_of(path.stem)
        detection = transformer.detect(onnx.load(path))
        assert (path.stem, detection.model_type, detection.num_heads, detection.hidden_size) == (
            path.stem, model_type, heads, hidden)


@pytest.mark.corpus
def test_an_ocr_recognizer_is_not_taken_for_bert(caplog):
    """Case c: PP-OCRv4's SVTR recognizer has attention and layer norms (Paddle's ReduceMean
    pattern) but Swish and HardSwish activations, no GELU: left alone, with the warning."""
    from onnxcampo.benchmarks import corpus

    try:
        path = corpus.fetch(corpus.get("ppocr_rec"))
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")
    model = onnx.load(str(path))
    detection = transformer.detect(model)
    assert (detection.model_type, detection.attention) == (None, True)
    assert detection.reason == ("not BERT- or GPT-2-like: attention and layer norms, but no Gelu (the op, its erf or "
                                "tanh form)")
    with caplog.at_level(logging.WARNING, logger="onnxcampo.rewrites.transformer"):
        fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert fused is model and report["model_type"] is None
    assert [r.getMessage() for r in caplog.records] == [
        f"fuse: not fused: {detection.reason}; fuse='bert' or fuse='gpt2' fuses it as that model type"]
