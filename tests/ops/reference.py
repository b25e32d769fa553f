"""Numpy references of the ai.onnxcampo ops (float32 throughout, one rounding per operation, in
the order of the standard-op graph of onnxcampo/training/step.py), and single-op models."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnxcampo.ops import nodes
from onnxcampo.runtime import make_session, run

F32 = np.float32


def unscale_check_finite(inv_scale, grads):
    found = any(not np.isfinite(g).all() for g in grads)
    return np.array(found), [g.astype(F32) * F32(inv_scale) for g in grads]


def sgd(lr, found_inf, weights, grads, velocities=None, momentum=0.0):
    if bool(found_inf):
        return [w.copy() for w in weights], [v.copy() for v in velocities or []]
    lr, mu = F32(lr), F32(momentum)
    if velocities is None:
        return [w - lr * g.astype(F32) for w, g in zip(weights, grads)], []
    new_v = [mu * v + g.astype(F32) for v, g in zip(velocities, grads)]
    return [w - lr * v for w, v in zip(weights, new_v)], new_v


def adamw(lr, step, found_inf, weights, grads, m, v, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01):
    if bool(found_inf):
        return F32(step), [w.copy() for w in weights], [x.copy() for x in m], [x.copy() for x in v]
    b1, b2, eps, wd, lr = F32(beta1), F32(beta2), F32(eps), F32(weight_decay), F32(lr)
    one_b1, one_b2 = F32(1.0 - float(b1)), F32(1.0 - float(b2))
    t = F32(step) + F32(1)
    c1, c2 = F32(1) - b1 ** t, F32(1) - b2 ** t
    new_w, new_m, new_v = [], [], []
    for w, g, m_, v_ in zip(weights, grads, m, v):
        g = g.astype(F32)
        mm = b1 * m_ + one_b1 * g
        vv = b2 * v_ + one_b2 * (g * g)
        direction = (mm / c1) / (np.sqrt(vv / c2) + eps)
        new_w.append(w - lr * (direction + wd * w))
        new_m.append(mm)
        new_v.append(vv)
    return t, new_w, new_m, new_v


def run_node(node: onnx.NodeProto, feeds: dict[str, np.ndarray], outputs: dict[str, tuple[int, list[int]]],
             provider: str = "cpu") -> dict[str, np.ndarray]:
    """Run one ai.onnxcampo node through onnxcampo's session (which registers the library)."""
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
              for name, a in feeds.items()]
    outs = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in outputs.items()]
    model = helper.make_model(helper.make_graph([node], "op", inputs, outs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    onnx.checker.check_model(model)
    return run(make_session(model, provider=provider), feeds)
