"""``onnxcampo inspect``: the precision plan, printed (summary, nodes table, JSON) or drawn
(``--html``), without writing a model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from onnxcampo.cli.options import EXAMPLE, add_model_argument, add_plan_options, config_from_args, examples
from onnxcampo.errors import ConfigError
from onnxcampo.report import summary

EPILOGS = {"inspect": examples(f"onnxcampo inspect {EXAMPLE} --input-shape x:16384,256 --nodes",
                               "onnxcampo inspect model.onnx --dim batch=1 --policy amp")}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    ins = sub.add_parser("inspect", epilog=EPILOGS["inspect"], help="print the precision plan without writing a model")
    add_model_argument(ins)
    add_plan_options(ins)
    ins.add_argument("--nodes", action="store_true",
                     help="print the nodes table: one line per node (and per Cast or Pad/Slice onnxcampo inserts) "
                          "with its precision, op type, its own predicted fp32 and fp16 times, the Casts it causes "
                          "(a Cast belongs to the fp16 side of its boundary, shared equally among the fp16 nodes "
                          "reading it), its name and the reason")
    ins.add_argument("--op", action="append", default=[], metavar="OP",
                     help="nodes table and --json: only nodes of this op type (repeatable; implies --nodes)")
    ins.add_argument("--precision", choices=("fp16", "fp32", "inserted"),
                     help="nodes table and --json: only nodes of this precision, or the nodes onnxcampo inserts "
                          "(implies --nodes)")
    ins.add_argument("--name", metavar="REGEX",
                     help="nodes table and --json: only nodes whose names match (re.search; implies --nodes)")
    ins.add_argument("--json", action="store_true",
                     help="print the report (as optimize --report writes it) as JSON on stdout, with the nodes "
                          "table's rows as its nodes entry, instead of the text")
    ins.add_argument("--html", type=Path, metavar="FILE.html",
                     help="write the plan as one self-contained page (written atomically): the planned graph "
                          "coloured by precision, inserted Casts and Pad/Slice marked, a node's reason and predicted "
                          "times on click, a searchable nodes table, the summary counts and every plan's predicted "
                          "time")
    return [ins]


def run(args: argparse.Namespace) -> int:
    import re

    from onnxcampo import ir
    from onnxcampo.api import optimize
    from onnxcampo.report.plan_html import write_html
    from onnxcampo.report.plan_view import filter_rows, node_rows, table

    if args.name is not None:
        try:
            re.compile(args.name)
        except re.error as exc:
            raise ConfigError(f"--name {args.name!r} is no regular expression: {exc}") from None
    if args.html is not None:
        ir.check_output_path(args.html, args.input if args.input.exists() else None)
    result = optimize(args.input, config=config_from_args(args), accuracy="off")
    rows = filter_rows(node_rows(result.report), ops=args.op, precision=args.precision, name=args.name)
    if args.json:
        print(json.dumps({**result.report, "nodes": [row.to_json() for row in rows]}, indent=1))
    else:
        print(summary(result.report, None))
        if args.nodes or args.op or args.precision or args.name:
            print(table(rows))
    if args.html is not None:
        write_html(args.html, result.model, result.report, title=args.input.name)
        print(f"onnxcampo: wrote {args.html}", file=sys.stderr)
    return 0
