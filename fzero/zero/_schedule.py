"""Stage 3: the gathers of one step on one rank, with prefetch in forward and in backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from fzero.layout._layout import Layout
from fzero.memory import note_gathered

if TYPE_CHECKING:
    from fzero.zero._gathered import _Call


class Schedule:
    """The gathers of one step on one rank, with prefetch, forward and backward.

    ``order`` is the sequence of units the previous step gathered (forward, then backward), carried in
    the state. While this step follows it, every gather starts the next one asynchronously, so it
    overlaps the current unit's compute; at most one prefetched unit is held at a time. A prefetch for
    a backward refill goes straight into the freed buffer of the call it will refill (the latest call of
    that unit still waiting for its backward). The first departure from the order stops prefetch for
    the rest of the step (pending gathers are completed and dropped, on every rank alike), and the order
    this step really took goes into the new state.
    """

    def __init__(self, comm: Any, layout: Layout, shards: dict[str, torch.Tensor], order: tuple[str, ...], prefetch: bool,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.comm = comm
        self.release = release  # disk offload of params: give a shard's pages back once it is gathered
        self.units = {u.name: u for u in layout.units}
        self.shards = shards  # the state's own shard tensors (not the autograd-wrapped ones)
        self.order = order
        self.seen: list[str] = []
        self.waiting: dict[str, list[_Call]] = {}  # calls whose buffer is freed until their backward, by unit
        self.calls: list[_Call] = []  # every call that keeps its graph this step: each is let go at finish
        self.pending: dict[int, tuple[str, Any, _Call | None]] = {}
        self.following = prefetch and bool(order)
        if self.following:
            self._issue(0)

    def _issue(self, pos: int, current: _Call | None = None) -> None:
        if pos >= len(self.order):
            return
        name = self.order[pos]
        unit = self.units[name]
        if current is not None and current.unit.name == name and current.keeps_graph:
            # the unit's backward comes right after its forward (the last unit, at the turn): its buffer is
            # kept rather than freed and gathered again, as FSDP keeps its last layer
            self.pending[pos] = (name, None, current)
            return
        waiting = self.waiting.get(name)
        target = waiting[-1] if waiting and waiting[-1].unalloc() else None
        if target is not None:  # a backward refill: into the buffer the graph already points at
            out = target.alloc()
            with _same_version(out):
                handle = self.comm.all_gather_async(out, self.shards[name], tag="params", label=name)
        else:
            out = note_gathered(torch.empty(unit.padded, dtype=unit.dtype))
            handle = self.comm.all_gather_async(out, self.shards[name], tag="params", label=name)
        self.pending[pos] = (name, handle, target)

    def _stop_following(self, ahead) -> None:
        """Off the recorded order: complete what is in flight (every rank alike), drop it, prefetch no more."""
        self.following = False
        self._drain([ahead] if ahead is not None else [])

    def _drain(self, extra: list) -> None:
        for _, handle, target in extra + list(self.pending.values()):
            if handle is None:  # a kept buffer (see ``_issue``): free it as every other
                target.free()
                continue
            if target is None:
                handle.wait()
                continue
            with _same_version(target.full):
                handle.wait()
            target.free()
        self.pending.clear()

    def _next(self, name: str):
        pos = len(self.seen)
        self.seen.append(name)
        ahead = self.pending.pop(pos, None)
        return pos, ahead

    def gather(self, call: _Call, shard: torch.Tensor) -> torch.Tensor:
        """A unit's buffer for its forward (or a remat recompute): prefetched, or gathered now."""
        name = call.unit.name
        pos, ahead = self._next(name)
        if self.following and ahead is not None and ahead[0] == name and ahead[2] is None:
            full = ahead[1].wait()
        else:
            if self.following:
                self._stop_following(ahead)
            full = note_gathered(torch.empty(call.unit.padded, dtype=shard.dtype, device=shard.device))
            self.comm.all_gather(full, shard, tag="params", label=name)
        self._after(name, pos, call)
        if call.keeps_graph:
            self.waiting.setdefault(name, []).append(call)
            self.calls.append(call)
        return full

    def refill(self, call: _Call) -> None:
        """Gather ``call``'s unit back into its freed buffer, just before its backward."""
        name = call.unit.name
        pos, ahead = self._next(name)
        calls = self.waiting.get(name, [])
        if call in calls:
            calls.remove(call)
        full = call.full
        if self.following and ahead is not None and ahead[1] is None and ahead[2] is call and not call.unalloc():
            pass  # kept since its forward (see ``_issue``)
        elif self.following and ahead is not None and ahead[0] == name and ahead[2] in (call, None):
            with _same_version(full), torch.no_grad():
                got = ahead[1].wait()
                if ahead[2] is None:  # gathered ahead while the forward still used this buffer: copy it in
                    call.alloc().copy_(got)
            del got, ahead  # the pending gather holds its buffer: drop it before the next one is issued
        else:
            if self.following:
                self._stop_following(ahead)
            out = call.alloc()
            with _same_version(out):
                self.comm.all_gather(out, self.shards[name], tag="params", label=name)
        self._after(name, pos)

    def _after(self, name: str, pos: int, current: _Call | None = None) -> None:
        if self.release is not None:
            self.release(self.shards[name])
        if self.following:
            self._issue(pos + 1, current)

    def kept(self, call: _Call) -> bool:
        """Whether ``call``'s buffer stays gathered after its forward, for its backward next (see ``_issue``)."""
        return any(handle is None and target is call for _, handle, target in self.pending.values())

    def finish(self) -> tuple[str, ...]:
        """Complete what is still in flight and free every buffer; the order this step took."""
        self._drain([])
        for c in self.calls:  # those whose backward never came, or came without reaching their params
            c.done()
            c.free()
        self.calls.clear()
        self.waiting.clear()
        return tuple(self.seen)


def _same_version(buffer: torch.Tensor):
    """Writes into a unit's buffer that restore the values its forward read: autograd's saved views of it
    must not count them as modifications (FSDP refills its unsharded params the same way)."""
    return torch.autograd._unsafe_preserve_version_counter(buffer)
