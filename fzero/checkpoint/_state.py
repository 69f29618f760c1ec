"""What a checkpoint holds, as logical per-parameter tensors, and how rank states map onto them.

Keys (every per-parameter tensor is 1-D, the parameter flattened; its shape is in ``fzero.json``):

- ``params/<name>``: the parameters in the dtype the step computes in;
- ``master/<name>``: fp32 master weights (mixed precision);
- ``opt/<path>/<name>``: an optimizer-state leaf shaped like the params (Adam's ``0.mu``, ``0.nu``);
- ``opt/<path>``: any other optimizer-state leaf (step counts), replicated, written once;
- ``step``, ``loss_scale/<field>``, ``rng/<process>`` (torch's CPU generator), and the other RNG states
  (``rng_python/<process>``, ``rng_numpy/<process>``, ``rng_cuda/<process>``, ``rng_ranks/<process>/...``: ``_rng``);
- ``buffers/<name>``: the module's persistent buffers (BatchNorm statistics), rank 0's, as the state holds them.

A rank of a layout owns the window ``[r*S, (r+1)*S)`` of each unit's padded flat buffer (S = padded/N).
Whatever it holds of a unit (the whole buffer, or only the shard) it *writes* that window: the windows
of the N ranks cover every parameter element once. It *reads* everything it holds. Both are, per
parameter, one contiguous range of the flattened parameter: a DCP chunk (see ``fzero.checkpoint._dcp``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import optree
import torch
import torch.distributed as dist

from fzero.layout import pytrees as _tree, same_values, Unit
from fzero.checkpoint._dcp import CheckpointError, Dest, Piece
from fzero.zero import DiskOptState
from fzero.step import RankStates, TrainState, is_busy, is_donated, MasterState

PARAM = "param"  # an optimizer-state entry shaped like the params (one tensor per unit)
TENSOR = "tensor"  # any other optimizer-state tensor


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- per-unit sources: a dict of tensors, or the files of disk offload -----------------------------------


class _Memory:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def numel(self, unit: str) -> int:
        return self.tensors[unit].numel()

    def dtype(self, unit: str) -> torch.dtype:
        return self.tensors[unit].dtype

    def get(self, unit: str, a: int, b: int) -> torch.Tensor:
        return self.tensors[unit][a:b]

    def dest(self, unit: str, a: int, b: int) -> dict[str, Any]:
        return {"view": self.tensors[unit][a:b]}


class _Disk:
    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key  # key: "opt/0/1" or "master"; the file of unit u is f"{key}/{u}"

    def numel(self, unit: str) -> int:
        return self.store.sizes[f"{self.key}/{unit}"]

    def dtype(self, unit: str) -> torch.dtype:
        return torch.float32

    def get(self, unit: str, a: int, b: int) -> torch.Tensor:
        return self.store.read(f"{self.key}/{unit}", a, torch.empty(b - a, dtype=torch.float32))

    def dest(self, unit: str, a: int, b: int) -> dict[str, Any]:
        key = f"{self.key}/{unit}"
        return {"write": lambda off, data: self.store.write(key, a + off, data.to(torch.float32).contiguous())}


@dataclasses.dataclass
class Entries:
    """One rank state's contents: per-parameter sources by key prefix, replicated tensors by key."""

    per_param: dict[str, Any]  # "params" / "master" / "opt/<path>" -> _Memory | _Disk
    tensors: dict[str, torch.Tensor]  # "step", "loss_scale/<field>", "opt/<path>" -> tensor


def entries(state: TrainState, *, api: str) -> Entries:
    layout = state.meta.layout
    units = {u.name for u in layout.units}
    per_param: dict[str, Any] = {"params": _Memory(state.params)}
    tensors: dict[str, torch.Tensor] = {"step": state.step}
    opt = state.opt_state
    if isinstance(opt, DiskOptState):
        if opt.master:
            per_param["master"] = _Disk(opt.store, "master")
        for names, index, leaf in _walk(opt.small, (), (), units=units, disk=True, api=api):
            if leaf is PARAM:
                per_param[_opt_key(names)] = _Disk(opt.store, "opt/" + "/".join(str(i) for i in index))
            else:
                tensors[_opt_key(names)] = leaf
    else:
        if isinstance(opt, MasterState):
            per_param["master"] = _Memory(opt.master)
            opt = opt.inner
        for names, _index, leaf in _walk(opt, (), (), units=units, disk=False, api=api):
            if isinstance(leaf, dict):
                per_param[_opt_key(names)] = _Memory(leaf)
            else:
                tensors[_opt_key(names)] = leaf
    if state.loss_scale is not None:
        ls = state.loss_scale
        fields = getattr(ls, "_fields", None)
        if fields is None or not all(isinstance(x, torch.Tensor) for x in ls):
            raise TypeError(f"{api}: state.loss_scale is a {type(ls).__name__}; expected a NamedTuple of tensors (fzero's LossScaleState).")
        tensors.update({f"loss_scale/{f}": x for f, x in zip(fields, ls)})
    tensors.update({f"buffers/{name}": t for name, t in state.buffers.items()})
    return Entries(per_param, tensors)


def without_optimizer(e: Entries) -> Entries:
    """``e`` without the optimizer's entries (``load(..., optimizer=False)``): params, masters, buffers and the step;
    not the loss scale either, which is the optimizer step's business."""
    return Entries({k: v for k, v in e.per_param.items() if k in ("params", "master")},
                   {k: t for k, t in e.tensors.items() if not k.startswith(("opt/", "loss_scale/"))})


def _is_skip_count(key: str) -> bool:
    """An optimizer's per-parameter skip counts (``ScaleByAdamState.skipped``: steps a param had no gradient)."""
    return key.startswith("opt/") and key.removeprefix("opt/").rpartition(".")[2] == "skipped"


def _opt_key(names: tuple[str, ...]) -> str:
    return "opt/" + (".".join(names) if names else "<root>")


def _walk(tree: Any, names: tuple, index: tuple, *, units: set[str], disk: bool, api: str) -> Iterator[tuple[tuple, tuple, Any]]:
    """(field-name path, pytree index path, leaf) for every tensor of an optimizer state; a dict keyed by the
    layout's units (in memory) or ``{"g": None}`` (disk offload's per-unit template) is one per-parameter leaf."""
    if tree is None:
        return
    if isinstance(tree, torch.Tensor):
        yield names, index, tree
    elif isinstance(tree, dict):
        if disk and set(tree) == {"g"} and tree["g"] is None:
            yield names, index, PARAM
        elif not disk and set(tree) == units and all(isinstance(v, torch.Tensor) for v in tree.values()):
            yield names, index, tree
        else:
            for k, v in tree.items():
                yield from _walk(v, names + (str(k),), index + (k,), units=units, disk=disk, api=api)
    elif isinstance(tree, tuple) and hasattr(tree, "_fields"):
        for i, (f, v) in enumerate(zip(tree._fields, tree)):
            yield from _walk(v, names + (f,), index + (i,), units=units, disk=disk, api=api)
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            yield from _walk(v, names + (str(i),), index + (i,), units=units, disk=disk, api=api)
    else:
        raise TypeError(
            f"{api}: the optimizer state holds a {type(tree).__name__} at {'.'.join(names) or '<root>'}; a checkpoint "
            f"saves tensors in dicts, tuples, lists and NamedTuples only."
        )


# -- description (fzero.json) --------------------------------------------------------------------------


def describe(state: TrainState, e: Entries) -> dict[str, Any]:
    """The JSON description of what rank states like ``state`` hold (rank 0's view; all ranks agree)."""
    layout = state.meta.layout
    slots = {s.path: s for u in layout.units for s in u.slots}
    names = [""] * len(layout.order)  # in pytree leaf order: a dict rebuilt from them flattens to the same layout
    for slot_index, leaf_index in enumerate(layout.order):
        names[leaf_index] = layout.paths[slot_index]
    flat_dict = layout.treespec == optree.tree_structure({n: 0 for n in names}, namespace=_tree.NAMESPACE)
    return {
        "params": [{"name": n, "shape": list(slots[n].shape)} for n in names],
        "packing_order": list(layout.paths),  # the model's order: like=step rebuilds its dict in it, so units come out the same
        "params_tree": "dict" if flat_dict else str(layout.treespec),
        "params_dtype": dtype_name(layout.units[0].dtype),
        "master": "master" in e.per_param,
        "opt": [{"key": k, "kind": PARAM} for k in e.per_param if k.startswith("opt/")]
        + [{"key": k, "kind": TENSOR, "shape": list(t.shape), "dtype": dtype_name(t.dtype)} for k, t in e.tensors.items() if k.startswith("opt/")],
        "loss_scale": [k.removeprefix("loss_scale/") for k in e.tensors if k.startswith("loss_scale/")] or None,
        "buffers": [{"name": k.removeprefix("buffers/"), "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
                    for k, t in e.tensors.items() if k.startswith("buffers/")],
        "stage": state.meta.stage,
        "world_size": state.meta.world_size,
        "device": state.meta.device.type,  # where the params computed: load(like=step) rebuilds them there
        "gather_order": list(state.meta.gather_order),
    }


def with_saved_buffers(state: TrainState, info: dict[str, Any]) -> TrainState:
    """``state`` with a tensor (to be read into) for every buffer the checkpoint holds and the state lacks, on the device
    the state's params compute on, where the module's own buffers are (on the host, a CUDA model's BatchNorm met
    host running statistics at its first step)."""
    device = state.meta.device if state.meta is not None else torch.device("cpu")
    missing = {b["name"]: torch.empty(b["shape"], dtype=getattr(torch, b["dtype"]), device=device)
               for b in info.get("buffers", ()) if b["name"] not in state.buffers}
    return dataclasses.replace(state, buffers={**state.buffers, **missing}) if missing else state


def check_fits(path: str, info: dict[str, Any], state: TrainState, e: Entries, *, api: str) -> None:
    """Raise unless the checkpoint's params and optimizer state have the names and shapes of ``state``'s."""
    saved = {p["name"]: tuple(p["shape"]) for p in info["params"]}
    mine = {s.path: s.shape for u in state.meta.layout.units for s in u.slots}
    problems = [f"missing from the checkpoint: {_few(sorted(set(mine) - set(saved)))}"] if set(mine) - set(saved) else []
    if set(saved) - set(mine):
        problems.append(f"not in the state: {_few(sorted(set(saved) - set(mine)))}")
    shapes = [f"{n}: saved {list(saved[n])}, state {list(mine[n])}" for n in sorted(set(saved) & set(mine)) if saved[n] != mine[n]]
    if shapes:
        problems.append(f"shapes differ: {_few(shapes)}")
    if problems:
        raise CheckpointError(
            f"{api}: the checkpoint {path} does not hold this model's parameters ({'; '.join(problems)}). Load it with "
            f"the model (and params pytree) it was saved from."
        )
    saved_opt = {o["key"]: (o["kind"], tuple(o.get("shape", ()))) for o in info["opt"]}
    my_opt = {k: (PARAM, ()) for k in e.per_param if k.startswith("opt/")}
    my_opt.update({k: (TENSOR, tuple(t.shape)) for k, t in e.tensors.items() if k.startswith("opt/")})
    for k in [k for k in my_opt if _is_skip_count(k) and k not in saved_opt]:
        del my_opt[k]  # saved before per-parameter skip counts existed: every param took every step (zeros)
    if saved_opt != my_opt:
        raise CheckpointError(
            f"{api}: the optimizer state in {path} ({_few(sorted(saved_opt))}) differs from this step's optimizer's "
            f"({_few(sorted(my_opt))}). Load with the optimizer the checkpoint was saved with (same transforms, same "
            f"kind of learning rate: a float or a schedule)."
        )


RECORD_BYTES = 1024  # the least DCP's torch.save adds per record (zip headers, pickle, 64-byte alignment); measured 1.5-1.8 kB


def size_lower_bound(state: TrainState, e: Entries, *, processes: int, rng_bytes: int, rng_records: int = 1) -> int:
    """At least how many bytes the data files of a checkpoint of rank states like ``state`` take (every rank's part
    together): the tensor bytes plus ``RECORD_BYTES`` for each record there must be (one per parameter and
    per-parameter entry at least, one per other tensor, ``rng_records`` RNG states of ``rng_bytes`` together per
    process: this process's, ``_rng``). Every rank computes it alike."""
    total = sum(t.numel() * t.element_size() for t in e.tensors.values()) + processes * rng_bytes
    for source in e.per_param.values():
        total += sum(unit.numel * source.dtype(unit.name).itemsize for unit in state.meta.layout.units)
    params = sum(len(unit.slots) for unit in state.meta.layout.units)
    return total + RECORD_BYTES * (params * len(e.per_param) + len(e.tensors) + processes * rng_records)


def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(map(str, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


# -- entries that are one tensor: each read aside, then compared ----------------------------------------------


def read_shared_aside(e: Entries) -> tuple[Entries, dict[str, str]]:
    """``e`` with every optimizer entry whose tensors are those of an earlier entry (``multi_transform``'s two
    ``adamw`` groups in memory share one Adam state) given a copy of its own to be read into, and ``{that entry: the
    earlier one}``. Why: a checkpoint that does not say whether its groups shared their state (saved before
    ``groups_share_state`` was recorded) is judged by what it holds: read into one tensor, the second entry's values
    silently replaced the first's; read aside, the two can be compared (``shared_that_differ``) before the state is
    used. The copies start as the shared tensor, so elements no entry reads (padding) compare equal."""
    owner: dict[tuple[int, int, torch.dtype], str] = {}
    per_param, aside = dict(e.per_param), {}
    for key, source in e.per_param.items():
        tensors = getattr(source, "tensors", None)  # in memory; disk offload's files are each their own
        if not key.startswith("opt/") or tensors is None:
            continue
        ids = [(t.data_ptr(), t.numel(), t.dtype) for t in tensors.values() if t.numel()]
        first = next((owner[i] for i in ids if i in owner), None)
        if first is None:
            owner.update(dict.fromkeys(ids, key))
            continue
        per_param[key] = _Memory({u: t.detach().clone() for u, t in tensors.items()})
        aside[key] = first
    return Entries(per_param, e.tensors), aside


def shared_that_differ(state: TrainState, e: Entries, read: Entries, aside: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(param, entry, other entry)`` for each param whose elements two entries of ``state`` that are one tensor
    (``e``, the state's own entries) were read with different values (``read``: ``read_shared_aside``'s, after the
    read): the checkpoint kept those entries apart (each group's moments in files of its own, under
    ``offload='disk'``; a state copied leaf by leaf), and one tensor can hold only one of them."""
    layout, rank, n = state.meta.layout, state.meta.rank, state.meta.world_size
    out = []
    for later, first in aside.items():
        mine, theirs, kept = e.per_param[later].tensors, e.per_param[first].tensors, read.per_param[later].tensors
        for unit in layout.units:
            shared, copy = theirs[unit.name], kept[unit.name]
            if mine[unit.name].data_ptr() != shared.data_ptr() or not shared.numel():
                continue
            lo, hi, base = _window(unit, read.per_param[later], rank, n, holding=True, api="fzero.checkpoint.load")
            for slot, a, b in _overlaps(unit, lo, hi):
                if not same_values(shared[a - base:b - base], copy[a - base:b - base]):
                    out.append((slot.path, first, later))
    return out


# -- pieces to write, destinations to read ------------------------------------------------------------------


def _window(unit: Unit, source: Any, rank: int, n: int, *, holding: bool, api: str) -> tuple[int, int, int]:
    """(lo, hi, base): the range of the unit's padded buffer to write (holding=False) or to read (holding=True),
    and the buffer index where ``source``'s tensor starts (0 if it holds the whole buffer, r*S if only its shard)."""
    numel, (lo, hi) = source.numel(unit.name), unit.shard_range(rank, n)
    if numel == unit.padded:
        return (0, unit.padded, 0) if holding else (lo, hi, 0)
    if numel == hi - lo:
        return lo, hi, lo
    raise CheckpointError(
        f"{api}: unit {unit.name!r} holds {numel} elements on rank {rank}, neither the whole padded buffer "
        f"({unit.padded}) nor a shard ({hi - lo}); the state does not match its layout."
    )


def _overlaps(unit: Unit, lo: int, hi: int) -> Iterator[tuple[Any, int, int]]:
    for slot in unit.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            yield slot, a, b


def pieces(state: TrainState, e: Entries, *, replicated: bool, api: str) -> list[Piece]:
    """What this rank state writes: its window of every per-parameter source, and (once) the replicated tensors."""
    layout, rank, n = state.meta.layout, state.meta.rank, state.meta.world_size
    out = []
    for unit in layout.units:
        for prefix, source in e.per_param.items():
            lo, hi, base = _window(unit, source, rank, n, holding=False, api=api)
            for slot, a, b in _overlaps(unit, lo, hi):
                out.append(Piece(
                    f"{prefix}/{slot.path}", (slot.numel,), (a - slot.offset,), (b - a,), source.dtype(unit.name),
                    lambda s=source, u=unit.name, i=a - base, j=b - base: s.get(u, i, j),
                ))
    if replicated:
        for key, t in e.tensors.items():
            out.append(Piece(key, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, lambda t=t: t))
    return out


def dests(state: TrainState, e: Entries, info: dict[str, Any]) -> list[Dest]:
    """Where this rank state's tensors come from: all it holds of every unit, and the replicated tensors."""
    layout, rank, n = state.meta.layout, state.meta.rank, state.meta.world_size
    saved_master = info["master"]
    out = []
    for unit in layout.units:
        for prefix, source in e.per_param.items():
            key = prefix
            if prefix == "params" and saved_master and source.dtype(unit.name) == torch.float32:
                key = "master"  # an fp32 step resumes from the fp32 masters, not their rounding
            elif prefix == "master" and not saved_master:
                key = "params"
            lo, hi, base = _window(unit, source, rank, n, holding=True, api="fzero.checkpoint.load")
            for slot, a, b in _overlaps(unit, lo, hi):
                out.append(Dest(
                    f"{key}/{slot.path}", (a - slot.offset,), (b - a,), source.dtype(unit.name), **source.dest(unit.name, a - base, b - base)
                ))
    saved_scale = set(info["loss_scale"] or ())
    saved_opt = {o["key"] for o in info["opt"]}
    saved_buffers = {b["name"] for b in info.get("buffers", ())}
    for key, t in e.tensors.items():
        if key.startswith("loss_scale/") and key.removeprefix("loss_scale/") not in saved_scale:
            continue  # a policy with a loss scale resumed from one without: keep the initial scale
        if key.startswith("buffers/") and key.removeprefix("buffers/") not in saved_buffers:
            continue  # saved before a step adopted it: the state keeps its own (or adopts it at its first step)
        if _is_skip_count(key) and key not in saved_opt:
            continue  # saved before per-parameter skip counts existed: the state's zeros are right
        out.append(Dest(key, (0,) * t.dim(), tuple(t.shape), t.dtype, view=t))
    return out


# -- which rank states this process holds ----------------------------------------------------------------


def held(state: Any, api: str) -> tuple[list[TrainState], bool]:
    """The rank states this process holds, and whether they are one rank of a torch.distributed job."""
    if is_busy(state) and not is_donated(state):
        raise ValueError(f"{api}: a step is running on this state now, in another thread, and updating its buffers in place; "
                         f"save the state that step returns.")
    if is_donated(state):
        raise ValueError(f"{api}: this state was already passed to a step, which reused its buffers, or a state sharing them "
                         f"was (step.with_buffers' result and the state it was given are one); save the state that step returned.")
    if isinstance(state, RankStates):
        return list(state.states), False
    if not isinstance(state, TrainState) or state.meta is None:
        raise TypeError(f"{api}: expected a TrainState or RankStates from Step.init or a step, got {type(state).__name__}.")
    n, rank = state.meta.world_size, state.meta.rank
    if n == 1:
        return [state], False
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != n or dist.get_rank() != rank:
        raise ValueError(
            f"{api}: this TrainState is rank {rank} of {n}, but this process is not rank {rank} of a {n}-process "
            f"torch.distributed job. Under fzero.local_mesh pass the whole RankStates (all ranks' states); under torchrun "
            f"call it on every rank with that rank's state."
        )
    return [state], True


def which_process(distributed: bool) -> tuple[int, int]:
    """This process's rank and the number of processes that write (or read) the checkpoint together."""
    return (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
