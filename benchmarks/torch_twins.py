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

from onnxcampo.benchmarks.policies import Unavailable


class TorchStep:
    """One PyTorch training step of ``policy`` on ``built`` (the module docstring's set-up), ready
    to run: ``step()`` queues a step and returns its loss tensor, ``sync()`` waits for the device;
    ``__call__`` queues a step and reads its loss as a float every ``read_every`` calls (None in
    between), as the ONNX runner does: the rotation's unit."""

    def __init__(self, built, policy: str, *, provider: str, lr: float = 0.01, momentum: float = 0.9,
                 read_every: int = 1) -> None:
        self.read_every, self._calls = max(1, int(read_every)), 0
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
        self.channels_last = policy.endswith("-cl")
        self.amp = policy.removesuffix("-cl").endswith("-amp")
        self.compiled = policy.startswith("torch-compile")
        self.replayed = policy.startswith("torch-compile-graph")  # mode="reduce-overhead": CUDA graphs
        if self.replayed and device.type != "cuda":
            raise Unavailable("CUDA graphs (mode='reduce-overhead') need CUDA")
        module, inputs, labels = built.torch_module()
        if self.channels_last and not any(v.dim() == 4 for v in inputs.values()):
            raise Unavailable("channels_last applies to models with image (4-D) inputs")
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        # in the mode its build gives it: a BatchNorm model exported for training trains in training
        # mode, as its step graph does (dropout is off in every model)
        self.module = module.to(device, memory_format=layout)
        self.inputs = {k: v.to(device, memory_format=layout) if v.dim() == 4 else v.to(device) for k, v in inputs.items()}
        self.labels = labels.to(device)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=lr, momentum=momentum)
        self.forward = (torch.compile(self.module, mode="reduce-overhead" if self.replayed else None) if self.compiled
                        else self.module)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp)
        self.device, self.torch, self.F = device, torch, F

    def step(self):
        torch, F = self.torch, self.F
        if self.replayed:  # the previous step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.device.type, dtype=torch.float16, enabled=self.amp):
            logits = self.forward(**self.inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), self.labels.reshape(-1))
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def __call__(self) -> float | None:
        loss = self.step()
        self._calls += 1
        return float(loss.detach()) if self._calls % self.read_every == 0 else None

    def info(self) -> dict[str, Any]:
        return {"tf32": self.device.type == "cuda", "loss_scale": float(self.scaler.get_scale()) if self.amp else None,
                "memory_format": "channels_last" if self.channels_last else "contiguous",
                **({"compile_mode": "reduce-overhead" if self.replayed else "default"} if self.compiled else {})}

    def close(self) -> None:
        del self.module, self.optimizer, self.forward, self.inputs, self.labels
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


def train(built, policy: str, *, provider: str, warmup: int, blocks: int, per_block: int,
          lr: float = 0.01, momentum: float = 0.9) -> dict[str, Any]:
    """ms per step of each timed block, the first and last loss, and the compile time."""
    twin = TorchStep(built, policy, provider=provider, lr=lr, momentum=momentum)
    start = time.perf_counter()
    first = float(twin.step().detach())
    twin.sync()
    first_step_s = time.perf_counter() - start
    for _ in range(max(warmup - 1, 0)):
        twin.step()
    twin.sync()
    times = []
    loss = None
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(per_block):
            loss = twin.step()
        twin.sync()
        times.append((time.perf_counter() - start) * 1e3 / per_block)
    out = {"ms_blocks": times, "loss_first": first, "loss_last": float(loss.detach()), "steps": warmup + blocks * per_block,
           "first_step_s": round(first_step_s, 2), **twin.info()}
    twin.close()
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
