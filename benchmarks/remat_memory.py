"""Activation memory and time of ``fzero.remat`` on a GPT: every block plain, remat'ed, or remat'ed with offload.

Run from the repository root (about 30 s on a 2-core CPU):

    .venv/bin/python benchmarks/remat_memory.py

Options: ``--layers/--width/--heads/--seq/--batch/--vocab`` (default 12 x 128, 4 heads, seq 128, batch 8, vocab
256), ``--rounds``, ``--threads``, ``--device cuda``, ``--json-out FILE``.

What is measured is one gradient computation, ``torch.func.grad`` of the mean next-token loss with respect to
all params (fp32), for the GPT of ``fzero.models`` run block by block with ``torch.func.functional_call`` on
explicit params, each block either called as is (``plain``) or through ``fzero.remat`` (``remat``) or
``fzero.remat(..., offload="cpu")`` (``remat+offload``):

* peak live bytes: on the CPU, ``fzero.memory.LiveBytes`` (bytes of tensor storages created during the call,
  peak; params excluded, gradients included) in one untimed call; on CUDA, ``torch.cuda.max_memory_allocated``
  above what was allocated before the call. On the CPU, offload only copies the saved block inputs into
  separate host buffers, so it cannot lower this number; on CUDA it moves them off the device.
* time: median over ``--rounds`` interleaved rounds (one call of each system per round, in an order that
  rotates, after one warm-up call each). The recompute costs about one extra forward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

import fzero
from fzero.autodiff._remat import remat
from fzero.memory import LiveBytes
from fzero.models import GPT, GPTConfig, gpt_loss, num_params

SYSTEMS = {"plain": None, "remat": (None,), "remat+offload": ("cpu",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def _sub(params, prefix):
    return {k[len(prefix) + 1:]: v for k, v in params.items() if k.startswith(prefix + ".")}


def make_loss(model, x, y, system):
    """The loss of the GPT run block by block; ``system`` says how each block is called."""
    wrap = SYSTEMS[system]

    def loss_fn(params):
        h = F.embedding(x, params["tok_emb.weight"]) + F.embedding(torch.arange(x.shape[1], device=x.device), params["pos_emb.weight"])
        for i, block in enumerate(model.blocks):
            def run(p, h, block=block):
                return functional_call(block, p, (h,))
            h = (run if wrap is None else remat(run, offload=wrap[0]))(_sub(params, f"blocks.{i}"), h)
        h = functional_call(model.ln_f, _sub(params, "ln_f"), (h,))
        return gpt_loss(F.linear(h, params["tok_emb.weight"]), y)

    return loss_fn


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(fn, params, device) -> int:
    if device == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = torch.func.grad(fn)(params)
        sync(device)
        del grads
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as lb:
        torch.func.grad(fn)(params)
    return lb.peak


def timed(fn, params, device) -> float:
    sync(device)
    t = time.perf_counter()
    torch.func.grad(fn)(params)
    sync(device)
    return time.perf_counter() - t


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=args.layers, n_head=args.heads, d_model=args.width, seq_len=args.seq, vocab_size=args.vocab)
    model = GPT(cfg).to(dev)
    params = fzero.params_of(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = {s: make_loss(model, x, y, s) for s in SYSTEMS}

    peaks = {s: peak_bytes(fn, params, dev) for s, fn in losses.items()}
    for fn in losses.values():  # warm-up
        timed(fn, params, dev)
    times = {s: [] for s in SYSTEMS}
    names = list(SYSTEMS)
    for r in range(args.rounds):
        for s in names[r % len(names):] + names[:r % len(names)]:
            times[s].append(timed(losses[s], params, dev))

    med = {s: statistics.median(v) for s, v in times.items()}
    print(f"GPT {args.layers} x {args.width}, {args.heads} heads, seq {args.seq}, batch {args.batch}, vocab {args.vocab}: "
          f"{num_params(model) / 1e6:.2f}M params, fp32, {dev}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("torch.func.grad of the loss; every block plain / fzero.remat / fzero.remat(offload='cpu')\n")
    print("| system | peak live MB | vs plain | grad time s (median) | vs plain |")
    print("|---|---|---|---|---|")
    for s in SYSTEMS:
        print(f"| {s} | {peaks[s] / 1e6:.1f} | {peaks[s] / peaks['plain']:.2f}x | {med[s]:.3f} | {med[s] / med['plain']:.2f}x |")
    result = {"config": vars(args), "params": num_params(model), "peak_bytes": peaks, "median_s": med, "times_s": times,
              "machine": {"cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                          "threads": torch.get_num_threads()}}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
