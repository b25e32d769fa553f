"""``ai.onnxcampo::ScatterNDAdd`` where the order of the additions is not fixed (CUDA's atomics):
the cases, the float64 reference and the bound a sum in any order keeps to, and the embedding
gradients of BERT-base and GPT-2 for timing. ``tests/gpu/test_scatter_cuda.py`` runs them;
``tests/ops/test_scatter.py`` checks :func:`compare` itself.

The reference is ``np.add.at`` in float64. An element that receives m updates may differ from it
by 2 (m + 1) u S (u: 2^-24 for float32, 2^-11 for float16, whose running sums are float16; S:
|data| plus the sum of the |updates| it receives); an element that receives none must equal data
bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxcampo.ops import nodes

UNIT = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float16): 2.0 ** -11}
TINY = 2.0 ** -126  # float32 atomics may flush subnormal sums to zero
ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
VARIANTS = ("ScatterND", "ScatterNDAdd")  # ORT's op (reduction add), the library's


def scatter_model(variant: str, dtype, ranks: tuple[int, int, int]) -> onnx.ModelProto:
    """One node, ``output = variant(data, indices, updates)``, ORT's with reduction "add"; the
    dimensions symbolic (one session serves every shape of these ranks)."""
    if variant == "ScatterND":
        node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["output"], name="scatter", reduction="add")
    else:
        node = nodes.scatter_nd_add("data", "indices", "updates", output="output", name="scatter")
    elem = ELEM[np.dtype(dtype)]

    def value(name, elem_type, rank):
        return helper.make_tensor_value_info(name, elem_type, [f"{name}_{d}" for d in range(rank)])

    graph = helper.make_graph([node], "scatter", [value("data", elem, ranks[0]), value("indices", TensorProto.INT64, ranks[1]),
                                                  value("updates", elem, ranks[2])], [value("output", elem, ranks[0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    nodes.import_domain(model)
    return model


def effective_indices(data_shape, indices: np.ndarray, provider: str) -> np.ndarray | None:
    """Index tuples [tuples, k] wrapped (negative) and, on CUDA, clamped as ORT's CUDA kernel
    does; None on the CPU when one is out of range (the kernel must fail)."""
    k = indices.shape[-1]
    tuples = indices.reshape(int(np.prod(indices.shape[:-1], dtype=np.int64)), k).astype(np.int64)
    dims = np.array(data_shape[:k], dtype=np.int64)
    bad = (tuples < -dims) | (tuples >= dims)
    if bad.any() and provider != "cuda":
        return None
    wrapped = np.where(tuples < 0, tuples + dims, tuples)
    return np.where(tuples >= dims, dims - 1, np.where(tuples < -dims, 0, wrapped))


def reference(data: np.ndarray, tuples: np.ndarray, updates: np.ndarray):
    """float64 sums, how many updates each element receives, and |data| + sum |updates|."""
    k = tuples.shape[1]
    slices = updates.reshape(len(tuples), *data.shape[k:]).astype(np.float64)
    exact = data.astype(np.float64)
    count = np.zeros(data.shape, np.int64)
    magnitude = np.abs(data.astype(np.float64))
    if len(tuples) and k == 0:
        exact = exact + slices.sum(axis=0)
        count += len(tuples)
        magnitude = magnitude + np.abs(slices).sum(axis=0)
    elif len(tuples):
        where = tuple(tuples.T)
        np.add.at(exact, where, slices)
        np.add.at(count, where, 1)
        np.add.at(magnitude, where, np.abs(slices))
    return exact, count, magnitude


def compare(out: np.ndarray, data: np.ndarray, tuples: np.ndarray, updates: np.ndarray, expected=None) -> dict:
    """``ok`` when every element is within its bound and every element no update reaches keeps
    data's bits; the worst error over its bound and the most updates an element receives."""
    exact, count, magnitude = expected if expected is not None else reference(data, tuples, updates)
    report = {"shape_ok": out.shape == data.shape and out.dtype == data.dtype}
    if not report["shape_ok"]:
        return {**report, "ok": False, "got": [list(out.shape), str(out.dtype)]}
    unit = UNIT[np.dtype(data.dtype)]
    error = np.abs(out.astype(np.float64) - exact)
    allowed = 2 * (count + 1) * unit * magnitude + count * TINY
    touched = count > 0
    untouched_ok = bool(np.array_equal(out[~touched].view(np.uint8), data[~touched].view(np.uint8))) if out.size else True
    worst = float((error / np.maximum(allowed, np.finfo(np.float64).tiny))[touched].max()) if touched.any() else 0.0
    report.update(ok=bool(untouched_ok and (error <= allowed).all()), untouched_equal_data=untouched_ok,
                  max_abs_error=float(error.max()) if out.size else 0.0, worst_error_over_bound=worst,
                  max_updates_per_element=int(count.max()) if out.size else 0)
    return report


def random_case(rng, dtype, data_shape, k, lead, negative: float = 0.33):
    """Random data, indices with many duplicates (``negative`` of them negative), updates."""
    data = (rng.standard_normal(data_shape) * 4).astype(dtype)
    dims = np.array(data_shape[:k], dtype=np.int64)
    positive = rng.integers(0, np.maximum(dims, 1), size=(*lead, k)) if k else np.zeros((*lead, 0), np.int64)
    indices = np.where(rng.random(positive.shape) < negative, positive - dims, positive).astype(np.int64)
    updates = (rng.standard_normal((*lead, *data_shape[k:])) * 4).astype(dtype)
    return data, indices, updates


def cases(seed: int = 0) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(name, data, indices, updates): float32 and float16, duplicate and negative indices, index
    tuples of 0..3 entries, slice lengths that take the vector and the scalar paths, empty
    tensors, indices out of range."""
    rng = np.random.default_rng(seed)
    out = []
    shapes = [((6, 5), 1, (40,)), ((30, 16, 3), 1, (4, 8)), ((5, 4, 3), 2, (25,)), ((3, 4, 2), 3, (2, 30)),
              ((4, 3), 0, (3,)), ((7,), 1, (50,)), ((10, 7), 1, (33,)), ((10, 6), 1, (33,)),
              ((64, 768), 1, (300,)), ((1000, 768, 1), 1, (8, 64))]
    for dtype in (np.float32, np.float16):
        for data_shape, k, lead in shapes:
            data, indices, updates = random_case(rng, dtype, data_shape, k, lead)
            out.append((f"{np.dtype(dtype).name} data {list(data_shape)} k={k} tuples {list(lead)}", data, indices, updates))
    for data_shape, index_shape, update_shape in [((4, 3), (0, 1), (0, 3)), ((0, 3), (0, 1), (0, 3)),
                                                  ((4, 0), (2, 1), (2, 0)), ((4, 3), (2, 0, 1), (2, 0, 3))]:
        data = np.arange(int(np.prod(data_shape)), dtype=np.float32).reshape(data_shape)
        out.append((f"empty: data {list(data_shape)} indices {list(index_shape)}", data,
                    np.ones(index_shape, np.int64), np.ones(update_shape, np.float32)))
    for dtype in (np.float32, np.float16):
        data = np.zeros((4, 8), dtype)
        indices = np.array([[1], [4], [-5], [100], [-(2 ** 40)], [-4]])
        out.append((f"{np.dtype(dtype).name} indices out of range", data, indices,
                    (rng.standard_normal((6, 8)) * 4).astype(dtype)))
    return out


def zipf_ids(rng, count: int, vocab: int, first: int = 0, exponent: float = 1.07) -> np.ndarray:
    """Token ids with a Zipf law over ranks (a fixed shuffle of ids first..vocab-1)."""
    ranks = np.arange(1, vocab - first + 1, dtype=np.float64)
    p = ranks ** -exponent
    order = np.random.default_rng(1234).permutation(vocab - first) + first
    return order[rng.choice(len(ranks), size=count, p=p / p.sum())]


def bert_ids(rng, batch: int = 32, seq: int = 128, vocab: int = 30522) -> np.ndarray:
    """b x s token ids: [CLS] (101), word pieces, [SEP] (102), [PAD] (0) to the end."""
    ids = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        length = int(rng.integers(seq // 4, seq + 1))
        ids[row, 0], ids[row, length - 1] = 101, 102
        ids[row, 1:length - 1] = zipf_ids(rng, length - 2, vocab, first=999)
    return ids.reshape(-1, 1)


def benchmarks() -> list[dict]:
    """BERT-base's embedding gradient (data [30522, 768], indices [4096, 1] of b32 s128 token ids:
    a few rows take hundreds of updates), GPT-2's ([50257, 768], [2048, 1], Zipf), and a worst
    case with every index equal; float32."""
    rng = np.random.default_rng(5)
    specs = [("bert-base b32 s128", 30522, 768, bert_ids(rng)),
             ("gpt2 b16 s128", 50257, 768, zipf_ids(rng, 2048, 50257).reshape(-1, 1)),
             ("bert-base shape, every index equal", 30522, 768, np.full((4096, 1), 1037, np.int64))]
    out = []
    for name, vocab, width, indices in specs:
        updates = (rng.standard_normal((len(indices), width)) * 1e-2).astype(np.float32)
        unique, counts = np.unique(indices, return_counts=True)
        out.append({"name": name, "data": np.zeros((vocab, width), np.float32), "indices": indices.astype(np.int64),
                    "updates": updates, "distinct_rows": int(len(unique)), "max_duplicates": int(counts.max())})
    return out
