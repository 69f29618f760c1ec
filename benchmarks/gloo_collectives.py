"""What the ZeRO collectives cost on gloo here, in each form ``DistComm`` can run them: torch.distributed's own
collectives (``dist_mesh(collectives="native")``) against direct point-to-point exchanges (``"p2p"``,
``fzero.mesh._p2p``), through fzero's comm with its fault board, as a step calls them.

Run from the repository root (about a minute):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py

Stage 0 (and DDP) all-reduces the gradient; stages 1-2 reduce-scatter it and all-gather the updated params;
stage 3 all-gathers every unit twice (forward, backward) and reduce-scatters its gradient. On a ring the
all-gather and the reduce-scatter move (N-1)/N of the buffer per rank, the all-reduce twice that; the
exchanges move the same. Sizes: small buffers (where ``"auto"`` keeps gloo's own below 64K elements), one
block of the benchmark GPT (3.1M fp32), one 12.5 MiB unit of stages 0-1 (3.3M) and the whole 37.9M model.
Median of ``--calls`` calls after one warm-up, barrier before each, the two forms alternating call by call;
rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import fzero
from _common import markdown_table, write_json


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4096,65536,262144,3149824,3276800,37958144", help="buffer sizes in fp32 elements")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", FutureWarning)
    comms = {form: fzero.dist_mesh(collectives=form).comm(api="benchmarks/gloo_collectives.py") for form in ("native", "p2p")}
    rank, n = dist.get_rank(), dist.get_world_size()
    rows, result = [], {}
    for numel in [int(x) for x in args.sizes.split(",")]:
        numel -= numel % n
        full, out = torch.randn(numel), torch.empty(numel)
        shard = torch.randn(numel // n)

        def ops(comm):
            return {"all_reduce": lambda: comm.all_reduce(full, tag="grads"),
                    "reduce_scatter": lambda: comm.reduce_scatter(full, tag="grads"),
                    "all_gather": lambda: comm.all_gather(out, shard, tag="params")}

        times = {(op, form): [] for op in ops(comms["native"]) for form in comms}
        for call in range(args.calls + 1):
            for form in (("native", "p2p") if call % 2 else ("p2p", "native")):
                for op, fn in ops(comms[form]).items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    if call:
                        times[op, form].append(time.perf_counter() - t0)
        ms = {f"{op} {form}": 1000 * statistics.median(ts) for (op, form), ts in times.items()}
        result[numel] = ms
        row = [f"{numel:,}"]
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            nat, ex = ms[f"{op} native"], ms[f"{op} p2p"]
            row += [f"{nat:.2f}", f"{ex:.2f}", f"{nat / ex:.2f}x"]
        rows.append(row)
    if rank == 0:
        print(f"\ngloo, {n} ranks, fp32, ms per call through fzero's DistComm (median of {args.calls}):\n")
        head = ["elements"] + [f"{op} {c}" for op in ("all-reduce", "reduce-scatter", "all-gather") for c in ("native", "p2p", "native/p2p")]
        print(markdown_table(head, rows))
        write_json(args.json_out, {"world_size": n, "ms": result})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
