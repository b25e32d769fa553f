"""``ai.onnxcampo::BlockReduceSum`` on CUDA against numpy float64 sums, and timed against ONNX
Runtime's ReduceSum on the training steps' shapes (tests/gpu/conftest.py: skipped without a GPU).

Checks, for float16 and float32 inputs and outputs, on shapes that take each kernel and vector
width (R == 1, P == 1, long and short rows, odd sizes, empty tensors, a Q of 100003):

- integer-valued inputs (|x| <= 8), whose float32 sums are exact in any order: the output equals
  the float64 sum (float32 output) or that sum rounded once to float16;
- normal random inputs: within the float32 bound ``P*R * 2^-24 * sum|x|`` of the float64 sum and
  within ``rtol 1e-4`` (what random terms give), and two runs equal bit for bit;
- the node replayed as a CUDA graph (its workspace comes from ORT's arena while the graph is
  captured) gives the plain run's bits.

Timing, per shape: ORT's ReduceSum float16 -> float16, float32 -> float32 and Cast float16 ->
float32 + ReduceSum (for ``[N, C, HW]`` shapes the ReduceSum pair over HW then N that simplify
rule 7 writes, and the single ReduceSum over (0, 2) as well) against BlockReduceSum float16 ->
float16, float32 -> float32 and float16 -> float32. Each variant is one model of ``COPIES``
independent copies (distinct inputs, read from memory, not from the L2), timed plain and replayed
as a CUDA graph (the replay's time is the GPU's, free of the host's launches); the figures are
per model run (divide by ``copies`` for one reduction). Every variant must agree with the float64
sum of its input within float32 rounding (float16 outputs: one float16 step).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.ops import nodes

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
NP = {FLOAT: np.float32, FLOAT16: np.float16}
NAME = {FLOAT: "f32", FLOAT16: "f16"}
TYPES = [(FLOAT16, FLOAT16), (FLOAT16, FLOAT), (FLOAT, FLOAT16), (FLOAT, FLOAT)]
TYPE_IDS = [f"{NAME[a]}-{NAME[b]}" for a, b in TYPES]
COPIES = 8

CHECKED = [  # (P, Q, R)
    (4096, 768, 1), (4096, 3072, 1), (2048, 768, 1), (64, 256, 3136), (64, 2048, 49), (64, 64, 12544),
    (1, 1, 1), (5, 3, 1), (33, 70, 1), (7, 13, 1), (3, 100003, 1), (100000, 3, 1), (8192, 1, 1),
    (1, 5, 9), (1, 768, 4096), (1, 64, 77), (1, 2, 1000000), (4, 16, 49), (3, 7, 12544), (2, 9, 196),
    (6, 5, 3), (2, 70001, 2), (130, 6, 8), (64, 512, 196), (64, 1024, 196), (64, 512, 784),
    (0, 4, 3), (3, 0, 5), (2, 3, 0),
]
# (label, tensor shape, reduced axes): BERT-base b32 s128 and GPT-2 b8 s256 bias / LayerNorm-scale
# gradients, ResNet-50 b64 Conv-bias gradients
TIMED = [
    ("bert-768", (4096, 768), (0,)),
    ("bert-3072", (4096, 3072), (0,)),
    ("gpt2-768", (2048, 768), (0,)),
    ("gpt2-3072", (2048, 3072), (0,)),
    ("resnet-256x56x56", (64, 256, 56 * 56), (0, 2)),
    ("resnet-2048x7x7", (64, 2048, 49), (0, 2)),
    ("resnet-64x112x112", (64, 64, 112 * 112), (0, 2)),
]


def _model(graph_nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(graph_nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _value(name, elem_type, shape):
    return helper.make_tensor_value_info(name, elem_type, list(shape))


def _is_slow(sizes) -> bool:
    return int(np.prod(sizes)) > 1 << 20


@pytest.mark.parametrize("in_type, out_type", TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("sizes", [pytest.param(s, marks=pytest.mark.slow) if _is_slow(s) else s for s in CHECKED],
                         ids=["x".join(map(str, s)) for s in CHECKED])
def test_sums_are_exact_float32_accurate_reproducible_and_replay(device, sizes, in_type, out_type):
    p, q, r = sizes
    count = p * q * r
    node = nodes.block_reduce_sum("x", output="y", sizes=sizes, output_type=out_type, name="reduce")
    model = _model([node], [_value("x", in_type, [count])], [_value("y", out_type, [q])])
    rng = np.random.default_rng(count + q + in_type + 3 * out_type)
    # exact: integers
    x = rng.integers(-8, 9, size=count).astype(NP[in_type])
    want = x.astype(np.float64).reshape(p, q, r).sum(axis=(0, 2)).astype(NP[out_type])
    got = device.run(model, {"x": x})["y"]
    assert np.array_equal(got, want, equal_nan=True), "integer sums are exact in any order"
    # random: float32 accuracy, reproducible bits
    x = (rng.standard_normal(count) * 3).astype(NP[in_type])
    runner = device.bound(model, {"x": x})
    runner()
    first = runner.outputs()["y"]
    runner()
    second = runner.outputs()["y"]
    exact = x.astype(np.float64).reshape(p, q, r)
    total = exact.sum(axis=(0, 2))
    error = np.abs(first.astype(np.float64) - total)
    bound = p * r * 2.0 ** -24 * np.abs(exact).sum(axis=(0, 2))
    if out_type == FLOAT16:
        bound = bound + np.abs(total) * 2.0 ** -11 + 2.0 ** -25
    tolerance = (2.0 ** -10 if out_type == FLOAT16 else 1e-4) * np.abs(total) + 1e-3 * np.sqrt(max(p * r, 1))
    assert np.all(error <= bound), f"{int(np.sum(error > bound))} sums off the float32 bound"
    assert np.all(error <= tolerance), f"max error {error.max(initial=0.0)}"
    assert np.array_equal(first.view(np.uint8), second.view(np.uint8)), "two runs differ"
    if count > 0 and q > 0:
        replayed = device.run(model, {"x": x}, cuda_graph=True)["y"]
        assert np.array_equal(replayed.view(np.uint8), first.view(np.uint8)), "the replay differs from the plain run"


def sizes_of(shape, axes) -> tuple[int, int, int]:
    """(P, Q, R) of a reduction over a leading and/or trailing block."""
    kept = [i for i in range(len(shape)) if i not in axes]
    p = int(np.prod(shape[:kept[0]])) if kept else int(np.prod(shape))
    q = int(np.prod([shape[i] for i in kept]))
    r = int(np.prod(shape[kept[-1] + 1:])) if kept else 1
    return p, q, r


def ort_nodes(x: str, y: str, axes, in_type: int, out_type: int, tag: str, pair: bool):
    """ORT's reduction of ``x`` (a Cast to float32 first when ``in_type`` is float16 and
    ``out_type`` float32): one ReduceSum over ``axes``, or with ``pair`` (3-D, axes (0, 2)) the
    ReduceSum over axis 2 then over axis 0 that simplify rule 7 writes."""
    made, constants = [], []
    source = x
    if in_type != out_type:
        made.append(helper.make_node("Cast", [x], [f"c{tag}"], name=f"cast{tag}", to=int(out_type)))
        source = f"c{tag}"
    if pair:
        constants += [numpy_helper.from_array(np.array([2], np.int64), f"a2{tag}"),
                      numpy_helper.from_array(np.array([0], np.int64), f"a0{tag}")]
        made.append(helper.make_node("ReduceSum", [source, f"a2{tag}"], [f"m{tag}"], name=f"sum2{tag}", keepdims=0))
        made.append(helper.make_node("ReduceSum", [f"m{tag}", f"a0{tag}"], [y], name=f"sum0{tag}", keepdims=0))
    else:
        constants.append(numpy_helper.from_array(np.array(axes, np.int64), f"a{tag}"))
        made.append(helper.make_node("ReduceSum", [source, f"a{tag}"], [y], name=f"sum{tag}", keepdims=0))
    return made, constants


def variants(shape):
    """(name, kind, in type, out type, pair) of the timed variants of one shape."""
    three = len(shape) == 3
    out = []
    for in_type, out_type in ((FLOAT16, FLOAT16), (FLOAT, FLOAT), (FLOAT16, FLOAT)):
        label = f"{NAME[in_type]}_{NAME[out_type]}"
        out.append((f"ort_{label}" + ("_pair" if three else ""), "ort", in_type, out_type, three))
        if three:
            out.append((f"ort_{label}_single", "ort", in_type, out_type, False))
        out.append((f"block_{label}", "block", in_type, out_type, False))
    return out


def timed_model(kind, shape, axes, in_type, out_type, pair) -> onnx.ModelProto:
    p, q, r = sizes_of(shape, axes)
    made, constants, inputs, outputs = [], [], [], []
    for k in range(COPIES):
        x, y = f"x{k}", f"y{k}"
        inputs.append(_value(x, in_type, shape))
        outputs.append(_value(y, out_type, [q]))
        if kind == "block":
            made.append(nodes.block_reduce_sum(x, output=y, sizes=(p, q, r), output_type=out_type, name=f"block{k}"))
        else:
            more, values = ort_nodes(x, y, list(axes), in_type, out_type, str(k), pair)
            made += more
            constants += values
    return _model(made, inputs, outputs, constants)


@pytest.mark.slow
@pytest.mark.parametrize("label, shape, axes", TIMED, ids=[t[0] for t in TIMED])
def test_block_reduce_sum_timed_against_ort_reduce_sum(device, results, label, shape, axes):
    p, q, r = sizes_of(shape, axes)
    base = (np.random.default_rng(7).standard_normal(shape) * 0.25).astype(np.float32)
    copies = {t: [(base + np.float32(k) * np.float32(2.0 ** -8)).astype(NP[t]) for k in range(COPIES)]
              for t in (FLOAT, FLOAT16)}  # the same values in both types, one distinct copy per model input
    runners, made = {}, {}
    for name, kind, in_type, out_type, pair in variants(shape):
        model = timed_model(kind, shape, axes, in_type, out_type, pair)
        feeds = {f"x{k}": copies[in_type][k] for k in range(COPIES)}
        made[name] = (in_type, out_type)
        runners[f"{name}/plain"] = device.bound(model, feeds)
        if device.cuda:
            runners[f"{name}/graph"] = device.bound(model, feeds, cuda_graph=True)
    figures = device.time(runners, rounds=7)
    # every variant against the float64 sum of its own input values
    agreement = {}
    for key, runner in runners.items():
        in_type, out_type = made[key.split("/")[0]]
        values = copies[in_type][0].astype(np.float64).reshape(p, q, r)
        scale = max(float(np.abs(values).sum(axis=(0, 2)).max()), 1e-30)
        error = np.abs(runner.outputs()["y0"].astype(np.float64) - values.sum(axis=(0, 2))) / scale
        agreement[key] = float(error.max())
    read = {name: base.size * np.dtype(NP[in_type]).itemsize * COPIES for name, (in_type, _) in made.items()}
    GBps = {key: read[key.split("/")[0]] / (figures[key]["ms"] * 1e-3) / 1e9 for key in figures}
    results.record(shape=list(shape), axes=list(axes), sizes=[p, q, r], copies=COPIES, timing=figures,
                   GBps=GBps, max_rel_error=agreement)
    for key, error in agreement.items():
        assert error <= (2.0 ** -10 if made[key.split("/")[0]][1] == FLOAT16 else 1e-4), (key, error)
