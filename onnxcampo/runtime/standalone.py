"""Sessions for scripts that run where onnxcampo is not installed: a model (bytes or a path) with
the custom-op library registered, on one provider.

Imports nothing of onnxcampo (nor onnx), on purpose: ``scripts/check_fused_elementwise_cuda.py``,
``scripts/check_reduce_cuda.py`` and ``scripts/check_scatter_cuda.py`` run on the GPU machine
without onnxcampo installed and load this file by its path, so that this package stays the only
code that creates ONNX Runtime sessions.
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
