"""Per-rank memory of every ZeRO stage and offload choice, before a run: ``python -m fzero.estimate``.

The ZeRO paper's Figure 1 (7.5B parameters, 64 ranks, mixed precision with Adam: K = 12)::

    python -m fzero.estimate --params 7.5e9 --world-size 64

The repo's reference GPT (218M parameters) on 2 ranks in fp32, with its units and gathered working set::

    python -m fzero.estimate --model gpt-218m --world-size 2 --precision fp32

Like DeepSpeed's ``estimate_zero3_model_states_mem_needs_all_live``, but for stages 0-3, with offload to the
host or to disk, and (given a model) the stage-3 gathered units and the step's transients; see
``fzero.estimate_memory`` for what each column counts. Activations are not included.
"""

from __future__ import annotations

import argparse
import math

import torch

from fzero.estimate._estimate import CATEGORIES, MemoryEstimate, estimate_memory
from fzero import _rules

__all__ = ["CHOICES", "MODELS", "estimate_memory", "main", "table"]

UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}
MODELS = ("gpt-tiny", "gpt-small", "gpt-218m")
CHOICES = _rules.combinations()  # (stage, offload, offload_params): every combination fzero.compile accepts


def _model(name: str) -> torch.nn.Module:
    from fzero.models import GPT, GPTConfig

    cfg = {"gpt-tiny": GPTConfig.tiny, "gpt-small": GPTConfig.small, "gpt-218m": GPTConfig.ref218m}[name]()
    with torch.device("meta"):  # shapes only: nothing is allocated
        return GPT(cfg)


def table(estimates: list[MemoryEstimate], *, unit: str = "GB") -> str:
    """One row per estimate: model states (the paper's column), then device categories, host and disk totals, and
    the total where device and host are one memory (a CPU-only machine: the host's copies are the tensors)."""
    size = UNITS[unit]
    cols = ("stage", "offload", "model states", *(f"dev {c}" for c in CATEGORIES), "dev total", "host total", "disk total",
            "one-memory total")
    rows = []
    for e in estimates:
        where = "none" if e.offload is None else e.offload + ("+params" if e.offload_params else "")
        values = [e.model_states, *(getattr(e.device, c) for c in CATEGORIES), e.device.total, e.host.total, e.disk.total,
                  e.one_memory.total]
        rows.append([str(e.stages), where, *(f"{v / size:.2f}" for v in values)])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[MemoryEstimate]:
    p = argparse.ArgumentParser(prog="python -m fzero.estimate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=float, help="number of parameters, e.g. 7.5e9")
    src.add_argument("--model", choices=MODELS, help="one of fzero.models' reference GPTs (built on the meta device)")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                   help="bf16/fp16: 2-byte params and grads with fp32 master weights (the paper's mixed precision)")
    p.add_argument("--optimizer", choices=("adamw", "adam", "lamb", "lion", "sgd"), default="adamw")
    p.add_argument("--unit", choices=tuple(UNITS), default="GB", help="GB = 1e9 bytes, as the paper")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.params is not None and not (args.params >= 1 and math.isfinite(args.params)):  # nan and inf too
        p.error(f"--params must be a finite number >= 1, got {args.params:g}")
    source = args.params if args.params is not None else _model(args.model)
    estimates = [estimate_memory(source, stages=s, world_size=args.world_size, offload=o, offload_params=op,
                                 precision=args.precision, optimizer=args.optimizer) for s, o, op in CHOICES]
    first = estimates[0]
    what = args.model or "a parameter count"
    print(f"{first.num_params:,} parameters ({what}), {args.world_size} ranks, {first.precision}, {args.optimizer}: "
          f"{args.unit} per rank")
    print(table(estimates, unit=args.unit))
    if args.model is None:
        print("(a count has no units: the stage-3 gathered units and the step's transients need --model)")
    return estimates

# What other packages use of this one (they import it from here, never from a private module):
from fzero.estimate._estimate import estimate_memory, MemoryEstimate
from fzero.estimate._formula import zero_model_state_bytes
