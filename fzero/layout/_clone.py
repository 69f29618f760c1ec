"""Structural clones of a module: new module objects, tensors shared, no mutable container shared.

fzero runs a module without writing into it: each step runs a clone of the user's module (at stages 2-3 a
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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

# containers copied one level deep: the built-in types exactly. An object of any other type, a subclass of these
# included, is shared like any other object: its class decides what a copy of it would mean.
_CONTAINERS = frozenset({dict, OrderedDict, list, set})
_TREE = frozenset({"_parameters", "_buffers", "_modules"})  # rebuilt below, entry by entry


def clone_structure(module: nn.Module, *, param: Callable[[nn.Parameter], torch.Tensor] | None = None,
                    buffer: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``module``'s tree of module objects; ``param``/``buffer`` map each parameter/buffer (default:
    the same tensor). Shared submodules stay shared, tied parameters stay tied (one mapping per tensor), and
    no container of the clone is one of ``module``'s (see the module docstring)."""
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    containers: dict[int, Any] = {}

    def mapped(t, fn):
        if t is None or fn is None:
            return t
        out = tensors.get(id(t))
        if out is None:
            out = tensors[id(t)] = fn(t)
        return out

    containers_get = containers.get

    def visit(m: nn.Module) -> nn.Module:
        new = modules.get(id(m))
        if new is not None:
            return new
        cls = m.__class__
        new = cls.__new__(cls)
        modules[id(m)] = new
        d = new.__dict__
        for k, v in m.__dict__.items():  # one pass; the per-entry work is what a step pays for every module
            if type(v) in _CONTAINERS and k not in _TREE:
                c = containers_get(id(v))
                if c is None:
                    c = containers[id(v)] = v.copy()
                d[k] = c
            else:
                d[k] = v
        d["_parameters"] = {k: mapped(p, param) for k, p in m._parameters.items()} if param else dict(m._parameters)
        d["_buffers"] = {k: mapped(b, buffer) for k, b in m._buffers.items()} if buffer else dict(m._buffers)
        d["_modules"] = {k: None if c is None else visit(c) for k, c in m._modules.items()}
        return new

    return visit(module)
