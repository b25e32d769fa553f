#!/usr/bin/env python3
"""Shrink the onnxruntime-gpu wheel for an sm_90 machine: zero the device code of other GPUs.

In every fat binary of the CUDA provider that holds an sm_90 image, the payloads of the images
for other architectures are zeroed (headers kept, so nothing is chosen differently on sm_90),
and the wheel is rewritten with LZMA members; RECORD gets the new hashes. For the GPU machine
(H100, H200: both sm_90), whose runs carry at most 64 MiB: docs/benchmarks/README.md, "Preparing".

    python scripts/prune_ort_gpu.py WHEEL OUT_WHEEL
"""
import base64
import hashlib
import struct
import sys
import zipfile

MAGIC = 0xBA55ED50


def prune(data: bytearray, keep: int = 90) -> int:
    """Zeroes in place what sm_``keep`` never loads; returns the bytes zeroed."""
    zeroed = 0
    o = 0
    find = data.find
    while True:
        o = find(struct.pack("<I", MAGIC), o)
        if o < 0:
            return zeroed
        _, _, hsz, size = struct.unpack_from("<IHHQ", data, o)
        e, end = o + hsz, o + hsz + size
        entries = []
        ok = True
        while e < end:
            kind, _, ehsz, padded, _, _, _, _, sm = struct.unpack_from("<HHIIIIIII", data, e)
            if ehsz < 40 or e + ehsz + padded > end or kind not in (1, 2):
                ok = False
                break
            entries.append((kind, sm, e + ehsz, padded))
            e += ehsz + padded
        if ok and e == end and any(k == 2 and sm == keep for k, sm, _, _ in entries):
            for kind, sm, start, padded in entries:
                if not (kind == 2 and sm == keep):
                    data[start:start + padded] = bytes(padded)
                    zeroed += padded
            o = end
        else:
            o += 4


def main(src: str, dst: str) -> None:
    zin = zipfile.ZipFile(src)
    files = {}
    for info in zin.infolist():
        blob = zin.read(info)
        if info.filename.endswith("libonnxruntime_providers_cuda.so"):
            blob = bytearray(blob)
            print("zeroed", prune(blob) >> 20, "MB of other GPUs' code", file=sys.stderr)
            blob = bytes(blob)
        files[info.filename] = (info, blob)
    record = next(n for n in files if n.endswith(".dist-info/RECORD"))
    lines = []
    for line in files[record][1].decode().splitlines():
        name = line.split(",")[0]
        if name in files and name != record:
            blob = files[name][1]
            digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
            line = f"{name},sha256={digest},{len(blob)}"
        lines.append(line)
    files[record] = (files[record][0], ("\n".join(lines) + "\n").encode())
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_LZMA) as zout:
        for name, (info, blob) in files.items():
            zi = zipfile.ZipInfo(name, info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_LZMA
            zout.writestr(zi, blob)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: prune_ort_gpu.py WHEEL OUT_WHEEL")
    main(sys.argv[1], sys.argv[2])
