"""``python -m onnxcampo.benchmarks SUBCOMMAND [options]``: one subcommand a tool, each with the
options of its module's ``main`` (``SUBCOMMAND --help``). Modules are imported only when their
subcommand runs."""

from __future__ import annotations

import importlib
import sys

PROG = "python -m onnxcampo.benchmarks"

# subcommand: (module, what it does)
COMMANDS = {
    "run": ("runner", "the benchmark suite: policies against the anchors, inference and training"),
    "report": ("report", "the suite's JSON lines -> docs/benchmarks/h200.md, .json and plots"),
    "ops": ("custom_ops", "the custom-op kernels, and training steps with them"),
    "loss-curves": ("loss_curves", "training variants' loss curves over many steps against fp32"),
    "rotate": ("rotate_training", "one model's training steps side by side, in rotation, in one process"),
    "tool": ("tool", "speed and memory of onnxcampo.optimize itself"),
    "prediction-metrics": ("prediction_metrics", "the cost model's plan times against the measured runs"),
    "graph-factors": ("graph_factors", "per-class factors of single-op times inside whole graphs"),
    "host-overlap": ("host_overlap", "the share of host launch time a plain run adds, fitted from whole runs"),
    "profile-step": ("profile_step", "where a training step's time goes, per op type"),
    "profile-variants": ("profile_variants", "where a model's inference time goes under several policies"),
    "probe-options": ("probe_options", "a benchmark variant timed under several CUDA EP option sets"),
    "probe-cl-inference": ("probe_cl_inference", "ResNet-50 inference, NCHW against channels-last (CUPTI)"),
    "probe-torch-layout": ("probe_torch_layout", "ResNet-50's PyTorch step, NCHW against channels_last"),
    "executed-counts": ("executed_counts", "nodes ORT's CPU and CUDA providers leave of the same models"),
    "fused-elementwise-costs": ("fused_elementwise_costs", "FusedElementwise's cost on this GPU, fitted"),
    "avg-matmul": ("avg_matmul", "AvgMatMulInteger against 32-bit accumulation on the CPU"),
    "train-parity": ("train_parity", "training accuracy parity of fp32, amp and campo step graphs"),
    "finetune": ("finetune", "the fine-tuning example: magika with a new head, a loss curve"),
    "fetch-corpus": ("fetch_corpus", "fetch the real-model corpus into the cache and describe it"),
    "survey-corpus": ("survey_corpus", "the corpus survey tables (docs/corpus-survey.md)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} SUBCOMMAND [options]", "", "SUBCOMMAND --help shows its options.", "",
             "subcommands:"]
    lines += [f"  {name:{width}s}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{PROG}: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"onnxcampo.benchmarks.{COMMANDS[name][0]}")
    # the tool parses sys.argv as when it was a script of its own: its --help and the command
    # lines it records name the subcommand
    sys.argv = [f"{PROG} {name}", *rest]
    return module.main()


if __name__ == "__main__":
    sys.exit(main())
