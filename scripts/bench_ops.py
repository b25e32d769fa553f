"""The custom-op benchmark (scripts/benchkit/custom_ops.py says what it measures and how to run it).

Run as a file path from the repository root, ``python3 scripts/bench_ops.py --provider cuda ...``
(scripts/ is then first on sys.path, so the harness package ``benchkit`` beside this file imports).
"""

import sys

from benchkit.custom_ops import main

if __name__ == "__main__":
    sys.exit(main())
