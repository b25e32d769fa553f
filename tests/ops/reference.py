"""Numpy references of the ai.onnxcampo ops (float32 throughout, one rounding per operation, in
the order of the standard-op graph of onnxcampo/training/step.py), and single-op models."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session, run

F32 = np.float32


def unscale_check_finite(inv_scale, grads):
    found = any(not np.isfinite(g).all() for g in grads)
    return np.array(found), [g.astype(F32) * F32(inv_scale) for g in grads]


def sgd(lr, found_inf, weights, grads, velocities=None, momentum=0.0):
    if bool(found_inf):
        return [w.copy() for w in weights], [v.copy() for v in velocities or []]
    lr, mu = F32(lr), F32(momentum)
    if velocities is None:
        return [w - lr * g.astype(F32) for w, g in zip(weights, grads)], []
    new_v = [mu * v + g.astype(F32) for v, g in zip(velocities, grads)]
    return [w - lr * v for w, v in zip(weights, new_v)], new_v


def adamw(lr, step, found_inf, weights, grads, m, v, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01):
    if bool(found_inf):
        return F32(step), [w.copy() for w in weights], [x.copy() for x in m], [x.copy() for x in v]
    b1, b2, eps, wd, lr = F32(beta1), F32(beta2), F32(eps), F32(weight_decay), F32(lr)
    one_b1, one_b2 = F32(1.0 - float(b1)), F32(1.0 - float(b2))
    t = F32(step) + F32(1)
    c1, c2 = F32(1) - b1 ** t, F32(1) - b2 ** t
    new_w, new_m, new_v = [], [], []
    for w, g, m_, v_ in zip(weights, grads, m, v):
        g = g.astype(F32)
        mm = b1 * m_ + one_b1 * g
        vv = b2 * v_ + one_b2 * (g * g)
        direction = (mm / c1) / (np.sqrt(vv / c2) + eps)
        new_w.append(w - lr * (direction + wd * w))
        new_m.append(mm)
        new_v.append(vv)
    return t, new_w, new_m, new_v


def run_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], outputs: dict[str, tuple[int, list[int]]],
             provider: str = "cpu", intra_op_threads: int | None = None) -> dict[str, np.ndarray]:
    """Run one ai.onnxcampo node through onnxcampo's session (which registers the library);
    ``intra_op_threads`` sizes ORT's intra-op pool (None: ORT's default)."""
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
              for name, a in feeds.items()]
    outs = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in outputs.items()]
    model = helper.make_model(helper.make_graph([node], "op", inputs, outs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    onnx.checker.check_model(model)
    return run(make_session(model, provider=provider, intra_op_threads=intra_op_threads), feeds)


# ---- AvgMatMulInteger (docs/avg-matmul.md) -----------------------------------------------------


def subtree_sizes(k: int) -> list[int]:
    """K's binary digits, largest first: the sizes of the consecutive subtrees."""
    return [1 << bit for bit in reversed(range(k.bit_length())) if k >> bit & 1]


def tree_sum(products: np.ndarray) -> np.ndarray:
    """The seed's approximate sum over axis 1 of ``products`` (integers <= 65025, shape [M, K, N]):
    consecutive power-of-two subtrees, pairwise ``floor((x + y) / 2)`` up each one, the root
    times the subtree's size, summed. int64, exact."""
    products = products.astype(np.int64)
    total = np.zeros((products.shape[0], products.shape[2]), np.int64)
    start = 0
    for size in subtree_sizes(products.shape[1]):
        level = products[:, start:start + size]
        while level.shape[1] > 1:
            level = (level[:, 0::2] + level[:, 1::2]) >> 1
        total += level[:, 0] * size
        start += size
    return total


def avg_matmul_integer(a, b, a_zero_point=None, b_zero_point=None, *, exact=False):
    """AvgMatMulInteger (``exact=True``: ExactMatMulInteger): uint8 [M, K] x uint8 [K, N] ->
    float32 [M, N] = float32(S - zb*rowsum(A) - za*colsum(B) + K*za*zb), S the tree sum of the
    raw products a*b (or their exact sum); zero points scalar, per row of A, per column of B."""
    a, b = np.asarray(a, np.uint8), np.asarray(b, np.uint8)
    m, k = a.shape
    n = b.shape[1]
    products = a.astype(np.int64)[:, :, None] * b.astype(np.int64)[None, :, :]
    s = products.sum(axis=1) if exact else tree_sum(products)
    za = np.zeros(m, np.int64) if a_zero_point is None else np.broadcast_to(np.asarray(a_zero_point, np.int64).reshape(-1), (m,))
    zb = np.zeros(n, np.int64) if b_zero_point is None else np.broadcast_to(np.asarray(b_zero_point, np.int64).reshape(-1), (n,))
    row = a.astype(np.int64).sum(axis=1)
    col = b.astype(np.int64).sum(axis=0)
    value = s - zb[None, :] * row[:, None] - za[:, None] * col[None, :] + k * za[:, None] * zb[None, :]
    return value.astype(np.float32)


def error_bound(k: int) -> int:
    """The largest |S - S~| the tree can make (docs/avg-matmul.md): sum over subtrees of
    size * depth / 2, i.e. 2^n * n / 2 for a subtree of 2^n leaves."""
    return sum(size * (size.bit_length() - 1) // 2 for size in subtree_sizes(k))


def matmul_u8_model(op="AvgMatMulInteger", *, zero_points=(False, False), zp_shapes=((), ())) -> onnx.ModelProto:
    """A one-node model: Y = op(A, B[, a_zero_point, b_zero_point]), all inputs graph inputs."""
    U8 = onnx.TensorProto.UINT8
    inputs = [helper.make_tensor_value_info("A", U8, ["M", "K"]), helper.make_tensor_value_info("B", U8, ["K", "N"])]
    names = ["", ""]
    for index, (present, name, shape) in enumerate(zip(zero_points, ("a_zero_point", "b_zero_point"), zp_shapes)):
        if present:
            inputs.append(helper.make_tensor_value_info(name, U8, list(shape)))
            names[index] = name
    node = nodes.avg_matmul_integer("A", "B", *names, output="Y", name="matmul", exact=op == "ExactMatMulInteger")
    graph = helper.make_graph([node], "matmul_u8", inputs,
                              [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["M", "N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    nodes.import_domain(model)
    return model


# ---- ScatterNDAdd (ONNX ScatterND, reduction "add") --------------------------------------------


def scatter_nd_add(data: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> np.ndarray:
    """``np.add.at`` over the index tuples in order (negative indices wrapped), in data's dtype:
    float16 sums round to float16 after every addition, as the CPU kernel's do."""
    out = data.copy()
    k = indices.shape[-1]
    tuples = indices.reshape(int(np.prod(indices.shape[:-1])), k)
    slices = updates.reshape(len(tuples), *data.shape[k:])
    if k == 0:  # every empty tuple selects all of data
        for update in slices:
            out += update
        return out
    wrapped = np.where(tuples < 0, tuples + np.array(data.shape[:k]), tuples)
    np.add.at(out, tuple(wrapped.T), slices)
    return out


def scatter_nd_add_model(dtype: int, *, reduction: str | None = None, ranks: tuple[int, int, int] | None = None,
                         op: str = "ScatterNDAdd", opset: int = 18) -> onnx.ModelProto:
    """One ScatterNDAdd node (or ``op="ScatterND"``, reduction "add") on inputs data, indices,
    updates of ``dtype`` (int64 indices), shapes left symbolic (of the given ranks) or unknown."""
    def value(name, elem_type, rank):
        return helper.make_tensor_value_info(name, elem_type, None if rank is None else [f"{name}{d}" for d in range(rank)])

    data_rank, index_rank, update_rank = ranks or (None, None, None)
    attributes = {"reduction": reduction} if reduction is not None else {}
    if op == "ScatterND":
        node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["output"], name="scatter", reduction="add")
    else:
        node = helper.make_node(op, ["data", "indices", "updates"], ["output"], name="scatter", domain=nodes.DOMAIN,
                                **attributes)
    graph = helper.make_graph([node], "scatter", [value("data", dtype, data_rank),
                                                  value("indices", onnx.TensorProto.INT64, index_rank),
                                                  value("updates", dtype, update_rank)],
                              [value("output", dtype, data_rank)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    nodes.import_domain(model)
    return model
