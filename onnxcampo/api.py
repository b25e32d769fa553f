"""``optimize()``: load -> prepare -> plan -> choose -> apply -> export (``onnxcampo.pipeline``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import onnx

from onnxcampo import pipeline
from onnxcampo.config import OptimizeConfig
from onnxcampo.pipeline import ANALYSIS, COMPARED, METADATA_KEY, OptimizeResult, read_executed_graph

__all__ = ["ANALYSIS", "COMPARED", "METADATA_KEY", "OptimizeResult", "optimize", "read_executed_graph"]


def optimize(
    model: str | os.PathLike | onnx.ModelProto,
    *,
    config: OptimizeConfig | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
    **options,
) -> OptimizeResult:
    """Turn an fp32 model into a mixed fp16/fp32 one; the input model is never modified.

    ``options`` are :class:`OptimizeConfig` fields and override those of ``config``; an
    ``experimental`` mapping is merged over ``config.experimental``
    (``experimental={"fuse_column_sums": False}``; :class:`~onnxcampo.config.ExperimentalOptions`).
    ``inputs``: with ``tune``, the feeds the candidates are timed on (a training step: its
    batch); with ``activation_limit``, the calibration feeds; random ones by default.
    """
    config = config or OptimizeConfig()
    if options:
        config = config.replace(**options)
    loaded = pipeline.load(model, config, inputs)
    if isinstance(loaded, OptimizeResult):  # nothing to do: written unchanged
        return loaded
    if loaded.config.tune is not None:
        from onnxcampo.tune import tune

        return tune(loaded.model, loaded.config, inputs, loaded.source)
    return pipeline.run_loaded(loaded, inputs)
