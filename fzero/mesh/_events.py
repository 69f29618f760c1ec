"""Where fzero reports the parameter buffers it gathers, frees and refills, to whatever measures memory.

The core calls ``gathered(buffer)`` when it allocates a buffer to gather a unit into, ``resized(buffer)``
when stage 3 frees a buffer's storage between a unit's forward and its backward or gives it back its
memory, and ``lent(buffer)`` / ``returned(buffer)`` when a step's pool (``fzero.step._pool``) lends a buffer it
already held (no allocation a dispatch mode would see) or gets one back. Nothing in the core knows who listens: a measuring tool (``fzero.memory.GatheredBytes`` and
``LiveBytes``) enters ``watching(observer)`` in the thread it measures (on a ``local_mesh``, through the
mesh's ``rank_context``) and gets ``observer.on_gathered(buffer)`` and ``observer.on_resized(buffer)``.
With no observer, both calls cost one attribute lookup.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

_local = threading.local()  # observers per thread: the ranks of a local mesh are threads


@contextlib.contextmanager
def watching(observer: Any) -> Iterator[Any]:
    """Send this thread's buffer events to ``observer`` (which has ``on_gathered`` and ``on_resized``) inside the block."""
    observers = getattr(_local, "observers", ())
    _local.observers = (*observers, observer)
    try:
        yield observer
    finally:
        _local.observers = observers


def gathered(buffer: torch.Tensor) -> torch.Tensor:
    """Report a freshly allocated buffer that a unit is gathered into; returns it."""
    for observer in getattr(_local, "observers", ()):
        observer.on_gathered(buffer)
    return buffer


def lent(buffer: torch.Tensor) -> None:
    """Report a buffer a pool lends again: in use from now on, as a new allocation would be."""
    for observer in getattr(_local, "observers", ()):
        getattr(observer, "on_lent", _ignore)(buffer)


def returned(buffer: torch.Tensor) -> None:
    """Report a buffer given back to a pool: no longer in use, as if freed."""
    for observer in getattr(_local, "observers", ()):
        getattr(observer, "on_returned", _ignore)(buffer)


def _ignore(buffer: torch.Tensor) -> None:
    pass


def resized(buffer: torch.Tensor) -> None:
    """Report that a gathered buffer's storage was freed (``resize_(0)``) or given its memory back."""
    for observer in getattr(_local, "observers", ()):
        observer.on_resized(buffer)
