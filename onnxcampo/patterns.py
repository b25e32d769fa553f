"""Multi-node patterns whose numerical risk differs from that of their ops one by one.

The tanh approximation of GELU (GPT-2's ``gelu_new``, BERT variants, ViT) computes
``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``. ``Pow`` is on the deny list, but
here ``x^3`` only feeds ``x + c * x^3`` (same sign as ``x``, so no inf - inf) and then ``Tanh``,
which saturates: in fp16 ``x^3`` overflows to +-inf for |x| > 40, ``tanh(+-inf) = +-1``, and the
result is ``x`` or ``0``, which is what GELU gives there. ONNX Runtime fuses the same pattern into
``FastGelu``, an infer-list op. Its ``Pow`` is therefore treated as an infer-list op.

The derivative of the exact (erf) GELU, which onnx-ad writes into every BERT backward pass,
computes the Gaussian ``exp(-u * u)``: ``Exp`` is on the deny list, but its argument here is never
positive, so the result lies in (0, 1]; in fp16 ``u * u`` overflows to +inf for |u| > 256 and
``exp(-inf) = 0``, the limit, and ``exp`` of an argument below -17 underflows to 0 where the
Gaussian factor no longer matters. Such an ``Exp`` (of ``Neg(Mul(u, u))`` or ``Neg(Pow(u, 2))``,
that ``Pow`` included) is treated as an infer-list op too.

The gradient of ``y = Softmax(x)`` is ``y * (dy - sum(y * dy))`` over the softmax axis: its
``ReduceSum`` sums ``y_i * dy_i`` with ``y_i >= 0`` and ``sum(y_i) = 1``, a weighted mean of ``dy``,
bounded by ``max |dy|`` like ReduceMean, and ONNX Runtime's kernels accumulate fp16 in fp32. Such a
``ReduceSum`` (of ``Mul(y', dy)`` with ``y'`` the Softmax output through shape-only ops, over the
softmax axis) is an infer-list op.

A ``Transpose`` that moves a batch axis next to the matrix axes (perm ``[1, ..., r-2, 0, r-1]`` or
``[1, ..., r-2, r-1, 0]``) and feeds a ``MatMul`` whose other operand has rank 1 or 2 is what ONNX
Runtime's ``MatmulTransposeFusion`` turns into a ``FusedMatMul`` with ``transBatchA/B``; in fp16,
creating a CPU session of it at ``ORT_ENABLE_ALL`` crashes the process with SIGSEGV (ORT 1.32.0,
either operand side, the operand an initializer, a Constant or a Cast of one; basic and extended
levels, an fp32 graph and a 3-D operand load). Such a Transpose stays fp32 (a Cast between it and
the MatMul keeps ORT from fusing them): :func:`ort_cpu_crashing_transposes`.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxcampo import oplists

_CUBE = 3.0


def _single_consumer(ctx, tensor: gs.Tensor, op: str) -> gs.Node | None:
    consumers = list(tensor.outputs)
    if len(consumers) == 1 and consumers[0].op == op and tensor.name not in ctx.graph_outputs:
        return consumers[0]
    return None


def _constant_operand(ctx, node: gs.Node, other: gs.Tensor) -> bool:
    operands = [t for t in node.inputs if t is not other]
    return len(operands) == 1 and ctx.is_constant(operands[0])


def _moves_batch_axis(perm) -> bool:
    rank = len(perm)
    if rank < 3 or list(perm[:rank - 2]) != list(range(1, rank - 1)):
        return False
    return list(perm[rank - 2:]) in ([0, rank - 1], [rank - 1, 0])


def ort_cpu_crashing_transposes(ctx) -> set[str]:
    """Names of ``Transpose`` nodes that move a batch axis and feed a ``MatMul`` (directly or
    through ``Identity``) whose other operand has rank <= 2, or an unknown rank (module
    docstring: ORT's CPU EP crashes loading them in fp16)."""
    found = set()
    for node in ctx.nodes:
        perm = node.attrs.get("perm") if node.op == "Transpose" else None
        if not perm or not _moves_batch_axis([int(p) for p in perm]):
            continue
        readers, seen = list(node.outputs[0].outputs) if node.outputs else [], set()
        while readers:
            reader = readers.pop()
            if id(reader) in seen:
                continue
            seen.add(id(reader))
            if reader.op == "Identity" and reader.outputs:
                readers.extend(reader.outputs[0].outputs)
                continue
            if reader.op != "MatMul" or len(reader.inputs) != 2:
                continue
            others = [t for t in reader.inputs if not _reads(t, node.outputs[0])]
            ranks = [_rank(ctx, t) for t in others]
            if not others or any(rank is None or rank <= 2 for rank in ranks):
                found.add(node.name)
                break
    return found


def _rank(ctx, tensor: gs.Tensor) -> int | None:
    shape = _shape(ctx, tensor)
    if shape is None and isinstance(tensor, gs.Constant):
        shape = tensor.shape
    return None if shape is None else len(shape)


def _reads(tensor: gs.Tensor, source: gs.Tensor) -> bool:
    """Whether ``tensor`` is ``source``, or ``source`` through Identity nodes."""
    while tensor is not source:
        producer = tensor.inputs[0] if tensor.inputs else None
        if producer is None or producer.op != "Identity":
            return False
        tensor = producer.inputs[0]
    return True


def tanh_gelu_powers(ctx) -> set[str]:
    """Names of ``Pow`` nodes that start a tanh-GELU: ``Pow(x, 3) -> Mul(c) -> Add(x) ->
    Mul(c) -> Tanh``, each intermediate read by the next node only."""
    found = set()
    for node in ctx.nodes:
        if node.op != "Pow" or len(node.inputs) != 2 or not ctx.is_constant(node.inputs[1]):
            continue
        exponent = np.asarray(ctx.constant_array(node.inputs[1]), dtype=np.float64)
        if exponent.size != 1 or float(exponent.reshape(-1)[0]) != _CUBE:
            continue
        x, cube = node.inputs[0], node.outputs[0]
        scaled = _single_consumer(ctx, cube, "Mul")
        if scaled is None or not _constant_operand(ctx, scaled, cube):
            continue
        summed = _single_consumer(ctx, scaled.outputs[0], "Add")
        if summed is None or x not in summed.inputs:
            continue
        argument = _single_consumer(ctx, summed.outputs[0], "Mul")
        if argument is None or not _constant_operand(ctx, argument, summed.outputs[0]):
            continue
        if _single_consumer(ctx, argument.outputs[0], "Tanh") is not None:
            found.add(node.name)
    return found


def gaussian_exps(ctx) -> set[str]:
    """Names of ``Exp`` nodes computing ``exp(-u * u)``: ``Exp(Neg(Mul(u, u)))`` or
    ``Exp(Neg(Pow(u, 2)))``, each intermediate read by the next node only (and of that ``Pow``,
    also a deny-list op, whose overflow only takes the Gaussian to its limit 0)."""
    found = set()
    for node in ctx.nodes:
        if node.op != "Exp":
            continue
        negated = node.inputs[0].inputs[0] if node.inputs[0].inputs else None
        if negated is None or negated.op != "Neg" or _single_consumer(ctx, negated.outputs[0], "Exp") is not node:
            continue
        square = negated.inputs[0].inputs[0] if negated.inputs[0].inputs else None
        if square is None or _single_consumer(ctx, square.outputs[0], "Neg") is not negated:
            continue
        if square.op == "Mul" and len(square.inputs) == 2 and square.inputs[0] is square.inputs[1]:
            found.add(node.name)
        elif square.op == "Pow" and len(square.inputs) == 2 and ctx.is_constant(square.inputs[1]):
            exponent = np.asarray(ctx.constant_array(square.inputs[1]), dtype=np.float64).reshape(-1)
            if exponent.size == 1 and float(exponent[0]) == 2.0:
                found |= {node.name, square.name}
    return found


def _through_shape_ops(tensor: gs.Tensor) -> gs.Tensor:
    while tensor.inputs and tensor.inputs[0].op in oplists.SHAPE_ONLY:
        tensor = tensor.inputs[0].inputs[0]
    return tensor


def _split(shape, axis: int) -> tuple[int, int, int]:
    """(product of the dims before ``axis``, the dim, product of the dims after)."""
    return int(np.prod(shape[:axis], dtype=np.int64)), int(shape[axis]), int(np.prod(shape[axis + 1:], dtype=np.int64))


def softmax_gradient_sums(ctx) -> set[str]:
    """Names of ``ReduceSum`` nodes summing ``y * dy`` over the axis of the Softmax that made ``y``
    (in a row-major layout: the same rows, whatever shape-only ops moved ``y`` in between)."""
    found = set()
    for node in ctx.nodes:
        if node.op != "ReduceSum" or not node.inputs or not node.inputs[0].inputs:
            continue
        product = node.inputs[0].inputs[0]
        if product.op != "Mul" or len(product.inputs) != 2 or _single_consumer(ctx, product.outputs[0], "ReduceSum") is not node:
            continue
        shape = _shape(ctx, node.inputs[0])
        axes = _constant_axes(ctx, node)
        if shape is None or axes is None or len(axes) != 1 or any(not isinstance(d, int) for d in shape):
            continue
        reduced = _split(shape, axes[0] % len(shape))
        for operand in product.inputs:
            source = _through_shape_ops(operand)
            softmax = source.inputs[0] if source.inputs else None
            if softmax is None or softmax.op != "Softmax":
                continue
            y_shape = _shape(ctx, source)
            if y_shape is None or any(not isinstance(d, int) for d in y_shape):
                continue
            axis = int(softmax.attrs.get("axis", -1)) % len(y_shape)
            if _split(y_shape, axis) == reduced:
                found.add(node.name)
                break
    return found


def _constant_axes(ctx, node: gs.Node) -> list[int] | None:
    if len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].name:
        if not ctx.is_constant(node.inputs[1]):
            return None
        return [int(a) for a in np.asarray(ctx.constant_array(node.inputs[1])).reshape(-1)]
    axes = node.attrs.get("axes")
    return [int(a) for a in axes] if axes else None


# --- chains ONNX Runtime may fuse (their measured cost: onnxcampo.costdb.chains) --------------

def _shape(ctx, tensor: gs.Tensor):
    entry = ctx.info.get(tensor.name)
    return entry.shape if entry is not None else None


def _bias_add(ctx, tensor: gs.Tensor) -> gs.Node | None:
    """The Add reading ``tensor`` and a constant vector (a bias), if that is its only reader."""
    add = _single_consumer(ctx, tensor, "Add")
    if add is None or not _constant_operand(ctx, add, tensor):
        return None
    other = next(t for t in add.inputs if t is not tensor)
    shape = _shape(ctx, other)
    return add if shape is not None and sum(d != 1 for d in shape) <= 1 else None


def _erf_gelu(ctx, x: gs.Tensor) -> list[gs.Node] | None:
    """torch's erf GELU on ``x``: Div(x, c) -> Erf -> Add(c) -> Mul(x, .) -> Mul(., c)."""
    readers = list(x.outputs)
    if len(readers) != 2 or x.name in ctx.graph_outputs:
        return None
    div = next((n for n in readers if n.op == "Div" and n.inputs[0] is x and _constant_operand(ctx, n, x)), None)
    if div is None:
        return None
    erf = _single_consumer(ctx, div.outputs[0], "Erf")
    plus = erf and _single_consumer(ctx, erf.outputs[0], "Add")
    if plus is None or not _constant_operand(ctx, plus, erf.outputs[0]):
        return None
    product = _single_consumer(ctx, plus.outputs[0], "Mul")
    if product is None or x not in product.inputs or product not in readers:
        return None
    half = _single_consumer(ctx, product.outputs[0], "Mul")
    if half is None or not _constant_operand(ctx, half, product.outputs[0]):
        return None
    return [div, erf, plus, product, half]


def fusion_chains(ctx) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{node name: (pattern, member names)}`` for every node of a chain of
    :data:`onnxcampo.costdb.chains.PATTERNS`; a node belongs to one chain at most (a bias Add
    followed by a GELU is a ``bias_gelu``, not the end of a ``matmul_bias``)."""
    chains: dict[str, tuple[str, tuple[str, ...]]] = {}

    def claim(pattern: str, nodes: list[gs.Node]) -> None:
        names = tuple(n.name for n in nodes)
        if not any(name in chains for name in names):
            for name in names:
                chains[name] = (pattern, names)

    for node in ctx.nodes:
        if node.op == "Add" and len(node.inputs) == 2:
            bias = next((t for t in node.inputs if ctx.is_constant(t)), None)
            if bias is not None and _bias_add(ctx, next(t for t in node.inputs if t is not bias)) is node:
                gelu = _erf_gelu(ctx, node.outputs[0])
                if gelu is not None:
                    claim("bias_gelu", [node, *gelu])
    for node in ctx.nodes:
        if node.op == "Conv" and node.outputs:
            out = node.outputs[0]
            add = _single_consumer(ctx, out, "Add")
            if add is not None and not any(ctx.is_constant(t) for t in add.inputs):
                relu = _single_consumer(ctx, add.outputs[0], "Relu")
                if relu is not None:
                    claim("conv_add_relu", [node, add, relu])
                    continue
            relu = _single_consumer(ctx, out, "Relu")
            if relu is not None:
                claim("conv_relu", [node, relu])
        elif node.op == "MatMul" and len(node.inputs) == 2 and ctx.is_constant(node.inputs[1]) \
                and len(_shape(ctx, node.inputs[0]) or ()) == 2:  # measured on 2-D products only
            add = _bias_add(ctx, node.outputs[0])
            if add is not None:
                claim("matmul_bias", [node, add])
        elif node.op == "Add" and len(node.inputs) == 2 and not any(ctx.is_constant(t) for t in node.inputs):
            norm = _single_consumer(ctx, node.outputs[0], "LayerNormalization")
            if norm is not None:
                claim("add_layernorm", [node, norm])
    return chains
