"""Where each parameter lies in the leaves an optimizer is given: the context for per-parameter norms.

Element-wise optimizers (Adam, SGD, Lion) don't care how params are cut into leaves. Layer-wise ones (LAMB's
trust ratio ``||p|| / ||update||``) need one norm per *parameter*, but ZeRO hands the optimizer flat buffers:
one leaf per unit, a concatenation of many parameters (plus padding), and at stages 1-3 only this rank's
shard of it. So the optimizer asks the current ``Segments`` for two things and never looks at a layout:

- ``sumsq(tree)``: for each leaf, a 1-D tensor with the sum of squares of every parameter ("segment") the
  leaf holds part of, complete over all ranks (a collective, in a layout-aware implementation);
- ``expand(per_segment, like)``: back to element shape, each element holding its segment's value.

The default, ``WholeLeaves``, treats every leaf as one parameter with no communication: right for an
optimizer applied to a params pytree directly. fzero's train step installs a layout-aware ``Segments``
around the optimizer call with ``use_segments`` (thread-local: a local mesh runs its ranks as threads).

A ``Segments`` may also say which parameters take this step (optional methods; without them every
parameter does). torch.optim skips a parameter whose ``grad`` is None: no decay, no moment update, and its
own step count (Adam's ``state["step"]``) does not advance. The train step knows which parameters got no
gradient (``fzero.step._usage``) and says so through three methods:

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
import threading
from typing import Any, Iterator, Protocol, runtime_checkable

import optree
import torch

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
_local = threading.local()


def current_segments() -> Segments:
    """The ``Segments`` installed in this thread by ``use_segments``, else ``WholeLeaves()``."""
    return getattr(_local, "segments", None) or _WHOLE_LEAVES


@contextlib.contextmanager
def use_segments(segments: Segments) -> Iterator[Segments]:
    """Install ``segments`` for optimizer updates run in this thread, for the length of the ``with`` block (nests)."""
    if not (callable(getattr(segments, "sumsq", None)) and callable(getattr(segments, "expand", None))):
        raise TypeError(
            f"fzero.optim.use_segments: segments must have sumsq(tree) and expand(per_segment, like) methods "
            f"(the fzero.optim.Segments protocol), got {type(segments).__name__}. Pass e.g. fzero.optim.WholeLeaves()."
        )
    previous = getattr(_local, "segments", None)
    _local.segments = segments
    try:
        yield segments
    finally:
        _local.segments = previous


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
