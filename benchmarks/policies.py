"""The variants the benchmark compares and how each model file is made.

Inference (ONNX Runtime):
    fp32            the model as exported, TF32 on (ORT's default)
    fp32-notf32     the same, ``use_tf32=0``
    occ-fp16        onnxconverter-common ``convert_float_to_float16(keep_io_types=True)``
    ort-fp16        ``onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types=True)``
                    then a toposort (onnx-graphsurgeon), since its graphs are not sorted
    modelopt        NVIDIA ModelOpt AutoCast ``convert_to_mixed_precision`` (fp16, keep_io_types,
                    calibrated on the benchmark's inputs, ORT CPU)
    amp, fp16, campo  onnxcampo's policies
    campo-nopad     campo without Tensor Core padding (ablation)
    campo-nocost    campo's passes with a cost-blind model (ablation): fp16 always 2x faster
                    (4x when Tensor-Core aligned), Casts and Pads free, no plan comparison
    campo-tune      campo's candidate plans timed on the benchmark's provider and inputs (``tune``)
    campo-calib     campo with ``activation_limit=512`` calibrated on the benchmark's inputs (nodes
                    reading or writing values beyond 512 stay fp32: ModelOpt's data_max)
    campo-fused     campo with every fusion of the custom-op library: ``--fuse-reductions``
                    (block ReduceSums and their Casts as BlockReduceSum nodes) and
                    ``--fuse-elementwise`` (elementwise chains and their Casts as FusedElementwise
                    nodes); campo-fused-graph the same planned for and replayed as a CUDA graph;
                    campo-reduce(-graph) the reductions alone, campo-ew-graph the elementwise chains alone;
                    campo-fused-cudnn-graph / campo-fused-gemm-graph (training) campo-fused-graph on a
                    step graph built with ``conv_weight_grad="cudnn"`` (ConvWeightGrad for every Conv
                    weight gradient) / ``"gemm"`` (the Gemm over Im2Col); the group's own step takes
                    build_train_step's default (cudnn where the CUDA provider and kernels are)
    campo-fused-yield-graph  campo-fused-graph with ``yield_to_ort_fusions``: the nodes ONNX
                    Runtime fuses itself are left to it
    campo-fused-norows-graph  campo-fused-graph without LayerNormGrad / SoftmaxGrad
    campo-fused-bnsums-graph, campo-fused-cl-bnsums-graph  campo-fused-graph and campo-fused-cl-graph
                    with ``batchnorm_sums``: a training BatchNorm's sums as BatchNormStats /
                    BatchNormGradSums nodes (one pass each pair): their A/B
    campo-fused-means-graph, campo-fused-cl-means-graph  campo-fused-graph and campo-fused-cl-graph
                    with ``means_end_deny``: deny propagation ends at a sum scaled to a mean (a
                    training BatchNorm's backward then plans by cost): their A/B
    campo-fused-cl-graph, fp16-fused-cl-graph, campo-fused-cl  campo-fused-graph, fp16-fused-graph and
                    campo-fused with ``channels_last`` (the convolutions as ai.onnxcampo's NHWC ops,
                    their activations channels-last: onnxcampo.rewrites.layout)
    campo-fused-nosums-graph, campo-fused-cl-nosums-graph  campo-fused-graph and
                    campo-fused-cl-graph with ``fuse_column_sums=False``: the bias gradients' column
                    sums as BlockReduceSum nodes, not in the elementwise kernels: their A/B
    campo-static(-graph)  campo with default options, the model written fixed at the benchmark's
                    input shapes (``static_shapes``): the rewrites then apply to dynamic-batch models
    campo-fused-cl-nostem-graph  campo-fused-cl-graph with ``channels_last_stem=0``: the stem
                    convolution and the MaxPool NCHW (as before MaxPoolNhwc): their A/B
    campo-fused-cl-stem4-graph  campo-fused-cl-graph with the stem's input padded to 4 channels
                    (``channels_last_stem=4``, the default: the same model)
    campo-fused-cl-stem8-graph  campo-fused-cl-graph with the stem's input padded to 8 channels
                    (``channels_last_stem=8``, the default before): their A/B
                    (``fuse_row_gradients=False``): their elementwise parts fused, reductions apart
    campo-fused-nhwc-graph  (training) campo-fused-graph's model in a session with the CUDA EP's
                    ``prefer_nhwc`` (Convs and their neighbours in NHWC; ORT 1.31 has no NHWC
                    ConvTranspose, so a CNN step's dgrads go to the CPU and its graph cannot be
                    captured: docs/benchmarks/training-steps.md)
    campo-fused-blind-graph  campo-fused-graph's fusions and replay, its plan made fusion-blind
                    (``plan_for_fusion=False``: costed as if no fusion ran); beside campo-fused-graph
                    it shows what planning with fusion in view buys, predicted and measured
    fp16-fused      (training) the all-fp16 plan with both fusions, plain (its CUPTI breakdown
                    beside campo-fused's: where the two plans' kernels differ)
    fp16-fused-graph  the all-fp16 plan with both fusions, replayed: the all-fp16 plan that
                    campo-fused-graph must beat on equal terms
    fp32-fused(-graph)  the fp32 plan with both fusions (its convolutions stay NCHW): the fp32 step
                    with onnxcampo's kernels, against torch.compile fp32
    campo-auto, campo-auto-graph  campo with the three rewrites left to optimize's default
                    (``fuse_elementwise``, ``fuse_reductions``, ``channels_last`` None: decided by
                    their predicted cost where the library's CUDA kernels run), plain and replayed:
                    what the prediction chose, beside campo-fused(-cl)(-graph); campo-auto-rawmask the
                    same with a BERT Attention's raw padding mask (``attention_bias=False``)
Training (step graphs from ``build_train_step``; fp32 variants are the step graph unoptimized):
    fp32, fp32-notf32, amp, fp16, campo, campo-nopad, campo-nocost, campo-fused, campo-reduce
    (``--fuse-reductions`` alone)
    torch-eager, torch-eager-amp, torch-compile, torch-compile-amp   (see torch_twins.py), and for
    image models the same four in channels_last: torch-eager-cl, torch-eager-amp-cl,
    torch-compile-cl, torch-compile-amp-cl; torch-compile-graph, torch-compile-graph-amp (and
    -cl): torch.compile(mode="reduce-overhead"), the compiled step replayed as CUDA graphs

Anchors, what a user picks today and what campo must beat: fp32 (TF32), occ-fp16, ort-fp16,
modelopt and amp (greedy, cast-blind; TensorFlow AMP's painting) for inference; fp32, amp and the
PyTorch variants for training.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

# "-graph": the same model or step graph replayed as a CUDA graph (ORT's enable_cuda_graph), CUDA only
# (onnxcampo's -graph variants are planned for the replay: ``execution="cuda-graph"``)
GRAPH_POLICIES = ("fp32-graph", "amp-graph", "fp16-graph", "campo-graph", "campo-fused-graph", "campo-reduce-graph",
                  "campo-ew-graph", "campo-fused-blind-graph", "fp16-fused-graph", "campo-fused-cudnn-graph",
                  "campo-fused-gemm-graph", "campo-fused-yield-graph", "campo-fused-nhwc-graph",
                  "campo-fused-norows-graph", "campo-fused-cl-graph", "fp16-fused-cl-graph",
                  "campo-fused-cl-nostem-graph", "campo-fused-cl-stem4-graph", "campo-fused-cl-stem8-graph",
                  "campo-fused-nosums-graph", "campo-fused-cl-nosums-graph", "campo-auto-graph",
                  "campo-static-graph", "fp32-fused-graph", "campo-fused-bnsums-graph", "campo-fused-cl-bnsums-graph",
                  "campo-fused-means-graph", "campo-fused-cl-means-graph")
# Training policies whose step graph is built otherwise than the group's (build_train_step's
# options): campo-fused-cudnn-graph is campo-fused-graph on a step whose Conv weight gradients are
# ai.onnxcampo::ConvWeightGrad (cuDNN's backward filter), campo-fused-gemm-graph on one whose are
# Im2Col + Gemm, whatever build_train_step's default picks for the group's step.
STEP_OPTIONS = {"campo-fused-cudnn-graph": {"conv_weight_grad": "cudnn"},
                "campo-fused-gemm-graph": {"conv_weight_grad": "gemm"}}
# Training policies whose session gets CUDA EP options of its own: campo-fused-nhwc-graph runs
# campo-fused-graph's model with ``prefer_nhwc`` (ORT's layout transformer puts Conv, pooling and
# their neighbours in NHWC; cuDNN's NCHW <-> NHWC transforms around each Conv go).
CUDA_OPTIONS = {"campo-fused-nhwc-graph": {"prefer_nhwc": "1"}}
INFERENCE_POLICIES = ("fp32", "fp32-notf32", "occ-fp16", "ort-fp16", "ortopt-fp16", "modelopt", "amp", "fp16",
                      "campo", "campo-nopad", "campo-nocost", "campo-tune", "campo-calib", "campo-fused", "campo-reduce",
                      "campo-fused-cl", "campo-auto", "campo-auto-rawmask", *(p for p in GRAPH_POLICIES if p not in STEP_OPTIONS and p not in CUDA_OPTIONS))
TORCH_POLICIES = ("torch-eager", "torch-eager-amp", "torch-compile", "torch-compile-amp",
                  "torch-eager-cl", "torch-eager-amp-cl", "torch-compile-cl", "torch-compile-amp-cl",
                  "torch-compile-graph", "torch-compile-graph-amp", "torch-compile-graph-cl",
                  "torch-compile-graph-amp-cl")
TRAINING_POLICIES = ("fp32-notf32", "fp32", "amp", "fp16", "campo", "campo-nopad", "campo-nocost", "campo-tune",
                     "campo-fused", "campo-reduce", "fp16-fused", "campo-fused-cl", "fp32-fused",
                     *GRAPH_POLICIES,
                     *TORCH_POLICIES)
INFERENCE_ANCHORS = ("fp32", "occ-fp16", "ort-fp16", "ortopt-fp16", "modelopt", "amp")
TRAINING_ANCHORS = ("fp32", "amp", *TORCH_POLICIES)
FUSIONS = {"fuse_reductions": True, "fuse_elementwise": True}  # what campo-fused(-graph) turn on
AUTO = dict.fromkeys(("fuse_elementwise", "fuse_reductions", "channels_last"))  # optimize's default decides
REFERENCE = "fp32-notf32"  # outputs and losses are compared with fp32 without TF32
ONNXCAMPO = {"amp": {"policy": "amp"}, "fp16": {"policy": "fp16"}, "campo": {"policy": "campo"},
             "campo-nopad": {"policy": "campo", "experimental": {"pad_tensor_cores": False}},
             "campo-nocost": {"policy": "campo", "experimental": {"compare_plans": False}, "blind": True},
             # campo's candidate plans timed on the benchmark's provider and inputs (optimize's tune)
             "campo-tune": {"policy": "campo", "tune": True},
             # campo with default options on the model written fixed at the benchmark's shapes
             # (experimental static_shapes: the rewrites, which act on static shapes, can apply to a
             # corpus model's dynamic batch), plain and replayed
             "campo-static": {"policy": "campo", "experimental": {"static_shapes": True}},
             "campo-static-graph": {"policy": "campo", "execution": "cuda-graph", "experimental": {"static_shapes": True}},
             # campo calibrated on the benchmark's inputs like ModelOpt (inference only)
             "campo-calib": {"policy": "campo", "activation_limit": 512.0},
             # planned for CUDA-graph replay, and replayed (GRAPH_POLICIES)
             "amp-graph": {"policy": "amp", "execution": "cuda-graph"},
             "fp16-graph": {"policy": "fp16", "execution": "cuda-graph"},
             "campo-graph": {"policy": "campo", "execution": "cuda-graph"},
             # all fusions of the custom-op library: block ReduceSums as BlockReduceSum, elementwise
             # chains as FusedElementwise (their Casts folded into both)
             "campo-fused": {"policy": "campo", **FUSIONS},
             "campo-fused-graph": {"policy": "campo", "execution": "cuda-graph", **FUSIONS},
             "campo-fused-cudnn-graph": {"policy": "campo", "execution": "cuda-graph", **FUSIONS},
             "campo-fused-gemm-graph": {"policy": "campo", "execution": "cuda-graph", **FUSIONS},
             "campo-fused-nhwc-graph": {"policy": "campo", "execution": "cuda-graph", **FUSIONS},
             # the same fusions and replay, the plan made as if they did not run (the fusion-blind plan)
             "campo-fused-blind-graph": {"policy": "campo", "execution": "cuda-graph",
                                         "experimental": {"plan_for_fusion": False}, **FUSIONS},
             # the same fusions and replay, the nodes ORT fuses itself left to it (yield_to_ort_fusions)
             "campo-fused-yield-graph": {"policy": "campo", "execution": "cuda-graph",
                                         "experimental": {"yield_to_ort_fusions": True}, **FUSIONS},
             # the same without LayerNormGrad / SoftmaxGrad (fuse_row_gradients=False): their A/B
             "campo-fused-norows-graph": {"policy": "campo", "execution": "cuda-graph",
                                          "experimental": {"fuse_row_gradients": False}, **FUSIONS},
             # the same with the column sums as BlockReduceSum nodes (fuse_column_sums=False): their A/B
             "campo-fused-nosums-graph": {"policy": "campo", "execution": "cuda-graph",
                                          "experimental": {"fuse_column_sums": False}, **FUSIONS},
             # the same with a training BatchNorm's sums in one pass a pair (batchnorm_sums): their A/B
             "campo-fused-bnsums-graph": {"policy": "campo", "execution": "cuda-graph",
                                          "experimental": {"batchnorm_sums": True}, **FUSIONS},
             "campo-fused-cl-bnsums-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                             "experimental": {"batchnorm_sums": True}, **FUSIONS},
             # the same with deny propagation ended at means (means_end_deny): their A/B
             "campo-fused-means-graph": {"policy": "campo", "execution": "cuda-graph",
                                         "experimental": {"means_end_deny": True}, **FUSIONS},
             "campo-fused-cl-means-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                            "experimental": {"means_end_deny": True}, **FUSIONS},
             # the convolutions channels-last (onnxcampo.rewrites.layout), with both fusions
             "campo-fused-cl": {"policy": "campo", "channels_last": True, **FUSIONS},
             "campo-fused-cl-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True, **FUSIONS},
             "fp16-fused-cl-graph": {"policy": "fp16", "execution": "cuda-graph", "channels_last": True, **FUSIONS},
             # the same with the stem convolution and the MaxPool NCHW (channels_last_stem=False): their A/B
             "campo-fused-cl-nostem-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                             "experimental": {"channels_last_stem": 0}, **FUSIONS},
             # the same with the column sums as BlockReduceSum nodes: their A/B
             "campo-fused-cl-nosums-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                             "experimental": {"fuse_column_sums": False}, **FUSIONS},
             # the same with the stem's input padded to 4 channels, the layout of cuDNN's image_first_layer kernels
             "campo-fused-cl-stem4-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                            "experimental": {"channels_last_stem": 4}, **FUSIONS},
             # the same padded to 8 channels (channels_last_stem=8)
             "campo-fused-cl-stem8-graph": {"policy": "campo", "execution": "cuda-graph", "channels_last": True,
                                            "experimental": {"channels_last_stem": 8}, **FUSIONS},
             # the fp32 plan with the same fusions and replay: the fp32 step with onnxcampo's kernels
             # (the plain "fp32" variant is the step graph as built), against torch.compile fp32
             "fp32-fused": {"policy": "fp32", **FUSIONS},
             "fp32-fused-graph": {"policy": "fp32", "execution": "cuda-graph", **FUSIONS},
             # the all-fp16 plan with the same fusions and replay: campo-fused-graph's fair fp16 comparison
             "fp16-fused-graph": {"policy": "fp16", "execution": "cuda-graph", **FUSIONS},
             # its plain run (for a CUPTI breakdown beside campo-fused's)
             "fp16-fused": {"policy": "fp16", **FUSIONS},
             # the reductions alone (BlockReduceSum), without FusedElementwise
             "campo-reduce": {"policy": "campo", "fuse_reductions": True},
             "campo-reduce-graph": {"policy": "campo", "execution": "cuda-graph", "fuse_reductions": True},
             # the elementwise chains alone (FusedElementwise), without BlockReduceSum
             "campo-ew-graph": {"policy": "campo", "execution": "cuda-graph", "fuse_elementwise": True},
             # the rewrites left to optimize's default: decided by their predicted cost (AUTO)
             "campo-auto": {"policy": "campo", **AUTO},
             # the same with a BERT Attention's raw padding mask (attention_bias=False): their A/B
             "campo-auto-rawmask": {"policy": "campo", "experimental": {"attention_bias": False}, **AUTO},
             "campo-auto-graph": {"policy": "campo", "execution": "cuda-graph", **AUTO}}
# The fusions are named by each variant: optimize's default (on for a training step where the
# fused CUDA kernels are) would otherwise turn the unfused variants and the amp/fp16 anchors into
# fused ones on the GPU machine.
for _options in ONNXCAMPO.values():
    _options.setdefault("fuse_elementwise", False)
    _options.setdefault("fuse_reductions", False)
    _options.setdefault("channels_last", False)

# Wheels the anchors need on the GPU machine (scripts/bench_wheels.sh downloads them into .benchwheels).
PACKAGE_DIR = Path(os.environ.get("ONNXCAMPO_BENCH_PKGS", "/tmp/benchpkgs"))


class Unavailable(RuntimeError):
    """A variant that cannot run here (a package is missing); recorded, not retried with --retry-failed only."""


def tf32_of(policy: str) -> bool:
    return policy != "fp32-notf32"


def cuda_options_of(policy: str) -> dict[str, str] | None:
    """The CUDA EP options a policy's session adds (CUDA_OPTIONS), or None."""
    return CUDA_OPTIONS.get(policy)


def graph_base(policy: str) -> str:
    """The policy whose model or step graph a ``-graph`` policy replays (``fp32-graph`` ->
    ``fp32``); onnxcampo's own -graph policies are made for the replay (``ONNXCAMPO``)."""
    return policy if policy in ONNXCAMPO else policy.removesuffix("-graph")


# --------------------------------------------------------------------------------------------
# extra packages
# --------------------------------------------------------------------------------------------


def install_wheels(wheel_dir: Path, target: Path = PACKAGE_DIR) -> str:
    """Install the wheels of ``wheel_dir`` that fit this Python into ``target`` (offline, no deps)
    once, and put ``target`` at the END of sys.path (packages already installed win)."""
    if not wheel_dir.is_dir():
        return f"no wheel folder {wheel_dir}; anchors needing extra packages may be unavailable"
    marker = target / ".installed"
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not marker.is_file() or marker.read_text() != "\n".join(w.name for w in wheels):
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename

        supported = set(sys_tags())
        fitting = [w for w in wheels if parse_wheel_filename(w.name)[3] & supported]
        target.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                   "--upgrade", "--target", str(target), *map(str, fitting)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"pip install of {len(fitting)} wheels failed: {done.stderr.strip()[-300:]}"
        marker.write_text("\n".join(w.name for w in wheels))
    # the one sys.path change of the harness, on purpose: the anchors' optional packages, installed
    # at run time on the GPU machine, go last so that nothing already installed is shadowed
    if str(target) not in sys.path:
        sys.path.append(str(target))
    return f"{len(wheels)} wheels in {target}"


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("onnx", "onnxruntime-gpu", "onnxruntime", "onnx-graphsurgeon", "onnx-ad", "onnxconverter-common",
                 "nvidia-modelopt", "polygraphy", "onnxslim", "numpy", "torch", "torchvision", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    import onnxruntime

    # the GPU image has CPU onnxruntime installed too: say which one the run imported
    out["onnxruntime (imported)"] = f"{onnxruntime.__version__} {Path(onnxruntime.__file__).parent}"
    return out


# --------------------------------------------------------------------------------------------
# making each variant's model
# --------------------------------------------------------------------------------------------


def _save(model: onnx.ModelProto, path: Path) -> None:
    """Write a converter's output; IR version at most 10, since converters that build a new model
    with onnx 1.23 write IR 14, which ONNX Runtime 1.31 rejects (DESIGN.md)."""
    from onnxcampo import ir

    if model.ir_version > 10:
        model.ir_version = 10
    ir.save_model(model, path)


class BlindCostModel:
    """The ``campo-nocost`` ablation: campo's passes priced without any measurement.

    fp16 halves every op's time (quarters it when Tensor-Core aligned, so padding always looks
    worth it), Casts and Pads cost nothing: what a cast-blind greedy converter assumes.
    """

    def __new__(cls):
        from onnxcampo.costdb.analytic import AnalyticCostModel
        from onnxcampo.costdb.model import CostModel

        class _Blind(CostModel):
            name = "blind (ablation: fp16 always faster, Casts and Pads free)"

            def __init__(self):
                self.base = AnalyticCostModel()

            def fp32_time(self, features):
                return self.base.fp32_time(features)

            def fp16_time(self, features, fp32_time):
                return fp32_time * (0.25 if features.tensor_core_aligned else 0.5)

            def cast_time(self, elements):
                return 0.0

            def pad_time(self, elements, kind="Pad"):
                return 0.0
        return _Blind()


@contextlib.contextmanager
def _cost_model(blind: bool):
    if not blind:
        yield
        return
    import onnxcampo.api as api

    saved = api.load_cost_model
    api.load_cost_model = lambda device_db=None: BlindCostModel()
    try:
        yield
    finally:
        api.load_cost_model = saved


def run_onnxcampo(policy: str, source: Path, target: Path, shapes: dict[str, tuple[int, ...]], *,
                  provider: str = "cuda", inputs: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """``inputs``: what ``campo-tune`` times its candidates on (the benchmark's feeds or batch)."""
    import onnxcampo

    options = dict(ONNXCAMPO[policy])
    blind = options.pop("blind", False)
    if options.get("tune"):
        options["tune"] = provider
    with _cost_model(blind):
        calibrated = options.get("tune") or options.get("activation_limit") is not None
        result = onnxcampo.optimize(str(source), input_shapes=shapes, inputs=inputs if calibrated else None,
                                     accuracy="off", **options)  # the harness compares the outputs itself
    report = result.report
    if options.get("channels_last") and not (report.get("channels_last") or {}).get("convolutions"):
        raise Unavailable("channels_last: no convolution of this model is stored channels-last (the model would "
                          "be campo-fused's)")
    _save(result.model, target)
    return {"chosen_plan": report.get("chosen_plan"), "nodes_fp16": report.get("nodes_fp16"),
            # the cost model's prediction of every plan it compared, for the prediction metrics
            "execution": report.get("execution"), "cost_graph": report.get("cost_graph"),
            "ort_nodes": report.get("ort_nodes"), "fuse": report.get("fuse"),
            "predicted_us": {plan: entry.get("total_us") for plan, entry in (report.get("predicted_us") or {}).items()},
            # the chosen plan's predicted time (the policy's entry is the plan kept: choose_plan)
            "predicted_plan_us": ((report.get("predicted_us") or {}).get(options["policy"]) or {}).get("total_us"),
            "plan_for_fusion": options.get("experimental", {}).get("plan_for_fusion", True),
            **({"channels_last": report["channels_last"]} if "channels_last" in report else {}),
            # each rewrite's decision, who made it and its predicted totals with and without it
            **({"rewrites": report["rewrites"]} if report.get("rewrites") else {}),
            **({"predicted_fusion": report["predicted_fusion"]} if "predicted_fusion" in report else {}),
            "casts_inserted": report.get("casts_inserted"), "pads_inserted": report.get("pads_inserted"),
            "cost_model": (report.get("cost_model") or {}).get("name"),
            **({"tuning": report["tuning"]} if "tuning" in report else {}),
            **({"calibration": {k: v for k, v in report["calibration"].items() if k != "nodes"}}
               if "calibration" in report else {})}


def _toposort(model: onnx.ModelProto) -> onnx.ModelProto:
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    graph.toposort()
    out = gs.export_onnx(graph)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return out


def run_occ(source: Path, target: Path) -> dict[str, Any]:
    try:
        from onnxconverter_common import float16
    except ImportError as exc:
        raise Unavailable(f"onnxconverter-common not installed: {exc}") from None
    model = onnx.load(str(source))
    _save(float16.convert_float_to_float16(model, keep_io_types=True), target)
    return {}


def run_ort_fp16(source: Path, target: Path) -> dict[str, Any]:
    try:
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.transformers not importable: {exc}") from None
    model = onnx.load(str(source))
    converted = convert_float_to_float16(model, keep_io_types=True)
    _save(_toposort(converted), target)
    return {"note": "toposorted with onnx-graphsurgeon"}


def run_ortopt_fp16(source: Path, target: Path) -> dict[str, Any]:
    """What ORT users run for transformers on the GPU: the transformers optimizer (GPU options,
    model type, heads and hidden size as onnxcampo's --fuse detects them) and its fp16 conversion
    (keep_io_types). Only for BERT- and GPT-2-like models."""
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.transformers not importable: {exc}") from None
    from onnxcampo.rewrites.transformer import detect

    model = onnx.load(str(source))
    found = detect(model)
    if found.model_type is None:
        raise Unavailable(f"ortopt-fp16 is for BERT- and GPT-2-like models: {found.reason}")
    heads, hidden = found.num_heads, found.hidden_size
    if not (heads and hidden and hidden % heads == 0):
        heads = hidden = 0  # ORT's optimizer asserts both or neither: it detects them itself
    model_type = "gpt2" if "gpt2" in source.name else found.model_type  # the benchmark knows its model
    optimized = optimize_model(model, model_type=model_type, num_heads=heads, hidden_size=hidden,
                               use_gpu=True, opt_level=0)
    optimized.convert_float_to_float16(keep_io_types=True)
    fused = {op: count for op, count in optimized.get_fused_operator_statistics().items() if count}
    _save(_toposort(optimized.model), target)
    return {"note": f"{model_type}, {heads or 'ORT-detected'} heads, hidden {hidden or 'ORT-detected'}; fused {fused}"}


def run_modelopt(source: Path, target: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except Exception as exc:  # noqa: BLE001 - ImportError, or its own import-time checks
        raise Unavailable(f"nvidia-modelopt not importable: {str(exc).splitlines()[0]}") from None
    model = convert_to_mixed_precision(onnx_path=str(source), low_precision_type="fp16", keep_io_types=True,
                                       calibration_data=dict(feeds), providers=["cpu"])
    _save(model, target)
    return {"note": "calibrated on the benchmark inputs (attention masks with zeros)"}


def make_variant(policy: str, source: Path, target: Path, feeds: dict[str, np.ndarray],
                 shapes: dict[str, tuple[int, ...]], *, provider: str = "cuda") -> tuple[Path, dict[str, Any]]:
    """The model file of ``policy`` (``source`` itself for fp32) and what making it reported, with
    ``convert_s`` (the converter's wall time). ``feeds``: the model's inputs (a step graph's
    batch); ``provider``: where ``campo-tune`` times its candidates."""
    start = time.perf_counter()
    policy = graph_base(policy)  # a CUDA-graph policy replays its base policy's model
    if policy in ("fp32", "fp32-notf32"):
        return source, {"convert_s": 0.0}
    if policy in ONNXCAMPO:
        info = run_onnxcampo(policy, source, target, shapes, provider=provider, inputs=feeds or None)
    elif policy == "occ-fp16":
        info = run_occ(source, target)
    elif policy == "ort-fp16":
        info = run_ort_fp16(source, target)
    elif policy == "ortopt-fp16":
        info = run_ortopt_fp16(source, target)
    elif policy == "modelopt":
        info = run_modelopt(source, target, feeds)
    else:
        raise ValueError(f"unknown policy {policy!r}")
    info["convert_s"] = round(time.perf_counter() - start, 3)
    return target, info


def cleanup(path: Path, keep: Path) -> None:
    if path != keep and path.exists():
        path.unlink()
        data = path.with_name(path.name + ".data")
        if data.exists():
            data.unlink()


__all__ = ["INFERENCE_POLICIES", "TRAINING_POLICIES", "GRAPH_POLICIES", "graph_base", "TORCH_POLICIES", "INFERENCE_ANCHORS", "TRAINING_ANCHORS",
           "REFERENCE", "Unavailable", "install_wheels", "make_variant", "package_versions"]
