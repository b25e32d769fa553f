"""Training-step graphs in standard ONNX ops: forward + loss + backward (onnx-ad) + update.

Conventions (what :class:`onnxcampo.training.Trainer` relies on):

* the forward model's weights (float initializers) become graph inputs named as before (the fp32
  master weights), except those matching ``freeze`` and those that are not weights: BatchNorm
  running statistics, Resize scales, formula constants, grouped Conv weights, constants with no
  gradient path (see :mod:`onnxcampo.training.trainable`); these stay constants;
* the batch is the forward model's own inputs plus ``labels``: float targets of the prediction's
  shape for ``mse``, ``l1``, ``huber`` and ``bce_with_logits`` (0/1 or soft targets), int64 class
  indices for ``cross_entropy``;
* outputs: ``loss`` (scalar, fp32), then ``<weight>.updated`` for every weight;
* optimizer state: ``<weight>.momentum`` (momentum), ``<weight>.adam_m`` / ``<weight>.adam_v``
  and the scalar ``step`` (adamw) are inputs, their next values ``<name>.updated`` outputs;
* training-mode BatchNormalization and Dropout (``train_mode``, :mod:`onnxcampo.training.train_mode`):
  running means and variances (named in metadata ``onnxcampo.running_stats``) and the scalar
  ``dropout_seed`` are state inputs too, their next values ``<name>.updated`` outputs;
* ``lr`` is a scalar input, so schedules need no new graph (the value given to
  :func:`build_train_step` is stored as metadata ``onnxcampo.lr``, the Trainer's default).

Losses (each a mean over the elements, or over the samples for ``cross_entropy``):

* ``mse``: mean (x - y)^2;
* ``cross_entropy``: mean over samples of -log softmax(x)[label], softmax over the last axis;
* ``bce_with_logits``: binary cross-entropy on logits, in the stable form
  mean(max(x, 0) - x*y + log(1 + exp(-|x|)));
* ``l1``: mean |x - y|;
* ``huber``: mean of 0.5 d^2 where |d| < delta, else delta (|d| - 0.5 delta), d = x - y
  (``huber_delta``, default 1.0; computed as 0.5 m^2 + delta (|d| - m), m = min(|d|, delta)).

The prediction the loss reads is the model's first output, or the one named by ``output``; the
step graph's outputs are ``loss`` and the updated state only (the model's other outputs are not
outputs of the step, as before ``output`` existed).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir
from onnxcampo import ops
from onnxcampo.errors import ConfigError, UnsupportedModelError, option
from onnxcampo.ops import nodes as op_nodes
from onnxcampo.training.scatter import fuse_scatter_add
from onnxcampo.training.simplify import ALIAS_RULES, CONV_WEIGHT_GRADS, simplify_backward
from onnxcampo.training.train_mode import (DROPOUT_SEED, RUNNING_KEY, TrainModeRewrite, apply_train_mode,
                                           lower_batchnorms, running_stats)
from onnxcampo.training.trainable import (TrainableSelection, check_trainable, forget_declared_shapes,
                                          constants_to_initializers, forward_values, select_trainable,
                                          shared_parameter_warnings, tie_transposed)

log = logging.getLogger(__name__)

LOSSES = ("mse", "cross_entropy", "bce_with_logits", "l1", "huber")
FLOAT_LABEL_LOSSES = ("mse", "bce_with_logits", "l1", "huber")  # labels: float, the prediction's shape
OPTIMIZERS = ("sgd", "momentum", "adamw")
UPDATED = ".updated"
LABELS = "labels"
LOSS = "loss"
LR = "lr"
STEP = "step"
INITIAL_PREFIX = "onnxcampo.initial/"  # initializer "<prefix><weight>": the weight's starting value
FROZEN_KEY = "onnxcampo.frozen"  # what train-graph kept constant, and why (one line)
# scalar state: the step count, loss scaling, the dropout seed
SCALARS = (STEP, "loss_scale", "loss_scale_clean_steps", DROPOUT_SEED)
FOUND_INF = "update/found_inf"  # the fused update's skip flag: False until loss scaling feeds it
FUSED_METADATA = "onnxcampo.fused_ops"


@dataclass(frozen=True)
class StepSpec:
    """What a step graph expects and returns (read back by the Trainer)."""

    weights: tuple[str, ...]
    state: tuple[str, ...]
    batch: tuple[str, ...]
    optimizer: str
    loss: str


def build_train_step(
    forward: str | os.PathLike | onnx.ModelProto,
    *,
    loss: str = "mse",
    optimizer: str = "sgd",
    lr: float = 0.01,
    momentum: float = 0.9,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    freeze: str | None = None,
    input_shapes: dict[str, tuple[int, ...]] | None = None,
    fused: bool | None = None,
    simplify: bool = True,
    output: str | None = None,
    huber_delta: float = 1.0,
    train_mode: bool | None = None,
    running_var: str = "unbiased",
    conv_weight_grad: str | None = None,
) -> onnx.ModelProto:
    """One training step as an ONNX model (see the module docstring for names).

    ``fused``: the update as one ``ai.onnxcampo`` multi-tensor op, (with ``simplify``) each Conv
    weight gradient's im2col as one ``ai.onnxcampo::Im2Col``, and every ``ScatterND`` with
    ``reduction="add"`` (onnx-ad's Gather adjoints, :mod:`onnxcampo.training.scatter`) as
    ``ai.onnxcampo::ScatterNDAdd`` (True), or all in standard ONNX ops (False); None picks the
    fused ops when the custom-op library is available.
    ``simplify``: rewrite onnx-ad's backward graph with the same math in fewer, cheaper ops
    (:func:`onnxcampo.training.simplify.simplify_backward`); False keeps it as emitted.
    ``conv_weight_grad`` (with the fused ops): ``"gemm"`` each Conv weight gradient as the Gemm
    over Im2Col, ``"cudnn"`` as one ``ai.onnxcampo::ConvWeightGrad`` (cuDNN's backward filter on
    CUDA; on the CPU a direct loop, slower than the Gemm); None (the default) ``"cudnn"`` where
    this onnxruntime has the CUDA execution provider and the custom-op library its CUDA kernels,
    else ``"gemm"`` (H200, ResNet-50 b64: the step 1.21x faster with ConvWeightGrad,
    docs/benchmarks/training-steps.md).
    ``output``: the model output the loss reads (default: the first); the step graph does not
    return the model's outputs. ``huber_delta``: where ``huber`` turns from quadratic to linear.
    ``train_mode``: which BatchNormalization and Dropout nodes run in training mode (batch
    statistics with running statistics as state, a dropout mask drawn from the ``dropout_seed``
    state): None as exported, True all, False none (:mod:`onnxcampo.training.train_mode`);
    ``running_var``: the batch variance the running variance takes, ``"unbiased"`` (PyTorch's)
    or ``"biased"`` (the ONNX specification's).
    """
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if loss == "huber" and not (np.isfinite(huber_delta) and huber_delta > 0):
        raise ConfigError(f"huber_delta must be a positive number, not {huber_delta!r}")
    model, weights, initial, prediction, trained = _prepare(
        forward, freeze=freeze, input_shapes=input_shapes or {}, output=output, train_mode=train_mode,
        running_var=running_var)
    info, _ = ir.infer_tensor_info(model)
    shape = info[prediction].shape if prediction in info else None
    if shape is None or None in shape:
        raise UnsupportedModelError(
            f"the shape of the prediction {prediction!r} is not static; pin the inputs with {option('input_shapes')}")
    _warn_if_normalized_twice(model, prediction, loss)
    _add_loss(model, prediction, loss, list(shape), huber_delta=huber_delta)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info(LOSS, TensorProto.FLOAT, []))
    model.graph.output.extend(trained.outputs)  # running statistics and dropout_seed, updated
    model.ir_version = min(model.ir_version, 10)
    gradients = _backward(model, weights)
    lower_batchnorms(gradients)  # training BatchNorms: their forward written out, the gradient is closed-form
    seed = next(i.name for i in gradients.graph.input if i.name.startswith("grad_"))
    if fused is None:
        fused = ops.available()
        if not fused:
            log.warning("the custom-op library is not built or does not load: the step uses standard ONNX ops "
                        "only (the update, im2col and embedding gradients as many nodes, slower); build it with "
                        "python -m onnxcampo.ops.build, or pass %s to say so", option("fused", False))
    if simplify:
        _pin_seed(gradients, seed)
        # the prediction names where the loss starts (metadata onnxcampo.prediction): kept by name;
        # with the fused ops, each Conv weight gradient's im2col is one ai.onnxcampo::Im2Col
        simplify_backward(gradients, keep=[prediction], fused=fused,
                          conv_weight_grad=_conv_weight_grad(conv_weight_grad, fused))
    add_update(gradients, weights, optimizer, fused=fused, momentum=momentum, betas=betas, eps=eps,
                weight_decay=weight_decay)
    if simplify:  # the gradients' Reshape -> Identity -> Squeeze (seed axis off) become one Reshape
        simplify_backward(gradients, keep=[seed, prediction, *(f"{w}/grad" for w in weights)], rules=ALIAS_RULES)
    if fused:  # onnx-ad's Gather adjoints (ScatterND, reduction "add"): one thread per element
        fuse_scatter_add(gradients)
    gradients.metadata_props.add(key="onnxcampo.train_step", value=f"{loss},{optimizer}")
    gradients.metadata_props.add(key=FUSED_METADATA, value="1" if fused else "0")
    gradients.metadata_props.add(key="onnxcampo.lr", value=repr(float(lr)))
    if loss == "huber":
        gradients.metadata_props.add(key="onnxcampo.huber_delta", value=repr(float(huber_delta)))
    gradients.metadata_props.add(key=ir.PREDICTION_KEY, value=prediction)  # where the loss starts
    gradients.metadata_props.add(key="onnxcampo.loss_seed", value=seed)  # d loss / d loss, 1 until scaled
    if trained.running:
        ir.set_metadata(gradients, RUNNING_KEY, json.dumps(trained.running))
    ir.name_nodes(gradients)  # onnx-ad leaves backward nodes unnamed; plans and reports need names
    for tensor in (*initial, *trained.initial):  # read by the Trainer; no node reads them (ORT drops them)
        tensor.name = INITIAL_PREFIX + tensor.name
    gradients.graph.initializer.extend((*initial, *trained.initial))
    onnx.checker.check_model(gradients)
    return gradients


def _conv_weight_grad(choice: str | None, fused: bool) -> str:
    """rule 1's emission (simplify_backward's conv_weight_grad) for build_train_step's choice."""
    if choice is None:
        return "cudnn" if fused and ops.cuda_kernels_here() else "gemm"
    if choice not in CONV_WEIGHT_GRADS:
        raise ConfigError(f"unknown conv_weight_grad {choice!r}; choose one of {', '.join(CONV_WEIGHT_GRADS)}")
    return choice


def step_spec(step: onnx.ModelProto) -> StepSpec:
    inputs = [i.name for i in step.graph.input]
    outputs = {o.name for o in step.graph.output}
    updated = [name for name in inputs if name + UPDATED in outputs]
    statistics = running_stats(step)
    weights = tuple(n for n in updated if not re.search(r"\.(momentum|adam_m|adam_v)$", n) and n not in SCALARS
                    and n not in statistics)
    state = tuple(n for n in updated if n not in weights)
    batch = tuple(n for n in inputs if n not in updated and n != LR)
    kind = ir.metadata(step, "onnxcampo.train_step", "mse,sgd")
    loss, optimizer = kind.split(",")
    return StepSpec(weights, state, batch, optimizer, loss)


def _prepare(forward, *, freeze: str | None, input_shapes: dict[str, tuple[int, ...]], output: str | None = None,
             train_mode: bool | None = None, running_var: str = "unbiased",
             ) -> tuple[onnx.ModelProto, list[str], list[onnx.TensorProto], str, TrainModeRewrite]:
    """The forward model made differentiable by onnx-ad, its trainable weights (lifted to inputs),
    their initial values, the prediction (``output``, or the first output when None) and what the
    training-mode rewrite added.

    Upgrades old opsets to 17, pins the given input shapes, rejects non-standard ops, turns float
    Constant nodes into initializers (weights of Paddle exports), lifts only the real weights
    (:mod:`onnxcampo.training.trainable` freezes running statistics, Resize scales, formula
    constants and grouped Conv weights), folds the shape arithmetic that the pinned shapes make
    constant, so the prediction gets a static shape, and last writes the BatchNormalization and
    Dropout nodes that train as explicit math (:mod:`onnxcampo.training.train_mode`; the running
    statistics, frozen until then, become state).
    """
    from onnx_ad.fold import fold_constants  # onnx-ad is pinned; its folder is what reverse() uses

    model, _ = ir.read_model(forward)
    outputs = [o.name for o in model.graph.output]
    if output is not None and output not in outputs:
        raise ConfigError(f"the model has no output {output!r}; its outputs: {', '.join(outputs)}")
    prediction = output if output is not None else outputs[0]
    if ir.default_opset(model) < 17:
        try:
            model = onnx.version_converter.convert_version(model, 17)
        except Exception as exc:  # the converter raises bare RuntimeErrors/ValueErrors per op
            raise UnsupportedModelError(
                f"cannot upgrade opset {ir.default_opset(model)} to 17 for onnx-ad: {str(exc).splitlines()[0]}") from None
    _pin_inputs(model, input_shapes)
    check_trainable(model)
    constants_to_initializers(model)
    forget_declared_shapes(model)
    weights, initial = _lift_weights(model, freeze, prediction)
    if not weights:
        raise ConfigError("the model has no float initializer left to train (all frozen?)")
    folded = fold_constants(model)
    if folded is not model:
        model.CopyFrom(folded)
        forget_declared_shapes(model)
    trained = apply_train_mode(model, train_mode=train_mode, running_var=running_var)
    if trained.batchnorms or trained.dropouts:
        log.info("%s", trained.summary())
    return model, weights, initial, prediction, trained


def _pin_inputs(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    if shapes:
        ir.pin_input_shapes(model, shapes, {}, require_static=False)


def _lift_weights(model: onnx.ModelProto, freeze: str | None, prediction: str | None = None
                  ) -> tuple[list[str], list[onnx.TensorProto]]:
    """Move the trainable initializers (those with a gradient path to ``prediction``) to graph
    inputs; returns their names and initial values."""
    selection = select_trainable(model, freeze=freeze, prediction=prediction)
    weights = list(selection.weights)
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer}
    tied = tie_transposed(model, weights)
    if tied:
        selection = TrainableSelection(tuple(weights), selection.frozen, selection.values - sum(sizes[n] for n in tied))
    shared_parameter_warnings(model, weights)
    summary = selection.summary() + (f"; {len(tied)} tied to another's transpose" if tied else "")
    model.metadata_props.add(key=FROZEN_KEY, value=summary)  # read back by the CLI
    trainable = set(weights)
    lifted = [t for t in model.graph.initializer if t.name in trainable]
    # old exporters list initializers as inputs too; frozen ones must stay plain constants
    initializers = {t.name for t in model.graph.initializer}
    kept_inputs = [i for i in model.graph.input if i.name not in initializers]
    del model.graph.input[:]
    model.graph.input.extend(kept_inputs)
    frozen = [t for t in model.graph.initializer if t.name not in trainable]
    model.graph.input.extend(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in lifted)
    model.graph.ClearField("initializer")
    model.graph.initializer.extend(frozen)
    return weights, lifted


def _warn_if_normalized_twice(model: onnx.ModelProto, prediction: str, loss: str) -> None:
    """cross_entropy applies its own LogSoftmax: a prediction a Softmax or LogSoftmax already
    made is normalized twice (the loss trains, towards the wrong optimum). One warning naming the
    logits to train on instead."""
    if loss != "cross_entropy":
        return
    producer = next((n for n in model.graph.node if prediction in n.output), None)
    if producer is None or producer.op_type not in ("Softmax", "LogSoftmax") or producer.domain not in ("", "ai.onnx"):
        return
    log.warning("the prediction %r is the output of a %s, and cross_entropy applies its own LogSoftmax: the "
                "probabilities are normalized twice; train on the logits instead (make %r an output of the "
                "model and pass %s)", prediction, producer.op_type, producer.input[0],
                option("output", producer.input[0]))


def _add_loss(model: onnx.ModelProto, prediction: str, loss: str, shape: list[int], *, huber_delta: float = 1.0) -> None:
    """The loss nodes (names ``loss/...``), reading only the prediction, ``labels`` and constants:
    what :func:`onnxcampo.training.scaling.fp32_nodes` recognises as loss nodes (kept fp32)."""
    graph = model.graph
    node = helper.make_node

    def const(name: str, value: float) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    if loss in FLOAT_LABEL_LOSSES:
        graph.input.append(helper.make_tensor_value_info(LABELS, TensorProto.FLOAT, shape))
    if loss == "mse":
        graph.node.extend([
            node("Sub", [prediction, LABELS], ["loss/diff"], name="loss/diff"),
            node("Mul", ["loss/diff", "loss/diff"], ["loss/square"], name="loss/square"),
            node("ReduceMean", ["loss/square"], [LOSS], name="loss/mean", keepdims=0),
        ])
        return
    if loss == "l1":
        graph.node.extend([
            node("Sub", [prediction, LABELS], ["loss/diff"], name="loss/diff"),
            node("Abs", ["loss/diff"], ["loss/abs"], name="loss/abs"),
            node("ReduceMean", ["loss/abs"], [LOSS], name="loss/mean", keepdims=0),
        ])
        return
    if loss == "huber":  # 0.5 m^2 + delta (|d| - m), m = min(|d|, delta): both branches in one formula
        delta = const("loss/delta", huber_delta)
        graph.node.extend([
            node("Sub", [prediction, LABELS], ["loss/diff"], name="loss/diff"),
            node("Abs", ["loss/diff"], ["loss/abs"], name="loss/abs"),
            node("Min", ["loss/abs", delta], ["loss/clipped"], name="loss/clipped"),
            node("Mul", ["loss/clipped", "loss/clipped"], ["loss/square"], name="loss/square"),
            node("Mul", ["loss/square", const("loss/half", 0.5)], ["loss/quadratic"], name="loss/quadratic"),
            node("Sub", ["loss/abs", "loss/clipped"], ["loss/excess"], name="loss/excess"),
            node("Mul", ["loss/excess", delta], ["loss/linear"], name="loss/linear"),
            node("Add", ["loss/quadratic", "loss/linear"], ["loss/elementwise"], name="loss/elementwise"),
            node("ReduceMean", ["loss/elementwise"], [LOSS], name="loss/mean", keepdims=0),
        ])
        return
    if loss == "bce_with_logits":  # max(x, 0) - x y + log(1 + exp(-|x|)): no overflow for any x
        graph.node.extend([
            node("Relu", [prediction], ["loss/relu"], name="loss/relu"),
            node("Mul", [prediction, LABELS], ["loss/xy"], name="loss/xy"),
            node("Abs", [prediction], ["loss/abs"], name="loss/abs"),
            node("Neg", ["loss/abs"], ["loss/neg_abs"], name="loss/neg_abs"),
            node("Exp", ["loss/neg_abs"], ["loss/exp"], name="loss/exp"),
            node("Add", ["loss/exp", const("loss/one", 1.0)], ["loss/one_plus"], name="loss/one_plus"),
            node("Log", ["loss/one_plus"], ["loss/log"], name="loss/log"),
            node("Sub", ["loss/relu", "loss/xy"], ["loss/linear"], name="loss/linear"),
            node("Add", ["loss/linear", "loss/log"], ["loss/elementwise"], name="loss/elementwise"),
            node("ReduceMean", ["loss/elementwise"], [LOSS], name="loss/mean", keepdims=0),
        ])
        return
    classes = shape[-1]
    graph.input.append(helper.make_tensor_value_info(LABELS, TensorProto.INT64, shape[:-1]))
    graph.initializer.extend([
        numpy_helper.from_array(np.array(classes, np.int64), "loss/depth"),
        numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "loss/onehot_values"),
        numpy_helper.from_array(np.array([-1], np.int64), "loss/axis"),
    ])
    graph.node.extend([
        helper.make_node("LogSoftmax", [prediction], ["loss/logp"], name="loss/log_softmax", axis=-1),
        helper.make_node("OneHot", [LABELS, "loss/depth", "loss/onehot_values"], ["loss/onehot"], name="loss/onehot", axis=-1),
        helper.make_node("Mul", ["loss/onehot", "loss/logp"], ["loss/picked"], name="loss/picked"),
        helper.make_node("ReduceSum", ["loss/picked", "loss/axis"], ["loss/per_sample"], name="loss/sum", keepdims=0),
        helper.make_node("ReduceMean", ["loss/per_sample"], ["loss/mean_logp"], name="loss/mean", keepdims=0),
        helper.make_node("Neg", ["loss/mean_logp"], [LOSS], name="loss/neg"),
    ])


def _backward(model: onnx.ModelProto, weights: list[str]) -> onnx.ModelProto:
    import onnx_ad

    model = onnx.shape_inference.infer_shapes(model, data_prop=True)  # onnx-ad places seed axes by rank
    try:
        step = onnx_ad.reverse(model, inputs=weights, outputs=[LOSS], layout="onnx", prefix="grad_")
    except onnx_ad.UnsupportedOperator as exc:
        raise UnsupportedModelError(f"cannot differentiate the model: {exc}") from None
    return step


def _pin_seed(step: onnx.ModelProto, seed: str) -> None:
    """Declare the seed input ``[1]`` (onnx-ad leaves the seed count symbolic): the update makes
    it the constant 1, and static shapes are what :func:`simplify_backward` needs."""
    value = next(i for i in step.graph.input if i.name == seed)
    dims = value.type.tensor_type.shape.dim
    del dims[:]
    dims.add().dim_value = 1


def add_update(step: onnx.ModelProto, weights: list[str], optimizer: str, *, fused: bool = False, **hyper) -> None:
    graph = step.graph
    seed = next(i for i in graph.input if i.name.startswith("grad_"))
    graph.input.remove(seed)
    graph.initializer.append(numpy_helper.from_array(np.ones(1, np.float32), seed.name))
    graph.input.append(helper.make_tensor_value_info(LR, TensorProto.FLOAT, []))
    # the loss, and the state the forward updates itself (running statistics, dropout_seed)
    kept_outputs = [o for o in graph.output if o.name == LOSS or o.name.endswith(UPDATED)]
    grads = {o.name[len("grad_"):]: o.name for o in graph.output if o.name.startswith("grad_")}
    del graph.output[:]
    graph.output.extend(kept_outputs)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}

    def const(name: str, value: float) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return name

    axis = numpy_helper.from_array(np.array([-1], np.int64), "update/seed_axis")
    graph.initializer.append(axis)
    if fused:
        _add_fused_update(step, weights, grads, shapes, optimizer, **hyper)
        return
    if optimizer == "adamw":
        graph.input.append(helper.make_tensor_value_info(STEP, TensorProto.FLOAT, []))
        beta1, beta2 = hyper["betas"]
        nodes = [
            helper.make_node("Add", [STEP, const("update/one", 1.0)], [STEP + UPDATED], name="update/step"),
            helper.make_node("Pow", [const("update/beta1", beta1), STEP + UPDATED], ["update/b1t"], name="update/b1t"),
            helper.make_node("Pow", [const("update/beta2", beta2), STEP + UPDATED], ["update/b2t"], name="update/b2t"),
            helper.make_node("Sub", ["update/one", "update/b1t"], ["update/c1"], name="update/c1"),
            helper.make_node("Sub", ["update/one", "update/b2t"], ["update/c2"], name="update/c2"),
        ]
        graph.node.extend(nodes)
        graph.output.append(helper.make_tensor_value_info(STEP + UPDATED, TensorProto.FLOAT, []))
        # 1 - beta of the float32 beta, rounded once: what the fused op computes from its attributes
        const("update/1-beta1", 1.0 - float(np.float32(beta1)))
        const("update/1-beta2", 1.0 - float(np.float32(beta2)))
        const("update/eps", hyper["eps"])
        const("update/wd", hyper["weight_decay"])
    if optimizer == "momentum":
        const("update/mu", hyper["momentum"])
    for weight in weights:
        g = f"{weight}/grad"
        graph.node.append(helper.make_node("Squeeze", [grads[weight], "update/seed_axis"], [g], name=f"{weight}/squeeze"))
        out = weight + UPDATED
        if optimizer == "sgd":
            graph.node.extend([
                helper.make_node("Mul", [LR, g], [f"{weight}/step"], name=f"{weight}/lr_grad"),
                helper.make_node("Sub", [weight, f"{weight}/step"], [out], name=f"{weight}/update"),
            ])
        elif optimizer == "momentum":
            v, v_out = f"{weight}.momentum", f"{weight}.momentum{UPDATED}"
            graph.input.append(helper.make_tensor_value_info(v, TensorProto.FLOAT, shapes[weight]))
            graph.node.extend([
                helper.make_node("Mul", ["update/mu", v], [f"{weight}/mu_v"], name=f"{weight}/mu_v"),
                helper.make_node("Add", [f"{weight}/mu_v", g], [v_out], name=f"{weight}/velocity"),
                helper.make_node("Mul", [LR, v_out], [f"{weight}/step"], name=f"{weight}/lr_v"),
                helper.make_node("Sub", [weight, f"{weight}/step"], [out], name=f"{weight}/update"),
            ])
            graph.output.append(helper.make_tensor_value_info(v_out, TensorProto.FLOAT, shapes[weight]))
        else:
            m, v = f"{weight}.adam_m", f"{weight}.adam_v"
            for name in (m, v):
                graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[weight]))
                graph.output.append(helper.make_tensor_value_info(name + UPDATED, TensorProto.FLOAT, shapes[weight]))
            p = f"{weight}/adam"
            graph.node.extend([
                helper.make_node("Mul", ["update/beta1", m], [p + "/b1m"], name=p + "/b1m"),
                helper.make_node("Mul", ["update/1-beta1", g], [p + "/g1"], name=p + "/g1"),
                helper.make_node("Add", [p + "/b1m", p + "/g1"], [m + UPDATED], name=p + "/m"),
                helper.make_node("Mul", [g, g], [p + "/g2"], name=p + "/g2"),
                helper.make_node("Mul", ["update/beta2", v], [p + "/b2v"], name=p + "/b2v"),
                helper.make_node("Mul", ["update/1-beta2", p + "/g2"], [p + "/g2s"], name=p + "/g2s"),
                helper.make_node("Add", [p + "/b2v", p + "/g2s"], [v + UPDATED], name=p + "/v"),
                helper.make_node("Div", [m + UPDATED, "update/c1"], [p + "/mhat"], name=p + "/mhat"),
                helper.make_node("Div", [v + UPDATED, "update/c2"], [p + "/vhat"], name=p + "/vhat"),
                helper.make_node("Sqrt", [p + "/vhat"], [p + "/sqrt"], name=p + "/sqrt"),
                helper.make_node("Add", [p + "/sqrt", "update/eps"], [p + "/denom"], name=p + "/denom"),
                helper.make_node("Div", [p + "/mhat", p + "/denom"], [p + "/dir"], name=p + "/dir"),
                helper.make_node("Mul", ["update/wd", weight], [p + "/decay"], name=p + "/decay"),
                helper.make_node("Add", [p + "/dir", p + "/decay"], [p + "/total"], name=p + "/total"),
                helper.make_node("Mul", [LR, p + "/total"], [p + "/step"], name=p + "/step"),
                helper.make_node("Sub", [weight, p + "/step"], [out], name=p + "/update"),
            ])
        graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, shapes[weight]))


def _add_fused_update(step: onnx.ModelProto, weights: list[str], grads: dict[str, str],
                      shapes: dict[str, list[int]], optimizer: str, **hyper) -> None:
    """The update of :func:`add_update` as one multi-tensor op; graph inputs and outputs are
    named and ordered as in the standard-op graph. Its ``found_inf`` input is the initializer
    ``update/found_inf`` (False), for loss scaling to rewire to a real flag."""
    graph = step.graph
    graph.initializer.append(numpy_helper.from_array(np.array(False), FOUND_INF))
    squeezed = []
    for weight in weights:
        g = f"{weight}/grad"
        graph.node.append(helper.make_node("Squeeze", [grads[weight], "update/seed_axis"], [g], name=f"{weight}/squeeze"))
        squeezed.append(g)

    def state(suffix: str) -> list[str]:
        return [weight + suffix for weight in weights]

    updated = [w + UPDATED for w in weights]
    if optimizer == "adamw":
        graph.input.append(helper.make_tensor_value_info(STEP, TensorProto.FLOAT, []))
        graph.output.append(helper.make_tensor_value_info(STEP + UPDATED, TensorProto.FLOAT, []))
        m, v = state(".adam_m"), state(".adam_v")
        for weight, m_name, v_name in zip(weights, m, v):  # the standard graph's order: m, v, w per weight
            for name in (m_name, v_name):
                graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[weight]))
                graph.output.append(helper.make_tensor_value_info(name + UPDATED, TensorProto.FLOAT, shapes[weight]))
            graph.output.append(helper.make_tensor_value_info(weight + UPDATED, TensorProto.FLOAT, shapes[weight]))
        graph.node.append(op_nodes.multi_tensor_adamw(
            LR, STEP, FOUND_INF, weights, squeezed, m, v, step_output=STEP + UPDATED, outputs=updated,
            m_outputs=[name + UPDATED for name in m], v_outputs=[name + UPDATED for name in v],
            betas=hyper["betas"], eps=hyper["eps"], weight_decay=hyper["weight_decay"], name="update/adamw"))
    elif optimizer == "momentum":
        velocities = state(".momentum")
        for weight, name in zip(weights, velocities):  # v, then w per weight
            graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shapes[weight]))
            graph.output.append(helper.make_tensor_value_info(name + UPDATED, TensorProto.FLOAT, shapes[weight]))
            graph.output.append(helper.make_tensor_value_info(weight + UPDATED, TensorProto.FLOAT, shapes[weight]))
        graph.node.append(op_nodes.multi_tensor_sgd(
            LR, FOUND_INF, weights, squeezed, velocities, outputs=updated,
            velocity_outputs=[name + UPDATED for name in velocities], momentum=hyper["momentum"], name="update/sgd"))
    else:
        for weight in weights:
            graph.output.append(helper.make_tensor_value_info(weight + UPDATED, TensorProto.FLOAT, shapes[weight]))
        graph.node.append(op_nodes.multi_tensor_sgd(LR, FOUND_INF, weights, squeezed, outputs=updated,
                                                    name="update/sgd"))
    op_nodes.import_domain(step)


def initial_weights(forward: str | os.PathLike | onnx.ModelProto | None, step: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The fp32 master copy of the step's trainable weights: the forward model's values, or
    (``forward=None``) the starting values the step graph carries (``onnxcampo.initial/<w>``)."""
    if forward is None:
        stored = {t.name[len(INITIAL_PREFIX):]: t for t in step.graph.initializer if t.name.startswith(INITIAL_PREFIX)}
        missing = [w for w in step_spec(step).weights if w not in stored]
        if missing:
            raise ConfigError(f"the step graph carries no starting values for {missing[:5]}; "
                              "pass the weights (initial_weights(forward_model, step))")
        return {w: numpy_helper.to_array(stored[w]).astype(np.float32) for w in step_spec(step).weights}
    model, _ = ir.read_model(forward)
    spec = step_spec(step)
    values = forward_values(model)  # initializers, and Constant nodes (Paddle exports)
    missing = [w for w in spec.weights if w not in values]
    if missing:
        raise ConfigError(f"the forward model lacks weights of the step graph: {missing[:5]}")
    return {w: numpy_helper.to_array(values[w]).astype(np.float32).copy() for w in spec.weights}


__all__ = ["FLOAT_LABEL_LOSSES", "LOSSES", "OPTIMIZERS", "StepSpec", "build_train_step", "initial_weights", "step_spec"]
