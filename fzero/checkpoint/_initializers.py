"""What makes the params a Hugging Face checkpoint lacks, for ``fzero.checkpoint.pretrained(..., missing=...)``.

``missing="init"`` is ``from_pretrained``'s own initializer: a Hugging Face model's ``_init_weights`` over the
param's module and every module above it, children first (``_hf_init``), else the module's ``reset_parameters``; a
param that no initializer writes is refused. A function ``(path, meta) -> tensor`` is taken as it is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

API = "fzero.checkpoint.pretrained"


def initializer(model: nn.Module, missing: Any) -> Any:
    """``pretrained``'s ``missing=`` as a ``(path, meta) -> tensor``, or None."""
    if missing is None or callable(missing):
        return missing
    if missing != "init":
        raise ValueError(f"{API}: missing={missing!r}; pass 'init' (the model's own initializer) or a function "
                         f"(path, meta_tensor) -> tensor.")

    def init(path: str, meta: torch.Tensor) -> torch.Tensor:
        owner, _, name = path.rpartition(".")
        module = model.get_submodule(owner)
        hf_init = getattr(model, "_init_weights", None)
        if callable(hf_init):  # a Hugging Face model: the initializer from_pretrained runs for missing weights
            value = _hf_init(model, hf_init, path, meta)
        elif callable(getattr(module, "reset_parameters", None)):
            real = copy.deepcopy(module).to_empty(device="cpu")  # the module alone, with memory: what its init writes
            real.reset_parameters()
            value = getattr(real, name).detach()
        else:
            raise ValueError(
                f"{API}: missing='init' cannot initialize {path!r}: {type(model).__name__} has no _init_weights and "
                f"{type(module).__name__} no reset_parameters. Pass missing=fn(path, meta_tensor) -> its initial value.")
        if value.is_floating_point() and bool(value.isnan().any()):
            raise ValueError(
                f"{API}: missing='init' found no initializer that writes {path!r} ({type(module).__name__}.{name}: "
                f"{type(model).__name__}._init_weights has no branch for it, and from_pretrained would leave it "
                f"uninitialised too). Pass missing=fn(path, meta_tensor) -> its initial value, or a checkpoint that holds it.")
        return value

    return init


def _hf_init(model: nn.Module, hf_init: Any, path: str, meta: torch.Tensor) -> torch.Tensor:
    """The value a Hugging Face model's ``_init_weights`` gives the param at ``path``, as ``from_pretrained`` runs it
    for a missing weight: over the modules children first, so the param's owner, then each module above it up to the
    model, the later ones overriding (GPT-2's attention and MLP scale their ``c_proj.weight``, T5's attention sizes
    its ``q`` by the model's width). Each is a copy on the meta device with only this param real (starting as NaN,
    so that a param no branch writes is found): the other params' inits write nothing, and nothing of the model is
    allocated."""
    parts = path.split(".")
    value = torch.full(meta.shape, float("nan"), dtype=meta.dtype) if meta.is_floating_point() else torch.zeros(meta.shape, dtype=meta.dtype)
    for depth in range(len(parts) - 1, -1, -1):  # the owner (depth len - 1), then its ancestors, the model last
        here = ".".join(parts[:depth])
        copied = copy.deepcopy(model.get_submodule(here) if here else model)
        holder = copied.get_submodule(".".join(parts[depth:-1]))
        holder._parameters[parts[-1]] = nn.Parameter(value, requires_grad=meta.requires_grad)
        try:
            hf_init(copied)
        except Exception as e:  # noqa: BLE001 - an init that needs the module's other params real (a weight norm's)
            raise ValueError(
                f"{API}: missing='init' could not run {type(model).__name__}._init_weights on {type(copied).__name__} "
                f"({here or 'the model'}) for {path!r} with only that param made ({type(e).__name__}: {e}). Pass "
                f"missing=fn(path, meta_tensor) -> its initial value, or a checkpoint that holds it."
            ) from e
        value = holder._parameters[parts[-1]].detach()
    return value
