"""The matcher the rewrites share: what a pattern reads of a model file, and how a rewrite
replaces what it matched.

A rewrite module writes each of its rules as

1. a *pattern*, a function ``match(view, node) -> Match | Miss`` anchored at one node: it walks
   producers and readers through a :class:`GraphView` and returns what it found, or a
   :class:`Miss` whose text says which condition failed (logged at debug level, so ``-v --debug``
   says why a subgraph was left alone);
2. a *rewrite*, the node(s) built from the match, handed to :meth:`GraphView.replace` with the
   nodes it removes;
3. a *prediction*, the rewrite's ``predict()``, that prices the model with and without it
   (:func:`onnxcampo.estimate.with_and_without`).

The view is built once per model and rewrite; it never changes the graph itself until
:meth:`GraphView.replace`. Tensor names that are graph inputs or outputs, or that subgraphs read,
are *protected*: a pattern never removes their producer or absorbs them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxcampo import ir, oplists

log = logging.getLogger(__name__)

FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)
VIEWS = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")  # the elements in their order


class Miss(str):
    """Why a pattern did not match at a node: a reason, falsy so that ``if not found`` reads."""

    def __bool__(self) -> bool:
        return False


class GraphView:
    """A model file seen by a pattern: producers, readers, constants, and the types and static
    shapes of ``info`` (:func:`onnxcampo.ir.infer_tensor_info`; ``empty``: whether a shape with a
    zero dim counts as static). ``edit`` is the :class:`onnxcampo.ir.ModelEdit` the rewrite
    replaces nodes through (``fresh_prefix`` names what it makes)."""

    def __init__(self, model: onnx.ModelProto, info: Mapping[str, ir.TensorInfo], *, fresh_prefix: str,
                 empty: bool = True) -> None:
        self.model, self.info, self._empty = model, info, empty
        self.edit = ir.ModelEdit(model, fresh_prefix=fresh_prefix)
        self.constants = self.edit.constants()
        self.producers = self.edit.producers()
        self.consumers = self.edit.consumers()
        self.protected = self.edit.interface()

    # --- tensors ------------------------------------------------------------------------------
    def static(self, name: str, dtypes: Collection[int] | None = None) -> tuple[int, ...] | None:
        """``name``'s shape when every dimension is a known number (a 0 only when the view counts
        an empty shape as static); with ``dtypes``, None too unless its type is one of them."""
        if dtypes is not None and self.dtype(name) not in dtypes:
            return None
        return ir.static_shape(self.info, name) if self._empty else ir.static_shape(self.info, name, empty=False)

    def dtype(self, name: str) -> int | None:
        return ir.tensor_dtype(self.info, name)

    def constant(self, name: str) -> np.ndarray | None:
        tensor = self.constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)

    def broadcast(self, name: str, shape: tuple[int, ...], keep: set[int]) -> bool:
        """Whether ``name`` is static, no longer than ``shape`` and, right-aligned, 1 on every
        axis outside ``keep`` and ``shape``'s size on those in it."""
        own = self.static(name)
        if own is None or len(own) > len(shape):
            return False
        padded = (1,) * (len(shape) - len(own)) + own
        return all(padded[k] == (shape[k] if k in keep else 1) for k in range(len(shape)))

    # --- nodes ---------------------------------------------------------------------------------
    @staticmethod
    def is_op(node: onnx.NodeProto | None, op: str) -> bool:
        """``node`` is the default domain's ``op``."""
        return node is not None and node.op_type == op and node.domain in oplists.DEFAULT_DOMAINS

    def readers(self, name: str) -> list[onnx.NodeProto]:
        return self.consumers.get(name, [])

    def sole_reader(self, name: str) -> onnx.NodeProto | None:
        """The one node reading ``name`` when it is read once and is not protected."""
        found = self.readers(name)
        return found[0] if len(found) == 1 and name not in self.protected else None

    def only(self, name: str, reader: onnx.NodeProto) -> bool:
        """``reader`` is the only reader of ``name``, which is not protected."""
        return name not in self.protected and self.readers(name) == [reader]

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        """The producer of ``name`` when it is the default domain's ``op`` and ``name`` is not
        protected."""
        node = self.producers.get(name)
        return node if self.is_op(node, op) and name not in self.protected else None

    @staticmethod
    def operands(node: onnx.NodeProto) -> tuple[str, str] | None:
        return (node.input[0], node.input[1]) if len(node.input) == 2 else None

    @staticmethod
    def other(node: onnx.NodeProto, name: str) -> str | None:
        """The input of a two-input node that is not ``name`` (None when both or neither are)."""
        if len(node.input) != 2 or (node.input[0] == name) == (node.input[1] == name):
            return None
        return node.input[1] if node.input[0] == name else node.input[0]

    def reduce_axes(self, node: onnx.NodeProto, rank: int) -> list[int] | None:
        """The normalized axes a ReduceSum/ReduceMean reduces (attribute before opset 13 / 18,
        input since), or None when they are not a known constant or empty."""
        return reduce_axes(node, self.constants, rank)

    def reduces(self, node: onnx.NodeProto | None, x: str, shape: tuple[int, ...], axes: set[int]) -> bool:
        """Whether the ReduceMean/ReduceSum ``node`` reduces ``x`` over ``axes``, keeping dims."""
        return (node is not None and node.input[0] == x and ir.attribute(node, "keepdims", 1) == 1
                and set(self.reduce_axes(node, len(shape)) or []) == axes)

    def source(self, name: str, count: int, *, casts: bool) -> str:
        """``name`` back through views (with ``casts`` also Casts between the float types) over
        ``count`` float elements, to the first tensor: what a fused op may read instead."""
        while True:
            node = self.producers.get(name)
            if node is None or node.domain not in oplists.DEFAULT_DOMAINS or not node.input:
                return name
            before = node.input[0]
            moves = node.op_type in VIEWS or (casts and node.op_type == "Cast" and self.dtype(before) in FLOATS)
            shape = self.static(before)
            if not moves or shape is None or math.prod(shape) != count or self.dtype(before) not in FLOATS:
                return name
            name = before

    def views_after(self, start: str) -> tuple[str, list[onnx.NodeProto]]:
        """``start`` through the chain of views its sole readers make: the last value, the views."""
        chain, value = [], start
        while True:
            nxt = self.sole_reader(value)
            if nxt is None or nxt.op_type not in VIEWS or nxt.domain not in oplists.DEFAULT_DOMAINS \
                    or nxt.input[0] != value or self.static(nxt.output[0]) is None:
                return value, chain
            chain.append(nxt)
            value = nxt.output[0]

    # --- the rewrite ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the producers, readers and constants again, after the rewrite changed the graph in
        place other than through :meth:`replace` (the protected names stay those of the start)."""
        self.constants = self.edit.constants()
        self.producers = self.edit.producers()
        self.consumers = self.edit.consumers()

    def feeders_left_unread(self, removed: set[int], reads: Iterable[str]) -> set[int]:
        """The views and Casts (ids) that only removed nodes read, transitively from the removed
        nodes' inputs: they go with them. ``reads``: what the new nodes read (kept)."""
        removed = set(removed)
        read_after: dict[str, int] = {}
        for node in self.model.graph.node:
            if id(node) not in removed:
                for name in node.input:
                    read_after[name] = read_after.get(name, 0) + 1
        for name in reads:
            read_after[name] = read_after.get(name, 0) + 1
        frontier = [i for node in self.model.graph.node if id(node) in removed for i in node.input]
        dead: set[int] = set()
        while frontier:
            name = frontier.pop()
            node = self.producers.get(name)
            if (node is None or id(node) in removed or node.domain not in oplists.DEFAULT_DOMAINS
                    or node.op_type not in (*VIEWS, "Cast") or read_after.get(name, 0) or name in self.protected
                    or any(o != name and (read_after.get(o, 0) or o in self.protected) for o in node.output)):
                continue
            if any(id(r) not in removed for r in self.readers(name)):
                continue
            removed.add(id(node))
            dead.add(id(node))
            frontier.extend(node.input)
        return dead

    def replace(self, made: Mapping[int, onnx.NodeProto], removed: set[int], outputs: Iterable[str],
                extra: Iterable[onnx.ValueInfoProto] = ()) -> None:
        """Put each new node of ``made`` in the place of the removed node whose id keys it, drop
        the ``removed`` nodes, and record the types and static shapes of the new ``outputs``
        (kept in ``info`` for the rewrites after this one) and the ``extra`` tensors the new
        nodes make (their types and shapes given)."""
        infos = [helper.make_tensor_value_info(name, self.dtype(name), list(self.static(name))) for name in outputs]
        infos += list(extra)
        self.edit.replace_nodes(dict(made), removed, infos)
        ir.record_value_infos(self.info, infos)


def reduce_axes(node: onnx.NodeProto, constants: Mapping[str, onnx.TensorProto], rank: int) -> list[int] | None:
    """The normalized axes a ReduceSum/ReduceMean reduces (attribute before opset 13 / 18, input
    since), or None when they are not a known constant or empty (all axes, or none with
    noop_with_empty_axes)."""
    if len(node.input) > 1 and node.input[1]:
        tensor = constants.get(node.input[1])
        if tensor is None:
            return None
        values = [int(a) for a in numpy_helper.to_array(tensor).reshape(-1)]
    else:
        values = [int(a) for a in ir.attribute(node, "axes", []) or []]
    if not values or any(not -rank <= a < rank for a in values):
        return None
    return sorted({a % rank for a in values})


def first_match(patterns, view: GraphView, node: onnx.NodeProto, rewrite: str):
    """The first of ``patterns`` (each ``pattern(view, node)``) that matches at ``node``, or None;
    each miss is logged at debug level with its reason."""
    misses = []
    for pattern in patterns:
        found = pattern(view, node)
        if not isinstance(found, Miss) and found is not None:
            return found
        if found is not None:
            misses.append(f"{pattern.__name__.strip('_')}: {found}")
    if misses and log.isEnabledFor(logging.DEBUG):
        log.debug("%s: %s not rewritten (%s)", rewrite, node.name or node.op_type, "; ".join(misses))
    return None


def match_all(view: GraphView, op: str, patterns, rewrite: str) -> list:
    """Every match of ``patterns`` anchored at the default domain's ``op`` nodes, in graph order,
    none overlapping: a match that takes a node an earlier match took is dropped. A match has
    ``removed``, the nodes it replaces."""
    matches, taken = [], set()
    for node in list(view.model.graph.node):
        if not view.is_op(node, op) or id(node) in taken:
            continue
        found = first_match(patterns, view, node, rewrite)
        if found is None or any(id(n) in taken for n in found.removed):
            continue
        taken.update(id(n) for n in found.removed)
        matches.append(found)
    return matches


__all__ = ["FLOATS", "GraphView", "Miss", "VIEWS", "first_match", "match_all", "reduce_axes"]
