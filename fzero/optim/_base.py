"""The optimizer protocol: a ``GradientTransformation`` is a pair of pure functions, and ``chain`` composes them.

``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)`` never mutate their
inputs. A transform may also carry ``fused(grads, state, params) -> state``: the whole optimizer step done in
place (params written through the given tensor objects, which may be views into larger ZeRO buffers), for
when a pure copy of params and state would cost the memory ZeRO exists to save. ``apply_inplace`` is the one
entry point the train step uses: the fused step when there is one, else ``update`` then ``p.add_(u)``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import optree
import torch

from fzero.optim._segments import active_params, current_segments, param_ranges

Schedule = Callable[[int], float]
"""A learning-rate schedule: a pure function of the step count (steps already taken, from 0) to a float."""

LearningRate = Union[float, Schedule]


class EmptyState(NamedTuple):
    """State of a transform that keeps none."""


class GradientTransformation(NamedTuple):
    """An optimizer (or a piece of one) as pure functions over pytrees of tensors.

    Fields:
      init: ``init(params) -> state``; works on meta tensors (abstract shapes) too.
      update: ``update(updates, state, params=None) -> (updates, new_state)``; pure.
      fused: optional ``fused(grads, state, params) -> new_state`` that performs the whole step in place:
        each params tensor is written in place, state tensors may be updated in place and the returned
        state may alias them. Arithmetic follows ``update`` (and torch.optim), not necessarily bit for bit.
      learning_rate: the float or schedule this optimizer scales by, if it has one (read for metrics);
        ``None`` otherwise.
    """

    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]
    fused: Optional[Callable[[Any, Any, Any], Any]] = None
    learning_rate: Optional[LearningRate] = None


def identity() -> GradientTransformation:
    """Passes updates through unchanged; keeps no state."""

    def init(params: Any) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        del params
        return updates, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states.

    The result has no ``fused`` step (``apply_inplace`` then uses ``update``), except that a chain of one
    transform is that transform. Its ``learning_rate`` is the one member's that has one.
    """
    for i, t in enumerate(transforms):
        if not _is_transform(t):
            raise TypeError(
                f"fzero.optim.chain: argument {i} must be a GradientTransformation such as fzero.optim.scale(0.5), "
                f"got {type(t).__name__}."
            )
    if len(transforms) == 1:
        return transforms[0]
    rates = [t.learning_rate for t in transforms if getattr(t, "learning_rate", None) is not None]

    def init(params: Any) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"fzero.optim.chain: state must be the tuple of {len(transforms)} states that this chain's init "
                f"returned, got {type(state).__name__}. Make it with opt.init(params)."
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update, None, rates[0] if len(rates) == 1 else None)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates`` leaf by leaf, as a new tree in the params' dtypes (pure)."""
    return optree.tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


def apply_inplace(opt: GradientTransformation, grads: Any, state: Any, params: Any) -> Any:
    """One optimizer step that writes every params tensor in place; returns the new state.

    Uses ``opt.fused`` when the optimizer has one; otherwise ``updates, state = opt.update(grads, state,
    params)`` followed by ``p.add_(u)`` per leaf (the same arithmetic as ``apply_updates``). Params are
    written through the given tensor objects, never rebound, so views into larger buffers stay valid. Runs
    under ``torch.no_grad()``.

    Parameters that the current ``Segments`` says skip this step (``active()``; torch.optim's ``p.grad is
    None``) come out as they went in, with every param-shaped part of the state (moments, momentum): their
    ranges are copied before the step and written back after it, whatever the optimizer did to them. Step
    counts are the optimizer's business (``scale_by_adam`` keeps one per parameter). When every parameter
    takes the step (``active()`` is None) nothing is copied.
    """
    if not _is_transform(opt):
        raise TypeError(
            f"fzero.optim.apply_inplace: opt must be a GradientTransformation such as fzero.optim.adamw(1e-3), "
            f"got {type(opt).__name__}."
        )
    p_spec, g_spec = optree.tree_structure(params), optree.tree_structure(grads)
    if p_spec != g_spec:
        raise ValueError(
            f"fzero.optim.apply_inplace: grads must have the tree structure of params.\n  params: {p_spec}\n"
            f"  grads:  {g_spec}\nPass one gradient per parameter, in the same containers."
        )
    with torch.no_grad():
        segments = current_segments()
        active = active_params(segments)
        kept = None if active is None else _keep(active, param_ranges(params, segments), params, state)
        if opt.fused is not None:
            state = opt.fused(grads, state, params)
        else:
            updates, state = opt.update(grads, state, params)
            for p, u in zip(optree.tree_leaves(params), optree.tree_leaves(updates)):
                p.add_(u)
        if kept is not None:
            _put_back(kept, params, state)
    return state


# -- parameters that skip a step --------------------------------------------------------------------------------


def _keep(active: torch.Tensor, ranges: list, params: Any, state: Any) -> list | None:
    """Copies of what a step must not change: the ranges of every skipped parameter (``active`` False) in the
    params and in each param-shaped part of the state. None if nothing skips.

    Generic over optimizers: whatever a transform does to a parameter without a gradient (decay it, decay
    its moments, ...) is undone, as torch.optim never visits it. Only the skipped ranges are copied."""
    live = active.tolist()
    spans = []
    for leaf, leaf_ranges in enumerate(ranges):
        merged: list[list[int]] = []
        for a, b, i in leaf_ranges:
            if i >= 0 and not live[i] and b > a:
                if merged and merged[-1][1] == a:
                    merged[-1][1] = b
                else:
                    merged.append([a, b])
        spans += [(leaf, a, b) for a, b in merged]
    if not spans:
        return None
    trees = [optree.tree_leaves(params)] + _param_shaped(state, params)
    return [(leaf, a, b, [_window(t[leaf], a, b).clone() for t in trees]) for leaf, a, b in spans]


def _put_back(kept: list, params: Any, state: Any) -> None:
    trees = [optree.tree_leaves(params)] + _param_shaped(state, params)
    for leaf, a, b, copies in kept:
        for t, saved in zip(trees, copies):
            _window(t[leaf], a, b).copy_(saved)


def _window(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    if a == 0 and b == t.numel():
        return t
    if not t.is_contiguous():
        raise ValueError(
            "fzero.optim.apply_inplace: a parameter that skips this step lies in part of a non-contiguous leaf "
            f"(shape {tuple(t.shape)}, elements {a}:{b}); its range cannot be kept apart. Give the optimizer "
            "contiguous leaves (ZeRO's flat buffers are)."
        )
    return t.view(-1)[a:b]


def _param_shaped(state: Any, params: Any) -> list[list[torch.Tensor]]:
    """The leaves of each subtree of ``state`` shaped like ``params`` (Adam's mu and nu, a momentum trace, ...)."""
    spec = optree.tree_structure(params)
    shapes = [t.shape for t in optree.tree_leaves(params)]
    found: list[list[torch.Tensor]] = []

    def walk(node: Any) -> None:
        if node is None or isinstance(node, torch.Tensor) and spec.num_nodes > 1:
            return
        leaves, node_spec = optree.tree_flatten(node)
        if node_spec == spec and all(isinstance(t, torch.Tensor) and t.shape == s for t, s in zip(leaves, shapes)):
            found.append(leaves)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                walk(v)

    walk(state)
    return found


# -- shared checks ---------------------------------------------------------------------------------


def _is_transform(t: Any) -> bool:
    return callable(getattr(t, "init", None)) and callable(getattr(t, "update", None))


def check_learning_rate(api: str, value: Any) -> LearningRate:
    """A learning rate is a finite float >= 0 or a schedule (a callable of the step count)."""
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{api}: learning_rate must be a float >= 0 or a schedule callable (step -> float), got "
            f"{type(value).__name__} {value!r}. Pass e.g. 1e-3 or fzero.optim.cosine_decay_schedule(1e-3, 1000)."
        )
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{api}: learning_rate must be a float >= 0 or a schedule callable, got {value!r}. The sign is the "
            f"optimizer's business (it descends); pass e.g. 1e-3."
        )
    return float(value)


def check_float(api: str, name: str, value: Any, *, low: float, high: float = math.inf, high_open: bool = False, hint: str = "") -> float:
    """``value`` is a real number in [low, high] (or [low, high) when ``high_open``)."""
    bracket = ")" if high_open else "]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{api}: {name} must be a float in [{low}, {high}{bracket}, got {type(value).__name__} {value!r}.{hint}")
    above = value >= high if high_open else value > high
    if math.isnan(value) or value < low or above:
        raise ValueError(f"{api}: {name} must be in [{low}, {high}{bracket}, got {value!r}.{hint}")
    return float(value)
