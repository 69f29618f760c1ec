"""Overhead of fzero's ZeRO-3 machinery on one rank: stage 3 on ``fzero.local_mesh(1)`` vs a plain step.

Run from the repository root (about 2 minutes on a 2-core CPU):

    .venv/bin/python benchmarks/stage3_overhead.py --json-out runs/stage3_overhead.json

Systems, all on the same GPT (default 6 layers x 256 wide, 8 heads, vocab 256, seq 128, batch 8; fp32),
the same batches, AdamW(lr 3e-4, weight decay 0.01) and no gradient clipping:

* ``plain``: ``torch.func.functional_call`` + ``loss.backward()`` + ``torch.optim.AdamW(fused=True)``;
* ``plain-ckpt``: the plain step on the module itself with each block under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the cost of recomputing each block's
  forward in backward, which stage 3 also pays, without any of fzero's machinery;
* ``fzero-s0``: ``fzero.compile(stages=0)`` with no mesh (torch.func.grad over flat buffers, fused AdamW);
* ``fzero-s0-remat``: the same with ``remat=True`` (each block recomputed in backward, as ``plain-ckpt`` does);
* ``fzero-s3``: ``fzero.compile(stages=3, mesh=fzero.local_mesh(1))``, prefetch on (the default);
* ``fzero-s3-nopf``: the same with ``prefetch=False``;
* ``fzero-s3-ag``: stage 3 with ``autodiff="autograd"`` (plain torch.autograd instead of torch.func.grad);
* ``fzero-s3-remat``: stage 3 with ``remat=True`` (each unit recomputed in backward, gathered again).

Stage 3 on one rank moves no data but still does what ZeRO-3 does: one flat buffer per unit, a copy
("gather") of each unit before its forward and again before its backward (its storage freed in
between), a skeleton module per step. Each unit's forward runs once, as in the plain step. So
``fzero-s3 / plain`` is the price of that machinery; ``fzero-s3-remat`` adds the recompute (about one
extra forward, ~1/3 of a forward+backward), as ``plain-ckpt`` does to the plain step.

The systems are interleaved: each round runs ``--steps`` timed steps of every system, in an order that
rotates from round to round, so slow drifts of a noisy machine hit all of them alike. Reported: the
median step time of each system over all timed steps, and the median over rounds of the per-round
ratio to ``plain`` (the ratio the target is about: stage 3 <= 1.10x plain).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch.utils.checkpoint import checkpoint

import fzero
from _common import (PlainStep, build_model, gpt_loss, machine, make_batch, markdown_table, median, now,
                     num_params, write_json, LR, WEIGHT_DECAY)

SYSTEMS = ("plain", "plain-ckpt", "fzero-s0", "fzero-s0-remat", "fzero-s3", "fzero-s3-nopf", "fzero-s3-ag", "fzero-s3-remat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system before the rounds")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ", ".join(SYSTEMS))
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


class FzeroSystem:
    def __init__(self, model, loss_fn, **kw):
        self.step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), **kw)
        self.state = self.step.init(fzero.params_of(model))

    def __call__(self, batch) -> float:
        self.state, metrics = self.step(self.state, batch)
        return metrics["loss"]


class PlainCheckpointStep:
    """Eager training of a copy of the module, every block under activation checkpointing."""

    def __init__(self, model) -> None:
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

    def forward(self, idx):
        m = self.model  # GPT.forward, with each block checkpointed
        x = m.tok_emb(idx) + m.pos_emb(torch.arange(idx.shape[1]))
        for block in m.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x = m.ln_f(x)
        return torch.nn.functional.linear(x, m.tok_emb.weight) if m.lm_head is None else m.lm_head(x)

    def __call__(self, batch) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = gpt_loss(self.forward(batch["x"]), batch["y"])
        loss.backward()
        self.opt.step()
        return float(loss.detach())


def make_system(name: str, model, loss_fn):
    if name == "plain":
        return PlainStep(model, loss_fn)
    if name == "plain-ckpt":
        return PlainCheckpointStep(model)
    if name == "fzero-s0":
        return FzeroSystem(model, loss_fn, stages=0)
    if name == "fzero-s0-remat":
        return FzeroSystem(model, loss_fn, stages=0, remat=True)
    if name == "fzero-s3":
        return FzeroSystem(model, loss_fn, stages=3, mesh=fzero.local_mesh(1))
    if name == "fzero-s3-nopf":
        return FzeroSystem(model, loss_fn, stages=3, mesh=fzero.local_mesh(1), prefetch=False)
    if name == "fzero-s3-ag":
        return FzeroSystem(model, loss_fn, stages=3, mesh=fzero.local_mesh(1), autodiff="autograd")
    if name == "fzero-s3-remat":
        return FzeroSystem(model, loss_fn, stages=3, mesh=fzero.local_mesh(1), remat=True)
    raise SystemExit(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if "plain" not in names:
        names.insert(0, "plain")
    model = build_model(args.layers, args.width, args.heads, args.seq, args.vocab)

    def loss_fn(params, batch):
        return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    systems = {n: make_system(n, model, loss_fn) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    round_medians: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    k = 0
    for n in names:  # warm-up (first stage-3 step records the gather order; allocator warm-up)
        for w in range(args.warmup):
            losses[n].append(systems[n](make_batch(w, args.batch, args.seq, args.vocab)))
    k = args.warmup
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        batches = [make_batch(k + i, args.batch, args.seq, args.vocab) for i in range(args.steps)]
        k += args.steps
        for n in order:
            ts = []
            for b in batches:
                t0 = now()
                losses[n].append(systems[n](b))
                ts.append(now() - t0)
            times[n] += ts
            round_medians[n].append(median(ts))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {round_medians[n][-1]:.3f}s" for n in names),
              file=sys.stderr, flush=True)

    base = median(times["plain"])
    rows, out = [], {}
    for n in names:
        ratios = [a / b for a, b in zip(round_medians[n], round_medians["plain"])]
        out[n] = {"median_s": median(times[n]), "min_s": min(times[n]), "ratio_to_plain": median(ratios),
                  "round_ratios": ratios, "times_s": times[n], "final_loss": losses[n][-1]}
        rows.append([n, median(times[n]), min(times[n]), median(times[n]) / base, median(ratios), losses[n][-1]])
    psi = num_params(model)
    info = machine()
    print(f"\nGPT {args.layers}x{args.width}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, "
          f"{psi:,} params, fp32 | {args.rounds} rounds x {args.steps} steps, interleaved | "
          f"{info['cores']} cores, torch {info['torch']}, {info['torch_threads']} threads\n")
    print(markdown_table(["system", "median s/step", "min s/step", "median / plain median", "median of round ratios",
                          "last loss"], rows))
    result = {"args": vars(args), "num_params": psi, "machine": info, "systems": out}
    write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
