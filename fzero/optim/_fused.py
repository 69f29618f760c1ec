"""Whole optimizer steps done in place: torch's fused Adam/AdamW kernels, and SGD op for op as torch does it.

These are what ``apply_inplace`` runs for ``adam``, ``adamw`` and ``sgd``. They read and write the very
state that the pure ``update`` path uses, so the two paths can be mixed step by step.

Dispatch (an internal choice of arithmetic, not a silent fallback): the Adam kernel runs when every param,
grad and moment is a contiguous CPU or CUDA float tensor (fp16/bf16/fp32/fp64) with the dtype and device of
its param. Anything else (meta tensors, non-contiguous views, grads of another dtype) takes the pure
``update`` followed by ``p.add_(u)``, which agrees with the kernel to rounding. Non-contiguous params must
not reach the CPU kernel: it walks ``data_ptr`` densely and would write the wrong elements.

On CUDA, float32 leaves of ``TRITON_MIN_ELEMENTS`` or more go to fzero.ops' Triton Adam kernel instead when
triton is installed (``_kernel``); smaller ones stay with torch's kernel, which is faster there:
it agrees with torch's CUDA kernel to fp32 rounding and is elementwise, with no scalar tail, so the bitwise
facts below about shards and windows hold for it without conditions. CPU leaves always take torch's kernel.

Per-parameter step counts (a parameter that had no gradient in some step, see ``fzero.optim._base``) and
per-parameter weight decay (``adamw(mask=...)``): the kernel takes one step count and one decay per call, and a
ZeRO leaf holds many parameters; ``_per_param_counts`` runs each leaf once with its most common (count, decay)
and redoes the others in aligned windows (its docstring says why that is the cheapest exact way). While no
parameter has ever skipped a step and none is left undecayed, the one-call-per-dtype path runs as before.

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
from fzero.optim._base import active_params, current_segments, param_ranges, param_tree
from fzero.optim._base import per_param_steps, scheduled, skipped_after
from fzero.optim._transforms import ScaleByAdamState, ScaleByScheduleState

_KERNEL_DEVICES = ("cpu", "cuda")
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _lr_now(learning_rate: LearningRate, lr_state: Any) -> float:
    """The learning rate for this step; advances a schedule's count in place."""
    if isinstance(lr_state, ScaleByScheduleState):
        lr = float(scheduled(learning_rate, int(lr_state.count)))
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
    learning_rate: LearningRate, adam_index: int, lr_index: int, decay_groups: Any = None,
) -> Callable[[Any, Any, Any], Any]:
    """The in-place step of a ``chain`` whose state holds a ``ScaleByAdamState`` at ``adam_index`` and the
    learning-rate state at ``lr_index``; ``update`` is the chain's pure update, used when the kernel can't run.

    ``decay_groups`` (``adamw(mask=...)``: ``fzero.optim._groups.Groups`` of the decayed params): the params it
    leaves out take the step with ``weight_decay=0``, through ``_per_param_counts``: each leaf goes through the
    kernel once with the decay, and only the few undecayed params (biases, norms) are redone without it, in
    aligned windows. That costs about their size in extra work, not a second pass over the shard, and gives
    every element the bits the kernel gives it in a whole buffer, so stages 1-3 stay bitwise equal to stage 0.
    (Rejected: ``p *= 1 - lr * wd`` on the decayed elements before a kernel without decay: a second pass over
    the params, measured +36 % on the step of a 6.4M-param GPT; one kernel call per group on views: the bits
    would depend on where a shard cuts a view, see the module docstring.)"""
    kernel_name = "_fused_adamw_" if decoupled else "_fused_adam_"
    api = "fzero.optim.adamw" if decoupled else "fzero.optim.adam"

    def fused(grads: Any, state: tuple, params: Any) -> tuple:
        adam: ScaleByAdamState = state[adam_index]
        p_leaves = optree.tree_leaves(params)
        groups = _kernel_groups(p_leaves, optree.tree_leaves(grads), optree.tree_leaves(adam.mu), optree.tree_leaves(adam.nu))
        if groups is None or adam.count.device.type == "meta":
            updates, new_state = update(grads, state, params)
            for p, u in zip(p_leaves, optree.tree_leaves(updates)):
                p.add_(u)
            return new_state
        segments = current_segments()
        active = active_params(segments)
        skipped = skipped_after(api, adam.skipped, active)
        lr = _lr_now(learning_rate, state[lr_index])
        beta1 = float(scheduled(b1, int(adam.count))) if callable(b1) else b1  # a momentum schedule (OneCycle)
        adam.count.add_(1)
        if skipped is not adam.skipped:
            adam.skipped.copy_(skipped)
        steps = per_param_steps(adam.count, adam.skipped)
        kernel = _kernel(getattr(torch, kernel_name), decoupled, groups)  # looked up per call: tests count calls
        settings = dict(lr=lr, beta1=beta1, beta2=b2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        undecayed = _undecayed(decay_groups, params, segments) if decay_groups is not None and weight_decay else None
        if active is None and steps is None and undecayed is None:  # one count, one decay: one call per (device, dtype)
            for (device, _), (ps, gs, ms, vs) in groups.items():
                step = adam.count if adam.count.device == device else adam.count.to(device)
                # One shared step tensor: the kernel only reads it (torch keeps one per param, all equal).
                kernel(ps, gs, ms, vs, [], [step] * len(ps), **settings)
            return state
        _per_param_counts(kernel, settings, params, grads, adam, active, steps, segments, undecayed)
        return state

    return fused


def _undecayed(decay_groups: Any, params: Any, segments: Any) -> list[bool] | None:
    """Per parameter (the user's pytree order): True where ``adamw(mask=...)``'s mask leaves it undecayed; None when
    every parameter is decayed."""
    tree = param_tree(params, segments)  # the ranks compare the mask's answers (``Groups.across_ranks``)
    groups = decay_groups.resolver.groups(tree, agree=decay_groups.across_ranks(tree, params, decay_groups.comm_to_agree(segments)))
    flags = [g < 0 for g in groups]
    return flags if any(flags) else None


# From this many elements a leaf goes to fzero.ops' Triton Adam; smaller CUDA leaves share one call of torch's
# multi-tensor kernel. Measured on an H100 (benchmarks/gpu.py, AdamW bandwidth, one leaf): Triton was 0.62x torch's
# kernel at 2^24 elements, 1.05x at 2^26 and 1.11x at 2^28, and each Triton call costs about 60 us of host time
# (its Python launcher) where torch's one call takes every small leaf. A module attribute so that tests can lower it.
TRITON_MIN_ELEMENTS = 2 ** 25


def triton_leaf(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether fzero.ops' Triton Adam takes leaves of this device and dtype instead of torch's kernel: CUDA
    float32 (the kernel's master and moments are fp32). A function of its own so that tests can widen it to
    CPU leaves, where the kernel runs under Triton's interpreter."""
    return device.type == "cuda" and dtype == torch.float32


def _kernel(torch_kernel: Callable, decoupled: bool, groups: dict) -> Callable:
    """torch's fused kernel; or, when some (device, dtype) group is Triton's (``triton_leaf``) and triton imports,
    a callable with torch's signature that sends those leaves to ``fzero.ops.adam_`` and the rest to torch.

    Why fzero's kernel on CUDA: it can take the gradient unscale, a bf16/fp16 copy-out and the non-finite flag in
    the same pass (what a mixed-precision step needs; this fp32 path uses none of them yet), it equals its torch
    reference bit for bit, and it agrees with torch's CUDA kernel to fp32 rounding (``fzero.ops._adam``). CPU
    leaves never get here: the CPU path is torch's kernel, untouched, and fzero.ops (and triton) are not even
    imported for it.
    """
    if not any(triton_leaf(device, dtype) for device, dtype in groups):
        return torch_kernel
    from fzero.ops import triton_available

    if not triton_available():
        return torch_kernel
    return lambda *lists, **settings: _triton_adam(torch_kernel, decoupled, *lists, **settings)


def _triton_adam(torch_kernel: Callable, decoupled: bool, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list,
                 max_exp_avg_sqs: list, state_steps: list, *, lr: float, beta1: float, beta2: float, weight_decay: float,
                 eps: float, amsgrad: bool, maximize: bool) -> None:
    """torch's ``_fused_adam(w)_`` signature, run by ``fzero.ops.adam_`` (one call per leaf: ZeRO leaves are a few
    flat buffers) for Triton's leaves of at least ``TRITON_MIN_ELEMENTS`` and by torch's kernel (one call) for the
    others.

    Step counts: ``fzero.ops.adam_`` takes the count as a host number, so each distinct step tensor is read once
    (a device sync when the count lives on the GPU; ``per_param_steps`` has already synced this step). The
    per-parameter counts of ``_per_param_counts`` come through here as separate calls with their own step
    tensors, so they need nothing more. amsgrad and maximize are never set by ``adam_step``.
    """
    from fzero.ops import adam_

    if amsgrad or maximize or max_exp_avg_sqs:
        raise NotImplementedError("fzero.optim: the Triton Adam kernel has no amsgrad or maximize (adam_step never asks).")
    rest: list[list] = [[], [], [], [], []]
    counts: dict[int, float] = {}
    for quad_step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        p, g, m, v, step = quad_step
        if not triton_leaf(p.device, p.dtype) or p.numel() < TRITON_MIN_ELEMENTS:
            for lst, t in zip(rest, quad_step):
                lst.append(t)
            continue
        if id(step) not in counts:
            counts[id(step)] = float(step)
        adam_(p, g, m, v, step=counts[id(step)], lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              decoupled=decoupled, impl="triton")
    if rest[0]:
        torch_kernel(*rest[:4], [], rest[4], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                     amsgrad=amsgrad, maximize=maximize)


# Windows recomputed with their own step count start and end on multiples of this many elements from their leaf's
# start (or at its end): then no element of them falls in the kernel's scalar tail unless it does in the whole leaf
# too (see the module docstring: 16 fp32 / 32 bf16 elements), and a ZeRO shard starts on such a multiple
# (SHARD_ALIGN), so the recomputed elements get the bits the whole-buffer call would give them, at every stage.
_WINDOW_ALIGN = 64


def _per_param_counts(kernel: Callable, settings: dict, params: Any, grads: Any, adam: ScaleByAdamState,
                      active: torch.Tensor | None, steps: torch.Tensor | None, segments: Any,
                      undecayed: list[bool] | None = None) -> None:
    """Adam when parameters have different step counts, or some skip this step (torch.optim's per-parameter
    ``state["step"]``, and ``p.grad is None``), or some take no weight decay (``undecayed``: ``adamw(mask=...)``).

    The cheapest exact way with a kernel that takes one step count per tensor, where a ZeRO leaf is a flat
    buffer of many parameters: each leaf goes through the kernel once, with the count most of its live
    parameters share (always ``count`` for a parameter that never skipped, so the common parameters get
    the very bits they would get with no skip anywhere); the few parameters with another count are then
    redone from copies taken before, in aligned windows, and only their ranges are copied back. A leaf
    with no parameter taking the step is left out of the kernel. Parameters that skip this step are
    updated here like the others and put back by ``apply_inplace``, which saved them (with every other
    param-shaped piece of state). Extra work: the copies and recompute of the odd parameters only.

    Rejected: one kernel call per parameter, or per run of equal counts, on slices of the leaf (a slice
    that starts or ends off a 16-element boundary moves elements into the kernel's scalar tail, so the
    bits would depend on where the ZeRO stage cuts the buffer, and a leaf of hundreds of parameters
    would be hundreds of calls); a step count per element (the kernel takes none, and the pure path
    costs a few times the kernel's time and 4 bytes per element).
    """
    own = steps.tolist() if steps is not None else None
    live = active.tolist() if active is not None else None
    base, decay = float(adam.count), settings["weight_decay"]
    p_leaves, g_leaves = optree.tree_leaves(params), optree.tree_leaves(grads)
    m_leaves, v_leaves = optree.tree_leaves(adam.mu), optree.tree_leaves(adam.nu)
    # a parameter's kind: (its step count, its weight decay); most of a leaf's parameters share the usual one
    usual = (base, decay)
    calls: dict[tuple[torch.device, torch.dtype, tuple], list[list[torch.Tensor]]] = {}
    redo: list[tuple] = []  # (kind, [p, m, v] flat targets, window copies, start and stop in the window, start in the leaf)
    for quad, ranges in zip(zip(p_leaves, g_leaves, m_leaves, v_leaves), param_ranges(params, segments)):
        kinds = [(a, b, (own[i] if own is not None else base, 0.0 if undecayed is not None and undecayed[i] else decay))
                 for a, b, i in ranges if i >= 0 and (live is None or live[i])]
        if not kinds:
            continue  # nothing in this leaf takes the step
        sizes: dict[tuple, int] = {}
        for a, b, k in kinds:
            sizes[k] = sizes.get(k, 0) + b - a
        main = usual if usual in sizes else max(sizes, key=sizes.__getitem__)
        p = quad[0]
        for t, lst in zip(quad, calls.setdefault((p.device, p.dtype, main), [[], [], [], []])):
            lst.append(t)
        numel = p.numel()
        odd = _runs([(a, b, k) for a, b, k in kinds if k != main])
        flat = [t.view(-1) for t in quad] if odd else None
        for k, a, b in odd:
            lo, hi = a // _WINDOW_ALIGN * _WINDOW_ALIGN, min(-(-b // _WINDOW_ALIGN) * _WINDOW_ALIGN, numel)
            copies = [flat[0][lo:hi].clone(), flat[1][lo:hi], flat[2][lo:hi].clone(), flat[3][lo:hi].clone()]
            redo.append((k, [flat[0], flat[2], flat[3]], copies, a - lo, b - lo, a))
    for (device, _, (c, wd)), (ps, gs, ms, vs) in calls.items():
        kernel(ps, gs, ms, vs, [], [_step_tensor(adam.count, c, device)] * len(ps), **{**settings, "weight_decay": wd})
    by_kind: dict[tuple, list[tuple]] = {}  # one kernel call per (kind, device, dtype): its windows as a list
    for item in redo:
        by_kind.setdefault((item[0], item[2][0].device, item[2][0].dtype), []).append(item)
    for ((c, wd), device, _), items in by_kind.items():
        lists = [[window[j] for _, _, window, _, _, _ in items] for j in range(4)]
        kernel(*lists, [], [_step_tensor(adam.count, c, device)] * len(items), **{**settings, "weight_decay": wd})
        for _, targets, window, a, b, start in items:
            for target, new in zip(targets, (window[0], window[2], window[3])):
                target[start : start + b - a].copy_(new[a:b])


def _runs(pieces: list[tuple[int, int, Any]]) -> list[tuple[Any, int, int]]:
    """Adjacent ranges of the same kind (step count and decay) merged: (kind, start, stop)."""
    out: list[tuple[float, int, int]] = []
    for a, b, c in pieces:
        if out and out[-1][0] == c and out[-1][2] == a:
            out[-1] = (c, out[-1][1], b)
        else:
            out.append((c, a, b))
    return out


def _step_tensor(count: torch.Tensor, value: float, device: torch.device) -> torch.Tensor:
    step = count if float(count) == value else torch.full((), value, dtype=count.dtype)
    return step if step.device == device else step.to(device)


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

