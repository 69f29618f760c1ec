"""Shared pieces of the benchmarks: the model, batches, the plain reference step, timing and tables.

Not a benchmark itself; imported by the scripts next to it (run them from the repository root).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch

from fzero.models import GPT, GPTConfig, gpt_loss, num_params

LR = 3e-4
WEIGHT_DECAY = 0.01


def build_model(layers: int, width: int, heads: int, seq: int, vocab: int, seed: int = 0, tie: bool = True) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=layers, d_model=width, n_head=heads, seq_len=seq, vocab_size=vocab, tie_embeddings=tie))


def make_batch(k: int, batch: int, seq: int, vocab: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Batch number ``k``: random token ids (a pure function of seed and k)."""
    g = torch.Generator().manual_seed(seed + k)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}


class PlainStep:
    """The unsharded reference: ``torch.func.functional_call`` + ``loss.backward()`` + ``AdamW(fused=True)``.

    Same model, same loss, params as detached leaf copies (the module is not touched), no clipping.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable) -> None:
        self.params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.loss_fn = loss_fn

    def __call__(self, batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.params, batch)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def now() -> float:
    return time.perf_counter()


def peak_rss_reset() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_kib(field: str = "VmHWM") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | None, obj: Any) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)
