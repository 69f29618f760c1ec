"""Stage 3: the gathers of one step on one rank (``Schedule``), with prefetch in forward and in backward, and the
buffer of each unit call (``UnitCall``), whose storage the schedule frees and refills."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from fzero.layout import Binding, bound, Layout, Unit
from fzero.mesh import events as _events, Pending
from fzero.step import GatherBucket, Pool, alloc_memory, can_move, free_memory, move_into, take

class UnitCall:
    """One invocation of one unit at stage 3, and its gathered buffer.

    ``full`` is the buffer the unit was gathered into for its forward. The forward's graph keeps views of
    it (a linear layer saves its weight), so the buffer object lives as long as the graph; what is freed
    between the forward and the backward is its *storage* (``resize_(0)``), refilled in place just before
    the unit's backward needs it and freed again once the unit's gradient is reduce-scattered.
    """

    def __init__(self, inner: nn.Module, unit: Unit, params: Any) -> None:
        self.inner, self.unit, self.params = inner, unit, params
        self.full: torch.Tensor | None = None
        # the call keeps its graph (grad enabled, no remat): its buffer waits, freed, for its backward. Decided
        # before the gather Function runs: inside a Function's forward grad mode is always off.
        self.keeps_graph = False
        self.refilled = False  # set when backward refills the buffer: checked before the gradient leaves the unit
        self.tensors: dict[str, torch.Tensor] = {}  # what the unit's module ran with: views of ``full``, its buffers
        self._bound: Any = None
        self._binding: Binding | None = None  # where the unit's module keeps each tensor: found once per call

    @property
    def schedule(self) -> "Schedule":
        return self.params.schedule

    def run(self, views: tuple[torch.Tensor, ...], args: tuple, kwargs: dict, *, keep: bool = False) -> Any:
        """The unit's forward on ``views`` (its params, in slot order); ``keep``: hold its tensors for ``bind`` in its backward."""
        prefix = len(self.unit.name) + 1
        self.tensors = {s.path[prefix:]: v for s, v in zip(self.unit.slots, views)}
        self.tensors.update(self.params.unit_buffers(self.unit))
        self.bind()
        try:
            return self.params.runner(self.inner, self.unit)(*args, **kwargs)
        finally:
            self.unbind()
            if not keep:
                self.tensors = {}

    def done(self) -> None:
        """The unit's backward is over (or will not come): let go of its views. They lead to the autograd
        graph, whose nodes hold this call: a cycle through C++ objects that Python's collector cannot break,
        which would keep the step's state (and a disk-offloaded state's files) alive."""
        self.unbind()
        self.tensors = {}

    def bind(self) -> None:
        """The unit's module holds its gathered params (and its buffers of the step) while the unit is gathered:
        for its forward, and again for its backward, where ``torch.utils.checkpoint`` (HF's gradient
        checkpointing) calls it once more. Otherwise it holds meta tensors, so that a read outside the unit
        gets the error of ``_UnitSkin.__getattr__`` (``fzero.zero._sharded``), never a view of a freed buffer."""
        if self._bound is None and self.tensors:
            if self._binding is None or not self._binding.current():
                self._binding = Binding.of(self.inner)
            self._bound = bound(self.inner, self.tensors, self._binding)
            self._bound.__enter__()

    def unbind(self) -> None:
        if self._bound is not None:
            bound, self._bound = self._bound, None
            bound.__exit__(None, None, None)

    def free(self) -> None:
        """Give the gathered buffer's memory back (to the step's pool, on the host); the graph's views of it stay,
        pointing at nothing until refilled."""
        if self.full is not None and self.full.untyped_storage().nbytes():
            free_memory(self.schedule.pool, self.full)
            _events.resized(self.full)

    def unalloc(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() == 0

    def alloc(self) -> torch.Tensor:
        """The buffer with its memory back (contents undefined until a gather fills it)."""
        full = self.full
        if not full.untyped_storage().nbytes():
            alloc_memory(self.schedule.pool, full)
            _events.resized(full)
        return full


class Schedule:
    """The gathers of one step on one rank, with prefetch, forward and backward.

    ``order`` is the sequence of units the previous step gathered (forward, then backward), carried in
    the state. While this step follows it, every gather starts the next one asynchronously, so it
    overlaps the current unit's compute; at most one prefetched unit is held at a time. A prefetch for
    a backward refill goes straight into the freed buffer of the call it will refill (the latest call of
    that unit still waiting for its backward). The first departure from the order stops prefetch for
    the rest of the step (pending gathers are completed and dropped, on every rank alike), and the order
    this step really took goes into the new state.

    ``bucket_elements`` (``shard_grads(bucket_elements=...)``): a prefetch takes the next gathers of the order
    together, until they hold at least that many elements, in one all-gather (``GatherBucket``), so a model of many
    small units pays one collective's latency per bucket rather than per unit. Each unit's buffer is then filled
    from the bucket's, the same values its own gather would give.
    """

    def __init__(self, comm: Any, layout: Layout, shards: dict[str, torch.Tensor], order: tuple[str, ...], prefetch: bool,
                 release: Callable[[torch.Tensor], None] | None = None, device: torch.device = torch.device("cpu"),
                 pool: Pool | None = None, bucket_elements: int = 0, cast: Callable[[str], torch.Tensor | None] | None = None) -> None:
        self.comm = comm
        # stage 3 with fp32 masters beside the shards: what a unit's gather sends, its master cast to the compute dtype
        # (``fzero.zero._shard_params.CastFromMasters``; None for a unit whose shard is kept)
        self.cast = cast
        self.bucket_elements = bucket_elements
        self.pool = pool  # where gathered buffers' memory comes from and goes back to (fzero.step._pool)
        self.device = device  # where units are gathered; a shard held elsewhere (on the host) is copied here first
        self.release = release  # disk offload of params: give a shard's pages back once it is gathered
        self.units = {u.name: u for u in layout.units}
        self.shards = shards  # the state's own shard tensors (not the autograd-wrapped ones)
        self.order = order
        self.seen: list[str] = []
        self.waiting: dict[str, list[UnitCall]] = {}  # calls whose buffer is freed until their backward, by unit
        self.calls: list[UnitCall] = []  # every call that keeps its graph this step: each is let go at finish
        self.pending: dict[int, tuple[str, Any, UnitCall | None]] = {}
        # one rank: a gather is a copy (or a cast) of the shard, with nothing to overlap; prefetched, it would only
        # hold a second unit beside the one that runs
        self.following = prefetch and bool(order) and comm.size > 1
        if self.following:
            self._issue(0)

    def _issue(self, pos: int, current: UnitCall | None = None) -> None:
        if pos >= len(self.order) or pos in self.pending:  # (already issued with a bucket)
            return
        name = self.order[pos]
        if current is not None and current.unit.name == name and current.keeps_graph:
            # the unit's backward comes right after its forward (the last unit, at the turn): its buffer is
            # kept rather than freed and gathered again, as FSDP keeps its last layer
            self.pending[pos] = (name, None, current)
            return
        span = self._bucket_span(pos)
        if len(span) > 1:
            self._issue_bucket(span)
            return
        unit = self.units[name]
        target = self._target(name)
        if target is not None:  # a backward refill: into the buffer the graph already points at
            out = target.alloc()
            with _same_version(out):
                handle = self.comm.all_gather_async(out, self.input_of(name), tag="params", label=name)
        else:
            out = self._fresh(unit)
            handle = self.comm.all_gather_async(out, self.input_of(name), tag="params", label=name)
        self.pending[pos] = (name, handle, target)

    def _target(self, name: str) -> "UnitCall | None":
        """The call whose freed buffer a gather of ``name`` refills (its latest call still waiting for its backward),
        or None: a fresh buffer.

        Always a fresh one under torch.distributed: its async collectives bump their output's version counter when
        the work completes, on the backend's thread, outside any ``_same_version``; into the buffer the graph's views
        point at, that is "a view ... modified inplace" in backward. The refill then moves (or copies) it in."""
        waiting = self.waiting.get(name)
        target = waiting[-1] if waiting and waiting[-1].unalloc() else None
        return target if target is not None and getattr(self.comm, "async_writes_keep_version", False) else None

    def _bucket_span(self, pos: int) -> list[int]:
        """The positions of the order gathered together from ``pos``: consecutive gathers of distinct units of one
        dtype, until they hold ``bucket_elements``. A bucket ends before the turn (a unit gathered twice in a row,
        whose buffer ``_issue`` keeps instead)."""
        span = [pos]
        if not self.bucket_elements:
            return span
        first = self.units[self.order[pos]]
        total = first.padded
        while total < self.bucket_elements and span[-1] + 1 < len(self.order):
            nxt = span[-1] + 1
            name = self.order[nxt]
            unit = self.units[name]
            if name in {self.order[p] for p in span} or unit.dtype != first.dtype:
                break
            span.append(nxt)
            total += unit.padded
        return span

    def _issue_bucket(self, span: list[int]) -> None:
        """One all-gather for the units at positions ``span`` (``GatherBucket``); each unit's buffer is filled from it
        when the unit's gather is waited for."""
        names = [self.order[p] for p in span]
        bucket = GatherBucket(self.comm, [self.input_of(n) for n in names], pool=self.pool, label="+".join(names),
                              mark=_events.gathered)
        for p, name, at in zip(span, names, bucket.offsets):
            unit, target = self.units[name], self._target(name)
            # the unit's buffer gets its memory when its part is filled in, not now: then the bucket and its units'
            # buffers are not all held while the gather runs
            dest = target.alloc if target is not None else functools.partial(self._fresh, unit)
            self.pending[p] = (name, Pending(functools.partial(_fill, bucket, at, dest)), target)

    def _fresh(self, unit: Unit) -> torch.Tensor:
        """A fresh buffer to gather ``unit`` into, from the step's pool (counted as gathered memory)."""
        return _events.gathered(take(self.pool, unit.padded, dtype=unit.dtype, device=self.device))

    def input_of(self, name: str) -> torch.Tensor:
        """What this rank sends to a gather of unit ``name``: its shard on the gather's device, or its master cast."""
        cast = self.cast(name) if self.cast is not None else None
        return cast if cast is not None else self._here(self.shards[name])

    def _here(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard on the gather's device: itself, or (params offloaded to the host) an asynchronous copy up."""
        return shard if shard.device == self.device else shard.to(self.device, non_blocking=True)

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

    def gather(self, call: UnitCall, shard: torch.Tensor) -> torch.Tensor:
        """A unit's buffer for its forward (or a remat recompute): prefetched, or gathered now."""
        name = call.unit.name
        pos, ahead = self._next(name)
        if self.following and ahead is not None and ahead[0] == name and ahead[2] is None:
            full = ahead[1].wait()
        else:
            if self.following:
                self._stop_following(ahead)
            full = _events.gathered(take(self.pool, call.unit.padded, dtype=shard.dtype, device=self.device))
            self.comm.all_gather(full, self.input_of(name), tag="params", label=name)
        self._after(name, pos, call)
        if call.keeps_graph:
            self.waiting.setdefault(name, []).append(call)
            self.calls.append(call)
        return full

    def refill(self, call: UnitCall) -> None:
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
                if ahead[2] is None and call.unalloc() and can_move(self.pool, got):  # gathered ahead: its memory
                    move_into(call.full, got)  # becomes the freed buffer's, no copy
                    _events.resized(got)
                    _events.resized(call.full)
                elif ahead[2] is None:  # gathered ahead while the forward still used this buffer: copy it in
                    call.alloc().copy_(got)
            del got, ahead  # the pending gather holds its buffer: drop it before the next one is issued
        else:
            if self.following:
                self._stop_following(ahead)
            out = call.alloc()
            with _same_version(out):
                self.comm.all_gather(out, self.input_of(name), tag="params", label=name)
        self._after(name, pos)

    def _after(self, name: str, pos: int, current: UnitCall | None = None) -> None:
        if self.release is not None:
            self.release(self.shards[name])
        if self.following:
            self._issue(pos + 1, current)

    def kept(self, call: UnitCall) -> bool:
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


def _fill(bucket: GatherBucket, at: int, dest: Callable[[], torch.Tensor]) -> torch.Tensor:
    """One unit's share of a ``GatherBucket`` (what ``Schedule.pending`` holds where a unit's own gather would be):
    its buffer, given its memory now, filled from the bucket."""
    return bucket.fill(at, dest())
