"""ResNet-50's PyTorch training step in NCHW and in channels_last, and where its GPU time goes.

The benchmark's torch anchors (``torch_twins``) for ResNet-50 b64 (BatchNorm folded,
SGD momentum, cross-entropy) timed in both memory formats, eager and ``torch.compile``, fp32 (TF32)
and AMP, one after another in one process; then the eager AMP step of each format and the
compiled channels_last one under ``torch.profiler`` (CUPTI kernel times), its kernels grouped into cuDNN's layout transforms, the
convolutions, and the rest. Needs only PyTorch with CUDA (no ONNX Runtime):

    python3 -P -m onnxcampo.benchmarks probe-torch-layout --out $OUT/torch-layout.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

POLICIES = ("torch-eager-amp", "torch-eager-amp-cl", "torch-compile-amp", "torch-compile-amp-cl",
            "torch-compile", "torch-compile-cl")
TRANSFORM = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.I)
CONV = re.compile(r"conv|cudnn|xmma|implicit|dgrad|wgrad|sm\d\d_.*gemm|cutlass|fprop", re.I)


class Built:
    """What torch_twins.train reads: the module, its inputs and labels, the learning rate."""

    def __init__(self, batch: int):
        self.batch, self.lr = batch, 1e-3

    def torch_module(self):
        import torch
        import torchvision

        from onnxcampo.benchmarks.models import distinct_parameters, fold_batchnorm

        torch.manual_seed(0)
        net = torchvision.models.resnet50(weights=None, zero_init_residual=True).eval()
        generator = torch.Generator().manual_seed(1)
        x = torch.randn((self.batch, 3, 224, 224), generator=generator)
        labels = torch.randint(0, 1000, (self.batch,), generator=generator)
        return fold_batchnorm(distinct_parameters(net)), {"x": x}, labels


def kernel_split(built: Built, channels_last: bool, compiled: bool = False, steps: int = 5) -> dict:
    """CUPTI kernel ms a step of the AMP step (eager, or its forward through ``torch.compile`` as
    the benchmark's anchor runs it), by group, and the largest kernels."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    layout = torch.channels_last if channels_last else torch.contiguous_format
    module, inputs, labels = built.torch_module()
    module = module.cuda().to(memory_format=layout)
    x = inputs["x"].cuda().to(memory_format=layout)
    labels = labels.cuda()
    forward = torch.compile(module) if compiled else module
    optimizer = torch.optim.SGD(module.parameters(), lr=built.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = forward(x)
        loss = F.cross_entropy(logits.float(), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and getattr(event, "device_time_total", 0):
            kernels[event.key] = kernels.get(event.key, 0.0) + event.device_time_total / 1e3 / steps
    groups = {"transforms": 0.0, "convolutions": 0.0, "other": 0.0}
    for name, ms in kernels.items():
        groups["transforms" if TRANSFORM.search(name) else "convolutions" if CONV.search(name) else "other"] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"memory_format": "channels_last" if channels_last else "contiguous", "compiled": compiled,
            "gpu_ms": round(sum(kernels.values()), 3), "groups_ms": {k: round(v, 3) for k, v in groups.items()},
            "top": [[name[:160], round(ms, 4)] for name, ms in top]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--per-block", type=int, default=10)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("error: PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    from onnxcampo.benchmarks import torch_twins

    built = Built(args.batch)
    report = {"batch": args.batch, "versions": torch_twins.versions(), "cudnn": torch.backends.cudnn.version(),
              "steps": {}, "kernels": []}
    for channels_last, compiled in ((False, False), (True, False), (True, True)):
        report["kernels"].append(kernel_split(built, channels_last, compiled))
        print(json.dumps({k: v for k, v in report["kernels"][-1].items() if k != "top"}), flush=True)
    for policy in args.policies.split(","):
        row = torch_twins.train(built, policy, provider="cuda", warmup=10, blocks=args.blocks,
                                per_block=args.per_block, lr=built.lr)
        row["ms"] = sorted(row["ms_blocks"])[len(row["ms_blocks"]) // 2]
        report["steps"][policy] = row
        print(f"{policy}: {row['ms']:.2f} ms a step (loss {row['loss_first']:.4f} -> {row['loss_last']:.4f})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
