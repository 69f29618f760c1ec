"""Block-sparse attention against dense attention: time (forward and backward) and peak memory by sequence length.

    python benchmarks/sparse_attention.py                                    # CUDA: 2k..32k tokens, a fixed layout
    python benchmarks/sparse_attention.py --device cpu --lengths 256,512     # the torch reference, small

Each length runs ``fzero.ops.sparse_attention`` (FlexAttention on CUDA) with a causal ``FixedLayout`` (block 64,
4 local blocks, 1 global) and ``F.scaled_dot_product_attention(is_causal=True)`` on the same q, k, v (bf16 on CUDA,
fp32 on the CPU), each alone: median of ``--repeats`` forward+backward passes after a warm-up, and the peak memory
above the inputs (CUDA). A length that runs out of memory is reported as such, so the longest that fits shows.

On CUDA a third row, ``flex_causal``, is FlexAttention itself with a causal mask and nothing else (compiled, its
default 128-token tiles): the control that says how much of a gap to SDPA is FlexAttention's own cost on this GPU and
how much is the layout's. FlexAttention's tiles are 128 tokens (its backward on an H100/H200 takes no smaller mask
block without max-autotune), so a layout of 64-token blocks leaves half of each global-column tile masked out;
``--block 128`` measures a layout whose blocks are the tiles.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def measure(fn, q, k, v, repeats: int, cuda: bool) -> dict:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        fn(q, k, v).sum().backward()  # warm-up (and compile)
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            fn(q, k, v).sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
        return {"ms": statistics.median(times) * 1e3, "peak_mib": peak}
    except torch.OutOfMemoryError:
        return {"ms": None, "peak_mib": None, "error": "out of memory"}
    finally:
        for t in (q, k, v):
            t.grad = None


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    import fzero.ops as ops

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    layout = ops.FixedLayout(block=args.block, num_local_blocks=4, num_global_blocks=1, attention="unidirectional")
    rows = []
    flex_causal = _flex_causal() if cuda else None
    for n in [int(x) for x in args.lengths.split(",")]:
        q, k, v = (torch.randn(args.batch, args.heads, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        sparse = measure(lambda a, b, c: ops.sparse_attention(a, b, c, layout, causal=True), q, k, v, args.repeats, cuda)
        dense = measure(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v, args.repeats, cuda)
        control = measure(flex_causal, q, k, v, args.repeats, cuda) if flex_causal else None
        kept = float(ops.token_mask(layout, min(n, 4096), causal=True).float().mean()) if n <= 4096 else None
        row = {"tokens": n, "sparse": sparse, "dense": dense, "mask_density": kept}
        if control:
            row["flex_causal"] = control
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(torch.cuda.get_device_name() if cuda else "cpu"), "rows": rows}, f, indent=1)
    return rows


def _flex_causal():
    """FlexAttention with a causal block mask alone (compiled; the mask made once per length)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex, masks = torch.compile(flex_attention), {}

    def causal(b, h, qi, ki):
        return ki <= qi

    def run(q, k, v):
        n = q.shape[2]
        if n not in masks:
            masks[n] = create_block_mask(causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device=q.device)
        return flex(q, k, v, block_mask=masks[n])

    return run


if __name__ == "__main__":
    main(sys.argv[1:])
