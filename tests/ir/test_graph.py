"""Loading and inference of graphs with ops ONNX has no schema for (ONNX Runtime training ops).

ONNX inference stops at such ops; what follows them is typed by ``_propagate_dtypes`` and sized
by the shapes the producer declared (pinned like the inputs).
"""

from __future__ import annotations

import onnx
import pytest
from helpers import FLOAT, make_model, tensor_vi
from onnx import TensorProto, helper

from onnxcampo import ir
from onnxcampo.errors import ModelLoadError

MS = "com.microsoft"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]


def _pool_grad_model(op_type: str = "MaxPoolGrad") -> onnx.ModelProto:
    return make_model(
        [helper.make_node(op_type, ["dy", "indices"], ["dx"], name="pool_grad"),
         helper.make_node("Relu", ["dx"], ["y"], name="relu")],
        [tensor_vi("dy", [1, 2, 2, 2]), tensor_vi("indices", [1, 2, 2, 2], TensorProto.INT64)],
        [tensor_vi("y", [1, 2, 4, 4])], opsets=OPSETS,
    )


def test_ort_default_domain_training_op_passes_the_check_and_is_left_as_it_was(tmp_path):
    """MaxPoolGrad sits in the default domain without being an ONNX op: the checker alone
    rejects it; read_model accepts it (from a ModelProto and from a file) and leaves its
    domain and the opset imports as they were."""
    model = _pool_grad_model()
    with pytest.raises(onnx.checker.ValidationError, match="MaxPoolGrad"):
        onnx.checker.check_model(model)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    for source in (model, path):
        loaded, _ = ir.read_model(source)
        assert loaded.graph.node[0].domain == ""
        assert [(o.domain, o.version) for o in loaded.opset_import] == [("", 17), (MS, 1)]
    ir.check_model(model, full_check=True)
    assert model.graph.node[0].domain == "" and len(model.opset_import) == 2


def test_unknown_default_domain_op_is_still_rejected():
    """Only ORT's known default-domain training ops are exempt: a misspelt one is an error."""
    with pytest.raises(ModelLoadError, match="No Op registered for MaxPoolGradd"):
        ir.read_model(_pool_grad_model("MaxPoolGradd"))


def test_dtypes_behind_ops_without_schema():
    """SoftmaxCrossEntropyLossGrad (no schema in plain ONNX Runtime) reads float and int64
    labels: its output is float (labels do not bind it), and so is the ReduceSum after it.
    MaxPool's indices behind it are int64 (its schema allows nothing else)."""
    model = make_model(
        [helper.make_node("SoftmaxCrossEntropyLossGrad", ["dloss", "log_prob", "labels"], ["dx"],
                          name="sce_grad", domain=MS),
         helper.make_node("ReduceSum", ["dx", "axes"], ["db"], name="bias_grad"),
         helper.make_node("Unsqueeze", ["dx", "axes2"], ["dx4"], name="to_4d"),
         helper.make_node("MaxPool", ["dx4"], ["pooled", "mask"], name="pool", kernel_shape=[1, 1])],
        [tensor_vi("dloss", []), tensor_vi("log_prob", ["batch", 10]),
         tensor_vi("labels", ["batch"], TensorProto.INT64)],
        [tensor_vi("db", [10]), tensor_vi("pooled", None), tensor_vi("mask", None, TensorProto.INT64)],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [0]),
         helper.make_tensor("axes2", TensorProto.INT64, [2], [0, 1])],
        opsets=OPSETS,
    )
    del model.graph.output[1:]  # leave pooled and mask undeclared
    info, _ = ir.infer_tensor_info(model)
    assert {name: info[name].dtype for name in ("dx", "db", "dx4", "pooled", "mask")} == {
        "dx": FLOAT, "db": FLOAT, "dx4": FLOAT, "pooled": FLOAT, "mask": TensorProto.INT64}


@pytest.mark.parametrize("pins", [
    {"dim_values": {"batch": 16}},
    {"input_shapes": {"x": (16, 8)}},  # the input's dim name pins the same name elsewhere
])
def test_named_dims_pin_declared_value_infos_behind_ops_without_schema(pins):
    """ReluGrad stops ONNX inference; its output's declared shape ``[batch, 8]`` gets the
    pinned batch, and so does what ONNX infers from it (the Gemm after it)."""
    model = make_model(
        [helper.make_node("ReluGrad", ["dy", "x"], ["dx"], name="relu_grad", domain=MS),
         helper.make_node("Gemm", ["dx", "w"], ["y"], name="gemm")],
        [tensor_vi("x", ["batch", 8]), tensor_vi("dy", ["batch", 8]), tensor_vi("w", [8, 4])],
        [tensor_vi("y", ["batch", 4])], value_info=[tensor_vi("dx", ["batch", 8])], opsets=OPSETS,
    )
    info, _ = ir.infer_tensor_info(model, **pins)
    assert info["dx"].shape == (16, 8) and info["y"].shape == (16, 4)
    assert model.graph.value_info[0].type.tensor_type.shape.dim[0].dim_param == "batch"  # input untouched
