"""Precision policies and the fp16 loss scale: frozen values, and the pure update of the scale.

``Precision`` says in which dtype the params live and the forward/backward runs (``compute``), in which
dtype gradients are summed across ranks (``reduce``), and whether the optimizer keeps fp32 master
weights (``master``): with them, the paper's mixed-precision layout holds, 2-byte params and grads and
K = 12 optimizer bytes (master, m, v) per parameter.

fp16 needs a loss scale. ``DynamicLossScale`` has DeepSpeed's defaults (initial 2^16, window 1000,
hysteresis 2, minimum 1); ``StaticLossScale`` a fixed one. The scale lives in the ``TrainState`` as a
``LossScaleState`` of tensors, and ``next_loss_scale`` is its pure update. Whether a step overflowed
is decided from the squared gradient norm *after* it is summed over ranks, so every rank takes the
same decision: no rank ever steps while another skips. The scale is a float32 tensor: growth stops at
2**127 (``MAX_LOSS_SCALE``), and a scale above it is refused up front, since inf overflows every step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def max_scale(dtype: torch.dtype = torch.float32) -> float:
    """The largest finite power of two of ``dtype`` (float32: 2**127): the ceiling of a loss scale held in it.
    A power of two, so that scaling and unscaling stay exact."""
    return 2.0 ** math.floor(math.log2(torch.finfo(dtype).max))


MAX_LOSS_SCALE = max_scale(torch.float32)  # the scale lives in the state as a float32 tensor


def _check_scale(api: str, name: str, value: float) -> None:
    """A loss scale above ``MAX_LOSS_SCALE`` is inf in the float32 state: every step would overflow and be skipped,
    and halving inf never brings it back, so such a scale can never succeed."""
    if isinstance(value, (int, float)) and value > MAX_LOSS_SCALE:
        raise ValueError(
            f"{api}: {name}={value:g} is above the largest finite float32 power of two, 2**127 ({MAX_LOSS_SCALE:g}); held "
            f"as a float32 it is inf, and every step would be skipped as an overflow forever. Use a scale <= 2**127; "
            f"DeepSpeed's default is 2**16 (initial_scale_power 16)."
        )


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    initial: float = 2.0**16
    window: int = 1000  # steps without overflow before the scale grows by ``factor``
    hysteresis: int = 2  # overflows tolerated (skipped without shrinking) before the scale shrinks
    min_scale: float = 1.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        _check(self.initial > 0 and self.min_scale > 0 and self.factor > 1 and self.window >= 1 and self.hysteresis >= 1,
               f"fzero.DynamicLossScale: needs initial > 0, min_scale > 0, factor > 1, window >= 1, hysteresis >= 1; got {self}.")
        _check_scale("fzero.DynamicLossScale", "initial", self.initial)
        _check_scale("fzero.DynamicLossScale", "min_scale", self.min_scale)
        _check(math.isfinite(self.factor), f"fzero.DynamicLossScale: factor must be finite, got {self.factor!r}.")


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    scale: float = 1.0

    def __post_init__(self) -> None:
        _check(self.scale > 0, f"fzero.StaticLossScale: scale must be > 0, got {self.scale!r}.")
        _check_scale("fzero.StaticLossScale", "scale", self.scale)


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy. ``precision="bf16"`` etc. in ``fzero.compile`` name the common ones."""

    compute: torch.dtype = torch.float32
    reduce: torch.dtype | None = None  # None: the compute dtype
    master: bool = True  # fp32 master weights in the optimizer state (ignored when compute is fp32)
    loss_scale: DynamicLossScale | StaticLossScale | None = None

    def __post_init__(self) -> None:
        floats = (torch.float32, torch.bfloat16, torch.float16)
        _check(self.compute in floats, f"fzero.Precision: compute must be one of {floats}, got {self.compute!r}.")
        _check(self.reduce in (None, *floats), f"fzero.Precision: reduce must be None or one of {floats}, got {self.reduce!r}.")
        if self.compute == torch.float16 and self.loss_scale is None:
            raise ValueError(
                "fzero.Precision: compute=torch.float16 needs a loss_scale (fp16 gradients underflow without one). "
                "Pass loss_scale=fzero.DynamicLossScale(), or use precision='fp16'."
            )

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.reduce or self.compute

    @property
    def has_master(self) -> bool:
        return self.master and self.compute != torch.float32


NAMED = {
    "fp32": Precision(),
    "bf16": Precision(compute=torch.bfloat16),
    "fp16": Precision(compute=torch.float16, loss_scale=DynamicLossScale()),
}


def policy(precision: str | Precision, *, api: str) -> Precision:
    if isinstance(precision, Precision):
        return precision
    if precision not in NAMED:
        raise ValueError(f"{api}: precision must be one of {sorted(NAMED)} or a fzero.Precision(...), got {precision!r}.")
    return NAMED[precision]


class LossScaleState(NamedTuple):
    scale: torch.Tensor  # float32 0-d: the current loss scale
    good_steps: torch.Tensor  # int64 0-d: steps since the last overflow or growth
    hysteresis: torch.Tensor  # int64 0-d: overflows left before the scale shrinks


def init_loss_scale(config: DynamicLossScale | StaticLossScale | None) -> LossScaleState | None:
    if config is None:
        return None
    if isinstance(config, StaticLossScale):
        return LossScaleState(torch.tensor(float(config.scale)), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    return LossScaleState(
        torch.tensor(float(config.initial)), torch.zeros((), dtype=torch.int64), torch.tensor(config.hysteresis, dtype=torch.int64)
    )


def next_loss_scale(config, state: LossScaleState, *, overflow: bool, step: int) -> LossScaleState:
    """The scale after a step (DeepSpeed's dynamic rule). Raises when the minimum scale still overflows."""
    if isinstance(config, StaticLossScale):
        return state
    scale, good, hyst = float(state.scale), int(state.good_steps), int(state.hysteresis)
    if overflow:
        if scale <= config.min_scale and hyst <= 1:
            raise FloatingPointError(
                f"fzero.Step: fp16 gradients overflowed at step {step} with the loss scale already at its minimum "
                f"({config.min_scale:g}); the model diverges or the minimum is too high. Lower "
                f"DynamicLossScale(min_scale=...), lower the learning rate, or train in bf16 (precision='bf16')."
            )
        if hyst > 1:
            hyst -= 1
        else:
            scale = max(scale / config.factor, config.min_scale)
        good = 0
    else:
        good += 1
        if good % config.window == 0:
            # capped where the next growth would leave the state's dtype (2**127 in float32): an inf scale would
            # turn every later step into an overflow that halving never undoes
            scale = min(scale * config.factor, max_scale(state.scale.dtype))
            hyst = config.hysteresis
            good = 0
    return LossScaleState(torch.tensor(scale), torch.tensor(good, dtype=torch.int64), torch.tensor(hyst, dtype=torch.int64))

