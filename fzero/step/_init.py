"""``Step.init``: the initial state of every rank this process runs, packed unit by unit.

Each unit is packed once (its meta leaves made by ``materialize`` first), broadcast from rank 0 under
``dist_mesh`` (as DDP does), and each rank keeps what its ``params`` part holds of it (the whole buffer,
or its shard) and what its ``opt_state`` part holds of the fp32 master; then the packed buffer is
dropped, so at stage 3 the params are never whole all at once (only shards and one unit).

``materialize`` is any ``(path, meta) -> tensor``: a model's own initializer, or
``fzero.checkpoint.pretrained(dir, model=model)``, which reads each param from a Hugging Face checkpoint when its
unit is packed. A ``materialize`` object with an ``init_buffers()`` method (that reader) also gives the state's
persistent buffers when ``buffers=`` is not passed. The model comes from ``fzero.empty_params()`` (parameters
on meta, buffers real); a meta tensor left in the module is named by ``fzero.apply`` before the first forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from fzero.mesh import AGREE_FIX, DistMesh, LocalMesh, program_fields
from fzero.layout import (pytrees as _tree, DEVICE_TYPES, Layout, ROOT, Slot, Unit, build_frozen, build_layout, device_of, frozen_key, pack_frozen,
                          LayoutSegments, check_units_exist)
from fzero.optim import use_segments
from fzero.step._donate import Donated, byte_span, packed_values
from fzero.step._refusals import check_not_freed
from fzero.step._update import init_loss_scale
from fzero.step._state import RankStates, StateMeta, TrainState

API = "fzero.Step.init"


def _check_remat_has_units(step: Any, layout: Any) -> None:
    """Refuse ``remat=True`` or ``jit=True`` at stages 2-3 where the layout has no unit but the root.

    Why: both act on each unit (remat recomputes its forward, jit compiles it); the root unit (what no unit holds) runs
    once, eagerly, with its graph kept. A model whose blocks are plain attributes (``self.block1``, ``self.block2``: no
    ``ModuleList``/``Sequential`` index in any param's name, so no default unit) had every param in the root:
    ``remat=True`` recomputed nothing and saved no activation memory, ``jit=True`` compiled nothing, without a word."""
    asked = [name for name, on in (("remat=True", step.unit_settings.remat), ("jit=True", step.unit_settings.jit)) if on]
    if not asked or step.grads.unit_of(API) is None:
        return
    if any(u.name != ROOT for u in layout.units):
        return
    what = {"remat=True": "recomputes each unit's forward in backward", "jit=True": "compiles each unit's forward"}
    raise ValueError(
        f"{API}: {' and '.join(f'{a} {what[a]}' for a in asked)}, but every param is in the root unit (the default units "
        f"are the children of a ModuleList/Sequential, and no param name has one's index), so nothing would be "
        f"{'recomputed (no activation memory saved)' if 'remat=True' in asked else 'compiled'}. Name the blocks as "
        f"units: units=fzero.units_of(model, module_types=YourBlock) or their module paths, e.g. units=('block1', "
        f"'block2'); or drop {' and '.join(asked)}."
    )


def init_state(step: Any, params: Any, *, buffers: dict[str, torch.Tensor] | None,
               materialize: Callable[[str, torch.Tensor], torch.Tensor] | None, donate: bool = False,
               frozen: dict[str, torch.Tensor] | None = None) -> TrainState | RankStates:
    """See ``Step.init``."""
    if materialize is not None and not callable(materialize):
        raise TypeError(f"{API}: materialize must be a function (path, meta_tensor) -> tensor, got {materialize!r}.")
    if getattr(materialize, "__qualname__", None) == "pretrained" and getattr(materialize, "__module__", "").startswith("fzero.checkpoint"):
        raise TypeError(f"{API}: materialize=fzero.checkpoint.pretrained is the function that makes a reader, not a "
                        f"reader (called with (path, meta) it fails on its arguments); pass its result: "
                        f"materialize=fzero.checkpoint.pretrained(dir, model=model).")
    if not isinstance(donate, bool):
        raise TypeError(f"{API}: donate must be True or False, got {donate!r}.")
    if buffers is None and hasattr(materialize, "init_buffers"):  # a checkpoint reader: its persistent buffers too
        buffers = getattr(materialize, "init_buffers")()
    buffers = _checked_buffers(buffers)
    n = step.world_size
    prec = step.precision
    low = None if prec.compute == torch.float32 else prec.compute
    check_params_train(params, low_precision=low is not None, compute=prec.compute, master=prec.has_master)
    layout = build_layout(params, world_size=n, unit_elements=step.unit_elements, unit_of=step.grads.unit_of(API), dtype=low, api=API)
    if step.grads.units is not None:  # a typo would otherwise silently leave its params in the root unit
        # with frozen=, a unit may hold frozen params alone (a frozen tower named as one unit)
        check_units_exist(step.grads.units, [*layout.paths, *(frozen if isinstance(frozen, dict) else ())], api=API)
    if frozen is not None:
        layout = _frozen_layout(step, layout, params, frozen, low)
    _check_remat_has_units(step, layout)
    paths, leaves, _ = _tree.flatten_with_paths(params)
    check_not_freed(zip([p or "<root>" for p in paths], leaves), api=API, what="params")
    device = device_of(paths, leaves, api=API)  # None: all meta (made by materialize, or received)
    donated = Donated(paths, leaves) if donate else None
    dist = isinstance(step.mesh, DistMesh)
    ranks = list(range(n)) if isinstance(step.mesh, LocalMesh) else [step.mesh.rank if dist else 0]
    receives = dist and ranks[0] != 0  # its values come from rank 0's broadcast
    if materialize is None and not receives and any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
        where = f"rank {ranks[0]} of dist_mesh" if dist else ("a local_mesh" if n > 1 else "a single rank")
        raise ValueError(
            f"{API}: params hold meta tensors (shapes without values) on " + where + ", and no materialize= "
            "makes them. Pass materialize=fn(path, meta_tensor) -> initial value (e.g. model.init_value), or real "
            "params; only ranks other than 0 under fzero.dist_mesh() may pass meta params alone (rank 0's values "
            "are broadcast to them, as FSDP's sync_module_states). A module whose parameters were given to a state by "
            "step.init(fzero.params_of(model, copy=False), donate=True) holds meta tensors since: its values are that "
            "state's (step.gather(state))."
        )
    comm = step.mesh.comm(api="fzero.Step.init") if dist else None
    reader = _reader_on_every_rank(materialize, comm, step.mesh) if comm is not None else None
    if reader is not None:  # every rank reads its own part of the checkpoint: none receives
        receives = False
    make = None if receives else materialize
    if device is None and receives:
        device = step.mesh.device
    agreed = comm is None
    if comm is not None and reader is not None:  # its values are made where the reader makes them, on every rank alike
        device = device or reader.device
        comm.agree(program_fields(layout, stage=step.stage, precision=prec, grad_accum=step.grad_accum, device_type=device.type,
                                  collectives=getattr(comm, "collectives", None)), api=API, fix=AGREE_FIX)
        agreed = True
    flats: dict[int, dict[str, torch.Tensor]] = {r: {} for r in ranks}
    masters: dict[int, dict[str, torch.Tensor]] | None = {r: {} for r in ranks} if prec.has_master else None
    made: dict[int, TrainState] = {}
    try:
        for unit in layout.units:
            indices = layout.leaf_indices(unit)
            if reader is not None and all(leaves[j].is_meta and reader.reads(s.path) for j, s in zip(indices, unit.slots)):
                device = _read_own_part(step, layout, unit, leaves, reader, ranks[0], device, flats, masters)
                if donated is not None:
                    donated.packed(indices)
                continue
            values = leaves
            if make is not None and (reader is None or ranks[0] == 0):  # this unit's meta leaves made once, for both packings below
                values = list(leaves)
                for j, slot in zip(indices, unit.slots):
                    if values[j].is_meta:
                        values[j] = _materialized(make, slot, values[j], device)
                if device is None:  # the first made value decides, and the others must follow it
                    device = next(values[j].device for j in indices)
            if comm is not None and not agreed:  # once, before any collective could pair unrelated buffers of one padded size; here, because
                # a rank that makes its params learns their device from the first unit it made
                if dist:  # the receivers keep their state where rank 0 keeps its own: rank 0's materialize may make CPU
                    # tensors on a machine with CUDA (the mesh's guess for a rank that only receives), and a job of more
                    # ranks than GPUs runs on the CPU
                    code = torch.tensor([0 if device is None or device.type == "cpu" else 1])  # on the GPU without gloo (host_stage)
                    comm.broadcast(code, src=0, tag="init")
                    if receives and int(code[0]) == 0:
                        device = torch.device("cpu")
                fields = program_fields(layout, stage=step.stage, precision=prec, grad_accum=step.grad_accum,
                                        device_type=(device or torch.device("cpu")).type, collectives=getattr(comm, "collectives", None))
                comm.agree(fields, api=API, fix=AGREE_FIX)
                agreed = True
            flat = layout.pack_unit(unit, values, device=device)  # in the compute dtype
            master = layout.pack_unit(unit, values, dtype=torch.float32, device=device) if prec.has_master else None  # from fp32 values
            for t in (flat, master):
                if comm is not None and t is not None:
                    comm.broadcast(t, src=0, tag="init")
            for i, r in enumerate(ranks):
                lo, hi = unit.shard_range(r, n)
                flats[r][unit.name] = step.params.hold(flat, lo, hi, copy=i > 0)
                if masters is not None:  # the optimizer updates fp32 masters of what this rank owns
                    masters[r][unit.name] = step.opt_state.hold_master(master, lo, hi)
            del flat, master, values
            if donated is not None:
                donated.packed(indices)
        device = device or torch.device("cpu")  # no unit at all had a value: nothing was packed
        shards = _frozen_shards(layout, frozen or {}, ranks, device)
        seen = {name: (t._version, t.data_ptr()) for name, t in (frozen or {}).items()}
        for r in ranks:  # (each rank's packed buffers dropped once its state holds them: kept for a failure until then)
            made[r] = _with_frozen(_init_rank(step, layout, flats[r], masters and masters[r], r, device), buffers, shards[r], seen)
            del flats[r]
            if masters is not None:
                del masters[r]
        states = [made[r] for r in ranks]
    except BaseException as e:
        if donated is not None and donated.freed:  # the module's values are in what was packed: put them back
            donated.give_back(e, packed_values(step, layout, ranks, flats, masters, made))
        raise
    return RankStates(tuple(states)) if isinstance(step.mesh, LocalMesh) else states[0]


def _init_rank(step: Any, layout: Layout, flats: dict[str, torch.Tensor], master: dict | None, rank: int, device: torch.device) -> TrainState:
    """``flats``: what this rank holds of each unit; ``master``: the fp32 copy of what it owns."""
    # the optimizer's per-parameter state (Adam's skip counts) is sized by the layout's params, not its buffers
    with use_segments(LayoutSegments(layout, sharded=step.opt_state.sharded, rank=rank, comm=None)):
        opt_state, flats = step.opt_state.init(step.optimizer, step.params, layout, flats, master, rank)
    meta = StateMeta(layout=layout, stage=step.stage, world_size=layout.world_size, rank=rank, device=device)
    return TrainState(
        params=flats, opt_state=opt_state, step=torch.zeros((), dtype=torch.int64),
        loss_scale=init_loss_scale(step.precision.loss_scale), meta=meta,
    )


def _frozen_layout(step: Any, layout: Layout, params: Any, frozen: Any, low: torch.dtype | None) -> Layout:
    """``Step.init(..., frozen=...)``, checked: ``layout`` with the frozen groups (``fzero.layout.build_frozen``), and
    a unit of no trainable params for each module unit whose params are all frozen (a frozen block of a partial
    fine-tune, a frozen vision tower): gathered and freed as the others are, rather than with the root for the whole
    step.

    Why: a frozen parameter is the module's, read whole on every rank; a frozen base under a LoRA adapter is most of
    the model, so at stage 3 each rank would hold all of it beside its shard of what trains. DeepSpeed ZeRO-3 and
    FSDP2 shard frozen parameters too; ``frozen=`` does here: each rank keeps its shard, and each unit's frozen params
    are gathered with the unit."""
    if not step.params.sharded:
        raise ValueError(
            f"{API}: frozen= shards frozen params across the ranks at stage 3, but this step is {step.stage_name}, where "
            f"every rank holds the params whole and the frozen ones are read from the module. Leave frozen= out, or "
            f"train at stages=3.")
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in frozen.items()):
        raise TypeError(f"{API}: frozen must be a dict of parameter name -> tensor, as fzero.frozen_of(model) returns; got "
                        f"{type(frozen).__name__}.")
    if not frozen:
        raise ValueError(f"{API}: frozen= is an empty dict: the model has no frozen parameter (requires_grad=False) to "
                         f"shard. Leave frozen= out.")
    trained = set(layout.paths)
    for name, t in frozen.items():
        why = None
        if name in trained:
            why = "is in params too: a parameter either trains (params) or is frozen (frozen=)"
        elif t.requires_grad:
            why = "requires grad: a trained parameter belongs in params (fzero.params_of(model))"
        elif type(t) not in (torch.Tensor, nn.Parameter):  # a quantized weight (bitsandbytes' Params4bit) is not its values
            why = (f"is a {type(t).__name__}, whose data is not the values the module computes with (a quantized "
                   f"weight); leave it out of frozen= and it is read from the module")
        elif not t.is_floating_point():
            why = f"has dtype {t.dtype}; frozen= shards floating-point params, leave it out and it is read from the module"
        elif t.is_meta:
            why = "is a meta tensor (a shape without a value): give it its value first (load the pretrained weights)"
        if why is not None:
            raise ValueError(f"{API}: frozen[{name!r}] {why}.")
    paths, leaves, _ = _tree.flatten_with_paths(params)
    at = device_of(paths, leaves, api=API)
    devices = {t.device for t in frozen.values()}
    if len(devices) > 1 or at is not None and devices != {at}:
        raise ValueError(f"{API}: the frozen params are on {sorted(map(str, devices))} and params on {at}; a unit's frozen "
                         f"params are gathered with it, so give them the params' device (model.to(device) before "
                         f"fzero.params_of and fzero.frozen_of).")
    unit_of = step.grads.unit_of(API) or (lambda p: ROOT)
    trained = {u.name for u in layout.units}
    empty = dict.fromkeys(u for u in map(unit_of, frozen) if u != ROOT and u not in trained)
    units = (*layout.units, *(Unit(name, (), 0, 0, layout.units[0].dtype) for name in empty))
    layout = dataclasses.replace(layout, units=units)
    return dataclasses.replace(layout, frozen=build_frozen(frozen, layout, unit_of=unit_of), frozen_compute=low)


def _with_frozen(state: TrainState, buffers: dict, frozen: dict, seen: dict) -> TrainState:
    """``state`` with (copies of) the buffers and its frozen shards, kept where it keeps its params' shards (the host,
    with ``offload_params``; each comes to the device to be gathered, as theirs do)."""
    where = next((t.device for t in state.params.values()), None)
    frozen = {k: v.to(where) for k, v in frozen.items()} if where is not None else frozen
    meta = state.meta
    if seen and meta is not None:
        meta = dataclasses.replace(meta, frozen_seen=seen)
    return dataclasses.replace(state, buffers={k: v.clone() for k, v in buffers.items()}, frozen=frozen, meta=meta)


def _frozen_shards(layout: Layout, frozen: dict[str, torch.Tensor], ranks: list[int], device: torch.device) -> dict[int, dict]:
    """Each rank's shard of every frozen group, packed one group at a time, in the group's dtype (the params' own)."""
    out: dict[int, dict[str, torch.Tensor]] = {r: {} for r in ranks}
    for group in layout.frozen:
        flat = pack_frozen(group, frozen, dtype=group.dtype, device=device)
        for r in ranks:
            lo, hi = group.shard_range(r, layout.world_size)
            out[r][frozen_key(group)] = flat[lo:hi].clone()
        del flat
    return out


def _reader_on_every_rank(materialize: Any, comm: Any, mesh: Any) -> Any:
    """``materialize`` where every rank of the ``dist_mesh`` was given a checkpoint reader (an object with
    ``reads(path)``, ``read_range(path, meta, start, stop)`` and ``device``: ``fzero.checkpoint.pretrained``), else None.

    Why: a reader gives every rank the same values, so each rank can read the part of a unit it keeps (its
    shard at stage 3) from the files itself, in parallel, instead of rank 0 reading every unit whole and
    broadcasting it: no rank reads or receives the model, and nothing of it crosses the network. Where any rank
    has no reader (ranks other than 0 may pass meta params alone), all ranks keep rank 0's broadcast."""
    has = all(callable(getattr(materialize, name, None)) for name in ("reads", "read_range")) and hasattr(materialize, "device")
    count = torch.tensor([1 if has else 0], dtype=torch.int64)  # reduced on the GPU where the group has no gloo (host_stage)
    comm.all_reduce(count, tag="init")
    return materialize if int(count[0]) == comm.size else None


def _read_own_part(step: Any, layout: Layout, unit: Unit, leaves: list, reader: Any, rank: int, device: torch.device | None,
                   flats: dict, masters: dict | None) -> torch.device:
    """Pack what ``rank`` keeps of ``unit`` (its shard at stage 3, the whole unit where its params or masters are
    whole) from its own reads of the checkpoint; returns the device the values were made on."""
    lo, hi = unit.shard_range(rank, layout.world_size)
    whole = not step.params.sharded or masters is not None and not step.opt_state.sharded
    start, stop = (0, unit.padded) if whole else (lo, hi)
    pieces = {}
    for i, (j, slot) in enumerate(zip(layout.leaf_indices(unit), unit.slots)):
        a, b = layout.slot_range(unit, i, start, stop)
        if a < b:
            pieces[i] = _ranged(reader, slot, leaves[j], a, b, device)
            device = device or pieces[i].device
    device = device or torch.device(reader.device)
    flat = layout.pack_range(unit, pieces, start, stop, device=device)  # in the compute dtype
    flats[rank][unit.name] = step.params.hold(flat, lo - start, hi - start, copy=False)
    if masters is not None:  # from the values as read, before any cast to the compute dtype
        master = layout.pack_range(unit, pieces, start, stop, dtype=torch.float32, device=device)
        masters[rank][unit.name] = step.opt_state.hold_master(master, lo - start, hi - start)
    return device


def _ranged(reader: Any, slot: Slot, meta: torch.Tensor, a: int, b: int, device: torch.device | None) -> torch.Tensor:
    """``reader.read_range(path, meta, a, b)``: elements ``a:b`` of the flattened param, checked."""
    value = reader.read_range(slot.path, meta, a, b)
    if (not isinstance(value, torch.Tensor) or value.shape != (b - a,) or value.is_meta
            or device is not None and value.device != device):
        got = f"a {type(value).__name__}" if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)} on {value.device}"
        raise ValueError(f"{API}: materialize.read_range({slot.path!r}, ..., {a}, {b}) returned {got}; it must return "
                         f"elements {a}:{b} of the flattened parameter, shape ({b - a},)" + (f" on {device}." if device else "."))
    return value


def _checked_buffers(buffers: Any) -> dict[str, torch.Tensor]:
    if buffers is None:
        return {}
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items()):
        raise TypeError(
            f"{API}: buffers must be a dict of buffer name -> tensor, as fzero.buffers_of(model) returns; got "
            f"{type(buffers).__name__}."
        )
    meta = sorted(k for k, v in buffers.items() if v.is_meta)
    if meta:
        raise ValueError(f"{API}: buffers {meta[:3]} are meta tensors; pass their values (fzero.buffers_of of a materialized model).")
    return buffers


def _materialized(materialize: Callable, slot: Slot, meta: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """``materialize(path, meta)``, checked: Step.init's streaming init of a meta-device model. ``device``: where
    the params that are not meta live (the made values must be there too), or None."""
    value = materialize(slot.path, meta)
    where = "a CPU or CUDA tensor" if device is None else f"a tensor on {device} (where the other params are)"
    if (not isinstance(value, torch.Tensor) or value.shape != meta.shape or value.is_meta
            or value.device.type not in DEVICE_TYPES or device is not None and value.device != device):
        got = f"a {type(value).__name__}" if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)} on {value.device}"
        raise ValueError(
            f"{API}: materialize({slot.path!r}, ...) returned {got}; it must return the parameter's initial "
            f"value, {where} of shape {tuple(meta.shape)}."
        )
    return value


def check_params_train(params: Any, *, low_precision: bool, compute: torch.dtype = torch.float32, master: bool = False) -> None:
    """Refuse params that a step would train other than as given, before anything is packed.

    - The same tensor under two paths (or two overlapping views of one storage): each path would become a slot
      of its own and train apart, breaking the tie. ``fzero.params_of`` lists a tied parameter once, and
      ``fzero.apply`` resolves its other names (``tie_weights=True``), as PyTorch trains it: as one.
    - A frozen module parameter (an ``nn.Parameter`` with ``requires_grad=False``, or a tensor without it among
      tensors with it): the step would update it like any other. ``fzero.params_of`` leaves it out, and
      ``fzero.apply`` reads it from the module.
    - Under an fp32 policy, a parameter of another dtype (float64, bf16): the step holds every parameter in its
      compute dtype, and a unit holds one dtype.
    - Under a bf16/fp16 policy without master weights, a model of several floating dtypes: its wider parameters
      would train in the compute dtype (``_check_low_precision_dtypes``).
    """
    if params is None:
        return
    paths, leaves, _ = _tree.flatten_with_paths(params)
    tensors = [(p or "<root>", x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]
    _check_no_ties(tensors)
    trains = any(x.requires_grad for _, x in tensors)
    for path, x in tensors:
        if not x.requires_grad and (isinstance(x, nn.Parameter) or trains):
            raise ValueError(
                f"{API}: params[{path!r}] is frozen (requires_grad=False), but every tensor in params is trained. "
                f"Leave frozen parameters out of params: fzero.params_of(model) does, and fzero.apply reads them from "
                f"the module; or set requires_grad=True to train it."
            )
        if not low_precision and x.is_floating_point() and x.dtype != torch.float32:
            raise TypeError(
                f"{API}: params[{path!r}] is {x.dtype}, but this step computes in torch.float32 (precision=\"fp32\") and "
                f"holds every parameter in that dtype. Cast it (model.float(), or {{k: v.float() for k, v in params.items()}}), "
                f"or give the step the policy of that dtype (precision=\"bf16\" or \"fp16\" for half-precision params)."
            )
    if low_precision:
        _check_low_precision_dtypes(tensors, compute=compute, master=master)


def _check_low_precision_dtypes(tensors: list[tuple[str, torch.Tensor]], *, compute: torch.dtype, master: bool) -> None:
    """Without master weights (``Precision(master=False)``) the state holds and updates every parameter in the compute
    dtype. A model of several floating dtypes (a bf16 Hugging Face model whose ``_keep_in_fp32_modules`` stay fp32,
    as T5's ``wo``) is refused: its wider parameters would train, and be exported, in the compute dtype, where plain
    PyTorch updates each in its own. A model of one dtype is cast whole, as ``master=False`` asks (Lightning's
    ``"bf16-true"``); with fp32 masters, the wider parameters' values stay in the masters (an fp64 one as fp32, as
    DeepSpeed's bf16 engine keeps it).
    """
    floats = [(path, x) for path, x in tensors if x.is_floating_point()]
    if master or len({x.dtype for _, x in floats}) <= 1:
        return
    wide = [(path, x.dtype) for path, x in floats if x.dtype != compute]
    raise TypeError(
        f"{API}: params {_named(wide)} are not {compute}, the compute dtype of this step without master weights "
        f"(fzero.Precision(compute={compute}, master=False)), which holds and updates every parameter in it: they "
        f"would train and be exported in {compute}, where plain PyTorch updates each in its own dtype. Keep fp32 "
        f"masters for them (precision=\"bf16\"/\"fp16\", or Precision(master=True): their values stay exact in "
        f"the masters and run in the compute dtype, as DeepSpeed's bf16 engine runs them), or cast the model "
        f"to one dtype first (model.to({compute})) to train them all in it."
    )


def _named(items: list[tuple[str, torch.dtype]]) -> str:
    """The first three paths with their dtypes, and how many more."""
    shown = ", ".join(f"{path!r} ({dtype})" for path, dtype in items[:3])
    return f"[{shown}" + (f", ... {len(items) - 3} more]" if len(items) > 3 else "]")


def _check_no_ties(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Two leaves that are one tensor, or views of overlapping memory, are refused by both paths."""
    spans: dict[Any, list[tuple[int, int, str]]] = {}
    first: dict[int, str] = {}
    for path, x in tensors:
        other = first.setdefault(id(x), path)
        if other == path and not x.is_meta and x.numel():
            storage = x.untyped_storage()
            lo, hi = byte_span(x)
            key = (storage.device, storage.data_ptr())
            for a, b, q in spans.get(key, ()):
                if lo < b and a < hi:
                    other = q
            spans.setdefault(key, []).append((lo, hi, path))
        if other != path:
            raise ValueError(
                f"{API}: params[{other!r}] and params[{path!r}] are the same tensor (or overlapping views of one), so the "
                f"step would train them as two parameters and break the tie. Pass a tied parameter once, as "
                f"fzero.params_of(model) does: fzero.apply(model, params, ...) gives it to every name it is tied to."
            )
