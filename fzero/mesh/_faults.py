"""The fault board of a ``dist_mesh`` job: how a rank learns which other rank failed, vanished or stalled.

A ``torch.distributed`` collective that loses a peer fails with gloo's "Connection closed by peer", or not at
all until the timeout; neither names the rank or the cause. So every process of the job keeps a ``Board`` on
the store the process group already has (torch.distributed's ``TCPStore``, which torchrun's agent hosts and
which outlives any worker), under keys of its own:

- ``pid/<r>``: rank r's host and process id, written when the board is made: a rank on the same host can tell
  at once whether rank r's process is gone (a SIGKILL, the out-of-memory killer, a crash in C++).
- ``fault/<r>``: what went wrong with rank r, as JSON ``{"by": reporter, "text": ...}``: by rank r itself when
  it raises (``fzero.mesh._process_hooks`` writes it from ``sys.excepthook``, with the exception's type and
  message), or by a rank that saw r vanish or not arrive. ``faults`` counts them, so that a waiting rank checks
  for any fault with one round trip.
- ``waiting/<r>``: the collective rank r has been waiting at for more than a moment (its sequence number and
  description); two ranks waiting at the same number for different collectives disagree.
- ``done/<r>``: rank r has reported its error, or ended; ``exited/<r>``: its interpreter is ending.

A rank waits for a collective in slices (``fzero.mesh._dist_comm``) and between slices reads the fault count,
so it stops within a second of another rank's failure, with a ``RankFailed`` naming that rank, its exception
and what this rank was doing (which collective, what it moved, in which call of the step). The board costs
nothing while collectives complete: the store is touched only by a wait that lasts longer than a slice, and
by the error paths.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import weakref
from collections import Counter as _Tally
from typing import Any

FIX_TIMEOUT = (
    "If a step is just slow on some rank (a compile-heavy first step, a long evaluation or checkpoint on one rank), "
    "raise the limit: fzero.dist_mesh(timeout=1800) (or init_process_group(timeout=...) where you create the "
    "process group yourself)."
)


class RankFailed(RuntimeError):
    """Another rank of this ``dist_mesh`` job raised, vanished or stalled; this rank stopped instead of waiting for it.

    ``rank`` is the rank at fault (None when no rank can be named) and ``cause`` what went wrong with it; the message also says what this rank
    was doing. The root cause is on rank ``rank``: its own traceback, in its output.
    """

    def __init__(self, message: str, *, rank: int | None, cause: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class RankStopped(BaseException):
    """This rank was told to stop (SIGTERM: torchrun stops every rank of a job once one has failed).

    A ``BaseException``, as ``KeyboardInterrupt``: a request to stop, which ``except Exception`` must not swallow.
    """


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective of this process, as the board describes it."""

    seq: int  # this process's collective count on the mesh: the same on every rank for the same collective
    what: str  # e.g. "all_gather params 'layers.1', 288 x float32"
    phase: str  # e.g. "step call #3 (fzero.Step.__call__)"

    def __str__(self) -> str:
        return f"collective #{self.seq} ({self.what}) in {self.phase}"


class Board:
    """This process's view of the job's fault board (see the module docstring); one per process group."""

    def __init__(self, store: Any, *, rank: int, size: int, timeout: float, group: Any = None) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        # The process group this board serves (a new group gets a new board). Weakly: a process group that outlives
        # destroy_process_group would be destroyed during interpreter finalization, with gloo's threads still about.
        self._group = None if group is None else weakref.ref(group)
        # Keys of an earlier board of the same job (a process group destroyed and made again, a torchrun restart
        # with its agent's store) must not be read as this one's: every process counts the boards it made.
        generation = store.add(f"fzero/boards/{rank}", 1)
        self.prefix = f"fzero/{generation}"
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.seq = 0
        self.last: Call | None = None  # the last collective this rank completed
        self.issued: Call | None = None  # the last collective this rank issued (an all-gather may run ahead)
        self.phase = "its program, before any fzero call"
        self._calls: _Tally[str] = _Tally()
        self.reported = False  # this rank has reported its own error (or ended): its hooks stand down
        self.current: Call | None = None  # the collective this rank waits at, if any
        self.failing: BaseException | None = None  # the error this rank raised for another rank's fault
        self._processes: dict[int, tuple[str, int]] = {}
        self._set("pid", self.rank, f"{self.host}\t{self.pid}")

    @property
    def group(self) -> Any:
        return None if self._group is None else self._group()

    # -- what this rank is doing ------------------------------------------------------------------------
    def enter(self, api: str) -> None:
        """A call of ``api`` (e.g. "fzero.Step.__call__") starts; its collectives are described as in it."""
        self._calls[api] += 1
        n = self._calls[api]
        self.phase = f"step call #{n} ({api})" if api == "fzero.Step.__call__" else f"call #{n} of {api}"

    def issue(self, what: str) -> Call:
        self.seq += 1
        self.issued = Call(self.seq, what, self.phase)
        return self.issued

    def completed(self, call: Call) -> None:
        if self.last is None or call.seq > self.last.seq:
            self.last = call

    def doing(self) -> str:
        """What this rank is doing, for an error message: waiting at a collective, or computing after one."""
        if self.current is not None:
            return f"waiting at {self.current}"
        after = "before its first collective" if self.issued is None else f"after issuing {self.issued}"
        return f"computing in {self.phase}, {after}"

    # -- the keys -------------------------------------------------------------------------------------
    def _key(self, name: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{name}" if rank is None else f"{self.prefix}/{name}/{rank}"

    def _set(self, name: str, rank: int, value: str) -> None:
        self.store.set(self._key(name, rank), value)

    def _get(self, name: str, rank: int) -> str | None:
        key = self._key(name, rank)
        # get() blocks until the key exists (up to the store's timeout): look first
        return self.store.get(key).decode() if self.store.check([key]) else None

    def publish(self, culprit: int, text: str) -> None:
        """Record what went wrong with rank ``culprit`` (the first report of a rank stands)."""
        if self._get("fault", culprit) is None:
            self._set("fault", culprit, json.dumps({"by": self.rank, "text": text}))
            self.store.add(self._key("faults"), 1)

    def faults(self) -> dict[int, dict[str, Any]]:
        """Rank -> {"by", "text"} of every fault published so far (one round trip when there is none)."""
        if self.store.add(self._key("faults"), 0) == 0:
            return {}
        found = {}
        for r in range(self.size):
            raw = self._get("fault", r)
            if raw is not None:
                found[r] = json.loads(raw)
        return found

    def wait_at(self, call: Call) -> None:
        self._set("waiting", self.rank, f"{call.seq}\t{call.what}")

    def left(self, call: Call) -> None:
        self.store.delete_key(self._key("waiting", self.rank))

    def waiting(self, rank: int) -> tuple[int, str] | None:
        raw = self._get("waiting", rank)
        if raw is None:
            return None
        seq, what = raw.split("\t", 1)
        return int(seq), what

    def mark(self, name: str) -> None:
        """``done`` (this rank has reported, or ends) or ``exited`` (its interpreter is ending)."""
        self._set(name, self.rank, "1")

    def has(self, name: str, rank: int) -> bool:
        return self.store.check([self._key(name, rank)])

    # -- liveness --------------------------------------------------------------------------------------
    def process(self, rank: int) -> tuple[str, int] | None:
        """(host, pid) of rank's process, once it has made its board."""
        if rank not in self._processes:
            raw = self._get("pid", rank)
            if raw is None:
                return None
            host, pid = raw.split("\t")
            self._processes[rank] = (host, int(pid))
        return self._processes[rank]

    def alive(self, rank: int) -> bool | None:
        """Whether rank's process is alive: None when it runs on another host (this rank cannot look)."""
        where = self.process(rank)
        if where is None or where[0] != self.host:
            return None
        return process_alive(where[1])


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its launcher, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# -- the errors a waiting rank raises ------------------------------------------------------------------


def failed(board: Board, culprit: int, fault: dict[str, Any], where: str) -> RankFailed:
    """A ``RankFailed`` for the fault of rank ``culprit`` seen while this rank was ``where``."""
    own = fault["by"] == culprit
    text = fault["text"]
    if culprit == board.rank:
        head = f"{text} (seen by rank {fault['by']})"
        tail = "The cause is on this rank: see what it was doing."
    elif own:
        head = f"rank {culprit} failed with {text}"
        tail = f"The cause is on rank {culprit}: its traceback is in its output."
    else:
        head = f"{text} (seen by rank {fault['by']})"
        tail = f"The cause is on rank {culprit}."
    return RankFailed(f"fzero.dist_mesh: {head.rstrip('.')}. This rank ({board.rank}) stopped {where}. {tail}",
                      rank=culprit, cause=text)


def first_fault(board: Board, faults: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """The fault to name: one a rank reported about itself (its own exception) before one seen by another rank."""
    own = [r for r, f in faults.items() if f["by"] == r]
    culprit = own[0] if own else min(faults)
    return culprit, faults[culprit]


def vanished(board: Board, gone: list[int], where: str, detail: str) -> RankFailed:
    """Ranks whose process ended without a word: recorded on the board (so that every rank names them) and raised."""
    culprit = gone[0]
    host, pid = board.process(culprit) or ("?", -1)
    if board.has("exited", culprit):  # its interpreter ended normally: it made fewer collective calls than this rank
        text = (f"rank {culprit} ended its program (its process exited without an error) while this rank still expected "
                f"it at a collective: every rank must make the same fzero calls (steps, Step.evaluate, Step.gather, "
                f"checkpoints) the same number of times")
    else:
        text = (f"rank {culprit} vanished: its process (pid {pid} on {host}) ended without reporting an error (killed by "
                f"a signal such as SIGKILL or the out-of-memory killer, or a crash in C++; see the launcher's output and dmesg). "
                f"Where that output shows gloo's \"Received data size doesn't match expected size\", the ranks issued "
                f"collectives of different sizes here and gloo aborted the rank: look for what differs per rank (a unit "
                f"skipped on some ranks, control flow that depends on the rank or its data, {GENERATE_HINT})")
    board.publish(culprit, text)
    others = f" (also gone: ranks {gone[1:]})" if len(gone) > 1 else ""
    return RankFailed(f"fzero.dist_mesh: {text}{others}. This rank ({board.rank}) stopped {where}. [{detail}]",
                      rank=culprit, cause=text)


def not_arrived(board: Board, call: Call, limit: str) -> tuple[int | None, str]:
    """(the rank that did not arrive at ``call`` within ``limit``, why): for the timeout error. Reads every rank's
    position."""
    positions = {r: board.waiting(r) for r in range(board.size) if r != board.rank}
    here = [board.rank] + [r for r, p in positions.items() if p is not None and p[0] == call.seq]
    elsewhere = {r: p for r, p in positions.items() if p is not None and p[0] != call.seq}
    missing = [r for r, p in positions.items() if p is None]
    took_part = "before any collective" if board.last is None else f"took part in {board.last}"
    if missing:
        culprit = missing[0]
        alive = board.alive(culprit)
        state = {True: "its process is alive", False: "its process is gone", None: "it runs on another host"}[alive]
        why = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not arrive at {call} within "
               f"{limit}. Rank {culprit} {took_part} and is not waiting at any collective "
               f"({state}): it is stuck or much slower in its own code since (loss_fn, the data loader, I/O, a lock). "
               f"Ranks waiting at #{call.seq}: {here}")
    elif elsewhere:
        culprit = min(elsewhere)
        why = (f"rank {culprit} waits at collective #{elsewhere[culprit][0]} ({elsewhere[culprit][1]}) while rank "
               f"{board.rank} waits at {call}: the ranks issued different collectives")
    else:
        culprit = None
        why = f"every rank waits at {call} and it did not complete within {limit}"
    return culprit, why


def disagree_text(board: Board, call: Call, other: int, theirs: tuple[int, str]) -> str:
    return (f"fzero.dist_mesh: ranks disagree at collective #{call.seq}: rank {board.rank} {call.what}, rank {other} "
            f"{theirs[1]} (in {call.phase} on rank {board.rank}). Every rank must run the same model with the same units "
            f"and issue the same collectives in the same order: look for what differs per rank (a model or settings "
            f"built differently, a unit skipped on some ranks, control flow that depends on the rank or its data, a "
            f"call such as Step.gather or Step.evaluate made on some ranks only, {GENERATE_HINT}).")


# model.generate at stage 3: each new token runs every unit, so ranks that stop at different lengths issue different
# collectives (DeepSpeed ZeRO-3 has the same rule, and Hugging Face's synced_gpus=True for it)
GENERATE_HINT = ("a model.generate that stops at another length on each rank: pass synced_gpus=True, as under DeepSpeed "
                 "ZeRO-3, or min_new_tokens=max_new_tokens")


def wait_for(predicate, *, seconds: float, every: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``seconds`` pass; whether it held."""
    deadline = time.monotonic() + seconds
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
