"""scripts/prune_ort_gpu.py (the GPU machine's onnxruntime-gpu, sm_90 device code only) on
synthetic fat binaries: in one that holds an sm_90 image the other images' payloads are zeroed,
headers and the sm_90 image kept byte for byte; one without sm_90, and bytes around the fat
binaries, are left as they are; a wheel keeps its files, RECORD gets their new hashes."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prune_ort_gpu", ROOT / "scripts" / "prune_ort_gpu.py")
prune_ort_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prune_ort_gpu)

ENTRY_HEADER = 64


def _entry(kind: int, sm: int, payload: bytes) -> bytes:
    header = struct.pack("<HHIIIIIII", kind, 0x0101, ENTRY_HEADER, len(payload), 0, len(payload), 0, 0, sm)
    return header.ljust(ENTRY_HEADER, b"\0") + payload


def _fatbin(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", prune_ort_gpu.MAGIC, 1, 16, len(body)) + body


def test_other_gpus_code_is_zeroed_where_sm90_is_there():
    sm80, sm90, ptx = b"\x11" * 48, b"\x22" * 40, b"\x33" * 24
    with90 = _fatbin([_entry(2, 80, sm80), _entry(2, 90, sm90), _entry(1, 90, ptx)])
    without = _fatbin([_entry(2, 80, sm80), _entry(2, 86, b"\x44" * 16)])
    data = bytearray(b"head" + with90 + b"middle" + without + b"tail")
    before = bytes(data)
    zeroed = prune_ort_gpu.prune(data)
    assert zeroed == len(sm80) + len(ptx)
    assert len(data) == len(before)
    start = 4 + 16
    assert data[start + ENTRY_HEADER:start + ENTRY_HEADER + len(sm80)] == bytes(len(sm80))
    second = start + ENTRY_HEADER + len(sm80)
    assert data[second:second + ENTRY_HEADER + len(sm90)] == before[second:second + ENTRY_HEADER + len(sm90)]
    rest = 4 + len(with90)
    assert data[rest:] == before[rest:]  # the fat binary without sm_90 and the bytes around it
    assert data[:start + ENTRY_HEADER] == before[:start + ENTRY_HEADER]  # headers kept


def test_the_wheel_keeps_its_files_with_their_new_hashes(tmp_path):
    library = b"ELF" + _fatbin([_entry(2, 75, b"\x55" * 32), _entry(2, 90, b"\x66" * 32)])
    source, target = tmp_path / "in.whl", tmp_path / "out.whl"
    with zipfile.ZipFile(source, "w") as wheel:
        wheel.writestr("onnxruntime/capi/libonnxruntime_providers_cuda.so", library)
        wheel.writestr("onnxruntime/__init__.py", b"x = 1\n")
        wheel.writestr("pkg.dist-info/RECORD", "onnxruntime/capi/libonnxruntime_providers_cuda.so,sha256=old,1\n"
                                               "onnxruntime/__init__.py,sha256=old,1\npkg.dist-info/RECORD,,\n")
    prune_ort_gpu.main(str(source), str(target))
    with zipfile.ZipFile(target) as wheel:
        names = wheel.namelist()
        assert sorted(names) == sorted(["onnxruntime/capi/libonnxruntime_providers_cuda.so", "onnxruntime/__init__.py",
                                        "pkg.dist-info/RECORD"])
        assert all(info.compress_type == zipfile.ZIP_LZMA for info in wheel.infolist())
        pruned = wheel.read("onnxruntime/capi/libonnxruntime_providers_cuda.so")
        assert b"\x55" * 32 not in pruned and b"\x66" * 32 in pruned
        record = wheel.read("pkg.dist-info/RECORD").decode().splitlines()
    for line in record[:2]:
        name, digest, size = line.split(",")
        with zipfile.ZipFile(target) as wheel:
            blob = wheel.read(name)
        expected = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}" and int(size) == len(blob)
    assert record[2] == "pkg.dist-info/RECORD,,"
