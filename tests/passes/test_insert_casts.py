"""Mutating pass ``insert_casts``: apply the plan with one Cast per (tensor, dtype).

Each test decides every node by hand (the plan states the precision under test), runs
InsertCasts with invariant checks (topological order, onnx.checker full check, no Cast round
trip, graph I/O dtypes) and compares the exported graph with the exact nodes expected.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FLOAT,
    FLOAT16,
    build_context,
    cast_round_trips,
    cast_to,
    casts,
    consumers,
    decide,
    elem_types,
    export,
    initializer,
    io_types,
    node,
    ops,
    parse,
    producer,
    reference_run,
    run_passes,
)

from onnxcampo import OptimizeConfig, optimize
from onnxcampo.passes.classify import Classify
from onnxcampo.passes.insert_casts import InsertCasts
from onnxcampo.passes.manager import InvariantError
from onnxcampo.passes.uniform_precision import UniformPrecision
from onnxcampo.plan import Precision, Reason

W_INIT = "float[8,8] w = {" + ",".join(["0.125"] * 64) + "}"


def apply(text, plan, **options):
    """Classify, then the given decisions, every other node fp32, then InsertCasts."""
    ctx, model, _ = apply_counted(text, plan, **options)
    return ctx, model


def apply_counted(text, plan, **options):
    """:func:`apply`, and the counts InsertCasts reported."""
    ctx = build_context(parse(text), **options)
    run_passes(ctx, Classify())
    decide(ctx, **{k: v for k, v in plan.items() if not ctx.plan.is_decided(k)})
    results = run_passes(ctx, UniformPrecision(Precision.FP32, Reason.DEFAULT_FP32), InsertCasts())
    return ctx, export(ctx), results[-1].counts


def assert_graph(model, expected):
    """``expected``: list of (op_type, inputs, outputs) in graph order."""
    got = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert got == expected


# --- rule 1 and 2: retyped outputs, pinned names ------------------------------------------
def test_graph_output_from_fp16_node_keeps_name_and_fp32():
    """Rules 1-2: y is a graph output made by an fp16 Relu. The Relu writes ``y/fp16`` and a
    Cast gives back ``y`` in fp32: the output keeps its name and dtype."""
    _, model = apply("""
    g (float[4,8] x) => (float[4,8] y) {
      [relu] y = Relu(x)
    }
    """, {"relu": "fp16"})
    assert_graph(model, [
        ("Cast", ["x"], ["x/fp16"]),
        ("Relu", ["x/fp16"], ["y/fp16"]),
        ("Cast", ["y/fp16"], ["y"]),
    ])
    assert [cast_to(c) for c in casts(model)] == [FLOAT16, FLOAT]
    assert io_types(model) == {"x": FLOAT, "y": FLOAT}
    assert [o.name for o in model.graph.output] == ["y"]


def test_graph_output_also_read_inside_is_shared_in_fp16():
    """Rules 2-3: y is a graph output and also read by an fp16 Sigmoid: the Sigmoid reads
    ``y/fp16`` directly (no Cast back and forth), the output ``y`` comes from one Cast."""
    _, model = apply("""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
      [relu] y = Relu(x)
      [sig] z = Sigmoid(y)
    }
    """, {"relu": "fp16", "sig": "fp16"})
    assert node(model, "sig").input[0] == "y/fp16"
    assert len(casts(model)) == 3  # x -> fp16, y/fp16 -> y, z/fp16 -> z
    assert cast_round_trips(model) == []


def test_existing_cast_to_float_feeding_fp16_consumer_is_retargeted():
    """Rule 1: an existing ``Cast(to=FLOAT)`` of int64 ids feeding an fp16 MatMul, planned
    fp16, becomes ``Cast(to=FLOAT16)``: no extra Cast is added after it."""
    text = f"""
    g (int64[4,8] ids) => (float[4,8] y) <{W_INIT}> {{
      [to_float] f = Cast<to=1>(ids)
      [mm] y = MatMul(f, w)
    }}
    """
    _, model = apply(text, {"to_float": "fp16", "mm": "fp16"})
    assert_graph(model, [
        ("Cast", ["ids"], ["f"]),
        ("MatMul", ["f", "w"], ["y/fp16"]),
        ("Cast", ["y/fp16"], ["y"]),
    ])
    assert cast_to(node(model, "to_float")) == FLOAT16
    assert elem_types(model)["f"] == FLOAT16


@pytest.mark.parametrize("policy", ["fp16", "amp", "campo"])
def test_existing_cast_to_float_retargeted_in_every_policy(policy):
    """Rule 1 end to end: every policy that runs the MatMul fp16 retargets the Cast instead of
    adding one (campo with Tensor-Core-sized dims, so that fp16 pays)."""
    w = ",".join(["0.01"] * (256 * 256))
    text = f"""
    g (int64[512,256] ids) => (float[512,256] y) <float[256,256] w = {{{w}}}> {{
      [to_float] f = Cast<to=1>(ids)
      [mm] y = MatMul(f, w)
    }}
    """
    result = optimize(parse(text), config=OptimizeConfig(policy=policy), experimental={"check_invariants": True})
    assert result.plan.is_fp16("mm"), result.report["plan"]
    assert ops(result.model) == ["Cast", "MatMul", "Cast"]
    assert cast_to(node(result.model, "to_float")) == FLOAT16


def test_cast_planned_fp32_stays_and_a_cast_is_added():
    """Rule 3: the same Cast planned fp32 keeps ``to=FLOAT`` and the fp16 MatMul gets
    ``f/fp16`` from a new Cast (int64 -> fp32 -> fp16 is no round trip)."""
    text = f"""
    g (int64[4,8] ids) => (float[4,8] y) <{W_INIT}> {{
      [to_float] f = Cast<to=1>(ids)
      [mm] y = MatMul(f, w)
    }}
    """
    _, model = apply(text, {"to_float": "fp32", "mm": "fp16"})
    assert cast_to(node(model, "to_float")) == FLOAT
    assert node(model, "mm").input[0] == "f/fp16"
    assert cast_to(producer(model, "f/fp16")) == FLOAT16


# --- rule 3: one Cast per (tensor, dtype) ----------------------------------------------------
def _x_read_four_times():
    """The pass on x read by three fp16 nodes and one fp32 node, all four graph outputs: (ctx,
    model, counts)."""
    return apply_counted("""
    g (float[4,8] x) => (float[4,8] a, float[4,8] b, float[4,8] c, float[4,8] d) {
      [relu] a = Relu(x)
      [sig] b = Sigmoid(x)
      [tanh] c = Tanh(x)
      [exp] d = Exp(x)
    }
    """, {"relu": "fp16", "sig": "fp16", "tanh": "fp16", "exp": "fp32"})


def test_one_cast_per_tensor_and_dtype_shared_by_consumers():
    """Rule 3: x is read by three fp16 nodes and one fp32 node: one Cast ``x -> x/fp16``
    feeds all three fp16 consumers; the fp32 Exp reads x."""
    ctx, model, counts = _x_read_four_times()
    to_half = [c for c in casts(model) if list(c.input) == ["x"]]
    assert len(to_half) == 1 and list(to_half[0].output) == ["x/fp16"]
    assert sorted(n.name for n in consumers(model, "x/fp16")) == ["relu", "sig", "tanh"]
    assert node(model, "exp").input[0] == "x"
    assert counts["casts"] == 4  # x -> fp16, and a, b, c back to fp32


def test_one_cast_back_to_fp32_shared_by_fp32_consumers():
    """Rule 3: an fp16 MatMul output read by two fp32 nodes: one Cast ``a -> a/fp32``."""
    _, model = apply(f"""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [exp] y = Exp(a)
      [log] z = Log(a)
    }}
    """, {"mm": "fp16", "exp": "fp32", "log": "fp32"})
    assert node(model, "exp").input[0] == node(model, "log").input[0] == "a/fp32"
    assert [list(c.input) for c in casts(model)] == [["x"], ["a"]]


def test_reverse_cast_returns_the_original_tensor():
    """Rule 3: ``f = Cast<to=FLOAT>(x)`` planned fp16 becomes ``Cast<to=FLOAT16>``; an fp32 Exp
    that read ``f`` gets the Cast's source ``x`` back (it already is fp32), not a Cast of f
    back to fp32 (which would be a fp32 -> fp16 -> fp32 round trip)."""
    _, model = apply("""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
      [c] f = Cast<to=1>(x)
      [relu] y = Relu(f)
      [exp] z = Exp(f)
    }
    """, {"c": "fp16", "relu": "fp16", "exp": "fp32"})
    assert node(model, "exp").input[0] == "x"
    assert node(model, "relu").input[0] == "f"
    assert cast_to(node(model, "c")) == FLOAT16
    assert cast_round_trips(model) == []
    assert len(casts(model)) == 2  # the retargeted Cast and y/fp16 -> y


def test_reverse_cast_of_fp16_source_no_round_trip():
    """Rule 3: ``f = Cast<to=FLOAT>(r)`` of an fp16 tensor feeding an fp16 Sigmoid: the Sigmoid
    reads ``r`` itself, never Cast(fp16 -> fp32) -> Cast(fp32 -> fp16)."""
    _, model = apply("""
    g (float16[4,8] x) => (float[4,8] y) {
      [h] r = Relu(x)
      [c] f = Cast<to=1>(r)
      [sig] y = Sigmoid(f)
    }
    """, {"c": "fp32", "sig": "fp16"})
    assert node(model, "sig").input[0] == "r"
    assert cast_round_trips(model) == []


# --- rule 3 and 4: constants ------------------------------------------------------------------
def test_initializer_used_by_fp16_and_fp32_is_duplicated_and_fp16_only_converted_in_place():
    """Rule 4: ``w`` feeds an fp16 and an fp32 MatMul: it stays fp32 and an fp16 copy
    ``w/fp16`` is added for the fp16 one. ``b`` feeds only fp16 Adds: converted in place
    (same name, fp16, no copy)."""
    ctx, model, counts = apply_counted(f"""
    g (float[4,8] x) => (float[4,8] y1, float[4,8] y2, float[4,8] y3, float[4,8] y4)
      <{W_INIT}, float[8] b = {{1,2,3,4,5,6,7,8}}> {{
      [mm16] y1 = MatMul(x, w)
      [mm32] y2 = MatMul(x, w)
      [add1] y3 = Add(x, b)
      [add2] y4 = Sub(x, b)
    }}
    """, {"mm16": "fp16", "mm32": "fp32", "add1": "fp16", "add2": "fp16"})
    names = sorted(t.name for t in model.graph.initializer)
    assert names == ["b", "w", "w/fp16"]
    assert initializer(model, "w").dtype == np.float32 and initializer(model, "w/fp16").dtype == np.float16
    np.testing.assert_array_equal(initializer(model, "w/fp16"), np.full((8, 8), 0.125, np.float16))
    assert initializer(model, "b").dtype == np.float16
    assert list(node(model, "mm16").input) == ["x/fp16", "w/fp16"]
    assert list(node(model, "mm32").input) == ["x", "w"]
    assert list(node(model, "add1").input) == list(node(model, "add2").input) == ["x/fp16", "b"]
    assert counts["constants"] == 2
    assert not [c for c in casts(model) if c.input[0] in ("w", "b")]  # constants: never cast at run time


def test_constant_node_duplicated_or_converted_in_place():
    """Rule 4 for Constant nodes: ``k`` read by fp16 and fp32 Adds gets a second Constant
    node ``k/fp16``; ``k2`` read only in fp16 is converted in place."""
    _, model = apply("""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z, float[4,8] q) {
      [k] k = Constant<value=float[8] {1,2,3,4,5,6,7,8}>()
      [k2] k2 = Constant<value=float[8] {1,2,3,4,5,6,7,8}>()
      [a16] y = Add(x, k)
      [a32] z = Add(x, k)
      [s16] q = Sub(x, k2)
    }
    """, {"a16": "fp16", "a32": "fp32", "s16": "fp16"})
    types = elem_types(model)
    assert types["k"] == FLOAT and types["k/fp16"] == FLOAT16 and types["k2"] == FLOAT16
    assert producer(model, "k/fp16").op_type == "Constant"
    assert list(node(model, "a16").input) == ["x/fp16", "k/fp16"]
    assert list(node(model, "a32").input) == ["x", "k"]
    assert list(node(model, "s16").input) == ["x/fp16", "k2"]
    assert ops(model).count("Constant") == 3


def test_values_beyond_fp16_range_are_clamped_and_counted():
    """Rule 3: a -3.4e38 attention-mask constant read by an fp16 Add becomes -65504, not -inf;
    3e38 becomes 65504; a real -inf stays -inf. Two values were clamped, and the report says
    so."""
    text = """
    g (float[2,4] x) => (float[2,4] y) <float[4] mask = {-3.4e38, 0, 3.0e38, 0}, float[4] minf = {0, 0, 0, -inf}> {
      [add] s = Add(x, mask)
      [add2] y = Add(s, minf)
    }
    """
    ctx, model, counts = apply_counted(text, {"add": "fp16", "add2": "fp16"})
    assert counts["clamped"] == 2
    np.testing.assert_array_equal(initializer(model, "mask"), np.array([-65504, 0, 65504, 0], np.float16))
    assert np.isneginf(initializer(model, "minf")[3])


def test_attention_mask_clamped_in_report_and_softmax_finite():
    """Rule 3 end to end (policy fp16): the attention logits + -3.4e38 mask feed a Softmax.
    The written mask holds -65504 (finite), ``report["initializer_values_clamped"]`` counts
    the masked entries, and the fp16 softmax (reference evaluator, real fp16 arithmetic)
    gives 0 where masked and matches the fp32 model elsewhere."""
    text = """
    g (float[2,4] scores) => (float[2,4] probs) <float[2,4] mask = {0, 0, -3.4e38, -3.4e38, 0, -3.4e38, 0, -3.4e38}> {
      [mask_add] masked = Add(scores, mask)
      [softmax] probs = Softmax<axis=-1>(masked)
    }
    """
    model = parse(text)
    result = optimize(model, config=OptimizeConfig(policy="fp16"), experimental={"check_invariants": True})
    assert result.report["initializer_values_clamped"] == 4
    mask = initializer(result.model, "mask")
    assert mask.dtype == np.float16 and np.isfinite(mask).all() and mask.min() == -65504
    scores = np.array([[0.5, -1.0, 2.0, 0.25], [1.5, 0.0, -0.5, 3.0]], np.float32)
    (expected,) = reference_run(model, {"scores": scores})
    (got,) = reference_run(result.model, {"scores": scores})
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=2e-3)
    assert got[0, 2] == got[0, 3] == got[1, 1] == got[1, 3] == 0


# --- signature slots: never cast --------------------------------------------------------------
def test_resize_scales_reshape_shape_slice_indices_never_cast():
    """Rule 3 reads the op schema: Resize's ``scales`` (tensor(float), a constant or a graph
    input), Reshape's ``shape`` and Slice's ``starts/ends/axes`` keep their dtypes when the
    node runs fp16; only the data inputs and outputs are cast."""
    text = """
    g (float[1,1,4,4] x, float[4] s) => (float[1,1,8,8] y1, float[1,1,8,8] y2, float[16] y3, float[1,1,2,4] y4)
      <float[4] sc = {1, 1, 2, 2}, int64[1] shp = {16}, int64[1] st = {0}, int64[1] en = {2}, int64[1] ax = {2}> {
      [rz1] y1 = Resize(x, , sc)
      [rz2] y2 = Resize(x, , s)
      [rs] y3 = Reshape(x, shp)
      [sl] y4 = Slice(x, st, en, ax)
    }
    """
    ctx, model = apply(text, {"rz1": "fp16", "rz2": "fp16", "rs": "fp16", "sl": "fp16"})
    cast_inputs = sorted(c.input[0] for c in casts(model))
    assert cast_inputs == ["x", "y1/fp16", "y2/fp16", "y3/fp16", "y4/fp16"]
    assert list(node(model, "rz1").input) == ["x/fp16", "", "sc"]
    assert list(node(model, "rz2").input) == ["x/fp16", "", "s"]
    assert list(node(model, "rs").input) == ["x/fp16", "shp"]
    assert list(node(model, "sl").input) == ["x/fp16", "st", "en", "ax"]
    assert initializer(model, "sc").dtype == np.float32
    assert {initializer(model, n).dtype for n in ("shp", "st", "en", "ax")} == {np.dtype(np.int64)}
    assert io_types(model)["s"] == FLOAT


def test_resize_scales_from_fp16_node_are_cast_back_to_fp32():
    """Rule 3: scales computed by an fp16 Mul must be fp32 for the Resize: one Cast back."""
    text = """
    g (float[1,1,4,4] x, float[4] s) => (float[1,1,8,8] y) <float[4] two = {1, 1, 2, 2}> {
      [scale] sc = Mul(s, two)
      [rz] y = Resize(x, , sc)
    }
    """
    _, model = apply(text, {"scale": "fp16", "rz": "fp16"})
    rz = node(model, "rz")
    assert rz.input[2] == "sc/fp32" and cast_to(producer(model, "sc/fp32")) == FLOAT
    assert elem_types(model)["sc/fp32"] == FLOAT


# --- rule 5: I/O types ------------------------------------------------------------------------
IO_MODEL = """
g (float[4,8] x, float[4,8] x2) => (float[4,8] y, float[4,8] z, float[4,8] t) {
  [relu] y = Relu(x)
  [sig] s = Sigmoid(x)
  [exp] z = Exp(x2)
  [tanh] t = Tanh(x2)
}
"""
IO_PLAN = {"relu": "fp16", "sig": "fp16", "exp": "fp32", "tanh": "fp16"}


def test_io_types_kept_by_default():
    """Rule 5 off (default ``keep_io_types``): every graph input and output keeps fp32."""
    _, model = apply(IO_MODEL, IO_PLAN)
    assert io_types(model) == {"x": FLOAT, "x2": FLOAT, "y": FLOAT, "z": FLOAT, "t": FLOAT}


def test_io_types_change_without_keep_io_types():
    """Rule 5: ``keep_io_types=False``: x, read only in fp16, becomes an fp16 input (no Cast);
    x2, read in fp32 too, stays fp32 with a Cast for the Tanh; outputs made in fp16 (y, t) are
    fp16 under their own names; z stays fp32."""
    _, model = apply(IO_MODEL, IO_PLAN, keep_io_types=False)
    assert io_types(model) == {"x": FLOAT16, "x2": FLOAT, "y": FLOAT16, "z": FLOAT, "t": FLOAT16}
    assert [list(c.input) for c in casts(model)] == [["x2"]]
    assert node(model, "relu").input[0] == "x" and node(model, "tanh").input[0] == "x2/fp16"
    assert [o.name for o in model.graph.output] == ["y", "z", "t"]


def test_a_reader_of_any_dtype_does_not_keep_an_input_fp32():
    """Rule 5: a Shape reads x in any dtype, so x, read otherwise only in fp16, becomes fp16 with
    no Cast, as ``casting.tensor_casts`` counts it (it was kept fp32 with a Cast for the Relu, one
    Cast more than the estimate's)."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y, int64[2] s) {
      [relu] y = Relu(x)
      [shape] s = Shape(x)
    }
    """)
    result = optimize(model, config=OptimizeConfig(policy="fp16", keep_io_types=False),
                      experimental={"check_invariants": True})
    assert io_types(result.model)["x"] == FLOAT16 and not casts(result.model)
    assert node(result.model, "shape").input[0] == "x"
    assert result.report["casts_inserted"] == result.report["predicted_us"]["fp16"]["casts"] == 0
    (y, shape) = reference_run(result.model, {"x": np.ones((4, 8), np.float16)})
    assert shape.tolist() == [4, 8] and y.dtype == np.float16


def test_keep_io_types_false_end_to_end_runs_in_fp16():
    """Rule 5 end to end: policy fp16 without keep_io_types takes and gives fp16 tensors."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [relu] r = Relu(x)
      [sig] y = Sigmoid(r)
    }
    """)
    result = optimize(model, config=OptimizeConfig(policy="fp16", keep_io_types=False),
                      experimental={"check_invariants": True})
    assert io_types(result.model) == {"x": FLOAT16, "y": FLOAT16}
    assert ops(result.model) == ["Relu", "Sigmoid"]
    x = np.linspace(-3, 3, 32, dtype=np.float16).reshape(4, 8)
    (y,) = reference_run(result.model, {"x": x})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-np.maximum(x.astype(np.float32), 0))), atol=1e-3)


# --- requirements and numerics ----------------------------------------------------------------
def test_refuses_an_incomplete_plan():
    """InsertCasts needs a precision for every node."""
    ctx = build_context(parse("""
    g (float[4,8] x) => (float[4,8] y) {
      [relu] y = Relu(x)
    }
    """))
    with pytest.raises(InvariantError, match="no precision"):
        run_passes(ctx, InsertCasts())


def test_mixed_graph_matches_numpy_fp16():
    """The cast graph computes what numpy computes with the same precisions: MatMul and Add
    in fp16 (reference evaluator, no hidden fp32), Exp in fp32."""
    text = f"""
    g (float[4,8] x) => (float[4,8] y) <{W_INIT}, float[8] b = {{0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8}}> {{
      [mm] a = MatMul(x, w)
      [add] s = Add(a, b)
      [exp] y = Exp(s)
    }}
    """
    _, model = apply(text, {"mm": "fp16", "add": "fp16", "exp": "fp32"})
    assert ops(model) == ["Cast", "MatMul", "Add", "Cast", "Exp"]
    x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
    (y,) = reference_run(model, {"x": x})
    b = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], np.float16)
    half = (x.astype(np.float16) @ np.full((8, 8), 0.125, np.float16)) + b
    np.testing.assert_allclose(y, np.exp(half.astype(np.float32)), rtol=1e-6)


# --- regressions (bugs these tests found; fixed in 0806cbd) -------------------------------------
@pytest.mark.parametrize("policy", ["fp16", "amp"])
def test_identity_cast_feeding_graph_output_makes_no_round_trip(policy):
    """Rules 1-3: ``f = Cast<to=FLOAT>(x)`` of an fp32 input is a graph output and feeds a
    MatMul. Whatever the plan, ``f`` must stay exactly ``x`` (no fp32 -> fp16 -> fp32)."""
    model = parse(f"""
    g (float[4,8] x) => (float[4,8] f, float[4,8] y) <{W_INIT}> {{
      [c] f = Cast<to=1>(x)
      [mm] y = MatMul(f, w)
    }}
    """)
    result = optimize(model, config=OptimizeConfig(policy=policy), experimental={"check_invariants": True})
    assert cast_round_trips(result.model) == []
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8) + np.float32(1e-4)
    f, _ = reference_run(result.model, {"x": x})
    np.testing.assert_array_equal(f, x)


@pytest.mark.parametrize("attr", ["value_float=2.0", "value_floats=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]"])
def test_constant_node_with_value_float_attribute(attr):
    """Rule 3-4 for Constant nodes written with ``value_float(s)``: the fp16 Add reads an fp16
    constant and the result matches."""
    model = parse(f"""
    g (float[4,8] x) => (float[4,8] y) {{
      [k] k = Constant<{attr}>()
      [add] y = Add(x, k)
    }}
    """)
    result = optimize(model, config=OptimizeConfig(policy="fp16"), experimental={"check_invariants": True})
    assert result.plan.is_fp16("add")
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    (want,) = reference_run(model, {"x": x})
    (got,) = reference_run(result.model, {"x": x})
    np.testing.assert_allclose(got, want, atol=1e-2)


@pytest.mark.parametrize("policy", ["fp16", "amp"])
def test_comparison_inputs_get_one_dtype(policy):
    """A comparison reading a tensor made in fp16 and an fp32 graph input must see both
    inputs in one dtype (a Cast on one side)."""
    model = parse(f"""
    g (float[4,8] x) => (bool[4,8] c, float[4,8] y) <{W_INIT}> {{
      [mm] a = MatMul(x, w)
      [relu] y = Relu(a)
      [less] c = Less(a, x)
    }}
    """)
    result = optimize(model, config=OptimizeConfig(policy=policy), experimental={"check_invariants": True})
    assert result.plan.is_fp16("mm")
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    (want, _), (got, _) = reference_run(model, {"x": x}), reference_run(result.model, {"x": x})
    np.testing.assert_array_equal(got, want)


def test_fp16_model_with_fp32_output_cast_gets_no_extra_cast():
    """Rules 1-2: a Relu on an fp16 input whose result is cast to an fp32 graph output is
    already what policy fp16 wants: nothing is inserted."""
    model = parse("""
    g (float16[4,8] x) => (float[4,8] y) {
      [relu] r = Relu(x)
      [up] y = Cast<to=1>(r)
    }
    """)
    result = optimize(model, config=OptimizeConfig(policy="fp16"), experimental={"check_invariants": True})
    assert result.report["casts_inserted"] == 0
    assert ops(result.model) == ["Relu", "Cast"]


def test_predicted_casts_match_inserted_casts():
    """The estimate counts Casts as Cast insertion makes them: one per (tensor, dtype)."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
      [relu] y = Relu(x)
      [sig] s = Sigmoid(x)
      [exp] z = Exp(s)
    }
    """)
    result = optimize(model, config=OptimizeConfig(policy="fp16", exclude_ops=frozenset({"Exp"})),
                      experimental={"check_invariants": True})
    assert result.report["casts_inserted"] == 3  # x -> fp16, s -> fp32, y back to fp32
    assert result.report["predicted_us"]["fp16"]["casts"] == 3


def test_predicted_casts_match_inserted_casts_without_keep_io_types():
    """Rule 5 and the estimate: x is read by an fp16 Relu and an fp32 Exp, so it stays fp32
    and one Cast feeds the Relu; the estimate must count that Cast."""
    model = parse("""
    g (float[4,8] x) => (float[4,8] y, float[4,8] z) {
      [relu] y = Relu(x)
      [exp] z = Exp(x)
    }
    """)
    config = OptimizeConfig(policy="fp16", keep_io_types=False, exclude_ops=frozenset({"Exp"}))
    result = optimize(model, config=config, experimental={"check_invariants": True})
    assert result.report["casts_inserted"] == 1 and ops(result.model) == ["Cast", "Relu", "Exp"]
    assert result.report["predicted_us"]["fp16"]["casts"] == 1


def test_every_cast_says_why_it_is_there():
    """Each Cast the pass adds is recorded (``ctx.inserted``, the written node's doc_string) with
    its tensor, where the tensor comes from and who reads it: x to fp16 for the three fp16
    readers, each output back to fp32 because it is a graph output."""
    ctx, model, _ = _x_read_four_times()
    assert sorted(ctx.inserted) == sorted(c.name for c in casts(model))
    assert ctx.inserted["x/cast_fp16"] == {
        "op": "Cast", "why": "Cast to float16 of x (graph input); for fp16 relu, fp16 sig, fp16 tanh"}
    assert ctx.inserted["a/fp16/cast_fp32"]["why"] == (
        "Cast to float32 of a/fp16 (made by fp16 relu); graph output a keeps its dtype")
