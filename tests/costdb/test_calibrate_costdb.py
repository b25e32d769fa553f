"""``costdb calibrate`` and the cost model a GPU gets: the calibrated database (per user, keyed
by GPU and versions), the shipped one, or the analytic model of the GPU's own specs; the
calibration's budget, resumption and interruption, run on ONNX Runtime's CPU provider (the
command's wiring: the times are the CPU's)."""

from __future__ import annotations

import json

import pytest

from onnxcampo.cli import main
from onnxcampo.costdb import calibrate, device, select
from onnxcampo.costdb.analytic import H200, AnalyticCostModel
from onnxcampo.costdb.measure import Case
from onnxcampo.costdb.regression import RegressionCostModel
from onnxcampo.errors import CostModelError
from onnxcampo.rewrites import layout

H100 = device.GpuSpec(name="NVIDIA H100 80GB HBM3", compute_capability="9.0", multiprocessors=132,
                      sm_clock_mhz=1980.0, memory_clock_mhz=2619.0, bus_width_bits=5120, memory_mb=81559)


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("ONNXCAMPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ONNXCAMPO_DEVICE", raising=False)
    select.detected_gpu.cache_clear()
    select._say_once.cache_clear()
    yield
    select.detected_gpu.cache_clear()
    select._say_once.cache_clear()


def _gpu(monkeypatch, spec: device.GpuSpec | None) -> None:
    monkeypatch.setattr(select, "gpu_spec", lambda: spec)
    select.detected_gpu.cache_clear()


# --- the analytic model of the GPU's own specs -------------------------------------------------

def test_peaks_of_the_reference_gpu_reproduce_its_model():
    # the H200's SMs and clock, and a memory whose peak is the 4.8 TB/s the shares were taken on
    h200 = device.GpuSpec(name="NVIDIA H200", compute_capability="9.0", multiprocessors=132, sm_clock_mhz=1980.0,
                          memory_clock_mhz=4.8e12 / (2 * 768) / 1e6, bus_width_bits=6144)
    peaks = device.peaks_for(h200)
    for field in ("tf32_flops", "fp32_flops", "fp16_tc_flops", "fp16_unaligned_flops", "half_rate_flops", "bandwidth"):
        assert getattr(peaks, field) == pytest.approx(getattr(H200, field), rel=1e-9), field


def test_peaks_follow_the_gpu():
    h100 = device.peaks_for(H100)
    assert h100.bandwidth == pytest.approx(2 * 2619e6 * 640 * device.EFFICIENCY["bandwidth"])
    assert h100.bandwidth < H200.bandwidth  # 3.35 TB/s against 4.8
    a100 = device.peaks_for(device.GpuSpec(name="NVIDIA A100-SXM4-80GB", compute_capability="8.0",
                                           multiprocessors=108, sm_clock_mhz=1410.0, memory_clock_mhz=1593.0,
                                           bus_width_bits=5120))
    assert a100.fp16_tc_flops == pytest.approx(108 * 1410e6 * 2048 * device.EFFICIENCY["fp16_tc"])
    assert a100.tf32_flops == pytest.approx(a100.fp16_tc_flops / 2 * device.EFFICIENCY["tf32"]
                                            / device.EFFICIENCY["fp16_tc"])
    turing = device.peaks_for(device.GpuSpec(name="Tesla T4", compute_capability="7.5", multiprocessors=40,
                                             sm_clock_mhz=1590.0, memory_clock_mhz=5001.0, bus_width_bits=256))
    assert turing.tf32_flops == pytest.approx(turing.fp32_flops)  # no TF32 before compute capability 8.0


def test_no_peaks_without_what_they_need():
    assert device.peaks_for(device.GpuSpec(name="x", compute_capability="9.0", source="nvidia-smi")) is None
    pascal = device.GpuSpec(name="Tesla P100", compute_capability="6.0", multiprocessors=56, sm_clock_mhz=1480.0,
                            memory_clock_mhz=715.0, bus_width_bits=4096)
    assert device.peaks_for(pascal) is None


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onnxcampo.costdb.select" and r.levelname == "WARNING"]


def test_a_gpu_without_a_database_gets_its_own_specs_and_one_line(monkeypatch, caplog):
    _gpu(monkeypatch, device.GpuSpec(**{**H100.to_json(), "name": "NVIDIA L40S"}))
    first = select.load_cost_model()
    second = select.load_cost_model()
    assert isinstance(first, AnalyticCostModel) and first.peaks.name.startswith("NVIDIA L40S")
    assert first.origin["source"] == "analytic-spec" and second.origin["source"] == "analytic-spec"
    said = _warnings(caplog)
    assert len(said) == 1, said  # said once per process
    err = said[0]
    assert "uncalibrated" in err and "onnxcampo costdb calibrate" in err and "NVIDIA L40S" in err


def test_no_gpu_plans_for_the_reference_silently(monkeypatch, caplog):
    _gpu(monkeypatch, None)
    model = select.load_cost_model()
    assert isinstance(model, AnalyticCostModel) and model.peaks == H200
    assert model.origin["source"] == "analytic-reference"
    assert _warnings(caplog) == []


# --- the databases: calibrated, shipped ---------------------------------------------------------

def _database(name: str, date: str = "2026-12-01") -> dict:
    database = json.loads((select.DATA / "nvidia-h200.json").read_text())
    database["device"] = {**database["device"], "name": name, "date": date}
    return database


def test_the_calibrated_database_wins_over_the_shipped_one(monkeypatch):
    _gpu(monkeypatch, device.GpuSpec(**{**H100.to_json(), "name": "NVIDIA H200"}))
    assert select.load_cost_model().origin["source"] == "shipped"
    path = select.user_database_path("NVIDIA H200")
    assert "nvidia-h200--ort-" in path.name and path.parent.parent.name == "cache"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_database("NVIDIA H200", "2026-12-05")))
    model = select.load_cost_model()
    assert isinstance(model, RegressionCostModel)
    assert model.origin["source"] == "calibrated" and model.origin["path"] == str(path)
    assert model.origin["measured"] == "2026-12-05" and model.origin["age_days"] >= 0
    assert model.describe()["origin"]["source"] == "calibrated"
    assert select.load_cost_model(select.DATA / "nvidia-h200.json").origin["source"] == "--device-db"


def test_the_database_is_keyed_by_the_runtime_versions(monkeypatch):
    monkeypatch.setattr(select, "runtime_versions", lambda: ("1.31.1", "13.0"))
    one = select.user_database_path("NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(select, "runtime_versions", lambda: ("1.32.0", "13.0"))
    assert select.user_database_path("NVIDIA H100 80GB HBM3") != one
    assert one.name == "nvidia-h100-80gb-hbm3--ort-1-31-1--cuda-13-0.json"


def test_a_corrupt_calibrated_database_is_reported_and_ignored(monkeypatch, caplog):
    _gpu(monkeypatch, device.GpuSpec(**{**H100.to_json(), "name": "NVIDIA H200"}))
    path = select.user_database_path("NVIDIA H200")
    path.parent.mkdir(parents=True)
    path.write_text('{"schema_version": 1, "device": ')
    model = select.load_cost_model()
    assert model.origin["source"] == "shipped"
    err = " ".join(_warnings(caplog))
    assert "ignoring the calibrated cost database" in err and str(path) in err


def test_the_shipped_h100_database_is_picked_for_an_h100(monkeypatch):
    _gpu(monkeypatch, H100)
    if select.shipped_database(H100.name) is None:
        pytest.skip("no database shipped for the H100 in this checkout")
    model = select.load_cost_model()
    assert model.origin["source"] == "shipped" and model.database["device"]["name"] == H100.name


def test_a_database_with_a_spec_falls_back_to_that_gpu():
    database = _database(H100.name)
    database["device"]["spec"] = H100.to_json()
    model = RegressionCostModel(database)
    assert model.fallback.peaks == device.peaks_for(H100)
    assert RegressionCostModel(_database("NVIDIA H200")).fallback.peaks == H200


# --- the calibration run (CPU provider: the wiring) ---------------------------------------------

GRID = ([Case("Cast", ((n,),), tag=tag) for n in (1000, 4000, 16000, 64000) for tag in ("to_fp16", "to_fp32")]
        + [Case("Add", ((n, 64), (n, 64))) for n in (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)])
SAMPLES = len(calibrate._tf32_only(GRID))  # Casts one each, the Adds fp32 and fp16


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(calibrate, "_check_here", lambda provider: H100)
    from onnxcampo.costdb import measure

    original = measure.Timer

    def quick(provider, **kw):
        return original(provider, warmup=1, runs=3, min_seconds=0.0)

    monkeypatch.setattr(measure, "Timer", quick)


def _run(tmp_path, **kw):
    lines = []
    result = calibrate.calibrate(out=tmp_path / "db.json", grid=GRID, chains=[], fused=False, provider="cpu",
                                 say=lines.append, **kw)
    return result, lines


@pytest.mark.slow
def test_calibrate_measures_fits_and_resumes(on_cpu, tmp_path):
    result, lines = _run(tmp_path)
    assert result.complete and result.measured == SAMPLES and result.database is not None
    written = json.loads((tmp_path / "db.json").read_text())
    assert written["device"]["spec"] == H100.to_json() and written["device"]["name"] == H100.name
    assert written["calibration"]["cases_left"] == 0 and "Add" in written["ops"]
    assert RegressionCostModel.load(tmp_path / "db.json").fallback.peaks == device.peaks_for(H100)
    assert "wrote" in lines[-1] and "held-out error" in lines[-1]
    again, _ = _run(tmp_path)
    assert again.measured == 0 and again.complete  # everything measured is kept


@pytest.mark.slow
def test_calibrate_stops_at_its_budget_and_resumes(on_cpu, tmp_path):
    result, lines = _run(tmp_path, budget_s=1e-6)
    assert result.measured == 1 and result.cases_left == SAMPLES - 1
    assert result.database is not None and result.database["calibration"]["cases_left"] == SAMPLES - 1
    assert "cases left" in lines[-1]
    rest, _ = _run(tmp_path)
    assert rest.measured == SAMPLES - 1 and rest.complete
    with pytest.raises(CostModelError, match="too few to fit"):  # no Cast measured yet: nothing to fit
        calibrate.calibrate(out=tmp_path / "adds.json", grid=GRID[8:], chains=[], fused=False, provider="cpu",
                            say=lines.append, budget_s=1e-6)


@pytest.mark.slow
def test_an_interrupted_calibration_keeps_its_samples(on_cpu, tmp_path, monkeypatch):
    from onnxcampo.costdb import measure

    real = measure.iter_samples

    def interrupted(*args, **kw):
        for count, sample in enumerate(real(*args, **kw)):
            if count == 3:
                raise KeyboardInterrupt
            yield sample

    monkeypatch.setattr(measure, "iter_samples", interrupted)
    result, lines = _run(tmp_path)
    assert result.database is None and result.measured == 3 and not (tmp_path / "db.json").exists()
    assert "interrupted" in lines[-1] and "again to resume" in lines[-1]
    # a write cut by the interruption: the incomplete last line is dropped when the file is read again
    with (tmp_path / "db.jsonl").open("a") as sink:
        sink.write('{"key": "Cast|in=')
    monkeypatch.setattr(measure, "iter_samples", real)
    rest, _ = _run(tmp_path)
    assert rest.measured == SAMPLES - 3 and rest.complete


def test_calibrate_without_cuda_is_one_line(capsys):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    assert main(["costdb", "calibrate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA execution provider" in err and "Traceback" not in err


def test_host_entries_from_probe_rows():
    rows = [{"kind": "host", "class": "other", "us_per_launch": 3.21},
            {"kind": "host", "class": "conv", "us_per_launch": 7.5},
            {"kind": "host", "class": "conv_fp16", "us_per_launch": 9.25},
            {"kind": "host", "class": "run", "replayed_us": 12.0}]
    entries = calibrate.host_entries(rows)
    assert entries["host_launch"]["inference"]["other"] == 3.21
    assert entries["host_launch"]["inference"]["conv"] == 7.5
    assert entries["host_launch"]["inference"]["conv_fp16"] == 9.25
    assert entries["host_launch"]["inference"]["host"] == "additive"
    assert entries["run_overhead"]["us"] == 12.0
    assert calibrate.host_entries([]) == {}


def test_fused_entry_fits_bandwidth_and_fixed_cost():
    rows = [{"kind": "fused_elementwise", "bytes": b, "time_us": 2.0 + b / 3e6} for b in (1e5, 1e6, 1e7, 1e8)]
    entry = calibrate.fused_entry(rows)
    assert entry["bytes_per_us"] == pytest.approx(3e6, rel=1e-6) and entry["fixed_us"] == pytest.approx(2.0, abs=1e-3)
    assert calibrate.fused_entry(rows[:2]) is None


@pytest.mark.parametrize("kind", ["other", "conv", "conv_fp16", "conv_nhwc", "conv_nhwc_graph", "custom"])
def test_host_probe_chains_run(kind):
    """The host probes' chains are valid models that compute what they should (ORT's CPU
    provider, the library's CPU kernels for its ops: the wiring; the timing needs CUDA graphs)."""
    import numpy as np

    from onnxcampo import ops
    from onnxcampo.runtime import make_session

    if kind in calibrate.LIBRARY_HOST_CLASSES and not ops.available():
        pytest.skip("the custom-op library is not built")
    model, feeds = calibrate._chain_model(kind, 3)
    (out,) = make_session(model).run(None, feeds)
    expected = feeds["t0"] + (3e-3 if kind == "other" else 0.0)  # C channels x 1 / C: the convolutions keep ones
    np.testing.assert_allclose(out.astype(np.float32), expected.astype(np.float32), rtol=1e-3)


def _host_model(**per_launch):
    """A cost model of the H100 whose database has host rows of these classes (us a launch)."""
    database = _database(H100.name)
    database.update(calibrate.host_entries([{"kind": "host", "class": kind, "us_per_launch": us}
                                            for kind, us in per_launch.items()]))
    return RegressionCostModel(database)


def test_library_host_costs_reach_the_estimate(monkeypatch):
    monkeypatch.delenv("ONNXCAMPO_CUDNN_API", raising=False)
    model = _host_model(other=3.0, conv_nhwc=11.5, custom=4.5)
    assert model.library_launch_us("conv_nhwc") == 11.5 and model.library_launch_us("custom") == 4.5
    assert layout.nhwc_call_us(model) == 11.5
    assert layout.nhwc_call_us(AnalyticCostModel()) == layout.CONV_NHWC_HOST_US


def test_the_nhwc_call_is_priced_for_the_cudnn_api_in_use(monkeypatch):
    """The legacy calls and cuDNN's graph API are measured apart (``conv_nhwc``, ``conv_nhwc_graph``:
    the class calibrate measures follows ONNXCAMPO_CUDNN_API), and a plan prices the API its
    sessions will use; the graph API unmeasured costs what ORT's Conv launch does."""
    monkeypatch.delenv("ONNXCAMPO_CUDNN_API", raising=False)
    assert calibrate.library_host_classes() == ("conv_nhwc", "custom")
    legacy_only = _host_model(other=3.0, conv=5.0, conv_nhwc=119.0)
    both = _host_model(other=3.0, conv=5.0, conv_nhwc=119.0, conv_nhwc_graph=7.5)
    assert layout.nhwc_call_us(legacy_only) == layout.nhwc_call_us(both) == 119.0
    monkeypatch.setenv("ONNXCAMPO_CUDNN_API", "graph")
    assert calibrate.library_host_classes() == ("conv_nhwc_graph", "custom")
    assert layout.nhwc_call_us(legacy_only) == 5.0  # unmeasured: an ORT Conv launch
    assert layout.nhwc_call_us(both) == 7.5
    monkeypatch.setenv("ONNXCAMPO_CUDNN_API", "legacy")
    assert layout.nhwc_call_us(both) == 119.0


def test_the_roofline_of_a_detected_gpu_counts_the_host(monkeypatch):
    """A detected GPU's uncalibrated model prices launches (the typical host's figures); the
    reference model used without a GPU keeps none (its plans are unchanged)."""
    from onnxcampo.costdb.analytic import TYPICAL_HOST

    _gpu(monkeypatch, device.GpuSpec(**{**H100.to_json(), "name": "NVIDIA L40S"}))
    model = select.load_cost_model()
    assert model.launch_us("conv") == TYPICAL_HOST.conv_us and model.launch_us("other") == TYPICAL_HOST.other_us
    assert model.host_adds() and model.run_us() == TYPICAL_HOST.run_us
    reference = AnalyticCostModel()
    assert reference.launch_us("conv") == 0.0 and not reference.host_adds() and reference.run_us() == 0.0


def test_a_measured_custom_op_call_adds_its_extra_host_time():
    from onnxcampo import estimate

    database = _database(H100.name)
    database["host_launch"] = {"inference": {"conv": 8.0, "other": 3.0, "host": "additive", "custom": 4.5}}
    model = RegressionCostModel(database)
    assert estimate.fused_call_extra_us(model) == pytest.approx(1.5)
    assert estimate.fused_call_extra_us(model, training=True) == 0.0
    assert estimate.fused_call_extra_us(AnalyticCostModel()) == 0.0
