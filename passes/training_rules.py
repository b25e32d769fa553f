"""What a training step's planning must know before any plan is made (an analysis pass: it
writes the context's tables, never the graph).

Rules:
1. the loss, its gradient and the optimizer update stay fp32 (``scaling.fp32_nodes``), under every
   policy;
2. under campo with dynamic loss scaling (asked for, or already in the step), the weight-gradient
   sums leave the deny list for the infer list: ORT's kernels accumulate them in fp32 and loss
   scaling catches their overflow (``scaling.gradient_sums``); amp keeps them on the deny list, as
   the baseline does;
3. a step that will get loss scaling pays its overhead in every plan with fp16 nodes
   (``scaling.overhead``: the unscale, the finite check, the update of the scale).
"""

from __future__ import annotations

from onnxcampo import oplists
from onnxcampo.context import GraphContext
from onnxcampo.training import scaling

from onnxcampo.passes.manager import PassBase, PassResult


class TrainingRules(PassBase):
    name = "training_rules"

    def requires(self, ctx: GraphContext) -> str | None:
        return None if scaling.is_train_step(ctx.model) else "the model is not a training step"

    def run(self, ctx: GraphContext) -> PassResult:
        model, config, info = ctx.model, ctx.config, ctx.info
        ctx.training_fp32 = frozenset(scaling.fp32_nodes(model))
        moved = 0
        if config.policy == "campo" and (config.loss_scaling or scaling.has_loss_scaling(model)):
            for name in scaling.gradient_sums(model):
                if ctx.categories.get(name) is oplists.Category.DENY:
                    ctx.categories[name] = oplists.Category.INFER
                    moved += 1
        if config.loss_scaling and not scaling.has_loss_scaling(model):
            ctx.loss_scaling = scaling.overhead(model, lambda name: info[name].numel if name in info else None)
            tensors = ctx.graph.tensors()
            ctx.loss_scaling_gradients = frozenset(g for g in ctx.loss_scaling.gradients_read_as_is if g in tensors)
        return PassResult(self.name, False, {"fp32_nodes": len(ctx.training_fp32), "gradient_sums_to_infer": moved,
                                             "loss_scaling_costed": int(ctx.loss_scaling is not None)})
