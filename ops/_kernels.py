"""The Triton kernels, and how they are built: compiled for CUDA tensors, interpreted for CPU tensors.

Imported only after ``import triton`` worked (``fzero.ops._dispatch``). The kernel functions below are plain
Python functions, not decorated at import: ``kernel(fn, interpret=...)`` builds each one both ways on
first use. Triton 3.x picks the interpreter when ``@triton.jit`` runs, from ``TRITON_INTERPRET``; building the
interpreted twin explicitly (with that variable set only around the ``triton.jit`` call) lets the interpreter
tests run inside an ordinary pytest process, next to code that uses the compiled kernels, with nothing set
globally. One catch: triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``, ...) were built when
triton was imported, compiled, and an interpreted kernel cannot call them. So the kernels call only builtins
(``tl.full``, not ``tl.zeros``): the non-finite flag is a masked store instead of a max, and the one sum is
``tl.reduce`` with ``_add``, whose plain Python body the interpreter calls (``combine_fn.fn``) and which
compiles as any combine function. A kernel that breaks this rule fails loudly in the interpreter tests.

Arithmetic that must be the same in both builds and in the torch reference:

- fp64 scalars (Adam's betas, eps, weight decay) travel as the int64 bit patterns of the doubles and are
  bitcast back in the kernel. The interpreter turns a Python float argument into an fp32 constant whatever
  the annotation, so an fp64 argument would lose its low bits there and the two builds would differ.
- fp32 scalars are passed already rounded to fp32 (``f32``), so no build rounds them differently.
- Division and square root use ``div_rn`` / ``sqrt_rn``, IEEE round-to-nearest, as CUDA C does by default;
  Triton's ``/`` and ``sqrt`` are approximate on NVIDIA GPUs.
- fp32 to bf16 is rounded to nearest even by hand on the bits (``_bf16_bits`` below, inlined): the
  interpreter's own fp32->bf16 cast truncates.
"""

# No `from __future__ import annotations`: triton < 3.3 reads the kernels' annotations (tl.constexpr) as objects.

import os
import threading
from typing import Callable

import numpy as np
import triton
import triton.language as tl

from ._numbers import f32, f64_bits  # noqa: F401  (re-exported for the launchers)

_lock = threading.Lock()
_built: dict[tuple[Callable, bool], object] = {}


def kernel(fn: Callable, *, interpret: bool, do_not_specialize: tuple[str, ...] = ()) -> object:
    """``fn`` as a Triton kernel: compiled (for CUDA tensors) or interpreted (for CPU tensors); built once."""
    key = (fn, interpret)
    with _lock:  # rank threads of a local mesh may build at once, and the env var below is process-wide
        if key not in _built:
            if interpret:
                before = os.environ.get("TRITON_INTERPRET")
                os.environ["TRITON_INTERPRET"] = "1"
                try:
                    _built[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize))
                finally:
                    if before is None:
                        del os.environ["TRITON_INTERPRET"]
                    else:
                        os.environ["TRITON_INTERPRET"] = before
            else:
                _built[key] = triton.jit(fn, do_not_specialize=list(do_not_specialize))
        return _built[key]


def launch(fn: Callable, grid: tuple[int, ...], *args, interpret: bool, do_not_specialize: tuple[str, ...] = (),
           **meta) -> None:
    """Run ``fn`` on ``grid``.

    Compiled without FMA contraction (``enable_fp_fusion=False``): each ``a * b + c`` rounds twice, as the torch
    references and the interpreter compute it, so the compiled kernels equal them bit for bit. Passing it also
    keeps triton >= 3.9 from warning that its default changes. The interpreter computes with numpy, which warns
    on inf - inf and the like; a GPU computes those silently (IEEE), so it runs with numpy's warnings off.
    """
    k = kernel(fn, interpret=interpret, do_not_specialize=do_not_specialize)
    if interpret:
        with np.errstate(all="ignore"):
            k[grid](*args, **meta)
    else:
        k[grid](*args, enable_fp_fusion=False, **meta)


# -- fused Adam / AdamW --------------------------------------------------------------------------------------

ADAM_NO_SPECIALIZE = ("b1_bits", "omb1_bits", "b2_bits", "omb2_bits", "eps_bits", "wd_bits")


def adam_kernel(
    master_ptr, grad_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, found_ptr, flag_ptr,
    n, inv_scale, step_size, bc2_sqrt,
    b1_bits: tl.int64, omb1_bits: tl.int64, b2_bits: tl.int64, omb2_bits: tl.int64, eps_bits: tl.int64, wd_bits: tl.int64,
    DECAY: tl.constexpr, SCALE: tl.constexpr, SKIP: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr,
):
    # DECAY: 0 none, 1 L2 (Adam: grad += wd * param), 2 decoupled (AdamW: param -= lr * wd * param; wd_bits is lr*wd)
    # SCALE: 0 none, 1 grad *= inv_scale (an fp32 argument), 2 grad *= *scale_ptr (an fp32 tensor)
    # SKIP: found_ptr given; a nonzero value there masks every load and store (the step is skipped)
    # OUT: 0 none, 1 bf16 copy-out (rounded by hand), 2 copy-out cast to out_ptr's dtype (fp16/fp32)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: shards past 2**31 elements
    if SKIP:  # a set found_inf empties the range (not `mask & flag`: the interpreter cannot `&` a block and a scalar)
        mask = offs < tl.where(tl.load(found_ptr) == 0, n, 0)
    else:
        mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE == 1:
        g = g * inv_scale
    elif SCALE == 2:
        g = g * tl.load(scale_ptr)
    # The flag is only ever set: every lane with a bad element stores 1.0 to the one address (they all write
    # the same value, so the race is harmless), and no lane stores anything when all are finite.
    bad = mask & ((g != g) | (tl.abs(g) == float("inf")))
    tl.store(flag_ptr + tl.full([BLOCK], 0, tl.int32), tl.full([BLOCK], 1.0, tl.float32), mask=bad)
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    b1 = b1_bits.to(tl.int64).to(tl.float64, bitcast=True)
    omb1 = omb1_bits.to(tl.int64).to(tl.float64, bitcast=True)
    b2 = b2_bits.to(tl.int64).to(tl.float64, bitcast=True)
    omb2 = omb2_bits.to(tl.int64).to(tl.float64, bitcast=True)
    eps = eps_bits.to(tl.int64).to(tl.float64, bitcast=True)
    wd = wd_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if DECAY == 2:
        p64 = p.to(tl.float64)
        p = (p64 - wd * p64).to(tl.float32)
    elif DECAY == 1:
        g = (g.to(tl.float64) + p.to(tl.float64) * wd).to(tl.float32)
    g64 = g.to(tl.float64)
    m = (b1 * m.to(tl.float64) + omb1 * g64).to(tl.float32)
    v = (b2 * v.to(tl.float64) + omb2 * g64 * g64).to(tl.float32)
    denom = (tl.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
    p = p - tl.div_rn(step_size * m, denom)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if OUT == 1:  # fp32 -> bf16 rounded to nearest even on the bits; any NaN -> the quiet NaN 0x7FC0
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(out_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    elif OUT == 2:
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


# -- per-unit sum of squares ---------------------------------------------------------------------------------


def sumsq_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    # One program per block of BLOCK elements writes that block's sum of squares; torch adds the partial sums. No
    # atomics, so the result is the same in every run; no loop, so every Triton interpreter runs it (3.5's cannot
    # loop over tensor bounds with numpy 2.4).
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.reduce(x * x, 0, _add))


@triton.jit
def _add(a, b):
    return a + b


# -- cast and scale ------------------------------------------------------------------------------------------


def scale_cast_kernel(x_ptr, out_ptr, n, scale, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    if OUT_BF16:  # as in adam_kernel: round to nearest even on the bits
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        tl.store(out_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
