"""Where fzero reports the parameter buffers it gathers, frees and refills, to whatever measures memory.

The core calls ``gathered(buffer)`` when it allocates a buffer to gather a unit into, and ``resized(buffer)``
when stage 3 frees a buffer's storage between a unit's forward and its backward or gives it back its
memory. Nothing in the core knows who listens: a measuring tool (``fzero.memory.GatheredBytes`` and
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


def resized(buffer: torch.Tensor) -> None:
    """Report that a gathered buffer's storage was freed (``resize_(0)``) or given its memory back."""
    for observer in getattr(_local, "observers", ()):
        observer.on_resized(buffer)
