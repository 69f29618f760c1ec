"""Per-parameter reductions over ZeRO's flat shards, for layer-wise optimizers (LAMB's trust ratio).

The optimizer sees ``{unit: tensor}``: a unit's whole flat buffer at stage 0, this rank's shard of it
at stages 1-3. ``LayoutSegments`` knows from the layout which parameter ("segment") each element
belongs to, sums squares per segment over the part this rank holds, and all-reduces those few numbers
when the parameter is spread over ranks. Segments are contiguous ranges, so nothing per element is
stored: the expansion back to element shape is one ``repeat_interleave``.
"""

from __future__ import annotations

from typing import Any

import torch

from fzero._layout import Layout


class LayoutSegments:
    def __init__(self, layout: Layout, *, stage: int, rank: int, comm: Any) -> None:
        self.comm = comm
        self.sharded = stage >= 1
        n = layout.world_size
        self.pieces: dict[str, list[tuple[int, int]]] = {}  # unit -> (start, stop) within the held range, per segment
        for unit in layout.units:
            lo, hi = unit.shard_range(rank, n) if self.sharded else (0, unit.padded)
            bounds = [(s.offset, s.offset + s.numel) for s in unit.slots] + [(unit.numel, unit.padded)]  # last: padding
            self.pieces[unit.name] = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in bounds]

    def sumsq(self, tree: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        names = self._names(tree)
        local = torch.cat([
            torch.stack([tree[k][a:b].float().square().sum() for a, b in self.pieces[k]]) for k in names
        ])
        if self.sharded:  # a parameter's elements are spread over the ranks' shards
            self.comm.all_reduce(local, tag="optimizer")
        out, i = {}, 0
        for k in names:
            m = len(self.pieces[k])
            out[k] = local[i : i + m]
            i += m
        return out

    def expand(self, per_segment: dict[str, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k in self._names(like):
            counts = torch.tensor([b - a for a, b in self.pieces[k]])
            out[k] = torch.repeat_interleave(per_segment[k], counts).to(like[k].device)
        return out

    def _names(self, tree: Any) -> list[str]:
        if not isinstance(tree, dict) or set(tree) != set(self.pieces):
            raise TypeError(
                f"fzero: a layer-wise optimizer asked for per-parameter norms of a tree that is not the step's "
                f"{{unit: tensor}} dict (got {type(tree).__name__}); call it on what the step passes it."
            )
        return list(tree)
