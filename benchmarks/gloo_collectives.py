"""What the ZeRO collectives cost on gloo here: all-reduce vs reduce-scatter vs all-gather of one buffer.

Run from the repository root (about 30 s):

    torchrun --standalone --nproc_per_node 2 benchmarks/gloo_collectives.py

Stage 0 (and DDP) all-reduces the gradient; stages 1-2 reduce-scatter it and all-gather the updated
params; stage 3 all-gathers every unit twice (forward, backward) and reduce-scatters its gradient. On a
ring all three move about the same bytes per rank per call ((N-1)/N of the buffer, twice that for
all-reduce), so on a bandwidth-bound network stage 1 costs what stage 0 does. This measures what gloo
really takes on this machine for fp32 buffers the size of the benchmark GPT's params (37.9M, as in
``peers.py``) and of one of its blocks (3.1M), with the calls fzero makes (``all_gather_single`` /
``reduce_scatter_single``, i.e. the ``*_into_tensor`` collectives) and the list forms. Median of 8 calls after 1
warm-up, barrier before each; rank 0 prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from _common import markdown_table, write_json


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="37958144,3149824", help="buffer sizes in fp32 elements")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", FutureWarning)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    rows, result = [], {}
    for numel in [int(x) for x in args.sizes.split(",")]:
        numel -= numel % n
        full, out, shard = torch.randn(numel), torch.empty(numel), torch.randn(numel // n)
        ins, outs = list(full.chunk(n)), list(out.chunk(n))
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "reduce_scatter_single": lambda: reduce_scatter_single(shard, full),
            "reduce_scatter (list)": lambda: dist.reduce_scatter(shard, ins),
            "all_gather_single": lambda: all_gather_single(out, shard),
            "all_gather (list)": lambda: dist.all_gather(outs, shard),
        }
        ms = {}
        for name, fn in ops.items():
            ts = []
            for _ in range(args.calls + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            ms[name] = 1000 * statistics.median(ts[1:])
        result[numel] = ms
        gb = numel * 4 / 1e9
        rows.append([f"{numel:,}", *(f"{ms[k]:.1f}" for k in ops),
                     f"{(ms['reduce_scatter_single'] + ms['all_gather_single']) / ms['all_reduce']:.2f}x",
                     f"{gb / (ms['all_reduce'] / 1000):.2f}"])
    if rank == 0:
        print(f"\ngloo, {n} ranks, fp32, ms per call (median of {args.calls}):\n")
        print(markdown_table(["elements", *ops, "(RS + AG) / AR", "all-reduce GB/s of buffer"], rows))
        write_json(args.json_out, {"world_size": n, "ms": result})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
