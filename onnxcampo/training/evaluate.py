"""The forward part of a training-step graph, for :meth:`onnxcampo.training.Trainer.evaluate`.

A step graph (:mod:`onnxcampo.training.step`) computes the prediction (metadata
``onnxcampo.prediction``: the forward model's first output, kept by name), the ``loss`` on it,
the gradients and the update. Pruned to the prediction (and the loss, when labels are given) it
is the forward on the fp32 master weights: no gradient, no update, no state written. Where the
step trains BatchNormalization or Dropout (:mod:`onnxcampo.training.train_mode`), every ``Where``
reading the flag ``onnxcampo.train_mode`` takes its false branch first, so the pruned forward is
the inference one: running statistics, no dropout (the batch statistics and the mask go). Where
``--fuse-reductions`` removed the Slice that cut a padded LM head's output to the prediction (no
training node reads it; metadata ``onnxcampo.prediction_slice``), the pruned graph slices it back.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxcampo import ir
from onnxcampo.ir.topology import iter_graphs
from onnxcampo.errors import ConfigError
from onnxcampo.training.step import LOSS
from onnxcampo.training.train_mode import TRAIN_FLAG

PREDICTION_KEY = ir.PREDICTION_KEY


def prediction_name(step: onnx.ModelProto) -> str:
    name = ir.metadata(step, PREDICTION_KEY)
    if not name:
        raise ConfigError("the step graph names no prediction (metadata onnxcampo.prediction): "
                          "rebuild it with this onnxcampo's train-graph")
    return name


def _read_names(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads, those its subgraphs read from the outer scope included."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        graphs = [attribute.g] if attribute.HasField("g") else list(attribute.graphs)
        for graph in graphs:
            for inner in graph.node:
                names |= _read_names(inner)
    return names


def eval_model(step: onnx.ModelProto, *, with_loss: bool) -> onnx.ModelProto:
    """``step`` pruned to the nodes the prediction (and ``loss``) need; inputs and initializers
    no kept node reads are dropped. The outputs: the prediction, then ``loss`` if ``with_loss``."""
    step = _restore_prediction(_inference_mode(step))
    prediction = prediction_name(step)
    wanted = [prediction, LOSS] if with_loss else [prediction]
    producers = {out: index for index, node in enumerate(step.graph.node) for out in node.output}
    missing = [name for name in wanted if name not in producers
               and name not in {i.name for i in step.graph.input}]
    if missing:
        raise ConfigError(f"the step graph does not compute {missing[0]!r}; cannot evaluate")
    keep: set[int] = set()
    needed = list(wanted)
    seen: set[str] = set()
    while needed:
        name = needed.pop()
        if name in seen:
            continue
        seen.add(name)
        index = producers.get(name)
        if index is not None and index not in keep:
            keep.add(index)
            needed.extend(_read_names(step.graph.node[index]))
    model = onnx.ModelProto()
    model.CopyFrom(step)
    graph = model.graph
    nodes = [node for index, node in enumerate(step.graph.node) if index in keep]
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [i for i in step.graph.input if i.name in seen]
    del graph.input[:]
    graph.input.extend(inputs)
    initializers = [t for t in step.graph.initializer if t.name in seen]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    known = {vi.name: vi for vi in (*step.graph.value_info, *step.graph.output)}
    del graph.output[:]
    for name in wanted:
        graph.output.append(known[name] if name in known else helper.ValueInfoProto(name=name))
    del graph.value_info[:]
    graph.value_info.extend(vi for vi in step.graph.value_info if vi.name in seen)
    return model


def _restore_prediction(step: onnx.ModelProto) -> onnx.ModelProto:
    """``step`` with its prediction computed again where the loss fusion removed the Slice that
    made it (metadata ``onnxcampo.prediction_slice``: the first ``columns`` columns of ``input``,
    a padded LM head's output); a copy, or the step itself when nothing was removed."""
    recorded = ir.metadata(step, ir.PREDICTION_SLICE_KEY)
    prediction = ir.metadata(step, PREDICTION_KEY)
    if not recorded or not prediction or any(prediction in n.output for n in step.graph.node):
        return step
    spec = json.loads(recorded)
    model = onnx.ModelProto()
    model.CopyFrom(step)
    names = [f"{prediction}/restore_{part}" for part in ("starts", "ends", "axes")]
    for name, value in zip(names, (0, int(spec["columns"]), -1)):
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), name))
    model.graph.node.append(helper.make_node("Slice", [spec["input"], *names], [prediction],
                                             name=f"{prediction}/restore_slice"))
    return model


def _inference_mode(step: onnx.ModelProto) -> onnx.ModelProto:
    """``step`` with each ``Where(onnxcampo.train_mode, a, b)`` an ``Identity(b)``, and the flag
    false for any other node that reads it (one an optimizer fused a Where into); a copy, or the
    step itself when it has no training-mode nodes."""
    return _switched(step, False)


def training_mode(step: onnx.ModelProto) -> onnx.ModelProto:
    """``step`` with each ``Where(onnxcampo.train_mode, a, b)`` an ``Identity(a)`` (ONNX Runtime
    removes those; the Wheres would each be a kernel of a few values a step, two per
    BatchNormalization); a copy, or the step itself when it has no training-mode nodes. The
    session that runs the steps runs this; :func:`eval_model` still switches the written step."""
    return _switched(step, True)


def _switched(step: onnx.ModelProto, train: bool) -> onnx.ModelProto:
    if not any(t.name == TRAIN_FLAG for t in step.graph.initializer):
        return step
    model = onnx.ModelProto()
    model.CopyFrom(step)
    for node in model.graph.node:
        if node.op_type == "Where" and node.input[0] == TRAIN_FLAG:
            node.CopyFrom(helper.make_node("Identity", [node.input[1 if train else 2]], list(node.output),
                                           name=node.name))
    flag = next(t for t in model.graph.initializer if t.name == TRAIN_FLAG)
    if any(TRAIN_FLAG in node.input for graph in iter_graphs(model.graph) for node in graph.node):
        flag.CopyFrom(numpy_helper.from_array(np.array(train), TRAIN_FLAG))
    else:  # read by no node now: ONNX Runtime would warn that it removes it
        model.graph.initializer.remove(flag)
    return model


__all__ = ["eval_model", "prediction_name", "training_mode"]
