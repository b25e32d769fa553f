"""The batches ``onnxcampo train --data PATH`` reads: one ``.npz`` file or a folder of them.

1. A file holds one batch: an array per batch input of the step graph (the forward inputs and
   ``labels``). An array with one axis more than its graph input holds one batch per index on
   that axis; step ``i`` takes index ``i`` modulo its length (as before folders were read).
2. A folder holds one batch per ``*.npz`` file, taken in sorted name order; step ``i`` takes
   file ``i`` modulo their count, so ``--steps`` may run past the end (epochs) and a resumed run
   continues with the file the checkpoint's step count names.
3. Every file is checked before the first step, from the ``.npy`` headers (no array is read):
   the names must be the step graph's batch inputs, the dtypes and static dims theirs. A wrong
   file is one ConfigError naming it; an empty folder too.
4. A file that is a partial batch (:func:`onnxcampo.training.batches.partial_batch`: fewer rows
   in every input with the batch dim, a folder's last file, say) is such an error too, naming
   the sizes; with ``drop_partial`` it is left out of the cycle instead (``self.dropped``), and a
   folder of nothing but partial batches is an error.
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from onnxcampo.errors import ConfigError
from onnxcampo.training.batches import BatchShapeError, InputSpec, PartialBatch, check_array, partial_batch

__all__ = ["NpzBatches", "dropped_text", "npz_header"]


def npz_header(path: Path) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every array in the ``.npz`` at ``path``, read from the
    ``.npy`` headers; a ConfigError when it is no readable ``.npz``."""
    try:
        with zipfile.ZipFile(path) as archive:
            header = {}
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with archive.open(info) as stream:
                    version = np.lib.format.read_magic(stream)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(stream)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(stream)
                    else:  # a format numpy has no public header reader for: read the array
                        with np.load(path, allow_pickle=False) as data:
                            array = data[info.filename[:-4]]
                        shape, dtype = array.shape, array.dtype
                header[info.filename[:-4]] = (np.dtype(dtype), tuple(int(d) for d in shape))
            return header
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"{path}: not a readable .npz ({exc})") from None


class NpzBatches:
    """The batches of ``--data`` (module docstring): ``batches[i]`` is step ``i``'s batch, a dict
    of numpy arrays. ``specs``: the step graph's batch inputs (``Trainer.inputs`` restricted to
    ``Trainer.spec.batch``)."""

    def __init__(self, path: Path, specs: Mapping[str, InputSpec], *, drop_partial: bool = False) -> None:
        self.path = Path(path)
        self.specs = dict(specs)
        self.dropped: list[tuple[Path, PartialBatch]] = []
        self.folder = self.path.is_dir()
        self.stacked = {name: False for name in self.specs}
        if self.folder:
            files = sorted(f for f in self.path.iterdir() if f.suffix == ".npz" and f.is_file())
            if not files:
                raise ConfigError(f"{self.path}: no .npz files in this folder")
        elif self.path.is_file():
            files = [self.path]
            header = self._header(self.path)
            # an array with one axis more than its input holds one batch per index on it
            self.stacked = {name: spec.dims is not None and len(header[name][1]) == len(spec.dims) + 1
                            for name, spec in self.specs.items()}
        else:
            raise ConfigError(f"{self.path}: no such file or folder")
        self.files: list[Path] = []
        for file in files:
            partial = self._check(file)
            if partial is None:
                self.files.append(file)
            elif drop_partial:
                self.dropped.append((file, partial))
            else:
                raise ConfigError(f"{file}: {partial.message()}")
        if not self.files:
            first = self.dropped[0][1]
            raise ConfigError(f"{self.path}: every batch is partial ({first.rows} rows, the step graph takes "
                              f"{first.graph_rows}): nothing to train on")
        self._loaded: tuple[Path, dict[str, np.ndarray]] | None = None  # the last file read

    def _header(self, file: Path) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        header = npz_header(file)
        missing = sorted(set(self.specs) - set(header))
        unknown = sorted(set(header) - set(self.specs))
        if missing or unknown:
            raise ConfigError(f"{file}: does not match the step graph's batch inputs {sorted(self.specs)}: "
                              f"missing {missing}, unknown {unknown}")
        return header

    def _check(self, file: Path) -> PartialBatch | None:
        """A ConfigError unless ``file`` fits the step graph; its :class:`PartialBatch` if it is one."""
        wrong = []
        for name, (dtype, shape) in self._header(file).items():
            if self.stacked[name]:
                if shape[0] == 0:
                    raise ConfigError(f"{file}: {name} stacks no batch (its leading axis is 0)")
                shape = shape[1:]
            try:
                check_array(self.specs[name], dtype, shape, f"in {file.name}")
            except BatchShapeError as error:
                wrong.append(error)
            except ConfigError as error:
                raise ConfigError(f"{file}: {error}") from None
        if not wrong:
            return None
        partial = partial_batch(self.specs, wrong)
        if partial is None:
            raise ConfigError(f"{file}: {wrong[0]}")
        return partial

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        file = self.files[index % len(self.files)]
        if self._loaded is None or self._loaded[0] != file:
            try:
                with np.load(file, allow_pickle=False) as data:
                    self._loaded = (file, {name: data[name] for name in self.specs})
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
                raise ConfigError(f"{file}: not a readable .npz ({exc})") from None
        arrays = self._loaded[1]
        return {name: array[index % len(array)] if self.stacked[name] else array for name, array in arrays.items()}


def dropped_text(dropped: Sequence[tuple[Path, PartialBatch]]) -> str:
    """One line naming the partial batches left out."""
    names = ", ".join(file.name for file, _ in dropped[:3]) + (f" and {len(dropped) - 3} more" if len(dropped) > 3 else "")
    partial = dropped[0][1]
    return (f"left out {len(dropped)} partial batch{'es' if len(dropped) > 1 else ''} ({names}: {partial.rows} rows, "
            f"the step graph takes {partial.graph_rows})")
