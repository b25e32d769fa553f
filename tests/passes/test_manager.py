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
    manager = PassManager([Noop()], check_invariants=True)
    assert manager.run(ctx()) == PassResult("pipeline", False, {})
    assert [r.name for r in manager.results] == ["noop"]


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


class CountDown(PassBase):
    """Fires (changes) while its counter is above zero: a rule that needs several rounds."""

    name = "count_down"

    def __init__(self, fires: int) -> None:
        self.left = fires

    def run(self, ctx):
        fired = self.left > 0
        self.left -= fired
        return PassResult(self.name, fired, {"fired": int(fired)})


class Boom(PassBase):
    name = "boom"

    def run(self, ctx):
        raise KeyError("no such tensor")


def test_the_manager_is_a_pass_that_runs_to_a_fixpoint_within_its_steps():
    once = PassManager([CountDown(3)]).run(ctx())
    assert (once.changed, once.counts) == (True, {"fired": 1})
    fixpoint = PassManager([CountDown(3)], steps=10, name="rules")
    result = fixpoint.run(ctx())
    # three rounds that fire and a fourth that finds nothing to do
    assert (result.name, result.changed, result.counts) == ("rules", True, {"fired": 3})
    assert [r.changed for r in fixpoint.results] == [True, True, True, False]
    bounded = PassManager([CountDown(5)], steps=2)
    assert bounded.run(ctx()).counts == {"fired": 2}


def test_managers_compose_and_an_inner_manager_reports_its_passes():
    inner = PassManager([CountDown(2)], steps=5, name="inner")
    outer = PassManager([Noop(), inner, Noop()], check_invariants=True, name="outer")
    result = outer.run(ctx())
    assert result.counts == {"fired": 2} and result.changed
    assert [r.name for r in outer.results] == ["noop", "count_down", "count_down", "count_down", "noop"]
    assert not outer.mutates and PassManager([BadMutation()]).mutates


def test_an_exception_in_a_pass_names_the_pass_and_the_passes_before_it():
    from onnxcampo.passes.manager import PassError

    inner = PassManager([Noop(), Boom()], name="inner")
    with pytest.raises(PassError, match=r"pass boom failed \(passes: noop -> boom\): KeyError") as caught:
        PassManager([Noop(), inner]).run(ctx())
    assert isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(ValueError, match="steps"):
        PassManager([Noop()], steps=0)


def test_a_users_error_raised_in_a_pass_stays_the_users_error():
    from onnxcampo.errors import UnsupportedModelError

    class Refuses(PassBase):
        name = "refuses"

        def run(self, ctx):
            raise UnsupportedModelError("model: an op this pass cannot plan")

    with pytest.raises(UnsupportedModelError, match="cannot plan"):
        PassManager([Refuses()]).run(ctx())


def test_a_manager_checks_another_operand_with_its_checker():
    # the finishing passes work on the written model file, not the context: their manager is
    # given what "sound" means for it
    class Breaks(PassBase):
        name = "breaks"
        mutates = True

        def run(self, operand):
            operand["broken"] = True
            return PassResult(self.name, True)

    def checker(operand):
        return ["broken on purpose"] if operand.get("broken") else []

    with pytest.raises(InvariantError, match=r"after pass breaks \(passes: breaks\): broken on purpose"):
        PassManager([Breaks()], check_invariants=True, checker=checker).run({})
    PassManager([Breaks()], checker=checker).run({})  # unchecked: runs


def test_the_finishing_passes_are_data():
    from onnxcampo.pipeline import FINISHING

    assert [p.name for p in FINISHING] == ["int8_avg", "loss_scaling", "channels_last", "fuse_reductions",
                                            "fuse_elementwise", "starting_weights", "annotate_nodes"]
    assert all(p.mutates for p in FINISHING)
