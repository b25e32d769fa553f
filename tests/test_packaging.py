"""Packaging: ONNX Runtime is chosen with an extra (its CPU and CUDA wheels share one package
folder), the README installs the CPU one, CI runs the README's own command, the license ships."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=~!; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _readme_commands() -> list[str]:
    block = (ROOT / "README.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_the_core_pins_no_onnxruntime_and_the_extras_choose_one():
    assert not _requirement_names(PROJECT["dependencies"]) & {"onnxruntime", "onnxruntime-gpu"}
    extras = PROJECT["optional-dependencies"]
    assert _requirement_names(extras["cpu"]) == {"onnxruntime"}
    assert _requirement_names(extras["gpu"]) == {"onnxruntime-gpu"}
    assert "onnxruntime-gpu[cuda,cudnn]" in extras["gpu"][0]  # the CUDA libraries as wheels too
    for name, requirements in extras.items():
        if name not in ("cpu", "gpu"):
            assert not _requirement_names(requirements) & {"onnxruntime", "onnxruntime-gpu"}, name


def test_the_readme_installs_the_cpu_build_and_shows_the_gpu_one():
    first, second = _readme_commands()[:2]
    assert "pip install -e '.[cpu]'" in first and "onnxcampo optimize" in first
    assert "pip install -q -e '.[cpu,test]'" in second and second.endswith("pytest -q")
    assert "pip install -e '.[gpu]'" in (ROOT / "README.md").read_text()


def test_ci_runs_the_readmes_second_command():
    """.ci/run holds the README's second command verbatim, as its last line."""
    last = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert last == _readme_commands()[1]


def test_license_and_metadata():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert any(c.startswith("Programming Language :: Python :: 3") for c in PROJECT["classifiers"])
    assert PROJECT["urls"]


def test_every_package_folder_ships():
    """Each folder with an ``__init__.py`` under the shipped trees is a listed package: one left
    out installs without it, and its importers fail only where the package is installed."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"onnxcampo": ROOT / "onnxcampo", **{name: ROOT / path for name, path in setuptools["package-dir"].items()}}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((name, *parts)))
    assert found - set(setuptools["packages"]) == set()
