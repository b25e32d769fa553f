"""Trainer checkpoints: one ``.npz`` file (numpy's zip of ``.npy`` arrays), written atomically.

Entries: one fp32 array per step-graph state input, named as the graph input (the weights,
``<weight>.momentum``, ``<weight>.adam_m`` / ``<weight>.adam_v``, ``step``, ``loss_scale``,
``loss_scale_clean_steps``, training-mode BatchNorm running statistics, ``dropout_seed``), plus ``onnxcampo.checkpoint``: a 0-d unicode array holding JSON
``{"format": 1, "onnxcampo": version, "steps": n, "lr": lr, "inputs": [step graph input names],
"state": {name: [dtype, shape]}}``. Readable with ``numpy.load(path)`` and no onnxcampo.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Mapping

import numpy as np

from onnxcampo import __version__, ir
from onnxcampo.errors import ConfigError

FORMAT = 1
META = "onnxcampo.checkpoint"


def write_checkpoint(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], *, steps: int, lr: float,
                     inputs: list[str]) -> None:
    meta = {"format": FORMAT, "onnxcampo": __version__, "steps": int(steps), "lr": float(lr), "inputs": list(inputs),
            "state": {name: [str(value.dtype), list(value.shape)] for name, value in arrays.items()}}
    buffer = io.BytesIO()
    np.savez(buffer, **{META: np.array(json.dumps(meta))}, **arrays)
    ir.write_bytes_atomically(path, buffer.getvalue())


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The metadata and the arrays of a checkpoint; ConfigError (one line) if it is not one."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such checkpoint") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: an empty file
        raise ConfigError(f"{path}: not an onnxcampo checkpoint (.npz): {(str(exc) or type(exc).__name__).splitlines()[0]}") from None
    if META not in arrays:
        raise ConfigError(f"{path}: not an onnxcampo checkpoint (no {META} entry)")
    try:
        meta = json.loads(str(arrays.pop(META)))
    except ValueError:
        raise ConfigError(f"{path}: unreadable {META} entry") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path}: checkpoint format {meta.get('format')!r}, this onnxcampo reads format {FORMAT}")
    return meta, arrays


__all__ = ["FORMAT", "META", "read_checkpoint", "write_checkpoint"]
