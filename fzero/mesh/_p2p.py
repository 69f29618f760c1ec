"""The collectives of ``DistComm`` as direct point-to-point exchanges: the faster form on gloo, chosen by measurement.

On gloo (CPU tensors), ``torch.distributed``'s own collectives are slow for what they move: on 2 ranks of a
2-core machine a reduce-scatter of one GPT block (3.1M fp32) takes 12.8 ms in its list form and 19.8 ms in
its ``*_single`` form, an all-reduce 19.3 ms, an all-gather 7.9-8.5 ms, while each rank sending the others their
chunks directly (``isend``/``irecv``) takes 6.2 ms for either; gloo's reduce-scatter also runs only inside
``wait`` (it cannot overlap anything), where the exchanges below run on gloo's transport thread from the moment
they are issued (``benchmarks/gloo_collectives.py`` measures both side by side).

Each form moves what a ring moves (every rank sends and receives ``T (N-1)/N`` elements for a ``T``-element
all-gather or reduce-scatter, twice that for an all-reduce), so the communication counts do not change. Sums
are taken in rank order 0, 1, ..., N-1, as ``ThreadComm`` takes them, so a ``dist_mesh`` of N processes and a
``local_mesh(N)`` give the same bits:

* all-gather: each rank sends its shard to every other rank and receives theirs into their regions of ``out``;
* reduce-scatter: each rank sends chunk ``r`` of its buffer to rank ``r`` and sums the N chunks it holds;
* all-reduce: a reduce-scatter, then an all-gather of the summed chunks into the tensor (any length: the
  chunks need not be equal).

Messages between two ranks are matched in the order they are posted (gloo keeps a pair's messages of one tag
in order), and every rank issues the same collectives in the same order (``Step.init`` checked the layouts
agree, ``DistComm.begin`` that every rank runs the same call), so the k-th message one rank sends another is
the k-th that one receives from it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist


class Exchange:
    """Issued point-to-point messages: ``works`` to wait for, then ``finish()`` for the result (which may issue
    and wait for a second round itself, as the all-reduce's all-gather does)."""

    def __init__(self, works: list[Any], finish: Callable[[], torch.Tensor]) -> None:
        self.works = works
        self.finish = finish


def bounds(numel: int, size: int) -> list[int]:
    """Where rank r's chunk of a ``numel``-element buffer starts (r) and ends (r + 1): equal chunks when ``size``
    divides ``numel`` (the padded units), else the first ones one element shorter."""
    return [r * numel // size for r in range(size + 1)]


def all_gather(out: torch.Tensor, shard: torch.Tensor, *, rank: int, size: int, group: Any) -> Exchange:
    """Fill ``out`` with every rank's ``shard`` in rank order (``shard`` may be this rank's region of ``out``)."""
    n = shard.numel()
    own = out[rank * n:(rank + 1) * n]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    works = []
    for step in range(1, size):  # a ring order of peers: every rank talks to its neighbours first
        to, frm = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(own, _global(group, to), group=group))
        works.append(dist.irecv(out[frm * n:(frm + 1) * n], _global(group, frm), group=group))
    return Exchange(works, lambda: out)


def reduce_scatter(full: torch.Tensor, *, rank: int, size: int, group: Any, out: torch.Tensor | None = None) -> Exchange:
    """This rank's chunk of the sum over ranks of ``full``, summed in rank order, in ``out`` (new if None);
    ``full`` is only read. The first peer's chunk is received straight into ``out``: no copy of our own chunk,
    and one receive buffer fewer (none on 2 ranks)."""
    edge = bounds(full.numel(), size)
    chunk = lambda r: full[edge[r]:edge[r + 1]]  # noqa: E731
    out = torch.empty(edge[rank + 1] - edge[rank], dtype=full.dtype, device=full.device) if out is None else out
    first = 1 if rank == 0 else 0  # the lowest rank that is not us: its chunk goes into ``out``
    theirs: dict[int, torch.Tensor] = {}
    works = []
    for step in range(1, size):
        to, frm = (rank + step) % size, (rank - step) % size
        works.append(dist.isend(chunk(to), _global(group, to), group=group))
        theirs[frm] = out if frm == first else torch.empty_like(out)
        works.append(dist.irecv(theirs[frm], _global(group, frm), group=group))

    def finish() -> torch.Tensor:
        if rank == 0:  # c0 + c1, as c1 + c0 is the same float: addition commutes bitwise
            torch.add(chunk(0), out, out=out)
        for r in range(2 if rank == 0 else 1, size):
            out.add_(chunk(rank) if r == rank else theirs[r])
        return out

    return Exchange(works, finish)


def all_reduce(tensor: torch.Tensor, *, rank: int, size: int, group: Any, wait: Callable[[list[Any]], None]) -> Exchange:
    """Sum ``tensor`` over ranks in place: a reduce-scatter of its chunks, then an all-gather of the sums into it.
    ``wait(works)``: how the second round is waited for (the comm's bounded wait)."""
    edge = bounds(tensor.numel(), size)
    first = reduce_scatter(tensor, rank=rank, size=size, group=group)

    def finish() -> torch.Tensor:
        mine = first.finish()  # every send of the first round is done: the tensor may be written
        tensor[edge[rank]:edge[rank + 1]].copy_(mine)
        works = []
        for step in range(1, size):
            to, frm = (rank + step) % size, (rank - step) % size
            works.append(dist.isend(mine, _global(group, to), group=group))
            works.append(dist.irecv(tensor[edge[frm]:edge[frm + 1]], _global(group, frm), group=group))
        wait(works)
        return tensor

    return Exchange(first.works, finish)


def _global(group: Any, rank: int) -> int:
    """A group rank as the global rank that ``isend``/``irecv`` take."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)
