"""The collectives protocol: what every comm offers, the counter, and the errors of disagreeing ranks.

Every collective fzero issues goes through a comm, the object a mesh hands each rank's program. Its methods
take flat tensors, and all reductions are sums (averaging is done by the caller, so that every stage divides
the same sums by the same N and stays bitwise comparable):

- ``all_gather(out, shard, *, tag, label=None)``: fill ``out`` (N·len(shard) elements) with every rank's
  shard, in rank order; ``shard`` may be a view of ``out``. ``all_gather_async`` (same arguments) starts it
  and returns a ``Pending`` whose ``wait()`` gives ``out`` once filled; ranks must issue in the same order.
- ``reduce_scatter(full, *, tag, label=None, out=None)``: this rank's 1/N slice of the sum over ranks of ``full``
  (``full`` itself when N = 1), written into ``out`` when given (a buffer a step reuses, ``fzero.step._pool``).
  ``reduce_scatter_async`` starts it and returns a ``Pending`` (``full`` must not change until it is waited for).
- ``all_reduce(tensor, *, tag, label=None)``: sum ``tensor`` over ranks, in place; returns it (``all_reduce_async``:
  started, a ``Pending``).
- ``broadcast(tensor, *, src, tag, label=None)``: overwrite ``tensor`` with rank ``src``'s, in place.
- ``agree(fields, *, api, fix)``: raise ``RanksDisagree`` naming the first field (in rank 0's order) whose
  value differs on some rank. ``fields`` are small picklable (name, value) pairs describing what every rank
  must share. Not a counted collective: it moves a description, not training data.

``Comm`` is this protocol as a type; ``CommWrapper`` is the base of a comm around another, which
``fzero.wrap_comm(mesh, wrapper)`` puts around every comm a mesh makes.

``tag`` is the kind of traffic ("params", "grads", "metrics", "init"), for the counter; ``label`` is what
exactly is moved (e.g. a unit's name). Two implementations: ``ThreadComm`` (``fzero.mesh._thread_comm``) runs
the ranks of a ``local_mesh`` as threads that meet at a barrier and reduce over shared buffers in rank order
0, 1, ..., N-1 (deterministic); ``DistComm`` (``fzero.mesh._dist_comm``) calls ``torch.distributed``. Both
are importable from this module too.

Every call is reported to the mesh's ``Counter`` (when it has one) with the number of elements each
rank moves on a ring: all-gather and reduce-scatter move T·(N-1)/N of a T-element buffer, all-reduce
twice that. Tests assert communication volume from it.

Ranks must agree, or the mesh says so. On the thread mesh every collective is matched across ranks by op,
tag, label, size and dtype (and ``src`` for a broadcast), and when a rank's program ends it meets the others
once more: a mismatch, or one rank finishing while another still communicates, raises ``RanksDisagree`` on
every rank, naming what each rank called, instead of silently pairing unrelated buffers of the same size (a
rank-dependent model, LayerDrop decided per rank) or hanging until the timeout. On ``torch.distributed``
a per-call check would cost a round trip per collective; there ``Step.init`` checks once, with
``agree``, that every rank runs the same layout and settings.
"""

from __future__ import annotations

import contextlib
import typing
import dataclasses
import functools
import importlib
import threading
from collections import Counter as _Tally
from typing import Any, Callable

import torch


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective as one rank saw it."""

    rank: int
    op: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    tag: str  # what it carried: "grads", "params", "metrics", "init"
    numel: int  # elements of the whole (unsharded) buffer
    itemsize: int
    world_size: int
    label: str | None = None  # what the call moves, e.g. a unit's name (None: unlabelled)

    @property
    def ring_elements(self) -> float:
        """Elements this rank sends (= receives) on a ring for this call."""
        n = self.world_size
        factor = 2 if self.op == "all_reduce" else 1
        return factor * self.numel * (n - 1) / n


class Counter:
    """Records every collective of a mesh. Thread-safe; ``calls`` in the order they were made."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()

    def elements(self, *, rank: int = 0, tag: str | None = None, op: str | None = None) -> float:
        """Ring elements moved by ``rank``, optionally only for one tag or op."""
        return sum(c.ring_elements for c in self._select(rank, tag, op))

    def count(self, *, rank: int = 0, tag: str | None = None, op: str | None = None) -> int:
        return len(self._select(rank, tag, op))

    def summary(self, *, rank: int = 0) -> dict[tuple[str, str], int]:
        """Number of calls per (op, tag) for ``rank``."""
        return dict(_Tally((c.op, c.tag) for c in self._select(rank, None, None)))

    def _select(self, rank, tag, op):
        with self._lock:
            return [c for c in self.calls if c.rank == rank and (tag is None or c.tag == tag) and (op is None or c.op == op)]


class Pending:
    """An issued collective: ``wait()`` returns its output."""

    def __init__(self, wait: Callable[[], torch.Tensor]) -> None:
        self._wait = wait
        self._out: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._wait()
        return self._out


def pooled_reduce_scatter(comm: Any, full: torch.Tensor, *, pool: Any, tag: str, label: str | None = None) -> Pending:
    """Start the reduce-scatter of ``full`` into a buffer of ``pool`` (a step's buffer pool: ``take``/``give``, or
    None for fresh memory); when it is waited for, ``full`` (if the pool lent it) goes back to the pool. The result is
    the caller's to give back when its use is over."""
    n = full.numel() // comm.size

    def start() -> Pending:
        out = None
        if comm.size > 1:
            out = torch.empty(n, dtype=full.dtype, device=full.device) if pool is None else pool.take(n, dtype=full.dtype, device=full.device)
        return comm.reduce_scatter_async(full, tag=tag, label=label, out=out)

    # a comm whose collectives run when waited for (the threads of a local mesh) gets its buffer then, not before
    pending = None if getattr(comm, "runs_when_waited", False) else start()

    def done() -> torch.Tensor:
        shard = (pending or start()).wait()
        if shard is not full and pool is not None:  # one rank: the shard is ``full`` itself, still in use
            pool.give(full)
        return shard

    return Pending(done)


def profiled(name: Callable[[], str]) -> Any:
    """``torch.profiler.record_function(name())`` while a profiler (torch.profiler, emit_nvtx) records, else
    nothing: a range costs about 6 us to open, paid per collective and per unit on the step's hot path, and the
    check 0.04 us."""
    return torch.profiler.record_function(name()) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


def ranged(method: Callable) -> Callable:
    """A collective in a profiler range named ``fzero.<op>:<tag>[:<unit>]`` (``profiled``), so a trace shows each
    collective, what it moves and for which unit."""
    op = method.__name__.removesuffix("_async")  # started or waited for, the range names the collective

    @functools.wraps(method)
    def inner(self, *args: Any, tag: str, label: str | None = None, **kwargs: Any) -> Any:
        with profiled(lambda: f"fzero.{op}:{tag}" if label is None else f"fzero.{op}:{tag}:{label}"):
            return method(self, *args, tag=tag, label=label, **kwargs)

    return inner


@typing.runtime_checkable
class Comm(typing.Protocol):
    """What a rank's program calls for every collective (the module docstring says what each one does). A mesh makes
    one per rank and call (``ThreadComm``, ``DistComm``); ``fzero.wrap_comm(mesh, wrapper)`` puts a wrapper around
    each, the seam where a transform of the traffic (compression, quantised gathers, a tracer) plugs in."""

    rank: int
    size: int

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, tag: str, label: str | None = None) -> torch.Tensor: ...
    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, *, tag: str, label: str | None = None) -> Pending: ...
    def reduce_scatter(self, full: torch.Tensor, *, tag: str, label: str | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor: ...
    def reduce_scatter_async(self, full: torch.Tensor, *, tag: str, label: str | None = None,
                             out: torch.Tensor | None = None) -> Pending: ...
    def all_reduce(self, tensor: torch.Tensor, *, tag: str, label: str | None = None) -> torch.Tensor: ...
    def all_reduce_async(self, tensor: torch.Tensor, *, tag: str, label: str | None = None) -> Pending: ...
    def broadcast(self, tensor: torch.Tensor, *, src: int, tag: str, label: str | None = None) -> torch.Tensor: ...
    def agree(self, fields: list[tuple[str, Any]], *, api: str, fix: str) -> None: ...


class CommWrapper:
    """A ``Comm`` around another: every attribute and collective is the inner comm's unless a subclass overrides it
    (``inner`` is the wrapped comm). The base of what ``fzero.wrap_comm`` puts around a mesh's comms.

    A subclass that changes what a collective returns overrides both forms of it (``reduce_scatter`` and
    ``reduce_scatter_async``, ...): the step calls either, depending on the stage and on what overlaps."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # only for what this class and its subclass do not define
        return getattr(self.inner, name)

    @staticmethod
    def then(pending: "Pending", fn: Callable[[torch.Tensor], torch.Tensor]) -> "Pending":
        """A started collective whose result passes through ``fn`` when it is waited for (for the ``*_async`` forms)."""
        return Pending(lambda: fn(pending.wait()))


class Recording:
    """Mixin: report each call to the counter before doing it."""

    counter: Counter | None
    # Whether an all-gather on a one-rank mesh is a ``copy_`` of the shard into the output, which converts dtypes
    # (the thread mesh's); a process group's collective needs both in one dtype.
    gather_casts_at_one_rank = False

    def _note(self, op: str, tag: str, numel: int, tensor: torch.Tensor, label: str | None = None) -> None:
        if self.counter is not None:
            self.counter.record(Call(self.rank, op, tag, numel, tensor.element_size(), self.size, label))


# -- ranks that disagree ----------------------------------------------------------------------------


class RanksDisagree(RuntimeError):
    """Ranks of one mesh issued different collectives, or hold different layouts or settings."""


class MeshTimeout(RuntimeError):
    """A rank waited longer than the mesh's timeout at a collective: the ranks disagree on what to call."""


def first_difference(described: list[list[tuple[str, Any]]]) -> tuple[str, int, Any, Any] | None:
    """(field, rank, rank 0's value, that rank's value) of the first field, in rank 0's order, that some rank
    has differently or lacks; a field only another rank has comes after. None when every rank agrees."""
    if all(d == described[0] for d in described[1:]):
        return None
    mine = dict(described[0])
    names = [k for k, _ in described[0]] + [k for d in described[1:] for k, _ in d if k not in mine]
    missing = "(nothing: no such field)"
    for name in dict.fromkeys(names):
        for r, d in enumerate(described[1:], start=1):
            theirs = dict(d)
            if mine.get(name, missing) != theirs.get(name, missing):
                return name, r, mine.get(name, missing), theirs.get(name, missing)
    return None


def disagreement(described: list[list[tuple[str, Any]]], *, api: str, fix: str) -> RanksDisagree | None:
    diff = first_difference(described)
    if diff is None:
        return None
    field, r, v0, vr = diff
    return RanksDisagree(f"{api}: ranks disagree on {field}: rank 0 has {v0}, rank {r} has {vr}. {fix}")


# -- the implementations, importable from here as well ---------------------------------------------------

_IMPLEMENTATIONS = {"Rendezvous": "fzero.mesh._thread_comm", "ThreadComm": "fzero.mesh._thread_comm", "DistComm": "fzero.mesh._dist_comm"}


def __getattr__(name: str) -> Any:
    # Imported on first use: the implementations import this module, so it cannot import them up front.
    if name in _IMPLEMENTATIONS:
        return getattr(importlib.import_module(_IMPLEMENTATIONS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
