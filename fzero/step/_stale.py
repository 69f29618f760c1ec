"""The first step's check that ``loss_fn`` reads nothing stale off a module: a value the forward has replaced.

Within a step, ``fzero.apply(model, params, x)`` runs fzero's copy of ``model`` (``fzero.layout``'s clones, the
stage 2-3 skeletons), and what the forward writes on ``self`` reaches the user's module only when the step returns
("What a forward writes on its module" in ``fzero.layout``). A loss function written for plain PyTorch often reads
such a write right after the forward: an MoE layer's ``self.aux_loss = ...``, added in the loop as
``loss = task + model.aux_loss``. Under fzero that read gets the user's module, which still holds the value from
``__init__`` or from the step before, with no gradient: the loss is off and the router never trains, silently
(measured: 4e-2 off PyTorch's weights after three AdamW steps of a tiny MoE).

A plain attribute read cannot be seen, but what it returns can be chosen. On a step object's first step (where the
other first-step checks run), once ``fzero.apply``'s forward has replaced a tensor the user's module held under a
public name (``note_replaced``), the user's module holds, for the rest of that ``loss_fn`` call, a ``StaleAlias`` of
it in its place: the same memory and value, of a tensor subclass whose torch functions refuse to run outside a
forward, naming the attribute and the fix. So exactly a read of the attribute after the forward is refused: the
tensor itself, held elsewhere (a value ``loss_fn`` read before the forward to compare with, a shared table the module
also held), stays a plain tensor, and no torch function mode is entered (a mode would turn torch's fast paths off for
all of ``loss_fn``: a frozen ``nn.TransformerEncoder`` teacher called in it gave other values). When the call ends,
the user's module gets the tensor back (``StaleWatch.restore``), before the step keeps what the forward wrote.

The ranks of a local mesh share the user's modules, so each alias belongs to the one rank that put it in
(``StaleAlias._fz_watch``; the others leave a place an alias holds as it is, ``_LOCK``) and refuses in that rank's
``loss_fn`` only: seen by another, it is a plain tensor. Refused by any rank's check, a rank that reads the
attribute before its own forward, the value from before the step on purpose, got the first rank's alias whenever that
rank's forward had ended first, and was refused (at random, as the threads ran). Ranks run one ``loss_fn``, so the
rank that put an alias in is refused where the others would be. A copy of the module (``copy.deepcopy``: a teacher
made in ``loss_fn``, a user's thread; ``torch.save``, pickle) copies the tensor, not the alias, and is not refused:
it uses no value in the loss; copied, an alias failed (torch's "default implementation of __deepcopy__() for
non-wrapper subclasses" error) or, pickled, carried the whole module and fzero's class into the file.

Not refused: a tensor the forward replaced with an equal one without a graph (a cached mask rebuilt), one it changed
in place (the copy's too: copies share tensors), one written into the user's module during the forward (a hook that
closes over the module: ``self.captured[k] = out``; ``held_tensors`` says what it held before), and a read inside a
forward. Not seen: a number (a Python ``float``) or an entry of a list or dict read off the module, and a tensor of a
subclass (its own torch functions, which an alias would go around; a wrapper subclass, DTensor say, cannot be aliased:
``_make_subclass`` raised, failing the first step of a module that only held one), and a sparse or nested tensor
(``torch.equal`` has no kernel for them: comparing one failed the first step of a module whose forward rebuilt one, a
graph's normalized adjacency; only dense tensors are compared and aliased).
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from torch import nn

from fzero.mesh import current_context

_GONE = object()
_LOCK = threading.Lock()  # the user's modules are shared by the rank threads of a local mesh


class StaleAlias(torch.Tensor):
    """A tensor the user's module held, put back in its place for the rest of the first ``loss_fn`` call after a
    forward replaced it on fzero's copy: any torch function on it outside a forward, in the ``loss_fn`` call of the
    rank that put it in, is refused (``_refusal``). ``_fz_stale``: (the module holding it, its path from the module
    ``fzero.apply`` ran, that module); ``_fz_original``: the tensor it aliases; ``_fz_watch``: the rank's
    ``StaleWatch`` that put it in (the ``stale`` of that rank's context while its ``loss_fn`` runs)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        watch = current_context().stale  # None inside a forward, after the call, in another thread than a rank's
        if watch is not None and getattr(func, "__name__", "") != "__get__":  # (a property reads no value)
            alias = _owned_alias((*args, *kwargs.values()), watch)
            if alias is not None:
                raise ValueError(_refusal(*alias.__dict__["_fz_stale"]))
        with torch._C.DisableTorchFunctionSubclass():  # elsewhere (a forward, another rank, after the call): plain
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        """The tensor's copy (see the module docstring: a copy of the module uses no value in the loss)."""
        return copy.deepcopy(self.__dict__["_fz_original"], memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save`` of the module, ``copy.copy``) as the tensor it aliases."""
        return self.__dict__["_fz_original"].__reduce_ex__(protocol)


def _owned_alias(values: tuple, watch: "StaleWatch") -> StaleAlias | None:
    """A ``StaleAlias`` that ``watch`` put in, among ``values`` or one level into a list or tuple among them
    (``torch.stack([...])``)."""
    for a in values:
        for x in (a if type(a) in (list, tuple) else (a,)):
            if isinstance(x, StaleAlias) and x.__dict__["_fz_watch"] is watch:
                return x
    return None


def _refusal(module: nn.Module, path: str, root: nn.Module) -> str:
    cls = type(module).__name__
    name = path.rsplit(".", 1)[-1]
    expression = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))  # blocks.0.x: .blocks[0].x
    return (
        f"fzero.Step: loss_fn used `{path}` ({cls}.{name}) read off your module after fzero.apply ran it, but within a "
        f"step the forward runs on fzero's copy of the module, and what it wrote there (a new {name}) reaches your "
        f"module only when the step returns: your module still holds the value from before this step (from __init__ "
        f"or the last step), without its gradient, so the loss would be off and what computes {name} would not train. "
        f"Read it where the forward ran: return it from forward, or run a method that returns it, e.g. "
        f"`def with_aux(self, x): return self(x), self{expression}` on {type(root).__name__}, as "
        f"`out, aux = fzero.apply(model.with_aux, params, x)`. To use the value from before this step on purpose, "
        f"read it before calling fzero.apply.")


class StaleWatch:
    """One rank's first ``loss_fn`` call: the aliases it put into the user's modules (``note_replaced``), taken out
    again by ``restore`` when the call ends, however it ends."""

    def __init__(self) -> None:
        self.installed: list[tuple[dict, str, StaleAlias]] = []

    def put(self, module: nn.Module, key: str, old: torch.Tensor, path: str, root: nn.Module) -> None:
        """``module.key`` (holding ``old``) as a ``StaleAlias`` of ``old``, this watch's, until ``restore``. Where
        another rank's alias holds the place already, it stays (it is that rank's to refuse and to take out)."""
        d = module.__dict__
        with _LOCK:  # the check and the write as one: two ranks never both put one in, one over the other's
            if d.get(key, _GONE) is not old:
                return  # another rank's alias, this one's own (a module reached by two paths), or written since
            alias = torch.Tensor._make_subclass(StaleAlias, old.detach(), old.requires_grad)
            alias.__dict__.update(_fz_stale=(module, path, root), _fz_original=old, _fz_watch=self)
            d[key] = alias
        self.installed.append((d, key, alias))

    def restore(self) -> None:
        with _LOCK:
            for d, key, alias in reversed(self.installed):
                if d.get(key, _GONE) is alias:  # else loss_fn wrote the attribute itself: its value stays
                    d[key] = alias.__dict__["_fz_original"]
        self.installed = []


def held_tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    """The tensors ``module``'s tree holds as public attributes, by id: taken before a forward, so that
    ``note_replaced`` tells a value from before the step from one written into the user's module during it (a hook
    closing over the module)."""
    return {id(v): v for _, _, _, v in _public(module)}


def note_replaced(module: nn.Module, copy: nn.Module, watch: StaleWatch, *, before: dict[int, torch.Tensor],
                  private: dict | None = None) -> None:
    """Put a ``StaleAlias`` (``watch.put``) in the place of each tensor ``module``'s tree held before the forward
    (``before``: ``held_tensors``) and holds still under a public attribute name, which the forward just run on
    ``copy`` (its structural copy) has replaced there: deleted, or another object, unless an equal tensor without a
    graph. ``private``: a local mesh rank's own copies of the module's objects (``fzero.layout.Writes.private``),
    id(the object) -> (this rank's copy, it): the copy holding this rank's copy of a tensor has not replaced it."""
    copies = {"": copy}
    for prefix, o, k, v in _public(module, copies):
        c = copies[prefix]
        if c is o or before.get(id(v)) is not v:
            continue  # shared, not copied (written in place, never stale); or not held before the forward
        now = c.__dict__.get(k, _GONE)
        if _holds(now, v, private) or (isinstance(now, torch.Tensor) and not now.requires_grad and _equal(v, now)):
            continue  # not replaced, or replaced by an equal value (a cache rebuilt): what it holds is current
        watch.put(o, k, v, f"{prefix}.{k}" if prefix else k, module)


def _public(module: nn.Module, copies: dict[str, nn.Module] | None = None) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(path of the module holding it, that module, name, tensor)`` of every public tensor attribute in ``module``'s
    tree (a module's path as ``blocks.0``). ``copies``: path of a module -> its copy, filled in as the walk goes down a
    copy's tree beside it (a submodule the copy lacks is not walked)."""
    out = []
    stack = [("", module)]
    while stack:
        prefix, o = stack.pop()
        for k, v in o.__dict__.items():
            if k[:1] != "_" and type(v) is torch.Tensor and v.layout == torch.strided and not v.is_nested:
                # dense, not a subclass (see the module docstring), nor an alias
                out.append((prefix, o, k, v))
        for k, sub in o.__dict__["_modules"].items():
            path = f"{prefix}.{k}" if prefix else k
            if sub is None:
                continue
            if copies is not None:
                csub = copies[prefix].__dict__.get("_modules", {}).get(k)
                if csub is None:
                    continue
                copies[path] = csub
            stack.append((path, sub))
    return out


def _holds(now: Any, v: torch.Tensor, private: dict | None) -> bool:
    if now is v:
        return True
    own = private.get(id(v)) if private else None
    return own is not None and own[0] is now


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is a dense tensor holding dense ``a``'s values (a subclass, sparse or nested ``b``: not shown)."""
    if type(b) is not torch.Tensor or b.is_nested or b.layout != torch.strided or b.is_meta or a.is_meta:
        return False
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
