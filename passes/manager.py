"""Pass infrastructure: one entry point per pass, a manager that runs a tuple of them.

A pass declares whether it mutates the graph. Analysis passes may only write the plan; with
``check_invariants`` the manager verifies that (the graph's fingerprint is unchanged) and, after
every mutating pass, that the graph is still a valid model: topologically sorted, passing
``onnx.checker`` (full check), every float tensor typed, no Cast(T->U)->Cast(U->T) round trips,
graph I/O dtypes unchanged unless asked. A failure names the pass and the passes before it.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from onnxcampo.context import GraphContext

log = logging.getLogger("onnxcampo.passes")


class InvariantError(RuntimeError):
    """A pass broke the graph: a bug in onnxcampo, not in the user's model."""


@dataclass(frozen=True)
class PassResult:
    name: str
    changed: bool
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class PassBase(abc.ABC):
    """One rule over the graph. Subclasses set ``name`` and implement :meth:`run`."""

    name: str = "pass"
    mutates: bool = False

    def requires(self, ctx: GraphContext) -> str | None:
        """Why the pass cannot run on this context, or None."""
        return None

    @abc.abstractmethod
    def run(self, ctx: GraphContext) -> PassResult: ...

    def __call__(self, ctx: GraphContext) -> PassResult:
        reason = self.requires(ctx)
        if reason:
            raise InvariantError(f"pass {self.name} cannot run: {reason}")
        start = time.perf_counter()
        result = self.run(ctx)
        if not isinstance(result, PassResult):
            raise InvariantError(f"pass {self.name} returned {type(result).__name__}, not PassResult")
        return PassResult(result.name, result.changed, result.counts, time.perf_counter() - start)


class PassManager:
    def __init__(self, passes: Sequence[PassBase], *, check_invariants: bool = False) -> None:
        self.passes = tuple(passes)
        self.check_invariants = check_invariants

    def run(self, ctx: GraphContext) -> list[PassResult]:
        results: list[PassResult] = []
        for index, pass_ in enumerate(self.passes):
            before = fingerprint(ctx) if self.check_invariants and not pass_.mutates else None
            result = pass_(ctx)
            results.append(result)
            counts = ", ".join(f"{k}={v}" for k, v in result.counts.items()) or "no change"
            log.info("%s: %s (%.2f s)", pass_.name, counts, result.seconds)
            if not self.check_invariants:
                continue
            history = " -> ".join(p.name for p in self.passes[: index + 1])
            if before is not None and fingerprint(ctx) != before:
                raise InvariantError(f"analysis pass {pass_.name} changed the graph (passes: {history})")
            if pass_.mutates:
                problems = check_graph(ctx)
                if problems:
                    raise InvariantError(
                        f"after pass {pass_.name} (passes: {history}): " + "; ".join(problems[:5])
                    )
        return results


def fingerprint(ctx: GraphContext) -> tuple:
    graph = ctx.graph
    return (
        tuple((n.name, n.op, tuple(t.name for t in n.inputs), tuple(t.name for t in n.outputs)) for n in graph.nodes),
        tuple(sorted(ctx.dtypes.items())),
    )


def check_graph(ctx: GraphContext) -> list[str]:
    """Invariant violations of the current graph (empty when it is sound)."""
    from onnxcampo.ir import check_model, export_model

    problems: list[str] = []
    graph = ctx.graph
    seen = {name for name, t in graph.tensors().items() if not t.inputs}  # inputs and constants
    for node in graph.nodes:
        for tensor in node.inputs:
            if tensor.name and tensor.name not in seen:
                problems.append(f"not topologically sorted: {node.name} reads {tensor.name} before it is made")
                break
        seen.update(t.name for t in node.outputs)
    for node in graph.nodes:
        for tensor in (*node.inputs, *node.outputs):
            entry = ctx.info.get(tensor.name)
            if entry is not None and entry.is_float and ctx.dtypes.get(tensor.name, 0) == 0:
                problems.append(f"tensor {tensor.name} has no dtype")
        if node.op == "Cast" and node.inputs and node.inputs[0].inputs:
            upstream = node.inputs[0].inputs[0]
            if upstream.op == "Cast" and upstream.inputs:
                source = ctx.dtypes.get(upstream.inputs[0].name)
                if source == int(node.attrs.get("to", 0)) and source in (TensorProto.FLOAT, TensorProto.FLOAT16):
                    problems.append(f"Cast round trip {upstream.name} -> {node.name}")
    if ctx.config.keep_io_types:
        original = {vi.name: vi.type.tensor_type.elem_type for vi in (*ctx.model.graph.input, *ctx.model.graph.output)}
        for tensor in (*graph.inputs, *graph.outputs):
            if tensor.name in original and ctx.dtypes.get(tensor.name) != original[tensor.name]:
                problems.append(f"graph I/O {tensor.name} changed dtype")
    if not problems:
        model = export_model(graph.copy(), ctx.model, ctx.dtypes, {})
        try:
            check_model(model, full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            problems.append(f"onnx.checker: {str(exc).splitlines()[0]}")
    return problems
