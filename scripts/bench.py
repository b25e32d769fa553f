"""The benchmark suite (scripts/benchkit/runner.py says what it does and how to run it).

Run as a file path from the repository root, ``python3 scripts/bench.py ...``: scripts/ is then
first on sys.path, so the harness package ``benchkit`` beside this file imports and ./onnxcampo
does not shadow the installed onnxcampo.
"""

import sys

from benchkit.runner import main

if __name__ == "__main__":
    sys.exit(main())
