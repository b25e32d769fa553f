"""The shape of the code a newcomer carries on: what ``docs/guide/architecture.md`` promises.

- no function or method of the package (``onnxcampo/``, ``passes/``, ``costdb/``) is longer than
  100 lines: a longer one is split where its steps are;
- ``OptimizeConfig`` has at most 22 public fields (the experiment switches live in
  ``ExperimentalOptions``, ``experimental=`` / ``--experimental key=value``);
- ``onnxcampo/`` has at most 22 top-level modules: a new layer gets a folder (``rewrites/``,
  ``accuracy/``, ``report/``, ``cli/``, ...);
- ``scripts/`` holds a few one-off generators, at most 3,000 lines (the benchmarks are the
  package ``onnxcampo.benchmarks``, the GPU checks tests under ``tests/gpu/``);
- ``docs/guide/architecture.md`` exists.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from onnxcampo.config import OptimizeConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("onnxcampo", "passes", "costdb")
LONGEST_FUNCTION = 100
CONFIG_FIELDS = 22
TOP_LEVEL_MODULES = 22
SCRIPT_LINES = 3000


def long_functions(roots=PACKAGE, limit: int = LONGEST_FUNCTION) -> list[str]:
    found = []
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_package_is_longer_than_100_lines():
    assert long_functions() == []


def test_the_checker_sees_a_long_function(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [f.split()[1] for f in long_functions(("pkg",))] == ["long"]


def test_the_config_has_at_most_22_public_fields():
    public = [f.name for f in dataclasses.fields(OptimizeConfig) if not f.name.startswith("_")]
    assert len(public) <= CONFIG_FIELDS, public


def test_the_package_has_at_most_22_top_level_modules():
    modules = sorted(p.name for p in (ROOT / "onnxcampo").glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, modules


def test_scripts_hold_at_most_3000_lines():
    files = [p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".py", ".sh", ".cc")]
    lines = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in files)
    assert lines <= SCRIPT_LINES, f"scripts/ has {lines} lines"


def test_the_architecture_guide_exists():
    guide = ROOT / "docs" / "guide" / "architecture.md"
    assert guide.is_file()
    text = guide.read_text(encoding="utf-8")
    for section in ("A model-file rewrite", "A custom op"):
        assert section in text
