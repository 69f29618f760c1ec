"""The optimizer protocol: a ``GradientTransformation`` is a pair of pure functions, and ``chain`` composes them.

``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)`` never mutate their
inputs. A transform may also carry ``fused(grads, state, params) -> state``: the whole optimizer step done in
place (params written through the given tensor objects, which may be views into larger ZeRO buffers), for
when a pure copy of params and state would cost the memory ZeRO exists to save. ``apply_inplace`` is the one
entry point the train step uses: the fused step when there is one, else ``update`` then ``p.add_(u)``.

## Segments

Where each parameter lies in the leaves an optimizer is given: the context for per-parameter norms.

Element-wise optimizers (Adam, SGD, Lion) don't care how params are cut into leaves. Layer-wise ones (LAMB's
trust ratio ``||p|| / ||update||``) need one norm per *parameter*, but ZeRO hands the optimizer flat buffers:
one leaf per unit, a concatenation of many parameters (plus padding), and at stages 1-3 only this rank's
shard of it. So the optimizer asks the current ``Segments`` for two things and never looks at a layout:

- ``sumsq(tree)``: for each leaf, a 1-D tensor with the sum of squares of every parameter ("segment") the
  leaf holds part of, complete over all ranks (a collective, in a layout-aware implementation);
- ``expand(per_segment, like)``: back to element shape, each element holding its segment's value.

The default, ``WholeLeaves``, treats every leaf as one parameter with no communication: right for an
optimizer applied to a params pytree directly. fzero's train step installs a layout-aware ``Segments``
around the optimizer call with ``use_segments`` (a field of the rank's context, ``fzero.mesh.RankContext``: a local mesh runs its ranks as threads).

A ``Segments`` may also say which parameters take this step (optional methods; without them every
parameter does). torch.optim skips a parameter whose ``grad`` is None: no decay, no moment update, and its
own step count (Adam's ``state["step"]``) does not advance. The train step knows which parameters got no
gradient (``fzero.step._context``) and says so through three methods:

- ``param_count(tree)``: P, the number of parameters the leaves hold parts of (over all ranks);
- ``param_ranges(tree)``: for each leaf (in ``optree.tree_leaves`` order), its element ranges
  ``(start, stop, param)``, in order, covering the leaf; ``param`` indexes ``[0, P)`` (in the order of the
  user's params pytree, the same at every stage and world size), or is -1 for padding;
- ``active()``: a 1-D bool tensor of P entries, False for a parameter that skips this step; or None when
  every parameter takes it (the common case, which then costs nothing).

``apply_inplace`` leaves a skipped parameter and its param-shaped optimizer state as they were, and
optimizers with step counts (``scale_by_adam``, ``scale_by_lamb``) keep one count per parameter.

Parameter groups (``fzero.optim.masked``, ``multi_transform``) are decided on the user's params pytree, which the
optimizer does not see under a train step, so a ``Segments`` may also give (optional methods, with
``WholeLeaves``' answers where missing):

- ``param_tree(tree)``: the user's params pytree that the leaves of ``tree`` hold parts of, as tensors of each
  parameter's shape and dtype (meta tensors under a train step): what a mask function is called on; its leaf
  ``i`` (``optree.tree_leaves`` order) is the parameter ``i`` of ``param_ranges``;
- ``all_reduce(t)``: ``t`` summed over the ranks that hold parts of the same parameters (in place or not; the
  result is returned); the identity where every leaf is whole.

```python
with fzero.optim.use_segments(my_segments):
    updates, state = opt.update(grads, state, params)
```
"""

from __future__ import annotations

import contextlib
import math
import threading
import types
from typing import Any, Callable, Iterator, NamedTuple, Optional, Protocol, Union, runtime_checkable

import optree
import torch

from fzero.mesh import current_context, with_context


_LOW_PRECISION = (torch.float16, torch.bfloat16)


@runtime_checkable
class Segments(Protocol):
    """How the leaves of a params-shaped tree split into parameters (segments), and how to reduce over ranks."""

    def sumsq(self, tree: Any) -> Any:
        """For each leaf of ``tree`` (shaped like params), a 1-D tensor: the sum of squares of each parameter
        (segment) the leaf holds part of, summed over all ranks. Float32 or wider (bf16/fp16 leaves are
        squared in float32)."""
        ...

    def expand(self, per_segment: Any, like: Any) -> Any:
        """``per_segment``: a tree of 1-D tensors as ``sumsq`` returns. Returns a tree shaped like ``like`` where
        each element holds the value of its segment (elements of no segment, such as padding: any finite value)."""
        ...


class WholeLeaves:
    """Every leaf is one whole parameter; nothing to communicate; every parameter takes every step. The default
    ``Segments``."""

    def sumsq(self, tree: Any) -> Any:
        return optree.tree_map(lambda t: _opmath(t).square().sum().reshape(1), tree)

    def expand(self, per_segment: Any, like: Any) -> Any:
        return optree.tree_map(lambda s, t: s.reshape([1] * t.dim()).expand(t.shape), per_segment, like)

    def param_count(self, tree: Any) -> int:
        return len(optree.tree_leaves(tree))

    def param_ranges(self, tree: Any) -> list[list[tuple[int, int, int]]]:
        return [[(0, t.numel(), i)] for i, t in enumerate(optree.tree_leaves(tree))]

    def active(self) -> None:
        return None

    def param_tree(self, tree: Any) -> Any:
        return tree

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def __repr__(self) -> str:
        return "WholeLeaves()"


_WHOLE_LEAVES = WholeLeaves()


def current_segments() -> Segments:
    """The ``Segments`` installed in this thread by ``use_segments``, else ``WholeLeaves()``."""
    return current_context().segments or _WHOLE_LEAVES


@contextlib.contextmanager
def use_segments(segments: Segments) -> Iterator[Segments]:
    """Install ``segments`` for optimizer updates run in this thread, for the length of the ``with`` block (nests)."""
    if not (callable(getattr(segments, "sumsq", None)) and callable(getattr(segments, "expand", None))):
        raise TypeError(
            f"fzero.optim.use_segments: segments must have sumsq(tree) and expand(per_segment, like) methods "
            f"(the fzero.optim.Segments protocol), got {type(segments).__name__}. Pass e.g. fzero.optim.WholeLeaves()."
        )
    with with_context(segments=segments):
        yield segments


# -- the optional per-parameter methods, with WholeLeaves' answers where a Segments lacks them ---------------------


def param_count(tree: Any, segments: Any = None) -> int:
    """P: how many parameters ``tree``'s leaves hold parts of (the length of per-parameter state)."""
    segments = segments or current_segments()
    fn = getattr(segments, "param_count", None)
    return fn(tree) if callable(fn) else _WHOLE_LEAVES.param_count(tree)


def param_ranges(tree: Any, segments: Any = None) -> list[list[tuple[int, int, int]]]:
    """Per leaf of ``tree`` (``optree.tree_leaves`` order): its ``(start, stop, param)`` element ranges."""
    segments = segments or current_segments()
    fn = getattr(segments, "param_ranges", None)
    return fn(tree) if callable(fn) else _WHOLE_LEAVES.param_ranges(tree)


def active_params(segments: Any = None) -> torch.Tensor | None:
    """The 1-D bool mask of parameters that take this step, or None when all of them do."""
    segments = segments or current_segments()
    fn = getattr(segments, "active", None)
    return fn() if callable(fn) else None


def param_tree(tree: Any, segments: Any = None) -> Any:
    """The user's params pytree that ``tree``'s leaves hold parts of (``tree`` itself for ``WholeLeaves``)."""
    segments = segments or current_segments()
    fn = getattr(segments, "param_tree", None)
    return fn(tree) if callable(fn) else _WHOLE_LEAVES.param_tree(tree)


def per_element(values: torch.Tensor, ranges: list[tuple[int, int, int]], pad: float, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``like`` (flattened leaf ``ranges``) holding ``values[param]`` on each range, ``pad``
    on padding (param -1). ``values``: 1-D over the P parameters."""
    index = torch.tensor([p for _, _, p in ranges], dtype=torch.int64)
    lengths = torch.tensor([b - a for a, b, _ in ranges], dtype=torch.int64)
    host = values.detach().to("cpu")
    per_range = torch.where(index >= 0, host[index.clamp(min=0)], torch.tensor(pad, dtype=host.dtype))
    return torch.repeat_interleave(per_range, lengths).to(like.device).reshape(like.shape)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t


# -- per-parameter step counts (the optimizers that keep them: scale_by_adam, scale_by_lamb) ------------------------


def skipped_after(api: str, skipped: torch.Tensor | None, active: torch.Tensor | None) -> torch.Tensor | None:
    """Per-parameter skip counts after this step (``skipped + ~active``); ``skipped`` itself when every
    parameter takes the step.

    Why counts of *skips* next to one ``count``, and not one step count per parameter: ``count`` stays what a
    learning-rate or momentum schedule reads (torch's schedulers are global too), the common case of no skip
    is one comparison (``skipped.any()``) away from the single-count fast path, and a 1-D tensor over the
    parameters, in the order of the user's params pytree, is the same at every stage and world size, so a
    checkpoint saves it as one replicated tensor and reshards without knowing about it.
    """
    if active is None:
        return skipped
    if skipped is None:
        raise ValueError(
            f"{api}: parameters without a gradient must skip this step (as torch.optim skips p.grad is None), but the "
            f"optimizer state has skipped=None: no per-parameter step counts. Make the state with the optimizer's "
            f"init (opt.init(params), or step.init(params) in a train step), not by hand."
        )
    if skipped.numel() != active.numel():
        raise ValueError(
            f"{api}: the optimizer state counts steps for {skipped.numel()} parameters, but this step has "
            f"{active.numel()}. The state was made for other params: make it with this step's init, "
            f"step.init(params) (under a train step, opt.init sees one parameter per flat buffer otherwise)."
        )
    return skipped + (~active).to(skipped.device, skipped.dtype)


def per_param_steps(count: torch.Tensor, skipped: torch.Tensor | None) -> torch.Tensor | None:
    """Each parameter's own step count (``count - skipped``, at least 1), or None when no parameter ever
    skipped a step: then ``count`` is everyone's and the single-count path runs, as before any skip."""
    if skipped is None or skipped.device.type == "meta" or not bool(skipped.any()):
        return None
    return (count - skipped).clamp(min=1)


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


# -- a schedule's value, once per step -----------------------------------------------------------------


class ScheduleValues:
    """The values the schedules (learning rate, momentum) took in one call of a step, shared by its ranks: each
    schedule is called once per step count, however many places read it (the step checks and reports the learning
    rate, then the update applies it) and however many ranks of a ``local_mesh`` run the update.

    Called at each place and on each rank, a schedule with Python state (a closure that counts its calls, as a
    ``LambdaLR`` user writes one, or one that reads a value another thread changes) was called twice per step on one
    rank and four times on a ``local_mesh(2)``, in the order the rank threads ran: ``metrics["lr"]`` was not the
    learning rate applied (5e-3 reported, 2.5e-3 applied), and at stages 0-2 the ranks applied different rates, so
    the replicas of a stage-0 model drifted apart (1e-3 after one SGD step), silently."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, int], tuple[Callable[[int], Any], Any]] = {}
        self._lock = threading.Lock()

    def value(self, schedule: Callable[[int], Any], count: int) -> Any:
        # a bound method is a new object at each ``obj.method`` (``sgd(s.lr)`` for two groups: two objects), so it is
        # known by its object and function, as ``==`` knows it; each is kept below, so no id is reused within a step
        key = ((id(schedule.__self__), id(schedule.__func__)) if isinstance(schedule, types.MethodType)
               else id(schedule), count)
        with self._lock:  # one rank calls it; the others wait for its value
            if key not in self._values:
                self._values[key] = (schedule, schedule(count))  # the schedule kept: its id names no other object
            return self._values[key][1]


def scheduled(schedule: Callable[[int], Any], count: int) -> Any:
    """``schedule(count)``, called once per step for all the places and ranks that read it (``ScheduleValues``, which
    each rank of a step call finds in its context: ``RankContext.schedules``, set by ``fzero.step._step``); outside a
    step (an optimizer run by hand), called each time."""
    values = current_context().schedules
    return schedule(count) if values is None else values.value(schedule, count)


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
