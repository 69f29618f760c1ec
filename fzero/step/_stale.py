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
first micro-batch of a step object's first step only (where the other first-step checks run) and left while a
forward runs (``outside``: a mode would keep torch's fast paths off), that knows which
tensors the user's modules hold under public names that this step's forwards have replaced in their copies
(``note_replaced``, after each ``fzero.apply``), and refuses an op that takes one, by name, with the fix, before any
update. A tensor the forward replaced with an equal one (a cached mask rebuilt) is let through: its value is current.
A tensor the forward changed in place is the copy's too (copies share tensors), so it is never stale.

A value written into the user's module during the forward (by a hook that closes over the module:
``self.captured[k] = out``) is current, and so is anything the module did not hold before the forward
(``held_tensors``). What it cannot see: a number (a Python ``float`` or ``int``) read off the module, and an entry a
forward appended to a list whose older entries are still current. A loss function that
reads the value from before this step on purpose (an average with the last step's) takes ``.clone()`` of it before
calling ``fzero.apply``: a copy is not the module's tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

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


@contextlib.contextmanager
def outside(reads: StaleReads | None) -> Iterator[None]:
    """The block (a forward, run by ``fzero.apply``) without ``reads`` on torch's mode stack, where it is on top: any
    torch function mode keeps torch's fast paths off (``nn.MultiheadAttention`` and ``nn.TransformerEncoder`` check
    ``has_torch_function``), and the check must not change what the forward runs. A mode the user entered above it
    keeps them off anyway."""
    n = torch._C._len_torch_function_stack()
    if reads is None or n == 0 or torch._C._get_function_stack_at(n - 1) is not reads:
        yield
        return
    mode = torch._C._pop_torch_function_stack()
    try:
        yield
    finally:
        torch._C._push_on_torch_function_stack(mode)


def held_tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    """The tensors ``module``'s tree holds under public attribute names, as the value or as an entry of a list, tuple
    or dict, by id: taken before a forward, so that ``note_replaced`` tells a value from before the step from one
    written into the user's module during it (a hook closing over the module: ``self.captured[k] = out``)."""
    held: dict[int, torch.Tensor] = {}
    for _, _, v in _public(module):
        for x in (v.values() if type(v) is dict else v) if type(v) in (list, tuple, dict) else (v,):
            if isinstance(x, torch.Tensor):
                held[id(x)] = x
    return held


def note_replaced(module: nn.Module, copy: nn.Module, reads: StaleReads, *, before: dict[int, torch.Tensor],
                  private: dict | None = None) -> None:
    """Record in ``reads`` the tensors ``module``'s tree held before the forward (``before``: ``held_tensors``) and
    holds still, under public attribute names (as the value, or as an entry of a list, tuple or dict), that the forward
    just run on ``copy`` (its structural copy) has replaced there: deleted, or another object under that name or key.
    ``private``: a local mesh rank's own copies of the module's objects (``fzero.layout.Writes.private``), id(the
    object) -> (this rank's copy, it): the copy holding this rank's copy of a tensor has not replaced it."""
    copies = {"": copy}
    for prefix, o, v in _public(module, copies):
        c = copies[prefix.rsplit(".", 1)[0] if "." in prefix else ""]
        if c is o:
            continue  # shared, not copied: written in place, never stale
        k = prefix.rsplit(".", 1)[-1]
        now = c.__dict__.get(k, _GONE)
        if isinstance(v, torch.Tensor):
            if before.get(id(v)) is v and not _holds(now, v, private):
                reads.replaced[id(v)] = (v, o, prefix, c, _attribute(k), module)
        elif type(v) in (list, tuple, dict) and type(now) is type(v):
            for key, x in (v.items() if type(v) is dict else enumerate(v)):
                try:
                    y = now[key]
                except (KeyError, IndexError):
                    continue  # gone from the copy's container (popped): not replaced by another value
                if isinstance(x, torch.Tensor) and before.get(id(x)) is x and not _holds(y, x, private):
                    reads.replaced[id(x)] = (x, o, f"{prefix}[{key!r}]", c, _entry(k, key), module)


def _public(module: nn.Module, copies: dict[str, nn.Module] | None = None) -> list[tuple[str, nn.Module, Any]]:
    """``(path, the module holding it, value)`` of every public attribute in ``module``'s tree that is a tensor or a
    list, tuple or dict (paths as ``blocks.0.aux_loss``). ``copies``: path of a module -> its copy, to fill in as the
    walk goes down a copy's tree beside it (a submodule the copy lacks is not walked)."""
    out = []
    stack = [("", module)]
    while stack:
        prefix, o = stack.pop()
        for k, v in o.__dict__.items():
            if k[:1] != "_" and (isinstance(v, torch.Tensor) or type(v) in (list, tuple, dict)):
                out.append((prefix + k, o, v))
        for k, sub in o.__dict__["_modules"].items():
            if sub is None:
                continue
            if copies is not None:
                csub = copies[prefix[:-1]].__dict__.get("_modules", {}).get(k)
                if csub is None:
                    continue
                copies[prefix + k] = csub
            stack.append((f"{prefix}{k}.", sub))
    return out


def _holds(now: Any, v: torch.Tensor, private: dict | None) -> bool:
    if now is v:
        return True
    own = private.get(id(v)) if private else None
    return own is not None and own[0] is now


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
