"""Graph order and scope: the topological sort after a mutating pass, and what subgraphs read."""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

CONTROL_FLOW_ATTRS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(attr.type in CONTROL_FLOW_ATTRS for attr in node.attribute)


def outer_scope_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the enclosing scope (implicit inputs)."""
    names: set[str] = set()

    def visit(graph: onnx.GraphProto, bound: set[str]) -> None:
        local = set(bound)
        local.update(i.name for i in graph.input)
        local.update(t.name for t in graph.initializer)
        for inner in graph.node:
            for name in inner.input:
                if name and name not in local:
                    names.add(name)
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
    return names


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


def toposort(graph: gs.Graph) -> None:
    """Stable topological order: nodes keep their current order unless a producer comes later,
    in which case it is moved up just in front of its first consumer. Linear time (graphsurgeon's
    own sort recomputes hierarchy levels and takes seconds on 20k nodes)."""
    producer = {id(t): n for n in graph.nodes for t in n.outputs}
    placed: set[int] = set()
    order: list[gs.Node] = []
    for start in graph.nodes:
        if id(start) in placed:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if id(node) in placed:
                continue
            if expanded:
                placed.add(id(node))
                order.append(node)
                continue
            stack.append((node, True))
            for tensor in reversed([*node.inputs, *_implicit_inputs(node)]):
                source = producer.get(id(tensor))
                if source is not None and id(source) not in placed:
                    stack.append((source, False))
    graph.nodes = order


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
