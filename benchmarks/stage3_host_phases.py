"""Where a stage-3 step's host time goes, phase by phase, against a plain PyTorch step of the same model.

On a GPU a step of a small model is bound by its host: the GPU waits while Python launches the next kernels. The H200
trace of GPT-2 124M (docs/benchmarks.md) showed fzero's kernels taking less GPU time than plain PyTorch's while its
step took 10 ms longer, the GPU idle in the forward (12 units whose host time exceeds their kernels'), before it (the
step's skeleton) and after the backward (the metrics and the update); the backward, run by autograd's device thread,
kept the GPU busy. This measures the host time of each of those phases without a profiler (a profiler's own cost per
op inflated every phase of both systems by a third or more): fzero's functions are wrapped with ``perf_counter``
timers, the systems alternate step by step, and each phase's median over the timed steps is printed.

    .venv/bin/python benchmarks/stage3_host_phases.py                         # CPU: GPT-2 124M's structure, widths of 8
    .venv/bin/python benchmarks/stage3_host_phases.py --device cuda --width 768 --heads 12 --batch 8 --seq 1024 \
        --vocab 50304                                                         # the GPU run's 124M

The model is ``fzero.models.GPT`` (``--layers`` blocks, 148 parameters at 12), moved to meta once the state holds its
params, as ``benchmarks/gpu_profile.py`` runs it; fzero runs ``stages=3`` on ``local_mesh(1)`` with bf16 compute,
fp32 reduce and ``fzero.optim.adamw``; plain runs the module under autocast(bf16) with ``AdamW(fused=True)`` and
reads the loss (one wait per step, as fzero's metrics do). On CUDA each timed step ends with a synchronize, so a
phase's time is its host time plus any wait for the device inside it (``finish`` holds the step's one wait).

Phases of fzero's step (nested ones indented; ``other`` is the rest of the phase above it):

* ``entry``: ``Step.__call__`` outside the rank program (state checks, batch split, the writes kept);
* ``gradient``: ``fzero.step._batch.gradient``: ``skeleton`` (``_build_skeleton``), ``units`` (every unit call, its
  module's own forward, ``module``, inside), ``backward`` (``torch.autograd.backward``), ``other`` (root unit, the
  model outside its units, the loss, ``gradient``'s own work);
* ``release``: ``UnitParams.release`` (the writes of the skeleton's forward, noted);
* ``finish``: ``fzero.step._update.finish`` (gradient norm, metrics, the wait, the update);
* ``rest``: the rank program's remainder (view, collect, the schedule's finish, restore).
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import sys
import time
from typing import Any, Callable

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fzero", default=None, help="import fzero from this checkout instead (before/after comparisons)")
    return p.parse_args(argv)


class Timers:
    """Host time per label within one step: ``wrap`` puts a ``perf_counter`` timer around a function attribute."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = collections.defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        acc = self.acc

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, fn))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def fzero_timers() -> Timers:
    """Timers on the functions of fzero's stage-3 step that bound its phases (see the module docstring)."""
    import fzero.step._batch as batch_mod
    import fzero.step._step as step_mod
    import fzero.zero._sharded as sharded

    t = Timers()
    t.wrap(step_mod.Step, "__call__", "step")
    t.wrap(step_mod, "rank_program", "rank_program")
    t.wrap(step_mod, "gradient", "gradient")
    t.wrap(sharded, "_build_skeleton", "skeleton")
    t.wrap(sharded, "run_unit", "units")
    t.wrap(sharded, "_as_own_class", "module")
    t.wrap(batch_mod.torch.autograd, "backward", "backward")
    t.wrap(sharded.UnitParams, "release", "release")
    t.wrap(step_mod, "finish", "finish")
    return t


def phases(acc: dict[str, float]) -> dict[str, float]:
    """The table's rows (ms) from one step's timers."""
    ms = {k: v * 1e3 for k, v in acc.items()}
    g = ms.get("gradient", 0.0)
    out = {
        "step": ms.get("step", 0.0),
        "entry": ms.get("step", 0.0) - ms.get("rank_program", 0.0),
        "gradient": g,
        "  skeleton": ms.get("skeleton", 0.0),
        "  units": ms.get("units", 0.0),
        "    module": ms.get("module", 0.0),
        "    fzero's": ms.get("units", 0.0) - ms.get("module", 0.0),
        "  backward": ms.get("backward", 0.0),
        "  other": g - ms.get("skeleton", 0.0) - ms.get("units", 0.0) - ms.get("backward", 0.0),
        "release": ms.get("release", 0.0),
        "finish": ms.get("finish", 0.0),
    }
    out["rest"] = ms.get("rank_program", 0.0) - g - out["release"] - out["finish"]
    return out


def build(args) -> dict[str, Callable[[], Any]]:
    """``{"plain": run, "fzero-s3": run}``: one step of each per call, on the same model and batch."""
    import fzero
    from fzero.models import GPT, GPTConfig

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, d_model=args.width, n_head=args.heads, seq_len=args.seq,
                          vocab_size=args.vocab, bias=True)).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    batch = {"x": tokens[:, :-1].contiguous(), "y": tokens[:, 1:].contiguous()}

    def lm(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    own = copy.deepcopy(model)
    opt = torch.optim.AdamW(own.parameters(), lr=1e-3, weight_decay=0.01, fused=True)

    def plain():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = own(batch["x"])
        loss = lm(logits, batch["y"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    step = fzero.compile(lambda params, b: lm(fzero.apply(model, params, b["x"]), b["y"]),
                         optimizer=fzero.optim.adamw(1e-3, weight_decay=0.01), stages=3, mesh=fzero.local_mesh(1),
                         precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32))
    box = {"state": step.init(fzero.params_of(model))}
    model.to("meta")  # the state holds the params; fzero reads the module's structure (as gpu_profile.py runs it)

    def s3():
        box["state"], metrics = step(box["state"], batch)
        return metrics["loss"]

    return {"plain": plain, "fzero-s3": s3}


def main(argv=None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    if args.fzero:
        sys.path.insert(0, args.fzero)
    import fzero

    if args.device == "cpu":
        torch.set_num_threads(1)  # the host's Python and dispatch, not the kernels, are what this measures
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    systems = build(args)
    for run in systems.values():
        for _ in range(args.warmup):
            run()
    timers = fzero_timers()
    totals: dict[str, list[float]] = {k: [] for k in systems}
    rows: dict[str, list[float]] = collections.defaultdict(list)
    try:
        for _ in range(args.rounds):
            for name, run in systems.items():
                timers.acc.clear()
                sync()
                t = time.perf_counter()
                run()
                sync()
                totals[name].append((time.perf_counter() - t) * 1e3)
                if name == "fzero-s3":
                    for k, v in phases(timers.acc).items():
                        rows[k].append(v)
    finally:
        timers.restore()
    med = {k: statistics.median(v) for k, v in totals.items()}
    out = {"totals": med, "phases": {k: statistics.median(v) for k, v in rows.items()}}
    print(f"fzero from {fzero.__file__}; {args.layers} blocks x {args.width}, batch {args.batch}x{args.seq}, {args.device}")
    print(f"plain     {med['plain']:8.2f} ms/step (median of {args.rounds})")
    print(f"fzero-s3  {med['fzero-s3']:8.2f} ms/step, {med['fzero-s3'] - med['plain']:+.2f} ms over plain")
    print("fzero-s3 phases (median ms):")
    for k, v in out["phases"].items():
        print(f"  {k:14s} {v:8.2f}")
    return out


if __name__ == "__main__":
    main()
