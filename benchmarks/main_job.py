"""The main job at every ZeRO stage: ``examples/train_gpt.py`` under torchrun, tokens/s and memory per rank.

Run from the repository root (about 3.5 minutes on a 2-core CPU: 4 stages x 45 s of training, plus
start-up and the final evaluation of each):

    .venv/bin/python benchmarks/main_job.py --json-out runs/main_job.json

For each stage S in ``--stages`` (default 0,1,2,3) it runs, one after the other,

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py --stages S --max-seconds 45 --json-out ...

(the example's defaults: GPT 4 layers x 128 wide, 4 heads, seq 128, 8 sequences per rank, AdamW with a
warm-up + cosine schedule, no gradient clipping) and tabulates the example's own numbers: tokens/s over
the steps after the first, the loss, and per rank the bytes of params, grads and optimizer state
(params and optimizer measured from the training state; grads from the flat layout, since gradients
live only inside a step) next to the ZeRO formula for fp32 AdamW: stage 0 16Ψ, stage 1 8Ψ + 8Ψ/N,
stage 2 4Ψ + 12Ψ/N, stage 3 16Ψ/N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import machine, markdown_table, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB = 1024


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--max-seconds", type=float, default=45)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--extra", default="", help="more arguments for train_gpt.py, e.g. '--layers 6 --width 256'")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    results = {}
    for s in [int(x) for x in args.stages.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
                   os.path.join(ROOT, "examples", "train_gpt.py"), "--stages", str(s),
                   "--max-seconds", str(args.max_seconds), "--json-out", out] + args.extra.split()
            t0 = time.time()
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(out):
                print(f"stage {s}: FAILED (rc {proc.returncode})\n" + (proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
                results[s] = {"error": (proc.stdout + proc.stderr)[-3000:]}
                continue
            with open(out) as f:
                results[s] = json.load(f)
            results[s]["wall_s"] = time.time() - t0
        r = results[s]
        print(f"stage {s}: {r['steps']} steps, {r['tokens_per_s']:,.0f} tok/s ({results[s]['wall_s']:.0f} s)",
              file=sys.stderr, flush=True)

    ok = {s: r for s, r in results.items() if "error" not in r}
    if not ok:
        raise SystemExit("every stage failed")
    any_r = next(iter(ok.values()))
    cfg = any_r["config"]
    print(f"\nexamples/train_gpt.py, GPT {cfg['layers']}x{cfg['width']}, {cfg['heads']} heads, seq {cfg['seq']}, "
          f"{any_r['num_params']:,} params, fp32 | {any_r['world_size']} ranks (torchrun, gloo), batch {cfg['batch_size']} "
          f"per rank | --max-seconds {args.max_seconds:g} | {machine()['cores']} cores\n")
    base = ok.get(0, any_r)["tokens_per_s"]
    rows = []
    for s, r in ok.items():
        tail = r["losses"][-10:]
        rows.append([s, r["steps"], f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base:.2f}x",
                     f"{r['losses'][0]:.3f} -> {sum(tail) / len(tail):.3f}", f"{r['val_loss']:.3f}"])
    print(markdown_table(["stage", "steps", "tokens/s", "vs stage 0", "train loss (first -> mean of last 10)", "val loss"],
                         rows) + "\n")
    rows = []
    for s, r in ok.items():
        f = r["memory"]["formula"]
        for rank, row in enumerate(r["memory"]["ranks"]):
            rows.append([s, rank] + [f"{row[k] / KiB:,.1f}" for k in ("params", "grads", "optimizer", "total")]
                        + [" / ".join(f"{f[k] / KiB:,.1f}" for k in ("params", "grads", "optimizer")),
                           f"{f['total'] / KiB:,.1f}", f"{row['total'] / f['total']:.3f}"])
    print("model-state bytes per rank, KiB (measured from the state; grads from the flat layout):\n")
    print(markdown_table(["stage", "rank", "params", "grads", "optimizer", "total",
                          "formula params / grads / optimizer", "formula total", "measured / formula"],
                         rows))
    result = {"args": vars(args), "machine": machine(), "results": {str(k): v for k, v in results.items()}}
    write_json(args.json_out, result)
    return result


if __name__ == "__main__":
    main()
