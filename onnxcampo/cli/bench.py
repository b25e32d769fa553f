"""``onnxcampo bench``: a model optimized under several policies, timed side by side on ONNX
Runtime (:mod:`onnxcampo.bench`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxcampo.cli.options import (add_cost_options, add_experimental_option, add_model_argument, add_provider_option,
                                   add_shape_options, cost_fields, examples, group)
from onnxcampo.config import EXECUTION_MODES, POLICIES, OptimizeConfig, parse_dim_value, parse_input_shape

EPILOGS = {"bench": examples("onnxcampo bench model.onnx --dim batch=32 --policies fp32,amp,campo --json bench.json",
                             "onnxcampo bench model.onnx --dim batch=1 --execution cuda-graph --rounds 20")}


def add_parser(sub) -> list[argparse.ArgumentParser]:
    bn = sub.add_parser("bench", epilog=EPILOGS["bench"], help="optimize a model under several policies and time them side by side on ORT")
    add_model_argument(bn)
    timed = group(bn, "policies and timing")
    timed.add_argument("--policies", default="fp32,fp16,amp,campo", metavar="P1,P2,...",
                    help=f"comma-separated policies of {', '.join(POLICIES)} (default fp32,fp16,amp,campo; fp32 is "
                         "always timed: it is the reference)")
    add_provider_option(timed, "cuda")
    timed.add_argument("--execution", choices=EXECUTION_MODES, default="plain",
                    help="plain (node by node, default) or cuda-graph (captured once and replayed; --provider cuda); "
                         "the plans are costed for it too")
    add_shape_options(bn, "The inputs of --inputs pin the dynamic dims nothing else pins")
    timed.add_argument("--inputs", type=Path, metavar="FILE.npz", help="inputs to run on (default: random)")
    timed.add_argument("--json", type=Path, metavar="FILE.json",
                    help='write the results as JSON (atomically): {"policies": {name: {"ms", "min_ms", "max_ms", '
                         '"q1_ms", "q3_ms", "blocks_ms", "speedup", "rel_err", "casts", ...}}, "provider", '
                         '"execution", "plan_options", ...}')
    timed.add_argument("--rounds", type=int, default=10, metavar="N",
                    help="rotation rounds: each times one block of every policy, in a rotated order (default 10)")
    timed.add_argument("--block-ms", type=float, default=20.0, metavar="MS",
                    help="a timed block lasts at least this long (default 20)")
    add_cost_options(bn)  # every policy is optimized with them
    add_experimental_option(bn)
    return [bn]


def run(args: argparse.Namespace) -> int:
    from onnxcampo import ir
    from onnxcampo.bench import bench, write_json

    if args.json is not None:
        ir.check_output_path(args.json, args.input if args.input.exists() else None)
    result = bench(args.input, policies=args.policies, provider=args.provider, execution=args.execution,
                   input_shapes=dict(parse_input_shape(text) for text in args.input_shape),
                   dim_values=dict(parse_dim_value(text) for text in args.dim), inputs=args.inputs,
                   rounds=args.rounds, block_ms=args.block_ms,
                   config=OptimizeConfig(**cost_fields(args)))
    print(result.table())
    if args.json is not None:
        write_json(result, args.json)
        print(f"onnxcampo: wrote {args.json}", file=sys.stderr)
    return 0
