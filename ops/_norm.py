"""Per-unit sum of squared gradients, with the non-finite flag, in one pass over the gradients.

For global-norm clipping and the fp16 overflow decision: ``sumsq, flag = grad_sumsq(unit_grads)``; the
global norm is ``sumsq.sum().sqrt()`` (after summing over ranks), and ``flag`` can go straight to
``adam_(..., found_inf=flag)`` to skip the step on the device.

The flag is set when a sum is not finite. That is exactly "some gradient element is inf or NaN" (an inf or
NaN element makes its sum inf or NaN, in any order of summation), plus the case of finite gradients whose
sum of squares passes fp32's range (a norm past 1.8e19): a step with that norm is as unusable, and torch's
``clip_grad_norm_(error_if_nonfinite=True)`` and DeepSpeed's overflow check refuse it too. Deriving the flag
from the sums costs no second pass over the gradients.

Order of summation: the Triton kernel sums each block of ``BLOCK`` elements of a unit in one program (a
tree in fp32), and torch then adds each unit's block sums (one row per unit of a zero-padded matrix: the
padding is 4 bytes per 16 KiB of the largest unit, and adding zeros changes no bit). No atomics: the same
bits on every run. The
reference is ``torch.dot`` in fp32 (what fzero's step used before), another order of the same fp32 sums, so
the two agree to fp32 summation error (about log2(n) ulps), not bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ._dispatch import choose, on_device

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 4096
API = "fzero.ops.grad_sumsq"


class SumSq(NamedTuple):
    """sumsq: float32 (len(grads),), each unit's sum of squares. nonfinite: float32 (1,), 1.0 when a sum is not
    finite (module docstring), else 0.0. Both on the gradients' device."""

    sumsq: torch.Tensor
    nonfinite: torch.Tensor


def grad_sumsq(grads: Sequence[torch.Tensor] | torch.Tensor, *, sizes: Sequence[int] | None = None,
               impl: str = "auto") -> SumSq:
    """Each unit's fp32 sum of squared gradient elements, and a non-finite flag, in one pass.

    grads: one contiguous fp32/bf16/fp16 tensor per unit, all on one device; or one flat buffer with
    ``sizes``, the numel of each unit in order (they must add up to its numel). impl: "auto", "triton" or
    "torch" (``fzero.ops._dispatch``).
    """
    units = _units(grads, sizes)
    device = units[0].device if units else torch.device("cpu")
    if choose(API, impl, device) == "triton":
        sumsq = _sumsq_triton(units, device)
    else:
        sumsq = sumsq_reference(units, device)
    return SumSq(sumsq, (~torch.isfinite(sumsq).all()).to(torch.float32).reshape(1))


def sumsq_reference(units: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """fp32 ``dot(g, g)`` per unit (a bf16/fp16 unit is first converted to fp32, exactly)."""
    if not units:
        return torch.zeros(0, dtype=torch.float32, device=device)
    sums = []
    for g in units:
        g32 = g.reshape(-1).to(torch.float32)
        sums.append(torch.dot(g32, g32))
    return torch.stack(sums)


def _sumsq_triton(units: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    from . import _kernels as k

    interpret = device.type != "cuda"
    blocks = [-(-g.numel() // BLOCK) for g in units]
    partial = torch.zeros(len(units), max(blocks, default=0), dtype=torch.float32, device=device)
    with on_device(device):
        for i, g in enumerate(units):
            if blocks[i]:
                k.launch(k.sumsq_kernel, (blocks[i],), g, partial[i], g.numel(), interpret=interpret, BLOCK=BLOCK,
                         num_warps=8)
    return partial.sum(dim=1)


def _units(grads, sizes) -> list[torch.Tensor]:
    if isinstance(grads, torch.Tensor):
        if sizes is None:
            raise TypeError(f"{API}: a single tensor needs sizes=[numel of each unit]; or pass a list with one tensor per unit.")
        sizes = [int(s) for s in sizes]
        if any(s < 0 for s in sizes) or sum(sizes) != grads.numel():
            raise ValueError(f"{API}: sizes must be numels >= 0 that add up to the buffer's {grads.numel()} elements; got {sizes}.")
        _check_one("grads", grads)
        return list(grads.reshape(-1).split(sizes))
    if sizes is not None:
        raise TypeError(f"{API}: sizes goes with one flat buffer; with a list of tensors (one per unit) leave it out.")
    units = list(grads)
    for i, g in enumerate(units):
        _check_one(f"grads[{i}]", g)
        if g.device != units[0].device:
            raise ValueError(f"{API}: every unit must be on one device; grads[0] is on {units[0].device}, grads[{i}] on {g.device}.")
    return units


def _check_one(name: str, g) -> None:
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{API}: {name} must be a tensor, got {type(g).__name__}.")
    if g.dtype not in _DTYPES:
        raise TypeError(f"{API}: {name} must be float32, bfloat16 or float16, got {g.dtype}.")
    if not g.is_contiguous():
        raise ValueError(f"{API}: {name} must be contiguous; call .contiguous() on it, or pass the flat buffer it views.")
