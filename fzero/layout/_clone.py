"""Structural clones of a module: new module objects, every tensor and every other attribute shared.

fzero runs a module without writing into it: each stage-2/3 step runs a *skeleton* (the same modules,
trainable params replaced by meta tensors, units swapped for stand-ins), and each simulated rank its
own copy, because ``torch.func.functional_call`` swaps tensors into module attributes while it runs.
``copy.deepcopy`` does not serve: it copies every tensor it finds in an attribute, and refuses a
non-leaf one ("Only Tensors created explicitly by the user support the deepcopy protocol"), which is
what a forward hook that keeps an activation on a module leaves there. Only the module tree needs new
objects; everything a module holds besides its children, parameters and buffers is shared.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def clone_structure(module: nn.Module, *, param: Callable[[nn.Parameter], torch.Tensor] | None = None,
                    buffer: Callable[[torch.Tensor], torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``module``'s tree of module objects; ``param``/``buffer`` map each parameter/buffer (default:
    the same tensor). Shared submodules stay shared, tied parameters stay tied (one mapping per tensor)."""
    modules: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}

    def mapped(t, fn):
        if t is None or fn is None:
            return t
        if id(t) not in tensors:
            tensors[id(t)] = fn(t)
        return tensors[id(t)]

    def visit(m: nn.Module) -> nn.Module:
        if id(m) in modules:
            return modules[id(m)]
        new = m.__class__.__new__(m.__class__)
        modules[id(m)] = new
        new.__dict__.update(m.__dict__)
        new._parameters = {k: mapped(p, param) for k, p in m._parameters.items()}
        new._buffers = {k: mapped(b, buffer) for k, b in m._buffers.items()}
        new._modules = {k: None if c is None else visit(c) for k, c in m._modules.items()}
        return new

    return visit(module)
