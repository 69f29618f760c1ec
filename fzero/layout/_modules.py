"""The user's module as fzero runs it: binding tensors into it for a call, structural clones of it, and
parameters without values.

## Binding

Putting tensors into a module's parameter and buffer slots for a call, and taking them out again.

This is what ``torch.func.functional_call(module, tensors, tie_weights=True, strict=False)`` does around a call,
and what fzero does for every unit call of every step (twice at stage 3: for the forward and again for the
backward). torch's version walks the whole module tree twice per call (``named_parameters`` and
``named_buffers``, to find tied names) and resolves every name through ``get_submodule``: on one GPU that host
time was a visible part of a stage-3 step of a 124M GPT, whose kernels then waited for it.

``Binding`` does the walk once (``Binding.of``), and binding is then a dictionary write per name. Its
semantics are torch's, point by point:

- a given name that is a parameter slot is written in ``_parameters``, a buffer slot in ``_buffers``;
- every other name that holds the *same tensor object* (a tied weight) gets the same tensor, and two given
  names of one tie with different tensors are an error;
- on restore, each slot gets its original tensor back, in reverse order, and where the call replaced a
  given slot's tensor (a module that assigns ``self.buf = ...``), the new tensor is written back into the
  given mapping, as torch writes it back into the dictionary it was given.

A name that is not a parameter or buffer slot (a new attribute) is not handled here: ``bound`` falls back to
torch's own context manager for such a call, so every case keeps torch's behaviour.

## Clones

Structural clones of a module: new module objects, tensors shared, no mutable container shared.

fzero runs a module without writing into it (one exception, after a train step: the refusal of a direct call of a module
the state has moved on from, ``fzero.step._module``): each step runs a clone of the user's module (at stages 2-3 a
*skeleton*: trainable params replaced by meta tensors, units made to gather before they run), on every
rank, because ``torch.func.functional_call`` swaps tensors into module attributes while it runs, and because
a forward may write into its module: Hugging Face installs its output-capturing forward hooks lazily, from
inside the first forward that asks for hidden states, attentions or router logits, and a module may append to
a list it holds. ``copy.deepcopy`` does not serve: it copies every tensor it finds in an attribute, and
refuses a non-leaf one ("Only Tensors created explicitly by the user support the deepcopy protocol"), which is
what a forward hook that keeps an activation on a module leaves there.

So the module tree gets new objects, each with its own ``__dict__``, and every container in a ``__dict__``
(the hook dictionaries ``_forward_hooks``, ``_forward_pre_hooks``, ``_backward_hooks`` and the rest, and any
dict, list or set a module keeps; built-in types only, not subclasses) is copied one level deep: the clone starts with the hooks and entries the
module has, and what is added to it or removed from it stays in the clone. Hook functions, tensors, configs
and other objects are shared. A container that two modules share stays shared between their clones (one copy
per container), as tied parameters stay tied.

## What a forward writes on its module

The clone is fzero's copy, but the forward is the user's, and what it writes on ``self`` is the user's data:
Lightning 2.x's ``self.training_step_outputs.append(loss)`` in ``training_step``, a counter ``self.calls += 1``, an
MoE block's ``self.aux_loss = ...`` read after the step. Plain PyTorch keeps it on the module; dropping it with the
copy would lose it without a word. So ``Writes`` records what the copies changed in the modules' **public**
attributes (names without a leading underscore; ``_parameters``, the hook dictionaries and the rest of
``nn.Module``'s own, and the private flags a library keeps, such as transformers' ``_output_capturing_hooks_installed``
beside the hooks it installed in the copy, stay the copy's): a value rebound, added or deleted, or a built-in
container whose entries changed. A copy made later in the same call (a stage 2-3 skeleton per micro-batch) starts
with those changes laid over it, so the second micro-batch sees the first's counter as in PyTorch. When the step
call succeeds, the changes are written into the user's modules, a container in place, so that a list held
elsewhere sees the appends (one the forward rebound is a new object, as in PyTorch). A value naming a module of the
copy (a bound method, a submodule in a list) is written as naming the user's module. On a ``local_mesh`` of several
ranks the calling thread plays rank 0, whose writes are kept (each torchrun process keeps its own); a step that
raises keeps none, as it keeps no update. Objects shared rather than copied (one inside a container, a tensor
written in place, a module shared by ``_bound_to``) are written where they are, as in PyTorch, in one process of
one rank. A rank of several in one process (``Writes(private=True)``, a ``local_mesh``'s thread) would write them
while the others read them, so its copies take copies of their own (``_private``) of the objects public names hold,
kept for the step call; rank 0's are written back into the user's objects, in place, when the call succeeds.

## Empty params

Models whose parameters have no values yet are built under ``fzero.empty_params()`` (``fzero.layout._empty``).
``check_no_meta`` is what ``fzero.apply`` runs before a forward: a meta tensor the forward would read from the
module (a buffer nobody gave a value, a parameter outside ``params``) is named, with the fix, instead of failing
deep in the model with torch's "Cannot copy out of meta tensor".
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import random
import sys
import types
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from fzero.layout._empty import META_BUFFER_FIX


_KINDS = ("_parameters", "_buffers")


def walk(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` in ``named_modules(remove_duplicate=False)``'s order (pre-order, every path to a shared
    submodule), the prefix ending in "." (empty for ``module``): by a stack, without torch's nested generators."""
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        yield prefix, m
        subs = m.__dict__["_modules"]
        if subs:  # most modules are leaves: no list made for them (a step walks its whole tree several times)
            stack.extend([(f"{prefix}{key}.", c) for key, c in reversed(subs.items()) if c is not None])


def named_tensors(module: nn.Module, kind: str, *, remove_duplicate: bool = True,
                  persistent_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """``module.named_parameters()`` (``kind="_parameters"``) or ``named_buffers()`` (``"_buffers"``), the same names in
    the same order, from one ``walk``: torch's nested generators cost a step's host time (fzero runs this per step).
    ``persistent_only``: the buffers ``state_dict()`` holds, without the non-persistent ones (rotary tables, masks)."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, m in walk(module):
        skip = m.__dict__["_non_persistent_buffers_set"] if persistent_only else ()
        for key, t in m.__dict__[kind].items():
            if t is None or id(t) in seen or key in skip:
                continue
            if remove_duplicate:
                seen.add(id(t))
            out.append((prefix + key, t))
    return out


class Binding:
    """Where each parameter and buffer name of one module tree lives, and which names are tied; made by ``of``."""

    __slots__ = ("module", "slots", "ties")

    def __init__(self, module: nn.Module, slots: dict[str, tuple[nn.Module, str, str, torch.Tensor]],
                 ties: dict[str, tuple[str, ...]]) -> None:
        self.module = module
        self.slots = slots  # dotted name -> (owning module, "_parameters" | "_buffers", key, tensor found there)
        self.ties = ties  # dotted name -> every name holding the same tensor object (only names with a tie)

    @classmethod
    def of(cls, module: nn.Module) -> "Binding":
        """One walk of ``module``'s tree (every path to a shared submodule, as ``remove_duplicate=False`` walks)."""
        # ``walk``'s order, inlined (a step makes one per unit call and one per ``fzero.apply``: the generator, the
        # per-kind loop and the list per tensor were most of its cost); a tensor's first name in ``first``, a list only
        # for a tensor held under a second name
        slots: dict[str, tuple[nn.Module, str, str, torch.Tensor]] = {}
        first: dict[int, str] = {}
        tied: dict[int, list[str]] = {}
        stack = [("", module)]
        while stack:
            prefix, m = stack.pop()
            d = m.__dict__
            for kind in _KINDS:
                for key, t in d[kind].items():
                    if t is None:
                        continue
                    name = prefix + key
                    if kind == "_buffers" and name in slots:
                        continue  # a parameter of that name wins, as named_parameters() comes first in torch
                    slots[name] = (m, kind, key, t)
                    held = first.setdefault(id(t), name)
                    if held is not name:
                        tied.setdefault(id(t), [held]).append(name)
            subs = d["_modules"]
            if subs:
                stack.extend((f"{prefix}{key}.", c) for key, c in reversed(subs.items()) if c is not None)
        ties = {n: tuple(names) for names in tied.values() for n in names}
        return cls(module, slots, ties)

    def current(self) -> bool:
        """Whether every slot still holds the tensor it held when the binding was made (nothing re-tied since)."""
        return all(m.__dict__[kind].get(key) is t for m, kind, key, t in self.slots.values())

    def covers(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return all(name in self.slots for name in tensors)

    @contextlib.contextmanager
    def bound(self, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        """``tensors`` in their slots (and in their tied slots) for the length of the block; see the module docstring."""
        writes: dict[str, torch.Tensor] = dict(tensors)
        for name, value in tensors.items():
            for other in self.ties.get(name, ()):
                if other in tensors and tensors[other] is not value:
                    raise ValueError(f"functional_call got multiple values for keys {sorted(self.ties[name])}, which "
                                     f"are tied. Consider using tie_weights=False")
                writes[other] = value
        saved: list[tuple[str, nn.Module, str, str, torch.Tensor]] = []
        try:
            for name, value in writes.items():
                m, kind, key, _ = self.slots[name]
                d = m.__dict__[kind]
                saved.append((name, m, kind, key, d[key]))
                d[key] = value
            yield
        finally:
            for name, m, kind, key, orig in reversed(saved):
                d = m.__dict__[kind]
                now = d.get(key)
                d[key] = orig
                if name in tensors and now is not None:
                    tensors[name] = now


def bound(module: nn.Module, tensors: dict[str, torch.Tensor], binding: Binding | None = None):
    """``torch.nn.utils.stateless._reparametrize_module(module, tensors, tie_weights=True, strict=False)``, fast:
    a context manager. ``binding``: one made earlier for this module, still ``current()`` (the caller checks)."""
    if binding is None:
        binding = Binding.of(module)
    if binding.covers(tensors):
        return binding.bound(tensors)
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=True, strict=False)


# containers copied one level deep: the built-in types exactly. An object of any other type, a subclass of these
# included, is shared like any other object: its class decides what a copy of it would mean.
_CONTAINERS = frozenset({dict, OrderedDict, list, set})
_TREE = frozenset({"_parameters", "_buffers", "_modules"})  # rebuilt below, entry by entry


def clone_structure(module: nn.Module, *, param: Callable[[nn.Parameter], torch.Tensor] | None = None,
                    buffer: Callable[[torch.Tensor], torch.Tensor] | None = None, writes: "Writes | None" = None,
                    made: dict[int, nn.Module] | None = None) -> nn.Module:
    """A copy of ``module``'s tree of module objects; ``param``/``buffer`` map each parameter/buffer (default:
    the same tensor). Shared submodules stay shared, tied parameters stay tied (one mapping per tensor), and
    no container of the clone is one of ``module``'s (see the module docstring).

    The walk is a method of a ``_Cloner``, not a recursive closure: a nested function that calls itself holds
    itself through its closure cell, a reference cycle, so its memo (every clone and every mapped tensor) would
    outlive the call until Python's cyclic collector ran: a step's whole skeleton, with its cast buffers and
    frozen params, kept after the step that made it, and the collector's passes paid on the host every step.

    ``writes``: the public attribute changes earlier copies in the same step call made (``Writes``), laid over
    the clone once its tree is made (a value naming a module of the tree, its bound method say, names the new copy);
    the clone's copies of the module's public containers are recorded there, so that a container the forward mutated
    is told from one it rebound.

    ``made``: the copies made earlier in the same step call, by ``id`` of the module each copies: a module among
    them is not copied again but is that copy (a module run inside its parent and on its own is one copy, as it is
    one module, so what both forwards write on it adds up); the new copies are added to it."""
    cloner = _Cloner(param, buffer, writes, made)
    clone = cloner.visit(module)
    if writes is not None and writes.changed:
        cloner.lay_over(writes.changed)
    return clone


class _Cloner:
    """One ``clone_structure`` call: its memos (by ``id``: module, tensor, container) and its mappings."""

    __slots__ = ("param", "buffer", "copies", "private", "modules", "fresh", "tensors", "containers", "origins")

    def __init__(self, param: Callable[[nn.Parameter], torch.Tensor] | None,
                 buffer: Callable[[torch.Tensor], torch.Tensor] | None, writes: "Writes | None",
                 made: dict[int, nn.Module] | None = None) -> None:
        self.param, self.buffer = param, buffer
        self.copies = None if writes is None else writes.copies
        self.private = None if writes is None else writes.private
        self.origins = None if writes is None else writes.origins
        self.modules: dict[int, nn.Module] = {} if made is None else made
        self.fresh: list[int] = []  # the modules this call copied (``modules`` may hold earlier calls' copies)
        self.tensors: dict[int, torch.Tensor] = {}
        self.containers: dict[int, Any] = {}

    def mapped(self, t: Any, fn: Callable[[Any], torch.Tensor] | None) -> Any:
        if t is None or fn is None:
            return t
        out = self.tensors.get(id(t))
        if out is None:
            out = self.tensors[id(t)] = fn(t)
        return out

    def visit(self, m: nn.Module) -> nn.Module:
        new = self.modules.get(id(m))
        if new is not None:
            return new
        cls = m.__class__
        new = cls.__new__(cls)
        self.modules[id(m)] = new
        self.fresh.append(id(m))
        if self.origins is not None:
            self.origins[id(new)] = id(m)
        d = new.__dict__
        containers, private = self.containers, self.private
        own_callable = False
        for k, v in m.__dict__.items():  # one pass; the per-entry work is what a step pays for every module
            kind = type(v)
            # (a random stream under a private name too: ``self._rng``, drawn from, is no less the rank's own)
            if private is not None and (k[:1] != "_" or kind in _STREAMS) and (kind in _COPIED or isinstance(v, torch.Tensor)):
                c = d[k] = _private(v, private)  # one rank of several in this process: its own objects, all through
                if c is not v:
                    self.copies[id(c)] = (c, v)
            elif kind in _CONTAINERS and k not in _TREE:
                c = containers.get(id(v))
                if c is None:
                    c = containers[id(v)] = v.copy()
                    if self.copies is not None and k[:1] != "_":
                        self.copies[id(c)] = (c, v)
                d[k] = c
            else:
                if kind in _CALLABLES and not own_callable:
                    own_callable = _bound_to(v, m)
                d[k] = v
        if own_callable and not _holds_tensors(m):  # shared, not cloned: see _bound_to (a rank of several: a deep copy)
            shared = m if private is None else _private_module(m, private)
            self.modules[id(m)] = shared
            if self.origins is not None:
                self.origins[id(shared)] = id(m)
            return shared
        param, buffer, mapped = self.param, self.buffer, self.mapped
        d["_parameters"] = {k: mapped(p, param) for k, p in m._parameters.items()} if param else dict(m._parameters)
        d["_buffers"] = {k: mapped(b, buffer) for k, b in m._buffers.items()} if buffer else dict(m._buffers)
        if private is not None and m._non_persistent_buffers_set:
            _private_buffers(d["_buffers"], m._non_persistent_buffers_set, private)
        d["_modules"] = {k: None if c is None else self.visit(c) for k, c in m._modules.items()}
        return new

    def lay_over(self, changed: "dict[int, tuple[nn.Module, dict[str, Any]]]") -> None:
        """Earlier copies' changes on this clone's modules: the earlier copy's own objects (a list appended to goes on
        growing), except that a value naming one of the user's modules (``Writes`` keeps them so) names its copy here."""
        own = {i: self.modules[i] for i in self.fresh if i in changed}  # never an earlier call's copy, in use already
        for i, new in own.items():
            d = new.__dict__
            for k, v in changed[i][1].items():
                if v is _GONE:
                    d.pop(k, None)
                else:
                    d[k] = _renamed(v, self.modules)


_CALLABLES = frozenset({types.MethodType, types.FunctionType, functools.partial})
_GONE = object()  # a public attribute the copy deleted
_MODULE_OWN = frozenset(nn.Module().__dict__) - {"training"}  # nn.Module.__init__'s private state


class Writes:
    """What the forwards of one step call, on one rank, changed in the public attributes of the user's modules
    through fzero's copies of them, to be written into those modules when the call succeeds (see "What a forward
    writes on its module" in the module docstring)."""

    __slots__ = ("changed", "copies", "private", "origins")

    def __init__(self, *, private: bool = False, start: Callable[[Any], Any] | None = None) -> None:
        self.changed: dict[int, tuple[nn.Module, dict[str, Any]]] = {}  # id(user's module) -> (it, {name: value})
        self.copies: dict[int, tuple[Any, Any]] = {}  # id(a copy's public container) -> (it, the module's it copies)
        # id(a module of a copy's tree) -> id(the user's module it copies), for the copies made with this record: a
        # submodule slot of a copy holding anything else was set by the forward (``_refuse_replaced``)
        self.origins: dict[int, int] = {}
        # ``private``: this rank is one of several in this process (a local mesh's), which must not write the user's
        # objects while the others read them: id(a mutable object the modules hold) -> (this rank's copy, the object)
        # ``start``: where this rank's copy of a random stream the modules hold starts (``HeldStreams.start``: its own
        # end state of the last step call, as a torchrun process's goes on); None: the object's own state
        self.private: dict[int, tuple[Any, Any]] | None = _Memo(start) if private else None

    def note(self, original: nn.Module, copy: nn.Module, *, seen: set[int] | None = None) -> None:
        """Record what ``copy`` (``clone_structure(original, writes=self)``) holds in public attributes that
        ``original`` does not: every change of this call so far, since the copy started from the earlier ones.
        One walk of the two trees side by side; a module shared rather than copied was written in place.

        A value that names a module of the copy (a bound method of it, the module itself, as such a value or an entry
        of a container) is recorded as naming the user's module, as it would in PyTorch: kept as the copy's, it would
        keep the step's copy (at stages 2-3 the skeleton, with the step's unit params) alive on the user's module,
        and calling it would run that copy. A tensor whose memory was freed (a view of a unit's params, gathered for
        its call at stage 3) is refused by name: kept, it would crash the process where it is read.

        The copy is done with once noted, so what its forward wrote on it (public or not) is dropped from it: a tensor
        kept with its graph (``self.act = self.lin(x)``) at stages 2-3 holds the unit's autograd node, which holds the
        skeleton back, a cycle through torch's C++ graph that Python's collector cannot see: each step's skeleton,
        graph and saved activations would stay allocated for good.

        ``seen``: the ids of the modules noted already by the calls this one is part of (the roots of one step call,
        whose copies may share a submodule's copy): each copy is noted once, since noting drops what it wrote."""
        changed, renamed = self.changed, None
        seen = set() if seen is None else seen
        stack = [(original, copy)]
        while stack:
            o, c = stack.pop()
            if c is o or id(o) in seen or (self.private is not None and id(o) in self.private):
                continue  # shared, noted already, or a module copied whole for this rank (kept by keep_private)
            seen.add(id(o))
            od, cd = o.__dict__, c.__dict__
            diff, stale = _changes(od, cd)
            if diff:
                if any(_names_a_module(v) for v in diff.values()):
                    renamed = renamed if renamed is not None else _originals(original, copy)
                    diff = {k: _renamed(v, renamed) for k, v in diff.items()}
                _refuse_freed(original, o, diff)
                changed[id(o)] = (o, diff)
            else:
                changed.pop(id(o), None)
            for k in stale:
                del cd[k]
            copies = cd["_modules"]
            _refuse_replaced(original, o, od["_modules"], copies, self.origins)
            for k, sub in od["_modules"].items():
                csub = copies.get(k)
                if sub is not None and csub is not None:
                    stack.append((sub, csub))

    def keep(self) -> None:
        """Write the recorded changes into the user's modules; a built-in container in place (its object stays the
        one the module had, so what holds it sees the new entries). A tensor, as the value or as an entry of a
        container written, is kept detached: the step's backward has run, and its graph would hold what the step made
        (at stage 3 the units' gathers) until the attribute is next written; under ``autodiff="func"`` it is the
        plain tensor inside ``torch.func.grad``'s wrapper, which would otherwise outlive its transform."""
        back = _keep_private(self.private) if self.private else _detached
        for module, diff in self.changed.values():
            d = module.__dict__
            for k, v in diff.items():
                v, old = back(v), d.get(k, _GONE)
                if v is old or (type(v) is tuple and type(old) is tuple and _same_entries(list(v), list(old))):
                    continue  # a rank's own copy of the module's object (several ranks in one process): written back
                # in place only where the copy's container is its copy of this one: one the forward rebound
                # (``self.rows = []``) is a new object, as in PyTorch, and a list held elsewhere keeps what it had;
                # an attribute that was None and is now a list (torchvision's MultiScaleRoIAlign.scales, set on its
                # first forward) is rebound, not matched to the None of a container the copy never had
                copied = self.copies.get(id(v))
                in_place = copied is not None and copied[1] is old and old is not _GONE
                if v is _GONE:
                    d.pop(k, None)
                elif type(v) in _CONTAINERS:
                    v = _entries_mapped(v, back)
                    if not in_place:
                        d[k] = v
                    elif type(v) is list:
                        old[:] = v
                    else:  # a set, a dict
                        old.clear()
                        old.update(v)
                else:
                    d[k] = _detached(v)
        self.changed, self.copies, self.origins = {}, {}, {}
        self.private = None if self.private is None else _Memo(getattr(self.private, "start", None))


def _entries_mapped(v: Any, fn: Callable[[Any], Any]) -> Any:
    """A new built-in container of ``v``'s type whose entries (a dict's values) are ``fn`` of ``v``'s."""
    return type(v)((k, fn(x)) for k, x in v.items()) if isinstance(v, dict) else type(v)(map(fn, v))


def _detached(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(v):
        v = functorch.get_unwrapped(v)
    return v.detach()


# what a rank of several in one process copies (``_private``): the built-in containers and the standard library's
# mutable collections a forward appends to or counts in, tensors and random streams (``_STREAMS``); any other object is shared
_PRIVATE = frozenset({dict, OrderedDict, list, set, collections.defaultdict, collections.Counter, collections.deque})


def _random_streams() -> dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], None]]]:
    """The random stream objects a forward may draw from, kept on a module (``self.gen``, ``self.rng``), by type: how to
    read and set each one's state. A ``torch.Generator``, Python's ``random.Random``, NumPy's ``RandomState`` and
    ``Generator`` (NumPy where installed: torch imports it then, so it is in ``sys.modules`` by now). Each torchrun
    process holds its own copy of such an object, seeded alike; the rank threads of a ``local_mesh`` shared one and drew
    from it in turn, in whatever order the threads ran."""
    found: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], None]]] = {
        torch.Generator: (lambda g: g.get_state(), lambda g, state: g.set_state(state)),
        random.Random: (lambda g: g.getstate(), lambda g, state: g.setstate(state)),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        found[np.random.RandomState] = (lambda g: g.get_state(legacy=False), lambda g, state: g.set_state(state))
        found[np.random.Generator] = (lambda g: g.bit_generator.state,
                                      lambda g, state: setattr(g.bit_generator, "state", state))
    return found


_STREAMS = _random_streams()
RANDOM_STREAMS = _STREAMS  # (what other packages read: remat replays the streams a unit's modules hold)
_COPIED = _PRIVATE | {tuple} | set(_STREAMS)  # what ``_private`` may copy, tensors aside (a tensor subclass is one)


def _same_state(a: Any, b: Any) -> bool:
    """Whether two states of a random stream (``_STREAMS``) are one: tensors, NumPy arrays, dicts, tuples, numbers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a NumPy array (a Mersenne Twister's key)
        np = sys.modules["numpy"]
        return bool(np.array_equal(a, b))
    return a == b


class _Memo(dict):
    """``Writes.private``: id(an object the modules hold) -> (this rank's copy, the object, what the copy started as),
    and ``start``, where this rank's copy of a random stream starts (``HeldStreams.start``; None: the object's state)."""

    __slots__ = ("start",)

    def __init__(self, start: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        self.start = start


class HeldStreams:
    """Where each rank's copy of a random stream the modules hold (``_STREAMS``: ``self._rng``, ``self.gen``, one in a
    container) ended in the last step call of a local mesh of several ranks, so that the next call goes on from it.

    Each rank copies such a stream for the call (``_private``) and rank 0's state is written back on the user's object.
    A torchrun process goes on from its own stream's state at its next step; had every rank's copy started again from
    the object (rank 0's state), ranks that draw other amounts in a step (a draw per non-padding token, per example of
    a variable-length batch) would diverge from torchrun: rank 1 drew rank 0's numbers from the second step on (2.6e-3
    to 8.6e-3 off torchrun in the params after 4 SGD steps, silently). So rank r starts from its own end state of the
    last call, as long as the object still holds what that call left in it (rank 0's: nothing drew from it or set it
    in between, as ``fzero.mesh``'s ``Carry`` asks of the global generators); where it does not (reseeded, drawn from
    between steps, or a step on a mesh of another size or on no mesh drew from it), every rank starts from the
    object's state, as every torchrun process would after the same reseed. Held beside the global generators' states (``Carry.held``), one for every
    local mesh of a size in the process: the steps on any ``local_mesh(n)`` of the process stand for the same n
    processes, whose one module object each of them draws from. It holds each stream object it has seen (a few KiB
    each; NumPy's take no weak reference) for as long as the process lives."""

    def __init__(self) -> None:
        # id(the user's stream) -> (it, its state when the last call ended, each rank's copy's end state). The object
        # is held so that its id names it alone (NumPy's streams take no weak reference); a few KiB each
        self.ends: dict[int, tuple[Any, Any, list[Any]]] = {}

    def start(self, v: Any, *, rank: int, n: int) -> Any:
        """The state rank ``rank`` of ``n`` starts its copy of the stream ``v`` in (see the class docstring)."""
        now = _STREAMS[type(v)][0](v)
        last = self.ends.get(id(v))
        if last is not None and last[0] is v and len(last[2]) == n and _same_state(now, last[1]):
            return last[2][rank]
        return now

    def keep(self, writes: "list[Writes]") -> None:
        """``writes[0].keep()`` (rank 0's writes, its streams' states among them, into the user's objects), after
        noting where each rank's copy of each stream ended; a rank that copied no stream the others did keeps the
        state it would have started from (its stream did not move)."""
        memos = [w.private or {} for w in writes]
        streams = {i: e[1] for memo in memos for i, e in memo.items() if type(e[1]) in _STREAMS}
        ends = {}
        for i, v in streams.items():
            get_state = _STREAMS[type(v)][0]
            ends[i] = [get_state(memo[i][0]) if i in memo else self.start(v, rank=r, n=len(memos))
                       for r, memo in enumerate(memos)]
        writes[0].keep()
        for i, v in streams.items():
            self.record(v, ends[i])

    def record(self, v: Any, ends: list[Any]) -> None:
        """Each rank's copy of the stream ``v`` ended in ``ends`` (rank order), and ``v`` holds rank 0's state now. A
        ``torch.Generator`` in the batch is copied per rank too (``fzero.step._batch.split_batch``), and noted here."""
        self.ends[id(v)] = (v, _STREAMS[type(v)][0](v), ends)


def _private(v: Any, memo: dict[int, tuple[Any, Any]]) -> Any:
    """This rank's own copy of ``v`` (see ``Writes``: one of several ranks in this process): a container of
    ``_PRIVATE``'s types copied with its entries' copies, a tensor cloned (a parameter is the step's to place),
    a tuple rebuilt where an entry was copied; anything else is ``v`` itself. ``memo``: id(object) -> (its copy,
    it), for the whole step call, so two modules sharing an object share its copy, and a later copy of a module (a
    stage 2-3 skeleton per micro-batch) meets what the earlier one wrote."""
    hit = memo.get(id(v))
    if hit is not None:
        return hit[0]
    kind = type(v)
    if kind in _PRIVATE:
        c = v.copy() if kind is dict or kind is list else copy.copy(v)  # a defaultdict's factory, a deque's maxlen
        memo[id(v)] = (c, v)
        if isinstance(c, dict):
            for k, x in list(c.items()):
                c[k] = _private(x, memo)
        elif kind is not set:  # a set's members are hashable values, not written in place
            items = [_private(x, memo) for x in c]
            c.clear()
            c.extend(items)
        # the copy's entries as made: one the call left so is not written back over what loss_fn (or another path to
        # ``v``) wrote on ``v`` itself during the call
        memo[id(v)] = (c, v, dict(c) if isinstance(c, dict) else set(c) if kind is set else list(c))
        return c
    if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
        if v.requires_grad and not v.is_leaf:  # computed from the user's tensors: shared, as before, so that a loss it
            return v                           # reaches is refused as on one rank (a detached copy trained silently)
        c = _private_view(v, memo)
        if c is not None:
            return c
        c = v.detach().clone()
        if v.requires_grad:  # never requires_grad_(False): under torch.func.grad any requires_grad_ call is refused
            c.requires_grad_()
        memo[id(v)] = (c, v, _version(v))  # v's version now: a write on v by another path (loss_fn, a private name)
        return c
    stream = _STREAMS.get(kind)
    if stream is not None:  # a generator the forward draws from (torch.randn(..., generator=self.gen), self.rng.random()):
        # each torchrun process has its own, seeded alike; shared by the rank threads, the ranks drew from one stream in
        # the order the threads ran (found by the diffusers sweep for torch's: 3e-2 off DDP after 3 SGD steps on 2 ranks,
        # varying run to run; NumPy's and Python's by a sweep of models nobody here wrote: 7e-3 after 4 AdamW steps)
        get_state, set_state = stream
        c = torch.Generator(device=v.device) if kind is torch.Generator else copy.deepcopy(v)
        start = getattr(memo, "start", None)  # this rank's own state from the last step call (HeldStreams)
        state = get_state(v) if start is None else start(v)
        set_state(c, state)
        memo[id(v)] = (c, v, state)
        return c
    if kind is tuple:
        items = tuple(_private(x, memo) for x in v)
        return items if any(a is not b for a, b in zip(items, v)) else v
    return v


def _private_view(v: torch.Tensor, memo: dict[int, tuple[Any, Any]]) -> torch.Tensor | None:
    """This rank's copy of ``v``, a view of another tensor (``v._base``), as the same view of this rank's copy of that
    base, so that the copies alias as the originals do (a non-persistent buffer ``head = cache[:4]`` that the forward
    reads after writing ``cache`` in place: cloned apart, ``head`` kept its old values on a local mesh, 4e-2 off DDP
    after 3 SGD steps, silently). None where ``v`` is no view, or its base is not copied (a parameter) or not copied
    alike (its copy's layout differs): ``v`` is then cloned on its own, as before."""
    base = v._base
    if base is None or v.requires_grad or base.requires_grad or isinstance(base, nn.Parameter) or base.is_meta:
        return None
    cb = _private(base, memo)
    if cb is base or not isinstance(cb, torch.Tensor) or cb.stride() != base.stride() or base.storage_offset() != 0 \
            or cb.storage_offset() != 0 or cb.dtype != v.dtype:
        return None
    c = cb.as_strided(v.size(), v.stride(), v.storage_offset())
    memo[id(v)] = (c, v, _version(v))  # type: ignore[assignment]  # (as _private's entries: a third item)
    return c


def _private_buffers(buffers: dict[str, Any], names: set[str], memo: dict[int, tuple[Any, Any]]) -> None:
    """This rank's own copies (``_private``) of the non-persistent buffers among ``buffers`` (a copy's ``_buffers``).
    The step's bank stands in for the persistent ones; the non-persistent ones (rotary tables, masks, a running average
    kept out of the state_dict) are the module's, and a forward that writes one in place wrote the one tensor every
    rank thread reads: twice a step on ``local_mesh(2)``, where each torchrun process writes its own and DDP hands
    every rank rank 0's at each forward (``broadcast_buffers`` covers every buffer). Rank 0's copy is written back
    when the call succeeds (``_keep_private``), so each step starts every rank from it, as DDP does."""
    for k in names:
        b = buffers.get(k)
        if isinstance(b, torch.Tensor):
            buffers[k] = _private(b, memo)


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter, or None where it has none (an inference tensor)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _written(c: torch.Tensor, o: torch.Tensor, base: int | None) -> bool:
    """Whether this rank's copy ``c`` of the tensor ``o`` (at version ``base`` when copied) holds a write of the call:
    written in place (a fresh clone's version counter starts at 0), or, where nothing else wrote ``o`` meanwhile, values
    other than ``o``'s (a write no counter sees: ``.data``, a kernel's in-place statistics). A copy left as it was never
    writes its old values over ``o``: what ``loss_fn`` or a private name of the module wrote on ``o`` itself stays."""
    if o.is_meta:
        return False
    if _version(c):
        return True
    if base is not None and _version(o) != base:
        return False
    return o.shape != c.shape or o.dtype != c.dtype or o.device != c.device or not torch.equal(o, c)


def _private_module(m: nn.Module, memo: dict[int, tuple[Any, Any]]) -> nn.Module:
    """This rank's own copy of a module shared rather than cloned (``_bound_to``: a torchmetrics ``Metric``), by
    ``copy.deepcopy``, whose protocol such a class defines for itself (a metric's ``clone()`` is one)."""
    hit = memo.get(id(m))
    if hit is not None:
        return hit[0]
    try:
        c = copy.deepcopy(m)
    except Exception as e:
        raise TypeError(
            f"fzero.apply: {type(m).__name__}, which the forward updates through methods bound to it (as a torchmetrics "
            f"Metric), must be copied for each rank of a local_mesh of several ranks (one process), as each torchrun "
            f"process has its own, and copy.deepcopy failed ({type(e).__name__}: {e}). Make it deep-copyable, keep it "
            f"outside the modules the step runs, or run the ranks under torchrun."
        ) from e
    memo[id(m)] = (c, m)
    return c


def _keep_private(memo: dict[int, tuple[Any, Any]]) -> Callable[[Any], Any]:
    """Write rank 0's copies (``_private``, ``_private_module``) into the objects they copy, in place: a container's
    entries (each entry copied written back as the object it copies), a tensor's values, a module's state. Returns
    the map from a copy to what it copies (anything else: itself, detached if a tensor) for ``Writes.keep``."""
    originals = {id(c): o for c, o, *_ in memo.values()}
    # the tensors whose values the call changed, all found before any is written (two views of one tensor are copied
    # apart, and the one left as it was must not write its old values over the other's)
    changed = {id(c) for c, o, *base in memo.values() if isinstance(o, torch.Tensor) and _written(c, o, base[0])}

    def back(x: Any) -> Any:
        if type(x) is tuple:  # rebuilt by _private around copied entries
            return tuple(back(e) for e in x)
        o = originals.get(id(x), _GONE)
        return _detached(x) if o is _GONE else o

    for c, o, *base in memo.values():
        if isinstance(o, nn.Module):
            _keep_module(o, c, back)
        elif isinstance(o, torch.Tensor):
            if id(c) not in changed:
                continue
            with torch.inference_mode() if o.is_inference() else torch.no_grad():
                if o.shape != c.shape or o.dtype != c.dtype or o.device != c.device:  # resized in place by the forward
                    o.set_(_detached(c))
                else:
                    o.copy_(c)
        elif type(o) in _STREAMS:
            get_state, set_state = _STREAMS[type(o)]
            if not _same_state(get_state(c), base[0]):  # rank 0 drew from it: the user's generator goes on from there
                set_state(o, get_state(c))
        elif base and _same_entries(base[0], dict(c) if isinstance(c, dict) else list(c) if type(c) is collections.deque else c):
            continue  # a container this rank left as it was copied
        elif isinstance(o, dict):
            entries = {k: back(x) for k, x in c.items()}
            o.clear()
            o.update(entries)  # a mapping: a Counter's update(iterable) counts the (key, value) pairs as elements
        elif type(o) is list:
            o[:] = [back(x) for x in c]
        elif type(o) is collections.deque:
            o.clear()
            o.extend(back(x) for x in c)
        else:  # a set
            o.clear()
            o.update(back(x) for x in c)
    return back


def _keep_module(original: nn.Module, copy_: nn.Module, back: Callable[[Any], Any]) -> None:
    """A module copied whole for rank 0 (``_private_module``): its state, private names included (a metric's
    ``_update_count``), into the user's, except the methods bound to the copy; submodules likewise."""
    stack = [(original, copy_)]
    while stack:
        o, c = stack.pop()
        od = o.__dict__
        for k, v in c.__dict__.items():
            if k == "_modules":
                stack.extend((od["_modules"][n], sub) for n, sub in v.items() if sub is not None and od["_modules"].get(n) is not None)
            elif k not in _TREE and not _bound_to(v, c):
                od[k] = _entries_mapped(v, back) if type(v) in _CONTAINERS else back(v)


def _names_a_module(v: Any) -> bool:
    """Whether ``v``, or an entry of ``v`` where it is a built-in container, is a module or a method bound to one."""
    if type(v) in _CONTAINERS:
        return any(_names_a_module(x) for x in (v.values() if isinstance(v, dict) else v))
    return isinstance(v, nn.Module) or (type(v) is types.MethodType and isinstance(v.__self__, nn.Module))


def _originals(original: nn.Module, copy: nn.Module) -> dict[int, nn.Module]:
    """id(a module of ``copy``'s tree) -> the module of ``original``'s it copies (one walk; only where a value names one)."""
    found: dict[int, nn.Module] = {}
    stack = [(original, copy)]
    while stack:
        o, c = stack.pop()
        if id(c) in found:
            continue
        found[id(c)] = o
        copies = c.__dict__["_modules"]
        stack.extend((sub, copies[k]) for k, sub in o.__dict__["_modules"].items() if sub is not None and copies.get(k) is not None)
    return found


def _renamed(v: Any, modules: dict[int, nn.Module]) -> Any:
    """``v`` with a module, or a method bound to one, that ``modules`` maps (by id) replaced by what it maps to;
    a built-in container's entries likewise (a new container only where an entry changed)."""
    kind = type(v)
    if kind in _CONTAINERS:
        if not _names_a_module(v):
            return v
        if isinstance(v, dict):
            return kind((k, _renamed(x, modules)) for k, x in v.items())
        return kind(_renamed(x, modules) for x in v)
    if kind is types.MethodType:
        to = modules.get(id(v.__self__))
        return v if to is None else types.MethodType(v.__func__, to)
    if isinstance(v, nn.Module):
        return modules.get(id(v), v)
    return v


def _refuse_freed(root: nn.Module, module: nn.Module, diff: dict[str, Any]) -> None:
    """Refuse a tensor among ``diff``'s values (or a container's entries) whose memory is gone: a view of a unit's
    params gathered for its call at stage 3, whose buffer is freed once the unit has run."""
    for k, v in diff.items():
        for x in (v.values() if isinstance(v, dict) else v) if type(v) in _CONTAINERS else (v,):
            if isinstance(x, torch.Tensor) and freed(x):
                path = next((n for n, sub in root.named_modules(remove_duplicate=False) if sub is module), "?")
                name = f"{path}.{k}" if path else k
                raise RuntimeError(
                    f"fzero.apply (stage 3): the forward kept a tensor of shape {tuple(x.shape)} on `{name}` that is a "
                    f"view of a unit's parameters, gathered for the unit's call and freed once it ran: after the step it "
                    f"would hold no values (reading it crashes the process). Keep a copy of it in the forward "
                    f"(`self.{k} = <the tensor>.detach().clone()`), or read the trained parameters after the step with "
                    f"`step.gather(state)`."
                )


def _refuse_replaced(root: nn.Module, module: nn.Module, own: dict[str, Any], copied: dict[str, Any],
                     origins: dict[int, int]) -> None:
    """Refuse a submodule the forward set on a copy of ``module`` (``own``/``copied``: the two ``_modules``): one
    replaced (``self.act = nn.ReLU()``; Hugging Face BigBird's ``set_attention_type``, which its forward calls when the
    sequence is too short for block-sparse attention), added or deleted. The copy is fzero's and is dropped after the
    step, where PyTorch keeps the new submodule on the module: each step would start from the module as it was while
    its public attributes carried the forward's other writes (BigBird's ``attention_type``), and the new module's public
    attributes were written onto the old one as if it were its copy (0.7 off PyTorch after 3 SGD steps of a Linear
    whose Tanh the first forward replaced by a ReLU, silently; BigBird's second step failed deep in its attention)."""
    changed = [k for k in own if k not in copied] if len(own) != len(copied) else []
    for k, c in copied.items():  # a dict lookup per submodule: this runs for every module a step copied
        o = own.get(k, _GONE)
        if c is not o and (o is _GONE or o is None or c is None or origins.get(id(c)) != id(o)):
            changed.append(k)
    if not changed:
        return
    path = next((n for n, sub in root.named_modules(remove_duplicate=False) if sub is module), "?")
    k = sorted(changed)[0]
    name = f"{path}.{k}" if path else k
    old, new = own.get(k), copied.get(k)
    what = (f"added the submodule `{name}` ({type(new).__name__})" if k not in own else
            f"deleted the submodule `{name}` ({type(old).__name__})" if k not in copied else
            f"replaced the submodule `{name}` ({type(old).__name__}) with a {type(new).__name__}")
    raise RuntimeError(
        f"fzero.apply: the forward of {type(root).__name__} {what}. Within a step fzero runs a copy of your module and "
        f"never changes its structure, so the next step would run the module as it was before (PyTorch keeps the new "
        f"submodule), silently. Make the change before fzero.params_of and step.init: call what the forward calls to "
        f"make it (for Hugging Face BigBird, whose forward switches to full attention for sequences too short for "
        f"block-sparse attention: model.set_attention_type('original_full'), or config.attention_type="
        f"'original_full'), or set the submodule once in __init__ and have the forward choose between them."
    )


def freed(t: torch.Tensor) -> bool:
    """Whether ``t`` has elements but its storage no longer has the bytes they need (resized to 0 when freed)."""
    if t.is_meta or t.layout is not torch.strided or t.numel() == 0 or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own: not a gathered view
        return False
    return nbytes < (t.storage_offset() + 1) * t.element_size()


def _changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The public entries of a copy's ``__dict__`` (``new``) that differ from its module's (``old``): rebound,
    added, deleted (``_GONE``), or a built-in container whose entries are other objects; and the names of every
    entry of the copy's own that is not the module's object (what the copy drops once noted: ``Writes.note``).
    Runs for every module copied in a step: identity tests only (a tensor's ``==`` is elementwise)."""
    diff: dict[str, Any] = {}
    stale: list[str] = []
    for k in new.keys() - _MODULE_OWN:  # nn.Module's own ~20 entries left out at C speed: the rest are few
        v, o = new[k], old.get(k, _GONE)
        if o is v:
            continue
        stale.append(k)  # a container copied, or what the forward wrote
        if k[:1] == "_" or (type(v) in _CONTAINERS and type(o) is type(v) and _same_entries(o, v)):
            continue
        diff[k] = v
    for k in old.keys() - new.keys():  # a name only the module has: deleted in the copy
        if k[:1] != "_":
            diff[k] = _GONE
    return diff, stale


def _same_entries(a: Any, b: Any) -> bool:
    if len(a) != len(b):
        return False
    if type(a) is list:
        return all(x is y for x, y in zip(a, b))
    if type(a) is set:
        return a == b  # members by hash and identity first
    return all(k in b and b[k] is v for k, v in a.items())


def _bound_to(v: Any, m: nn.Module) -> bool:
    """Whether ``v``, an entry of ``m``'s own ``__dict__``, is a method bound to ``m`` or a wrapper of one
    (``functools.wraps`` sets ``__wrapped__``): torchmetrics' ``Metric`` wraps ``update`` and ``compute`` so at init. A
    clone would share those callables, which act on the original object's state while the clone's own methods act on
    the clone's: a metric updated on one and computed on the other (Lightning's ``self.log("acc", self.acc)`` logged a
    running value for the batch's, and wrong epoch values). Such a module is shared instead of cloned, when nothing
    of a step is bound into it (``_holds_tensors``)."""
    while v is not None:
        if isinstance(v, types.MethodType):
            return v.__self__ is m
        v = getattr(v, "__wrapped__", None)
    return False


def _holds_tensors(m: nn.Module) -> bool:
    """Whether ``m`` or a module under it has a parameter or a buffer (what a step puts in its slots)."""
    return any(sub.__dict__["_parameters"] or sub.__dict__["_buffers"] for _, sub in walk(m))


def check_no_meta(module: nn.Module, names: Iterable[str], *, state_buffers: bool, api: str) -> None:
    """Refuse a forward of ``module`` that would read a meta tensor from the module itself.

    ``names``: the params the call is given (a meta module parameter among them is replaced, so fine).
    ``state_buffers``: persistent buffers come from the train state (inside a step), which names its own meta
    ones; a non-persistent buffer always comes from the module."""
    given = None
    seen: set[int] = set()  # a tied parameter is checked under its first path, as named_parameters names it
    meta_params = []
    for prefix, sub in walk(module):  # one walk for both checks: this runs at every fzero.apply
        for name, b in sub._buffers.items():
            if b is None or not b.is_meta:
                continue
            persistent = name not in sub._non_persistent_buffers_set
            if state_buffers and persistent:
                continue
            why = ("outside a step, the forward reads buffers from the module" if persistent else
                   "it is non-persistent, so no train state or checkpoint holds it: the forward reads it from the module")
            raise ValueError(
                f"{api}: the {'buffer' if persistent else 'non-persistent buffer'} {prefix + name!r} "
                f"of {type(module).__name__} is a meta tensor (a shape without a value), and {why}. {META_BUFFER_FIX}."
            )
        for name, p in sub._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                if p.is_meta:
                    meta_params.append((prefix + name, p))
    for path, p in meta_params:  # after every buffer, as before: a meta buffer is named first
        if p.is_meta:
            given = set(names) if given is None else given
            if path not in given:
                why = "it is frozen (requires_grad=False), so fzero.params_of leaves it out" if not p.requires_grad else "params lacks it"
                raise ValueError(
                    f"{api}: the parameter {path!r} of {type(module).__name__} is a meta tensor and {why}, so the "
                    f"forward would read it from the module. Make it trainable and pass it in params (step.init "
                    f"materializes it), or give the module a real value for it (e.g. load_state_dict(..., assign=True)) "
                    f"before training."
                )

# -- predicates on a module and its tensors that a step reads at every call (fzero.step) ----------------------------


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape, dtype and device) hold the same values, a NaN equal to a NaN: ``torch.equal``
    calls a param holding a NaN (a row never looked up, memory ``torch.empty`` left) unequal to itself, so a check by it
    refused a module nothing wrote."""
    return a.shape == b.shape and bool(torch.eq(a, b).logical_or_(torch.isnan(a) & torch.isnan(b)).all())


def value_changes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element by element, where ``a`` and ``b`` hold other values, a NaN equal to a NaN (``same_values``)."""
    return torch.ne(a, b).logical_and_(~(torch.isnan(a) & torch.isnan(b)))


def has_grad_hooks(p: torch.Tensor) -> bool:
    """Whether trainable ``p`` carries a gradient hook (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``).
    Two attribute reads (the hooks first: ``requires_grad`` is the slower read), ~20 us a step over GPT-2's 148 params:
    meant for the per-step walks over a module's params (``check_no_grad_hooks``)."""
    return bool(p._backward_hooks or p._post_accumulate_grad_hooks) and p.requires_grad


def compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``OptimizedModule``). Read without importing
    ``torch._dynamo`` (seconds of import): no such wrapper exists before dynamo is imported."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` ran on ``module``: ``nn.Module.compile`` keeps ``torch.compile`` of the module's
    own ``_call_impl`` in ``_compiled_call_impl``, which ``__call__`` runs instead. That call is bound to the module it
    was made on, so a step's copy of the module (``fzero.step._context``) would run the original with its own tensors."""
    return getattr(module, "_compiled_call_impl", None) is not None
