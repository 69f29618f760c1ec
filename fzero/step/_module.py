"""Functional use of an ordinary ``nn.Module``, which fzero never mutates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fzero.layout import check_no_meta
from fzero.step._context import call_module, cast_floating, current_buffers, current_compute_dtype, module_for_thread, note_applied
from fzero.step._state import check_params_fit_module


def params_of(module: nn.Module, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` as ``{name: detached copy}``, in ``named_parameters`` order.

    Copies, so that training never writes into the module; a tied parameter appears once, under its first
    name (as ``named_parameters`` lists it). Frozen parameters (``requires_grad=False``) are left out: they
    stay in the module and ``fzero.apply`` reads them from there. ``copy=False`` gives the module's own
    tensors, detached: for ``step.init``, which copies anyway, so that a large model is not held twice.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.params_of: expected an nn.Module, got {type(module).__name__}.")
    if not isinstance(copy, bool):
        raise TypeError(f"fzero.params_of: copy must be True or False, got {copy!r}.")
    return {name: p.detach().clone() if copy else p.detach() for name, p in module.named_parameters() if p.requires_grad}


def apply(module: nn.Module, params: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with ``params`` in place of its own (``torch.func.functional_call``); the module is unchanged.

    ``params`` maps names as in ``params_of``; tied names are resolved by torch (``tie_weights=True``), and
    parameters not in ``params`` come from the module. Inside a step, persistent buffers come from the
    train state and what the forward writes into them goes back there (BatchNorm statistics); outside a
    step, buffers are the module's. At stages 2 and 3 ``params`` is what
    ``loss_fn`` was given (``ReplicatedParams``/``ShardedParams``) and the model runs unit by unit.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.apply: expected an nn.Module as the first argument, got {type(module).__name__}.")
    note_applied(module)  # for the first step's checks of the loss and of the ranks' structure
    dtype = current_compute_dtype()  # set by a step under a bf16/fp16 policy
    args, kwargs = cast_floating((args, kwargs), dtype)
    bank = current_buffers()
    # before the forward: a meta tensor it would read from the module is named here, not deep inside the model
    if isinstance(params, Mapping):  # else: the TypeError below
        check_no_meta(module, params, state_buffers=bank is not None, api="fzero.apply")
    run_module = getattr(type(params), "run_module", None)
    if run_module is not None:  # stages 2-3 (fzero.zero's unit params): unit by unit as the forward reaches them
        return run_module(params, module, args, kwargs)  # builds its own per-rank skeleton
    if not isinstance(params, dict):
        raise TypeError(f"fzero.apply: params must be a dict of name -> tensor (as fzero.params_of returns), got {type(params).__name__}.")
    target = module_for_thread(module)  # a per-rank clone on a multi-rank local_mesh (see fzero.step._context)
    check_params_fit_module(target, params, api="fzero.apply")  # a state of another model width must not run
    if bank is not None:  # in a step: the state's buffers, never the module's (see fzero.step._buffers)
        params = {**bank.for_module(module), **params}
    if dtype is not None:  # buffers and frozen params meet the low-precision params in the compute dtype
        extra = {n: t for n, t in (*target.named_parameters(), *target.named_buffers()) if n not in params}
        params = {**cast_floating(extra, dtype), **params}
    return call_module(target, params, args, kwargs)
