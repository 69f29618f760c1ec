"""What every part of the DeepSpeed config reader shares: the API name in errors, the parse context, typed values."""

from __future__ import annotations

import json
import math
from typing import Any

import torch

API = "fzero.config.from_deepspeed"
UNSET: Any = object()


class Ctx:
    """What a parse collects: the resolve arguments, which were used, notes, resolutions."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.resolved: list[tuple[str, Any, str]] = []

    def arg(self, name: str) -> Any:
        if name in self.args:
            self.used.add(name)
            return self.args[name]
        return UNSET


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def as_int(path: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, float) and value.is_integer():  # JSON numbers such as 5e8
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{API}: {path} must be an integer >= {low}, got {json.dumps(value)}.")
    return value


def as_float(path: str, value: Any, *, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        finite = "finite " if isinstance(value, float) and not math.isfinite(value) else ""  # Infinity is >= 0 too
        raise ValueError(f"{API}: {path} must be a {finite}number >= {low:g}, got {json.dumps(value)}.")
    return float(value)


def as_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{API}: {path} must be true or false, got {json.dumps(value)}.")
    return value
