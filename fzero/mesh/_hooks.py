"""The process hooks of a ``dist_mesh`` rank: it reports its own error, and when it is stopped, it says why.

``install(board)`` (called by ``dist_mesh``) sets, once per process:

- ``sys.excepthook``: an exception that ends this rank's program is written to the fault board first
  (``fault/<rank>``: "ValueError: ..."), so the ranks waiting for this one stop within a second and name it;
  then the previous hook prints the traceback as usual. Errors that already name another rank's fault
  (``RankFailed``, a ``MeshTimeout`` naming the rank that did not arrive) are not reported as this rank's own.
- then a short wait before the process ends: torchrun stops every other rank (SIGTERM) as soon as one rank's
  process ends, which would kill the ranks that have not yet printed why they stop. The rank at fault waits
  until every other rank has reported or is gone, at most ``LINGER`` seconds: a rank waiting at a collective
  learns of the fault within a second; one that is computing, or blocked in a gloo reduce-scatter (which runs
  inside ``wait`` and ignores a timeout), learns of it when this process ends: its collective fails with
  "Connection closed by peer", or torchrun's SIGTERM arrives, and either is explained from the board. (Closing
  the process group's connections earlier is not possible: gloo closes them only when the group is destroyed,
  and the traceback being printed still refers to it.) A rank stopped by another's fault waits, as long, until
  that rank's process has ended, so that torchrun reports the rank at fault as the first failure.
- ``atexit``: marks this rank done.
- SIGTERM (only where the handler is still Python's default, and only from the main thread): raises
  ``RankStopped`` in the main thread, naming the rank at fault and what this rank was doing, so that a rank
  busy computing when torchrun stops the job still says why. A SIGTERM while this rank's own error naming the
  rank at fault is on its way up changes nothing; a second SIGTERM, or one after this rank has reported, ends
  the process as the default handler does.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from typing import Any

from fzero.mesh._faults import Board, RankStopped, failed, first_fault, vanished

LINGER = 3.0  # seconds, at most, that a failing rank stays for the others to report

_state: dict[str, Any] = {"board": None, "installed": False, "previous": None}


def install(board: Board) -> None:
    """Make ``board`` this process's fault board and set the hooks (once per process)."""
    _state["board"] = board
    if _state["installed"]:
        return
    _state["installed"] = True
    _state["previous"] = sys.excepthook
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def current() -> Board | None:
    return _state["board"]


def _excepthook(etype: type, value: BaseException, tb: Any) -> None:
    board: Board | None = _state["board"]
    own = not hasattr(value, "fzero_culprit")
    if board is not None and board.failing is None:  # a SIGTERM while this is printed must not interrupt it
        board.failing = value
    if board is not None and not board.reported and own:
        _quietly(board.publish, board.rank, f"{etype.__name__}: {_message(value)}")
    _state["previous"](etype, value, tb)
    if board is not None and not board.reported:
        board.reported = True
        _quietly(board.mark, "done")
        _quietly(_linger, board, None if own else getattr(value, "fzero_culprit", None))


def _linger(board: Board, culprit: int | None) -> None:
    others = [r for r in range(board.size) if r != board.rank]
    grace = min(LINGER, board.timeout)
    if culprit is None:  # this rank's own error: stay until the others have said why they stop
        _until(lambda: all(board.has("done", r) or board.alive(r) is False for r in others), grace)
        return
    fault = board.faults().get(culprit)
    if fault is not None and fault["by"] == culprit:  # the rank at fault waits for us: let it end first
        alive = board.alive(culprit)
        if alive is None:
            _until(lambda: board.has("exited", culprit), grace)
        else:
            _until(lambda: board.alive(culprit) is False, grace)


def _at_exit() -> None:
    board: Board | None = _state["board"]
    if board is not None:
        board.reported = True
        _quietly(board.mark, "done")
        _quietly(board.mark, "exited")


def _on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
    board: Board | None = _state["board"]
    if board is None or board.reported:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if board.failing is not None:  # an error is on its way up or being printed: let it be
        return
    where = board.doing()
    error: BaseException | None = None
    try:
        faults = board.faults()
        if faults:
            error = failed(board, *first_fault(board, faults), where)
        else:
            gone = [r for r in range(board.size) if r != board.rank and board.alive(r) is False]
            if gone:
                error = vanished(board, gone, where, "stopped by SIGTERM")
    except Exception:  # noqa: BLE001 - the store may be gone with the job: say what is known
        error = None
    if error is not None:
        stopped = RankStopped(f"{error} It was stopped by SIGTERM (torchrun stops every rank of a job once one has failed).")
        stopped.fzero_culprit = error.rank  # type: ignore[attr-defined]
    else:
        stopped = RankStopped(
            f"fzero.dist_mesh: rank {board.rank} was stopped by SIGTERM while {where}; no rank reported an error: the "
            f"launcher or the job scheduler stopped the job (a time limit, preemption, Ctrl-C).")
        stopped.fzero_culprit = None  # type: ignore[attr-defined]
    raise stopped


def _message(value: BaseException) -> str:
    """The exception's first line (the others are for its own traceback), at most 1000 characters."""
    lines = str(value).strip().splitlines() or [""]
    text = lines[0][:1000]
    return text + (" [...]" if len(lines) > 1 or len(lines[0]) > 1000 else "")


def _until(predicate: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a hook must never hide the error being reported; the store may be gone
        pass
