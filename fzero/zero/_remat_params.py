"""Stages 0-1 under ``remat=True``: ``RematParams``, what ``loss_fn`` receives, and ``_RematUnit``, what each module unit
of the step's clone of the module becomes, whose call runs through ``fzero.remat``.

Apart from ``fzero.zero._sharded`` (stages 2 and 3), whose ``_skinned`` and ``_as_own_class`` it uses, so that each
stays short.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from fzero.autodiff import check_unit_hooks, remat
from fzero.layout import named_tensors, units_of
from fzero.step import apply_dict, buffers_for_run, call_module, current_buffers, module_for_thread
from fzero.zero._sharded import _as_own_class, _skinned


class RematParams(Mapping):
    """What ``loss_fn`` receives at stages 0-1 under ``remat=True``: the params dict, whose ``fzero.apply`` recomputes
    each module unit (``fzero.units_of(model)``: by default each block of a ``ModuleList``) in backward, as stages 2-3
    do with theirs.

    Units at stages 0-1 are flat buffers by size, not modules, so the units to recompute are found on the module when
    ``fzero.apply`` first runs it in a step: this step's clone of it (the user's module is never changed) gets each
    unit's class swapped for a subclass (``_skinned``) whose call goes through ``fzero.remat``."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def run_module(self, module: nn.Module, args: tuple, kwargs: dict, *, method: Any = None) -> Any:
        target = module_for_thread(module)
        if target is not module and not target.__dict__.get("_fz_remat"):  # a clone, once: never the user's module
            target.__dict__["_fz_remat"] = True
            units = units_of(target)
            if not units:
                _refuse_no_units(target, self.params)
            for path in units:
                sub = target.get_submodule(path)
                sub.__class__ = _skinned(_RematUnit, type(sub))  # type: ignore[arg-type]  # (classes hash)
                sub.__dict__["_fz_unit"] = path
        return apply_dict(module, self.params, args, kwargs, method=method)


def _refuse_no_units(module: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Refuse ``remat=True`` at stages 0-1 for a module with no unit to recompute that runs every param of the step.

    Why: the units recomputed are ``fzero.units_of(module)`` (children of a ``ModuleList``/``Sequential``); a model whose
    blocks are plain attributes has none, and ``remat=True`` recomputed nothing and saved no activation memory, without a
    word. Only a module holding all of the step's params is refused: beside another module run with the same params (a
    generator and its discriminator), the other may have the units."""
    held = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    if not set(params) <= held:
        return
    raise ValueError(
        f"fzero.compile(remat=True): at stages 0-1 the units recomputed in backward are fzero.units_of(model)'s (the "
        f"children of a ModuleList/Sequential), and {type(module).__name__} has none, so nothing would be recomputed and "
        f"no activation memory saved. Keep its blocks in an nn.ModuleList, wrap them in fzero.remat yourself, or use "
        f"stages=2 or 3 with units=fzero.units_of(model, module_types=YourBlock); or drop remat=True."
    )


class _RematUnit(nn.Module):
    """A module unit of a stage 0-1 step under ``remat=True`` (see ``RematParams``): its call runs through
    ``fzero.remat`` with the params it holds now (the step's, bound by ``fzero.apply``) as arguments, so its
    activations are recomputed in backward; inside, the module runs as its own class (hooks, its class's
    ``__call__``). Buffers come through ``buffers_for_run``, so a recompute never writes them twice."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run = functools.partial(_as_own_class, self, lambda: self)
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        params = {n: p for n, p in named_tensors(self, "_parameters") if p.requires_grad}
        buffers = dict(named_tensors(self, "_buffers"))

        prefix = self.__dict__["_fz_unit"] + "."  # a unit, not the root (whose call checks the whole tree)
        bank = current_buffers()
        # the step's buffers this unit holds (by name in the step's module), as a stage 2-3 unit's call is handed them:
        # the remat forward runs under no_grad, whose binding ends with the call, so a buffer the forward replaced
        # (self.n = self.n + 1) was put back before the root's call could take it over (the counters stayed 0)
        owned = {} if bank is None else {prefix + n: v for n, v in buffers.items() if prefix + n in bank.values}

        def unit_forward(params, /, *args, **kwargs):
            return call_module(self, {**buffers_for_run(buffers), **params}, args, kwargs, call=run, owned=owned,
                               prefix=prefix)

        unit_forward.__qualname__ = f"unit {self.__dict__['_fz_unit']!r}"
        unit_forward.module = self  # type: ignore[attr-defined]  # what fzero.remat may walk (_norm_hooks)
        check_unit_hooks(self, self.__dict__["_fz_unit"])
        return remat(unit_forward)(params, *args, **kwargs)
