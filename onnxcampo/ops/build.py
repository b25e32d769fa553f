"""Build the custom-op library: ``python -m onnxcampo.ops.build [--quiet] [--cpu-only] [--force]``.

1. ONNX Runtime's C/C++ API headers come from Debian's ``libonnxruntime-dev`` (trixie, 1.21;
   the C API is backward compatible, so they serve the 1.31/1.32 runtimes). The pinned .deb is
   fetched once (checked against its SHA-256), else whatever version ``apt-get download``
   finds with a private sources list and lists folder; it is unpacked into
   ``~/.cache/onnxcampo/ort-headers/``. Nothing of the system changes.
   ``$ONNXCAMPO_ORT_INCLUDE`` (a folder holding ``onnxruntime_cxx_api.h``) skips the download.
2. CMake builds the op units (``onnxcampo/ops/<unit>/``, shared code in ``onnxcampo/ops/common/``;
   ``onnxcampo/ops/CMakeLists.txt``, shipped with the package) in ``build/ops-<kernels>/`` of a
   source checkout (``~/.cache/onnxcampo/build/`` for an installed package): CPU kernels always,
   CUDA kernels (sm_80, sm_90) when nvcc is found (``$CUDACXX``, ``PATH``, ``/usr/local/cuda/bin``).
3. The library is copied to ``onnxcampo/ops/lib/`` with a stamp of its inputs; a later run
   with the same sources, headers and compilers does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from onnxcampo.errors import CampoError, OpsLibraryError
from onnxcampo.ops import LIBRARY_FILE, _load_error, default_path

logger = logging.getLogger("onnxcampo.ops.build")

PACKAGE = "libonnxruntime-dev"
SUITE = "trixie"
MIRROR = "http://deb.debian.org/debian"
PINNED_DEB = "pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
PINNED_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
HEADER = "onnxruntime_cxx_api.h"
INCLUDE_ENV = "ONNXCAMPO_ORT_INCLUDE"


SOURCE_SUFFIXES = (".h", ".cc", ".cu", ".cmake")


def sources_dir() -> Path:
    """``onnxcampo/ops/``: its ``CMakeLists.txt``, the units' folders and ``common/``."""
    return Path(__file__).resolve().parent


def source_files(sources: Path) -> list[Path]:
    """The files the library is built from (``lib/``, Python files and caches left out)."""
    return sorted(path for path in sources.rglob("*")
                  if path.is_file() and (path.suffix in SOURCE_SUFFIXES or path.name == "CMakeLists.txt")
                  and "lib" not in path.relative_to(sources).parts[:1])


def build_root() -> Path:
    """``build/`` of the source checkout the package is in, else ``~/.cache/onnxcampo/build``."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / "build"
    return cache_dir().parent / "build"


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "onnxcampo" / "ort-headers"


# --------------------------------------------------------------------------------------------
# Headers
# --------------------------------------------------------------------------------------------


def ort_headers() -> Path:
    """The folder holding ``onnxruntime_cxx_api.h``: given, cached, or downloaded now."""
    given = os.environ.get(INCLUDE_ENV)
    if given:
        folder = Path(given).expanduser()
        if not (folder / HEADER).is_file():
            raise OpsLibraryError(f"${INCLUDE_ENV}={given} holds no {HEADER}")
        return folder
    root = cache_dir()
    include = root / "usr" / "include" / "onnxruntime"
    if (include / HEADER).is_file():
        logger.info("ONNX Runtime headers: cached in %s", root)
        return include
    with tempfile.TemporaryDirectory(prefix="onnxcampo-ort-headers-") as tmp:
        deb = _download_deb(Path(tmp))
        staging = Path(tmp) / "root"
        _unpack_deb(deb, staging)
        if not (staging / "usr" / "include" / "onnxruntime" / HEADER).is_file():
            raise OpsLibraryError(f"{deb.name} holds no usr/include/onnxruntime/{HEADER}")
        root.parent.mkdir(parents=True, exist_ok=True)
        if root.exists():
            shutil.rmtree(root)
        shutil.move(str(staging), str(root))
        (root / "SOURCE").write_text(deb.name + "\n")
    logger.info("ONNX Runtime headers: %s unpacked into %s", deb.name, root)
    return include


def _download_deb(folder: Path) -> Path:
    reasons = []
    url = f"{MIRROR}/{PINNED_DEB}"
    try:
        logger.info("downloading %s", url)
        with urllib.request.urlopen(url, timeout=60) as response:
            data = response.read()
        digest = hashlib.sha256(data).hexdigest()
        if digest != PINNED_SHA256:
            raise OSError(f"SHA-256 {digest} differs from the pinned {PINNED_SHA256}")
        deb = folder / Path(PINNED_DEB).name
        deb.write_bytes(data)
        return deb
    except OSError as exc:
        reasons.append(f"{url}: {exc}")
    try:
        return _apt_download(folder)
    except (OSError, subprocess.CalledProcessError) as exc:
        reasons.append(f"apt-get download {PACKAGE} ({SUITE}): {_tail(exc)}")
    raise OpsLibraryError(
        f"could not download the ONNX Runtime headers ({PACKAGE} from Debian {SUITE}): "
        + "; ".join(reasons) + f"; set ${INCLUDE_ENV} to a folder holding {HEADER} to build offline")


def _apt_download(folder: Path) -> Path:
    """``apt-get download`` with a private sources list and lists folder (Debian's signed index)."""
    if shutil.which("apt-get") is None:
        raise OSError("apt-get is not installed")
    lists = folder / "lists"
    (lists / "partial").mkdir(parents=True)
    (folder / "archives" / "partial").mkdir(parents=True)
    sources = folder / "sources.list"
    sources.write_text(f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {MIRROR} {SUITE} main\n")
    options = [
        f"-oDir::Etc::SourceList={sources}", "-oDir::Etc::SourceParts=/dev/null",
        f"-oDir::State::Lists={lists}", f"-oDir::Cache={folder}", "-oDir::State::status=/dev/null",
        "-oDebug::NoLocking=1",
    ]
    if os.geteuid() == 0:
        options.append("-oAPT::Sandbox::User=root")  # apt's _apt user cannot write into our temp folder
    logger.info("resolving %s with apt-get (Debian %s)", PACKAGE, SUITE)
    subprocess.run(["apt-get", *options, "update"], check=True, capture_output=True, text=True)
    subprocess.run(["apt-get", *options, "download", PACKAGE], check=True, capture_output=True, text=True, cwd=folder)
    debs = sorted(folder.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise OSError("apt-get download wrote no .deb")
    return debs[-1]


def _unpack_deb(deb: Path, target: Path) -> None:
    """``dpkg -x`` when there is dpkg, else read the ar archive's data.tar.* here."""
    target.mkdir(parents=True)
    if shutil.which("dpkg"):
        subprocess.run(["dpkg", "-x", str(deb), str(target)], check=True, capture_output=True)
        return
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise OpsLibraryError(f"{deb.name} is not a Debian package")
    offset = 8
    while offset + 60 <= len(data):
        name = data[offset:offset + 16].decode().strip().rstrip("/")
        size = int(data[offset + 48:offset + 58].decode().strip())
        body = data[offset + 60:offset + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                if hasattr(tarfile, "data_filter"):
                    archive.extractall(target, filter="data")
                else:  # Python without extraction filters (< 3.10.12)
                    archive.extractall(target)
            return
        offset += 60 + size + (size % 2)
    raise OpsLibraryError(f"{deb.name} holds no data.tar member")


def _tail(exc: BaseException) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


# --------------------------------------------------------------------------------------------
# Compilers and the build
# --------------------------------------------------------------------------------------------


def find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def _version_line(tool: str) -> str:
    result = subprocess.run([tool, "--version"], capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else tool


def _stamp(sources: Path, include: Path, nvcc: str | None, cmake: str) -> str:
    digest = hashlib.sha256()
    for path in source_files(sources):
        digest.update(path.relative_to(sources).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update((include / HEADER).read_bytes())
    digest.update((include / "onnxruntime_c_api.h").read_bytes())
    for tool in (cmake, os.environ.get("CXX") or "c++", nvcc):
        digest.update(str(tool).encode())
        if tool:
            digest.update(_version_line(tool).encode())
    return digest.hexdigest()


def build(*, cpu_only: bool = False, force: bool = False, jobs: int | None = None) -> Path:
    """Build (or reuse) the library; returns the installed file."""
    sources = sources_dir()
    if not (sources / "CMakeLists.txt").is_file():
        raise OpsLibraryError(f"no library sources at {sources} (no CMakeLists.txt); reinstall onnxcampo")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise OpsLibraryError("cmake is not installed; install it (apt-get install cmake, or pip install cmake)")
    include = ort_headers()
    nvcc = None if cpu_only else find_nvcc()
    kernels = "cpu+cuda" if nvcc else "cpu"
    if nvcc:
        logger.info("nvcc found (%s): building CPU and CUDA kernels (sm_80, sm_90)", nvcc)
    else:
        logger.info("%s: building CPU kernels only", "--cpu-only" if cpu_only else "no nvcc found")
    target = default_path()
    stamp_file = target.with_suffix(".stamp.json")
    stamp = _stamp(sources, include, nvcc, cmake)
    if not force and target.is_file() and stamp_file.is_file():
        previous = json.loads(stamp_file.read_text())
        if previous.get("stamp") == stamp:
            logger.info("up to date: %s (%s kernels)", target, previous.get("kernels"))
            return target
    build_dir = build_root() / f"ops-{kernels.replace('+', '-')}"
    _drop_stale_cache(build_dir, sources)
    configure = [cmake, "-S", str(sources), "-B", str(build_dir), f"-DORT_INCLUDE_DIR={include}",
                 "-DCMAKE_BUILD_TYPE=Release", f"-DONNXCAMPO_CUDA={'ON' if nvcc else 'OFF'}"]
    if nvcc:
        configure.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    logger.info("configuring in %s", build_dir)
    _run(configure)
    logger.info("compiling%s", " (the CUDA kernels take a minute)" if nvcc else "")
    _run([cmake, "--build", str(build_dir), "--parallel", str(jobs or os.cpu_count() or 2)])
    built = build_dir / LIBRARY_FILE
    if not built.is_file():
        raise OpsLibraryError(f"the build finished without {built}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".tmp")
    shutil.copy2(built, staging)
    os.replace(staging, target)  # a process that holds the old file keeps its mapping
    stamp_file.write_text(json.dumps({"stamp": stamp, "kernels": kernels, "headers": str(include)}, indent=1) + "\n")
    logger.info("built %s (%s kernels)", target, kernels)
    return target


def _drop_stale_cache(build_dir: Path, sources: Path) -> None:
    """Removes a build folder CMake configured for another source folder (it would refuse it)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            home = line.split("=", 1)[-1].strip()
            if Path(home).resolve() != sources.resolve():
                logger.info("%s was configured for %s: starting it afresh", build_dir, home)
                shutil.rmtree(build_dir)
            return


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip().splitlines()
        details = "\n".join(output[-25:])
        raise OpsLibraryError(f"`{' '.join(command)}` failed (exit {result.returncode}):\n{details}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m onnxcampo.ops.build", description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument("--cpu-only", action="store_true", help="leave the CUDA kernels out even if nvcc is there")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="onnxcampo.ops.build: %(message)s", stream=sys.stderr)
    try:
        path = build(cpu_only=args.cpu_only, force=args.force, jobs=args.jobs)
    except CampoError as exc:
        print(f"onnxcampo.ops.build: error: {exc}", file=sys.stderr)
        return exc.exit_code
    error = _load_error(str(path))
    if error:
        print(f"onnxcampo.ops.build: error: {error}", file=sys.stderr)
        return OpsLibraryError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
