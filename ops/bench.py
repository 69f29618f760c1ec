"""GB/s of one fused AdamW step: fzero's Triton kernel, its torch reference, or ``torch._fused_adamw_``.

``adamw_gbps(n, device="cuda", impl="triton")`` is what ``benchmarks/gpu.py`` reports next to
``impl="torch_fused"``. The bytes counted are the ones a fused step must move, whatever an
implementation moves in fact: read the gradient and the fp32 master, exp_avg and exp_avg_sq, write the
three back, and write the param copy-out if there is one (28 bytes per element for an fp32 gradient and no
copy-out). So GB/s is comparable across implementations: an implementation that moves more (the
reference's fp64 temporaries, or ``torch_fused`` followed by a separate copy-out) shows as slower.

On the CPU (for a smoke test, or to compare with torch's fused CPU kernel, measured
at about 780 M elements/s on this project's 2-core machine) "torch" and "torch_fused" run; "triton" would be the interpreter, which measures nothing useful.
"""

from __future__ import annotations

import statistics
import time

import torch

from ._adam import adamw_

IMPLS = ("triton", "torch", "torch_fused")
API = "fzero.ops.bench.adamw_gbps"


def adamw_bytes(n: int, *, grad_dtype: torch.dtype = torch.float32, param_out: torch.dtype | None = None) -> int:
    """Bytes one fused AdamW step over ``n`` elements must move (module docstring)."""
    grad = torch.empty((), dtype=grad_dtype).element_size()
    out = torch.empty((), dtype=param_out).element_size() if param_out is not None else 0
    return n * (grad + 4 * 3 + 4 * 3 + out)


def adamw_gbps(n: int, *, device: str | torch.device = "cuda", impl: str = "triton", repeats: int = 20,
               warmup: int = 3, grad_dtype: torch.dtype = torch.float32, param_out: torch.dtype | None = None) -> float:
    """Median GB/s (1e9 bytes per second) of one AdamW step over ``n`` fp32 elements, over ``repeats`` timed steps.

    impl: "triton" (fzero's kernel), "torch" (its reference) or "torch_fused" (``torch._fused_adamw_``, with
    ``param_out.copy_(master)`` after it when a copy-out dtype is given, since torch's kernel has none).
    Timed with CUDA events on a GPU (the GPU time of each step alone), ``time.perf_counter`` on the CPU.
    The first ``warmup`` steps are not timed (they compile the Triton kernel). Take n of 10**7 or more on a
    GPU: below that, the host's launch overhead (tens of microseconds) is part of what the events see.
    """
    device = torch.device(device)
    if impl not in IMPLS:
        raise ValueError(f"{API}: impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}.")
    if impl == "triton" and device.type != "cuda":
        raise ValueError(f"{API}: impl='triton' needs a CUDA device (on {device} Triton only runs its interpreter, "
                         f"which measures nothing); use device='cuda', or impl='torch' / 'torch_fused' on the CPU.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"{API}: n and repeats must be integers >= 1 and warmup >= 0; got n={n!r}, repeats={repeats!r}, "
                         f"warmup={warmup!r}.")
    if impl == "torch_fused" and grad_dtype != torch.float32:
        raise ValueError(f"{API}: impl='torch_fused' needs grad_dtype=torch.float32 (torch's kernel wants the params' "
                         f"dtype); got {grad_dtype}.")
    gen = torch.Generator(device="cpu").manual_seed(0)
    master = torch.randn(n, generator=gen).to(device)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(device=device, dtype=grad_dtype)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(n, dtype=param_out, device=device) if param_out is not None else None
    # torch's kernel reads its step count from a tensor: made before the timing, so no fill is timed.
    step_ts = [torch.full((), s, dtype=torch.float32, device=device) for s in range(warmup + repeats + 1)]
    settings = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)

    def one_step(step: int) -> None:
        if impl == "torch_fused":
            torch._fused_adamw_([master], [grad], [exp_avg], [exp_avg_sq], [], [step_ts[step]], amsgrad=False, maximize=False,
                                **settings)
            if out is not None:
                out.copy_(master)
        else:
            adamw_(master, grad, exp_avg, exp_avg_sq, step=step, param_out=out, impl=impl, **settings)
    for step in range(1, warmup + 1):
        one_step(step)
    times = []
    for step in range(warmup + 1, warmup + repeats + 1):
        times.append(_time(one_step, step, device))
    return adamw_bytes(n, grad_dtype=grad_dtype, param_out=param_out) / statistics.median(times) / 1e9


def _time(fn, step: int, device: torch.device) -> float:
    """Seconds one call takes: CUDA events around it on a GPU (its GPU time), wall clock on the CPU."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(step)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    t0 = time.perf_counter()
    fn(step)
    return time.perf_counter() - t0
