"""Transient memory of one training step: peak bytes of tensors allocated during the step, and by which ops.

Run from the repository root (about 20 s):

    .venv/bin/python benchmarks/step_live_bytes.py

One process, one rank, the GPT of ``peers.py`` (12 layers x 512, vocab 256, seq 128, 37.9M params, fp32),
batch 2. For the plain step (``functional_call`` + ``backward`` + fused ``torch.optim.AdamW``, grads set to
None each step), fzero stage 0 (no mesh) and fzero stage 3 (``local_mesh(1)``), each under plain autograd and
under ``torch.func.grad`` (which differentiates with ``create_graph=True`` and so keeps the backward's
intermediate gradients until it returns): ``fzero.memory.LiveBytes``
over the second step (storages allocated during the step, peak of their live sum; the state's own
buffers are not counted), in units of 4Ψ (one fp32 copy of the params), and the ops that allocated
tensors above 4 MiB. A plain step needs about 4Ψ (the gradient) plus activations.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from _common import LR, WEIGHT_DECAY, PlainStep, build_model, gpt_loss, make_batch, markdown_table
from fzero.memory import LiveBytes


class BigAllocations(TorchDispatchMode):
    """Bytes of new storages above ``threshold`` per op."""

    def __init__(self, threshold: int = 4 * 2**20) -> None:
        super().__init__()
        self.threshold = threshold
        self.by_op: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.nbytes() > self.threshold and s.data_ptr() not in ins:
                    self.by_op[str(func)] += s.nbytes()
        return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args(argv)
    model = build_model(args.layers, args.width, args.heads, 128, 256)
    psi = sum(q.numel() for q in model.parameters())

    def loss_fn(params, batch):
        return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    def fzero_system(stage, autodiff):
        mesh = fzero.local_mesh(1) if stage == 3 else None
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), stages=stage, mesh=mesh,
                             autodiff=autodiff)
        box = {"state": step.init(fzero.params_of(model))}

        def run(batch):
            box["state"], _ = step(box["state"], batch)

        return run

    rows = []
    systems = [("plain", PlainStep(model, loss_fn))]
    for autodiff in ("autograd", "func"):
        systems += [(f"fzero stage 0, autodiff={autodiff!r}", fzero_system(0, autodiff)),
                    (f"fzero stage 3, local_mesh(1), autodiff={autodiff!r}", fzero_system(3, autodiff))]
    for name, system in systems:
        system(make_batch(0, args.batch, 128, 256))
        big = BigAllocations()
        with LiveBytes() as lb, big:
            system(make_batch(1, args.batch, 128, 256))
        ops = ", ".join(f"{op} {b / 2**20:.0f}" for op, b in big.by_op.most_common(4)) or "-"
        rows.append([name, f"{lb.peak / 2**20:.0f}", f"{lb.peak / (4 * psi):.2f}", ops])
    print(f"\nGPT {args.layers}x{args.width}, {psi:,} params (4Ψ = {4 * psi / 2**20:.0f} MiB), batch {args.batch}, one rank\n")
    print(markdown_table(["step", "peak live MiB during the step", "in units of 4Ψ", "MiB allocated in tensors > 4 MiB, by op"],
                         rows))


if __name__ == "__main__":
    main()
