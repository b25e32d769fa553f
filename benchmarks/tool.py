"""Speed and memory of ``onnxcampo.optimize`` itself (not of the models it writes).

Times ``optimize`` (policy campo, analytic cost model) on the largest corpus models and on a
generated graph of about 20,000 nodes, each in a fresh subprocess so that peak RSS belongs to
that model alone. Targets: under 10 s for 20k nodes on a 2-core machine; peak memory
under 3x the model size (reported as extra RSS over the interpreter's baseline).

    python -m onnxcampo.benchmarks tool [--nodes 20000] [--json docs/benchmarks/bench-tool/bench-tool.json]

``--model PATH`` times the command line on one model file instead: ``onnxcampo optimize PATH
OUT`` with the given ``--dim`` / ``--input-shape`` pins and otherwise default options (the
accuracy check included), and again with ``--no-accuracy-check``, each ``--repeat`` times in
fresh processes (alternating), best and every wall time printed (and written with ``--json``):

    python -m onnxcampo.benchmarks tool --model bert_base.onnx --dim batch=32 --dim sequence=128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.benchmarks import ROOT

LARGEST_CORPUS = ("layout_cdla", "ppocr_rec", "ppocr_det", "ddddocr_det", "smart_turn")


def generated_model(nodes: int, hidden: int = 64) -> onnx.ModelProto:
    """A deep residual MLP: blocks of MatMul, Add, Relu/Gelu-ish ops, LayerNorm, Softmax now and
    then, with unaligned widths, so every pass has work to do."""
    rng = np.random.default_rng(0)
    initializers, graph_nodes = [], []
    current = "x"
    index = 0
    while len(graph_nodes) < nodes:
        width = hidden + (index % 3)  # some widths not multiples of 8
        w = numpy_helper.from_array((rng.standard_normal((hidden, width)) * 0.05).astype(np.float32), f"w{index}")
        w2 = numpy_helper.from_array((rng.standard_normal((width, hidden)) * 0.05).astype(np.float32), f"v{index}")
        b = numpy_helper.from_array(np.zeros(width, np.float32), f"b{index}")
        initializers += [w, w2, b]
        p = f"blk{index}"
        graph_nodes += [
            helper.make_node("MatMul", [current, w.name], [f"{p}_mm"], name=f"{p}_mm"),
            helper.make_node("Add", [f"{p}_mm", b.name], [f"{p}_add"], name=f"{p}_add"),
            helper.make_node("Relu" if index % 2 else "Tanh", [f"{p}_add"], [f"{p}_act"], name=f"{p}_act"),
            helper.make_node("MatMul", [f"{p}_act", w2.name], [f"{p}_mm2"], name=f"{p}_mm2"),
            helper.make_node("Add", [f"{p}_mm2", current], [f"{p}_res"], name=f"{p}_res"),
        ]
        current = f"{p}_res"
        if index % 4 == 3:
            graph_nodes.append(helper.make_node("Softmax", [current], [f"{p}_sm"], name=f"{p}_sm", axis=-1))
            graph_nodes.append(helper.make_node("Mul", [f"{p}_sm", current], [f"{p}_gate"], name=f"{p}_gate"))
            current = f"{p}_gate"
        index += 1
    graph = helper.make_graph(
        graph_nodes, "deep_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, hidden])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, [512, hidden])],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the high-water mark (VmHWM) to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def measure_one(path: str, shapes_json: str) -> dict:
    """Runs in the child: current RSS, then optimize, then the peak RSS (high-water mark)."""
    import onnxcampo

    shapes = {k: tuple(v) for k, v in json.loads(shapes_json).items()}
    # Warm up on the bundled example so lazy imports (ONNX Runtime's schemas) are not counted.
    from onnxcampo.examples import mlp_block_path

    onnxcampo.optimize(mlp_block_path(), input_shapes={"x": (64, 256)}, accuracy="off")
    _reset_peak_rss()
    baseline = _status_kb("VmRSS")
    start = time.perf_counter()
    result = onnxcampo.optimize(path, input_shapes=shapes, accuracy="off")  # the optimizer alone
    seconds = time.perf_counter() - start
    peak = _status_kb("VmHWM")
    return {
        "seconds": round(seconds, 3),
        "extra_rss_mb": round((peak - baseline) / 1024, 1),
        "casts": result.report["casts_inserted"],
        "nodes_fp16": result.report["nodes_fp16"],
    }


def run_child(path: Path, shapes: dict) -> dict:
    code = ("import json; from onnxcampo.benchmarks.tool import measure_one; "
            "print(json.dumps(measure_one(%r, %r)))" % (str(path), json.dumps(shapes)))
    # -P as this process has it: a --target install run from the repository root must not find ./onnxcampo
    safe = ["-P"] if sys.flags.safe_path else []
    done = subprocess.run([sys.executable, *safe, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_command_line(path: Path, pins: list[str], repeat: int) -> dict:
    """Wall seconds of ``onnxcampo optimize`` on ``path`` (``pins``: its --dim/--input-shape
    arguments), with the default accuracy check and without, ``repeat`` runs each, alternating,
    each in a fresh process (imports included, as a user runs it)."""
    runs: dict[str, list[float]] = {"default": [], "no_accuracy_check": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeat):
            for name, extra in (("default", []), ("no_accuracy_check", ["--no-accuracy-check"])):
                command = [sys.executable, "-m", "onnxcampo", "optimize", str(path), str(Path(tmp) / "out.onnx"),
                           *pins, *extra]
                start = time.perf_counter()
                subprocess.run(command, capture_output=True, text=True, check=True)
                runs[name].append(round(time.perf_counter() - start, 2))
    return {"model": str(path), "size_mb": round(path.stat().st_size / 1e6, 2), "pins": pins,
            **{f"{name}_best_s": min(times) for name, times in runs.items()},
            **{f"{name}_s": times for name, times in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=20000)
    parser.add_argument("--json", type=Path, default=None,
                        help="where the rows go (default: docs/benchmarks/bench-tool/bench-tool.json; with --model: "
                             "printed only)")
    parser.add_argument("--skip-corpus", action="store_true")
    parser.add_argument("--model", type=Path, help="time `onnxcampo optimize` on this model file instead")
    parser.add_argument("--dim", action="append", default=[], metavar="NAME=N", help="with --model: a dim pin")
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME:D0,D1,...",
                        help="with --model: an input shape pin")
    parser.add_argument("--repeat", type=int, default=3, help="with --model: runs of each variant (default 3)")
    args = parser.parse_args(argv)
    if args.model is not None:
        pins = [*(part for dim in args.dim for part in ("--dim", dim)),
                *(part for shape in args.input_shape for part in ("--input-shape", shape))]
        row = time_command_line(args.model, pins, args.repeat)
        print(json.dumps(row), flush=True)
        if args.json is not None:
            machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "onnx": onnx.__version__}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"machine": machine, "rows": [row]}, indent=1) + "\n")
            print(f"wrote {args.json}")
        return 0
    args.json = args.json or ROOT / "docs" / "benchmarks" / "bench-tool" / "bench-tool.json"

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = generated_model(args.nodes)
        path = Path(tmp) / "generated.onnx"
        onnx.save(model, str(path))
        row = {"model": f"generated ({len(model.graph.node)} nodes)", "nodes": len(model.graph.node),
               "size_mb": round(path.stat().st_size / 1e6, 2), **run_child(path, {})}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.skip_corpus:
        from onnxcampo.benchmarks import corpus

        for key in LARGEST_CORPUS:
            entry = corpus.get(key)
            path = corpus.fetch(entry)
            proto = onnx.load(str(path), load_external_data=False)
            row = {"model": key, "nodes": len(proto.graph.node), "size_mb": round(path.stat().st_size / 1e6, 2),
                   **run_child(path, {k: list(v) for k, v in entry.input_shapes.items()})}
            rows.append(row)
            print(json.dumps(row), flush=True)
    machine = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "onnx": onnx.__version__}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
