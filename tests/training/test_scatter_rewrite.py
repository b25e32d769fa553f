"""fuse_scatter_add: which ScatterNDs become ai.onnxcampo::ScatterNDAdd (graph rewrite only, no
session: the library is not needed)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ops
from onnxcampo.training.scatter import fuse_scatter_add


def scatter_model(*, reduction: str | None = "add", dtype: int = TensorProto.FLOAT, data_from: str = "constant",
                  domain: str = "") -> onnx.ModelProto:
    attributes = {"reduction": reduction} if reduction is not None else {}
    zeros = numpy_helper.from_array(np.zeros((5, 3), helper.tensor_dtype_to_np_dtype(dtype)), "zeros")
    nodes = [helper.make_node("ScatterND", ["zeros", "indices", "updates"], ["grad"], name="scatter", domain=domain,
                              doc_string="the Gather adjoint", **attributes),
             helper.make_node("Identity", ["grad"], ["out"], name="out")]
    inputs = [helper.make_tensor_value_info("indices", TensorProto.INT64, [4, 1]),
              helper.make_tensor_value_info("updates", dtype, [4, 3])]
    initializers = []
    if data_from == "constant":
        nodes.insert(0, helper.make_node("Constant", [], ["zeros"], name="zeros", value=zeros))
    elif data_from == "initializer":
        initializers.append(zeros)
    else:  # computed: only type inference knows its type
        nodes.insert(0, helper.make_node("Mul", ["updates", "updates"], ["square"], name="square"))
        nodes.insert(1, helper.make_node("Concat", ["square", "square"], ["zeros"], name="zeros", axis=0))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", dtype, ["rows", 3])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("data_from", ["constant", "initializer", "computed"])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_an_adding_scatter_on_float_data_becomes_scatter_nd_add(data_from, dtype):
    model = scatter_model(dtype=dtype, data_from=data_from)
    assert fuse_scatter_add(model) == 1
    node = next(n for n in model.graph.node if n.name == "scatter")
    assert (node.domain, node.op_type, list(node.input), list(node.output)) == \
        (ops.DOMAIN, "ScatterNDAdd", ["zeros", "indices", "updates"], ["grad"])
    assert not node.attribute and node.doc_string == "the Gather adjoint"
    assert [n.name for n in model.graph.node][-2:] == ["scatter", "out"]  # in place
    declared = {v.name: v.type.tensor_type for v in model.graph.value_info}
    assert declared["grad"].elem_type == dtype
    assert [d.dim_value for d in declared["grad"].shape.dim] == ([5, 3] if data_from != "computed" else [8, 3])
    assert (ops.DOMAIN, 1) in {(o.domain, o.version) for o in model.opset_import}
    onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("model", [
    scatter_model(reduction=None), scatter_model(reduction="none"), scatter_model(reduction="mul"),
    scatter_model(reduction="max"), scatter_model(dtype=TensorProto.DOUBLE), scatter_model(dtype=TensorProto.BFLOAT16),
    scatter_model(domain="com.example"),
], ids=["no-reduction", "none", "mul", "max", "float64", "bfloat16", "other-domain"])
def test_other_scatters_stay(model):
    before = model.SerializeToString()
    assert fuse_scatter_add(model) == 0
    assert model.SerializeToString() == before  # no opset import either


def test_a_declared_output_keeps_its_value_info():
    model = scatter_model()
    model.graph.value_info.append(helper.make_tensor_value_info("grad", TensorProto.FLOAT, ["rows", 3]))
    assert fuse_scatter_add(model) == 1
    assert [(v.name, v.type.tensor_type.shape.dim[0].dim_param) for v in model.graph.value_info] == [("grad", "rows")]
