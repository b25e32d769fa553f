"""Fetch the real-model corpus into the cache: ``python -m onnxcampo.benchmarks fetch-corpus``
(onnxcampo.benchmarks.fetch_corpus; the same options), kept as the set-up command of README.md."""

import sys

from onnxcampo.benchmarks.fetch_corpus import main

if __name__ == "__main__":
    sys.exit(main())
