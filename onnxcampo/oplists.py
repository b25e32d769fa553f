"""Op policy as data: which ops may run in fp16, and why.

The four lists follow TensorFlow's auto-mixed-precision (the colour sets Campo extends), mapped
to ONNX and to the com.microsoft ops ONNX Runtime emits:

* ``ALLOW``  - numerically safe in fp16 and worth converting: Tensor Core math with fp32
  accumulation. The paper's pass 1 (``allow_by_cost``) converts them only when the cost model
  says it pays.
* ``DENY``   - |f(x)| can be much larger than |x|, or the op sums many terms without an fp32
  accumulator: these stay fp32, and so does what is downstream of them through INFER/CLEAR ops
  (under ``amp``, as in TensorFlow: only along paths that lead to an INFER/DENY op).
* ``INFER``  - safe in fp16 unless fed by a DENY op (element-wise arithmetic, activations,
  normalizations whose ONNX Runtime kernels keep mean/variance in fp32).
* ``CLEAR``  - no numerical effect (data movement, max/min): run in whatever precision saves casts.

``NEUTRAL`` ops read a float tensor of either precision without caring (``Shape``); they never
need a Cast. Quantization ops and ops between DequantizeLinear and QuantizeLinear are left alone so
that ONNX Runtime's QDQ fusions still match.

A test checks that the lists do not overlap. Passes never name op types; they ask
:func:`category_of`.
"""

from __future__ import annotations

import enum

MS_DOMAIN = "com.microsoft"
DEFAULT_DOMAINS = ("", "ai.onnx")


class Category(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    INFER = "infer"
    CLEAR = "clear"
    NEUTRAL = "neutral"
    QUANTIZED = "quantized"
    UNKNOWN = "unknown"


def _ops(*groups: tuple[str, ...]) -> frozenset[str]:
    return frozenset(op for group in groups for op in group)


# --- ALLOW: Tensor Core math, fp32 accumulation in cuBLAS/cuDNN -------------------------------
_TENSOR_CORE = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")
_TENSOR_CORE_MS = ("FusedMatMul", "FusedConv", "Attention", "MultiHeadAttention", "FusedGemm")
# ORT's fused attention (flash / memory-efficient kernels keep the softmax in fp32) and its GEMM with
# a FastGelu epilogue.
_TENSOR_CORE_FUSED_MS = ("GroupQueryAttention", "GemmFastGelu")
# Backward ops of the above in ORT training graphs: same kernels, same safety.
_TENSOR_CORE_GRAD_MS = ("ConvGrad", "ConvTransposeGrad", "FusedMatMulGrad", "GemmGrad")

ALLOW = _ops(_TENSOR_CORE, _TENSOR_CORE_MS, _TENSOR_CORE_FUSED_MS, _TENSOR_CORE_GRAD_MS)

# --- DENY ---------------------------------------------------------------------------------
# |f(x)| >> |x|: overflow in fp16 (max 65504) for moderate inputs.
_EXPONENTIAL = ("Exp", "Pow", "Softplus", "LogSoftmax")
# Log of small values and reciprocal-like ops lose all precision near fp16's tiny range.
_LOGARITHMIC = ("Log",)
# Sums over many terms: fp16 accumulation overflows or stalls (x + small == x). (A training step's
# weight-gradient sums may run fp16 under campo with loss scaling: ``training.scaling.gradient_sums``.)
_SUM_REDUCTIONS = (
    "ReduceSum", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare", "CumSum",
)
# Losses and their gradients: the quantity being minimised must keep full precision.
_LOSSES = (
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
)
_LOSSES_MS = (
    "SoftmaxCrossEntropyLossGrad", "SoftmaxCrossEntropyLossInternal",
    "SoftmaxCrossEntropyLossInternalGrad", "SoftmaxGrad", "SoftmaxGrad_13", "LogSoftmaxGrad",
    "LogSoftmaxGrad_13", "SoftmaxCrossEntropy", "SoftmaxCrossEntropyGrad",
    "SparseSoftmaxCrossEntropy", "SparseSoftmaxCrossEntropyGrad",
)
# Training-graph state: gradient accumulators and optimizer math hold fp32 master values.
# These update their state input in place (ONNX Runtime aliases the output to it): in fp16 they
# would update a Cast's copy and leave the real buffer untouched, so they stay fp32 under every
# policy (see ``IN_PLACE_STATE``).
_IN_PLACE_STATE_MS = (
    "InPlaceAccumulator", "InPlaceAccumulatorV2", "ZeroGradient", "SGDOptimizer",
    "SGDOptimizerV2", "AdamOptimizer", "AdamWOptimizer", "LambOptimizer",
)
_OPTIMIZER_MATH_MS = ("ReduceAllL2",)

DENY = _ops(
    _EXPONENTIAL, _LOGARITHMIC, _SUM_REDUCTIONS, _LOSSES, _LOSSES_MS, _IN_PLACE_STATE_MS, _OPTIMIZER_MATH_MS,
)

# --- INFER --------------------------------------------------------------------------------
_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Sum", "Mean", "Neg", "Reciprocal", "Sqrt", "Erf")
_ACTIVATIONS = (
    "Sigmoid", "HardSigmoid", "Tanh", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Gelu",
    "HardSwish", "Softsign", "Mish", "ThresholdedRelu", "Sin", "Cos",
)
_ACTIVATIONS_MS = ("FastGelu", "BiasGelu", "QuickGelu", "BiasAdd", "BiasSplitGelu")
# A rotation of pairs of elements by the cos/sin caches: |y| = |x| pair by pair, nothing grows.
_ROTATIONS_MS = ("RotaryEmbedding",)
# ORT's fp16 kernels for these keep mean and variance in fp32 (cuDNN for BatchNormalization).
_NORMALIZATIONS = (
    "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "RMSNormalization", "LpNormalization", "AveragePool", "GlobalAveragePool",
)
_NORMALIZATIONS_MS = (
    "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
    "EmbedLayerNormalization",
)
# Backward ops of the element-wise ops above.
_ELEMENTWISE_GRAD_MS = (
    "ReluGrad", "GeluGrad", "FastGeluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX",
    "SigmoidGrad", "TanhGrad", "LayerNormalizationGrad", "SimplifiedLayerNormalizationGrad",
    "BatchNormalizationGrad", "DropoutGrad", "BitmaskDropoutGrad",
    "GlobalAveragePoolGrad", "DivGrad", "MulGrad",
)

# Ops whose ONNX Runtime fp16 kernels accumulate in fp32 and whose result is bounded by their
# input's range: Softmax (in [0, 1]; exp of x - max never overflows) and ReduceMean (a mean lies
# between the input's extremes). The seeds' "reductions in fp32 math" holds inside the kernel;
# TensorFlow AMP denied them because its kernels then did not. Sums and LogSoftmax (losses)
# stay on the deny list.
_FP32_ACCUMULATING = ("Softmax", "ReduceMean")
_FP32_ACCUMULATING_MS = ("BiasSoftmax",)

INFER = _ops(
    _FP32_ACCUMULATING, _FP32_ACCUMULATING_MS,
    _ARITHMETIC, _ACTIVATIONS, _ACTIVATIONS_MS, _ROTATIONS_MS, _NORMALIZATIONS, _NORMALIZATIONS_MS,
    _ELEMENTWISE_GRAD_MS,
)

# --- CLEAR --------------------------------------------------------------------------------
_DATA_MOVEMENT = (
    "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Concat", "Split", "Slice",
    "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "Identity",
    "DepthToSpace", "SpaceToDepth", "Resize", "Upsample", "Where", "ScatterND",
    "ScatterElements", "ReverseSequence", "Trilu", "Compress",
)
# Selection does not change magnitudes.
_SELECTION = (
    "Relu", "Max", "Min", "Abs", "Clip", "MaxPool", "GlobalMaxPool", "ReduceMax", "ReduceMin",
    "Dropout", "Sign", "Floor", "Ceil", "Round",
)
_DATA_MOVEMENT_MS = ("BitmaskDropout", "GatherGrad", "GatherElementsGrad", "GatherNDGrad")

CLEAR = _ops(_DATA_MOVEMENT, _SELECTION, _DATA_MOVEMENT_MS)
# Ops that only move values (a constant passed through them is still that constant's values).
DATA_MOVEMENT = _ops(_DATA_MOVEMENT)
# data movement that only re-shapes (same elements, same order): patterns look through these
SHAPE_ONLY = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"})
# deny propagation's rule 3 (``experimental.means_end_deny``): a sum scaled down to a mean
MEAN_SUMS = frozenset({"ReduceSum"})
MEAN_SCALES = frozenset({"Mul"})

# --- NEUTRAL: read any float precision, produce no float -----------------------------------
# Cast is neutral on its input side only; its float output follows the plan (its `to` changes).
NEUTRAL = frozenset({
    "Shape", "Size", "Cast", "CastLike", "IsNaN", "IsInf", "ArgMax", "ArgMin", "NonZero",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "EyeLike",
})

# --- fp32 under every policy, user inclusions too -------------------------------------------
IN_PLACE_STATE = _ops(_IN_PLACE_STATE_MS)
# ONNX Runtime's pooling-gradient kernels (default domain) take their output shape from the shape
# the graph declares for their output. ORT's CPU runs an fp16 node without an fp16 kernel (these
# have none there) in fp32 between Casts of its own, on a new output tensor with no declared
# shape: onnxruntime-training-cpu 1.19.2 then crashes creating the session.
DECLARED_OUTPUT_SHAPE = frozenset({"MaxPoolGrad", "AveragePoolGrad"})

# --- ONNX Runtime's CUDA kernels for com.microsoft ops --------------------------------------
# A contrib schema that allows fp16 does not mean the CUDA EP can run the op in fp16: ORT registers
# its kernels type by type. Read from onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc (for the
# untyped registrations of BiasGelu and BiasSoftmax, contrib_ops/cuda/math/bias_gelu.cc and
# bias_softmax.cc) of microsoft/onnxruntime at commit 004b79eda305 (main, with the contrib op set
# of the onnxruntime 1.32 installed here). These have an MLFloat16 CUDA kernel (GroupQueryAttention
# has only fp16 and bf16 ones):
CUDA_FP16_KERNELS_MS = frozenset({
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "FusedMatMul",
    "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization",
    "BiasGelu", "FastGelu", "Gelu", "QuickGelu", "BiasSplitGelu", "BiasAdd", "BiasSoftmax",
    "RotaryEmbedding",
})
# These have none: FusedConv is registered for float only; FusedGemm (a CPU kernel) and GemmFastGelu
# (ROCm) have no CUDA kernel at all. In fp16 the CUDA EP would run them on the CPU between copies or
# find no kernel, so they stay fp32 under every policy, user inclusions too. (ORT registers
# SimplifiedLayerNormalization in the ONNX domain, with fp16 CUDA kernels.)
CUDA_NO_FP16_KERNEL_MS = frozenset({"FusedConv", "FusedGemm", "GemmFastGelu"})

# --- ONNX Runtime training ops in the default domain ---------------------------------------
# The training build registers these in the ONNX domain although ONNX defines no such op
# (``onnx.defs.has`` is False): ``generate_artifacts`` writes MaxPoolGrad there. The ONNX checker
# rejects them as unknown ONNX ops, so they are checked like ops of a foreign domain. Any other
# default-domain op without an ONNX schema is still an error.
ORT_DEFAULT_DOMAIN_OPS = frozenset({
    "MaxPoolGrad", "AveragePoolGrad", "ConvGrad", "SinGrad", "SparseSoftmaxCrossEntropy",
    "SparseSoftmaxCrossEntropyGrad",
})

# The op whose ``to`` attribute Cast insertion rewrites (and never chains).
CAST = "Cast"

# --- QUANTIZED: left intact together with the float ops they wrap -------------------------
QUANTIZE_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
    "ConvInteger", "QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul",
    "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention", "QGemm",
    "MatMulNBits", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearGlobalAveragePool",
    "QLinearConcat", "QLinearAveragePool", "DynamicQuantizeLSTM",
})
# ``QuantizeLinear`` takes float in and ``DequantizeLinear`` gives float out: ops next to them in a
# QDQ pattern are fused by ONNX Runtime only when those tensors stay fp32.
QDQ_INPUT_OPS = frozenset({"QuantizeLinear"})
QDQ_OUTPUT_OPS = frozenset({"DequantizeLinear"})

# --- Type parameters that never follow the node's precision -------------------------------
# ``U`` of the normalizations is the statistics ("stash") type, fp32 by attribute.
FIXED_TYPE_PARAMS: dict[str, frozenset[str]] = {
    "LayerNormalization": frozenset({"U"}),
    "SkipLayerNormalization": frozenset({"U"}),
    "SimplifiedLayerNormalization": frozenset({"U"}),
    "SkipSimplifiedLayerNormalization": frozenset({"U"}),
    "LayerNormalizationGrad": frozenset({"U"}),
    "SimplifiedLayerNormalizationGrad": frozenset({"U"}),
    # Resize/Upsample: only the image follows; roi, scales and sizes are coordinates.
    "Resize": frozenset({"T2"}),
    # BatchNormalization-15 allows T1/T2 (scale, stats) to differ from T; ORT's CUDA fp16 kernel
    # wants all of them in T, so they follow and are not listed here.
}

# the experimental int8_avg (onnxcampo/rewrites/int8_avg.py): the integer matmul it replaces by ai.onnxcampo's
# AvgMatMulInteger, and the op that must read its int32 output (the op gives float directly).
INT8_AVG_REPLACES = "MatMulInteger"
INT8_AVG_CAST = "Cast"

# --- ai.onnxcampo: the custom ops the precision passes may retype ----------------------------
# Other ops of the domain (the fused updates, UnscaleCheckFinite, AvgMatMulInteger) are UNKNOWN:
# they keep their types. Im2Col (a Conv's column matrix) only moves values, its output in its
# input's type: clear, so it goes fp16 with the Gemm that reads it. ConvWeightGrad (a Conv's
# weight gradient, cuDNN's backward filter on CUDA) is the Tensor Core product the Gemm over
# Im2Col was: allow, costed as that Gemm (costdb.features.STANDS_FOR).
ONNXCAMPO_DOMAIN = "ai.onnxcampo"
ONNXCAMPO_OPS: dict[str, Category] = {"Im2Col": Category.CLEAR, "ConvWeightGrad": Category.ALLOW}
# ScatterNDAdd (ScatterND with reduction "add", which build_train_step puts in place of onnx-ad's
# Gather adjoints, onnxcampo/training/scatter.py) is UNKNOWN too, and fixed fp32 with the reason
# of the accumulating scatters (classify 7b), whatever its attributes.
CUSTOM_ACCUMULATING_SCATTERS = frozenset({(ONNXCAMPO_DOMAIN, "ScatterNDAdd")})
# Without a schema every tensor of an ai.onnxcampo node is taken to share its one float type
# (onnxcampo.signature). These inputs and outputs, by position, have a type of their own whatever
# the node's: the argmax of the channels-last max pooling, the uint8 tap of each window's maximum
# (MaxPoolNhwc's output 1, MaxPoolNhwcGrad's input 1; layout.py writes both).
_UINT8 = 2  # onnx.TensorProto.UINT8
ONNXCAMPO_FIXED_INPUT_TYPES: dict[str, dict[int, int]] = {"MaxPoolNhwcGrad": {1: _UINT8}}
ONNXCAMPO_FIXED_OUTPUT_TYPES: dict[str, dict[int, int]] = {"MaxPoolNhwc": {1: _UINT8}}

_LISTS = {
    Category.ALLOW: ALLOW,
    Category.DENY: DENY,
    Category.INFER: INFER,
    Category.CLEAR: CLEAR,
    Category.NEUTRAL: NEUTRAL,
    Category.QUANTIZED: QUANTIZE_OPS,
}


def category_of(op_type: str, domain: str = "") -> Category:
    """The list an op belongs to; ``UNKNOWN`` for ops in no list or in a custom domain (but the
    ``ai.onnxcampo`` ops of :data:`ONNXCAMPO_OPS`)."""
    if domain == ONNXCAMPO_DOMAIN:
        return ONNXCAMPO_OPS.get(op_type, Category.UNKNOWN)
    if domain not in DEFAULT_DOMAINS and domain != MS_DOMAIN:
        return Category.UNKNOWN
    for category, ops in _LISTS.items():
        if op_type in ops:
            return category
    return Category.UNKNOWN


def custom_fixed_types(op_type: str, domain: str = "") -> tuple[dict[int, int], dict[int, int]]:
    """(input position -> element type, output position -> element type) of an ``ai.onnxcampo``
    op's tensors whose type never follows the node's; empty for other ops."""
    if domain != ONNXCAMPO_DOMAIN:
        return {}, {}
    return ONNXCAMPO_FIXED_INPUT_TYPES.get(op_type, {}), ONNXCAMPO_FIXED_OUTPUT_TYPES.get(op_type, {})


def updates_state_in_place(op_type: str, domain: str = "") -> bool:
    """Whether the op writes training state (gradient buffers, optimizer state) in place."""
    return domain == MS_DOMAIN and op_type in IN_PLACE_STATE


def needs_declared_output_shape(op_type: str, domain: str = "") -> bool:
    """Whether ONNX Runtime's kernel for the op reads its output's declared shape."""
    return domain in DEFAULT_DOMAINS and op_type in DECLARED_OUTPUT_SHAPE


def lacks_cuda_fp16_kernel(op_type: str, domain: str = "") -> bool:
    """Whether ONNX Runtime's CUDA EP has no fp16 kernel for the op, whatever its schema allows."""
    return domain == MS_DOMAIN and op_type in CUDA_NO_FP16_KERNEL_MS


def overlaps() -> dict[tuple[str, str], frozenset[str]]:
    """Pairs of lists sharing an op (must be empty; checked by a test)."""
    items = list(_LISTS.items())
    found = {}
    for i, (cat_a, ops_a) in enumerate(items):
        for cat_b, ops_b in items[i + 1:]:
            common = ops_a & ops_b
            if common:
                found[(cat_a.value, cat_b.value)] = common
    return found


# ONNX Runtime runs no kernel for these: Constant is folded into an initializer; Identity, Reshape,
# Squeeze, Unsqueeze and Flatten alias their output to their input's buffer (their CUDA kernels
# declare the alias; a run launches nothing for them and a CUDA graph captures nothing). They
# cost nothing in a plan's time (onnxcampo.estimate).
ALIASED = frozenset({"Constant", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
# ONNX Runtime removes these from an inference graph whatever surrounds them (a Cast after one reads
# its input instead): a plan's Casts never bring them back.
ELIMINATED = frozenset({"Dropout", "Identity"})
# cuDNN runs an fp16 NCHW convolution between layout transforms (nchwToNhwc, nhwcToNchw): CUPTI saw
# 135 of them next to 51 convolution kernels in ResNet-50's training step on the H200. The extra
# launches cost host time that the single-op database does not count.
NCHW_FP16_LAYOUT_OPS = frozenset({"Conv", "ConvTranspose", "FusedConv"})
NCHW_FP16_LAYOUT_LAUNCHES = 2

SCATTER_OPS = frozenset({"ScatterND", "ScatterElements"})  # reduction != none: accumulating (classify 7b)


# Every op type the lists above name: with ONNX's own ops, what --exclude-op/--include-op accept
# (besides the model's op types), so that a misspelt name is an error, not a no-op.
KNOWN_OPS = ALLOW | DENY | INFER | CLEAR | NEUTRAL | IN_PLACE_STATE | CUDA_FP16_KERNELS_MS | ORT_DEFAULT_DOMAIN_OPS | QUANTIZE_OPS
