"""``TrainingRules``: a training step's tables before planning (loss and update fp32, weight-gradient
sums to the infer list under campo with loss scaling, loss scaling's overhead costed)."""

from __future__ import annotations

import pytest
from helpers import build_context, run_passes

from onnxcampo.examples.training_mlp import wide_mlp
from onnxcampo.oplists import Category
from onnxcampo.passes.manager import InvariantError
from onnxcampo.passes.training_rules import TrainingRules
from onnxcampo.training import build_train_step
from onnxcampo.training.scaling import fp32_nodes, gradient_sums


def mlp():
    return wide_mlp(rows=32, width=64)


@pytest.fixture(scope="module")
def step():
    return build_train_step(mlp(), loss="cross_entropy", optimizer="sgd", fused=False)


def test_campo_with_loss_scaling_moves_the_weight_gradient_sums_to_the_infer_list(step):
    ctx = build_context(step, policy="campo")
    sums = gradient_sums(ctx.model)
    assert sums and all(ctx.categories[name] is Category.DENY for name in sums)  # TensorFlow's lists
    (result,) = run_passes(ctx, TrainingRules())
    assert all(ctx.categories[name] is Category.INFER for name in sums)
    assert ctx.training_fp32 == frozenset(fp32_nodes(ctx.model)) and ctx.loss_scaling is not None
    assert result.counts["gradient_sums_to_infer"] == len(sums) and not ctx.plan.items()  # no plan written


@pytest.mark.parametrize("options", [{"policy": "amp"}, {"policy": "campo", "loss_scaling": False}],
                         ids=["amp", "campo-unscaled"])
def test_amp_and_unscaled_steps_keep_the_sums_on_the_deny_list(step, options):
    ctx = build_context(step, **options)
    run_passes(ctx, TrainingRules())
    assert all(ctx.categories[name] is Category.DENY for name in gradient_sums(ctx.model))
    assert ctx.training_fp32  # the loss and the update stay fp32 under every policy
    assert (ctx.loss_scaling is None) == (options.get("loss_scaling") is False)


def test_an_inference_model_is_refused():
    with pytest.raises(InvariantError, match="not a training step"):
        run_passes(build_context(mlp()), TrainingRules())
