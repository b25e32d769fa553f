"""Where a training step's time goes: per-op-type split of forward / backward / update.

    python -m onnxcampo.benchmarks profile-step resnet50 --batch 2 --size 64 --provider cpu
    python -m onnxcampo.benchmarks profile-step FWD.onnx --input-shape x:32,3,224,224 --provider cuda
    python -m onnxcampo.benchmarks profile-step resnet50 --batch 32 --size 224 --provider cuda --compare

Builds the step graph of a forward model (``build_train_step``: cross-entropy, AdamW by default),
runs it a few times with every input bound once (weights and optimizer state stay where they
are, as in ``Trainer``), and reads ONNX Runtime's profile (``_kernel_time`` node events, the runs
after the first). Every node is put in one phase:

* forward: the nodes the loss needs (ancestors of ``loss``);
* update: the optimizer (from the ``<weight>/squeeze`` nodes of the gradients on);
* backward: the rest (onnx-ad's adjoint nodes and the primal helpers they add: masks, argmax).

Profiled node names are those after ORT's own graph optimizations; a fused or inserted node whose
name is not one of ours is matched by the longest name of ours it starts with, else counted as
``ort-inserted``.

``resnet50`` / ``resnet18`` / ``resnet-mini`` are built here with ``onnx.helper`` in the layout of a
BN-folded torchvision export (Conv+bias, Relu, residual Add, MaxPool 3x3/2, GlobalAveragePool,
Flatten, Gemm), so no torch is needed. ``--compare`` profiles the step built with and without
``simplify_backward`` and checks the two give the same loss and gradients (read off a plain-SGD
step: AdamW's first step is lr * sign(grad) wherever |grad| >> eps, so float-level differences in
near-zero gradients flip whole updates and make updated weights a poor equality test).

On CUDA the node events time the host side of each kernel launch (asynchronous kernels), so they
show where launches and synchronizing kernels go, not GPU time; ``--cupti`` (needs torch) adds the
GPU time per kernel name as CUPTI sees it, and the wall time per step is always printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


import onnxruntime as ort

from onnxcampo.runtime import make_session
from onnxcampo.runtime import trace as ort_trace
from onnxcampo.training import build_train_step, initial_weights, step_spec
from onnxcampo.training.step import LOSS, LR, UPDATED

DEPTHS = {"resnet50": ((3, 4, 6, 3), True), "resnet18": ((2, 2, 2, 2), False), "resnet-mini": ((1, 1, 1, 1), True)}


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------

def resnet(name: str, batch: int, size: int, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """A BN-folded ResNet in the node layout of ``torch.onnx.export`` of torchvision's (eval mode)."""
    depths, bottleneck = DEPTHS[name]
    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def conv(x, cin, cout, k, stride, tag):
        w = (rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{tag}.weight"),
                      numpy_helper.from_array(np.zeros(cout, np.float32), f"{tag}.bias")])
        nodes.append(helper.make_node("Conv", [x, f"{tag}.weight", f"{tag}.bias"], [f"{tag}/out"], name=f"{tag}/Conv",
                                      kernel_shape=[k, k], strides=[stride] * 2, pads=[k // 2] * 4, dilations=[1, 1],
                                      group=1))
        return f"{tag}/out"

    def relu(x, tag):
        nodes.append(helper.make_node("Relu", [x], [f"{tag}/relu"], name=f"{tag}/Relu"))
        return f"{tag}/relu"

    x = relu(conv("x", 3, 64, 7, 2, "stem"), "stem")
    nodes.append(helper.make_node("MaxPool", [x], ["stem/pool"], name="stem/MaxPool", kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=0))
    x, cin = "stem/pool", 64
    for stage, depth in enumerate(depths):
        width = 64 * 2 ** stage
        for block in range(depth):
            tag, stride = f"layer{stage + 1}.{block}", (2 if stage and not block else 1)
            cout = width * 4 if bottleneck else width
            if bottleneck:
                y = relu(conv(x, cin, width, 1, 1, f"{tag}.conv1"), f"{tag}.conv1")
                y = relu(conv(y, width, width, 3, stride, f"{tag}.conv2"), f"{tag}.conv2")
                y = conv(y, width, cout, 1, 1, f"{tag}.conv3")
            else:
                y = relu(conv(x, cin, width, 3, stride, f"{tag}.conv1"), f"{tag}.conv1")
                y = conv(y, width, width, 3, 1, f"{tag}.conv2")
            short = conv(x, cin, cout, 1, stride, f"{tag}.downsample") if stride != 1 or cin != cout else x
            nodes.append(helper.make_node("Add", [y, short], [f"{tag}/sum"], name=f"{tag}/Add"))
            x, cin = relu(f"{tag}/sum", tag), cout
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["pool"], name="GlobalAveragePool"))
    nodes.append(helper.make_node("Flatten", ["pool"], ["flat"], name="Flatten", axis=1))
    fc = (rng.standard_normal((classes, cin)) / np.sqrt(cin)).astype(np.float32)
    inits.extend([numpy_helper.from_array(fc, "fc.weight"), numpy_helper.from_array(np.zeros(classes, np.float32), "fc.bias")])
    nodes.append(helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc/Gemm", alpha=1.0,
                                  beta=1.0, transB=1))
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def load_forward(args) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]]]:
    if args.model in DEPTHS:
        return resnet(args.model, args.batch, args.size), {"x": (args.batch, 3, args.size, args.size)}
    model = onnx.load(args.model)
    shapes = {}
    for item in args.input_shape or []:
        name, dims = item.split(":")
        shapes[name] = tuple(int(d) for d in dims.split(","))
    return model, shapes


def batch_feeds(step: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], rng: np.random.Generator) -> dict[str, np.ndarray]:
    spec = step_spec(step)
    declared = {i.name: i for i in step.graph.input}
    feeds = {}
    for name in spec.batch:
        tensor = declared[name].type.tensor_type
        dims = shapes.get(name) or tuple(d.dim_value for d in tensor.shape.dim)
        if tensor.elem_type == TensorProto.INT64:  # class labels
            feeds[name] = rng.integers(0, 10, dims).astype(np.int64)
        else:
            feeds[name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


# --------------------------------------------------------------------------------------------
# phases
# --------------------------------------------------------------------------------------------

def phases(step: onnx.ModelProto) -> dict[str, str]:
    """node name -> forward | backward | update (see the module docstring)."""
    nodes = list(step.graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}
    forward, stack = set(), [LOSS]
    while stack:
        index = producer.get(stack.pop())
        if index is None or index in forward:
            continue
        forward.add(index)
        stack.extend(nodes[index].input)
    update, consumers = set(), defaultdict(list)
    for i, node in enumerate(nodes):
        for name in node.input:
            consumers[name].append(i)
    stack = [i for i, node in enumerate(nodes) if node.name.startswith("update/") or node.name.endswith("/squeeze")]
    while stack:
        index = stack.pop()
        if index in update:
            continue
        update.add(index)
        for out in nodes[index].output:
            stack.extend(consumers[out])
    return {node.name: ("forward" if i in forward else "update" if i in update else "backward")
            for i, node in enumerate(nodes)}


def phase_of(name: str, table: dict[str, str], ordered: list[str]) -> str:
    if name in table:
        return table[name]
    for known in ordered:  # longest first
        if name.startswith(known):
            return table[known]
    return "ort-inserted"


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------

class BoundStep:
    """Every input bound once (on the device), every output bound to a device buffer."""

    def __init__(self, step: onnx.ModelProto, forward: onnx.ModelProto, feeds: dict[str, np.ndarray], *, provider: str,
                 profiling: bool, opt_level: str, prefix: str):
        self.session = make_session(step, provider=provider, profiling=profiling, optimization_level=opt_level,
                                    profile_file_prefix=prefix)
        device = "cuda" if provider == "cuda" else "cpu"
        spec = step_spec(step)
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in step.graph.input}
        values = dict(feeds)
        values.update(initial_weights(forward, step))
        for name in spec.state:
            values[name] = np.zeros(shapes[name], np.float32)
        values[LR] = np.array(1e-3, np.float32)
        self.host = {k: np.ascontiguousarray(v) for k, v in values.items()}  # the OrtValues borrow these on CPU
        self.binding = self.session.io_binding()
        self.inputs = {k: ort.OrtValue.ortvalue_from_numpy(v, device, 0) for k, v in self.host.items()}
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        self.output_names = [o.name for o in step.graph.output]
        for name in self.output_names:
            self.binding.bind_output(name, device, 0)

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)

    def outputs(self) -> dict[str, np.ndarray]:
        self.binding.synchronize_outputs()
        return dict(zip(self.output_names, (v.numpy() for v in self.binding.get_outputs())))


def time_steps(bound: BoundStep, steps: int) -> float:
    bound.run()
    bound.binding.synchronize_outputs()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        bound.run()
        bound.binding.synchronize_outputs()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profile(step: onnx.ModelProto, forward: onnx.ModelProto, feeds, *, provider: str, runs: int, opt_level: str,
            folder: Path, cupti: bool) -> dict:
    """Per (phase, op type) milliseconds per step, node counts, and the wall time per step."""
    wall_bound = BoundStep(step, forward, feeds, provider=provider, profiling=False, opt_level=opt_level, prefix="")
    wall_ms = time_steps(wall_bound, runs)
    kernels = cupti_by_kernel(wall_bound, runs) if cupti and provider == "cuda" else None
    del wall_bound
    bound = BoundStep(step, forward, feeds, provider=provider, profiling=True, opt_level=opt_level,
                      prefix=str(folder / "step"))
    for _ in range(runs + 1):
        bound.run()
    bound.binding.synchronize_outputs()
    events = ort_trace.read_events(bound.session.end_profiling())
    table = phases(step)
    ordered = sorted(table, key=len, reverse=True)
    windows = ort_trace.run_windows(events)[1:]  # the first run is the warm-up
    per = defaultdict(float)
    for e in events:
        if not ort_trace.is_kernel_event(e):
            continue
        if not any(a <= e["ts"] <= b for a, b in windows):
            continue
        name = e["name"][: -len(ort_trace.KERNEL_SUFFIX)]
        op = e.get("args", {}).get("op_name", "?")
        per[(phase_of(name, table, ordered), op)] += e["dur"] / 1e3 / len(windows)
    counts = defaultdict(int)
    for node in step.graph.node:
        counts[(table[node.name], node.op_type)] += 1
    return {"wall_ms": wall_ms, "per": dict(per), "counts": dict(counts), "kernels": kernels,
            "nodes": len(step.graph.node)}


def cupti_by_kernel(bound: BoundStep, runs: int) -> list[tuple[str, float, float]] | None:
    """(kernel name, GPU ms per step, launches per step) from CUPTI via torch.profiler, top first."""
    from onnxcampo.benchmarks import measure as bench_measure

    kernels = bench_measure.cupti_kernels(bound.run, runs)
    if kernels is None:
        print("  (no CUPTI: torch with CUDA is needed)", file=sys.stderr)
    return kernels


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def report(label: str, result: dict, top: int) -> str:
    per, counts = result["per"], result["counts"]
    total = sum(per.values()) or 1.0
    lines = [f"== {label}: {result['nodes']} nodes, {result['wall_ms']:.2f} ms/step wall, "
             f"{total:.2f} ms/step in node events"]
    for phase in ("forward", "backward", "update", "ort-inserted"):
        ms = sum(v for (p, _), v in per.items() if p == phase)
        n = sum(v for (p, _), v in counts.items() if p == phase)
        if ms or n:
            lines.append(f"  {phase:<12} {ms:9.2f} ms  {100 * ms / total:5.1f} %  ({n} nodes in the step graph)")
    lines.append(f"  {'phase':<12} {'op type':<22} {'ms/step':>9} {'share':>6} {'nodes':>6}")
    for (phase, op), ms in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {phase:<12} {op:<22} {ms:9.3f} {100 * ms / total:5.1f}% {counts.get((phase, op), 0):6d}")
    if result.get("kernels"):
        lines.append("  GPU kernels (CUPTI), ms/step, calls/step:")
        for name, ms, calls in result["kernels"][:top]:
            lines.append(f"    {ms:9.3f}  {calls:5.0f}  {name[:110]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="forward ONNX file, or one of: " + ", ".join(DEPTHS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="image side for the built-in ResNets")
    parser.add_argument("--input-shape", action="append", metavar="NAME:D0,D1,...")
    parser.add_argument("--loss", default="cross_entropy")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--fused", choices=("auto", "yes", "no"), default="auto")
    parser.add_argument("--provider", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--runs", type=int, default=3, help="profiled runs after one warm-up run")
    parser.add_argument("--opt-level", choices=("all", "basic", "disable"), default="all")
    parser.add_argument("--simplify", choices=("yes", "no"), default="yes", help="simplify_backward (the default)")
    parser.add_argument("--compare", action="store_true", help="profile both, check same outputs")
    parser.add_argument("--cupti", action="store_true", help="CUDA: GPU time per kernel name (needs torch)")
    parser.add_argument("--ort-verbose", action="store_true",
                        help="ORT's verbose log: node placements per provider, Memcpy nodes added")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--save-step", metavar="PATH", help="write the step graph (the simplified one)")
    parser.add_argument("--json", metavar="PATH", help="write the numbers")
    args = parser.parse_args(argv)

    if args.ort_verbose:
        ort.set_default_logger_severity(0)
    forward, shapes = load_forward(args)
    fused = {"auto": None, "yes": True, "no": False}[args.fused]
    variants = [("simplified", True), ("as emitted", False)] if args.compare else \
        [("simplified" if args.simplify == "yes" else "as emitted", args.simplify == "yes")]
    rng = np.random.default_rng(0)
    results, outputs, feeds = {}, {}, None
    with tempfile.TemporaryDirectory(prefix="profile-step-") as tmp:
        for label, simplify in variants:
            start = time.perf_counter()
            step = build_train_step(forward, loss=args.loss, optimizer=args.optimizer, fused=fused,
                                    input_shapes=shapes, simplify=simplify)
            build_s = time.perf_counter() - start
            if args.save_step and simplify == (args.simplify == "yes"):
                onnx.save(step, args.save_step)
            feeds = feeds or batch_feeds(step, shapes, rng)
            result = profile(step, forward, feeds, provider=args.provider, runs=args.runs, opt_level=args.opt_level,
                             folder=Path(tmp), cupti=args.cupti)
            result["build_s"] = build_s
            results[label] = result
            print(report(f"{label} ({args.provider}, build {build_s:.1f} s)", result, args.top), flush=True)
            if args.compare:  # gradients through plain SGD: w - w.updated = lr * grad, compared per tensor
                sgd = build_train_step(forward, loss=args.loss, optimizer="sgd", fused=False, input_shapes=shapes,
                                       simplify=simplify)
                bound = BoundStep(sgd, forward, feeds, provider=args.provider, profiling=False,
                                  opt_level=args.opt_level, prefix="")
                bound.run()
                weights = initial_weights(forward, sgd)
                got = bound.outputs()
                outputs[label] = {k: (weights[k[: -len(UPDATED)]] - v if k.endswith(UPDATED) else v)
                                  for k, v in got.items()}
    status = 0
    if args.compare:
        a, b = outputs["simplified"], outputs["as emitted"]
        worst, where = max((float(np.max(np.abs(a[k] - b[k])) / (np.abs(b[k]).max() + 1e-30)), k) for k in b)
        same = set(a) == set(b) and worst < 1e-4
        speed = results["as emitted"]["wall_ms"] / results["simplified"]["wall_ms"]
        print(f"== simplified vs as emitted: {results['as emitted']['nodes']} -> {results['simplified']['nodes']} nodes, "
              f"wall {speed:.2f}x; loss and SGD gradients {'match' if same else 'DIFFER'} (worst difference "
              f"{worst:.1e} of the tensor's largest value, {where})")
        status = 0 if same else 1
    if args.json:
        def plain(result):
            return {**result, "per": [[p, op, ms] for (p, op), ms in result["per"].items()],
                    "counts": [[p, op, n] for (p, op), n in result["counts"].items()]}
        Path(args.json).write_text(json.dumps({k: plain(v) for k, v in results.items()}, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
