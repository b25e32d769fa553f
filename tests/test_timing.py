"""``onnxcampo.runtime.timing``: the bound runner and the timing in rotation.

On the CPU provider these tests check the wiring only (binding, in-place updates, the rotation
order, the errors): ORT's CPU EP has no CUDA graphs, and its timings say nothing about a GPU's.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import profile, runtime
from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.runtime import make_session, run, validate
from onnxcampo.runtime.timing import (BlockTimes, BoundRunner, bound_runner, run_once, runs_per_block,
                                      time_in_rotation)


def affine(shift: float = 0.0) -> onnx.ModelProto:
    """y = Relu(x @ W + shift), x of shape [2, 4]."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10, "W")
    b = numpy_helper.from_array(np.full(3, shift, np.float32), "B")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"), helper.make_node("Add", ["h", "B"], ["a"], name="add"),
         helper.make_node("Relu", ["a"], ["y"], name="relu")], "affine",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


X = np.arange(8, dtype=np.float32).reshape(2, 4) - 3


def test_bound_runner_gives_the_plain_run_outputs_and_takes_new_inputs_in_place():
    session = make_session(affine())
    caller = X.copy()
    runner = BoundRunner(session, {"x": caller}, "cpu")
    assert runner() > 0
    np.testing.assert_allclose(runner.outputs()["y"], run(session, {"x": X})["y"])
    runner.update({"x": -X})
    runner()
    np.testing.assert_allclose(runner.outputs()["y"], run(session, {"x": -X})["y"])
    np.testing.assert_array_equal(caller, X)  # the runner binds its own copy, not the caller's array


def test_bound_runner_updates_keep_the_bound_shape_and_names():
    runner = BoundRunner(make_session(affine()), {"x": X}, "cpu")
    with pytest.raises(ConfigError, match=r"update: input 'x' is float32\[3, 4\] but was bound as float32\[2, 4\]"):
        runner.update({"x": np.zeros((3, 4), np.float32)})
    with pytest.raises(ConfigError, match="'z' is not a bound input"):
        runner.update({"z": X})
    with pytest.raises(ConfigError, match=r"missing \['x'\]"):
        BoundRunner(make_session(affine()), {}, "cpu")


def test_cuda_graph_replay_needs_the_cuda_provider():
    with pytest.raises(ConfigError, match="needs the cuda device"):
        BoundRunner(make_session(affine()), {"x": X}, "cpu", cuda_graph=True)
    with pytest.raises(ConfigError, match="execution cuda-graph needs provider cuda"):
        bound_runner(affine(), {"x": X}, provider="cpu", execution="cuda-graph")
    with pytest.raises(ConfigError, match="unknown execution mode"):
        run_once(affine(), {"x": X}, execution="replay")


def test_run_once_and_validate_on_the_cpu_run_plain():
    np.testing.assert_allclose(run_once(affine(), {"x": X})["y"], run(make_session(affine()), {"x": X})["y"])
    [check] = validate(affine(), affine(shift=1e-4), feeds={"x": X}, execution="cuda-graph")  # cpu: plain runs
    assert check.ok and 0 < check.error < 1e-3
    [check] = validate(affine(), affine(shift=1.0), feeds={"x": X})
    assert not check.ok and check.max_abs_err == pytest.approx(1.0)


def test_profile_keeps_its_old_names():
    assert profile.BoundRunner is BoundRunner and runtime.BoundRunner is BoundRunner
    assert profile.measure_latency(affine(), feeds={"x": X}, warmup=1, runs=3).runs == 3


def test_runs_per_block_fill_the_block():
    assert runs_per_block(0.001, 20.0) == 20
    assert runs_per_block(0.05, 20.0) == 1
    assert runs_per_block(0.0, 20.0) == 20000  # a run too fast to time counts as 1 us


def test_rotation_times_every_variant_each_round_in_a_rotated_order():
    """Three variants, three rounds: after the warm-up, round r starts with the r-th variant."""
    calls = []

    def variant(name: str):
        def once() -> None:
            calls.append(name)
            time.sleep(0.0002)
        return once

    timed = time_in_rotation({name: variant(name) for name in "abc"}, rounds=3, block_ms=1.0, warmup_s=0.0,
                             warmup_runs=2)
    visits = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert visits == list("abc") + list("abc") + list("bca") + list("cab")
    for name, result in timed.items():
        assert len(result.blocks_ms) == 3 and result.runs_per_block >= 1 and result.error is None
        assert result.min_ms <= result.median_ms <= result.max_ms


def test_fixed_runs_per_block_are_kept_and_need_no_warm_up():
    """per_block fixes the runs per block of the variants it names (the benchmark's rows set them);
    with no warm-up asked those variants run only in their blocks; the others are set as before."""
    calls = {"a": 0, "b": 0}

    def variant(name: str):
        def once() -> None:
            calls[name] += 1
        return once

    timed = time_in_rotation({"a": variant("a"), "b": variant("b")}, rounds=2, block_ms=0.5, warmup_s=0.0,
                             warmup_runs=1, per_block={"a": 7})
    assert timed["a"].runs_per_block == 7 and calls["a"] == 1 + 2 * 7
    assert timed["b"].runs_per_block >= 1 and len(timed["b"].blocks_ms) == 2
    timed = time_in_rotation({"a": variant("a")}, rounds=1, warmup_s=0.0, warmup_runs=0, per_block={"a": 3})
    assert calls["a"] == 1 + 2 * 7 + 3 and timed["a"].blocks_ms


def test_a_failing_variant_is_dropped_with_its_error_and_the_others_go_on():
    state = {"runs": 0}

    def flaky() -> None:
        state["runs"] += 1
        if state["runs"] > 3:
            raise CampoError("ONNX Runtime failed to run the model: out of memory")

    timed = time_in_rotation({"good": lambda: None, "flaky": flaky}, rounds=2, block_ms=0.5, warmup_s=0.0,
                             warmup_runs=3)
    assert timed["good"].error is None and len(timed["good"].blocks_ms) == 2
    assert "out of memory" in timed["flaky"].error and timed["flaky"].median_ms is None
    assert timed["flaky"].to_json() == {"error": timed["flaky"].error}
    with pytest.raises(ConfigError, match="rounds >= 1"):
        time_in_rotation({"good": lambda: None}, rounds=0)


def test_block_times_report_median_spread_and_blocks():
    times = BlockTimes("fp16", (1.0, 3.0, 2.0, 10.0), runs_per_block=5)
    row = times.to_json()
    assert row["ms"] == 2.5 and (row["min_ms"], row["max_ms"]) == (1.0, 10.0)
    assert (row["q1_ms"], row["q3_ms"]) == (1.75, 4.75) and row["blocks_ms"] == [1.0, 3.0, 2.0, 10.0]
    assert row["runs_per_block"] == 5


def test_a_run_that_queues_its_work_is_waited_for_inside_each_block_and_warm_up():
    """A run with ``sync()`` (queued GPU steps): each warm-up call and each block end with a wait,
    inside the clock, so a block does not leave work to the next variant's."""
    events = []

    class Queued:
        def __call__(self):
            events.append("run")

        def sync(self):
            events.append("sync")

    times = time_in_rotation({"queued": Queued()}, rounds=2, block_ms=1e-3, warmup_s=0, warmup_runs=2)
    assert times["queued"].error is None and len(times["queued"].blocks_ms) == 2
    assert events[:4] == ["run", "sync", "run", "sync"]  # warm-up: each call waited for
    blocks = "".join("r" if e == "run" else "s" for e in events[4:])
    assert blocks == "rs" * 2  # one run a block (1 ns blocks), then the wait
