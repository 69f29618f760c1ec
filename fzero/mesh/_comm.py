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

Collectives as autograd Functions that work under ``torch.func`` (``AllGather``, ``ReduceScatter``,
``ReplicatedShardGrad``, at the end of this module): ``torch.func.grad`` rejects a ``torch.distributed`` call
made inside a Function's ``backward`` ("mutate a captured Tensor") and silently zeroes the gradient of a raw
collective in a forward. The pattern that works: each collective runs in the *forward* of its own new-style
Function, and the Functions name each other as their backward: all-gather <-> reduce-scatter. Each takes the
counter tag of its own collective and of its backward's ("params" forward, "grads" backward).

## Buffer events (``events``)

Where fzero reports the parameter buffers it gathers, frees and refills, to whatever measures memory.

The core calls ``gathered(buffer)`` when it allocates a buffer to gather a unit into, ``resized(buffer)``
when stage 3 frees a buffer's storage between a unit's forward and its backward or gives it back its
memory, and ``lent(buffer)`` / ``returned(buffer)`` when a step's pool (``fzero.step._pool``) lends a buffer it
already held (no allocation a dispatch mode would see) or gets one back. Nothing in the core knows who listens: a measuring tool (``fzero.memory.GatheredBytes`` and
``LiveBytes``) enters ``watching(observer)`` in the thread it measures (on a ``local_mesh``, through the
mesh's ``rank_context``) and gets ``observer.on_gathered(buffer)`` and ``observer.on_resized(buffer)``.
With no observer, both calls cost one attribute lookup.

## ``Function``

``Function``: ``torch.autograd.Function`` whose ``apply`` does not re-read its forward's signature each call.

torch's ``Function.apply``, for a Function with a ``setup_context`` (the form ``torch.func`` needs), binds the call's
arguments with ``inspect.signature(cls.forward).bind(...)`` and ``apply_defaults()`` on every call, to fill in the
forward's default arguments: tens of microseconds of Python per call. fzero applies several Functions per unit per
step (gather, refill, reduce, the recording of which params got a gradient), and on one GPU that host time showed
up as idle GPU time between a step's kernels.

A subclass of this one keeps a signature on its forward (``__signature__``, which ``inspect.signature`` returns as
it is), made once with the class. Its ``bind`` answers at once when the call needs no binding (no keyword
arguments, and every positional parameter given, so no default to fill in) and binds as ``inspect`` does otherwise,
so ``apply`` gets the same arguments either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
import types
import typing
from collections import Counter as _Tally
from typing import Any, Callable, Iterator

import torch

from fzero.mesh._rank import borrowed, current_context, needs_context, with_context


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Bound:
    """What torch reads of a ``BoundArguments``: ``apply_defaults()``, ``args`` and (torch 2.13) ``kwargs``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple) -> None:
        self.args = args
        self.kwargs: dict = {}  # no keyword-only parameter (``_Signature``): nothing to put here

    def apply_defaults(self) -> None:  # every positional parameter was given: no default to apply
        pass


class _Signature(inspect.Signature):
    __slots__ = ("_positional", "_varargs", "_fast")

    def __init__(self, sig: inspect.Signature) -> None:
        super().__init__(list(sig.parameters.values()), return_annotation=sig.return_annotation)
        kinds = [p.kind for p in sig.parameters.values()]
        self._positional = sum(k in _POSITIONAL for k in kinds)
        self._varargs = inspect.Parameter.VAR_POSITIONAL in kinds
        # a keyword-only parameter would get its default in BoundArguments.kwargs: such a forward always binds
        self._fast = not any(k in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) for k in kinds)

    def bind(self, *args, **kwargs):
        if self._fast and not kwargs and (len(args) == self._positional or (self._varargs and len(args) >= self._positional)):
            return _Bound(args)
        return super().bind(*args, **kwargs)


class Function(torch.autograd.Function):
    """fzero's autograd Functions: the forward's signature made once (torch's ``apply`` otherwise rebuilds it with
    ``inspect`` on every call), and the backward run in the rank context the forward ran in where its thread has
    none (``fzero.mesh._rank.borrowed``: autograd's device thread, in a backward no step noted)."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        func = getattr(forward, "__func__", forward)  # a staticmethod's function
        if func is not None and not hasattr(func, "__signature__"):
            func.__signature__ = _Signature(inspect.signature(func))
        setup, backward = cls.__dict__.get("setup_context"), cls.__dict__.get("backward")
        if isinstance(setup, staticmethod) and isinstance(backward, staticmethod):
            setattr(cls, "setup_context", staticmethod(_noting_context(setup.__func__)))
            setattr(cls, "backward", staticmethod(_in_forward_context(backward.__func__)))


def _noting_context(setup: Any) -> Any:
    def setup_context(ctx: Any, inputs: Any, output: Any) -> Any:
        ctx.rank_context = current_context()
        return setup(ctx, inputs, output)

    return functools.wraps(setup)(setup_context)


def _in_forward_context(backward: Any) -> Any:
    def in_context(ctx: Any, *grads: Any) -> Any:
        if not needs_context():  # (the common case, without a context manager's cost)
            return backward(ctx, *grads)
        with borrowed(getattr(ctx, "rank_context", None)):
            return backward(ctx, *grads)

    return functools.wraps(backward)(in_context)


@contextlib.contextmanager
def watching(observer: Any) -> Iterator[Any]:
    """Send this thread's buffer events to ``observer`` (which has ``on_gathered`` and ``on_resized``) inside the block."""
    with with_context(observers=(*current_context().observers, observer)):
        yield observer


def gathered(buffer: torch.Tensor) -> torch.Tensor:
    """Report a freshly allocated buffer that a unit is gathered into; returns it."""
    for observer in current_context().observers:
        observer.on_gathered(buffer)
    return buffer


def lent(buffer: torch.Tensor) -> None:
    """Report a buffer a pool lends again: in use from now on, as a new allocation would be."""
    for observer in current_context().observers:
        getattr(observer, "on_lent", _ignore)(buffer)


def returned(buffer: torch.Tensor) -> None:
    """Report a buffer given back to a pool: no longer in use, as if freed."""
    for observer in current_context().observers:
        getattr(observer, "on_returned", _ignore)(buffer)


def _ignore(buffer: torch.Tensor) -> None:
    pass


def resized(buffer: torch.Tensor) -> None:
    """Report that a gathered buffer's storage was freed (``resize_(0)``) or given its memory back."""
    for observer in current_context().observers:
        observer.on_resized(buffer)


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


def _take(pool: Any, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer lent by ``pool`` (a step's buffer pool: ``take``/``give``), or a new one without a pool."""
    return torch.empty(numel, dtype=dtype, device=device) if pool is None else pool.take(numel, dtype=dtype, device=device)


def _give(pool: Any, buffer: torch.Tensor | None) -> None:
    if pool is not None and buffer is not None:
        pool.give(buffer)


# -- bucketing: several units in one collective -----------------------------------------------------------------------


def bucketed_reduce_scatter(comm: Any, grads: list[torch.Tensor], *, pool: Any, label: str) -> Pending:
    """Start one reduce-scatter of several units' flat gradients (each a multiple of ``comm.size`` long), laid out rank
    chunk by rank chunk (every unit's chunk r together, for r = 0 .. n-1), so that the reduced chunk of rank r is rank
    r's shard of every unit, side by side; ``grads`` (lent by ``pool``) go back to it once packed. One gradient is
    reduce-scattered as it is. Waited for, the ``Pending`` gives the concatenated shards (the caller's to give back)."""
    n = comm.size
    if len(grads) == 1:
        return pooled_reduce_scatter(comm, grads[0], pool=pool, tag="grads", label=label)
    full = _take(pool, sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
    at = 0
    for r in range(n):
        for g in grads:
            c = g.numel() // n
            full[at:at + c].copy_(g[r * c:(r + 1) * c])
            at += c
    for g in grads:
        _give(pool, g)
    return pooled_reduce_scatter(comm, full, pool=pool, tag="grads", label=label)


class GatherBucket:
    """One all-gather of several units' shards (``bucket_elements``): each rank's shards side by side, so the gathered
    chunk of rank r holds rank r's shard of every unit. Waited for once; ``fill`` then puts one unit together in its
    own buffer (the values its own all-gather would give), and the bucket's buffers go back to the pool after the
    last unit is filled."""

    def __init__(self, comm: Any, shards: list[torch.Tensor], *, pool: Any, label: str,
                 mark: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        sizes = [s.numel() for s in shards]
        dtype, device = shards[0].dtype, shards[0].device
        mine = _take(pool, sum(sizes), dtype=dtype, device=device)
        torch.cat(shards, out=mine)
        # ``mark``: how the caller accounts for gathered memory (stage 3 reports it to fzero.memory.GatheredBytes)
        out = mark(_take(pool, comm.size * sum(sizes), dtype=dtype, device=device))
        self.mine: torch.Tensor | None = mine  # this rank's shards side by side, until the gather is done
        self.out: torch.Tensor | None = out  # every rank's, until the last unit is filled from it
        self.handle: Pending | None = comm.all_gather_async(out, mine, tag="params", label=label)
        self.sizes, self.ranks, self.pool = sizes, comm.size, pool
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]  # where each unit's shard lies in a rank's chunk
        self.left = len(sizes)

    def fill(self, at: int, dest: torch.Tensor) -> torch.Tensor:
        """``dest`` (a unit's whole buffer) from the bucket: the unit's shard lies at ``at`` in every rank's chunk."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
            _give(self.pool, self.mine)
            self.mine = None
        chunk, size = sum(self.sizes), dest.numel() // self.ranks
        if self.out is None:
            raise RuntimeError("fzero internal error: a GatherBucket was asked for more units than it holds.")
        with torch.no_grad():
            dest.view(self.ranks, size).copy_(self.out.view(self.ranks, chunk)[:, at:at + size])
        self.left -= 1
        if not self.left:
            _give(self.pool, self.out)
            self.out = None
        return dest


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
    rank: int
    size: int
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


class ReduceScatter(Function):
    """Forward: this rank's shard of the sum over ranks. Backward: all-gather of the shard gradient.
    ``pool`` (plain autograd, a step's ``fzero.step._pool``): the shard is made in one of its buffers, and ``full``
    goes back to it."""

    @staticmethod
    def forward(full, comm, tag, back_tag, pool=None):
        if pool is not None:
            out = pooled_reduce_scatter(comm, full.contiguous(), pool=pool, tag=tag).wait()
        else:
            out = comm.reduce_scatter(full.contiguous(), tag=tag)
        # One rank returns ``full`` itself; a Function must not hand back its input unaliased.
        return out.view_as(out) if out is full else out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.tag, ctx.back_tag = inputs[1:4]

    @staticmethod
    def backward(ctx, grad_shard):
        return AllGather.apply(grad_shard, ctx.comm, ctx.back_tag, ctx.tag), None, None, None, None


class AllGather(Function):
    """Forward: every rank's shard, concatenated. Backward: reduce-scatter of the full gradient (summed in
    ``reduce_dtype`` when given; autograd casts the result back to the shard's dtype). ``pool`` (plain autograd):
    the gathered buffer and the reduced shard are a step's buffers (``fzero.step._pool``). ``values``: what this rank
    sends in place of ``shard``'s own values (stage 3 casting the root unit's master: ``shard``'s memory is freed)."""

    @staticmethod
    def forward(shard, comm, tag, back_tag, reduce_dtype=None, pool=None, values=None):
        sent = shard if values is None else values
        n = shard.numel() * comm.size
        out = torch.empty(n, dtype=shard.dtype, device=shard.device) if pool is None else pool.take(n, dtype=shard.dtype, device=shard.device)
        return comm.all_gather(gathered(out), sent.contiguous(), tag=tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.tag, ctx.back_tag = inputs[1:4]
        ctx.reduce_dtype = inputs[4] if len(inputs) > 4 else None
        ctx.pool = inputs[5] if len(inputs) > 5 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(_as(grad_full, ctx.reduce_dtype), ctx.comm, ctx.back_tag, ctx.tag, ctx.pool), None, None, None, None, None, None


class ReplicatedShardGrad(Function):
    """ZeRO-2's gradient path: forward returns the unit's whole (replicated) buffer unchanged; the
    gradient with respect to this rank's *shard* is the reduce-scattered unit gradient.

    Autograd calls the backward once per unit, as soon as every use of the unit in the graph has
    contributed, so the whole gradient of a unit lives only until its reduce-scatter: at most one
    unit's full gradient at a time, plus the shards (ZeRO-2's 2Ψ + (2+K)Ψ/N).

    Under plain autograd a ``sink`` (``fzero.zero._stages.ShardGradView``) may take the reduction instead:
    the backward hands it the unit's gradient (``sink.ready(name, grad, shard)``), which starts its reduce-scatter
    (alone, or in a bucket with the next units) and returns no gradient, so the next unit's backward runs while
    it is in flight. (A collective started in a
    backward is what ``torch.func`` refuses, so under it the reduction stays a Function of its own, as above.)
    """

    @staticmethod
    def forward(shard, full, comm, reduce_dtype=None, sink=None, name=None):
        return full.view_as(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[2]
        ctx.reduce_dtype = inputs[3] if len(inputs) > 3 else None
        ctx.sink, ctx.name = inputs[4:6] if len(inputs) > 4 else (None, None)
        ctx.shard = inputs[0].detach()  # where and in which dtype its gradient goes (a view: no memory)

    @staticmethod
    def backward(ctx, grad_full):
        if ctx.sink is not None:
            ctx.sink.ready(ctx.name, _as(grad_full, ctx.reduce_dtype).contiguous(), ctx.shard)
            return None, None, None, None, None, None
        return ReduceScatter.apply(_as(grad_full, ctx.reduce_dtype), ctx.comm, "grads", "params"), None, None, None, None, None


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


events = types.SimpleNamespace(watching=watching, gathered=gathered, lent=lent, returned=returned, resized=resized)
"""The buffer events by name (``fzero.mesh.events.resized(buffer)``): see "Buffer events" above."""
