"""Shared test setup: ``tests/`` on the import path so tests can ``import helpers``."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Tests pin the cost model: the analytic one unless a test asks for a GPU's database (a machine
# with an H200 would otherwise pick the shipped database and change every cost decision).
import os  # noqa: E402

os.environ.setdefault("ONNXCAMPO_DEVICE", "none")
