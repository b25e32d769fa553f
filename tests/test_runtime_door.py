"""One runtime door: onnxcampo.runtime is the only code that creates ONNX Runtime sessions.

Everything else (the optimizer, the cost database, the benchmark scripts) asks
``onnxcampo.runtime.make_session`` for one, so that providers, TF32, CUDA graphs, session options
and ORT's errors are handled in one place. The modules are read as text: a new
``InferenceSession(`` or ``SessionOptions(`` outside the door fails here, named by file and line.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("onnxcampo", "costdb", "passes", "scripts")
# the door itself; the custom-op library's load probe (ops.available() builds SessionOptions to
# try registering the library); a script that runs in the onnxruntime-training venv, where
# onnxcampo is not installed
EXEMPT = ("onnxcampo/runtime/", "onnxcampo/ops/__init__.py", "scripts/check_ort_artifacts.py")
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
