"""``fzero.remat``: rematerialisation (activation checkpointing) that works under ``torch.func``.

``torch.utils.checkpoint`` and ``torch.autograd.graph.save_on_cpu`` are built on saved-tensor hooks,
which ``torch.func.grad``/``vjp`` disable, so both raise there. ``remat`` is the recompute
pattern of stage 3's units (``fzero.zero._sharded``) on its own, for any function:

* ``_RematForward`` runs ``fn`` under ``no_grad``; what backward keeps is ``fn``'s tensor inputs (or, with
  ``offload="cpu"``, host copies of them), the RNG states and the autocast state. None of ``fn``'s
  internal activations survive the forward.
* Its backward calls a second Function, ``_RematBackward``, whose *forward* restores the RNG and autocast
  state, recomputes ``fn`` with grad and takes the vector-Jacobian product with ``torch.autograd.grad``.
  Recomputing in a Function's forward (not in ``backward``) is what works under ``torch.func`` and under
  plain autograd alike.

Only gradients with respect to ``fn``'s *arguments* are produced. A tensor that ``fn`` closes over is not
an argument, so its gradient would be lost (under ``torch.func.grad`` silently: a zero gradient); the
forward watches every torch call ``fn`` makes and raises when one reads a captured tensor that requires a
gradient (``_CAPTURED`` says how to fix it).

Only gradients through ``fn``'s *outputs* reach the arguments, too. A tensor ``fn`` computes from them and keeps
somewhere else (a forward hook that stores a module's output, as Hugging Face's ``output_router_logits`` does; an
attribute ``self.aux = h``) is made without a graph in the forward, so a loss that uses it would get no gradient
through it. The same watch follows what is computed from the differentiable arguments, and a tensor of that kind
still alive after ``fn`` returned, other than its outputs, is refused (``_ESCAPED``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as torch_pytree
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from fzero.autodiff._refusals import (
    _DEPTH,
    _ESCAPED,
    _NoCapturedGrad,
    _check_inputs_unwritten,
    _check_unchanged,
    _describe,
    _escaped,
    _held_where,
    _holds_state,
    _where,
)
from fzero.mesh import Function
from fzero.layout import pytrees as _tree
from fzero.step import (
    Snapshots,
    as_in_forward,
    current_buffers,
    current_compute_dtype,
    recompute_scope,
    recording,
    replaying,
)

__all__ = ["remat"]

OFFLOADS = (None, "cpu")
_DEPRECATED_NORMS = (WeightNorm, SpectralNorm)

_UNIT_PARAMS = """fzero.remat: {name} was given the {kind} that loss_fn receives at stage {stage}; remat can neither save nor
differentiate it (it is not a tensor). {fix}"""
_UNIT_FIX = {
    2: "Recompute the units with fzero.compile(..., remat=True), or pass the tensors themselves, e.g. "
       "remat(f)({k: params[k] for k in names}, x).",
    3: "At stage 3, recompute the units with fzero.compile(..., remat=True) (or "
       "fzero.shard_params(step, remat=True)): each unit is then recomputed in backward, gathered again.",
}


def remat(fn: Callable, *, offload: str | None = None) -> Callable:
    """``fn`` with the same signature, whose internal activations are recomputed in backward, not stored.

    ``remat(fn)(*args, **kwargs)`` returns what ``fn(*args, **kwargs)`` returns (any pytree of tensors and
    other values, as ``torch.utils._pytree`` flattens it) and the same gradients, under ``torch.func.grad``,
    ``torch.func.vjp`` and plain ``torch.autograd`` alike. The forward runs ``fn`` under ``no_grad`` and
    keeps only the tensor leaves of ``args``/``kwargs``; backward runs ``fn`` a second time, with grad, and
    takes its vector-Jacobian product. The CPU RNG state (and that of each CUDA device among the inputs)
    and the autocast state are replayed for the recompute, so dropout draws the same mask.

    **Gradients flow only to arguments.** Every tensor that needs a gradient (parameters included) must
    be passed in ``args``/``kwargs``: ``remat(lambda params, x: fzero.apply(block, params, x))(params, x)``.
    A call that reads a captured tensor requiring grad raises a ``RuntimeError`` in the forward. In a
    ``loss_fn`` at stages 0-1, ``params`` is a dict and can be passed as is; at stage 2 pass its tensors
    (``{k: params[k] ...}``); at stage 3 pass ``remat=True`` to ``compile``/``shard_params`` instead (each unit is
    recomputed, gathered again), and passing the
    ``ShardedParams`` to a remat'ed function raises a ``TypeError`` that says so.

    ``offload="cpu"`` keeps the saved inputs in host memory between forward and backward (pinned, with
    non-blocking copies, when they live on a CUDA device; a separate copy when they are already on the
    CPU) and copies them back for the recompute.

    Not supported: double backward (the backward is a recompute), forward-mode AD (``torch.func.jvp``)
    and ``torch.func.vmap`` over the wrapped function. With grad disabled, ``fn`` is simply called.
    """
    if not callable(fn):
        raise TypeError(f"fzero.remat: fn must be callable, got {type(fn).__name__}; e.g. fzero.remat(lambda params, x: ...).")
    if not (offload is None or (isinstance(offload, str) and offload in OFFLOADS)):
        raise ValueError(f"fzero.remat: offload={offload!r} is not supported; choose one of {OFFLOADS}.")

    # updated=(): wrapping an nn.Module must not copy its __dict__ (parameters, hooks) onto the function
    @functools.wraps(fn, updated=())
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no graph is built, so there is nothing to save or recompute
            return fn(*args, **kwargs)
        return _remat_call(fn, offload, args, kwargs)

    return rematerialised


def _remat_call(fn: Callable, offload: str | None, args: tuple, kwargs: dict) -> Any:
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    for x in leaves:
        stage = getattr(type(x), "unit_stage", None)  # the unit params of stages 2-3 (fzero.zero._sharded)
        if stage is not None:
            name = getattr(fn, "__qualname__", None) or type(fn).__name__
            raise TypeError(_UNIT_PARAMS.format(name=name, kind=type(x).__name__, stage=stage, fix=_UNIT_FIX[stage]))
    tensors = [leaves[i] for i in tensor_pos]
    for i, x in enumerate(leaves):
        if isinstance(x, (dict, list)) or dataclasses.is_dataclass(x) and not isinstance(x, type):
            found, opened = _open(x)
            if found:
                leaves[i] = opened
                tensor_pos += [i] * len(found)
                tensors += found
    # Decided here, outside apply: inside a Function's forward under torch.func, requires_grad reads False.
    diff = tuple(t.requires_grad and _differentiable(t) for t in tensors)
    call = _Call(fn, offload, spec, [_SLOT if isinstance(x, torch.Tensor) else x for x in leaves], tensor_pos, diff)
    outs = list(_RematForward.apply(call, *tensors))
    for i, j in call.returned_inputs.items():  # an argument returned as it is: that very tensor, as without remat
        outs[i] = tensors[j]
    for i, (source, k, geometry) in call.views.items():  # a view of an argument or of another output: made again on it
        outs[i] = (tensors[k] if source == "input" else outs[k]).as_strided(*geometry)
    for (m, name), weight in zip(call.normed, outs[call.n_out:]):  # (_norm_hooks) set as the forward left it, with a graph
        setattr(m(), name, weight)
    return call.rebuild(outs[:call.n_out])


_SLOT = object()  # where a tensor goes back into a flattened pytree of inputs or outputs


class _Opened:
    """A leaf of torch's pytree that holds tensors all the same: a ``dict`` or ``list`` subclass no pytree knows
    (``class Batch(dict)``), a dataclass. Left a leaf, its tensors reached ``fn`` without being the call's inputs: a
    unit given one was refused as having read "a tensor that requires grad but is not one of its arguments", where
    PyTorch trains it. Walked as stage 3's unit call walks it (``fzero.layout.pytrees.tensors_and_rebuild``), its tensors
    are inputs like the others, and each run gets a shallow copy of it (type and attributes kept) holding them."""

    __slots__ = ("skeleton", "rebuild", "n")

    def __init__(self, skeleton: Any, rebuild: Callable[[list[torch.Tensor]], Any], n: int) -> None:
        # skeleton: the container with placeholders for its tensors (what _object_states describes)
        self.skeleton, self.rebuild, self.n = skeleton, rebuild, n


def _open(x: Any) -> tuple[list[torch.Tensor], _Opened]:
    """The tensors inside ``x`` and how to rebuild it around others. The rebuild is made from a copy of ``x`` holding
    meta placeholders: what the call keeps until backward must not hold ``x``'s own tensors (``offload="cpu"`` lets
    the device ones go)."""
    found, rebuild = _tree.tensors_and_rebuild(x)
    skeleton = rebuild([torch.empty(0, device="meta") for _ in found]) if found else x
    return found, _Opened(skeleton, _tree.tensors_and_rebuild(skeleton)[1], len(found))


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Call:
    """One call of a remat'ed function: what both Functions need to (re)run it."""

    def __init__(self, fn, offload, spec, leaves, tensor_pos, diff):
        self.fn, self.offload = fn, offload
        self.spec, self.leaves, self.tensor_pos, self.diff = spec, leaves, tensor_pos, diff
        self.devices: list[torch.device] = []  # of the inputs, where the recompute puts them back
        self.rebuild: Callable[[list[torch.Tensor]], Any] | None = None  # the forward's output, from its tensors
        self.n_out = 0
        self.rng: _RngState | None = None
        self.autocast: list[tuple[str, bool, torch.dtype]] = []
        self.unused: list[bool] = []
        # deprecated norm hooks in fn's module (_norm_hooks), and those whose weight the forward set: returned as outputs too
        # (weakly: the weight set on a module has a graph through this call, and a cycle would be left to Python's collector)
        self.hooked = [(weakref.ref(m), h.name) for m, h in _norm_hooks(getattr(fn, "module", None))]
        self.normed: list[tuple[weakref.ref, str]] = []
        self.returned_inputs: dict[int, int] = {}  # output position -> the argument (tensor position) it is, as it is
        # output position -> ("input" or "output", the position of the tensor it is a view of, (size, stride, offset))
        self.views: dict[int, tuple[str, int, tuple]] = {}
        self.snapshots = Snapshots()  # the step's buffers as the forward found them, for the recompute
        self.bank, self.dtype = current_buffers(), current_compute_dtype()  # what fzero.apply ran with in the forward
        self.cached = _parametrize_caching()  # under torch.nn.utils.parametrize.cached() in the forward
        self.hits: set = set()  # the cache keys an earlier forward in that cached() had filled (_not_stepping)
        self.cache_made: set[int] = set()  # ids of the tensors this forward put in that cache

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", None) or type(self.fn).__name__

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        leaves = list(self.leaves)
        k = 0
        while k < len(tensors):
            pos = self.tensor_pos[k]
            x = leaves[pos]
            n = x.n if isinstance(x, _Opened) else 1  # an opened container's tensors come in a row
            leaves[pos] = x.rebuild(tensors[k:k + n]) if isinstance(x, _Opened) else tensors[k]
            k += n
        args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        weights = [m().__dict__.get(name) for m, name in self.hooked]
        outs, rebuild = _tree.tensors_and_rebuild(self.fn(*args, **kwargs))  # dataclasses too
        if self.rebuild is None:
            self.rebuild, self.n_out = rebuild, len(outs)
            self.normed = [(m, name) for (m, name), w in zip(self.hooked, weights) if m().__dict__.get(name) is not w]
        elif len(outs) != self.n_out or [o.shape for o in outs] != self.shapes:
            raise RuntimeError(
                f"fzero.remat: the recompute of {self.name} returned {len(outs)} tensors of shapes "
                f"{[tuple(o.shape) for o in outs]}, its forward {self.n_out} of shapes {[tuple(s) for s in self.shapes]}; "
                f"the wrapped function must be deterministic in what it returns."
            )
        self.shapes = [o.shape for o in outs]
        return outs + [m().__dict__[name] for m, name in self.normed]


class _RngState:
    """The CPU RNG state this thread draws from, and that of each CUDA device among the inputs, replayed by
    the recompute.

    Both are read and replayed through ``fzero.mesh.rng`` (``fzero/mesh/_rank.py``): in a rank thread of a ``local_mesh`` that is
    the rank's own stream (as in a torchrun process), never the global generator the rank threads share,
    so the recompute draws the mask this rank's forward drew, and no other rank's draws move it.
    """

    def __init__(self, tensors, module: torch.nn.Module | None = None, args: Any = ()) -> None:
        from fzero.mesh import rng as _rng

        self.cuda = sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                            for t in tensors if t.device.type == "cuda"})
        self.cpu_state = _rng.get_state()
        self.cuda_states = [_rng.cuda_get_state(d) for d in self.cuda]
        self.host = [(get, put, get()) for get, put in _host_streams(module, args)]

    @contextlib.contextmanager
    def replay(self):
        from fzero.mesh import rng as _rng

        # As fork_rng: every generator is put back afterwards, so the recompute does not advance them.
        cuda_now = [_rng.cuda_get_state(d) for d in self.cuda]
        host_now = [get() for get, _, _ in self.host]
        try:
            for d, state in zip(self.cuda, self.cuda_states):
                _rng.cuda_set_state(state, d)
            for _, put, state in self.host:
                put(state)
            with _rng.replay(self.cpu_state):
                yield
        finally:
            for d, state in zip(self.cuda, cuda_now):
                _rng.cuda_set_state(state, d)
            for (_, put, _), state in zip(self.host, host_now):
                put(state)


def _host_streams(module: torch.nn.Module | None, args: Any = ()) -> list[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """(read the state, set it) of each random stream besides torch's own generators that a forward may draw from:
    Python's ``random`` and NumPy's global ``RandomState`` (the module-level functions, which in a rank thread of a
    ``local_mesh`` act on the rank's own, ``fzero/mesh/_rank.py``), and the stream objects ``module``'s tree holds
    (``self.gen = torch.Generator()``, ``self.rng = np.random.default_rng()``, a ``random.Random``: a unit's, as
    fzero's remat of units gives ``fn.module``). Replayed for the recompute as torch's are: before, the recompute drew
    new numbers from them, so its masks were not the forward's (6.4e-3 to 7.6e-3 off PyTorch after one AdamW step at
    every stage, silently), and each stream moved on twice per step. ``args``: the call's argument leaves, whose streams
    are replayed too (a ``torch.Generator`` in the batch, handed down to each block: 8.7e-2 off DDP after 3 SGD steps at
    stage 3 on local_mesh(2), silently, the stream moved on twice a step)."""
    import random
    import sys

    from fzero.layout import RANDOM_STREAMS

    out: list[tuple[Callable[[], Any], Callable[[Any], None]]] = [(lambda: random.getstate(), lambda s: random.setstate(s))]
    np = sys.modules.get("numpy")
    if np is not None:
        out.append((lambda: np.random.get_state(), lambda s: np.random.set_state(s)))
    seen: set[int] = set()
    held = [] if module is None else [v for m in module.modules() for v in _held_streams(m.__dict__.values(), seen)]
    for v in held + list(_held_streams(args, seen)):
        get, put = RANDOM_STREAMS[type(v)]
        out.append((functools.partial(get, v), functools.partial(put, v)))
    return out


def _held_streams(values: Any, seen: set[int]) -> Iterator[Any]:
    """The random streams among ``values`` (a module's ``__dict__`` values), and in the built-in lists, tuples, sets and
    dicts among them, at any depth (``self.gens = [torch.Generator()]`` is held as well as ``self.gen = ...``: before, a
    stream in a container was not replayed, so the recompute drew another mask than the forward, 3.8e-2 off PyTorch after
    two AdamW steps, silently). ``seen``: the ids met so far, each stream yielded once, each container walked once."""
    from fzero.layout import RANDOM_STREAMS

    for v in values:
        if id(v) in seen:
            continue
        kind = type(v)
        if kind in RANDOM_STREAMS:
            seen.add(id(v))
            yield v
        elif kind in (list, tuple, set, frozenset) or kind is dict:
            seen.add(id(v))
            yield from _held_streams(v.values() if kind is dict else v, seen)
        elif kind is _Opened:  # an argument's dict or list subclass or dataclass: its copy holds the same streams
            seen.add(id(v))
            x = v.skeleton
            inner = (x.values() if isinstance(x, dict) else x if isinstance(x, list)
                     else [getattr(x, f.name, None) for f in dataclasses.fields(x)])
            yield from _held_streams(inner, seen)


def _parametrize_caching() -> bool:
    from torch.nn.utils import parametrize

    return bool(parametrize._cache_enabled)


@contextlib.contextmanager
def _own_parametrize_cache(enabled: bool):
    """Run the forward, or its recompute, with a cache of parametrized tensors of its own
    (``torch.nn.utils.parametrize.cached()``, a dict global to the process), on as it was in the forward.

    A ``cached()`` around the step (or the forward) kept what the ``no_grad`` forward computed, a weight without a graph,
    and the recompute inside it read that back: the parametrization's original got no gradient (orthogonal's 100% off
    PyTorch after 4 AdamW steps at stage 3). A ``cached()`` inside ``loss_fn`` had ended before the backward, so the
    recompute ran uncached where the forward had not. Nothing is swapped where no cache is on (the rank threads of a
    local_mesh, where ``fzero.apply`` refuses one, so the global is never swapped from two threads)."""
    from torch.nn.utils import parametrize

    if not enabled and not parametrize._cache_enabled:
        yield
        return
    saved = parametrize._cache, parametrize._cache_enabled
    parametrize._cache, parametrize._cache_enabled = {}, int(enabled)
    try:
        yield
    finally:
        parametrize._cache, parametrize._cache_enabled = saved


class _OuterCache(dict):
    """torch's cache of parametrized tensors (``parametrize._cache``) in a ``cached()`` in which remat forwards ran, put in
    its place with the same entries (the ``cached()`` drops it when it ends, as it drops its own), holding the cache
    those forwards share (``forwards``). A read outside the units of a stateful tensor a remat forward computed (the
    model's forward reading a unit's spectral-normed weight after the unit ran) would compute it again, stepping its
    state twice where PyTorch reuses the unit's (1.8e-3 off PyTorch's params, 5.3e-2 off its vectors after 4 AdamW steps
    at stage 0, silently): refused (``_CACHED_ACROSS``)."""

    def __init__(self, entries: dict) -> None:
        super().__init__(entries)
        self.forwards = _ForwardsCache(self)

    def get(self, key, default=None):
        if key not in self and key in self.forwards and key in self.forwards.stateful:
            raise RuntimeError(_CACHED_ACROSS.format(name=self.forwards.stateful[key], where="inside a unit under remat",
                                                     other="outside it, after the unit ran"))
        return super().get(key, default)


class _ForwardsCache(dict):
    """The cache of parametrized tensors the remat forwards under one ``parametrize.cached()`` share (``_OuterCache``).
    ``outer``: torch's cache, and ``stateful``: the keys of the parametrizations of the units run so far that hold buffers
    (``spectral_norm``'s vectors), each with its name, for ``get``."""

    def __init__(self, outer: dict) -> None:
        super().__init__()
        self.outer, self.stateful = outer, {}
        self.scope: Any = None  # a weak reference to the micro-batch's buffer bank the entries were computed in

    def enter(self, bank: Any) -> None:
        """Start afresh in another micro-batch (a step's forward, with its own bank): a ``cached()`` around several
        steps would otherwise hand a later step the weights of the params before its update, where PyTorch refuses a
        second backward through the first one's graph."""
        if bank is None or (self.scope is not None and self.scope() is bank):
            return
        self.clear()
        self.stateful = {}
        self.scope = weakref.ref(bank)

    def get(self, key, default=None):
        """A key torch's cache holds but this one does not was computed outside the remat'ed units in this cached() (a
        read in the model's forward before the block): PyTorch's unit reuses it, with its graph, which remat cannot
        differentiate through, so the unit computes it again, as the same value where the parametrization is a pure
        function; a stateful one (spectral_norm) would step twice (4.9e-4 off PyTorch's params, 4e-2 off its vectors
        after 4 AdamW steps, silently), so it is refused."""
        if key not in self and key in self.stateful and isinstance(dict.get(self.outer, key), torch.Tensor):
            raise RuntimeError(_CACHED_ACROSS.format(name=self.stateful[key], where="outside the remat'ed units",
                                                     other="inside a unit under remat"))
        return super().get(key, default)


_CACHED_ACROSS = """fzero.remat: {name} is a parametrized tensor with state (spectral_norm's power-iteration vectors) that
parametrize.cached() computed {where} earlier in this step, and it is read again {other}. PyTorch computes it once per
cached() and reuses it, with its graph, but a unit under remat runs without one and recomputes in backward: computing it
again would step its state twice (silently off PyTorch), so the step stops here. Fix: read it only inside its unit (or
only outside the units), or take parametrize.cached() off the step, or build the step without remat
(compile(..., remat=False))."""


@contextlib.contextmanager
def _forward_parametrize_cache(call: "_Call"):
    """Run a remat forward under ``parametrize.cached()`` with the cache the forwards in that ``cached()`` share, noting
    in ``call.hits`` what the earlier ones computed (``_not_stepping``).

    PyTorch computes a parametrized tensor once per ``cached()``: a unit called twice (a block run twice with one set of
    weights) reads the first call's weight, and ``spectral_norm`` runs its power iteration once. With a cache of its own
    each remat forward computed it again: the power iteration ran once per call (6.8e-4 off PyTorch's params and 1.2e-2
    off its vectors after 4 AdamW steps). Its own no-grad weights never reach torch's cache, whose other readers (outside
    remat) would get no graph, as ``_own_parametrize_cache`` says: the shared cache is held by torch's, an ``_OuterCache``
    put in its place for the rest of the ``cached()``."""
    from torch.nn.utils import parametrize

    if not call.cached:
        with _own_parametrize_cache(False):
            yield
        return
    cache = parametrize._cache
    if not isinstance(cache, (_ForwardsCache, _OuterCache)):
        cache = parametrize._cache = _OuterCache(cache)
    shared = cache if isinstance(cache, _ForwardsCache) else cache.forwards
    shared.enter(call.bank)
    call.hits = set(shared)
    shared.stateful.update(_stateful_keys(getattr(call.fn, "module", None)))
    parametrize._cache = shared
    try:
        yield
    finally:
        parametrize._cache = cache
        # what this forward computed, for the cached() to hand to the next forwards: no escape (_RematForward.forward)
        call.cache_made = {id(t) for k, t in shared.items() if k not in call.hits}


class _Probed(Exception):
    def __init__(self, key: Any) -> None:
        super().__init__(key)
        self.key = key


class _KeyProbe(dict):
    def get(self, key, default=None):  # torch's cache is read with .get((id(module), name)) before anything is computed
        raise _Probed(key)


def _cache_key(module: torch.nn.Module, name: str) -> Any:
    """The key under which ``parametrize.cached()`` keeps ``module.name`` (the id of the module the parametrization was
    registered on, which fzero's copies of a module keep), read off the cache's lookup before anything is computed."""
    from torch.nn.utils import parametrize

    saved = parametrize._cache, parametrize._cache_enabled
    parametrize._cache, parametrize._cache_enabled = _KeyProbe(), 1
    try:
        getattr(module, name)
    except _Probed as probed:
        return probed.key
    finally:
        parametrize._cache, parametrize._cache_enabled = saved
    return None


def _stateful_keys(module: torch.nn.Module | None) -> dict:
    """The cache keys (``_cache_key``) of ``module``'s parametrizations that hold buffers, each with its name."""
    from torch.nn.utils import parametrize

    if module is None:
        return {}
    return {_cache_key(m, name): f"{type(m).__name__}.{name}" for m in module.modules() if parametrize.is_parametrized(m)
            for name in m.parametrizations if any(True for _ in m.parametrizations[name].buffers())}


@contextlib.contextmanager
def _not_stepping(call: "_Call"):
    """The recompute of a forward that read a parametrized tensor an earlier forward had computed (``call.hits``) runs
    that parametrization in eval mode: it computes the tensor again (with a graph, from the same values) without
    stepping its state (``spectral_norm``'s power iteration, which that forward never ran; its vectors are replayed as
    that forward found them, after the earlier one's iteration). Only for fzero's units (``fn.module``)."""
    from torch.nn.utils import parametrize

    module = getattr(call.fn, "module", None)
    if not call.hits or module is None:
        yield
        return
    lists = [m.parametrizations[name] for m in module.modules() if parametrize.is_parametrized(m)
             for name in m.parametrizations if _cache_key(m, name) in call.hits]
    modes = [(sub, sub.training) for lst in lists for sub in lst.modules()]
    for lst in lists:
        lst.train(False)
    try:
        yield
    finally:
        for sub, mode in modes:
            sub.training = mode


def _autocast_state(devices) -> list[tuple[str, bool, torch.dtype]]:
    types = sorted({d.type for d in devices if d.type != "meta"} | {"cpu"})
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


def _replay_autocast(state) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device_type, enabled, dtype in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
    return stack


def under_remat() -> bool:
    """Whether this thread runs a function ``remat`` recomputes, under its watch (``_NoCapturedGrad``, a
    TorchFunctionMode): ``jit`` refuses to compile there, where torch.compile would fall back to eager silently."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, _NoCapturedGrad) for m in _get_current_function_mode_stack())


def _norm_hooks(module: torch.nn.Module | None) -> list[tuple[torch.nn.Module, Any]]:
    """The (module, hook) pairs of torch's deprecated ``torch.nn.utils.weight_norm`` / ``spectral_norm`` among the modules
    of ``module`` (a unit: what fzero's remat of units gives as ``fn.module``) whose hook has set its weight on its
    module as a plain attribute (a forward pre-hook computes it at every call).

    Such a weight outlives the call, and a model may read it after the call, outside the unit (``self.blocks[0].fc.weight``
    in its forward). Made in the forward, which runs under no_grad, it had no graph: that read trained without its
    gradient (0.62 off PyTorch after 2 SGD steps at stages 0-1, 1.1e-2 at stage 3, silently). So each weight the forward
    set is returned by the remat'ed call as one more output (``_Call.run``), which has a graph through the recompute as
    the call's own outputs have, and set on its module after the call (``_remat_call``): read or not, it costs no more
    than the tensor the hook left there (a gradient comes only where it is read)."""
    if module is None:
        return []
    return [(m, h) for m in module.modules() if m._forward_pre_hooks for h in m._forward_pre_hooks.values()
            if isinstance(h, _DEPRECATED_NORMS) and isinstance(m.__dict__.get(h.name), torch.Tensor)]


def _object_states(call: "_Call") -> list[tuple[str, Any, Any]]:
    """``(where, object, description)`` of each leaf of fn's arguments that is an object holding state."""
    tree = torch_pytree.tree_unflatten(call.leaves, call.spec)
    leaves, _ = torch_pytree.tree_flatten_with_path(tree)
    leaves = [(path, x.skeleton if isinstance(x, _Opened) else x) for path, x in leaves]
    return [(_where(path), x, _describe(x, _DEPTH, set())) for path, x in leaves if x is not _SLOT and _holds_state(x)]


class _RematForward(Function):
    @staticmethod
    def forward(call, *inputs):
        call.devices = [x.device for x in inputs]
        call.rng = _RngState(inputs, getattr(call.fn, "module", None), call.leaves)
        call.autocast = _autocast_state(call.devices)
        before = _object_states(call)
        versions = [x._version for x in inputs]
        watch = _NoCapturedGrad(call, inputs, call.diff)
        with torch.no_grad(), watch, recording(call.snapshots), _forward_parametrize_cache(call):
            outs = call.run(list(inputs))
        _check_inputs_unwritten(call, inputs, versions)
        _check_unchanged(call, before)
        escaped = _escaped(watch, outs, call.cache_made)
        call.cache_made = set()
        if escaped:
            raise RuntimeError(_ESCAPED.format(name=call.name, n=len(escaped),
                                               what=", ".join(f"{tuple(t.shape)} {t.dtype}{_held_where(t)}" for t in escaped[:3])))
        del watch
        # A Function must not return one of its inputs as is, nor one tensor twice.
        first: dict[int, int] = {}  # id of each tensor ``fn`` returned -> the first position it was returned at
        res = []
        for i, o in enumerate(outs):
            given = next((j for j, x in enumerate(inputs) if o is x), None)
            if given is not None:  # (unwritten: checked above) handed back as that very argument by ``_remat_call``: a
                # write into it after the call reaches the caller's references to it, as without remat (a view of it,
                # made by a Function, could not be written: "Output 0 of _RematForward is a view")
                call.returned_inputs[i] = given
                o = o.view_as(o)
            elif id(o) in first:
                # one tensor returned twice (``return h, h``): made again by ``_remat_call`` as an alias of its first
                # position, so that a write into either reaches the other and its gradient, as without remat (a
                # ``view_as`` here was a view made by a Function, which torch refuses to see written in place)
                call.views[i] = ("output", first[id(o)], (tuple(o.size()), tuple(o.stride()), o.storage_offset()))
                o = o.detach()
            elif o._is_view():
                first[id(o)] = i
                # a view made in the forward (a Linear on a 3-d input reshapes its 2-d product), returned as it is, is an
                # output that torch refuses to see written in place ("Output 0 of _RematForward is a view and is being
                # modified inplace"), where torch.utils.checkpoint's output may be (h = block(h); h.mul_(2)). Detached
                # (no grad here), it is no view: the same memory and version counter
                _view_of(call, i, o, inputs, outs)
                o = o.detach()
            else:
                first[id(o)] = i
            res.append(o)
        return tuple(res)

    @staticmethod
    def setup_context(ctx, inputs, output):
        call, *ins = inputs
        ctx.call = call
        if call.offload == "cpu":
            # From CUDA, a non-blocking copy to the host lands in pinned memory (torch pins the destination
            # of a non_blocking device-to-host _to_copy). It is ordered on the current stream before any
            # reuse of the device input's memory. On the CPU it is a separate buffer.
            ins = [x.detach().to("cpu", non_blocking=True, copy=True) for x in ins]
        ctx.save_for_backward(*ins)
        ctx.mark_non_differentiable(*[o for o in output if not _differentiable(o)])
        ctx.set_materialize_grads(False)  # an output without a gradient comes as None: nothing to allocate

    @staticmethod
    def backward(ctx, *grad_outs):
        call = ctx.call
        saved = ctx.saved_tensors
        wanted = _wanted_now(ctx, call.diff)
        if not any(wanted):
            return (None,) * (1 + len(saved))
        grads = list(_RematBackward.apply(call, wanted, len(saved), *saved, *grad_outs))
        unused = iter(call.unused)
        out = [None]
        for need in wanted:
            g = grads.pop(0) if need else None
            out.append(None if g is None or next(unused) else g)
        return tuple(out)


def _view_of(call: "_Call", i: int, o: torch.Tensor, inputs: tuple, outs: Any) -> None:
    """Record in ``call.views`` that output ``i`` (``o``, a view) is a view of an argument or of another output (its
    base): ``_remat_call`` makes it again on that tensor outside the Function. Detached alone, it would share their memory
    but not their graph: a write into the base after the call (``h, cls = block(x); h.mul_(2)``, ``cls = h[:, 0]``)
    changed ``cls``'s values but not its gradient (silently), where PyTorch records the write in the view."""
    base = o._base
    geometry = (tuple(o.size()), tuple(o.stride()), o.storage_offset())
    for k, x in enumerate(inputs):
        if x is base or (x._is_view() and x._base is base):
            call.views[i] = ("input", k, geometry)
            return
    for k, x in enumerate(outs):
        if x is base:
            call.views[i] = ("output", k, geometry)
            return


def _wanted_now(ctx: Any, diff: list[bool]) -> tuple[bool, ...]:
    """Of ``fn``'s differentiable inputs, those whose gradient this backward goes on to use.

    A backward that asks for some gradients only (``torch.autograd.grad(loss, x)`` inside ``loss_fn``, as adversarial
    training takes the input's gradient before the real loss) still calls this node, and the recompute's own
    ``torch.autograd.grad`` would otherwise differentiate with respect to every input, running what lies behind one
    whose gradient nobody asked for: at stage 3 the unit's gather, whose backward reduces the params' gradient into
    the step's, so the input's gradient trained the params too (2.5e-2 off PyTorch after 3 steps). The engine says
    which of this node's next functions it will run (``next_functions``: one per tensor input, in order)."""
    edges = getattr(ctx, "next_functions", None)
    if edges is None or len(edges) != len(diff):  # not a plain autograd node (torch.func's): every input, as before
        return tuple(diff)
    return tuple(need and node is not None and _will_run(node) for need, (node, _) in zip(diff, edges))


def _will_run(node: Any) -> bool:
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf that torch.autograd.grad captures ("a leaf node was passed ... not supported"): asked for
        return True


class _RematBackward(Function):
    @staticmethod
    def forward(call, wanted, n_in, *rest):
        saved, grad_outs = rest[:n_in], rest[n_in:]
        # Host copies go back to their device; the copy from pinned memory is asynchronous on the current
        # stream, ordered before the recompute that reads it.
        ins = [x.to(d, non_blocking=True) if x.device != d else x for x, d in zip(saved, call.devices)]
        leaves = [x.detach().requires_grad_() if need else x for x, need in zip(ins, wanted)]
        # fn gets a view of each leaf, not the leaf: a hook on a module's input that asks the engine which nodes it will
        # run (torch.autograd.graph.register_multi_grad_hook, which torch.utils.flop_counter.FlopCounterMode's module
        # tracker puts on every module's inputs) fails on a leaf inside torch.autograd.grad ("A leaf node was passed to
        # _will_engine_execute_node ..."), and the product below is such a call. The gradient is the view's, as the leaf's
        # (the views are made with grad on: a Function's forward runs without)
        # The product is taken in the recompute's context and scope: a torch.utils.checkpoint inside fn calls its layers
        # again during it, and they must find what the recompute ran with (recompute_scope).
        normed = [m().__dict__[name] for m, name in call.normed]  # the recompute sets them again: put back after it
        with torch.enable_grad(), call.rng.replay(), _replay_autocast(call.autocast), recompute_scope(), \
                as_in_forward(call.bank, call.dtype), replaying(call.snapshots), _own_parametrize_cache(call.cached), \
                _not_stepping(call):
            given = [x.view_as(x) if need else x for x, need in zip(leaves, wanted)]
            outs = call.run(given)
            pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
            wrt = [x for x, need in zip(leaves, wanted) if need]
            grads = [None] * len(wrt)
            if pairs:
                grads = list(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        for (m, name), weight in zip(call.normed, normed):  # (the recomputed one would keep the recomputed graph alive)
            m().__dict__[name] = weight
        del outs, pairs, leaves, given, ins  # the recomputed graph is freed here, before the caller's backward goes on
        call.unused = [g is None for g in grads]
        # placeholders for unused inputs (_RematForward.backward turns them into None); a Function must not
        # hand back one of its inputs as is (a gradient may be a grad_out passed straight through)
        return tuple(w.new_empty(0) if g is None else g.view_as(g) if any(g is x for x in rest) else g for g, w in zip(grads, wrt))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "fzero.remat: double backward through a remat'ed function is not supported (its backward is a recompute): "
            "a gradient of a gradient (torch.autograd.grad(..., create_graph=True) in loss_fn or the model, as a "
            "gradient penalty, WGAN-GP or R1 takes it) passes through it. Build the step without remat "
            "(fzero.compile(..., remat=False)), or keep fzero.remat off the function the penalty differentiates.")
