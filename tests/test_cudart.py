"""Finding the CUDA runtime library the Trainer calls for batches in GPU memory (no GPU needed:
where it is looked for, in which order, and how a failure reads)."""

from __future__ import annotations

import pytest

from onnxcampo.errors import CampoError
from onnxcampo.runtime import cudart

MAPS = """\
7f0000000000-7f0000001000 r-xp 00000000 08:01 11 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000100000-7f0000200000 r-xp 00000000 08:01 12 /site/torch/lib/libcudart-9a8b7c6d.so.13
7f0000300000-7f0000400000 r-xp 00000000 08:01 13 /site/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000300000-7f0000400000 r--p 00100000 08:01 13 /site/nvidia/cuda_runtime/lib/libcudart.so.12
7f0000500000-7f0000600000 r-xp 00000000 08:01 14 /opt/cuda/lib64/libcudart.so.11.8.89
7f0000700000-7f0000701000 rw-p 00000000 00:00 0
7f0000800000-7f0000900000 r-xp 00000000 08:01 15 /opt/libcudart_static_helper.so
"""


def test_copies_already_loaded_come_first_the_one_of_orts_cuda_major_first(tmp_path, monkeypatch):
    monkeypatch.delenv(cudart.ENV, raising=False)
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    found = cudart.candidates(maps, major=12, search_path=[])
    assert found[:3] == ["/site/nvidia/cuda_runtime/lib/libcudart.so.12", "/site/torch/lib/libcudart-9a8b7c6d.so.13",
                         "/opt/cuda/lib64/libcudart.so.11.8.89"]
    assert found[3:5] == ["libcudart.so.12", "libcudart.so.13"]  # then by name: ORT's major, 13, 12
    assert not any("static_helper" in place or "libc.so" in place for place in found)
    assert cudart.candidates(maps, major=13, search_path=[])[0].endswith("libcudart-9a8b7c6d.so.13")


def test_the_nvidia_wheels_are_looked_in_and_the_environment_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv(cudart.ENV, raising=False)
    for parts in (("nvidia", "cu13", "lib", "libcudart.so.13"), ("nvidia", "cuda_runtime", "lib", "libcudart.so.12")):
        path = tmp_path.joinpath(*parts)
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    found = cudart.candidates(tmp_path / "no-maps", major=12, search_path=[str(tmp_path)])
    assert found[:2] == ["libcudart.so.12", "libcudart.so.13"]
    assert found[2:4] == [str(tmp_path / "nvidia/cu13/lib/libcudart.so.13"),
                          str(tmp_path / "nvidia/cuda_runtime/lib/libcudart.so.12")]
    monkeypatch.setenv(cudart.ENV, "/my/libcudart.so.12")
    assert cudart.candidates(tmp_path / "no-maps", major=12, search_path=[str(tmp_path)]) == ["/my/libcudart.so.12"]


def test_no_loadable_runtime_is_one_error_listing_the_places_tried(tmp_path):
    empty = tmp_path / "libcudart.so.12"
    empty.write_bytes(b"")
    with pytest.raises(CampoError, match=r"no CUDA runtime library \(libcudart\) could be loaded .* tried "
                                         r"/nowhere/libcudart.so.99 \(.*\); .*libcudart.so.12 \(.*\)\. Set ONNXCAMPO_CUDART"):
        cudart._load(["/nowhere/libcudart.so.99", str(empty)])


def test_a_runtime_found_here_reports_cuda_errors_as_campo_errors():
    """Where this machine has a CUDA runtime (a GPU or not), it loads and says its version;
    a call that CUDA refuses (no GPU, no driver) is a CampoError naming the call."""
    try:
        runtime = cudart._load(cudart.candidates())
    except CampoError:
        pytest.skip("no CUDA runtime library on this machine")
    assert runtime.version >= 11000
    try:
        runtime.synchronize(cudart.LEGACY_STREAM)
    except CampoError as exc:
        assert "cudaStreamSynchronize failed with cudaError" in str(exc)
