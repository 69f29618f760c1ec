"""The first step's check that ``loss_fn`` reads nothing stale off a module: a value the forward has replaced.

Within a step, ``fzero.apply(model, params, x)`` runs fzero's copy of ``model`` (``fzero.layout``'s clones, the
stage 2-3 skeletons), and what the forward writes on ``self`` reaches the user's module only when the step returns
("What a forward writes on its module" in ``fzero.layout``). A loss function written for plain PyTorch often reads
such a write right after the forward: an MoE layer's ``self.aux_loss = ...``, added in the loop as
``loss = task + model.aux_loss``. Under fzero that read gets the user's module, which still holds the value from
``__init__`` or from the step before, with no gradient: the loss is off and the router never trains, silently
(measured: 4e-2 off PyTorch's weights after three AdamW steps of a tiny MoE).

Nothing can be read off a plain attribute access on the user's module without changing its class, which fzero never
does. What can be seen is the stale tensor being *used*: ``StaleReads`` is a ``TorchFunctionMode``, entered for the
first micro-batch of a step object's first step only (where the other first-step checks run), that knows which
tensors the user's modules hold under public names that this step's forwards have replaced in their copies
(``note_replaced``, after each ``fzero.apply``), and refuses an op that takes one, by name, with the fix, before any
update. A tensor the forward replaced with an equal one (a cached mask rebuilt) is let through: its value is current.
A tensor the forward changed in place is the copy's too (copies share tensors), so it is never stale.

What it cannot see: a number (a Python ``float`` or ``int``) read off the module, an entry a forward appended to a
list whose older entries are still current, and reads under ``jit=True`` (a mode active while units compile would be
part of what ``torch.compile`` guards on, and a later step without it would compile them again). A loss function that
reads the value from before this step on purpose (an average with the last step's) takes ``.clone()`` of it before
calling ``fzero.apply``: a copy is not the module's tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_GONE = object()


class StaleReads(TorchFunctionMode):
    """Refuses an op on a tensor that a user's module holds and that this step's forward has replaced on the copy.

    ``replaced``: id(the user's tensor) -> (it, the user's module holding it, its path from the module ``fzero.apply``
    ran, the copy of its module, how to read the current value off the copy, and that module), filled by
    ``note_replaced``."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced: dict[int, tuple[torch.Tensor, nn.Module, str, nn.Module, Any, nn.Module]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.replaced and getattr(func, "__name__", "") != "__get__":  # a property (``.shape``) reads no value
            for t in _tensors_in(args, kwargs):
                entry = self.replaced.get(id(t))
                if entry is not None and entry[0] is t:
                    _refuse_if_stale(entry)
        return func(*args, **kwargs)


def _tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among an op's arguments, and one level into a list or tuple argument (``torch.stack([...])``)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif type(a) in (list, tuple):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _refuse_if_stale(entry: tuple[torch.Tensor, nn.Module, str, nn.Module, Any, nn.Module]) -> None:
    old, module, path, copy, current, root = entry
    now = current(copy)
    if isinstance(now, torch.Tensor) and not now.requires_grad and _equal(old, now):
        return  # replaced by an equal value (a cache rebuilt): what it holds is current
    cls = type(module).__name__
    name = path.rsplit(".", 1)[-1].split("[", 1)[0]
    expression = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))  # blocks.0.x: .blocks[0].x
    raise ValueError(
        f"fzero.Step: loss_fn used `{path}` ({cls}.{name}) read off your module after fzero.apply ran it, but within a step the "
        f"forward runs on fzero's copy of the module, and what it wrote there (a new {name}) reaches your module only "
        f"when the step returns: your module still holds the value from before this step (from __init__ or the last "
        f"step), without its gradient, so the loss would be off and what computes {name} would not train. Read it "
        f"where the forward ran: return it from forward, or run a method that returns it, e.g. "
        f"`def with_aux(self, x): return self(x), self{expression}` on {type(root).__name__}, as "
        f"`out, aux = fzero.apply(model.with_aux, params, x)`. To use the value from before this step on purpose, "
        f"take `.clone()` of it before calling fzero.apply.")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.is_meta or b.is_meta:
        return False
    return bool(torch.equal(a, b))


def note_replaced(module: nn.Module, copy: nn.Module, reads: StaleReads, *, private: dict | None = None) -> None:
    """Record in ``reads`` the tensors ``module``'s tree holds under public attribute names (as the value, or as an
    entry of a list, tuple or dict) that the forward just run on ``copy`` (its structural copy) has replaced there.
    ``private``: a local mesh rank's own copies of the module's objects (``fzero.layout.Writes.private``), id(the
    object) -> (this rank's copy, it): the copy holding this rank's copy of a tensor has not replaced it."""
    stack = [("", module, copy)]
    while stack:
        prefix, o, c = stack.pop()
        if c is o:
            continue  # shared, not copied: written in place, never stale
        od, cd = o.__dict__, c.__dict__
        for k, v in od.items():
            if k[:1] == "_":
                continue
            if isinstance(v, torch.Tensor):
                if not _holds(cd.get(k, _GONE), v, private):
                    reads.replaced[id(v)] = (v, o, prefix + k, c, _attribute(k), module)
            elif type(v) in (list, tuple, dict):
                now = cd.get(k, _GONE)
                entries = v.items() if type(v) is dict else enumerate(v)
                for key, x in entries:
                    if isinstance(x, torch.Tensor) and not _still_in(now, x, private):
                        reads.replaced[id(x)] = (x, o, f"{prefix}{k}[{key!r}]", c, _entry(k, key), module)
        subs = cd.get("_modules", {})
        for k, sub in od["_modules"].items():
            csub = subs.get(k)
            if sub is not None and csub is not None:
                stack.append((f"{prefix}{k}.", sub, csub))


def _holds(now: Any, v: torch.Tensor, private: dict | None) -> bool:
    if now is v:
        return True
    own = private.get(id(v)) if private else None
    return own is not None and own[0] is now


def _still_in(now: Any, x: torch.Tensor, private: dict | None) -> bool:
    if type(now) not in (list, tuple, dict):
        return False
    return any(_holds(y, x, private) for y in (now.values() if type(now) is dict else now))


def _attribute(name: str) -> Any:
    return lambda copy: copy.__dict__.get(name, _GONE)


def _entry(name: str, key: Any) -> Any:
    def current(copy: nn.Module) -> Any:
        held = copy.__dict__.get(name, _GONE)
        try:
            return held[key]
        except (KeyError, IndexError, TypeError):
            return _GONE
    return current
