"""Loss curves of the training variants against fp32 (scripts/benchkit/loss_curves.py says what
it measures and how to run it).

Run as a file path from the repository root, ``python3 scripts/loss_curves.py ...``: scripts/ is
then first on sys.path, so the harness package ``benchkit`` beside this file imports and
./onnxcampo does not shadow the installed onnxcampo.
"""

import sys

from benchkit.loss_curves import main

if __name__ == "__main__":
    sys.exit(main())
