"""ONNX nodes of the ``ai.onnxcampo`` ops, with their input and output order in one place.

A model that holds them needs :func:`import_domain`; running it needs the library
(:func:`onnxcampo.ops.library_path`).
"""

from __future__ import annotations

import math
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
    _same_length(name, inputs=inputs, outputs=outputs)
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
    _same_length(name, weights=weights, grads=grads, outputs=outputs)
    if velocities or velocity_outputs:
        _same_length(name, weights=weights, velocities=velocities, velocity_outputs=velocity_outputs)
    scale, extra = ([inv_scale], {"unscale": 1}) if inv_scale else ([], {})
    return helper.make_node("MultiTensorSGD", [lr, found_inf, *scale, *weights, *grads, *velocities],
                            [*outputs, *velocity_outputs], name=name, domain=DOMAIN, momentum=float(momentum), **extra)


def multi_tensor_adamw(lr: str, step: str, found_inf: str, weights: Sequence[str], grads: Sequence[str],
                       m: Sequence[str], v: Sequence[str], *, step_output: str, outputs: Sequence[str],
                       m_outputs: Sequence[str], v_outputs: Sequence[str], betas: tuple[float, float],
                       eps: float, weight_decay: float, inv_scale: str | None = None, name: str) -> onnx.NodeProto:
    """AdamW over all weights (``docs/ops.md`` has the formula); nothing changes, ``step``
    included, while ``found_inf`` is true. ``inv_scale``: as :func:`multi_tensor_sgd`'s."""
    _same_length(name, weights=weights, grads=grads, m=m, v=v, outputs=outputs, m_outputs=m_outputs,
                 v_outputs=v_outputs)
    scale, extra = ([inv_scale], {"unscale": 1}) if inv_scale else ([], {})
    return helper.make_node(
        "MultiTensorAdamW", [lr, step, found_inf, *scale, *weights, *grads, *m, *v],
        [step_output, *outputs, *m_outputs, *v_outputs], name=name, domain=DOMAIN,
        beta1=float(betas[0]), beta2=float(betas[1]), eps=float(eps), weight_decay=float(weight_decay), **extra)


def scatter_nd_add(data: str, indices: str, updates: str, *, output: str, name: str) -> onnx.NodeProto:
    """``output = ScatterNDAdd(data, indices, updates)``: ONNX ScatterND with ``reduction="add"``
    (data and updates float32 or float16, indices int64; duplicates accumulate, negative indices
    count from the end; ``docs/ops.md`` says what the kernels do with indices out of range)."""
    return helper.make_node("ScatterNDAdd", [data, indices, updates], [output], name=name, domain=DOMAIN)


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
                      input_types: Sequence[int] = (), column_sums: Sequence[int] | None = None,
                      column_sums_type: int = onnx.TensorProto.FLOAT, column_sums_shape: Sequence[int] | None = None,
                      name: str) -> onnx.NodeProto:
    """``(y_1..y_m) = FusedElementwise(x_1..x_n)``: the register program ``program`` (four ints per
    instruction, :mod:`onnxcampo.ops.elementwise`) run per element of the inputs' broadcast shape;
    output ``k`` is float32 (``output_types[k] == 1``) or float16 (10). The program is checked here
    (:class:`~onnxcampo.ops.elementwise.ProgramError`) as the kernels check it; ``constants`` is
    left out of the node when empty (ONNX has no empty-list attribute without a type).
    ``input_types`` (optional, one per input) are the element types the program was written for:
    the kernels check them, and run the node in fp32 where ORT's CPU provider casts its fp16
    inputs to fp32 (``docs/ops.md``). ``column_sums`` (``[k, Q]``): ``outputs`` holds one more
    name, last, for the column sums of output ``k`` (Q columns) in ``column_sums_type``, shaped
    ``column_sums_shape`` (default ``[Q]``)."""
    from onnxcampo.ops import elementwise

    summed = column_sums is not None
    if len(outputs) != len(output_types) + summed:
        raise ValueError(f"{name}: {len(outputs)} outputs but {len(output_types)} output_types"
                         + (" and the column sums" if summed else ""))
    elementwise.check(program, registers, constants, len(inputs), output_types)
    attributes = {"program": [int(v) for v in program], "registers": int(registers),
                  "output_types": [int(t) for t in output_types]}
    if len(constants):
        attributes["constants"] = [float(c) for c in constants]
    if len(input_types):
        if len(input_types) != len(inputs) or any(t not in elementwise.NUMPY_TYPES for t in input_types):
            raise ValueError(f"{name}: input_types must give 1 or 10 for each of the {len(inputs)} inputs")
        attributes["input_types"] = [int(t) for t in input_types]
    if summed:
        elementwise.check_column_sums(column_sums, column_sums_type, column_sums_shape, len(output_types))
        attributes["column_sums"] = [int(v) for v in column_sums]
        attributes["column_sums_type"] = int(column_sums_type)
        if column_sums_shape is not None:
            attributes["column_sums_shape"] = [int(d) for d in column_sums_shape]
    return helper.make_node(elementwise.OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN, **attributes)


def im2col_shape(x_shape: Sequence[int], *, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                 dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0)) -> tuple[int, int]:
    """``[C*kh*kw, N*Ho*Wo]``, the shape of ``Im2Col(x)`` for ``x`` of ``x_shape`` [N, C, H, W]
    (ONNX Conv arithmetic: ``Ho = (H + top + bottom - ((kh - 1)*dh + 1)) // sh + 1``). Raises
    ValueError for attributes the op refuses or a kernel larger than the padded image."""
    _check_im2col(kernel_shape, strides, dilations, pads)
    if len(x_shape) != 4:
        raise ValueError(f"Im2Col: x must be 4-D [N, C, H, W], got shape {list(x_shape)}")
    n, c, h, w = (int(d) for d in x_shape)
    (kh, kw), (sh, sw), (dh, dw), (top, left, bottom, right) = kernel_shape, strides, dilations, pads
    extent_h, extent_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    if extent_h > h + top + bottom or extent_w > w + left + right:
        raise ValueError(f"Im2Col: the kernel's extent {extent_h} x {extent_w} exceeds the padded input "
                         f"{h + top + bottom} x {w + left + right}")
    ho, wo = (h + top + bottom - extent_h) // sh + 1, (w + left + right - extent_w) // sw + 1
    return c * kh * kw, n * ho * wo


def im2col(x: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
           dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``columns = Im2Col(x)``: the column matrix of a 2-D convolution (ONNX Conv attributes; pads
    ``[top, left, bottom, right]``). x [N, C, H, W] (float32 or float16) -> [C*kh*kw, N*Ho*Wo] of
    x's type: ``columns[(c*kh + i)*kw + j, (n*Ho + oh)*Wo + ow] = x[n, c, oh*sh + i*dh - top,
    ow*sw + j*dw - left]``, 0 in the padding."""
    _check_im2col(kernel_shape, strides, dilations, pads)
    return helper.make_node("Im2Col", [x], [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])


def conv_weight_grad(x: str, dy: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                     dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                     name: str) -> onnx.NodeProto:
    """``dw = ConvWeightGrad(x, dy)``: the weight gradient of a 2-D convolution (ONNX Conv
    attributes, group 1; pads ``[top, left, bottom, right]``): x [N, Cin, H, W] and dy [N, Cout,
    Ho, Wo], both float32 or both float16 -> dw [Cout, Cin, kh, kw] of their type, ``dw[co, ci, i,
    j] = sum over n, oh, ow of dy[n, co, oh, ow] * x[n, ci, oh*sh + i*dh - top, ow*sw + j*dw -
    left]`` (sums in float32). On CUDA cuDNN's backward-filter convolution (pads must give cuDNN's
    symmetric-padding output size), on the CPU a direct loop."""
    _check_im2col(kernel_shape, strides, dilations, pads, op="ConvWeightGrad")
    return helper.make_node("ConvWeightGrad", [x, dy], [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])


def conv_nhwc(x: str, w: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
              dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), group: int = 1,
              name: str) -> onnx.NodeProto:
    """``y = ConvNhwc(x, w)``: a 2-D convolution in channels-last layout (ONNX Conv attributes, no
    bias; pads ``[top, left, bottom, right]``): x [N, H, W, Cin] and w [Cout, kh, kw, Cin / group]
    (cuDNN's KRSC filter), both float32 or both float16 -> y [N, Ho, Wo, Cout], sums in float32
    (``onnxcampo.ops.conv_nhwc`` has the numpy reference). ``group`` (dividing Cin and Cout; Cin
    for a depthwise convolution) is written only when not 1. On CUDA cuDNN (pads must give
    cuDNN's symmetric-padding output size), on the CPU a direct loop."""
    if int(group) < 1:
        raise ValueError(f"ConvNhwc: group must be a positive int, got {group}")
    node = _conv_nhwc_node("ConvNhwc", [x, w], output, kernel_shape, strides, dilations, pads, name)
    if int(group) != 1:
        node.attribute.append(helper.make_attribute("group", int(group)))
    return node


def conv_nhwc_data_grad(dy: str, w: str, *, output: str, input_spatial: Sequence[int], kernel_shape: Sequence[int],
                        strides: Sequence[int] = (1, 1), dilations: Sequence[int] = (1, 1),
                        pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``dx = ConvNhwcDataGrad(dy, w)``: the input gradient of :func:`conv_nhwc` (its adjoint in
    x, what ONNX ConvTranspose computes for a Conv's input): dy [N, Ho, Wo, Cout], w [Cout, kh, kw,
    Cin] -> dx [N, H, W, Cin] with ``input_spatial = (H, W)``."""
    if len(input_spatial) != 2 or any(int(v) < 1 for v in input_spatial):
        raise ValueError(f"ConvNhwcDataGrad: input_spatial must be 2 positive ints, got {list(input_spatial)}")
    node = _conv_nhwc_node("ConvNhwcDataGrad", [dy, w], output, kernel_shape, strides, dilations, pads, name)
    node.attribute.append(helper.make_attribute("input_spatial", [int(v) for v in input_spatial]))
    return node


def conv_nhwc_weight_grad(x: str, dy: str, *, output: str, kernel_shape: Sequence[int], strides: Sequence[int] = (1, 1),
                          dilations: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                          name: str) -> onnx.NodeProto:
    """``dw = ConvNhwcWeightGrad(x, dy)``: the filter gradient of :func:`conv_nhwc`: x [N, H, W,
    Cin], dy [N, Ho, Wo, Cout] -> dw [Cout, kh, kw, Cin] (KRSC), sums in float32."""
    return _conv_nhwc_node("ConvNhwcWeightGrad", [x, dy], output, kernel_shape, strides, dilations, pads, name)


def _conv_nhwc_node(op, inputs, output, kernel_shape, strides, dilations, pads, name) -> onnx.NodeProto:
    _check_im2col(kernel_shape, strides, dilations, pads, op=op)
    return helper.make_node(op, list(inputs), [output], name=name, domain=DOMAIN,
                            kernel_shape=[int(k) for k in kernel_shape], strides=[int(s) for s in strides],
                            dilations=[int(d) for d in dilations], pads=[int(p) for p in pads])


def max_pool_nhwc(x: str, *, output: str, argmax: str | None = None, kernel_shape: Sequence[int],
                  strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0), name: str) -> onnx.NodeProto:
    """``y[, argmax] = MaxPoolNhwc(x)``: a 2-D max pooling in channels-last layout (ONNX MaxPool's
    ``kernel_shape``, ``strides``, ``pads`` ``[top, left, bottom, right]``; no dilations, Ho, Wo
    rounded down; each pad below the kernel size along its axis, ``kh * kw <= 255``): x [N, H, W,
    C] (float32 or float16) -> y [N, Ho, Wo, C] of x's type and, when ``argmax`` names an output,
    the uint8 tap ``i*kw + j`` of each window's first maximum (``onnxcampo.ops.max_pool`` has the
    numpy reference), which :func:`max_pool_nhwc_grad` reads."""
    _check_max_pool("MaxPoolNhwc", kernel_shape, strides, pads)
    return helper.make_node("MaxPoolNhwc", [x], [output] + ([argmax] if argmax else []), name=name, domain=DOMAIN,
                            **_max_pool_attributes(kernel_shape, strides, pads))


def max_pool_nhwc_grad(dy: str, argmax: str, *, output: str, input_spatial: Sequence[int], kernel_shape: Sequence[int],
                       strides: Sequence[int] = (1, 1), pads: Sequence[int] = (0, 0, 0, 0),
                       name: str) -> onnx.NodeProto:
    """``dx = MaxPoolNhwcGrad(dy, argmax)``: the input gradient of :func:`max_pool_nhwc`: dy [N,
    Ho, Wo, C] (float32 or float16) and its argmax -> dx [N, H, W, C] of dy's type with
    ``input_spatial = (H, W)``; each dy added to the element its argmax names, the sums in
    float32 in a fixed order (no scatter, deterministic)."""
    _check_max_pool("MaxPoolNhwcGrad", kernel_shape, strides, pads)
    if len(input_spatial) != 2 or any(int(v) < 1 for v in input_spatial):
        raise ValueError(f"MaxPoolNhwcGrad: input_spatial must be 2 positive ints, got {list(input_spatial)}")
    return helper.make_node("MaxPoolNhwcGrad", [dy, argmax], [output], name=name, domain=DOMAIN,
                            input_spatial=[int(v) for v in input_spatial],
                            **_max_pool_attributes(kernel_shape, strides, pads))


def nchw_to_nhwc(x: str, *, output: str, to: int, channels: int | None = None, name: str) -> onnx.NodeProto:
    """``y = NchwToNhwc(x)``: x [N, C, S...] (float32 or float16) channels-last, as ``to`` (1
    float32, 10 float16: rounded to nearest even), with zero channels appended up to ``channels``
    (default C): ``Pad(Cast(Transpose(x, [0, 2, ..., 1])))`` in one pass (``onnxcampo.ops.conv_nhwc``
    has the numpy reference)."""
    if to not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: to must be 1 (float32) or 10 (float16), got {to}")
    attributes = {"to": int(to)}
    if channels is not None:
        if int(channels) < 1:
            raise ValueError(f"{name}: channels must be >= 1, got {channels}")
        attributes["channels"] = int(channels)
    return helper.make_node("NchwToNhwc", [x], [output], name=name, domain=DOMAIN, **attributes)


def _max_pool_attributes(kernel_shape, strides, pads) -> dict:
    return {"kernel_shape": [int(k) for k in kernel_shape], "strides": [int(s) for s in strides],
            "pads": [int(p) for p in pads]}


def _check_max_pool(op: str, kernel_shape, strides, pads) -> None:
    from onnxcampo.ops.max_pool import MAX_TAPS

    for label, values, count, low in (("kernel_shape", kernel_shape, 2, 1), ("strides", strides, 2, 1),
                                      ("pads", pads, 4, 0)):
        if len(values) != count or any(int(v) < low for v in values):
            kind = "positive" if low else "non-negative"
            raise ValueError(f"{op}: {label} must be {count} {kind} ints, got {list(values)}")
    kh, kw = (int(k) for k in kernel_shape)
    if kh * kw > MAX_TAPS:
        raise ValueError(f"{op}: kernel_shape {[kh, kw]} has {kh * kw} taps; at most {MAX_TAPS} (argmax is one byte)")
    top, left, bottom, right = (int(p) for p in pads)
    if max(top, bottom) >= kh or max(left, right) >= kw:
        raise ValueError(f"{op}: pads {[top, left, bottom, right]} must each be below the kernel size along their axis "
                         f"(kernel_shape {[kh, kw]})")


def _check_im2col(kernel_shape, strides, dilations, pads, op: str = "Im2Col") -> None:
    for label, values, count, low in (("kernel_shape", kernel_shape, 2, 1), ("strides", strides, 2, 1),
                                      ("dilations", dilations, 2, 1), ("pads", pads, 4, 0)):
        if len(values) != count or any(int(v) < low for v in values):
            kind = "positive" if low else "non-negative"
            raise ValueError(f"{op}: {label} must be {count} {kind} ints, got {list(values)}")


def block_reduce_sum(x: str, *, output: str, sizes: Sequence[int], output_type: int = onnx.TensorProto.FLOAT,
                     output_shape: Sequence[int] | None = None, input_type: int | None = None,
                     name: str) -> onnx.NodeProto:
    """``y = BlockReduceSum(x)``: ``x`` (float16 or float32, ``P*Q*R`` elements, any shape) read as
    a contiguous ``[P, Q, R]`` array and summed over axes 0 and 2 in float32, rounded once to
    ``output_type`` (1 float32, 10 float16); ``y`` is shaped ``output_shape`` (default ``[Q]``).
    ``input_type`` (optional): the type ``x`` was planned in; a float16 ``x`` that ORT's CPU
    provider turns into float32 (running the node in fp32) makes a float16 ``y`` float32 too."""
    sizes = [int(s) for s in sizes]
    if len(sizes) != 3 or min(sizes) < 0:
        raise ValueError(f"{name}: sizes must be three ints [P, Q, R] >= 0, got {sizes}")
    if output_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: output_type must be 1 (float32) or 10 (float16), got {output_type}")
    attributes = {"sizes": sizes, "output_type": int(output_type)}
    if input_type is not None:
        if input_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            raise ValueError(f"{name}: input_type must be 1 (float32) or 10 (float16), got {input_type}")
        attributes["input_type"] = int(input_type)
    if output_shape is not None:
        shape = [int(d) for d in output_shape]
        if min(shape, default=0) < 0 or math.prod(shape) != sizes[1]:
            raise ValueError(f"{name}: output_shape {shape} must hold Q = {sizes[1]} elements")
        attributes["output_shape"] = shape
    return helper.make_node("BlockReduceSum", [x], [output], name=name, domain=DOMAIN, **attributes)


def _output_type(name: str, output_type: int) -> int:
    if output_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        raise ValueError(f"{name}: output_type must be 1 (float32) or 10 (float16), got {output_type}")
    return int(output_type)


def softmax_cross_entropy(x: str, labels: str, *, picked: str, lse: str, classes: int | None = None,
                          output_type: int = onnx.TensorProto.FLOAT, name: str) -> onnx.NodeProto:
    """``(picked, lse) = SoftmaxCrossEntropy(x, labels)``: the log softmax of each row of ``x`` (its
    first ``classes`` columns) at the row's label, and the row's log-sum-exp (float32); both
    shaped like ``labels`` (``onnxcampo.ops.cross_entropy``)."""
    attributes = {"output_type": _output_type(name, output_type)}
    if classes is not None:
        attributes["classes"] = int(classes)
    return helper.make_node("SoftmaxCrossEntropy", [x, labels], [picked, lse], name=name, domain=DOMAIN, **attributes)


def softmax_cross_entropy_grad(x: str, lse: str, labels: str, scale: str, *, output: str, classes: int | None = None,
                               output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                               output_columns: int | None = None, name: str) -> onnx.NodeProto:
    """``dx = SoftmaxCrossEntropyGrad(x, lse, labels, scale)``: ``scale * (OneHot(labels) -
    softmax(x))`` row by row, ``scale`` one value or one per row; shaped ``output_shape`` (default
    x's shape with the last dimension ``output_columns``); ``output_columns`` (default
    ``classes``) pads each row with zeros."""
    attributes = {"output_type": _output_type(name, output_type)}
    if classes is not None:
        attributes["classes"] = int(classes)
    if output_columns is not None:
        attributes["output_columns"] = int(output_columns)
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    return helper.make_node("SoftmaxCrossEntropyGrad", [x, lse, labels, scale], [output], name=name, domain=DOMAIN,
                            **attributes)


def layer_norm_grad(dy: str, xhat: str, invstd: str, gamma: str, acc: str | None = None, *, output: str,
                    output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                    name: str) -> onnx.NodeProto:
    """``dx = LayerNormGrad(dy, xhat, invstd, gamma[, acc])``: a layer normalization's input
    gradient row by row (``onnxcampo.ops.layer_norm``), ``acc`` added when given."""
    attributes = {"output_type": _output_type(name, output_type)}
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    inputs = [dy, xhat, invstd, gamma] + ([acc] if acc else [])
    return helper.make_node("LayerNormGrad", inputs, [output], name=name, domain=DOMAIN, **attributes)


def softmax_grad(dy: str, y: str, *, output: str, cols: int, scale: float = 1.0,
                 output_type: int = onnx.TensorProto.FLOAT, output_shape: Sequence[int] | None = None,
                 name: str) -> onnx.NodeProto:
    """``dx = SoftmaxGrad(dy, y)``: ``scale * y * (dy - sum(dy * y))`` over rows of ``cols``
    (``onnxcampo.ops.softmax``), ``y`` the softmax's output."""
    if int(cols) < 1:
        raise ValueError(f"{name}: cols must be >= 1, got {cols}")
    attributes = {"cols": int(cols), "output_type": _output_type(name, output_type)}
    if float(scale) != 1.0:
        attributes["scale"] = float(scale)
    if output_shape is not None:
        attributes["output_shape"] = [int(d) for d in output_shape]
    return helper.make_node("SoftmaxGrad", [dy, y], [output], name=name, domain=DOMAIN, **attributes)
