"""ONNX Runtime training artifacts (``generate_artifacts`` output) as input.

The fixtures in ``tests/fixtures/ort_artifacts/{mlp,cnn}`` come from
``scripts/make_ort_artifacts.py`` (onnxruntime-training-cpu 1.19.2). Plain ONNX Runtime cannot
run them (no training kernels), so these tests check structure: the model stays valid, its
inputs and outputs (parameters, gradient buffers, ``lazy_reset_grad``, the loss) keep names and
dtypes, the training state stays fp32, and the forward ops the policy converts are converted.
``scripts/check_ort_artifacts.py`` trains the optimized artifacts on the training build.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

import onnxcampo
from onnxcampo import ir
from onnxcampo.cli import main
from onnxcampo.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ort_artifacts"
MODELS = ("mlp", "cnn")
POLICIES = ("campo", "amp", "fp16", "fp32")
BATCH = {"batch": 16}
# Forward ops that amp (greedy) and fp16 convert: the test fails if optimize does nothing.
FORWARD_FP16 = {"mlp": ("/fc1/Gemm", "/fc2/Gemm"), "cnn": ("/conv/Conv", "/fc/Gemm")}
# Ops fixed to fp32 whatever the policy, and why.
FIXED_FP32 = {
    "InPlaceAccumulatorV2": "training_state",
    "BatchNormInternal": "unknown_op",  # a com.microsoft op in no list
    "MaxPoolGrad": "declared_output_shape",
}


def training_model(name: str) -> Path:
    return FIXTURES / name / "training_model.onnx"


def io_signature(model: onnx.ModelProto) -> list[tuple[str, str, int, tuple]]:
    return [
        (kind, vi.name, vi.type.tensor_type.elem_type,
         tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim))
        for kind, values in (("input", model.graph.input), ("output", model.graph.output)) for vi in values
    ]


def checker_error(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.checker.ValidationError as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.fixture(scope="module", params=[(m, p) for m in MODELS for p in POLICIES], ids=lambda mp: "-".join(mp))
def optimized(request):
    name, policy = request.param
    original = onnx.load(str(training_model(name)))
    result = onnxcampo.optimize(training_model(name), policy=policy, dim_values=BATCH,
                                experimental={"check_invariants": True})
    return name, policy, original, result


def test_fixtures_are_what_the_issue_describes():
    """IR <= 9 (onnx 1.16), com.microsoft gradient ops, MaxPoolGrad in the default domain."""
    for name in MODELS:
        model = onnx.load(str(training_model(name)))
        assert model.ir_version <= 9
        ops = {(n.domain, n.op_type) for n in model.graph.node}
        assert {("com.microsoft", "InPlaceAccumulatorV2"), ("com.microsoft", "SoftmaxCrossEntropyLossGrad")} <= ops
    cnn_ops = {(n.domain, n.op_type) for n in onnx.load(str(training_model("cnn"))).graph.node}
    assert {("", "MaxPoolGrad"), ("com.microsoft", "ConvGrad"), ("com.microsoft", "BatchNormInternal")} <= cnn_ops


def test_model_stays_valid_and_keeps_ir_version_and_opsets(optimized):
    """The checker accepts the result whenever it accepts the original; the CNN's MaxPoolGrad
    is rejected by the plain checker in both, for that reason only, and the check that sets
    ORT's default-domain ops aside passes in full."""
    _, _, original, result = optimized
    assert checker_error(result.model) == checker_error(original)
    ir.check_model(result.model, full_check=True)
    assert result.model.ir_version == original.ir_version
    assert list(result.model.opset_import) == list(original.opset_import)


def test_inputs_and_outputs_keep_names_dtypes_and_shapes(optimized):
    _, _, original, result = optimized
    assert io_signature(result.model) == io_signature(original)


def test_training_state_and_unknown_ops_stay_fp32_with_a_reason(optimized):
    _, _, original, result = optimized
    plan = result.report["plan"]
    fixed = [n for n in original.graph.node if n.op_type in FIXED_FP32]
    assert fixed
    for node in fixed:
        assert plan[node.name] == {"precision": "fp32", "reason": FIXED_FP32[node.op_type]}, node.name


def test_accumulators_read_their_buffers_and_get_fp32_gradients(optimized):
    """Each InPlaceAccumulatorV2 still reads its gradient buffer (a graph input) directly, and
    its gradient input is fp32: an fp16 gradient reaches it through a Cast."""
    _, _, original, result = optimized
    model = result.model
    inputs = {vi.name for vi in model.graph.input}
    produced = {out: n for n in model.graph.node for out in n.output}
    before = {n.name: list(n.input) for n in original.graph.node if n.op_type == "InPlaceAccumulatorV2"}
    after = {n.name: list(n.input) for n in model.graph.node if n.op_type == "InPlaceAccumulatorV2"}
    assert after.keys() == before.keys()
    dtypes = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.value_info}
    for name, (buffer, gradient, reset) in after.items():
        assert buffer == before[name][0] and buffer in inputs and reset == "lazy_reset_grad"
        source = produced[gradient]
        if source.op_type == "Cast":
            assert source.attribute[0].i == TensorProto.FLOAT
        else:
            assert gradient == before[name][1] and dtypes.get(gradient, TensorProto.FLOAT) == TensorProto.FLOAT


def test_amp_and_fp16_convert_the_forward_ops(optimized):
    """Under amp and fp16 the forward Gemm/Conv run fp16 and read Casts of the fp32 inputs and
    parameters; under fp32 nothing changes; campo decides by cost (these models are small)."""
    name, policy, original, result = optimized
    plan = result.report["plan"]
    if policy in ("amp", "fp16"):
        assert all(plan[node]["precision"] == "fp16" for node in FORWARD_FP16[name])
        assert result.report["casts_inserted"] > 0
        first = next(n for n in result.model.graph.node if n.name == FORWARD_FP16[name][0])
        casts = {out: n for n in result.model.graph.node if n.op_type == "Cast" for out in n.output}
        assert first.input[0] in casts and casts[first.input[0]].attribute[0].i == TensorProto.FLOAT16
    elif policy == "fp32":
        assert result.report["casts_inserted"] == 0 and result.report["nodes_fp16"] == 0
        assert [n.op_type for n in result.model.graph.node] == [n.op_type for n in original.graph.node]


def test_without_declared_value_infos_every_float_tensor_is_still_typed():
    """A training graph stripped of its value infos: dtypes come from propagation alone (through
    SoftmaxCrossEntropyLossGrad, whose int64 labels must not bind it). amp stays valid, and the
    fp16 backward Gemm reading the loss gradient gets it through a Cast."""
    model = onnx.load(str(training_model("mlp")))
    del model.graph.value_info[:]
    result = onnxcampo.optimize(model, policy="amp", dim_values=BATCH, experimental={"check_invariants": True})
    ir.check_model(result.model, full_check=True)
    plan = result.report["plan"]
    assert plan["onnx::SoftmaxCrossEntropyLoss::4_Grad/SoftmaxCrossEntropyLossGrad_0"]["precision"] == "fp32"
    casts = {out: n for n in result.model.graph.node if n.op_type == "Cast" for out in n.output}
    readers = [n for n in result.model.graph.node if n.name.startswith("/fc2/Gemm_Grad/Gemm")]
    assert len(readers) == 2 and all(plan[n.name]["precision"] == "fp16" for n in readers)
    for gemm in readers:
        cast = casts[gemm.input[0]]
        assert list(cast.input) == ["output_grad"] and cast.attribute[0].i == TensorProto.FLOAT16


def test_no_keep_io_types_is_refused():
    with pytest.raises(ConfigError, match="training graph"):
        onnxcampo.optimize(training_model("mlp"), policy="amp", keep_io_types=False)


def test_cli_inspect_and_optimize_a_fixture(tmp_path, capsys):
    code = main(["inspect", str(training_model("cnn")), "--dim", "batch=16", "--nodes"])
    out = capsys.readouterr().out
    assert code == 0
    assert "training_state" in out and "declared_output_shape" in out
    written = tmp_path / "training_model.onnx"
    code = main(["optimize", str(training_model("cnn")), str(written), "--policy", "amp", "--dim", "batch=16"])
    assert code == 0 and written.exists()
    ir.read_model(written)
    capsys.readouterr()
    code = main(["optimize", str(training_model("mlp")), str(tmp_path / "x.onnx"), "--no-keep-io-types"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "training graph" in err
