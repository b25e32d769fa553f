"""Graph order and scope: the one topological sort of onnxcampo, and what subgraphs read.

:func:`toposort` (an onnx-graphsurgeon graph, after a mutating pass) and :func:`toposort_model`
(the nodes of a model proto: ORT's fused graphs, loss scaling) order nodes by one rule
(:func:`_stable_order`):

1. a node keeps its place unless a node it reads from comes later;
2. such a producer is moved up just in front of its first consumer (so a sorted graph stays as it
   is, and a node added at the end moves up to where it is needed);
3. what an If/Loop/Scan body reads from the enclosing graph counts as read by the node that holds
   the body;
4. a cycle raises :class:`~onnxcampo.errors.UnsupportedModelError` naming a node on it.

It takes linear time (graphsurgeon's own sort recomputes hierarchy levels and takes seconds on
20k nodes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

import onnx
import onnx_graphsurgeon as gs

from onnxcampo.errors import UnsupportedModelError

CONTROL_FLOW_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)

Node = TypeVar("Node")


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in CONTROL_FLOW_ATTRS for attr in node.attribute)


def outer_scope_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the enclosing scope (implicit inputs)."""
    return set(_outer_scope_reads(node))


def _outer_scope_reads(node: onnx.NodeProto) -> list[str]:
    """:func:`outer_scope_names` in the order the subgraphs first read them (the sort's order
    must not depend on string hashing)."""
    names: dict[str, None] = {}

    def visit(graph: onnx.GraphProto, bound: set[str]) -> None:
        local = set(bound)
        local.update(i.name for i in graph.input)
        local.update(t.name for t in graph.initializer)
        for inner in graph.node:
            for name in inner.input:
                if name and name not in local:
                    names.setdefault(name)
            for attr in inner.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    visit(attr.g, local)
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for sub in attr.graphs:
                        visit(sub, local)
            local.update(inner.output)

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            visit(attr.g, set())
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                visit(sub, set())
    return list(names)


def subgraph_node_names(node: onnx.NodeProto) -> list[str]:
    """``parent/child`` names of every node inside a node's subgraphs (for the plan)."""
    found = []

    def visit(graph: onnx.GraphProto, prefix: str) -> None:
        for index, inner in enumerate(graph.node):
            name = f"{prefix}/{inner.name or inner.op_type + '_' + str(index)}"
            found.append(name)
            for attr in inner.attribute:
                subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                for sub in subs:
                    visit(sub, name)

    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            visit(sub, f"{node.name}:{attr.name}")
    return found


def graph_key(graph: onnx.GraphProto) -> bytes:
    """The graph's bytes without the nodes' doc_strings (subgraphs included): two graphs with one
    key compute the same (onnxcampo writes its reasons into doc_strings; ``tune`` times a
    candidate only when its key is new)."""
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)

    def strip(g: onnx.GraphProto) -> None:
        for node in g.node:
            node.doc_string = ""
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    strip(attr.g)
                for body in attr.graphs:
                    strip(body)
    strip(copy)
    return copy.SerializeToString(deterministic=True)


def toposort(graph: gs.Graph) -> None:
    """Put ``graph.nodes`` in topological order (the module's rule), in place."""
    graph.nodes = _stable_order(
        graph.nodes,
        reads=lambda node: [id(t) for t in (*node.inputs, *_implicit_inputs(node))],
        writes=lambda node: [id(t) for t in node.outputs],
        name=lambda node: node.name,
    )


def toposort_model(model: onnx.ModelProto) -> bool:
    """Put the top-level nodes of ``model`` in topological order (the module's rule), in place;
    True if they were not in order."""
    graph = model.graph
    nodes = list(graph.node)
    order = _stable_order(
        nodes,
        reads=lambda node: [name for name in (*node.input, *_outer_scope_reads(node)) if name],
        writes=lambda node: [name for name in node.output if name],
        name=lambda node: node.name or node.op_type,
    )
    if all(a is b for a, b in zip(order, nodes)):
        return False
    del graph.node[:]
    graph.node.extend(order)
    return True


def _stable_order(
    nodes: Sequence[Node],
    *,
    reads: Callable[[Node], Iterable[Hashable]],
    writes: Callable[[Node], Iterable[Hashable]],
    name: Callable[[Node], str],
) -> list[Node]:
    """``nodes`` in topological order: a depth-first walk from each node, in the given order,
    through the producers of what it reads (the first input's first), placing a node once its
    producers are placed."""
    producer = {key: node for node in nodes for key in writes(node)}
    placed: set[int] = set()
    walking: set[int] = set()  # expanded, not yet placed: a producer of a node above it
    order: list[Node] = []
    for start in nodes:
        if id(start) in placed:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in placed:
                continue
            if expanded:
                walking.discard(id(node))
                placed.add(id(node))
                order.append(node)
                continue
            if id(node) in walking:
                raise UnsupportedModelError(f"the graph has a cycle through node {name(node)!r}")
            walking.add(id(node))
            stack.append((node, True))
            for key in reversed(list(reads(node))):
                source = producer.get(key)
                if source is not None and id(source) not in placed:
                    stack.append((source, False))
    return order


def _implicit_inputs(node: gs.Node) -> list[gs.Tensor]:
    """Tensors an If/Loop/Scan body reads from the enclosing graph (graphsurgeon shares the
    tensor objects across scopes)."""
    found: list[gs.Tensor] = []
    for value in node.attrs.values():
        for body in (value if isinstance(value, list) else [value]):
            if isinstance(body, gs.Graph):
                inner = {id(t) for n in body.nodes for t in n.outputs} | {id(t) for t in body.inputs}
                for inner_node in body.nodes:
                    found.extend(t for t in (*inner_node.inputs, *_implicit_inputs(inner_node)) if id(t) not in inner)
    return found
