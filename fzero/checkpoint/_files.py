"""A checkpoint on disk: the directory's files, finding the newest complete one, checking it, publishing it atomically.

A checkpoint directory holds DCP's files, ``fzero.json`` (``INFO``: what the state was) and, written last, the
marker ``COMPLETE`` (``MARKER``: the size and CRC-32 of every file, see ``_verify``). A save writes into
``.<name>.partial`` and ``publish`` renames it into place (swapping out an existing checkpoint atomically where
Linux can).

The process that writes a ``.partial`` directory holds an exclusive ``flock`` on it until it is published or
removed. The kernel drops the lock when that process dies, however it dies (``kill -9`` included), so a
``.partial`` that can be locked is the leftover of a crashed save, and ``sweep_partials`` removes it; one that
cannot is a save still running, and is left alone.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from typing import Any

from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._verify import MARKER, Manifest, read_manifest

FORMAT, VERSION = "fzero.checkpoint", 1  # the checksums went into the marker, not into the format: VERSION stays
INFO = "fzero.json"
STEP_NAME = re.compile(r"^step_(\d{8,})$")
PARTIAL_NAME = re.compile(r"^\.(.+)\.partial$")
_SAVE_FILE = re.compile(r"^(\.metadata(\.tmp)?|fzero\.json|COMPLETE|__\d+_\d+\.distcp)$")  # all a save ever writes


def step_dir(step: int) -> str:
    """The name ``save(..., keep=K)`` gives the checkpoint of ``step`` inside its parent directory."""
    return f"step_{step:08d}"


def refuse_to_clobber(final: str, keep: int | None, api: str) -> None:
    if not os.path.lexists(final):
        return
    if not os.path.isdir(final):
        raise CheckpointError(f"{api}: {final} exists and is not a directory; refusing to replace it. Pick another path.")
    entries_ = os.listdir(final)
    if not entries_ or INFO in entries_ or ".metadata" in entries_:
        return  # an empty directory, or an (even incomplete) checkpoint: replaced
    hint = " It holds step_* checkpoints: pass keep=K to save into it." if keep is None and any(STEP_NAME.match(e) for e in entries_) else ""
    raise CheckpointError(f"{api}: {final} exists and is not an fzero checkpoint; refusing to replace it.{hint}")


def check_destination(path: str, final: str, keep: int | None, api: str) -> None:
    """Raise a ``CheckpointError`` if the directory a save makes or writes into (``path`` with ``keep=K``, else the
    parent of ``final``), or the nearest existing folder above it, is not a directory (a regular file, say): named
    before anything is written, rather than as the OS's bare FileExistsError or NotADirectoryError."""
    folder = path if keep is not None else os.path.dirname(final)
    probe = folder
    while not os.path.lexists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.isdir(probe):
        return
    kind = "regular file" if os.path.isfile(probe) else "file that is not a directory"
    role = (f"the directory that keep={keep} saves step_* checkpoints into" if keep is not None and probe == folder else
            f"the directory to hold {final}" if probe == folder else f"a folder above {final}")
    raise CheckpointError(f"{api}: {probe} is a {kind}, but it is {role}. Pass a path where directories can be made, or move the file away.")


def write_synced(file: str, data: bytes) -> None:
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(partial: str, final: str) -> None:
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
    fsync_dir(os.path.dirname(final))


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def prune(parent: str, keep: int, *, final: str | None = None) -> None:
    """Keep the ``keep`` complete ``step_*`` checkpoints of ``parent`` saved last (``_complete_steps``), ``final`` (the
    one just saved) always among them; remove older ones and leftovers."""
    done = _complete_steps(parent)
    last = os.path.basename(final) if final is not None else None
    if last in done:  # the newest save by its record; kept whatever a clock says of the others
        done.remove(last)
        done.append(last)
    for e in done[:-keep]:
        shutil.rmtree(os.path.join(parent, e), ignore_errors=True)
    for e in os.listdir(parent):  # a publish without an atomic swap that died between its renames
        if e.startswith(".step_") and e.endswith(".old"):
            shutil.rmtree(os.path.join(parent, e), ignore_errors=True)


# -- the lock of a save in progress, and the leftovers of crashed ones ---------------------------------------


def lock_partial(partial: str, api: str) -> int | None:
    """Take the exclusive lock that marks ``partial`` as being written by this process; returns the fd to close
    when done (None where the filesystem has no locks: then nothing tells a live save from a dead one)."""
    fd = os.open(partial, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise CheckpointError(f"{api}: {partial} is being written by another running save; wait for it or save elsewhere.") from None
        return None
    return fd


def unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


# -- one run per keep=K directory --------------------------------------------------------------------------
# Two runs saving keep=K checkpoints into one directory prune and replace each other's step_* checkpoints, and
# every save returns: the directory ends up holding one run's states, or a mix. So the first save of a process
# into a keep=K directory takes an exclusive flock on the directory itself and holds it while the process lives
# (the kernel drops it when the process ends, however it ends: a dead run's lock never blocks the next run). A
# save of another process into it is refused, naming the holder's pid (from /proc/locks) and host. No file is
# added to the directory.

_held_dirs: dict[tuple[int, int], int] = {}  # (st_dev, st_ino) of a keep=K directory -> the fd holding its lock


def hold_directory(parent: str, api: str) -> None:
    """Take (or keep) this process's lock on the keep=K directory ``parent``; raise if another process holds it."""
    st = os.stat(parent)
    if (st.st_dev, st.st_ino) in _held_dirs:
        return
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return  # a filesystem without locks: nothing to hold (as for a save's .partial)
        raise CheckpointError(
            f"{api}: another process saves checkpoints into {parent} ({_lock_holder(st)}): two runs saving keep=K "
            f"checkpoints into one directory prune and replace each other's, and the directory would hold a mix of "
            f"both. Give this run a directory of its own, or end the other run first (its lock goes with its process)."
        ) from None
    _held_dirs[(st.st_dev, st.st_ino)] = fd


def _lock_holder(st: os.stat_result) -> str:
    """'pid N on HOST' of the process holding a flock on the file ``st`` (from /proc/locks), or why unknown."""
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" in fields and inode in fields:
                    pid = fields[fields.index(inode) - 1]
                    return f"pid {pid} on {socket.gethostname()} holds its lock"
    except OSError:
        pass
    return "its lock is held by a process not visible here, e.g. on another host"


def is_stale(partial: str) -> bool | None:
    """True if no live process holds ``partial``'s lock (its save crashed), False if one does, None if unknown."""
    try:
        fd = os.open(partial, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)  # closing the fd releases the lock


def sweep_partials(parent: str) -> list[str]:
    """Remove the leftovers of crashed saves in ``parent``: directories named ``.<name>.partial`` holding only
    files a save writes, whose lock no live process holds. Returns what was removed."""
    removed = []
    for e in sorted(os.listdir(parent)):
        path = os.path.join(parent, e)
        if not PARTIAL_NAME.match(e) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            ours = all(_SAVE_FILE.match(f) for f in os.listdir(path))
        except OSError:
            continue
        if ours and is_stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def _complete_steps(parent: str) -> list[str]:
    """The names of the complete ``step_*`` checkpoints in ``parent``, in the order they were saved (``saved_ns`` in
    their ``fzero.json``), the last saved last; by step where that is equal or missing (checkpoints of older fzero).

    Why the order of saving and not the step: after a rollback (``load`` of an older checkpoint, training on from
    it), the new line's checkpoints have lower steps than the abandoned line's. Ranked by step, ``keep=1`` removed
    the checkpoint just saved and ``latest`` resumed the abandoned line; DeepSpeed records the tag it saved last
    for the same reason."""
    done = []
    for e in os.listdir(parent):
        m = STEP_NAME.match(e)
        if m and is_complete(os.path.join(parent, e)):
            done.append((_saved_ns(os.path.join(parent, e)), int(m.group(1)), e))
    return [e for _, _, e in sorted(done)]


def _saved_ns(path: str) -> int:
    """When the checkpoint at ``path`` was saved (ns since the epoch), from its ``fzero.json``; -1 if it has none."""
    try:
        with open(os.path.join(path, INFO), "rb") as f:
            value = json.loads(f.read()).get("saved_ns", -1)
    except (OSError, ValueError, AttributeError):
        return -1
    return value if isinstance(value, int) else -1


def latest(path: str | os.PathLike) -> str | None:
    """The complete ``step_*`` checkpoint in ``path`` saved last (or ``path`` itself if it is one); None if there is
    none. Saved last, not of the highest step: after a rollback, the line training goes on from."""
    path = os.path.abspath(os.fspath(path))
    if is_complete(path):
        return path
    if not os.path.isdir(path):
        return None
    done = _complete_steps(path)
    return os.path.join(path, done[-1]) if done else None


def open_checkpoint(path: str | os.PathLike, api: str, *, verify: bool = True) -> tuple[str, dict[str, Any], Manifest]:
    """The complete checkpoint at ``path`` (or the newest in it), its ``fzero.json`` and its manifest, after checking
    that every file is there with its size and (``verify``) that the marker and the small files have their checksums.
    The data files are checked when read (``Manifest.check``)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"{api}: no checkpoint at {path} (it does not exist).")
    found = latest(path)
    if found is None:
        other = _other_format(path, api)
        if other is not None:
            raise CheckpointError(other)
        if os.path.exists(os.path.join(path, ".metadata")) or os.path.exists(os.path.join(path, INFO)):
            raise CheckpointError(f"{api}: {path} is incomplete: it has no {MARKER} marker (the save was interrupted, or is still running).")
        raise CheckpointError(f"{api}: {path} is neither a checkpoint nor a directory holding complete step_* checkpoints.")
    manifest = read_manifest(found, verify=verify, api=api)
    try:
        with open(os.path.join(found, INFO), "rb") as f:
            info = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{api}: {found}/{INFO} is missing or corrupted ({type(e).__name__}: {e}).") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("version"), int):
        raise CheckpointError(f"{api}: {found}/{INFO} is not an fzero checkpoint description.")
    if info["version"] > VERSION:
        raise CheckpointError(f"{api}: {found} has format version {info['version']}; this fzero reads up to {VERSION}. Upgrade fzero.")
    return found, info, manifest


# Which tool wrote a directory, by its files' names: for the errors of load, pretrained and from_deepspeed, each
# given a directory another reader takes
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TORCH_OPTIMIZERS = ("optimizer.pt", "optimizer.bin")  # a Hugging Face Trainer's or Accelerate's, beside the weights


def fzero_names(names: Any) -> bool:
    """fzero's: a checkpoint (``fzero.json``) or a run directory of ``step_*`` checkpoints."""
    return INFO in names or any(STEP_NAME.match(n) for n in names)


def deepspeed_names(names: Any) -> bool:
    """DeepSpeed's ``engine.save_checkpoint``: its save_dir (``latest``, ``global_stepN``) or a tag folder."""
    return "latest" in names or any(n.startswith("global_step") or n.endswith("_optim_states.pt") for n in names)

_FROM_OTHERS = "From FSDP2, DDP or the Hugging Face Trainer"  # the section of docs/migrating.md the errors point to


def _other_format(path: str, api: str) -> str | None:
    """The error for a directory another tool wrote, naming it and what fzero does with it (None: not one it knows).

    Why: users point ``load`` at the checkpoint they come with. An FSDP2 run's ``dcp.save`` directory (DCP's
    ``.metadata``, no ``fzero.json``) was called an interrupted fzero save, and a Hugging Face Trainer's
    ``checkpoint-N`` (or Accelerate's ``save_state`` folder) "neither a checkpoint nor a directory holding" one,
    with no word of what fzero can read of either: their weights, not their optimizer state."""
    if not os.path.isdir(path) or PARTIAL_NAME.match(os.path.basename(path)):
        return None
    names = set(os.listdir(path))
    # fzero's own, none complete (copied in part): the caller says so, though a run directory may also hold
    # save_weights' model.safetensors or a `latest` file of the user's, which are not what the directory is
    if fzero_names(names):
        return None
    if ".metadata" in names:
        return (
            f"{api}: {path} is a torch.distributed.checkpoint (DCP) directory that fzero did not write (it has no {INFO}): "
            f"an FSDP2 or Accelerate run's dcp.save of get_state_dict/get_model_state_dict. fzero resumes its own "
            f"checkpoints only and does not read that optimizer state. Load the weights into the module before step.init "
            f"(docs/migrating.md, '{_FROM_OTHERS}'): torch.distributed.checkpoint.format_utils.dcp_to_torch_save({path!r}, "
            f"'full.pt') makes one file of it; model.load_state_dict(torch.load('full.pt', weights_only=True)['model']) "
            f"(the key the dict was saved under); state = step.init(fzero.params_of(model)). The optimizer starts afresh."
        )
    weights = [f for f in HF_WEIGHTS if f in names]
    if weights:
        optimizer = [f for f in TORCH_OPTIMIZERS if f in names]
        read = ("step.init(fzero.params_of(model, copy=False), materialize=fzero.checkpoint.pretrained(path, model=model)) "
                "for a model built under fzero.empty_params(), or from_pretrained(path) and step.init(fzero.params_of(model))"
                if weights[0].startswith("model.safetensors") else "from_pretrained(path) and step.init(fzero.params_of(model))")
        return (
            f"{api}: {path} holds Hugging Face weights ({weights[0]}: save_pretrained's, a Trainer's checkpoint-N or "
            f"Accelerate's save_state), not an fzero checkpoint. Start from its weights with {read}"
            + (f"; its {optimizer[0]} (a torch optimizer's state: AdamW's moments) is not read, so the optimizer starts "
               f"afresh (docs/migrating.md, '{_FROM_OTHERS}')" if optimizer else "") + "."
        )
    if deepspeed_names(names):
        return f"{api}: {path} is a DeepSpeed checkpoint (engine.save_checkpoint), not an fzero one: resume it with fzero.checkpoint.from_deepspeed({path!r}, like=step)."
    return None


def read_extra(path: str | os.PathLike) -> Any:
    """The ``extra`` given to ``save`` (None if none) of the checkpoint at ``path`` (or the newest in it)."""
    return open_checkpoint(path, "fzero.checkpoint.read_extra")[1]["extra"]


def verify(path: str | os.PathLike) -> str:
    """Check every file of the checkpoint at ``path`` (or the newest in it) against its recorded size and CRC-32;
    return its path, or raise ``CheckpointCorrupted`` naming the first file that differs."""
    found, _, manifest = open_checkpoint(path, "fzero.checkpoint.verify")
    manifest.check(manifest.files)
    return found
