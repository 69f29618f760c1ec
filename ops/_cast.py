"""Scale a gradient and cast it into the reduce dtype in one pass: ``out = (grad * scale).to(dtype)``.

For example the pre-division by the world size before a bf16 reduce-scatter, which keeps the sum in
range: reading an fp32 gradient once and writing bf16 moves 6 bytes per element, where ``grad.mul(s)``
then ``.to(torch.bfloat16)`` moves 14 and allocates an fp32 temporary.

Arithmetic, the same in the kernel and the reference: the gradient is converted to fp32 (exactly), multiplied
by ``scale`` rounded to fp32, and the fp32 product rounded once to ``dtype``, to nearest even. (Multiplying
a bf16 tensor by a number in torch would round to bf16 first, and converting that to fp32 keeps that
rounding; here a bf16 gradient into an fp32 output is rounded once, not twice.) So the two agree bit for bit.
"""

from __future__ import annotations

import torch

from ._dispatch import choose, on_device
from ._numbers import f32

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024
API = "fzero.ops.scale_cast"


def scale_cast(grad: torch.Tensor, scale: float, dtype: torch.dtype, *, out: torch.Tensor | None = None,
               impl: str = "auto") -> torch.Tensor:
    """``(grad * scale).to(dtype)`` in one pass, rounded once (module docstring); returns ``out``.

    grad: a contiguous fp32/bf16/fp16 tensor. scale: a number (used as fp32). dtype: float32, bfloat16 or
    float16. out: optional, a contiguous tensor of ``dtype`` and grad's numel and device (it may not overlap
    grad unless it is grad itself, of the same dtype); None: a new tensor of grad's shape. impl: "auto",
    "triton" or "torch" (``fzero.ops._dispatch``).
    """
    _check(grad, scale, dtype, out)
    if out is None:
        out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    s = f32(scale)
    if choose(API, impl, grad.device) == "triton":
        _scale_cast_triton(grad, s, out)
    else:
        scale_cast_reference(grad, s, out)
    return out


def scale_cast_reference(grad: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """fp32 product, rounded once into ``out`` (torch's copy_ rounds to nearest even); ``scale`` is an fp32 value."""
    out.view(-1).copy_(grad.reshape(-1).to(torch.float32) * scale)


def _scale_cast_triton(grad: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    from . import _kernels as k

    n = grad.numel()
    if n == 0:
        return
    with on_device(grad.device):
        k.launch(k.scale_cast_kernel, (-(-n // BLOCK),), grad, out, n, scale, interpret=grad.device.type != "cuda",
                 OUT_BF16=out.dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4)


def _check(grad, scale, dtype, out) -> None:
    if not isinstance(grad, torch.Tensor) or grad.dtype not in _DTYPES:
        raise TypeError(f"{API}: grad must be a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(grad, 'dtype', type(grad).__name__)}.")
    if not grad.is_contiguous():
        raise ValueError(f"{API}: grad must be contiguous; call .contiguous() on it, or pass the flat buffer it views.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{API}: scale must be a number (e.g. 1 / world_size), got {type(scale).__name__}.")
    if dtype not in _DTYPES:
        raise TypeError(f"{API}: dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}.")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{API}: out must be a tensor or None, got {type(out).__name__}.")
        if out.dtype != dtype or out.numel() != grad.numel() or out.device != grad.device or not out.is_contiguous():
            raise ValueError(f"{API}: out must be a contiguous {dtype} tensor of grad's {grad.numel()} elements on "
                             f"{grad.device}; got {out.dtype}, {out.numel()} elements on {out.device}"
                             f"{'' if out.is_contiguous() else ', not contiguous'}.")
