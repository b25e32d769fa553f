"""The graph-factors subcommand (benchmarks/graph_factors.py): per-class factors of single-op times inside whole graphs."""

from __future__ import annotations

from onnxcampo.benchmarks import graph_factors
import pytest


def sample(conv, product, other, k=(2.0, 1.0, 0.5)):
    predicted = {"conv": conv, "product": product, "other": other}
    return {"predicted": predicted, "gpu_us": sum(f * predicted[c] for f, c in zip(k, graph_factors.CLASSES))}


def test_the_fit_recovers_per_class_factors():
    factors = graph_factors.fit([sample(100, 0, 50), sample(0, 200, 100), sample(50, 50, 300)])
    assert list(factors) == pytest.approx([2.0, 1.0, 0.5])


def test_a_class_no_model_has_keeps_factor_one():
    factors = graph_factors.fit([sample(0, 100, 50), sample(0, 30, 200)])
    assert factors[0] == 1.0 and list(factors[1:]) == pytest.approx([1.0, 0.5])
