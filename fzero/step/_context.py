"""Per-thread context of a step.

``torch.func.functional_call`` swaps tensors into the module's attributes for the length of a forward, and a
forward may write into its module (Hugging Face installs its output-capturing hooks lazily, from inside the
forward). So within a step, on every rank (one process, a ``local_mesh`` rank thread, a torchrun process),
``fzero.apply`` runs a clone of the user's module: new module objects that share every parameter and buffer
tensor with the original and no mutable container (``fzero.layout._clone``). The clones copy a module at rest
and live for one step call; the user's module is never written, not even for the length of a step.
Outside a step, ``fzero.apply`` is ``functional_call`` on the module itself.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch import nn

from fzero.layout import clone_structure

_local = threading.local()


@contextlib.contextmanager
def module_clones() -> Iterator[None]:
    """For the length of one step call on this thread (one rank): ``fzero.apply`` runs clones of the modules it
    is given, one per module, made on first use."""
    with _set("clones", {}):
        yield


def module_for_thread(module: nn.Module) -> nn.Module:
    """Within a step, this step's (and this rank's) clone of ``module``, sharing all its tensors; else ``module``."""
    clones = getattr(_local, "clones", None)
    if clones is None:
        return module
    clone = clones.get(id(module))
    if clone is None:
        clone = clones[id(module)] = clone_structure(module)
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
    from fzero.layout import bound

    scope = getattr(_local, "scope", None)
    run = module if call is None else call
    args = args if isinstance(args, tuple) else (args,)  # as functional_call takes a single argument
    kwargs = kwargs or {}
    tensors = tensors if type(tensors) is dict else dict(tensors)  # a dict of the caller's gets torch's write-back
    if scope is None or not torch.is_grad_enabled():  # no graph, no recompute: restore at once
        with bound(module, tensors):
            return run(*args, **kwargs)
    scope.enter_context(bound(module, tensors))
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


@contextlib.contextmanager
def watching_apply() -> Iterator[list]:
    """Within the block, the modules ``fzero.apply`` runs in this thread, each once, in the order first run: for the
    first forward's checks (``fzero.step._batch.LossFnInContext``), which name parameters and agree on structure."""
    modules: list = []
    with _set("applied", modules):
        yield modules


def note_applied(module: nn.Module) -> None:
    modules = getattr(_local, "applied", None)
    if modules is not None and not any(m is module for m in modules):
        modules.append(module)


def cast_floating(tree: Any, dtype: "torch.dtype | None") -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    import torch.utils._pytree as torch_pytree

    return torch_pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# -- buffers under recompute ---------------------------------------------------------------------------
# fzero.remat runs a function twice: under no_grad in the forward, and again with grad in backward. What the
# function writes into the step's buffers (BatchNorm running statistics, spectral-norm vectors) must be written
# once, by the forward, as without remat; and the recompute must read the values the forward read. So while a
# remat forward runs, every buffer the step hands a module is noted with a copy of its value (``Snapshots``), and
# while its recompute runs, the module gets a fresh copy of that value instead: its writes go nowhere.


@contextlib.contextmanager
def as_in_forward(bank: Any, dtype: "torch.dtype | None") -> Iterator[None]:
    """A recompute in backward runs where the forward ran: with the step's buffer bank and compute dtype, which
    the step set only for the length of its forward (without them ``fzero.apply`` would run the module's own
    buffers, and write into them, and skip the low-precision casts)."""
    with _set("buffers", bank), _set("dtype", dtype):
        yield


class Snapshots(dict):
    """``{id(live buffer): (live buffer, its value when the forward first handed it out)}``, for one remat call
    (the live tensor is kept so that its id stays its own)."""


@contextlib.contextmanager
def recording(snapshots: Snapshots) -> Iterator[None]:
    """A remat forward: note each buffer handed out (``buffers_for_run``) into ``snapshots``."""
    with _set("snapshots", snapshots), _set("replay", False):
        yield


@contextlib.contextmanager
def replaying(snapshots: Snapshots) -> Iterator[None]:
    """A remat recompute: hand out copies of the values in ``snapshots`` instead of the live buffers."""
    with _set("snapshots", snapshots), _set("replay", True):
        yield


def buffers_for_run(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's ``buffers`` as a module should run with them now (see the comment above)."""
    snapshots = getattr(_local, "snapshots", None)
    if snapshots is None or not buffers:
        return buffers
    if getattr(_local, "replay", False):
        return {k: snapshots[id(v)][1].clone() if id(v) in snapshots else v for k, v in buffers.items()}
    for v in buffers.values():
        if id(v) not in snapshots:
            snapshots[id(v)] = (v, v.detach().clone())
    return buffers
