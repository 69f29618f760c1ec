"""One rank's program for a step and for an evaluation: the same for every stage.

A step: the ``params`` part makes the view that the gradient is taken over (``fzero.step._parts``), the
gradient is taken per micro-batch and accumulated (whole gradients, or shards where the ``grads`` part
reduces them in backward), and ``fzero.step._update.finish`` synchronises, checks, clips and updates.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fzero.step._gradient import gradient, split_loss
from fzero.step._batch import split_micro
from fzero.step._buffers import Buffers, broadcast_buffers
from fzero.step._context import compute_dtype, step_buffers
from fzero.step._state import TrainState
from fzero.step._update import finish
from fzero.step._usage import recording


def rank_program(step: Any, comm: Any, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    prec = step.precision
    reduce_dtype = None if prec.reduce_dtype == prec.compute else prec.reduce_dtype
    # disk offload of params: a mapped shard's pages go back to its file after each use
    release = step.opt_state.release(state.opt_state)
    # under torch.func the backward's buffers are the transform's: a pool lends only to plain autograd's
    pool = step.pool if step.autodiff == "autograd" else None
    view = step.params.view(step.grads, comm, state, reduce_dtype=reduce_dtype, release=release, pool=pool,
                            masters=_masters_beside_params(step, state))
    try:
        new_state, metrics = _step(step, comm, state, batch, view, release)
    finally:  # after the update (whose gradients are gone by now), or on an error: the params whole again
        view.restore()
    return dataclasses.replace(new_state, params=dict(state.params)), metrics


def _masters_beside_params(step: Any, state: TrainState) -> dict[str, torch.Tensor] | None:
    """This rank's fp32 masters where they live beside its params (no offload), for a stage-3 view to gather from."""
    if step.opt_state.offload is not None or not step.opt_state.has_masters(state.opt_state):
        return None
    return step.opt_state.masters(state.opt_state, state.meta.layout)


def _step(step: Any, comm: Any, state: TrainState, batch: Any, view: Any, release: Any) -> tuple[TrainState, dict[str, Any]]:
    prec = step.precision
    scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
    acc: list[torch.Tensor] | None = None
    losses, aux = [], None
    low = None if prec.compute == torch.float32 else prec.compute
    buffers = broadcast_buffers(comm, state.buffers)
    with compute_dtype(low), recording(state.meta.layout) as usage:  # which params the gradients use (torch's grad=None)
        micros = split_micro(batch, step.grad_accum)
        for k, micro in enumerate(micros):
            view.begin_micro(last=k == len(micros) - 1)
            grads, loss, aux, buffers = gradient(step.loss_fn, view.build, view.inputs, micro, scale, step.autodiff, buffers, low,
                                                 into=getattr(view, "grad_into", None))
            view.release()
            # accumulate over micro-batches: whole gradients, or this rank's shards where reduced in backward
            # (or nothing to do: the view accumulated them in place)
            acc = grads if acc is None or getattr(view, "accumulates", False) else [a.add_(g) for a, g in zip(acc, grads)]
            del grads
            losses.append(loss)
    acc = view.collect(acc)  # one gradient per unit (stages 0-1 flatten the per-param ones, freeing each as it goes)
    meta = view.finish(state.meta)
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    new_state, metrics = finish(step, comm, view.for_update(state), acc, loss, scale, meta, aux, usage, pool=step.pool)
    new_state = dataclasses.replace(new_state, buffers=buffers)
    if release is not None:  # e.g. the root unit's shard, or every shard of a skipped step
        for t in state.params.values():
            release(t)
    return new_state, metrics


def eval_program(step: Any, comm: Any, state: TrainState, batch: Any) -> dict[str, Any]:
    prec = step.precision
    low = None if prec.compute == torch.float32 else prec.compute
    release = step.opt_state.release(state.opt_state)
    view = step.params.eval_view(comm, state, release=release)
    # the state's buffers as the step would broadcast them; what the forward writes is dropped
    bank = Buffers(broadcast_buffers(comm, state.buffers, copy=True), lift=lambda t: t.clone(), dtype=low)
    with torch.no_grad(), compute_dtype(low), step_buffers(bank):
        loss, aux = split_loss(step.loss_fn(view.build([]), batch))
    view.release()
    view.finish(state.meta)  # the order a step records is not changed by an evaluation
    for t in state.params.values() if release is not None else ():  # the root unit's shard too
        release(t)
    metrics: dict[str, Any] = {"loss": float(comm.all_reduce(loss.detach().float().reshape(1), tag="metrics")[0]) / comm.size}
    if aux is not None:
        metrics["aux"] = aux
    return metrics
