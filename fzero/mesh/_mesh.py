"""Meshes: where the ranks of one SPMD program live.

- ``local_mesh(n)``: n ranks simulated in this process, one thread per rank. For
  notebooks and unit tests: deterministic, no subprocesses. ``step(state, batch)`` takes the *global*
  batch and splits dim 0 across ranks. The ranks are isolated as processes are: each has its own RNG
  streams, which go on from one call to the next as a process's do, on every ``local_mesh`` of that size in the
  process (two ``local_mesh(2)`` stand for the same two processes; ``fzero.mesh._rank``), and every
  collective is matched across ranks (``fzero.mesh._thread_comm``), so a simulated mesh equals n ``torchrun``
  processes running the same seeded program, bit for bit, or says where the ranks went apart.
- ``dist_mesh()``: this process is one rank of a ``torch.distributed`` job started by ``torchrun``
  (gloo for CPU tensors, NCCL for CUDA ones). Each process passes its own batch.
- no mesh (``None``): one rank.

A mesh is a frozen value. ``count_collectives(mesh)`` returns the same mesh with a fresh ``Counter``
that every collective run on it reports to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
from typing import Any, Callable, ContextManager, Sequence

import torch

from fzero.mesh._comm import Counter, MeshTimeout, RanksDisagree
from fzero.mesh._thread_comm import Rendezvous, ThreadComm
from fzero.mesh._rank import Carry, carry_of, own_stream, rank_streams

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class LocalMesh:
    size: int
    timeout: float = 120.0
    counter: Counter | None = dataclasses.field(default=None, compare=False)
    # Entered around each rank's program in its own thread: per-rank profilers and memory counters.
    rank_context: Callable[[int], ContextManager[Any]] | None = dataclasses.field(default=None, compare=False)
    wrap: Callable[[Any], Any] | None = dataclasses.field(default=None, compare=False)  # see wrap_comm

    @property
    def carry(self) -> Carry:
        """Each rank's RNG streams from one run to the next, as a torchrun rank's generators go on: one for every local
        mesh of this size in the process, not this mesh's own (``fzero.mesh._rank.Carry`` says why)."""
        return carry_of(self.size)

    def run(self, fn: Callable[..., Any], args: Sequence[tuple]) -> list[Any]:
        """Run ``fn(comm, *args[r])`` for every rank r in its own thread; results in rank order.

        Each rank thread draws random numbers from its own stream, which starts as a copy of the global
        CPU generator, or where that rank's stream ended in the last run of a mesh of this size (this one or another:
        they stand for the same processes) when nothing has drawn from the global generator since
        (``fzero.mesh._rank.Carry``); afterwards the global generator holds rank 0's final state,
        as if this process were rank 0 of a torchrun job (``fzero.mesh._rank``). A single rank runs in the caller's thread on the
        global generator itself, as plain PyTorch does.

        If a rank raises, the others are released from the barrier and the first real error is re-raised
        here, with the rank that raised it noted, so a failure never turns into a hang. A rank that
        finishes meets the others once more, so a rank left waiting at a collective fails at once with
        both ranks' calls named (``RanksDisagree``) rather than after the timeout.

        The caller's thread-local settings a rank's program would have in a torchrun process, whose script
        runs the step where it called it, are the rank threads' too: the ``torch.autocast`` in effect
        (``_caller_autocast``; without it ``local_mesh(2)`` trained in fp32 under the autocast that one rank
        and torchrun honour). A Ctrl-C (or any exception) in the caller while it waits for the ranks stops
        them at their next collective and waits for them before it is raised: rank threads left running
        would go on with the state the caller may pass to its next step, and update it in place under that
        step's result (measured: 0.01 off, one lr, with both steps' results returned as if fine).
        """
        rv = Rendezvous(self.size, self.timeout)
        if self.size == 1:  # no thread to start: one rank meets nobody
            with self._context(0):
                return [fn(_wrapped(self.wrap, ThreadComm(0, rv, self.counter)), *args[0])]
        _refuse_callers_dispatch_modes(self.size)
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        device = _current_cuda_device()
        autocast = _caller_autocast()

        ended = [threading.Event() for _ in range(self.size)]  # set by each rank thread as its very last act

        def body(rank: int, stream) -> None:
            try:
                _rank_body(rank, stream)
            finally:
                ended[rank].set()

        def _rank_body(rank: int, stream) -> None:
            try:
                if device is not None:  # the current CUDA device is per thread: the ranks run on the caller's
                    torch.cuda.set_device(device)
                # Each rank's backward on its own thread. Otherwise autograd runs the backward of CUDA tensors on
                # its one worker thread per device, shared by every rank thread: a rank's collective inside its
                # backward (a stage-3 refill) blocks that thread, and the other ranks' backwards, which must reach
                # the same collective, wait behind it forever (seen on an H100: a 120 s MeshTimeout every step).
                # autocast(): the caller's torch.autocast (thread-local), as the caller's own thread would run under it
                with self._context(rank), own_stream(stream), torch.autograd.set_multithreading_enabled(False), autocast():
                    comm = _wrapped(self.wrap, ThreadComm(rank, rv, self.counter))
                    results[rank] = fn(comm, *args[rank])
                    comm.finish()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
                errors[rank] = e
                # Every rank sees the same disagreement and raises it by itself; breaking the barrier
                # would turn a rank that was released but not yet awake into a secondary MeshTimeout.
                if not isinstance(e, RanksDisagree):
                    rv.abort()

        with rank_streams(self.size, self.carry) as streams:
            threads = [threading.Thread(target=body, args=(r, streams[r]), name=f"fzero-rank{r}", daemon=True)
                       for r in range(self.size)]
            for t in threads:
                t.start()
            try:
                for t in threads:
                    t.join()
            except BaseException:  # Ctrl-C in the caller: no rank may go on with the state once the caller has it back
                rv.abort()  # each rank stops at its next collective (one in its update finishes it, and spends the state)
                _wait_all(ended)
                for t in threads:  # each is past its last act: only the thread's own exit is left
                    t.join(timeout=5.0)
                raise
        first = next((e for e in errors if e is not None and not _is_secondary(e)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            rank = errors.index(first)
            first.add_note(f"(raised on rank {rank} of fzero.local_mesh({self.size}))")
            # each error's traceback holds its rank's frames, whose closure holds this list: a cycle that kept the ranks'
            # frames (torch.func's wrapped tensors among their locals) for the garbage collector, and one left to the
            # interpreter's exit aborted the process there ("terminate called without an active exception")
            errors.clear()
            try:
                raise first
            finally:
                first = None  # (this frame, in the traceback, would hold the error too)
        return results

    def _context(self, rank: int) -> ContextManager[Any]:
        return self.rank_context(rank) if self.rank_context is not None else contextlib.nullcontext()


def _wait_all(ended: Sequence[threading.Event]) -> None:
    """Wait until every rank thread has ended (its event set), through further Ctrl-Cs (re-raised once they have): the
    ranks were told to stop and do at their next collective. Events, not ``Thread.join``: a join that a
    KeyboardInterrupt broke may leave ``is_alive()`` false for a thread that still runs (CPython 3.11's
    ``_wait_for_tstate_lock`` marks it stopped), which let a rank run on with the state (measured: 1 in 2 runs)."""
    interrupted: BaseException | None = None
    for e in ended:
        while not e.is_set():
            try:
                e.wait()
            except BaseException as x:  # noqa: BLE001 - a second Ctrl-C: keep waiting, raise it after
                interrupted = x
    if interrupted is not None:
        raise interrupted


def _caller_autocast() -> Callable[[], ContextManager[Any]]:
    """The caller thread's ``torch.autocast`` state (thread-local in torch), as a context to enter in a rank thread."""
    on = [(t, torch.get_autocast_dtype(t)) for t in ("cpu", "cuda") if torch.is_autocast_enabled(t)]
    if not on:
        return contextlib.nullcontext
    cache = torch.is_autocast_cache_enabled()

    def enter() -> ContextManager[Any]:
        stack = contextlib.ExitStack()
        for device_type, dtype in on:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        return stack

    return enter


def _current_cuda_device() -> int | None:
    """The caller's current CUDA device, if CUDA is in use in this process (never initialises CUDA)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def _is_secondary(e: BaseException) -> bool:
    """A rank released from the barrier because another rank failed: not the root cause."""
    return isinstance(e, MeshTimeout)


@dataclasses.dataclass(frozen=True)
class DistMesh:
    size: int
    rank: int
    backend: str
    counter: Counter | None = dataclasses.field(default=None, compare=False)
    timeout: float = 300.0  # seconds a rank waits at a collective for the others (see dist_mesh)
    collectives: str = "auto"  # how gloo collectives run: see dist_mesh
    wrap: Callable[[Any], Any] | None = dataclasses.field(default=None, compare=False)  # see wrap_comm

    @property
    def device(self) -> torch.device:
        """Where a rank that passes only meta params to ``Step.init`` keeps its state: this process's CUDA
        device when NCCL serves CUDA tensors here, else the CPU."""
        if "nccl" in self.backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def comm(self, *, api: str):
        """This rank's comm for one call of ``api`` (the step, its init, evaluate or gather, a checkpoint writer), whose
        collectives it numbers and describes, under that name, for the errors of a failed job (``fzero.mesh._faults``)."""
        import torch.distributed as dist

        from fzero.mesh._dist_comm import DistComm

        board = fault_board(self.timeout)
        if board is not None:
            board.enter(api)
        comm = DistComm(self.rank, self.size, dist.group.WORLD, self.counter, board, collectives=self.collectives)
        comm.begin()
        return _wrapped(self.wrap, comm)


def fault_board(timeout: float) -> Any:
    """This process's fault board for the default process group (made, with its process hooks, on first use);
    None where torch.distributed has no default store to keep it on."""
    import torch.distributed as dist

    from fzero.mesh import _hooks
    from fzero.mesh._faults import Board

    board = _hooks.current()
    world = dist.group.WORLD
    if board is None or board.group is not world:
        get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
        if get_store is None:
            return None
        board = Board(get_store(), rank=dist.get_rank(), size=dist.get_world_size(), timeout=timeout, group=world)
        _hooks.install(board)
    board.timeout = timeout
    return board


Mesh = LocalMesh | DistMesh


def _refuse_callers_dispatch_modes(n: int) -> None:
    """Refuse a ``TorchDispatchMode`` of the caller's (``torch.utils.flop_counter.FlopCounterMode`` around a step, for
    MFU) when the ranks run in threads of their own: dispatch modes are per thread, so no rank's op reaches it, and a
    FlopCounterMode counted 0 flops, silently. fzero's own (``fzero.memory.LiveBytes``) say they count their thread."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    foreign = [m for m in _get_current_dispatch_mode_stack() if not type(m).__module__.startswith("fzero.")]
    if foreign:
        kind = f"{type(foreign[-1]).__module__}.{type(foreign[-1]).__qualname__}"
        if kind == "torch.utils.flop_counter._FlopCounterMode":  # what a FlopCounterMode pushes
            kind = "torch.utils.flop_counter.FlopCounterMode"
        raise RuntimeError(
            f"fzero.local_mesh({n}): a TorchDispatchMode ({kind}) is active in the calling thread, but each of the {n} "
            f"ranks runs in a thread of its own and dispatch modes are per thread: no rank's op would reach it (a "
            f"FlopCounterMode counts 0 flops). Enter one per rank, as each torchrun process has its own: "
            f"mesh = dataclasses.replace(fzero.local_mesh({n}), rank_context=lambda r: modes.setdefault(r, {kind.rsplit('.', 1)[-1]}(...))), "
            f"each then sees its rank's share; or run with mesh=None (or local_mesh(1)), in the calling thread.")


def local_mesh(n: int, *, timeout: float = 120.0) -> LocalMesh:
    """n ranks simulated in this process, one thread each, reductions in a fixed rank order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"fzero.local_mesh: n must be an int >= 1 (the number of simulated ranks), got {n!r}.")
    if not timeout > 0:
        raise ValueError(f"fzero.local_mesh: timeout must be > 0 seconds, got {timeout!r}.")
    return LocalMesh(n, float(timeout))


COLLECTIVES = ("auto", "native", "p2p")  # dist_mesh(collectives=...)


def dist_mesh(*, backend: str | None = None, timeout: float = 300.0, collectives: str = "auto") -> DistMesh:
    """This process as one rank of a ``torchrun`` job; initialises the default process group if needed.

    ``backend`` defaults to gloo for CPU tensors and, where CUDA is available, NCCL for CUDA tensors
    (``"cpu:gloo,cuda:nccl"``: each collective goes to the backend of its tensors' device, so a job whose
    params live on the CPU works on a GPU machine too). With CUDA, a process that has not chosen its
    device is put on ``LOCAL_RANK``'s, as torchrun numbers them.

    Faults end the job fast and say why (``fzero.mesh._faults``): when a rank raises, the others stop
    within about a second with a ``RankFailed`` naming that rank, its exception and the collective they
    were waiting at; a rank whose process vanishes (SIGKILL, the out-of-memory killer) is named the same
    way. ``timeout`` (seconds, default 300) is how long a rank waits at one collective for the others: a
    rank that stalls ends the job after it with a ``MeshTimeout`` naming the rank that did not arrive. It
    bounds the wait for the slowest rank, not a step: raise it where one rank can fall that far behind the
    others, e.g. ``dist_mesh(timeout=1800)`` for a compile-heavy first step (``torch.compile`` on one rank
    while the others wait) or a long evaluation or checkpoint on rank 0 alone. It is also the process
    group's timeout when ``dist_mesh`` creates the group; a group made with ``init_process_group(timeout=...)``
    keeps its own, and the shorter of the two applies. CUDA collectives rely on NCCL's own timeout.

    ``collectives``: how the collectives of CPU tensors run on gloo. ``"auto"`` (the default): all-gathers and
    reduce-scatters as direct point-to-point exchanges (``fzero.mesh._p2p``: measured 1.3-1.7x and 2-4x faster
    than gloo's own on the sizes a step moves, and they run while the rank computes), all-reduces as gloo's ring
    (faster than an exchange's two rounds); ``"native"``: torch.distributed's collectives throughout; ``"p2p"``:
    all-reduces as exchanges too, which sum in rank order as ``local_mesh`` does (the same bits on any number of
    ranks). NCCL's collectives are always NCCL's own.
    """
    import torch.distributed as dist

    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"fzero.dist_mesh: timeout must be a number of seconds > 0, got {timeout!r}; e.g. "
                         f"fzero.dist_mesh(timeout=1800) for a slow first step.")
    if collectives not in COLLECTIVES:
        raise ValueError(f"fzero.dist_mesh: collectives must be one of {COLLECTIVES}, got {collectives!r}.")

    if not dist.is_initialized():
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"fzero.dist_mesh: no torchrun environment ({', '.join(missing)} not set). Launch the script with "
                f"`torchrun --nproc_per_node N script.py`, or simulate N ranks in this process with fzero.local_mesh(N)."
            )
        backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ and not torch.cuda.is_initialized():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout))
    fault_board(float(timeout))  # every rank's process id and hooks are on the board before its first collective
    return DistMesh(dist.get_world_size(), dist.get_rank(), dist.get_backend(), timeout=float(timeout), collectives=collectives)


def wrap_comm(mesh: Mesh, wrapper: Callable[[Any], Any]) -> Mesh:
    """The same mesh, with ``wrapper(comm)`` in place of each comm it hands a rank's program: the step, its init,
    evaluate and gather then issue every collective through it. ``wrapper`` takes a comm (``fzero.mesh._comm.Comm``)
    and returns one, usually a ``CommWrapper`` subclass that overrides the collectives it changes. Applied to a
    mesh that has a wrapper already, the new one goes around the old.

    Why a mesh transform: the comm is made per rank and per call inside the step, so this is where a change of the
    traffic (compressed gradients, quantised gathers, tracing) can reach every collective without a change to the
    step."""
    if not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.wrap_comm: expected a mesh from fzero.local_mesh or fzero.dist_mesh, got {mesh!r}.")
    if not callable(wrapper):
        raise TypeError(f"fzero.wrap_comm: wrapper must be a function comm -> comm (e.g. a CommWrapper subclass), got {wrapper!r}.")
    inner = mesh.wrap
    return dataclasses.replace(mesh, wrap=wrapper if inner is None else (lambda comm: wrapper(inner(comm))))


def _wrapped(wrap: Callable[[Any], Any] | None, comm: Any) -> Any:
    return comm if wrap is None else wrap(comm)


def count_collectives(mesh: Mesh) -> Mesh:
    """The same mesh with a fresh ``Counter`` (``mesh.counter``) that records every collective run on it."""
    if not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.count_collectives: expected a mesh from fzero.local_mesh or fzero.dist_mesh, got {mesh!r}.")
    return dataclasses.replace(mesh, counter=Counter())


# -- what the ranks of a mesh must agree on ---------------------------------------------------------

AGREE_FIX = (
    "Every rank must build the same model (the same parameter names, shapes and dtypes, hence the same units) and "
    "the same step (stages, precision, grad_accum): build both from the same code and config on every rank, and keep "
    "rank-dependent choices out of them."
)


def program_fields(layout: Any, *, stage: int, precision: Any, grad_accum: int, device_type: str | None = None,
                   collectives: str | None = None) -> list[tuple[str, Any]]:
    """What every rank of one job must share, as (name, value) pairs in the order a difference is reported.

    Ranks that differ in any of these would issue collectives of different units or sizes, or pair
    unrelated buffers of the same padded size and train silently wrong; a comm's ``agree`` compares them once.
    """
    fields: list[tuple[str, Any]] = [
        ("the ZeRO stage", stage), ("the precision", precision), ("grad_accum", grad_accum),
        ("the number of units", len(layout.units)),
    ]
    if device_type is not None:  # gloo and NCCL would each wait for the other: a hang, not an error
        fields.append(("the device type of the params", device_type))
    if collectives is not None:  # exchanges on one rank and gloo's collectives on another pair unrelated messages
        fields.append(("how gloo collectives run (dist_mesh(collectives=...))", repr(collectives)))
    fields += [(f"unit #{i}", repr(u.name)) for i, u in enumerate(layout.units)]
    for u in layout.units:
        fields += [(f"the number of params in unit {u.name!r}", len(u.slots)), (f"the dtype of unit {u.name!r}", str(u.dtype))]
        for j, s in enumerate(u.slots):
            fields += [(f"param #{j} of unit {u.name!r}", repr(s.path)), (f"the shape of {s.path!r}", tuple(s.shape))]
    return fields
