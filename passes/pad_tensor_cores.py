"""Mutating pass: zero-pad fp16 MatMul/Gemm/Conv dims to multiples of 8 where it pays.

Rules, per fp16 node whose weight (its second input) has a static shape:
1. MatMul ``A[..., M, K] x W[K, N]`` and Gemm (bias absent or 1-D; with ``transA = 1`` only when
   M is aligned, A's row stride): K and N are padded up to multiples of 8: a constant weight
   offline with zeros, a weight computed in the graph (a training step's weights, the gradients
   its backward multiplies) by a Pad node, A with a Pad on its K axis (when K grows), the result
   with a Slice back to N (when N grows); a 1-D Gemm bias gets zeros. M is never padded: it is no
   leading dimension of A [M, K], so it does not decide Tensor Core use. (GPT-2's LM head,
   N = 50257: its three GEMMs of the training step ran cuBLAS's unaligned kernels, 3.6 of the
   step's 15.5 GPU ms on the H200.)
2. Conv (weight ``[C_out, C_in, k...]``, a constant) and ConvTranspose (weight ``[C_in, C_out, k...]``, no
   ``output_shape``) with ``group = 1`` and a constant bias of ``[C_out]`` or none: the channels
   are padded the same way (Pad on axis 1 of X, zero weight slices, zero bias, Slice on axis 1
   of Y).
3. A node is padded only when ``fp16_time(padded) + pad/slice time < fp16_time(unpadded)``;
   aligned nodes are never touched. Zero padding adds exact zeros to every dot product, so the
   result equals the unpadded op's.
Grouped convolutions are left unpadded. Every Pad and Slice added is recorded with why it is there
(``ctx.inserted``).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxcampo.context import GraphContext
from onnxcampo.editing import GraphEditor
from onnxcampo.ir.topology import toposort
from onnxcampo.padding import PadPlan, pad_plan
from onnxcampo.plan import Precision

from onnxcampo.passes.manager import PassBase, PassResult


class PadTensorCores(PassBase):
    name = "pad_tensor_cores"
    mutates = True

    def run(self, ctx: GraphContext) -> PassResult:
        self.ctx = ctx
        self.edit = GraphEditor(ctx)
        padded = inserted = 0
        for node in list(ctx.graph.nodes):
            if ctx.plan.get(node.name) is None or ctx.plan.precision(node.name) is not Precision.FP16:
                continue
            plan = pad_plan(ctx, node)
            if plan is None:
                continue
            inserted += self._apply(node, plan)
            padded += 1
        if padded:
            toposort(ctx.graph)
            ctx.nodes = list(ctx.graph.nodes)
        return PassResult(self.name, bool(padded), {"nodes": padded, "pad_slice_nodes": inserted})

    # --- applying -----------------------------------------------------------------------
    def _apply(self, node: gs.Node, plan: PadPlan) -> int:
        rank, k, k2, n, n2 = plan.rank, plan.k, plan.k_padded, plan.n, plan.n_padded
        axis_in, axis_out = plan.input_axis, plan.output_axis
        weight_k_axis, weight_n_axis = plan.weight_axes
        inserted = 0
        weight = node.inputs[1]
        if plan.dynamic:
            pads = np.zeros(4, dtype=np.int64)  # a 2-D weight: [begin0, begin1, end0, end1]
            pads[2 + weight_k_axis] = k2 - k
            pads[2 + weight_n_axis] = n2 - n
            wide = self.edit.variable(f"{weight.name}/padded", self.ctx.dtypes[weight.name])
            pad = self.edit.node("Pad", f"{node.name}/pad_weight", [weight, self.edit.constant(f"{node.name}/weight_pads", pads)],
                                 [wide], {"mode": "constant"})
            self._record(pad, f"zero-pads {weight.name} from {k}x{n} to {k2}x{n2} (K x N) for Tensor Cores in fp16 "
                              f"{node.op} {node.name}, each run (the weight is computed in the graph): "
                              f"{self._gain(node, plan)}")
            node.inputs[1] = wide
            inserted += 1
        else:
            values = np.asarray(weight.values)
            widths = [(0, 0)] * values.ndim
            widths[weight_k_axis] = (0, k2 - k)
            widths[weight_n_axis] = (0, n2 - n)
            node.inputs[1] = self.edit.constant(f"{weight.name}/padded", np.pad(values, widths))
        if len(node.inputs) > 2 and isinstance(node.inputs[2], gs.Constant) and n2 != n:
            bias = node.inputs[2]
            node.inputs[2] = self.edit.constant(f"{bias.name}/padded", np.pad(np.asarray(bias.values), (0, n2 - n)))
        if k2 != k:
            source = node.inputs[0]
            axis = axis_in % rank
            pads = np.zeros(2 * rank, dtype=np.int64)
            pads[rank + axis] = k2 - k
            padded = self.edit.variable(f"{source.name}/padded", self.ctx.dtypes[source.name])
            pads_const = self.edit.constant(f"{node.name}/pads", pads)
            pad = self.edit.node("Pad", f"{node.name}/pad_k", [source, pads_const], [padded], {"mode": "constant"})
            self._record(pad, f"zero-pads {source.name} from {k} to {k2} along the reduced axis of fp16 {node.op} "
                              f"{node.name} for Tensor Cores: {self._gain(node, plan)}")
            node.inputs[0] = padded
            inserted += 1
        if n2 != n:
            result = node.outputs[0]
            wide = self.edit.variable(f"{result.name}/padded", self.ctx.dtypes[result.name])
            node.outputs[0] = wide
            starts, ends, axes = (self.edit.constant(f"{node.name}/slice_{label}", np.array([v], dtype=np.int64))
                                  for label, v in (("starts", 0), ("ends", n), ("axes", axis_out)))
            cut = self.edit.node("Slice", f"{node.name}/slice_n", [wide, starts, ends, axes], [result], {})
            self._record(cut, f"slices the output of fp16 {node.op} {node.name}, padded from {n} to {n2} for Tensor "
                              f"Cores, back to {n}: {self._gain(node, plan)}")
            inserted += 1
        return inserted

    def _record(self, node: gs.Node, why: str) -> None:
        self.ctx.inserted[node.name] = {"op": node.op, "why": why}

    @staticmethod
    def _gain(node: gs.Node, plan: PadPlan) -> str:
        return f"predicted {plan.padded_us:.2f} us padded (Pad/Slice included) against {plan.fp16_us:.2f} us unpadded"
