"""Learning-rate schedules (onnxcampo.training.schedules) and their --lr-schedule syntax."""

from __future__ import annotations

import math

import pytest

from onnxcampo.errors import ConfigError
from onnxcampo.training.schedules import constant, cosine, linear_warmup, parse_schedule, step_decay


def values(schedule, n):
    return [schedule(step) for step in range(n)]


def test_constant_and_step_decay():
    assert values(constant(0.1), 3) == [0.1, 0.1, 0.1]
    assert values(step_decay(1.0, 2, 0.5), 6) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25]


def test_cosine():
    schedule = cosine(1.0, 4, min_lr=0.2)
    assert schedule(0) == 1.0
    assert schedule(2) == pytest.approx(0.6)
    assert schedule(1) == pytest.approx(0.2 + 0.8 * (1 + math.cos(math.pi / 4)) / 2)
    assert schedule(4) == schedule(100) == 0.2
    assert cosine(0.5, 10)(10) == 0.0


def test_linear_warmup():
    assert values(linear_warmup(4, 0.8), 6) == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    then = cosine(1.0, 4)
    schedule = linear_warmup(2, then)
    assert values(schedule, 3) == pytest.approx([0.5, 1.0, 1.0])
    assert schedule(4) == pytest.approx(then(2))


@pytest.mark.parametrize("spec, expected", [
    ("constant", [0.1, 0.1, 0.1, 0.1]),
    ("step:2:0.5", [0.1, 0.1, 0.05, 0.05]),
    ("cosine:2", [0.1, 0.05, 0.0, 0.0]),
    ("cosine:2:0.02", [0.1, 0.06, 0.02, 0.02]),
    ("warmup:2", [0.05, 0.1, 0.1, 0.1]),
    ("warmup:2,cosine:2", [0.05, 0.1, 0.1, 0.05]),
    ("warmup:1,step:1:0.1", [0.1, 0.1, 0.01, 0.001]),
])
def test_parse_schedule(spec, expected):
    assert values(parse_schedule(spec, 0.1), 4) == pytest.approx(expected)


@pytest.mark.parametrize("spec, message", [
    ("linear", "unknown schedule 'linear'"),
    ("step:2", "step takes 2 numbers"),
    ("cosine", "cosine takes 1 or 2 numbers"),
    ("cosine:ten", "the total steps must be an integer, not 'ten'"),
    ("step:0:0.5", "the step size must be positive"),
    ("warmup:x", "the warmup steps must be an integer"),
    ("warmup:2,warmup:3", "one warmup at most"),
    ("constant:1", "constant takes 0 numbers"),
])
def test_bad_schedules_give_one_line(spec, message):
    """One line naming the text as the caller gave it: the schedule from Python, the flag under the
    command line."""
    from onnxcampo.errors import command_line

    with pytest.raises(ConfigError, match=message) as error:
        parse_schedule(spec, 0.1)
    assert "\n" not in str(error.value) and str(error.value).startswith(f"schedule {spec!r}")
    with command_line(), pytest.raises(ConfigError, match=message) as error:
        parse_schedule(spec, 0.1)
    assert str(error.value).startswith(f"--lr-schedule {spec!r}")
