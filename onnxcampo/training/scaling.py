"""Mixed precision for training steps: what must stay fp32, and dynamic loss scaling.

A step graph from :func:`onnxcampo.training.build_train_step` has three parts: the forward
model with its backward pass, the loss (with its own gradient), and the optimizer update. Only
the first is worth fp16. :func:`fp32_nodes` names the nodes of the other two, which
``onnxcampo optimize`` keeps fp32 whatever the policy: the loss and its gradient (a mean over a
batch loses bits in fp16) and the update of the fp32 master weights and optimizer state.

:func:`add_loss_scaling` makes fp16 gradients safe, as torch's ``GradScaler`` does, inside the
graph:

* the backward pass is seeded with ``loss_scale`` instead of 1, so every gradient is computed
  ``loss_scale`` times larger (small gradients stay above fp16's underflow);
* each weight gradient is unscaled in fp32 (``g * (1 / loss_scale)``) before the update (with
  the fused ops, by the update itself: ``CheckFinite`` reads the gradients once for the flag and
  ``MultiTensorSGD``/``MultiTensorAdamW`` with ``unscale=1`` multiply as they read them, so no
  float32 copy of every gradient is written and read back);
* ``found_inf`` is true when any gradient holds inf or NaN; the step then changes nothing
  (weights and optimizer state pass through) and halves the scale;
* after ``growth_interval`` clean steps in a row the scale doubles.

``loss_scale`` and ``loss_scale_clean_steps`` are state like the optimizer's: graph inputs
paired with ``<name>.updated`` outputs; their initial values are stored as metadata
``onnxcampo.initial_state``, which the Trainer reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir
from onnxcampo import oplists
from onnxcampo.errors import UnsupportedModelError
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.training.step import FUSED_METADATA as FUSED_KEY
from onnxcampo.training.step import LABELS, LOSS, UPDATED, step_spec

LOSS_SCALE = "loss_scale"
CLEAN_STEPS = "loss_scale_clean_steps"
FOUND_INF = "found_inf"
FUSED_FOUND_INF = "update/found_inf"  # the constant `false` a fused optimizer op reads until scaling is added
SEED_KEY = "onnxcampo.loss_seed"
PREDICTION_KEY = ir.PREDICTION_KEY
STATE_KEY = "onnxcampo.initial_state"
SCALING_KEY = "onnxcampo.loss_scaling"
DEFAULT_INIT_SCALE = 2.0 ** 16
DEFAULT_GROWTH_INTERVAL = 2000


def is_train_step(model: onnx.ModelProto) -> bool:
    return any(p.key == "onnxcampo.train_step" for p in model.metadata_props)


def has_loss_scaling(model: onnx.ModelProto) -> bool:
    return any(i.name == LOSS_SCALE for i in model.graph.input)


def initial_state(model: onnx.ModelProto) -> dict[str, float]:
    """Initial values of scalar state that does not start at zero (``loss_scale``)."""
    text = ir.metadata(model, STATE_KEY)
    return {name: float(value) for name, value in json.loads(text).items()} if text else {}


def fp32_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes of a step graph that must stay fp32: loss, its gradient, the update.

    * loss: every node whose non-constant inputs all come from the prediction, the labels, the
      backward seed or earlier loss nodes (the loss and the gradient of the loss with respect
      to the prediction, where the model's own backward pass starts);
    * update: every node that feeds an ``.updated`` output without feeding the loss or a
      weight gradient (the unscaling, the finite check, the optimizer, the scale update).
    """
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    prediction = ir.metadata(model, PREDICTION_KEY)
    seed = ir.metadata(model, SEED_KEY)
    if prediction is None or seed is None:
        raise UnsupportedModelError(
            "the training-step graph lacks onnxcampo's loss metadata; rebuild it with `onnxcampo train-graph`")

    constants.discard(seed)  # an initializer (1) until loss scaling computes it
    loss_side = {prediction, seed, LABELS, LOSS_SCALE}
    loss_nodes = set()
    for node in graph.node:  # step graphs are written in topological order
        inputs = [t for t in node.input if t and t not in constants]
        if inputs and all(t in loss_side for t in inputs):
            loss_nodes.add(node.name)
            loss_side.update(node.output)

    gradients = {_gradient_source(model, w) for w in step_spec(model).weights}
    feeds_backward = _ancestors(graph, gradients | {LOSS})
    feeds_update = _ancestors(graph, {o.name for o in graph.output if o.name.endswith(UPDATED)})
    update_nodes = {n.name for n in graph.node if n.name in feeds_update and n.name not in feeds_backward}
    return loss_nodes | update_nodes


def gradient_sums(model: onnx.ModelProto) -> set[str]:
    """Names of the ReduceSum nodes whose result is a weight gradient as it is: the gradient
    tensor itself, or reached through shape-only ops (``oplists.SHAPE_ONLY``) and further ReduceSums
    (a sum in stages) that nothing else reads.

    These are the bias and normalization-scale gradients (a sum of ``dy`` or ``dy * x_hat`` over
    the batch rows). ReduceSum is on the deny list because a sum in fp16 overflows or stalls; ONNX
    Runtime's CUDA ReduceSum accumulates fp16 input in fp32 (its row/column kernels and cuDNN's
    reduction alike) and only rounds each result (a sum in stages also rounds its partial sums,
    which may overflow where the total would not), and a weight gradient that overflows fp16 is
    what dynamic loss scaling detects and recovers from (the step is skipped, the scale halved),
    as with the fp16 weight gradients of PyTorch's AMP. So, with loss scaling, they may read the
    fp16 ``dy`` directly: the Cast to fp32 is then on the reduced result (a bias's size) instead of
    on ``dy`` (the activation's size).
    """
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    found = set()
    for weight in step_spec(model).weights:
        try:
            node = producer.get(_gradient_source(model, weight))
        except UnsupportedModelError:
            continue
        # back from the gradient through shape-only ops and ReduceSums (a sum split in stages,
        # simplify's rule 7), each read by nothing else
        while node is not None and (node.op_type in oplists.SHAPE_ONLY or node.op_type == "ReduceSum"):
            if node.op_type == "ReduceSum":
                found.add(node.name)
            source = node.input[0]
            node = producer.get(source) if readers.get(source) == 1 and source not in outputs else None
    return found


@dataclass(frozen=True)
class ScalingOverhead:
    """What :func:`add_loss_scaling` adds to a step: ``nodes`` launched and ``elements`` moved,
    counted as Cast-equivalent passes (one read and one write of an element)."""

    nodes: int
    elements: int
    # fused unscale: the weight gradients it reads as they are; where the plan makes one fp16, the
    # Cast to fp32 in front of the update goes away (add_loss_scaling removes it)
    gradients_read_as_is: tuple[str, ...] = ()


SCALE_UPDATE_NODES = 10  # seed Reshape, Reciprocal, and the eight nodes that update the scale


def overhead(model: onnx.ModelProto, numel: Callable[[str], int | None]) -> ScalingOverhead:
    """The cost :func:`add_loss_scaling` would add to ``model`` (``numel``: elements of a tensor,
    None where unknown, counted as 0). A mixed-precision plan for a training step pays it on top of
    its nodes, so the plan comparison charges it (``onnxcampo.estimate.plan_time``)."""
    spec = step_spec(model)
    weights = sum(numel(w) or 0 for w in spec.weights)
    state = sum(numel(s) or 0 for s in spec.state)
    nodes, elements, read_as_is = SCALE_UPDATE_NODES, 0, ()
    if ir.metadata(model, FUSED_KEY) == "1":
        # one CheckFinite over every gradient (a read, half a Cast's pass); the update unscales
        nodes, elements = nodes + 1, elements + weights // 2
        read_as_is = tuple(f"{w}/grad" for w in spec.weights)
    else:  # Mul and ReduceSum per gradient, then Sum, Mul, IsNaN
        nodes, elements = nodes + 2 * len(spec.weights) + 3, elements + 2 * weights
    if not any(FUSED_FOUND_INF in n.input for n in model.graph.node):  # a Where per updated tensor
        nodes, elements = nodes + len(spec.weights) + len(spec.state), elements + weights + state
    return ScalingOverhead(nodes, elements, read_as_is)


def _gradient_source(model: onnx.ModelProto, weight: str) -> str:
    """The tensor holding the (scaled) gradient of ``weight`` as the backward pass leaves it."""
    names = {o for n in model.graph.node for o in n.output}
    for candidate in (f"{weight}/grad.scaled", f"{weight}/grad"):
        if candidate in names:
            return candidate
    raise UnsupportedModelError(f"no gradient tensor for weight {weight!r} in the training-step graph")


def _ancestors(graph: onnx.GraphProto, tensors: Iterable[str]) -> set[str]:
    """Names of the nodes some of ``tensors`` depend on (including their producers)."""
    producer = {o: n for n in graph.node for o in n.output}
    found: set[str] = set()
    stack = [producer[t] for t in tensors if t in producer]
    while stack:
        node = stack.pop()
        if node.name in found:
            continue
        found.add(node.name)
        stack.extend(producer[t] for t in node.input if t in producer)
    return found


def add_loss_scaling(
    model: onnx.ModelProto,
    *,
    init_scale: float = DEFAULT_INIT_SCALE,
    growth_interval: int = DEFAULT_GROWTH_INTERVAL,
    dtypes: dict[str, int] | None = None,
) -> None:
    """Insert dynamic loss scaling into a training-step graph, in place (see the module doc).

    ``dtypes`` maps tensor names to ONNX element types (the optimizer knows them); by default
    they are inferred.
    """
    if has_loss_scaling(model):
        return
    if init_scale <= 0 or growth_interval < 1:
        raise ValueError("init_scale must be > 0 and growth_interval >= 1")
    graph = model.graph
    seed = ir.metadata(model, SEED_KEY)
    seed_init = next((t for t in graph.initializer if t.name == seed), None)
    if seed_init is None:
        raise UnsupportedModelError(
            "the training-step graph lacks its backward seed; rebuild it with `onnxcampo train-graph`")
    spec = step_spec(model)
    if dtypes is None:
        info, _ = ir.infer_tensor_info(model)
        dtypes = {name: entry.dtype for name, entry in info.items()}
    b = _Builder()
    # The backward pass starts from loss_scale instead of 1.
    graph.initializer.remove(seed_init)
    seed_shape = b.const("seed_shape", list(seed_init.dims), np.int64)
    seeded = helper.make_node("Reshape", [LOSS_SCALE, seed_shape], [seed], name=f"{LOSS_SCALE}/seed")
    producers = {o: n for n in graph.node for o in n.output}
    found = _unscale(model, spec, producers, dtypes, b)
    _skip_non_finite(model, spec, producers, found, b)
    _update_scale(found, growth_interval, b)

    # Inputs and outputs; the seed must be computed before the backward pass reads it.
    for name in (LOSS_SCALE, CLEAN_STEPS):
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, []))
        graph.output.append(helper.make_tensor_value_info(name + UPDATED, TensorProto.FLOAT, []))
    graph.initializer.extend(b.consts)
    body = list(graph.node)
    del graph.node[:]
    graph.node.extend([seeded, *body, *b.nodes])
    try:
        ir.toposort_model(model)
    except UnsupportedModelError:
        raise UnsupportedModelError("loss scaling left the training-step graph with a cycle") from None
    state = initial_state(model)
    state[LOSS_SCALE] = float(init_scale)
    ir.set_metadata(model, STATE_KEY, json.dumps(state))
    ir.set_metadata(model, SCALING_KEY, json.dumps({"init_scale": init_scale, "growth_interval": growth_interval}))


class _Builder:
    """The nodes and constants loss scaling adds, named under ``loss_scale/``."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[onnx.TensorProto] = []

    def const(self, name: str, value, dtype=np.float32) -> str:
        """The constant ``loss_scale/<name>``, made once."""
        full = f"{LOSS_SCALE}/{name}"
        if all(c.name != full for c in self.consts):
            self.consts.append(numpy_helper.from_array(np.array(value, dtype), full))
        return full

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output


def _unscale(model: onnx.ModelProto, spec, producers: dict[str, onnx.NodeProto], dtypes: dict[str, int],
             b: _Builder) -> str:
    """Unscale every weight gradient in fp32, where the update reads it, and flag inf/NaN: the
    name of the flag."""
    inv = b.node("Reciprocal", [LOSS_SCALE], f"{LOSS_SCALE}/inverse")
    if ir.metadata(model, FUSED_KEY) == "1":
        updates = [n for n in model.graph.node if FUSED_FOUND_INF in n.input]
        return _fused_unscale(model, spec.weights, producers, dtypes, inv, b.nodes, updates)
    sums = []
    for weight in spec.weights:
        gradient = _fp32_gradient(model, weight, producers, dtypes)
        scaled = gradient + ".scaled"
        producer = producers[gradient]
        producer.output[list(producer.output).index(gradient)] = scaled
        b.node("Mul", [scaled, inv], gradient)
        sums.append(b.node("ReduceSum", [gradient], f"{weight}/grad.sum", keepdims=0))
    # Any inf or NaN makes the sum of all gradients non-finite, and sum * 0 NaN.
    total = b.node("Sum", sums, f"{LOSS_SCALE}/grad_sum")
    zeroed = b.node("Mul", [total, b.const("zero", 0.0)], f"{LOSS_SCALE}/grad_sum_x0")
    return b.node("IsNaN", [zeroed], FOUND_INF)


def _skip_non_finite(model: onnx.ModelProto, spec, producers: dict[str, onnx.NodeProto], found: str,
                     b: _Builder) -> None:
    """A step with a non-finite gradient changes nothing: every update is a Where on ``found``."""
    graph = model.graph
    fused = [n for n in graph.node if FUSED_FOUND_INF in n.input]
    for n in fused:
        n.input[list(n.input).index(FUSED_FOUND_INF)] = found
    fused_outputs = {o for n in fused for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for tensor in set(n.input):
            readers.setdefault(tensor, []).append(n)
    for name in (*spec.weights, *spec.state):
        out = name + UPDATED
        if out in fused_outputs:
            continue
        producer = producers[out]
        candidate = out + ".candidate"
        producer.output[list(producer.output).index(out)] = candidate
        for reader in readers.get(out, ()):  # the update itself reads the candidate (AdamW's step count)
            reader.input[list(reader.input).index(out)] = candidate
        b.node("Where", [found, name, candidate], out)
    if fused and not any(FUSED_FOUND_INF in n.input for n in graph.node):
        for tensor in list(graph.initializer):
            if tensor.name == FUSED_FOUND_INF:
                graph.initializer.remove(tensor)


def _update_scale(found: str, growth_interval: int, b: _Builder) -> None:
    """Halve the scale on overflow; double it after ``growth_interval`` clean steps."""
    zero = b.const("zero", 0.0)
    one = b.const("one", 1.0)
    counted = b.node("Add", [CLEAN_STEPS, one], f"{LOSS_SCALE}/clean_plus_one")
    clean = b.node("Where", [found, zero, counted], f"{LOSS_SCALE}/clean")
    grow = b.node("GreaterOrEqual", [clean, b.const("growth_interval", float(growth_interval))], f"{LOSS_SCALE}/grow")
    b.node("Where", [grow, zero, clean], CLEAN_STEPS + UPDATED)
    doubled = b.node("Mul", [LOSS_SCALE, b.const("two", 2.0)], f"{LOSS_SCALE}/doubled")
    halved = b.node("Mul", [LOSS_SCALE, b.const("half", 0.5)], f"{LOSS_SCALE}/halved")
    grown = b.node("Where", [grow, doubled, LOSS_SCALE], f"{LOSS_SCALE}/grown")
    b.node("Where", [found, halved, grown], LOSS_SCALE + UPDATED)


def _fused_unscale(model: onnx.ModelProto, weights: Sequence[str], producers: dict[str, onnx.NodeProto],
                   dtypes: dict[str, int], inv: str, nodes: list[onnx.NodeProto],
                   updates: list[onnx.NodeProto]) -> str:
    """The fused ops' unscale (step graphs built with them need the library anyway), reading fp16
    gradients directly: the Casts to fp32 that the update had go away. Where the fused update
    alone reads the unscaled gradients it unscales them itself (:func:`_update_unscales`) and a
    ``CheckFinite`` makes the flag; else one ``UnscaleCheckFinite`` whose fp32 outputs take the
    names the update reads."""
    grads, outputs = [], []
    edit = ir.ModelEdit(model)
    readers, kept = edit.consumers(), edit.interface()  # what the loop removes is no Cast's reader
    for weight in weights:
        gradient = f"{weight}/grad"
        target = _fp32_gradient(model, weight, producers, dtypes)
        if target == gradient:
            producer = producers[gradient]
            _read_fp16_through_reshape(model, producer, producers, readers, kept, dtypes)
            producer.output[list(producer.output).index(gradient)] = gradient + ".scaled"
            grads.append(gradient + ".scaled")
        else:
            model.graph.node.remove(producers[target])  # the Cast: the op reads fp16 itself
            grads.append(gradient)
        outputs.append(target)
    if _update_unscales(model, updates, dict(zip(outputs, grads)), inv):
        nodes.append(op_nodes.check_finite(grads, found_inf=FOUND_INF, name=f"{LOSS_SCALE}/unscale"))
    else:
        nodes.append(op_nodes.unscale_check_finite(inv, grads, found_inf=FOUND_INF, outputs=outputs,
                                                   name=f"{LOSS_SCALE}/unscale"))
    op_nodes.import_domain(model)
    return FOUND_INF


UPDATE_SCALARS = {"MultiTensorSGD": 2, "MultiTensorAdamW": 3}  # inputs before the tensors: (lr, found_inf), (lr, step, found_inf)


def _update_unscales(model: onnx.ModelProto, updates: list[onnx.NodeProto], scaled: dict[str, str],
                     inv_scale: str) -> bool:
    """Where one MultiTensorSGD/AdamW reads every unscaled gradient u (``scaled``: u -> the scaled
    g) as its gradients and nothing else reads them, it reads the g and ``inv_scale`` instead
    (``unscale=1``: the same float32 products, ``docs/ops.md``) and True is returned: no float32
    copy of every gradient is written and read back (GPT-2 small: ~1 GB a step)."""
    if len(updates) != 1 or updates[0].op_type not in UPDATE_SCALARS or ir.attribute(updates[0], "unscale", 0):
        return False
    update = updates[0]
    first = UPDATE_SCALARS[update.op_type]
    tensors = list(update.input[first:])
    if update.op_type == "MultiTensorAdamW":  # w.., g.., m.., v..
        n = len(tensors) // 4
    else:  # w.., g.. -> w'..; w.., g.., v.. -> w'.., v'..
        n = len(update.output) if len(tensors) == 2 * len(update.output) else len(update.output) // 2
    grads = tensors[n:2 * n]
    read_elsewhere = any(u in scaled for other in model.graph.node if other is not update for u in other.input)
    if sorted(grads) != sorted(scaled) or read_elsewhere or {o.name for o in model.graph.output} & set(scaled):
        return False
    for i, u in enumerate(grads):
        update.input[first + n + i] = scaled[u]
    update.input.insert(first, inv_scale)
    update.attribute.append(helper.make_attribute("unscale", 1))
    return True


def _read_fp16_through_reshape(model: onnx.ModelProto, reshape: onnx.NodeProto,
                               producers: dict[str, onnx.NodeProto], readers: dict[str, list[onnx.NodeProto]],
                               kept: set[str], dtypes: dict[str, int]) -> None:
    """A gradient made by ``Reshape(Cast(g16, to=float))`` (a weight gradient computed in fp16 as
    a Gemm, shaped back to the weight's dims) is reshaped in fp16: the unscale reads fp16 itself,
    so the Cast, a pass over a weight-sized tensor, goes away."""
    if reshape.op_type != "Reshape":
        return
    cast = producers.get(reshape.input[0])
    if cast is None or cast.op_type != "Cast" or ir.attribute(cast, "to") != TensorProto.FLOAT \
            or dtypes.get(cast.input[0]) != TensorProto.FLOAT16:
        return
    users = readers.get(cast.output[0], [])
    if len(users) != 1 or users[0] is not reshape or cast.output[0] in kept:
        return
    reshape.input[0] = cast.input[0]
    model.graph.node.remove(cast)


def _fp32_gradient(model: onnx.ModelProto, weight: str, producers: dict[str, onnx.NodeProto],
                   dtypes: dict[str, int]) -> str:
    """The fp32 tensor the update reads as the gradient of ``weight``.

    That is ``<weight>/grad`` itself, or, where the backward pass ran in fp16, the Cast to fp32
    that ``onnxcampo optimize`` put in front of the (fp32) update.
    """
    gradient = f"{weight}/grad"
    if gradient not in producers:
        raise UnsupportedModelError(f"no gradient tensor {gradient!r} in the training-step graph")
    if dtypes.get(gradient, TensorProto.FLOAT) == TensorProto.FLOAT:
        return gradient
    casts = [n for n in model.graph.node if gradient in n.input and n.op_type == "Cast"
             and any(a.name == "to" and a.i == TensorProto.FLOAT for a in n.attribute)]
    if len(casts) != 1:
        raise UnsupportedModelError(f"the gradient {gradient!r} is not fp32 and has no single Cast to fp32")
    return casts[0].output[0]


__all__ = [
    "CLEAN_STEPS", "FOUND_INF", "LOSS_SCALE", "add_loss_scaling", "fp32_nodes", "has_loss_scaling",
    "initial_state", "is_train_step",
]
