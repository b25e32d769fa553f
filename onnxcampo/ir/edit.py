"""The model file's graph as the proto-level rewrites read and edit it.

The precision passes edit an onnx-graphsurgeon graph (:mod:`onnxcampo.ir.export`); the rewrites
that work on a model file itself (onnx-ad's backward graph simplified, the experimental ``int8_avg``, the
transformer-pattern checks before ORT's fusions) read it through :class:`ModelEdit`: who produces
and who reads each tensor, the graph's constants, attributes by name, fresh names, readers
redirected. Tables are computed when asked, from the graph as it is then: a rewrite that changed
the graph asks again.
"""

from __future__ import annotations

from collections import defaultdict

import onnx
from onnx import helper

from onnxcampo.ir.topology import has_subgraph, iter_graphs, outer_scope_names
from onnxcampo.oplists import DEFAULT_DOMAINS


# metadata of a training step naming its prediction (the forward output the loss reads), which
# Trainer.evaluate prunes the step to: a tensor every rewrite keeps, as it keeps graph outputs
PREDICTION_KEY = "onnxcampo.prediction"
# metadata of a step whose prediction is the first `columns` columns of a wider tensor that a
# fusion left unread (JSON {"input": name, "columns": C}): evaluation slices it back
PREDICTION_SLICE_KEY = "onnxcampo.prediction_slice"


def attribute(node: onnx.NodeProto, name: str, default=None):
    """The value of ``node``'s attribute ``name`` (``default`` when it has none)."""
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


class ModelEdit:
    """One model's main graph (or a graph given alone), edited in place."""

    def __init__(self, model: onnx.ModelProto | onnx.GraphProto, *, fresh_prefix: str = "onnxcampo") -> None:
        self.model = model if isinstance(model, onnx.ModelProto) else None
        self.graph: onnx.GraphProto = model.graph if isinstance(model, onnx.ModelProto) else model
        self._prefix = fresh_prefix
        self._taken: set[str] | None = None
        self._fresh = 0

    @property
    def nodes(self):
        return self.graph.node

    def producers(self) -> dict[str, onnx.NodeProto]:
        """Tensor name -> the node that writes it."""
        return {out: node for node in self.nodes for out in node.output if out}

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        """Tensor name -> the nodes reading it (a node once per input slot that reads it)."""
        table: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.nodes:
            for name in node.input:
                if name:
                    table[name].append(node)
        return table

    def constants(self) -> dict[str, onnx.TensorProto]:
        """Initializers and the tensors of default-domain ``Constant`` nodes given by ``value``."""
        found = {t.name: t for t in self.graph.initializer}
        for node in self.nodes:
            if node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS:
                value = attribute(node, "value")
                if isinstance(value, onnx.TensorProto):
                    found[node.output[0]] = value
        return found

    def interface(self) -> set[str]:
        """Names a rewrite must keep: graph inputs and outputs, a training step's prediction
        (:data:`PREDICTION_KEY`), and what If/Loop/Scan bodies read from this graph (no reader
        there is seen by a rule on the main graph)."""
        names = {o.name for o in self.graph.output} | {i.name for i in self.graph.input}
        if self.model is not None:
            names |= {p.value for p in self.model.metadata_props if p.key == PREDICTION_KEY}
        for node in self.nodes:
            if has_subgraph(node):
                names |= outer_scope_names(node)
        return names

    def fresh(self, stem: str) -> str:
        """A name no tensor, initializer or node of the graph has, nor any earlier fresh name."""
        if self._taken is None:
            graph = self.graph
            self._taken = ({t.name for t in graph.initializer} | {i.name for i in graph.input}
                           | {o for n in graph.node for o in (*n.output, n.name)})
        while True:
            self._fresh += 1
            name = f"{self._prefix}/{stem}_{self._fresh}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def replace_nodes(self, made: dict[int, onnx.NodeProto | list[onnx.NodeProto]], removed: set[int],
                      outputs: list[onnx.ValueInfoProto]) -> None:
        """The rewrite of a fusion pass, applied: every node whose id is in ``made`` replaced by
        ``made[id]`` (a node or a list of nodes, in its place), the others whose id is in ``removed`` dropped; then the
        initializers and Constant nodes only the removed nodes read, the value_info of their
        outputs, and ``outputs`` (the new nodes' types and shapes, which later passes and ORT read)
        written as value_info unless they are graph outputs."""
        gone = [node for node in self.nodes if id(node) in removed or id(node) in made]
        kept = []
        for node in self.nodes:
            if id(node) in made:
                new = made[id(node)]
                kept.extend(new if isinstance(new, list) else [new])
            elif id(node) not in removed:
                kept.append(node)
        del self.graph.node[:]
        self.graph.node.extend(kept)
        self.drop_unread({name for node in gone for name in node.input if name})
        written = {v.name for v in outputs}
        dead = {name for node in gone for name in node.output} | written
        declared = {o.name for o in self.graph.output}
        kept_info = [v for v in self.graph.value_info if v.name not in dead]
        del self.graph.value_info[:]
        self.graph.value_info.extend(kept_info + [v for v in outputs if v.name not in declared])

    def drop_unread(self, names: set[str]) -> None:
        """Initializers and Constant nodes among ``names`` that nothing reads any more (what
        subgraphs read from this graph counts)."""
        graph = self.graph
        read = {i for n in graph.node for i in n.input if i} | {o.name for o in graph.output}
        for node in graph.node:
            if has_subgraph(node):
                read |= outer_scope_names(node)
        unread = names - read
        if not unread:
            return
        initializers = [t for t in graph.initializer if t.name not in unread]
        if len(initializers) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(initializers)
        nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output and n.output[0] in unread)]
        if len(nodes) != len(graph.node):
            del graph.node[:]
            graph.node.extend(nodes)

    def drop_dead(self) -> None:
        """Nodes none of whose outputs a node, a subgraph or the graph's outputs read (to a fixed
        point), then the initializers no node reads (graph inputs kept)."""
        graph = self.graph
        kept_names = {o.name for o in graph.output} | {i.name for i in graph.input}
        while True:
            read = {i for n in graph.node for i in n.input if i} | kept_names
            for node in graph.node:
                if has_subgraph(node):
                    read |= outer_scope_names(node)
            alive = [n for n in graph.node if any(o in read for o in n.output if o)]
            if len(alive) == len(graph.node):
                break
            del graph.node[:]
            graph.node.extend(alive)
        initializers = [t for t in graph.initializer if t.name in read]
        if len(initializers) != len(graph.initializer):
            del graph.initializer[:]
            graph.initializer.extend(initializers)

    def replace_uses(self, old: str, new: str) -> None:
        """Every reader of ``old`` in the main graph reads ``new`` instead."""
        for node in self.nodes:
            for i, name in enumerate(node.input):
                if name == old:
                    node.input[i] = new


def rename_tensors(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Every tensor of ``mapping`` renamed wherever it appears in ``graph`` and its subgraphs:
    initializers (sparse ones too), inputs, outputs, value infos, node inputs and outputs."""
    for g in iter_graphs(graph):
        for tensor in g.initializer:
            tensor.name = mapping.get(tensor.name, tensor.name)
        for sparse in g.sparse_initializer:
            sparse.values.name = mapping.get(sparse.values.name, sparse.values.name)
        for value_info in (*g.input, *g.output, *g.value_info):
            value_info.name = mapping.get(value_info.name, value_info.name)
        for node in g.node:
            node.input[:] = [mapping.get(name, name) for name in node.input]
            node.output[:] = [mapping.get(name, name) for name in node.output]


__all__ = ["PREDICTION_KEY", "PREDICTION_SLICE_KEY", "ModelEdit", "attribute", "rename_tensors"]
