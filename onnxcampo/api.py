"""``optimize()``: load -> plan (analysis passes) -> apply (mutating passes) -> export."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxcampo import __version__
from onnxcampo import estimate, fuse, oplists
from onnxcampo import graph as graph_io
from onnxcampo.config import OptimizeConfig
from onnxcampo.context import GraphContext
from onnxcampo.errors import ConfigError
from onnxcampo.costdb.select import load_cost_model
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.amp_deny_propagation import AmpDenyPropagation
from onnxcampo.passes.allow_islands import AllowIslands
from onnxcampo.passes.amp_casts import AmpCasts
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.clear_by_cost import ClearByCost
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear
from onnxcampo.passes.insert_casts import InsertCasts
from onnxcampo.passes.manager import PassManager, PassResult
from onnxcampo.passes.pad_tensor_cores import PadTensorCores
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, PrecisionPlan, Reason
from onnxcampo.training import scaling
from onnxcampo.training.step import INITIAL_PREFIX

log = logging.getLogger(__name__)

METADATA_KEY = "onnxcampo.policy"
_DEFAULT = UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32)

# The pipelines are data: analysis passes per policy, then the mutating ones.
# Every plan starts from the decisions of pass 0 (``Classify``), made once.
ANALYSIS = {
    "campo": (AllowByCost(), DenyPropagation(), AllowIslands(), FillInferClear(), ClearByCost(),
              ClearByCost(infer=True), _DEFAULT),
    "amp": (AllowByCost(greedy=True), AmpDenyPropagation(), FillInferClear(casts=False), ClearByCost(greedy=True),
            AmpCasts(), _DEFAULT),
    "fp16": (UniformPrecision(Precision.FP16, Reason.POLICY_FP16),),
    "fp32": (UniformPrecision(Precision.FP32, Reason.POLICY_FP32),),
}
COMPARED = ("fp32", "amp")  # plans campo must never be predicted slower than


@dataclass
class OptimizeResult:
    model: onnx.ModelProto
    plan: PrecisionPlan
    report: dict
    changed: bool = True
    passes: list[PassResult] = field(default_factory=list)

    def save(self, path: str | os.PathLike) -> None:
        # ONNX Runtime test-loads what onnxcampo changed; an unchanged model is the input's business
        graph_io.save_model(self.model, Path(path), check_loads=self.changed)


def optimize(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    config: OptimizeConfig | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    **options,
) -> OptimizeResult:
    """Turn an fp32 model into a mixed fp16/fp32 one; the input model is never modified.

    ``options`` are :class:`OptimizeConfig` fields and override those of ``config``.
    ``inputs``: with ``tune``, the feeds the candidates are timed on (a training step: its
    batch); with ``activation_limit``, the calibration feeds; random ones by default.
    """
    config = config or OptimizeConfig()
    if options:
        config = config.replace(**options)
    original, source = graph_io.read_model(model)
    if not config.keep_io_types and any(oplists.updates_state_in_place(n.op_type, n.domain) for n in original.graph.node):
        raise ConfigError(
            f"{source or 'model'}: --no-keep-io-types cannot apply to an ONNX Runtime training graph: its "
            "inputs and outputs (parameters, gradient buffers) are bound by name and dtype to its checkpoint"
        )
    reason = _nothing_to_do(original)
    if reason:
        log.warning("%s: nothing to optimize: %s; the model is written unchanged", source or "model", reason)
        return OptimizeResult(original, PrecisionPlan(), _unchanged_report(config, source, reason), changed=False)
    if inputs is not None:
        if config.tune is None and config.activation_limit is None:
            raise ConfigError("optimize(inputs=...) feeds tune or activation_limit; without either it has no use")
        config = _shapes_from_inputs(original, config, inputs)
    if config.tune is not None:
        from onnxcampo.tune import tune

        return tune(original, config, optimize, inputs, source)
    # read_model gave us our own copy: we name its nodes, and the export reuses it in place.
    graph_io.name_nodes(original)
    original, fused = fuse.fuse_transformer(original, config)  # ORT's transformer fusions, before planning
    training = scaling.is_train_step(original)
    if training and not config.keep_io_types:
        log.warning("a training step keeps its input/output types (fp32 master weights and state)")
        config = config.replace(keep_io_types=True)

    needs_sizes = config.policy == "campo" or config.profile != "predict"
    info, unresolved = graph_io.infer_tensor_info(
        original, input_shapes=config.input_shapes, dim_values=config.dim_values, require_static=needs_sizes
    )
    cost = load_cost_model(config.device_db)
    ctx = GraphContext.build(original, source, config, cost, info, unresolved)
    if training:
        ctx.training_fp32 = frozenset(scaling.fp32_nodes(original))
        if config.policy == "campo" and (config.loss_scaling or scaling.has_loss_scaling(original)):
            # weight-gradient sums accumulate in fp32 inside ORT's kernels and loss scaling catches
            # their overflow (scaling.gradient_sums); amp keeps them on the deny list, as the baseline
            for name in scaling.gradient_sums(original):
                if ctx.categories.get(name) is oplists.Category.DENY:
                    ctx.categories[name] = oplists.Category.INFER
        if config.loss_scaling and not scaling.has_loss_scaling(original):
            ctx.loss_scaling = scaling.overhead(original, lambda name: info[name].numel if name in info else None)
            tensors = ctx.graph.tensors()
            ctx.loss_scaling_gradients = [tensors[g] for g in ctx.loss_scaling.gradients_read_as_is if g in tensors]
    if config.cost_graph == "ort":
        read_executed_graph(ctx)
    if config.activation_limit is not None:
        if training:
            raise ConfigError("--activation-limit calibrates inference models: a training step's activations "
                              "change as it trains (and its inputs include the weights)")
        _calibrate(ctx, inputs)
    if config.profile != "predict":
        _measure_fp32_times(ctx)

    ctx.freeze_topology(True)
    fixed = _analyse(ctx, PrecisionPlan(), (Classify(),))
    plans, times = {}, {}
    # The plans the report compares: the chosen policy's, plus fp32 and amp (what campo must beat).
    wanted = dict.fromkeys((config.policy, "fp32", "amp"))
    for name, passes in ((name, ANALYSIS[name]) for name in wanted):
        # Only campo pads for Tensor Cores; the other plans are costed as they would run.
        ctx.padding_enabled = name == "campo" and config.pad_tensor_cores
        plans[name] = _analyse(ctx, fixed.copy(), passes)
        times[name] = estimate.plan_time(ctx, plans[name])
    ctx.padding_enabled = False
    ctx.freeze_topology(False)
    chosen = config.policy
    notes = []
    if config.policy == "campo" and config.compare_plans:
        best = min(COMPARED, key=lambda name: times[name].total_us)
        if times[best].total_us < times["campo"].total_us:
            notes.append(
                f"the {best} plan is predicted faster ({times[best].total_us:.1f} us) than campo's "
                f"({times['campo'].total_us:.1f} us): keeping it"
            )
            plans["campo"] = plans[best].copy()  # its decisions keep their own reasons
            times["campo"] = times[best]
            chosen = best
        fp32_us, mixed_us = times["fp32"].total_us, times["campo"].total_us
        mixed = plans["campo"].counts().get("fp16", 0) > 0
        if mixed and chosen != "fp32" and mixed_us > (1 - config.min_gain) * fp32_us:
            gain = (fp32_us - mixed_us) / fp32_us if fp32_us else 0.0
            notes.append(
                f"the {chosen} plan is predicted {100 * gain:.1f} % faster than fp32, less than --min-gain "
                f"{100 * config.min_gain:.1f} % (within the cost model's error): keeping fp32"
            )
            plans["campo"] = plans["fp32"].copy()
            times["campo"] = times["fp32"]
            chosen = "fp32"
    ctx.plan = plans[config.policy]

    mutating = [InsertCasts()]
    if config.policy == "campo" and config.pad_tensor_cores:
        mutating.append(PadTensorCores())
    results = PassManager(mutating, check_invariants=config.check_invariants).run(ctx)

    report = _report(ctx, config, source, plans, times, chosen, notes, results)
    report["fuse"] = fused
    if config.activation_limit is not None:
        kept = sorted(n for n, d in ctx.plan.items() if d.reason is Reason.ACTIVATION_RANGE)
        report["calibration"] = {"inputs": "given" if inputs is not None else "random",
                                 "activation_limit": config.activation_limit, "tensors": len(ctx.activation_max),
                                 "largest": max(ctx.activation_max.values(), default=0.0),
                                 "nodes_kept_fp32": len(kept), "nodes": kept[:50]}
    metadata = {METADATA_KEY: config.policy, "onnxcampo.version": __version__}
    # A step graph's starting weights (read by the Trainer, by no node) survive the export.
    starts = [copy.deepcopy(t) for t in original.graph.initializer if t.name.startswith(INITIAL_PREFIX)] if training else []
    out = graph_io.export_model(ctx.graph, original, ctx.dtypes, metadata, in_place=True)
    fuse.clean_export(out)  # no planning-only shapes; no tensor names that ORT's fusions generate at load
    known = {t.name for t in out.graph.initializer}
    out.graph.initializer.extend(t for t in starts if t.name not in known)
    if config.int8_avg:
        report["int8_avg"] = _replace_matmul_integer(out)
    report["loss_scaling"] = False
    if training and config.loss_scaling and ctx.plan.counts().get("fp16", 0) and not scaling.has_loss_scaling(out):
        scaling.add_loss_scaling(out, dtypes=ctx.dtypes)
        report["loss_scaling"] = True
        report["notes"].append("dynamic loss scaling inserted (inputs loss_scale, loss_scale_clean_steps)")
    return OptimizeResult(out, ctx.plan, report, passes=results)


def _replace_matmul_integer(model: onnx.ModelProto) -> dict:
    """``--int8-avg`` on the exported model (the precision passes never see the custom op)."""
    from onnxcampo import ops
    from onnxcampo.int8_avg import replace_matmul_integer

    result = replace_matmul_integer(model)
    if result.replaced and not ops.available():
        log.warning("the model now uses %s ops; build the custom-op library (%s) to run it", ops.DOMAIN,
                    ops.BUILD_COMMAND)
    return result.to_json()


def _analyse(ctx: GraphContext, plan: PrecisionPlan, passes) -> PrecisionPlan:
    ctx.plan = plan
    PassManager(passes, check_invariants=ctx.config.check_invariants).run(ctx)
    return ctx.plan


def _nothing_to_do(model: onnx.ModelProto) -> str | None:
    graph = model.graph
    if not graph.node:
        return "the graph has no nodes"
    if any(p.key == METADATA_KEY for p in model.metadata_props):
        return "it was already optimized by onnxcampo"
    float32 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    float32 |= {v.name for v in (*graph.input, *graph.value_info, *graph.output)
                if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    has_constant_float = any(
        n.op_type == "Constant" and any(a.t.data_type == onnx.TensorProto.FLOAT for a in n.attribute) for n in graph.node
    )
    if not float32 and not has_constant_float:
        info, _ = graph_io.infer_tensor_info(model)
        if not any(entry.dtype == onnx.TensorProto.FLOAT for entry in info.values()):
            return "it has no float32 tensors"
    return None


def _shapes_from_inputs(model: onnx.ModelProto, config: OptimizeConfig,
                        inputs: Mapping[str, np.ndarray]) -> OptimizeConfig:
    """Pin the dynamic dims of the inputs given (tune's or the calibration's feeds) to their shapes,
    where neither ``input_shapes`` nor ``dim_values`` does: the plan could not be costed without
    them. Pins the user gave win (a calibration batch need not be the batch the plan is for)."""
    added = {}
    for vi in graph_io.graph_inputs(model):
        if vi.name in config.input_shapes or vi.name not in inputs or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        open_dims = [d for d in dims if not (d.HasField("dim_value") and d.dim_value > 0)
                     and not (d.HasField("dim_param") and d.dim_param in config.dim_values)]
        if open_dims and np.ndim(inputs[vi.name]) == len(dims):
            added[vi.name] = tuple(int(d) for d in np.shape(inputs[vi.name]))
    if not added:
        return config
    log.info("dynamic dims pinned to the given inputs' shapes: %s",
             ", ".join(f"{name}:{','.join(map(str, dims))}" for name, dims in added.items()))
    return config.replace(input_shapes={**config.input_shapes, **added})


def _calibrate(ctx: GraphContext, inputs: Mapping[str, np.ndarray] | None) -> None:
    """``activation_limit``: the largest |value| of every float tensor on the calibration feeds."""
    from onnxcampo.calibrate import activation_ranges
    from onnxcampo.runtime import random_inputs

    config = ctx.config
    if inputs is None:
        log.warning("calibrating on random inputs (standard-normal floats, integers 0-7): give representative "
                    "ones with --inputs / optimize(inputs=...) for ranges the model will see")
    feeds = dict(inputs) if inputs is not None else random_inputs(
        ctx.model, input_shapes=config.input_shapes, dim_values=config.dim_values)
    ctx.activation_max = activation_ranges(ctx.model, feeds, info=ctx.info)
    beyond = sum(v > config.activation_limit for v in ctx.activation_max.values())
    log.info("calibration: %d of %d float tensors beyond |x| = %g", beyond, len(ctx.activation_max),
             config.activation_limit)


def read_executed_graph(ctx: GraphContext) -> None:
    """Which nodes ORT runs as they are (``cost_graph="ort"``): read from the graph its
    optimizations leave of the model, input shapes pinned as the plan's (shape-dependent fusions
    such as MatMul + Add on 3-D inputs need them). A model ORT cannot load here is costed node by
    node, with a log line."""
    from onnxcampo.errors import CampoError
    from onnxcampo.runtime.optimized import executed_graph

    model = onnx.ModelProto()
    model.CopyFrom(ctx.model)
    fuse.rename_ort_generated_names(model)  # names ORT's own fusions would collide with at load
    try:
        graph_io.pin_input_shapes(model, ctx.config.input_shapes, ctx.config.dim_values, require_static=False)
        executed = executed_graph(model)
    except CampoError as exc:
        log.info("costing every ONNX node: ONNX Runtime's optimized graph is not available (%s)",
                 str(exc).splitlines()[0])
        return
    # the copy's tensor names are those of the executed graph (renamed); its node names are ours
    ctx.ort_status = executed.node_status(model)
    ctx.ort_nodes = executed.nodes
    if ctx.loss_scaling is not None:
        # a mixed step gets loss scaling, which makes the loss gradient's seed read the scale: ORT
        # no longer folds that chain. A node counts as fused only where it is so in both graphs.
        scaled = onnx.ModelProto()
        scaled.CopyFrom(model)
        try:
            scaling.add_loss_scaling(scaled)
            with_scaling = executed_graph(scaled).node_status(scaled)
        except CampoError as exc:  # one status set for every plan, so neither kind gains from it
            log.info("ORT's graph of the loss-scaled step not read (%s): its plans are costed on the step's",
                     str(exc).splitlines()[0])
            return
        ctx.ort_status_fp32 = ctx.ort_status  # an all-fp32 step gets no scaling (estimate.plan_time)
        ctx.ort_status = {name: status for name, status in ctx.ort_status.items() if with_scaling.get(name) == status}
    log.info("ONNX Runtime runs %d of the %d nodes (%d absorbed, %d fused)", executed.nodes, len(ctx.nodes),
             sum(s == "absorbed" for s in ctx.ort_status.values()),
             sum(s != "absorbed" for s in ctx.ort_status.values()))


def _measure_fp32_times(ctx: GraphContext) -> None:
    from onnxcampo.profile import measure_node_times
    from onnxcampo.runtime import random_inputs

    feeds = random_inputs(ctx.model, input_shapes=ctx.config.input_shapes, dim_values=ctx.config.dim_values)
    measured = measure_node_times(ctx.model, provider=ctx.config.profile, feeds=feeds)
    used = 0
    for name, micros in measured.node_us.items():
        if name in ctx.fp32_us and micros > 0:
            ctx.fp32_us[name] = micros
            used += 1
    ctx.stats["profiled_nodes"] = used
    log.info("profiled %d nodes on %s: a run takes %.1f us", used, ctx.config.profile, measured.run_us)


def _report(ctx, config, source, plans, times, chosen, notes, results) -> dict:
    plan = ctx.plan
    counts = plan.counts()
    return {
        "onnxcampo_version": __version__,
        "input": str(source) if source else None,
        "policy": config.policy,
        "chosen_plan": chosen,
        "cost_model": ctx.cost.describe(),
        "profile": config.profile,
        "execution": config.execution,
        "cost_graph": "ort" if ctx.ort_nodes is not None else "onnx",
        "nodes": len(ctx.model.graph.node),
        "ort_nodes": ctx.ort_nodes,
        "nodes_fp16": counts.get("fp16", 0),
        "nodes_fp32": counts.get("fp32", 0),
        "reasons": plan.reasons(),
        "casts_inserted": ctx.stats["casts_inserted"],
        "pads_inserted": ctx.stats["pads_inserted"],
        "initializers_converted": ctx.stats["initializers_converted"],
        "initializer_values_clamped": ctx.stats["initializer_values_clamped"],
        "predicted_us": {name: t.to_json() for name, t in times.items()},
        "plans": {name: {"nodes_fp16": p.counts().get("fp16", 0), "casts": times[name].casts} for name, p in plans.items()},
        "unresolved_dims": ctx.unresolved_dims,
        "notes": notes,
        "passes": [{"name": r.name, "counts": r.counts, "seconds": round(r.seconds, 4)} for r in results],
        "plan": plan.to_json(),
    }


def _unchanged_report(config: OptimizeConfig, source, reason: str) -> dict:
    return {
        "onnxcampo_version": __version__, "input": str(source) if source else None, "policy": config.policy,
        "chosen_plan": None, "nodes_fp16": 0, "nodes_fp32": 0, "casts_inserted": 0, "pads_inserted": 0,
        "initializers_converted": 0, "initializer_values_clamped": 0, "notes": [f"nothing to optimize: {reason}"],
        "plan": {},
    }
