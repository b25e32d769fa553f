"""The JSON report of an optimization: what was planned, predicted, inserted and why, and its
human summary (:func:`summary`, what ``onnxcampo optimize`` prints on stderr)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from onnxcampo import __version__, oplists
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import command_line_text
from onnxcampo.plan import Precision, PrecisionPlan, Reason

# Nodes that are no float computation, whatever the policy: counted apart so that the headline
# says how many of the float compute nodes run fp16 (BERT-base: 585 of 585, not "585 fp16, 825 fp32").
# The report's layout: raised when a key changes meaning or goes (new keys keep it).
SCHEMA_VERSION = 2

VIEW_OPS = oplists.ALIASED - {"Constant"}  # views: ORT aliases their output to their input
OTHER_NODES = {Reason.NO_FLOAT: "shape_arithmetic", Reason.CONSTANT: "constants"}


def node_counts(plan: PrecisionPlan, op_types: dict[str, str] | None = None) -> dict[str, int]:
    """Float compute nodes (every planned node but shape arithmetic, constants and views) by
    precision, and the others by kind; ``op_types`` (node name -> op type) tells the views
    (Identity, Reshape, Squeeze, Unsqueeze, Flatten: ORT aliases their output to their input, so
    they compute nothing in either precision)."""
    counts = {"float_compute": 0, "float_compute_fp16": 0, "float_compute_fp32": 0,
              **{kind: 0 for kind in OTHER_NODES.values()}, "views": 0}
    op_types = op_types or {}
    for name, decision in plan.items():
        kind = OTHER_NODES.get(decision.reason)
        if kind is None and op_types.get(name) in VIEW_OPS:
            kind = "views"
        if kind is not None:
            counts[kind] += 1
            continue
        counts["float_compute"] += 1
        counts["float_compute_fp16" if decision.precision is Precision.FP16 else "float_compute_fp32"] += 1
    return counts


def counts_headline(counts: dict[str, int]) -> str:
    """``node_counts`` in words: "585 of 585 float compute nodes fp16; 825 others (729 shape
    arithmetic, 96 constants) unchanged"."""
    text = f"{counts['float_compute_fp16']} of {counts['float_compute']} float compute nodes fp16"
    views = counts.get("views", 0)
    others = counts["shape_arithmetic"] + counts["constants"] + views
    if others:
        parts = [f"{counts['shape_arithmetic']} shape arithmetic", f"{counts['constants']} constants"]
        if views:
            parts.append(f"{views} views")
        text += f"; {others} others ({', '.join(parts)}) unchanged"
    return text


def build_report(ctx, source, plans, times, chosen, notes, results, node_costs=None) -> dict:
    """The JSON report of one optimization (``result.report``). ``node_costs``: each planned
    node's own numbers (``estimate.node_costs``), the report's ``plan_nodes``."""
    config = ctx.config
    plan = ctx.plan
    counts = plan.counts()
    return {
        **how_it_ran(config),
        "onnxcampo_version": __version__,
        "input": str(source) if source else None,
        "policy": config.policy,
        "chosen_plan": chosen,
        "cost_model": ctx.cost.describe(),
        "profile": config.experimental.profile,
        "execution": config.execution,
        "cost_graph": "ort" if ctx.ort_nodes is not None else "onnx",
        "experimental": config.experimental.changed(),
        "nodes": len(ctx.model.graph.node),
        "ort_nodes": ctx.ort_nodes,
        "nodes_fp16": counts.get("fp16", 0),
        "nodes_fp32": counts.get("fp32", 0),
        "node_counts": node_counts(plan, {n.name: n.op_type for n in ctx.model.graph.node
                                          if n.domain in ("", "ai.onnx")}),
        "reasons": plan.reasons(),
        "casts_inserted": _counted(results, "insert_casts", "casts"),
        "pads_inserted": _counted(results, "pad_tensor_cores", "pad_slice_nodes"),
        "initializers_converted": _counted(results, "insert_casts", "constants"),
        "initializer_values_clamped": _counted(results, "insert_casts", "clamped"),
        "predicted_us": {name: t.to_json() for name, t in times.items()},
        "plans": {name: {"nodes_fp16": p.counts().get("fp16", 0), "casts": times[name].casts} for name, p in plans.items()},
        "unresolved_dims": ctx.unresolved_dims,
        "notes": notes,
        "passes": [{"name": r.name, "counts": r.counts, "seconds": round(r.seconds, 4)} for r in results],
        "plan": plan.to_json(),
        "plan_nodes": {name: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
                       for name, row in (node_costs or {}).items()},
        "inserted_nodes": dict(ctx.inserted),
    }


def unchanged_report(config: OptimizeConfig, source, reason: str) -> dict:
    """The report of a model written unchanged (nothing to optimize)."""
    return {
        **how_it_ran(config),
        "onnxcampo_version": __version__, "input": str(source) if source else None, "policy": config.policy,
        "chosen_plan": None, "nodes_fp16": 0, "nodes_fp32": 0, "node_counts": None, "casts_inserted": 0, "pads_inserted": 0,
        "initializers_converted": 0, "initializer_values_clamped": 0, "notes": [f"nothing to optimize: {reason}"],
        "plan": {},
    }


def how_it_ran(config: OptimizeConfig) -> dict:
    """What reproduces the run: the report's ``schema_version``, the options that differ from the
    defaults (``options``: input shapes and dims included; the experimental ones under
    ``experimental``) and, from the command line, the command (``command_line``)."""
    defaults = OptimizeConfig()
    options = {f.name: _plain(getattr(config, f.name)) for f in dataclasses.fields(config)
               if f.name != "experimental" and getattr(config, f.name) != getattr(defaults, f.name)}
    found = {"schema_version": SCHEMA_VERSION, "options": options}
    text = command_line_text()
    if text is not None:
        found["command_line"] = text
    return found


def _plain(value):
    """A config value as JSON holds it (tuples and sets as lists, paths as text)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (frozenset, set)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _counted(results, pass_name: str, key: str) -> int:
    """A count the mutating passes reported (``PassResult.counts``), summed over their runs."""
    return sum(r.counts.get(key, 0) for r in results if r.name == pass_name)


def _node_headline(report: dict) -> str:
    """How many float compute nodes run fp16, the shape arithmetic and constants counted apart."""
    counts = report.get("node_counts")
    if not counts:
        return f"{report['nodes_fp16']} nodes fp16, {report['nodes_fp32']} fp32"
    return counts_headline(counts)


ORIGINS = {"--device-db": "database given by --device-db", "calibrated": "database calibrated on this GPU",
           "shipped": "database shipped for this GPU", "analytic-spec": "uncalibrated: roofline from the GPU's specs",
           "analytic-reference": "uncalibrated: the reference H200 roofline"}


def cost_model_line(cost_model: dict) -> str:
    """Which cost model planned, from where and how old: ``NVIDIA H100 80GB HBM3, database
    shipped for this GPU (costdb/data/nvidia-h100-80gb-hbm3.json), measured 2026-12-07 (0 days ago)``."""
    origin = cost_model.get("origin") or {}
    gpu = origin.get("gpu") or cost_model.get("device", {}).get("name") or cost_model.get("name", "cost model")
    text = f"{gpu}, {ORIGINS.get(origin.get('source'), cost_model.get('name', 'cost model'))}"
    if origin.get("path"):
        text += f" ({Path(origin['path']).name})"
    if origin.get("measured"):
        age = origin.get("age_days")
        text += f", measured {origin['measured']}" + (f" ({age} days ago)" if isinstance(age, int) else "")
    return text


def rewrites_line(rewrites: dict[str, dict]) -> str | None:
    """The report's ``rewrites`` (``pipeline.RewriteDecision``) in one line, unless the user set
    every one: "rewrites: channels-last off (predicted 5687.7 us with it, 4133.8 without), ..."."""
    if not rewrites or all(entry["by"] == "user" for entry in rewrites.values()):
        return None
    said: dict[tuple[str, str, str], list[str]] = {}  # (state, why, own) -> the rewrites it holds for
    for name, entry in rewrites.items():
        state, own = "on" if entry["on"] else "off", ""
        if entry["by"] == "prediction" and "predicted_with_us" in entry:
            why = f"predicted {entry['predicted_with_us']:.1f} us with it, {entry['predicted_without_us']:.1f} without"
            own = name  # each prediction is its own
        elif entry["by"] == "unavailable":
            why = f"unavailable: {entry['why']}"
        else:
            why = entry["by"]
        said.setdefault((state, why, own), []).append(name.replace("_", "-"))
    parts = [f"{', '.join(names[:-1])}{' and ' if len(names) > 1 else ''}{names[-1]} {state} ({why})"
             for (state, why, _), names in said.items()]
    return "rewrites: " + ", ".join(parts)


def summary(report: dict, output: Path | None) -> str:
    """The human summary: counts by reason, Casts and Pads, predicted times per plan."""
    lines = []
    if output is not None:
        lines.append(f"onnxcampo: wrote {output}")
    lines.append(f"policy {report['policy']}: {_node_headline(report)}; "
                 f"{report['casts_inserted']} Casts, {report['pads_inserted']} Pad/Slice inserted; "
                 f"{report['initializers_converted']} constants converted "
                 f"({report['initializer_values_clamped']} values clamped to the fp16 range)")
    for reason, count in sorted(report.get("reasons", {}).items(), key=lambda kv: -kv[1]):
        lines.append(f"  {count:6d}  {reason}")
    predicted = report.get("predicted_us")
    if predicted:
        parts = ", ".join(f"{name} {t['total_us']:.1f} us ({t['casts']} casts)" for name, t in predicted.items())
        lines.append(f"predicted time ({cost_model_line(report['cost_model'])}): {parts}")
    rewrites = rewrites_line(report.get("rewrites") or {})
    if rewrites:
        lines.append(rewrites)
    accuracy = report.get("accuracy")
    if accuracy is not None and "skipped" not in accuracy:
        worst = [row.get("rel_l2") for row in accuracy["outputs"] if isinstance(row.get("rel_l2"), (int, float))]
        lines.append(f"accuracy ({accuracy['inputs']} inputs, {accuracy['provider']}): "
                     f"{'passes' if accuracy['ok'] else 'FAILS'} {accuracy['criterion']}"
                     + (f" (worst rel L2 {max(worst):.3g})" if worst else "")
                     + (", after --fix" if accuracy.get("fixed") else ""))
    calibration = report.get("calibration")
    if calibration is not None:
        lines.append(f"calibration ({calibration['inputs']} inputs): {calibration['nodes_kept_fp32']} nodes kept fp32 "
                     f"for values beyond |{calibration['activation_limit']:g}| (largest |value| "
                     f"{calibration['largest']:.4g} over {calibration['tensors']} tensors)")
    int8_avg = report.get("int8_avg")
    if int8_avg is not None:
        skipped = ", ".join(f"{count} {reason}" for reason, count in int8_avg["skipped"].items())
        lines.append(f"int8-avg: {int8_avg['replaced']} MatMulInteger -> AvgMatMulInteger"
                     + (f" ({int8_avg['reshaped']} with A flattened)" if int8_avg["reshaped"] else "")
                     + (f"; kept: {skipped}" if skipped else ""))
    layout = report.get("channels_last")
    if layout is not None:
        left = sum((layout.get("left") or {}).values())
        pools = layout.get("pools", 0)
        lines.append(f"channels-last: {layout['convolutions']} Conv, {layout['data_grads']} input and "
                     f"{layout['weight_grads']} weight gradients as NHWC ops"
                     + (f" ({layout['padded']} of a stem with its channels padded)" if layout.get("padded") else "")
                     + (f", {pools} MaxPool and {layout.get('pool_grads', 0)} of their gradients" if pools else "")
                     + f", {layout['channels_last']} tensors channels-last, {layout['transposes']} layout Transposes"
                     + (f" ({layout['conversions']} of them cast and padded in one NchwToNhwc)"
                        if layout.get("conversions") else "")
                     + (f"; stem kept NCHW: {layout['stem_kept']}" if layout.get("stem_kept") else "")
                     + (f"; {left} kept NCHW ({', '.join(f'{n}: {why}' for why, n in layout['left'].items())})"
                        if left else ""))
    reductions = report.get("fuse_reductions")
    if reductions is not None:
        loss, norms = reductions.get("loss") or {}, reductions.get("layer_norms") or {}
        lines.append(f"fuse-reductions: {reductions['reduce_sums_replaced']} ReduceSums, {reductions['casts_folded']} "
                     f"Casts and {reductions['reshapes_folded']} Reshapes as {reductions['fused_nodes']} BlockReduceSum "
                     "nodes" + (f" ({reductions['sums_shared']} sums shared)" if reductions.get("sums_shared") else "")
                     + (f"; the cross-entropy loss ({loss['nodes_replaced']} nodes) as SoftmaxCrossEntropy"
                                + (" and its gradient" if loss.get("softmax_cross_entropy_grad") else "")
                                + (f" (written float16: {loss['gradient_casts_folded']} Casts and "
                                   f"{loss.get('gradient_pads_folded', 0)} Pads after it folded)"
                                   if loss.get("gradient_casts_folded") else "")
                                if loss.get("softmax_cross_entropy") else "")
                     + (f"; {norms['layer_norm_grad']} layer-norm and {norms['softmax_grad']} softmax gradients as "
                        f"LayerNormGrad / SoftmaxGrad ({norms['nodes_replaced']} nodes)"
                        if norms.get("layer_norm_grad") or norms.get("softmax_grad") else ""))
    chains = report.get("fuse_elementwise")
    if chains is not None:
        extra = [f"{chains[key]} {what}" for key, what in (("biases", "Conv/Gemm biases moved in"),
                                                             ("column_sums", "bias-gradient sums written by the kernels"),
                                                             ("weight_casts", "weight Casts as one MultiTensorCast"))
                 if chains.get(key)]
        lines.append(f"fuse-elementwise: {chains['nodes_replaced']} nodes as {chains['fused_nodes']} FusedElementwise "
                     "nodes" + (f" ({', '.join(extra)})" if extra else ""))
    fused = report.get("fuse") or {}
    if fused.get("model_type"):
        lines.append(f"fused as {fused['model_type']} by ONNX Runtime's transformers optimizer before planning (--fuse "
                     f"{fused['mode']}): " + ", ".join(f"{count} {op}" for op, count in fused["ops"].items())
                     + (f"; the padding mask as an attention bias in {fused['attention_bias']} Attention"
                        if fused.get("attention_bias") else ""))
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
