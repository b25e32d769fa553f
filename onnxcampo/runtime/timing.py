"""Run a session the fast way, and time variants of a model side by side.

:class:`BoundRunner` runs a session as a deployed model runs: inputs on the device, bound once;
outputs allocated by the first run and bound from then on; with ``cuda_graph`` the run is
captured once into a CUDA graph (ORT's ``enable_cuda_graph``) and replayed, new inputs copied
into the bound buffers in place (:meth:`BoundRunner.update`), since a replay reads and writes the
addresses it was captured with.

:func:`time_in_rotation` times several variants (policies, candidate plans) in one process:

1. every variant's runner is alive for the whole measurement;
2. each is warmed up (at least ``warmup_runs`` runs and ``warmup_s`` seconds), and its runs per
   block are set from its warm-up so that one block lasts at least ``block_ms``;
3. ``rounds`` rounds follow; round ``r`` visits every variant once, starting from the ``r``-th
   (a rotated order, so no variant always runs first or after the same neighbour), and times one
   block of it;
4. a variant's time is the median of its block means; the spread is their range and quartiles.

Drift of the machine (clocks, other load) then falls on every variant alike instead of on the
one timed last.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from onnxcampo.config import EXECUTION_MODES
from onnxcampo.errors import CampoError, ConfigError
from onnxcampo.runtime import _ORT_ERRORS, make_session

logger = logging.getLogger(__name__)

__all__ = ["BlockTimes", "BoundRunner", "bound_runner", "check_feeds", "run_once", "runs_per_block", "time_block",
           "time_in_rotation", "warm_up"]

ROUNDS = 10  # rotation rounds: blocks per variant
BLOCK_MS = 20.0  # a timed block lasts at least this long
WARMUP_S = 0.2  # warm-up per variant (and at least WARMUP_RUNS runs)
WARMUP_RUNS = 3


def check_feeds(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray]) -> None:
    """IO binding gives poor errors for missing or unknown feeds, so check them first."""
    expected = {i.name for i in session.get_inputs()}
    overridable = {i.name for i in session.get_overridable_initializers()}
    missing = sorted(expected - set(feeds))
    unknown = sorted(set(feeds) - expected - overridable)
    if missing or unknown:
        raise ConfigError(
            f"feeds do not match the model inputs: missing {missing}, unknown {unknown}"
        )


class BoundRunner:
    """Runs a session through IO binding so host<->device copies stay out of the timings.

    Inputs are copied to the device once. Outputs are allocated on the device by the first run
    and those buffers are bound for the following runs, so per-run output allocation is not
    timed either (DESIGN.md: host copies of GPT-2's logits tripled the node sum).

    ``cuda_graph``: the session was made with ``make_session(..., cuda_graph=True)``. The first
    call then captures the run (ORT runs it as often as it needs to allocate and capture, then
    replays the graph once) and every later call replays it; inputs and outputs keep their
    device buffers throughout, so new inputs go through :meth:`update`, which copies them into
    the bound buffers.
    """

    def __init__(self, session: ort.InferenceSession, feeds: Mapping[str, np.ndarray],
                 device: str, *, cuda_graph: bool = False) -> None:
        if cuda_graph and device != "cuda":
            raise ConfigError(f"CUDA-graph replay needs the cuda device, not '{device}'")
        check_feeds(session, feeds)
        self._session = session
        self._binding = session.io_binding()
        self._device = device
        self.cuda_graph = cuda_graph
        # Own copies, kept alive: on the CPU an OrtValue borrows the numpy buffer, and update()
        # writes into it (it must not write into the caller's arrays).
        self._arrays = {name: np.array(array, order="C", copy=True) for name, array in feeds.items()}
        self._inputs = {name: ort.OrtValue.ortvalue_from_numpy(array, device, 0)
                        for name, array in self._arrays.items()}
        self._bound = {name: (array.dtype, array.shape) for name, array in self._arrays.items()}
        if device != "cpu":
            self._arrays = {}  # copied to the device
        for name, value in self._inputs.items():
            self._binding.bind_ortvalue_input(name, value)
        self._output_names = [o.name for o in session.get_outputs()]
        for name in self._output_names:
            self._binding.bind_output(name, device)
        self._outputs: list[ort.OrtValue] | None = None

    def __call__(self) -> float:
        """One run (with ``cuda_graph``: a replay, the first call a capture); its wall time in
        seconds."""
        start = time.perf_counter()
        try:
            self._session.run_with_iobinding(self._binding)
            self._binding.synchronize_outputs()
        except _ORT_ERRORS as exc:
            raise CampoError(f"ONNX Runtime failed to run the model: {exc}") from exc
        elapsed = time.perf_counter() - start
        if self._outputs is None:
            self._preallocate_outputs()
        return elapsed

    def launch(self) -> None:
        """One run without waiting for its outputs, for a block of runs timed as a whole: call
        :meth:`synchronize` after the block (``__call__`` waits after every run)."""
        try:
            self._session.run_with_iobinding(self._binding)
        except _ORT_ERRORS as exc:
            raise CampoError(f"ONNX Runtime failed to run the model: {exc}") from exc
        if self._outputs is None:
            self._preallocate_outputs()

    def synchronize(self) -> None:
        """Wait for the bound outputs of the runs launched so far."""
        self._binding.synchronize_outputs()

    def update(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Copy new values into the bound input buffers (some or all inputs); each keeps the
        dtype and shape it was bound with (a CUDA graph replays fixed buffers)."""
        for name, array in feeds.items():
            if name not in self._inputs:
                raise ConfigError(f"update: '{name}' is not a bound input; bound are {sorted(self._inputs)}")
            array = np.ascontiguousarray(array)
            dtype, shape = self._bound[name]
            if (array.dtype, array.shape) != (dtype, shape):
                raise ConfigError(
                    f"update: input '{name}' is {array.dtype}{list(array.shape)} but was bound as "
                    f"{dtype}{list(shape)}; bound buffers keep their shape and type"
                )
            self._inputs[name].update_inplace(array)

    def outputs(self) -> dict[str, np.ndarray]:
        """The last run's outputs, copied to the host (after at least one run)."""
        values = self._outputs if self._outputs is not None else self._binding.get_outputs()
        return {name: value.numpy() for name, value in zip(self._output_names, values)}

    def _preallocate_outputs(self) -> None:
        """Bind the first run's output buffers so later runs write into them."""
        self._outputs = self._binding.get_outputs()
        for name, value in zip(self._output_names, self._outputs):
            self._binding.bind_ortvalue_output(name, value)


def _check_execution(execution: str, provider: str) -> bool:
    """Whether ``execution`` replays CUDA graphs; a clear error where it cannot."""
    if execution not in EXECUTION_MODES:
        raise ConfigError(f"unknown execution mode {execution!r}; choose one of {', '.join(EXECUTION_MODES)}")
    if execution == "cuda-graph" and provider != "cuda":
        raise ConfigError(f"execution cuda-graph needs provider cuda (CUDA graphs replay on the CUDA EP), "
                          f"not '{provider}'")
    return execution == "cuda-graph"


def bound_runner(model: onnx.ModelProto | str, feeds: Mapping[str, np.ndarray], *, provider: str = "cpu",
                 execution: str = "plain") -> BoundRunner:
    """A session for ``model`` on ``provider`` (all graph optimizations on) and its
    :class:`BoundRunner`; ``execution="cuda-graph"`` (provider cuda) captures and replays."""
    cuda_graph = _check_execution(execution, provider)
    session = make_session(model, provider=provider, cuda_graph=cuda_graph)
    return BoundRunner(session, feeds, "cuda" if provider == "cuda" else "cpu", cuda_graph=cuda_graph)


def run_once(model: onnx.ModelProto | str, feeds: Mapping[str, np.ndarray], *, provider: str = "cpu",
             execution: str = "plain") -> dict[str, np.ndarray]:
    """The outputs of ``model`` run as it will run: bound; with ``cuda-graph`` those of a replay
    (the capture call first, then one replay)."""
    runner = bound_runner(model, feeds, provider=provider, execution=execution)
    runner()
    if runner.cuda_graph:
        runner()
    return runner.outputs()


# --------------------------------------------------------------------------------------------
# Timed blocks
# --------------------------------------------------------------------------------------------


def warm_up(run: Callable[[], object], *, seconds: float = WARMUP_S, runs: int = WARMUP_RUNS) -> list[float]:
    """Call ``run`` at least ``runs`` times and for at least ``seconds``; the wall time of each
    call (s)."""
    times = []
    deadline = time.perf_counter() + seconds
    finish = getattr(run, "sync", None)  # a run that queues work: waited for after each warm-up call
    while len(times) < runs or time.perf_counter() < deadline:
        start = time.perf_counter()
        run()
        if finish is not None:
            finish()
        times.append(time.perf_counter() - start)
    return times


def runs_per_block(once_s: float, block_ms: float = BLOCK_MS) -> int:
    """Runs that make a block of at least ``block_ms`` when one run takes ``once_s``."""
    return max(1, math.ceil(block_ms / max(once_s * 1e3, 1e-3)))


def time_block(run: Callable[[], object], count: int) -> float:
    """ms per call of ``count`` calls of ``run`` in a row; a ``run`` that queues work on a device
    without waiting for it (one with a ``sync()`` method) is waited for before the clock stops."""
    finish = getattr(run, "sync", None)
    start = time.perf_counter()
    for _ in range(count):
        run()
    if finish is not None:
        finish()
    return (time.perf_counter() - start) * 1e3 / count


@dataclass(frozen=True)
class BlockTimes:
    """One variant timed in rotation: ``blocks_ms`` the ms per run of each block, in the order
    timed; ``error`` when it failed (its blocks then stop there)."""

    name: str
    blocks_ms: tuple[float, ...] = ()
    runs_per_block: int = 0
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.blocks_ms) if self.blocks_ms and self.error is None else None

    @property
    def min_ms(self) -> float | None:
        return min(self.blocks_ms) if self.blocks_ms else None

    @property
    def max_ms(self) -> float | None:
        return max(self.blocks_ms) if self.blocks_ms else None

    @property
    def quartiles_ms(self) -> tuple[float, float] | None:
        """(first, third) quartile of the block means."""
        if not self.blocks_ms:
            return None
        q1, q3 = np.percentile(self.blocks_ms, [25, 75])
        return float(q1), float(q3)

    def to_json(self) -> dict:
        if self.error is not None:
            return {"error": self.error}
        q1, q3 = self.quartiles_ms
        return {"ms": _sig(self.median_ms), "min_ms": _sig(self.min_ms), "max_ms": _sig(self.max_ms),
                "q1_ms": _sig(q1), "q3_ms": _sig(q3), "runs_per_block": self.runs_per_block,
                "blocks_ms": [_sig(b) for b in self.blocks_ms]}


def _sig(value: float) -> float:
    """Five significant digits: a block mean is not known better (and 4 decimals lose a 5 us run)."""
    return float(f"{value:.5g}")


def time_in_rotation(
    runs: Mapping[str, Callable[[], object]],
    *,
    rounds: int = ROUNDS,
    block_ms: float = BLOCK_MS,
    warmup_s: float = WARMUP_S,
    warmup_runs: int = WARMUP_RUNS,
    per_block: Mapping[str, int] | None = None,
) -> dict[str, BlockTimes]:
    """Time every variant of ``runs`` (name -> one run; e.g. a :class:`BoundRunner`) in blocks,
    in rotation, all alive at once (see the module's numbered steps). A variant whose run raises
    is dropped with its error (logged); the others go on.

    ``per_block``: runs per block of the variants it names, fixed by the caller (the benchmark
    keeps each variant's from its own measurement) instead of set from the warm-up in step 2;
    with ``warmup_runs=0`` and ``warmup_s=0`` such a variant is not run before its first block."""
    if rounds < 1 or not block_ms > 0:
        raise ConfigError(f"need rounds >= 1 and block_ms > 0, got rounds={rounds} block_ms={block_ms}")
    names = list(runs)
    blocks: dict[str, list[float]] = {name: [] for name in names}
    fixed = dict(per_block or {})
    per_block = {}
    errors: dict[str, str] = {}

    def attempt(name: str, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one failing variant must not end the others' timing
            logger.warning("%s failed: %s", name, exc)
            errors[name] = str(exc)

    for name in names:
        logger.info("warming up %s", name)

        def warm(name: str = name) -> None:
            times = warm_up(runs[name], seconds=warmup_s, runs=warmup_runs)
            if name in fixed:
                per_block[name] = fixed[name]
                return
            # the first run may include a capture or an algorithm search: not a run's time
            per_block[name] = runs_per_block(statistics.median(times[1:] or times), block_ms)

        attempt(name, warm)
    for index in range(rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        logger.info("round %d of %d", index + 1, rounds)
        for name in order:
            if name not in errors:
                attempt(name, lambda name=name: blocks[name].append(time_block(runs[name], per_block[name])))
    result = {}
    for name in names:
        result[name] = BlockTimes(name, tuple(blocks[name]), per_block.get(name, 0), errors.get(name))
        if name not in errors:
            logger.info("%s %.4f ms (%d blocks of %d runs)", name, result[name].median_ms, rounds, per_block[name])
    return result
