"""A BERT / GPT-2 encoder layer as PyTorch's exporters spell it (the transformer fusion's cases)."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HIDDEN, HEADS, SEQ, BATCH, FFN = 64, 4, 8, 2, 256


def bert_layer(*, batch=BATCH, seq=SEQ, hidden=HIDDEN, heads=HEADS, ffn=FFN, causal=False, norm="pattern",
               activation="erf", nan_guard=False, seed=0) -> onnx.ModelProto:
    """One encoder layer as a PyTorch export of BERT spells it; ``causal`` adds a decoder's
    lower-triangular mask (0 on and below the diagonal, -10000 above) to the scores; ``norm``:
    ``pattern`` (ReduceMean ... Div), ``reciprocal`` (... Mul by Reciprocal(Sqrt)), ``op``
    (LayerNormalization) or ``none``; ``activation``: ``erf`` (BERT's Gelu), ``tanh`` (GPT-2's) or
    ``relu``; ``nan_guard`` puts SDPA's Where(IsNaN(p), 0, p) between the Softmax and probs.V."""
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
        if norm == "none":
            return x
        if norm == "op":
            return node("LayerNormalization", [x, const(f"{prefix}/gamma", gamma), const(f"{prefix}/beta", beta)],
                        f"{prefix}/out", axis=-1, epsilon=1e-12)
        mean = node("ReduceMean", [x], f"{prefix}/mean", axes=[-1])
        centred = node("Sub", [x, mean], f"{prefix}/sub")
        variance = node("ReduceMean", [node("Pow", [centred, const(f"{prefix}/two", 2.0)], f"{prefix}/pow")],
                        f"{prefix}/var", axes=[-1])
        deviation = node("Sqrt", [node("Add", [variance, const(f"{prefix}/eps", 1e-12)], f"{prefix}/add_eps")],
                         f"{prefix}/sqrt")
        if norm == "reciprocal":
            normed = node("Mul", [centred, node("Reciprocal", [deviation], f"{prefix}/reciprocal")], f"{prefix}/div")
        else:
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
    if nan_guard:
        probs = node("Where", [node("IsNaN", [probs], "attn/isnan"), const("attn/zero", 0.0), probs], "attn/guard")
    context = node("Transpose", [node("MatMul", [probs, v], "attn/context")], "attn/transpose", perm=[0, 2, 1, 3])
    context = node("Reshape", [context, const("attn/merge_heads", [0, 0, hidden], np.int64)], "attn/merge")
    ln1 = layer_norm(node("Add", [linear(context, "attn_out", hidden, hidden), ln0], "attn/residual"), "ln1")
    h = linear(ln1, "ffn1", hidden, ffn)
    if activation == "relu":
        act = node("Relu", [h], "act/out")
    else:
        if activation == "tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            cubic = node("Mul", [node("Pow", [h, const("gelu/three", 3.0)], "gelu/pow"), const("gelu/c", 0.044715)],
                         "gelu/cubic")
            inner = node("Mul", [node("Add", [h, cubic], "gelu/inner_add"),
                                 const("gelu/scale", math.sqrt(2 / math.pi))], "gelu/inner")
            bounded = node("Tanh", [inner], "gelu/tanh")
        else:
            bounded = node("Erf", [node("Div", [h, const("gelu/sqrt2", math.sqrt(2.0))], "gelu/div")], "gelu/erf")
        act = node("Mul", [node("Mul", [h, node("Add", [bounded, const("gelu/one", 1.0)], "gelu/add")], "gelu/mul"),
                           const("gelu/half", 0.5)], "gelu/out")
    ln2 = layer_norm(node("Add", [linear(act, "ffn2", ffn, hidden), ln1], "ffn/residual"), "ln2")
    nodes.append(helper.make_node("Identity", [ln2], ["hidden_states"], name="output"))
    graph = helper.make_graph(
        nodes, "bert_layer",
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, [batch, seq, hidden]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [batch, seq])],
        [helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, [batch, seq, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model
