"""Cost features of ORT's com.microsoft ops: the fused products are GEMMs with the FLOPs of all
their products; the element-wise and normalization ops count the bytes they move."""

from __future__ import annotations

import math

import pytest

from onnxcampo.costdb.analytic import AnalyticCostModel
from onnxcampo.costdb.features import op_features

B, S, H, HEADS = 2, 128, 768, 12


@pytest.mark.parametrize("op, attrs", [("FusedMatMul", {"alpha": 1.0}), ("FusedGemm", {"activation": "Relu"}),
                                       ("GemmFastGelu", {})])
def test_fused_products_are_the_gemm_of_their_first_two_inputs(op, attrs):
    features = op_features(op, [(B * S, H), (H, 4 * H), (4 * H,)], [(B * S, 4 * H)], attrs)
    assert features.gemm == (1, B * S, H, 4 * H) and features.flops == 2.0 * B * S * H * 4 * H
    assert features.tensor_core_aligned


def test_attention_is_its_qkv_projection_plus_the_two_batched_products():
    """input [B, S, H] x weights [H, 3H]: the projection is its GEMM; Q K^T and softmax(.) V add
    2 B S S H each. The int32 mask is no float input."""
    features = op_features(
        "Attention", [(B, S, H), (H, 3 * H), (3 * H,), (B,)], [(B, S, H)], {"num_heads": HEADS},
        float_inputs=[True, True, True, False],
    )
    projection = 2.0 * B * S * H * 3 * H
    products = 2 * (2.0 * B * S * S * H)
    assert features.known and features.gemm == (B, S, H, 3 * H)
    assert features.flops == projection + products
    assert features.elements == B * S * H + H * 3 * H + 3 * H + B * S * H


def test_attention_with_past_attends_over_past_and_new_keys():
    past = 32
    features = op_features(
        "Attention", [(B, S, H), (H, 3 * H), (3 * H,), None, (2, B, HEADS, past, H // HEADS)],
        [(B, S, H), (2, B, HEADS, past + S, H // HEADS)], {"num_heads": HEADS},
        float_inputs=[True, True, True, False, True],
    )
    assert features.flops == 2.0 * B * S * H * 3 * H + 2 * (2.0 * B * S * (past + S) * H)


@pytest.mark.parametrize("inputs", [
    [(B, S, H), (B, S, H), (B, S, H)],  # separate Q, K, V [B, S, hidden]
    [(B, S, H), (B, HEADS, S, H // HEADS), (B, HEADS, S, H // HEADS)],  # K, V as [B, N, L, head]
    [(B, S, HEADS, 3, H // HEADS)],  # packed QKV
])
def test_multi_head_attention_is_its_two_batched_products(inputs):
    features = op_features("MultiHeadAttention", inputs, [(B, S, H)], {"num_heads": HEADS})
    assert features.gemm == (B * HEADS, S, H // HEADS, S)
    assert features.flops == 2 * (2.0 * B * S * S * H)


def test_attention_is_priced_as_a_product_not_as_memory_traffic():
    model = AnalyticCostModel()
    attention = op_features("Attention", [(B, S, H), (H, 3 * H), (3 * H,)], [(B, S, H)], {"num_heads": HEADS})
    as_elementwise = op_features("Add", [(B, S, H), (H, 3 * H), (3 * H,)], [(B, S, H)])
    assert attention.is_gemm and not as_elementwise.is_gemm
    assert model.fp32_time(attention) > model.fp32_time(as_elementwise)


@pytest.mark.parametrize("op, inputs, outputs", [
    ("SkipLayerNormalization", [(B, S, H), (B, S, H), (H,), (H,)], [(B, S, H)]),
    ("FastGelu", [(B, S, 4 * H), (4 * H,)], [(B, S, 4 * H)]),
    ("BiasSoftmax", [(B, HEADS, S, S), (B, 1, 1, S)], [(B, HEADS, S, S)]),
    ("RotaryEmbedding", [(B, S, H), None, (S, 32), (S, 32)], [(B, S, H)]),
])
def test_element_wise_and_normalization_ops_count_the_elements_they_move(op, inputs, outputs):
    features = op_features(op, inputs, outputs, float_inputs=[s is not None for s in inputs])
    expected = sum(math.prod(s) for s in (*[i for i in inputs if i is not None], *outputs))
    assert features.known and not features.is_gemm
    assert features.elements == expected and features.flops == math.prod(outputs[0])


def test_embed_layer_normalization_reads_the_rows_it_gathers_not_whole_tables():
    """word (30522 x H), position (512 x H) and segment (2 x H) tables: B x S rows of each."""
    inputs = [(B, S), (B, S), (30522, H), (512, H), (2, H), (H,), (H,)]
    features = op_features("EmbedLayerNormalization", inputs, [(B, S, H), (B,)],
                           float_inputs=[False, False, True, True, True, True, True], float_outputs=[True, False])
    assert features.elements == 3 * B * S * H + 2 * H + B * S * H


def test_contrib_ops_named_like_onnx_ops_are_costed_under_their_domain():
    from onnxcampo.costdb.features import cost_key, keyed

    # com.microsoft's Gelu (its fp16 kernel measured no faster than fp32 on the H200) must not
    # price ONNX's Gelu-20, nor contrib Attention ONNX's Attention-23; unique names stay bare
    assert cost_key("Gelu", "com.microsoft") == "com.microsoft.Gelu" and cost_key("Gelu", "") == "Gelu"
    assert cost_key("Attention", "com.microsoft") == "com.microsoft.Attention"
    assert cost_key("SkipLayerNormalization", "com.microsoft") == "SkipLayerNormalization"
    features = op_features("Gelu", [(4, 8)], [(4, 8)])
    assert keyed(features, "com.microsoft").op_type == "com.microsoft.Gelu"
    assert keyed(features, "com.microsoft").flops == features.flops and keyed(features, "") is features


def test_a_matmul_with_a_2d_weight_is_one_gemm_of_the_batch_rows_and_finds_its_measurement():
    """[8, 256, 768] x [768, 50257] runs as one GEMM of M = 2048 (ORT flattens A's leading dims for
    a 2-D B): the same features, and the same entry of the shipped database's measured table, as
    [2048, 768] x [768, 50257] (GPT-2's LM head in a training step had fallen to the regression,
    which predicted 539 us for a measured 1231 us). A batched B stays batched."""
    from onnxcampo.costdb.regression import shape_key
    from onnxcampo.costdb.select import load_cost_model
    from pathlib import Path

    folded = op_features("MatMul", [(8, 256, 768), (768, 50257)], [(8, 256, 50257)], {})
    flat = op_features("MatMul", [(2048, 768), (768, 50257)], [(2048, 50257)], {})
    assert folded.gemm == flat.gemm == (1, 2048, 768, 50257) and shape_key(folded) == shape_key(flat)
    batched = op_features("MatMul", [(8, 256, 64), (8, 64, 256)], [(8, 256, 256)], {})
    assert batched.gemm == (8, 256, 64, 256)
    cost = load_cost_model(Path(__file__).resolve().parents[2] / "costdb" / "data" / "nvidia-h200.json")
    assert cost.fp16_time(folded, cost.fp32_time(folded)) == pytest.approx(1230.7759)
