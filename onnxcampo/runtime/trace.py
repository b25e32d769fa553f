"""ONNX Runtime's profiler trace (Chrome trace format), read the same way by every caller.

ORT writes an event when it ends, so a run's node events come before its ``model_run`` event in
the file: runs are found by time window (the ``Session``/``model_run`` events), not by file
order. A kernel's time is a ``Node`` event named ``<node name>_kernel_time``.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["KERNEL_SUFFIX", "is_kernel_event", "read_events", "run_windows"]

KERNEL_SUFFIX = "_kernel_time"


def read_events(trace: str | os.PathLike | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of a trace: the path of ORT's JSON file (a bare list, or a dict with
    ``traceEvents``), or the list of events itself."""
    if isinstance(trace, list):
        return trace
    with open(trace, encoding="utf-8") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def run_windows(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(start, end) in trace microseconds of every run (``model_run`` event), in time order."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    return [(int(e["ts"]), int(e["ts"]) + int(e["dur"])) for e in runs]


def is_kernel_event(event: dict[str, Any]) -> bool:
    """A node's kernel time (the node's name is the event's name without :data:`KERNEL_SUFFIX`)."""
    return event.get("cat") == "Node" and event.get("name", "").endswith(KERNEL_SUFFIX)
