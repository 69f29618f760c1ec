"""Learning-rate schedules: pure functions of the step count (steps already taken, 0 at the first step).

Each returns a plain Python float, so that the fused kernels (which take the learning rate as a scalar)
and the train step's ``lr`` metric read the same number.
"""

from __future__ import annotations

import math

from fzero.optim._base import Schedule, check_float


def _check_steps(api: str, name: str, value: object, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {name} must be an int >= {low}, got {type(value).__name__} {value!r}.")
    if value < low:
        raise ValueError(f"{api}: {name} must be an int >= {low}, got {value!r}.")
    return value


def _check_step(api: str, step: int) -> int:
    step = int(step)
    if step < 0:
        raise ValueError(f"{api}: the step count must be >= 0, got {step}. Schedules count steps already taken, from 0.")
    return step


def constant_schedule(value: float) -> Schedule:
    """``value`` at every step."""
    api = "fzero.optim.constant_schedule"
    value = check_float(api, "value", value, low=-math.inf)

    def schedule(step: int) -> float:
        _check_step(api, step)
        return value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """From ``init_value`` at step 0 linearly to ``end_value`` at ``transition_steps``, then constant."""
    api = "fzero.optim.linear_schedule"
    init_value = check_float(api, "init_value", init_value, low=-math.inf)
    end_value = check_float(api, "end_value", end_value, low=-math.inf)
    transition_steps = _check_steps(api, "transition_steps", transition_steps)

    def schedule(step: int) -> float:
        frac = min(_check_step(api, step), transition_steps) / transition_steps
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Half a cosine from ``init_value`` at step 0 down to ``alpha * init_value`` at ``decay_steps``, then constant."""
    api = "fzero.optim.cosine_decay_schedule"
    init_value = check_float(api, "init_value", init_value, low=-math.inf)
    decay_steps = _check_steps(api, "decay_steps", decay_steps)
    alpha = check_float(api, "alpha", alpha, low=0.0, high=1.0, hint=" It is the final fraction of init_value.")

    def schedule(step: int) -> float:
        frac = min(_check_step(api, step), decay_steps) / decay_steps
        return init_value * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * frac)) + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a cosine down to
    ``end_value`` at ``decay_steps`` (counted from step 0, warmup included), then constant."""
    api = "fzero.optim.warmup_cosine_decay_schedule"
    init_value = check_float(api, "init_value", init_value, low=-math.inf)
    peak_value = check_float(api, "peak_value", peak_value, low=-math.inf)
    end_value = check_float(api, "end_value", end_value, low=-math.inf)
    warmup_steps = _check_steps(api, "warmup_steps", warmup_steps, low=0)
    decay_steps = _check_steps(api, "decay_steps", decay_steps)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"{api}: decay_steps counts from step 0 and includes the warmup, so it must exceed warmup_steps; got "
            f"decay_steps={decay_steps}, warmup_steps={warmup_steps}. E.g. warmup_steps=100, decay_steps=10_000."
        )

    def schedule(step: int) -> float:
        step = _check_step(api, step)
        if step < warmup_steps:
            return init_value + (peak_value - init_value) * step / warmup_steps
        frac = min(step - warmup_steps, decay_steps - warmup_steps) / (decay_steps - warmup_steps)
        return end_value + (peak_value - end_value) * 0.5 * (1 + math.cos(math.pi * frac))

    return schedule
