"""The largest GPT the main job trains on this machine: 2 processes (torchrun, gloo), stage 3, per offload.

    python benchmarks/largest_gpt.py --dir /tmp/fzero-offload --modes none cpu disk disk+params

For each offload mode it runs ``examples/train_gpt.py`` itself, as a user would, for ``--steps``
optimizer steps (model on the meta device, streaming ``step.init``; no validation, to save time):

1. at two small depths (``--calibrate``), to fit the two processes' summed peak RSS as ``a + b * params``
   (the per-rank numbers come from the main job's ``peak_rss``: ru_maxrss, init and training);
2. at the largest depth the fit puts within ``--budget-gib``, to show it really trains there and what
   it really peaks at (stepping one block down while the measured peak is over the budget).

``--predict-only MODE`` skips step 2 for a mode whose run would take too long (disk offload of a
multi-billion-parameter model writes tens of GB per step); its row says "predicted". Out-of-memory
is not provoked: a depth is run only when the fit says it fits, and the budget leaves the system room.
Results go to stdout and, with ``--json-out``, to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from fzero.models import GPT, GPTConfig, num_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
MODES = {"none": [], "cpu": ["--offload", "cpu"], "disk": ["--offload", "disk"],
         "disk+params": ["--offload", "disk", "--offload-params"]}


def params_at(layers: int, args: argparse.Namespace) -> int:
    with torch.device("meta"):
        return num_params(GPT(GPTConfig(n_layer=layers, d_model=args.width, n_head=args.heads, seq_len=args.seq)))


def run(mode: str, layers: int, args: argparse.Namespace) -> dict:
    """One main-job run; its JSON plus wall time, or the failure."""
    out = os.path.join(args.dir, f"run-{mode}-{layers}.json")
    extra = MODES[mode] + (["--offload-dir", args.dir] if mode.startswith("disk") else [])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "train_gpt.py"), "--stages", "3", "--layers", str(layers),
           "--width", str(args.width), "--heads", str(args.heads), "--seq", str(args.seq), "--batch-size", "1",
           "--steps", str(args.steps), "--warmup", "0", "--lr", str(args.lr), "--log-every", "1", "--eval-batches", "0",
           "--json-out", out, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"mode": mode, "layers": layers, "ok": False, "wall_s": wall, "error": proc.stderr[-2000:]}
    with open(out) as f:
        res = json.load(f)
    os.remove(out)
    rss = res["memory"]["peak_rss"]
    row = {"mode": mode, "layers": layers, "params": res["num_params"], "ok": True, "wall_s": wall,
           "peak_rss": rss, "total_rss": sum(rss), "losses": res["losses"],
           "step_s": res["elapsed_s"] / max(1, res["steps"]), "model_states_fp32": 16 * res["num_params"]}
    print(f"  {mode:12s} {layers:3d} layers {row['params'] / 1e9:6.3f} B params: peak RSS "
          f"{' + '.join(f'{r / GiB:.2f}' for r in rss)} = {row['total_rss'] / GiB:.2f} GiB, "
          f"{row['step_s']:.1f} s/step, run {wall:.0f} s, losses {[round(x, 3) for x in res['losses']]}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="offload directory (also scratch for the runs' JSON)")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    p.add_argument("--predict-only", nargs="*", default=[], choices=sorted(MODES))
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5, help="learning rate (no warm-up in so few steps: at width 2048 a first Adam step of 1e-4 raises the loss)")
    p.add_argument("--calibrate", type=int, nargs=2, default=(2, 8), help="two depths for the fit")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="summed peak RSS allowed (default: MemTotal minus 2 GiB for the system)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.budget_gib is None:
        with open("/proc/meminfo") as f:
            total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
        args.budget_gib = total / GiB - 2
    budget = args.budget_gib * GiB
    print(f"GPT width {args.width}, {args.heads} heads, seq {args.seq}, batch 1 per rank, fp32 AdamW, stage 3, "
          f"2 processes; budget {args.budget_gib:.1f} GiB summed peak RSS", flush=True)
    results = []
    for mode in args.modes:
        a, b = (run(mode, n, args) for n in args.calibrate)
        if not (a["ok"] and b["ok"]):
            results.append({"mode": mode, "calibration": [a, b]})
            print(f"  {mode}: calibration failed:\n{(a if not a['ok'] else b)['error']}")
            continue
        slope = (b["total_rss"] - a["total_rss"]) / (b["params"] - a["params"])  # bytes per param, both processes
        base = a["total_rss"] - slope * a["params"]
        per_layer = params_at(2, args) - params_at(1, args)
        fixed = params_at(1, args) - per_layer
        layers = max(1, math.floor(((budget - base) / slope - fixed) / per_layer))
        print(f"  {mode}: fit {base / GiB:.2f} GiB + {slope:.2f} B/param -> {layers} layers, "
              f"{params_at(layers, args) / 1e9:.3f} B params", flush=True)
        row = {"mode": mode, "calibration": [a, b], "bytes_per_param": slope, "base_bytes": base,
               "predicted_layers": layers, "predicted_params": params_at(layers, args),
               "predicted_total_rss": base + slope * params_at(layers, args)}
        if mode not in args.predict_only:
            while layers >= 1:
                got = run(mode, layers, args)
                if got["ok"] and got["total_rss"] <= budget:
                    row["verified"] = got
                    break
                row.setdefault("over", []).append(got)
                layers -= 1
        results.append(row)
    print("\n| offload | largest GPT (layers x width) | params | fp32 model states 16Ψ | summed peak RSS | s/step | |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "verified" in r:
            v = r["verified"]
            print(f"| {r['mode']} | {v['layers']} x {args.width} | {v['params'] / 1e9:.2f} B | {16 * v['params'] / GiB:.1f} GiB "
                  f"| {v['total_rss'] / GiB:.2f} GiB ({' + '.join(f'{x / GiB:.2f}' for x in v['peak_rss'])}) | {v['step_s']:.1f} | measured |")
        elif "predicted_layers" in r:
            print(f"| {r['mode']} | {r['predicted_layers']} x {args.width} | {r['predicted_params'] / 1e9:.2f} B | "
                  f"{16 * r['predicted_params'] / GiB:.1f} GiB | {r['predicted_total_rss'] / GiB:.2f} GiB | | predicted "
                  f"({r['bytes_per_param']:.2f} B/param fit) |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
