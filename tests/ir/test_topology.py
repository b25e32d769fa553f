"""The one topological sort (``onnxcampo.ir.topology``): both entry points, a graphsurgeon graph
and a model proto, follow its rule. Graphs are ONNX text, parsed without the checker (it
rejects unsorted graphs)."""

from __future__ import annotations

import itertools

import onnx
import pytest
from helpers import HEADER

from onnxcampo.errors import UnsupportedModelError
from onnxcampo.ir.export import to_graphsurgeon
from onnxcampo.ir.topology import toposort, toposort_model

CHAIN = """
g (float[4] x) => (float[4] y) {
  [a] a = Relu(x)
  [b] b = Neg(a)
  [c] c = Abs(x)
  [d] y = Add(b, c)
}
"""


def _model(text: str) -> onnx.ModelProto:
    return onnx.parser.parse_model(f"{HEADER}\n{text}")


def _reordered(text: str, names: list[str]) -> onnx.ModelProto:
    model = _model(text)
    by_name = {node.name: node for node in model.graph.node}
    nodes = [by_name[name] for name in names]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


def _order(model: onnx.ModelProto) -> list[str]:
    return [node.name for node in model.graph.node]


def _gs_order(model: onnx.ModelProto) -> list[str]:
    graph = to_graphsurgeon(model)
    toposort(graph)
    return [node.name for node in graph.nodes]


def test_a_sorted_graph_keeps_its_order():
    model = _model(CHAIN)
    assert toposort_model(model) is False
    assert _order(model) == ["a", "b", "c", "d"]
    assert _gs_order(_model(CHAIN)) == ["a", "b", "c", "d"]


def test_a_late_producer_moves_just_in_front_of_its_first_consumer():
    """Rules 1 and 2: ``a`` (read by ``b``) comes last; it moves in front of ``b``, the rest keep
    their order."""
    model = _reordered(CHAIN, ["c", "b", "d", "a"])
    assert toposort_model(model) is True
    assert _order(model) == ["c", "a", "b", "d"]
    onnx.checker.check_model(model)


@pytest.mark.parametrize("names", list(itertools.permutations("abcd")))
def test_both_entry_points_give_the_same_order(names):
    """One rule: the proto sort and the graphsurgeon sort agree on every order of the nodes."""
    expected = _gs_order(_reordered(CHAIN, list(names)))
    model = _reordered(CHAIN, list(names))
    toposort_model(model)
    assert _order(model) == expected
    onnx.checker.check_model(model)


IF_READS_OUTER = """
g (bool cond, float[4] x) => (float[4] y) {
  [make] hidden = Relu(x)
  [branch] y = If(cond) <
    then_branch = t () => (float[4] ty) { ty = Neg(hidden) },
    else_branch = e () => (float[4] ey) { ey = Abs(hidden) }
  >
}
"""


def test_what_a_subgraph_reads_from_the_enclosing_graph_counts_as_read():
    """Rule 3: the If reads ``hidden`` only inside its branches; put last, its producer moves in
    front again. (The graphsurgeon graph is reordered after import: graphsurgeon shares a tensor
    with a subgraph only when it has met the producer first.)"""
    model = _reordered(IF_READS_OUTER, ["branch", "make"])
    assert toposort_model(model) is True
    assert _order(model) == ["make", "branch"]
    graph = to_graphsurgeon(_model(IF_READS_OUTER))
    graph.nodes = graph.nodes[::-1]
    toposort(graph)
    assert [node.name for node in graph.nodes] == ["make", "branch"]


CYCLE = """
g (float[4] x) => (float[4] y) {
  [p] p = Add(x, q)
  [q] q = Relu(p)
  [out] y = Neg(q)
}
"""


@pytest.mark.parametrize("sort", ["proto", "graphsurgeon"])
def test_a_cycle_is_an_error_naming_a_node_on_it(sort):
    """Rule 4."""
    model = _model(CYCLE)
    with pytest.raises(UnsupportedModelError, match="cycle through node '[pq]'"):
        toposort_model(model) if sort == "proto" else _gs_order(model)
