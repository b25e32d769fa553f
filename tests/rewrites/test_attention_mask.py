"""The padding mask of ORT's fused BERT Attention as an additive attention bias
(``onnxcampo.rewrites.attention_mask``). Wiring checks on ORT's CPU provider in fp32 (the CPU
Attention kernel reads ``attention_bias`` as the CUDA one does); which CUDA kernel runs is
measured on the GPU (``docs/benchmarks``)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxcampo.config import OptimizeConfig
from onnxcampo.rewrites import attention_mask, transformer
from onnxcampo.runtime import make_session, run

from cases.transformer import bert_layer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "transformers"


def masks(batch: int, seq: int) -> list[np.ndarray]:
    """All ones, right-padded, left-padded and with a gap: a bias must mean the same for each."""
    right, left, gap = (np.ones((batch, seq), np.int64) for _ in range(3))
    right[0, seq // 2:] = 0
    left[-1, : seq // 2] = 0
    gap[0, 1:3] = 0
    return [np.ones((batch, seq), np.int64), right, left, gap]


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Attention"]


def test_every_bert_attention_reads_one_shared_bias_instead_of_the_mask():
    fused, report = transformer.fuse_transformer(onnx.load(FIXTURES / "bert_eager_torchscript.onnx"), OptimizeConfig())
    nodes = attention_nodes(fused)
    assert report["attention_bias"] == len(nodes) == 2
    assert {n.input[3] for n in nodes} == {""}
    assert len({n.input[5] for n in nodes}) == 1
    onnx.checker.check_model(fused)
    assert [o.name for o in fused.graph.output] == [o.name for o in onnx.load(FIXTURES / "bert_eager_torchscript.onnx").graph.output]


@pytest.mark.parametrize("which", range(4))
def test_the_bias_computes_what_the_raw_mask_does_for_any_padding(which):
    model = onnx.load(FIXTURES / "bert_eager_torchscript.onnx")
    raw, _ = transformer.fuse_transformer(model, OptimizeConfig(experimental={"attention_bias": False}))
    biased, _ = transformer.fuse_transformer(model, OptimizeConfig())
    assert all(n.input[3] for n in attention_nodes(raw))
    rng = np.random.default_rng(which)
    batch, seq = 3, 16
    feeds = {"input_ids": rng.integers(0, 100, (batch, seq)), "attention_mask": masks(batch, seq)[which],
             "token_type_ids": np.zeros((batch, seq), np.int64)}
    output = model.graph.output[0].name
    expected = run(make_session(model), feeds)[output]
    np.testing.assert_allclose(run(make_session(biased), feeds)[output], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(run(make_session(raw), feeds)[output], expected, rtol=1e-4, atol=1e-5)


def test_the_built_layer_keeps_a_left_padded_row_right():
    model = bert_layer()
    fused, report = transformer.fuse_transformer(model, OptimizeConfig())
    assert report["attention_bias"] == 1
    mask = np.ones((2, 8), np.int64)
    mask[1, :4] = 0
    inputs = {"embeddings": np.random.default_rng(1).standard_normal((2, 8, 64)).astype(np.float32),
              "attention_mask": mask}
    np.testing.assert_allclose(run(make_session(fused), inputs)["hidden_states"],
                               run(make_session(model), inputs)["hidden_states"], rtol=1e-4, atol=1e-4)


def _with_attention(**changes) -> onnx.ModelProto:
    fused, _ = transformer.fuse_transformer(onnx.load(FIXTURES / "bert_eager_torchscript.onnx"),
                                            OptimizeConfig(experimental={"attention_bias": False}))
    for node in attention_nodes(fused):
        for key, value in changes.items():
            node.attribute.append(helper.make_attribute(key, value))
    return fused


@pytest.mark.parametrize("attribute", ["unidirectional", "past_present_share_buffer"])
def test_causal_and_cached_attention_keep_their_mask(attribute):
    model = _with_attention(**{attribute: 1})
    before = model.SerializeToString()
    assert attention_mask.mask_as_bias(model) == 0
    assert model.SerializeToString() == before


def test_a_mask_index_or_an_unknown_rank_is_left_alone():
    model = _with_attention()
    mask = attention_nodes(model)[0].input[3]
    assert attention_mask.mask_as_bias(copy.deepcopy(model), {mask: 1}) == 0  # a mask index: [B]
    assert attention_mask.mask_as_bias(copy.deepcopy(model), {}) == 0
    assert attention_mask.mask_as_bias(copy.deepcopy(model), {mask: 2}) == 2


def test_the_mask_filter_value_is_the_bias_fill():
    model = _with_attention(mask_filter_value=-30000.0)
    assert attention_mask.mask_as_bias(model) == 2
    fills = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer if "/fill_" in t.name]
    assert [float(f) for f in fills] == [-30000.0]


def test_an_opset_12_graph_gets_unsqueeze_with_axes_as_an_attribute():
    model = _with_attention()
    model.opset_import[0].version = 12 if model.opset_import[0].domain == "" else model.opset_import[0].version
    assert attention_mask.mask_as_bias(model) == 2
    unsqueeze = [n for n in model.graph.node if n.op_type == "Unsqueeze" and n.name.startswith("attention_bias/")]
    assert [len(n.input) for n in unsqueeze] == [1] and unsqueeze[0].attribute[0].ints == [1, 2]
