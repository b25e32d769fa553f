"""The op tests need the built library: without it they fail (never skip) and say how to build it."""

from __future__ import annotations

import pytest

from onnxcampo import ops
from onnxcampo.errors import OpsLibraryError


@pytest.fixture
def library(monkeypatch) -> str:
    """The path of the built library (``$ONNXCAMPO_OPS_LIBRARY`` cleared)."""
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    try:
        return ops.check()
    except OpsLibraryError as exc:
        pytest.fail(f"{exc} (the README's set-up runs it)", pytrace=False)

