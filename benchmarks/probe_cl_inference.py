"""Where ResNet-50 inference spends its GPU time, campo with FusedElementwise in NCHW against the
same with ``channels_last`` (ai.onnxcampo's ConvNhwc), per batch: the CUPTI kernel split (through
torch's profiler) of each plan run plainly, plus both plans timed side by side, plain and
replayed as a CUDA graph. It answers why the channels-last plan can lose at batch 1.

    python3 -P -m onnxcampo.benchmarks probe-cl-inference --batches 1,64 [--execution plain] --out probe-cl-inference.json

Needs onnxruntime-gpu, the custom-op library with CUDA kernels (ONNXCAMPO_OPS_LIBRARY), torch
(for CUPTI) and what the benchmark builds the model with (``models``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


VARIANTS = {"campo-fused": {"channels_last": False}, "campo-fused-cl": {"channels_last": True}}


def plans(batch: int, execution: str = "cuda-graph") -> tuple[dict, dict, dict]:
    import onnxcampo
    from onnxcampo.benchmarks import models as bm

    built = bm.MODELS["resnet50"].build(batch, training=False)
    shapes = {k: list(v.shape) for k, v in built.feeds.items()}
    models, reports = {}, {}
    for name, options in VARIANTS.items():
        result = onnxcampo.optimize(str(built.path), input_shapes=shapes, policy="campo", fuse_elementwise=True,
                                    fuse_reductions=False, execution=execution, accuracy="off", **options)
        models[name] = result.model.SerializeToString()
        reports[name] = {"channels_last": result.report.get("channels_last"), "nodes_fp16": result.report.get("nodes_fp16"),
                         "ops": dict(sorted(_ops(result.model).items()))}
    return models, reports, {"feeds": built.feeds}


def _ops(model) -> dict:
    from collections import Counter

    return Counter(n.op_type for n in model.graph.node)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--runs", type=int, default=20, help="calls profiled per variant")
    parser.add_argument("--execution", choices=("plain", "cuda-graph"), default="cuda-graph",
                        help="the execution campo plans for (both plans run plain and replayed either way)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import onnxruntime

    from onnxcampo.benchmarks import measure as m
    from onnxcampo import ops
    from onnxcampo.runtime.standalone import BoundSession, custom_op_session, time_in_rotation

    onnxruntime.preload_dlls()
    library = str(ops.library_path())
    result = {"command": " ".join(["python3 -P -m onnxcampo.benchmarks probe-cl-inference", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        models, reports, io = plans(batch, args.execution)
        entry = {"plans": reports, "cupti": {}, "ms": {}}
        sessions = {}
        for name, model in models.items():
            probe = custom_op_session(model, library, "cuda")
            names = [o.name for o in probe.get_outputs()]
            outputs = {k: (v.shape, v.dtype) for k, v in zip(names, probe.run(names, io["feeds"]))}
            del probe
            for graph in (False, True):
                key = name + ("-graph" if graph else "")
                sessions[key] = BoundSession(model, library, "cuda", io["feeds"], outputs, cuda_graph=graph)
                for _ in range(5):
                    sessions[key].run()
            kernels = m.cupti_kernels(sessions[name].run, args.runs)
            entry["cupti"][name] = None if kernels is None else m.gpu_split(kernels, top=15)
        entry["ms"] = {k: round(v, 4) for k, v in time_in_rotation({k: s.run for k, s in sessions.items()},
                                                                    rounds=5, runs=20).items()}
        result["batches"][str(batch)] = entry
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in entry["ms"].items()), flush=True)
        for name, split in entry["cupti"].items():
            if split:
                print(f"  {name}: GPU {split['total_ms']:.3f} ms {split['by_class_ms']}", flush=True)
                for kernel, ms, count in split["top"][:6]:
                    print(f"    {ms:8.4f} ms x{count:5.1f}  {kernel[:100]}", flush=True)
        del sessions
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
