"""Per-parameter views of ZeRO's flat shards, for the optimizer: norms for layer-wise optimizers (LAMB's trust
ratio), and which parameters take a step (torch.optim skips a parameter whose grad is None).

The optimizer sees ``{unit: tensor}``: a unit's whole flat buffer at stage 0, this rank's shard of it
at stages 1-3. ``LayoutSegments`` knows from the layout which parameter ("segment") each element
belongs to, sums squares per segment over the part this rank holds, and all-reduces those few numbers
when the parameter is spread over ranks. Segments are contiguous ranges, so nothing per element is
stored: the expansion back to element shape is one ``repeat_interleave``.

It also carries the step's ``active`` mask (``fzero.step._usage``: the parameters some rank used), indexed by
the parameter's position in the user's params pytree (``Layout.order``), so per-parameter optimizer state
(Adam's skip counts) means the same at every stage and world size. ``sub_group`` narrows it to a range of
one unit, for disk offload's sub-group updates.

Parameter groups (``fzero.optim.masked``, ``multi_transform``) are decided on the user's params pytree:
``param_tree`` gives it as meta tensors of each parameter's shape (made once per layout, not per step), and
``all_reduce`` sums a group's per-parameter norms over the ranks' shards.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fzero.layout._layout import Layout


class LayoutSegments:
    def __init__(self, layout: Layout, *, sharded: bool, rank: int, comm: Any, active: torch.Tensor | None = None) -> None:
        self.comm = comm
        self.layout = layout
        self.sharded = sharded  # each rank holds a shard of the optimizer state (stages 1-3)
        self.count = len(layout.order)
        self._active = active  # 1-D bool over the params (pytree order); None: every param takes the step
        n = layout.world_size
        self.pieces: dict[str, list[tuple[int, int]]] = {}  # unit -> (start, stop) within the held range, per segment
        self.params: dict[str, list[int]] = {}  # unit -> pytree leaf index of each segment's param (-1: padding)
        for unit in layout.units:
            lo, hi = unit.shard_range(rank, n) if self.sharded else (0, unit.padded)
            bounds = [(s.offset, s.offset + s.numel) for s in unit.slots] + [(unit.numel, unit.padded)]  # last: padding
            self.pieces[unit.name] = [(min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in bounds]
            self.params[unit.name] = list(layout.leaf_indices(unit)) + [-1]

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
            counts = torch.tensor([b - a for a, b in self.pieces[k]], device=per_segment[k].device)
            out[k] = torch.repeat_interleave(per_segment[k], counts).to(like[k].device)
        return out

    # -- which parameters take the step (fzero.optim.Segments' optional methods) -----------------------------
    def param_count(self, tree: Any) -> int:
        """Every parameter of the layout, whatever part of it ``tree`` holds."""
        return self.count

    def param_ranges(self, tree: dict[str, torch.Tensor]) -> list[list[tuple[int, int, int]]]:
        self._names(tree)
        units = [path[0] for path in optree.tree_paths(tree)]  # optree's leaf order (sorted keys)
        return [self._ranges(k, 0, None) for k in units]

    def active(self) -> torch.Tensor | None:
        return self._active

    def param_tree(self, tree: Any = None) -> Any:
        """The user's params pytree as meta tensors (each parameter's shape, the units' dtype), whatever part of it
        ``tree`` holds: what a mask or label function of ``fzero.optim.masked``/``multi_transform`` is called on."""
        return _param_tree(self.layout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks when each holds a shard of the optimizer's leaves (stages 1-3)."""
        if self.sharded:
            self.comm.all_reduce(t, tag="optimizer")
        return t

    def sub_group(self, unit: str, start: int, stop: int) -> "SubGroupSegments":
        """The segments of elements ``start:stop`` of ``unit`` (what this rank holds of it), for a sub-group update."""
        return SubGroupSegments(self, unit, start, stop)

    def _ranges(self, unit: str, start: int, stop: int | None) -> list[tuple[int, int, int]]:
        out = []
        for (a, b), i in zip(self.pieces[unit], self.params[unit]):
            a, b = max(a, start), b if stop is None else min(b, stop)
            if b > a:
                out.append((a - start, b - start, i))
        return out

    def _names(self, tree: Any) -> list[str]:
        if not isinstance(tree, dict) or set(tree) != set(self.pieces):
            raise TypeError(
                f"fzero: a layer-wise optimizer asked for per-parameter norms of a tree that is not the step's "
                f"{{unit: tensor}} dict (got {type(tree).__name__}); call it on what the step passes it."
            )
        return list(tree)


class NoSegments:
    """Installed during a sub-group update: a layer-wise optimizer cannot see whole parameters there."""

    def sumsq(self, tree: Any) -> Any:
        raise NotImplementedError(
            "fzero.offload('disk'): the optimizer asked for per-parameter norms (a layer-wise optimizer such as "
            "fzero.optim.lamb), but disk offload updates the state in sub-groups that cut through parameters. "
            "Use an element-wise optimizer (adamw, adam, sgd, lion) with disk offload, or offload='cpu'."
        )

    expand = sumsq


class SubGroupSegments:
    """One sub-group of one unit (disk offload updates ``{"g": elements start:stop}`` at a time): which parameters
    it holds and which take the step. Per-parameter norms cannot be had there (``NoSegments`` says why)."""

    def __init__(self, parent: LayoutSegments, unit: str, start: int, stop: int) -> None:
        self.parent, self.unit, self.start, self.stop = parent, unit, start, stop

    def sumsq(self, tree: Any) -> Any:
        return NoSegments().sumsq(tree)

    expand = sumsq

    def param_count(self, tree: Any) -> int:
        return self.parent.count

    def param_ranges(self, tree: Any) -> list[list[tuple[int, int, int]]]:
        leaves = optree.tree_leaves(tree)
        if len(leaves) != 1 or leaves[0].numel() != self.stop - self.start:
            raise TypeError(
                f"fzero (disk offload): the optimizer asked which parameters a tree holds, but it is not the sub-group "
                f"of unit {self.unit!r} being updated ({self.stop - self.start} elements); call it on what the step passes it."
            )
        return [self.parent._ranges(self.unit, self.start, self.stop)]

    def active(self) -> torch.Tensor | None:
        return self.parent.active()

    def param_tree(self, tree: Any = None) -> Any:
        return self.parent.param_tree(tree)


_PARAM_TREES: dict[int, tuple[Layout, Any]] = {}  # id(layout) -> (layout, its params pytree of meta tensors)


def _param_tree(layout: Layout) -> Any:
    """The params pytree of ``layout`` as meta tensors, made once per layout (a step builds its segments every step)."""
    hit = _PARAM_TREES.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    leaves: list[Any] = [None] * len(layout.order)
    slots = [(s, u.dtype) for u in layout.units for s in u.slots]
    for (slot, dtype), leaf in zip(slots, layout.order):
        leaves[leaf] = torch.empty(slot.shape, dtype=dtype, device="meta")
    tree = layout.treespec.unflatten(leaves)
    if len(_PARAM_TREES) >= 16:  # a few layouts live at a time (one per step); forget the old ones
        _PARAM_TREES.clear()
    _PARAM_TREES[id(layout)] = (layout, tree)
    return tree
