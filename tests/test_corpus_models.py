"""Real models from PyPI wheels (docs/corpus-survey.md): every policy gives a model that passes
the full ONNX check, runs on ONNX Runtime CPU, and stays close to the fp32 model there.

The closeness check is a wiring check (Casts, renamed outputs, converted constants in the right
places): ORT's CPU provider runs most fp16 nodes in fp32 between Casts of its own, which hides
fp16 rounding. fp16 numerics are checked with the ONNX reference evaluator in the pass tests.

Closeness is the largest absolute error relative to the largest reference magnitude of each
output. The bound is 2 % except where a model needs more, with the reason next to it.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxcampo
from onnxcampo import ir
from onnxcampo.benchmarks import corpus
from onnxcampo.runtime import make_session, run

pytestmark = pytest.mark.corpus

BOUND = 0.02
# ppocr_det on random images outputs sigmoid values around 1e-5 (max 5.9e-5): an absolute fp16
# rounding of ~1e-6 in the final sigmoid is 2.5 % of that. On real images outputs are O(1).
LOOSER = {"ppocr_det": 0.05}


def _load(entry: corpus.CorpusModel):
    try:
        path = corpus.fetch(entry)
    except corpus.CorpusUnavailable as exc:
        pytest.skip(f"corpus model unavailable: {exc}")
    proto = onnx.load(str(path))
    feeds = corpus.make_inputs(entry, proto=proto)
    return path, proto, feeds


def _relative_errors(reference: dict, candidate: dict) -> dict[str, float]:
    errors = {}
    for name, ref in reference.items():
        got = candidate[name]
        assert got.shape == ref.shape, name
        if ref.dtype.kind != "f":
            errors[name] = float(np.abs(got.astype(np.int64) - ref.astype(np.int64)).max(initial=0))
            continue
        scale = max(float(np.abs(ref).max(initial=0)), 1e-30)
        errors[name] = float(np.abs(got.astype(np.float64) - ref.astype(np.float64)).max(initial=0)) / scale
    return errors


@pytest.mark.parametrize("entry", corpus.CORPUS, ids=[m.key for m in corpus.CORPUS])
@pytest.mark.parametrize("policy", ["campo", "amp", "fp16"])
def test_policy_on_real_model(entry, policy):
    path, proto, feeds = _load(entry)
    result = onnxcampo.optimize(path, policy=policy, input_shapes=entry.input_shapes, accuracy="off",
                                experimental={"check_invariants": True})
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == proto.ir_version
    assert [i.type for i in model.graph.input] == [i.type for i in proto.graph.input]
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [o.type.tensor_type.elem_type for o in proto.graph.output]
    reference = run(make_session(proto), feeds)
    optimized = run(make_session(model), feeds)
    bound = LOOSER.get(entry.key, BOUND)
    errors = _relative_errors(reference, optimized)
    assert max(errors.values()) <= bound, errors
    casts = sum(n.op_type == "Cast" for n in model.graph.node) - sum(n.op_type == "Cast" for n in proto.graph.node)
    assert casts == result.report["casts_inserted"]
    if policy == "campo":
        predicted = result.report["predicted_us"]
        assert predicted["campo"]["total_us"] <= predicted["fp32"]["total_us"] + 1e-6
        # never predicted slower than amp either, unless amp's edge over fp32 is below --min-gain
        if result.report["chosen_plan"] != "fp32":
            assert predicted["campo"]["total_us"] <= predicted["amp"]["total_us"] + 1e-6
        else:
            assert predicted["amp"]["total_us"] >= 0.98 * predicted["fp32"]["total_us"]


def test_quantized_model_is_left_intact():
    """smart_turn is int8 QDQ throughout: campo must not insert a single Cast or touch a QDQ op."""
    entry = corpus.get("smart_turn")
    path, proto, _ = _load(entry)
    result = onnxcampo.optimize(path, input_shapes=entry.input_shapes, accuracy="off")
    assert result.report["casts_inserted"] == 0
    assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in proto.graph.node]
    reasons = result.report["reasons"]
    assert reasons.get("fp32: part of a quantized (QDQ / integer) pattern", 0) > 100


def test_if_subgraphs_stay_fp32_with_reason():
    """silero_vad keeps its network inside If branches: they are planned fp32 with a reason."""
    entry = corpus.get("silero_vad")
    path, _, _ = _load(entry)
    result = onnxcampo.optimize(path, policy="fp16", input_shapes=entry.input_shapes, accuracy="off")
    plan = result.report["plan"]
    inner = [v for k, v in plan.items() if "/" in k]
    assert len(inner) > 100
    assert all(v["precision"] == "fp32" and v["reason"] == "in_subgraph" for v in inner)


def test_if_bodies_nothing_changed_do_not_grow_the_model():
    """silero_vad_16k_op15's LSTM weights live in the outer graph and are read by both branches of
    an If, which stay fp32: the written model holds them once, in the outer graph (graphsurgeon's
    export copied them into each branch, 1.41x the size), and its outputs are the input model's."""
    entry = corpus.get("silero_vad_op15")
    path, proto, feeds = _load(entry)
    result = onnxcampo.optimize(path, input_shapes=entry.input_shapes, accuracy="off")
    # the graphs and weights (onnxcampo writes its reason into every node's doc_string, bodies included)
    assert len(ir.graph_key(result.model.graph)) < 1.01 * len(ir.graph_key(proto.graph))
    assert {t.name for t in result.model.graph.initializer} == {t.name for t in proto.graph.initializer}
    reference = run(make_session(proto), feeds)
    candidate = run(make_session(result.model), feeds)
    assert max(_relative_errors(reference, candidate).values()) < 1e-6


def test_bn_variance_beyond_fp16_range_keeps_node_fp32():
    """ppocr_det has a BatchNormalization variance of 9.8e7: clamping it would change the model."""
    entry = corpus.get("ppocr_det")
    path, _, _ = _load(entry)
    result = onnxcampo.optimize(path, policy="fp16", input_shapes=entry.input_shapes, accuracy="off")
    out_of_range = [k for k, v in result.report["plan"].items() if v["reason"] == "constant_out_of_range"]
    assert out_of_range
    assert result.report["initializer_values_clamped"] == 0
