"""Check, on a GPU, the fused update that unscales the gradients itself (CheckFinite, then
MultiTensorSGD / MultiTensorAdamW with ``unscale=1``) against UnscaleCheckFinite followed by the
plain update, and time the two in rotation.

1. Small mixed lists (float16 and float32 gradients, empty tensors, an injected inf or NaN):
   found_inf the same, and every output of the update bit for bit the same, momentum SGD, plain
   SGD and AdamW, plain run and CUDA-graph replay.
2. GPT-2 small's parameter list (163M weights with its untied LM head; matrices' gradients
   float16, vectors' float32, as campo's step has them), momentum SGD: the same checks, then
   both forms replayed as CUDA graphs, timed in rotation (ms a call and CUPTI GPU ms).

    python3 scripts/check_update_cuda.py --out $OUT/checks/update.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import check_cli  # noqa: E402
from check_im2col_cuda import check  # noqa: E402
from onnxcampo.ops import nodes  # noqa: E402

PROVIDER = "cuda"
TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
         np.dtype(bool): TensorProto.BOOL}
SMALL = [((7, 5), np.float16), ((0,), np.float32), ((33,), np.float16), ((4, 3, 2, 2), np.float32),
         ((1000, 17), np.float16), ((1,), np.float32)]


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


def models(shapes, optimizer: str) -> dict[str, tuple[bytes, list[str]]]:
    """The two forms of a loss-scaled update over ``shapes``: name -> (model, output names)."""
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
        graph = helper.make_graph(graph_nodes, name,
                                  [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                                  [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
        nodes.import_domain(model)
        made[name] = (model.SerializeToString(), {k: (s, helper.tensor_dtype_to_np_dtype(t))
                                                  for k, (t, s) in outputs.items()}, inputs)
    return made


def feeds_for(inputs: dict, shapes, rng, bad=None) -> dict[str, np.ndarray]:
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
    return a.view({2: np.uint16, 4: np.uint32, 1: np.uint8}[a.dtype.itemsize])


def compare(shapes, optimizer, library, rng, bad=None, replay=True) -> dict:
    made = models(shapes, optimizer)
    feeds = feeds_for(next(iter(made.values()))[2], shapes, rng, bad)
    results = {}
    for name, (model, outputs, _) in made.items():
        session = check_cli.bound(model, library, PROVIDER, feeds, outputs)
        session.run()
        results[name] = session.results()
        if replay and PROVIDER == "cuda":
            replayed = check_cli.bound(model, library, PROVIDER, feeds, outputs, cuda_graph=True)
            for _ in range(3):
                replayed.run()
            results[name + "_replayed"] = replayed.results()
    want = results["unscale_then_update"]
    differ = {name: sorted(k for k in want if not np.array_equal(_bits(got[k]), _bits(want[k])))
              for name, got in results.items()}
    flagged = bool(want["found_inf"])
    ok = all(not d for d in differ.values()) and flagged == (bad is not None)
    return {"ok": ok, "found_inf": flagged, "differ": {k: v[:5] for k, v in differ.items() if v}}


def small_checks(results, library, rng) -> None:
    for optimizer in ("momentum", "sgd", "adamw"):
        for bad in (None, np.inf, np.nan):
            check(f"small list, {optimizer}, {'clean' if bad is None else f'g0 holds {bad}'}: the two forms bit "
                  "for bit, plain and replayed", lambda o=optimizer, b=bad: compare(SMALL, o, library, rng, b), results)


def gpt2_checks(results, library, rng, rounds: int, runs: int) -> dict:
    shapes = gpt2_shapes()
    elements = sum(int(np.prod(s)) for s, _ in shapes)
    check(f"GPT-2 small's {len(shapes)} weights ({elements / 1e6:.1f}M), momentum SGD: the two forms bit for bit",
          lambda: compare(shapes, "momentum", library, rng), results)
    timing = {"tensors": len(shapes), "elements": elements}

    def timed():
        made = models(shapes, "momentum")
        feeds = feeds_for(next(iter(made.values()))[2], shapes, rng)
        sessions = {name: check_cli.bound(model, library, PROVIDER, feeds, outputs, cuda_graph=True)
                    for name, (model, outputs, _) in made.items()}
        timing.update(check_cli.timed({name: s.run for name, s in sessions.items()}, rounds, runs, PROVIDER))
        return {"ok": True, "device_ms": timing["device_ms"]}
    check("GPT-2 small momentum SGD: UnscaleCheckFinite + MultiTensorSGD against CheckFinite + MultiTensorSGD "
          "unscale=1, replayed, in rotation", timed, results)
    return timing


def main(argv: list[str] | None = None) -> int:
    global PROVIDER
    args = check_cli.parser(__doc__, rounds=5).parse_args(argv)
    library = check_cli.open_library(args)
    if library is None:
        return 2
    PROVIDER = args.provider
    rng = np.random.default_rng(0)
    results: list = []
    small_checks(results, library, rng)
    timing = None if args.quick else gpt2_checks(results, library, rng, args.rounds, args.runs)
    status = check_cli.report(args, results, {"gpt2_momentum": timing})
    if timing and "check_and_unscaling_update" in timing:
        print(f"GPT-2 small momentum SGD, ms a call: UnscaleCheckFinite + update {timing['unscale_then_update']:.4f}, "
              f"CheckFinite + update unscale=1 {timing['check_and_unscaling_update']:.4f}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
