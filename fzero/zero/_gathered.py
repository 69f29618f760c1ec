"""Stage 3, one unit call: gather, run once with its graph, free; refill before its backward, reduce after.

``run_unit`` is what a unit of the stage-3 skeleton does when the forward reaches it (``fzero.zero._sharded``).
``_UnitGather`` gathers the unit (through the step's ``Schedule``) and hands its module the params as views
of the gathered buffer; after the forward the buffer's storage is freed while the graph keeps the views.
``_RefillBeforeBackward`` on the unit's outputs refills the storage in place (``_Refill``) when the gradient
reaches them, and ``_UnitGather``'s backward (``_UnitReduce``) reduce-scatters the unit's gradient and frees
the storage again. Under ``torch.func.grad`` every collective runs in a Function's forward (the transform refuses
one in a backward); under plain autograd (the default) the unit's reduction is started from its backward, and
travels while the next unit's backward runs (``sink``, ``fzero.zero._shard_grads.ShardGradView``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from fzero._function import Function
from fzero.autodiff import remat
from fzero.mesh import profiled
from fzero.layout import pytrees as _tree, Unit, split_sizes
from fzero.step import usage as _usage, give
from fzero.zero._schedule import UnitCall

def run_unit(inner: nn.Module, unit: Unit, params: Any, args: tuple, kwargs: dict) -> Any:
    """One unit call at stage 3: gather, run once with its graph, free; the backward refills (see ``UnitCall``).

    With ``remat`` (``shard_params(..., remat=True)``) the unit is instead run through ``fzero.remat``: no
    graph is kept, and the recompute in backward gathers the unit again.
    """
    with profiled(lambda: f"fzero.unit:{unit.name}"):  # a trace shows each unit's gather and forward
        return _run_unit(inner, unit, params, args, kwargs)


def _run_unit(inner: nn.Module, unit: Unit, params: Any, args: tuple, kwargs: dict) -> Any:
    call = UnitCall(inner, unit, params)
    shard = params.inputs[unit.name]
    if params.remat and torch.is_grad_enabled():
        def unit_forward(shard, /, *args, **kwargs):  # gathers again when remat recomputes it
            return call.run(_UnitGather.apply(shard, call, False, _usage.active(unit)), args, kwargs)

        unit_forward.__qualname__ = f"unit {unit.name!r}"
        return remat(unit_forward)(shard, *args, **kwargs)
    call.keeps_graph = torch.is_grad_enabled()
    views = _UnitGather.apply(shard, call, True, _usage.active(unit))
    out = call.run(views, args, kwargs, keep=torch.is_grad_enabled())
    if not torch.is_grad_enabled():  # no graph: nothing will read the buffer again
        out = _unalias(out, call.full)
        call.free()
        return out
    if not call.params.schedule.kept(call):
        call.free()
    return _before_backward(out, call)


def _unalias(out: Any, full: torch.Tensor) -> Any:
    """``out`` with any tensor that shares the gathered buffer's memory copied (the buffer is about to be freed)."""
    ptr = full.untyped_storage().data_ptr()
    return torch_pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr else t, out
    )


def _before_backward(out: Any, call: UnitCall) -> Any:
    """``out`` with its differentiable tensors passed through ``_RefillBeforeBackward``: the unit's backward
    cannot start before the gradient of every output that reaches the loss has arrived there, so that is
    where the buffer is refilled (as FSDP's pre-backward hook on a module's outputs).

    Pytrees, dataclasses (a unit may return one) and Hugging Face ``ModelOutput``s are searched; a tensor
    that leaves the unit another way (stored on a module, captured by a hook on a submodule inside the
    unit) and is the only path of a gradient into the unit is not seen (see the module docstring).
    """
    found, rebuild = _tree.tensors_and_rebuild(out)
    wanted = [i for i, t in enumerate(found) if t.requires_grad]
    if not wanted:
        return out
    copy = not torch._C._functorch.is_functorch_wrapped_tensor(found[wanted[0]])  # plain autograd (see the Function)
    passed = _RefillBeforeBackward.apply(call, copy, *[found[i] for i in wanted])
    for i, t in zip(wanted, passed):
        found[i] = t
    return rebuild(found)


class _UnitGather(Function):
    """Forward: gather the unit into a buffer (kept as ``call.full`` when ``free_after``) and return its params,
    shaped views of that buffer in slot order. Backward: the params' gradients in one flat gradient
    (``fzero.step._usage.join``, noting which params got one in ``usage``), reduce-scattered by ``_UnitReduce``.

    One Function does what a gather, a ``split`` and a view per param would: under ``torch.func`` every
    custom Function and every op on a wrapped tensor costs a layer of Python, paid per unit per step.
    """

    @staticmethod
    def forward(shard, call, free_after, usage):
        full = call.schedule.gather(call, shard.detach())  # values only: the gradient is this Function's
        if free_after:
            call.full = full
        # one split into every slot (and the padding), then a view each: half the dispatcher calls of narrow + view
        pieces = full.split_with_sizes(split_sizes(call.unit))
        return tuple(piece.view(s.shape) for piece, s in zip(pieces, call.unit.slots))

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, call, ctx.free_after, usage = inputs
        ctx.call = call
        ctx.sizes = tuple(split_sizes(call.unit))
        ctx.used = usage.used[call.unit.name] if usage is not None else None
        ctx.like = (shard.dtype, shard.device)
        ctx.set_materialize_grads(False)  # a param that got no gradient arrives as None

    @staticmethod
    def backward(ctx, *grads):
        flat = _usage.join(grads, ctx.sizes, ctx.used, ctx.like, pool=ctx.call.params.pool)
        if ctx.call.params.sink is not None:  # plain autograd: the reduction in flight while the next unit's backward runs
            _reduce(flat, ctx.call, ctx.free_after, sink=ctx.call.params.sink)
            return None, None, None, None
        return _UnitReduce.apply(flat, ctx.call, ctx.free_after), None, None, None


def _reduce(grad_full: torch.Tensor, call: Any, free_after: bool, *, sink: Any = None) -> torch.Tensor | None:
    """Reduce-scatter a unit's gradient into its shard's, and free the gathered buffer again. ``sink``: start the
    reduction and hand it there (``ShardGradView.reduced``), returning None; else wait for it and return the shard."""
    if free_after and not call.refilled:
        raise RuntimeError(_NOT_REFILLED.format(unit=call.unit.name))
    params = call.params
    grad = grad_full if params.reduce_dtype is None else grad_full.to(params.reduce_dtype)
    if grad is not grad_full:  # the compute-dtype gradient (a pool buffer, ``_usage.join``) is done with: back to the pool
        give(params.pool, grad_full)
        del grad_full
    shard = params.inputs[call.unit.name]  # its gradient goes where it is (to the host, params offloaded there)
    if sink is not None:  # the sink starts its reduction (alone or in a bucket with the next units')
        grad_shard = None
    else:
        grad_shard = params.comm.reduce_scatter(grad, tag="grads", label=call.unit.name).to(shard.device, shard.dtype, non_blocking=shard.is_cuda)
    if free_after:
        call.done()
        call.free()
        call.refilled = False
    if sink is not None:
        sink.ready(call.unit.name, grad, shard.detach())
    return grad_shard


class _UnitReduce(Function):
    """Forward: reduce-scatter the unit's gradient into the shard's, and free the gathered buffer again."""

    @staticmethod
    def forward(grad_full, call, free_after):
        grad_shard = _reduce(grad_full, call, free_after)
        return grad_shard.view_as(grad_shard) if grad_shard is grad_full else grad_shard

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("fzero (stage 3): double backward through a unit's gradient reduction is not supported.")


class _RefillBeforeBackward(Function):
    """Forward: the unit's outputs. Backward: refill the unit's buffer (``_Refill``), gradients unchanged.

    ``copy``: under plain autograd the outputs are copies, not views: a view made by a custom Function cannot
    be modified in place there, and models do that to a block's output (``h = block(h); h.add_(x)``). Under
    ``torch.func`` such a view can be, so no copy is made.
    """

    @staticmethod
    def forward(call, copy, *outs):
        return tuple(o.clone() if copy else o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_Refill.apply(ctx.call, *grads))


class _Refill(Function):
    """Forward: gather the unit into its own (freed) buffer again; returns the gradients unchanged.

    The refill is a collective, so it runs in a Function's forward (``torch.func.grad`` refuses a collective in a
    backward). It writes the same
    values the forward read, under ``_unsafe_preserve_version_counter``: autograd's check of the views it
    saved must not see a modification.
    """

    @staticmethod
    def forward(call, *grads):
        call.schedule.refill(call)
        call.refilled = True
        call.bind()
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fzero (stage 3): double backward through a unit is not supported.")


_NOT_REFILLED = """fzero (stage 3): unit {unit!r} computed its parameter gradient, but its gathered parameters were never
brought back for its backward: the gradient reached the inside of the unit without passing through the
unit's return value (a tensor made inside the unit that left it another way, e.g. stored on a module or
captured by a hook on a submodule of the unit). Return such tensors from the unit's forward, put the hook
on the unit itself, or keep that module out of the units (units=... without {unit!r})."""
