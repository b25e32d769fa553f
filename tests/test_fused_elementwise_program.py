"""The FusedElementwise program: its checks and its reference semantics (numpy, fp16 rounding seen)."""

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

from onnxcampo.ops import elementwise as ew
from onnxcampo.ops.elementwise import Op


def _ins(*rows):
    return [v for row in rows for v in row]


def test_a_program_adds_broadcast_inputs_and_stores_fp16_and_fp32():
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    bias = np.array([0.1, 0.2, 0.3], np.float16)
    program = _ins((Op.LOAD, 0, 0, 0), (Op.LOAD, 1, 1, 0), (Op.ADD, 2, 0, 1), (Op.RELU, 3, 2, 0),
                   (Op.STORE, 0, 3, 0), (Op.STORE, 1, 2, 0))
    y16, y32 = ew.run(program, 4, [], [10, 1], [x, bias])
    expected = x + bias.astype(np.float32)
    assert y16.dtype == np.float16 and y32.dtype == np.float32 and y16.shape == (2, 3)
    np.testing.assert_array_equal(y32, expected)
    np.testing.assert_array_equal(y16, np.maximum(expected, 0).astype(np.float16))


def test_round_f16_gives_the_value_an_fp16_node_would_hold():
    x = np.array([1 + 2 ** -12, 3.0], np.float32)  # 1 + 2^-12 is not an fp16 value
    program = _ins((Op.LOAD, 0, 0, 0), (Op.ROUND_F16, 1, 0, 0), (Op.CONST, 2, 0, 0), (Op.MUL, 3, 1, 2),
                   (Op.STORE, 0, 3, 0))
    (y,) = ew.run(program, 4, [2.0], [1], [x])
    np.testing.assert_array_equal(y, np.array([2.0, 6.0], np.float32))


@pytest.mark.parametrize("program, message", [
    ([Op.ADD, 0, 1, 2], "reads register"),
    ([Op.LOAD, 0, 3, 0, Op.STORE, 0, 0, 0], "LOAD of input 3"),
    ([Op.LOAD, 0, 0, 0], "never stored"),
    ([99, 0, 0, 0], "unknown opcode"),
    ([Op.LOAD, 0, 0, 0, Op.STORE, 0, 0, 0, Op.STORE, 0, 0, 0], "each stored once"),
])
def test_programs_the_kernels_would_refuse_are_refused(program, message):
    with pytest.raises(ew.ProgramError, match=message):
        ew.check(program, 4, [], 1, [1])


def test_the_reference_evaluator_runs_the_node_like_the_unfused_graph_in_fp16():
    # y = Cast(Tanh(Cast(x, fp16) * 0.5), fp32): every step in fp16 as numpy rounds it
    x = np.linspace(-3, 3, 17, dtype=np.float32)
    unfused = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[17] x) => (float[17] y) {
      h = Cast <to = 10> (x)
      c = Constant <value = float[1] {0.5}> ()
      half = Cast <to = 10> (c)
      m = Mul(h, half)
      t = Tanh(m)
      y = Cast <to = 1> (t)
    }
    """)
    program = _ins((Op.LOAD, 0, 0, 0), (Op.ROUND_F16, 0, 0, 0), (Op.CONST, 1, 0, 0), (Op.MUL, 2, 0, 1),
                   (Op.ROUND_F16, 2, 2, 0), (Op.TANH, 3, 2, 0), (Op.ROUND_F16, 3, 3, 0), (Op.STORE, 0, 3, 0))
    node = helper.make_node(ew.OP_TYPE, ["x"], ["y"], domain="ai.onnxcampo", program=[int(v) for v in program],
                            registers=4, constants=[0.5], output_types=[1])
    fused = helper.make_model(helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", 1, [17])], [helper.make_tensor_value_info("y", 1, [17])]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnxcampo", 1)])
    want = ReferenceEvaluator(unfused).run(None, {"x": x})[0]
    got = ReferenceEvaluator(fused, new_ops=[ew.reference_op()]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op, f", [(Op.EXP, np.exp), (Op.LOG, np.log), (Op.TANH, np.tanh)])
def test_transcendental_reference_is_float64_rounded_once(op, f):
    # numpy's float32 exp/log are SIMD approximations whose last bits vary by CPU; the reference
    # is the float64 value rounded to float32, the same everywhere
    x = np.random.default_rng(3).uniform(0.01, 20, 10_000).astype(np.float32)
    (y,) = ew.run(_ins((Op.LOAD, 0, 0, 0), (op, 1, 0, 0), (Op.STORE, 0, 1, 0)), 2, [], [1], [x])
    np.testing.assert_array_equal(y, f(x.astype(np.float64)).astype(np.float32))
