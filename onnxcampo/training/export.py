"""Export a PyTorch module for training: the model the step graph trains is the module's.

An inference export is the wrong starting point for a training step: exporters fold and merge
what inference does not need apart. torch.onnx's TorchScript exporter merges initializers of
equal value (fresh LayerNorm scales, zero biases: they would train as one) and, with constant
folding, writes a tied output projection as a transposed copy of the embedding (trained apart);
its default (dynamo) exporter folds BatchNorms into convolutions, position embeddings and masks
into constants, and exports BatchNorm in inference mode. :func:`export` exports for training
instead, with either exporter:

1. The module in training mode, no constant folding: BatchNorm and Dropout train (BatchNorm
   nodes are marked ``training_mode=1``; the dynamo exporter writes them in inference form),
   nothing is folded; the TorchScript exporter in its training mode, which merges only tensors
   that are one tensor in the module (a tied weight).
2. Every ``nn.Parameter`` is one initializer named after it (``module.named_parameters()``:
   a shared or tied parameter under its first name; the dynamo exporter may write another alias,
   which is renamed). Buffers keep their names and are not trained.
3. The model records its parameters (metadata ``onnxcampo.parameters``: those that require a
   gradient; ``onnxcampo.frozen_parameters``: those that do not), which
   :func:`onnxcampo.training.build_train_step` trains and freezes exactly, in place of its rules
   for graphs from elsewhere (:mod:`onnxcampo.training.trainable`).
4. It checks what it wrote: the parameters that the step would train are the module's that
   require a gradient, by name. A parameter missing from the graph (folded, merged), or that
   does not reach the output, is one :class:`~onnxcampo.errors.ConfigError` naming it, and
   nothing is written. Weights of grouped convolutions and ConvTranspose, which the step cannot
   differentiate, are a warning (their gradients still flow through).

The file is written atomically (a failed export leaves ``path`` as it was). torch is imported
here only (the ``torch`` extra).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import onnx

from onnxcampo import ir
from onnxcampo.errors import ConfigError

log = logging.getLogger(__name__)

PARAMETERS_KEY = "onnxcampo.parameters"  # JSON list: the module's parameters that train
FROZEN_PARAMETERS_KEY = "onnxcampo.frozen_parameters"  # JSON list: those with requires_grad False
EXPORTERS = ("dynamo", "torchscript")
OPSET = 18
# what the step cannot differentiate: warned about, not an error
LIMITS = {"grouped-conv": "grouped convolution", "conv-transpose": "ConvTranspose"}


def export(module, example_inputs, path: str | os.PathLike, *, exporter: str = "dynamo",
           input_names: list[str] | None = None, output_names: list[str] | None = None,
           opset: int = OPSET) -> Path:
    """Export ``module`` (a ``torch.nn.Module``) for training into ``path`` and return it.

    ``example_inputs``: a tensor or a tuple of tensors, the batch the step graph will have the
    shapes of. ``exporter``: ``"dynamo"`` (torch.onnx's default) or ``"torchscript"``.
    ``input_names``: the graph inputs' names (default: the names of ``forward``'s parameters);
    ``output_names``: the outputs' (default ``output``, ``output_1``, ...). The module is put
    back in the mode it was in. See the module docstring for what is checked."""
    torch = _torch()
    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter must be one of {', '.join(EXPORTERS)}, not {exporter!r}")
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"export takes a torch.nn.Module, not {type(module).__name__}")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    input_names = list(input_names or _forward_names(module, len(args)))
    path = Path(path)
    parameters = _parameters(module)
    was_training = module.training
    # tracing runs the forward in training mode, which moves the BatchNorms' running statistics:
    # they are put back, in the module and in the model
    buffers = {name: buffer.detach().clone() for name, buffer in module.named_buffers()}
    module.train()
    try:
        with tempfile.TemporaryDirectory(prefix="onnxcampo-export-") as tmp:
            raw = Path(tmp) / "export.onnx"
            _run_exporter(torch, module, args, raw, exporter, input_names, output_names, opset)
            model = onnx.load(str(raw))
    finally:
        module.train(was_training)
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
    _restore_buffers(model, buffers)
    _rename_aliases(model, parameters)
    _mark_batchnorm_training(model)
    _split_sequences(model)
    _drop_zero_biases(model)
    trained = [name for name, (_, grad) in parameters.items() if grad]
    frozen = [name for name, (_, grad) in parameters.items() if not grad]
    ir.set_metadata(model, PARAMETERS_KEY, json.dumps(trained))
    ir.set_metadata(model, FROZEN_PARAMETERS_KEY, json.dumps(frozen))
    _check(model, parameters)
    ir.save_model(model, path, check_loads=False)  # ORT's inference build has no training-mode BatchNorm
    log.info("exported %s for training with the %s exporter: %d parameters (%d trained)", type(module).__name__,
             exporter, len(parameters), len(trained))
    return path


def _torch():
    try:
        import torch
    except ImportError:
        raise ConfigError("onnxcampo.training.export needs PyTorch: pip install 'onnxcampo[torch]'") from None
    return torch


def _forward_names(module, count: int) -> list[str]:
    names = [p.name for p in inspect.signature(module.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[:count] if len(names) >= count else [f"input_{k}" for k in range(count)]


def _parameters(module) -> dict[str, tuple[list[str], bool]]:
    """``{first name: (every name of the tensor, requires_grad)}``, one entry per parameter tensor
    (a tied or shared parameter has several names; ``named_parameters()`` gives the first)."""
    names: dict[int, list[str]] = {}
    for name, tensor in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(tensor), []).append(name)
    return {name: (names[id(tensor)], bool(tensor.requires_grad)) for name, tensor in module.named_parameters()}


def _run_exporter(torch, module, args: tuple, path: Path, exporter: str, input_names: list[str],
                  output_names: list[str] | None, opset: int) -> None:
    options: dict[str, Any] = {"input_names": input_names, "opset_version": opset}
    if output_names:
        options["output_names"] = list(output_names)
    if exporter == "torchscript":
        options.update(dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    else:
        options.update(dynamo=True, optimize=False, verbose=False)  # the optimizer folds constants
    try:
        with warnings.catch_warnings(record=True) as caught:  # the exporters' notes on their internals
            warnings.simplefilter("always")
            torch.onnx.export(module, args, str(path), **options)
        for warning in caught:
            log.debug("torch.onnx: %s", warning.message)
    except Exception as exc:  # noqa: BLE001 - torch.onnx fails in many ways; one line says which
        text = str(exc).strip().splitlines()
        raise ConfigError(f"torch.onnx ({exporter} exporter) cannot export {type(module).__name__}: "
                          f"{type(exc).__name__}: {text[0] if text else ''}") from None
    if not output_names:
        model = onnx.load(str(path))
        renamed = {o.name: ("output" if k == 0 else f"output_{k}") for k, o in enumerate(model.graph.output)}
        ir.rename_tensors(model.graph, renamed)
        onnx.save(model, str(path))


def _restore_buffers(model: onnx.ModelProto, buffers: dict) -> None:
    """The initializers of the module's buffers hold their values from before the export."""
    from onnx import numpy_helper

    for k, tensor in enumerate(model.graph.initializer):
        saved = buffers.get(tensor.name)
        if saved is not None and list(saved.shape) == list(tensor.dims):
            value = saved.cpu().numpy().astype(numpy_helper.to_array(tensor).dtype)
            model.graph.initializer[k].CopyFrom(numpy_helper.from_array(value, tensor.name))


def _rename_aliases(model: onnx.ModelProto, parameters: dict[str, tuple[list[str], bool]]) -> None:
    """An initializer the exporter named after another alias of a shared parameter gets the
    parameter's first name (the dynamo exporter names a tied weight after its last use)."""
    names = {t.name for t in model.graph.initializer}
    renamed = {}
    for first, (aliases, _) in parameters.items():
        if first not in names:
            alias = next((a for a in aliases if a in names), None)
            if alias is not None:
                renamed[alias] = first
    if renamed:
        ir.rename_tensors(model.graph, renamed)


def _mark_batchnorm_training(model: onnx.ModelProto) -> None:
    """Every BatchNormalization trains (the module was in training mode), with the three outputs
    of training mode."""
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept)
            node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
            while len(node.output) < 3:  # the running statistics' outputs, which training mode has
                node.output.append(f"{node.output[0]}/running_{('mean', 'var')[len(node.output) - 1]}")


def _split_sequences(model: onnx.ModelProto) -> int:
    """``SplitToSequence`` read only by ``SequenceAt`` of constant positions (the dynamo
    exporter's ``tensor.split``, unoptimized) as one ``Split``, which the step can differentiate;
    returns how many. Needs the split axis's length where ``split`` is one chunk size."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    edit = ir.ModelEdit(model)
    values = {name: numpy_helper.to_array(t) for name, t in edit.constants().items()}
    readers = edit.consumers()
    outputs = {o.name for o in graph.output}
    shapes = None
    replaced: dict[int, onnx.NodeProto] = {}
    gone: set[int] = set()
    for node in graph.node:
        if node.op_type != "SplitToSequence" or node.output[0] in outputs:
            continue
        at = readers.get(node.output[0], [])
        if not at or any(r.op_type != "SequenceAt" or r.input[1] not in values for r in at):
            continue
        axis = int(ir.attribute(node, "axis", 0))
        split = values.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if split is None:
            continue  # chunks of one, squeezed (keepdims): not written by the exporter for split()
        if split.ndim == 0:
            if shapes is None:
                shapes = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
                shapes.update({vi.name: vi for vi in graph.input})
            info = shapes.get(node.input[0])
            dims = [d.dim_value for d in info.type.tensor_type.shape.dim] if info is not None else []
            if not dims or dims[axis] <= 0:
                continue
            chunk, length = int(split), dims[axis]
            sizes = [chunk] * (length // chunk) + ([length % chunk] if length % chunk else [])
        else:
            sizes = [int(v) for v in split]
        names = [f"{node.output[0]}/part_{k}" for k in range(len(sizes))]
        for reader in at:
            names[int(values[reader.input[1]]) % len(sizes)] = reader.output[0]
            gone.add(id(reader))
        sizes_name = f"{node.output[0]}/sizes"
        graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), sizes_name))
        replaced[id(node)] = helper.make_node("Split", [node.input[0], sizes_name], names, name=f"{node.name}/split",
                                              axis=axis)
    if not replaced:
        return 0
    kept = [replaced.get(id(n), n) for n in graph.node if id(n) not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


def _drop_zero_biases(model: onnx.ModelProto) -> int:
    """A Conv's bias that is zeros broadcast to the channels (the dynamo exporter writes
    ``Expand(CastLike(0, x), Shape(weight)[:1])`` for ``bias=False``) dropped; returns how many."""
    from onnx import numpy_helper

    graph = model.graph
    edit = ir.ModelEdit(model)
    producers = edit.producers()
    zeros = {name for name, t in edit.constants().items() if not numpy_helper.to_array(t).any()}

    def is_zeros(name: str) -> bool:
        node = producers.get(name)
        if name in zeros:
            return True
        if node is None or node.op_type not in ("Expand", "CastLike", "Cast"):
            return False
        return is_zeros(node.input[0])

    dropped = 0
    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose") and len(node.input) == 3 and node.input[2] \
                and node.input[2] not in zeros and is_zeros(node.input[2]):
            del node.input[2]
            dropped += 1
    if dropped:
        ir.ModelEdit(model).drop_dead()  # the zeros' Expand, CastLike and Shape
    return dropped


def _check(model: onnx.ModelProto, parameters: dict[str, tuple[list[str], bool]]) -> None:
    """Rule 4: what the step would train is the module's parameters that require a gradient."""
    from onnxcampo.training.trainable import select_trainable

    names = {t.name for t in model.graph.initializer}
    missing = [name for name in parameters if name not in names]
    if missing:
        raise ConfigError(f"parameter {missing[0]} is not in the exported graph (the exporter folded or merged it"
                          + (f"; {len(missing) - 1} more" if len(missing) > 1 else "") + "): nothing written")
    selection = select_trainable(model)
    for name, (_, grad) in parameters.items():
        reason = selection.frozen.get(name)
        if not grad or reason is None:
            continue
        if reason in LIMITS:
            log.warning("parameter %s is the weight of a %s, which the step cannot differentiate: it stays as "
                        "initialized (its layer's bias trains, gradients flow through)", name, LIMITS[reason])
            continue
        what = "does not reach the output" if reason == "no-gradient-path" else f"would not train ({reason})"
        raise ConfigError(f"parameter {name} {what}: nothing written")
