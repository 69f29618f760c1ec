"""Checkpoints of a training state: sharded save, load at any stage and world size, consolidation, crash safety.

```python
fzero.checkpoint.save("ckpt", state, extra={"batch": k}, keep=3)   # ckpt/step_00000500, keeping the last 3
state = fzero.checkpoint.load("ckpt", like=step)                  # the latest complete one, sharded for `step`
k = fzero.checkpoint.read_extra("ckpt")["batch"]
fzero.checkpoint.consolidate("ckpt", "model.pt", model=model)     # one fp32 state dict for model.load_state_dict
```
or ``python -m fzero.checkpoint consolidate ckpt model.pt`` (``info ckpt`` prints what a checkpoint holds).

**Format.** A checkpoint is a directory in torch.distributed.checkpoint's file format holding one logical
tensor per parameter (see ``fzero/_checkpoint_state.py`` for the keys), so it loads into any stage, world
size, unit layout, mesh kind (none, ``local_mesh``, torchrun) and precision policy, plus ``fzero.json``
(parameter names and shapes, the optimizer-state entries, the step, the user's ``extra``) and the marker
``COMPLETE`` (the size of every file). Every rank writes only the window of each unit it owns and reads
only what it will hold: no collective moves parameters, and a save needs at most about 64 MiB beyond the
state (DCP copies the chunks of one data file). ``latest(parent)`` finds the newest complete checkpoint.

**Safety.** A save writes into ``.<name>.partial`` beside the target, fsyncs every file, writes the
marker last and renames the directory into place (an existing checkpoint is swapped out atomically with
``renameat2(RENAME_EXCHANGE)`` where Linux offers it), so a crash or ``kill -9`` leaves the previous
checkpoint loadable. Loading checks the marker and file sizes first and names what is missing. Nothing
executes code on load: tensors are read with ``torch.load(weights_only=True)``, DCP's ``.metadata`` with
an unpickler that resolves only DCP's metadata classes, everything else is JSON.

Under torchrun, ``save`` and ``load`` are collective (every rank calls them, with its own state) and the
directory must be on a filesystem every rank sees.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import sys
from typing import Any

import torch

from fzero.checkpoint import _dcp as _dcp
from fzero.layout import _tree
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._state import check_fits, dests, describe, entries, pieces, with_saved_buffers
from fzero.zero._offload import DiskOptState
from fzero.step._state import RankStates, TrainState, is_donated

__all__ = ["CheckpointError", "consolidate", "latest", "load", "read_extra", "save", "step_dir"]

FORMAT, VERSION = "fzero.checkpoint", 1
INFO, MARKER = "fzero.json", "COMPLETE"
_STEP = re.compile(r"^step_(\d{8,})$")


def step_dir(step: int) -> str:
    """The name ``save(..., keep=K)`` gives the checkpoint of ``step`` inside its parent directory."""
    return f"step_{step:08d}"


# -- save ---------------------------------------------------------------------------------------------------


def save(path: str | os.PathLike, state: TrainState | RankStates, *, extra: Any = None, keep: int | None = None) -> str:
    """Save ``state`` (a ``TrainState``, or a local mesh's ``RankStates``) and return the checkpoint directory.

    ``keep=None``: ``path`` is the checkpoint (an existing checkpoint there is replaced atomically).
    ``keep=K``: ``path`` is a parent directory; the checkpoint is ``path/step_<step:08d>`` and only the K
    newest complete ones are kept. ``extra``: anything JSON can hold (e.g. the data loader's position),
    returned by ``read_extra``. Under torchrun every rank calls ``save`` with its own state.
    """
    api = "fzero.checkpoint.save"
    states, distributed = _held(state, api)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"{api}: keep must be None (path is the checkpoint) or an int >= 1 (checkpoints to keep in path), got {keep!r}.")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{api}: extra must be JSON data (dicts, lists, str, int, float, bool, None); {e}.") from None
    path = os.path.abspath(os.fspath(path))
    if keep is not None and _is_complete(path):
        raise ValueError(f"{api}: {path} is a checkpoint itself; keep=K saves step_* checkpoints into a parent directory. Pass its parent.")
    step = states[0].step_count
    final = path if keep is None else os.path.join(path, step_dir(step))
    parent, name = os.path.split(final)
    partial = os.path.join(parent, f".{name}.partial")
    process, processes = _process(distributed)
    ents = [entries(s, api=api) for s in states]
    info = {"format": FORMAT, "version": VERSION, "step": step, "processes": processes, "torch": torch.__version__,
            **describe(states[0], ents[0]), "extra": extra_json}
    todo = [p for i, (s, e) in enumerate(zip(states, ents)) for p in pieces(s, e, replicated=i == 0 and process == 0, api=api)]
    todo.append(_dcp.Piece(f"rng/{process}", *_whole(torch.get_rng_state())))

    def prepare() -> None:
        _refuse_to_clobber(final, keep, api)
        os.makedirs(parent, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before
        os.makedirs(partial)

    _on_rank0(prepare, distributed, f"{api}: preparing {partial}")
    _dcp.save(partial, todo, distributed=distributed)

    def finish() -> None:
        _write(os.path.join(partial, INFO), json.dumps(info, indent=1).encode())
        files = {f: os.path.getsize(os.path.join(partial, f)) for f in sorted(os.listdir(partial))}
        _write(os.path.join(partial, MARKER), json.dumps({"files": files}, indent=1).encode())  # last: the checkpoint is complete
        _fsync_dir(partial)
        _publish(partial, final)
        if keep is not None:
            _prune(path, keep)

    _on_rank0(finish, distributed, f"{api}: completing {final}")
    return final


def _held(state: Any, api: str) -> tuple[list[TrainState], bool]:
    """The rank states this process holds, and whether they are one rank of a torch.distributed job."""
    if is_donated(state):
        raise ValueError(f"{api}: this state was passed to a step, which reused its buffers; save the state that step returned.")
    if isinstance(state, RankStates):
        return list(state.states), False
    if not isinstance(state, TrainState) or state.meta is None:
        raise TypeError(f"{api}: expected a TrainState or RankStates from Step.init or a step, got {type(state).__name__}.")
    n, rank = state.meta.world_size, state.meta.rank
    if n == 1:
        return [state], False
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != n or dist.get_rank() != rank:
        raise ValueError(
            f"{api}: this TrainState is rank {rank} of {n}, but this process is not rank {rank} of a {n}-process "
            f"torch.distributed job. Under fzero.local_mesh pass the whole RankStates (all ranks' states); under torchrun "
            f"call it on every rank with that rank's state."
        )
    return [state], True


def _process(distributed: bool) -> tuple[int, int]:
    """This process's rank and the number of processes that write (or read) the checkpoint together."""
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)


def _whole(t: torch.Tensor) -> tuple:
    return tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, lambda: t


def _on_rank0(fn: Any, distributed: bool, what: str) -> None:
    """Run ``fn`` on rank 0 only; under torchrun every rank learns whether it worked (and none hangs if not)."""
    import torch.distributed as dist

    error: Exception | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = e
    if distributed:
        flag = torch.tensor([0 if error is None else 1])
        dist.all_reduce(flag)
        if error is None and int(flag):
            raise CheckpointError(f"{what} failed on rank 0 (see its error).")
    if isinstance(error, OSError):
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from None
    if error is not None:
        raise error


def _refuse_to_clobber(final: str, keep: int | None, api: str) -> None:
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise CheckpointError(f"{api}: {final} exists and is not a directory; refusing to replace it. Pick another path.")
    entries_ = os.listdir(final)
    if not entries_ or INFO in entries_ or ".metadata" in entries_:
        return  # an empty directory, or an (even incomplete) checkpoint: replaced
    hint = " It holds step_* checkpoints: pass keep=K to save into it." if keep is None and any(_STEP.match(e) for e in entries_) else ""
    raise CheckpointError(f"{api}: {final} exists and is not an fzero checkpoint; refusing to replace it.{hint}")


def _write(file: str, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(partial: str, final: str) -> None:
    """Move the finished ``partial`` to ``final``: a rename, or an atomic swap with the checkpoint already there."""
    if not os.path.lexists(final):
        os.rename(partial, final)
    else:
        if _exchange(partial, final):
            old = partial  # now holds the previous checkpoint
        else:  # no atomic swap here: a crash between the two renames leaves the old one at .<name>.old
            old = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(final))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _prune(parent: str, keep: int) -> None:
    done = sorted((int(m.group(1)), e) for e in os.listdir(parent) if (m := _STEP.match(e)) and _is_complete(os.path.join(parent, e)))
    for _, e in done[:-keep]:
        shutil.rmtree(os.path.join(parent, e), ignore_errors=True)
    for e in os.listdir(parent):  # partial saves of steps that are complete now, or long gone
        if e.startswith(".step_") and e.endswith((".partial", ".old")):
            shutil.rmtree(os.path.join(parent, e), ignore_errors=True)


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


# -- finding and checking ---------------------------------------------------------------------------------


def latest(path: str | os.PathLike) -> str | None:
    """The newest complete ``step_*`` checkpoint in ``path`` (or ``path`` itself if it is one); None if there is none."""
    path = os.path.abspath(os.fspath(path))
    if _is_complete(path):
        return path
    if not os.path.isdir(path):
        return None
    done = sorted((int(m.group(1)), e) for e in os.listdir(path) if (m := _STEP.match(e)) and _is_complete(os.path.join(path, e)))
    return os.path.join(path, done[-1][1]) if done else None


def _open(path: str | os.PathLike, api: str) -> tuple[str, dict[str, Any]]:
    """The complete checkpoint at ``path`` (or the newest in it) and its ``fzero.json``, after checking its files."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{api}: no checkpoint at {path} (it does not exist).")
    found = latest(path)
    if found is None:
        if os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(os.path.join(path, INFO)):
            raise CheckpointError(f"{api}: {path} is incomplete: it has no {MARKER} marker (the save was interrupted, or is still running).")
        raise CheckpointError(f"{api}: {path} is neither a checkpoint nor a directory holding complete step_* checkpoints.")
    try:
        with open(os.path.join(found, MARKER), "rb") as f:
            files = json.loads(f.read())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{api}: {found}/{MARKER} is corrupted ({type(e).__name__}: {e}).") from None
    for name, size in files.items():
        file = os.path.join(found, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{api}: {found} is damaged: the file {name} is missing.")
        if os.path.getsize(file) != size:
            raise CheckpointError(f"{api}: {found} is damaged: {name} has {os.path.getsize(file)} bytes, {size} were written (truncated or changed).")
    try:
        with open(os.path.join(found, INFO), "rb") as f:
            info = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{api}: {found}/{INFO} is missing or corrupted ({type(e).__name__}: {e}).") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("version"), int):
        raise CheckpointError(f"{api}: {found}/{INFO} is not an fzero checkpoint description.")
    if info["version"] > VERSION:
        raise CheckpointError(f"{api}: {found} has format version {info['version']}; this fzero reads up to {VERSION}. Upgrade fzero.")
    return found, info


def read_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` given to ``save`` (None if none) of the checkpoint at ``path`` (or the newest in it)."""
    return _open(path, "fzero.checkpoint.read_extra")[1]["extra"]


# -- load ---------------------------------------------------------------------------------------------------


def load(path: str | os.PathLike, like: Any, *, restore_rng: bool = True) -> TrainState | RankStates:
    """The state saved at ``path`` (a checkpoint, or a ``keep=`` parent: its newest), laid out for ``like``.

    ``like``: the ``Step`` to resume with (its stage, mesh, precision and optimizer; the params pytree is
    rebuilt from the saved names and shapes, which needs a flat dict of names such as ``fzero.params_of``
    gives), or a state from that step's ``init`` (any params pytree; only its structure is used, and the
    checkpoint must hold exactly its parameters: pass ``step.init(fzero.params_of(model))`` to have a
    checkpoint checked against a model). Any stage and world size load any other. The torch CPU RNG is restored when the job has as many processes as the one that
    saved (``restore_rng=False``: left alone). Under torchrun every rank calls it. ``read_extra`` gives ``extra``.
    """
    api = "fzero.checkpoint.load"
    found, info = _open(path, api)
    metadata = _dcp.read_metadata(found)
    target = _with_buffers(_target(like, info, found, api), info)
    states, distributed = _held(target, api)
    ents = [entries(s, api=api) for s in states]
    check_fits(found, info, states[0], ents[0], api=api)
    process, processes = _process(distributed)
    rng = torch.empty(0, dtype=torch.uint8)
    todo = [d for s, e in zip(states, ents) for d in dests(s, e, info)]
    if restore_rng and processes == info["processes"]:
        rng = torch.empty(metadata.state_dict_metadata[f"rng/{process}"].size, dtype=torch.uint8)
        todo.append(_dcp.Dest(f"rng/{process}", (0,), tuple(rng.shape), torch.uint8, view=rng))
    _dcp.load(found, metadata, todo)
    if rng.numel():
        torch.set_rng_state(rng)
    return _with_gather_order(target, info)


def _target(like: Any, info: dict[str, Any], path: str, api: str) -> TrainState | RankStates:
    from fzero.step._step import Step

    if isinstance(like, Step):
        if info["params_tree"] != "dict":
            raise CheckpointError(
                f"{api}: {path} was saved from a params pytree that is not a flat dict ({info['params_tree']}), which "
                f"like=step cannot rebuild. Pass like=step.init(params) with your params pytree instead."
            )
        params = {p["name"]: torch.zeros(p["shape"], dtype=torch.float32) for p in info["params"]}
        return like.init(params)
    if isinstance(like, (TrainState, RankStates)):
        first = like.states[0] if isinstance(like, RankStates) else like
        if isinstance(first.opt_state, DiskOptState):
            raise TypeError(f"{api}: like is a disk-offloaded state, whose files a copy would share; pass like=step instead.")
        return _tree.tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, like)
    raise TypeError(f"{api}: like must be the Step to resume with, or a TrainState/RankStates from its init; got {type(like).__name__}.")


def _with_buffers(state: Any, info: dict[str, Any]) -> Any:
    if isinstance(state, RankStates):
        return RankStates(tuple(with_saved_buffers(s, info) for s in state.states))
    return with_saved_buffers(state, info)


def _with_gather_order(state: Any, info: dict[str, Any]) -> Any:
    """Stage 3: keep the saved order of unit gathers (prefetch) when the units are the same."""
    import dataclasses

    order = tuple(info.get("gather_order") or ())
    first = state.states[0] if isinstance(state, RankStates) else state
    if not order or first.meta.stage != 3 or not set(order) <= {u.name for u in first.meta.layout.units}:
        return state

    def fix(s: TrainState) -> TrainState:
        return dataclasses.replace(s, meta=dataclasses.replace(s.meta, gather_order=order))

    return RankStates(tuple(fix(s) for s in state.states)) if isinstance(state, RankStates) else fix(state)


# -- consolidate ------------------------------------------------------------------------------------------


def consolidate(path: str | os.PathLike, out_file: str | os.PathLike, *, model: torch.nn.Module | None = None) -> str:
    """Write the parameters of the checkpoint at ``path`` as one fp32 state dict file; returns ``out_file``.

    Without ``model``: the trained parameters under their saved names (fp32 masters when the run kept them)
    and the saved buffers. With ``model``: exactly ``model.state_dict()``'s keys, so that
    ``model.load_state_dict(torch.load(out, weights_only=True))`` is strict: tied aliases get the saved
    tensor, buffers the saved ones, and what the checkpoint lacks (frozen parameters, buffers never adopted)
    comes from ``model``. Floating tensors are fp32.
    """
    api = "fzero.checkpoint.consolidate"
    found, info = _open(path, api)
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


# -- command line ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fzero.checkpoint", description="Inspect and consolidate fzero checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one fp32 state dict (torch.save) of a checkpoint's parameters")
    c.add_argument("path", help="a checkpoint directory, or a parent of step_* checkpoints (the newest is used)")
    c.add_argument("out", help="the .pt file to write")
    i = sub.add_parser("info", help="print a checkpoint's fzero.json")
    i.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            found, info = _open(args.path, "fzero.checkpoint info")
            print(json.dumps({"path": found, **info}, indent=1))
        else:
            found, info = _open(args.path, "fzero.checkpoint consolidate")
            out = consolidate(found, args.out)
            count = sum(int(torch.Size(p["shape"]).numel()) for p in info["params"])
            print(f"{out}: {len(info['params'])} tensors, {count:,} parameters (fp32) from {found} (step {info['step']})")
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
