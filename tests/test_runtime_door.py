"""One runtime door: onnxcampo.runtime is the only code that creates ONNX Runtime sessions.

Everything else (the optimizer, the cost database, the benchmarks) asks
``onnxcampo.runtime.make_session`` for one, so that providers, TF32, CUDA graphs, session options
and ORT's errors are handled in one place. The modules are read as text: a new
``InferenceSession(`` or ``SessionOptions(`` outside the door fails here, named by file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("onnxcampo", "costdb", "passes", "benchmarks", "scripts")
# the door itself; the custom-op library's load probe (ops.available() builds SessionOptions to
# try registering the library)
EXEMPT = ("onnxcampo/runtime/", "onnxcampo/ops/__init__.py")
SESSION_MAKERS = re.compile(r"\b(InferenceSession|SessionOptions)\(")


def _modules() -> list[Path]:
    return sorted(path for folder in SEARCHED for path in (ROOT / folder).rglob("*.py"))


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_outside_onnxcampo_runtime_creates_an_ort_session():
    found = []
    for path in _modules():
        name = _relative(path)
        if name.startswith(EXEMPT):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SESSION_MAKERS.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "make ORT sessions with onnxcampo.runtime.make_session:\n" + "\n".join(found)


def test_the_scan_sees_the_exempt_makers():
    """The exemptions are live (each exempt place still makes one) and the scan would see them."""
    modules = {_relative(path): path for path in _modules()}
    assert len(modules) > 50
    for exempt in EXEMPT:
        texts = [path.read_text(encoding="utf-8") for name, path in modules.items() if name.startswith(exempt)]
        assert any(SESSION_MAKERS.search(text) for text in texts), exempt


def test_the_placed_graph_door_stands_alone_for_the_training_venv():
    # scripts/check_ort_artifacts.py loads it by path where onnxcampo is not installed
    source = (ROOT / "onnxcampo" / "runtime" / "placed.py").read_text()
    assert not re.search(r"^\s*(from|import) onnxcampo", source, re.M)
    assert "placed.py" in (ROOT / "scripts" / "check_ort_artifacts.py").read_text()


def test_the_placed_graph_counts_what_orts_cpu_leaves_fp16(tmp_path):
    # wiring on ORT CPU: a Transpose has a kernel of any type and stays fp16; ORT's CPU has no fp16
    # Sigmoid, so it places one in fp32 between Casts of its own, and the node no longer counts
    import onnx
    from onnx import TensorProto, helper

    from onnxcampo.runtime.placed import fp16_nodes, placed_graph

    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]), helper.make_node("Sigmoid", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [3, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert fp16_nodes(model) == 2
    placed = placed_graph(path, tmp_path / "placed.onnx")
    assert fp16_nodes(placed) == 1 and [n.op_type for n in placed.graph.node].count("Cast") == 2


def test_the_standalone_sessions_stand_alone():
    # the benchmark harness's probes make sessions from a path and a library file alone
    source = (ROOT / "onnxcampo" / "runtime" / "standalone.py").read_text()
    assert not re.search(r"^\s*(from|import) (onnxcampo|onnx\b)", source, re.M)
