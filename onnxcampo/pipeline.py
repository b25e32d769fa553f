"""The optimizer as data: what runs, in which order, for each policy.

An untuned ``optimize()`` is :func:`load` -> :func:`prepare` (ORT's transformer fusions, shapes,
costs, what ORT executes, calibration, profiling) -> :func:`plan_policies` (one analysis pipeline
per compared policy, each costed) -> :func:`choose_plan` -> :func:`apply` (the mutating passes)
-> :func:`export` (the model file and its finishing steps). ``optimize`` runs :func:`run`;
``tune`` runs it once per candidate.
"""

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
from onnxcampo import estimate, oplists
from onnxcampo.rewrites import transformer
from onnxcampo import ir
from onnxcampo.config import OptimizeConfig
from onnxcampo.context import GraphContext, Planning
from onnxcampo.costdb.select import load_cost_model
from onnxcampo.errors import ConfigError, did_you_mean, option
from onnxcampo.passes.allow_by_cost import AllowByCost
from onnxcampo.passes.allow_islands import AllowIslands
from onnxcampo.passes.amp_casts import AmpCasts
from onnxcampo.passes.amp_deny_propagation import AmpDenyPropagation
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.clear_by_cost import ClearByCost
from onnxcampo.passes.deny_propagation import DenyPropagation
from onnxcampo.passes.fill_infer_clear import FillInferClear
from onnxcampo.passes.insert_casts import InsertCasts
from onnxcampo.passes.manager import PassBase, PassManager, PassResult
from onnxcampo.passes.pad_tensor_cores import PadTensorCores
from onnxcampo.passes.refine_by_cost import RefineByCost
from onnxcampo.passes.training_rules import TrainingRules
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, PrecisionPlan, Reason
from onnxcampo.report import build_report, unchanged_report
from onnxcampo.training import scaling
from onnxcampo.training.step import INITIAL_PREFIX

log = logging.getLogger("onnxcampo.api")

METADATA_KEY = "onnxcampo.policy"
_DEFAULT = UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32)

# --- the pipelines ---------------------------------------------------------------------------
# Every plan starts from the decisions of ``Classify`` (made once), then runs its policy's passes;
# amp's are TensorFlow's auto_mixed_precision (passes/amp_deny_propagation.py, amp_casts.py).
CLASSIFY = (Classify(),)
ANALYSIS: dict[str, tuple[PassBase, ...]] = {
    "campo": (AllowByCost(), DenyPropagation(), AllowIslands(), FillInferClear(), ClearByCost(),
              ClearByCost(infer=True), _DEFAULT, RefineByCost()),
    "amp": (AllowByCost(greedy=True), AmpDenyPropagation(), FillInferClear(casts=False), ClearByCost(greedy=True),
            AmpCasts(), _DEFAULT),
    "fp16": (UniformPrecision(Precision.FP16, Reason.POLICY_FP16),),
    "fp32": (UniformPrecision(Precision.FP32, Reason.POLICY_FP32),),
}
COMPARED = ("fp32", "amp")  # plans campo must never be predicted slower than
TRAINING = (TrainingRules(),)  # a training step's rules, before any plan (passes/training_rules.py)


def mutating_passes(config: OptimizeConfig) -> tuple[PassBase, ...]:
    """The passes that change the graph, after the plan is chosen: Casts, then (campo) padding."""
    if config.policy == "campo" and config.experimental.pad_tensor_cores:
        return (InsertCasts(), PadTensorCores())
    return (InsertCasts(),)


@dataclass
class OptimizeResult:
    model: onnx.ModelProto
    plan: PrecisionPlan
    report: dict
    changed: bool = True
    passes: list[PassResult] = field(default_factory=list)

    def save(self, path: str | os.PathLike) -> None:
        # ONNX Runtime test-loads what onnxcampo changed; an unchanged model is the input's business
        ir.save_model(self.model, Path(path), check_loads=self.changed)


# The model-file rewrites whose option may be left None, in the order the finishing passes run
# them and :func:`decide_rewrites` decides them.
REWRITES = ("channels_last", "fuse_reductions", "fuse_elementwise")


@dataclass
class RewriteDecision:
    """Whether one of :data:`REWRITES` runs, and who decided (``by``): ``user`` (an explicit
    True/False), ``default`` (a training step's: on where the library's CUDA kernels run when the
    step is built with the fused ops, off when it is built with standard ops), ``unavailable``
    (left None where the library's CUDA kernels, or NVRTC, would not run the written model: off,
    ``why`` says why) or ``prediction`` (left None on an inference model: :func:`decide_rewrites`;
    ``on`` is None until it has). ``prediction``: the plan's predicted time with and without it."""

    on: bool | None
    by: str
    why: str = ""
    prediction: estimate.RewritePrediction | None = None

    def to_json(self) -> dict:
        out = {"on": self.on, "by": self.by, "why": self.why}
        if self.prediction is not None:
            out.update({"predicted_with_us": round(self.prediction.with_us, 3),
                        "predicted_without_us": round(self.prediction.without_us, 3)})
        return out


@dataclass
class Loaded:
    """A model read for planning: our own copy, the config its inputs completed, and how each of
    :data:`REWRITES` is (to be) decided."""

    model: onnx.ModelProto
    source: Path | None
    config: OptimizeConfig
    rewrites: dict[str, RewriteDecision] = field(default_factory=dict)


@dataclass
class Prepared:
    ctx: GraphContext
    fused: dict | None
    training: bool


@dataclass
class Plans:
    """Every compared policy's plan and predicted time, and the one chosen for the policy asked."""

    plans: dict[str, PrecisionPlan]
    times: dict[str, estimate.PlanTime]
    chosen: str
    notes: list[str]


# --- the steps -------------------------------------------------------------------------------

def load(model, config: OptimizeConfig, inputs: Mapping[str, np.ndarray] | None) -> Loaded | OptimizeResult:
    """Read the model and check the request; an :class:`OptimizeResult` when there is nothing to do."""
    original, source = ir.read_model(model)
    _check_names(original, config)
    if config.experimental.static_shapes:  # our own copy: the written model gets the pinned dims
        ir.pin_input_shapes(original, config.input_shapes, config.dim_values, require_static=False)
    config, rewrites = _default_rewrites(original, config, source)
    if not config.keep_io_types and any(oplists.updates_state_in_place(n.op_type, n.domain) for n in original.graph.node):
        raise ConfigError(
            f"{source or 'model'}: {option('keep_io_types', False)} cannot apply to an ONNX Runtime training graph: its "
            "inputs and outputs (parameters, gradient buffers) are bound by name and dtype to its checkpoint"
        )
    if config.fuse_elementwise:
        _require_ops_library(option("fuse_elementwise"))
    if config.fuse_reductions:
        _require_ops_library(option("fuse_reductions"))
    if config.channels_last:
        _require_ops_library(option("channels_last"))
    reason = _nothing_to_do(original)
    if reason:
        log.warning("%s: nothing to optimize: %s; the model is written unchanged", source or "model", reason)
        return OptimizeResult(original, PrecisionPlan(), unchanged_report(config, source, reason), changed=False)
    if inputs is not None:
        if config.tune is None and config.activation_limit is None:
            raise ConfigError("optimize(inputs=...) feeds tune or activation_limit; without either it has no use")
        config = _shapes_from_inputs(original, config, inputs)
    return Loaded(original, source, config, rewrites)


def _default_rewrites(model: onnx.ModelProto, config: OptimizeConfig,
                      source) -> tuple[OptimizeConfig, dict[str, RewriteDecision]]:
    """Who decides each of :data:`REWRITES` (:class:`RewriteDecision`). An option the user set is
    theirs. One left None:

    1. a training step built with standard ops: off (it runs without the library);
    2. where the written model would not run the library's CUDA kernels (no CUDA execution
       provider, the library not built or built without them; FusedElementwise: no NVRTC): off,
       with one line saying why (a warning where a GPU is detected: speed was expected);
    3. a training step built with the fused ops: on;
    4. an inference model: left None, decided by predicted cost after the plan (:func:`decide_rewrites`).
    """
    decisions = {name: RewriteDecision(bool(getattr(config, name)), "user") for name in REWRITES
                 if getattr(config, name) is not None}
    unset = [name for name in REWRITES if getattr(config, name) is None]
    if not unset:
        return config, decisions
    from onnxcampo import ops

    step = scaling.is_train_step(model)
    if step and not ops.uses_ops(model):
        decisions.update({name: RewriteDecision(False, "default", "a training step built with standard ops")
                          for name in unset})
        return config.replace(**dict.fromkeys(unset, False)), decisions
    here = {"channels_last": ops.cuda_kernels_here(), "fuse_reductions": ops.cuda_kernels_here(),
            "fuse_elementwise": ops.generated_kernels_here()}
    chosen, missing = {}, {}
    for name in unset:
        if not here[name]:
            why = (ops.missing_cuda_kernels(generated=name == "fuse_elementwise")
                   or "the library's CUDA kernels do not run here")
            missing.setdefault(why, []).append(name)
            chosen[name] = False
            decisions[name] = RewriteDecision(False, "unavailable", why)
        elif step:
            chosen[name] = True
            decisions[name] = RewriteDecision(True, "default", "a training step built with the fused ops, their CUDA "
                                                               "kernels here")
        else:
            decisions[name] = RewriteDecision(None, "prediction")
    if missing:
        from onnxcampo.costdb.select import detected_gpu

        gpu = detected_gpu()
        text = "; ".join(f"{_listed([option(name) for name in names])} off: {why}" for why, names in missing.items())
        (log.warning if gpu else log.info)("%s: %s%s", source or "model", text,
                                            f" (the GPU here, {gpu}, runs the model without onnxcampo's kernels)"
                                            if gpu else "")
    on = [name for name, value in chosen.items() if value]
    if on:
        log.info("%s: a training step on a machine with the fused ops' CUDA kernels: %s on by default (%s to turn "
                 "off)", source or "model", " and ".join(option(name) for name in on),
                 " / ".join(option(name, False) for name in on))
    return config.replace(**chosen), decisions


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def run(model, config: OptimizeConfig, inputs: Mapping[str, np.ndarray] | None = None) -> OptimizeResult:
    """An untuned ``optimize``: load -> prepare -> plan -> choose -> apply -> export."""
    loaded = load(model, config, inputs)
    if isinstance(loaded, OptimizeResult):
        return loaded
    return run_loaded(loaded, inputs)


def run_loaded(loaded: Loaded, inputs: Mapping[str, np.ndarray] | None = None) -> OptimizeResult:
    prepared = prepare(loaded, inputs)
    chosen = decide_rewrites(prepared.ctx, plan_policies(prepared.ctx), loaded.rewrites)
    config = prepared.ctx.config
    # before the mutating passes change the graph
    both = _both_costings(prepared.ctx, chosen) if config.fuse_elementwise or config.fuse_reductions else None
    plan = chosen.plans[config.policy]
    costs = node_rows(prepared.ctx, plan, padding=chosen.chosen == "campo" and config.experimental.pad_tensor_cores)
    ctx = Planning(prepared.ctx, plan)  # the chosen plan, applied and exported
    results = apply(ctx)
    report = build_report(ctx, loaded.source, chosen.plans, chosen.times, chosen.chosen, chosen.notes, results,
                          node_costs=costs)
    report["fuse"] = prepared.fused
    report["rewrites"] = {name: loaded.rewrites[name].to_json() for name in REWRITES if name in loaded.rewrites}
    if both is not None:
        report["predicted_fusion"] = both
    if config.activation_limit is not None:
        kept = sorted(n for n, d in ctx.plan.items() if d.reason is Reason.ACTIVATION_RANGE)
        report["calibration"] = {"inputs": "given" if inputs is not None else "random",
                                 "activation_limit": config.activation_limit, "tensors": len(ctx.activation_max),
                                 "largest": max(ctx.activation_max.values(), default=0.0),
                                 "nodes_kept_fp32": len(kept), "nodes": kept[:50]}
    out = export(ctx, ctx.model, prepared.training, report)  # the planned (fused) model
    return OptimizeResult(out, ctx.plan, report, passes=results)


def prepare(loaded: Loaded, inputs: Mapping[str, np.ndarray] | None = None) -> Prepared:
    """The context the passes read: ORT's transformer fusions first, then shapes, the cost model,
    the training step's rules, the graph ORT executes, calibration and profiling."""
    config, source = loaded.config, loaded.source
    # load gave us our own copy: we name its nodes, and the export reuses it in place.
    ir.name_nodes(loaded.model)
    # ORT's transformer fusions, before planning, on our copy itself
    original, fused = transformer.fuse_transformer(loaded.model, config, in_place=True)
    training = scaling.is_train_step(original)
    if training and not config.keep_io_types:
        log.warning("a training step keeps its input/output types (fp32 master weights and state)")
        config = config.replace(keep_io_types=True)
    needs_sizes = config.policy == "campo" or config.experimental.profile != "predict"
    info, unresolved = ir.infer_tensor_info(
        original, input_shapes=config.input_shapes, dim_values=config.dim_values, require_static=needs_sizes
    )
    cost = load_cost_model(config.device_db)
    ctx = GraphContext.build(original, source, config, cost, info, unresolved)
    if training:
        analyse(Planning(ctx, analysis=True), TRAINING)  # tables only: no plan yet
    if config.experimental.cost_graph == "ort":
        read_executed_graph(ctx)
    if config.activation_limit is not None:
        if training:
            raise ConfigError(f"{option('activation_limit')} calibrates inference models: a training step's activations "
                              "change as it trains (and its inputs include the weights)")
        _calibrate(ctx, inputs)
    if config.experimental.profile != "predict":
        _measure_fp32_times(ctx)
    return Prepared(ctx, fused, training)


def plan_policies(ctx: GraphContext) -> Plans:
    """The plans the report compares (the chosen policy's, plus fp32 and amp: what campo must
    beat), each costed, and the choice among them (:func:`choose_plan`)."""
    config = ctx.config
    fixed = analyse(Planning(ctx, analysis=True), CLASSIFY)
    plans, times = {}, {}
    for name in dict.fromkeys((config.policy, "fp32", "amp")):
        # Only campo pads for Tensor Cores; the other plans are costed as they would run.
        padding = name == "campo" and config.experimental.pad_tensor_cores
        planning = Planning(ctx, fixed.copy(), padding=padding, analysis=True)
        plans[name] = analyse(planning, ANALYSIS[name])
        times[name] = estimate.plan_time(planning, plans[name])
    chosen, notes = choose_plan(config, plans, times)
    return Plans(plans, times, chosen, notes)


def decide_rewrites(ctx: GraphContext, chosen: Plans, decisions: dict[str, RewriteDecision]) -> Plans:
    """Decide the rewrites left to prediction (``decisions[name].by == "prediction"``) on the kept
    plan, in the execution mode configured, and return the plans to keep.

    1. Each rewrite's ``estimate.PREDICTIONS`` function costs the plan with it and without it, the
       other rewrites as decided so far (those not decided yet: off); it is kept when predicted at
       least ``min_gain`` faster. In :data:`REWRITES` order, in sweeps until no decision changes
       (one rewrite may pay only with another: channels-last's bias and ReLUs cost nothing more
       with the elementwise fusion), so each decision's numbers are the final configuration with
       and without it.
    2. ``ctx.config`` becomes the decided configuration.
    3. With a rewrite kept (and ``plan_for_fusion``), the policies are planned again costed with it,
       as an explicit option would have them; the new plans are kept unless the kept plan with the
       rewrites is predicted faster, else the kept plans are costed as they now run. The
       decisions keep the numbers of the plan they were made on.
    """
    pending = [name for name in REWRITES if name in decisions and decisions[name].by == "prediction"]
    if not pending:
        return chosen
    config = ctx.config
    plan = chosen.plans[config.policy]
    padding = chosen.chosen == "campo" and config.experimental.pad_tensor_cores
    planning = Planning(ctx, plan, padding=padding, analysis=True)
    settings = dict.fromkeys(pending, False)
    ctx.config = config.replace(**settings)
    try:
        for _ in range(len(REWRITES) + 1):
            changed = False
            for name in pending:
                prediction = estimate.PREDICTIONS[name](planning, plan)
                on = prediction.with_us <= (1 - config.min_gain) * prediction.without_us
                changed |= on != settings[name]
                settings[name] = on
                ctx.config = ctx.config.replace(**{name: on})
                decisions[name] = RewriteDecision(on, "prediction", _prediction_words(prediction, config.min_gain),
                                                  prediction)
            if not changed:
                break
    except BaseException:
        ctx.config = config
        raise
    decided = ctx.config
    _say_where_dynamic_dims_stop_them(ctx.model, {name: decisions[name] for name in pending})
    log.info("rewrites by predicted cost (%s): %s", config.execution,
             ", ".join(f"{option(name)} {'on' if settings[name] else 'off'}" for name in pending))
    kept = estimate.plan_time(planning, plan)
    if any(settings.values()) and decided.experimental.plan_for_fusion:
        again = plan_policies(ctx)
        if again.times[config.policy].total_us <= kept.total_us:
            return again
    pads = decided.experimental.pad_tensor_cores
    times = {name: kept if name == config.policy else estimate.plan_time(
                 Planning(ctx, other, padding=name == "campo" and pads, analysis=True), other)
             for name, other in chosen.plans.items()}
    return Plans(chosen.plans, times, chosen.chosen, chosen.notes)


def _say_where_dynamic_dims_stop_them(model: onnx.ModelProto, decisions: dict[str, RewriteDecision]) -> None:
    """The rewrites act on the written model's static shapes only; a model with dynamic input dims
    keeps them (the pins of ``input_shapes`` / ``dim_values`` size the costs only), so each rewrite
    is predicted to change nothing. Say so once, with the way out, and in each decision's words."""
    unchanged = [name for name, d in decisions.items()
                 if d.prediction is not None and d.prediction.with_us == d.prediction.without_us]
    dynamic = ir.dynamic_inputs(model)
    if not unchanged or len(unchanged) != len(decisions) or not dynamic:
        return
    names, one = ", ".join(dynamic), len(dynamic) == 1
    words = f"it acts on static shapes only, and {names} {'keeps' if one else 'keep'} dynamic dims in the written model"
    for name in unchanged:
        decision = decisions[name]
        decision.why = f"{decision.why}: {words}"
    log.warning("the fused kernels and channels-last act on static shapes only: %s dynamic dims, which the "
                "written model keeps (the pinned dims size the costs only); to have them considered, fix the "
                "dims in the model first (python -m onnxruntime.tools.make_dynamic_shape_fixed --input_name "
                "NAME --input_shape DIMS IN.onnx OUT.onnx), or write it fixed at the pinned dims with %s",
                f"input {names} has" if one else f"inputs {names} have", option("static_shapes", True))


def _prediction_words(prediction: estimate.RewritePrediction, min_gain: float) -> str:
    gain = prediction.gain
    text = (f"predicted {prediction.with_us:.1f} us with it, {prediction.without_us:.1f} us without "
            f"({100 * abs(gain):.1f} % {'faster' if gain >= 0 else 'slower'})")
    if 0 <= gain < min_gain:
        text += f", less than min_gain {100 * min_gain:.1f} %"
    return text


def _both_costings(ctx: GraphContext, chosen: Plans) -> dict:
    """The kept plan's predicted total costed with the fusion passes in view and without
    (``plan_for_fusion``): the plan was chosen under one of them; the other says what it would
    have been predicted to cost the other way (a fusion-blind plan run fused, for one)."""
    config = ctx.config
    padding = chosen.chosen == "campo" and config.experimental.pad_tensor_cores
    kernel = ctx.cost.fused_kernel()
    out = {"planned_for_fusion": config.experimental.plan_for_fusion,
           "fused_kernel": {"bytes_per_us": kernel.bytes_per_us, "fixed_us": kernel.fixed_us, "measured": kernel.measured}}
    for name, aware in (("fusion_aware_us", True), ("fusion_blind_us", False)):
        ctx.config = config.with_experimental(plan_for_fusion=aware)
        try:
            planning = Planning(ctx, chosen.plans[config.policy], padding=padding, analysis=True)
            out[name] = round(estimate.plan_time(planning, chosen.plans[config.policy]).total_us, 3)
        finally:
            ctx.config = config
    return out


def choose_plan(config: OptimizeConfig, plans: dict[str, PrecisionPlan],
                times: dict[str, estimate.PlanTime]) -> tuple[str, list[str]]:
    """Which plan the campo policy keeps (``plans["campo"]``/``times["campo"]`` become it): the
    fastest of campo, fp32 and amp by prediction (``compare_plans``), and fp32 unless the mixed
    plan is predicted at least ``min_gain`` faster. Other policies keep their own plan."""
    chosen, notes = config.policy, []
    if config.policy != "campo" or not config.experimental.compare_plans:
        return chosen, notes
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
    return chosen, notes


def node_rows(ctx: GraphContext, plan: PrecisionPlan, *, padding: bool) -> dict[str, dict]:
    """Each planned node's op and own numbers under the chosen plan (``estimate.node_costs``),
    read before the mutating passes change the graph."""
    costs = estimate.node_costs(Planning(ctx, plan, padding=padding, analysis=True), plan)
    status = ctx.ort_status or {}
    return {node.name: {"op": node.op, **costs[node.name],
                        **({"ort": status[node.name]} if node.name in status else {})} for node in ctx.nodes}


def analyse(planning: Planning, passes) -> PrecisionPlan:
    """Run analysis ``passes`` on ``planning`` and return the plan they leave."""
    PassManager(passes, check_invariants=planning.config.experimental.check_invariants, name="analyse").run(planning)
    return planning.plan


def apply(ctx: Planning) -> list[PassResult]:
    """The mutating passes on the chosen plan (invariants checked after each with ``--debug``)."""
    manager = PassManager(mutating_passes(ctx.config), check_invariants=ctx.config.experimental.check_invariants,
                          name="apply")
    manager.run(ctx)
    return manager.results


def export(ctx: Planning, original: onnx.ModelProto, training: bool, report: dict) -> onnx.ModelProto:
    """The written model: the edited graph as a model file, then the :data:`FINISHING` passes on
    it (each recorded in ``report``; with ``check_invariants`` the ONNX checker after each)."""
    config = ctx.config
    metadata = {METADATA_KEY: config.policy, "onnxcampo.version": __version__}
    # read before the export, which reuses the planned model in place
    starts = [copy.deepcopy(t) for t in original.graph.initializer if t.name.startswith(INITIAL_PREFIX)] if training else []
    before = {node.name: (node.op_type, node.doc_string) for node in _all_nodes(original.graph)}
    out = ir.export_model(ctx.graph, original, ctx.dtypes, metadata, in_place=True)
    transformer.clean_export(out)  # no planning-only shapes; no tensor names that ORT's fusions generate at load
    exported = Exported(out, ctx, training, report, starts, before)
    PassManager(FINISHING, check_invariants=config.experimental.check_invariants, checker=_check_exported,
                name="finish").run(exported)
    return out


@dataclass
class Exported:
    """What the finishing passes work on: the model file as written, and what they read."""

    model: onnx.ModelProto
    ctx: Planning
    training: bool
    report: dict
    starting_weights: list[onnx.TensorProto]
    original_nodes: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (op type, doc_string)
    # the model's tensor types and shapes as --fuse-reductions left them (it records what it makes):
    # --fuse-elementwise reads them instead of inferring them again
    tensor_info: dict | None = None


class KeepStartingWeights(PassBase):
    """A step graph's starting weights (read by the Trainer, by no node) survive the export."""

    name = "starting_weights"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        known = {t.name for t in exported.model.graph.initializer}
        kept = [t for t in exported.starting_weights if t.name not in known]
        exported.model.graph.initializer.extend(kept)
        return PassResult(self.name, bool(kept), {"kept": len(kept)})


class Int8Avg(PassBase):
    """The experimental ``int8_avg``: MatMulInteger as ai.onnxcampo's AvgMatMulInteger (the precision passes
    never see the custom op)."""

    name = "int8_avg"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        if not exported.ctx.config.experimental.int8_avg:
            return PassResult(self.name, False)
        exported.report["int8_avg"] = summary = _replace_matmul_integer(exported.model)
        replaced = int(summary.get("replaced", 0) or 0)
        return PassResult(self.name, bool(replaced), {"replaced": replaced})


class AddLossScaling(PassBase):
    """A training step with fp16 nodes gets dynamic loss scaling (inputs ``loss_scale``,
    ``loss_scale_clean_steps``), unless asked not to or already there."""

    name = "loss_scaling"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        ctx, out, report = exported.ctx, exported.model, exported.report
        report["loss_scaling"] = False
        if not (exported.training and ctx.config.loss_scaling and ctx.plan.counts().get("fp16", 0)
                and not scaling.has_loss_scaling(out)):
            return PassResult(self.name, False)
        scaling.add_loss_scaling(out, dtypes=ctx.dtypes)
        report["loss_scaling"] = True
        report["notes"].append("dynamic loss scaling inserted (inputs loss_scale, loss_scale_clean_steps)")
        return PassResult(self.name, True, {"inserted": 1})


class FuseElementwise(PassBase):
    """``--fuse-elementwise``: chains of elementwise ops and their Casts as FusedElementwise
    nodes, last (it sees the Casts and the loss scaling ORT will run)."""

    name = "fuse_elementwise"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        if not exported.ctx.config.fuse_elementwise:
            return PassResult(self.name, False)
        from onnxcampo.rewrites.elementwise import fuse_elementwise

        experimental = exported.ctx.config.experimental
        leave = ort_fused_nodes(exported.ctx, exported.model) if experimental.yield_to_ort_fusions else set()
        result = fuse_elementwise(exported.model, leave=leave, info=exported.tensor_info,
                                  column_sums=experimental.fuse_column_sums)
        exported.report["fuse_elementwise"] = {**result.to_json(), "left_to_ort": len(leave)}
        return PassResult(self.name, bool(result.groups), {"fused": result.groups, "replaced": result.nodes})


def ort_fused_nodes(ctx: GraphContext, model: onnx.ModelProto) -> set[str]:
    """Nodes of ``model`` that ONNX Runtime's own graph optimizations fuse into a neighbour or
    fold (``ctx.ort_status``: absorbed, fused, carried; read on the planning graph at the extended
    level, as the CUDA EP fuses): the elementwise fusion leaves them to ORT, as the costing
    (``onnxcampo.rewrites.elementwise.predicted_groups``) assumed. Casts and views stay fusable: ORT's removal of
    those is no kernel of its own, and the fusion computes them in registers. Used with
    ``yield_to_ort_fusions`` (off by default, no GPU measurement shows it faster: on the BERT-base
    b32 step it leaves 361 nodes to ORT and makes 139 fused groups instead of 211, 72 Casts then
    standalone)."""
    if not ctx.ort_status:
        return set()
    ops = {node.name: node.op_type for node in model.graph.node}
    return {name for name in ctx.ort_status
            if name in ops and ops[name] != "Cast" and ops[name] not in oplists.ALIASED}


class ChannelsLast(PassBase):
    """``--channels-last``: the 2-D convolutions and their gradients as ai.onnxcampo's NHWC ops,
    their activations channels-last (``onnxcampo.rewrites.layout``); after loss scaling, before the
    fusions (which then fuse the channels-last elementwise ops and reductions)."""

    name = "channels_last"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        if not exported.ctx.config.channels_last:
            return PassResult(self.name, False)
        from onnxcampo.rewrites.layout import to_channels_last

        result = to_channels_last(exported.model, stem=exported.ctx.config.experimental.channels_last_stem)
        exported.report["channels_last"] = result.to_json()
        converted = result.convolutions + result.data_grads + result.weight_grads
        return PassResult(self.name, bool(converted), {"converted": converted, "transposes": result.transposes})


class FuseReductions(PassBase):
    """``--fuse-reductions``: a cross-entropy loss and its gradient as SoftmaxCrossEntropy(Grad)
    nodes, layer-norm and softmax input gradients as LayerNormGrad / SoftmaxGrad nodes
    (``fuse_row_gradients``), then ReduceSums over leading/trailing blocks of axes, with the
    Reshapes and Casts around them, as BlockReduceSum nodes; after loss scaling (whose Casts it
    folds), before the elementwise fusion (which then sees the reductions' Casts gone)."""

    name = "fuse_reductions"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        if not exported.ctx.config.fuse_reductions:
            return PassResult(self.name, False)
        from onnxcampo.rewrites.loss import fuse_softmax_cross_entropy
        from onnxcampo.rewrites.norm import NormFusionResult, fuse_layer_norm_grad
        from onnxcampo.rewrites.reductions import fuse_reductions

        # first the patterns whose reductions the block reductions would take: the loss's, the
        # layer norms' and softmaxes' input gradients; one shape inference for the three (each
        # records the tensors it makes)
        info, _ = ir.infer_tensor_info(exported.model)
        loss = fuse_softmax_cross_entropy(exported.model, info)
        norms = (fuse_layer_norm_grad(exported.model, info) if exported.ctx.config.experimental.fuse_row_gradients
                 else NormFusionResult())
        result = fuse_reductions(exported.model, info)
        report = {**result.to_json(), "loss": loss.to_json(), "layer_norms": norms.to_json()}
        fused = result.fused + loss.forward + loss.backward + norms.fused + norms.softmax
        if exported.ctx.config.experimental.batchnorm_sums:  # the block sums a training BatchNorm makes, in pairs
            from onnxcampo.rewrites.batch_norm import fuse_batchnorm_sums

            sums = fuse_batchnorm_sums(exported.model, info)
            report["batchnorm_sums"] = sums.to_json()
            fused += sums.forward + sums.backward
        exported.tensor_info = info
        exported.report["fuse_reductions"] = report
        return PassResult(self.name, bool(fused),
                          {"fused": fused, "replaced": result.reductions + loss.nodes + norms.nodes})


class AnnotateNodes(PassBase):
    """Every written node says in its doc_string what onnxcampo made of it (Netron shows it): a
    planned node its precision, the reason and its own predicted times (``report["plan_nodes"]``),
    a node onnxcampo inserted why it is there; the input's doc_string text is kept, ours appended.
    Last: it sees the nodes the other finishing passes add."""

    name = "annotate_nodes"
    mutates = True

    def run(self, exported: Exported) -> PassResult:
        plan, report = exported.ctx.plan, exported.report
        rows, inserted, original = report.get("plan_nodes", {}), exported.ctx.inserted, exported.original_nodes
        annotated = 0
        for node in _all_nodes(exported.model.graph):
            op, doc = original.get(node.name, (None, ""))
            decision = plan.get(node.name)
            if decision is not None and op == node.op_type:
                text = f"onnxcampo: {decision.precision.value} ({decision.reason.value})"
                row = rows.get(node.name)
                if row is not None:
                    text += f"; {node_numbers_text(row)}"
            elif node.name in inserted and inserted[node.name]["op"] == node.op_type:
                text = f"onnxcampo: inserted: {inserted[node.name]['why']}"
            else:
                doc = doc if op == node.op_type else ""
                added = "added after planning" + (" (dynamic loss scaling)" if report.get("loss_scaling") else "")
                text = f"onnxcampo: {_ADDED.get(node.op_type, added)}"
            node.doc_string = f"{doc}\n{text}" if doc and text not in doc else (doc or text)
            annotated += 1
        return PassResult(self.name, bool(annotated), {"nodes": annotated})


def node_numbers_text(row: dict) -> str:
    """A node's own predicted numbers in words (``report["plan_nodes"]`` row)."""
    if row["fp32_us"] == row["fp16_us"]:
        text = f"predicted {row['fp32_us']:.2f} us"
    else:
        text = f"predicted fp32 {row['fp32_us']:.2f} us, fp16 {row['fp16_us']:.2f} us"
    if row.get("casts"):
        text += f", causes {row['casts']:.3g} Cast{'' if row['casts'] == 1 else 's'} ({row['cast_us']:.2f} us)"
    return text


# What the finishing passes add, in words, for the doc_string of their nodes.
_ADDED = {
    "FusedElementwise": "a chain of elementwise ops (and their Casts) as one kernel (--fuse-elementwise)",
    "BlockReduceSum": "a ReduceSum over a block of axes with its Reshapes and Casts as one kernel (--fuse-reductions)",
    "SoftmaxCrossEntropy": "the cross-entropy loss (LogSoftmax, OneHot, Mul, ReduceSum) in one pass over the logits "
                           "(--fuse-reductions)",
    "SoftmaxCrossEntropyGrad": "the cross-entropy loss's gradient (g - exp(logp) * ReduceSum(g)) in one pass "
                               "(--fuse-reductions)",
    "LayerNormGrad": "a layer norm's input gradient (Muls, Subs, two ReduceMeans, the residual Sum) in one pass "
                     "(--fuse-reductions)",
    "SoftmaxGrad": "a softmax's input gradient (Mul, ReduceSum, Sub, Mul and a constant scale) in one pass "
                   "(--fuse-reductions)",
    "BatchNormStats": "a training BatchNorm's two forward sums (of x and of its squared deviations) in one pass "
                      "(--experimental batchnorm_sums)",
    "BatchNormGradSums": "a training BatchNorm's two backward sums (of dy and dy * xhat) in one pass "
                         "(--experimental batchnorm_sums)",
    "MultiTensorCast": "the float32 -> float16 Casts of the weights as one kernel (--fuse-elementwise)",
    "AvgMatMulInteger": "MatMulInteger with 16-bit tree-averaging accumulation (the experimental int8_avg)",
}


def _all_nodes(graph: onnx.GraphProto):
    """The graph's nodes and those of its If/Loop/Scan bodies, outer first."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for body in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _all_nodes(body)


# Passes on the written model: loss scaling and int8_avg rewrite a model file (loss scaling is
# also what read_executed_graph costs a mixed step with, on a copy of the input model), and the
# fusions must see what loss scaling adds; the annotation sees every node.
# the starting weights go back last: no node reads them, and the rewrites drop what no node reads
FINISHING = (Int8Avg(), AddLossScaling(), ChannelsLast(), FuseReductions(), FuseElementwise(), KeepStartingWeights(),
             AnnotateNodes())


def _check_exported(exported: Exported) -> list[str]:
    try:
        ir.check_model(exported.model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        return [f"onnx.checker: {str(exc).splitlines()[0]}"]
    return []


# --- helpers -----------------------------------------------------------------------------------

def _replace_matmul_integer(model: onnx.ModelProto) -> dict:
    """The experimental ``int8_avg`` on the exported model (the precision passes never see the custom op)."""
    from onnxcampo import ops
    from onnxcampo.rewrites.int8_avg import replace_matmul_integer

    result = replace_matmul_integer(model)
    if result.replaced and not ops.available():
        log.warning("the model now uses %s ops; build the custom-op library (%s) to run it", ops.DOMAIN,
                    ops.BUILD_COMMAND)
    return result.to_json()


def _check_names(model: onnx.ModelProto, config: OptimizeConfig) -> None:
    """Op types of ``exclude_ops``/``include_ops`` and dims of ``dim_values`` must exist, or a
    typo would silently change nothing: an op type is one of the model's (subgraphs included), an
    ONNX op or one the op lists name (ORT's fused ops, which ``fuse`` may create); a dim is one of
    the model's symbolic dims. The error names the closest valid name."""
    ir.check_dim_names(model, config.dim_values)
    asked = [(name, op) for name in ("exclude_ops", "include_ops") for op in sorted(getattr(config, name))]
    if not asked:
        return
    known = {schema.name for schema in onnx.defs.get_all_schemas()} | oplists.KNOWN_OPS | _op_types(model.graph)
    for name, op in asked:
        if op not in known:
            raise ConfigError(f"{option(name)}: unknown op type {op!r} (op types are case-sensitive: the model's, "
                              f"ONNX's, or those onnxcampo's op lists name){did_you_mean(op, known)}")


def _op_types(graph: onnx.GraphProto) -> set[str]:
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attr in node.attribute:
            for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs):
                found |= _op_types(body)
    return found


def _require_ops_library(option: str) -> None:
    from onnxcampo import ops

    if not ops.available():
        raise ConfigError(f"{option} writes {ops.DOMAIN} ops, which the written model is test-loaded with: the "
                          f"custom-op library is not available here ({ops.BUILD_COMMAND} builds it)")


# Domains whose ops onnxcampo leaves as they are (classical ML, training-only ops): a model of
# those alone is written unchanged.
_UNCONVERTED_DOMAINS = frozenset({"ai.onnx.ml", "ai.onnx.preview.training"})


def _nothing_to_do(model: onnx.ModelProto) -> str | None:
    graph = model.graph
    if not graph.node:
        return "the graph has no nodes"
    if any(p.key == METADATA_KEY for p in model.metadata_props):
        return "it was already optimized by onnxcampo"
    domains = {n.domain for n in graph.node}
    if domains <= _UNCONVERTED_DOMAINS:
        return f"its ops are all of {', '.join(sorted(domains))}, which onnxcampo does not convert"
    float32 = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    float32 |= {v.name for v in (*graph.input, *graph.value_info, *graph.output)
                if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    has_constant_float = any(
        n.op_type == "Constant" and any(a.t.data_type == onnx.TensorProto.FLOAT for a in n.attribute) for n in graph.node
    )
    if not float32 and not has_constant_float:
        info, _ = ir.infer_tensor_info(model)
        if not any(entry.dtype == onnx.TensorProto.FLOAT for entry in info.values()):
            return "it has no float32 tensors"
    return None


def _shapes_from_inputs(model: onnx.ModelProto, config: OptimizeConfig,
                        inputs: Mapping[str, np.ndarray]) -> OptimizeConfig:
    """Pin the dynamic dims of the inputs given (tune's or the calibration's feeds) to their shapes,
    where neither ``input_shapes`` nor ``dim_values`` does: the plan could not be costed without
    them. Pins the user gave win (a calibration batch need not be the batch the plan is for)."""
    added = {}
    for vi in ir.graph_inputs(model):
        if vi.name in config.input_shapes or vi.name not in inputs or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        open_dims = [d for d in dims if not (d.HasField("dim_value") and d.dim_value >= 0)
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
    from onnxcampo.runtime.optimized import IN_MEMORY, executed_graph

    # a copy without the weights, whose data ORT reads from ctx.model's tensors
    model, held = ir.without_weights(ctx.model, location=IN_MEMORY)
    renamed = transformer.rename_ort_generated_names(model)  # names ORT's own fusions would collide with at load
    weights = {renamed.get(name, name): tensor for name, tensor in held.items()}
    try:
        ir.pin_input_shapes(model, ctx.config.input_shapes, ctx.config.dim_values, require_static=False)
        executed = executed_graph(model, weights=weights)
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
            with_scaling = executed_graph(scaled, weights=weights).node_status(scaled)
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
    measured = measure_node_times(ctx.model, provider=ctx.config.experimental.profile, feeds=feeds)
    used = 0
    for name, micros in measured.node_us.items():
        if name in ctx.fp32_us and micros > 0:
            ctx.fp32_us[name] = micros
            used += 1
    log.info("profiled %d nodes on %s: a run takes %.1f us", used, ctx.config.experimental.profile, measured.run_us)
