"""Collectives as autograd Functions that work under ``torch.func``.

``torch.func.grad`` rejects a ``torch.distributed`` call made inside a Function's ``backward`` ("mutate a
captured Tensor") and silently zeroes the gradient of a raw collective in a forward. The
pattern that works: each collective runs in the *forward* of its own new-style Function, and the
Functions name each other as their backward: all-gather <-> reduce-scatter. Each takes the counter tag
of its own collective and of its backward's ("params" forward, "grads" backward).
"""

from __future__ import annotations

import torch

from fzero._function import Function
from fzero.mesh import _events
from fzero.mesh._comm import pooled_reduce_scatter


class ReduceScatter(Function):
    """Forward: this rank's shard of the sum over ranks. Backward: all-gather of the shard gradient.
    ``pool`` (plain autograd, a step's ``fzero.step._pool``): the shard is made in one of its buffers, and ``full``
    goes back to it."""

    @staticmethod
    def forward(full, comm, tag, back_tag, pool=None):
        if pool is not None:
            out = pooled_reduce_scatter(comm, full.contiguous(), pool=pool, tag=tag).wait()
        else:
            out = comm.reduce_scatter(full.contiguous(), tag=tag)
        # One rank returns ``full`` itself; a Function must not hand back its input unaliased.
        return out.view_as(out) if out is full else out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.tag, ctx.back_tag = inputs[1:4]

    @staticmethod
    def backward(ctx, grad_shard):
        return AllGather.apply(grad_shard, ctx.comm, ctx.back_tag, ctx.tag), None, None, None, None


class AllGather(Function):
    """Forward: every rank's shard, concatenated. Backward: reduce-scatter of the full gradient (summed in
    ``reduce_dtype`` when given; autograd casts the result back to the shard's dtype). ``pool`` (plain autograd):
    the gathered buffer and the reduced shard are a step's buffers (``fzero.step._pool``). ``values``: what this rank
    sends in place of ``shard``'s own values (stage 3 casting the root unit's master: ``shard``'s memory is freed)."""

    @staticmethod
    def forward(shard, comm, tag, back_tag, reduce_dtype=None, pool=None, values=None):
        sent = shard if values is None else values
        n = shard.numel() * comm.size
        out = torch.empty(n, dtype=shard.dtype, device=shard.device) if pool is None else pool.take(n, dtype=shard.dtype, device=shard.device)
        return comm.all_gather(_events.gathered(out), sent.contiguous(), tag=tag)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.tag, ctx.back_tag = inputs[1:4]
        ctx.reduce_dtype = inputs[4] if len(inputs) > 4 else None
        ctx.pool = inputs[5] if len(inputs) > 5 else None

    @staticmethod
    def backward(ctx, grad_full):
        return ReduceScatter.apply(_as(grad_full, ctx.reduce_dtype), ctx.comm, ctx.back_tag, ctx.tag, ctx.pool), None, None, None, None, None, None


class ReplicatedShardGrad(Function):
    """ZeRO-2's gradient path: forward returns the unit's whole (replicated) buffer unchanged; the
    gradient with respect to this rank's *shard* is the reduce-scattered unit gradient.

    Autograd calls the backward once per unit, as soon as every use of the unit in the graph has
    contributed, so the whole gradient of a unit lives only until its reduce-scatter: at most one
    unit's full gradient at a time, plus the shards (ZeRO-2's 2Ψ + (2+K)Ψ/N).

    Under plain autograd a ``sink`` (``fzero.zero._shard_grads.ShardGradView``) may take the reduction instead:
    the backward hands it the unit's gradient (``sink.ready(name, grad, shard)``), which starts its reduce-scatter
    (alone, or in a bucket with the next units) and returns no gradient, so the next unit's backward runs while
    it is in flight. (A collective started in a
    backward is what ``torch.func`` refuses, so under it the reduction stays a Function of its own, as above.)
    """

    @staticmethod
    def forward(shard, full, comm, reduce_dtype=None, sink=None, name=None):
        return full.view_as(full)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[2]
        ctx.reduce_dtype = inputs[3] if len(inputs) > 3 else None
        ctx.sink, ctx.name = inputs[4:6] if len(inputs) > 4 else (None, None)
        ctx.shard = inputs[0].detach()  # where and in which dtype its gradient goes (a view: no memory)

    @staticmethod
    def backward(ctx, grad_full):
        if ctx.sink is not None:
            ctx.sink.ready(ctx.name, _as(grad_full, ctx.reduce_dtype).contiguous(), ctx.shard)
            return None, None, None, None, None, None
        return ReduceScatter.apply(_as(grad_full, ctx.reduce_dtype), ctx.comm, "grads", "params"), None, None, None, None, None


def _as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)
