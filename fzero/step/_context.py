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

from fzero.layout._clone import clone_structure

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
def _set(name: str, value: Any) -> Iterator[None]:
    """This thread's ``name`` is ``value`` for the length of the block, then what it was."""
    outer = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield
    finally:
        setattr(_local, name, outer)


@contextlib.contextmanager
def compute_dtype(dtype: "torch.dtype | None") -> Iterator[None]:
    """Within a step under a bf16/fp16 policy: the dtype ``fzero.apply`` casts floating inputs, buffers
    and frozen parameters to, so that they meet the low-precision params (as FSDP's MixedPrecisionPolicy
    casts forward inputs)."""
    with _set("dtype", dtype):
        yield


def current_compute_dtype() -> "torch.dtype | None":
    return getattr(_local, "dtype", None)


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """The length of one micro-batch's forward *and* backward: modules run by ``call_module`` keep the
    tensors they were given until it ends."""
    with contextlib.ExitStack() as stack, _set("scope", stack):
        yield


def call_module(module: nn.Module, tensors: dict[str, torch.Tensor], args: Any, kwargs: Any, *, call: Any = None) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, but within a step the module keeps
    ``tensors`` until the step's backward is done, not only until the forward returns.

    ``torch.utils.checkpoint`` (Hugging Face's ``gradient_checkpointing_enable()``) recomputes a block in
    backward by calling it again: with the tensors put back when the forward returned, the recompute
    would read the module's own stale weights (or a skeleton's meta tensors) and train silently wrong.
    The module is restored when the step's scope closes; the user's module is never left changed.
    ``call``: what to call instead of ``module`` while it holds ``tensors`` (its compiled forward, ``jit=True``).
    """
    from torch.nn.utils.stateless import _reparametrize_module

    scope = getattr(_local, "scope", None)
    run = module if call is None else call
    if scope is None or not torch.is_grad_enabled():  # no graph, no recompute: restore at once
        if call is None:
            return torch.func.functional_call(module, tensors, args, kwargs, tie_weights=True, strict=False)
        with _reparametrize_module(module, tensors, tie_weights=True, strict=False):
            return run(*args, **kwargs)
    scope.enter_context(_reparametrize_module(module, tensors, tie_weights=True, strict=False))
    return run(*args, **kwargs)


@contextlib.contextmanager
def outside_step_scope() -> Iterator[None]:
    """For fzero.remat's own recompute, which needs no module to keep its tensors (and must not keep a
    stage-3 unit's gathered buffer alive until the step ends)."""
    with _set("scope", None):
        yield


@contextlib.contextmanager
def step_buffers(bank: Any) -> Iterator[None]:
    """Within a step's forward: the ``fzero.step._buffers.Buffers`` bank that ``fzero.apply`` runs modules with."""
    with _set("buffers", bank):
        yield


def current_buffers() -> Any:
    return getattr(_local, "buffers", None)


def cast_floating(tree: Any, dtype: "torch.dtype | None") -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    import torch.utils._pytree as torch_pytree

    return torch_pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)
