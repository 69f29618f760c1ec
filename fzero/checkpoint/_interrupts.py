"""Ctrl-C during a save: held back while torch runs C++ code, raised as itself at the next safe point.

Why: a ``KeyboardInterrupt`` that Python raises while the main thread is inside torch's C++ (``torch.save``
calls back into Python to write each record) either unwinds through C++ frames that cannot throw, which aborts
the process ("terminate called after throwing an instance of ..."), or is caught by torch.distributed.checkpoint
and wrapped into a ``CheckpointException`` that fzero used to turn into a ``CheckpointError``, an ``Exception``
that a training loop's ``except Exception`` swallows (measured at commit 759f906: 9 of 18 Ctrl-C's swallowed,
3 of 18 C++ aborts). So while ``deferred()`` is entered, SIGINT only sets a flag; ``check()`` raises the
``KeyboardInterrupt`` at points where only Python is on the stack (between the tensors a save writes, between
its phases), and leaving ``deferred()`` raises it if it is still pending. The save's own cleanup then removes its
``.partial`` and the previous checkpoint stays as it was.

Only the default handler is replaced, and only in the main thread (where Python delivers signals): a program
that installed its own SIGINT handler keeps it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

_pending = threading.Event()  # a SIGINT arrived while deferred and has not been raised yet
_depth = [0]  # nested deferred() (a save inside a save's callback): only the outermost installs the handler


def _on_sigint(signum: int, frame: object) -> None:
    _pending.set()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """SIGINT held back for the length of the block (see the module docstring); a pending one raised on leaving."""
    mine = (threading.current_thread() is threading.main_thread() and _depth[0] == 0
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if mine:
        _pending.clear()
        signal.signal(signal.SIGINT, _on_sigint)
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1
        if mine:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if mine:
        check()


def check() -> None:
    """Raise the pending ``KeyboardInterrupt`` now (main thread only: elsewhere it waits for the main thread)."""
    if _pending.is_set() and threading.current_thread() is threading.main_thread():
        _pending.clear()
        raise KeyboardInterrupt


def stop_signal(error: BaseException, *, rank: int = 0) -> BaseException | None:
    """The ``KeyboardInterrupt`` (or other ``BaseException`` that is not an ``Exception``: ``SystemExit``, fzero's
    ``RankStopped``) inside ``error``: itself, or one that torch.distributed.checkpoint wrapped (its
    ``CheckpointException`` keeps each rank's exception in ``failures``: only this process's, ``rank``, counts; another
    rank's Ctrl-C is that rank's to raise), or one further down the chain of causes. None if there is none: then
    ``error`` is a failure to explain, not a request to stop."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if not isinstance(e, Exception) and type(e).__name__ != "CheckpointException":
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict) and rank in failures:
            todo.append(failures[rank][0])
        todo += [e.__cause__, e.__context__]
    return None
