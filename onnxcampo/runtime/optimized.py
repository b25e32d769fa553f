"""The graph ONNX Runtime executes: what its graph optimizations leave of a model.

ORT folds constants, aliases data-movement ops (Identity, Reshape, Squeeze, Unsqueeze, Flatten:
no kernel, the output shares the input's buffer) and fuses patterns (MatMul + Add -> Gemm,
BatchNormalization into Conv, the LayerNorm and Gelu sub-graphs, Conv + Relu) before it runs a
model. A plan costed node by node on the ONNX graph charges kernels and launches ORT never makes
(BERT-base: 614 ONNX nodes, 430 on ORT's CUDA EP). :func:`executed_graph` asks ORT itself: it
builds a CPU session at the extended level (``SessionOptions.optimized_model_filepath``), which
reproduces the CUDA EP's node counts on the models measured, and reads back the graph ORT wrote,
without its weights. The session gets a copy of the model without its large initializers
(``ir.without_weights``) and those initializers' data from memory, as arrays over their bytes
(``SessionOptions.add_external_initializers``): ORT's graph optimizations see the same values, and
the model is not serialized whole for it; weight prepacking, which runs after the optimized graph
is written, is off. Measured on the H200 (onnxruntime-gpu 1.31.1, ``docs/benchmarks/raw/inference-h200/
executed-counts.json``): BERT-base 564 ONNX nodes -> 406 on both, GPT-2 780 -> 384 on both;
ResNet-50 122 -> 122 on the CUDA EP but 89 on the CPU, whose ConvActivationFusion makes FusedConv
of Conv + Relu, which the CUDA EP leaves apart: the stand-in runs without it (``CPU_ONLY_FUSIONS``).
"""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from onnxcampo import oplists
from onnxcampo.ir.io import declared_bytes, without_weights

log = logging.getLogger(__name__)

_OPTIMIZED = "optimized.onnx"
_ALIASING = oplists.ALIASED - {"Constant"}  # ops ORT keeps as nodes that pass their input on
# ORT graph transformers the CPU provider runs and the CUDA EP does not: ConvActivationFusion
# (checked on the H200: the CUDA EP keeps ResNet-50's Conv and Relu apart), and those ORT registers
# for the CPU provider alone (graph_transformer_utils.cc: GemmActivationFusion makes FusedGemm, which
# has no CUDA kernel; the integer-MatMul fusions)
CPU_ONLY_FUSIONS = ("ConvActivationFusion", "GemmActivationFusion", "MatMulIntegerToFloatFusion",
                    "DynamicQuantizeMatMulFusion")
_OPTIMIZED_DATA = "optimized.onnx.data"
IN_MEMORY = "onnxcampo-in-memory"  # the location a stub of ir.without_weights names for an ORT session


@dataclass(frozen=True)
class ExecutedGraph:
    """What ORT runs of a model: which op produces each tensor its remaining nodes make."""

    producers: dict[str, str]  # tensor name -> "domain:op" of the node ORT runs to make it
    op_counts: Counter = field(default_factory=Counter)  # "domain:op" -> nodes ORT runs
    provider: str = "cpu"
    level: str = "extended"
    aliases: dict[str, str] = field(default_factory=dict)  # output of an aliasing node -> its input

    def computed_by(self, name: str) -> str | None:
        """The op that computes a tensor, through the aliasing nodes (Reshape, ...) that pass it on."""
        seen = set()
        while name in self.aliases and name not in seen:
            seen.add(name)
            name = self.aliases[name]
        return self.producers.get(name)

    @property
    def nodes(self) -> int:
        return sum(self.op_counts.values())

    def launches(self) -> dict[str, int]:
        """Kernel launches of one run by class (``CostModel.launch_us``): ``conv`` (convolutions,
        whose cuDNN calls cost the host more) and ``other``; aliased ops launch nothing."""
        counts = {"conv": 0, "other": 0}
        for op, count in self.op_counts.items():
            op_type, domain = _op_and_domain(op)
            if domain in oplists.DEFAULT_DOMAINS and op_type in oplists.ALIASED:
                continue
            counts["conv" if op_type in oplists.NCHW_FP16_LAYOUT_OPS else "other"] += count
        return counts

    def node_status(self, model: onnx.ModelProto) -> dict[str, str]:
        """For each top-level node of ``model`` (its nodes must be named, as ``optimize`` names
        them) that ORT does not run as it is: ``"absorbed"`` when every output it makes is gone
        (folded, aliased, fused into a neighbour that produces a later tensor) or ``"fused"`` when
        ORT makes its output with another op (the fused node took its place: the LayerNorm
        sub-graph's last Add, made by a LayerNormalization), ``"carried"`` when that other op is
        a Tensor Core product that absorbed the node's work (a BatchNormalization's output made by
        the Conv it was folded into; the Conv itself is ``"absorbed"``, its time is the fused
        node's). Nodes ORT runs unchanged are left out. Graph outputs always survive."""
        outputs = {o.name for o in model.graph.output}
        status = {}
        for node in model.graph.node:
            made = [name for name in node.output if name]
            if not made:
                continue
            kept = [name for name in made if name in self.producers]
            if not kept:
                if not any(name in outputs for name in made):
                    status[node.name] = "absorbed"
                continue
            own = f"{node.domain or 'ai.onnx'}:{node.op_type}"
            if node.op_type in _ALIASING:
                others = {self.producers[name] for name in kept} - {own}
            else:  # a bias Add whose output a Reshape after the fused Gemm passes on is the Gemm's
                others = {self.computed_by(name) or self.producers[name] for name in kept} - {own}
            if others:
                products = [op for op in others if oplists.category_of(*_op_and_domain(op)) is oplists.Category.ALLOW]
                status[node.name] = "carried" if products and oplists.category_of(
                    node.op_type, node.domain or "") is not oplists.Category.ALLOW else "fused"
        return status


def _op_and_domain(op: str) -> tuple[str, str]:
    """``"com.microsoft:FusedConv"`` -> ``("FusedConv", "com.microsoft")``."""
    domain, _, op_type = op.partition(":")
    return op_type, ("" if domain == "ai.onnx" else domain)


def executed_graph(model: onnx.ModelProto, *, provider: str = "cpu", level: str = "extended",
                   weights: Mapping[str, onnx.TensorProto] | None = None) -> ExecutedGraph:
    """The graph ORT executes for ``model`` after its graph optimizations at ``level``.

    ``weights``: where ``model`` is a copy made by ``ir.without_weights(..., location=IN_MEMORY)``,
    the initializers it holds out, by name; otherwise that copy is made here. ``model`` is not
    modified.

    Raises what :func:`onnxcampo.runtime.make_session` raises when ORT cannot load the model
    (callers that only want better costs catch :class:`onnxcampo.errors.CampoError`).
    """
    if weights is None:
        model, weights = without_weights(model, location=IN_MEMORY)
    with tempfile.TemporaryDirectory(prefix="onnxcampo-ort-") as tmp:
        path = Path(tmp) / _OPTIMIZED
        # log errors only: ORT's warnings on unused initializers are not the user's business; the
        # weights go to a side file ORT writes and we never read: only the node list matters
        # the CPU provider stands in for the CUDA EP: without the fusions only the CPU makes
        disabled = CPU_ONLY_FUSIONS if provider == "cpu" else ()
        _write_optimized(model, weights, provider=provider, level=level, disabled=disabled, session_config={
            "session.optimized_model_filepath": str(path),
            "session.optimized_model_external_initializers_file_name": _OPTIMIZED_DATA,
            "session.optimized_model_external_initializers_min_size_in_bytes": "64",
            "session.disable_prepacking": "1"})
        optimized = onnx.load(str(path), load_external_data=False)
    producers = {name: f"{node.domain or 'ai.onnx'}:{node.op_type}"
                 for node in optimized.graph.node for name in node.output if name}
    # what an aliasing node (MatMulAddFusion's Reshape -> Gemm -> Reshape on 3-D inputs) passes on
    aliases = {node.output[0]: node.input[0] for node in optimized.graph.node
               if node.op_type in _ALIASING and (node.domain or "") in ("", "ai.onnx") and node.input and node.output}
    counts = Counter(f"{node.domain or 'ai.onnx'}:{node.op_type}" for node in optimized.graph.node)
    log.debug("ORT (%s, %s level) runs %d of %d nodes", provider, level, sum(counts.values()), len(model.graph.node))
    return ExecutedGraph(producers, counts, provider, level, aliases)


def _write_optimized(model: onnx.ModelProto, weights: Mapping[str, onnx.TensorProto], *, provider: str,
                     level: str, disabled: tuple[str, ...], session_config: Mapping[str, object]) -> None:
    """Create (and drop) a session of ``model``, whose held-out initializers are stubs (as
    ``ir.without_weights`` makes them with location :data:`IN_MEMORY`) that ORT fills from
    ``weights``: arrays over the tensors' raw bytes, handed over as external initializers (alive
    as long as the session). Options, providers and errors are
    :func:`onnxcampo.runtime.make_session`'s. A stub whose tensor's raw data is not the size its
    type and dims give gets the tensor back, in a copy of ``model`` (ORT then reports it as it
    would have)."""
    import onnxruntime as ort

    from onnxcampo import ops
    from onnxcampo.errors import CampoError
    from onnxcampo.runtime import _create_from_proto, _providers, _session_options

    if ops.uses_ops(model):
        ops.require()  # as make_session: how to build the library, before ORT's own message
    names, values, odd = [], [], []
    for index, stub in enumerate(model.graph.initializer):
        if not _in_memory(stub) or stub.name not in weights:
            continue
        tensor = weights[stub.name]
        raw = tensor.raw_data
        if len(raw) != declared_bytes(tensor):
            odd.append(index)
            continue
        array = np.frombuffer(raw, dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type)).reshape(tuple(tensor.dims))
        names.append(stub.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
    if odd:
        model = _with_tensors(model, {index: weights[model.graph.initializer[index].name] for index in odd})
    options = _session_options(profiling=False, optimization_level=level, custom_ops_library=None,
                               intra_op_threads=1, profile_file_prefix=None, session_config=session_config,
                               log_severity=3)
    if names:
        options.add_external_initializers(names, values)
    session = _create_from_proto(model, options, _providers(provider), disabled)
    if provider == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise CampoError("ONNX Runtime fell back to CPU: CUDAExecutionProvider failed to initialise "
                         "(check the CUDA/cuDNN libraries; see ORT's warnings above)")
    del session


def _with_tensors(model: onnx.ModelProto, tensors: Mapping[int, onnx.TensorProto]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers at the given indices are the given tensors."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for index, tensor in tensors.items():
        out.graph.initializer[index].CopyFrom(tensor)
    return out


def _in_memory(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        entry.key == "location" and entry.value == IN_MEMORY for entry in tensor.external_data)
