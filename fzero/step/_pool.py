"""Flat host buffers that a step lends itself across units and across calls: memory, never values.

Why a step keeps them: glibc serves an allocation above its mmap threshold (at most 32 MiB by default, 128 KiB
under ``MALLOC_MMAP_THRESHOLD_=131072``) with fresh pages from the kernel and unmaps them when it is freed, and
below it trims the heap's top on free. A buffer made anew per unit per step (a unit's flat gradient, its
reduce-scattered shard, a received chunk) is then faulted in page by page, zeroed by the kernel, at every step:
measured on the 218M workload, that churn was most of what stages 1-2 paid over DDP when both ran in one process
(``docs/benchmarks.md``, issue 15). PyTorch's CUDA caching allocator already reuses device memory, so on a
device the pool keeps nothing and hands out plain ``torch.empty`` tensors.

The contract, what makes lending safe:

* ``take`` returns a buffer whose contents are undefined: its user overwrites all of it before reading;
* ``give`` is its user's last touch; the pool lends it again only once no other tensor (the taker's, a view,
  an autograd record, an optimizer state that kept it) refers to its storage, which ``take`` checks: a buffer
  something still holds is dropped from the pool, never written while it is read;
* a buffer is never part of a ``TrainState`` nor of the metrics a step returns.

So no value crosses from one step to the next through a pool, and a step's results are the same with or without
it (``tests/test_pool.py``). A pool is thread safe (the ranks of a ``local_mesh`` share their step's pool, each
taking its own buffers). It holds at most what was in use at once, per size: the units' sizes are few and fixed.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from fzero.mesh import events as _events


class Pool:
    """Free host buffers by (elements, dtype); see the module docstring for the contract."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        # data pointer -> (elements, dtype) of each buffer out on loan: only those come back. A buffer dropped without
        # ``give`` leaves its pointer here; another tensor later allocated at that address, of another size or dtype,
        # is refused (adopted, it would be held forever: nothing takes its size)
        self._lent: dict[int, tuple[int, torch.dtype]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, *, dtype: torch.dtype, device: torch.device, report: bool = True) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements, uninitialised: a free one nothing else refers to, or a new one.
        ``report``: tell a memory measurement (``fzero.memory.LiveBytes``) the buffer is in use, as an
        allocation would (False: its memory is about to move into another storage, which reports it)."""
        device = torch.device(device)
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        buffer = None
        with self._lock:
            free = self._free.get((numel, dtype), [])
            while free and buffer is None:
                candidate = free.pop()
                # 2: the pool's own tensor and the storage object made to ask. More: a tensor given back is still
                # held somewhere (a view, a saved tensor, a state that kept it): it is that holder's now, never lent again
                if torch._C._storage_Use_Count(candidate.untyped_storage()._cdata) == 2:
                    buffer = candidate
        if buffer is None:
            buffer = torch.empty(numel, dtype=dtype)
        with self._lock:
            self._lent[buffer.data_ptr()] = (numel, dtype)
        if report:
            _events.lent(buffer)
        return buffer

    def give(self, buffer: torch.Tensor | None) -> None:
        """``buffer`` (from ``take``) is no longer used by its taker; anything else is ignored. Whether something
        else still holds it is asked when it would be lent again (``take``), when its taker's references are gone."""
        if buffer is None or buffer.device.type != "cpu" or buffer._base is not None:
            return
        with self._lock:
            if self._lent.get(buffer.data_ptr()) != (buffer.numel(), buffer.dtype):
                return
            del self._lent[buffer.data_ptr()]
            self._free[(buffer.numel(), buffer.dtype)].append(buffer.detach())  # its own alias, not the taker's tensor
        _events.returned(buffer)

    def forget(self, buffer: torch.Tensor) -> None:
        """``buffer`` (from ``take``) will not be given back (its taker lets it go with its last reference): its record
        of the loan goes, so that the records do not grow with every such buffer."""
        if buffer.device.type != "cpu":
            return
        with self._lock:
            if self._lent.get(buffer.data_ptr()) == (buffer.numel(), buffer.dtype):
                del self._lent[buffer.data_ptr()]

    def clear(self) -> None:
        """Let go of every free buffer (their memory goes back to the allocator); buffers out on loan are unaffected."""
        with self._lock:
            self._free.clear()

    @property
    def loans(self) -> int:
        """How many buffers are out on loan now (taken, neither given back nor forgotten)."""
        with self._lock:
            return len(self._lent)

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers it holds now."""
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)


# Stage 3 frees a gathered unit's memory between its forward and its backward while the graph keeps views of
# the buffer, so the memory, not the buffer, goes to the pool and back: the storage's data pointer is swapped
# with an empty one's (what ``resize_(0)`` and ``resize_(n)`` do with a fresh allocation). The views never see a
# write: autograd's version counter is untouched, as under ``resize_``.
_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def can_move(pool: Pool | None, buffer: torch.Tensor) -> bool:
    """Whether ``buffer``'s memory can move to and from ``pool`` (host memory, a pool, this torch)."""
    return pool is not None and _SWAP and buffer.device.type == "cpu" and buffer._base is None and buffer.numel() > 0


def free_memory(pool: Pool | None, buffer: torch.Tensor) -> None:
    """Leave ``buffer``'s storage empty: its memory into ``pool`` where it can move (``can_move``), else ``resize_(0)``."""
    if not can_move(pool, buffer):
        forget(pool, buffer)  # (without _swap_data_ptr_, torch < 2.6 or 2.11: a buffer taken from the pool never comes back)
        buffer.untyped_storage().resize_(0)
        return
    holder = torch.empty(0, dtype=buffer.dtype)
    buffer.untyped_storage()._swap_data_ptr_(holder.untyped_storage())  # type: ignore[attr-defined]  # torch >= 2.6, checked by can_move
    holder.set_(holder.untyped_storage(), 0, (buffer.numel(),))  # type: ignore[call-overload]  # torch's stubs lack the storage form
    pool.give(holder)  # type: ignore[union-attr]  # can_move holds only with a pool


def alloc_memory(pool: Pool | None, buffer: torch.Tensor) -> None:
    """Give ``buffer``'s empty storage memory (contents undefined): from ``pool`` where it can move, else ``resize_(n)``."""
    if not can_move(pool, buffer):
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        return
    move_into(buffer, pool.take(buffer.numel(), dtype=buffer.dtype, device=buffer.device, report=False))  # type: ignore[union-attr]  # as above


def move_into(buffer: torch.Tensor, source: torch.Tensor) -> None:
    """``source``'s memory (and values) into ``buffer``'s empty storage, without a copy; ``source`` is left empty."""
    if buffer.untyped_storage().nbytes() or source.untyped_storage().nbytes() != buffer.numel() * buffer.element_size():
        raise RuntimeError("fzero internal error: a unit's memory can move only into its freed buffer, from one of its size.")
    buffer.untyped_storage()._swap_data_ptr_(source.untyped_storage())  # type: ignore[attr-defined]  # see free_memory


def take(pool: Pool | None, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``pool.take``, or a new buffer without a pool."""
    return torch.empty(numel, dtype=dtype, device=device) if pool is None else pool.take(numel, dtype=dtype, device=device)


def give(pool: Pool | None, buffer: torch.Tensor | None) -> None:
    if pool is not None:
        pool.give(buffer)


def forget(pool: Pool | None, buffer: torch.Tensor) -> None:
    if pool is not None:
        pool.forget(buffer)
