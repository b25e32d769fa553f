"""``onnxcampo.runtime.trace``: ORT profiler events, run windows and kernel events."""

from __future__ import annotations

import json

from onnxcampo.runtime import trace

EVENTS = [
    {"cat": "Node", "name": "mm_kernel_time", "ts": 15, "dur": 3},  # written before its run's event
    {"cat": "Session", "name": "model_run", "ts": 10, "dur": 10},
    {"cat": "Node", "name": "mm_fence_before", "ts": 12, "dur": 0},
    {"cat": "Session", "name": "model_run", "ts": 0, "dur": 5},
    {"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 1},
]


def test_a_trace_is_read_from_a_bare_list_a_trace_events_dict_or_the_events(tmp_path):
    bare, wrapped = tmp_path / "bare.json", tmp_path / "wrapped.json"
    bare.write_text(json.dumps(EVENTS))
    wrapped.write_text(json.dumps({"traceEvents": EVENTS}))
    assert trace.read_events(bare) == trace.read_events(str(wrapped)) == trace.read_events(EVENTS) == EVENTS


def test_runs_are_found_by_time_and_kernels_by_name():
    assert trace.run_windows(EVENTS) == [(0, 5), (10, 20)]
    assert [e["name"] for e in EVENTS if trace.is_kernel_event(e)] == ["mm_kernel_time"]
