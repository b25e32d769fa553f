"""``python -m benchkit`` (from inside scripts/): the benchmark suite, as ``python3 scripts/bench.py``."""

import sys

from benchkit.runner import main

sys.exit(main())
