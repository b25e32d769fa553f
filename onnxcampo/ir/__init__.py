"""The model as onnxcampo reads, edits and writes it, one module per job:

- :mod:`onnxcampo.ir.io`: read and check a model, metadata, atomic writes (external data past
  2 GB, test-loaded by ONNX Runtime before the rename), copies without the weights' data for
  checks and sessions that do not read it;
- :mod:`onnxcampo.ir.shapes`: input dims pinned, shape/type inference once at load into the
  :class:`TensorInfo` table, ORT's symbolic inference where ONNX's leaves float shapes unknown;
- :mod:`onnxcampo.ir.topology`: the one topological sort, and what If/Loop/Scan bodies read;
- :mod:`onnxcampo.ir.export`: the onnx-graphsurgeon graph the passes edit, and the output model
  built from it;
- :mod:`onnxcampo.ir.edit`: the model file's graph as the proto-level rewrites edit it
  (producers, consumers, constants, fresh names).

The names below are the public ones of the five modules, importable from here
(``from onnxcampo import ir``; ``ir.read_model(...)``).
"""

from __future__ import annotations

from onnxcampo.ir.io import (
    MIN_OPSET,
    StagedModel,
    check_model,
    check_output_path,
    default_opset,
    exceeds_protobuf_limit,
    dynamic_inputs,
    graph_inputs,
    metadata,
    name_nodes,
    ort_default_domain_nodes,
    read_model,
    save_model,
    set_metadata,
    without_weights,
    write_bytes_atomically,
    write_text_atomically,
)
from onnxcampo.ir.shapes import (
    FLOAT_TYPES,
    TensorInfo,
    check_dim_names,
    fill_unknown_shapes,
    infer_tensor_info,
    pin_input_shapes,
    record_value_infos,
    skeleton,
    static_shape,
    symbolic_dims,
    tensor_dtype,
)
from onnxcampo.ir.topology import (
    CONTROL_FLOW_ATTRS,
    graph_key,
    has_subgraph,
    outer_scope_names,
    subgraph_node_names,
    toposort,
    toposort_model,
)
from onnxcampo.ir.export import export_model, to_graphsurgeon
from onnxcampo.ir.edit import PREDICTION_KEY, PREDICTION_SLICE_KEY, ModelEdit, attribute, rename_tensors

__all__ = [
    "CONTROL_FLOW_ATTRS", "PREDICTION_KEY", "PREDICTION_SLICE_KEY", "FLOAT_TYPES", "MIN_OPSET", "ModelEdit", "StagedModel", "TensorInfo", "attribute", "check_dim_names", "check_model", "check_output_path",
    "default_opset", "exceeds_protobuf_limit", "export_model", "fill_unknown_shapes", "dynamic_inputs", "graph_inputs", "graph_key",
    "has_subgraph", "infer_tensor_info", "metadata", "name_nodes", "ort_default_domain_nodes",
    "outer_scope_names", "pin_input_shapes", "read_model", "record_value_infos", "rename_tensors", "save_model", "set_metadata", "skeleton", "static_shape",
    "subgraph_node_names", "symbolic_dims", "tensor_dtype", "to_graphsurgeon", "toposort", "toposort_model", "without_weights", "write_bytes_atomically",
    "write_text_atomically",
]
