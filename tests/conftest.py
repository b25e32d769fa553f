"""Shared test setup. ``tests/`` is on the import path through pytest's ``pythonpath`` option
(pyproject.toml), so tests can ``import helpers``; the benchmarks are ``onnxcampo.benchmarks``."""

from __future__ import annotations

# Tests pin the cost model: the analytic one unless a test asks for a GPU's database (a machine
# with an H200 would otherwise pick the shipped database and change every cost decision).
import os

os.environ.setdefault("ONNXCAMPO_DEVICE", "none")

import pytest  # noqa: E402


@pytest.fixture
def library(monkeypatch) -> str:
    """The path of the built custom-op library (``$ONNXCAMPO_OPS_LIBRARY`` cleared): a test that
    needs it fails (never skips) without it, and says how to build it."""
    from onnxcampo import ops
    from onnxcampo.errors import OpsLibraryError

    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    try:
        return ops.check()
    except OpsLibraryError as exc:
        pytest.fail(f"{exc} (the README's set-up runs it)", pytrace=False)
