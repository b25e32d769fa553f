"""Learning-rate schedules: callables ``schedule(step) -> lr``, ``step`` counting from 0.

``lr`` is an input of the step graph, so a schedule needs no new graph: set
``trainer.lr = schedule(trainer.steps)`` before each ``trainer.step(batch)``. ``trainer.steps``
is restored by ``load_checkpoint``, so a resumed run continues the schedule where it stopped.

* :func:`constant` ``(lr)``: ``lr``;
* :func:`step_decay` ``(lr, step_size, gamma)``: ``lr * gamma ** (step // step_size)`` (PyTorch StepLR);
* :func:`cosine` ``(lr, total_steps, min_lr=0)``: from ``lr`` down to ``min_lr`` at ``total_steps``
  along half a cosine, ``min_lr`` after (PyTorch CosineAnnealingLR for one half period);
* :func:`linear_warmup` ``(warmup_steps, then)``: ``then(0) * (step + 1) / warmup_steps`` for the
  first ``warmup_steps`` steps, then ``then(step - warmup_steps)`` (the following schedule counts
  its steps from the end of the warmup); ``then`` a schedule or a number.

:func:`parse_schedule` reads the command line's ``--lr-schedule`` text.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from onnxcampo.errors import ConfigError, on_command_line

Schedule = Callable[[int], float]

SYNTAX = "constant | step:STEP_SIZE:GAMMA | cosine:TOTAL_STEPS[:MIN_LR] | warmup:STEPS[,SCHEDULE]"


def constant(lr: float) -> Schedule:
    lr = float(lr)
    return lambda step: lr


def step_decay(lr: float, step_size: int, gamma: float) -> Schedule:
    if step_size <= 0:
        raise ConfigError(f"step schedule: the step size must be positive, not {step_size}")
    lr, gamma = float(lr), float(gamma)
    return lambda step: lr * gamma ** (step // step_size)


def cosine(lr: float, total_steps: int, min_lr: float = 0.0) -> Schedule:
    if total_steps <= 0:
        raise ConfigError(f"cosine schedule: the total steps must be positive, not {total_steps}")
    lr, min_lr = float(lr), float(min_lr)

    def schedule(step: int) -> float:
        if step >= total_steps:
            return min_lr
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * step / total_steps)) / 2.0

    return schedule


def linear_warmup(warmup_steps: int, then: Schedule | float) -> Schedule:
    if warmup_steps <= 0:
        raise ConfigError(f"warmup schedule: the warmup steps must be positive, not {warmup_steps}")
    after = constant(then) if isinstance(then, (int, float)) else then

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return after(0) * (step + 1) / warmup_steps
        return after(step - warmup_steps)

    return schedule


def _named() -> str:
    """The schedule as the caller gave it: ``--lr-schedule`` under the command line, else
    ``schedule`` (parse_schedule's text)."""
    return "--lr-schedule" if on_command_line() else "schedule"


def _number(text: str, kind: type, what: str, spec: str) -> float | int:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{_named()} {spec!r}: {what} must be {'an integer' if kind is int else 'a number'}, "
                          f"not {text!r} (syntax: {SYNTAX})") from None


def parse_schedule(spec: str, lr: float) -> Schedule:
    """``--lr-schedule`` text (:data:`SYNTAX`) over the base learning rate ``lr``; a ConfigError
    line on bad text."""
    text = spec.strip()
    if text.startswith("warmup:"):
        head, _, rest = text.partition(",")
        parts = head.split(":")
        if len(parts) != 2:
            raise ConfigError(f"{_named()} {spec!r}: warmup takes one number, warmup:STEPS (syntax: {SYNTAX})")
        steps = _number(parts[1], int, "the warmup steps", spec)
        if rest.strip().startswith("warmup"):
            raise ConfigError(f"{_named()} {spec!r}: one warmup at most (syntax: {SYNTAX})")
        return linear_warmup(steps, parse_schedule(rest, lr) if rest.strip() else constant(lr))
    name, *args = text.split(":")
    arity = {"constant": (0, 0), "step": (2, 2), "cosine": (1, 2)}
    if name not in arity:
        raise ConfigError(f"{_named()} {spec!r}: unknown schedule {name!r} (syntax: {SYNTAX})")
    low, high = arity[name]
    if not low <= len(args) <= high:
        raise ConfigError(f"{_named()} {spec!r}: {name} takes {low if low == high else f'{low} or {high}'} "
                          f"number{'s' if high != 1 else ''} (syntax: {SYNTAX})")
    try:
        if name == "constant":
            return constant(lr)
        if name == "step":
            return step_decay(lr, _number(args[0], int, "the step size", spec), _number(args[1], float, "gamma", spec))
        return cosine(lr, _number(args[0], int, "the total steps", spec),
                      _number(args[1], float, "the minimum lr", spec) if len(args) > 1 else 0.0)
    except ConfigError as exc:
        message = str(exc)
        flag = _named()
        raise ConfigError(message if message.startswith(flag) else f"{flag} {spec!r}: {message}") from None


__all__ = ["SYNTAX", "Schedule", "constant", "cosine", "linear_warmup", "parse_schedule", "step_decay"]
