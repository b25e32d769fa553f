"""Pass infrastructure: one entry point per pass, a manager (itself a pass) that runs a tuple of them.

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
    """One rule over the graph. Subclasses set ``name`` and implement :meth:`run`.

    The precision passes' operand is an :class:`onnxcampo.context.Planning`: the context's tables
    (``ctx.categories``, ``ctx.features``, ...) read through it, and ``ctx.plan``, the plan being
    made (``ctx.padding``: whether it is costed with Tensor Core padding)."""

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


class PassError(InvariantError):
    """A pass raised: re-raised naming the pass and the passes before it (the cause chained)."""


class PassManager(PassBase):
    """Runs ``passes`` in order; a pass itself, so managers compose.

    ``steps``: rounds over the sequence, stopping after a round in which no pass changed anything
    (``steps=1``: once; a large ``steps``: to a fixpoint). ``run`` returns the combined
    :class:`PassResult` (counts summed); :attr:`results` holds every pass's result of the last
    run, nested managers' passes included. An exception inside a pass is re-raised as
    :class:`PassError` naming the pass and the passes before it. With ``check_invariants``
    analysis passes must leave the graph's fingerprint unchanged (the operand a
    :class:`GraphContext`) and every mutating pass must leave a sound graph: ``checker(operand)``
    returns the problems, :func:`check_graph` by default.
    """

    def __init__(self, passes: Sequence[PassBase], *, check_invariants: bool = False, steps: int = 1,
                 name: str = "pipeline", log_level: int = logging.INFO, checker=None) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.passes = tuple(passes)
        self.check_invariants = check_invariants
        self.checker = checker or check_graph  # what "a sound graph" means for this operand
        self.steps = steps
        self.name = name
        self.log_level = log_level
        self.mutates = any(p.mutates for p in self.passes)
        self.results: list[PassResult] = []

    def run(self, ctx) -> PassResult:
        self.results = []
        history: list[str] = []
        changed, counts = False, {}
        for _ in range(self.steps):
            changed_now = False
            for pass_ in self.passes:
                history.append(pass_.name)
                result = self._run_one(pass_, ctx, history)
                changed_now |= result.changed
                for key, value in result.counts.items():
                    counts[key] = counts.get(key, 0) + value
            changed |= changed_now
            if not changed_now:
                break
        return PassResult(self.name, changed, counts)

    def _run_one(self, pass_: PassBase, ctx, history: list[str]) -> PassResult:
        before = fingerprint(ctx) if self.check_invariants and not pass_.mutates else None
        try:
            result = pass_(ctx)
        except PassError:
            raise  # an inner manager named it already
        except Exception as exc:
            from onnxcampo.errors import CampoError

            if isinstance(exc, CampoError):
                raise  # the user's problem, worded for the user
            raise PassError(f"pass {pass_.name} failed (passes: {' -> '.join(history)}): "
                            f"{type(exc).__name__}: {exc}") from exc
        if isinstance(pass_, PassManager):
            self.results.extend(pass_.results)
        else:
            self.results.append(result)
            counts = ", ".join(f"{k}={v}" for k, v in result.counts.items()) or "no change"
            log.log(self.log_level, "%s: %s (%.2f s)", pass_.name, counts, result.seconds)
        if self.check_invariants:
            trail = " -> ".join(history)
            if before is not None and fingerprint(ctx) != before:
                raise InvariantError(f"analysis pass {pass_.name} changed the graph (passes: {trail})")
            if pass_.mutates:
                problems = self.checker(ctx)
                if problems:
                    raise InvariantError(f"after pass {pass_.name} (passes: {trail}): " + "; ".join(problems[:5]))
        return result


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
