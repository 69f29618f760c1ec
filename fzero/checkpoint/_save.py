"""``fzero.checkpoint.save``: every rank writes the windows it owns, rank 0 completes and publishes the directory."""

from __future__ import annotations

import json
import time
import os
import shutil
import sys
import warnings
from typing import Any

import torch
from fzero.checkpoint import _dcp, _frozen, _interrupts, _oserrors, _rng
from fzero.checkpoint._collective import Ranks
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import (
    FORMAT, INFO, VERSION, check_destination, fsync_dir, hold_directory, is_complete, lock_partial, prune, publish,
    refuse_to_clobber, step_dir, sweep_partials, unlock, write_synced,
)
from fzero.checkpoint._groups import groups_share_state, labels, step_of
from fzero.optim import for_file
from fzero.checkpoint._oserrors import check_space
from fzero.checkpoint._state import describe, entries, held, pieces, size_lower_bound, which_process
from fzero.checkpoint._verify import MARKER, crc32_file, marker_bytes
from fzero.mesh import DistMesh
from fzero.step import RankStates, TrainState, whole_frozen


def _frozen_values(state: Any, model: Any, api: str) -> dict[str, torch.Tensor]:
    """``save(..., model=)``'s frozen params: the module's, and those the state holds sharded (``step.init(...,
    frozen=...)``) from the state, exact (the module's may be emptied by ``fzero.free_frozen``)."""
    held = _frozen.held_names(state)
    out = _frozen.frozen_of(model, api=api, held=held)
    if held:  # one group at a time, each to the host once whole: the device never holds the whole frozen model
        first = state.states[0] if isinstance(state, RankStates) else state
        step = step_of(first)
        mesh = getattr(step, "mesh", None)
        distributed = first.meta.layout.world_size > 1 and not isinstance(state, RankStates)
        comm = None
        if distributed:  # the step's mesh; for a state no step made (a copy, one load returned), the job's process group
            comm = mesh.comm(api=api) if isinstance(mesh, DistMesh) else Ranks(api, True).comm
        out.update(whole_frozen(state, comm, host=True))
    return out


def save(path: str | os.PathLike, state: TrainState | RankStates, *, extra: Any = None, keep: int | None = None,
         model: Any = None) -> str:
    """Save ``state`` (a ``TrainState``, or a local mesh's ``RankStates``) and return the checkpoint directory.

    ``keep=None``: ``path`` is the checkpoint (an existing checkpoint there is replaced atomically).
    ``keep=K``: ``path`` is a parent directory; the checkpoint is ``path/step_<step:08d>`` and only the K
    newest complete ones are kept. The first such save of a process holds the directory for it while it lives: a
    save of another process (another run) into it is refused, naming that process. ``extra``: anything JSON can
    hold (e.g. the data loader's position), returned by ``read_extra``: dict keys must be str (JSON would turn
    others into str; refused), and tuples come back as lists; under torchrun every rank gives the same one. Under torchrun every rank calls ``save``
    with its own state (a rank that does not is named, see ``_collective``).

    ``model``: the module the state trains; its frozen parameters (``requires_grad=False``, which stay in the module
    and are not in the state) are saved too, as DeepSpeed saves them by default, and ``load(..., model=model)`` puts
    them back (``_frozen``). Without it they are not saved: for a frozen base that comes from elsewhere.

    Ctrl-C during a save raises ``KeyboardInterrupt`` itself once torch is out of its C++ code, and the previous
    checkpoint stays (``_interrupts``).
    """
    api = "fzero.checkpoint.save"
    states, distributed = held(state, api)
    frozen = None if model is None else _frozen_values(state, model, api)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"{api}: keep must be None (path is the checkpoint) or an int >= 1 (checkpoints to keep in path), got {keep!r}.")
    try:
        extra_json = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{api}: extra must be JSON data (dicts, lists, str, int, float, bool, None); {e}.") from None
    _check_keys(extra, "extra", api)
    path = os.path.abspath(os.fspath(path))
    if keep is not None and is_complete(path):
        raise ValueError(f"{api}: {path} is a checkpoint itself; keep=K saves step_* checkpoints into a parent directory. Pass its parent.")
    step = states[0].step_count
    final = path if keep is None else os.path.join(path, step_dir(step))
    check_destination(path, final, keep, api)  # on every rank, before the first collective: each names it alike
    refuse_to_clobber(final, keep, api)
    parent, name = os.path.split(final)
    partial = os.path.join(parent, f".{name}.partial")
    ranks = Ranks(api, distributed)
    _agree_on_extra(ranks, extra_json, api)
    process, processes = which_process(distributed)
    ents = [entries(s, api=api) for s in states]
    info = {"format": FORMAT, "version": VERSION, "step": step, "processes": processes, "torch": torch.__version__,
            "saved_ns": time.time_ns(),  # keep=K and latest() go by the order of saving (a rollback saves lower steps)
            **describe(states[0], ents[0]), "param_groups": for_file(labels(states[0], step_of(states[0]))),
            "groups_share_state": groups_share_state(states[0], step_of(states[0])), "extra": extra_json}
    if frozen is not None:
        info["frozen"] = _frozen.describe(frozen)
        info["ties"] = _frozen.ties(model, [p["name"] for p in info["params"]] + list(frozen))
    todo = [p for i, (s, e) in enumerate(zip(states, ents)) for p in pieces(s, e, replicated=i == 0 and process == 0, api=api)]
    rngs = _rng.tensors(process, step_of(states[0]))  # torch's, Python's, NumPy's, CUDA's; a local mesh's per rank
    todo += [_dcp.Piece(key, *_whole(t)) for key, t in rngs.items()]
    if frozen is not None and process == 0:
        todo += _frozen.pieces(frozen)
    needed = size_lower_bound(states[0], ents[0], processes=processes, rng_bytes=sum(t.numel() * t.element_size() for t in rngs.values()),
                              rng_records=len(rngs))
    previous = final if is_complete(final) else None
    lock: list[int | None] = []  # rank 0's fd holding the lock on `partial` while it writes there

    def prepare() -> None:
        refuse_to_clobber(final, keep, api)
        try:
            os.makedirs(parent, exist_ok=True)
            if keep is not None:
                hold_directory(parent, api)
            if os.path.lexists(partial):  # a save that died before (or one still running: then it is refused)
                unlock(lock_partial(partial, api))
                shutil.rmtree(partial)
            check_space(api=api, path=final, needed=needed, previous=previous)
            os.makedirs(partial)
            lock.append(lock_partial(partial, api))
        except OSError as e:
            raise _write_error(e, api=api, path=final, needed=needed, previous=previous) from None

    def explain(e: BaseException) -> Exception | None:
        return (_oserrors.explain(e, api=api, path=final, needed=needed, written=_oserrors.used_bytes(partial), previous=previous)
                or ranks.failed_elsewhere(e, f"torch.distributed.checkpoint's own collectives, writing {partial}"))

    def finish(crcs: dict[str, int]) -> None:
        try:
            write_synced(os.path.join(partial, INFO), json.dumps(info, indent=1).encode())
            crcs = {**crcs, INFO: crc32_file(os.path.join(partial, INFO)), ".metadata": crc32_file(os.path.join(partial, ".metadata"))}
            write_synced(os.path.join(partial, MARKER), marker_bytes(partial, crcs))  # last: the checkpoint is complete
            fsync_dir(partial)
            _interrupts.check()  # the last point to stop with the previous checkpoint in place: the publish is a rename
            publish(partial, final)
        except OSError as e:
            raise _write_error(e, api=api, path=final, needed=needed, previous=previous) from None
        try:  # the checkpoint is complete and in place: what follows is housekeeping, whose failure loses nothing
            if keep is not None:
                prune(path, keep, final=final)
            sweep_partials(parent)
        except OSError as e:
            warnings.warn(f"{api}: {final} is saved and complete, but removing older checkpoints or the leftovers of "
                          f"crashed saves in {parent} failed ({type(e).__name__}: {e}); the next save tries again.",
                          stacklevel=_outside_fzero())

    try:
        with _interrupts.deferred():  # Ctrl-C: raised as itself between the phases and tensors, never inside torch's C++
            _on_rank0(prepare, ranks, f"{api}: preparing {partial}")
            _interrupts.check()
            _dcp.save(partial, todo, distributed=distributed, explain=explain, rank=process)
            _interrupts.check()
            crcs = _checksums(partial, process, ranks, api)
            _interrupts.check()
            _on_rank0(lambda: finish(crcs), ranks, f"{api}: completing {final}")
    except BaseException:
        if lock:  # this process made `partial`: a failed save leaves nothing behind (a full disk gets its space back)
            shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        for fd in lock:
            unlock(fd)
    return final


def _check_keys(value: Any, where: str, api: str) -> None:
    """Refuse a dict key of ``extra`` that is not a str: JSON writes it as one, so it would come back changed (a data
    loader's ``{rank: position}`` read back as ``{"0": ...}``, where ``positions.get(rank, 0)`` restarts the data
    silently) or, beside the str of itself (``{1: a, "1": b}``), not come back at all. ``torch.save``, which
    DeepSpeed's ``client_state`` goes through, would have kept it; ``json.dumps`` accepts it without a word."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                written = next(iter(json.loads(json.dumps({key: 0}))))  # what JSON makes of it
                clash = f", the key of the entry {where}[{written!r}], one of which would be lost" if written in value else ""
                raise TypeError(
                    f"{api}: extra must be JSON data, whose dict keys are str; {where} has the key {key!r} "
                    f"({type(key).__name__}), which would come back from read_extra as the str {written!r}{clash}. "
                    f"Write str keys (str({key!r})) and convert them back after read_extra, or a list of pairs."
                )
            _check_keys(item, f"{where}[{key!r}]", api)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_keys(item, f"{where}[{i}]", api)


def _agree_on_extra(ranks: Ranks, extra_json: Any, api: str) -> None:
    """Refuse, on every rank, an ``extra`` that differs between the ranks under torchrun.

    Why: the checkpoint holds one ``extra``, rank 0's (as DeepSpeed keeps rank 0's ``client_state``), so another
    rank's (its own data loader's position, its own sample count) was dropped without a word, and that rank resumed
    from rank 0's value. Every rank sees every rank's text, so all raise alike (none is left in a collective)."""
    if ranks.comm is None:
        return
    mine = json.dumps(extra_json, sort_keys=True)
    every = ranks.gather(mine, f"{api}: compare the ranks' extra")
    differ = [r for r, text in enumerate(every) if text != every[0]]
    if not differ:
        return
    cut = lambda text: text if len(text) <= 120 else text[:117] + "..."  # noqa: E731
    raise ValueError(
        f"{api}: the ranks give different extra: rank 0 {cut(every[0])}, rank {differ[0]} {cut(every[differ[0]])}"
        f"{f' (and {len(differ) - 1} more ranks)' if len(differ) > 1 else ''}. A checkpoint holds one extra, so the "
        f"other ranks' would be lost. Give every rank the same extra: gather what differs into it first (e.g. "
        f"torch.distributed.all_gather_object, then extra={{'pos': positions}}, one per rank, read back by rank), and "
        f"leave out what need not be kept (a per-rank time)."
    )


def _outside_fzero() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called here that names the first frame outside fzero's package: the
    user's ``save`` call (or Lightning's). A fixed count named fzero's own lines: ``save`` reaches its housekeeping
    through ``_on_rank0`` and a closure, and other paths (``FZeroStrategy``) call it from deeper."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _checksums(partial: str, process: int, ranks: Ranks, api: str) -> dict[str, int]:
    """The CRC-32 of every data file (each process reads back the files it wrote); all of them on rank 0."""
    mine: dict[str, int] | str
    try:
        mine = {f: crc32_file(os.path.join(partial, f)) for f in os.listdir(partial) if f.startswith(f"__{process}_")}
    except OSError as e:
        mine = f"rank {process}: {type(e).__name__}: {e}"
    every = ranks.gather(mine, f"{api}: gather the checksums of the files written")
    errors = [x for x in every if isinstance(x, str)]
    if errors:
        raise CheckpointError(f"{api}: could not read back the files just written in {partial} to checksum them: {'; '.join(errors)}")
    return {k: v for x in every for k, v in x.items()}


def _write_error(e: OSError, **how: Any) -> Exception:
    """A ``CheckpointWriteError`` naming the errno where it is one of a full disk, a read-only filesystem or a
    denied permission, else a ``CheckpointError`` with the OS's words."""
    return _oserrors.explain(e, **how) or CheckpointError(f"{how['api']}: cannot write {how['path']}: {type(e).__name__}: {e}")


def _whole(t: torch.Tensor) -> tuple:
    return tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, lambda: t


def _on_rank0(fn: Any, ranks: Ranks, what: str) -> None:
    """Run ``fn`` on rank 0 only; under torchrun every rank learns whether it worked (and none hangs if not)."""
    error: Exception | None = None
    if ranks.rank == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            error = e
    if ranks.any(error is not None, what) and error is None:
        raise CheckpointError(f"{what} failed on rank 0 (see its error).")
    if isinstance(error, OSError):
        raise CheckpointError(f"{what}: {type(error).__name__}: {error}") from None
    if error is not None:
        raise error
