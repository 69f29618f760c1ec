"""``fzero.checkpoint.consolidate``: a checkpoint's weights as one state dict file (``model.load_state_dict``) or as
Hugging Face safetensors files (``from_pretrained``)."""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any, BinaryIO, Iterator

import torch

from fzero.checkpoint import _dcp, _oserrors
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import fsync_dir, open_checkpoint
from fzero.checkpoint._oserrors import CheckpointWriteError, check_space
from fzero.checkpoint._safetensors import check_in_range, out_dtype, parse_size
from fzero.step import check_export_model
from fzero.checkpoint._weights import DEFAULT_SHARD, check_format, check_tied_values, items_for, names, prepare_dir, writing


def consolidate(path: str | os.PathLike, out_file: str | os.PathLike, *, model: torch.nn.Module | None = None, verify: bool = True,
                format: str = "pt", dtype: str = "fp32", max_shard_size: int | str = DEFAULT_SHARD) -> str:
    """Write the parameters of the checkpoint at ``path`` as one state dict file, or as safetensors files; returns
    ``out_file``.

    Without ``model``: the trained parameters under their saved names (fp32 masters when the run kept them)
    and the saved buffers. With ``model``: exactly ``model.state_dict()``'s keys, so that
    ``model.load_state_dict(torch.load(out, weights_only=True))`` is strict: tied aliases get the saved
    tensor, buffers the saved ones, frozen parameters the saved ones where ``save(..., model=model)`` wrote them,
    and what the checkpoint lacks (frozen parameters saved without it, buffers never adopted) comes from ``model``.
    Floating tensors are in ``dtype`` ("fp32", "bf16" or "fp16"). ``verify``: as for ``load``.

    ``format="safetensors"``: ``out_file`` is a directory (made if missing; its parent must exist) that gets
    Hugging Face's ``model.safetensors``, or shards and ``model.safetensors.index.json`` past ``max_shard_size``
    (bytes, or "5GB", "500MB"), for ``from_pretrained`` beside a ``config.json``. Tied weights are written once,
    under the name ``save_pretrained`` keeps (see ``save_weights``). Parameters are read from the checkpoint
    and written a group of about 256 MiB at a time: the model is never whole in memory.

    ``out_file``'s directory must exist and be writable, and its filesystem must have room for the tensors:
    each is checked before the checkpoint is read, and a write that fails anyway (ENOSPC, EROFS, EACCES) is
    reported as such, leaving no partial file behind.
    """
    api = "fzero.checkpoint.consolidate"
    check_format(format, api=api, allowed=("pt", "safetensors"))
    dt, max_bytes = out_dtype(dtype, api=api), parse_size(max_shard_size, api=api)
    found, info, manifest = open_checkpoint(path, api, verify=verify)
    metadata = _dcp.read_metadata(found)
    out_file = os.path.abspath(os.fspath(out_file))
    if format == "safetensors":
        return _to_safetensors(found, info, manifest, metadata, out_file, model=model, dtype=dt, max_bytes=max_bytes, api=api)
    if os.path.isdir(out_file):  # else torch.save wrote beside it, and os.replace failed raw, leaving the partial file
        raise CheckpointWriteError(
            f"{api}: {out_file} is a directory, and format='pt' writes one file. Pass a file path such as "
            f"{os.path.join(out_file, 'model.pt')}, or format='safetensors' (--format safetensors) to write Hugging Face's "
            f"files into the directory.", errno=errno.EISDIR, path=out_file,
        )
    check_out_dir(os.path.dirname(out_file), api=api)
    needed = sum(4 * int(torch.Size(p["shape"]).numel()) for p in info["params"])
    needed += sum(getattr(torch, b["dtype"]).itemsize * int(torch.Size(b["shape"]).numel()) for _, b in _module_tensors(info))
    check_space(api=api, path=out_file, needed=needed)
    tmp = f"{out_file}.partial"
    with _writing(tmp, out_file, api=api, needed=needed) as f:  # opened first: a read-only directory fails before the reading
        source = "master" if info["master"] else "params"
        flats = {p["name"]: torch.zeros(int(torch.Size(p["shape"]).numel()), dtype=torch.float32) for p in info["params"]}
        _dcp.load(found, metadata, [_dcp.Dest(f"{source}/{n}", (0,), tuple(t.shape), torch.float32, view=t) for n, t in flats.items() if t.numel()],
                  check=manifest.check)
        tensors = {p["name"]: flats[p["name"]].view(p["shape"]) for p in info["params"]}
        buffers = {(kind, b["name"]): torch.empty(b["shape"], dtype=getattr(torch, b["dtype"])) for kind, b in _module_tensors(info)}
        _dcp.load(found, metadata, [_dcp.Dest(f"{kind}/{n}", (0,) * t.dim(), tuple(t.shape), t.dtype, view=t) for (kind, n), t in buffers.items()],
                  check=manifest.check)
        tensors.update({n: t for (_, n), t in buffers.items()})
        if model is None:  # tied aliases, as save(..., model=model) recorded them: the file loads strictly
            out = {**tensors, **{alias: tensors[name] for alias, name in (info.get("ties") or {}).items() if name in tensors}}
        else:
            out = _as_model_state_dict(tensors, model, found, api, complete=_complete(info))
        converted = {k: v.to(dt) if v.is_floating_point() else v for k, v in out.items()}
        for k, v in out.items():
            check_in_range(k, v, converted[k].reshape(-1), api=api)
        torch.save(converted, f)
    os.replace(tmp, out_file)
    fsync_dir(os.path.dirname(out_file))
    return out_file


GROUP_BYTES = 256 << 20  # fp32 bytes of parameters read from the checkpoint at once by the safetensors export


def _to_safetensors(found: str, info: dict[str, Any], manifest: Any, metadata: Any, out_dir: str, *, model: torch.nn.Module | None,
                    dtype: torch.dtype, max_bytes: int, api: str) -> str:
    """The checkpoint's params and buffers as safetensors files in ``out_dir``, a group of params at a time."""
    source = "master" if info["master"] else "params"
    shapes = {p["name"]: tuple(p["shape"]) for p in info["params"]}
    order = [n for n in info.get("packing_order") or () if n in shapes] or list(shapes)  # the model's order where recorded
    held = {n: (shapes[n], torch.float32) for n in order}
    buffers = {(kind, b["name"]): (tuple(b["shape"]), getattr(torch, b["dtype"])) for kind, b in _module_tensors(info)}
    held.update({n: v for (_, n), v in buffers.items()})
    rename, extras = names(held, model, api=api, complete=_complete(info))
    items = items_for(held, rename, extras, dtype)
    prepare_dir(out_dir, api=api, needed=sum(i.nbytes for i in items))
    with writing(out_dir, items, max_shard_size=max_bytes, api=api) as w:
        for group in _groups(order, shapes):
            flats = {n: torch.empty(int(torch.Size(shapes[n]).numel()), dtype=torch.float32) for n in group}
            _dcp.load(found, metadata, [_dcp.Dest(f"{source}/{n}", (0,), tuple(t.shape), torch.float32, view=t) for n, t in flats.items() if t.numel()],
                      check=manifest.check)
            for n in group:
                w.put(rename[n], flats.pop(n).view(shapes[n]))
        loaded = {key: torch.empty(shape, dtype=d) for key, (shape, d) in buffers.items()}
        _dcp.load(found, metadata, [_dcp.Dest(f"{kind}/{n}", (0,) * t.dim(), tuple(t.shape), t.dtype, view=t) for (kind, n), t in loaded.items()],
                  check=manifest.check)
        check_tied_values({n: t for (_, n), t in loaded.items()}, model, api=api)
        for (_, n), t in loaded.items():
            if n in rename:  # a tied buffer once (``names``)
                w.put(rename[n], t)
        for n, t in extras:
            w.put(n, t)
        w.close()
    return out_dir


def _module_tensors(info: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The checkpoint's tensors of the module beside the params, as (kind, description): the buffers, and the frozen
    parameters a ``save(..., model=model)`` wrote (then the export holds their saved values, not the model's)."""
    return [("buffers", b) for b in info.get("buffers", ())] + [("frozen", f) for f in info.get("frozen") or ()]


def _groups(order: list[str], shapes: dict[str, tuple[int, ...]]) -> Iterator[list[str]]:
    """Consecutive names of at most ``GROUP_BYTES`` of fp32 each (a larger tensor alone)."""
    group, size = [], 0
    for n in order:
        b = 4 * int(torch.Size(shapes[n]).numel())
        if group and size + b > GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(n)
        size += b
    if group:
        yield group


def check_out_dir(directory: str, *, api: str) -> None:
    """Refuse a directory to write into that does not exist or is not a directory (the file's path has a typo)."""
    if not os.path.exists(directory):
        raise CheckpointWriteError(
            f"{api}: cannot write into {directory}: the directory does not exist. Create it first (os.makedirs) or pass another path.",
            errno=errno.ENOENT, path=directory,
        )
    if not os.path.isdir(directory):
        raise CheckpointWriteError(f"{api}: cannot write into {directory}: it is not a directory.", errno=errno.ENOTDIR, path=directory)


@contextlib.contextmanager
def _writing(tmp: str, out_file: str, *, api: str, needed: int) -> Iterator[BinaryIO]:
    """``tmp`` opened for writing, flushed and fsynced on exit; removed if anything fails, with filesystem
    failures (from ``open``, from writes, or wrapped by ``torch.save``) reported as what they are."""
    try:
        f = open(tmp, "wb")
    except OSError as e:
        raise _oserrors.explain(e, api=api, path=out_file, needed=needed) or CheckpointError(f"{api}: cannot write {tmp}: {e}") from None
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, CheckpointError):
            better = _oserrors.explain(e, api=api, path=out_file, needed=needed, written=written)
            if better is not None:
                raise better from None
        raise


def _complete(info: dict[str, Any]) -> bool:
    """Whether the checkpoint holds every parameter of the model it was saved with: ``save(..., model=model)``
    recorded its frozen ones (``_frozen``), which the checkpoint holds beside the params."""
    return info.get("frozen") is not None


def _as_model_state_dict(tensors: dict[str, torch.Tensor], model: torch.nn.Module, path: str, api: str, *,
                         complete: bool) -> dict[str, torch.Tensor]:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{api}: model must be an nn.Module (the one the checkpoint trained), got {type(model).__name__}.")
    check_export_model(model, tensors, api=api, complete=complete, error=CheckpointError)
    saved_as = {}  # id of a parameter object -> its saved name: tied aliases share the object
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in tensors:
            saved_as.setdefault(id(p), n)
    used, out = set(), {}
    for n, t in model.state_dict(keep_vars=True).items():
        name = n if n in tensors else saved_as.get(id(t))
        # what the checkpoint lacks, from the model, on the host as the checkpoint's own tensors are (and as the
        # safetensors export writes it): a CUDA model's frozen params were written as CUDA tensors, beside host ones,
        # and torch.load of the file failed on a machine without CUDA
        value = t.detach().to("cpu", copy=True) if name is None else tensors[name]
        if name is not None:
            used.add(name)
            if tuple(value.shape) != tuple(t.shape):
                raise CheckpointError(f"{api}: {n} has shape {list(t.shape)} in the model but {list(value.shape)} in {path}.")
        out[n] = value.float() if value.is_floating_point() else value
    if set(tensors) - used:
        raise CheckpointError(f"{api}: the model has no parameter for {sorted(set(tensors) - used)[:5]} saved in {path}; pass the model it was trained from.")
    return out
