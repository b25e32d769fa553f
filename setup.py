"""Wheel tags: the metadata lives in pyproject.toml; this file only tags the wheel.

A wheel built after ``python -m onnxcampo.ops.build`` carries ``onnxcampo/ops/lib/*.so``, a
library compiled for this machine's platform (x86-64 Linux, say), which ONNX Runtime loads by path:
such a wheel is tagged ``py3-none-<platform>`` (any Python 3, no Python ABI, this platform), not
``py3-none-any``. Without the library the wheel stays pure Python.
"""

from pathlib import Path

from setuptools import Distribution, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel  # setuptools >= 70.1
except ImportError:  # older setuptools: the wheel package's command
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

LIBRARY = Path(__file__).resolve().parent / "onnxcampo" / "ops" / "lib"


def _carries_library() -> bool:
    return any(LIBRARY.glob("*.so"))


class LibraryDistribution(Distribution):
    def has_ext_modules(self):
        return _carries_library() or super().has_ext_modules()  # not pure: platform tag, platlib


class bdist_wheel(_bdist_wheel):
    def get_tag(self):
        python, abi, platform = super().get_tag()
        if _carries_library() and not self.distribution.ext_modules:
            return "py3", "none", platform  # no extension module: any Python 3 loads it
        return python, abi, platform


setup(distclass=LibraryDistribution, cmdclass={"bdist_wheel": bdist_wheel})
