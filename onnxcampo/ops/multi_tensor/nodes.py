"""The ONNX nodes of the multi_tensor unit's ``ai.onnxcampo`` ops (re-exported by :mod:`onnxcampo.ops.nodes`)."""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN
from onnxcampo.ops.common.nodes import same_length


def unscale_check_finite(inv_scale: str, grads: Sequence[str], *, found_inf: str, outputs: Sequence[str],
                         name: str) -> onnx.NodeProto:
    """``(found_inf, u_1..u_n) = UnscaleCheckFinite(inv_scale, g_1..g_n)``; ``u_i = float32(g_i) * inv_scale``."""
    same_length(name, grads=grads, outputs=outputs)
    return helper.make_node("UnscaleCheckFinite", [inv_scale, *grads], [found_inf, *outputs], name=name, domain=DOMAIN)


def check_finite(grads: Sequence[str], *, found_inf: str, name: str) -> onnx.NodeProto:
    """``found_inf = CheckFinite(g_1..g_n)``: UnscaleCheckFinite's check alone, for an update
    that unscales the gradients itself (``unscale=True`` of :func:`multi_tensor_sgd` and
    :func:`multi_tensor_adamw`)."""
    if not grads:
        raise ValueError(f"{name}: CheckFinite needs at least one gradient")
    return helper.make_node("CheckFinite", list(grads), [found_inf], name=name, domain=DOMAIN)


MULTI_TENSOR_CAST = "MultiTensorCast"


def multi_tensor_cast(inputs: Sequence[str], outputs: Sequence[str], *, name: str) -> onnx.NodeProto:
    """``(y_1..y_n) = MultiTensorCast(x_1..x_n)``: ``y_i = Cast(x_i, to=FLOAT16)`` for float32
    ``x_i``, all in one kernel launch."""
    same_length(name, inputs=inputs, outputs=outputs)
    return helper.make_node(MULTI_TENSOR_CAST, list(inputs), list(outputs), name=name, domain=DOMAIN)


def multi_tensor_cast_reference_op():
    """``MultiTensorCast`` for :class:`onnx.reference.ReferenceEvaluator` (``new_ops=[...]``)."""
    import numpy as np
    from onnx.reference.op_run import OpRun

    class MultiTensorCast(OpRun):
        op_domain = DOMAIN

        def _run(self, *inputs):
            return tuple(np.asarray(x, np.float32).astype(np.float16) for x in inputs)

    return MultiTensorCast


def multi_tensor_sgd(lr: str, found_inf: str, weights: Sequence[str], grads: Sequence[str],
                     velocities: Sequence[str] = (), *, outputs: Sequence[str], velocity_outputs: Sequence[str] = (),
                     momentum: float = 0.0, inv_scale: str | None = None, name: str) -> onnx.NodeProto:
    """SGD over all weights: with velocities ``v' = momentum*v + g; w' = w - lr*v'``, without
    ``w' = w - lr*g``; nothing changes while ``found_inf`` is true. ``inv_scale``: the ``g`` are
    scaled gradients, used as ``float32(g) * inv_scale`` (attribute ``unscale=1``, ``inv_scale``
    the first tensor input)."""
    same_length(name, weights=weights, grads=grads, outputs=outputs)
    if velocities or velocity_outputs:
        same_length(name, weights=weights, velocities=velocities, velocity_outputs=velocity_outputs)
    scale, extra = ([inv_scale], {"unscale": 1}) if inv_scale else ([], {})
    return helper.make_node("MultiTensorSGD", [lr, found_inf, *scale, *weights, *grads, *velocities],
                            [*outputs, *velocity_outputs], name=name, domain=DOMAIN, momentum=float(momentum), **extra)


def multi_tensor_adamw(lr: str, step: str, found_inf: str, weights: Sequence[str], grads: Sequence[str],
                       m: Sequence[str], v: Sequence[str], *, step_output: str, outputs: Sequence[str],
                       m_outputs: Sequence[str], v_outputs: Sequence[str], betas: tuple[float, float],
                       eps: float, weight_decay: float, inv_scale: str | None = None, name: str) -> onnx.NodeProto:
    """AdamW over all weights (``docs/ops.md`` has the formula); nothing changes, ``step``
    included, while ``found_inf`` is true. ``inv_scale``: as :func:`multi_tensor_sgd`'s."""
    same_length(name, weights=weights, grads=grads, m=m, v=v, outputs=outputs, m_outputs=m_outputs,
                 v_outputs=v_outputs)
    scale, extra = ([inv_scale], {"unscale": 1}) if inv_scale else ([], {})
    return helper.make_node(
        "MultiTensorAdamW", [lr, step, found_inf, *scale, *weights, *grads, *m, *v],
        [step_output, *outputs, *m_outputs, *v_outputs], name=name, domain=DOMAIN,
        beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay), **extra)
