"""ONNX nodes of the ``ai.onnxcampo`` ops, with their input and output order in one place.

A model that holds them needs :func:`import_domain`; running it needs the library
(:func:`onnxcampo.ops.library_path`).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import helper

from onnxcampo.ops import DOMAIN, OPSET_VERSION


def import_domain(model: onnx.ModelProto) -> None:
    """Add the ``ai.onnxcampo`` opset import if the model lacks it."""
    if not any(opset.domain == DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))


def unscale_check_finite(inv_scale: str, grads: Sequence[str], *, found_inf: str, outputs: Sequence[str],
                         name: str) -> onnx.NodeProto:
    """``(found_inf, u_1..u_n) = UnscaleCheckFinite(inv_scale, g_1..g_n)``; ``u_i = float32(g_i) * inv_scale``."""
    _same_length(name, grads=grads, outputs=outputs)
    return helper.make_node("UnscaleCheckFinite", [inv_scale, *grads], [found_inf, *outputs], name=name, domain=DOMAIN)


def multi_tensor_sgd(lr: str, found_inf: str, weights: Sequence[str], grads: Sequence[str],
                     velocities: Sequence[str] = (), *, outputs: Sequence[str], velocity_outputs: Sequence[str] = (),
                     momentum: float = 0.0, name: str) -> onnx.NodeProto:
    """SGD over all weights: with velocities ``v' = momentum*v + g; w' = w - lr*v'``, without
    ``w' = w - lr*g``; nothing changes while ``found_inf`` is true."""
    _same_length(name, weights=weights, grads=grads, outputs=outputs)
    if velocities or velocity_outputs:
        _same_length(name, weights=weights, velocities=velocities, velocity_outputs=velocity_outputs)
    return helper.make_node("MultiTensorSGD", [lr, found_inf, *weights, *grads, *velocities],
                            [*outputs, *velocity_outputs], name=name, domain=DOMAIN, momentum=float(momentum))


def multi_tensor_adamw(lr: str, step: str, found_inf: str, weights: Sequence[str], grads: Sequence[str],
                       m: Sequence[str], v: Sequence[str], *, step_output: str, outputs: Sequence[str],
                       m_outputs: Sequence[str], v_outputs: Sequence[str], betas: tuple[float, float],
                       eps: float, weight_decay: float, name: str) -> onnx.NodeProto:
    """AdamW over all weights (``docs/ops.md`` has the formula); nothing changes, ``step``
    included, while ``found_inf`` is true."""
    _same_length(name, weights=weights, grads=grads, m=m, v=v, outputs=outputs, m_outputs=m_outputs,
                 v_outputs=v_outputs)
    return helper.make_node(
        "MultiTensorAdamW", [lr, step, found_inf, *weights, *grads, *m, *v],
        [step_output, *outputs, *m_outputs, *v_outputs], name=name, domain=DOMAIN,
        beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay))


def _same_length(name: str, **lists: Sequence[str]) -> None:
    lengths = {key: len(value) for key, value in lists.items()}
    if len(set(lengths.values())) != 1 or 0 in lengths.values():
        raise ValueError(f"{name}: lists must be non-empty and of one length, got {lengths}")


def avg_matmul_integer(a: str, b: str, a_zero_point: str = "", b_zero_point: str = "", *, output: str,
                       name: str, exact: bool = False) -> onnx.NodeProto:
    """``Y = AvgMatMulInteger(A, B[, a_zero_point, b_zero_point])``: uint8 [M, K] x uint8 [K, N]
    -> float32 [M, N], the products summed by tree averaging in 16 bits (``docs/avg-matmul.md``);
    ``exact=True`` gives ``ExactMatMulInteger``, the same with exact 32-bit accumulation."""
    inputs = [a, b, a_zero_point, b_zero_point]
    while inputs[-1] == "":
        inputs.pop()
    op = "ExactMatMulInteger" if exact else "AvgMatMulInteger"
    return helper.make_node(op, inputs, [output], name=name, domain=DOMAIN)


def fused_elementwise(inputs: Sequence[str], outputs: Sequence[str], *, program: Sequence[int], registers: int,
                      constants: Sequence[float] = (), output_types: Sequence[int],
                      input_types: Sequence[int] = (), name: str) -> onnx.NodeProto:
    """``(y_1..y_m) = FusedElementwise(x_1..x_n)``: the register program ``program`` (four ints per
    instruction, :mod:`onnxcampo.ops.elementwise`) run per element of the inputs' broadcast shape;
    output ``k`` is float32 (``output_types[k] == 1``) or float16 (10). The program is checked here
    (:class:`~onnxcampo.ops.elementwise.ProgramError`) as the kernels check it; ``constants`` is
    left out of the node when empty (ONNX has no empty-list attribute without a type).
    ``input_types`` (optional, one per input) are the element types the program was written for:
    the kernels check them, and run the node in fp32 where ORT's CPU provider casts its fp16
    inputs to fp32 (``docs/ops.md``)."""
    from onnxcampo.ops import elementwise

    if len(outputs) != len(output_types):
        raise ValueError(f"{name}: {len(outputs)} outputs but {len(output_types)} output_types")
    elementwise.check(program, registers, constants, len(inputs), output_types)
    attributes = {"program": [int(v) for v in program], "registers": int(registers),
                  "output_types": [int(t) for t in output_types]}
    if len(constants):
        attributes["constants"] = [float(c) for c in constants]
    if len(input_types):
        if len(input_types) != len(inputs) or any(t not in elementwise.NUMPY_TYPES for t in input_types):
            raise ValueError(f"{name}: input_types must give 1 or 10 for each of the {len(inputs)} inputs")
        attributes["input_types"] = [int(t) for t in input_types]
    return helper.make_node(elementwise.OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, **attributes)
