"""Per-thread context of a simulated rank.

``torch.func.functional_call`` swaps tensors into the module's attributes for the length of a forward,
so two rank threads running the same module at once would see each other's parameters (and could leave
them behind). On a ``local_mesh`` with more than one rank, every rank thread therefore runs a shallow
clone of the module: new module objects that share every parameter and buffer tensor with the
original, which no rank thread then swaps (so the clones copy a module at rest). Clones live for one
step call; single-rank runs use the module itself.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import nn

from fzero._clone import clone_structure

_local = threading.local()


@contextlib.contextmanager
def simulated_rank(rank: int) -> Iterator[None]:
    """Mark this thread as rank ``rank`` of a multi-rank ``local_mesh`` for the length of one step."""
    _local.rank, _local.clones = rank, {}
    try:
        yield
    finally:
        _local.rank, _local.clones = None, {}


def module_for_thread(module: nn.Module) -> nn.Module:
    """``module`` itself, or in a rank thread of a multi-rank local mesh, this step's clone of it sharing all tensors."""
    rank = getattr(_local, "rank", None)
    if rank is None:
        return module
    clone = _local.clones.get(id(module))
    if clone is None:
        clone = _local.clones[id(module)] = clone_structure(module)
    return clone


@contextlib.contextmanager
def compute_dtype(dtype: "torch.dtype | None") -> Iterator[None]:
    """Within a step under a bf16/fp16 policy: the dtype ``fzero.apply`` casts floating inputs, buffers
    and frozen parameters to, so that they meet the low-precision params (as FSDP's MixedPrecisionPolicy
    casts forward inputs)."""
    outer = getattr(_local, "dtype", None)
    _local.dtype = dtype
    try:
        yield
    finally:
        _local.dtype = outer


def current_compute_dtype() -> "torch.dtype | None":
    return getattr(_local, "dtype", None)


def cast_floating(tree: Any, dtype: "torch.dtype | None") -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    import torch.utils._pytree as torch_pytree

    return torch_pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
