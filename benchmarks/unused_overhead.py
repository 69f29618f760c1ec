"""What tracking unused params (issue 12, item 5) costs a step in which every param is used: this checkout
against another one (the commit before it), step time side by side.

    git worktree add /tmp/fzero-before <commit before>
    .venv/bin/python benchmarks/unused_overhead.py --baseline /tmp/fzero-before

Each round runs, in a fresh process per checkout and system (alternating, so drifts of a noisy machine hit
both alike), ``--steps`` timed steps after ``--warmup`` untimed ones, of the same GPT (default 6 layers x 256
wide, vocab 256, seq 128, batch 8; fp32, AdamW with the fused kernel), one intra-op thread. Systems: ``s0``
(stage 0, no mesh), ``s1`` (stage 1 on local_mesh(2)), ``s3`` (stage 3 on local_mesh(1)). Reported per
checkout and system: the median CPU time per step (``time.process_time``, all threads: on a machine shared
with other jobs it moves far less than wall time) and the median wall time over all rounds, and the median
over rounds of the per-round CPU-time ratio this/baseline.

What the common path pays: the unit split is a Python autograd Function instead of ``torch.split`` (same
views forward, the same single ``cat`` backward), one float per param more in the metrics all-reduce, a
mask check, and ``skipped.any()`` on Adam's per-param skip counts.

Measured (2-core CPU shared with other jobs, 6 rounds x 6 steps, against d4d30a7): CPU time per step this
/ baseline, median of rounds: s0 0.983, s1 1.018, s3 0.979 (0.42-0.55 s per step; single rounds scatter
by +-10 %): no slowdown within the noise. In isolation the Function costs about 0.3 ms per unit call plus
10 us per param under torch.func.grad (1-3 ms of these steps) and Adam's checks 4 us per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = ("s0", "s1", "s3")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=False, help="a checkout of fzero to compare with (e.g. the previous commit)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--one", nargs=2, metavar=("ROOT", "SYSTEM"), help=argparse.SUPPRESS)  # child process
    return p.parse_args(argv)


def one(root: str, system: str, args) -> list[float]:
    """Child: time ``system`` with the fzero under ``root``; prints a JSON list of step times."""
    sys.path.insert(0, root)
    sys.path.insert(0, HERE)
    import torch

    import fzero
    from _common import build_model, gpt_loss, make_batch, now

    assert os.path.dirname(os.path.dirname(os.path.abspath(fzero.__file__))) == os.path.abspath(root), fzero.__file__
    model = build_model(args.layers, args.width, 8, 128, 256)

    def loss_fn(params, batch):
        return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    torch.set_num_threads(1)
    stages, mesh = {"s0": (0, None), "s1": (1, fzero.local_mesh(2)), "s3": (3, fzero.local_mesh(1))}[system]
    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(3e-4), stages=stages, mesh=mesh)
    state = step.init(fzero.params_of(model))
    times = []
    for k in range(args.warmup + args.steps):
        batch = make_batch(k, 8, 128, 256)
        t, c = now(), time.process_time()
        state, _ = step(state, batch)
        if k >= args.warmup:
            times.append((time.process_time() - c, now() - t))
    del torch
    return times


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], args)))
        return
    roots = {"this": ROOT, "baseline": args.baseline}
    systems = args.systems.split(",")
    times = {(r, s): [] for r in roots for s in systems}
    ratios = {s: [] for s in systems}
    passthrough = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--layers", str(args.layers), "--width", str(args.width)]
    for k in range(args.rounds):
        order = list(roots) if k % 2 == 0 else list(roots)[::-1]
        for s in systems:
            med = {}
            for r in order:
                out = subprocess.run([sys.executable, __file__, "--one", roots[r], s, *passthrough], capture_output=True,
                                     text=True, check=True, cwd=ROOT)
                ts = json.loads(out.stdout.strip().splitlines()[-1])
                times[(r, s)] += ts
                med[r] = statistics.median(c for c, _ in ts)
            ratios[s].append(med["this"] / med["baseline"])
            print(f"round {k + 1} {s}: CPU s/step this {med['this']:.4f}, baseline {med['baseline']:.4f}, ratio "
                  f"{ratios[s][-1]:.3f}", flush=True)
    print("\n| system | this: CPU s/step (wall) | baseline: CPU s/step (wall) | CPU ratio (median of rounds) |\n|---|---|---|---|")
    for s in systems:
        cells = []
        for r in ("this", "baseline"):
            ts = times[(r, s)]
            cells.append(f"{statistics.median(c for c, _ in ts):.4f} ({statistics.median(w for _, w in ts):.4f})")
        print(f"| {s} | {cells[0]} | {cells[1]} | {statistics.median(ratios[s]):.3f} |")


if __name__ == "__main__":
    main()
