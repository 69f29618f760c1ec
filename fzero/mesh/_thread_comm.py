"""The thread mesh's comm: the N ranks of one ``local_mesh`` call as threads of this process.

The ranks meet at a barrier for every collective, read each other's tensors from shared slots and reduce
them in rank order 0, 1, ..., N-1, so results are deterministic. Every collective is matched across ranks
first (``_Sig``: op, tag, label, size, dtype, source) and ``finish`` meets the others once more when a
rank's program ends, so ranks that disagree raise ``RanksDisagree`` at once (see ``fzero.mesh._comm``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from fzero.mesh._comm import Counter, MeshTimeout, Pending, RanksDisagree, Recording, disagreement, ranged


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
    "ranks only (LayerDrop, early exit, routing), or control flow that depends on the rank or on its data (a "
    "model.generate that stops at another length on each rank: at stage 3 every new token runs the units, so give "
    "min_new_tokens=max_new_tokens; a local mesh cannot take Hugging Face's synced_gpus=True, which needs torchrun)."
)


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


class ThreadComm(Recording):
    # its "async" gathers copy under the caller's _same_version when waited for: a stage-3 prefetch may gather
    # straight into a freed buffer the graph's views point at (fzero.zero._unit)
    async_writes_keep_version = True
    gather_casts_at_one_rank = True  # all_gather at one rank is ``out.copy_(shard)``

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

    @ranged
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

    runs_when_waited = True  # every *_async below: what a caller allocates for it can wait until then too

    def all_gather_async(self, out, shard, *, tag, label=None):  # its profiler range is the all_gather's, when waited for
        # Threads of one process have no transfer to overlap with compute, so the exchange runs when the
        # result is waited for: at the same point of the program on every rank, so ranks stay matched.
        return Pending(lambda: self.all_gather(out, shard, tag=tag, label=label))

    def reduce_scatter_async(self, full, *, tag, label=None, out=None):  # as all_gather_async: the exchange runs when waited for
        return Pending(lambda: self.reduce_scatter(full, tag=tag, label=label, out=out))

    @ranged
    def reduce_scatter(self, full, *, tag, label=None, out=None):
        self._note("reduce_scatter", tag, full.numel(), full, label)
        if self.size == 1:
            return full
        slots = self._exchange(self._sig("reduce_scatter", tag, label, full.numel(), full), full)
        n = full.numel() // self.size
        lo, hi = self.rank * n, (self.rank + 1) * n
        acc = torch.add(slots[0][lo:hi], slots[1][lo:hi], out=out) if out is not None else slots[0][lo:hi] + slots[1][lo:hi]
        for theirs in slots[2:]:
            acc += theirs[lo:hi]
        self._done()
        return acc

    def all_reduce_async(self, tensor, *, tag, label=None):  # as all_gather_async: the exchange runs when waited for
        return Pending(lambda: self.all_reduce(tensor, tag=tag, label=label))

    @ranged
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

    @ranged
    def broadcast(self, tensor, *, src, tag, label=None):
        self._note("broadcast", tag, tensor.numel(), tensor, label)
        if self.size == 1:
            return tensor
        slots = self._exchange(self._sig("broadcast", tag, label, tensor.numel(), tensor, src), tensor)
        theirs = slots[src].clone() if self.rank != src else None
        self._done()
        return tensor if theirs is None else tensor.copy_(theirs)
