"""Where a rank's RSS goes while a fzero run is set up: model, ``params_of``, ``step.init``, freeing the module.

A diagnostic behind ``peers.py``'s "peak" column (which includes set-up). Run from the repository root:

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc_per_node 2 benchmarks/init_memory.py --stages 3

(the threshold makes glibc return freed buffers to the OS, so RSS follows live memory). Same GPT as
``peers.py`` (12 layers x 512, vocab 256, seq 128, 37.9M params, fp32). Rank 0 prints RSS and the peak
(VmHWM, reset after imports) after each set-up phase, then after ``--steps`` training steps.
"""

from __future__ import annotations

import argparse
import gc

import torch.distributed as dist

import fzero
from _common import LR, WEIGHT_DECAY, build_model, gpt_loss, make_batch, markdown_table, peak_rss_reset, rss_kib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []

    def note(phase: str) -> None:
        rows.append([phase, f"{rss_kib('VmRSS') / 1024:.0f}", f"{rss_kib('VmHWM') / 1024:.0f}"])

    peak_rss_reset()
    note("after imports and process group")
    model = build_model(args.layers, args.width, args.heads, 128, 256)
    note("model built (4Ψ)")
    params = fzero.params_of(model)
    note("fzero.params_of(model) (a copy: 4Ψ)")

    def loss_fn(params, batch):
        return gpt_loss(fzero.apply(model, params, batch["x"]), batch["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, weight_decay=WEIGHT_DECAY), stages=args.stages,
                         mesh=fzero.dist_mesh())
    state = step.init(params)
    note(f"step.init(params), stage {args.stages}")
    del params
    gc.collect()
    note("del params")
    model.to("meta")
    note("model.to('meta')")
    for k in range(args.steps):
        b = make_batch(k, args.batch * world, 128, 256)
        state, _ = step(state, {n: t[rank * args.batch:(rank + 1) * args.batch] for n, t in b.items()})
        note(f"after training step {k + 1}")
    if rank == 0:
        print(markdown_table(["phase (rank 0)", "RSS MiB", "peak so far MiB"], rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
