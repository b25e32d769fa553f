"""Command line: ``onnxcampo optimize | inspect | bench | train-graph | train | costdb
{calibrate | measure | fit | fit-step-dispatch | fit-fused-elementwise | eval}``.

One module per command (:mod:`~onnxcampo.cli.optimize`, :mod:`~onnxcampo.cli.inspect`,
:mod:`~onnxcampo.cli.bench`, :mod:`~onnxcampo.cli.train_graph`, :mod:`~onnxcampo.cli.train`,
:mod:`~onnxcampo.cli.costdb`), each with its ``add_parser`` and ``run``; the argument groups they
share, and the :class:`~onnxcampo.config.OptimizeConfig` they make, in :mod:`~onnxcampo.cli.options`;
:func:`build_parser` in :mod:`~onnxcampo.cli.parser`; :func:`main` in :mod:`~onnxcampo.cli.program`.
The commands are thin over the Python API: ``optimize`` is :func:`onnxcampo.optimize` with its
accuracy check, then the file written.

User errors print one line on stderr and exit 2 (validation failures exit 1); no traceback
unless ``--debug``. Options are never abbreviated (a usage error names the closest one); ``-q``
keeps only warnings and errors on stderr, ``--log-file`` writes the full log; messages of the code
shared with the Python API name flags here (:func:`onnxcampo.errors.command_line`).

Every option is described once, in its help text in its command's module: ``docs/guide/cli-reference.md``
is rendered from :func:`build_parser` (``python -m onnxcampo.cli.reference``), and a test fails
when it is out of date.
"""

from onnxcampo.cli.options import config_from_args
from onnxcampo.cli.parser import EPILOGS, build_parser
from onnxcampo.cli.program import OncePerRun, main
from onnxcampo.report import summary

__all__ = ["EPILOGS", "OncePerRun", "build_parser", "config_from_args", "main", "summary"]
