"""The comm of ``dist_mesh``: one rank per process, every collective a ``torch.distributed`` call.

No per-call matching across ranks here (it would cost a round trip per collective): ``Step.init`` checks
once, with ``agree``, that every rank runs the same layout and settings (see ``fzero.dist._comm``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fzero.dist._comm import Counter, Pending, Recording, disagreement, ranged

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases only have the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistComm(Recording):
    def __init__(self, rank: int, size: int, group, counter: Counter | None) -> None:
        self.rank = rank
        self.size = size
        self.group = group
        self.counter = counter

    def agree(self, fields, *, api, fix):
        if self.size == 1:
            return
        described: list[Any] = [None] * self.size
        dist.all_gather_object(described, list(fields), group=self.group)
        error = disagreement(described, api=api, fix=fix)
        if error is not None:
            raise error

    @ranged
    def all_gather(self, out, shard, *, tag, label=None):
        self._note("all_gather", tag, out.numel(), out, label)
        # gloo may not accept an input that aliases the output; a shard-sized copy is cheap.
        _ALL_GATHER(out, shard.clone(), group=self.group)
        return out

    @ranged
    def all_gather_async(self, out, shard, *, tag, label=None):
        self._note("all_gather", tag, out.numel(), out, label)
        work = _ALL_GATHER(out, shard.clone(), group=self.group, async_op=True)
        return Pending(lambda: (work.wait(), out)[1])

    @ranged
    def reduce_scatter(self, full, *, tag, label=None):
        self._note("reduce_scatter", tag, full.numel(), full, label)
        out = torch.empty(full.numel() // self.size, dtype=full.dtype, device=full.device)
        _REDUCE_SCATTER(out, full, op=dist.ReduceOp.SUM, group=self.group)
        return out

    @ranged
    def all_reduce(self, tensor, *, tag, label=None):
        self._note("all_reduce", tag, tensor.numel(), tensor, label)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    @ranged
    def broadcast(self, tensor, *, src, tag, label=None):
        self._note("broadcast", tag, tensor.numel(), tensor, label)
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor
