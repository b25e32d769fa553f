"""The parser of every command: :func:`build_parser`, from the command modules' own
``add_parser`` and the shared groups of :mod:`onnxcampo.cli.options`."""

from __future__ import annotations

import argparse

from onnxcampo import __version__
from onnxcampo.cli import bench, costdb, inspect, optimize, train, train_graph
from onnxcampo.cli.options import EXAMPLE, Parser, add_common_options, add_verbosity_options, examples

# in the order --help lists them
COMMAND_MODULES = (optimize, inspect, train_graph, train, bench, costdb)
EPILOGS = {name: text for module in COMMAND_MODULES for name, text in module.EPILOGS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="onnxcampo", description="Cost-aware mixed-precision optimizer for ONNX graphs",
                    epilog=examples(f"onnxcampo optimize {EXAMPLE} out.onnx --input-shape x:16384,256 --validate",
                                    "onnxcampo COMMAND --help"))
    parser.add_argument("--version", action="version", version=f"onnxcampo {__version__}",
                        help="print the version and exit")
    add_common_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        for command in module.add_parser(sub):
            add_verbosity_options(command)
            add_common_options(command)
    return parser
