"""Filesystem failures while writing a checkpoint or consolidated weights, named as what they are.

Why this is needed: torch hides them. ``torch.save`` into a stream that fails with ENOSPC raises
``RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598`` (the ``OSError``
survives only as its ``__context__``), DCP wraps that into a ``CheckpointException`` keyed by rank, and under
torchrun the exceptions of other ranks arrive pickled, without their context. So ``explain`` looks for an
errno along every exception chain, and where none survived it asks the filesystem: if what is still free
cannot hold what remained to write, the disk was full.
"""

from __future__ import annotations

import errno as errnos
import os
import shutil

from fzero.checkpoint._dcp import CheckpointError

SPACE, READ_ONLY, DENIED = (errnos.ENOSPC, errnos.EDQUOT), errnos.EROFS, (errnos.EACCES, errnos.EPERM)
_SLACK = 64 << 10  # a write that failed with less than this free beyond what remained to write: the disk was full


class CheckpointWriteError(CheckpointError):
    """A checkpoint or consolidated file could not be written where asked: no space (ENOSPC, EDQUOT), a read-only
    filesystem (EROFS), no permission (EACCES, EPERM) or no such directory (ENOENT). ``errno`` says which."""

    def __init__(self, message: str, *, errno: int, path: str) -> None:
        super().__init__(message)
        self.errno, self.path = errno, path


def size_text(n: int) -> str:
    """``n`` bytes for a person: '1.23 GB (1,234,567,890 bytes)'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def free_bytes(path: str) -> int | None:
    """Bytes free to this user on the filesystem of ``path`` (or of its nearest existing parent); None if unknown."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def used_bytes(directory: str) -> int:
    """Bytes of the files directly in ``directory`` (what a failed write had already put there); 0 if none."""
    try:
        return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def find_oserror(e: BaseException | None) -> OSError | None:
    """The first ``OSError`` on ``e``'s chain (causes, contexts, and the per-rank failures of a DCP exception)."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            return x
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint's CheckpointException: {rank: (exc, tb)}
        if isinstance(failures, dict):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        todo += [x.__cause__, x.__context__]
    return None


def space_error(*, api: str, path: str, needed: int, free: int, code: int = errnos.ENOSPC, previous: str | None = None) -> CheckpointWriteError:
    what = "disk quota exceeded (EDQUOT)" if code == errnos.EDQUOT else "no space left on the device (ENOSPC)"
    return CheckpointWriteError(
        f"{api}: cannot write {path}: {what}: it needs at least {size_text(needed)}, {size_text(free)} are free there. "
        f"Free some space or write to another filesystem.{_previous(previous)}",
        errno=code, path=path,
    )


def explain(e: BaseException, *, api: str, path: str, needed: int, written: int = 0, previous: str | None = None) -> CheckpointWriteError | None:
    """A ``CheckpointWriteError`` naming the cause if ``e`` (raised while writing ``needed`` bytes to ``path``, of which
    ``written`` had reached the disk) is a full disk, a read-only filesystem or a denied permission; else None."""
    os_error = find_oserror(e)
    code = os_error.errno if os_error is not None else None
    where = path  # what the caller asked to write; the OS's filename may be a temporary beside it
    if code in SPACE or code is None:
        free = free_bytes(path)
        if code in SPACE or (free is not None and free < max(needed - written, 0) + _SLACK):
            # free as it will be once the failed write's files are removed (they are, by the caller)
            return space_error(api=api, path=path, needed=needed, free=(free or 0) + written, code=code or errnos.ENOSPC, previous=previous)
        return None
    if code == READ_ONLY:
        return CheckpointWriteError(
            f"{api}: cannot write {where}: the filesystem is read-only (EROFS). Write to a directory on a writable "
            f"filesystem.{_previous(previous)}", errno=code, path=where,
        )
    if code in DENIED:
        return CheckpointWriteError(
            f"{api}: cannot write {where}: permission denied ({errnos.errorcode[code]}). Write to a directory you may write "
            f"to, or change its permissions.{_previous(previous)}", errno=code, path=where,
        )
    if code == errnos.ENOENT:
        return CheckpointWriteError(f"{api}: cannot write {where}: no such file or directory (ENOENT).", errno=code, path=where)
    return None


def check_space(*, api: str, path: str, needed: int, previous: str | None = None) -> None:
    """Refuse before writing anything if the filesystem of ``path`` has less than ``needed`` bytes free.

    ``needed`` is a lower bound of what is written (tensor bytes and the least overhead per record), so this never
    refuses a write that would fit; it spares a job from filling the disk (and other programs on it) to learn
    what it could know.
    """
    free = free_bytes(path)
    if free is not None and free < needed:
        raise space_error(api=api, path=path, needed=needed, free=free, previous=previous)


def _previous(previous: str | None) -> str:
    return f" The previous checkpoint at {previous} is untouched." if previous else ""
