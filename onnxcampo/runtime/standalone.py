"""Sessions of a model (bytes or a path) with the custom-op library registered, on one provider,
bound once, and timed side by side; the GPU kernel time of a call as CUPTI sees it.

Imports nothing of onnxcampo (nor onnx): the benchmark harness's probes make their sessions here
from a path and a library file alone; the GPU tests take their CUPTI times from here.
"""

from __future__ import annotations

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider"]}  # no CPU fallback on cuda (below)


def custom_op_session(model: bytes | str, library: str, provider: str = "cpu", *, intra_op_threads: int | None = None,
                      cuda_graph: bool = False):
    """An ``onnxruntime.InferenceSession`` of ``model`` with ``library`` registered. On
    ``"cuda"`` the CPU fallback is disabled: a node that CUDA cannot run fails the session
    instead of running on the CPU unnoticed. ``cuda_graph`` (cuda only): the CUDA EP captures a
    run into a CUDA graph and replays it (``enable_cuda_graph``; inputs and outputs bound with IO
    binding at fixed addresses)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.register_custom_ops_library(library)
    options.log_severity_level = 3
    if provider == "cuda":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    if cuda_graph and provider != "cuda":
        raise ValueError(f"CUDA graphs need provider 'cuda', not '{provider}'")
    providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"})] if cuda_graph else PROVIDERS[provider]
    session = onnxruntime.InferenceSession(model, options, providers=providers)
    if provider == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
        raise RuntimeError(f"CUDAExecutionProvider is not available (providers {session.get_providers()})")
    return session


def cuda_kernel_times(fn, runs: int) -> list[tuple[str, float, float]] | None:
    """``(kernel, device us per call, launches per call)`` of ``runs`` calls of ``fn``, largest
    first, as CUPTI sees them through torch's profiler (it sees ORT's kernels too); None without
    torch or CUDA, or when the profiler does not answer (no figure rather than a failure)."""
    import os
    import sys

    try:
        import torch
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
    except Exception:  # noqa: BLE001 - torch is optional
        return None
    if not torch.cuda.is_available():
        return None
    # detach CUPTI when the profile ends: left attached it slows every later launch of the process
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                fn()
            torch.cuda.synchronize()
        rows = []
        for entry in prof.key_averages():
            if entry.device_type == DeviceType.CUDA:  # attribute names changed across torch versions
                us = getattr(entry, "self_device_time_total", None) or getattr(entry, "self_cuda_time_total", 0.0)
                rows.append((entry.key, us / runs, entry.count / runs))
        if not any(us for _, us, _ in rows):
            return None
        return sorted(rows, key=lambda row: -row[1])
    except Exception as exc:  # noqa: BLE001
        print(f"  (CUPTI unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
              file=sys.stderr)
        return None


def gpu_time_per_call(fn, runs: int = 10) -> dict | None:
    """:func:`cuda_kernel_times` summed: ``total_ms`` and ``launches`` a call of ``fn``, and each
    kernel's ms (``kernels_ms``); None where that gives None."""
    rows = cuda_kernel_times(fn, runs)
    if rows is None:
        return None
    return {"total_ms": sum(us for _, us, _ in rows) / 1e3, "launches": sum(n for _, _, n in rows),
            "kernels_ms": {name[:100]: us / 1e3 for name, us, _ in rows}}


class BoundSession:
    """A :func:`custom_op_session` with its inputs and outputs bound once, on the device for
    ``"cuda"`` (fixed addresses, as a replayed CUDA graph needs): ``feeds`` name -> array,
    ``outputs`` name -> (shape, numpy dtype) preallocated there."""

    def __init__(self, model: bytes | str, library: str, provider: str, feeds: dict, outputs: dict, *,
                 cuda_graph: bool = False):
        import onnxruntime

        device = "cuda" if provider == "cuda" else "cpu"
        self.session = custom_op_session(model, library, provider, cuda_graph=cuda_graph)
        self.inputs = {k: onnxruntime.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in feeds.items()}
        self.outputs = {k: onnxruntime.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, 0)
                        for k, (shape, dtype) in outputs.items()}
        self.binding = self.session.io_binding()
        for k, v in self.inputs.items():
            self.binding.bind_ortvalue_input(k, v)
        for k, v in self.outputs.items():
            self.binding.bind_ortvalue_output(k, v)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def results(self) -> dict:
        return {k: v.numpy() for k, v in self.outputs.items()}


def time_in_rotation(variants: dict, rounds: int, runs: int) -> dict:
    """Median ms a call of each variant (key -> a callable), timed side by side: ``rounds`` rounds,
    each timing every variant once (:func:`median_ms` of ``runs`` calls), starting one further
    along each round so that no variant always goes first."""
    import statistics

    keys = list(variants)
    times = {key: [] for key in keys}
    for turn in range(rounds):
        for key in keys[turn % len(keys):] + keys[:turn % len(keys)]:
            times[key].append(median_ms(variants[key], runs))
    return {key: statistics.median(values) for key, values in times.items()}


def median_ms(fn, runs: int, blocks: int = 5) -> float:
    """One warm-up call of ``fn``, then the median over ``blocks`` blocks of ``runs`` calls, in ms
    a call (wall time: a run bound on the device returns once its work is queued and, for ORT's
    CUDA provider, synchronised)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(runs):
            fn()
        times.append((time.perf_counter() - start) * 1e3 / runs)
    return statistics.median(times)
