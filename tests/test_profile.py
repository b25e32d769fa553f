"""Tests for onnxcampo.profile: measured per-node times on the CPU execution provider."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo import profile
from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.profile import MeasuredProfile, measure_node_times


def mlp(names=("mm", "add", "relu"), *, with_constant: bool = False) -> onnx.ModelProto:
    """MatMul(64x256 @ 256x256) + Add + Relu, dynamic batch; big enough to take measurable time."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("W", TensorProto.FLOAT, [256, 256],
                           rng.standard_normal(256 * 256).astype(np.float32))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name=names[0]),
             helper.make_node("Add", ["m", "B"], ["a"], name=names[1]),
             helper.make_node("Relu", ["a"], ["y"], name=names[2])]
    inits = []
    if with_constant:
        nodes.insert(0, helper.make_node(
            "Constant", [], ["B"], name="bias",
            value=helper.make_tensor("b", TensorProto.FLOAT, [256], np.ones(256, np.float32))))
    else:
        inits.append(helper.make_tensor("B", TensorProto.FLOAT, [256], np.ones(256, np.float32)))
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 256])],
        [w, *inits],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


FEEDS = {"x": np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)}


def test_measure_node_times_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="onnxcampo.profile"):
        prof = measure_node_times(mlp(), feeds=FEEDS, warmup=2, runs=5)
    assert isinstance(prof, MeasuredProfile) and prof.provider == "cpu"
    assert set(prof.node_us) == {"mm", "add", "relu"}
    assert all(t > 0 for t in prof.node_us.values())
    assert prof.node_sum_us == pytest.approx(sum(prof.node_us.values()))
    assert prof.node_sum_us > 0 and prof.run_us > 0
    # Kernels run inside session.run: their sum cannot exceed the wall time by much (medians
    # of different quantities, so allow some slack).
    assert prof.node_sum_us <= 1.5 * prof.run_us
    assert prof.node_us["mm"] > prof.node_us["relu"]  # 4M MACs vs 16K elementwise ops
    assert prof.unmatched == () and prof.absent == ()
    assert "node times sum to" in caplog.text and "us run" in caplog.text


def test_warmup_runs_are_dropped(monkeypatch):
    """Only the timed runs' events are counted: their number equals ``runs``."""
    seen = {}
    real = profile._per_run_times

    def spy(events, windows):
        per_run = real(events, windows)
        seen["windows"] = windows
        seen["per_run"] = per_run
        return per_run

    monkeypatch.setattr(profile, "_per_run_times", spy)
    measure_node_times(mlp(), feeds=FEEDS, warmup=3, runs=4)
    assert len(seen["windows"]) == 4
    # every timed run saw each node exactly once
    assert all(set(run) == {"mm", "add", "relu"} for run in seen["per_run"])
    starts = [s for s, _ in seen["windows"]]
    assert starts == sorted(starts)


def test_per_run_times_assigns_events_by_window():
    """ORT writes the model_run event after its nodes; assignment must use time windows."""
    events = [
        {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 5},
        {"cat": "Session", "name": "model_run", "ts": 5, "dur": 20},
        {"cat": "Node", "name": "a_kernel_time", "ts": 40, "dur": 7},
        {"cat": "Node", "name": "a_fence_before", "ts": 41, "dur": 100},
        {"cat": "Node", "name": "b_kernel_time", "ts": 50, "dur": 3},
        {"cat": "Session", "name": "model_run", "ts": 35, "dur": 30},
    ]
    windows = profile._run_windows(events, warmup=1, runs=1)
    assert windows == [(35, 65)]
    per_run = profile._per_run_times(events, windows)
    assert per_run == [{"a": 7.0, "b": 3.0}]


def test_too_few_runs_in_trace():
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 1}]
    with pytest.raises(CampoError, match="recorded 1 runs, expected 3"):
        profile._run_windows(events, warmup=1, runs=2)


def test_constant_node_is_absent_with_zero_time():
    prof = measure_node_times(mlp(with_constant=True), feeds=FEEDS, warmup=1, runs=2)
    assert prof.absent == ("bias",)
    assert prof.node_us["bias"] == 0.0
    assert all(prof.node_us[n] > 0 for n in ("mm", "add", "relu"))


@pytest.mark.parametrize("names, pattern", [
    (("mm", "", "relu"), "name"),
    (("mm", "mm", "relu"), r"duplicated: \['mm'\]"),
])
def test_node_names_must_be_unique_and_non_empty(names, pattern):
    with pytest.raises(CampoError, match=pattern):
        measure_node_times(mlp(names), feeds=FEEDS)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="runs >= 1"):
        measure_node_times(mlp(), feeds=FEEDS, runs=0)
    with pytest.raises(ConfigError, match=r"missing \['x'\]"):
        measure_node_times(mlp(), feeds={})
    with pytest.raises(ConfigError, match="unknown provider"):
        measure_node_times(mlp(), feeds=FEEDS, provider="rocm")


def test_profile_file_is_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(profile.tempfile, "tempdir", str(tmp_path))
    measure_node_times(mlp(), feeds=FEEDS, warmup=0, runs=1)
    assert list(tmp_path.iterdir()) == []
