"""The JSON report of an optimization: what was planned, predicted, inserted and why."""

from __future__ import annotations

from onnxcampo import __version__
from onnxcampo.config import OptimizeConfig
from onnxcampo.plan import Precision, PrecisionPlan, Reason

# Nodes that are no float computation, whatever the policy: counted apart so that the headline
# says how many of the float compute nodes run fp16 (BERT-base: 585 of 585, not "585 fp16, 825 fp32").
OTHER_NODES = {Reason.NO_FLOAT: "shape_arithmetic", Reason.CONSTANT: "constants"}


def node_counts(plan: PrecisionPlan) -> dict[str, int]:
    """Float compute nodes (every planned node but shape arithmetic and constants) by precision,
    and the others by kind."""
    counts = {"float_compute": 0, "float_compute_fp16": 0, "float_compute_fp32": 0,
              **{kind: 0 for kind in OTHER_NODES.values()}}
    for _, decision in plan.items():
        kind = OTHER_NODES.get(decision.reason)
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
    others = counts["shape_arithmetic"] + counts["constants"]
    if others:
        text += (f"; {others} others ({counts['shape_arithmetic']} shape arithmetic, {counts['constants']} "
                 "constants) unchanged")
    return text


def build_report(ctx, source, plans, times, chosen, notes, results, node_costs=None) -> dict:
    """The JSON report of one optimization (``result.report``). ``node_costs``: each planned
    node's own numbers (``estimate.node_costs``), the report's ``plan_nodes``."""
    config = ctx.config
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
        "node_counts": node_counts(plan),
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
        "onnxcampo_version": __version__, "input": str(source) if source else None, "policy": config.policy,
        "chosen_plan": None, "nodes_fp16": 0, "nodes_fp32": 0, "node_counts": None, "casts_inserted": 0, "pads_inserted": 0,
        "initializers_converted": 0, "initializer_values_clamped": 0, "notes": [f"nothing to optimize: {reason}"],
        "plan": {},
    }


def _counted(results, pass_name: str, key: str) -> int:
    """A count the mutating passes reported (``PassResult.counts``), summed over their runs."""
    return sum(r.counts.get(key, 0) for r in results if r.name == pass_name)
