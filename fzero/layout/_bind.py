"""Putting tensors into a module's parameter and buffer slots for a call, and taking them out again.

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
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

_KINDS = ("_parameters", "_buffers")


def walk(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(prefix, submodule)`` in ``named_modules(remove_duplicate=False)``'s order (pre-order, every path to a shared
    submodule), the prefix ending in "." (empty for ``module``): by a stack, without torch's nested generators."""
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        yield prefix, m
        stack.extend((f"{prefix}{key}.", c) for key, c in reversed(m.__dict__["_modules"].items()) if c is not None)


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
        slots: dict[str, tuple[nn.Module, str, str, torch.Tensor]] = {}
        by_tensor: dict[int, list[str]] = {}
        for prefix, m in walk(module):
            for kind in _KINDS:
                for key, t in m.__dict__[kind].items():
                    if t is None:
                        continue
                    name = prefix + key
                    if kind == "_buffers" and name in slots:
                        continue  # a parameter of that name wins, as named_parameters() comes first in torch
                    slots[name] = (m, kind, key, t)
                    by_tensor.setdefault(id(t), []).append(name)
        ties = {n: tuple(names) for names in by_tensor.values() if len(names) > 1 for n in names}
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
