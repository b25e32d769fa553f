"""``optimize()``: load -> prepare -> plan -> choose -> apply -> export (``onnxcampo.pipeline``)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

import numpy as np
import onnx

from onnxcampo import pipeline
from onnxcampo.config import OptimizeConfig
from onnxcampo.accuracy.guard import AccuracyCheck
from onnxcampo.pipeline import ANALYSIS, COMPARED, METADATA_KEY, OptimizeResult, read_executed_graph

__all__ = ["ANALYSIS", "COMPARED", "METADATA_KEY", "AccuracyCheck", "OptimizeResult", "optimize",
           "read_executed_graph"]


def optimize(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    config: OptimizeConfig | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    accuracy: str | AccuracyCheck = "report",
    **options,
) -> OptimizeResult:
    """Turn an fp32 model into a mixed fp16/fp32 one; the input model is never modified.

    ``options`` are :class:`OptimizeConfig` fields and override those of ``config``; an
    ``experimental`` mapping is merged over ``config.experimental``
    (``experimental={"fuse_column_sums": False}``; :class:`~onnxcampo.config.ExperimentalOptions`).
    ``inputs``: with ``tune``, the feeds the candidates are timed on (a training step: its
    batch); with ``activation_limit``, the calibration feeds; random ones by default.

    ``accuracy``: the optimized model checked against the fp32 one (:mod:`onnxcampo.accuracy.guard`), the
    verdict in ``report["accuracy"]``: ``"report"`` (default: checked once, a failure is a
    warning and a note, never an error), ``"validate"`` (a failure searches the nodes
    responsible and raises :class:`~onnxcampo.errors.ValidationError`), ``"fix"`` (a failure
    searches them and returns the optimization that keeps them fp32, when it passes) or
    ``"off"``; an :class:`~onnxcampo.accuracy.guard.AccuracyCheck` sets the tolerance, provider and
    inputs of the check too. The check runs in memory and writes nothing.
    """
    check = AccuracyCheck.of(accuracy)
    config = config or OptimizeConfig()
    if options:
        config = config.replace(**options)
    started = time.perf_counter()
    result = _optimize(model, config, inputs)
    if check.mode == "off":
        return result
    from onnxcampo.accuracy import guard

    return guard.check(model, config, result, check, optimize_s=time.perf_counter() - started, inputs=inputs)


def _optimize(model, config: OptimizeConfig, inputs) -> OptimizeResult:
    loaded = pipeline.load(model, config, inputs)
    if isinstance(loaded, OptimizeResult):  # nothing to do: written unchanged
        return loaded
    if loaded.config.tune is not None:
        from onnxcampo.tune import tune

        return tune(loaded.model, loaded.config, inputs, loaded.source)
    return pipeline.run_loaded(loaded, inputs)
