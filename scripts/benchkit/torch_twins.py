"""PyTorch training baselines: what users run instead of an ONNX training step.

The same model, batch, loss and optimizer as the ONNX step graph (cross-entropy, SGD with
momentum 0.9, lr 0.01) in four variants: eager and ``torch.compile``, each in fp32 (TF32 allowed
for matmuls and cuDNN, matching ORT's default ``use_tf32``) and with ``torch.autocast(float16)``
plus ``GradScaler``; for image models each also in ``channels_last`` (the ``-cl`` policies: the
module and the batch in NHWC memory format, PyTorch's recommended setting for convolutions on
Tensor Cores, where cuDNN needs no NCHW <-> NHWC transform around each convolution). The
``torch-compile-graph`` policies are ``torch.compile(mode="reduce-overhead")``: the compiled
forward and backward replayed as CUDA graphs (cudagraph trees; a new step marked with
``torch.compiler.cudagraph_mark_step_begin``), the SGD step and GradScaler eager around them, as
campo's ``-graph`` variants replay the ONNX step. The module runs in eval mode (frozen BatchNorm statistics, no dropout),
which is what the onnx-ad step graph computes. The batch stays on the device; the loss is read
back at the end of each timed block only (a step of the ONNX runner reads it every step).
Corpus models have no PyTorch source: their module is the ONNX file converted by onnx2torch,
training the step graph's weights (``bench_models.onnx_twin``).
"""

from __future__ import annotations

import time
from typing import Any

from benchkit.policies import Unavailable


def train(built, policy: str, *, provider: str, warmup: int, blocks: int, per_block: int,
          lr: float = 0.01, momentum: float = 0.9) -> dict[str, Any]:
    """ms per step of each timed block, the first and last loss, and the compile time."""
    if built.torch_module is None:
        raise Unavailable("no PyTorch twin for this model")
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:
        raise Unavailable(f"torch not installed: {exc}") from None
    device = torch.device("cuda" if provider == "cuda" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    channels_last = policy.endswith("-cl")
    amp = policy.removesuffix("-cl").endswith("-amp")
    compiled = policy.startswith("torch-compile")
    replayed = policy.startswith("torch-compile-graph")  # mode="reduce-overhead": CUDA graphs
    if replayed and device.type != "cuda":
        raise Unavailable("CUDA graphs (mode='reduce-overhead') need CUDA")
    module, inputs, labels = built.torch_module()
    if channels_last and not any(v.dim() == 4 for v in inputs.values()):
        raise Unavailable("channels_last applies to models with image (4-D) inputs")
    layout = torch.channels_last if channels_last else torch.contiguous_format
    module = module.to(device, memory_format=layout).eval()
    inputs = {k: v.to(device, memory_format=layout) if v.dim() == 4 else v.to(device) for k, v in inputs.items()}
    labels = labels.to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    forward = torch.compile(module, mode="reduce-overhead" if replayed else None) if compiled else module
    scaler = torch.amp.GradScaler(device.type, enabled=amp)

    def step():
        if replayed:  # the previous step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=amp):
            logits = forward(**inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    first = float(step().detach())
    sync()
    first_step_s = time.perf_counter() - start
    for _ in range(max(warmup - 1, 0)):
        step()
    sync()
    times = []
    loss = None
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(per_block):
            loss = step()
        sync()
        times.append((time.perf_counter() - start) * 1e3 / per_block)
    out = {"ms_blocks": times, "loss_first": first, "loss_last": float(loss.detach()), "steps": warmup + blocks * per_block,
           "first_step_s": round(first_step_s, 2), "tf32": device.type == "cuda",
           "loss_scale": float(scaler.get_scale()) if amp else None,
           "memory_format": "channels_last" if channels_last else "contiguous",
           **({"compile_mode": "reduce-overhead" if replayed else "default"} if compiled else {})}
    del module, optimizer, forward, inputs, labels
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def versions() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {}
    out = {"torch": torch.__version__}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out
