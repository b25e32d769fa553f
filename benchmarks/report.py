"""Turn the benchmark's JSON lines into ``docs/benchmarks/h200.md``, plots and the headline table.

    python -m onnxcampo.benchmarks report docs/benchmarks/raw            # writes docs/benchmarks/h200.md, .json + PNGs
    python -m onnxcampo.benchmarks report docs/benchmarks/raw --headline # also prints the headline table

Nothing here measures or invents a number: every figure comes from a row of ``<name>.jsonl``.
The targets are evaluated on the rows present and each is stated as met, not met, or not
measurable (with what is missing).

Next to the markdown, ``<name>.json`` (e.g. ``docs/benchmarks/h200.json``) gives the throughput per
model, mode and policy for programs (see ``throughput_json``)::

    {"meta": {"units": "samples per second ...", "higher_is_better": true, "device": ..., ...},
     "models": {"bert": {"inference": {"fp32": <samples/s>, "amp": ..., "campo": ..., ...},
                         "training": {...},
                         "batch": {"inference": 32, "training": 32},
                         "inaccurate": {"inference": ["ort_fp16"], "training": []},
                         "unchecked": {"inference": [], "training": []},
                         "batches": {"inference": {"1": {"throughput": {...}, "inaccurate": [...],
                                                         "unchecked": [...]},
                                                   "32": {...}},
                                     "training": {"32": {...}}}}}}

Policy keys are the benchmark's policy names with ``-`` replaced by ``_`` (``occ-fp16`` ->
``occ_fp16``, ``torch-compile-amp`` -> ``torch_compile_amp``). ``models.<m>.<mode>`` holds only
policy keys with numbers (samples per second, higher is better), measured at the LARGEST batch of
that model and mode at which some policy ran (``models.<m>.batch.<mode>``; a corpus model whose
batch dimension is fixed fails at the large batch, so its headline is batch 1); ``batches`` has
every batch tried, failed ones with an empty ``throughput``. A policy whose row failed (status not
``ok``, no or a non-finite throughput) is absent; a mode with nothing measured is ``{}`` with batch
``null``. A batch entry's ``interleaved`` is true when its throughputs are the medians of the
group's interleaved timing (``run --interleave``: all variants' sessions alive, blocks in
rotation) rather than of each row's own blocks.
Rows outside the accuracy tolerance KEEP their throughput and are listed in ``inaccurate``, so a
"higher is better" comparison can exclude them; rows whose accuracy could not be judged (no
reference row) are listed in ``unchecked``. PyTorch rows are never judged (another framework's
program: its loss is reported, not compared), the same rule as the markdown's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from onnxcampo.benchmarks import policies as pol

from onnxcampo.accuracy import DEFAULT_CRITERION

# inference: the relative L2 error (rows' output_error, onnxcampo.accuracy's default criterion) against fp32
# without TF32; rows measured before output_error existed: max |out - ref| / max |ref| <= LEGACY_INFER_TOL
INFER_TOL = DEFAULT_CRITERION.bounds["rel_l2"]
LEGACY_INFER_TOL = 0.02
TRAIN_TOL = 0.02  # |loss_N - loss_N(ref)| / (loss_0(ref) - loss_N(ref)) after the same N steps on the same batch
TRAIN_TARGET_OVER_AMP = 1.20
GEOMEAN_TARGET_OVER_BEST = 1.10


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; blank and torn lines (a run killed mid-write) are skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_rows(path: Path) -> list[dict[str, Any]]:
    rows = {row["key"]: row for row in json_lines(path)}  # the last row of a key wins (--retry-failed)
    return list(rows.values())


def read_runs(path: Path) -> list[dict[str, Any]]:
    """One record per run (a run writes one line when it starts and one when it ends; the last wins)."""
    runs: dict[str, dict[str, Any]] = {}
    for record in json_lines(path):
        runs[record.get("run", "?")] = {**runs.get(record.get("run", "?"), {}), **record}
    return sorted(runs.values(), key=lambda r: r.get("start", ""))


def read_interleaved(path: Path) -> list[dict[str, Any]]:
    """The interleaved timings (``run --interleave``) that succeeded, one per group and run."""
    records = {(r["key"], r.get("run")): r for r in json_lines(path)
               if r.get("status", "ok") == "ok" and isinstance(r.get("ms"), dict)}
    return list(records.values())


def apply_interleaved(rows: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[str]:
    """Groups timed side by side take the interleaved medians as their rows' ``ms`` (in place).

    A record counts only when it covers the whole group: every row of the group that ran (status
    ok) comes from the record's run (so the same graphs) and is in the record. Then all of the
    group's comparisons use one method; a group re-measured in part in a later run keeps its rows'
    own timings (mixing blocks in rotation with rows timed one after another would compare the
    methods, not the graphs). The interleaved medians are scaled so that fp32 keeps its own row's
    time: the ratios between policies come from the rotation, the level from a session alone, as
    the model will run (sessions side by side can be slower as a whole; the text says by how much).
    Each row keeps its own median as ``ms_row`` and is marked ``interleaved``; a campo row's
    ``fp32_ms_paired`` is set aside (fp32 is in the record, the fairer pair). Returns the groups
    applied, as text.
    """
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("status") == "ok" and row.get("mode") == "inference":
            groups[f"{row['model']}|{row['batch']}|{row['mode']}"].append(row)
    applied = []
    for record in sorted(records, key=lambda r: (r["key"], r.get("time", ""))):
        members = groups.get(record["key"], [])
        if len(members) < 2 or any(r.get("run") != record.get("run") or not record["ms"].get(r["policy"])
                                   for r in members):
            continue
        fp32 = next((r for r in members if r["policy"] == "fp32"), None)
        scale = fp32["ms"] / record["ms"]["fp32"] if fp32 is not None and fp32.get("ms") else 1.0
        for row in members:
            ms = record["ms"][row["policy"]] * scale
            row["ms_row"], row["ms"] = row.get("ms"), ms
            row["throughput"] = int(row["batch"]) * 1000.0 / ms
            row["interleaved"] = True
            if "fp32_ms_paired" in row and "fp32" in record["ms"]:
                row["fp32_ms_paired_row"] = row.pop("fp32_ms_paired")
        model, batch, _ = record["key"].split("|")
        level = f"; side by side, fp32 ran {1 / scale:.2f}x its own row" if fp32 is not None else ""
        applied.append(f"{model} b{batch} ({len(members)} variants, {record.get('rounds', '?')} rounds{level})")
    return applied


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def group_rows(rows: list[dict[str, Any]], *, measured: bool = True) -> dict[tuple[str, int, str], dict[str, dict[str, Any]]]:
    """Rows by (model, batch, mode), then policy. With ``measured``, groups none of whose rows ran
    or failed (all ``unavailable``: a batch the model cannot take, such as a corpus model's fixed
    batch dim) are left out: listed as failures, not as a table of dashes or a target "not
    measurable". A group whose variants all failed stays (its targets are not measurable)."""
    groups: dict[tuple[str, int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        groups[(row["model"], int(row["batch"]), row["mode"])][row["policy"]] = row
    if measured:
        return defaultdict(dict, {k: g for k, g in groups.items()
                                  if any(r.get("status") != "unavailable" for r in g.values())})
    return groups


FP32_FAMILY = ("fp32", "fp32-graph")  # fp32 arithmetic (TF32 on), like the reference but for TF32 and kernel choice
TRAIN_TOL_CAP = 10 * TRAIN_TOL  # fp32's spread widens the training tolerance up to this


def accuracy(row: dict[str, Any], group: dict[str, dict[str, Any]]) -> float | None:
    """Inference: the relative L2 output error (``output_error``; older rows: ``rel_err_max``). Training: the gap between the row's loss and the
    reference's after the same N steps, as a share of the reference's loss decrease over them
    (``|L - L_ref| / (L_first - L_ref)``; a share of the loss itself made tiny gaps huge where
    training drives the loss to ~0, magika: 6e-4)."""
    if row.get("mode") == "inference":
        return row["output_error"] if "output_error" in row else row.get("rel_err_max")
    ref = group.get(pol.REFERENCE)
    if not ref or ref.get("status") != "ok" or "loss_last" not in row or ref.get("loss_last") is None:
        return None
    decrease = ref["loss_first"] - ref["loss_last"] if ref.get("loss_first") is not None else None
    scale = decrease if decrease and decrease > 0 else abs(ref["loss_last"])
    return abs(row["loss_last"] - ref["loss_last"]) / scale if scale else None


def tolerance(row: dict[str, Any], group: dict[str, dict[str, Any]]) -> float:
    """Inference: INFER_TOL (rows without ``output_error``: LEGACY_INFER_TOL on ``rel_err_max``). Training: TRAIN_TOL, or the largest gap of the fp32 (TF32) runs of
    the same step graph when that is larger (at most TRAIN_TOL_CAP): what TF32 and run-to-run
    kernel choice alone move the loss by (PP-OCR's recognizer: the same fp32 graph ended 10.20 and 9.52 in two runs)."""
    if row.get("mode") == "inference":
        return INFER_TOL if "output_error" in row else LEGACY_INFER_TOL
    spread = [accuracy(group[p], group) for p in FP32_FAMILY if _ok(group.get(p))]
    return min(max([TRAIN_TOL, *(v for v in spread if v is not None)]), TRAIN_TOL_CAP)


def accurate(row: dict[str, Any], group: dict[str, dict[str, Any]]) -> bool:
    if row.get("policy", "").startswith("torch"):
        return True  # a different program on another framework: its loss is reported, not judged
    value = accuracy(row, group)
    return value is not None and value <= tolerance(row, group)


def valid(row: dict[str, Any] | None, group: dict[str, dict[str, Any]]) -> bool:
    return bool(row) and row.get("status") == "ok" and row.get("throughput") is not None and accurate(row, group)


def best_anchor(group: dict[str, dict[str, Any]], mode: str) -> tuple[str, float] | None:
    anchors = pol.INFERENCE_ANCHORS if mode == "inference" else pol.TRAINING_ANCHORS
    found = [(name, group[name]["throughput"]) for name in anchors if valid(group.get(name), group)]
    return max(found, key=lambda x: x[1]) if found else None


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and row.get("status") == "ok" and bool(row.get("throughput"))


def vs_fp32(group, campo: str = "campo") -> tuple[float | None, str]:
    """campo's speed over fp32's, and how it is known: "same graph" (campo kept every node fp32 and
    padded nothing: 1 by construction, whatever two runs measured), "paired" (fp32 timed right
    after campo in the same run: ``fp32_ms_paired``), "interleaved" (both timed side by side:
    ``run --interleave``) or "" (the two rows, maybe from runs hours apart)."""
    row = group.get(campo)
    if not _ok(row):
        return None, ""
    if row.get("nodes_fp16") == 0 and not row.get("pads_inserted"):
        return 1.0, "same graph"
    if row.get("interleaved") and (group.get("fp32") or {}).get("interleaved"):
        return _ratio(group, campo, "fp32"), "interleaved"
    if row.get("fp32_ms_paired") and row.get("ms"):  # an interleaved campo row: its own median is the pair's
        return row["fp32_ms_paired"] / row.get("ms_row", row["ms"]), "paired"
    return _ratio(group, campo, "fp32"), ""


def _ratio(group, a: str, b: str) -> float | None:
    """Throughput of ``a`` over ``b`` when both ran (accuracy is judged by its own target)."""
    ra, rb = group.get(a), group.get(b)
    if _ok(ra) and _ok(rb):
        return ra["throughput"] / rb["throughput"]
    return None


# --------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------


def evaluate_targets(rows: list[dict[str, Any]], campo: str = "campo") -> list[dict[str, Any]]:
    """Each target: {"name", "met": True/False/None, "text"} (None: not measurable), for
    ``campo`` (the policy judged: ``campo``, or ``campo-tune`` whose plan was measured)."""
    groups = group_rows(rows)
    out = []

    # 1. campo training >= 1.20x amp, geometric mean over the training models
    ratios = {k: _ratio(g, campo, "amp") for k, g in groups.items() if k[2] == "training"}
    have = {k: r for k, r in ratios.items() if r is not None}
    missing = sorted(f"{k[0]} b{k[1]}" for k, r in ratios.items() if r is None)
    if have:
        gm = geomean(list(have.values()))
        detail = ", ".join(f"{k[0]} {r:.2f}x" for k, r in sorted(have.items()))
        out.append({"name": f"{campo} training throughput >= 1.20x amp (geometric mean over the training models)",
                    "met": gm >= TRAIN_TARGET_OVER_AMP,
                    "text": f"geometric mean {gm:.3f}x over {len(have)} models ({detail})"
                            + (f"; not measurable for {', '.join(missing)}" if missing else "")})
    else:
        out.append({"name": f"{campo} training throughput >= 1.20x amp", "met": None,
                    "text": f"no training model has valid {campo} and amp rows"})

    # 2. campo >= 1.0x the best anchor on every model, >= 1.10x in geometric mean (inference and training)
    for mode in ("inference", "training"):
        per, worse, unmeasured = {}, [], []
        for key, group in sorted(groups.items()):
            if key[2] != mode:
                continue
            best = best_anchor(group, mode)
            row = group.get(campo)
            if best is None or not _ok(row):
                reason = f"{campo} failed or missing" if not _ok(row) else "no valid anchor"
                unmeasured.append(f"{key[0]} b{key[1]} ({reason})")
                continue
            ratio = row["throughput"] / best[1]
            per[key] = (ratio, best[0])
            if ratio < 1.0:
                worse.append(f"{key[0]} b{key[1]}: {ratio:.3f}x of {best[0]}")
        if not per:
            out.append({"name": f"{campo} >= best anchor on every model ({mode})", "met": None,
                        "text": "nothing measurable" + (f": {'; '.join(unmeasured)}" if unmeasured else "")})
            continue
        gm = geomean([r for r, _ in per.values()])
        every = not worse and not unmeasured
        out.append({"name": f"{campo} >= 1.0x the best anchor on every model and batch ({mode})",
                    "met": every if not unmeasured else (False if worse else None),
                    "text": (f"slower on {'; '.join(worse)}" if worse else f"at least 1.0x on all {len(per)} measured")
                            + (f"; not measurable: {'; '.join(unmeasured)}" if unmeasured else "")})
        out.append({"name": f"{campo} >= 1.10x the best anchor in geometric mean ({mode})",
                    "met": gm >= GEOMEAN_TARGET_OVER_BEST, "text": f"geometric mean {gm:.3f}x over {len(per)} model/batch pairs"})

    # 3. campo never slower than fp32 (TF32)
    slower, checked, close, same, paired = [], 0, [], [], 0
    for key, group in sorted(groups.items()):
        r, how = vs_fp32(group, campo)
        if r is None:
            continue
        checked += 1
        name = f"{key[0]} b{key[1]} {key[2]}"
        if how == "same graph":
            measured = _ratio(group, campo, "fp32")
            where = "side by side" if group[campo].get("interleaved") else "in another run"
            same.append(name + (f" (measured {measured:.2f}x {where})" if measured and abs(measured - 1) >= 0.02 else ""))
            continue
        paired += how in ("paired", "interleaved")
        if r < 1.0:
            slower.append(f"{name}: {r:.3f}x")
        elif r < 1.02:
            close.append(name)
    out.append({"name": f"{campo} never slower than fp32 (TF32) on any model or batch",
                "met": (not slower) if checked else None,
                "text": (f"slower on {'; '.join(slower)}" if slower else f"not slower on any of {checked}")
                        + (f"; within 2 % of fp32 (noise level): {', '.join(close)}" if close else "")
                        + (f"; the fp32 graph itself (no fp16 node, no pad): {', '.join(same)}" if same else "")
                        + (f"; {paired} of {checked - len(same)} compared with fp32 timed in the same run"
                           if checked > len(same) else "")})

    # 4. accuracy
    bad, checked = [], 0
    for key, group in sorted(groups.items()):
        row = group.get(campo)
        if not row or row.get("status") != "ok":
            continue
        value = accuracy(row, group)
        checked += 1
        if value is None or not accurate(row, group):
            widened = tolerance(row, group)
            bad.append(f"{key[0]} b{key[1]} {key[2]}: {'n/a' if value is None else f'{value:.2e}'}"
                       + (f" (tolerance {widened:.2e}: fp32's own spread)" if widened > TRAIN_TOL and key[2] == "training" else "")
                       + (" (the fp32 graph itself: run-to-run variation)" if vs_fp32(group, campo)[1] == "same graph" else ""))
    out.append({"name": f"{campo} accuracy within tolerance (inference relative L2 error <= {INFER_TOL}, "
                        f"training loss gap <= {TRAIN_TOL} of the loss decrease, or fp32's own spread up to {TRAIN_TOL_CAP:g})",
                "met": (not bad) if checked else None,
                "text": f"outside on {'; '.join(bad)}" if bad else f"within on all {checked}"})
    return out


def _word(met) -> str:
    return {True: "**met**", False: "**not met**", None: "**not measurable**"}[met]


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def _fmt(value, spec=".3f", dash="–") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return dash
    return format(value, spec)


def _policies(mode: str) -> tuple[str, ...]:
    return pol.INFERENCE_POLICIES if mode == "inference" else pol.TRAINING_POLICIES


def group_table(key, group: dict[str, dict[str, Any]]) -> list[str]:
    model, batch, mode = key
    unit = "ms/step" if mode == "training" else "ms"
    acc = "loss gap" if mode == "training" else "max rel err"
    lines = [f"| policy | {unit} | samples/s | x fp32 | x amp | Casts | Pads | {acc} | TC share of GEMM time | convert s | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for policy in _policies(mode):
        row = group.get(policy)
        if row is None:
            continue
        if row.get("status") != "ok":
            lines.append(f"| {policy} | – | – | – | – | – | – | – | – | – | {row.get('status')}: {_md(row.get('error', ''))[:160]} |")
            continue
        tc = (row.get("tc") or {}).get("tc_share_of_gemm")
        note = [] if accurate(row, group) else ["outside tolerance"]
        if row.get("chosen_plan") and row["chosen_plan"] != "campo" and policy.startswith("campo"):
            note.append(f"kept the {row['chosen_plan']} plan")
        if row.get("first_step_s") is not None and "compile" in policy:
            note.append(f"first step {row['first_step_s']} s")
        lines.append(
            f"| {policy} | {_fmt(row.get('ms'))} | {_fmt(row.get('throughput'), '.1f')} | {_fmt(_ratio(group, policy, 'fp32'), '.2f')} "
            f"| {_fmt(_ratio(group, policy, 'amp'), '.2f')} | {row.get('casts', '–')} | {row.get('pads', '–')} "
            f"| {_fmt(accuracy(row, group), '.1e')} | {_fmt(tc, '.0%')} | {_fmt(row.get('convert_s'), '.1f')} | {'; '.join(note)} |")
    return lines


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def breakdown_table(rows: list[dict[str, Any]]) -> list[str]:
    from onnxcampo.benchmarks.measure import CATEGORIES

    found = [r for r in rows if r.get("mode") == "training" and r.get("breakdown")]
    if not found:
        return ["No training step was profiled yet."]
    lines = ["| model | policy | kernel us/step | " + " | ".join(CATEGORIES) + " | top backward ops (us) |",
             "|---|---|---:|" + "---:|" * len(CATEGORIES) + "---|"]
    for r in sorted(found, key=lambda r: (r["model"], r["policy"])):
        b = r["breakdown"]
        shares = " | ".join(f"{100 * b['share'][c]:.0f} %" for c in CATEGORIES)
        top = ", ".join(f"{op} {us:.0f}" for op, us in b.get("top_backward", [])[:4])
        lines.append(f"| {r['model']} b{r['batch']} | {r['policy']} | {b['total_us']:.0f} | {shares} | {top} |")
    return lines


def gpu_table(rows: list[dict[str, Any]]) -> list[str]:
    """GPU ms per step by kernel class (CUPTI through torch.profiler) of the profiled training steps."""
    from onnxcampo.benchmarks.measure import KERNEL_CLASSES

    found = [r for r in rows if r.get("mode") == "training" and r.get("gpu")]
    if not found:
        return []
    classes = [c for c, _ in KERNEL_CLASSES] + ["other"]
    lines = ["| model | policy | ms/step (wall) | GPU ms/step | " + " | ".join(classes) + " |",
             "|---|---|---:|---:|" + "---:|" * len(classes)]
    for r in sorted(found, key=lambda r: (r["model"], r["policy"])):
        g = r["gpu"]["by_class_ms"]
        cells = " | ".join(_fmt(g.get(c), ".2f") for c in classes)
        lines.append(f"| {r['model']} b{r['batch']} | {r['policy']} | {_fmt(r.get('ms'), '.2f')} | "
                     f"{r['gpu']['total_ms']:.2f} | {cells} |")
    return lines


def torch_comparison(rows: list[dict[str, Any]]) -> list[str]:
    groups = group_rows(rows)
    lines = ["| model | campo ms/step | best PyTorch | its ms/step | campo / best PyTorch throughput | fp32 ORT ms/step |",
             "|---|---:|---|---:|---:|---:|"]
    any_row = False
    notes: list[str] = []
    for key, group in sorted(groups.items()):
        if key[2] != "training":
            continue
        torch_rows = [(p, group[p]) for p in pol.TORCH_POLICIES if group.get(p, {}).get("status") == "ok"]
        campo = group.get("campo")
        if not torch_rows or not campo or campo.get("status") != "ok":
            continue
        name, best = min(torch_rows, key=lambda x: x[1]["ms"])
        fp32 = group.get("fp32", {})
        lines.append(f"| {key[0]} b{key[1]} | {campo['ms']:.2f} | {name} | {best['ms']:.2f} | "
                     f"{best['ms'] / campo['ms']:.2f}x | {_fmt(fp32.get('ms'), '.2f')} |")
        any_row = True
        if campo["ms"] > best["ms"]:
            notes.append(_where_time_goes(key, campo, name, best))
    if not any_row:
        return ["No model has both a campo training row and a PyTorch row yet."]
    return lines + ([""] + notes if notes else [])


def cuda_graph_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Runs replayed as CUDA graphs (``fp32-graph``, ``campo-graph``) next to the plain runs, amp and
    the best anchor, with the geometric means of what replay buys, per mode."""
    groups = group_rows(rows)
    lines = ["| model | mode | batch | fp32 | amp | campo | fp32-graph | campo-graph | best anchor | campo-graph / amp | "
             "campo-graph / campo | campo-graph / best anchor |", "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    ratios_by_mode: dict[str, list[list[float]]] = {}
    for key, group in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        if not any(group.get(p) for p in pol.GRAPH_POLICIES):
            continue
        ms = {p: group[p]["ms"] if _ok(group.get(p)) else None for p in ("fp32", "amp", "campo", *pol.GRAPH_POLICIES)}
        best = best_anchor(group, key[2])
        graph = group.get("campo-graph")
        ratios = [_ratio(group, "campo-graph", "amp"), _ratio(group, "campo-graph", "campo"),
                  graph["throughput"] / best[1] if _ok(graph) and best else None]
        buckets = ratios_by_mode.setdefault(key[2], [[], [], []])
        for bucket, value in zip(buckets, ratios):
            if value is not None:
                bucket.append(value)
        anchor = f"{best[0]} {group[best[0]]['ms']:.2f}" if best else "–"
        lines.append(f"| {key[0]} | {key[2]} | {key[1]} | " + " | ".join(_fmt(ms[p], ".2f") for p in ms)
                     + f" | {anchor} | " + " | ".join(_times(v) for v in ratios) + " |")
    if len(lines) == 2:
        return ["Nothing was replayed as a CUDA graph yet."]
    means = []
    for mode, buckets in ratios_by_mode.items():
        parts = [f"{name} {geomean(values):.3f}x over {len(values)}" for name, values in
                 zip(("campo-graph / amp", "campo-graph / campo", "campo-graph / best anchor"), buckets) if values]
        if parts:
            means.append(f"{mode}: " + ", ".join(parts))
    return lines + ["", "Geometric means (" + "; ".join(means) + ")."]


FUSION_PLANS = ("campo-fused-graph", "campo-fused-blind-graph", "fp16-fused-graph")


def fusion_plan_comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Per model, the plan made with fusion in view (``campo-fused-graph``) beside the fusion-blind
    one (``campo-fused-blind-graph``) and the all-fp16 plan (``fp16-fused-graph``), all fused and
    replayed: each one's predicted ms (``predicted_plan_us``, as its own planning costed it) and
    measured ms. Only groups holding both campo rows."""
    groups = group_rows(rows)
    lines = ["| model | mode | batch | " + " | ".join(f"{p} predicted / measured ms" for p in FUSION_PLANS)
             + " | aware / blind throughput |", "|---|---|---:|" + "---:|" * (len(FUSION_PLANS) + 1)]
    for key, group in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        if not (group.get(FUSION_PLANS[0]) and group.get(FUSION_PLANS[1])):
            continue
        cells = []
        for policy in FUSION_PLANS:
            row = group.get(policy)
            predicted = (row or {}).get("predicted_plan_us")
            measured = row["ms"] if _ok(row) else None
            cells.append(f"{_fmt(predicted / 1e3 if predicted is not None else None, '.2f')} / {_fmt(measured, '.2f')}")
        ratio = _ratio(group, FUSION_PLANS[0], FUSION_PLANS[1])
        lines.append(f"| {key[0]} | {key[2]} | {key[1]} | " + " | ".join(cells) + f" | {_times(ratio)} |")
    if len(lines) == 2:
        return []
    return lines


def _where_time_goes(key, campo: dict[str, Any], name: str, best: dict[str, Any]) -> str:
    """One sentence per model where the ONNX Runtime step is slower than PyTorch: the breakdown's numbers."""
    text = (f"- {key[0]} b{key[1]}: campo's step takes {campo['ms']:.2f} ms, {campo['ms'] / best['ms']:.2f}x "
            f"{name}'s {best['ms']:.2f} ms.")
    gpu = campo.get("gpu")
    if gpu:
        classes = ", ".join(f"{c} {ms:.2f}" for c, ms in list(gpu["by_class_ms"].items())[:6])
        text += f" GPU kernels (CUPTI, the step as run: {gpu['total_ms']:.2f} ms): {classes} ms."
    b = campo.get("breakdown")
    if not b:
        return text + ("" if gpu else " No profile of the campo step was recorded.")
    parts = sorted(((c, b["per_step_us"][c]) for c in b["per_step_us"]), key=lambda x: -x[1])
    spent = ", ".join(f"{c} {us / 1000:.2f} ms ({100 * b['share'][c]:.0f} %)" for c, us in parts if us > 0)
    top = ", ".join(f"{op} {us / 1000:.2f} ms" for op, us in b.get("top_backward", [])[:4])
    return (text + f" Its nodes (profiled unfused, host time per node, {b['total_us'] / 1000:.2f} ms a step): {spent}. "
            f"Largest backward op types: {top}.")


def _times(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """The README's table: per model/batch/mode fp32, amp, the best anchor, campo, and the ratios."""
    groups = group_rows(rows)
    lines = ["| model | mode | batch | fp32 (TF32) | amp | best anchor | campo | campo / amp | campo / best anchor "
             "| campo-tune | campo-tune / best anchor |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for key, group in sorted(groups.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        model, batch, mode = key
        unit = "ms/step" if mode == "training" else "ms"
        best = best_anchor(group, mode)
        campo = group.get("campo")

        def ms(p):
            r = group.get(p)
            return f"{r['ms']:.2f}" if r and r.get("status") == "ok" and r.get("ms") else "–"
        best_text = f"{best[0]} {group[best[0]]['ms']:.2f}" if best else "–"
        ratio_best = campo["throughput"] / best[1] if best and _ok(campo) else None
        tuned = group.get("campo-tune")
        tuned_best = tuned["throughput"] / best[1] if best and _ok(tuned) else None
        lines.append(f"| {model} | {mode} ({unit}) | {batch} | {ms('fp32')} | {ms('amp')} | {best_text} | {ms('campo')} "
                     f"| {_times(_ratio(group, 'campo', 'amp'))} | {_times(ratio_best)} | {ms('campo-tune')} "
                     f"| {_times(tuned_best)} |")
    return lines


# --------------------------------------------------------------------------------------------
# JSON for programs
# --------------------------------------------------------------------------------------------

UNITS = ("samples per second (images, sequences, rows or audio windows per second: the batch size "
         "times 1000 over the median ms of an inference run or a training step); higher is better")


def json_policy_name(policy: str) -> str:
    """``occ-fp16`` -> ``occ_fp16``: the JSON's keys are the policy names with underscores."""
    return policy.replace("-", "_")


def _throughput(row: dict[str, Any] | None) -> float | None:
    """The row's throughput when it ran (status ok, a finite positive number), else None."""
    if not row or row.get("status") != "ok":
        return None
    value = row.get("throughput")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def _policy_order(mode: str, present) -> list[str]:
    known = list(_policies(mode))
    return [p for p in known if p in present] + sorted(p for p in present if p not in known)


def _batch_entry(group: dict[str, dict[str, Any]], mode: str) -> dict[str, Any]:
    throughput, inaccurate, unchecked = {}, [], []
    for policy in _policy_order(mode, group):
        row = group[policy]
        value = _throughput(row)
        if value is None:
            continue  # failed: absent
        name = json_policy_name(policy)
        throughput[name] = value
        if not accurate(row, group):
            (unchecked if accuracy(row, group) is None else inaccurate).append(name)
    return {"throughput": throughput, "inaccurate": inaccurate, "unchecked": unchecked,
            "interleaved": any(row.get("interleaved") for row in group.values())}


def _distinct(values) -> str | None:
    found = sorted({str(v) for v in values if v})
    return ", ".join(found) if found else None


def throughput_json(rows: list[dict[str, Any]], runs: list[dict[str, Any]], raw: str) -> dict[str, Any]:
    """The ``<name>.json`` document (structure in the module docstring); deterministic for given rows."""
    groups = group_rows(rows, measured=False)
    modes = ("inference", "training")
    models: dict[str, Any] = {}
    for model in sorted({key[0] for key in groups}):
        batches = {mode: sorted(b for (m, b, md) in groups if m == model and md == mode) for mode in modes}
        entry: dict[str, Any] = {}
        per_batch = {mode: {str(b): _batch_entry(groups[(model, b, mode)], mode) for b in batches[mode]}
                     for mode in modes}
        # the largest batch at which some policy ran (a corpus model whose batch dim is fixed fails at
        # the large batch for every policy: its headline is batch 1); when none ran, the largest tried
        headline_batch = {}
        for mode in modes:
            ran = [b for b in batches[mode] if per_batch[mode][str(b)]["throughput"]]
            headline_batch[mode] = (ran or batches[mode] or [None])[-1]
        for mode in modes:
            b = headline_batch[mode]
            entry[mode] = dict(per_batch[mode][str(b)]["throughput"]) if b is not None else {}
        entry["batch"] = headline_batch
        for part in ("inaccurate", "unchecked"):
            entry[part] = {mode: (list(per_batch[mode][str(headline_batch[mode])][part])
                                  if headline_batch[mode] is not None else []) for mode in modes}
        entry["batches"] = per_batch
        models[model] = entry

    versions = [r.get("versions") or {} for r in runs]
    ort = [(v.get("onnxruntime (imported)") or "").split(" ")[0] or v.get("onnxruntime-gpu") or v.get("onnxruntime")
           for v in versions]
    meta = {
        "units": UNITS,
        "higher_is_better": True,
        "device": _distinct(v.get("gpu") if r.get("provider") == "cuda" else "cpu" for r, v in zip(runs, versions)),
        "onnxruntime": _distinct(ort),
        "provider": _distinct(r.get("provider") for r in runs),
        "commands": sorted({r["command"] for r in runs if r.get("command")}),
        "runs": len(runs),
        "measured_from": runs[0].get("start") if runs else None,
        "measured_to": runs[-1].get("end") if runs else None,
        "source": raw,
        "rows": len(rows),
        "rows_ok": sum(r.get("status") == "ok" for r in rows),
        "policy_keys": "the benchmark's policy names with '-' replaced by '_' (occ-fp16 -> occ_fp16)",
        "headline_batch": "models.<m>.<mode> is the throughput at the largest batch of that model and mode at "
                          "which some policy ran (models.<m>.batch.<mode>; null: nothing measured); "
                          "models.<m>.batches.<mode>.<batch> has every batch tried",
        "absent": "a policy whose row failed (status not ok, or no finite throughput) or was not measured is absent",
        "inaccurate": f"policies outside the accuracy tolerance (inference relative L2 error > {INFER_TOL}, or for rows measured before it was "
                      f"recorded max rel err > {LEGACY_INFER_TOL}; training "
                      f"loss gap > {TRAIN_TOL} of the loss decrease against fp32_notf32, or more than fp32 (TF32) runs of the same "
                      f"step graph differ from it); their throughput is kept, exclude them "
                      "when comparing; 'unchecked': accuracy could not be judged (no reference row); "
                      "PyTorch rows are not judged",
    }
    return {"meta": meta, "models": models}


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Atomic: a temporary file in the same folder, then ``os.replace``. Strict JSON (no NaN)."""
    text = json.dumps(document, indent=1, allow_nan=False, ensure_ascii=False) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# --------------------------------------------------------------------------------------------
# plots
# --------------------------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], directory: Path, name: str) -> list[str]:
    """``<name>-throughput.png`` (one panel per model/batch/mode, a bar per policy) and
    ``<name>-speedup-over-amp.png``. Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted(group_rows(rows).items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1]))
    groups = [(k, g) for k, g in groups if any(r.get("status") == "ok" for r in g.values())]
    if not groups:
        return []
    written = []
    cols = 4
    rows_n = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.4 * rows_n), squeeze=False)
    for ax, (key, group) in zip(axes.flat, groups):
        names = [p for p in _policies(key[2]) if group.get(p, {}).get("status") == "ok"]
        values = [group[p]["throughput"] for p in names]
        colors = ["tab:red" if p == "campo" else ("tab:gray" if p in pol.INFERENCE_ANCHORS + pol.TRAINING_ANCHORS else "tab:blue")
                  for p in names]
        ax.bar(range(len(names)), values, color=colors)
        ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
        ax.set_title(f"{key[0]} b{key[1]} {key[2]}", fontsize=9)
        ax.set_ylabel("samples/s", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle("Throughput per model and policy (red: campo, gray: anchors)")
    written.append(_save(plt, fig, directory / f"{name}-throughput.png"))

    shown = ("campo", "campo-nopad", "campo-nocost", "fp16", "fp32", "ort-fp16", "occ-fp16", "modelopt",
             "torch-eager", "torch-compile", "torch-compile-amp")
    labels = [f"{k[0]} b{k[1]} {k[2][:5]}" for k, _ in groups]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(groups) + 3), 4.5))
    width = 0.8 / len(shown)
    for i, policy in enumerate(shown):
        ys = [_ratio(g, policy, "amp") if policy in g else None for _, g in groups]
        xs = [j + i * width for j, y in enumerate(ys) if y is not None]
        ax.bar(xs, [y for y in ys if y is not None], width, label=policy)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(TRAIN_TARGET_OVER_AMP, color="tab:red", linewidth=0.8, linestyle="--", label="1.20x (training target)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], labels, rotation=60, fontsize=7, ha="right")
    ax.set_ylabel("throughput / amp")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Speed-up over greedy AMP (onnxcampo amp) on ONNX Runtime")
    written.append(_save(plt, fig, directory / f"{name}-speedup-over-amp.png"))
    return written


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# --------------------------------------------------------------------------------------------
# the document
# --------------------------------------------------------------------------------------------


def render(rows: list[dict[str, Any]], runs: list[dict[str, Any]], plots: list[str], raw: str,
           interleaved: list[str] | None = None) -> str:
    groups = group_rows(rows)
    ok = sum(r.get("status") == "ok" for r in rows)
    last = runs[-1] if runs else {}
    where = (last.get("versions") or {}).get("gpu") if last.get("provider") == "cuda" else None
    where = where or ("the CPU (a smoke test: fp16 runs wrapped in casts, timings mean nothing)"
                      if last.get("provider") == "cpu" else "an NVIDIA H200")
    provider = "CPU EP" if last.get("provider") == "cpu" else "CUDA EP"
    lines = [f"# Benchmarks on {where}: fp32, fp16, amp, campo and the anchors", ""]
    lines.append(f"Generated by `benchmarks/report.py` from `{raw}` ({len(rows)} measurements, {ok} ok). "
                 "Every number below is a row of that file.")
    lines.append("")
    if runs:
        commands = sorted({r.get("command", "") for r in runs})
        versions = runs[-1].get("versions", {})
        gpu = versions.get("gpu", "?")
        lines += [f"Runs: {len(runs)}, from {runs[0].get('start')} to {runs[-1].get('end')}. GPU: {gpu}. "
                  f"Python {runs[-1].get('python')}.", "", "Command(s):", ""]
        lines += [f"    {c}" for c in commands]
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if k != "gpu"), ""]
    lines += [
        f"How it is measured: ONNX Runtime {provider}, IO binding with inputs on the device and outputs "
        "pre-bound, warm-up, then the median over 7 timed blocks (inference) or 5 blocks of 10 steps "
        "(training) of the mean time per run. fp32 runs with TF32 on (ORT's default) unless marked "
        "`fp32-notf32`. Accuracy is against fp32 without TF32 on the same inputs (attention masks with "
        f"zeros): for inference the criterion of `onnxcampo optimize --validate` (onnxcampo.accuracy), the relative L2 error "
        f"||out - ref|| / ||ref|| <= {INFER_TOL} per output (rows measured before it was recorded: max |out - ref| / max |ref| "
        f"<= {LEGACY_INFER_TOL}); for training the loss after "
        f"the same N steps on the same batch within {TRAIN_TOL:.0%} of the reference's loss decrease over "
        "those steps, or within the gap that fp32 (TF32) runs of the same step graph show (TF32 and "
        "run-to-run kernel choice alone), when that is larger. \"TC share\" is "
        "the share of GEMM/Conv node time (ORT profiler) in fp16 with K and N multiples of 8. "
        "ORT's profiler times each node on the host (onnxruntime-gpu 1.31 is built without CUPTI): "
        "for a CUDA node that is its launch plus whatever waiting the launch queue forces, not its "
        "GPU time, so the TC share and the splits below rank where time goes only roughly. "
        "Anchors: inference fp32, occ-fp16, ort-fp16, modelopt, amp; training fp32, amp and the four "
        "PyTorch variants. An anchor row outside the tolerance does not count as an anchor; campo's "
        "accuracy is judged by its own target.",
        "",
    ]
    if interleaved:
        lines += [
            "Interleaved groups: the inference variants of " + ", ".join(interleaved) + " were measured in one run "
            "and then timed again with all their sessions alive, one block each in a rotating order per round "
            "(`run --interleave`); their ms below are the medians of those blocks, scaled so that fp32 keeps "
            "its own row's time (each row keeps its own median as `ms_row`). Rows of one group timed one after another compare the host's drift at batch 1 "
            "(the same graph measured up to 1.4x apart minutes apart); blocks in rotation compare the graphs.",
            "",
        ]
    lines += [
        "## Targets",
        "",
        "Why a target is missed (from the tables below, written by hand after each measuring session): "
        "`docs/benchmarks/README.md`, \"Why the targets are missed\".",
        "",
    ]
    for target in evaluate_targets(rows):
        lines.append(f"- {target['name']}: {_word(target['met'])}. {target['text']}.")
    if any(r.get("policy") == "campo-tune" for r in rows):
        lines += ["", "The same targets for `campo-tune` (`optimize(..., tune=\"cuda\")`: campo's candidate plans, "
                  "its own, without padding, amp and fp32, timed on the GPU when optimizing, the fastest kept; fp32 "
                  "unless a mixed plan is measured 2 % faster):", ""]
        lines += [f"- {t['name']}: {_word(t['met'])}. {t['text']}." for t in evaluate_targets(rows, "campo-tune")]
    if any(r.get("policy") == "campo-calib" for r in rows):
        lines += ["", "The inference targets for `campo-calib` (`optimize(..., activation_limit=512)` calibrated on "
                  "the benchmark's inputs: nodes reading or writing values beyond 512 stay fp32, as ModelOpt's "
                  "`data_max`):", ""]
        lines += [f"- {t['name']}: {_word(t['met'])}. {t['text']}." for t in evaluate_targets(rows, "campo-calib")
                  if "training" not in t["name"]]
    lines += ["", "## Headline", ""] + headline(rows) + [""]
    for name in plots:
        lines += [f"![{name}]({name})", ""]
    for mode in ("inference", "training"):
        keys = sorted(k for k in groups if k[2] == mode)
        if not keys:
            continue
        lines += [f"## {mode.capitalize()}", ""]
        for key in keys:
            note = next((r.get("shape_note") for r in groups[key].values() if r.get("shape_note")), "")
            lines += [f"### {key[0]}, batch {key[1]}" + (f" ({note})" if note else ""), ""]
            lines += group_table(key, groups[key]) + [""]
    lines += ["## campo training on ONNX Runtime vs the best PyTorch variant", ""] + torch_comparison(rows) + [""]
    lines += ["## Replayed as CUDA graphs (ms per run or step)", "",
              "`fp32-graph` and `campo-graph` run the `fp32` and `campo` models or step graphs with ORT's "
              "`enable_cuda_graph` (training: one captured graph per ping-pong binding, `onnxcampo train --cuda-graph`, "
              "`Trainer(cuda_graph=True)`): the host launches one graph per run instead of one kernel per node. The "
              "targets above count `campo` without replay; any ORT policy (amp and the converters included) could be "
              "replayed the same way, and `fp32-graph` shows how much of the gain is the replay rather than the "
              "precision plan.", ""]
    lines += cuda_graph_comparison(rows) + [""]
    fusion = fusion_plan_comparison(rows)
    if fusion:
        lines += ["## Planning with fusion in view (fused and replayed)", "",
                  "`campo-fused-graph` plans with the fused kernels' costs (`plan_for_fusion`, the default), "
                  "`campo-fused-blind-graph` as if no fusion ran (`--experimental plan_for_fusion=false`); both then run the same "
                  "fusions. Predicted: the chosen plan's total as its own planning costed it.", ""]
        lines += fusion + [""]
    lines += ["## Where a training step's time goes (ORT profiler, graph optimizations off, host time per node and step)", ""]
    lines += breakdown_table(rows) + [""]
    gpu = gpu_table(rows)
    if gpu:
        lines += ["GPU time per step by kernel class (CUPTI through `torch.profiler`, the step with ORT's graph "
                  "optimizations on, 5 steps; kernel names put in classes by `onnxcampo.benchmarks.measure.KERNEL_CLASSES`):", ""]
        lines += gpu + [""]
    failures = [r for r in rows if r.get("status") != "ok"]
    if failures:
        lines += ["## Variants that failed or could not run", "", "| key | status | reason |", "|---|---|---|"]
        lines += [f"| {r['key']} | {r['status']} | {_md(r.get('error', ''))[:300]} |" for r in sorted(failures, key=lambda r: r["key"])]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="folder with <name>.jsonl")
    p.add_argument("--name", default="h200")
    p.add_argument("--out", type=Path, default=None, help="markdown file (default: RAW/../<name>.md); <name>.json is written next to it")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--headline", action="store_true", help="print the README's headline table")
    args = p.parse_args(argv)
    path = args.raw / f"{args.name}.jsonl"
    if not path.is_file():
        print(f"error: no results at {path}", file=sys.stderr)
        return 2
    rows = read_rows(path)
    interleaved = apply_interleaved(rows, read_interleaved(args.raw / f"{args.name}.interleaved.jsonl"))
    runs_path = args.raw / f"{args.name}.runs.jsonl"
    runs = read_runs(runs_path)
    out = args.out or args.raw.parent / f"{args.name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = [] if args.no_plots else plot(rows, out.parent, args.name)
    try:
        raw = str(path.resolve().relative_to(out.parent.resolve()))
    except ValueError:
        raw = str(path)
    out.write_text(render(rows, runs, plots, raw, interleaved) + "\n", encoding="utf-8")
    json_path = out.with_name(f"{args.name}.json")
    write_json(json_path, throughput_json(rows, runs, raw))
    print(f"wrote {out}, {json_path.name}" + (f" and {', '.join(plots)}" if plots else ""))
    if args.headline:
        print("\n".join(headline(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
