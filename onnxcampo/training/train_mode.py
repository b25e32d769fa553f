"""Training-mode BatchNormalization and Dropout in a step graph, as explicit math in standard ops.

onnx-ad differentiates BatchNormalization only in inference mode (frozen statistics) and Dropout
only as the identity. :func:`apply_train_mode` rewrites the forward, before differentiation, so
that onnx-ad sees plain ReduceMean/Sub/Mul/Div/Where arithmetic and the gradient through the batch
statistics comes out of the chain rule. Which nodes train (``train_mode``):

1. ``None`` (the default): each node as exported: a BatchNormalization with ``training_mode=1``
   (``torch.onnx.export(..., training=torch.onnx.TrainingMode.TRAINING)``) and a Dropout whose
   ``training_mode`` input is a constant true train; inference-mode nodes stay as they are.
2. ``True``: every BatchNormalization and every Dropout of the graph trains (an eval-mode
   export; PyTorch leaves its Dropouts out of such exports, other exporters keep them).
3. ``False``: none does; training-mode nodes are turned into their inference form.

A training BatchNormalization ``Y = BN(X, scale, B, input_mean, input_var)`` (``X`` of shape
``[N, C, D1, ...]``; statistics over every axis but 1) becomes, in ``X``'s shape broadcast::

    mean   = ReduceMean(X)                     batch mean
    D      = X - Where(train, mean, input_mean)
    var    = ReduceMean(D * D)                 batch variance (biased), two-pass
    invstd = 1 / Sqrt(Where(train, var, input_var) + epsilon)
    Y      = D * (scale * invstd) + B

Its gradient is not left to the chain rule through those nodes (a dozen passes over ``X``'s
size): onnx-ad differentiates the whole normalization as one node, ``ai.onnxcampo::
BatchNormTraining`` (a placeholder that only exists while :func:`onnxcampo.training.step.
build_train_step` differentiates; :func:`lower_batchnorms` then writes the forward above in its
place), whose reverse rule is the closed form, with ``xhat = D * invstd``, sums over the
statistics' axes and ``n`` the values a channel::

    dB     = sum(dY)
    dscale = sum(dY * xhat)
    dX     = (scale * invstd) * (dY - dB / n - xhat * dscale / n)

two reductions and one elementwise pass, the form the fused reductions and elementwise kernels
take (``tests/training/test_train_mode.py`` checks it against numpy and finite differences). The
forward's statistics stay means (no float16 sum of a whole channel to overflow under an
all-float16 plan); ``--fuse-reductions`` makes each one a float32 block sum and a multiplication
by 1/n (``onnxcampo/rewrites/reductions.py``, rule 7).

``train`` is the boolean initializer ``onnxcampo.train_mode`` (true). The running statistics
become state inputs paired with ``<name>.updated`` outputs, updated with ONNX's momentum
convention (``momentum`` attribute, default 0.9)::

    running_mean' = running_mean * momentum + mean * (1 - momentum)
    running_var'  = running_var * momentum + var * n / (n - 1) * (1 - momentum)

with ``n = N * D1 * ...`` the values per channel: the unbiased batch variance, as PyTorch
updates ``running_var`` (``running_var="unbiased"``, the default, so that running statistics
trained here equal PyTorch's); ``running_var="biased"`` leaves the factor out, as the ONNX
specification's reference and ONNX Runtime's training-mode kernel do. The state is named after
the forward model's initializer when that name holds ``mean`` (``var``), else
``<initializer>.running_mean`` (``.running_var``); metadata ``onnxcampo.running_stats`` maps
state names to the forward's initializers.

A training Dropout ``Y = Dropout(X, ratio)`` becomes ``Y = X * Where(train, keep / (1 - ratio),
1)``; ``keep`` is ``u >= ratio`` for a pseudo-random ``u`` uniform in [0, 1), a function of the
element's index, the node and the scalar state input ``dropout_seed`` (its ``.updated`` output is
the seed plus one, so each step draws a new mask and a run is reproduced by its starting seed,
``Trainer(seed=)``). The generator is exact int64 arithmetic (``x -> (x*x + k) mod (2^31 - 1)``
rounds over a Weyl sequence; :func:`dropout_mask` is its numpy twin): no provider rounds it
differently (checked on ORT CPU; on CUDA a step's losses follow the CPU's, docs/guide/training.md),
and the stream is state the Trainer sets and checkpoints (``RandomUniformLike``'s ``seed`` is an
attribute, fixed in the graph).

Evaluation (:func:`onnxcampo.training.evaluate.eval_model`) makes every ``Where`` reading
``onnxcampo.train_mode`` take its false branch: running statistics, no dropout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_ad.rules import reverse_rule

from onnxcampo import ir
from onnxcampo.errors import ConfigError, UnsupportedModelError
from onnxcampo.ops import DOMAIN
from onnxcampo.training.trainable import forward_values

TRAIN_FLAG = "onnxcampo.train_mode"  # bool initializer, True; eval_model takes the Wheres' false branch
RUNNING_KEY = "onnxcampo.running_stats"  # metadata: JSON {state name: forward initializer}
DROPOUT_SEED = "dropout_seed"
RUNNING_VARS = ("unbiased", "biased")
UPDATED = ".updated"
PLACEHOLDER = "BatchNormTraining"  # ai.onnxcampo, only between apply_train_mode and lower_batchnorms
PLACEHOLDER_DOMAIN = DOMAIN

# The dropout generator: a Weyl sequence x = base + i, then three rounds mod the Mersenne prime
# P = 2^31 - 1, each product below 2^63 so int64 never overflows: x*A + k2, then x*x + k3, x*x + k2.
PRIME = 2 ** 31 - 1
WEYL = 48271  # Park and Miller's multiplier
SEED_STRIDE, NODE_STRIDE, OFFSET = 40503, 69069, 12345


@dataclass(frozen=True)
class TrainModeRewrite:
    """What :func:`apply_train_mode` changed: the state it added (inputs paired with
    ``.updated`` outputs) and their starting values, named as the state."""

    running: dict[str, str] = field(default_factory=dict)  # state name -> forward initializer
    initial: tuple[onnx.TensorProto, ...] = ()
    outputs: tuple[onnx.ValueInfoProto, ...] = ()
    batchnorms: int = 0
    dropouts: int = 0

    def summary(self) -> str:
        return f"train mode: {self.batchnorms} BatchNormalization with batch statistics, {self.dropouts} Dropout"


def apply_train_mode(model: onnx.ModelProto, *, train_mode: bool | None = None,
                     running_var: str = "unbiased") -> TrainModeRewrite:
    """Rewrite ``model``'s BatchNormalization and Dropout nodes in place (module docstring).

    Requires static shapes for the inputs of the nodes that train (pinned inputs), running
    statistics held in initializers read by no other node, and constant Dropout ratios. Nodes
    inside If/Loop/Scan bodies are left as they are."""
    if running_var not in RUNNING_VARS:
        raise ConfigError(f"running_var must be one of {', '.join(RUNNING_VARS)}, not {running_var!r}")
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    constants = forward_values(model)  # initializers and Constant nodes (PyTorch's Dropout ratio)
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in ir.outer_scope_names(node) if ir.has_subgraph(node) else ():
            readers[name] = readers.get(name, 0) + 1
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for output in graph.output:
        readers[output.name] = readers.get(output.name, 0) + 1
    plans = [(node, _trains(node, train_mode, constants)) for node in graph.node]
    if not any(train for _, train in plans):
        for node, _ in plans:
            _to_inference(node, readers)
        return TrainModeRewrite()
    info, _ = ir.infer_tensor_info(model)
    emit = _Emitter(model)
    running: dict[str, str] = {}
    initial: list[onnx.TensorProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    nodes: list[onnx.NodeProto] = []
    batchnorms = dropouts = 0
    for node, train in plans:
        if not train:
            _to_inference(node, readers)
            nodes.append(node)
        elif node.op_type == "BatchNormalization":
            nodes.extend(_batchnorm(node, emit, info, initializers, readers, running, initial, outputs, running_var))
            batchnorms += 1
        else:
            nodes.extend(_dropout(node, emit, info, constants, readers, dropouts))
            dropouts += 1
    if dropouts:
        graph.input.append(helper.make_tensor_value_info(DROPOUT_SEED, TensorProto.FLOAT, []))
        nodes.append(helper.make_node("Add", [DROPOUT_SEED, emit.const("dropout/one", 1.0)],
                                      [DROPOUT_SEED + UPDATED], name="dropout/next_seed"))
        outputs.append(helper.make_tensor_value_info(DROPOUT_SEED + UPDATED, TensorProto.FLOAT, []))
    graph.initializer.append(numpy_helper.from_array(np.array(True), TRAIN_FLAG))
    del graph.node[:]
    graph.node.extend(nodes)
    for tensor in emit.removed:  # the running statistics: state inputs now
        graph.initializer.remove(tensor)
    graph.input.extend(emit.inputs)
    graph.initializer.extend(emit.constants)
    graph.value_info.extend(emit.value_info)
    if batchnorms and not any(o.domain == PLACEHOLDER_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(PLACEHOLDER_DOMAIN, 1))
    ir.set_metadata(model, RUNNING_KEY, json.dumps(running))
    return TrainModeRewrite(running, tuple(initial), tuple(outputs), batchnorms, dropouts)


@reverse_rule(PLACEHOLDER)
def _batchnorm_reverse(ctx, node, grads):
    """onnx-ad's reverse rule of the placeholder: the closed form of the module docstring. Only
    ``Y`` is differentiated: the statistics feed the running updates, which the loss never reads."""
    if any(grad is not None for grad in grads[1:]):
        raise UnsupportedModelError(f"{node.name}: the batch statistics of a training BatchNormalization "
                                    "reach the loss; only its output may")
    x, scale = node.input[:2]
    axes, count = list(ir.attribute(node, "axes")), int(ir.attribute(node, "count"))
    dtype = ctx.dtype(node.output[0], x)
    dy = ctx.full(grads[0], node.output[0])
    invstd = ctx.lift(node.output[3])
    xhat = ctx.b.op("Mul", [ctx.lift(node.output[4]), invstd], stem="xhat")
    # sums, not means: a ReduceSum over [N, C, H*W] blocks is what --fuse-reductions makes one kernel
    dbias = ctx.reduce_sum(dy, axes)
    dscale = ctx.reduce_sum(ctx.b.op("Mul", [dy, xhat]), axes)
    per_value = ctx.constant(1.0 / count, dtype)
    centered = ctx.b.op("Sub", [ctx.b.op("Sub", [dy, ctx.b.op("Mul", [dbias, per_value])]),
                                ctx.b.op("Mul", [xhat, ctx.b.op("Mul", [dscale, per_value])])])
    dx = ctx.b.op("Mul", [ctx.b.op("Mul", [ctx.lift(scale), invstd]), centered], stem="a_" + x)
    return [dx, dscale, dbias] + [None] * (len(node.input) - 3)


def lower_batchnorms(model: onnx.ModelProto) -> int:
    """Write each training normalization placeholder out as the forward of the module docstring
    (after differentiation: its outputs keep their names, so the gradient reads them); the count."""
    graph = model.graph
    placeholders = [n for n in graph.node if n.op_type == PLACEHOLDER and n.domain == PLACEHOLDER_DOMAIN]
    if not placeholders:
        return 0
    emit = _Emitter(model)
    nodes = []
    for node in graph.node:
        if node not in placeholders:
            nodes.append(node)
            continue
        p, axes = ir.attribute(node, "prefix").decode(), list(ir.attribute(node, "axes"))
        x, scale, bias, running_mean, running_var, flag, epsilon = node.input
        y, batch_mean, batch_var, invstd, centered = node.output

        def add(op: str, inputs: list[str], name: str, output: str | None = None, prefix: str = p) -> str:
            nodes.append(emit.node(op, inputs, f"{prefix}/{name}", output))
            return nodes[-1].output[0]

        nodes.append(emit.reduce_mean(x, axes, f"{p}/batch_mean_of"))
        nodes[-1].output[0] = batch_mean
        add("Sub", [x, add("Where", [flag, batch_mean, running_mean], "mean")], "centered", output=centered)
        nodes.append(emit.reduce_mean(add("Mul", [centered, centered], "squared"), axes, f"{p}/batch_var_of"))
        nodes[-1].output[0] = batch_var
        used_var = add("Where", [flag, batch_var, running_var], "var")
        add("Reciprocal", [add("Sqrt", [add("Add", [used_var, epsilon], "var_eps")], "std")], "invstd_of", output=invstd)
        factor = add("Mul", [scale, invstd], "factor")
        add("Add", [add("Mul", [centered, factor], "normalized"), bias], "output", output=y)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(emit.constants)
    if not any(n.domain == PLACEHOLDER_DOMAIN for n in graph.node):
        kept = [o for o in model.opset_import if o.domain != PLACEHOLDER_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return len(placeholders)


def running_stats(step: onnx.ModelProto) -> dict[str, str]:
    """The step graph's running-statistics state: ``{state name: forward initializer}``."""
    text = ir.metadata(step, RUNNING_KEY)
    return json.loads(text) if text else {}


def dropout_mask(seed: int, node: int, count: int, ratio: float) -> np.ndarray:
    """The keep mask (bool, ``count`` elements, flat) that the ``node``-th training Dropout of a
    step graph draws at ``dropout_seed = seed``: the graph's arithmetic in numpy."""
    base, k2, k3 = _keys(np.int64(seed), node)
    values = _mix(np.arange(count, dtype=np.int64) + base, k2, k3)
    return values >= _threshold(ratio)


def _keys(seed, node: int):
    """The Range base and the two round constants of a node's stream (numpy or emitted alike)."""
    base = (seed * SEED_STRIDE + (node + 1) * NODE_STRIDE + OFFSET) % PRIME
    k2 = _mix(base, 7, 11)
    k3 = _mix(k2, 13, 17)
    return base, k2, k3


def _mix(x, k2, k3):
    x = (x * WEYL + k2) % PRIME
    x = (x * x + k3) % PRIME
    return (x * x + k2) % PRIME


def _threshold(ratio: float) -> int:
    return math.ceil(ratio * PRIME)


def _trains(node: onnx.NodeProto, train_mode: bool | None, constants: dict[str, onnx.TensorProto]) -> bool:
    where = f"{node.op_type} node {node.name or node.output[0]!r}"
    if node.op_type == "BatchNormalization":
        return bool(ir.attribute(node, "training_mode", 0)) if train_mode is None else train_mode
    if node.op_type != "Dropout":
        return False
    flag = node.input[2] if len(node.input) > 2 else ""
    if train_mode is not None:
        return train_mode
    if not flag:
        return False
    if flag not in constants:
        raise UnsupportedModelError(f"{where} has a training_mode input that is not a constant; "
                                    "say which mode to train in (train_mode=True/False, train-graph --train-mode)")
    return bool(numpy_helper.to_array(constants[flag]).any())


def _to_inference(node: onnx.NodeProto, readers: dict[str, int]) -> None:
    """A training-mode node in its inference form (``train_mode=False``), in place."""
    where = f"{node.op_type} node {node.name or node.output[0]!r}"
    if node.op_type == "BatchNormalization" and ir.attribute(node, "training_mode", 0):
        if any(readers.get(name) for name in node.output[1:] if name):
            raise UnsupportedModelError(f"{where}: its running-statistics outputs are read, so it cannot "
                                        "run in inference mode")
        del node.output[1:]
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
    elif node.op_type == "Dropout" and len(node.input) > 2 and node.input[2]:
        node.input[2] = ""


class _Emitter:
    """Nodes and scalar constants under unique names, for one rewrite."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.opset = ir.default_opset(model)
        self.constants: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []  # state inputs
        self.removed: list[onnx.TensorProto] = []  # initializers that became state
        self.value_info: list[onnx.ValueInfoProto] = []  # the placeholders' outputs, for shape inference
        self.taken = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
        self.taken |= {o for n in model.graph.node for o in n.output} | {n.name for n in model.graph.node}

    def name(self, wanted: str) -> str:
        name, index = wanted, 1
        while name in self.taken:
            name, index = f"{wanted}_{index}", index + 1
        self.taken.add(name)
        return name

    def const(self, name: str, value, dtype=np.float32) -> str:
        name = self.name(name)
        self.constants.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, output: str | None = None, **attrs) -> onnx.NodeProto:
        node_name = self.name(name)
        return helper.make_node(op, inputs, [output or node_name], name=node_name, **attrs)

    def reduce_mean(self, x: str, axes: list[int], name: str) -> onnx.NodeProto:
        if self.opset >= 18:  # axes became an input in opset 18
            return self.node("ReduceMean", [x, self.const(name + "/axes", axes, np.int64)], name, keepdims=1)
        return self.node("ReduceMean", [x], name, axes=axes, keepdims=1)


def _static_shape(info, name: str, where: str) -> tuple[int, ...]:
    shape = info[name].shape if name in info else None
    if shape is None or any(not isinstance(d, int) or d <= 0 for d in shape):
        raise UnsupportedModelError(f"{where} trains, and needs the static shape of its input {name!r}; "
                                    "pin the inputs (input_shapes=, train-graph --input-shape)")
    return tuple(shape)


def _state_name(initializer: str, kind: str, emit: _Emitter) -> str:
    name = initializer if kind in initializer.lower() else f"{initializer}.running_{kind}"
    if name != initializer and name in emit.taken:
        raise UnsupportedModelError(f"cannot name the running {kind} of {initializer!r}: {name!r} is taken")
    emit.taken.add(name)
    return name


def _batchnorm(node: onnx.NodeProto, emit: _Emitter, info, initializers: dict[str, onnx.TensorProto],
               readers: dict[str, int], running: dict[str, str], initial: list[onnx.TensorProto],
               outputs: list[onnx.ValueInfoProto], running_var: str) -> list[onnx.NodeProto]:
    where = f"BatchNormalization node {node.name or node.output[0]!r}"
    x, scale, bias, mean_in, var_in = node.input[:5]
    shape = _static_shape(info, x, where)
    if info[x].dtype != TensorProto.FLOAT:  # the state and the constants here are fp32, like the master weights
        raise UnsupportedModelError(f"{where}: input {x!r} is not float32; train from the fp32 forward model")
    if len(shape) < 2:
        raise UnsupportedModelError(f"{where}: input {x!r} has rank {len(shape)}; batch statistics need [N, C, ...]")
    count = math.prod(shape) // shape[1]
    if count < 2:
        raise UnsupportedModelError(f"{where}: one value per channel ({list(shape)}) has no batch variance; "
                                    "train with a larger batch")
    states = []
    for stat, kind in ((mean_in, "mean"), (var_in, "var")):
        if stat not in initializers:
            raise UnsupportedModelError(f"{where}: the running {kind} {stat!r} is not an initializer; "
                                        "it must be one to become the step's state")
        if readers.get(stat, 0) > 1:
            raise UnsupportedModelError(f"{where}: the running {kind} {stat!r} is read by other nodes too; "
                                        "it cannot be this node's state")
        tensor = initializers[stat]
        state = _state_name(stat, kind, emit)
        running[state] = stat
        value = numpy_helper.to_array(tensor).astype(np.float32)
        initial.append(numpy_helper.from_array(value, state))
        emit.inputs.append(helper.make_tensor_value_info(state, TensorProto.FLOAT, list(value.shape)))
        outputs.append(helper.make_tensor_value_info(state + UPDATED, TensorProto.FLOAT, list(value.shape)))
        emit.removed.append(tensor)
        states.append(state)
    mean_state, var_state = states
    p = f"{node.name or node.output[0]}/train"
    momentum = float(ir.attribute(node, "momentum", 0.9))
    epsilon = float(ir.attribute(node, "epsilon", 1e-5))
    axes = [0, *range(2, len(shape))]
    broadcast = emit.const(p + "/channel_shape", [1, -1] + [1] * (len(shape) - 2), np.int64)
    flat = emit.const(p + "/flat", [-1], np.int64)
    n = []

    def add(op: str, inputs: list[str], name: str, output: str | None = None, **attrs) -> str:
        n.append(emit.node(op, inputs, f"{p}/{name}", output, **attrs))
        return n[-1].output[0]

    # the normalization as one node, differentiated by its closed form, written out after that
    inputs = [x, add("Reshape", [scale, broadcast], "scale"), add("Reshape", [bias, broadcast], "bias"),
              add("Reshape", [mean_state, broadcast], "running_mean"), add("Reshape", [var_state, broadcast], "running_var"),
              TRAIN_FLAG, emit.const(p + "/epsilon", epsilon)]
    outputs_of = [node.output[0], *(emit.name(f"{p}/{part}") for part in ("batch_mean", "batch_var", "invstd", "centered"))]
    n.append(helper.make_node(PLACEHOLDER, inputs, outputs_of, name=emit.name(f"{p}/normalize"),
                              domain=PLACEHOLDER_DOMAIN, prefix=p, axes=axes, count=count))
    channel = [1 if axis != 1 else shape[1] for axis in range(len(shape))]
    emit.value_info.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, dims) for name, dims in
                           zip(outputs_of, (shape, channel, channel, channel, shape)))
    mean, var = outputs_of[1:3]
    keep, take = emit.const(p + "/momentum", momentum), emit.const(p + "/1-momentum", 1.0 - momentum)
    batch_var = add("Reshape", [var, flat], "batch_var_flat")
    if running_var == "unbiased":
        batch_var = add("Mul", [batch_var, emit.const(p + "/bessel", count / (count - 1))], "batch_var_unbiased")
    for state, batch, extra in ((mean_state, add("Reshape", [mean, flat], "batch_mean_flat"), 1),
                                (var_state, batch_var, 2)):
        new = add("Add", [add("Mul", [state, keep], f"{state}/kept"), add("Mul", [batch, take], f"{state}/taken")],
                  f"{state}/update", output=state + UPDATED)
        if len(node.output) > extra and node.output[extra] and readers.get(node.output[extra]):
            add("Identity", [new], f"{state}/output", output=node.output[extra])
    return n


def _dropout(node: onnx.NodeProto, emit: _Emitter, info, constants: dict[str, onnx.TensorProto],
             readers: dict[str, int], index: int) -> list[onnx.NodeProto]:
    where = f"Dropout node {node.name or node.output[0]!r}"
    x = node.input[0]
    ratio_name = node.input[1] if len(node.input) > 1 else ""
    if ratio_name and ratio_name not in constants:
        raise UnsupportedModelError(f"{where}: its ratio {ratio_name!r} is not a constant")
    ratio = float(numpy_helper.to_array(constants[ratio_name])) if ratio_name else 0.5
    if not 0.0 <= ratio < 1.0:
        raise UnsupportedModelError(f"{where}: ratio {ratio} is outside [0, 1)")
    shape = _static_shape(info, x, where)
    dtype = helper.tensor_dtype_to_np_dtype(info[x].dtype) if info[x].dtype else np.float32
    p = f"{node.name or node.output[0]}/train"
    n = []

    def add(op: str, inputs: list[str], name: str, output: str | None = None, **attrs) -> str:
        n.append(emit.node(op, inputs, f"{p}/{name}", output, **attrs))
        return n[-1].output[0]

    def i64(name: str, value: int) -> str:
        return emit.const(f"{p}/{name}", value, np.int64)

    prime = i64("prime", PRIME)

    def mix(value: str, k2: str, k3: str, name: str) -> str:
        value = add("Mod", [add("Add", [add("Mul", [value, i64("weyl", WEYL)], f"{name}/weyl"), k2], f"{name}/k2"),
                            prime], f"{name}/round1")
        value = add("Mod", [add("Add", [add("Mul", [value, value], f"{name}/square1"), k3], f"{name}/k3"),
                            prime], f"{name}/round2")
        return add("Mod", [add("Add", [add("Mul", [value, value], f"{name}/square2"), k2], f"{name}/k2b"),
                           prime], f"{name}/round3")

    seed = add("Cast", [DROPOUT_SEED], "seed", to=TensorProto.INT64)
    base = add("Mod", [add("Add", [add("Mul", [seed, i64("seed_stride", SEED_STRIDE)], "seed_scaled"),
                                   i64("offset", (index + 1) * NODE_STRIDE + OFFSET)], "seed_offset"), prime], "base")
    k2 = mix(base, i64("c7", 7), i64("c11", 11), "k2")
    k3 = mix(k2, i64("c13", 13), i64("c17", 17), "k3")
    count = math.prod(shape)
    indices = add("Range", [base, add("Add", [base, i64("count", count)], "limit"), i64("one", 1)], "counter")
    values = mix(indices, k2, k3, "uniform")
    keep = add("Reshape", [add("GreaterOrEqual", [values, i64("threshold", _threshold(ratio))], "keep_flat"),
                           emit.const(p + "/shape", list(shape), np.int64)], "keep")
    scaled = add("Where", [keep, emit.const(p + "/scale", 1.0 / (1.0 - ratio), dtype),
                           emit.const(p + "/zero", 0.0, dtype)], "scaled_mask")
    mask = add("Where", [TRAIN_FLAG, scaled, emit.const(p + "/one", 1.0, dtype)], "mask")
    add("Mul", [x, mask], "output", output=node.output[0])
    if len(node.output) > 1 and node.output[1] and readers.get(node.output[1]):
        add("Identity", [keep], "mask_output", output=node.output[1])
    return n


__all__ = ["DROPOUT_SEED", "RUNNING_KEY", "RUNNING_VARS", "TRAIN_FLAG", "TrainModeRewrite", "apply_train_mode",
           "lower_batchnorms",
           "dropout_mask", "running_stats"]
