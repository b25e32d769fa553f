"""The JSON report of an optimization: what was planned, predicted, inserted and why."""

from __future__ import annotations

from onnxcampo import __version__
from onnxcampo.config import OptimizeConfig


def build_report(ctx, source, plans, times, chosen, notes, results) -> dict:
    """The JSON report of one optimization (``result.report``)."""
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
    }


def unchanged_report(config: OptimizeConfig, source, reason: str) -> dict:
    """The report of a model written unchanged (nothing to optimize)."""
    return {
        "onnxcampo_version": __version__, "input": str(source) if source else None, "policy": config.policy,
        "chosen_plan": None, "nodes_fp16": 0, "nodes_fp32": 0, "casts_inserted": 0, "pads_inserted": 0,
        "initializers_converted": 0, "initializer_values_clamped": 0, "notes": [f"nothing to optimize: {reason}"],
        "plan": {},
    }


def _counted(results, pass_name: str, key: str) -> int:
    """A count the mutating passes reported (``PassResult.counts``), summed over their runs."""
    return sum(r.counts.get(key, 0) for r in results if r.name == pass_name)
