"""Waiting for a ``torch.distributed`` collective without waiting forever, and saying why a wait ended badly.

A gloo collective's ``work.wait(timeout)`` gives up after ``timeout`` with "Operation timed out!" and can be
waited on again, so a rank waits in slices (0.1 s, doubling up to 1 s) and between two slices reads the fault
board (``fzero.mesh._faults``): another rank's error ends the wait at once as a ``RankFailed``; a neighbour
waiting at the same collective number for a different collective is a ``RanksDisagree``; past the mesh
timeout, a ``MeshTimeout`` names the rank that did not arrive. A collective that fails (gloo's "Connection
closed by peer") is explained from the board: the rank that reported an error, or the one whose process is gone.
A collective that completes within the first slice never touches the store.

gloo's reduce-scatter is the exception: its collective runs inside ``wait``, which ignores the timeout, and
``is_completed`` stays false until then: its first slice lasts until it ends, when a peer's process ends ("Connection
closed by peer", explained from the board) or at the process group's timeout (``dist_mesh``'s, when it made the
group), which is explained like the mesh timeout.

The point-to-point exchanges that stand for gloo's all-gather and reduce-scatter (``fzero.mesh._p2p``) are waited
for by a helper thread (``Together``): a send or receive waited on in a slice that runs out closes its connection.

NCCL's ``wait`` only orders CUDA streams (the CPU does not wait), and a wait with a timeout would make the CPU
spin until the GPU is done: CUDA collectives are waited on plainly and rely on NCCL's own watchdog and timeout;
their errors are explained the same way.
"""

from __future__ import annotations

import datetime
import queue
import re
import threading
import time
from typing import Any, Callable

from fzero.mesh._comm import MeshTimeout, RanksDisagree
from fzero.mesh._faults import (FIX_TIMEOUT, Board, Call, RankFailed, disagree_text, failed, first_fault, not_arrived,
                                vanished)

FIRST_SLICE = 0.1  # seconds; a collective that completes sooner never reads the store
LONGEST_SLICE = 1.0  # how late, at most, a rank learns of another rank's failure while it waits
_SLICE_ENDED = "Operation timed out!"  # what c10d's Work.wait(timeout) raises when the work is still running


class Together:
    """Several point-to-point works (``fzero.mesh._p2p``) waited for as one collective.

    A gloo send or receive must not be waited on in slices: a ``wait(timeout)`` that runs out closes the connection
    to that peer ("Application timeout caused pair closure"), and its ``is_completed`` stays false until ``wait``.
    So a bounded wait hands the works to a helper thread, which waits for them plainly, and waits in slices on the
    helper's answer instead (``wait(timedelta)`` below, with c10d's timeout error). A rank that gives up on such a
    wait (another rank failed) leaves the helper waiting on what will never come, so a fresh helper serves the
    next one.
    """

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._handed = False

    def run(self) -> None:  # on the helper thread
        try:
            for w in self.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - raised on the waiting thread instead
            self._error = e
        finally:
            self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        if timeout is None and not self._handed:  # nothing to bound: wait here
            self.run()
        elif not self._handed:
            self._handed = True
            _helper().put(self)
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(_SLICE_ENDED)
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """The waiting rank gives up: if the helper is still waiting for these works, retire it."""
        global _HELPER
        if self._handed and not self._done.is_set():
            _HELPER = None


_HELPER: "queue.SimpleQueue[Together] | None" = None  # the queue of the process's helper thread


def _helper() -> "queue.SimpleQueue[Together]":
    global _HELPER
    if _HELPER is None:
        jobs: queue.SimpleQueue[Together] = queue.SimpleQueue()

        def serve() -> None:
            while True:
                jobs.get().run()

        threading.Thread(target=serve, name="fzero-p2p-wait", daemon=True).start()
        _HELPER = jobs
    return _HELPER


def wait(work: Any, call: Call | None, board: Board | None, *, bounded: bool) -> None:
    """Wait for ``work`` (a ``torch.distributed`` Work) issued as ``call``; explain any failure from ``board``."""
    if board is None or call is None:
        work.wait()
        return
    board.current = call
    try:
        if bounded:
            _wait_in_slices(work, call, board)
        else:
            try:
                work.wait()
            except RuntimeError as e:
                raise explained(board, call, e) from None
    except BaseException as e:
        if isinstance(work, Together):
            work.abandon()
        if hasattr(e, "fzero_culprit"):  # on its way to this rank's excepthook: a SIGTERM now must not replace it
            board.failing = e
        raise
    finally:
        board.current = None
    board.completed(call)


# What gloo raises when a message is posted to a peer whose connection is gone (its process ended or closed its group).
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|pair closure|transport/tcp/pair")


def issued(post: Callable[[], Any], call: Call | None, board: Board | None) -> Any:
    """``post()``: issue a collective, or its next round of messages, and return its work.

    A peer that is already gone fails the collective here rather than in ``wait``: gloo raises "Connection closed by
    peer" from the ``isend`` or ``all_reduce`` call itself once that peer's process has ended. Such an error is
    explained from the board as a failed wait is (the rank at fault, named); any other error of the call (a dtype
    the backend lacks, a wrong group) is this rank's own and passes unchanged.
    """
    if board is None or call is None:
        return post()
    try:
        return post()
    except RuntimeError as e:
        if isinstance(e, (RankFailed, MeshTimeout, RanksDisagree)) or not _LOST_PEER.search(str(e)):
            raise  # already explained (a second round's wait), or not a lost peer
        board.current = call
        try:
            error = explained(board, call, e)
        finally:
            board.current = None
        if hasattr(error, "fzero_culprit"):  # on its way to this rank's excepthook: a SIGTERM now must not replace it
            board.failing = error
        raise error from None


def _wait_in_slices(work: Any, call: Call, board: Board) -> None:
    start = time.monotonic()
    span = FIRST_SLICE
    posted = False
    try:
        while True:
            try:
                work.wait(datetime.timedelta(seconds=span))
                return
            except RuntimeError as e:
                if _SLICE_ENDED not in str(e):
                    raise explained(board, call, e) from None
            if not posted:  # waiting longer than a moment: say where, for the others' checks and error messages
                board.wait_at(call)
                posted = True
            _check(board, call)
            if time.monotonic() - start > board.timeout:
                raise timed_out(board, call, None) from None
            span = min(LONGEST_SLICE, span * 2)
    finally:
        if posted:
            _quietly(board.left, call)


def _check(board: Board, call: Call) -> None:
    faults = board.faults()
    if faults:
        raise culprit_named(failed(board, *first_fault(board, faults), f"waiting at {call}"))
    if board.size == 1:
        return
    # One neighbour per rank: if every rank waits and two of them disagree, some neighbours do.
    other = (board.rank + 1) % board.size
    theirs = board.waiting(other)
    if theirs is not None and theirs[0] == call.seq and theirs[1] != call.what:
        text = disagree_text(board, call, other, theirs)
        board.publish(other, text.removeprefix("fzero.dist_mesh: "))
        raise culprit_named(RanksDisagree(text), other)


def explained(board: Board, call: Call, error: BaseException) -> BaseException:
    """The error to raise for a collective that failed with ``error`` (a raw backend error) while this rank waited."""
    detail = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    where = f"waiting at {call}"
    if "Timed out" in str(error) and not board.faults():  # gloo's own timeout (the process group's), not a slice of ours
        return timed_out(board, call, detail)
    others = [r for r in range(board.size) if r != board.rank]
    # A rank that raises writes its fault from sys.excepthook before its process ends, so before its connections
    # close; the launcher may not have reaped a killed rank yet: look again for a moment.
    deadline = time.monotonic() + 2.0
    while True:
        faults = board.faults()
        if faults:
            return culprit_named(failed(board, *first_fault(board, faults), where))
        gone = [r for r in others if board.alive(r) is False]
        if gone:
            return culprit_named(vanished(board, gone, where, detail))
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    remote = [r for r in others if board.alive(r) is None]
    hint = (f" Ranks on other hosts, which this rank cannot check: {remote}." if remote else "")
    return RankFailed(
        f"fzero.dist_mesh: collective failed on rank {board.rank} while {where}: {detail}. No rank reported an error "
        f"and every other rank on this host is alive: a rank on another host may have vanished, or a rank destroyed "
        f"its process group while the others still communicated.{hint}", rank=None, cause=detail)


def timed_out(board: Board, call: Call, detail: str | None) -> BaseException:
    limit = _limit(board, detail)
    culprit, why = not_arrived(board, call, limit)
    raw = f" [{detail}]" if detail else ""
    if culprit is not None and "different collectives" in why:
        board.publish(culprit, why)
        return culprit_named(RanksDisagree(f"fzero.dist_mesh: {why}.{raw}"), culprit)
    if culprit is not None:
        board.publish(culprit, f"rank {culprit} did not arrive at collective #{call.seq} ({call.what}) within {limit}")
    return culprit_named(MeshTimeout(f"fzero.dist_mesh: {why}. {FIX_TIMEOUT}{raw}"), culprit)


def _limit(board: Board, detail: str | None) -> str:
    """The limit that ran out: the mesh's, or the process group's (gloo's own error says how many ms) where it is shorter."""
    found = re.search(r"Timed out waiting (\d+)ms", detail or "")
    if found is None or abs(int(found.group(1)) / 1000 - board.timeout) < 1:
        return f"the mesh timeout of {board.timeout:g} s"
    return f"the process group's timeout of {int(found.group(1)) / 1000:g} s (init_process_group(timeout=...))"


def culprit_named(error: BaseException, culprit: int | None = None) -> BaseException:
    """Mark an error that names another rank's fault: this rank's hooks do not report it as its own."""
    error.fzero_culprit = getattr(error, "rank", culprit)  # type: ignore[attr-defined]
    return error


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the store may be gone with the job; the error being raised matters more
        pass


def failure_elsewhere(board: Board, what: str, error: BaseException) -> BaseException:
    """``explained`` for a collective fzero did not make (torch.distributed.checkpoint's own, inside a save): the
    error to raise when ``error`` (a raw backend error) came while this rank waited in ``what``, read against
    ``board``'s record of the failed ranks."""
    return explained(board, Call(board.seq, what, board.phase), error)
