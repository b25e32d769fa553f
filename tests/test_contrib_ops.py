"""The com.microsoft ops ORT's transformers optimizer and CUDA graph transformers emit are first-class:
each is in a list, its slots come from ORT's schema, and those without an fp16 CUDA kernel
(FusedConv: float only; FusedGemm, GemmFastGelu: no CUDA kernel) never run fp16."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

from onnxcampo import oplists, optimize
from onnxcampo.oplists import Category
from onnxcampo.signature import Slot, signature

MS = "com.microsoft"
FLOAT, FLOAT16, INT32 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT32
F, X = Slot.FOLLOW, Slot.FIXED

# What ORT's transformers optimizer and its CUDA graph transformers write.
ORT_FUSED_OPS = (
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization", "EmbedLayerNormalization",
    "BiasGelu", "FastGelu", "Gelu", "QuickGelu", "GemmFastGelu", "BiasSplitGelu", "BiasAdd",
    "BiasSoftmax", "FusedMatMul", "FusedConv", "RotaryEmbedding", "FusedGemm",
)
NO_FP16_KERNEL = ("FusedConv", "FusedGemm", "GemmFastGelu")


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _weight(name, shape, seed=0) -> onnx.TensorProto:
    values = np.random.default_rng(seed).standard_normal(shape) * 0.1
    return numpy_helper.from_array(values.astype(np.float32), name)


def _vi(name, shape, dtype=FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor of a written model, as ORT's symbolic inference types it
    (independent of onnxcampo's own inference)."""
    graph = SymbolicShapeInference.infer_shapes(model, auto_merge=True, guess_output_rank=True).graph
    types = {t.name: t.data_type for t in graph.initializer}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in (*graph.input, *graph.value_info, *graph.output)})
    return types


def _reasons(result) -> dict[str, str]:
    return {name: entry["reason"] for name, entry in result.report["plan"].items()}


# --- list membership and kernel data -------------------------------------------------------
@pytest.mark.parametrize("op", ORT_FUSED_OPS)
def test_every_ort_fused_op_is_in_a_list(op):
    domain = "" if op == "SimplifiedLayerNormalization" else MS  # ORT registers it in the ONNX domain
    assert oplists.category_of(op, domain) in (Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY)


def test_cuda_kernel_data_covers_the_com_microsoft_ops_and_is_consistent():
    """Every com.microsoft op of the list is recorded as having an fp16 CUDA kernel or not, never
    both; only the ones without one are kept fp32."""
    ms_ops = set(ORT_FUSED_OPS) - {"SimplifiedLayerNormalization"}
    assert not oplists.CUDA_FP16_KERNELS_MS & oplists.CUDA_NO_FP16_KERNEL_MS
    assert ms_ops <= oplists.CUDA_FP16_KERNELS_MS | oplists.CUDA_NO_FP16_KERNEL_MS
    assert {op for op in ms_ops if oplists.lacks_cuda_fp16_kernel(op, MS)} == set(NO_FP16_KERNEL)
    assert not oplists.lacks_cuda_fp16_kernel("FusedConv", "com.example")  # someone else's op


@pytest.mark.parametrize("op, domain, n_in, n_out, inputs, outputs", [
    # gamma and beta follow; mean and inv_std_var are 'U', fp32 by attribute
    ("SkipLayerNormalization", MS, 5, 4, (F, F, F, F, F), (F, X, X, F)),
    ("SkipSimplifiedLayerNormalization", MS, 4, 4, (F, F, F, F), (F, X, X, F)),
    ("SimplifiedLayerNormalization", "", 2, 2, (F, F), (F, X)),  # ORT's schema in the ONNX domain
    # mask_index is int32 ('M'); past and present follow
    ("Attention", MS, 5, 2, (F, F, F, X, F), (F, F)),
    ("MultiHeadAttention", MS, 5, 1, (F, F, F, F, X), (F,)),
    ("EmbedLayerNormalization", MS, 7, 2, (X, X, F, F, F, F, F), (F, X)),
    ("FastGelu", MS, 2, 1, (F, F), (F,)),
    ("RotaryEmbedding", MS, 4, 1, (F, X, F, F), (F,)),
])
def test_signatures_come_from_ort_schemas(op, domain, n_in, n_out, inputs, outputs):
    sig = signature(op, domain, 17, n_in, n_out)
    assert sig.schema_found and (sig.inputs, sig.outputs) == (inputs, outputs)


# --- whole models through optimize -----------------------------------------------------------
def _skip_ln_matmul_gelu() -> onnx.ModelProto:
    """SkipLayerNormalization (with its mean / inv_std outputs) -> MatMul -> FastGelu."""
    nodes = [
        helper.make_node("SkipLayerNormalization", ["x", "skip", "gamma", "beta"], ["ln", "mean", "inv_std"],
                         name="sln", domain=MS, epsilon=1e-5),
        helper.make_node("MatMul", ["ln", "w"], ["mm"], name="mm"),
        helper.make_node("FastGelu", ["mm", "bias"], ["y"], name="gelu", domain=MS),
    ]
    initializers = [numpy_helper.from_array(np.ones(64, np.float32), "gamma"),
                    numpy_helper.from_array(np.zeros(64, np.float32), "beta"),
                    _weight("w", (64, 256)), _weight("bias", (256,), 1)]
    return _model(nodes, [_vi("x", [2, 8, 64]), _vi("skip", [2, 8, 64])],
                  [_vi("y", [2, 8, 256]), _vi("mean", [2, 8, 1]), _vi("inv_std", [2, 8, 1])], initializers)


def test_fp16_policy_runs_skip_layer_norm_and_fast_gelu_in_fp16_with_fp32_statistics():
    """Policy fp16: every node goes fp16; SkipLayerNormalization's inputs, gamma and beta are fp16,
    its mean and inv_std outputs stay fp32 ('U'); FastGelu's bias follows; the graph outputs keep
    their dtype."""
    result = optimize(_skip_ln_matmul_gelu(), policy="fp16")
    assert set(_reasons(result).values()) == {"policy_fp16"}
    types = _dtypes(result.model)
    sln = next(n for n in result.model.graph.node if n.name == "sln")
    assert [types[t] for t in sln.input] == [FLOAT16] * 4
    assert types[sln.output[0]] == FLOAT16 and types["mm"] == FLOAT16 and types["bias"] == FLOAT16
    # the statistics are the float32 graph outputs themselves, written by the node without a Cast
    assert list(sln.output[1:]) == ["mean", "inv_std"]
    assert {o.name: o.type.tensor_type.elem_type for o in result.model.graph.output} == {
        "y": FLOAT, "mean": FLOAT, "inv_std": FLOAT}


def test_attention_mask_index_keeps_int32_in_fp16():
    """Policy fp16: Attention runs fp16 (input, weights, bias, output), its int32 mask_index is
    passed as it is (no Cast)."""
    nodes = [helper.make_node("Attention", ["x", "qkv_w", "qkv_b", "mask"], ["y"], name="attn", domain=MS,
                              num_heads=2)]
    model = _model(nodes, [_vi("x", [1, 8, 16]), _vi("mask", [1], INT32)], [_vi("y", [1, 8, 16])],
                   [_weight("qkv_w", (16, 48)), _weight("qkv_b", (48,), 1)])
    result = optimize(model, policy="fp16")
    attn = next(n for n in result.model.graph.node if n.name == "attn")
    types = _dtypes(result.model)
    assert [types[t] for t in attn.input] == [FLOAT16, FLOAT16, FLOAT16, INT32]
    assert attn.input[3] == "mask" and types[attn.output[0]] == FLOAT16


def _ops_without_fp16_kernel() -> onnx.ModelProto:
    """FusedConv -> (flatten) -> FusedGemm -> GemmFastGelu, large enough for fp16 to pay."""
    nodes = [
        helper.make_node("FusedConv", ["x", "cw", "cb"], ["c"], name="conv", domain=MS, activation="Relu",
                         pads=[1, 1, 1, 1]),
        helper.make_node("Flatten", ["c"], ["f"], name="flatten"),
        helper.make_node("FusedGemm", ["f", "gw", "gb"], ["g"], name="gemm", domain=MS, activation="Relu"),
        helper.make_node("GemmFastGelu", ["g", "fw", "fb"], ["y"], name="gemm_gelu", domain=MS),
    ]
    initializers = [_weight("cw", (64, 64, 3, 3)), _weight("cb", (64,), 1), _weight("gw", (64 * 16 * 16, 256), 2),
                    _weight("gb", (256,), 3), _weight("fw", (256, 256), 4), _weight("fb", (256,), 5)]
    return _model(nodes, [_vi("x", [64, 64, 16, 16])], [_vi("y", [64, 256])], initializers)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["campo", "amp", "fp16"])
def test_ops_without_an_fp16_cuda_kernel_stay_fp32_under_every_policy(policy):
    """FusedConv (float-only CUDA kernel), FusedGemm and GemmFastGelu (no CUDA kernel) stay fp32
    with NO_FP16_KERNEL whatever the policy, and read and write float32."""
    result = optimize(_ops_without_fp16_kernel(), policy=policy)
    reasons = _reasons(result)
    assert {name: reasons[name] for name in ("conv", "gemm", "gemm_gelu")} == dict.fromkeys(
        ("conv", "gemm", "gemm_gelu"), "no_fp16_kernel")
    types = _dtypes(result.model)
    for node in result.model.graph.node:
        if node.domain == MS:
            assert {types[t] for t in (*node.input, *node.output)} == {FLOAT}, node.name


@pytest.mark.slow
def test_an_inclusion_does_not_send_an_op_without_fp16_kernel_to_fp16():
    result = optimize(_ops_without_fp16_kernel(), policy="campo", include_ops=frozenset({"FusedConv"}))
    assert _reasons(result)["conv"] == "no_fp16_kernel"
