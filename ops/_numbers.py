"""Scalars as the kernels take them (no triton needed: the torch references use them too)."""

from __future__ import annotations

import struct

import numpy as np


def f32(x: float) -> float:
    """``x`` rounded to fp32 (to nearest even), as a Python float; past fp32's range, inf (IEEE, without numpy's warning)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def f64_bits(x: float) -> int:
    """The bit pattern of the double ``x`` as a signed int64, for a kernel to bitcast back (``_kernels``)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]
