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
    """Every leaf is one whole parameter; nothing to communicate. The default ``Segments``."""

    def sumsq(self, tree: Any) -> Any:
        return optree.tree_map(lambda t: _opmath(t).square().sum().reshape(1), tree)

    def expand(self, per_segment: Any, like: Any) -> Any:
        return optree.tree_map(lambda s, t: s.reshape([1] * t.dim()).expand(t.shape), per_segment, like)

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


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _LOW_PRECISION else t
