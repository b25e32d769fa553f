"""The plan's reasons: what the report counts and the summary prints."""

from __future__ import annotations

import re

from helpers import W_INIT, parse

import onnxcampo
from onnxcampo.plan import Reason


def test_reasons_name_their_rule_not_a_pass_number():
    """A reason says which rule decided ("allow by cost: ...", "deny list"); pass numbers change
    when the pipeline does, so none is named."""
    numbered = [r.name for r in Reason if re.search(r"\bpass \d", r.value)]
    assert numbered == []


def test_report_counts_reasons_by_their_texts():
    """Exp -> Add -> MatMul under the amp policy: the report's
    ``reasons`` are keyed "<precision>: <reason text>"."""
    text = f"""
    g (float[8,8] x) => (float[8,8] y) <{W_INIT}> {{
      [exp] e = Exp(x)
      [add] a = Add(e, x)
      [mm] y = MatMul(a, w)
    }}
    """
    reasons = onnxcampo.optimize(parse(text), policy="amp").report["reasons"]
    assert reasons == {"fp32: deny list": 1, f"fp32: {Reason.DENY_TOWARD_INFER.value}": 1,
                       "fp16: allow list (greedy)": 1}
