"""Whole optimizer steps done in place: torch's fused Adam/AdamW kernels, and SGD op for op as torch does it.

These are what ``apply_inplace`` runs for ``adam``, ``adamw`` and ``sgd``. They read and write the very
state that the pure ``update`` path uses, so the two paths can be mixed step by step.

Dispatch (an internal choice of arithmetic, not a silent fallback): the Adam kernel runs when every param,
grad and moment is a contiguous CPU or CUDA float tensor (fp16/bf16/fp32/fp64) with the dtype and device of
its param. Anything else (meta tensors, non-contiguous views, grads of another dtype) takes the pure
``update`` followed by ``p.add_(u)``, which agrees with the kernel to rounding. Non-contiguous params must
not reach the CPU kernel: it walks ``data_ptr`` densely and would write the wrong elements.

Bitwise facts about the CPU kernel (torch 2.13, measured; see tests/test_optim.py): it splits each tensor
into 64-byte (16 fp32) aligned chunks and runs the last ``numel % Vec`` elements of a tensor (Vec = 16 fp32 on
AVX512, 8 on AVX2) through a scalar loop whose rounding differs from the vector loop. So the result of an
element depends on whether it sits in its tensor's scalar tail: one flat buffer is *not* bitwise equal to
the same params as separate tensors, and a shard is bitwise equal to its part of the whole buffer when its
boundaries are multiples of 16 elements (32 for bf16/fp16) from the buffer's start, or the buffer's end.
"""

from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from fzero.optim._base import LearningRate
from fzero.optim._transforms import ScaleByAdamState, ScaleByScheduleState

_KERNEL_DEVICES = ("cpu", "cuda")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _lr_now(learning_rate: LearningRate, lr_state: Any) -> float:
    """The learning rate for this step; advances a schedule's count in place."""
    if isinstance(lr_state, ScaleByScheduleState):
        lr = float(learning_rate(int(lr_state.count)))
        lr_state.count.add_(1)
        return lr
    return float(learning_rate)


def _kernel_groups(params: list, grads: list, mu: list, nu: list) -> dict | None:
    """Leaves grouped by (device, dtype) for the fused kernel, or None when some leaf cannot go to it."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for quad in zip(params, grads, mu, nu):
        p = quad[0]
        for t in quad:
            if not isinstance(t, torch.Tensor) or t.dtype != p.dtype or t.device != p.device or not t.is_contiguous():
                return None
        if p.device.type not in _KERNEL_DEVICES or p.dtype not in _KERNEL_DTYPES:
            return None
        lists = groups.setdefault((p.device, p.dtype), [[], [], [], []])
        for lst, t in zip(lists, quad):
            lst.append(t)
    return groups


def adam_step(
    update: Callable, *, b1: float | Callable[[int], float], b2: float, eps: float, weight_decay: float, decoupled: bool,
    learning_rate: LearningRate, adam_index: int, lr_index: int,
) -> Callable[[Any, Any, Any], Any]:
    """The in-place step of a ``chain`` whose state holds a ``ScaleByAdamState`` at ``adam_index`` and the
    learning-rate state at ``lr_index``; ``update`` is the chain's pure update, used when the kernel can't run."""
    kernel_name = "_fused_adamw_" if decoupled else "_fused_adam_"

    def fused(grads: Any, state: tuple, params: Any) -> tuple:
        adam: ScaleByAdamState = state[adam_index]
        p_leaves = optree.tree_leaves(params)
        groups = _kernel_groups(p_leaves, optree.tree_leaves(grads), optree.tree_leaves(adam.mu), optree.tree_leaves(adam.nu))
        if groups is None or adam.count.device.type == "meta":
            updates, new_state = update(grads, state, params)
            for p, u in zip(p_leaves, optree.tree_leaves(updates)):
                p.add_(u)
            return new_state
        lr = _lr_now(learning_rate, state[lr_index])
        beta1 = float(b1(int(adam.count))) if callable(b1) else b1  # a momentum schedule (OneCycle)
        adam.count.add_(1)
        kernel = getattr(torch, kernel_name)  # looked up per call so that tests can count kernel calls
        for (device, _), (ps, gs, ms, vs) in groups.items():
            step = adam.count if adam.count.device == device else adam.count.to(device)
            # One shared step tensor: the kernel only reads it (torch keeps one per param, all equal).
            kernel(ps, gs, ms, vs, [], [step] * len(ps), lr=lr, beta1=beta1, beta2=b2, weight_decay=weight_decay,
                   eps=eps, amsgrad=False, maximize=False)
        return state

    return fused


def sgd_step(
    update: Callable, *, momentum: float, nesterov: bool, weight_decay: float, learning_rate: LearningRate,
    trace_index: int | None, lr_index: int,
) -> Callable[[Any, Any, Any], Any]:
    """SGD in place with the ops of torch.optim.SGD's for-loop path, so its results match torch bit for bit
    (``p.add_(d, alpha=-lr)`` rounds once where the pure ``p + (-lr * d)`` rounds twice)."""

    def fused(grads: Any, state: tuple, params: Any) -> tuple:
        p_leaves, g_leaves = optree.tree_leaves(params), optree.tree_leaves(grads)
        bufs = optree.tree_leaves(state[trace_index].trace) if trace_index is not None else [None] * len(p_leaves)
        if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in p_leaves + g_leaves):
            updates, new_state = update(grads, state, params)
            for p, u in zip(p_leaves, optree.tree_leaves(updates)):
                p.add_(u)
            return new_state
        lr = _lr_now(learning_rate, state[lr_index])
        for p, g, buf in zip(p_leaves, g_leaves, bufs):
            d = g.add(p, alpha=weight_decay) if weight_decay != 0.0 else g
            if buf is not None:
                buf.mul_(momentum).add_(d)  # zeros at the first step: buf becomes d exactly, as torch's clone
                d = d.add(buf, alpha=momentum) if nesterov else buf
            p.add_(d, alpha=-lr)
        return state

    return fused

