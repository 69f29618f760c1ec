"""One rank's context (``RankContext``), and the RNG stream in it that makes ``local_mesh(n)`` behave as n processes.

## The context

What code deep below a step reads of the rank it runs for, in one object.

A step's program is handed its comm, state and batch as arguments, down to the collectives. Some of what a rank
has cannot travel that way, because the code that needs it is called by the user or by torch, not by fzero:

| field | read by | why it cannot be an argument |
|---|---|---|
| ``clones``, ``writes``, ``compute_dtype``, ``buffers``, ``scope``, ``applied``, ``stale``, ``frozen`` | ``fzero.apply`` (``fzero.step._module``) | the user's ``loss_fn`` calls ``fzero.apply(model, params, x)``, and at stages 0-1 ``params`` is the user's own pytree |
| ``usage`` | the views ``loss_fn`` reads (``fzero.step._context``) | recorded inside user code, by autograd |
| ``snapshots``, ``replay`` | ``fzero.apply`` under ``fzero.remat`` | the recompute runs in backward, called by autograd |
| ``generator``, ``stream`` | torch's random ops (below) | torch reads the process generator; ranks must not share it |
| ``segments`` | the optimizers (``fzero.optim``) | optax-style ``update(grads, state, params)`` has no place for them |
| ``schedules`` | the optimizers' and the step's reads of a schedule (``fzero.optim._base.scheduled``) | optax-style ``update`` has no place for them, and the value is one step call's, shared by all its ranks |
| ``comm``, ``api`` | the first forward's structure check (``fzero.step._batch``) | it runs inside ``fzero.apply``, called by ``loss_fn`` |
| ``synced`` | ``fzero.apply`` under ``dist_mesh`` (``fzero.step._context.take_rank0_buffers``) | the modules whose non-persistent buffers take rank 0's values are known only when ``loss_fn`` runs them |
| ``observers`` | the buffer events (``fzero.mesh._comm``) | ``fzero.memory``'s counters are entered by the user around a step |

The rank's program makes its context once (``Step._as_rank``: the comm, the calling API, the module clones, over
the RNG stream and observers its mesh thread was given) and narrows it for a part of the program with
``with_context(field=value)``: a step's compute dtype, usage record and schedule values, a micro-batch's buffers, an
update's segments, a remat recompute's snapshots. Each ``with_context`` block gives back the
fields it changed when it ends, so nothing outlives the block that set it. On a ``local_mesh`` a rank is a thread
standing in for a process, so the current context is the calling thread's: one slot per thread, holding a frozen
``RankContext``; nothing else in fzero is kept per thread. A thread that runs part of a step's backward without a
context of its own (autograd's device thread, on a GPU) finds the step's by the backward's graph task
(``backward_context``).

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
``torch.manual_seed`` (and ``torch.cuda.manual_seed``/``manual_seed_all``) called inside a rank's program seeds
that rank's generators only, as it seeds that process's under torchrun (a per-step reseed in ``loss_fn``, Hugging
Face's ``set_seed``, Lightning's ``seed_everything``); before, it seeded the shared global generators, which the ranks
do not draw from, so the reseed was silently lost (measured: 0.7338 vs 0.7925 as a 2-rank dropout MLP's first
loss for two outer seeds, where torchrun gives one number).

## Python's ``random`` and NumPy's global ``RandomState``, one per simulated rank

Hugging Face's Wav2Vec2, HuBERT, SEW and Data2Vec-Audio draw SpecAugment masks and LayerDrop decisions from
``np.random`` in their training forward, and other code uses Python's ``random``. Under torchrun each process has
its own copy of these module-level streams; the threads of a ``local_mesh`` would share one, so rank 1 drew what
rank 0 left, in whatever order the threads ran (measured on a tiny Wav2Vec2ForCTC, ``local_mesh(2)``: first losses
171.599 and 171.655 for two runs of one seed, torchrun's semantics 171.858). So while rank threads run, the
module-level functions of ``random`` (its hidden ``Random`` instance's bound methods: ``random.random``,
``random.seed``, ``random.getstate``...) and of ``numpy.random`` (the legacy global ``RandomState``'s, with
``np.random.seed``) are replaced by ones that draw from the calling rank's own ``random.Random`` and
``np.random.RandomState``, made and carried from run to run exactly as the torch generators are (copies of the
global state; the global state takes rank 0's afterwards; ``Carry``); outside rank threads they call the originals.
Not covered here: a function bound before the mesh ran (``from random import random``), ``random.Random()`` and
``np.random.default_rng()`` objects (each its own stream already, as under torchrun, where made inside the step; one
kept on a module is copied for each rank with the module, ``fzero.layout._modules._private``, and each rank's copy goes
on from its own state at the next run, ``Carry.held``), and NumPy imported for
the first time inside a rank's program.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import sys
import threading
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fzero.layout import HeldStreams


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
    stale: Any = None  # the first loss_fn call's StaleWatch (fzero.step._stale), None while a forward runs
    trained: Any = None  # what a train step call moves behind its state, of the user's modules (``fzero.step._module.Trained``)
    snapshots: Any = None  # a remat call's buffer values (``fzero.step._context.Snapshots``)
    replay: bool = False  # a remat recompute: hand out the snapshots' copies, not the live buffers
    usage: Any = None  # which params this rank's gradients used (``fzero.step._context.Usage``)
    segments: Any = None  # the per-parameter segments of ZeRO leaves the optimizer updates (``fzero.optim``)
    schedules: Any = None  # one step call's schedule values, shared by its ranks (``fzero.optim``'s ``ScheduleValues``)
    generator: torch.Generator | None = None  # a local_mesh rank's CPU generator
    stream: Any = None  # a local_mesh rank's RNG stream (CPU and CUDA generators)
    observers: tuple = ()  # buffer-event observers (``fzero.memory``'s counters)
    frozen: Any = None  # one step call's record of the frozen params its rank threads read (``fzero.step._module.FrozenWrites``)
    synced: dict[int, Any] | None = None  # under dist_mesh of several processes: the modules (by id) whose non-persistent buffers this step call took from rank 0


_EMPTY = RankContext()
_local = threading.local()  # .context: this thread's RankContext
_TASKS: dict[int, RankContext] = {}  # autograd graph task id -> the context of the step whose backward it is


def current_context() -> RankContext:
    """This thread's context; in a thread that has none, the context of the step whose backward that thread is
    running a part of (``backward_context``); else (outside any rank program) the empty one."""
    context = getattr(_local, "context", None)
    if context is not None:
        return context
    if _TASKS:
        return _TASKS.get(torch._C._current_graph_task_id(), _EMPTY)
    return _EMPTY


@contextlib.contextmanager
def with_context(**fields: Any) -> Iterator[RankContext]:
    """This thread's context with ``fields`` changed, for the length of the block; on exit the fields it set get
    their outer values back (only those: what a block entered inside it set and left open stays). In a thread
    that had no context of its own (autograd's device thread, running a step's backward) it has none again after:
    that thread serves every backward of the process in turn."""
    own = getattr(_local, "context", None)
    borrowed = own is None and torch._C._current_graph_task_id() != -1  # in a backward, in a thread without one
    outer = current_context()
    _local.context = inner = _replaced(outer, fields)
    try:
        yield inner
    finally:
        if borrowed:
            del _local.context
        else:
            _local.context = _replaced(current_context(), {k: getattr(outer, k) for k in fields})


@contextlib.contextmanager
def backward_context() -> Iterator[Any]:
    """Gives a function to pass a step's loss through before its backward, so that the backward finds the
    step's context in every thread it runs in, for the length of the block.

    Why: autograd runs the backward of CUDA (and other accelerator) operations in its own device thread, one per
    device for the whole process, not in the thread that called it. Python that runs there and reads the context
    found none: a ``fzero.remat`` or ``torch.utils.checkpoint`` recompute of a stage-3 unit noted no gradient for
    the unit's params, so on a GPU they skipped every update, silently (measured on an H200: the optimizer put back
    the whole model's masters and moments every step). A thread-local set there would be wrong too: that thread
    serves every backward of the process in turn. So the context is found by the backward's graph task, which torch
    keeps per backward call in every thread that runs part of it: the loss's node, the first that backward runs,
    notes its task's id with the context; the id is forgotten when the block ends. The context is lent whole, its
    RNG stream too: autograd runs each node in that thread under the thread-local state the backward began with
    (``at::ThreadLocalState``, which carries the dispatch-mode stack), so the rank's ``own_stream`` mode is active
    there and draws from the rank's stream; a recompute's replay (``replay``, and ``torch.utils.checkpoint`` through
    ``torch.set_rng_state``) must set that stream. Lent without it, the replay set torch's global generator, which
    no draw there reads, and the recompute drew another dropout mask than the forward's (2.0e-3 off DDP after one
    AdamW step, 7.1e-3 after four, silently, in the CPU twin of a rank's backward run outside its thread). Where a
    GPU takes this path today (one rank: ``local_mesh(1)``, ``dist_mesh``) the context has no stream, and a rank
    thread of ``local_mesh(n)`` runs its whole backward itself (``fzero/mesh/_mesh.py``); the stream is lent so that
    no thread's draws and replays part. A nested backward (a reentrant checkpoint's) is a task of its own, not
    noted: the fzero code it reaches took its record at the forward (``_RecordedSplit``)."""
    tasks = _Noted()

    def bind(loss: torch.Tensor) -> torch.Tensor:  # the context as the loss is made: the one backward runs in
        return _NoteTask.apply(loss, current_context(), tasks) if loss.requires_grad else loss

    try:
        yield bind
    finally:
        for task in tasks.ids:
            _TASKS.pop(task, None)


def needs_context() -> bool:
    """This thread has no context of its own, nor one noted for the backward it runs a part of (``borrowed``)."""
    return getattr(_local, "context", None) is None and not (_TASKS and torch._C._current_graph_task_id() in _TASKS)


@contextlib.contextmanager
def borrowed(context: RankContext | None) -> Iterator[None]:
    """``context`` (what an fzero autograd Function's forward ran in) for the length of the block, in a thread that
    has none of its own and runs part of a backward no step noted (``backward_context``): on a GPU, the device
    thread's part of a backward that ``loss_fn`` runs itself (``torch.autograd.grad(inner_loss, x)``, an adversarial
    input's gradient), which found no context: the unit's buffers went unseen by ``fzero.memory``'s counters and
    outside the step's pool. Elsewhere (a thread with its own, a noted backward) nothing changes."""
    if context is None or not needs_context():
        yield
        return
    _local.context = context
    try:
        yield
    finally:
        del _local.context


class _Noted:
    """The graph tasks one ``backward_context`` noted. An object, not a list, as the Function's argument:
    ``torch.func`` rebuilds list arguments, so the ids were appended to a copy and never forgotten (each a step's
    context held for the process's life, its module clones among it)."""

    def __init__(self) -> None:
        self.ids: list[int] = []


class _NoteTask(torch.autograd.Function):
    """The identity on a step's loss; its backward notes the running graph task's context (``backward_context``)."""

    @staticmethod
    def forward(loss: torch.Tensor, context: RankContext, tasks: "_Noted") -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.context, ctx.tasks = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        task = torch._C._current_graph_task_id()
        if task != -1:
            _TASKS[task] = ctx.context
            ctx.tasks.ids.append(task)
        return grad, None, None


_FIELDS = frozenset(f.name for f in dataclasses.fields(RankContext))


def _replaced(context: RankContext, fields: dict[str, Any]) -> RankContext:
    """``dataclasses.replace(context, **fields)``: a copy of its fields with ``fields`` set, without ``replace``'s
    per-field walk through ``__init__`` (~10 us; a step enters a context per unit call). ``RankContext`` sets its
    fields and nothing else at init, so the copy is what ``__init__`` would make; a name that is no field goes to
    ``replace``, whose error names it."""
    if not fields.keys() <= _FIELDS:
        return dataclasses.replace(context, **fields)
    new = object.__new__(RankContext)
    d = new.__dict__
    d.update(context.__dict__)
    d.update(fields)
    return new


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
                 cuda_resume: dict[int, torch.Tensor] | None = None, *, py: random.Random | None = None,
                 np: Any = None) -> None:
        self.cpu = cpu
        self.cuda: dict[int, torch.Generator] = {}
        self._starts = cuda_starts  # shared by the ranks of one mesh: each device's global state when first needed
        self._resume = cuda_resume or {}  # this rank's own state per device, where it goes on from the last run (Carry)
        self._cuda_seeds: dict[int | None, int] = {}  # torch.(cuda.)manual_seed's seed per device (None: all) this run
        self.py = py  # this rank's Python ``random`` stream
        self.np = np  # this rank's NumPy legacy global ``RandomState`` (None: NumPy not imported)

    def seed(self, seed: int) -> None:
        """``torch.manual_seed(seed)`` in this rank: its CPU generator and every CUDA one, as in a torchrun process."""
        self.cpu.manual_seed(seed)
        self.seed_cuda(seed, None)

    def seed_cuda(self, seed: int, index: int | None) -> None:
        """``torch.cuda.manual_seed`` (``index``: one device) or ``manual_seed_all`` (None) in this rank; a generator
        made later for a seeded device starts from the seed, not from the global state."""
        if index is None:
            self._cuda_seeds = {None: seed}
        else:
            self._cuda_seeds[index] = seed
        for i, gen in self.cuda.items():
            if index is None or i == index:
                gen.manual_seed(seed)

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
            seed = self._cuda_seeds.get(index, self._cuda_seeds.get(None))
            if seed is None:
                gen.set_state(self._resume.get(index, start))
            else:
                gen.manual_seed(seed)
        return gen


class Carry:
    """Where each rank's streams ended in the last run of a local mesh of n ranks, and what the global generators were
    left holding. One per mesh size for the whole process (``carry_of(n)``), not one per mesh object: see below.

    A torchrun rank goes on from its own generator's state at its next step; a local mesh's rank thread is made
    again for every run. So the next run starts rank r from its own end state, as long as the global generators
    still hold what the last run left in them (rank 0's: nothing drew from them or reseeded them in between).
    Where they do not, every rank starts from the global state, as after a ``torch.manual_seed`` in each process of
    a torchrun job; a draw made between runs in the caller's thread (torchrun: a draw of each rank from its own
    stream) cannot be replayed for the other ranks, so their streams then restart from rank 0's. Why it matters:
    ranks that draw different amounts in a step (a mixture of experts dropping overflow tokens before a dropout,
    data-dependent sampling, a smaller last batch split unevenly) ended the step in different states, and a
    restart from rank 0's gave rank 1 rank 0's stream (found against torchrun: 1.7e-3 apart from step 1 on a
    Switch Transformers model).

    Why per size and not per mesh: two ``local_mesh(n)`` in one process stand for the same n processes, whose
    generators (and module objects) the steps on either mesh share, as the steps of one torchrun job share each
    process's (a GAN's generator and discriminator steps, two ``fzero.compile`` calls in a notebook, each given its
    own ``fzero.local_mesh(2)``). Kept on each mesh object, the carry of one mesh was stale once a step on the other
    had run, so every rank restarted from rank 0's state at each alternation: 7.7e-2 off torchrun (a data-dependent
    ``torch.rand`` in ``loss_fn``) and 2.0e-2 (a stream the module holds) in the params after 4 alternating steps,
    silently. The validity rule above is unchanged and does not depend on which mesh ran last: a reseed between
    runs (another test's ``torch.manual_seed`` in the same process) restarts every rank from the seed. The one case the
    rule cannot see: where rank 0 drew nothing since the ranks last started alike while another rank drew, the global
    generator still holds that start state, and a reseed that lands on it again (the same seed and the same draws
    before the next run: a test or a notebook cell run again) is taken for no reseed, so the other ranks go on.

    A run of n ranks reads the carry when it starts and writes it when its ranks have all returned (``rank_streams``,
    under ``_CARRY_LOCK``); a step call runs its ranks to the end before it returns, so two runs of one program never
    overlap. Runs that do (steps called from two threads of the caller at once, which share the global generators
    too) each read and write a whole snapshot: the last to end is what the next run may go on from."""

    def __init__(self) -> None:
        self.cpu: list[torch.Tensor] = []  # per rank, its CPU generator's state at the end of the last run
        self.cuda: list[dict[int, torch.Tensor]] = []  # per rank, per CUDA device it drew on
        self.left: torch.Tensor | None = None  # the global CPU generator's state the last run left (rank 0's)
        self.left_cuda: dict[int, torch.Tensor] = {}
        self.py: list[Any] = []  # per rank, its Python ``random`` state at the end of the last run
        self.py_left: Any = None  # what the last run left in Python's global ``random`` (rank 0's)
        self.np: list[Any] = []  # per rank, its NumPy global ``RandomState`` state
        self.np_left: Any = None
        # per rank, the random streams the modules hold (``self._rng``), copied for each rank by the step
        self.held = HeldStreams()

    def resumes(self, n: int, start: torch.Tensor) -> bool:
        return len(self.cpu) == n and self.left is not None and torch.equal(self.left, start)

    def py_resumes(self, n: int, start: Any) -> bool:
        return len(self.py) == n and self.py_left == start

    def np_resumes(self, n: int, start: Any) -> bool:
        return len(self.np) == n and self.np_left is not None and _np_states_equal(self.np_left, start)

    def cuda_resume(self, rank: int) -> dict[int, torch.Tensor]:
        """Rank ``rank``'s device states to go on from, for the devices whose global generator still holds what the
        last run left."""
        return {i: t for i, t in self.cuda[rank].items()
                if i in self.left_cuda and torch.equal(torch.cuda.default_generators[i].get_state(), self.left_cuda[i])}


_CARRIES: dict[int, Carry] = {}  # mesh size -> the carry of every local mesh of that size in this process
_CARRY_LOCK = threading.Lock()  # the registry, and a run's read and write of its carry's states


def carry_of(n: int) -> Carry:
    """The carry of every ``local_mesh(n)`` of this process (``Carry``: why one per size, not one per mesh).

    Called in a rank thread (a mesh's step or ``evaluate`` that another mesh's ``loss_fn`` calls), a new, empty one: the
    inner mesh stands for ranks inside that rank's process, which holds none of the process's carried states, and
    the rank threads of the enclosing mesh run it at once. Given the process's, an inner run in rank 0's thread went
    on from the enclosing ranks' states (its rank 1 drew the enclosing rank 1's numbers); each inner run now starts its
    ranks from the enclosing rank's stream, as a first run does."""
    if current_context().stream is not None:
        return Carry()
    with _CARRY_LOCK:
        carry = _CARRIES.get(n)
        if carry is None:
            carry = _CARRIES[n] = Carry()
        return carry


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


def _numpy() -> Any:
    """NumPy if the program imported it, else None (fzero never imports it: a program without it draws nothing from it)."""
    return sys.modules.get("numpy")


def _np_states_equal(a: Any, b: Any) -> bool:
    """Two ``RandomState.get_state()`` tuples ('MT19937', keys, pos, has_gauss, cached_gaussian) are equal."""
    return a[0] == b[0] and bool((a[1] == b[1]).all()) and tuple(a[2:]) == tuple(b[2:])


def _host_functions() -> list[tuple[Any, str, str, Any]]:
    """(module, its attribute, the method of a rank's instance it stands for, which stream: "py" or "np") for every
    module-level function that draws from (or reads, sets, seeds) Python's or NumPy's one global stream."""
    out = [(random, name, name, "py") for name in dir(random)
           if getattr(getattr(random, name), "__self__", None) is random._inst]
    np = _numpy()
    if np is not None:
        legacy = np.random.mtrand._rand
        out += [(np.random, name, name, "np") for name in dir(np.random)
                if getattr(getattr(np.random, name), "__self__", None) is legacy]
        # module functions (not bound methods) over the same RandomState
        out += [(np.random, name, method, "np") for name, method in (("seed", "seed"), ("sample", "random_sample"),
                                                                       ("ranf", "random_sample")) if hasattr(np.random, name)]
    return out


def _per_rank(original: Any, method: str, which: str) -> Any:
    """``original`` (a module-level random function) made to draw from the calling rank's own stream in a rank
    thread, and to be itself elsewhere."""
    @functools.wraps(original)
    def draw(*args: Any, **kwargs: Any) -> Any:
        stream = current_context().stream
        own = None if stream is None else getattr(stream, which)
        if own is None:
            return original(*args, **kwargs)
        return getattr(own, method)(*args, **kwargs)

    return draw


def _rank_manual_seed(seed: Any) -> torch.Generator:
    """``torch.manual_seed`` while rank threads run: in a rank thread it seeds that rank's generators only (as in a
    torchrun process), elsewhere it is torch's own."""
    stream = current_context().stream
    if stream is None:
        return _TORCH_SEED(seed)
    stream.seed(int(seed))
    return stream.cpu


def _rank_cuda_seed(seed: Any) -> None:
    stream = current_context().stream
    if stream is None:
        return _CUDA_SEED(seed)
    stream.seed_cuda(int(seed), torch.cuda.current_device())


def _rank_cuda_seed_all(seed: Any) -> None:
    stream = current_context().stream
    if stream is None:
        return _CUDA_SEED_ALL(seed)
    stream.seed_cuda(int(seed), None)


_TORCH_SEED = torch.manual_seed
_CUDA_SEED = _CUDA_SEED_ALL = None  # torch.cuda's own, read when a mesh starts
_HOST_SAVED: list[tuple[Any, str, Any]] = []  # (module, attribute, original) replaced while rank threads run

_meshes_running = 0  # rank_streams contexts open (nested or in several threads), under _PATCH
_PATCH = threading.Lock()


@contextlib.contextmanager
def _rank_aware_state_functions() -> Iterator[None]:
    """``torch.get_rng_state``/``torch.set_rng_state`` (and ``torch.random``'s) read and set the calling rank's
    stream while rank threads run: ``torch.utils.checkpoint`` (Hugging Face's gradient checkpointing) and
    ``torch.random.fork_rng`` save and restore the CPU generator through them, and must replay the rank's
    own draws in their recompute, not the global generator's. ``torch.manual_seed`` and ``torch.cuda``'s seed the
    calling rank's generators, and Python's ``random`` and NumPy's module-level functions draw from the calling
    rank's own streams (the module docstring says why). Outside rank threads they are all their own."""
    global _meshes_running, _CUDA_GET, _CUDA_SET, _CUDA_SEED, _CUDA_SEED_ALL
    with _PATCH:
        if _meshes_running == 0:
            torch.get_rng_state = torch.random.get_rng_state = get_state
            torch.set_rng_state = torch.random.set_rng_state = _rank_set_rng_state
            torch.manual_seed = torch.random.manual_seed = _rank_manual_seed
            _CUDA_GET, _CUDA_SET = torch.cuda.get_rng_state, torch.cuda.set_rng_state
            torch.cuda.get_rng_state, torch.cuda.set_rng_state = cuda_get_state, cuda_set_state
            _CUDA_SEED, _CUDA_SEED_ALL = torch.cuda.manual_seed, torch.cuda.manual_seed_all
            torch.cuda.manual_seed, torch.cuda.manual_seed_all = _rank_cuda_seed, _rank_cuda_seed_all
        _meshes_running += 1
    try:
        yield
    finally:
        with _PATCH:
            _meshes_running -= 1
            if _meshes_running == 0:
                torch.get_rng_state = torch.random.get_rng_state = _TORCH_GET
                torch.set_rng_state = torch.random.set_rng_state = _TORCH_SET
                torch.manual_seed = torch.random.manual_seed = _TORCH_SEED
                torch.cuda.get_rng_state, torch.cuda.set_rng_state = _CUDA_GET, _CUDA_SET
                torch.cuda.manual_seed, torch.cuda.manual_seed_all = _CUDA_SEED, _CUDA_SEED_ALL
                _CUDA_GET = _CUDA_SET = _CUDA_SEED = _CUDA_SEED_ALL = None


_host_meshes_running = 0  # rank_streams contexts of several ranks open, under _PATCH


@contextlib.contextmanager
def _per_rank_host_streams() -> Iterator[None]:
    """Python's ``random`` and NumPy's module-level functions draw from the calling rank's streams while the threads
    of a mesh of several ranks run (one rank draws from the global streams as one process would: nothing to patch)."""
    global _host_meshes_running
    with _PATCH:
        if _host_meshes_running == 0:
            for module, name, method, which in _host_functions():
                original = getattr(module, name)
                _HOST_SAVED.append((module, name, original))
                setattr(module, name, _per_rank(original, method, which))
        _host_meshes_running += 1
    try:
        yield
    finally:
        with _PATCH:
            _host_meshes_running -= 1
            if _host_meshes_running == 0:
                while _HOST_SAVED:
                    module, name, original = _HOST_SAVED.pop()
                    setattr(module, name, original)


@contextlib.contextmanager
def rank_streams(n: int, carry: Carry | None = None) -> Iterator[list[_Stream]]:
    """n streams, each a copy of the global CPU generator's state (and of a CUDA device's, when a rank first
    draws there), or, with ``carry`` (``carry_of(n)``) and nothing drawn from the global generators since the last run
    of n ranks in this process, each rank's own state where that run ended (``Carry``); on exit the global generators
    take rank 0's final states (the main thread continues as rank 0 would). Entered in the main thread."""
    start = torch.get_rng_state()
    host = n > 1  # one rank draws from Python's and NumPy's global streams themselves, as one process
    py_start = random.getstate() if host else None
    np = _numpy() if host else None
    np_start = None if np is None else np.random.get_state()
    cuda_starts: dict[int, torch.Tensor] = {}
    streams = []
    with _CARRY_LOCK if carry is not None else contextlib.nullcontext():  # (Carry: a whole snapshot read)
        resume = carry is not None and carry.resumes(n, start)
        py_resume = host and carry is not None and carry.py_resumes(n, py_start)
        np_resume = np_start is not None and carry is not None and carry.np_resumes(n, np_start)
        for r in range(n):
            g = torch.Generator()
            g.set_state(carry.cpu[r] if resume else start)
            py = None
            if host:
                py = random.Random()
                py.setstate(carry.py[r] if py_resume else py_start)
            own_np = None
            if np_start is not None:
                own_np = np.random.RandomState()
                own_np.set_state(carry.np[r] if np_resume else np_start)
            streams.append(_Stream(g, cuda_starts, carry.cuda_resume(r) if resume else None, py=py, np=own_np))
    try:
        with _rank_aware_state_functions(), _per_rank_host_streams() if host else contextlib.nullcontext():
            yield streams
    finally:
        torch.set_rng_state(streams[0].cpu.get_state())
        for index, gen in streams[0].cuda.items():
            torch.cuda.default_generators[index].set_state(gen.get_state())
        if host:
            random.setstate(streams[0].py.getstate())
        if np_start is not None:
            np.random.set_state(streams[0].np.get_state())
        if carry is not None:
            with _CARRY_LOCK:  # a whole snapshot written (Carry)
                carry.cpu = [st.cpu.get_state() for st in streams]
                carry.cuda = [{**(carry.cuda[r] if resume else {}), **{i: g.get_state() for i, g in st.cuda.items()}}
                              for r, st in enumerate(streams)]
                carry.left = torch.get_rng_state()
                carry.left_cuda = {i: torch.cuda.default_generators[i].get_state() for i in streams[0].cuda}
                carry.py = [st.py.getstate() for st in streams] if host else []
                carry.py_left = random.getstate() if host else None
                carry.np = [st.np.get_state() for st in streams] if np_start is not None else []
                carry.np_left = np.random.get_state() if np_start is not None else None


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
