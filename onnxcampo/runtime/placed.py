"""The graph as ONNX Runtime's CPU provider places it: a session with graph optimizations off
writes what every session does to a model anyway (on the CPU, fp32 kernels between Casts of its
own for fp16 nodes it has no fp16 kernel for, then fp32->fp16->fp32 Cast pairs dropped).

Imports nothing of onnxcampo, on purpose: ``scripts/check_ort_artifacts.py`` runs in the
onnxruntime-training venv, where onnxcampo is not installed, and loads this file by its path, so
that this door stays the only code that creates ONNX Runtime sessions.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def placed_graph(model_path: str | Path, out_path: str | Path) -> onnx.ModelProto:
    """The model at ``model_path`` as ORT's CPU provider places it (written to ``out_path``)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(out_path)
    onnxruntime.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return onnx.load(str(out_path))


def fp16_nodes(model: onnx.ModelProto) -> int:
    """Nodes other than Cast that read or write an fp16 tensor."""
    graph = model.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in (*graph.value_info, *graph.input, *graph.output)}
    types.update({t.name: t.data_type for t in graph.initializer})
    return sum(1 for node in graph.node if node.op_type != "Cast"
               and any(types.get(t) == onnx.TensorProto.FLOAT16 for t in (*node.input, *node.output)))
