"""One collectives protocol, two implementations, and a counter.

Every collective fzero issues goes through ``Comm``: ``all_gather``, ``reduce_scatter``, ``all_reduce``
and ``broadcast`` on flat tensors, all reductions being sums (averaging is done by the caller, so that
every stage divides the same sums by the same N and stays bitwise comparable). ``ThreadComm`` runs
the ranks of a ``local_mesh`` as threads that meet at a barrier and reduce over shared buffers in rank
order 0, 1, ..., N-1 (deterministic); ``DistComm`` calls ``torch.distributed``.

Every call is reported to the mesh's ``Counter`` (when it has one) with the number of elements each
rank moves on a ring: all-gather and reduce-scatter move T·(N-1)/N of a T-element buffer, all-reduce
twice that. Tests assert communication volume from it.

Ranks must agree, or the mesh says so. A collective takes an optional ``label`` (what it moves, e.g. a
unit's name). On the thread mesh every collective is matched across ranks by op, tag, label, size and
dtype (and ``src`` for a broadcast), and when a rank's program ends it meets the others once more: a
mismatch, or one rank finishing while another still communicates, raises ``RanksDisagree`` on every
rank, naming what each rank called, instead of silently pairing unrelated buffers of the same size (a
rank-dependent model, LayerDrop decided per rank) or hanging until the timeout. On ``torch.distributed``
a per-call check would cost a round trip per collective; there ``Step.init`` checks once, with
``agree``, that every rank runs the same layout and settings.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter as _Tally
from typing import Any, Callable, Protocol

import torch


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective as one rank saw it."""

    rank: int
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    tag: str  # what it carried: "grads", "params", "metrics", "init"
    numel: int  # elements of the whole (unsharded) buffer
    itemsize: int
    world_size: int
    label: str | None = None  # what the call moves, e.g. a unit's name (None: unlabelled)

    @property
    def ring_elements(self) -> float:
        """Elements this rank sends (= receives) on a ring for this call."""
        n = self.world_size
        factor = 2 if self.op == "all_reduce" else 1
        return factor * self.numel * (n - 1) / n


class Counter:
    """Records every collective of a mesh. Thread-safe; ``calls`` in the order they were made."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()

    def elements(self, *, rank: int = 0, tag: str | None = None, op: str | None = None) -> float:
        """Ring elements moved by ``rank``, optionally only for one tag or op."""
        return sum(c.ring_elements for c in self._select(rank, tag, op))

    def count(self, *, rank: int = 0, tag: str | None = None, op: str | None = None) -> int:
        return len(self._select(rank, tag, op))

    def summary(self, *, rank: int = 0) -> dict[tuple[str, str], int]:
        """Number of calls per (op, tag) for ``rank``."""
        return dict(_Tally((c.op, c.tag) for c in self._select(rank, None, None)))

    def _select(self, rank, tag, op):
        with self._lock:
            return [c for c in self.calls if c.rank == rank and (tag is None or c.tag == tag) and (op is None or c.op == op)]


class Comm(Protocol):
    """``tag``: the kind of traffic ("params", "grads", ...), for the counter; ``label``: what exactly is
    moved (e.g. a unit's name), matched across ranks on the thread mesh and kept in the counter."""

    rank: int
    size: int

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, tag: str, label: str | None = None) -> torch.Tensor:
        """Fill ``out`` (N·len(shard) elements) with every rank's shard, rank order. ``shard`` may be a view of ``out``."""

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, *, tag: str, label: str | None = None) -> "Pending":
        """Start ``all_gather``; ``.wait()`` on the result returns ``out`` once filled. Ranks must issue in the same order."""

    def reduce_scatter(self, full: torch.Tensor, *, tag: str, label: str | None = None) -> torch.Tensor:
        """Return this rank's 1/N slice of the sum over ranks of ``full`` (``full`` itself when N = 1)."""

    def all_reduce(self, tensor: torch.Tensor, *, tag: str, label: str | None = None) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; returns it."""

    def broadcast(self, tensor: torch.Tensor, *, src: int, tag: str, label: str | None = None) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s, in place; returns it."""

    def agree(self, fields: list[tuple[str, Any]], *, api: str, fix: str) -> None:
        """Raise ``RanksDisagree`` naming the first field (in rank 0's order) whose value differs on some rank.

        ``fields`` are small picklable (name, value) pairs describing what every rank must share. Not a
        counted collective: it moves a description, not training data.
        """


class Pending:
    """An issued collective: ``wait()`` returns its output."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self._wait = wait
        self._out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._wait()
        return self._out


class _Recording:
    """Mixin: report each call to the counter before doing it."""

    counter: Counter | None

    def _note(self, op: str, tag: str, numel: int, tensor: torch.Tensor, label: str | None = None) -> None:
        if self.counter is not None:
            self.counter.record(Call(self.rank, op, tag, numel, tensor.element_size(), self.size, label))


# -- agreement --------------------------------------------------------------------------------------


class RanksDisagree(RuntimeError):
    """Ranks of one mesh issued different collectives, or hold different layouts or settings."""


def first_difference(described: list[list[tuple[str, Any]]]) -> tuple[str, int, Any, Any] | None:
    """(field, rank, rank 0's value, that rank's value) of the first field, in rank 0's order, that some rank
    has differently or lacks; a field only another rank has comes after. None when every rank agrees."""
    if all(d == described[0] for d in described[1:]):
        return None
    mine = dict(described[0])
    names = [k for k, _ in described[0]] + [k for d in described[1:] for k, _ in d if k not in mine]
    missing = "(nothing: no such field)"
    for name in dict.fromkeys(names):
        for r, d in enumerate(described[1:], start=1):
            theirs = dict(d)
            if mine.get(name, missing) != theirs.get(name, missing):
                return name, r, mine.get(name, missing), theirs.get(name, missing)
    return None


def disagreement(described: list[list[tuple[str, Any]]], *, api: str, fix: str) -> RanksDisagree | None:
    diff = first_difference(described)
    if diff is None:
        return None
    field, r, v0, vr = diff
    return RanksDisagree(f"{api}: ranks disagree on {field}: rank 0 has {v0}, rank {r} has {vr}. {fix}")


@dataclasses.dataclass(frozen=True)
class _Sig:
    """What one rank asked of a collective: every rank of the thread mesh must ask the same."""

    op: str
    tag: str
    label: str | None
    numel: int
    dtype: torch.dtype | None
    src: int | None = None

    def __str__(self) -> str:
        if self.op == _FINISHED:
            return "finished its program (no more collectives)"
        if self.op == _AGREE:
            return f"compared its layout and settings ({self.tag})"
        label = "" if self.label is None else f" {self.label!r}"
        src = "" if self.src is None else f" from rank {self.src}"
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.op} {self.tag}{label}{src} {self.numel} x {dtype}"


_FINISHED = "finished"
_AGREE = "agree"
_MISMATCH_FIX = (
    "Every rank must run the same model with the same units and issue the same collectives in the same order. "
    "Look for what differs per rank: a model or settings built differently on one rank, a unit skipped on some "
    "ranks only (LayerDrop, early exit, routing), or control flow that depends on the rank or on its data."
)


# -- threads ---------------------------------------------------------------------------------------


class MeshTimeout(RuntimeError):
    """A rank waited longer than the mesh's timeout at a collective: the ranks disagree on what to call."""


class Rendezvous:
    """Shared meeting point of the N rank threads of one ``local_mesh`` call."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.slots: list[Any] = [None] * size  # each rank's tensor (or description, for ``agree``)
        self.sigs: list[_Sig | None] = [None] * size  # what each rank called, matched after the barrier
        self.where: list[str] = ["not started"] * size
        self.barrier = threading.Barrier(size, timeout=timeout)

    def abort(self) -> None:
        self.barrier.abort()

    def wait(self, rank: int) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise MeshTimeout(
                f"fzero.local_mesh: rank {rank} stopped waiting at {self.where[rank]} (timeout {self.timeout:g} s, or "
                f"another rank failed). Where each rank was: {dict(enumerate(self.where))}. Ranks must issue the same "
                f"collectives in the same order; raise the limit with fzero.local_mesh(n, timeout=...) if a step is just slow."
            ) from None


class ThreadComm(_Recording):
    def __init__(self, rank: int, rendezvous: Rendezvous, counter: Counter | None) -> None:
        self.rank = rank
        self.size = rendezvous.size
        self.rv = rendezvous
        self.counter = counter
        self._seq = 0

    def _exchange(self, sig: _Sig, payload: Any) -> list[Any]:
        self._seq += 1
        self.rv.where[self.rank] = f"collective #{self._seq} ({sig})"
        self.rv.slots[self.rank] = payload
        self.rv.sigs[self.rank] = sig
        self.rv.wait(self.rank)
        sigs = list(self.rv.sigs)
        if any(other != sigs[0] for other in sigs):  # every rank sees the same sigs, so every rank raises
            raise RanksDisagree(self._mismatch(sigs))
        return list(self.rv.slots)

    def _mismatch(self, sigs: list[_Sig]) -> str:
        shown = [0] + [r for r in range(1, self.size) if sigs[r] != sigs[0]][:3]
        calls = ", ".join(f"rank {r} {sigs[r]}" for r in shown)
        more = self.size - len(shown) - sum(1 for r in range(1, self.size) if sigs[r] == sigs[0])
        rest = f" (and {more} more ranks that differ)" if more > 0 else ""
        return f"fzero.local_mesh({self.size}): ranks disagree at collective #{self._seq}: {calls}{rest}. {_MISMATCH_FIX}"

    def _done(self) -> None:
        # Second barrier: nobody may overwrite its slot (or its buffer) while another rank still reads it.
        self.rv.wait(self.rank)
        self.rv.where[self.rank] = f"after collective #{self._seq}"

    @staticmethod
    def _sig(op, tag, label, numel, tensor, src=None) -> _Sig:
        return _Sig(op, tag, label, numel, tensor.dtype, src)

    def finish(self) -> None:
        """The end of this rank's program: meet the others once more, so that a rank still waiting at a
        collective learns at once that this one will never join it (instead of timing out)."""
        if self.size > 1:
            self._exchange(_Sig(_FINISHED, "", None, 0, None), None)
            self._done()

    def agree(self, fields, *, api, fix):
        if self.size == 1:
            return
        described = self._exchange(_Sig(_AGREE, api, None, 0, None), list(fields))
        self._done()
        error = disagreement(described, api=api, fix=fix)
        if error is not None:
            raise error

    def all_gather(self, out, shard, *, tag, label=None):
        self._note("all_gather", tag, out.numel(), out, label)
        if self.size == 1:  # one rank: nothing to exchange
            return out if out.data_ptr() == shard.data_ptr() else out.copy_(shard)
        slots = self._exchange(self._sig("all_gather", tag, label, out.numel(), out), shard)
        n = shard.numel()
        # Safe to write ``out`` before the closing barrier: the others read only our ``shard``, which is
        # either separate memory or our own region of ``out``, and we write every region but that one.
        for r, theirs in enumerate(slots):
            if r != self.rank:
                out[r * n : (r + 1) * n].copy_(theirs)
        own = out[self.rank * n : (self.rank + 1) * n]
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        self._done()
        return out

    def all_gather_async(self, out, shard, *, tag, label=None):
        # Threads of one process have no transfer to overlap with compute, so the exchange runs when the
        # result is waited for: at the same point of the program on every rank, so ranks stay matched.
        return Pending(lambda: self.all_gather(out, shard, tag=tag, label=label))

    def reduce_scatter(self, full, *, tag, label=None):
        self._note("reduce_scatter", tag, full.numel(), full, label)
        if self.size == 1:
            return full
        slots = self._exchange(self._sig("reduce_scatter", tag, label, full.numel(), full), full)
        n = full.numel() // self.size
        lo, hi = self.rank * n, (self.rank + 1) * n
        acc = slots[0][lo:hi].clone()
        for theirs in slots[1:]:
            acc += theirs[lo:hi]
        self._done()
        return acc

    def all_reduce(self, tensor, *, tag, label=None):
        self._note("all_reduce", tag, tensor.numel(), tensor, label)
        if self.size == 1:
            return tensor
        slots = self._exchange(self._sig("all_reduce", tag, label, tensor.numel(), tensor), tensor)
        acc = slots[0].clone()
        for theirs in slots[1:]:
            acc += theirs
        self._done()
        return tensor.copy_(acc)

    def broadcast(self, tensor, *, src, tag, label=None):
        self._note("broadcast", tag, tensor.numel(), tensor, label)
        if self.size == 1:
            return tensor
        slots = self._exchange(self._sig("broadcast", tag, label, tensor.numel(), tensor, src), tensor)
        theirs = slots[src].clone() if self.rank != src else None
        self._done()
        return tensor if theirs is None else tensor.copy_(theirs)


# -- torch.distributed ------------------------------------------------------------------------------


class DistComm(_Recording):
    def __init__(self, rank: int, size: int, group, counter: Counter | None) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.counter = counter

    def agree(self, fields, *, api, fix):
        import torch.distributed as dist

        if self.size == 1:
            return
        described: list[Any] = [None] * self.size
        dist.all_gather_object(described, list(fields), group=self.group)
        error = disagreement(described, api=api, fix=fix)
        if error is not None:
            raise error

    def all_gather(self, out, shard, *, tag, label=None):
        import torch.distributed as dist

        self._note("all_gather", tag, out.numel(), out, label)
        # gloo may not accept an input that aliases the output; a shard-sized copy is cheap.
        _all_gather_single(dist)(out, shard.clone(), group=self.group)
        return out

    def all_gather_async(self, out, shard, *, tag, label=None):
        import torch.distributed as dist

        self._note("all_gather", tag, out.numel(), out, label)
        work = _all_gather_single(dist)(out, shard.clone(), group=self.group, async_op=True)
        return Pending(lambda: (work.wait(), out)[1])

    def reduce_scatter(self, full, *, tag, label=None):
        import torch.distributed as dist

        self._note("reduce_scatter", tag, full.numel(), full, label)
        out = torch.empty(full.numel() // self.size, dtype=full.dtype, device=full.device)
        _reduce_scatter_single(dist)(out, full, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_reduce(self, tensor, *, tag, label=None):
        import torch.distributed as dist

        self._note("all_reduce", tag, tensor.numel(), tensor, label)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast(self, tensor, *, src, tag, label=None):
        import torch.distributed as dist

        self._note("broadcast", tag, tensor.numel(), tensor, label)
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor


def _all_gather_single(dist):
    # torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases only have the old name.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single(dist):
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
