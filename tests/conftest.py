"""Shared test setup. ``tests/`` and ``scripts/`` are on the import path through pytest's
``pythonpath`` option (pyproject.toml), so tests can ``import helpers`` and the harness."""

from __future__ import annotations

# Tests pin the cost model: the analytic one unless a test asks for a GPU's database (a machine
# with an H200 would otherwise pick the shipped database and change every cost decision).
import os

os.environ.setdefault("ONNXCAMPO_DEVICE", "none")
