"""Stage 3: a unit's backward where the gradient does not pass the unit's return value (``fzero.zero._unit``).

A hook's capture leaves the unit beside its return value (Hugging Face's output capture, ``output_hidden_states``),
and that return value may reach nothing in the loss, so ``_RefillBeforeBackward`` never runs: for a call that keeps
its graph, ``UnitCall._watch_hooks`` puts a hook first on each module of the unit that has forward hooks (the unit's
own only under ``jit``), and what those hooks are handed refills the unit before its backward (``_refill_on_escape``).
A unit of frozen params alone (``step.init(..., frozen=...)``) has no gradient to join and reduce: the gradient of its
inputs is where its backward ends and its buffer can be freed again (``_after_backward``).

Apart from ``fzero.zero._unit`` so that each stays short.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch import nn

from fzero.layout import pytrees as _tree
from fzero.mesh import Function


class _UnitCall(Protocol):
    """What these functions use of ``fzero.zero._unit.UnitCall`` (a Protocol, so that this module does not import the
    one that imports it)."""

    refilled: bool
    reduced: bool
    hooks: Any

    def refill_once(self) -> None: ...

    def done(self) -> None: ...

    def free(self) -> None: ...


def _after_backward(inputs: Any, call: _UnitCall) -> tuple[Any, list]:
    """``inputs`` with their differentiable tensors passed through ``_FreeAfterBackward``: for a unit of frozen params
    alone (``step.init(..., frozen=...)``), whose gather has no gradient to join and reduce, the gradient of its inputs
    is where its backward ends and its buffer can be freed again. (No input with a gradient: no backward reaches the
    unit, and its buffer, freed after the forward, is never refilled.) Also returns, under ``torch.func``, each input
    with the view the unit gets of it and that view's version, for ``write_back`` after the call (else [])."""
    found, rebuild = _tree.tensors_and_rebuild(inputs)
    wanted = [i for i, t in enumerate(found) if t.requires_grad]
    if not wanted:
        return inputs, []
    if not torch._C._functorch.is_functorch_wrapped_tensor(found[wanted[0]]):
        # plain autograd: a hook on the inputs themselves, not a Function between them and the unit. A Function's
        # outputs are views that the unit may not modify in place (``F.relu(x, inplace=True)`` on its input raised
        # "Output 0 of _FreeAfterBackward is a view and is being modified inplace"), and its node summed the gradients
        # of the input's uses inside the unit before the uses outside it (not bitwise the run without frozen=)
        call.hooks = torch.autograd.graph.register_multi_grad_hook([found[i] for i in wanted],
                                                                   functools.partial(_free_after_backward, call), mode="all")
        return inputs, []
    given = [found[i] for i in wanted]
    passed = _FreeAfterBackward.apply(call, *given)
    for i, t in zip(wanted, passed):
        found[i] = t
    return rebuild(found), [(g, t, t._version) for g, t in zip(given, passed)]


def write_back(passed: list) -> None:
    """After the call of a unit of frozen params alone under ``torch.func``: each of its inputs that it wrote in place
    (``nn.ReLU(inplace=True)`` first in a frozen tower) is copied into the caller's tensor it is a view of (``passed``:
    (that tensor, the view, its version before the call), from ``_after_backward``). The write itself already reached
    the caller's memory, but not its graph (nor autograd's check of the tensors saved from it): a view made by a
    Function is a tensor of its own there, so a caller that used the tensor after the unit (a residual beside the
    tower) got silently wrong gradients. The copy (of each element onto itself) records the write in the caller's
    tensor, as the write does in PyTorch."""
    for tensor, view, version in passed:
        if view._version != version:
            tensor.copy_(view)


def _free_after_backward(call: _UnitCall, grads: Any) -> None:
    """The unit's backward is over (its inputs' gradients are computed): let go of its views and free its buffer."""
    if call.refilled:
        call.done()
        call.free()
        call.refilled = False
        call.reduced = True  # over: a hook's capture read after it refills nothing (``UnitCall.refill_once``)


def _refill_on_escape(call: _UnitCall, start: int, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
    """A forward hook put first on a module of a unit (``UnitCall._watch_hooks``): the tensors the module's hooks are
    handed (its output, its inputs) that were made during the unit's call (``start``: the first autograd node number
    of the call) get a pre-hook on their ``grad_fn``, which refills the unit before that node's backward runs. Autograd
    runs ``_RefillBeforeBackward`` on the unit's return value first wherever that value reaches the loss too (it was
    made after every node of the unit), so this refills only where the hooks' capture is the gradient's way in."""
    _watch_made_since(call, start, (args, kwargs, output))


def _refill_on_escape_pre(call: _UnitCall, start: int, module: nn.Module, args: Any, kwargs: Any) -> None:
    """``_refill_on_escape`` for what a module's forward pre-hooks are handed: its inputs."""
    _watch_made_since(call, start, (args, kwargs))


def _watch_made_since(call: _UnitCall, start: int, tree: Any) -> None:
    for t in _tree.tensors_and_rebuild(tree)[0]:
        node = t.grad_fn
        if node is not None and node._sequence_nr() >= start:
            node.register_prehook(functools.partial(_refill_before, call))


def _refill_before(call: _UnitCall, grads: Any) -> None:
    call.refill_once()


class _FreeAfterBackward(Function):
    """Forward: the unit's inputs (views). Backward: the unit's backward is over: let go of its views and free its
    buffer, as ``UnitCall.reduce`` does for a unit that trains; gradients unchanged."""

    @staticmethod
    def forward(call, *inputs):
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        if call.refilled:
            call.done()
            call.free()
            call.refilled = False
            call.reduced = True
        return (None, *grads)
