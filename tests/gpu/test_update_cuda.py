"""The update that unscales the gradients itself (``CheckFinite``, then ``MultiTensorSGD`` /
``MultiTensorAdamW`` with ``unscale=1``) against ``UnscaleCheckFinite`` followed by the plain update,
on CUDA (tests/gpu/conftest.py: skipped without a GPU).

1. Small mixed lists (float16 and float32 gradients, empty tensors, an injected inf or NaN):
   found_inf the same, and every output of the update bit for bit the same, momentum SGD, plain
   SGD and AdamW, plain run and CUDA-graph replay.
2. GPT-2 small's parameter list (163M weights with its untied LM head; matrices' gradients
   float16, vectors' float32, as campo's step has them), momentum SGD: the same checks, then both
   forms replayed and timed side by side.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo.ops import nodes

TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}
SMALL = [((7, 5), np.float16), ((0,), np.float32), ((33,), np.float16), ((4, 3, 2, 2), np.float32),
         ((1000, 17), np.float16), ((1,), np.float32)]
FORMS = ("unscale_then_update", "check_and_unscaling_update")


def gpt2_shapes() -> list[tuple[tuple[int, ...], type]]:
    """GPT-2 small's weights (untied LM head): matrices with float16 gradients, vectors float32."""
    d, vocab = 768, 50257
    shapes = [((vocab, d), np.float16), ((1024, d), np.float16)]
    for _ in range(12):
        shapes += [((d,), np.float32)] * 2 + [((d, 3 * d), np.float16), ((3 * d,), np.float32),
                                              ((d, d), np.float16), ((d,), np.float32)]
        shapes += [((d,), np.float32)] * 2 + [((d, 4 * d), np.float16), ((4 * d,), np.float32),
                                              ((4 * d, d), np.float16), ((d,), np.float32)]
    return shapes + [((d,), np.float32)] * 2 + [((d, vocab), np.float16)]


def update_models(shapes, optimizer: str) -> tuple[dict[str, onnx.ModelProto], dict]:
    """The two forms of a loss-scaled update over ``shapes`` (name -> model), and their inputs
    (name -> (ONNX type, shape))."""
    n = len(shapes)
    g, w = [f"g{i}" for i in range(n)], [f"w{i}" for i in range(n)]
    m, v = [f"m{i}" for i in range(n)], [f"v{i}" for i in range(n)]
    inputs = {"inv_scale": (TensorProto.FLOAT, []), "lr": (TensorProto.FLOAT, [])}
    inputs.update({x: (TYPES[np.dtype(t)], list(s)) for x, (s, t) in zip(g, shapes)})
    inputs.update({x: (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(w, shapes)})
    outputs = {"found_inf": (TensorProto.BOOL, [])}
    outputs.update({x + "'": (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(w, shapes)})
    if optimizer in ("momentum", "adamw"):
        inputs.update({x: (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(v, shapes)})
        outputs.update({x + "'": (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(v, shapes)})
    if optimizer == "adamw":
        inputs["step"] = (TensorProto.FLOAT, [])
        inputs.update({x: (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(m, shapes)})
        outputs.update({x + "'": (TensorProto.FLOAT, list(s)) for x, (s, _) in zip(m, shapes)})
        outputs["step'"] = (TensorProto.FLOAT, [])

    def update(grads, inv_scale):
        if optimizer == "adamw":
            return nodes.multi_tensor_adamw("lr", "step", "found_inf", w, grads, m, v, step_output="step'",
                                            outputs=[x + "'" for x in w], m_outputs=[x + "'" for x in m],
                                            v_outputs=[x + "'" for x in v], betas=(0.9, 0.999), eps=1e-8,
                                            weight_decay=0.01, inv_scale=inv_scale, name="update")
        velocities = v if optimizer == "momentum" else ()
        return nodes.multi_tensor_sgd("lr", "found_inf", w, grads, velocities, outputs=[x + "'" for x in w],
                                      velocity_outputs=[x + "'" for x in velocities], momentum=0.9,
                                      inv_scale=inv_scale, name="update")

    u = [f"u{i}" for i in range(n)]
    forms = {"unscale_then_update": [nodes.unscale_check_finite("inv_scale", g, found_inf="found_inf", outputs=u,
                                                                 name="unscale"), update(u, None)],
             "check_and_unscaling_update": [nodes.check_finite(g, found_inf="found_inf", name="check"),
                                            update(g, "inv_scale")]}
    made = {}
    for name, graph_nodes in forms.items():
        graph = helper.make_graph(graph_nodes, name, [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                                  [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
        nodes.import_domain(model)
        made[name] = model
    return made, inputs


def update_feeds(inputs: dict, rng, bad=None) -> dict[str, np.ndarray]:
    feeds = {}
    for name, (t, shape) in inputs.items():
        dtype = helper.tensor_dtype_to_np_dtype(t)
        if name == "inv_scale":
            feeds[name] = np.array(2.0 ** -13, np.float32)
        elif name == "lr":
            feeds[name] = np.array(0.01, np.float32)
        elif name == "step":
            feeds[name] = np.array(5.0, np.float32)
        elif name.startswith("g"):
            feeds[name] = (rng.standard_normal(shape) * 4096).astype(dtype)
        elif name.startswith("v") and "step" in inputs:
            feeds[name] = rng.uniform(0, 0.1, shape).astype(dtype)
        else:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
    if bad is not None:
        feeds["g0"].flat[0] = bad
    return feeds


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _both_forms_agree(device, shapes, optimizer, bad=None) -> None:
    made, inputs = update_models(shapes, optimizer)
    feeds = update_feeds(inputs, np.random.default_rng(len(shapes)), bad)
    got = {}
    for name, model in made.items():
        got[name] = device.run(model, feeds)
        if device.cuda:
            got[f"{name}, replayed"] = device.run(model, feeds, cuda_graph=True)
    want = got["unscale_then_update"]
    differ = {name: sorted(k for k in want if not np.array_equal(_bits(out[k]), _bits(want[k])))[:5]
              for name, out in got.items()}
    assert not any(differ.values()), differ
    assert bool(want["found_inf"]) == (bad is not None)


@pytest.mark.parametrize("bad", [None, np.inf, np.nan], ids=["clean", "inf", "nan"])
@pytest.mark.parametrize("optimizer", ["momentum", "sgd", "adamw"])
def test_the_unscaling_update_equals_unscale_then_update_bit_for_bit(device, optimizer, bad):
    _both_forms_agree(device, SMALL, optimizer, bad)


@pytest.mark.slow
def test_the_two_forms_agree_on_gpt2_small(device):
    _both_forms_agree(device, gpt2_shapes(), "momentum")


@pytest.mark.slow
def test_the_two_forms_timed_on_gpt2_small(device, results):
    shapes = gpt2_shapes()
    made, inputs = update_models(shapes, "momentum")
    feeds = update_feeds(inputs, np.random.default_rng(0))
    runners = {name: device.bound(model, feeds, cuda_graph=True) for name, model in made.items()}
    results.record(tensors=len(shapes), elements=sum(int(np.prod(s)) for s, _ in shapes),
                   timing=device.time(runners, rounds=5))
