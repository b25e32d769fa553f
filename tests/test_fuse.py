"""``--fuse``: ONNX Runtime's transformers optimizer before planning (``onnxcampo.fuse``).

The graphs are built in code: a BERT-like encoder layer (embedding Add, decomposed LayerNorm,
Q/K/V projections split into heads, scaled and masked Softmax attention, output projection,
residual Adds, erf-Gelu FFN) with hidden size 64, 4 heads, sequence 8.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo import fuse
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import UnsupportedModelError
from onnxcampo.runtime import make_session, run

HIDDEN, HEADS, SEQ, BATCH, FFN = 64, 4, 8, 2, 256


def bert_layer(*, batch=BATCH, seq=SEQ, hidden=HIDDEN, heads=HEADS, ffn=FFN, causal=False, norm_op=False,
               tanh_gelu=False, seed=0) -> onnx.ModelProto:
    """One encoder layer as a PyTorch export of BERT spells it; ``causal`` adds a decoder's
    lower-triangular mask (0 on and below the diagonal, -10000 above) to the scores; ``norm_op``
    uses the LayerNormalization op, ``tanh_gelu`` GPT-2's tanh Gelu."""
    rng = np.random.default_rng(seed)
    head = hidden // heads
    inits, nodes = [], []

    def const(name, value, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(name, shape, scale=0.05):
        return const(name, rng.standard_normal(shape) * scale)

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def layer_norm(x, prefix):
        gamma, beta = 1 + 0.1 * rng.standard_normal(hidden), 0.1 * rng.standard_normal(hidden)
        if norm_op:
            return node("LayerNormalization", [x, const(f"{prefix}/gamma", gamma), const(f"{prefix}/beta", beta)],
                        f"{prefix}/out", axis=-1, epsilon=1e-12)
        mean = node("ReduceMean", [x], f"{prefix}/mean", axes=[-1])
        centred = node("Sub", [x, mean], f"{prefix}/sub")
        variance = node("ReduceMean", [node("Pow", [centred, const(f"{prefix}/two", 2.0)], f"{prefix}/pow")],
                        f"{prefix}/var", axes=[-1])
        deviation = node("Sqrt", [node("Add", [variance, const(f"{prefix}/eps", 1e-12)], f"{prefix}/add_eps")],
                         f"{prefix}/sqrt")
        normed = node("Div", [centred, deviation], f"{prefix}/div")
        scaled = node("Mul", [normed, const(f"{prefix}/gamma", gamma)], f"{prefix}/mul")
        return node("Add", [scaled, const(f"{prefix}/beta", beta)], f"{prefix}/out")

    def linear(x, prefix, n_in, n_out):
        product = node("MatMul", [x, weight(f"{prefix}/w", (n_in, n_out))], f"{prefix}/matmul")
        return node("Add", [weight(f"{prefix}/b", (n_out,)), product], f"{prefix}/add")

    def split_heads(x, prefix, perm):
        shape = const(f"{prefix}/heads", [0, 0, heads, head], np.int64)
        return node("Transpose", [node("Reshape", [x, shape], f"{prefix}/reshape")], f"{prefix}/transpose", perm=perm)

    ln0 = layer_norm(node("Add", ["embeddings", weight("position", (seq, hidden), 0.5)], "embed/add"), "ln0")
    q = split_heads(linear(ln0, "q", hidden, hidden), "q", [0, 2, 1, 3])
    k = split_heads(linear(ln0, "k", hidden, hidden), "k", [0, 2, 3, 1])
    v = split_heads(linear(ln0, "v", hidden, hidden), "v", [0, 2, 1, 3])
    scores = node("Div", [node("MatMul", [q, k], "attn/qk"), const("attn/scale", math.sqrt(head))], "attn/div")
    if causal:
        triangle = np.triu(np.full((seq, seq), -10000.0), k=1)
        scores = node("Add", [scores, const("attn/causal", triangle)], "attn/add_causal")
    mask = node("Unsqueeze", ["attention_mask", const("mask/axis1", [1], np.int64)], "mask/unsqueeze1")
    mask = node("Unsqueeze", [mask, const("mask/axis2", [2], np.int64)], "mask/unsqueeze2")
    mask = node("Cast", [mask], "mask/cast", to=TensorProto.FLOAT)
    mask = node("Mul", [node("Sub", [const("mask/one", 1.0), mask], "mask/sub"), const("mask/neg", -10000.0)],
                "mask/mul")
    probs = node("Softmax", [node("Add", [scores, mask], "attn/add_mask")], "attn/softmax", axis=-1)
    context = node("Transpose", [node("MatMul", [probs, v], "attn/context")], "attn/transpose", perm=[0, 2, 1, 3])
    context = node("Reshape", [context, const("attn/merge_heads", [0, 0, hidden], np.int64)], "attn/merge")
    ln1 = layer_norm(node("Add", [linear(context, "attn_out", hidden, hidden), ln0], "attn/residual"), "ln1")
    h = linear(ln1, "ffn1", hidden, ffn)
    if tanh_gelu:  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        cubic = node("Mul", [node("Pow", [h, const("gelu/three", 3.0)], "gelu/pow"), const("gelu/c", 0.044715)],
                     "gelu/cubic")
        inner = node("Mul", [node("Add", [h, cubic], "gelu/inner_add"), const("gelu/scale", math.sqrt(2 / math.pi))],
                     "gelu/inner")
        bounded = node("Tanh", [inner], "gelu/tanh")
    else:
        bounded = node("Erf", [node("Div", [h, const("gelu/sqrt2", math.sqrt(2.0))], "gelu/div")], "gelu/erf")
    gelu = node("Mul", [node("Mul", [h, node("Add", [bounded, const("gelu/one", 1.0)], "gelu/add")], "gelu/mul"),
                        const("gelu/half", 0.5)], "gelu/out")
    ln2 = layer_norm(node("Add", [linear(gelu, "ffn2", ffn, hidden), ln1], "ffn/residual"), "ln2")
    nodes.append(helper.make_node("Identity", [ln2], ["hidden_states"], name="output"))
    graph = helper.make_graph(
        nodes, "bert_layer",
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [batch, seq, hidden]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [batch, seq, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


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
        detection = fuse.detect(bert_layer(hidden=hidden, heads=heads))
        assert (detection.model_type, detection.num_heads, detection.hidden_size) == ("bert", heads, hidden)
    assert detection.reason == "layer norms, attention Softmax, Gelu and no causal mask"


@pytest.mark.parametrize("variant, model_type", [({"norm_op": True}, "bert"), ({"tanh_gelu": True}, "gpt2")],
                         ids=["LayerNormalization", "tanh-Gelu"])
def test_the_layer_norm_op_and_the_tanh_gelu_are_recognised_too(variant, model_type):
    """The tanh GELU alone (GPT-2's; BERT's is the erf form) makes the layer GPT-2-like: the
    transformers 5 export of GPT-2 builds its causal mask in a way the mask checks miss."""
    detection = fuse.detect(bert_layer(**variant))
    assert (detection.model_type, detection.num_heads, detection.hidden_size) == (model_type, 4, 64)
    assert ("tanh GELU" in detection.reason) == (model_type == "gpt2")


def test_a_causal_mask_makes_it_gpt2_like():
    """The same layer with a lower-triangular mask constant on the scores is a decoder; ORT's
    gpt2 fusions keep what it computes (the masked attention is not fused into an unmasked one)."""
    model = bert_layer(causal=True)
    assert fuse.detect(model).model_type == "gpt2"
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
    assert report["model_type"] == "gpt2" and report["ops"]["SkipLayerNormalization"] == 2
    np.testing.assert_allclose(run(make_session(fused), feeds())["hidden_states"],
                               run(make_session(model), feeds())["hidden_states"], rtol=1e-4, atol=1e-4)


def test_a_plain_mlp_is_left_untouched_with_the_reason():
    model = mlp()
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report == {"mode": "auto", "model_type": None,
                      "reason": "not a transformer: no layer norm (LayerNormalization or its pattern)"}


def test_training_steps_and_fused_graphs_are_never_fused():
    """Whatever the mode: a train-graph step, and a graph that already has ORT's fused ops."""
    step = bert_layer()
    step.metadata_props.add(key="onnxcampo.train_step", value="1")
    fused, report = fuse.fuse_transformer(step, OptimizeConfig(fuse="bert"))
    assert fused is step and report["reason"].startswith("a training-step graph")
    already, _ = fuse.fuse_transformer(bert_layer(), OptimizeConfig())
    again, report = fuse.fuse_transformer(already, OptimizeConfig(fuse="bert"))
    assert again is already and report["reason"].startswith("already fused (1 Attention, 1 BiasGelu")


# --- fusing -----------------------------------------------------------------------------------
def test_auto_fuses_a_bert_layer_into_ort_ops_and_keeps_the_model_valid():
    """SkipLayerNormalization and the Gelu family appear; IR version and opsets are the input's,
    com.microsoft is declared, the graph passes the checker; the input is not modified."""
    model = bert_layer()
    before = model.SerializeToString()
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
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
    fused, _ = fuse.fuse_transformer(model, OptimizeConfig())
    expected = run(make_session(model), feeds())["hidden_states"]
    got = run(make_session(fused), feeds())["hidden_states"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_forced_mode_takes_the_given_sizes():
    _, report = fuse.fuse_transformer(bert_layer(), OptimizeConfig(fuse="bert", num_heads=4, hidden_size=64))
    assert (report["mode"], report["model_type"], report["num_heads"], report["hidden_size"]) == ("bert", "bert", 4, 64)


def test_sizes_that_do_not_go_together_are_left_to_ort_to_detect():
    """ORT's optimizer asserts heads and hidden size both given (heads dividing the size) or
    neither: a hidden size without heads (what detection found on the H200's BERT export, whose
    head split is computed) goes as neither, and the graph is still fused."""
    _, report = fuse.fuse_transformer(bert_layer(), OptimizeConfig(fuse="bert", num_heads=3, hidden_size=64))
    assert (report["num_heads"], report["hidden_size"]) == (0, 0) and report["ops"]


def test_fused_ops_get_shapes_for_planning_only():
    """ONNX inference stops at com.microsoft ops: the fused outputs get marked value infos,
    which clean_export drops."""
    fused, _ = fuse.fuse_transformer(bert_layer(), OptimizeConfig())
    planning = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in fused.graph.value_info if vi.doc_string == fuse.PLANNING_SHAPE}
    assert planning["attn/merge"] == [BATCH, SEQ, HIDDEN]  # the Attention op's output
    assert planning["gelu/out"] == [BATCH, SEQ, FFN]
    fuse.clean_export(fused)
    assert not [vi for vi in fused.graph.value_info if vi.doc_string == fuse.PLANNING_SHAPE]


def test_an_unsorted_graph_is_sorted():
    model = bert_layer()
    reversed_nodes = list(model.graph.node)[::-1]
    del model.graph.node[:]
    model.graph.node.extend(reversed_nodes)
    assert fuse.toposort_model(model) is True
    onnx.checker.check_model(model)  # the checker rejects unsorted graphs
    assert fuse.toposort_model(model) is False


def test_an_optimizer_failure_leaves_auto_unfused_and_fails_a_forced_mode(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("pattern matcher fell over")

    monkeypatch.setattr(fuse, "_run_optimizer", broken)
    model = bert_layer()
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report["reason"] == "ONNX Runtime's transformers optimizer failed (RuntimeError: pattern matcher fell over)"
    with pytest.raises(UnsupportedModelError, match="fuse='bert': .*fuse='none'"):
        fuse.fuse_transformer(model, OptimizeConfig(fuse="bert"))


def test_an_optimizer_that_changes_the_graph_inputs_is_not_kept(monkeypatch):
    real = fuse._run_optimizer

    def renaming(*args, **kwargs):
        fused = real(*args, **kwargs)
        fused.graph.input[1].type.tensor_type.elem_type = TensorProto.INT32
        return fused

    monkeypatch.setattr(fuse, "_run_optimizer", renaming)
    model = bert_layer()
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
    assert fused is model
    assert report["reason"] == "ONNX Runtime's transformers optimizer changed graph input 'attention_mask'"


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
    result = onnxcampo.optimize(model, check_invariants=True)
    report = result.report
    assert report["fuse"]["model_type"] == "bert" and report["fuse"]["ops"]["SkipLayerNormalization"] == 2
    plan = report["plan"]
    fused_nodes = [n.name for n in result.model.graph.node if n.domain == "com.microsoft"]
    assert fused_nodes and all(plan[name]["reason"] != "unknown_shape" for name in fused_nodes)
    assert report["nodes_fp16"] > 0
    assert not [vi for vi in result.model.graph.value_info if vi.doc_string == fuse.PLANNING_SHAPE]
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
    original = fuse._run_optimizer
    monkeypatch.setattr(fuse, "_run_optimizer", lambda *args: calls.append(args) or original(*args))
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
    fused, report = fuse.fuse_transformer(model, OptimizeConfig())
    assert report["model_type"] is None and "invalid ONNX graph" in report["reason"] and fused is model
    with pytest.raises(UnsupportedModelError, match="invalid ONNX graph"):
        fuse.fuse_transformer(model, OptimizeConfig(fuse="bert"))
