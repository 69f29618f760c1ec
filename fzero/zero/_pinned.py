"""Page-locked host buffers of exact size, for offload on CUDA.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator rounds every pinned block up to
the next power of two and keeps freed blocks for reuse, so a full-size buffer can cost up to twice its size in
page-locked memory. Measured on one H100 (torch 2.11): ``offload="cpu"`` held 29.4 host bytes per parameter at
3.8B params, against the 16 of ZeRO-Offload's arithmetic (fp32 master, m, v and one gradient).

Here each buffer is its own anonymous mapping (page-aligned by the kernel, rounded up to a page, not to a power
of two), registered with ``cudaHostRegister`` so that copies to and from the device are asynchronous, and
unregistered before it is unmapped, when the last tensor using it is gone. Only CUDA has page-locked memory;
``pinned_empty`` is called where CUDA is available (``fzero.zero._policies.to_host``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from typing import Callable

import torch

PAGE = mmap.PAGESIZE


def registered_bytes(nbytes: int, *, page: int = PAGE) -> int:
    """Bytes a buffer of ``nbytes`` locks here: whole pages (at least one)."""
    return max(1, -(-nbytes // page)) * page


def caching_allocator_bytes(nbytes: int) -> int:
    """Bytes torch's caching host allocator reserves for a pinned block of ``nbytes``: the next power of two."""
    return 1 << max(0, nbytes - 1).bit_length()


def cuda_register(address: int, nbytes: int) -> Callable[[], None]:
    """Lock ``nbytes`` at ``address`` for CUDA (``cudaHostRegister``); returns the call that unlocks them."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"fzero.CPUOffload: cudaHostRegister of {nbytes:,} bytes of host memory failed ({err}): the system may "
            f"limit page-locked memory (ulimit -l) or be out of it. Pass fzero.CPUOffload(pin_memory=False) to offload "
            f"into pageable memory (copies are then synchronous)."
        )

    def unregister() -> None:
        # a copy into these pages may still be in flight (a step that failed after issuing it, whose state is then
        # dropped): wait for the device first, so no transfer outlives the pages (rare: once per buffer, at its end)
        if not sys.is_finalizing():  # (at the interpreter's exit nothing is left to copy, and CUDA may be gone)
            torch.cuda.synchronize()
        cudart.cudaHostUnregister(address)

    return unregister


class _Mapping:
    """The owner of one registered mapping: unregisters, then unmaps, when the last tensor over it is gone."""

    def __init__(self, nbytes: int, register: Callable[[int, int], Callable[[], None]]) -> None:
        self.size = registered_bytes(nbytes)
        self.map = mmap.mmap(-1, self.size)
        probe = ctypes.c_char.from_buffer(self.map)
        self.address = ctypes.addressof(probe)
        del probe  # no export left on the mapping, so that it can be closed
        self.unregister = None
        self.unregister = register(self.address, self.size)

    def __del__(self) -> None:
        if self.unregister is not None:
            self.unregister()  # before the pages are unmapped
        self.map.close()


def pinned_empty(numel: int, dtype: torch.dtype, *,
                 register: Callable[[int, int], Callable[[], None]] = cuda_register) -> torch.Tensor:
    """An uninitialised 1-D host tensor of ``numel`` elements in page-locked memory of exact size (whole pages).
    ``register(address, nbytes) -> unregister``: ``cuda_register`` (tests pass their own)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    owner = _Mapping(nbytes, register)
    view = (ctypes.c_uint8 * owner.size).from_address(owner.address)
    view.owner = owner  # type: ignore[attr-defined]  # the tensor keeps ``view`` alive, and ``view`` the mapping
    return torch.frombuffer(view, dtype=torch.uint8)[:nbytes].view(dtype)
