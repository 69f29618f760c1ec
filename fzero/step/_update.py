"""The second half of a step, after the gradient: synchronise, check, clip, update.

Per rank: synchronise the gradient as the step's ``grads`` part says (all-reduce, reduce-scatter, or
nothing where it was reduced in backward), average it over ranks and micro-batches and unscale it, take
the global norm, decide on overflow from that norm (summed over ranks, so every rank decides alike),
clip, run the optimizer on what the ``opt_state`` part says this rank owns (fp32 master weights when the
policy keeps them), and let it bring the params back (``after_update``: the all-gather of stages 1-2). A param that no rank's gradient used (``fzero.step._context``; torch's ``grad is None``)
skips the optimizer: the ``active`` mask travels to it through ``LayoutSegments``.

What cannot train is said here, before the optimizer writes anything: a learning-rate schedule whose value is
not finite or negative (``current_lr``), and some ranks' losses using no param while others' did (``EMPTY_FLAG``: a zero
gradient averaged in silently). A gradient that is exactly zero everywhere trains nothing, or worse lets weight
decay drift the params: it warns once per step object (``ZeroGradientWarning``).

## Precision

Precision policies and the fp16 loss scale: frozen values, and the pure update of the scale.

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

import ctypes
import ctypes.util
import dataclasses
import functools
import math
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch

from fzero.layout import Layout, LayoutSegments
from fzero.optim import scheduled
from fzero.mesh import Pending
from fzero.step._context import Usage
from fzero.step._pool import Pool, forget, give


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
    window: int = 1000  # the scale grows after window + 1 steps without overflow, then every window (DeepSpeed 0.19)
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
    good_steps: torch.Tensor  # int64 0-d: steps without overflow since the last overflow (or the start)
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
    """The scale after a step (DeepSpeed's dynamic rule, ``DynamicLossScaler.update_scale`` as of 0.19). Raises when
    the minimum scale still overflows.

    The scale grows at the ``window + 1``-th step without overflow since the last overflow (or the start), and every
    ``window`` steps after that: DeepSpeed counts the steps after the first clean one (``stable_interval``), and does
    not restart the count when it grows. (DeepSpeed 0.14 and before grew after ``window`` clean steps, restarting at
    each growth; checkpoints of that count resume here with their growth up to one window later.)"""
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
        stable = good - 1  # DeepSpeed's stable_interval
        if stable > 0 and stable % config.window == 0:
            # capped where the next growth would leave the state's dtype (2**127 in float32): an inf scale would
            # turn every later step into an overflow that halving never undoes
            scale = min(scale * config.factor, max_scale(state.scale.dtype))
            hyst = config.hysteresis
    return LossScaleState(torch.tensor(scale), torch.tensor(good, dtype=torch.int64), torch.tensor(hyst, dtype=torch.int64))


class MasterState(NamedTuple):
    """Optimizer state under a mixed-precision policy with master weights."""

    master: Any  # dict unit -> fp32 tensor: this rank's master copy of what it updates
    inner: Any  # the optimizer's own state, over ``master``


def _active(layout: Layout, used: torch.Tensor) -> torch.Tensor | None:
    """The params that take this step, as a bool mask in the user's pytree order (``used``: per slot, in layout
    order, summed over ranks); None when every param does (the common case: nothing more to do)."""
    used = used > 0
    if bool(used.all()):
        return None
    active = torch.empty(len(layout.order), dtype=torch.bool)
    active[torch.tensor(layout.order, dtype=torch.int64)] = used
    return active


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _trim_heap() -> None:
    """Give the freed pages inside glibc's heap back to the system. Why: glibc serves allocations below its
    dynamic mmap threshold (which rises to 32 MiB after the first such buffer is freed) from its heap, and gives
    heap memory back only at the heap's top; a unit's bf16 gradient freed while its fp32 copy (mmapped, larger)
    is made stays resident, so casting the whole gradient unit by unit peaked at 2 bytes per parameter more than
    the arithmetic (133M GPT, stage 3, bf16, offload="cpu": 20.1 B/param of peak RSS, 18.6 with this). A trim
    costs microseconds when there is little to give back."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def apply_update(optimizer: Any, grads: dict, opt_state: Any, params: dict, segments: Any) -> Any:
    """The optimizer's update of ``params`` in place; with fp32 masters (``MasterState``), of the masters, which
    the low-precision params then follow."""
    from fzero.optim import apply_inplace
    from fzero.optim import use_segments

    if isinstance(opt_state, MasterState):
        with use_segments(segments):
            inner = apply_inplace(optimizer, grads, opt_state.inner, opt_state.master)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(opt_state.master[name])
        return MasterState(opt_state.master, inner)
    grads = {k: g.to(params[k].dtype) for k, g in grads.items()}
    with use_segments(segments):
        return apply_inplace(optimizer, grads, opt_state, params)


def current_lr(optimizer: Any, step: int) -> float:
    """The learning rate ``optimizer`` applies at ``step`` (its ``learning_rate``: a float or a schedule); NaN if it has none.

    A schedule's value is checked here, before the optimizer runs: a NaN or inf learning rate would write NaN
    into every param at once, and the next step would blame the gradients."""
    lr = getattr(optimizer, "learning_rate", None)
    if lr is None:
        return math.nan
    groups = getattr(lr, "group_rates", None)
    if groups is not None:  # multi_transform's groups of different rates (layer-wise decay): each checked, none reported
        for label, rate in groups.items():
            if rate is not None:
                _checked_lr(rate, step, group=f" (of the parameter group {label!r})")
        return math.nan
    return _checked_lr(lr, step)


def _checked_lr(lr: Any, step: int, *, group: str = "") -> float:
    """``lr`` (a float or a schedule) at ``step``, refused when a schedule gives no float, a NaN, an inf or a negative."""
    if not callable(lr):
        return float(lr)
    value = scheduled(lr, step)  # the value the update then applies (one call per step: ScheduleValues)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"fzero.Step: the learning-rate schedule {schedule_name(lr)}{group} returned {type(value).__name__} {value!r} at step "
            f"{step}; a schedule returns a float (steps already taken -> learning rate). The params were not updated."
        ) from None
    if not math.isfinite(out):
        raise FloatingPointError(
            f"fzero.Step: the learning-rate schedule {schedule_name(lr)}{group} returned {out} at step {step} (schedules are "
            f"called with the steps already taken, so this is optimizer step {step + 1}); the params were not updated. "
            f"Fix the schedule for that step (a division by zero warmup or decay length? a log or power of 0?)."
        )
    if out < 0:  # the optimizer would step up the gradient: gradient ascent, with every metric looking normal
        raise ValueError(
            f"fzero.Step: the learning-rate schedule {schedule_name(lr)}{group} returned {out} at step {step} (optimizer step "
            f"{step + 1}); a negative learning rate runs gradient ascent. The params were not updated. Fix the "
            f"schedule for that step (a linear decay past its end? clamp it: max(0.0, ...))."
        )
    return out


def schedule_name(fn: Any) -> str:
    """How an error names a schedule: ``fzero.optim.<factory>`` for fzero's own, else its name and where it is defined."""
    qual = getattr(fn, "__qualname__", None)
    if qual is None:  # a functools.partial, a callable object
        return repr(fn)[:120]
    if getattr(fn, "__module__", "").startswith("fzero.optim") and ".<locals>." in qual:
        return f"fzero.optim.{qual.split('.<locals>.')[0]}"
    code = getattr(fn, "__code__", None)
    return qual + (f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else "")


class ZeroGradientWarning(UserWarning):
    """The whole gradient of a step was exactly zero: the loss does not depend on the params (see ``finish``)."""


# A step object warns about a zero gradient once (ids of the steps that did, with a weak reference to tell a reused id).
_warned: dict[int, Any] = {}
_warned_lock = threading.Lock()


def _first_warning(step: Any) -> bool:
    with _warned_lock:
        ref = _warned.get(id(step))
        if ref is not None and ref() is step:
            return False
        for key in [k for k, r in _warned.items() if r() is None]:
            del _warned[key]
        _warned[id(step)] = weakref.ref(step)
        return True


def _zero_gradient_message(step_no: int, loss: float, *, used_any: bool, moved: float) -> str:
    head = (f"fzero.Step: the gradient of step {step_no} is exactly zero (loss {loss:.6g}, grad_norm 0): the loss does "
            f"not depend on the params (a detached tensor, a constant, a loss computed under torch.no_grad, or every "
            f"path multiplied by 0?).")
    if not used_any:
        what = (" No param took part in the loss, so none was updated (metrics['unused'] lists them all). Make the "
                "loss depend on the model's output: loss_fn should run fzero.apply(model, params, x) and keep its graph.")
    elif moved > 0:
        what = (f" The optimizer still ran and MOVED the params (largest change {moved:.3g}): weight decay or momentum "
                f"act without a gradient, so training drifts while the loss cannot pull it back.")
    else:
        what = " The optimizer ran and the params did not move."
    return head + what + " (Warned once per step object.)"


# Usage flags of a rank whose loss used no param at all: a small negative value on every flag, so that the
# metrics all-reduce that already carries the flags also says how many ranks used nothing, at no extra cost:
# a slot then sums to (ranks that used it) - EMPTY_FLAG * (ranks that used nothing). The sums are exact in
# float32 for meshes below 2**12 ranks; larger meshes skip the check.
EMPTY_FLAG = 2.0 ** -12


def _empty_ranks(used: torch.Tensor, n: int) -> int:
    """How many ranks used no param, read from the summed usage flags (see ``EMPTY_FLAG``)."""
    if n == 1 or n >= 1 / EMPTY_FLAG or used.numel() == 0:
        return 0
    v = float(used[0])
    return round((math.ceil(v) - v) / EMPTY_FLAG)


def _check_every_rank_used(comm: Any, used: torch.Tensor, own: torch.Tensor, step_no: int) -> None:
    """Raise on every rank when some ranks' losses used no param while others' did: they would add a zero gradient
    to the average silently (DDP refuses this too). Which ranks, only on that path: one more all-reduce."""
    n = comm.size
    empty = _empty_ranks(used, n)
    if not 0 < empty < n:
        return
    mine = torch.zeros(n, dtype=torch.float32)  # reduced on the GPU where the group has no gloo (``host_stage``)
    mine[comm.rank] = float(not bool((own > 0).any()))
    ranks = comm.all_reduce(mine, tag="usage").nonzero().flatten().tolist()
    raise RuntimeError(
        f"fzero.Step: at step {step_no} the loss of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of "
        f"{n} used no param (its loss_fn never ran the model on its batch), while the other ranks' did: "
        f"{'they' if len(ranks) > 1 else 'it'} would add a zero gradient to the average, silently. Every rank's loss_fn "
        f"must run the model (DDP refuses this too, as unused parameters). If a rank has nothing to learn from its "
        f"batch, keep the model in its loss with a zero weight (0 * output.sum()) instead of returning a constant."
    )


def _nonfinite_fix(clip: float | None) -> str:
    """What the error for an inf/NaN gradient norm advises. Clipping bounds later steps, but cannot scale an inf or NaN
    gradient back (torch's clip_grad_norm_ writes NaN into it), so a step that already clips is not told to clip."""
    if clip is None:
        return "Lower the learning rate or clip (clip_grad_norm=...)"
    return (f"Clipping (clip_grad_norm={clip:g}) cannot scale an inf or NaN back: lower the learning rate, or look for "
            f"what overflows in the loss (a log or a division of 0, an fp32 overflow)")


def loss_seed(scale: float, grad_accum: int, *, scaled: bool) -> float:
    """What each micro-batch's loss is multiplied by before its backward. Under a loss scale (fp16), ``scale / k``, as
    DeepSpeed divides the loss by its accumulation steps before scaling it: the sum of k scaled fp16 micro-batch
    gradients then overflows where DeepSpeed's does, not at a k-times smaller gradient. ``finish`` divides by
    ``n * k * loss_seed(...)``: the same mean either way."""
    return scale / grad_accum if scaled else scale


def finish(step: Any, comm: Any, state: Any, grads: list[Any], loss: torch.Tensor, scale: float, meta: Any, aux: Any,
           usage: Usage | None = None, *, pool: Pool | None = None, spend: Callable[[], None] | None = None):
    """Everything after the gradient; returns (new state, metrics). ``usage``: which params this rank's
    gradients used (``fzero.step._context``); None: all of them. ``pool``: where the gradients' buffers go when
    the update is done with them (``fzero.step._pool``), and the reduce-scatters of stage 1 take theirs. ``spend``:
    called just before the update writes the state's buffers in place (marks the state given to the step spent, so
    that a step interrupted from there on, by Ctrl-C or an error, leaves a half-updated state that is refused, not
    trained on)."""
    layout, n, prec = state.meta.layout, comm.size, step.precision
    units = layout.units
    ranges = [u.shard_range(comm.rank, n) for u in units]
    reduce_dtype = prec.reduce_dtype

    # Sum over ranks in rank order, round to the compute dtype, then average: the same numbers at every
    # stage, so stages 1-3 equal stage 0 bitwise (with shards aligned, see SHARD_ALIGN), with one micro-batch. With
    # grad_accum > 1, stages 2-3 reduce each micro-batch's gradient in its backward and add the rounded shards (as
    # DeepSpeed's ZeRO-2 reduces per micro-batch), where stages 0-1 add the micro-batches first and reduce once: in
    # bf16 the two differ in their last bits.
    divisor = n * step.grad_accum * loss_seed(scale, step.grad_accum, scaled=state.loss_scale is not None)
    owned_grads, returned = [], []
    for i, g in enumerate(grads):
        grads[i] = None  # drop the whole gradient as soon as its shard exists (stage 1)
        # started in backward (stages 0-1 under plain autograd, ``ParamView``), or synchronised now
        g = g.wait() if isinstance(g, Pending) else step.grads.sync(comm, g, reduce_dtype=reduce_dtype, compute=prec.compute, pool=pool)
        g32 = g.to(torch.float32)
        # only a buffer the pool lent goes back to it after the update (the same tensor when no cast was needed);
        # a cast's new fp32 copy is freed with this step (given to the pool, it would be held there, unused,
        # between steps: 4 bytes per owned element, measured 2.7 B/param of a 133M GPT at stage 3, bf16)
        owned_grads.append(g32.div_(divisor))
        returned.append(g32 is g)
        if g32 is not g:  # the cast copied it: the pool's compute-dtype buffer dies with this step, and so does
            # its record of the loan (left, the records grew by a few per step under bf16/fp16, ~3 per step of a
            # 2-rank stage 3 run: millions in a long run)
            forget(pool, g if g._base is None else g._base)
        cast_on_host = g32 is not g and g32.device.type == "cpu"
        del g, g32  # this unit's compute-dtype gradient is freed now, not when the next one replaces it
        if cast_on_host:
            _trim_heap()

    # Global norm from this rank's slice of every unit, summed over ranks (grouped by unit: size buckets
    # at stages 0-1, modules at 2-3, so its last bits may differ between those).
    slices = [g[lo:hi] for g, (lo, hi) in zip(owned_grads, ranges)] if step.grads.whole else owned_grads
    sumsq = torch.stack([torch.dot(s, s) for s in slices]).sum()  # dot: no unit-sized temporary, unlike pow(2)
    # One all-reduce for the metrics and the usage of every param (1.0 per rank that used it): a param no rank
    # used keeps torch's grad=None and skips the update; one some rank used gets the averaged gradient (DDP).
    flags = usage.flags() if usage is not None else torch.ones(len(layout.order))
    own = flags
    if n > 1 and not bool(flags.any()):  # this rank used nothing: say so in the same all-reduce (see EMPTY_FLAG)
        flags = torch.full_like(flags, -EMPTY_FLAG)
    # sent up without a wait (non_blocking): a blocking copy of the host's flags (pageable memory) made the host wait
    # for the whole backward there, a second wait per step beside the metrics' read below. The copy call stages a
    # pageable source before it returns, and the read below waits for the rest
    dev = sumsq.device
    reduced = comm.all_reduce(torch.cat([torch.stack([loss.detach().float().to(dev, non_blocking=True), sumsq]),
                                         flags.to(dev, non_blocking=True)]), tag="metrics")
    reduced = reduced.cpu()  # the host decides on overflow and reads the metrics: one wait for the device per step
    step_no = int(state.step) + 1
    _check_every_rank_used(comm, reduced[2:], own, step_no)
    active = _active(layout, reduced[2:])
    grad_norm = math.sqrt(float(reduced[1])) if math.isfinite(float(reduced[1])) else float(reduced[1])

    skipped = not math.isfinite(grad_norm)
    loss_scale = state.loss_scale
    if skipped and loss_scale is None and step.on_nonfinite == "error":
        raise FloatingPointError(
            f"fzero.Step: the gradient norm is {grad_norm} at step {step_no} (loss {float(reduced[0]) / n:.6g}): the "
            f"gradients hold inf or NaN; the params were not updated. {_nonfinite_fix(step.clip_grad_norm)}; pass "
            f"on_nonfinite='skip' to skip such steps instead (the metrics say 'skipped')."
        )
    if loss_scale is not None and not isinstance(prec.loss_scale, StaticLossScale) or loss_scale is not None and skipped:
        loss_scale = next_loss_scale(prec.loss_scale, loss_scale, overflow=skipped, step=step_no)

    lr = current_lr(step.optimizer, int(state.step))
    opt_state = state.opt_state
    flats = state.params
    warning = None
    if not skipped:
        if step.clip_grad_norm is not None:  # as torch.nn.utils.clip_grad_norm_: scale by min(1, c / (norm + 1e-6))
            coef = (step.clip_grad_norm / (reduced[1].sqrt() + 1e-6)).clamp(max=1.0)
            for g in owned_grads:
                g.mul_(coef)
        params = step.opt_state.owned(step.params, layout, flats, comm.rank)
        grad_tree = {u.name: g for u, g in zip(units, owned_grads)}
        zero = float(reduced[1]) == 0.0 and comm.rank == 0 and _first_warning(step)  # rare: worth a copy to tell
        before = {k: p.detach().float().clone() for k, p in params.items()} if zero else None
        # per-parameter norms, and which params skip the update
        segments = LayoutSegments(layout, sharded=step.opt_state.sharded, rank=comm.rank, comm=comm, active=active)
        if spend is not None:
            spend()
        opt_state = step.opt_state.apply(step.optimizer, grad_tree, opt_state, params, segments)
        if before is not None:
            moved = max((float((params[k].float() - b).abs().max()) for k, b in before.items() if b.numel()), default=0.0)
            used_any = bool((reduced[2:] > 0).any())
            warning = _zero_gradient_message(step_no, float(reduced[0]) / n, used_any=used_any, moved=moved)
            del before
        del grad_tree, params
        step.opt_state.after_update(step.params, comm, flats, layout, bucket_elements=step.unit_settings.bucket_elements, pool=pool)
    del slices
    for g, mine in zip(owned_grads, returned):  # the update is done with them: the pool's serve the next step (a bucket's, once)
        if mine:
            give(pool, g if g._base is None else g._base)
    del owned_grads

    metrics = {
        "loss": float(reduced[0]) / n,
        "grad_norm": grad_norm,
        "lr": lr,
        "step": int(state.step) + (0 if skipped else 1),
        "loss_scale": scale,
        "skipped": skipped,
    }
    if aux is not None:
        metrics["aux"] = aux
    if active is not None:  # params no rank used in this step (torch's grad=None): left as they were
        metrics["unused"] = tuple(layout.paths[s] for s in (reduced[2:] <= 0).nonzero().flatten().tolist())
    new_state = dataclasses.replace(
        state, params=dict(flats), opt_state=opt_state, step=state.step + (0 if skipped else 1), loss_scale=loss_scale, meta=meta
    )
    if warning is not None:  # last: where warnings are errors, the step is whole when it raises
        warnings.warn(warning, ZeroGradientWarning, stacklevel=2)
    return new_state, metrics
