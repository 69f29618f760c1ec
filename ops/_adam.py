"""Fused Adam / AdamW over a flat shard: one pass over memory, fp32 master weights.

One call reads the gradient (fp32, bf16 or fp16) and the fp32 master, ``exp_avg`` and ``exp_avg_sq``, and
writes the three back (plus, optionally, the updated master cast into a bf16/fp16 param buffer): 16 bytes
read and 12 written per element for an fp32 gradient, the least a step can move. In the same pass it
unscales the gradient (``inv_scale``, for fp16 loss scaling or a clip coefficient) and reports whether any
gradient element is inf or NaN.

Order of operations: that of torch's CUDA kernel (``FusedAdamMathFunctor`` in
``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, as in torch 2.x sources), so that this kernel and
``torch._fused_adamw_`` / ``torch._fused_adam_`` on CUDA agree to fp32 rounding. There, the hyperparameters
are doubles and the element values fp32 (``opmath_t``), so C++'s promotion rules compute some steps in
double and round once to fp32; each step below says which. ``step`` is torch's fp32 step count:

1. ``g = grad * inv_scale`` (fp32; torch divides by the scale in double: the same bits when the scale is
   a power of two, as loss scales are);
2. AdamW: ``p = fp32(p - (lr*wd) * p)`` in double; Adam: ``g = fp32(g + p * wd)`` in double;
3. ``m = fp32(b1*m + (1-b1)*g)`` and ``v = fp32(b2*v + ((1-b2)*g)*g)`` in double;
4. on the host, once per call: ``bc1 = fp32(1 - b1**step)``, ``step_size = fp32(lr / bc1)``,
   ``bc2_sqrt = sqrt(fp32(1 - b2**step))`` with the sqrt in fp32 (torch's kernel keeps ``1 - b2**step`` in an
   fp32 ``opmath_t`` and takes ``std::sqrt`` of that; a double sqrt rounded once differs in the last bit at
   some steps, e.g. step 3 with b2 = 0.999, which then moved ~1% of the elements by an ulp on an H100);
5. ``denom = fp32(fp32(sqrt(v) / bc2_sqrt) + eps)``: sqrt and division in fp32, the eps add in double;
6. ``p = p - (step_size * m) / denom`` in fp32.

Why not the plain fp32 formula: the Triton kernel would then differ from torch's in the last bits of most
elements, and those differences grow through Adam's normalisation (it divides by the root of a small second moment), so every parity test
against torch would need a loose tolerance. Why not ``lerp`` (torch's CPU kernel uses it for ``m``): the
CUDA kernel does not, and on CUDA this kernel replaces the CUDA one.

Bitwise facts: the torch reference (``adam_reference``) and the Triton kernel, compiled or interpreted,
compute the very same IEEE operations (the reference divides by a device tensor, never by a Python number,
which torch's CUDA kernels turn into a multiplication by the reciprocal), unfused (compiled with ``enable_fp_fusion=False``), so they agree bit
for bit. torch's CUDA kernel is compiled by nvcc, which contracts the double mul-adds of steps 2-3 into FMAs,
and computes ``b**step`` with CUDA's pow: both can change a double's last bit, which changes the fp32 result
only when that bit decides the rounding (an estimate: once in 2**29 per operation), so rare elements end 1 ulp
apart. triton before 3.9 (3.3 and 3.5 checked) compiles ``div_rn``/``sqrt_rn`` flushing subnormal operands to
zero, which can matter only where a moment is subnormal (below 1.2e-38). torch's CPU kernel is another
arithmetic (fp32 hyperparameters, ``lerp`` for ``m``, a scalar tail): a few ulps apart.

The non-finite flag is the cheap part of the overflow check: it tells the caller about this call's
gradient, but the call has already updated the state (inf/NaN elements get NaN). To *skip* a step on
overflow, decide first and pass the decision in: ``grad_sumsq`` (which clipping needs anyway) gives a
flag, ``found_inf=flag`` makes this kernel a no-op on the device when it is set, with no host sync, as
torch's ``found_inf`` does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._dispatch import choose, on_device
from ._numbers import f32

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024
# The reference works on slices of this many elements so that its fp64 temporaries stay small; the
# arithmetic is elementwise, so slicing changes no bit.
_CHUNK = 1 << 20


class AdamScalars(NamedTuple):
    """The per-call numbers of the update, as both implementations use them (module docstring, steps 1-6)."""

    b1: float  # fp64
    omb1: float  # fp64: 1 - b1
    b2: float  # fp64
    omb2: float  # fp64: 1 - b2
    eps: float  # fp64
    wd: float  # fp64: lr * weight_decay (AdamW) or weight_decay (Adam)
    step_size: float  # fp32 value: lr / bc1
    bc2_sqrt: float  # fp32 value: sqrt(fp32(1 - b2**step)), the sqrt in fp32
    inv_scale: float  # fp32 value


def adam_scalars(*, step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 decoupled: bool, inv_scale: float = 1.0) -> AdamScalars:
    """Step 4 of the module docstring, on the host in double, rounded where torch's kernel rounds."""
    t = f32(step)  # torch keeps the step count in fp32
    bc1 = f32(1.0 - beta1**t)
    return AdamScalars(
        b1=float(beta1), omb1=1.0 - beta1, b2=float(beta2), omb2=1.0 - beta2, eps=float(eps),
        wd=lr * weight_decay if decoupled else float(weight_decay),
        step_size=f32(lr / bc1), bc2_sqrt=f32(math.sqrt(f32(1.0 - beta2**t))), inv_scale=f32(inv_scale),
    )


def adam_(
    master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    step: float | torch.Tensor, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
    weight_decay: float = 0.0, decoupled: bool = False, inv_scale: float | torch.Tensor = 1.0,
    param_out: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
    nonfinite: torch.Tensor | None = None, impl: str = "auto",
) -> torch.Tensor:
    """One Adam step (``decoupled=True``: AdamW) over a flat shard, in place; returns the non-finite flag.

    master, exp_avg, exp_avg_sq: contiguous fp32 tensors of one numel, updated in place. grad: contiguous,
    fp32/bf16/fp16, that numel, read only. step: the step count *after* this step (1 for the first), as
    torch's ``state["step"]``; a tensor is read on the host (a device sync for a CUDA tensor). inv_scale: the
    gradient is multiplied by it first (a number, or a one-element fp32 tensor on master's device, read on the
    device). param_out: a bf16/fp16/fp32 tensor of that numel that receives the updated master, rounded to
    nearest even. found_inf: a one-element fp32 tensor; nonzero means skip: nothing is read or written.
    nonfinite: a one-element fp32 tensor that is set to 1 when a gradient element (after ``inv_scale``) is
    inf or NaN and otherwise left as it is, so one flag can collect several calls; None: a new zero one.
    impl: "auto", "triton" or "torch" (``fzero.ops._dispatch``). The arithmetic is in the module docstring.
    """
    api = "fzero.ops.adamw_" if decoupled else "fzero.ops.adam_"
    _check(api, master, grad, exp_avg, exp_avg_sq, param_out, found_inf, nonfinite, inv_scale)
    for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{api}: {name} must be a Python number (a schedule's value for this step), got {type(value).__name__}.")
    if isinstance(step, torch.Tensor):
        step = float(step)  # a device sync for a CUDA tensor
    if not (isinstance(step, (int, float)) and step >= 1):
        raise ValueError(f"{api}: step must be the step count after this step, a number >= 1 (1 for the first step); got {step!r}.")
    scale_value = inv_scale if not isinstance(inv_scale, torch.Tensor) else 1.0
    s = adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     decoupled=decoupled, inv_scale=scale_value)
    if nonfinite is None:
        nonfinite = torch.zeros(1, dtype=torch.float32, device=master.device)
    decay = 0 if weight_decay == 0 else 2 if decoupled else 1  # as torch: no decay term at all when wd == 0
    scale = inv_scale if isinstance(inv_scale, torch.Tensor) else None if s.inv_scale == 1.0 else s.inv_scale
    if choose(api, impl, master.device) == "triton":
        _adam_triton(master, grad, exp_avg, exp_avg_sq, s, decay=decay, scale=scale, param_out=param_out,
                     found_inf=found_inf, nonfinite=nonfinite)
    else:
        adam_reference(master, grad, exp_avg, exp_avg_sq, s, decay=decay, scale=scale, param_out=param_out,
                       found_inf=found_inf, nonfinite=nonfinite)
    return nonfinite


def adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
           step: float | torch.Tensor, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
           weight_decay: float = 0.01, **kwargs) -> torch.Tensor:
    """AdamW (decoupled weight decay: ``param *= 1 - lr * wd``): ``adam_(..., decoupled=True)``; same arguments.
    weight_decay defaults to torch.optim.AdamW's 0.01."""
    return adam_(master, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, decoupled=True, **kwargs)


def adam_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   s: AdamScalars, *, decay: int, scale: float | torch.Tensor | None, param_out: torch.Tensor | None,
                   found_inf: torch.Tensor | None, nonfinite: torch.Tensor) -> None:
    """The kernel's arithmetic in plain torch ops (module docstring), on any device; the CPU execution path.

    ``decay``: 0 none, 1 L2 (Adam), 2 decoupled (AdamW). fp32 square roots are taken in double and rounded:
    torch's CPU fp32 ``sqrt`` is not correctly rounded, and a double square root rounded to fp32 is (53 bits
    are more than the 2*24+2 that make the double rounding harmless). ``found_inf`` is read on the host.
    """
    if found_inf is not None and float(found_inf.reshape(())) != 0:  # a device sync for a CUDA flag
        return
    flats = [t.view(-1) for t in (master, grad, exp_avg, exp_avg_sq)]
    # A tensor on the master's device, not a Python number: torch's CUDA division by a host scalar multiplies
    # by its reciprocal (one rounding more), which moves the last bit of ~0.1% of the elements.
    bc2_sqrt = torch.full((), s.bc2_sqrt, dtype=torch.float32, device=master.device)
    out = param_out.view(-1) if param_out is not None else None
    for lo in range(0, flats[0].numel(), _CHUNK):
        p, grad_c, m, v = (t[lo : lo + _CHUNK] for t in flats)
        g = grad_c.to(torch.float32)
        if scale is not None:
            g = g * (scale.reshape(()) if isinstance(scale, torch.Tensor) else scale)
        nonfinite.masked_fill_(~torch.isfinite(g).all(), 1.0)
        new_p = p
        if decay == 2:
            p64 = p.double()
            new_p = (p64 - s.wd * p64).float()
        elif decay == 1:
            g = (g.double() + p.double() * s.wd).float()
        g64 = g.double()
        new_m = (s.b1 * m.double() + s.omb1 * g64).float()
        new_v = (s.b2 * v.double() + s.omb2 * g64 * g64).float()
        denom = ((new_v.double().sqrt().float() / bc2_sqrt).double() + s.eps).float()
        new_p = new_p - (s.step_size * new_m) / denom
        p.copy_(new_p)
        m.copy_(new_m)
        v.copy_(new_v)
        if out is not None:
            out[lo : lo + _CHUNK].copy_(new_p)


def _adam_triton(master, grad, exp_avg, exp_avg_sq, s: AdamScalars, *, decay, scale, param_out, found_inf, nonfinite):
    from . import _kernels as k

    n = master.numel()
    if n == 0:
        return
    interpret = master.device.type != "cuda"
    scale_mode = 0 if scale is None else 2 if isinstance(scale, torch.Tensor) else 1
    out_mode = 0 if param_out is None else 1 if param_out.dtype == torch.bfloat16 else 2
    # Unused pointer arguments get a tensor that is there anyway: Triton needs some pointer of the right kind.
    args = (
        master, grad, exp_avg, exp_avg_sq,
        param_out if param_out is not None else master,
        scale if scale_mode == 2 else nonfinite,
        found_inf if found_inf is not None else nonfinite,
        nonfinite,
        n, s.inv_scale, s.step_size, s.bc2_sqrt,
        k.f64_bits(s.b1), k.f64_bits(s.omb1), k.f64_bits(s.b2), k.f64_bits(s.omb2), k.f64_bits(s.eps), k.f64_bits(s.wd),
    )
    meta = dict(DECAY=decay, SCALE=scale_mode, SKIP=found_inf is not None, OUT=out_mode, BLOCK=BLOCK, num_warps=4)
    grid = (-(-n // BLOCK),)
    with on_device(master.device):
        k.launch(k.adam_kernel, grid, *args, interpret=interpret, do_not_specialize=k.ADAM_NO_SPECIALIZE, **meta)


def _check(api, master, grad, exp_avg, exp_avg_sq, param_out, found_inf, nonfinite, inv_scale) -> None:
    """Shapes, dtypes, devices and layout, each error naming the argument and what it must be."""
    for name, t in (("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{api}: {name} must be a tensor, got {type(t).__name__}.")
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32:
            raise TypeError(f"{api}: {name} must be float32 (the fp32 master and moments), got {t.dtype}.")
    if grad.dtype not in _GRAD_DTYPES:
        raise TypeError(f"{api}: grad must be float32, bfloat16 or float16, got {grad.dtype}.")
    if param_out is not None and (not isinstance(param_out, torch.Tensor) or param_out.dtype not in _OUT_DTYPES):
        raise TypeError(f"{api}: param_out must be a bfloat16, float16 or float32 tensor or None, got "
                        f"{getattr(param_out, 'dtype', type(param_out).__name__)}.")
    flat = [("master", master), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    if param_out is not None:
        flat.append(("param_out", param_out))
    for name, t in flat:
        if t.numel() != master.numel() or t.device != master.device:
            raise ValueError(f"{api}: {name} must have master's numel and device ({master.numel()} on {master.device}); "
                             f"got {t.numel()} on {t.device}.")
        if not t.is_contiguous():
            raise ValueError(f"{api}: {name} must be contiguous (a flat shard); call .contiguous() on it, or pass the flat buffer it views.")
    for name, t in (("found_inf", found_inf), ("nonfinite", nonfinite),
                    ("inv_scale", inv_scale if isinstance(inv_scale, torch.Tensor) else None)):
        if t is not None and (t.dtype != torch.float32 or t.numel() != 1 or t.device != master.device):
            raise ValueError(f"{api}: {name} must be a one-element float32 tensor on {master.device}; got "
                             f"{t.dtype} of {t.numel()} elements on {t.device}.")
    if not isinstance(inv_scale, (torch.Tensor, int, float)) or isinstance(inv_scale, bool):
        raise TypeError(f"{api}: inv_scale must be a number or a one-element float32 tensor, got {type(inv_scale).__name__}.")
