"""Check the Trainer's CUDA paths on a GPU: CUDA-graph replay and batches already on the device.

Run on a CUDA machine (needs onnxruntime-gpu, numpy and this repository installed; torch and
CuPy are optional, their variants are skipped without them):

    python3 scripts/check_trainer_device.py --out results.json

One step graph (``wide_mlp`` 256x512 -> 64, mse, AdamW, standard ops unless --fused-ops) is
trained for --steps steps from the same weights on the same batches by one Trainer per variant:

- numpy batches, cuda_graph False (the reference) / True / None (the default: must pick True);
- OrtValue batches already in CUDA memory, cuda_graph False / True;
- torch CUDA tensors, cuda_graph False / True; torch tensors written on a side stream just
  before each step after a ~1 ms stall (the Trainer must wait for that stream; its times include
  the stall); torch tensors seen through DLPack alone (``OrtValue.from_dlpack``);
- CuPy arrays, cuda_graph False / True.

It prints (and with --out writes) JSON: per variant whether the steps were CUDA graphs, how each
batch value was read (DeviceArray: by pointer, OrtValue, host array), the losses, the largest
loss and weight differences to the reference, and the step times (median after the captures).
It also checks that wrong device batches are one-line ConfigErrors. Exit 1 on any mismatch or
error, 2 when the CUDA EP is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import onnxruntime as ort

from onnxcampo.errors import ConfigError
from onnxcampo.examples.training_mlp import wide_mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights
from onnxcampo.training.batches import DeviceArray, batch_value
from onnxcampo.training.trainer import CAPTURE_STEPS


def _optional(name):
    try:
        return __import__(name)
    except Exception:  # not installed, or no GPU build: its variants are skipped
        return None


def _how(trainer, batch) -> dict[str, str]:
    """How the Trainer reads each batch value (DeviceArray: by pointer, no host copy)."""
    return {name: type(batch_value(trainer.inputs[name], value)).__name__ for name, value in batch.items()}


def _train(step, weights, batches, cuda_graph, convert, side_stream=None):
    trainer = Trainer(step, weights={k: v.copy() for k, v in weights.items()}, provider="cuda", cuda_graph=cuda_graph)
    prepared = [convert(batch) for batch in batches]  # on the device before the clock starts
    losses, times = [], []
    how = _how(trainer, prepared[0])
    for batch in prepared:
        if side_stream is not None:
            batch = side_stream(batch)  # made just now, on another stream
        start = time.perf_counter()
        losses.append(trainer.step(batch))
        times.append(1e3 * (time.perf_counter() - start))
    return trainer, losses, times, how


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference accepted")
    parser.add_argument("--fused-ops", action="store_true", help="the update as the ai.onnxcampo fused op "
                        "(needs the custom-op library built with CUDA kernels)")
    args = parser.parse_args(argv)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider: run on a CUDA machine", file=sys.stderr)
        return 2
    torch = _optional("torch")
    if torch is not None and not torch.cuda.is_available():
        torch = None
    cupy = _optional("cupy")

    forward = wide_mlp()
    step = build_train_step(forward, loss="mse", optimizer="adamw", lr=1e-3, fused=None if args.fused_ops else False)
    weights = initial_weights(forward, step)
    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((256, 512)).astype(np.float32),
                "labels": rng.standard_normal((256, 64)).astype(np.float32)} for _ in range(args.steps)]

    variants = {
        "numpy/plain": (False, lambda b: b, None),
        "numpy/graph": (True, lambda b: b, None),
        "numpy/default": (None, lambda b: b, None),
        "ortvalue/plain": (False, lambda b: {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in b.items()}, None),
        "ortvalue/graph": (True, lambda b: {k: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for k, v in b.items()}, None),
    }
    if torch is not None:
        def to_torch(b):
            return {k: torch.from_numpy(v).cuda() for k, v in b.items()}

        class DLPackOnly:  # CUDA memory seen through DLPack alone (read by OrtValue.from_dlpack)
            def __init__(self, tensor):
                self._tensor = tensor

            def __dlpack__(self, **options):
                return self._tensor.__dlpack__(**options)

            def __dlpack_device__(self):
                return self._tensor.__dlpack_device__()

        def to_dlpack_only(b):
            return {k: DLPackOnly(v) for k, v in to_torch(b).items()}

        stream = torch.cuda.Stream()

        def on_side_stream(b):  # written on a side stream after a ~1 ms stall, not waited for here
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                if hasattr(torch.cuda, "_sleep"):
                    torch.cuda._sleep(2_000_000)
                return {k: (v * 2.0) * 0.5 for k, v in b.items()}

        variants.update({"torch/plain": (False, to_torch, None), "torch/graph": (True, to_torch, None),
                         "torch-side-stream/plain": (False, to_torch, on_side_stream),
                         "torch-side-stream/graph": (True, to_torch, on_side_stream),
                         "dlpack/plain": (False, to_dlpack_only, None), "dlpack/graph": (True, to_dlpack_only, None)})
    if cupy is not None:
        def to_cupy(b):
            return {k: cupy.asarray(v) for k, v in b.items()}

        variants.update({"cupy/plain": (False, to_cupy, None), "cupy/graph": (True, to_cupy, None)})

    results: dict = {"onnxruntime": ort.__version__, "torch": getattr(torch, "__version__", None),
                     "cupy": getattr(cupy, "__version__", None), "steps": args.steps, "rtol": args.rtol,
                     "fused_ops": args.fused_ops, "variants": {}, "checks": {}}
    reference = None
    ok = True
    for name, (cuda_graph, convert, side) in variants.items():
        entry = {"asked": cuda_graph}
        try:
            trainer, losses, times, how = _train(step, weights, batches, cuda_graph, convert, side)
            state = trainer.state_dict()
            settled = times[CAPTURE_STEPS:] or times
            entry.update(cuda_graph=trainer.cuda_graph, read_as=how, losses=losses,
                         ms_per_step=[round(t, 4) for t in times], median_ms=round(statistics.median(settled), 4))
            if reference is None:
                reference = (np.array(losses), state)
            gap = np.abs(np.array(losses) - reference[0])
            entry["max_abs_loss_diff"] = float(gap.max())
            entry["max_rel_loss_diff"] = float((gap / np.abs(reference[0])).max())
            entry["max_abs_weight_diff"] = max(float(np.abs(state[k] - reference[1][k]).max()) for k in state)
            wanted = cuda_graph if cuda_graph is not None else True  # static shapes on CUDA: graphs by default
            device_batch = not name.startswith("numpy")
            entry["ok"] = bool(entry["max_rel_loss_diff"] <= args.rtol and trainer.cuda_graph == wanted
                               and np.isfinite(losses).all()
                               and (not device_batch or all(v != "ndarray" for v in how.values())))
            if name.startswith(("torch", "cupy", "dlpack")):
                from onnxcampo.runtime.cudart import cuda_runtime

                results["cudart"] = cuda_runtime().where
        except Exception as exc:
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        ok &= entry["ok"]
        results["variants"][name] = entry

    if torch is not None:  # wrong device batches: one line each, before any CUDA call
        trainer = Trainer(step, weights=weights, provider="cuda")
        good = {k: torch.from_numpy(v).cuda() for k, v in batches[0].items()}
        cases = {"float64": {**good, "x": good["x"].double()},
                 "transposed": {**good, "x": torch.zeros(512, 256, device="cuda").t()},
                 "requires_grad": {**good, "x": good["x"].clone().requires_grad_()}}
        for case, batch in cases.items():
            try:
                trainer.step(batch)
                results["checks"][case] = {"ok": False, "error": "accepted"}
            except ConfigError as exc:
                results["checks"][case] = {"ok": True, "message": str(exc)}
            except Exception as exc:
                results["checks"][case] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            ok &= results["checks"][case]["ok"]
        results["checks"]["read_as"] = {k: type(batch_value(trainer.inputs[k], v)).__name__ for k, v in good.items()}
        ok &= all(isinstance(batch_value(trainer.inputs[k], v), DeviceArray) for k, v in good.items())

    results["ok"] = bool(ok)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    for name, entry in results["variants"].items():
        summary = entry.get("error") or (f"graph={entry['cuda_graph']} rel diff {entry['max_rel_loss_diff']:.2e} "
                                         f"median {entry['median_ms']:.3f} ms")
        print(f"{'ok  ' if entry['ok'] else 'FAIL'} {name:26s} {summary}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
