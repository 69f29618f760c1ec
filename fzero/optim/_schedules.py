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


# -- DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py), as pure functions --------------------------------
#
# Step indexing. DeepSpeed's engine runs ``optimizer.step()`` and *then* ``lr_scheduler.step()``, and each
# scheduler sets a learning rate in its constructor. So the k-th optimizer step (k = 0, 1, ...: the count fzero
# evaluates a schedule at) uses the lr the scheduler computes after k calls to ``step()``, at its
# ``last_batch_iteration = k - 1``; at k = 0 that is the constructor's value (``last_batch_iteration = -1``).
# Each function below returns exactly that, with the same float operations in the same order as DeepSpeed
# 0.19, so the values are equal bit for bit (tests/test_schedules.py drives DeepSpeed's classes when it is
# installed). DeepSpeed's quirks are kept on purpose and named in the docstrings.

_WARMUP_TYPES = ("log", "linear")


def _check_warmup(api: str, warmup_num_steps: object, warmup_type: object) -> tuple[int, str]:
    warmup_num_steps = _check_steps(api, "warmup_num_steps", warmup_num_steps)
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(
            f"{api}: warmup_type must be 'log' or 'linear', got {warmup_type!r}. (DeepSpeed falls back to 'log' "
            f"with a warning; fzero asks.) Pass warmup_type='linear' or 'log'."
        )
    # DeepSpeed warms up over max(2, warmup_num_steps) steps: log(1) would divide by zero.
    return max(2, warmup_num_steps), str(warmup_type)


def _check_total(api: str, total_num_steps: object, warmup_num_steps: int, given_warmup: int) -> int:
    total_num_steps = _check_steps(api, "total_num_steps", total_num_steps)
    if total_num_steps < warmup_num_steps:
        raise ValueError(
            f"{api}: total_num_steps counts from step 0 and includes the warmup, so it must be >= warmup_num_steps; "
            f"got total_num_steps={total_num_steps}, warmup_num_steps={given_warmup}. (DeepSpeed only warns, then "
            f"stays at the end value after the warmup.) E.g. warmup_num_steps=1000, total_num_steps=100_000."
        )
    return total_num_steps


def _check_lr(api: str, name: str, value: object) -> float:
    return check_float(api, name, value, low=0.0, hint=" Learning rates are >= 0; e.g. 1e-3.")


def _warmup_gamma(last: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup fraction at ``last_batch_iteration = last`` (0 <= last < warmup_num_steps)."""
    if warmup_type == "log":
        return 1.0 / math.log(warmup_num_steps) * math.log(last + 1)
    return last / warmup_num_steps


def warmup_lr(
    *, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000, warmup_type: str = "log"
) -> Schedule:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` up to ``warmup_max_lr`` over ``warmup_num_steps``, then constant.

    At step k: ``min + (max - min) * gamma`` with ``gamma = log(k) / log(W)`` ("log") or ``(k - 1) / W``
    ("linear") while ``k <= W`` (``W = max(2, warmup_num_steps)``), then 1. Steps 0 and 1 both use
    ``warmup_min_lr`` (DeepSpeed's constructor sets it, then its first ``step()`` is at iteration 0), and a
    linear warmup reaches ``warmup_max_lr`` at step ``W + 1``, from ``(W - 1) / W`` of the way at step ``W``.
    """
    api = "fzero.optim.warmup_lr"
    lo, hi = _check_lr(api, "warmup_min_lr", warmup_min_lr), _check_lr(api, "warmup_max_lr", warmup_max_lr)
    steps, kind = _check_warmup(api, warmup_num_steps, warmup_type)

    def schedule(step: int) -> float:
        last = _check_step(api, step) - 1
        if last < 0:
            return lo
        gamma = _warmup_gamma(last, steps, kind) if last < steps else 1.0
        return lo + (hi - lo) * gamma

    return schedule


def warmup_decay_lr(
    *,
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupDecayLR``: ``warmup_lr``'s warmup, then linear decay to 0 at ``total_num_steps``.

    After the warmup, at step k: ``min + (max - min) * max(0, (T - (k - 1)) / max(1, T - W))`` with ``T =
    total_num_steps`` and ``W = max(2, warmup_num_steps)``; it decays towards 0 (not towards ``warmup_min_lr``)
    and reaches ``warmup_min_lr`` at step ``T + 1``.
    """
    api = "fzero.optim.warmup_decay_lr"
    lo, hi = _check_lr(api, "warmup_min_lr", warmup_min_lr), _check_lr(api, "warmup_max_lr", warmup_max_lr)
    steps, kind = _check_warmup(api, warmup_num_steps, warmup_type)
    total = _check_total(api, total_num_steps, steps, warmup_num_steps)

    def schedule(step: int) -> float:
        last = _check_step(api, step) - 1
        if last < 0:
            return lo
        if last < steps:
            gamma = _warmup_gamma(last, steps, kind)
        else:
            gamma = max(0.0, float(total - last) / float(max(1.0, total - steps)))
        return lo + (hi - lo) * gamma

    return schedule


def warmup_cosine_lr(
    *,
    base_lr: float,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``: ``base_lr`` (the optimizer's lr in DeepSpeed) times a ratio that warms up
    from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``, then follows half a cosine down to
    ``cos_min_ratio`` at ``total_num_steps``, then stays there.

    At step 0 the lr is 0.0, not ``warmup_min_ratio * base_lr``: DeepSpeed's constructor sets 0 before its first
    ``step()``. Warmup: ``r = warmup_min_ratio + g * (1 - warmup_min_ratio)`` with ``g`` as in ``warmup_lr``.
    Then ``r = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(1, (k - W) / max(1, T - W)))) / 2``.
    """
    api = "fzero.optim.warmup_cosine_lr"
    base = _check_lr(api, "base_lr", base_lr)
    min_ratio = check_float(api, "warmup_min_ratio", warmup_min_ratio, low=0.0, high=1.0, hint=" It is a fraction of base_lr.")
    cos_min = check_float(api, "cos_min_ratio", cos_min_ratio, low=0.0, high=1.0, hint=" It is a fraction of base_lr.")
    steps, kind = _check_warmup(api, warmup_num_steps, warmup_type)
    total = _check_total(api, total_num_steps, steps, warmup_num_steps)

    def ratio(last: int) -> float:
        if last < steps:
            return min_ratio + _warmup_gamma(last, steps, kind) * (1.0 - min_ratio)
        progress = min(1.0, (last - steps + 1) / max(1, total - steps))
        return max(0.0, cos_min + (1.0 - cos_min) * ((1 + math.cos(math.pi * progress)) / 2))

    def schedule(step: int) -> float:
        last = _check_step(api, step) - 1
        return 0.0 if last < 0 else base * ratio(last)

    return schedule


def lr_range_test(
    *,
    lr_range_test_min_lr: float = 0.001,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
) -> Schedule:
    """DeepSpeed's ``LRRangeTest``: ``min_lr * (1 + step_rate * k / step_size)`` at step k, growing without bound
    (``floor(k / step_size)`` with ``lr_range_test_staircase``). For finding the largest lr that still trains."""
    api = "fzero.optim.lr_range_test"
    min_lr = _check_lr(api, "lr_range_test_min_lr", lr_range_test_min_lr)
    step_size = _check_steps(api, "lr_range_test_step_size", lr_range_test_step_size)
    rate = check_float(api, "lr_range_test_step_rate", lr_range_test_step_rate, low=0.0, hint=" Typical: 1.0.")
    if not isinstance(lr_range_test_staircase, bool):
        raise TypeError(
            f"{api}: lr_range_test_staircase must be a bool, got {type(lr_range_test_staircase).__name__} "
            f"{lr_range_test_staircase!r}."
        )

    def schedule(step: int) -> float:
        interval = float(_check_step(api, step)) / step_size
        if lr_range_test_staircase:
            interval = math.floor(interval)
        return min_lr * (1 + rate * interval)

    return schedule


class OneCycleSchedule:
    """A learning-rate schedule (call it with the step count) that carries a momentum schedule.

    ``momentum``: a ``Schedule`` for the first beta (Adam's ``b1``, or SGD's momentum), cycled inversely to the
    lr; ``None`` when built with ``cycle_momentum=False``.
    """

    def __init__(self, lr: Schedule, momentum: Schedule | None) -> None:
        self._lr = lr
        self.momentum = momentum

    def __call__(self, step: int) -> float:
        return self._lr(step)

    def __repr__(self) -> str:
        return f"OneCycleSchedule(momentum={'None' if self.momentum is None else 'cycled'})"


def one_cycle(
    *,
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
    cycle_momentum: bool = True,
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
) -> OneCycleSchedule:
    """DeepSpeed's ``OneCycle`` (1cycle policy): one cycle of the lr from ``cycle_min_lr`` up to ``cycle_max_lr``
    over ``cycle_first_step_size`` steps and back over ``cycle_second_step_size`` (default: the same), with the
    momentum moving the other way between ``cycle_max_mom`` and ``cycle_min_mom``; then a decay phase.

    Returns a ``OneCycleSchedule``: ``sched(k)`` is the lr, ``sched.momentum(k)`` the momentum (or ``None``).

    - Stairs: ``cycle_first_stair_count`` > 0 holds the lr and momentum flat over that many equal stairs of
      the rising half (``cycle_second_stair_count``, default the first's, for the falling half).
    - Decay (after the cycle, d steps into it): with ``decay_step_size`` > 0, ``lr = cycle_min_lr / (1 +
      decay_lr_rate * d / decay_step_size)`` and ``momentum = cycle_max_mom * (1 + decay_mom_rate * d /
      decay_step_size)`` (DeepSpeed grows the momentum here: keep ``decay_mom_rate`` small or 0); otherwise
      they stay at ``cycle_min_lr`` and ``cycle_max_mom``.
    - At step 0 the momentum is ``cycle_min_mom``, as DeepSpeed's constructor sets it (the cycle formula would
      give ``cycle_max_mom``); from step 1 on it follows the cycle. DeepSpeed also sets Adam's second beta to
      0.99 whenever it cycles momentum; fzero's schedule covers the first beta only.
    """
    api = "fzero.optim.one_cycle"
    min_lr, max_lr = _check_lr(api, "cycle_min_lr", cycle_min_lr), _check_lr(api, "cycle_max_lr", cycle_max_lr)
    decay_lr_rate = check_float(api, "decay_lr_rate", decay_lr_rate, low=0.0, hint=" 0.0 keeps cycle_min_lr after the cycle.")
    first = _check_steps(api, "cycle_first_step_size", cycle_first_step_size)
    second = first if cycle_second_step_size is None else _check_steps(api, "cycle_second_step_size", cycle_second_step_size, low=0)
    first_stairs = _check_steps(api, "cycle_first_stair_count", cycle_first_stair_count, low=0)
    second_stairs = (
        first_stairs if cycle_second_stair_count is None
        else _check_steps(api, "cycle_second_stair_count", cycle_second_stair_count, low=0)
    )
    decay_step_size = _check_steps(api, "decay_step_size", decay_step_size, low=0)
    if not isinstance(cycle_momentum, bool):
        raise TypeError(f"{api}: cycle_momentum must be a bool, got {type(cycle_momentum).__name__} {cycle_momentum!r}.")
    min_mom = check_float(api, "cycle_min_mom", cycle_min_mom, low=0.0, high=1.0, high_open=True, hint=" Typical: 0.85.")
    max_mom = check_float(api, "cycle_max_mom", cycle_max_mom, low=0.0, high=1.0, high_open=True, hint=" Typical: 0.95.")
    decay_mom_rate = check_float(api, "decay_mom_rate", decay_mom_rate, low=0.0, hint=" 0.0 keeps cycle_max_mom after the cycle.")

    total = float(first + second)
    step_ratio = first / total

    def scale_factor(batch: int) -> float:
        # The position in the cycle, 0 at its ends and 1 at its peak; ``batch`` = last_batch_iteration + 1 = k.
        cycle = math.floor(1 + batch / total)
        x = 1.0 + batch / total - cycle
        if x <= step_ratio:
            scale, stairs = x / step_ratio, first_stairs
        else:
            scale, stairs = (x - 1) / (step_ratio - 1), second_stairs
        if stairs > 0:  # from the integer offset, not from ``scale``: rounding could drop a whole stair
            offset = batch % total
            position = offset * stairs / first if offset <= first else (total - offset) * stairs / second
            scale = math.floor(position) / stairs
        return scale

    def decay_factor(rate: float, step: int) -> float | None:
        if decay_step_size == 0 or rate == 0.0:
            return None
        return 1 + rate * ((step - 1 - total + 1) / decay_step_size)

    def lr(step: int) -> float:
        step = _check_step(api, step)
        if step - 1 < total:  # still in the cycle (at k = 0, the constructor's cycle_min_lr is the formula's too)
            return min_lr + (max_lr - min_lr) * scale_factor(step)
        factor = decay_factor(decay_lr_rate, step)
        return min_lr if factor is None else min_lr / factor

    def momentum(step: int) -> float:
        step = _check_step(api, step)
        if step == 0:
            return min_mom
        if step - 1 < total:
            return max_mom - (max_mom - min_mom) * scale_factor(step)
        factor = decay_factor(decay_mom_rate, step)
        return max_mom if factor is None else max_mom * factor

    return OneCycleSchedule(lr, momentum if cycle_momentum else None)
