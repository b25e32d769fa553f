"""Writing models (``onnxcampo.ir.io.save_model``): the files written get the usual permissions."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from helpers import make_model, tensor_vi
from onnx import helper, numpy_helper

from onnxcampo import ir


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_external_data_gets_the_model_files_mode(tmp_path, monkeypatch, umask):
    """A model past the protobuf limit (lowered here) -> ``<output>.data`` next to it, with the
    model file's permissions (0666 less the umask), not the 0600 onnx writes it with."""
    model = make_model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], [tensor_vi("x", [2, 64])],
                       [tensor_vi("y", [2, 64])], [numpy_helper.from_array(np.ones((64, 64), np.float32), "W")])
    monkeypatch.setattr(ir.io, "_PROTOBUF_LIMIT", 10)
    old = os.umask(umask)
    try:
        ir.save_model(model, tmp_path / "m.onnx", check_loads=False)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"m.onnx": 0o666 & ~umask, "m.onnx.data": 0o666 & ~umask}
