import sys

from onnxcampo.cli import main

sys.exit(main())
