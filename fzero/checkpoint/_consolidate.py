"""``fzero.checkpoint.consolidate``: one fp32 state dict file from a checkpoint, for ``model.load_state_dict``."""

from __future__ import annotations

import os

import torch

from fzero.checkpoint import _dcp
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import open_checkpoint


def consolidate(path: str | os.PathLike, out_file: str | os.PathLike, *, model: torch.nn.Module | None = None) -> str:
    """Write the parameters of the checkpoint at ``path`` as one fp32 state dict file; returns ``out_file``.

    Without ``model``: the trained parameters under their saved names (fp32 masters when the run kept them)
    and the saved buffers. With ``model``: exactly ``model.state_dict()``'s keys, so that
    ``model.load_state_dict(torch.load(out, weights_only=True))`` is strict: tied aliases get the saved
    tensor, buffers the saved ones, and what the checkpoint lacks (frozen parameters, buffers never adopted)
    comes from ``model``. Floating tensors are fp32.
    """
    api = "fzero.checkpoint.consolidate"
    found, info = open_checkpoint(path, api)
    metadata = _dcp.read_metadata(found)
    source = "master" if info["master"] else "params"
    flats = {p["name"]: torch.zeros(int(torch.Size(p["shape"]).numel()), dtype=torch.float32) for p in info["params"]}
    _dcp.load(found, metadata, [_dcp.Dest(f"{source}/{n}", (0,), tuple(t.shape), torch.float32, view=t) for n, t in flats.items() if t.numel()])
    tensors = {p["name"]: flats[p["name"]].view(p["shape"]) for p in info["params"]}
    buffers = {b["name"]: torch.empty(b["shape"], dtype=getattr(torch, b["dtype"])) for b in info.get("buffers", ())}
    _dcp.load(found, metadata, [_dcp.Dest(f"buffers/{n}", (0,) * t.dim(), tuple(t.shape), t.dtype, view=t) for n, t in buffers.items()])
    tensors.update(buffers)
    out = tensors if model is None else _as_model_state_dict(tensors, model, found, api)
    out_file = os.path.abspath(os.fspath(out_file))
    tmp = f"{out_file}.partial"
    torch.save(out, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out_file)
    return out_file


def _as_model_state_dict(tensors: dict[str, torch.Tensor], model: torch.nn.Module, path: str, api: str) -> dict[str, torch.Tensor]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{api}: model must be an nn.Module (the one the checkpoint trained), got {type(model).__name__}.")
    saved_as = {}  # id of a parameter object -> its saved name: tied aliases share the object
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in tensors:
            saved_as.setdefault(id(p), n)
    used, out = set(), {}
    for n, t in model.state_dict(keep_vars=True).items():
        name = n if n in tensors else saved_as.get(id(t))
        value = t.detach().clone() if name is None else tensors[name]
        if name is not None:
            used.add(name)
            if tuple(value.shape) != tuple(t.shape):
                raise CheckpointError(f"{api}: {n} has shape {list(t.shape)} in the model but {list(value.shape)} in {path}.")
        out[n] = value.float() if value.is_floating_point() else value
    if set(tensors) - used:
        raise CheckpointError(f"{api}: the model has no parameter for {sorted(set(tensors) - used)[:5]} saved in {path}; pass the model it was trained from.")
    return out
