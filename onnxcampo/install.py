"""Which ONNX Runtime build is installed, and what to run when it is the wrong one.

onnxcampo's core does not pin ONNX Runtime: its CPU wheel (``onnxruntime``) and its CUDA wheel
(``onnxruntime-gpu``) install the same ``onnxruntime`` package folder, so with both installed
the one installed last owns the files (the CPU build, usually: no CUDA provider), and
``pip uninstall onnxruntime`` then deletes files ``onnxruntime-gpu`` needs. ``onnxcampo[cpu]``
and ``onnxcampo[gpu]`` choose one. The messages here say what actually repairs each state.
"""

from __future__ import annotations

from importlib import metadata

from onnxcampo.errors import OnnxRuntimeMissingError

CPU_WHEEL, GPU_WHEEL = "onnxruntime", "onnxruntime-gpu"
GPU_REQUIREMENT = "'onnxruntime-gpu[cuda,cudnn]'"  # the CUDA and cuDNN libraries as wheels too
CHOOSE = "pip install 'onnxcampo[cpu]' (CPU) or 'onnxcampo[gpu]' (CUDA), one of them"


def installed_wheels() -> set[str]:
    """The ONNX Runtime distributions pip has installed (of the CPU and CUDA ones)."""
    found = set()
    for name in (CPU_WHEEL, GPU_WHEEL):
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
    return found


def onnxruntime_error() -> Exception | None:
    """Why ONNX Runtime cannot be used here, or None. ``import onnxruntime`` alone is not enough:
    after ``pip uninstall onnxruntime`` next to ``onnxruntime-gpu`` the folder's leftovers still
    import (as a namespace package) without the compiled module."""
    try:
        import onnxruntime
        from onnxruntime.capi import onnxruntime_pybind11_state  # noqa: F401

        onnxruntime.InferenceSession  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return exc
    return None


def require_onnxruntime() -> None:
    """Raise :class:`OnnxRuntimeMissingError` (one line: what is wrong, what to run) unless
    ONNX Runtime imports whole."""
    exc = onnxruntime_error()
    if exc is not None:
        raise OnnxRuntimeMissingError(f"onnxcampo needs ONNX Runtime, but `import onnxruntime` fails ({exc}); "
                                      f"{_repair(installed_wheels())}") from exc


def _repair(wheels: set[str]) -> str:
    if wheels == {CPU_WHEEL, GPU_WHEEL}:
        return f"both {CPU_WHEEL} and {GPU_WHEEL} are installed and share one folder: {_reinstall_gpu()}"
    if wheels == {GPU_WHEEL}:  # e.g. after `pip uninstall onnxruntime` removed the shared files
        return f"{GPU_WHEEL}'s files are incomplete: pip install --force-reinstall --no-deps {GPU_WHEEL}"
    if wheels == {CPU_WHEEL}:
        return f"pip install --force-reinstall --no-deps {CPU_WHEEL}"
    return CHOOSE


def _reinstall_gpu() -> str:
    return (f"pip uninstall -y {CPU_WHEEL} {GPU_WHEEL} && pip install {GPU_REQUIREMENT} "
            f"(uninstalling {CPU_WHEEL} alone deletes files {GPU_WHEEL} needs)")


def cuda_provider_hint() -> str:
    """What to run when this onnxruntime has no CUDA execution provider."""
    wheels = installed_wheels()
    if wheels == {CPU_WHEEL, GPU_WHEEL}:
        return f"both {CPU_WHEEL} and {GPU_WHEEL} are installed and the CPU build's files won: {_reinstall_gpu()}"
    if wheels == {CPU_WHEEL}:
        return (f"this is the CPU build: pip uninstall -y {CPU_WHEEL} && pip install {GPU_REQUIREMENT} "
                "(or pip install 'onnxcampo[gpu]' in a fresh environment)")
    return f"install the CUDA build ({GPU_REQUIREMENT}, or pip install 'onnxcampo[gpu]')"
