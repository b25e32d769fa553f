"""Benchmark the ai.onnxcampo ops against the standard-op graphs they replace.

On the GPU machine (onnxruntime-gpu in /tmp/ortgpu, the library built here and carried along):

    pip install -q --no-deps --no-build-isolation --target /tmp/oc . &&
    PYTHONPATH=/tmp/oc:/tmp/ortgpu ONNXCAMPO_OPS_LIBRARY=$PWD/onnxcampo/ops/lib/libonnxcampo_ops.so \
        python3 -P -m onnxcampo.benchmarks ops --provider cuda --out $OUT/bench_ops.json

(carry onnxcampo/ops/lib, built here by ``python -m onnxcampo.ops.build`` with nvcc present).

Here, to check that it runs: ``python -m onnxcampo.benchmarks ops --provider cpu --quick --out /tmp/b.json``.

1. Correctness on the device: the CUDA kernels against the CPU kernels on the same inputs
   (inf/NaN injected, fp16/fp32 gradients, found_inf on and off, a call of 1200 tensors that
   needs several launches), and the fused update against the standard-op update on the device.
2. Kernel time: a ResNet-50 gradient set (161 tensors, 25.6 M parameters) and a BERT-base set
   (199 tensors, 109.5 M): the standard unscale + finite check (Cast, Mul, IsInf, IsNaN, Or,
   Cast, ReduceMax per gradient) against UnscaleCheckFinite, and train-graph's standard
   momentum/AdamW update (step.py's own nodes) against MultiTensorSGD/MultiTensorAdamW.
   Wall time per run with IO binding and pre-bound outputs (ORT synchronises the stream at the
   end of each run), median of blocks after warm-up; with PyTorch present also the GPU kernel
   time per run that CUPTI sees (torch.profiler).
3. Training-step time of a real model (torchvision ResNet-50 exported on the spot, else the
   bundled MLP block) with onnxcampo.training.Trainer, fused update against standard ops.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

import onnxcampo
from onnxcampo import ops
from onnxcampo.ops import nodes
from onnxcampo.runtime import available_providers, make_session, preload_cuda_dlls
from onnxcampo.runtime.timing import BoundRunner
from onnxcampo.training import Trainer, build_train_step
from onnxcampo.examples import mlp_block_path
from onnxcampo.training.step import add_update  # the exact update train-graph emits

F32, F16 = np.float32, np.float16
HYPER = dict(momentum=0.9, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


# --------------------------------------------------------------------------------------------
# Gradient sets
# --------------------------------------------------------------------------------------------


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision ResNet-50's parameters in order: conv/bn weights, bottlenecks [3, 4, 6, 3], fc."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,), (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return shapes + [(1000, 2048), (1000,)]


def bert_base_shapes() -> list[tuple[int, ...]]:
    """BERT-base (uncased) parameters: embeddings, 12 layers of 16 tensors, pooler."""
    h, ff = 768, 3072
    shapes: list[tuple[int, ...]] = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (h, ff), (ff,), (ff, h), (h,), (h,), (h,)]
    return shapes + [(h, h), (h,)]


def shrink(shapes: list[tuple[int, ...]], factor: int) -> list[tuple[int, ...]]:
    return [tuple(max(1, d // factor) for d in shape) for shape in shapes]


def random_set(rng: np.random.Generator, shapes, dtype) -> list[np.ndarray]:
    total = sum(math.prod(s) for s in shapes)
    flat = (rng.standard_normal(total, dtype=F32) * 0.01).astype(dtype)
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[offset:offset + size].reshape(shape))
        offset += size
    return out


# --------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------


def _model(graph_nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(graph_nodes, "bench", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def unscale_model(shapes, grad_type: int, fused: bool, lean: bool = False) -> onnx.ModelProto:
    """``lean``: the standard ops onnxcampo's loss scaling emits without the library (Cast, Mul,
    ReduceSum per gradient, then Sum, Mul by 0, IsNaN); else the usual per-gradient check."""
    grads = [f"g{i}" for i in range(len(shapes))]
    inputs = [helper.make_tensor_value_info("inv_scale", TensorProto.FLOAT, [])]
    inputs += [helper.make_tensor_value_info(g, grad_type, list(s)) for g, s in zip(grads, shapes)]
    outputs = [helper.make_tensor_value_info("found_inf", TensorProto.BOOL, [])]
    outputs += [helper.make_tensor_value_info(f"u{i}", TensorProto.FLOAT, list(s)) for i, s in enumerate(shapes)]
    if fused:
        node = nodes.unscale_check_finite("inv_scale", grads, found_inf="found_inf",
                                          outputs=[f"u{i}" for i in range(len(shapes))], name="unscale")
        return _model([node], inputs, outputs)
    graph_nodes, flags = [], []
    for i, g in enumerate(grads):
        x = g
        if grad_type != TensorProto.FLOAT:
            graph_nodes.append(helper.make_node("Cast", [g], [f"c{i}"], to=TensorProto.FLOAT))
            x = f"c{i}"
        if lean:
            graph_nodes += [helper.make_node("Mul", [x, "inv_scale"], [f"u{i}"]),
                            helper.make_node("ReduceSum", [f"u{i}"], [f"s{i}"], keepdims=0)]
            flags.append(f"s{i}")
            continue
        graph_nodes += [
            helper.make_node("Mul", [x, "inv_scale"], [f"u{i}"]),
            helper.make_node("IsInf", [x], [f"inf{i}"]),
            helper.make_node("IsNaN", [x], [f"nan{i}"]),
            helper.make_node("Or", [f"inf{i}", f"nan{i}"], [f"bad{i}"]),
            helper.make_node("Cast", [f"bad{i}"], [f"badf{i}"], to=TensorProto.FLOAT),
            helper.make_node("ReduceMax", [f"badf{i}"], [f"any{i}"], keepdims=0),
        ]
        flags.append(f"any{i}")
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])
    if lean:
        graph_nodes += [helper.make_node("Sum", flags, ["total"]), helper.make_node("Mul", ["total", "zero"], ["x0"]),
                        helper.make_node("IsNaN", ["x0"], ["found_inf"])]
        return _model(graph_nodes, inputs, outputs, [zero])
    graph_nodes += [helper.make_node("Max", flags, ["worst"]), helper.make_node("Greater", ["worst", "zero"], ["found_inf"])]
    return _model(graph_nodes, inputs, outputs, [zero])


def update_model(shapes, optimizer: str, fused: bool, grad_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """step.py's update on its own: gradients enter as graph inputs ``g/<w>`` shaped like onnx-ad's
    (a trailing seed axis) and reach the update through Identity nodes (removed by ORT)."""
    weights = [f"w{i}" for i in range(len(shapes))]
    inputs = [helper.make_tensor_value_info("grad_seed", TensorProto.FLOAT, [1])]
    inputs += [helper.make_tensor_value_info(w, TensorProto.FLOAT, list(s)) for w, s in zip(weights, shapes)]
    inputs += [helper.make_tensor_value_info(f"g/{w}", grad_type, [*s, 1]) for w, s in zip(weights, shapes)]
    graph_nodes = [helper.make_node("Identity", [f"g/{w}"], [f"grad_{w}"]) for w in weights]
    outputs = [helper.make_tensor_value_info(f"grad_{w}", grad_type, [*s, 1]) for w, s in zip(weights, shapes)]
    model = _model(graph_nodes, inputs, outputs)
    add_update(model, weights, optimizer, fused=fused, **HYPER)
    seed = [t for t in model.graph.initializer if t.name == "grad_seed"]  # the backward pass would read it
    for tensor in seed:
        model.graph.initializer.remove(tensor)
    return model


# --------------------------------------------------------------------------------------------
# Running and timing
# --------------------------------------------------------------------------------------------

NP_TYPES = {TensorProto.FLOAT: F32, TensorProto.FLOAT16: F16, TensorProto.BOOL: np.bool_}


def feeds_for(model: onnx.ModelProto, rng: np.random.Generator, grads: list[np.ndarray] | None = None,
              found_inf: bool = False) -> dict[str, np.ndarray]:
    """Inputs of an unscale or update model: the given gradients (else random ones), weights
    N(0, 1), optimizer state small and positive, lr 1e-3, step 10."""
    feeds, k = {}, 0
    for value in model.graph.input:
        name, elem = value.name, value.type.tensor_type.elem_type
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        if name in ("lr",):
            feeds[name] = np.array(1e-3, F32)
        elif name == "step":
            feeds[name] = np.array(10.0, F32)
        elif name == "inv_scale":
            feeds[name] = np.array(1 / 1024, F32)
        elif name.startswith("g"):  # g<i> or g/<w>
            g = grads[k] if grads is not None else (rng.standard_normal(shape, dtype=F32) * 0.01)
            feeds[name] = np.ascontiguousarray(g.reshape(shape).astype(NP_TYPES[elem]))
            k += 1
        elif name.endswith((".adam_v",)):
            feeds[name] = rng.uniform(0, 1e-4, shape).astype(F32)
        else:  # weights, momentum, adam_m
            feeds[name] = rng.standard_normal(shape, dtype=F32)
    if found_inf:
        for model_flag in model.graph.initializer:
            if model_flag.name == "update/found_inf":
                model_flag.CopyFrom(onnx.numpy_helper.from_array(np.array(True), model_flag.name))
    return feeds


def bound(model: onnx.ModelProto, feeds: dict[str, np.ndarray], provider: str) -> BoundRunner:
    """A session of ``model`` with its inputs and outputs bound on the device (onnxcampo.runtime)."""
    return BoundRunner(make_session(model, provider=provider), feeds, "cuda" if provider == "cuda" else "cpu")


def results(runner: BoundRunner) -> dict[str, np.ndarray]:
    """The last run's outputs on the host."""
    runner.synchronize()
    return runner.outputs()


def wall_ms(runner: BoundRunner, warmup: int, runs: int, blocks: int) -> float:
    """Median over ``blocks`` blocks of ms per run, a block being ``runs`` runs launched back to
    back and waited for once (the update ops are short: a wait per run would be timed too)."""
    for _ in range(warmup):
        runner.launch()
    runner.synchronize()
    times = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(runs):
            runner.launch()
        runner.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / runs)
    return statistics.median(times)


def copy_bandwidth_gbps(nbytes: int = 1 << 30, runs: int = 20) -> float | None:
    """Bytes read plus written per second of a device-to-device copy (torch), the roofline that a
    memory-bound kernel can approach; ``None`` without torch or a GPU."""
    try:
        import torch

        a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b.copy_(a)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        del a, b
        torch.cuda.empty_cache()
        return 2 * nbytes / statistics.median(times) / 1e6
    except Exception as exc:
        print(f"  (copy bandwidth unavailable: {exc})", file=sys.stderr)
        return None


def cupti_kernel_ms(fn, runs: int) -> float | None:
    """GPU time of all kernels, memsets and copies per call of ``fn`` as CUPTI sees them."""
    from onnxcampo.benchmarks import measure as bench_measure

    kernels = bench_measure.cupti_kernels(fn, runs)
    return sum(ms for _, ms, _ in kernels) if kernels else None


def max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, bool]:
    worst, same_nonfinite = 0.0, True
    for name, x in a.items():
        y = b[name]
        if x.dtype == np.bool_:
            same_nonfinite &= bool(np.array_equal(x, y))
            continue
        finite = np.isfinite(x) & np.isfinite(y)
        same_nonfinite &= bool(np.array_equal(np.isnan(x), np.isnan(y)) and np.array_equal(np.isinf(x), np.isinf(y)))
        if finite.any():
            scale = np.maximum(np.abs(y[finite]), 1e-6)
            worst = max(worst, float(np.max(np.abs(x[finite] - y[finite]) / scale)))
    return worst, same_nonfinite


def device_checks(provider: str, rng: np.random.Generator, quick: bool) -> list[dict]:
    """CUDA kernels vs CPU kernels (and fused vs standard update on the device)."""
    many = [(int(rng.integers(0, 3000)),) for _ in range(60 if quick else 1200)]  # > one table: several launches
    mixed = shrink(resnet50_shapes(), 4 if quick else 1)
    cases = []
    for label, shapes in (("resnet50-set", mixed), ("1200-tensors" if not quick else "60-tensors", many)):
        for grad_type in (TensorProto.FLOAT16, TensorProto.FLOAT):
            for inject in (False, True):
                grads = random_set(rng, shapes, NP_TYPES[grad_type])
                if inject:
                    grads[len(grads) // 2].flat[0] = np.nan if grad_type == TensorProto.FLOAT else np.inf
                cases.append((f"UnscaleCheckFinite {label} {'fp16' if grad_type == TensorProto.FLOAT16 else 'fp32'}"
                              f"{' +inf/nan' if inject else ''}", unscale_model(shapes, grad_type, True), grads, False))
        for optimizer in ("sgd", "momentum", "adamw"):
            for found_inf in (False, True):
                grad_type = TensorProto.FLOAT16 if optimizer == "momentum" else TensorProto.FLOAT
                grads = random_set(rng, shapes, NP_TYPES[grad_type])
                model = update_model(shapes, optimizer, True, grad_type)
                cases.append((f"{optimizer} fused {label} {'fp16' if grad_type == TensorProto.FLOAT16 else 'fp32'} grads"
                              f"{' found_inf' if found_inf else ''}", model, grads, found_inf))
    rows = []
    for name, model, grads, found_inf in cases:
        feeds = feeds_for(model, rng, grads, found_inf)
        reference = bound(model, feeds, "cpu")
        reference.launch()
        expected = results(reference)
        device = bound(model, feeds, provider)
        device.launch()
        worst, same = max_diff(results(device), expected)
        if found_inf:  # every output equals its input
            unchanged = all(np.array_equal(expected[n], feeds[n[:-len(".updated")]])
                            for n in expected if n.endswith(".updated"))
            same &= unchanged
        ok = same and worst <= 1e-5
        rows.append({"check": f"{provider} vs cpu kernels: {name}", "max_rel_diff": worst, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {rows[-1]['check']}: max rel diff {worst:.2e}", file=sys.stderr)
    for optimizer in ("momentum", "adamw"):  # the fused update equals the standard one on the device
        shapes = shrink(resnet50_shapes(), 4)
        grads = random_set(rng, shapes, F32)
        fused, standard = update_model(shapes, optimizer, True), update_model(shapes, optimizer, False)
        feeds = feeds_for(fused, rng, grads)
        a, b = bound(fused, feeds, provider), bound(standard, feeds, provider)
        a.launch()
        b.launch()
        worst, same = max_diff(results(a), results(b))
        ok = same and worst <= 1e-4
        rows.append({"check": f"{provider}: fused {optimizer} vs standard-op update", "max_rel_diff": worst, "ok": ok})
        print(f"  {'ok  ' if ok else 'FAIL'} {rows[-1]['check']}: max rel diff {worst:.2e}", file=sys.stderr)
    return rows


# --------------------------------------------------------------------------------------------
# 2. Kernel time
# --------------------------------------------------------------------------------------------


def kernel_bench(provider: str, rng: np.random.Generator, quick: bool, budget_end: float) -> list[dict]:
    sets = {"ResNet-50": resnet50_shapes(), "BERT-base": bert_base_shapes()}
    if quick:
        sets = {name: shrink(shapes, 16) for name, shapes in sets.items()}
    warmup, runs, blocks = (2, 3, 3) if quick else (5, 10, 7)
    rows = []
    for set_name, shapes in sets.items():
        params = sum(math.prod(s) for s in shapes)
        grads16 = random_set(rng, shapes, F16)
        grads32 = [g.astype(F32) for g in grads16]
        # the last item: bytes per element the fused op must move (read fp16 g, write fp32 u;
        # read g, w, v, write w, v; read g, w, m, v, write w, m, v)
        comparisons = [
            ("unscale + finite check (fp16 grads)", lambda fused: unscale_model(shapes, TensorProto.FLOAT16, fused),
             grads16, 2 + 4),
            ("unscale + finite check, onnxcampo's lean standard ops (fp16 grads)",
             lambda fused: unscale_model(shapes, TensorProto.FLOAT16, fused, lean=not fused), grads16, 2 + 4),
            ("SGD-momentum update", lambda fused: update_model(shapes, "momentum", fused), grads32, 5 * 4),
            ("AdamW update", lambda fused: update_model(shapes, "adamw", fused), grads32, 7 * 4),
        ]
        for what, build, grads, bytes_per_element in comparisons:
            if time.monotonic() > budget_end:
                print(f"  time budget spent: {set_name} {what} skipped", file=sys.stderr)
                continue
            row = {"set": set_name, "tensors": len(shapes), "params": params, "what": what}
            for variant, fused in (("standard", False), ("fused", True)):
                model = build(fused)
                runner = bound(model, feeds_for(model, rng, grads), provider)
                row[f"{variant}_nodes"] = len(model.graph.node)
                row[f"{variant}_wall_ms"] = wall_ms(runner, warmup, runs, blocks)
                row[f"{variant}_kernel_ms"] = cupti_kernel_ms(runner.launch, runs) if provider == "cuda" else None
                del runner
            row["wall_speedup"] = row["standard_wall_ms"] / row["fused_wall_ms"]
            if row["standard_kernel_ms"] and row["fused_kernel_ms"]:
                row["kernel_speedup"] = row["standard_kernel_ms"] / row["fused_kernel_ms"]
                row["fused_bytes"] = params * bytes_per_element
                row["fused_gbps"] = row["fused_bytes"] / row["fused_kernel_ms"] / 1e6
            rows.append(row)
            print(f"  {set_name} {what}: standard {row['standard_wall_ms']:.3f} ms, fused {row['fused_wall_ms']:.3f} ms "
                  f"({row['wall_speedup']:.1f}x wall"
                  + (f", {row['kernel_speedup']:.1f}x kernel" if "kernel_speedup" in row else "") + ")", file=sys.stderr)
    # measured after the ops (torch's CUDA work stays out of their timing)
    copy_gbps = copy_bandwidth_gbps() if provider == "cuda" else None
    if copy_gbps:
        print(f"  device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", file=sys.stderr)
        for row in rows:  # the fastest a fused op could be: its bytes at the copy bandwidth
            if "fused_bytes" in row:
                row["floor_ms"] = row["fused_bytes"] / copy_gbps / 1e6
                row["max_kernel_speedup"] = row["standard_kernel_ms"] / row["floor_ms"]
        rows.append({"set": "device", "what": "copy bandwidth (1 GiB device-to-device, read + write)", "gbps": copy_gbps})
    return rows


# --------------------------------------------------------------------------------------------
# 3. Training-step time
# --------------------------------------------------------------------------------------------


def real_model(name: str, batch: int, folder: Path, rng: np.random.Generator):
    """(label, forward model, batch feeds, loss): a model of the benchmark suite (``bert``, ``gpt2``,
    ``odd_cnn``, ... from ``onnxcampo.benchmarks.models``, built for training), else a torchvision model exported
    now, else the bundled MLP block."""
    if name != "mlp":
        try:
            from onnxcampo.benchmarks import models as bench_models

            if name in bench_models.MODELS:
                built = bench_models.MODELS[name].build(batch, training=True)
                feeds = {**built.feeds, "labels": built.labels}
                return f"{name} b{batch} {built.shape_note} (bench_models)", onnx.load(str(built.path)), feeds, "cross_entropy"
            import torch
            import torchvision

            net = getattr(torchvision.models, name)(weights=None).eval()
            x = torch.randn(batch, 3, 224, 224)
            path = folder / f"{name}.onnx"
            kwargs = dict(opset_version=17, input_names=["x"], output_names=["logits"], do_constant_folding=True)
            try:
                torch.onnx.export(net, (x,), str(path), dynamo=False, **kwargs)
            except TypeError:
                torch.onnx.export(net, (x,), str(path), **kwargs)
            feeds = {"x": x.numpy(), "labels": rng.integers(0, 1000, batch).astype(np.int64)}
            return f"{name} b{batch} (torchvision, eval-mode export)", onnx.load(str(path)), feeds, "cross_entropy"
        except Exception as exc:
            print(f"  {name} unavailable ({type(exc).__name__}: {exc}); using the bundled MLP block", file=sys.stderr)
    forward = onnx.load(str(mlp_block_path()))
    rows = batch * 128
    feeds = {"x": rng.standard_normal((rows, 256), dtype=F32), "labels": rng.integers(0, 10, rows).astype(np.int64)}
    return f"mlp_block b{rows}", forward, feeds, "cross_entropy"


def _step_pair(provider, label, forward, batch_feeds, loss, shapes, optimizer, policy, steps, cuda_graph=False) -> dict:
    """One optimizer and policy: the step with standard ops against the step with the fused ops
    (and, with ``cuda_graph``, the fused step replayed as a CUDA graph)."""
    row = {"model": label, "optimizer": optimizer, "policy": policy, "provider": provider}
    losses = {}
    variants = [("standard", False, False), ("fused", True, False)] + ([("graph", True, True)] if cuda_graph else [])
    for variant, fused, graph in variants:
        start = time.perf_counter()
        step = build_train_step(forward, loss=loss, optimizer=optimizer, lr=1e-3, fused=fused, input_shapes=shapes)
        row["weights"] = sum(1 for i in step.graph.input if i.name + ".updated" in {o.name for o in step.graph.output}
                             and not i.name.endswith((".momentum", ".adam_m", ".adam_v")) and i.name != "step")
        if policy != "fp32":
            result = onnxcampo.optimize(step, policy=policy, input_shapes=shapes)
            step = result.model
            row[f"{variant}_precisions"] = result.plan.counts()
        row[f"{variant}_nodes"] = len(step.graph.node)
        row[f"{variant}_custom_ops"] = sorted({n.op_type for n in step.graph.node if n.domain == ops.DOMAIN})
        try:
            trainer = Trainer(step, provider=provider, cuda_graph=graph)
            row[f"{variant}_build_s"] = time.perf_counter() - start
            for _ in range(3):
                trainer.step(batch_feeds)
        except Exception as exc:  # noqa: BLE001 - e.g. a node ORT will not capture into a CUDA graph
            if not graph:
                raise
            row[f"{variant}_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"  {label} {optimizer} {policy} {variant}: {row[f'{variant}_error']}", file=sys.stderr)
            continue
        times, curve = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            curve.append(float(trainer.step(batch_feeds)))  # each step waited for: its own time
            times.append((time.perf_counter() - t0) * 1e3)
        row[f"{variant}_step_ms"] = statistics.median(times)
        losses[variant] = curve
        del trainer
    if "graph_step_ms" in row:
        row["graph_speedup"] = row["fused_step_ms"] / row["graph_step_ms"]
        g = np.array(losses["graph"])
        row["graph_max_loss_rel_diff"] = float(np.max(np.abs(g - np.array(losses["fused"])) /
                                                      np.maximum(np.abs(g), 1e-12)))
        print(f"  {label} {optimizer} {policy}: fused as a CUDA graph {row['graph_step_ms']:.2f} ms/step "
              f"({row['graph_speedup']:.2f}x over fused)", file=sys.stderr)
    row["speedup"] = row["standard_step_ms"] / row["fused_step_ms"]
    a, b = np.array(losses["standard"]), np.array(losses["fused"])
    row["max_loss_rel_diff"] = float(np.max(np.abs(a - b) / np.maximum(np.abs(a), 1e-12)))
    print(f"  {label} {optimizer} {policy}: standard {row['standard_step_ms']:.2f} ms/step ({row['standard_nodes']} "
          f"nodes), fused {row['fused_step_ms']:.2f} ms/step ({row['fused_nodes']} nodes): {row['speedup']:.2f}x; "
          f"loss curves differ by {row['max_loss_rel_diff']:.1e}", file=sys.stderr)
    return row


def step_bench(provider: str, model_name: str, batch: int, optimizers: list[str], steps: int,
               rng: np.random.Generator, budget_end: float, policies: tuple[str, ...] = ("fp32",),
               cuda_graph: bool = False) -> list[dict]:
    """Step time with the standard-op update (and unscale) against the fused ops, per optimizer and
    precision policy: ``fp32`` is the step graph as built; ``amp``/``campo`` are that graph through
    ``onnxcampo.optimize``, which adds loss scaling (standard ops or ``UnscaleCheckFinite``)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        label, forward, batch_feeds, loss = real_model(model_name, batch, Path(tmp), rng)
        shapes = {k: v.shape for k, v in batch_feeds.items() if k != "labels"}
        for optimizer in optimizers:
            for policy in policies:
                if time.monotonic() > budget_end:
                    print(f"  time budget spent: {model_name} {optimizer} {policy} step skipped", file=sys.stderr)
                    continue
                rows.append(_step_pair(provider, label, forward, batch_feeds, loss, shapes, optimizer, policy, steps,
                                       cuda_graph))
    return rows


# --------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    copy = next((r["gbps"] for r in result["kernel"] if "gbps" in r), None)
    lines = ([f"device-to-device copy bandwidth: {copy:.0f} GB/s (read + write); floor: the fused op's bytes at that rate", ""]
             if copy else [])
    lines += ["| gradient set | update | standard ms (nodes) | fused ms | speedup wall | kernel ms std / fused | "
              "speedup kernel | fused GB/s | floor ms | max kernel speedup |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["kernel"]:
        if "gbps" in r:
            continue
        both = r.get("standard_kernel_ms") and r.get("fused_kernel_ms")
        kernel = f"{r['standard_kernel_ms']:.3f} / {r['fused_kernel_ms']:.3f}" if both else "n/a"
        kernel_speedup = f"{r['kernel_speedup']:.1f}x" if both else "n/a"
        roof = (f"{r['fused_gbps']:.0f} | {r['floor_ms']:.3f} | {r['max_kernel_speedup']:.1f}x" if "floor_ms" in r
                else "n/a | n/a | n/a")
        lines.append(f"| {r['set']} ({r['tensors']} tensors, {r['params'] / 1e6:.1f} M) | {r['what']} | "
                     f"{r['standard_wall_ms']:.3f} ({r['standard_nodes']}) | {r['fused_wall_ms']:.3f} | "
                     f"{r['wall_speedup']:.1f}x | {kernel} | {kernel_speedup} | {roof} |")
    lines += ["", "| model | optimizer | policy | weights | standard ms/step (nodes) | fused ms/step (nodes) | speedup | "
              "fused as CUDA graph ms/step |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["step"]:
        graph = (f"{r['graph_step_ms']:.2f} ({r['graph_speedup']:.2f}x)" if "graph_step_ms" in r
                 else "failed" if "graph_error" in r else "–")
        lines.append(f"| {r['model']} | {r['optimizer']} | {r.get('policy', 'fp32')} | {r['weights']} | "
                     f"{r['standard_step_ms']:.2f} ({r['standard_nodes']}) | {r['fused_step_ms']:.2f} ({r['fused_nodes']}) | "
                     f"{r['speedup']:.2f}x | {graph} |")
    failed = [c["check"] for c in result["checks"] if not c["ok"]]
    lines += ["", f"device checks: {len(result['checks']) - len(failed)}/{len(result['checks'])} passed"
              + (f"; FAILED: {failed}" if failed else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sets and few runs (a smoke test)")
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--model", default="resnet50",
                        help="models for the step time, comma-separated, each NAME or NAME:BATCH: a benchmark model (models.py) "
                             "(bert, gpt2, odd_cnn, ...), a torchvision model, or 'mlp' (default: resnet50)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizers", default="adamw,momentum", help="step-time optimizers, in order (budget)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cuda-graph", action="store_true",
                        help="also time the fused step replayed as a CUDA graph (Trainer(cuda_graph=True))")
    parser.add_argument("--sections", default="checks,kernel,step",
                        help="what to run, comma-separated: checks (device correctness), kernel (kernel time), step "
                             "(training-step time)")
    parser.add_argument("--policies", default="fp32",
                        help="step-time precision policies, comma-separated: fp32 (the step graph as built), amp, "
                             "campo (through onnxcampo.optimize: fp16 nodes plus loss scaling)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new measurements after this")
    args = parser.parse_args(argv)
    started = time.monotonic()
    budget_end = started + args.budget_s
    if args.provider == "cuda":
        preload_cuda_dlls()
    rng = np.random.default_rng(0)
    result = {
        "command": " ".join(["python -m onnxcampo.benchmarks ops", *sys.argv[1:]]),
        "onnxruntime": ort.__version__, "providers": available_providers(), "host": platform.node(),
        "library": ops.library_path(), "library_build": ops.build_info(), "provider": args.provider,
        "timing": "wall ms per run, IO binding, outputs pre-bound, median of blocks after warm-up; kernel ms: "
                  "CUPTI via torch.profiler (all GPU activity per run); TF32 on",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section: a run cut short keeps what it measured
        result["seconds"] = time.monotonic() - started
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    result.update(checks=[], kernel=[], step=[])
    sections = set(args.sections.split(","))
    if "checks" in sections:
        print("1. correctness on the device", file=sys.stderr)
        result["checks"] = device_checks(args.provider, rng, args.quick)
        save()
    if "kernel" in sections:
        print("2. kernel time", file=sys.stderr)
        result["kernel"] = kernel_bench(args.provider, rng, args.quick, budget_end)
        save()
    if "step" in sections:
        print("3. training-step time", file=sys.stderr)
    specs = [] if "step" not in sections else ["mlp"] if args.quick else args.model.split(",")
    errors = []
    for spec in specs:
        model_name, _, batch = spec.partition(":")
        batch = int(batch) if batch else (4 if args.quick else args.batch)
        try:
            result["step"] += step_bench(args.provider, model_name, batch, args.optimizers.split(","),
                                         5 if args.quick else args.steps, rng, budget_end, tuple(args.policies.split(",")),
                                         args.cuda_graph)
        except Exception as exc:  # e.g. an op of the exported model that onnx-ad cannot differentiate
            if model_name == "mlp":
                raise
            print(f"  {model_name} failed ({type(exc).__name__}: {exc})", file=sys.stderr)
            errors.append(f"{model_name}: {type(exc).__name__}: {exc}")
        save()
    if errors:
        result["step_error"] = "; ".join(errors)
        if not result["step"]:
            print("  timing the bundled MLP block instead", file=sys.stderr)
            result["step"] = step_bench(args.provider, "mlp", args.batch, args.optimizers.split(","), args.steps, rng,
                                        budget_end + 60)
    save()
    print(markdown(result))
    print(f"\nwrote {args.out} in {result['seconds']:.0f} s", file=sys.stderr)
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
