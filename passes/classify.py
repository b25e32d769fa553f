"""classify: fix the nodes the four passes must not touch, and why.

Rules, in order (the first that matches decides):
1. control-flow nodes (If/Loop/Scan) run fp32, and so does every node of their bodies;
2. constant sources (converted offline where fp16 consumers need them), nodes with no float tensor, or only precision-neutral ones (Shape), are not converted;
3. nodes whose float tensors are already fp16 stay fp16; a Cast whose output must keep its dtype
   (graph output, or read by an If/Loop/Scan body) stays as it is (retargeting it would need a
   Cast back: a round trip); ops that update training state in place (ONNX Runtime's gradient
   accumulators and optimizer ops) stay fp32 under every policy, user inclusions too: their
   output aliases their state input, so in fp16 they would update a Cast's copy of the buffer;
   so do ORT's pooling-gradient ops, whose kernels read the shape declared for their output
   (ORT's CPU, lacking an fp16 kernel, would run them on a new, undeclared output and crash);
   so does a Transpose that moves a batch axis into a MatMul with a 1-D/2-D operand: ORT's CPU EP
   crashes (SIGSEGV) creating a session of that pattern in fp16 (``patterns.ort_cpu_crashing_transposes``);
4. quantization ops, and float ops reading a DequantizeLinear or feeding a QuantizeLinear
   (ONNX Runtime fuses those QDQ patterns only in fp32), stay fp32;
5. user exclusions (``--exclude-op``, ``--exclude-node``) stay fp32, and so do the loss, its
   gradient and the optimizer update of a training step (``onnxcampo.training.scaling``);
6. ops of custom domains and ops without an fp16 type at the model's opset stay fp32, and so do
   com.microsoft ops that ONNX Runtime's CUDA EP has no fp16 kernel for (FusedConv is registered
   for float only), user inclusions too (``ai.onnxcampo::ScatterNDAdd`` with the reason of 7b);
7. nodes reading a float constant with finite values beyond the fp16 range (|x| > 65504),
   directly or through data movement (Reshape, Transpose, ...), stay fp32 (a BatchNormalization variance of 1e8 clamped to 65504 is a different model), unless
   those values are "infinity" sentinels (|x| >= 1e30, e.g. a -3.4e38 attention mask), which
   Cast insertion clamps to -65504/65504 where -inf would give 0 * -inf = NaN;
7a. with ``activation_limit`` (calibration, ``onnxcampo.calibrate``), nodes reading or writing a
   non-constant float tensor whose largest |value| on the calibration inputs exceeds the limit
   stay fp32 (fp16 holds such values too coarsely: 0.5 apart above 512);
7b. ScatterND/ScatterElements with a reduction (``add`` sums gradients in onnx-ad's backward
   passes of Gather and MaxPool) stay fp32: they accumulate in their data dtype, and ONNX Runtime's
   CPU provider has no fp16 kernel for them;
8. user inclusions (``--include-op``, ``--include-node``) go fp16, whatever the lists and the
   policy say;
9. ops in no list stay fp32.
Everything else is left to the four passes.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxcampo import casting, oplists, patterns
from onnxcampo.context import GraphContext
from onnxcampo.oplists import Category
from onnxcampo.plan import Precision, Reason

from onnxcampo.passes.manager import PassBase, PassResult

FP16_MAX = float(np.finfo(np.float16).max)
INFINITY_SENTINEL = 1e30


class Classify(PassBase):
    name = "classify"

    def run(self, ctx: GraphContext) -> PassResult:
        counts: dict[str, int] = {}
        self._crashing = patterns.ort_cpu_crashing_transposes(ctx)
        for node in ctx.nodes:
            decision = self._fixed(ctx, node)
            if decision is None:
                continue
            precision, reason = decision
            ctx.plan.decide(node.name, precision, reason)
            counts[reason.name.lower()] = counts.get(reason.name.lower(), 0) + 1
            if reason is Reason.CONTROL_FLOW:
                for inner in ctx.subgraph_nodes.get(node.name, ()):
                    ctx.plan.decide(inner, Precision.FP32, Reason.IN_SUBGRAPH)
                    counts["in_subgraph"] = counts.get("in_subgraph", 0) + 1
        return PassResult(self.name, False, counts)

    def _fixed(self, ctx: GraphContext, node):
        if node.name in ctx.subgraph_nodes:
            return Precision.FP32, Reason.CONTROL_FLOW
        sig = ctx.signatures[node.name]
        following = [t for t in (*ctx.follow_inputs(node), *ctx.follow_outputs(node))]
        category = ctx.categories[node.name]
        if not ctx.float_tensors(node):
            return Precision.FP32, Reason.NO_FLOAT
        if not node.inputs and all(ctx.is_constant(t) for t in node.outputs):
            return Precision.FP32, Reason.CONSTANT
        if category is Category.NEUTRAL and not ctx.follow_outputs(node):
            return Precision.FP32, Reason.NO_FLOAT
        if following and all(ctx.dtype(t) == TensorProto.FLOAT16 for t in following):
            return Precision.FP16, Reason.ALREADY_FP16
        if node.op == oplists.CAST and any(casting.pinned_dtype(ctx, t) for t in node.outputs):
            return Precision.FP32, Reason.PINNED_CAST
        if oplists.updates_state_in_place(node.op, node.domain or ""):
            return Precision.FP32, Reason.TRAINING_STATE
        if oplists.needs_declared_output_shape(node.op, node.domain or ""):
            return Precision.FP32, Reason.DECLARED_OUTPUT_SHAPE
        if node.name in self._crashing:
            return Precision.FP32, Reason.ORT_CPU_CRASH
        if category is Category.QUANTIZED or self._in_qdq(ctx, node):
            return Precision.FP32, Reason.QUANTIZED
        if node.name in ctx.config._accuracy_fix:
            return Precision.FP32, Reason.ACCURACY_FIX
        if ctx.excluded_by_user(node):
            return Precision.FP32, Reason.USER_EXCLUDED
        if node.name in ctx.training_fp32:
            return Precision.FP32, Reason.TRAINING_FP32
        domain = node.domain or ""
        if domain not in oplists.DEFAULT_DOMAINS and domain != oplists.MS_DOMAIN and category is Category.UNKNOWN:
            if (domain, node.op) in oplists.CUSTOM_ACCUMULATING_SCATTERS:
                return Precision.FP32, Reason.ACCUMULATING_SCATTER
            return Precision.FP32, Reason.CUSTOM_DOMAIN  # (ai.onnxcampo's Im2Col has a category)
        if not sig.has_fp16 or not any(ctx.is_float32(t) for t in following):
            return Precision.FP32, (Reason.NO_FP16_SCHEMA if sig.schema_found else Reason.NO_FLOAT)
        if oplists.lacks_cuda_fp16_kernel(node.op, domain):
            return Precision.FP32, Reason.NO_FP16_KERNEL
        if self._constant_out_of_range(ctx, node):
            return Precision.FP32, Reason.CONSTANT_OUT_OF_RANGE
        if self._beyond_activation_limit(ctx, node):
            return Precision.FP32, Reason.ACTIVATION_RANGE
        if node.op in oplists.SCATTER_OPS and node.attrs.get("reduction", "none") not in ("none", b"none"):
            return Precision.FP32, Reason.ACCUMULATING_SCATTER
        if ctx.included_by_user(node):
            return Precision.FP16, Reason.USER_INCLUDED
        if category is Category.UNKNOWN:
            return Precision.FP32, Reason.UNKNOWN_OP
        return None

    @staticmethod
    def _constant_out_of_range(ctx: GraphContext, node) -> bool:
        for tensor in ctx.follow_inputs(node):
            for constant in ctx.constant_sources(tensor):
                if not ctx.is_float32(constant):
                    continue
                values = ctx.constant_array(constant)
                if values.size == 0 or (values.max() <= FP16_MAX and values.min() >= -FP16_MAX):
                    continue  # the common case, without temporaries
                magnitude = np.abs(values[np.isfinite(values)])
                if np.any((magnitude > FP16_MAX) & (magnitude < INFINITY_SENTINEL)):
                    return True
        return False

    @staticmethod
    def _beyond_activation_limit(ctx: GraphContext, node) -> bool:
        limit = ctx.config.activation_limit
        if limit is None or not ctx.activation_max:
            return False
        return any(ctx.activation_max.get(t.name, 0.0) > limit
                   for t in (*ctx.follow_inputs(node), *ctx.follow_outputs(node)) if not ctx.is_constant(t))

    @staticmethod
    def _in_qdq(ctx: GraphContext, node) -> bool:
        for tensor in ctx.follow_inputs(node):
            producer = ctx.producer(tensor)
            if producer is not None and producer.op in oplists.QDQ_OUTPUT_OPS:
                return True
        for tensor in ctx.follow_outputs(node):
            if any(use.node.op in oplists.QDQ_INPUT_OPS for use in ctx.uses(tensor)):
                return True
        return False
