"""The benchmark harness: onnxcampo's policies against the anchors, inference and training.

Modules:
    runner       the suite: work list, budgets, measuring groups, interleaving (``scripts/bench.py``)
    results      keys, the JSON-lines files, resuming and killed items
    models       the benchmarked models (built in code, exported from torch, or from the corpus)
    policies     the variants compared and how each model file is made; extra wheels
    measure      timing, output errors, traces, the training-step breakdown (through onnxcampo.runtime)
    torch_twins  the PyTorch training variants (torch imported only when they run)
    report       JSON lines -> docs/benchmarks/h200.md, .json and plots (``scripts/bench_report.py``)
    custom_ops   the custom-op kernels and training steps with them (``scripts/bench_ops.py``)
    loss_curves  the training variants' loss curves over many steps against fp32 (``scripts/loss_curves.py``)

How it runs: the launchers ``scripts/bench.py``, ``scripts/bench_report.py`` and
``scripts/bench_ops.py`` are run as file paths from the repository root (``python3 scripts/bench.py
...``): Python then puts ``scripts/`` first on ``sys.path``, so ``benchkit`` imports and the
repository's ``./onnxcampo`` source folder does not shadow the installed package. From inside
``scripts/``, ``python -m benchkit ...`` runs the suite (``python -m benchkit.report ...``,
``python -m benchkit.custom_ops ...`` the others). ``python -m`` from the repository root does not
work on a ``--target`` install (``./onnxcampo`` lacks the mapped ``passes``/``costdb``). Tests reach
the package through pytest's ``pythonpath`` option (pyproject.toml).
"""
