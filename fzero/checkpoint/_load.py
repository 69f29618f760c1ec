"""``fzero.checkpoint.load``: every rank reads what it will hold, for any stage, world size and mesh."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from fzero.checkpoint import _dcp, _frozen, _rng
from fzero.checkpoint._collective import Ranks
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import open_checkpoint
from fzero.checkpoint._groups import check_labels, labels, step_of
from fzero.step import shares_group_state
from fzero.checkpoint._state import (check_fits, dests, entries, held, read_shared_aside, shared_that_differ, which_process,
                                    with_saved_buffers, without_optimizer)
from fzero.layout import pytrees as _tree
from fzero.optim import ScaleByScheduleState
from fzero.checkpoint._verify import MARKER, crc32_file
from fzero.step import RankStates, TrainState, Step
from fzero.zero import DiskOptState


def load(path: str | os.PathLike, like: Any, *, restore_rng: bool = True, verify: bool = True,
         model: Any = None, optimizer: bool = True) -> TrainState | RankStates:
    """The state saved at ``path`` (a checkpoint, or a ``keep=`` parent: its newest), laid out for ``like``.

    ``like``: the ``Step`` to resume with (its stage, mesh, precision and optimizer; the params pytree is
    rebuilt from the saved names and shapes, which needs a flat dict of names such as ``fzero.params_of``
    gives, on the kind of device the params computed on at the save: a CUDA checkpoint on this process's current
    CUDA device where it has one, else on the host), or a state from that step's ``init`` (any params pytree; only its structure is used, and the
    checkpoint must hold exactly its parameters: pass ``step.init(fzero.params_of(model))`` to have a
    checkpoint checked against a model). Any stage and world size load any other. Under torchrun every rank calls
    it. ``read_extra`` gives ``extra``.

    ``restore_rng``: when the job has as many processes as the one that saved, each process's random generators
    are set to what they held at the save, as the Hugging Face Trainer restores them: torch's CPU generator, every
    CUDA device's (where the checkpoint has them and this process sees as many devices), Python's global ``random``
    and NumPy's global ``np.random``; on a ``local_mesh`` of several ranks also each rank's own streams (torch CPU,
    Python, NumPy), into the mesh of the step ``like`` is or was made by, when it has as many ranks as the one that
    saved (else its ranks start from the restored global state, rank 0's). So a resumed run draws what the straight
    run draws, bit for bit. A checkpoint saved before these keys existed restores the torch CPU generator only.
    A local_mesh(n) and n torchrun processes map rank to process (each rank its own streams, either way); with
    another process count nothing is restored; ``restore_rng=False`` leaves every generator alone. Not
    restored: a local mesh's per-rank CUDA streams (its ranks go on from the restored device state, rank 0's), and
    generators of your own (``torch.Generator()``, ``np.random.default_rng()``): save their states yourself.

    ``verify``: check the CRC-32 of every file read against the one recorded at save time, and raise
    ``CheckpointCorrupted`` naming the file if one differs (``False``: sizes only; for checkpoints saved before
    checksums existed, which ``verify=True`` refuses).

    ``model``: the module to put the frozen parameters a ``save(..., model=model)`` wrote back into (by name,
    strict); a checkpoint that holds them is refused without it, since the run would resume on whatever values the
    module was built with.

    ``optimizer=False``: the params (and fp32 masters), buffers and step only, into a state of a step whose optimizer
    may differ from the one that saved: to evaluate a checkpoint (Lightning's ``trainer.validate(ckpt_path=...)``),
    not to resume training, which needs the optimizer's state too. The state keeps its own optimizer state (moments),
    but its learning-rate schedules go on from the checkpoint's step, as DeepSpeed's ``load_checkpoint(...,
    load_optimizer_states=False)`` loads the scheduler's position: so the lr a step applies is the ``metrics["lr"]``
    it reports, a schedule of that step.
    """
    api = "fzero.checkpoint.load"
    found, info, manifest = open_checkpoint(path, api, verify=verify)
    metadata = _dcp.read_metadata(found)
    sharded = _frozen.held_names(like) if isinstance(like, (TrainState, RankStates)) else []
    frozen = _frozen.load_into(model, found, info, lambda todo: _dcp.load(found, metadata, todo, check=manifest.check), api=api,
                               held=sharded, device=_compute_device(like, info))
    made_by = _step_of(like)  # before _target copies a state: the copy is no step's
    target = _with_buffers(_target(like, info, found, api), info)
    if sharded and frozen:  # the state holds the frozen params sharded: the checkpoint's values go there too
        target = _frozen.into_state(target, frozen, model)
    states, distributed = held(target, api)
    ranks = Ranks(api, distributed)
    if distributed:
        agree_on_checkpoint(ranks, found, info, manifest, api=api)
    ents = [entries(s, api=api) for s in states]
    if not optimizer:
        ents = [without_optimizer(e) for e in ents]
        info = {**info, "opt": []}
    check_fits(found, info, states[0], ents[0], api=api)
    if optimizer:
        check_labels(info.get("param_groups"), labels(states[0], made_by), path=found, step=info["step"], api=api,
                     shared=bool(info.get("groups_share_state")) and made_by is not None and shares_group_state(made_by))
    # groups whose entries the checkpoint may hold apart (False: saved under disk offload, or from a state copied leaf
    # by leaf; None or absent: not recorded) are judged by the values read, where this state shares them
    judged = optimizer and bool(info.get("param_groups")) and info.get("groups_share_state") is not True
    read = [read_shared_aside(e) if judged else (e, {}) for e in ents]  # every rank alike: one step, one optimizer
    process, processes = which_process(distributed)
    todo = [d for s, (e, _) in zip(states, read) for d in dests(s, e, info)]
    set_rngs = None
    if restore_rng and processes == info["processes"]:
        rng_dests, set_rngs = _rng.restore(metadata, process, made_by)
        todo += rng_dests
    elif restore_rng:  # a local_mesh(n) and n torchrun processes are the same n ranks: each gets its own streams
        across = _rng.restore_across(metadata, info["processes"], info.get("world_size"), process, processes,
                                       made_by)
        if across is not None:
            todo += across[0]
            set_rngs = across[1]
    _dcp.load(found, metadata, todo, check=manifest.check)
    if any(aside for _, aside in read):
        _check_shared_read_alike(ranks, [d for s, e, (r, aside) in zip(states, ents, read)
                                         for d in shared_that_differ(s, e, r, aside)], info, found, api)
    if set_rngs is not None:
        set_rngs()
    if not optimizer:
        target = _schedules_at_step(target)
    return _with_gather_order(target, info)


def _check_shared_read_alike(ranks: Ranks, differ: list[tuple[str, str, str]], info: dict[str, Any], found: str,
                             api: str) -> None:
    """Refuse, on every rank, a checkpoint whose entries for two parameter groups hold different values for a param,
    where this step's groups share one tensor (``multi_transform``'s two ``adamw`` groups in memory share one Adam
    state; ``differ``: this process's ``shared_that_differ``). Such a checkpoint kept the groups apart (saved under
    ``offload='disk'``, each group's files holding its own params' moments only; or from a state copied leaf by
    leaf), and one tensor holds one entry's values: params resumed with the other group's moments, 4.2e-3 off the
    run that never stopped after one step, silently. Judged by the values read, whatever ``groups_share_state`` says
    (before: a checkpoint saved before it was recorded loaded unrefused; one that recorded False was refused before
    reading, even where the entries were alike: a disk state saved before its first step). Where every shared entry was read alike (a checkpoint of a state in memory; one taken before the groups'
    entries diverged), the state is what it saved and loads."""
    every = [d for rank in ranks.gather(differ, f"{api}: compare the groups' optimizer state read") for d in rank]
    if not every:
        return
    names = sorted({p for p, _, _ in every})
    _, first, later = every[0]
    raise CheckpointError(
        f"{api}: the checkpoint {found} (step {info['step']}) keeps each parameter group's optimizer state apart: its "
        f"entries {first!r} and {later!r} hold different values for {', '.join(map(repr, names[:5]))}"
        f"{f' and {len(names) - 5} more' if len(names) > 5 else ''} (it was saved under offload='disk', each group's "
        f"tensors in files of their own, or from a state copied leaf by leaf), but "
        f"this step's multi_transform groups share one optimizer state in memory: one tensor would hold one group's "
        f"entries, and params would resume with another group's moments. Load it into a step with offload='disk'; or "
        f"load the params alone (optimizer=False), whose moments then start afresh."
    )


def _schedules_at_step(state: Any) -> Any:
    """``state`` with every learning-rate schedule's count (``ScaleByScheduleState``, in the optimizer state it kept)
    set to the state's step: the step reports ``metrics["lr"]`` as the schedule at ``state.step``, and the optimizer
    applies the schedule at its own count, so the two must agree."""
    def at(x: Any, step: int) -> Any:
        if isinstance(x, ScaleByScheduleState):
            return ScaleByScheduleState(torch.full_like(x.count, step))
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(at(v, step) for v in x))
        if isinstance(x, (tuple, list)):
            return type(x)(at(v, step) for v in x)
        if isinstance(x, dict):
            return {k: at(v, step) for k, v in x.items()}
        return x

    def fix(s: TrainState) -> TrainState:
        return dataclasses.replace(s, opt_state=at(s.opt_state, int(s.step)))

    return RankStates(tuple(fix(s) for s in state.states)) if isinstance(state, RankStates) else fix(state)


def agree_on_checkpoint(ranks: Ranks, found: str, info: dict[str, Any], manifest: Any, *, api: str) -> None:
    """Under torchrun: raise on every rank unless every rank opened the same checkpoint (its step, and the CRC-32 of
    its marker, which covers every file's checksum). Why: ranks that load different checkpoints (step 5 on one,
    step 2 on another: a stale copy on one node's disk, a ``latest`` that raced a save) train on as one job with
    states from different times, and nothing else would notice."""
    marker = os.path.join(found, MARKER)
    try:
        crc = f"{crc32_file(marker):08x}"
    except OSError:
        crc = "unreadable"
    mine = (info["step"], crc, found)
    every = ranks.gather(mine, f"{api}: compare the checkpoints the ranks load")
    odd = next((r for r, x in enumerate(every) if x[:2] != every[0][:2]), None)
    if odd is None:
        return
    (s0, c0, p0), (sr, cr, pr) = every[0], every[odd]
    raise CheckpointError(
        f"{api}: the ranks load different checkpoints: rank 0 loads step {s0} from {p0} ({MARKER} CRC-32 {c0}), rank "
        f"{odd} loads step {sr} from {pr} ({MARKER} CRC-32 {cr}). Every rank must resume from the same checkpoint: pass "
        f"the same path on every rank, on a filesystem every rank sees (or copy the whole checkpoint to each node)."
    )


def _step_of(like: Any) -> Any:
    """The step ``like`` is, or made it (None if unknown): its optimizer's parameter groups are the ones to load into."""
    if isinstance(like, Step):
        return like
    if isinstance(like, (TrainState, RankStates)):
        return step_of(like.states[0] if isinstance(like, RankStates) else like)
    return None


def _target(like: Any, info: dict[str, Any], path: str, api: str) -> TrainState | RankStates:
    if isinstance(like, Step):
        if info["params_tree"] != "dict":
            raise CheckpointError(
                f"{api}: {path} was saved from a params pytree that is not a flat dict ({info['params_tree']}), which "
                f"like=step cannot rebuild. Pass like=step.init(params) with your params pytree instead."
            )
        shapes = {p["name"]: p["shape"] for p in info["params"]}
        order = info.get("packing_order") or list(shapes)  # units are packed in the dict's order: rebuild it as saved
        device = saved_device(info)
        params = {n: torch.zeros(shapes[n], dtype=torch.float32, device=device) for n in order}
        return like.init(params)
    if isinstance(like, (TrainState, RankStates)):
        first = like.states[0] if isinstance(like, RankStates) else like
        if isinstance(first.opt_state, DiskOptState):
            raise TypeError(f"{api}: like is a disk-offloaded state, whose files a copy would share; pass like=step instead.")
        # a copy, not zeros: what the checkpoint does not hold keeps like's own values (its initial loss scale when
        # the checkpoint ran without one, buffers saved before a step adopted them, its optimizer state under
        # optimizer=False); zeros there were a loss scale of 0, which zeroes every gradient for good
        return _tree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, like)
    raise TypeError(f"{api}: like must be the Step to resume with, or a TrainState/RankStates from its init; got {type(like).__name__}.")


def saved_device(info: dict[str, Any]) -> torch.device:
    """Where ``load(like=step)`` puts the params: on the kind of device they computed on at the save, as ``torch.load``
    puts tensors back where they were; a CUDA save on this process's current CUDA device (each torchrun rank its
    own). On the host where this process has no CUDA (a GPU run's checkpoint evaluated on a laptop), and for
    checkpoints saved before the device was recorded. Why: the step computes where its params are, so params
    rebuilt on the host beside a model on the GPU failed in the model's first layer ("Expected all tensors to be on
    the same device"), naming neither the checkpoint nor the fix."""
    if info.get("device") == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compute_device(like: Any, info: dict[str, Any]) -> torch.device | None:
    """Where the loaded state computes: ``like``'s device (a state), or where ``like=step`` rebuilds the params."""
    if isinstance(like, Step):
        return saved_device(info)
    first = like.states[0] if isinstance(like, RankStates) else like
    meta = getattr(first, "meta", None)
    return meta.device if meta is not None else None


def _with_buffers(state: Any, info: dict[str, Any]) -> Any:
    if isinstance(state, RankStates):
        return RankStates(tuple(with_saved_buffers(s, info) for s in state.states))
    return with_saved_buffers(state, info)


def _with_gather_order(state: Any, info: dict[str, Any]) -> Any:
    """Stage 3: keep the saved order of unit gathers (prefetch) when the units are the same."""
    order = tuple(info.get("gather_order") or ())
    first = state.states[0] if isinstance(state, RankStates) else state
    if not order or first.meta.stage != 3 or not set(order) <= {u.name for u in first.meta.layout.units}:
        return state

    def fix(s: TrainState) -> TrainState:
        return dataclasses.replace(s, meta=dataclasses.replace(s.meta, gather_order=order))

    return RankStates(tuple(fix(s) for s in state.states)) if isinstance(state, RankStates) else fix(state)
