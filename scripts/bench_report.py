"""The benchmark report (scripts/benchkit/report.py says what it writes and how to run it).

Run as a file path from the repository root, ``python scripts/bench_report.py docs/benchmarks/raw``
(scripts/ is then first on sys.path, so the harness package ``benchkit`` beside this file imports).
"""

import sys

from benchkit.report import main

if __name__ == "__main__":
    sys.exit(main())
