"""``ai.onnxcampo::MultiTensorCast`` on CUDA against numpy bit for bit, and timed against one ONNX
Runtime ``Cast`` per tensor on the weights of GPT-2 small, BERT-base and ResNet-50
(tests/gpu/conftest.py: skipped without a GPU).

1. float16 rounding of every kind (ties to even, the largest float16 and overflow to inf,
   subnormals and underflow, signed zeros, inf, NaN) and tensors of 1 to 10^6 + 3 elements in one
   call (the kernel's vector path on 16-byte aligned tensors, its element path on their last
   elements), plain and replayed as a CUDA graph: ``numpy.astype(float16)`` bit for bit (NaN: any
   NaN).
2. Each weight set (the shapes of the model's float32 parameters) cast by one MultiTensorCast and
   by one Cast node per tensor, plain and replayed (what the Trainer runs), timed side by side;
   both give the same values.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo.ops import nodes

SPECIALS = np.array([0.0, -0.0, 1.0, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 65504.0, 65519.99, 65520.0, -7e4,
                     2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 6e-8, 1e-30, np.inf, -np.inf, np.nan], np.float32)
SIZES = [1, 7, 8, 9, 4099, 8192, 8193, 100_003, 1_000_003]


def weight_sets() -> dict[str, list[tuple[int, ...]]]:
    """The float32 parameter shapes of the three benchmark models (the Casts a campo step runs)."""
    gpt2 = [(50257, 768), (1024, 768)]
    for _ in range(12):
        gpt2 += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,),
                 (3072, 768), (768,)]
    gpt2 += [(768,), (768,), (768, 50257)]
    bert = [(30522, 768), (512, 768), (2, 768), (768,), (768,)]
    for _ in range(12):
        bert += [(768, 768), (768,)] * 4 + [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
    bert += [(768, 768), (768,), (768, 2), (2,)]
    resnet = [(64, 3, 7, 7), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            resnet += [(planes, inplanes, 1, 1), (planes,), (planes, planes, 3, 3), (planes,), (planes * 4, planes, 1, 1),
                       (planes * 4,)]
            if b == 0:
                resnet += [(planes * 4, inplanes, 1, 1), (planes * 4,)]
            inplanes = planes * 4
    resnet += [(1000, 2048), (1000,)]
    return {"gpt2": gpt2, "bert": bert, "resnet50": resnet}


def cast_model(shapes, *, separate: bool) -> onnx.ModelProto:
    xs, ys = [f"x{k}" for k in range(len(shapes))], [f"y{k}" for k in range(len(shapes))]
    if separate:
        made = [helper.make_node("Cast", [x], [y], to=TensorProto.FLOAT16) for x, y in zip(xs, ys)]
    else:
        made = [nodes.multi_tensor_cast(xs, ys, name="cast")]
    graph = helper.make_graph(made, "casts", [helper.make_tensor_value_info(x, TensorProto.FLOAT, s) for x, s in zip(xs, shapes)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT16, s) for y, s in zip(ys, shapes)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def same(got: np.ndarray, want: np.ndarray) -> bool:
    nan = np.isnan(want)
    return got.shape == want.shape and bool(np.array_equal(np.isnan(got), nan)) and bool(
        np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16)))


@pytest.mark.parametrize("replayed", [False, True], ids=["plain", "replayed"])
def test_every_rounding_and_size_equals_numpy_bit_for_bit(device, replayed):
    rng = np.random.default_rng(0)
    arrays = [SPECIALS] + [(rng.standard_normal(n) * rng.choice([1e-6, 1.0, 3e4])).astype(np.float32) for n in SIZES]
    with np.errstate(over="ignore"):
        want = [a.astype(np.float16) for a in arrays]
    feeds = {f"x{k}": a for k, a in enumerate(arrays)}
    got = device.run(cast_model([a.shape for a in arrays], separate=False), feeds, cuda_graph=replayed)
    bad = [int(a.size) for k, (a, w) in enumerate(zip(arrays, want)) if not same(got[f"y{k}"], w)]
    assert not bad, f"tensors of these sizes differ from numpy: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("label", list(weight_sets()))
def test_one_multi_tensor_cast_timed_against_a_cast_per_tensor(device, results, label):
    shapes = weight_sets()[label]
    rng = np.random.default_rng(1)
    feeds = {f"x{k}": rng.standard_normal(s).astype(np.float32) for k, s in enumerate(shapes)}
    runners = {f"{kind}{'-graph' if graph else ''}": device.bound(cast_model(shapes, separate=kind == "casts"), feeds,
                                                                   cuda_graph=graph)
               for kind in ("multi", "casts") for graph in ((True, False) if device.cuda else (False,))}
    figures = device.time(runners, rounds=5)
    multi, casts = runners["multi"].outputs(), runners["casts"].outputs()
    results.record(tensors=len(shapes), elements=int(sum(int(np.prod(s)) for s in shapes)), timing=figures)
    assert all(same(multi[k], casts[k]) for k in multi)
