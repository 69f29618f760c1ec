"""The entry points that take a module's tensors out of it and put them back, outside a step: its trainable params
(``params_of``), its frozen ones (``frozen_of``, ``free_frozen``, ``replace_params``), where its tensors are
(``module_device``), and its persistent buffers (``buffers_of``).

Kept apart from ``fzero.step._module`` (``apply`` and the buffer bank, which run at every step): these make
``step.init``'s arguments, or put values back into a module after training (``step.restore_frozen``, a checkpoint's
frozen params), and none of them runs in a step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fzero.step._donate import DONATED_FROM
from fzero.step._module import check_not_compiled, persistent_buffers
from fzero.step._refusals import check_not_freed, check_not_fsdp


def params_of(module: nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` as ``{name: detached copy}``, in ``named_parameters`` order.

    Copies, so that training never writes into the module; a tied parameter appears once, under its first
    name (as ``named_parameters`` lists it). Frozen parameters (``requires_grad=False``) are left out: they
    stay in the module and ``fzero.apply`` reads them from there. ``copy=False`` gives the module's own
    tensors, detached: for ``step.init``, which copies anyway, so that a large model is not held twice.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.params_of: expected an nn.Module, got {type(module).__name__}.")
    check_not_compiled(module, api="fzero.params_of")
    check_not_fsdp(module, api="fzero.params_of")
    if not isinstance(copy, bool):
        raise TypeError(f"fzero.params_of: copy must be True or False, got {copy!r}.")
    lazy = [name for name, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"fzero.params_of: {len(lazy)} parameter(s) of {type(module).__name__} are uninitialized (a lazy module, such "
            f"as nn.LazyLinear, before its first forward): {lazy[:4]}. Run the model once on a sample batch "
            f"(with torch.no_grad(): model(x)) so that they get their shapes and values, then call fzero.params_of(model)."
        )
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    check_not_freed(named, api="fzero.params_of", what=f"parameter(s) of {type(module).__name__}")
    if copy:
        return {name: p.detach().clone() for name, p in named}
    out = {}
    for name, p in named:
        out[name] = view = p.detach()
        view.__dict__[DONATED_FROM] = p  # step.init(..., donate=True) turns the module's parameter to meta too (_donate)
    return out


def frozen_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters of ``module`` (``requires_grad=False``) as ``{name: tensor}``, detached, not copied, in
    ``named_parameters`` order (a tied one once): for ``step.init(params, frozen=...)`` at stage 3, which shards them
    across the ranks (and copies what each rank keeps)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.frozen_of: expected an nn.Module, got {type(module).__name__}.")
    check_not_compiled(module, api="fzero.frozen_of")
    check_not_fsdp(module, api="fzero.frozen_of")
    return {name: p.detach() for name, p in module.named_parameters() if not p.requires_grad}


def free_frozen(module: nn.Module, state: Any) -> list[str]:
    """Give back the memory of the frozen parameters of ``module`` that ``state`` holds sharded (``step.init(params,
    frozen=fzero.frozen_of(model))``), and return their names: each becomes a meta parameter of its shape and dtype
    (every name a tied one has), as DeepSpeed's ``zero.Init`` empties a partitioned parameter and FSDP2 keeps only
    its shard. The step never reads them from the module; what does (``model.to(device)``, a forward outside
    ``fzero.apply``, ``save(..., model=)``) gets torch's or fzero's error for a meta tensor, never a stale value.
    ``step.restore_frozen(state, model)`` puts them back (ties kept), ``step.gather_frozen(state)`` gives them whole."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.free_frozen: expected an nn.Module, got {type(module).__name__}.")
    first = state.states[0] if hasattr(state, "states") else state
    meta = getattr(first, "meta", None)
    paths = [s.path for g in meta.layout.frozen for s in g.slots] if meta is not None else []
    if not paths:
        raise ValueError("fzero.free_frozen: the state holds no frozen parameters, so freeing the module's would lose "
                         "them. Make the state with step.init(fzero.params_of(model), frozen=fzero.frozen_of(model)) at "
                         "stages=3 first.")
    named = dict(module.named_parameters(remove_duplicate=False))
    missing = [p for p in paths if p not in named or named[p].requires_grad]
    if missing:
        raise ValueError(f"fzero.free_frozen: the state holds the frozen params {missing[:4]}, which "
                         f"{type(module).__name__} does not have frozen: pass the model the state was made from.")
    replace_params(module, {name: torch.empty(named[name].shape, dtype=named[name].dtype, device="meta") for name in paths})
    return paths


def module_device(module: nn.Module) -> torch.device | None:
    """Where ``module``'s real tensors are (its first non-meta parameter or buffer), None when all are meta: where values
    put back into it go (``Step.restore_frozen``, a checkpoint's frozen params into an emptied module)."""
    return next((t.device for t in (*module.parameters(), *module.buffers()) if not t.is_meta), None)


def replace_params(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Each parameter of ``module`` named in ``values`` becomes a new frozen parameter holding that tensor, under every
    name it has (a tied one stays one parameter, as ``load_state_dict(..., assign=True)`` would not keep it)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    new: dict[int, nn.Parameter] = {}
    for name, value in values.items():
        new.setdefault(id(named[name]), nn.Parameter(value, requires_grad=False))
    for sub in module.modules():
        for key, q in sub._parameters.items():
            if q is not None and id(q) in new:
                sub._parameters[key] = new[id(q)]


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``module`` (those in its ``state_dict``) as ``{name: copy}``, for
    ``step.init(params, buffers=...)``. A step adopts them from the module on its first call anyway; pass
    them to ``init`` when a state is saved or inspected before its first step."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.buffers_of: expected an nn.Module, got {type(module).__name__}.")
    return {name: b.detach().clone() for name, b in persistent_buffers(module).items()}
