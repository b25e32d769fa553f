"""What the GPU tests share: the ``gpu`` marker, the skip, the device and the results sink.

Every test under ``tests/gpu/`` is marked ``gpu`` and skips, with the reason, where a model written
here would not run the custom-op library's CUDA kernels: no CUDA execution provider in this
onnxruntime (onnxruntime-gpu has one), the library not built or built without nvcc, or no CUDA
device (:func:`onnxcampo.ops.missing_cuda_kernels`, then one CUDA session); with
``ONNXCAMPO_GPU_REQUIRED=1`` (a GPU machine's run) they fail instead. Tests that need
FusedElementwise's generated kernels ask for the ``generated_kernels`` fixture, which also skips
without NVRTC. On a GPU machine, from the repository root::

    ONNXCAMPO_GPU_RESULTS=results/ python -m pytest tests/gpu -m gpu

Fixtures:

- ``device`` (:class:`Device`): sessions through :func:`onnxcampo.runtime.make_session` (on CUDA
  with the CPU fallback off: a node without a CUDA kernel fails the session instead of running on
  the CPU unnoticed), bound runs (:class:`onnxcampo.runtime.timing.BoundRunner`, CUDA-graph replays
  included) and variants timed side by side (:func:`onnxcampo.runtime.timing.time_in_rotation`,
  plus the GPU kernel time a run as CUPTI sees it where torch is installed);
- ``results``: ``results.record(**figures)`` keeps a test's measured figures; with
  ``ONNXCAMPO_GPU_RESULTS=DIR`` they are written as JSON to ``DIR/<test module>.json`` (one entry
  per test, rewritten after each record, so a run cut short keeps what it measured), with the
  onnxruntime version, the library's build and the GPU's name.

Timing tests record their figures and assert only what is stable: every variant ran and its times
are positive. ``ONNXCAMPO_GPU_TESTS_DEVICE=cpu`` runs the tests on ORT's CPU provider instead (the
library's CPU kernels; a CUDA-graph replay is then a plain run, and no CUPTI): a check of the tests
themselves on a machine without a GPU (``tests/test_gpu_tests.py`` runs the fast ones).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxcampo import ops
from onnxcampo.runtime import make_session, run
from onnxcampo.runtime.timing import BoundRunner, time_in_rotation

HERE = Path(__file__).resolve().parent
RESULTS_VAR = "ONNXCAMPO_GPU_RESULTS"
DEVICE_VAR = "ONNXCAMPO_GPU_TESTS_DEVICE"
REQUIRED_VAR = "ONNXCAMPO_GPU_REQUIRED"
NO_CPU_FALLBACK = {"session.disable_cpu_ep_fallback": "1"}


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


def _device_name() -> str:
    return os.environ.get(DEVICE_VAR) or "cuda"


def _why_not_here() -> str | None:
    """Why the CUDA kernels cannot run here, or None."""
    if _device_name() == "cpu":
        return None
    reason = ops.missing_cuda_kernels()
    if reason:
        return reason
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    try:
        make_session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
                     provider="cuda")
    except Exception as exc:  # noqa: BLE001 - any failure here is the reason to skip
        return f"no CUDA device answers: {exc}"
    return None


@pytest.fixture(scope="session")
def why_not_here() -> str | None:
    return _why_not_here()


@pytest.fixture(scope="session", autouse=True)  # session: before any module fixture runs on the device
def _skip_without_the_cuda_kernels(why_not_here):
    if why_not_here and os.environ.get(REQUIRED_VAR):
        pytest.fail(f"GPU test, ${REQUIRED_VAR} set: {why_not_here}", pytrace=False)
    if why_not_here:
        pytest.skip(f"GPU test: {why_not_here}")


@pytest.fixture
def generated_kernels():
    """Skips where FusedElementwise's generated kernels cannot run (NVRTC missing)."""
    if _device_name() == "cpu":
        return
    reason = ops.missing_cuda_kernels(generated=True)
    if reason and os.environ.get(REQUIRED_VAR):
        pytest.fail(f"GPU test, ${REQUIRED_VAR} set: {reason}", pytrace=False)
    if reason:
        pytest.skip(f"GPU test: {reason}")


class Device:
    """Sessions, bound runs and timings on the device under test (``name``: "cuda", or "cpu" for
    a check of the tests themselves)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def cuda(self) -> bool:
        return self.name == "cuda"

    def session(self, model: onnx.ModelProto | bytes, *, cuda_graph: bool = False, cpu_fallback: bool = False,
                **options):
        """A session of ``model`` on the device; ``cpu_fallback`` lets ORT place nodes without a
        CUDA kernel on the CPU (a graph around the op under test that needs it)."""
        config = None if cpu_fallback or not self.cuda else NO_CPU_FALLBACK
        return make_session(model, provider=self.name, cuda_graph=cuda_graph and self.cuda, session_config=config,
                            **options)

    def bound(self, model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray], *, cuda_graph: bool = False,
              cpu_fallback: bool = False, **options) -> BoundRunner:
        """``model`` run through IO binding, inputs copied to the device once; with ``cuda_graph``
        the first call captures the run and later calls replay it."""
        graph = cuda_graph and self.cuda
        session = self.session(model, cuda_graph=graph, cpu_fallback=cpu_fallback, **options)
        return BoundRunner(session, feeds, self.name, cuda_graph=graph)

    def run(self, model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray], *, cuda_graph: bool = False,
            replays: int = 3, cpu_fallback: bool = False) -> dict[str, np.ndarray]:
        """The outputs of one bound run; with ``cuda_graph`` those after the capture and
        ``replays`` replays (a replay that piles up state shows there)."""
        runner = self.bound(model, feeds, cuda_graph=cuda_graph, cpu_fallback=cpu_fallback)
        for _ in range(1 + (replays if runner.cuda_graph else 0)):
            runner()
        return runner.outputs()

    @staticmethod
    def cpu(model: onnx.ModelProto | bytes, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The outputs of the library's CPU kernels (ORT's CPU provider)."""
        return run(make_session(model), feeds)

    def time(self, runs: Mapping[str, object], *, rounds: int = 10, block_ms: float = 20.0,
             cupti_runs: int = 10) -> dict[str, dict]:
        """``runs`` (name -> a call, e.g. a BoundRunner) timed side by side in rotation: per name
        the median ms a call and the block means, and on CUDA the GPU kernel time a call and its
        launches as CUPTI sees them (None without torch). Asserts that every variant ran and
        took a positive time: the stable part of a timing."""
        from onnxcampo.runtime.standalone import gpu_time_per_call

        timed = time_in_rotation(runs, rounds=rounds, block_ms=block_ms)
        figures = {}
        for name, times in timed.items():
            assert times.error is None, f"{name} failed while timed: {times.error}"
            assert times.median_ms > 0, name
            figures[name] = times.to_json()
            if self.cuda:
                gpu = gpu_time_per_call(runs[name], cupti_runs)
                figures[name]["gpu_ms"] = None if gpu is None else gpu["total_ms"]
                figures[name]["launches"] = None if gpu is None else gpu["launches"]
        return figures


@pytest.fixture(scope="session")
def device(why_not_here) -> Device:
    return Device(_device_name())


def _environment() -> dict:
    import onnxruntime as ort

    found = {"onnxruntime": ort.__version__, "device": _device_name()}
    try:
        found["library"] = ops.build_info()
    except Exception as exc:  # noqa: BLE001 - the figures still count without it
        found["library"] = str(exc)
    try:
        answer = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=20)
        found["gpu"] = answer.stdout.strip().splitlines()[0] if answer.returncode == 0 and answer.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        found["gpu"] = None
    return found


class _Sink:
    """The figures of one session's tests, by module; written out when ``folder`` is set."""

    def __init__(self, folder: str | None) -> None:
        self.folder = Path(folder) if folder else None
        self.modules: dict[str, dict] = {}
        self.environment: dict | None = None

    def record(self, module: str, test: str, figures: dict) -> None:
        text = json.dumps(figures, default=_plain)  # fails here, on any machine, if a figure is not JSON
        entries = self.modules.setdefault(module, {})
        entries[test] = {**entries.get(test, {}), **json.loads(text)}
        if self.folder is None:
            return
        if self.environment is None:
            self.environment = _environment()
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"environment": self.environment, "tests": entries}
        (self.folder / f"{module}.json").write_text(json.dumps(body, indent=1) + "\n")


def _plain(value):
    """numpy scalars and arrays, tuples of them: plain JSON values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not a JSON value: {type(value).__name__}")


@pytest.fixture(scope="session")
def _sink() -> _Sink:
    return _Sink(os.environ.get(RESULTS_VAR))


class Results:
    """``record(**figures)``: the measured figures of the test that asks (merged over calls)."""

    def __init__(self, sink: _Sink, module: str, test: str) -> None:
        self._sink, self._module, self._test = sink, module, test

    def record(self, **figures) -> None:
        self._sink.record(self._module, self._test, figures)


@pytest.fixture
def results(_sink, request) -> Results:
    test = re.sub(r"\s+", " ", request.node.name)
    return Results(_sink, Path(str(request.node.path)).stem, test)
