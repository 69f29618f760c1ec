"""Which implementation an op runs: the Triton kernel or its torch reference.

Every op in ``fzero.ops`` takes ``impl="auto" | "triton" | "torch"``:

- ``"auto"`` (the default): the Triton kernel for CUDA tensors when ``import triton`` works, else the torch
  reference. CPU tensors always get the reference: compiled Triton does not run on the CPU.
- ``"triton"``: the Triton kernel. On CUDA tensors it is compiled; on CPU tensors it runs under Triton's
  interpreter (numpy, about 100x slower), which is how CI tests the kernels on a CPU-only
  machine. Without triton installed this raises an ImportError that says how to install it.
- ``"torch"``: the reference, plain torch ops with the kernel's arithmetic, on any device.

triton is imported lazily, on the first op that asks for it, so ``import fzero`` and ``import fzero.ops``
never pay for it (about 0.3 s) and never warn when it is missing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any

import torch

IMPLS = ("auto", "triton", "torch")

INSTALL_HINT = "pip install 'fzero[triton]'"


@functools.lru_cache(maxsize=None)
def _import_triton() -> tuple[Any, str]:
    """(the triton module or None, why it is missing). Cached: the answer does not change in a process."""
    try:
        return importlib.import_module("triton"), ""
    except ImportError as e:  # only a missing package means "use the reference"; other errors are real bugs
        return None, f"{type(e).__name__}: {e}"


def triton_available() -> bool:
    """True when ``import triton`` works in this process."""
    return _import_triton()[0] is not None


def choose(api: str, impl: str, device: torch.device) -> str:
    """"triton" or "torch" for an op on tensors of ``device``; raises on a bad ``impl`` (see the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"{api}: impl must be one of {', '.join(map(repr, IMPLS))}; got {impl!r}.")
    if impl == "torch":
        return "torch"
    if impl == "triton":
        if not triton_available():
            raise ImportError(
                f"{api}: impl='triton' needs the triton package, which this Python cannot import "
                f"({_import_triton()[1]}). Install it with {INSTALL_HINT} (Linux x86_64), or pass impl='auto' "
                f"to run the torch reference wherever triton is missing."
            )
        return "triton"
    return "triton" if device.type == "cuda" and triton_available() else "torch"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' one (a no-op off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
