"""The building blocks optimizers are chained from. Every ``update`` is pure: it returns new tensors.

Arithmetic follows torch.optim's for-loop implementations op for op where it can (``lerp`` and ``addcmul`` for
Adam's moments, ``add(..., alpha=)`` for weight decay and momentum) so that the pure path stays within an ulp
or two of torch; the fused steps in ``_fused`` are the ones that match torch bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fzero.optim._base import EmptyState, GradientTransformation, LearningRate, Schedule, check_float, check_learning_rate
from fzero.optim._base import active_params, current_segments, param_count, param_ranges, per_param_steps, scheduled, skipped_after

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ScaleByAdamState(NamedTuple):
    """Adam's moments; the same state serves the pure ``update`` and the fused in-place kernel.

    count: float32 0-d tensor, steps taken (torch keeps Adam's ``step`` as float32 too); on the params'
      device when they share one, else on the CPU.
    mu: like params (same shapes, dtypes, devices): first moment, ``exp_avg``.
    nu: like params: second moment, ``exp_avg_sq``.
    skipped: float32 1-D tensor on count's device, one entry per parameter (see ``per_param_steps``): the
      steps that parameter sat out because it had no gradient. Its own step count, torch's per-parameter
      ``state["step"]`` that its bias correction uses, is ``count - skipped``. None (a state built by hand):
      no parameter may sit a step out.
    """

    count: torch.Tensor
    mu: Any
    nu: Any
    skipped: Any = None


class TraceState(NamedTuple):
    """trace: like params: the momentum buffer (zeros before the first step, which then makes it the grad)."""

    trace: Any


class ScaleByScheduleState(NamedTuple):
    """count: int64 0-d CPU tensor, steps taken: the schedule is evaluated at it, on the host."""

    count: torch.Tensor


def init_skipped(params: Any) -> torch.Tensor:
    """Zero skip counts, one per parameter of ``params`` as the current ``Segments`` counts them."""
    return torch.zeros(param_count(params), dtype=torch.float32, device=common_device(params))


def common_device(params: Any) -> torch.device:
    devices = {t.device for t in optree.tree_leaves(params) if isinstance(t, torch.Tensor)}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def _opmath(t: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 moments are combined in fp32, as torch's kernels do, then cast back.
    return t.float() if t.dtype in _LOW_PRECISION else t


def scale_by_adam(b1: float | Schedule = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m̂ / (sqrt(v̂) + eps)`` with torch's bias correction (not yet scaled by -lr).

    ``b1`` may be a schedule of the step count (e.g. ``one_cycle(...).momentum``, DeepSpeed's momentum
    cycling): each step uses its current value in the average and in the bias correction, as torch's
    Adam does when a scheduler rewrites ``betas``.
    """
    api = "fzero.optim.scale_by_adam"
    b1 = b1 if callable(b1) else check_float(api, "b1", b1, low=0.0, high=1.0, high_open=True, hint=" Typical: b1=0.9.")
    b2 = check_float(api, "b2", b2, low=0.0, high=1.0, high_open=True, hint=" Typical: b2=0.999.")
    eps = check_float(api, "eps", eps, low=0.0, hint=" Typical: eps=1e-8.")

    def init(params: Any) -> ScaleByAdamState:
        count = torch.zeros((), dtype=torch.float32, device=common_device(params))
        zeros = lambda p: torch.zeros_like(p, memory_format=torch.contiguous_format)  # noqa: E731
        return ScaleByAdamState(count, optree.tree_map(zeros, params), optree.tree_map(zeros, params), init_skipped(params))

    def update(updates: Any, state: ScaleByAdamState, params: Any = None) -> tuple[Any, ScaleByAdamState]:
        del params
        beta1 = float(scheduled(b1, int(state.count))) if callable(b1) else b1  # a schedule of the step, global as torch's
        count = state.count + 1
        skipped = skipped_after(api, state.skipped, active_params())
        mu = optree.tree_map(lambda m, g: m.lerp(g.to(m.dtype), 1 - beta1), state.mu, updates)
        nu = optree.tree_map(lambda v, g: v.mul(b2).addcmul(g.to(v.dtype), g.to(v.dtype), value=1 - b2), state.nu, updates)

        def biases(step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Bias corrections in float64 on 0-d tensors: no host sync, and works on meta tensors.
            step = step.double()
            return 1 - torch.pow(beta1, step), (1 - torch.pow(b2, step)).sqrt()

        def direction(m: torch.Tensor, v: torch.Tensor, bias1: torch.Tensor, bias2_sqrt: torch.Tensor) -> torch.Tensor:
            denom = (_opmath(v).sqrt() / bias2_sqrt).add_(eps)
            return (_opmath(m) / bias1).div_(denom).to(m.dtype)

        bias1, bias2_sqrt = biases(count)
        directions = optree.tree_map(lambda m, v: direction(m, v, bias1, bias2_sqrt), mu, nu)
        steps = per_param_steps(count, skipped)
        if steps is not None:  # a parameter that sat steps out has its own, smaller count: its ranges redone with it
            own = steps.tolist()
            base = float(count)
            for d, m, v, ranges in zip(optree.tree_leaves(directions), optree.tree_leaves(mu), optree.tree_leaves(nu),
                                       param_ranges(updates)):
                for a, b, i in ranges:
                    if i >= 0 and own[i] != base:
                        b1_i, b2_i = biases(steps[i])
                        d.view(-1)[a:b] = direction(m.reshape(-1)[a:b], v.reshape(-1)[a:b], b1_i, b2_i)
        return directions, ScaleByAdamState(count, mu, nu, skipped)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """``updates + weight_decay * params``: coupled (L2) before a scaling, decoupled (AdamW) after Adam."""
    weight_decay = check_float("fzero.optim.add_decayed_weights", "weight_decay", weight_decay, low=0.0)

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError(
                "fzero.optim.add_decayed_weights: update needs the params to decay, got params=None. "
                "Call opt.update(grads, state, params)."
            )
        return optree.tree_map(lambda u, p: u.add(p, alpha=weight_decay), updates, params), state

    return GradientTransformation(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum with torch SGD's semantics (no dampening): ``buf = decay * buf + g`` (``buf = g`` at the
    first step), update ``buf``, or ``g + decay * buf`` when ``nesterov``."""
    api = "fzero.optim.trace"
    decay = check_float(api, "decay", decay, low=0.0, hint=" Typical: 0.9.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{api}: nesterov must be a bool, got {type(nesterov).__name__} {nesterov!r}.")

    def init(params: Any) -> TraceState:
        return TraceState(optree.tree_map(lambda p: torch.zeros_like(p, memory_format=torch.contiguous_format), params))

    def update(updates: Any, state: TraceState, params: Any = None) -> tuple[Any, TraceState]:
        del params
        # zeros * decay + g == g exactly, so the first step needs no flag to start the buffer at the grad.
        buf = optree.tree_map(lambda t, g: t.mul(decay).add(g), state.trace, updates)
        if nesterov:
            updates = optree.tree_map(lambda g, t: g.add(t, alpha=decay), updates, buf)
        else:
            updates = buf
        return updates, TraceState(buf)

    return GradientTransformation(init, update)


def scale(factor: float) -> GradientTransformation:
    """``updates * factor``."""
    factor = check_float("fzero.optim.scale", "factor", factor, low=-float("inf"))

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        del params
        return optree.tree_map(lambda u: u.mul(factor), updates), state

    return GradientTransformation(init, update)


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of every element of ``tree`` (optax's ``global_norm``), over all ranks: a float32 0-d tensor.

    Why not ``sqrt(sum(x.square().sum()))`` in a transform of your own: under a train step at stages 1-3 an optimizer
    is given this rank's shard of each unit, so such a sum is this rank's share alone, and each rank would scale its
    shard by its own factor, without a word (measured: a hand-written clip 7.9e-4 off stage 0 after 3 SGD steps on
    2 ranks). This sums the elements of parameters (not the shards' padding) on each rank and adds the ranks' sums with
    the current ``Segments``' ``all_reduce``. Inside ``multi_transform`` it is the norm of the group's params, as optax's
    is of what the group's transform is given. Where the leaves are a disk-offload sub-group it cannot be had, and
    says so."""
    api = "fzero.optim.global_norm"
    leaves = optree.tree_leaves(tree)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise TypeError(f"{api}: tree must be a pytree of tensors (updates or gradients); got leaves of "
                        f"{sorted({type(t).__name__ for t in leaves})}.")
    segments = current_segments()
    reduce = getattr(segments, "all_reduce", None)
    if not callable(reduce):
        raise NotImplementedError(
            f"{api}: the optimizer is given {type(segments).__name__}'s leaves (with offload='disk', a sub-group of one "
            f"unit at a time), over which no global norm can be taken. Clip with fzero.compile(clip_grad_norm=...), "
            f"which clips by the norm over every rank before the update, or offload='cpu'."
        )
    # a rank whose shard holds none of a group's params still adds its zero: every rank runs the same all-reduce
    device = leaves[0].device if leaves else getattr(segments, "device", torch.device("cpu"))
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for t, ranges in zip(leaves, param_ranges(tree, segments)):
        flat = t.reshape(-1)
        for a, b, i in ranges:
            if i >= 0 and b > a:
                local += _opmath(flat[a:b]).float().square().sum().to(device)
    return reduce(local)[0].sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """optax's ``clip_by_global_norm``: updates scaled by ``max_norm / norm`` where their norm over every rank
    (``global_norm``) is ``max_norm`` or more. First in a chain, it clips the gradient as
    ``fzero.compile(clip_grad_norm=max_norm)`` does, less torch's ``1e-6`` in the divisor; prefer that one, which also
    gives ``metrics["grad_norm"]`` and keeps the optimizer's fused step."""
    max_norm = check_float("fzero.optim.clip_by_global_norm", "max_norm", max_norm, low=0.0)
    if max_norm <= 0.0:
        raise ValueError(f"fzero.optim.clip_by_global_norm: max_norm must be > 0, got {max_norm}.")

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        del params
        norm = global_norm(updates)
        factor = torch.where(norm < max_norm, torch.ones_like(norm), max_norm / norm)
        return optree.tree_map(lambda u: u * factor.to(u.device, u.dtype), updates), state

    return GradientTransformation(init, update)


def set_to_zero() -> GradientTransformation:
    """Updates of zero: the params it applies to stay as they are (to freeze a group of ``multi_transform``). Its
    fused step does nothing at all, so a frozen group costs no arithmetic. Their gradients are still taken and count in
    the step's global gradient norm (``clip_grad_norm``, ``metrics["grad_norm"]``), as a torch param group with
    ``lr=0`` does; unlike ``requires_grad=False``, whose params torch's ``clip_grad_norm_`` never sees."""

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        del params
        return optree.tree_map(torch.zeros_like, updates), state

    def fused(grads: Any, state: EmptyState, params: Any) -> EmptyState:
        del grads, params
        return state

    return GradientTransformation(init, update, fused)


def scale_by_learning_rate(learning_rate: LearningRate) -> GradientTransformation:
    """``updates * -lr``: descent. ``learning_rate`` is a float, or a schedule evaluated at the step count
    (0 at the first step) on the host."""
    learning_rate = check_learning_rate("fzero.optim.scale_by_learning_rate", learning_rate)
    if not callable(learning_rate):
        lr = learning_rate
        return scale(-lr)._replace(learning_rate=lr)
    schedule = learning_rate

    def init(params: Any) -> ScaleByScheduleState:
        del params
        return ScaleByScheduleState(torch.zeros((), dtype=torch.int64))

    def update(updates: Any, state: ScaleByScheduleState, params: Any = None) -> tuple[Any, ScaleByScheduleState]:
        del params
        lr = float(scheduled(schedule, int(state.count)))
        return optree.tree_map(lambda u: u.mul(-lr), updates), ScaleByScheduleState(state.count + 1)

    return GradientTransformation(init, update, None, schedule)
