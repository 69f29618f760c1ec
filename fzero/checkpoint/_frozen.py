"""Frozen parameters in a checkpoint: ``save(..., model=model)`` and ``load(..., model=model)``.

A state holds what trains; a frozen parameter (``requires_grad=False``) stays in the module and ``fzero.apply``
reads it from there. So a checkpoint of the state alone does not hold it, and a run resumed in a fresh process
trains on with whatever values that process built: a layer trained and then frozen resumes as its random init,
silently. DeepSpeed saves frozen parameters with the module by default (``exclude_frozen_parameters=False``), and
FSDP's ``model.state_dict()`` holds them. With ``model=`` a save writes them too, as ``frozen/<name>`` (rank 0's,
as the buffers), and a load needs the module to put them back into. Without it nothing changes, for a frozen base
that comes from elsewhere (a pretrained checkpoint under a LoRA adapter).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from fzero.checkpoint import _dcp
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._state import dtype_name
from fzero.layout import frozen_key, pack_frozen
from fzero.step import module_device, replace_params


def frozen_of(model: Any, *, api: str, held: Any = ()) -> dict[str, torch.Tensor]:
    """``model``'s frozen parameters by name (a tied one once, under its first name, as ``named_parameters``).
    ``held``: the names a state holds sharded (``step.init(..., frozen=...)``), which may be meta in the module
    (``fzero.free_frozen``): their values come from the state."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{api}: model must be the nn.Module the state trains (its frozen parameters are saved with "
                        f"it), got {type(model).__name__}.")
    out = {name: p for name, p in model.named_parameters() if not p.requires_grad}
    meta = [name for name, p in out.items() if p.is_meta and name not in held]
    if meta:
        raise ValueError(f"{api}: the frozen parameters {meta[:4]} of {type(model).__name__} are meta tensors, with no "
                         f"values to save. Give them values first (load the pretrained weights they come from), or save "
                         f"without model= and rebuild them the same way when you resume.")
    return out


def describe(frozen: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """What ``fzero.json`` records of them: name, shape and dtype, in the model's order."""
    return [{"name": n, "shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in frozen.items()]


def ties(model: Any, held: list[str]) -> dict[str, str]:
    """``{alias: held name}`` for every other name of a parameter the checkpoint holds under one name (tied weights:
    a GPT-2's ``lm_head.weight`` is its ``transformer.wte.weight``), so that a consolidation without the model (the
    command line's) writes each name ``model.state_dict()`` has, as DeepSpeed's ``zero_to_fp32`` restores shared
    parameters, and the file loads strictly."""
    held_set, first_of, out = set(held), {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first_of.setdefault(id(p), []).append(name)
    for names in first_of.values():
        kept = [n for n in names if n in held_set]
        if len(kept) == 1:
            out.update({n: kept[0] for n in names if n != kept[0]})
    return out


def pieces(frozen: dict[str, torch.Tensor]) -> list[_dcp.Piece]:
    """Each whole, written by one process (rank 0), as the buffers are."""
    return [_dcp.Piece(f"frozen/{n}", tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, _host(t)) for n, t in frozen.items()]


def _host(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t.detach().cpu()


def load_into(model: Any, found: str, info: dict[str, Any], read: Callable[[list[_dcp.Dest]], None], *, api: str,
              held: Any = (), device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's frozen parameters into ``model``'s, by name, strict: the same names, shapes, and frozen; returns
    them by name. ``read(dests)`` reads the checkpoint's tensors into the given views. ``held``: the names the state
    holds sharded (``step.init(..., frozen=...)``): a meta one in the module (``fzero.free_frozen``) gets its value in
    the state alone (``into_state``). ``device``: where the state computes, for meta ones of a module with no real
    tensor to say where it runs."""
    saved = info.get("frozen")
    if model is None:
        if saved:
            names = [f["name"] for f in saved]
            raise CheckpointError(
                f"{api}: {found} holds the frozen parameters {names[:4]}{' ...' if len(names) > 4 else ''} of the model it "
                f"was saved with (save(..., model=model)); pass that model, load(path, like=..., model=model), so that they "
                f"go back into it: without them a run resumes on whatever values the module was built with."
            )
        return {}
    have = frozen_of(model, api=api, held=[n for n, p in model.named_parameters()])  # meta ones get the checkpoint's below
    if saved is None:
        if have:
            raise CheckpointError(
                f"{api}: {found} was saved without model=, so it holds none of the frozen parameters of "
                f"{type(model).__name__} ({list(have)[:4]}{' ...' if len(have) > 4 else ''}); load it without model= and "
                f"give the module those values as when the checkpoint was saved (the pretrained weights they came from)."
            )
        return {}
    want = {f["name"]: f for f in saved}
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} & set(missing)
        raise CheckpointError(
            f"{api}: the frozen parameters of {type(model).__name__} are not those {found} saved: "
            + "; ".join(x for x in (f"saved but not frozen in the model: {missing[:4]}" + (" (trainable there)" if trainable else "") if missing else "",
                                    f"frozen in the model but not saved: {extra[:4]}" if extra else "") if x)
            + ". Build the model (and freeze it) as it was when the checkpoint was saved."
        )
    bad = [n for n, f in want.items() if list(have[n].shape) != f["shape"]]
    if bad:
        raise CheckpointError(f"{api}: frozen parameter {bad[0]!r} has shape {want[bad[0]]['shape']} in {found} but "
                              f"{list(have[bad[0]].shape)} in {type(model).__name__}: another configuration of the model.")
    values = {n: torch.empty(f["shape"], dtype=getattr(torch, f["dtype"])) for n, f in want.items()}
    read([_dcp.Dest(f"frozen/{n}", (0,) * t.dim(), tuple(t.shape), t.dtype, view=t) for n, t in values.items()])
    with torch.no_grad():
        for n, t in values.items():
            if not have[n].is_meta:
                have[n].copy_(t)
    # a meta one (``fzero.free_frozen``, or a model built on meta) becomes a parameter of the checkpoint's value, unless
    # the state holds it sharded (``held``: it gets the value there, ``into_state``, and the module stays emptied)
    # on the module's device; in a module of meta tensors alone, where the state computes (on the host, a CUDA state's
    # forward met host frozen params: "Expected all tensors to be on the same device")
    device = module_device(model) or device or torch.device("cpu")
    replace_params(model, {n: t.to(device) for n, t in values.items() if have[n].is_meta and n not in held})
    return values


def held_names(state: Any) -> list[str]:
    """The frozen params ``state`` (a TrainState or RankStates) holds sharded."""
    first = state.states[0] if hasattr(state, "states") else state
    return [s.path for g in first.meta.layout.frozen for s in g.slots] if first.meta is not None else []


def into_state(state: Any, values: dict[str, torch.Tensor], model: nn.Module) -> Any:
    """``state`` whose sharded frozen params (``step.init(..., frozen=...)``) are ``values`` (a checkpoint's, by name),
    on every rank it holds: a run resumed with ``load(..., model=)`` trains on the frozen values the checkpoint saved,
    as the module does, not on those the state was made from. Groups the checkpoint does not hold keep the state's.
    ``model``'s copies (``load_into`` wrote the values into those ``fzero.free_frozen`` left real) are recorded as read
    (``StateMeta.frozen_seen``): that write is the checkpoint's, not one the state would miss."""
    named = dict(model.named_parameters())
    seen = {n: (p._version, p.data_ptr()) for n, p in named.items() if n in values and not p.is_meta}

    states = list(state.states) if hasattr(state, "states") else [state]
    layout = states[0].meta.layout
    frozen = [dict(s.frozen) for s in states]
    for g in layout.frozen:  # each group packed once, every rank's shard cut from it
        if not all(slot.path in values for slot in g.slots):
            continue
        key = frozen_key(g)
        like = frozen[0][key]
        flat = pack_frozen(g, values, dtype=like.dtype, device=like.device)
        for s, mine in zip(states, frozen):
            lo, hi = g.shard_range(s.meta.rank, layout.world_size)
            mine[key] = flat[lo:hi].clone()
    out = [dataclasses.replace(s, frozen=mine, meta=dataclasses.replace(s.meta, frozen_seen={**s.meta.frozen_seen, **seen}))
           for s, mine in zip(states, frozen)]
    return type(state)(tuple(out)) if hasattr(state, "states") else out[0]
