"""Loss curves of the benchmark's training variants over many steps, compared with fp32.

The target: "loss curves over 200 steps within 2 % of fp32; no divergence".

Every model of ``--models`` is trained ``--steps`` steps by each variant of ``--policies``, all
from the same starting weights on the same sequence of batches: ``--batches K`` distinct seeded
batches (batch 0 is the benchmark's own feeds and labels, the others drawn the same way from
their index: ``models.Built.training_batch``), cycled, so a model can memorize them and
its loss moves. The step graphs are the benchmark's (``runner.Group.step_graph``,
``runner.training_variant``: cross-entropy, SGD momentum, the model's lr; built once and cached
on disk under ``$ONNXCAMPO_BENCH_CACHE``), run by ``measure.StepRunner`` (the benchmark's session
options: TF32 on or off, CUDA-graph replay for the ``-graph`` variants), the batch copied into
the bound buffers before each step.

Compared with the reference ``fp32-notf32`` (``compare``): the losses are averaged over windows
of ``--window`` steps (10); in each of the windows of the last ``--tail`` steps (50) the variant's
mean is compared with the reference's mean over the same steps, ``|mean - ref| / |ref|``. A
variant is **within** the tolerance (2 %) when the largest of those is at most 2 % and it did not
diverge. **Diverged**: a non-finite loss at any step, or a final window mean above the
reference's first window mean (the run ended worse than training started). With dynamic loss
scaling the variant's ``loss_scale`` is read after every step: a step whose scale went down was
skipped (an overflow: nothing updated), the final scale is recorded.

    python3 -P -m onnxcampo.benchmarks loss-curves                                      # bert, gpt2, resnet50 on CUDA
    python3 -P -m onnxcampo.benchmarks loss-curves --provider cpu --quick --models odd_mlp --steps 30 --policies fp32-notf32,amp,campo

Writes ``--out`` (JSON: every loss, the comparison, command lines, versions, times) after every
variant and a PNG beside it (one panel per model; needs matplotlib, else skipped with a warning:
``--plot-only`` draws it later from the JSON). A later run with the same ``--out`` and settings
keeps what is recorded and runs only what is missing (``--redo`` runs it all again), so a run cut
by ``--budget-s`` or the device's time limit continues where it stopped.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from onnxcampo.benchmarks import models as bench_models
from onnxcampo.benchmarks import policies as pol

log = logging.getLogger("loss_curves")
from onnxcampo.benchmarks import ROOT
DEFAULT_MODELS = ("bert", "gpt2", "resnet50")
DEFAULT_POLICIES = (pol.REFERENCE, "fp32", "amp-graph", "campo-graph", "campo-fused-graph", "campo-fused-cl-graph",
                    "campo-fused-cl-means-graph")
TOLERANCE = 0.02
WINDOW = 10
TAIL = 50
LOSS_SCALE = "loss_scale"
CLEAN_STEPS = "loss_scale_clean_steps"
FORMAT = 1  # the JSON layout's version


# --------------------------------------------------------------------------------------------
# the comparison (pure: losses in, numbers out)
# --------------------------------------------------------------------------------------------


def window_means(losses, window: int) -> list[float]:
    """Means of consecutive windows of ``window`` steps, aligned to the end of the run (a first
    partial window is dropped); one window of everything when the run is shorter."""
    values = np.asarray(losses, dtype=np.float64)
    if len(values) <= window:
        return [float(values.mean())] if len(values) else []
    start = len(values) % window
    return [float(v) for v in values[start:].reshape(-1, window).mean(axis=1)]


def compare(losses, reference, *, window: int = WINDOW, tail: int = TAIL, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """``losses`` (a variant's, one a step; NaN/inf/None where non-finite) against ``reference``
    (fp32-notf32's over the same steps and batches).

    Returns: ``finite`` (every loss finite), ``nonfinite_steps`` (their count), ``complete`` (as
    many steps as the reference), per window of the last ``tail`` steps the variant's mean, the
    reference's and ``|mean - ref| / |ref|`` (``windows``), ``max_rel_diff`` (the largest of
    those), ``final_rel_diff`` (the last window's), ``first_window`` / ``final_window`` (the
    variant's means), ``reference_first_window``, ``reference_drop`` (how much the reference's
    loss fell, first window to last, relative: near 0 the comparison says little), ``diverged``
    (a non-finite loss, or the final window above the reference's first) and ``within`` (not
    diverged, complete, and ``max_rel_diff <= tolerance``). Windows are aligned to the end of the
    run (``window_means``).
    """
    values = np.array([math.nan if v is None else v for v in losses], dtype=np.float64)
    ref = np.array([math.nan if v is None else v for v in reference], dtype=np.float64)
    nonfinite = int((~np.isfinite(values)).sum())
    complete = len(values) == len(ref) and len(ref) > 0
    steps = min(len(values), len(ref))
    out: dict[str, Any] = {"steps": len(values), "finite": nonfinite == 0 and len(values) > 0,
                           "nonfinite_steps": nonfinite, "complete": complete, "window": window, "tail": tail,
                           "tolerance": tolerance}
    if steps == 0:
        return {**out, "windows": [], "max_rel_diff": None, "final_rel_diff": None, "first_window": None,
                "final_window": None, "reference_first_window": None, "reference_drop": None, "diverged": True,
                "within": False}
    mine, theirs = window_means(values[:steps], window), window_means(ref[:steps], window)
    count = max(1, min(len(mine), tail // window if tail >= window else 1))
    rows = []
    first_step = steps - len(mine) * window if steps > window else 0
    for index in range(len(mine) - count, len(mine)):
        a, b = mine[index], theirs[index]
        rel = abs(a - b) / abs(b) if math.isfinite(a) and math.isfinite(b) and b != 0 else math.nan
        start = first_step + index * window if steps > window else 0
        rows.append({"steps": [start, min(start + window, steps)], "mean": _num(a), "reference": _num(b),
                     "rel_diff": _num(rel)})
    rels = [r["rel_diff"] for r in rows]
    worst = None if any(r is None for r in rels) else max(rels)
    ref_first, ref_last = theirs[0], theirs[-1]
    final = mine[-1]
    diverged = (not out["finite"]) or not math.isfinite(final) or (math.isfinite(ref_first) and final > ref_first)
    drop = (ref_first - ref_last) / abs(ref_first) if math.isfinite(ref_first) and math.isfinite(ref_last) and ref_first else None
    return {**out, "windows": rows, "max_rel_diff": worst, "final_rel_diff": rels[-1],
            "first_window": _num(mine[0]), "final_window": _num(final), "reference_first_window": _num(ref_first),
            "reference_drop": _num(drop), "diverged": bool(diverged),
            "within": bool(complete and not diverged and worst is not None and worst <= tolerance)}


def _num(value) -> float | None:
    """A float for the JSON, None where it is not finite (NaN and inf are not JSON)."""
    return float(value) if value is not None and math.isfinite(value) else None


def verdict(entry: dict[str, Any]) -> str:
    """``met (0.31 %)``, ``not met (2.40 %)``, ``not met (diverged: ...)``, ``unavailable``, ..."""
    status = entry.get("status")
    if status != "ok":
        return f"{status}: {entry.get('error', '')[:80]}"
    c = entry.get("comparison")
    if c is None:
        return "no reference"
    figure = "-" if c["max_rel_diff"] is None else f"{100 * c['max_rel_diff']:.2f} %"
    if c["within"]:
        return f"met ({figure})"
    if not c["finite"]:
        return f"not met (diverged: {c['nonfinite_steps']} non-finite losses)"
    if c["diverged"]:
        return f"not met (diverged: final window {c['final_window']:.4g} > reference's first {c['reference_first_window']:.4g})"
    if not c["complete"]:
        return f"not met (incomplete: {c['steps']} steps, {figure})"
    return f"not met ({figure})"


# --------------------------------------------------------------------------------------------
# training one variant
# --------------------------------------------------------------------------------------------


def train_variant(group, policy: str, batches: list[dict[str, np.ndarray]], *, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``policy``'s step graph from the group's starting weights, batch
    ``i % len(batches)`` at step ``i``: the losses, the loss scale's changes, timings."""
    import onnx

    from onnxcampo.benchmarks import measure as m
    from onnxcampo.benchmarks.runner import training_variant

    provider = group.settings.provider
    graph = policy in pol.GRAPH_POLICIES
    if graph and provider != "cuda":
        raise pol.Unavailable("CUDA graphs need the CUDA execution provider")
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    group.step_graph()
    seconds["step_graph"] = round(time.perf_counter() - started, 2)
    t0 = time.perf_counter()
    path, info = training_variant(group, policy)
    seconds["convert"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    step_model = onnx.load(str(path), load_external_data=False)
    counts = m.node_counts(step_model)
    weights = group.step_weights()
    runner = m.StepRunner(path, weights=weights, batch=batches[0], provider=provider, tf32=pol.tf32_of(policy),
                          model=step_model, cuda_graph=graph)
    del step_model
    seconds["session"] = round(time.perf_counter() - t0, 2)
    initial_scale = runner.state(LOSS_SCALE)  # before the first step: the graph's initial state
    scaled, scale = initial_scale is not None, initial_scale
    entry: dict[str, Any] = {"status": "ok", "policy": policy, "tf32": pol.tf32_of(policy), "cuda_graph": graph,
                             **{k: info[k] for k in ("chosen_plan", "nodes_fp16", "casts_inserted", "cached")
                                if info.get(k) is not None}, **counts}
    losses: list[float | None] = []
    step_ms: list[float] = []
    scale_changes: list[list[float]] = []  # [step, scale after it] wherever the scale changed
    skipped = 0
    t0 = time.perf_counter()
    for index in range(steps):
        if len(batches) > 1:
            runner.set_batch(batches[index % len(batches)])
        start = time.perf_counter()
        loss = runner()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(loss if math.isfinite(loss) else None)  # None in the JSON; "nonfinite" says which
        if not math.isfinite(loss):
            entry.setdefault("nonfinite", []).append([index, repr(loss)])
        if scaled:
            now = runner.state(LOSS_SCALE)
            if now != scale:
                scale_changes.append([index, now])
                skipped += now < scale  # halved: that step overflowed and updated nothing
                scale = now
    seconds["train"] = round(time.perf_counter() - t0, 2)
    entry.update(losses=losses, ms_per_step=round(float(np.median(step_ms[3:] or step_ms)), 3), seconds=seconds)
    if scaled:
        entry["loss_scale"] = {"initial": initial_scale, "final": scale, "skipped_steps": int(skipped),
                               "changes": scale_changes, "clean_steps": runner.state(CLEAN_STEPS)}
    del runner
    gc.collect()
    return entry


# --------------------------------------------------------------------------------------------
# the results file
# --------------------------------------------------------------------------------------------


def settings_key(args) -> dict[str, Any]:
    """What makes recorded curves comparable with this run's: a file made otherwise is not resumed."""
    return {"steps": args.steps, "batches": args.batches, "provider": args.provider, "quick": args.quick,
            "sample_seed": bench_models.SAMPLE_SEED}


def load_results(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The recorded results at ``path`` when made with the same settings; else (None, why not)."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"{path} is not readable JSON ({exc.__class__.__name__}); starting afresh"
    if data.get("format") != FORMAT or data.get("settings") != key:
        return None, f"{path} was made with other settings ({data.get('settings')}); starting afresh"
    return data, None


def assess(data: dict[str, Any], *, window: int, tail: int, tolerance: float) -> None:
    """(Re)compute every variant's comparison with its model's reference, in place."""
    data["analysis"] = {"window": window, "tail": tail, "tolerance": tolerance, "reference": pol.REFERENCE}
    for model in data["models"].values():
        reference = model["policies"].get(pol.REFERENCE, {})
        ref_losses = reference.get("losses") if reference.get("status") == "ok" else None
        for entry in model["policies"].values():
            if entry.get("status") == "ok" and ref_losses:
                entry["comparison"] = compare(entry["losses"], ref_losses, window=window, tail=tail,
                                              tolerance=tolerance)
            else:
                entry.pop("comparison", None)


def targets(data: dict[str, Any]) -> dict[str, Any]:
    """The issue's target over every variant compared (the reference itself left out)."""
    rows, missed = [], []
    for name, model in data["models"].items():
        for policy, entry in model["policies"].items():
            if policy == pol.REFERENCE:  # not compared with itself, but a diverging reference fails the target
                if (entry.get("comparison") or {}).get("diverged"):
                    missed.append(f"{name}/{policy} (the reference diverged)")
                continue
            c = entry.get("comparison")
            rows.append({"model": name, "policy": policy, "verdict": verdict(entry),
                         "max_rel_diff": None if c is None else c["max_rel_diff"]})
            if entry.get("status") == "ok" and not (c and c["within"]):
                missed.append(f"{name}/{policy}")
    compared = [r for r in rows if r["max_rel_diff"] is not None]
    worst = max(compared, key=lambda r: r["max_rel_diff"], default=None)
    return {"target": f"loss curves over {data['settings']['steps']} steps within "
                      f"{100 * data['analysis']['tolerance']:g} % of fp32; no divergence",
            "met": bool(compared) and not missed, "missed": missed, "rows": rows,
            "worst": None if worst is None else {k: worst[k] for k in ("model", "policy", "max_rel_diff")}}


def save(data: dict[str, Any], path: Path, mirror: Path | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    if mirror is not None:
        mirror.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, mirror / path.name)


# --------------------------------------------------------------------------------------------
# output: the table and the plot
# --------------------------------------------------------------------------------------------


def table(data: dict[str, Any]) -> str:
    a = data["analysis"]
    s = data["settings"]
    lines = [f"Loss curves: {s['steps']} steps, {s['batches']} batches cycled, {s['provider']}; windows of "
             f"{a['window']} steps, the last {min(a['tail'], s['steps'])} against {a['reference']} (|mean - ref| / ref)",
             f"{'model':10s} {'policy':18s} {'loss first->final window':>26s} {'max last ' + str(min(a['tail'], s['steps'])):>12s} "
             f"{'final':>8s} {'finite':>6s} {'skipped':>7s} {'scale':>8s}  within {100 * a['tolerance']:g} %"]
    for name, model in data["models"].items():
        for policy, entry in model["policies"].items():
            c = entry.get("comparison")
            if entry.get("status") != "ok" or c is None:
                lines.append(f"{name:10s} {policy:18s} {verdict(entry)}")
                continue
            first = "-" if c["first_window"] is None else f"{c['first_window']:.4f}"
            final = "-" if c["final_window"] is None else f"{c['final_window']:.4f}"
            pct = lambda v: "-" if v is None else f"{100 * v:.2f} %"  # noqa: E731
            scale = entry.get("loss_scale") or {}
            shown = "ref" if policy == a["reference"] else verdict(entry)
            lines.append(f"{name:10s} {policy:18s} {first + ' -> ' + final:>26s} {pct(c['max_rel_diff']):>12s} "
                         f"{pct(c['final_rel_diff']):>8s} {'yes' if c['finite'] else 'NO':>6s} "
                         f"{scale.get('skipped_steps', '-')!s:>7s} {scale.get('final', '-')!s:>8s}  {shown}")
        ref = model["policies"].get(a["reference"], {}).get("comparison")
        if ref and ref.get("reference_drop") is not None:
            lines.append(f"{'':10s} (the reference's loss fell {100 * ref['reference_drop']:.1f} % from its first "
                         f"window to its last)")
    t = data["targets"]
    worst = t["worst"]
    figure = "" if worst is None else f"worst {worst['model']}/{worst['policy']} {100 * worst['max_rel_diff']:.2f} %"
    state = "met" if t["met"] else "not met"
    extra = f"; missed: {', '.join(t['missed'])}" if t["missed"] else ""
    lines.append(f'Target "{t["target"]}": {state} ({figure or "nothing compared"}{extra})')
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """One panel per model (window means of every variant; the reference's raw losses faint) over
    one panel per model of the relative difference to the reference per window, with the band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is missing: no %s (python3 -P -m onnxcampo.benchmarks loss-curves --plot-only --out %s, where it "
                    "is installed)", path, path.with_suffix(".json"))
        return None
    models = [(name, m) for name, m in data["models"].items() if any(e.get("status") == "ok" for e in m["policies"].values())]
    if not models:
        return None
    a = data["analysis"]
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 7.0), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]})
    for column, (name, model) in enumerate(models):
        top, bottom = axes[0][column], axes[1][column]
        for policy, entry in model["policies"].items():
            if entry.get("status") != "ok":
                continue
            losses = np.array([math.nan if v is None else v for v in entry["losses"]], dtype=np.float64)
            means = window_means(losses, a["window"])
            centres = [len(losses) - (len(means) - i - 0.5) * a["window"] for i in range(len(means))]
            if policy == a["reference"]:
                top.plot(np.arange(len(losses)), losses, color="0.8", lw=0.7, zorder=0, label=f"{policy} (each step)")
            top.plot(centres, means, lw=1.4, marker=".", label=policy)
            c = entry.get("comparison")
            if c and policy != a["reference"]:
                ref = np.array([math.nan if v is None else v for v in model["policies"][a["reference"]]["losses"]])
                rm = window_means(ref[:len(losses)], a["window"])
                rel = [100 * (x - y) / abs(y) if y else math.nan for x, y in zip(means, rm)]
                bottom.plot(centres, rel, lw=1.2, marker=".", label=policy)
        steps = data["settings"]["steps"]
        for ax in (top, bottom):
            ax.axvspan(max(0, steps - a["tail"]), steps, color="0.93", zorder=-1)
            ax.grid(alpha=0.3)
        bottom.axhline(100 * a["tolerance"], color="red", lw=0.8, ls="--")
        bottom.axhline(-100 * a["tolerance"], color="red", lw=0.8, ls="--")
        bottom.axhline(0, color="0.5", lw=0.6)
        top.set_title(f"{name} b{model['batch']} ({model.get('shape_note', '')})", fontsize=9)
        top.set_ylabel(f"loss (mean of {a['window']} steps)")
        bottom.set_ylabel(f"vs {a['reference']} (%)")
        bottom.set_xlabel("step")
        top.legend(fontsize=7)
    s = data["settings"]
    fig.suptitle(f"Training loss, {s['steps']} steps on {s['batches']} batches cycled ({s['provider']}); shaded: "
                 f"the last {min(a['tail'], s['steps'])} steps compared", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------


class OutOfTime(BaseException):
    """The alarm shortly before the device's limit: stop with what is recorded."""


def _alarm(signum, frame):
    raise OutOfTime()


def device_name(provider: str) -> str:
    if provider != "cuda":
        return platform.processor() or platform.machine()
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated benchmark models")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma-separated training variants (the benchmark's names); {pol.REFERENCE} is always run first")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batches", type=int, default=8, help="distinct seeded batches, cycled")
    p.add_argument("--window", type=int, default=WINDOW, help="steps a loss is averaged over")
    p.add_argument("--tail", type=int, default=TAIL, help="the last steps compared with the reference")
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="the benchmark's tiny models at batch 4 (a smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help="results JSON (default docs/benchmarks/training/loss-curves-h200.json on cuda, "
                        "loss-curves-cpu.json on cpu); the PNG goes beside it")
    p.add_argument("--mirror", type=Path, default=None, help="also copy the JSON and PNG here after every variant ($OUT)")
    p.add_argument("--wheels", type=Path, default=ROOT / ".benchwheels", help="the bench's wheels (onnx-ad, ...)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no variant after this many seconds")
    p.add_argument("--redo", action="store_true", help="train again what --out already holds")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG and print the table from --out")
    p.add_argument("--check", action="store_true", help="exit 1 when the target is not met")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def default_out(provider: str) -> Path:
    return ROOT / "docs" / "benchmarks" / "training" / f"loss-curves-{'h200' if provider == 'cuda' else 'cpu'}.json"


def finish(data: dict[str, Any], args, out: Path) -> int:
    assess(data, window=args.window, tail=args.tail, tolerance=args.tolerance)
    data["targets"] = targets(data)
    save(data, out, args.mirror)
    png = plot(data, out.with_suffix(".png"))
    if png is not None and args.mirror is not None:
        shutil.copyfile(png, args.mirror / png.name)
    print(table(data), flush=True)
    print(f"wrote {out}" + (f" and {png}" if png else " (no PNG)"), flush=True)
    return 1 if args.check and not data["targets"]["met"] else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    out = args.out or default_out(args.provider)
    models = [m for m in args.models.split(",") if m]
    policies = [p for p in args.policies.split(",") if p]
    policies = [pol.REFERENCE, *[p for p in policies if p != pol.REFERENCE]]
    unknown = [m for m in models if m not in bench_models.MODELS or bench_models.MODELS[m].train_batch is None]
    bad = [p for p in policies if p not in pol.TRAINING_POLICIES or p in pol.TORCH_POLICIES]
    if unknown or bad or args.steps < 1 or args.batches < 1 or args.window < 1 or args.tail < 1:
        print(f"error: unknown or untrainable models {unknown}, policies {bad} (the ONNX training variants), or "
              f"--steps/--batches/--window/--tail below 1", file=sys.stderr)
        return 2
    key = settings_key(args)
    if args.plot_only:
        try:
            data = json.loads(out.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: no results at {out} ({exc.__class__.__name__})", file=sys.stderr)
            return 2
        if data.get("format") != FORMAT:
            print(f"error: {out} is not a loss-curves file of format {FORMAT}", file=sys.stderr)
            return 2
        return finish(data, args, out)

    from onnxcampo.benchmarks.runner import Group, Settings, check_provider

    problem = check_provider(args.provider)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    wheels = pol.install_wheels(args.wheels)
    data, why = (None, None) if args.redo else load_results(out, key)
    if why:
        print(why, flush=True)
    if data is None:
        data = {"format": FORMAT, "settings": key, "runs": [], "models": {}}
    run = uuid.uuid4().hex[:8]
    record = {"run": run, "start": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m onnxcampo.benchmarks loss-curves", *(sys.argv[1:] if argv is None else argv)]),
              "provider": args.provider, "device": device_name(args.provider), "python": platform.python_version(),
              "versions": pol.package_versions(), "wheels": wheels, "custom_ops": _custom_ops()}
    data["runs"].append(record)
    started = time.monotonic()
    settings = Settings.make(args.provider, args.quick, False, ())
    stopped = None
    last_s = 0.0
    signal.signal(signal.SIGALRM, _alarm)
    signal.signal(signal.SIGTERM, _alarm)
    signal.alarm(int(args.budget_s + 25))
    try:
        with tempfile.TemporaryDirectory(prefix="onnxcampo-loss-") as tmp:
            for name in models:
                spec = bench_models.MODELS[name]
                batch = bench_models.QUICK_BATCHES["train"] if args.quick else spec.train_batch
                entry = data["models"].setdefault(name, {"batch": batch, "policies": {}})
                todo = [p for p in policies if entry["policies"].get(p, {}).get("status") not in ("ok", "unavailable")]
                if not todo:
                    continue
                elapsed = time.monotonic() - started
                if elapsed > 0 and args.budget_s - elapsed < max(last_s, 30.0):
                    stopped = f"budget: {args.budget_s - elapsed:.0f} s left before {name}"
                    break
                t0 = time.perf_counter()
                try:
                    group = Group(name, batch, "training", settings, Path(tmp))
                    batches = [group.built.training_batch(k) for k in range(args.batches)]
                except Exception as exc:  # noqa: BLE001 - the model's row says why
                    entry["error"] = f"model build failed: {exc.__class__.__name__}: {str(exc)[:300]}"
                    print(f"{name}: {entry['error']}", flush=True)
                    save(data, out, args.mirror)
                    continue
                entry.update(shape_note=group.built.shape_note, lr=group.built.lr,
                             build_s=round(time.perf_counter() - t0, 1))
                entry.pop("error", None)
                for policy in todo:
                    elapsed = time.monotonic() - started
                    if args.budget_s - elapsed < max(last_s, 20.0):
                        stopped = f"budget: {args.budget_s - elapsed:.0f} s left before {name}/{policy}"
                        break
                    t1 = time.perf_counter()
                    try:
                        result = train_variant(group, policy, batches, steps=args.steps)
                    except pol.Unavailable as exc:
                        result = {"status": "unavailable", "error": str(exc)}
                    except Exception as exc:  # noqa: BLE001 - a failing variant is a result
                        if args.verbose:
                            import traceback

                            traceback.print_exc()
                        result = {"status": "failed", "error": f"{exc.__class__.__name__}: {str(exc)[:400]}"}
                    last_s = time.perf_counter() - t1
                    result.update(run=run, item_s=round(last_s, 1),
                                  time=datetime.now(timezone.utc).isoformat(timespec="seconds"))
                    entry["policies"][policy] = result
                    entry["step_build_s"] = group.step_build_s if group.step_build_s is not None else entry.get("step_build_s")
                    _print_variant(name, policy, result)
                    save(data, out, args.mirror)
                if stopped:
                    break
                del group, batches
                gc.collect()
    except OutOfTime:
        stopped = "hard stop (25 s past the budget, or SIGTERM); the variant in flight is not recorded"
    finally:
        signal.alarm(0)
    record.update(end=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  wall_s=round(time.monotonic() - started, 1), stopped=stopped)
    code = finish(data, args, out)
    left = [f"{n}/{p}" for n in models for p in policies
            if data["models"].get(n, {}).get("policies", {}).get(p, {}).get("status") not in ("ok", "unavailable")]
    if stopped and left:
        print(f"stopped ({stopped}); {len(left)} variants left: run the same command again", flush=True)
    return code


def _custom_ops() -> str:
    from onnxcampo import ops

    return "available" if ops.available() else "not available (standard ops for the update and loss scaling)"


def _print_variant(model: str, policy: str, result: dict[str, Any]) -> None:
    if result["status"] != "ok":
        print(f"  {model}/{policy}: {result['status']}: {result.get('error', '')[:200]}", flush=True)
        return
    losses = [v for v in result["losses"] if v is not None]
    scale = result.get("loss_scale")
    extra = f", loss scale {scale['final']:g} ({scale['skipped_steps']} skipped)" if scale else ""
    first, last = (f"{losses[0]:.4f}", f"{losses[-1]:.4f}") if losses else ("-", "-")
    print(f"  {model}/{policy}: loss {first} -> {last}, {len(result['losses']) - len(losses)} non-finite, "
          f"{result['ms_per_step']:.2f} ms a step{extra} ({result['item_s']} s)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
