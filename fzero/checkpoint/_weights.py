"""Weights out, for the tools that load them: ``save_weights`` streams a live state's params (and buffers) into
Hugging Face's safetensors files unit by unit; ``consolidate(..., format="safetensors")`` does it from a checkpoint
(``_consolidate``). Both name tensors as ``model.state_dict()`` does when given ``model`` (``names``).

Memory: at stage 3 (or with sharded fp32 masters) one unit is gathered at a time, written, and let go, so an
export holds the state plus one unit, never a second copy of the model. ``Step.state_dict`` gathers everything
first, which is right for ``load_state_dict`` in the same process and wrong for a model that barely fits.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any, Iterator

import optree
import torch
from torch import nn

from fzero.checkpoint import _oserrors
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._oserrors import CheckpointWriteError, check_space
from fzero.checkpoint._safetensors import Item, Writer, out_dtype, parse_size
from fzero.layout import pytrees as _tree
from fzero.step import check_export_model

DEFAULT_SHARD = "5GB"  # save_pretrained's default until transformers 5 (now 50GB): files any loader and hub take


# -- names: model.state_dict()'s, without tied aliases ------------------------------------------------------------


def names(held: dict[str, tuple[tuple[int, ...], torch.dtype]], model: nn.Module | None, *, api: str,
          complete: bool = False) -> tuple[dict[str, str], list[tuple[str, torch.Tensor]]]:
    """(held name -> name in the file, [(name, tensor)] the model adds) for tensors the state or checkpoint holds; a
    held name the first one is written for (a tied buffer, which the state holds under each of its names) is left out.

    Without ``model``: the held names. With ``model``: every tensor of ``model.state_dict()`` once. Tensors that
    are one object under several names (tied weights: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
    are written once, as Hugging Face does (safetensors refuses shared storage, ``save_pretrained`` drops the
    tied name and ``from_pretrained`` ties it again): under the first name that the model does not declare tied
    (``_tied_weights_keys``), in ``state_dict`` order. What the state lacks (frozen parameters, buffers a step
    never adopted) comes from ``model``. A model the tensors were not made from is refused where it would make the
    output silently wrong (``check_export_model``); ``complete``: ``held`` is every parameter of the model it came
    from (a checkpoint saved with ``model=``, which holds the frozen ones too).
    """
    if model is None:
        return {n: n for n in held}, []
    if not isinstance(model, nn.Module):
        raise TypeError(f"{api}: model must be the nn.Module the params came from, got {type(model).__name__}.")
    check_export_model(model, held, api=api, complete=complete, error=CheckpointError)
    tied = _declared_tied(model)
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(n)
        tensors[id(t)] = t
    rename, extras, used = {}, [], set()
    for key, group in groups.items():
        keep = next((n for n in group if n not in tied), group[0])
        source = next((n for n in group if n in held), None)
        if source is None:
            extras.append((keep, tensors[key].detach()))
            continue
        if tuple(held[source][0]) != tuple(tensors[key].shape):
            raise CheckpointError(f"{api}: {source} has shape {list(tensors[key].shape)} in the model but {list(held[source][0])} in the state.")
        rename[source] = keep
        used.update(n for n in group if n in held)  # a tied buffer the state holds under each name: written once
    prefix = _wrapper_prefix([n for n in held if n not in used], model)
    if prefix:
        raise CheckpointError(
            f"{api}: the state's names carry the prefix {prefix!r}: it was trained as part of a module holding "
            f"{type(model).__name__} (a wrapper, a LightningModule), which model= must be. That module's names keep the prefix, "
            f"which from_pretrained does not strip (unless it is the model's base_model_prefix); to write the inner model's "
            f"files, load its weights into it, inner.load_state_dict({{k[{len(prefix)}:]: v for k, v in "
            f"step.state_dict(state, wrapper).items() if k.startswith({prefix!r})}}), and call inner.save_pretrained(dir).")
    for n in held:  # a tied name that params_of did not list first, or a buffer under its own name
        if n not in used:
            raise CheckpointError(f"{api}: {type(model).__name__}.state_dict() has no {n!r}, which the state holds; pass the model it was trained from.")
    return rename, extras


def check_tied_values(values: dict[str, torch.Tensor], model: nn.Module | None, *, api: str) -> None:
    """Refuse to write a tied buffer once (``names``) where ``values`` holds another value under one of its names: a
    state trained with those buffers apart (another model, or fzero before it kept tied buffers as one tensor),
    written for a ``model`` that ties them, would lose all but one of them."""
    if model is None:
        return
    groups: dict[int, list[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(n)
    for group in groups.values():
        held = [n for n in group if n in values]
        if len(held) < 2:
            continue
        first = values[held[0]]
        apart = [n for n in held[1:] if values[n] is not first
                 and not (values[n].shape == first.shape and torch.equal(values[n], first.to(values[n].device)))]
        if apart:
            raise CheckpointError(
                f"{api}: the state holds separate values for {[held[0], *apart]}, which are one tied buffer in "
                f"{type(model).__name__}: one file entry would keep one of them and lose the others. Pass the model the "
                f"state was trained from, or set one value under every name first (step.with_buffers)."
            )


def _wrapper_prefix(unknown: list[str], model: nn.Module) -> str | None:
    """The prefix ("net.") shared by ``unknown`` names that ``model`` has without it: a state of a module holding it."""
    if not unknown or "." not in unknown[0]:
        return None
    prefix = unknown[0].split(".", 1)[0] + "."
    known = set(model.state_dict(keep_vars=True))
    return prefix if all(n.startswith(prefix) and n[len(prefix):] in known for n in unknown) else None


def _declared_tied(model: nn.Module) -> set[str]:
    """Names a Hugging Face model declares tied to another (``_tied_weights_keys``: a dict target -> source in
    transformers 5, a list of targets before), with their module prefixes."""
    out = set()
    for prefix, m in model.named_modules():
        keys = getattr(m, "_tied_weights_keys", None)
        if isinstance(keys, (dict, list, tuple, set)):
            out |= {f"{prefix}.{k}" if prefix else k for k in keys if isinstance(k, str)}
    return out


def items_for(held: dict[str, tuple[tuple[int, ...], torch.dtype]], rename: dict[str, str],
              extras: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> list[Item]:
    """The output items in write order: held tensors, then the model's extras; floating ones in ``dtype``."""
    def out(d: torch.dtype) -> torch.dtype:
        return dtype if d.is_floating_point else d

    return [Item(rename[n], tuple(shape), out(d)) for n, (shape, d) in held.items() if n in rename] + \
        [Item(n, tuple(t.shape), out(t.dtype)) for n, t in extras]


# -- the output directory ---------------------------------------------------------------------------------------


def prepare_dir(directory: str, *, api: str, needed: int) -> None:
    """Make ``directory`` (its parent must exist) and check that its filesystem has ``needed`` bytes free."""
    parent = os.path.dirname(directory)
    if not os.path.isdir(parent):
        raise CheckpointWriteError(
            f"{api}: cannot write into {directory}: its parent directory {parent} does not exist. Create it first (os.makedirs) "
            f"or pass another path.", errno=errno.ENOENT, path=directory,
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointWriteError(f"{api}: cannot write into {directory}: it is a file, not a directory.", errno=errno.ENOTDIR, path=directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise (_oserrors.explain(e, api=api, path=directory, needed=needed) or CheckpointError(f"{api}: cannot make {directory}: {e}")) from None
    check_space(api=api, path=directory, needed=needed)


@contextlib.contextmanager
def writing(directory: str, items: list[Item], *, max_shard_size: int, api: str) -> Iterator[Writer]:
    """A ``Writer`` whose filesystem failures (ENOSPC, EROFS, EACCES) are reported as such, its files removed."""
    writer = Writer(directory, items, max_shard_size=max_shard_size, api=api)
    try:
        yield writer
    except BaseException as e:
        writer.abort()
        if isinstance(e, Exception):
            better = translate(e, api=api, path=directory, needed=sum(i.nbytes for i in items))
            if better is not e:
                raise better from None
        raise


def check_format(format: Any, *, api: str, allowed: tuple[str, ...]) -> str:
    if format not in allowed:
        raise ValueError(f"{api}: format must be one of {list(allowed)}, got {format!r}.")
    return format


# -- save_weights: from a live state -------------------------------------------------------------------------------


def save_weights(step: Any, state: Any, out_dir: str | os.PathLike, *, model: nn.Module | None = None, format: str = "safetensors",
                 dtype: str = "fp32", max_shard_size: int | str = DEFAULT_SHARD) -> str:
    """Write the params (and buffers) of ``state`` as Hugging Face safetensors files into ``out_dir``; returns it.

    ``out_dir`` gets ``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards and
    ``model.safetensors.index.json`` when the tensors pass ``max_shard_size`` (bytes, or "5GB", "500MB"), so that
    ``from_pretrained(out_dir)`` reads it beside the model's ``config.json`` (written by you, e.g.
    ``model.config.save_pretrained(out_dir)``). ``model``: name tensors as ``model.state_dict()`` does, with tied
    weights once (as ``save_pretrained``) and what the state lacks taken from the model. ``dtype``: "fp32",
    "bf16" or "fp16" for the floating tensors (fp32 masters are the source when the run keeps them).

    The tensors are those of ``step.state_dict(state, model)``, but gathered and written one unit at a time: no
    second copy of the model is held. Under torchrun every rank calls it (the gathers are collectives) and rank
    0 writes; ``out_dir`` need only be visible to rank 0.
    """
    from fzero.mesh import DistMesh
    from fzero.step import RankStates
    from fzero.step import Step

    api = "fzero.checkpoint.save_weights"
    if not isinstance(step, Step):
        raise TypeError(f"{api}: the first argument must be the Step the state belongs to, got {type(step).__name__}.")
    check_format(format, api=api, allowed=("safetensors",))
    dt, max_bytes = out_dtype(dtype, api=api), parse_size(max_shard_size, api=api)
    step._check_state(state, api=api)
    states = list(state.states) if isinstance(state, RankStates) else [state]
    first = states[0]
    layout = first.meta.layout
    if layout.treespec != optree.tree_structure({p: 0 for p in layout.paths}, namespace=_tree.NAMESPACE):
        raise TypeError(f"{api}: the params pytree is not a flat dict of names ({layout.treespec}); weight files need params by "
                        f"name, as fzero.params_of(model) gives them.")
    distributed = isinstance(step.mesh, DistMesh)
    writes = not distributed or step.mesh.rank == 0
    has_master = step.opt_state.has_masters(first.opt_state)
    sources = [step.opt_state.masters(s.opt_state, layout) if has_master else s.params for s in states]
    sharded = step.params.sharded or (has_master and step.opt_state.sharded)
    held = {s.path: (s.shape, torch.float32 if has_master else u.dtype) for u in layout.units for s in u.slots}
    held.update({n: (tuple(t.shape), t.dtype) for n, t in first.buffers.items()})
    rename, extras = names(held, model, api=api)
    check_tied_values(first.buffers, model, api=api)
    items = items_for(held, rename, extras, dt)
    directory = os.path.abspath(os.fspath(out_dir))
    comm = step.mesh.comm(api="fzero.checkpoint.save_weights") if distributed else None

    def unit_flat(u: Any) -> torch.Tensor:
        if not sharded:
            return sources[0][u.name]
        if len(states) > 1:  # a local mesh: every shard is in this process
            return torch.cat([src[u.name] for src in sources])
        mine = sources[0][u.name]
        if comm is None:  # one rank (no mesh, or local_mesh(1)): its shard is the whole unit
            return mine
        return comm.all_gather(torch.empty(u.padded, dtype=mine.dtype, device=mine.device), mine, tag="gather", label=u.name)

    needed = sum(i.nbytes for i in items)
    error: Exception | None = None
    writer: Writer | None = None
    try:
        try:
            if writes:
                prepare_dir(directory, api=api, needed=needed)
                writer = Writer(directory, items, max_shard_size=max_bytes, api=api)
        except Exception as e:  # noqa: BLE001 - under torchrun the others must still be told (below), not left in a gather
            error = e
        for u in layout.units:  # every rank gathers every unit, even when rank 0 can no longer write: no one hangs
            flat = unit_flat(u)
            if writer is not None and error is None:
                try:
                    for s in u.slots:
                        writer.put(rename[s.path], flat.narrow(0, s.offset, s.numel).view(s.shape))
                except Exception as e:  # noqa: BLE001 - as above
                    error = e
            del flat
        release = step.opt_state.release(first.opt_state)
        for s in states if release is not None else ():
            for t in s.params.values():
                release(t)
        if writer is not None and error is None:
            try:
                for n, t in first.buffers.items():
                    if n in rename:  # a tied buffer once (``names``)
                        writer.put(rename[n], t)
                for n, t in extras:
                    writer.put(n, t)
                writer.close()
            except Exception as e:  # noqa: BLE001 - as above
                error = e
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if error is not None:
        if writer is not None:
            writer.abort()
        error = translate(error, api=api, path=directory, needed=needed)
    _agree(error, comm, api)
    return directory


def translate(e: Exception, *, api: str, path: str, needed: int) -> Exception:
    """``e`` as a ``CheckpointWriteError`` where it is a full disk, a read-only filesystem or a denied permission."""
    if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, CheckpointError):
        return _oserrors.explain(e, api=api, path=path, needed=needed) or e
    return e


def _agree(error: Exception | None, comm: Any, api: str) -> None:
    """Raise ``error``; under torchrun (``comm``: the mesh's) every rank learns whether rank 0's writing failed."""
    if comm is not None:
        flag = torch.tensor([0 if error is None else 1])  # reduced on the GPU where the group has no gloo (``host_stage``)
        comm.all_reduce(flag, tag="save_weights")
        if error is None and int(flag):
            raise CheckpointError(f"{api}: writing failed on rank 0 (see its error).")
    if error is not None:
        raise error
