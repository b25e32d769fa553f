"""``onnxcampo bench``: policies optimized, timed side by side in rotation, compared with fp32.

On the CPU provider these tests check the wiring only (the table, the JSON layout, the errors):
ORT's CPU EP hides fp16's rounding and its times say nothing about a GPU's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.bench import bench, parse_policies
from onnxcampo.cli import main
from onnxcampo.config import ExperimentalOptions
from onnxcampo.errors import ConfigError

FAST = ["--provider", "cpu", "--rounds", "2", "--block-ms", "2"]


@pytest.fixture(autouse=True)
def _quiet_loggers():
    """main() turns the bench's progress loggers on; later tests must not log to a closed capsys stream."""
    yield
    for name in ("onnxcampo.bench", "onnxcampo.runtime.timing"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def mlp(batch: str | int = "batch") -> onnx.ModelProto:
    """x[batch, 32] -> MatMul -> Relu -> MatMul -> y[batch, 16]."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 24)) * 0.2).astype(np.float32), "w0"),
             numpy_helper.from_array((rng.standard_normal((24, 16)) * 0.2).astype(np.float32), "w1")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"), helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("MatMul", ["a", "w1"], ["y"], name="mm1")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("onnxcampo: error:") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
def test_bench_two_policies_prints_the_table_and_writes_the_json(model_path, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code, table, err = run_cli(capsys, "bench", model_path, "--policies", "fp32,fp16", "--dim", "batch=8",
                               "--json", out, *FAST)
    assert code == 0, err
    header, columns, *rows = table.strip().splitlines()
    assert "cpu, plain, 2 rounds" in header
    assert columns.split() == ["policy", "median", "ms", "spread", "(min-max)", "vs", "fp32", "rel", "err", "Casts"]
    assert [row.split()[0] for row in rows] == ["fp32", "fp16"]
    assert "round 2 of 2" in err and "optimizing under fp16" in err and f"wrote {out}" in err  # progress on stderr
    written = json.loads(out.read_text())
    assert (written["provider"], written["execution"], written["reference"]) == ("cpu", "plain", "fp32")
    assert written["rounds"] == 2 and written["block_ms"] == 2.0 and written["inputs"] == "random"
    assert written["dim_values"] == {"batch": 8}
    assert list(written["policies"]) == ["fp32", "fp16"]
    fp32, fp16 = written["policies"]["fp32"], written["policies"]["fp16"]
    for row in (fp32, fp16):
        assert len(row["blocks_ms"]) == 2 and row["min_ms"] <= row["ms"] <= row["max_ms"]
        assert row["runs_per_block"] >= 1 and row["within_tolerance"]
    assert fp32["rel_err"] == 0.0 and fp32["speedup"] == 1.0 and fp32["casts"] == 0
    assert 0 < fp16["rel_err"] < 0.02 and fp16["casts"] == 2 and fp16["nodes_fp16"] == 3
    assert fp16["speedup"] == pytest.approx(fp32["ms"] / fp16["ms"], rel=1e-3)


def test_fp32_is_always_timed_as_the_reference():
    assert parse_policies("fp16") == ("fp32", "fp16")
    assert parse_policies("campo, fp32,campo") == ("fp32", "campo")
    with pytest.raises(ConfigError, match="--policies is empty"):
        parse_policies(" , ")


@pytest.mark.slow
def test_bench_from_python_on_given_inputs_pins_their_shapes():
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    result = bench(mlp(), policies=["campo"], provider="cpu", inputs={"x": x}, rounds=1, block_ms=1.0)
    assert list(result.policies) == ["fp32", "campo"] and result.input_shapes == {"x": (4, 32)}
    assert result.policies["campo"].ms > 0 and result.policies["campo"].rel_err is not None
    assert result.to_json()["policies"]["campo"]["chosen_plan"] in ("campo", "fp32", "amp")


@pytest.mark.slow
def test_bench_inputs_from_an_npz(model_path, tmp_path, capsys):
    np.savez(tmp_path / "x.npz", x=np.ones((3, 32), np.float32))
    out = tmp_path / "b.json"
    code, _, err = run_cli(capsys, "bench", model_path, "--policies", "amp", "--inputs", tmp_path / "x.npz",
                           "--json", out, *FAST)
    assert code == 0, err
    assert json.loads(out.read_text())["inputs"] == str(tmp_path / "x.npz")
    np.savez(tmp_path / "bad.npz", z=np.ones((3, 32), np.float32))
    code, _, err = run_cli(capsys, "bench", model_path, "--inputs", tmp_path / "bad.npz", *FAST)
    assert code == 2
    assert_one_line_error(err, "unknown input name(s) ['z']")


def test_bad_policy_name_is_one_line(model_path, capsys):
    code, out, err = run_cli(capsys, "bench", model_path, "--policies", "fp32,fp8", *FAST)
    assert code == 2 and out == ""
    assert_one_line_error(err, "unknown policy 'fp8'", "campo, amp, fp16, fp32")


def test_cuda_graph_on_the_cpu_provider_is_a_clear_error(model_path, tmp_path, capsys):
    out = tmp_path / "b.json"
    code, _, err = run_cli(capsys, "bench", model_path, "--execution", "cuda-graph", "--dim", "batch=2",
                           "--json", out, *FAST)
    assert code == 2
    assert_one_line_error(err, "--execution cuda-graph needs --provider cuda")
    assert not out.exists()


def test_dynamic_dims_left_open_and_bad_numbers_are_one_line(model_path, capsys):
    code, _, err = run_cli(capsys, "bench", model_path, *FAST)
    assert code == 2
    assert_one_line_error(err, "dynamic dim 'batch'", "--dim batch=N")
    code, _, err = run_cli(capsys, "bench", model_path, "--dim", "batch=2", "--provider", "cpu", "--rounds", "0")
    assert code == 2
    assert_one_line_error(err, "--rounds >= 1")


@pytest.mark.slow
def test_plan_options_reach_every_policys_optimize(model_path, tmp_path, capsys, monkeypatch):
    """--device-db, --fuse and --experimental are optimize's options: every policy is
    optimized with them (fp32, the reference, too), and the JSON says which were used."""
    import onnxcampo.api

    real, seen = onnxcampo.api.optimize, {}

    def spy(model, *, config=None, accuracy="report", **options):
        assert accuracy == "off"  # bench compares the outputs itself
        result = real(model, config=config, accuracy=accuracy, **options)
        seen[options["policy"]] = (config.replace(**options), result.report)
        return result

    monkeypatch.setattr(onnxcampo.api, "optimize", spy)
    database = Path(onnxcampo.api.__file__).parents[1] / "costdb" / "data" / "nvidia-h200.json"
    out = tmp_path / "bench.json"
    code, _, err = run_cli(capsys, "bench", model_path, "--policies", "fp16,amp,campo", "--dim", "batch=8",
                           "--device-db", database, "--experimental", "pad_tensor_cores=false",
                           "--experimental", "cost_graph=onnx", "--fuse", "none",
                           "--json", out, *FAST)
    assert code == 0, err
    assert list(seen) == ["fp32", "fp16", "amp", "campo"]
    for policy, (config, report) in seen.items():
        assert (config.device_db, config.experimental.pad_tensor_cores, config.experimental.cost_graph,
                config.fuse) == (database, False, "onnx", "none"), policy
        assert report["cost_model"]["kind"] == "regression" and report["cost_graph"] == "onnx", policy
    assert json.loads(out.read_text())["plan_options"] == {
        "device_db": str(database), "fuse": "none",
        "experimental": {"pad_tensor_cores": False, "cost_graph": "onnx"}}


@pytest.mark.slow
def test_plan_options_default_as_optimize_has_them(model_path, capsys, monkeypatch):
    import onnxcampo.api

    real, seen = onnxcampo.api.optimize, []
    monkeypatch.setattr(onnxcampo.api, "optimize",
                        lambda model, *, config=None, accuracy="report", **options: seen.append(
                            config.replace(**options)) or real(model, config=config, accuracy=accuracy, **options))
    code, _, err = run_cli(capsys, "bench", model_path, "--policies", "fp16", "--dim", "batch=2", *FAST)
    assert code == 0, err
    assert [(c.device_db, c.experimental, c.fuse) for c in seen] == [(None, ExperimentalOptions(), "auto")] * 2


def test_a_missing_device_db_is_one_line(model_path, tmp_path, capsys):
    code, out, err = run_cli(capsys, "bench", model_path, "--dim", "batch=2", "--device-db", tmp_path / "none.json",
                             *FAST)
    assert code == 2 and out == ""
    assert_one_line_error(err, "none.json")
