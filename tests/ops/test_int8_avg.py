"""``--int8-avg``: which MatMulInteger nodes become AvgMatMulInteger, what the graph looks like
after, and the accuracy ``--validate`` reports (needs the custom-op library)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ops
from onnxcampo.api import optimize
from onnxcampo.cli import main
from onnxcampo.examples import quantized_mlp_block
from onnxcampo.rewrites.int8_avg import replace_matmul_integer
from onnxcampo.runtime import make_session, run

from reference import avg_matmul_integer

U8 = TensorProto.UINT8


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return quantized_mlp_block(tmp_path_factory.mktemp("q") / "mlp_q.onnx")


def _matmul_integer(a_shape, *, cast_to=TensorProto.FLOAT, b_dtype=U8, b_const=True, extra_use=False):
    """A -> MatMulInteger(A, B, za, zb) -> Cast -> Mul(scale): the DynamicQuantizeMatMul pattern."""
    rng = np.random.default_rng(0)
    b = numpy_helper.from_array(rng.integers(0, 256, (12, 5)).astype(helper.tensor_dtype_to_np_dtype(b_dtype)), "B")
    zb = numpy_helper.from_array(np.array(128 if b_dtype == U8 else 0, helper.tensor_dtype_to_np_dtype(b_dtype)), "zb")
    scale = numpy_helper.from_array(np.array(0.01, np.float32), "scale")
    nodes = [helper.make_node("MatMulInteger", ["A", "B", "za", "zb"], ["I"], name="mm"),
             helper.make_node("Cast", ["I"], ["F"], to=cast_to, name="cast"),
             helper.make_node("Mul", ["F", "scale"], ["Y"], name="mul")]
    outputs = [helper.make_tensor_value_info("Y", cast_to, [*a_shape[:-1], 5])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("I", TensorProto.INT32, [*a_shape[:-1], 5]))
    inputs = [helper.make_tensor_value_info("A", U8, a_shape), helper.make_tensor_value_info("za", U8, [])]
    inits = [zb, scale]
    if b_const:
        inits.append(b)
    else:
        inputs.append(helper.make_tensor_value_info("B", b_dtype, [12, 5]))
    if cast_to == TensorProto.FLOAT16:
        scale.CopyFrom(numpy_helper.from_array(np.array(0.01, np.float16), "scale"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_rank2_pattern_becomes_one_op_and_the_mul_stays():
    model = _matmul_integer(["M", 12])
    result = replace_matmul_integer(model)
    assert result.replaced == ["mm"] and result.reshaped == 0
    assert [(n.op_type, n.domain) for n in model.graph.node] == [("AvgMatMulInteger", ops.DOMAIN), ("Mul", "")]
    assert list(model.graph.node[0].input) == ["A", "B", "za", "zb"] and list(model.graph.node[0].output) == ["F"]
    onnx.checker.check_model(model)


def test_other_ranks_are_flattened_and_reshaped_back():
    model = _matmul_integer([2, "T", 12])
    result = replace_matmul_integer(model)
    assert result.reshaped == 1
    assert Counter(n.op_type for n in model.graph.node) == Counter(
        {"Reshape": 2, "AvgMatMulInteger": 1, "Shape": 1, "Slice": 1, "Concat": 1, "Mul": 1})


def test_float16_cast_stays():
    model = _matmul_integer(["M", 12], cast_to=TensorProto.FLOAT16)
    replace_matmul_integer(model)
    assert [n.op_type for n in model.graph.node] == ["AvgMatMulInteger", "Cast", "Mul"]


@pytest.mark.parametrize("kwargs, reason", [
    ({"b_const": False}, "B is not a constant"),
    ({"b_dtype": TensorProto.INT8}, "B is not a 2-D uint8 constant"),
    ({"extra_use": True}, "its int32 output is a graph output"),
])
def test_ineligible_nodes_are_kept_with_a_reason(kwargs, reason):
    model = _matmul_integer(["M", 12], **kwargs)
    before = [n.op_type for n in model.graph.node]
    result = replace_matmul_integer(model)
    assert result.skipped == {"mm": reason}
    assert [n.op_type for n in model.graph.node] == before


@pytest.mark.parametrize("a_shape", [[7, 12], [2, 3, 12], [12]])
def test_replaced_graph_computes_the_reference(library, a_shape):
    """Output = tree-averaged product (bit-exact reference) times the scale, any rank of A."""
    model = _matmul_integer(a_shape)
    replaced = _matmul_integer(a_shape)
    replace_matmul_integer(replaced)
    rng = np.random.default_rng(1)
    feeds = {"A": rng.integers(0, 256, a_shape, dtype=np.uint8), "za": np.array(3, np.uint8)}
    y = run(make_session(replaced), feeds)["Y"]
    b = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "B"))
    expected = avg_matmul_integer(feeds["A"].reshape(-1, 12), b, 3, 128).reshape(*a_shape[:-1], 5) * np.float32(0.01)
    np.testing.assert_array_equal(y, expected)
    exact = run(make_session(model), feeds)["Y"]
    assert np.abs(exact - y).max() <= (12 * 3 / 2) * 0.01 + 1e-6  # K = 12: subtrees 8 + 4: 12 + 4 units


def test_cli_on_the_quantized_mlp_block(library, quantized, tmp_path, capsys):
    out, report = tmp_path / "avg.onnx", tmp_path / "report.json"
    code = main(["optimize", str(quantized), str(out), "--experimental", "int8_avg=true", "--policy", "fp32",
                 "--validate", "--input-shape", "x:64,256", "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "int8-avg: 3 MatMulInteger -> AvgMatMulInteger" in err
    data = json.loads(report.read_text())
    assert data["int8_avg"]["replaced"] == 3 and data["validation"][0]["ok"]
    written = onnx.load(str(out))
    assert Counter(n.op_type for n in written.graph.node)["AvgMatMulInteger"] == 3
    assert "MatMulInteger" not in {n.op_type for n in written.graph.node}


def test_without_the_flag_nothing_is_replaced(quantized):
    result = optimize(quantized, policy="fp32")
    assert "int8_avg" not in result.report
    assert Counter(n.op_type for n in result.model.graph.node)["MatMulInteger"] == 3
