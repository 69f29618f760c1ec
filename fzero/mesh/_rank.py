"""One rank's context (``RankContext``), and the RNG stream in it that makes ``local_mesh(n)`` behave as n processes.

## The context

What code deep below a step reads of the rank it runs for, in one object.

A step's program is handed its comm, state and batch as arguments, down to the collectives. Some of what a rank
has cannot travel that way, because the code that needs it is called by the user or by torch, not by fzero:

| field | read by | why it cannot be an argument |
|---|---|---|
| ``clones``, ``writes``, ``compute_dtype``, ``buffers``, ``scope``, ``applied`` | ``fzero.apply`` (``fzero.step._module``) | the user's ``loss_fn`` calls ``fzero.apply(model, params, x)``, and at stages 0-1 ``params`` is the user's own pytree |
| ``usage`` | the views ``loss_fn`` reads (``fzero.step._context``) | recorded inside user code, by autograd |
| ``snapshots``, ``replay`` | ``fzero.apply`` under ``fzero.remat`` | the recompute runs in backward, called by autograd |
| ``generator``, ``stream`` | torch's random ops (below) | torch reads the process generator; ranks must not share it |
| ``segments`` | the optimizers (``fzero.optim``) | optax-style ``update(grads, state, params)`` has no place for them |
| ``comm``, ``api`` | the first forward's structure check (``fzero.step._batch``) | it runs inside ``fzero.apply``, called by ``loss_fn`` |
| ``observers`` | the buffer events (``fzero.mesh._comm``) | ``fzero.memory``'s counters are entered by the user around a step |

The rank's program makes its context once (``Step._as_rank``: the comm, the calling API, the module clones, over
the RNG stream and observers its mesh thread was given) and narrows it for a part of the program with
``with_context(field=value)``: a step's compute dtype and usage record, a micro-batch's buffers, an update's
segments, a remat recompute's snapshots. Each ``with_context`` block gives back the
fields it changed when it ends, so nothing outlives the block that set it. On a ``local_mesh`` a rank is a thread
standing in for a process, so the current context is the calling thread's: one slot per thread, holding a frozen
``RankContext``; nothing else in fzero is kept per thread.

## One RNG stream per simulated rank

Under ``torchrun`` every rank is a process with its own CPU generator: n processes that ran the same
seeded program start a step with equal generator states and each draws its own dropout masks,
LayerDrop decisions and ``torch.rand`` values from its own copy. The rank threads of a ``local_mesh``
share one process, hence one global CPU generator: they would draw from one stream in whatever order
the threads happen to run (masks race, and two runs of one program differ). This module gives each
rank thread its own stream:

* ``rank_streams(n)`` (entered by ``LocalMesh.run`` in the main thread): every rank's stream starts as a
  copy of the global generator's state; when the ranks are done, the global generator is set to rank
  0's final state, so the main thread goes on as rank 0 of a torchrun job would.
* ``own_stream(gen)`` (entered in each rank thread, for the length of the rank's program) is a
  ``TorchDispatchMode``: dispatch-mode stacks are thread-local, so it sees exactly the ops of its own
  rank, under ``torch.func.grad`` and plain autograd alike (``F.dropout`` on CPU decomposes to
  ``bernoulli``, which it sees). Every op tagged ``torch.Tag.nondeterministic_seeded`` that would use
  the global CPU generator draws from the rank's ``torch.Generator`` instead: passed as the op's
  ``generator=`` argument where the op has one (no lock, and no one else's state is touched), or, for
  the few ops without one (``native_dropout``, ``rand.default``...), run under a process-wide lock
  with the global generator's state swapped to the rank's for the op. An op given an explicit
  generator, or on another device, is left alone. Both ways draw exactly what the op would draw from
  the global generator in that state, so the streams are bitwise those of torchrun processes.
* ``get_state()`` / ``replay(state)``: the current stream's state (the rank's in a rank thread, the
  global generator's elsewhere) and a context in which draws come from a saved state and after which
  the stream is back where it was (as ``torch.random.fork_rng``). A recompute (``fzero.remat``) uses
  them, so it replays its own rank's draws and never touches the shared global generator.

A single-rank mesh, no mesh, and ``dist_mesh`` install nothing: they use torch's global generator
exactly as plain PyTorch does. While rank threads run, ``torch.get_rng_state``/``torch.set_rng_state`` act on the calling rank's stream
(``_rank_aware_state_functions``), so ``torch.utils.checkpoint`` and ``fork_rng`` replay a rank's own draws.
CUDA draws are treated the same way: each rank has its own generator per CUDA device, a copy of that
device's global generator when the rank first draws there (the ranks never move the global one, and the
main thread waits, so that is its state at the start), and the device's global generator takes rank 0's
final state afterwards. ``torch.cuda.get_rng_state``/``set_rng_state`` act on the calling rank's.
Not covered: ``torch.manual_seed`` called inside a rank's program (it seeds the shared global generators),
Python's ``random`` and NumPy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What one rank's code reads of its rank (the module docstring says who reads each field and why)."""

    comm: Any = None  # the rank's comm under dist_mesh, for the first forward's agreement on the model's structure
    api: str | None = None  # the public call this rank program runs for (named by errors)
    clones: dict[int, Any] | None = None  # id(user's module) -> (it, this rank's clone of it), for one step call
    writes: Any = None  # what the clones changed in the modules' public attributes (``fzero.layout.Writes``)
    compute_dtype: torch.dtype | None = None  # a bf16/fp16 policy's dtype: inputs, buffers and frozen params meet it
    buffers: Any = None  # the step's buffer bank (``fzero.step._module.Buffers``) the forward runs with
    scope: contextlib.ExitStack | None = None  # a micro-batch's forward and backward: modules keep their tensors
    applied: list | None = None  # the modules ``fzero.apply`` ran, noted for the first step's checks
    snapshots: Any = None  # a remat call's buffer values (``fzero.step._context.Snapshots``)
    replay: bool = False  # a remat recompute: hand out the snapshots' copies, not the live buffers
    usage: Any = None  # which params this rank's gradients used (``fzero.step._context.Usage``)
    segments: Any = None  # the per-parameter segments of ZeRO leaves the optimizer updates (``fzero.optim``)
    generator: torch.Generator | None = None  # a local_mesh rank's CPU generator
    stream: Any = None  # a local_mesh rank's RNG stream (CPU and CUDA generators)
    observers: tuple = ()  # buffer-event observers (``fzero.memory``'s counters)


_EMPTY = RankContext()
_local = threading.local()  # .context: this thread's RankContext


def current_context() -> RankContext:
    """This thread's context (outside any rank program: the empty one)."""
    return getattr(_local, "context", _EMPTY)


@contextlib.contextmanager
def with_context(**fields: Any) -> Iterator[RankContext]:
    """This thread's context with ``fields`` changed, for the length of the block; on exit the fields it set get
    their outer values back (only those: what a block entered inside it set and left open stays)."""
    outer = current_context()
    _local.context = inner = dataclasses.replace(outer, **fields)
    try:
        yield inner
    finally:
        _local.context = dataclasses.replace(current_context(), **{k: getattr(outer, k) for k in fields})


_GLOBAL = threading.Lock()  # held while a rank's state is swapped into the global generator

# How an op draws, per OpOverload: None (it does not), or the index of its ``generator`` argument
# (-1: the op has none, so the global generator is swapped for it).
_HOW: dict[Any, tuple[int, bool] | None] = {}


def _how(func) -> tuple[int, bool] | None:
    """(index of ``generator`` in the schema or -1, whether it is keyword-only), or None for an op that draws nothing."""
    try:
        return _HOW[func]
    except KeyError:
        pass
    how = None
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        how = (-1, False)
        for i, arg in enumerate(func._schema.arguments):
            if arg.name == "generator":
                how = (i, arg.kwarg_only)
                break
    _HOW[func] = how
    return how


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    """The device an op runs on: its first tensor argument's, else (a factory) its device=."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    device = kwargs.get("device")
    return torch.get_default_device() if device is None else torch.device(device)


class _Stream:
    """One rank's generators: CPU, and one per CUDA device it has drawn on (made on first use, see the module docstring)."""

    def __init__(self, cpu: torch.Generator, cuda_starts: dict[int, torch.Tensor],
                 cuda_resume: dict[int, torch.Tensor] | None = None) -> None:
        self.cpu = cpu
        self.cuda: dict[int, torch.Generator] = {}
        self._starts = cuda_starts  # shared by the ranks of one mesh: each device's global state when first needed
        self._resume = cuda_resume or {}  # this rank's own state per device, where it goes on from the last run (Carry)

    def generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "cpu":
            return self.cpu
        if device.type != "cuda":
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = self.cuda.get(index)
        if gen is None:
            with _GLOBAL:
                start = self._starts.setdefault(index, torch.cuda.default_generators[index].get_state())
            gen = self.cuda[index] = torch.Generator(device=f"cuda:{index}")
            gen.set_state(self._resume.get(index, start))
        return gen


class Carry:
    """Where each rank's streams ended in a mesh's last run, and what the global generators were left holding.

    A torchrun rank goes on from its own generator's state at its next step; a local mesh's rank thread is made
    again for every run. So the next run starts rank r from its own end state, as long as the global generators
    still hold what the last run left in them (rank 0's: nothing drew from them or reseeded them in between).
    Where they do not, every rank starts from the global state, as after a ``torch.manual_seed`` in each process of
    a torchrun job; a draw made between runs in the caller's thread (torchrun: a draw of each rank from its own
    stream) cannot be replayed for the other ranks, so their streams then restart from rank 0's. Why it matters:
    ranks that draw different amounts in a step (a mixture of experts dropping overflow tokens before a dropout,
    data-dependent sampling, a smaller last batch split unevenly) ended the step in different states, and a
    restart from rank 0's gave rank 1 rank 0's stream (found against torchrun: 1.7e-3 apart from step 1 on a
    Switch Transformers model)."""

    def __init__(self) -> None:
        self.cpu: list[torch.Tensor] = []  # per rank, its CPU generator's state at the end of the last run
        self.cuda: list[dict[int, torch.Tensor]] = []  # per rank, per CUDA device it drew on
        self.left: torch.Tensor | None = None  # the global CPU generator's state the last run left (rank 0's)
        self.left_cuda: dict[int, torch.Tensor] = {}

    def resumes(self, n: int, start: torch.Tensor) -> bool:
        return len(self.cpu) == n and self.left is not None and torch.equal(self.left, start)

    def cuda_resume(self, rank: int) -> dict[int, torch.Tensor]:
        """Rank ``rank``'s device states to go on from, for the devices whose global generator still holds what the
        last run left."""
        return {i: t for i, t in self.cuda[rank].items()
                if i in self.left_cuda and torch.equal(torch.cuda.default_generators[i].get_state(), self.left_cuda[i])}


def _global_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


class _OwnStream(TorchDispatchMode):
    """Sends this thread's draws from the global CPU and CUDA generators to its rank's (see the module docstring)."""

    def __init__(self, stream: _Stream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        how = _how(func)
        if how is None:
            return func(*args, **kwargs)
        device = _device_of(args, kwargs)
        generator = self.stream.generator(device)
        if generator is None:  # a device fzero keeps no stream for: torch's own generator, as elsewhere
            return func(*args, **kwargs)
        index, kwarg_only = how
        if index >= 0:
            if kwarg_only or len(args) <= index:
                if kwargs.get("generator") is None:
                    kwargs = {**kwargs, "generator": generator}
            elif args[index] is None:
                args = (*args[:index], generator, *args[index + 1 :])
            return func(*args, **kwargs)
        with _GLOBAL:  # no generator argument: lend the op the global generator, in this rank's state
            default = _global_generator(device)
            saved = default.get_state()
            default.set_state(generator.get_state())
            try:
                out = func(*args, **kwargs)
                generator.set_state(default.get_state())
            finally:
                default.set_state(saved)
        return out


_TORCH_GET, _TORCH_SET = torch.get_rng_state, torch.set_rng_state  # torch's own, for threads outside a rank


def get_state() -> torch.Tensor:
    """The CPU RNG state this thread draws from: its rank's stream in a rank thread, else the global generator's.
    While rank threads run, this is ``torch.get_rng_state`` too (``_rank_aware_state_functions``)."""
    gen = current_context().generator
    return gen.get_state() if gen is not None else _TORCH_GET()


def _rank_set_rng_state(new_state: torch.Tensor) -> None:
    gen = current_context().generator
    if gen is not None:
        gen.set_state(new_state)
    else:
        _TORCH_SET(new_state)


_CUDA_GET = _CUDA_SET = None  # torch.cuda's own, read when a mesh starts (torch.cuda may be imported late)


def cuda_get_state(device: int | str | torch.device = "cuda") -> torch.Tensor:
    """The CUDA RNG state of ``device`` this thread draws from: its rank's stream in a rank thread, else torch's."""
    stream = current_context().stream
    if stream is None:
        return (_CUDA_GET or torch.cuda.get_rng_state)(device)
    return stream.generator(_cuda_device(device)).get_state()


def cuda_set_state(new_state: torch.Tensor, device: int | str | torch.device = "cuda") -> None:
    stream = current_context().stream
    if stream is None:
        (_CUDA_SET or torch.cuda.set_rng_state)(new_state, device)
    else:
        stream.generator(_cuda_device(device)).set_state(new_state)


def _cuda_device(device: int | str | torch.device) -> torch.device:
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


_meshes_running = 0  # rank_streams contexts open (nested or in several threads), under _PATCH
_PATCH = threading.Lock()


@contextlib.contextmanager
def _rank_aware_state_functions() -> Iterator[None]:
    """``torch.get_rng_state``/``torch.set_rng_state`` (and ``torch.random``'s) read and set the calling rank's
    stream while rank threads run: ``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing) and
    ``torch.random.fork_rng`` save and restore the CPU generator through them, and must replay the rank's
    own draws in their recompute, not the global generator's. Outside rank threads they are torch's own."""
    global _meshes_running, _CUDA_GET, _CUDA_SET
    with _PATCH:
        if _meshes_running == 0:
            torch.get_rng_state = torch.random.get_rng_state = get_state
            torch.set_rng_state = torch.random.set_rng_state = _rank_set_rng_state
            _CUDA_GET, _CUDA_SET = torch.cuda.get_rng_state, torch.cuda.set_rng_state
            torch.cuda.get_rng_state, torch.cuda.set_rng_state = cuda_get_state, cuda_set_state
        _meshes_running += 1
    try:
        yield
    finally:
        with _PATCH:
            _meshes_running -= 1
            if _meshes_running == 0:
                torch.get_rng_state = torch.random.get_rng_state = _TORCH_GET
                torch.set_rng_state = torch.random.set_rng_state = _TORCH_SET
                torch.cuda.get_rng_state, torch.cuda.set_rng_state = _CUDA_GET, _CUDA_SET
                _CUDA_GET = _CUDA_SET = None


@contextlib.contextmanager
def rank_streams(n: int, carry: Carry | None = None) -> Iterator[list[_Stream]]:
    """n streams, each a copy of the global CPU generator's state (and of a CUDA device's, when a rank first
    draws there), or, with ``carry`` from the mesh's last run and nothing drawn from the global generators since,
    each rank's own state where that run ended (``Carry``); on exit the global generators take rank 0's final states
    (the main thread continues as rank 0 would). Entered in the main thread."""
    start = torch.get_rng_state()
    resume = carry is not None and carry.resumes(n, start)
    cuda_starts: dict[int, torch.Tensor] = {}
    streams = []
    for r in range(n):
        g = torch.Generator()
        g.set_state(carry.cpu[r] if resume else start)
        streams.append(_Stream(g, cuda_starts, carry.cuda_resume(r) if resume else None))
    try:
        with _rank_aware_state_functions():
            yield streams
    finally:
        torch.set_rng_state(streams[0].cpu.get_state())
        for index, gen in streams[0].cuda.items():
            torch.cuda.default_generators[index].set_state(gen.get_state())
        if carry is not None:
            carry.cpu = [st.cpu.get_state() for st in streams]
            carry.cuda = [{**(carry.cuda[r] if resume else {}), **{i: g.get_state() for i, g in st.cuda.items()}}
                          for r, st in enumerate(streams)]
            carry.left = torch.get_rng_state()
            carry.left_cuda = {i: torch.cuda.default_generators[i].get_state() for i in streams[0].cuda}


@contextlib.contextmanager
def own_stream(stream: _Stream) -> Iterator[None]:
    """In a rank thread: every draw this thread makes from a global generator comes from its rank's ``stream``."""
    with with_context(generator=stream.cpu, stream=stream), _OwnStream(stream):
        yield


@contextlib.contextmanager
def replay(state: torch.Tensor) -> Iterator[None]:
    """Draws inside come from ``state`` (from ``get_state``); after, this thread's stream is where it was.

    In a rank thread only the rank's own generator is touched, never the global one, which other rank
    threads may be borrowing at that moment.
    """
    gen = current_context().generator
    if gen is None:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            yield
        return
    saved = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(saved)
