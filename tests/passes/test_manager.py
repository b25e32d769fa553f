"""``PassManager`` invariants: analysis passes may only write the plan; mutating passes must
leave a sound graph; failures name the pass and the passes before it."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest
from helpers import FakeCost, build_context, parse

from onnxcampo.passes.manager import InvariantError, PassBase, PassManager, PassResult, check_graph

MODEL = """
g (float[4,8] x) => (float[4,8] y) {
  [relu] r = Relu(x)
  [sig] y = Sigmoid(r)
}
"""


class Noop(PassBase):
    name = "noop"

    def run(self, ctx):
        return PassResult(self.name, False, {})


class SneakyAnalysis(PassBase):
    """An analysis pass that renames a node: not allowed."""

    name = "sneaky"

    def run(self, ctx):
        ctx.graph.nodes[0].name = "renamed"
        return PassResult(self.name, False)


class BadMutation(PassBase):
    """A mutating pass that makes the graph unsorted (Sigmoid before its producer)."""

    name = "bad_mutation"
    mutates = True

    def run(self, ctx):
        ctx.graph.nodes.reverse()
        return PassResult(self.name, True)


class RoundTrip(PassBase):
    """A mutating pass adding Cast(fp32 -> fp16) -> Cast(fp16 -> fp32) before the Sigmoid."""

    name = "round_trip"
    mutates = True

    def run(self, ctx):
        import numpy as np
        from onnx import TensorProto

        relu, sig = ctx.graph.nodes
        half = gs.Variable("half", dtype=np.float16)
        back = gs.Variable("back", dtype=np.float32)
        ctx.graph.nodes.insert(1, gs.Node("Cast", "c1", attrs={"to": TensorProto.FLOAT16}, inputs=[relu.outputs[0]], outputs=[half]))
        ctx.graph.nodes.insert(2, gs.Node("Cast", "c2", attrs={"to": TensorProto.FLOAT}, inputs=[half], outputs=[back]))
        sig.inputs[0] = back
        ctx.dtypes.update(half=TensorProto.FLOAT16, back=TensorProto.FLOAT)
        return PassResult(self.name, True)


class NotAResult(PassBase):
    name = "not_a_result"

    def run(self, ctx):
        return {"changed": False}


class NeedsSomething(PassBase):
    name = "needs_something"

    def requires(self, ctx):
        return "it needs something"

    def run(self, ctx):  # pragma: no cover - never reached
        raise AssertionError


def ctx():
    return build_context(parse(MODEL), cost=FakeCost())


def test_sound_graph_has_no_problems():
    assert check_graph(ctx()) == []
    assert [r.name for r in PassManager([Noop()], check_invariants=True).run(ctx())] == ["noop"]


def test_analysis_pass_changing_the_graph_is_caught():
    with pytest.raises(InvariantError, match=r"analysis pass sneaky changed the graph \(passes: noop -> sneaky\)"):
        PassManager([Noop(), SneakyAnalysis()], check_invariants=True).run(ctx())


def test_unsorted_graph_after_mutation_is_caught():
    with pytest.raises(InvariantError, match="after pass bad_mutation.*not topologically sorted"):
        PassManager([BadMutation()], check_invariants=True).run(ctx())


def test_cast_round_trip_is_caught():
    with pytest.raises(InvariantError, match="Cast round trip c1 -> c2"):
        PassManager([RoundTrip()], check_invariants=True).run(ctx())


def test_without_checks_nothing_is_verified():
    PassManager([SneakyAnalysis()], check_invariants=False).run(ctx())


def test_pass_must_return_a_result_and_may_refuse_to_run():
    with pytest.raises(InvariantError, match="returned dict"):
        PassManager([NotAResult()]).run(ctx())
    with pytest.raises(InvariantError, match="needs_something cannot run: it needs something"):
        PassManager([NeedsSomething()]).run(ctx())
