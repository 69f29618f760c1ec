"""Flat, padded unit buffers: how a params pytree is packed for sharding.

ZeRO shards *flat* buffers: the leaves of the params pytree are packed, in pytree order, into units
(buckets) of about ``unit_elements`` elements, each one contiguous 1-D buffer padded so that every
rank's shard has the same length, a multiple of ``SHARD_ALIGN`` (ceil-padded: the layout DTensor's
``Shard(0)`` chunking uses too, which later lets torch.distributed.checkpoint reshard it).

One buffer per unit means one collective per unit (bucketing), and unflattening is one
``torch.split`` per unit: its backward is a single ``cat``, so the gradient of a unit arrives as one
flat tensor without a full-size zero buffer per parameter. (During a step the split also records which
params got a gradient at all: ``fzero.step._context``.)

Segments (``LayoutSegments``, at the end of this module) are per-parameter views of ZeRO's flat shards, for
the optimizer: norms for layer-wise optimizers (LAMB's trust ratio), and which parameters take a step
(torch.optim skips a parameter whose grad is None).

The optimizer sees ``{unit: tensor}``: a unit's whole flat buffer at stage 0, this rank's shard of it
at stages 1-3. ``LayoutSegments`` knows from the layout which parameter ("segment") each element
belongs to, sums squares per segment over the part this rank holds, and all-reduces those few numbers
when the parameter is spread over ranks. Segments are contiguous ranges, so nothing per element is
stored: the expansion back to element shape is one ``repeat_interleave``.

It also carries the step's ``active`` mask (``fzero.step._context``: the parameters some rank used), indexed by
the parameter's position in the user's params pytree (``Layout.order``), so per-parameter optimizer state
(Adam's skip counts) means the same at every stage and world size. ``sub_group`` narrows it to a range of
one unit, for disk offload's sub-group updates.

Parameter groups (``fzero.optim.masked``, ``multi_transform``) are decided on the user's params pytree:
``param_tree`` gives it as meta tensors of each parameter's shape (made once per layout, not per step), and
``all_reduce`` sums a group's per-parameter norms over the ranks' shards.
"""

from __future__ import annotations

import dataclasses
import math
import types
import weakref
from typing import Any, Callable, Sequence

import optree
import torch

from fzero.layout import _tree


# 12.5 MiB of fp32, half DDP's 25 MB bucket. Stages 0-1 fill each unit's flat gradient as backward reaches it,
# so a step holds one gradient plus about one unit's worth while activations are still alive: measured on the
# 38M GPT of benchmarks/step_live_bytes.py, 1.06x a gradient at this size, 1.10x at 16 MiB, 1.16x at 25 MiB
# (a plain PyTorch step: 1.02x). A collective of this size is still far past gloo's and NCCL's per-call latency.
DEFAULT_UNIT_ELEMENTS = 25 * 2**20 // 8
# Every shard starts and ends on a multiple of this many elements (256 bytes in fp32). Element-wise CPU
# kernels (torch's fused AdamW among them) run a vector loop and a shorter tail; a shard boundary at an
# odd offset moves elements from one to the other and changes their rounding, so unaligned shards would
# break the bitwise equality of stages 1-3 with stage 0. Measured: 2 of 256 elements differed without it.
SHARD_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one leaf lives inside its unit's flat buffer."""

    path: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str
    slots: tuple[Slot, ...]
    numel: int  # unpadded
    padded: int  # multiple of the world size
    dtype: torch.dtype

    def shard_size(self, world_size: int) -> int:
        return self.padded // world_size

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        size = self.shard_size(world_size)
        return rank * size, (rank + 1) * size


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static description of the packing; hashable, so it can sit in a treespec."""

    treespec: Any  # optree PyTreeSpec of the user's params pytree
    units: tuple[Unit, ...]
    world_size: int
    order: tuple[int, ...]  # pytree leaf index of each slot, in unit order
    # stage 3 with ``step.init(..., frozen=...)``: the frozen params sharded beside the trainable ones, one group per unit
    # and dtype (named as the unit; ROOT for those outside every unit), gathered into the tail of the unit's buffer
    # (``gathered``); the state keeps each group's shard under ``frozen_key(group)``
    frozen: tuple[Unit, ...] = ()
    # the dtype the frozen groups are gathered in (a precision policy's compute dtype), when not each group's own: the
    # shards keep the values as given (an fp32 base stays exact in the state), and each gather casts, as FSDP2 does
    frozen_compute: torch.dtype | None = None

    def frozen_dtype(self, group: Unit) -> torch.dtype:
        """The dtype ``group`` is gathered in, and the forward reads it in."""
        return self.frozen_compute or group.dtype

    def frozen_groups(self, name: str) -> tuple[Unit, ...]:
        """The frozen groups gathered with unit ``name`` (one per dtype), in layout order."""
        return tuple(g for g in self.frozen if g.name == name)

    def gathered(self, unit: Unit) -> int:
        """How many elements of ``unit.dtype`` a stage-3 gather of ``unit`` fills: its padded buffer, then (frozen params
        sharded) each frozen group's padded buffer, in the dtype it is gathered in, over the same memory
        (``frozen_regions``)."""
        return unit.padded + sum(_extent(g, self.frozen_dtype(g), unit.dtype) for g in self.frozen_groups(unit.name))

    @property
    def numel(self) -> int:
        """Ψ: parameters the user gave, without padding."""
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded for u in self.units)

    @property
    def paths(self) -> list[str]:
        return [s.path for u in self.units for s in u.slots]

    # -- packing -----------------------------------------------------------------------------------
    def pack_unit(self, unit: Unit, leaves: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None,
                  device: torch.device | None = None) -> torch.Tensor:
        """One unit's fresh padded flat buffer from ``leaves`` (pytree order), on their device (or ``device``); a
        meta leaf leaves zeros (a rank that receives rank 0's values by broadcast)."""
        if device is None:
            device = next((leaves[j].device for j in self.leaf_indices(unit) if not leaves[j].is_meta), torch.device("cpu"))
        flat = torch.zeros(unit.padded, dtype=dtype or unit.dtype, device=device)
        for j, slot in zip(self.leaf_indices(unit), unit.slots):
            leaf = leaves[j]
            if not leaf.is_meta:
                flat[slot.offset : slot.offset + slot.numel].copy_(leaf.detach().reshape(-1))
        return flat

    def pack_range(self, unit: Unit, pieces: dict[int, torch.Tensor], start: int, stop: int, *,
                   dtype: torch.dtype | None = None, device: torch.device) -> torch.Tensor:
        """Elements ``start:stop`` of ``unit``'s padded flat buffer, from ``pieces``: slot index -> the elements of
        that param that fall in the range (``slot_range``), flattened. What a rank packs when it reads its own
        part of a unit (``Step.init`` from a checkpoint under ``dist_mesh``) rather than the whole of it."""
        out = torch.zeros(stop - start, dtype=dtype or unit.dtype, device=device)
        for i, piece in pieces.items():
            slot = unit.slots[i]
            lo, _ = self.slot_range(unit, i, start, stop)
            at = slot.offset + lo - start
            out[at : at + piece.numel()].copy_(piece)
        return out

    @staticmethod
    def slot_range(unit: Unit, i: int, start: int, stop: int) -> tuple[int, int]:
        """Which elements ``lo:hi`` of slot ``i``'s flattened param lie in ``start:stop`` of the unit's buffer
        (``lo == hi``: none)."""
        slot = unit.slots[i]
        lo = min(max(start - slot.offset, 0), slot.numel)
        return lo, max(lo, min(stop - slot.offset, slot.numel))

    def leaf_indices(self, unit: Unit) -> tuple[int, ...]:
        """The pytree leaf index of each of ``unit``'s slots."""
        first = 0
        for u in self.units:
            if u.name == unit.name:
                break
            first += len(u.slots)
        return self.order[first : first + len(unit.slots)]

    def unit_views(self, unit: Unit, flat: torch.Tensor, split: Callable | None = None) -> dict[str, torch.Tensor]:
        """``{path: view}`` of one unit's whole buffer, differentiable through one ``split(flat, unit)``
        (default ``split_unit``; a step passes ``fzero.step._context.split``, which also notes which params get a
        gradient)."""
        pieces = (split or split_unit)(flat, unit)
        return {s.path: p.view(s.shape) for p, s in zip(pieces, unit.slots)}

    def unpack(self, flats: dict[str, torch.Tensor], split: Callable | None = None) -> Any:
        """The user's params pytree as views of the unit buffers (differentiable through ``split``, as ``unit_views``)."""
        leaves: list[Any] = [None] * len(self.order)
        order = iter(self.order)
        for unit in self.units:
            for view in self.unit_views(unit, flats[unit.name], split).values():
                leaves[next(order)] = view
        return self.treespec.unflatten(leaves)

    # -- per-parameter inputs (stages 0-1) ---------------------------------------------------------
    def param_views(self, flats: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every param as a shaped view of its unit's buffer, in slot (layout) order.

        Stages 0-1 take the gradient with respect to these rather than the unit buffers: the gradient of a
        param is then kept as autograd delivers it, while a unit buffer's gradient is the ``cat`` of a split's
        backward, a node made before the forward, which autograd runs only after the whole backward, with every
        param's gradient still alive beside the new flat one (measured: 2.6x a gradient per step, 1.0x for DDP).
        """
        return [flats[u.name].narrow(0, s.offset, s.numel).view(s.shape) for u in self.units for s in u.slots]

    def assemble(self, leaves: Sequence[torch.Tensor], record: Callable | None = None) -> Any:
        """The user's params pytree from ``leaves`` in slot order (``param_views``); ``record(params, unit)``
        wraps each unit's params (a step notes which of them get a gradient: ``fzero.step._context.record``)."""
        out: list[Any] = [None] * len(self.order)
        order, first = iter(self.order), 0
        for unit in self.units:
            mine = tuple(leaves[first : first + len(unit.slots)])
            first += len(unit.slots)
            for leaf in record(mine, unit) if record is not None else mine:
                out[next(order)] = leaf
        return self.treespec.unflatten(out)

    def flatten_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Per-param gradients (slot order, as ``param_views``) into one padded flat gradient per unit.

        Each param's gradient is dropped from ``grads`` as soon as it is copied, so at most one unit's flat
        gradient exists beside the params' own: a step holds about one gradient plus one unit.
        """
        flats, j = [], 0
        for unit in self.units:
            like = grads[j]
            flat = torch.empty(unit.padded, dtype=like.dtype, device=like.device)
            for slot in unit.slots:
                flat.narrow(0, slot.offset, slot.numel).view(slot.shape).copy_(grads[j])
                grads[j] = None
                j += 1
            flat[unit.numel:].zero_()
            flats.append(flat)
        return flats


def _extent(group: Unit, dtype: torch.dtype, unit_dtype: torch.dtype) -> int:
    """Elements of ``unit_dtype`` that hold ``group``'s padded buffer in ``dtype`` (exact: a padded size is a multiple
    of ``SHARD_ALIGN``, so every region also starts on a multiple of its own element size)."""
    return group.padded * dtype.itemsize // unit_dtype.itemsize


def frozen_key(group: Unit) -> str:
    """The key of a frozen group's shard in a state's ``frozen``: its unit's name and its dtype (a unit may hold
    frozen params of several dtypes: a bf16 model whose ``_keep_in_fp32_modules`` stay fp32)."""
    return f"{group.name}:{str(group.dtype).removeprefix('torch.')}"


def frozen_regions(full: torch.Tensor, unit: Unit, groups: Sequence[Unit], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Each frozen group's gathered buffer inside ``full`` (a stage-3 unit buffer of ``Layout.gathered`` elements): the
    tail after the unit's own padded buffer, group after group, each viewed as the dtype it is gathered in
    (``Layout.frozen_dtype``). One storage for all, so that the unit's free, refill and pool moves carry the frozen
    params with the trainable ones."""
    out, at = [], unit.padded
    for group, dtype in zip(groups, dtypes):
        size = _extent(group, dtype, unit.dtype)
        region = full.narrow(0, at, size)
        out.append(region if dtype == unit.dtype else region.view(dtype))
        at += size
    return out


def frozen_views(flat: torch.Tensor, group: Unit) -> dict[str, torch.Tensor]:
    """``{path: view}`` of a frozen group's gathered buffer: shaped views, no gradient."""
    return {s.path: p.view(s.shape) for p, s in zip(flat.detach().split_with_sizes(split_sizes(group)), group.slots)}


def build_frozen(frozen: dict[str, torch.Tensor], layout: Layout, *, unit_of: Callable[[str], str]) -> tuple[Unit, ...]:
    """The frozen groups of ``frozen`` (name -> tensor, ``fzero.frozen_of``): each param goes with the unit
    ``unit_of`` gives it when ``layout`` has that unit (``fzero.step._init`` gives a module unit whose params are all
    frozen a unit of its own, with no trainable slot), else with the root unit (gathered for the whole step), one group
    per unit and dtype: each is held in its params' own dtype, exact, and gathered in the layout's ``frozen_compute`` (a
    precision policy's compute dtype) or its own."""
    trained = {u.name for u in layout.units}
    groups: dict[tuple[str, torch.dtype], list[str]] = {}
    for path in frozen:
        name = unit_of(path)
        groups.setdefault((name if name in trained else ROOT, frozen[path].dtype), []).append(path)
    out = []
    for (name, own), paths in groups.items():
        slots, offset = [], 0
        for path in paths:
            slots.append(Slot(path, tuple(frozen[path].shape), offset))
            offset += frozen[path].numel()
        quantum = layout.world_size * SHARD_ALIGN
        out.append(Unit(name, tuple(slots), offset, math.ceil(offset / quantum) * quantum, own))
    return tuple(out)


def pack_frozen(group: Unit, values: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A frozen group's whole padded flat buffer from ``values`` (path -> tensor), in ``dtype``: what each rank's shard
    is cut from (``step.init``, a checkpoint's values put back into a state)."""
    flat = torch.zeros(group.padded, dtype=dtype, device=device)
    for slot in group.slots:
        flat[slot.offset : slot.offset + slot.numel].copy_(values[slot.path].detach().reshape(-1))
    return flat


def split_sizes(unit: Unit) -> list[int]:
    """The sizes ``unit``'s flat buffer is cut into: its slots, then its padding (if any). A new list each call, from
    sizes made once per unit (``_SIZES``): a stage-3 step asks at each unit's gather, refill and split, ~2 calls per
    unit, each a product of every slot's shape."""
    hit = _SIZES.get(id(unit))
    if hit is not None and hit[0]() is unit:
        return list(hit[1])
    sizes = [s.numel for s in unit.slots]
    if unit.padded > unit.numel:
        sizes.append(unit.padded - unit.numel)
    _SIZES[id(unit)] = (weakref.ref(unit, lambda _, i=id(unit): _SIZES.pop(i, None)), tuple(sizes))
    return sizes


# id(unit) -> (a weak reference to it, its split sizes): a unit is frozen, so its sizes never change; by identity, as a
# frozen dataclass hashes every slot at each lookup. An entry goes with its unit; the id is checked against the live one.
_SIZES: dict[int, tuple[Any, tuple[int, ...]]] = {}


def split_unit(flat: torch.Tensor, unit: Unit) -> tuple[torch.Tensor, ...]:
    """``flat`` cut into ``unit``'s slots (and its padding, last), 1-D views."""
    return torch.split(flat, split_sizes(unit))


ROOT = "<root>"  # the unit of every parameter that belongs to no module unit (stage 3)


def build_layout(
    params: Any,
    *,
    world_size: int,
    unit_elements: int = DEFAULT_UNIT_ELEMENTS,
    unit_of: Callable[[str], str] | None = None,
    dtype: torch.dtype | None = None,
    api: str,
) -> Layout:
    """Check that ``params`` is a pytree of floating tensors and pack its leaves into units.

    Units are consecutive leaves of about ``unit_elements`` elements (stages 0-2: buckets for the
    collectives), or, given ``unit_of`` (stages 2-3), the groups of leaves that map to the same unit name.
    ``dtype``: the dtype the buffers hold (the compute dtype of a precision policy), if not the leaves'. With it, a
    unit may hold leaves of several floating dtypes (a bf16 Hugging Face model whose ``_keep_in_fp32_modules`` stay
    fp32 sits in one stage-3 unit per block): each is cast into the buffer, as stages 0-1 cast them, and the fp32
    masters are packed from the values as given.
    """
    paths, leaves, spec = _tree.flatten_with_paths(params)
    if not leaves:
        raise ValueError(f"{api}: params has no tensors (got {type(params).__name__}). Pass a pytree of tensors, e.g. fzero.params_of(model).")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{api}: params must be a pytree (dict/list/tuple) of tensors; the leaf at {path or '<root>'!r} is a "
                f"{type(leaf).__name__}. Pass fzero.params_of(model), or a dict of torch.Tensor."
            )
        if leaf.is_complex():  # not "keep integer tensors out": a learnable complex filter is a parameter
            raise TypeError(
                f"{api}: the parameter {path!r} has dtype {leaf.dtype}; fzero trains real floating-point tensors only "
                f"(its flat buffers, collectives and optimizers are real). Hold it as real and imaginary parts: "
                f"nn.Parameter(torch.view_as_real(z)) (shape (..., 2)) and torch.view_as_complex(p) in forward, which "
                f"is how torch.optim's Adam, AdamW and SGD update a complex parameter anyway."
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"{api}: the parameter {path!r} has dtype {leaf.dtype}; only floating-point tensors are trained. "
                f"Keep integer tensors out of params (as buffers of the module, or in the batch); a state dict "
                f"(model.state_dict(), torch.load of a checkpoint) holds buffers beside the parameters (BatchNorm's "
                f"num_batches_tracked): pass fzero.params_of(model)."
            )
    device_of(paths, leaves, api=api)
    if unit_of is None:  # consecutive params in the model's order (not optree's sorted keys): see insertion_order
        rank = {p: k for k, p in enumerate(_tree.insertion_order(params))}
        groups = units_by_size(paths, leaves, unit_elements, order=sorted(range(len(paths)), key=lambda i: rank.get(paths[i], i)))
    else:
        by_name: dict[str, list[int]] = {}
        for i, path in enumerate(paths):
            by_name.setdefault(unit_of(path), []).append(i)
        groups = list(by_name.items())
    units = []
    for name, idx in groups:
        dtypes = {leaves[i].dtype for i in idx}
        if len(dtypes) > 1 and dtype is None:  # with ``dtype`` (a bf16/fp16 policy) the buffer holds that dtype whatever the leaves'
            raise TypeError(f"{api}: unit {name!r} mixes dtypes {sorted(map(str, dtypes))}; give all its parameters one dtype.")
        slots, offset = [], 0
        for i in idx:
            slots.append(Slot(paths[i], tuple(leaves[i].shape), offset))
            offset += leaves[i].numel()
        quantum = world_size * SHARD_ALIGN
        padded = math.ceil(offset / quantum) * quantum
        units.append(Unit(name, tuple(slots), offset, padded, dtype or leaves[idx[0]].dtype))
    # pack_unit() and unpack() walk units in order and expect pytree leaf order: keep leaves sorted by unit
    order = [i for _, idx in groups for i in idx]
    return Layout(spec, tuple(units), world_size, tuple(order))


DEVICE_TYPES = ("cpu", "cuda")


def device_of(paths: Sequence[str], leaves: Sequence[torch.Tensor], *, api: str) -> torch.device | None:
    """The one device the params live on (CPU or one CUDA device), None when all are meta (shapes only).

    A step keeps each rank's units, gradients and optimizer state where its params are; params spread over
    devices would put one unit's buffer across them, so they are refused with the devices named.
    """
    found: dict[torch.device, str] = {}
    for path, leaf in zip(paths, leaves):
        if leaf.is_meta:
            continue
        if leaf.device.type not in DEVICE_TYPES:
            raise ValueError(f"{api}: the parameter {path!r} is on {leaf.device}; fzero runs on CPU and CUDA tensors. "
                             f"Move the model to one of them (model.to('cuda') or model.to('cpu')).")
        device = leaf.device if leaf.device.type == "cpu" or leaf.device.index is not None else torch.device("cuda", torch.cuda.current_device())
        found.setdefault(device, path)
    if len(found) > 1:
        where = ", ".join(f"{path!r} on {d}" for d, path in found.items())
        raise ValueError(f"{api}: the params are on more than one device ({where}); a step keeps every unit on one device. "
                         f"Move the whole model to one device first (model.to(device)).")
    return next(iter(found), None)


def units_by_size(paths: list[str], leaves: list[torch.Tensor], unit_elements: int,
                  order: Sequence[int] | None = None) -> list[tuple[str, list[int]]]:
    """Leaves in ``order`` (default as given) into units of at most ``unit_elements`` (a larger leaf is a unit of
    its own) and one dtype: ``[(unit name, leaf indices)]``. Shared with the estimator, which must group exactly as
    a step does (it passes the model's parameters in their registration order, the order a step groups in)."""
    groups: list[tuple[str, list[int]]] = []
    size = 0
    for i in order if order is not None else range(len(leaves)):
        leaf = leaves[i]
        if groups and size + leaf.numel() <= unit_elements and leaf.dtype == leaves[groups[-1][1][-1]].dtype:
            groups[-1][1].append(i)
            size += leaf.numel()
        else:
            groups.append((f"unit{len(groups)}", [i]))
            size = leaf.numel()
    return groups


class LayoutSegments:
    def __init__(self, layout: Layout, *, sharded: bool, rank: int, comm: Any, active: torch.Tensor | None = None) -> None:
        self.comm = comm
        self.layout = layout
        self.sharded = sharded  # each rank holds a shard of the optimizer state (stages 1-3)
        self.count = len(layout.order)
        self._active = active  # 1-D bool over the params (pytree order); None: every param takes the step
        # unit -> (start, stop) within the held range, per segment; unit -> pytree leaf index of each segment's param
        # (-1: padding). Read-only, shared by every LayoutSegments of this layout, rank and sharding (``_segments_of``).
        self.pieces, self.params = _segments_of(layout, self.sharded, rank)

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


# (id(layout), sharded, rank) -> (a weak reference to the layout, its pieces, its params): what ``LayoutSegments`` reads,
# a function of the layout (frozen: its units and order never change), the rank and the sharding alone, made once per
# layout rather than at every step's update (~0.2 ms a step at GPT-2 124M's 13 units, quadratic in the units through
# ``leaf_indices``). By identity: a frozen dataclass hashes all its fields (the treespec, every slot) at each lookup. An
# entry goes with its layout (the weak reference's callback); the id is checked against the live object.
_SEGMENTS: dict[tuple[int, bool, int], tuple[Any, Any, Any]] = {}


def _segments_of(layout: Layout, sharded: bool, rank: int) -> tuple[Any, Any]:
    """``LayoutSegments``'s ``pieces`` and ``params`` for ``layout`` at ``rank`` (read-only mappings of tuples)."""
    key = (id(layout), sharded, rank)
    hit = _SEGMENTS.get(key)
    if hit is not None and hit[0]() is layout:
        return hit[1], hit[2]
    n = layout.world_size
    pieces: dict[str, tuple[tuple[int, int], ...]] = {}
    params: dict[str, tuple[int, ...]] = {}
    for unit in layout.units:
        lo, hi = unit.shard_range(rank, n) if sharded else (0, unit.padded)
        bounds = [(s.offset, s.offset + s.numel) for s in unit.slots] + [(unit.numel, unit.padded)]  # last: padding
        pieces[unit.name] = tuple((min(max(a, lo), hi) - lo, min(max(b, lo), hi) - lo) for a, b in bounds)
        params[unit.name] = (*layout.leaf_indices(unit), -1)
    out = (types.MappingProxyType(pieces), types.MappingProxyType(params))
    _SEGMENTS[key] = (weakref.ref(layout, lambda _, key=key: _SEGMENTS.pop(key, None)), *out)
    return out


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
