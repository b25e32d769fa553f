"""ir.ModelEdit: the proto-level tables the model-file rewrites read."""

import onnx

from onnxcampo import ir


def _model():
    return onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[2,3] y) {
      k = Constant <value = int64[1] {3}> ()
      a = Relu(x)
      b = Add(a, a)
      y = Neg(b)
    }
    """)


def test_producers_consumers_and_constants_are_read_from_the_graph_as_it_is():
    model = _model()
    edit = ir.ModelEdit(model)
    assert edit.producers()["b"].op_type == "Add"
    assert [n.op_type for n in edit.consumers()["a"]] == ["Add", "Add"]  # once per slot
    assert set(edit.constants()) == {"k"}
    assert edit.interface() == {"x", "y"}
    edit.replace_uses("a", "x")
    assert "a" not in edit.consumers() and len(edit.consumers()["x"]) == 3


def test_fresh_names_are_new_to_the_graph_and_to_each_other():
    model = _model()
    model.graph.node[1].output[0] = "t/r_1"  # a tensor already has the first fresh name
    edit = ir.ModelEdit(model.graph, fresh_prefix="t")
    first, second = edit.fresh("r"), edit.fresh("r")
    assert first != "t/r_1" and first != second


def test_attribute_gives_the_value_or_the_default():
    node = onnx.helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])
    assert ir.attribute(node, "perm") == [1, 0] and ir.attribute(node, "axis", 7) == 7


def test_graph_key_ignores_doc_strings_in_bodies_too():
    from onnx import helper

    from onnxcampo import ir

    body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], doc_string="a")], "b", [],
                             [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body, doc_string="onnxcampo: fp32")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    other = onnx.GraphProto()
    other.CopyFrom(graph)
    other.node[0].doc_string = ""
    other.node[0].attribute[0].g.node[0].doc_string = "changed"
    assert ir.graph_key(graph) == ir.graph_key(other) and graph.node[0].doc_string == "onnxcampo: fp32"
    other.node[0].attribute[0].g.node[0].op_type = "Neg"
    assert ir.graph_key(graph) != ir.graph_key(other)
