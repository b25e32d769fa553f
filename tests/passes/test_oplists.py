"""The op lists are data: no op in two lists, and passes ask ``category_of`` instead of naming ops."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import onnxcampo.passes as passes_package
from onnxcampo import oplists
from onnxcampo.oplists import Category, category_of

PASSES_DIR = Path(passes_package.__file__).resolve().parent
ALL_LISTED = oplists.ALLOW | oplists.DENY | oplists.INFER | oplists.CLEAR | oplists.NEUTRAL | oplists.QUANTIZE_OPS

# Mutating passes must name the ops they create (and recognise those they created); nothing
# else in passes/ may name a listed op.
MAY_NAME = {
    "insert_casts.py": {"Cast"},
    "pad_tensor_cores.py": {"Pad", "Slice"},
    "manager.py": {"Cast"},  # the Cast round-trip invariant
}


def test_lists_do_not_overlap():
    assert oplists.overlaps() == {}


def test_lists_are_not_empty_and_hold_the_usual_suspects():
    assert {"MatMul", "Gemm", "Conv"} <= oplists.ALLOW
    assert {"Exp", "Pow", "ReduceSum", "Log", "LogSoftmax"} <= oplists.DENY
    assert {"Softmax", "ReduceMean"} <= oplists.INFER  # fp32-accumulating ORT kernels
    assert {"Add", "Mul", "Sigmoid", "Tanh", "LayerNormalization"} <= oplists.INFER
    assert {"Reshape", "Transpose", "Concat", "Relu"} <= oplists.CLEAR
    assert {"Shape", "Cast"} <= oplists.NEUTRAL
    assert {"QuantizeLinear", "DequantizeLinear"} <= oplists.QUANTIZE_OPS


@pytest.mark.parametrize("op, domain, expected", [
    ("MatMul", "", Category.ALLOW),
    ("MatMul", "ai.onnx", Category.ALLOW),
    ("FusedMatMul", "com.microsoft", Category.ALLOW),
    ("LogSoftmax", "", Category.DENY),
    ("Add", "", Category.INFER),
    ("SkipLayerNormalization", "com.microsoft", Category.INFER),
    ("Transpose", "", Category.CLEAR),
    ("Shape", "", Category.NEUTRAL),
    ("DequantizeLinear", "", Category.QUANTIZED),
    ("Hardmax", "", Category.UNKNOWN),
    ("MatMul", "com.example", Category.UNKNOWN),  # custom domain: whatever the op's name
])
def test_category_of(op, domain, expected):
    assert category_of(op, domain) is expected


def test_ort_default_domain_ops_are_not_onnx_ops():
    """They are checked as foreign ops only because ONNX has no schema for them; an op ONNX
    defines must never be exempted from the checker."""
    import onnx.defs

    assert "MaxPoolGrad" in oplists.ORT_DEFAULT_DOMAIN_OPS
    assert not any(onnx.defs.has(op) for op in oplists.ORT_DEFAULT_DOMAIN_OPS)


@pytest.mark.parametrize("op, domain, in_place, declared_shape", [
    ("InPlaceAccumulatorV2", "com.microsoft", True, False),
    ("AdamWOptimizer", "com.microsoft", True, False),
    ("InPlaceAccumulatorV2", "com.example", False, False),  # someone else's op of that name
    ("MaxPoolGrad", "", False, True),
    ("ReluGrad", "com.microsoft", False, False),
])
def test_fp32_under_every_policy(op, domain, in_place, declared_shape):
    assert oplists.updates_state_in_place(op, domain) is in_place
    assert oplists.needs_declared_output_shape(op, domain) is declared_shape


def test_fixed_type_params_name_listed_ops():
    assert set(oplists.FIXED_TYPE_PARAMS) <= ALL_LISTED


def _op_literals(path: Path) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ALL_LISTED:
            found.setdefault(node.value, []).append(node.lineno)
    return found


def test_passes_do_not_name_listed_ops():
    """Heuristic: no string literal in passes/ equals a listed op name, except the ops a
    mutating pass creates. Analysis passes decide by ``category_of`` alone."""
    sources = sorted(PASSES_DIR.glob("*.py"))
    assert {p.name for p in sources} >= {"classify.py", "allow_by_cost.py", "insert_casts.py"}
    offending = {}
    for path in sources:
        extra = {op: lines for op, lines in _op_literals(path).items() if op not in MAY_NAME.get(path.name, set())}
        if extra:
            offending[path.name] = extra
    assert offending == {}


def test_im2col_is_the_one_clear_op_of_onnxcampos_domain():
    """ai.onnxcampo::Im2Col only moves values (its output has its input's type): clear, so the
    precision passes may run it fp16 with its Gemm; the domain's other ops keep their types, and
    an Im2Col of another domain is unknown."""
    from onnxcampo.oplists import ONNXCAMPO_DOMAIN, category_of

    assert category_of("Im2Col", ONNXCAMPO_DOMAIN) is Category.CLEAR
    for op in ("UnscaleCheckFinite", "MultiTensorSGD", "MultiTensorAdamW", "AvgMatMulInteger", "FusedElementwise"):
        assert category_of(op, ONNXCAMPO_DOMAIN) is Category.UNKNOWN
    assert category_of("Im2Col", "") is Category.UNKNOWN and category_of("Im2Col", "com.example") is Category.UNKNOWN
