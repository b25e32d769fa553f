"""ai.onnxcampo::FusedElementwise on ORT's CPU EP with the built library against the numpy
reference (onnxcampo.ops.elementwise.run): every opcode, float16/float32 inputs and outputs mixed,
broadcasting, empty outputs, float16 rounding, thread-count independence; how ORT learns the
output types; programs refused at session creation. The cases (tests/cases/fused_elementwise.py)
are those that tests/gpu/test_fused_elementwise_cuda.py runs on the CUDA kernels."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from cases import fused_elementwise as cases
from helpers import BIAS_GELU_CHAIN, named_model
from onnxcampo.errors import CampoError
from onnxcampo.ops import elementwise as ew
from onnxcampo.ops import nodes
from onnxcampo.ops.elementwise import Op
from onnxcampo.runtime import make_session, run

F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT
ALL = {case.name: case for case in cases.all_cases()}


def _report(case, outputs):
    report = cases.compare(case, outputs, "cpu")
    assert report["ok"], report
    return report


@pytest.mark.parametrize("name", [n for n in ALL if n.startswith("op_")])
def test_every_opcode_matches_the_reference(library, name):
    case = ALL[name]
    report = _report(case, cases.run_case(case, "cpu"))
    exact = case.ulp["cpu"] == 0
    assert all(o["max_ulp"] == 0 for o in report["outputs"]) or not exact  # + - * / sqrt ...: bit for bit


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("op_")])
def test_broadcasting_rounding_and_chains_match_the_reference(library, name):
    case = ALL[name]
    outputs = cases.run_case(case, "cpu", declare=False)  # output types from the op's inference
    _report(case, outputs)
    if name not in ("gelu_erf",):  # exact float32 programs: equal bit for bit (column sums: within their bound)
        for got, want in zip(outputs[:len(case.output_types)], case.reference()):
            np.testing.assert_array_equal(got.view(np.uint8) if not np.isnan(want).any() else got,
                                          want.view(np.uint8) if not np.isnan(want).any() else want)


def test_the_case_models_are_valid_onnx():
    for case in (ALL["rank5"], ALL["op_POW"], ALL["gelu_erf"], ALL["column_sums_64x64_f16_to_f32"]):
        model = case.model()
        onnx.checker.check_model(model)
        node = model.graph.node[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == "ai.onnxcampo" and list(attrs["program"]) == case.program
        assert attrs["registers"] == case.registers and list(attrs["output_types"]) == case.output_types
        assert [round(c, 5) for c in attrs.get("constants", [])] == [round(c, 5) for c in case.constants]
    for kind in ("gelu", "layernorm_backward", "cast_mul"):
        onnx.checker.check_model(cases.unfused_model(kind, cases.chain_inputs(kind, 4, 8)))


def test_round_f16_is_visible_between_float32_operations(library):
    case = ALL["round_f16_visible"]
    rounded, plain = cases.run_case(case, "cpu")
    np.testing.assert_array_equal(rounded, np.array([2.0, 6.0, 2 + 2.0 ** -9, 131008.0], np.float32))  # 65519 -> 65504
    np.testing.assert_array_equal(plain, case.inputs[0] * np.float32(2))  # 1 + 2^-12 kept without ROUND_F16


@pytest.mark.slow
def test_results_do_not_depend_on_the_thread_count(library):
    rng = np.random.default_rng(7)
    program, constants = cases.gelu_program()
    inputs = [(rng.standard_normal((3, 700, 129)) * 2).astype(np.float16), rng.standard_normal((700, 1)).astype(np.float32)]
    case = cases.Case("threads", program, 4, constants, [F16], inputs)  # 271 K elements: 9 chunks, strided bias
    one = cases.run_case(case, "cpu", threads=1)[0]
    for threads in (2, 4):
        np.testing.assert_array_equal(cases.run_case(case, "cpu", threads=threads)[0].view(np.uint16), one.view(np.uint16))
    _report(case, [one])


def _node_model(node, inputs, outputs, value_info=()):
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs, value_info=list(value_info)),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


ADD_RELU = [Op.LOAD, 0, 0, 0, Op.LOAD, 1, 1, 0, Op.ADD, 2, 0, 1, Op.RELU, 3, 2, 0, Op.STORE, 0, 3, 0, Op.STORE, 1, 2, 0]


def _consumed_model(value_info=(), x_shape=("N", 3)):
    """FusedElementwise whose mixed fp16/fp32 outputs feed Identity nodes: their types are not
    graph outputs, so ORT must learn them from the op (or from value_info)."""
    fused = nodes.fused_elementwise(["x", "b"], ["h16", "h32"], program=ADD_RELU, registers=4, output_types=[F16, F32],
                                    name="fused")
    graph = helper.make_graph(
        [fused, helper.make_node("Identity", ["h16"], ["y16"]), helper.make_node("Identity", ["h32"], ["y32"])], "g",
        [helper.make_tensor_value_info("x", F32, list(x_shape)), helper.make_tensor_value_info("b", F16, [3])],
        [onnx.ValueInfoProto(name="y16"), onnx.ValueInfoProto(name="y32")], value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


@pytest.mark.parametrize("declared", [False, True])
def test_output_types_reach_ort_with_and_without_value_info(library, declared):
    vi = [helper.make_tensor_value_info("h16", F16, None), helper.make_tensor_value_info("h32", F32, None)] if declared else []
    session = make_session(_consumed_model(vi))
    meta = {o.name: (o.type, o.shape) for o in session.get_outputs()}
    assert meta == {"y16": ("tensor(float16)", ["N", 3]), "y32": ("tensor(float)", ["N", 3])}  # inferred shapes too
    x = np.array([[-1, 0.5, 2], [3, -4, 0.25]], np.float32)
    b = np.array([0.5, 0.25, -1], np.float16)
    out = run(session, {"x": x, "b": b})
    assert out["y16"].dtype == np.float16 and out["y32"].dtype == np.float32 and out["y32"].shape == (2, 3)
    want16, want32 = ew.run(ADD_RELU, 4, [], [F16, F32], [x, b])
    np.testing.assert_array_equal(out["y16"], want16)
    np.testing.assert_array_equal(out["y32"], want32)


def test_value_info_contradicting_output_types_is_refused(library):
    vi = [helper.make_tensor_value_info("h16", F32, None)]  # output_types says float16
    with pytest.raises(CampoError, match=r"h16.*does not match expected type|does not match.*h16"):
        make_session(_consumed_model(vi))


def test_symbolic_and_unknown_dimensions_are_inferred(library):
    fused = nodes.fused_elementwise(["x", "b"], ["y16", "y32"], program=ADD_RELU, registers=4, output_types=[F16, F32],
                                    name="fused")
    model = _node_model(fused, [helper.make_tensor_value_info("x", F32, ["N", 1, 3]),
                                helper.make_tensor_value_info("b", F16, ["M", 7, 1])],
                        [onnx.ValueInfoProto(name="y16"), onnx.ValueInfoProto(name="y32")])
    shapes = [o.shape for o in make_session(model).get_outputs()]
    assert shapes[0] == shapes[1] and shapes[0][1:] == [7, 3]
    assert shapes[0][0].startswith("onnxcampo_ew_")  # N against M: either may be 1, unknown


def test_zero_size_outputs(library):
    for shape_x, shape_b in (((0, 3), (3,)), ((2, 0), (1,)), ((0,), ())):
        x, b = np.zeros(shape_x, np.float32), np.ones(shape_b, np.float16)
        y16, y32 = cases.Case("z", ADD_RELU, 4, [], [F16, F32], [x, b]).reference()
        got = cases.run_case(cases.Case("z", ADD_RELU, 4, [], [F16, F32], [x, b]), "cpu", declare=False)
        assert got[0].shape == y16.shape == np.broadcast_shapes(shape_x, shape_b) and got[0].dtype == np.float16
        assert got[1].shape == y32.shape and got[1].dtype == np.float32


def _refused(node, inputs, outputs, match):
    with pytest.raises(CampoError, match=match):
        make_session(_node_model(node, inputs, outputs))


def _raw_node(inputs, outputs, **attributes):
    return helper.make_node("FusedElementwise", inputs, outputs, domain="ai.onnxcampo", name="bad", **attributes)


X = [helper.make_tensor_value_info("x", F32, [4])]
Y = [helper.make_tensor_value_info("y", F32, [4])]


@pytest.mark.parametrize("program, registers, message", [
    ([Op.ADD, 0, 1, 2], 4, r"instruction 0 \(ADD\) reads register 1 before any write"),
    ([Op.LOAD, 0, 3, 0, Op.STORE, 0, 0, 0], 4, "instruction 0: LOAD of input 3, the node has 1"),
    ([Op.LOAD, 0, 0, 0], 4, r"outputs \[0\] are never stored"),
    ([99, 0, 0, 0], 4, "instruction 0: unknown opcode 99"),
    ([Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0, Op.STORE, 0, 0, 0], 4, r"instruction 2: STORE to output 0 \(outputs 1, each"),
    ([Op.LOAD, 5, 0, 0, Op.STORE, 0, 5, 0], 4, "instruction 0: register 5 of 4"),
    ([Op.CONST, 0, 0, 0, Op.STORE, 0, 0, 0], 4, "instruction 0: CONST 0, the node has 0 constants"),
    ([Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0], 33, r"registers must be 1\.\.32, got 33"),
    ([Op.LOAD, 0, 0, 0, Op.STORE, 0, 0], 4, "program must be a non-empty list of 4-int instructions"),
    ([Op.LOAD, 0, 0, 0] * 128 + [Op.STORE, 0, 0, 0], 4, "program has 129 instructions, more than 128"),
])
def test_bad_programs_are_refused_at_session_creation(library, program, registers, message):
    node = _raw_node(["x"], ["y"], program=[int(v) for v in program], registers=registers, output_types=[F32])
    _refused(node, X, Y, r"FusedElementwise node 'bad': " + message)
    if "4-int" not in message:  # the Python check says the same
        with pytest.raises(ew.ProgramError, match=message):
            ew.check(program, registers, [], 1, [F32])


def test_bad_attributes_and_inputs_are_refused_at_session_creation(library):
    store = [int(v) for v in (Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0)]
    _refused(_raw_node(["x"], ["y"], registers=1, output_types=[F32]), X, Y, "attribute 'program' .* is missing")
    _refused(_raw_node(["x"], ["y"], program=store, output_types=[F32]), X, Y, "attribute 'registers' .* is missing")
    _refused(_raw_node(["x"], ["y"], program=store, registers=1), X, Y, "attribute 'output_types' .* is missing")
    _refused(_raw_node(["x"], ["y"], program=store, registers=1, output_types=[11]), X,
             [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [4])], r"outputs of type 1 or 10, got \[11\]")
    two = [int(v) for v in (Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0, Op.STORE, 1, 0, 0)]
    _refused(_raw_node(["x"], ["y"], program=two, registers=1, output_types=[F32, F32]), X, Y,
             "output_types has 2 entries, the node 1 outputs")
    _refused(_raw_node(["i"], ["y"], program=store, registers=1, output_types=[F32]),
             [helper.make_tensor_value_info("i", TensorProto.INT64, [4])], Y, "input 0 must be float32 or float16")


def test_shapes_that_do_not_broadcast_fail_when_run(library):
    fused = nodes.fused_elementwise(["x", "b"], ["y16", "y32"], program=ADD_RELU, registers=4, output_types=[F16, F32],
                                    name="fused")
    model = _node_model(fused, [helper.make_tensor_value_info("x", F32, ["N", 3]), helper.make_tensor_value_info("b", F16, ["M"])],
                        [helper.make_tensor_value_info("y16", F16, None), helper.make_tensor_value_info("y32", F32, None)])
    session = make_session(model)
    with pytest.raises(CampoError, match=r"FusedElementwise node 'fused': input shapes do not broadcast: \[2, 3\] \[4\]"):
        run(session, {"x": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float16)})


def test_more_than_eight_dimensions_after_merging_fail_when_run(library):
    copy = [Op.LOAD, 0, 0, 0, Op.LOAD, 1, 1, 0, Op.ADD, 0, 0, 1, Op.STORE, 0, 0, 0]
    a = np.ones((2, 1) * 4 + (2,), np.float32)
    b = np.ones((1, 2) * 4 + (1,), np.float32)  # broadcast patterns alternate: nothing merges
    with pytest.raises(Exception, match="keeps 9 dimensions after merging the contiguous ones, more than 8"):
        cases.run_case(cases.Case("deep", copy, 2, [], [F32], [a, b]), "cpu")
    c = np.ones((2, 1) * 4, np.float32)  # 8 dimensions: runs
    out = cases.run_case(cases.Case("deep8", copy, 2, [], [F32], [c, b[0]]), "cpu")[0]
    np.testing.assert_array_equal(out, c + b[0])


def test_the_node_builder_checks_the_program():
    node = nodes.fused_elementwise(["x"], ["y"], program=[Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0], registers=1,
                                   output_types=[F16], name="n")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "FusedElementwise" and node.domain == "ai.onnxcampo" and "constants" not in attrs
    assert list(attrs["program"]) == [0, 0, 0, 0, 2, 0, 0, 0] and attrs["registers"] == 1 and list(attrs["output_types"]) == [10]
    with pytest.raises(ew.ProgramError, match="never stored"):
        nodes.fused_elementwise(["x"], ["y"], program=[Op.LOAD, 0, 0, 0], registers=1, output_types=[F32], name="n")
    with pytest.raises(ValueError, match="2 outputs but 1 output_types"):
        nodes.fused_elementwise(["x"], ["y", "z"], program=[Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0], registers=1,
                                output_types=[F32], name="n")


FUSION_MODELS = {
    # the fp16 bias + erf GELU of a campo plan, Casts at the edges; an intermediate read outside
    "bias_gelu": ("""
    g (float[64,96] x, float16[96] bias) => (float[64,96] y, float16[64,96] a) {""" + BIAS_GELU_CHAIN + """
    }
    """, {"s": 0.70710678, "one": 1.0, "half": 0.5}),
    # fp32 arithmetic with a [N, 1] operand, a Sigmoid, fp16 at one edge
    "scaled_sigmoid": ("""
    g (float[32,50] x, float[32,1] r, float16[50] w) => (float16[32,50] y, float[32,50] t) {
      d = Sub(x, r)
      t = Mul(d, d)
      wf = Cast <to = 1> (w)
      q = Mul(t, wf)
      z = Sigmoid(q)
      y = Cast <to = 10> (z)
    }
    """, {}),
}


@pytest.mark.parametrize("name", sorted(FUSION_MODELS))
def test_models_fused_by_fuse_elementwise_run_on_ort_cpu(library, name):
    # onnxcampo.rewrites.elementwise writes the nodes; ORT runs them with this library and gives the
    # reference's values (ReferenceEvaluator with elementwise.run) and the unfused graph's
    from onnx import numpy_helper

    from onnxcampo.rewrites.elementwise import fuse_elementwise

    text, scalars = FUSION_MODELS[name]
    model = named_model(text)
    for key, value in scalars.items():
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.float16), key))
    rng = np.random.default_rng(5)
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(
        helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)) for i in model.graph.input}
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_elementwise(fused).groups >= 1 and ew.OP_TYPE in [n.op_type for n in fused.graph.node]
    got = run(make_session(fused), feeds)
    want = dict(zip([o.name for o in fused.graph.output],
                    ReferenceEvaluator(fused, new_ops=[ew.reference_op()]).run(None, feeds)))
    unfused = run(make_session(model), feeds)
    for key, value in got.items():
        assert value.dtype == want[key].dtype == unfused[key].dtype and value.shape == want[key].shape
        assert cases.ulp_distance(value, want[key]).max() <= 2, key  # erff, expf against the rounded reference
        np.testing.assert_allclose(value.astype(np.float32), unfused[key].astype(np.float32), rtol=2e-3, atol=2e-3)
