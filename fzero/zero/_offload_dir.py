"""The directory of one rank's offloaded files: made, held while in use, and removed on every exit path.

Why: disk offload writes each rank's optimizer state into ``offload_dir/fzero-rank<r>-p<pid>-...``. A process
that ends normally or with an exception removes its directories (the store's finalizer, which also runs at
interpreter exit), and an ``init`` that fails removes what it made at once (``fzero.zero._offload.init_disk``).
A process that is killed (``kill -9``, the out-of-memory killer, torchrun's SIGKILL, a crash in C++) runs no code,
and its directories, the size of the optimizer state, stay behind: measured at commit 759f906, every killed job
left one per rank. So the process holds an exclusive ``flock`` on each of its directories while it uses it (the
kernel drops it when the process ends, however it ends), and the next store made in the same ``offload_dir``
removes the directories whose lock no process holds, whose owner's pid (in the name) is not alive on this host,
and which hold only fzero's files: the leftovers of dead runs, never a live run's (on this host or another that
shares the directory and its locks), never a directory fzero did not make.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import uuid

_NAME = re.compile(r"^fzero-rank\d+-p(\d+)-[0-9a-f]{8}-")  # what make() names; older names (no pid) are never swept
_FILE = re.compile(r"^(?:[\w.-]|<root>)+\.bin$")  # DiskStore.path's files: unit names are module paths, or the root unit's <root>


def make(root: str, rank: int) -> tuple[str, int | None]:
    """A fresh directory for ``rank``'s files under ``root`` (after sweeping dead runs' leftovers), and the fd that
    holds its lock (None where the filesystem has no locks)."""
    sweep(root)
    path = tempfile.mkdtemp(prefix=f"fzero-rank{rank}-p{os.getpid()}-{uuid.uuid4().hex[:8]}-", dir=root)
    return path, _lock(path)


def _lock(path: str) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def release(path: str, fd: int | None) -> None:
    """Remove the directory, then let go of its lock."""
    shutil.rmtree(path, True)
    if fd is not None:
        os.close(fd)


def sweep(root: str) -> list[str]:
    """Remove the leftovers of dead runs in ``root`` (see the module docstring); returns what was removed."""
    from fzero.mesh import process_alive

    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        path = os.path.join(root, name)
        if m is None or os.path.islink(path) or not os.path.isdir(path) or process_alive(int(m.group(1))):
            continue
        try:
            ours = all(_FILE.match(f) for f in os.listdir(path))
        except OSError:
            continue
        if ours and _unheld(path):
            shutil.rmtree(path, True)
            removed.append(path)
    return removed


def _unheld(path: str) -> bool:
    """Whether no process holds ``path``'s lock (False when unsure: a filesystem without locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held (EWOULDBLOCK), or no locks here: then nothing tells a dead run from a live one
        return False
    finally:
        os.close(fd)
