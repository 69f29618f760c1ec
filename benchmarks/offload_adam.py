"""The offloaded optimizer step's throughput against this machine's memory-bandwidth roofline.

    python benchmarks/offload_adam.py                       # 128 Mi elements, 7 rounds
    python benchmarks/offload_adam.py --elements 67108864 --deepspeed --json-out adam.json

Measured side by side in one run, interleaved round by round, medians reported:

- ``roofline``: a STREAM-style triad (``c = a + s*b``) over buffers much larger than the caches gives
  the bandwidth; AdamW reads p, g, m, v and writes p, m, v, 28 bytes per fp32 element, so the roofline is
  bandwidth / 28 elements/s.
- ``fzero cpu``: ``fzero.optim.apply_inplace(adamw)`` on one flat buffer: torch's fused CPU AdamW, the
  path ``offload="cpu"`` runs.
- ``fzero disk``: the ``offload="disk"`` update (m and v in files, sub-groups with read-ahead); the files
  sit in the page cache after the first round, so this measures the extra copies, not the device.
- ``DeepSpeedCPUAdam`` (``--deepspeed``): DeepSpeed's AVX CPU Adam, built by DeepSpeed's JIT on first use.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import fzero
from fzero._offload import DiskOptState, NoSegments, OffloadPolicy, disk_update, init_disk


class Triad:
    """STREAM's triad on buffers allocated and touched once (first-touch page faults are not bandwidth)."""

    def __init__(self, n: int) -> None:
        self.a, self.b, self.c = torch.rand(n), torch.rand(n), torch.zeros(n)

    def bandwidth(self) -> float:
        t0 = time.perf_counter()
        torch.add(self.a, self.b, alpha=1.5, out=self.c)
        return 3 * 4 * self.a.numel() / (time.perf_counter() - t0)  # bytes/s: read a, b; write c


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 27, help="large enough to leave the caches (512 MiB a tensor)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sub-group", type=int, default=1 << 22)
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeedCPUAdam (JIT-builds its op)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    n = args.elements
    gen = torch.Generator().manual_seed(0)
    opt = fzero.optim.adamw(1e-4, weight_decay=0.01)

    p_cpu = {"w": torch.randn(n, generator=gen)}
    grads = {"w": torch.randn(n, generator=gen) * 1e-3}
    s_cpu = opt.init(p_cpu)
    p_disk = {"w": p_cpu["w"].clone()}
    tmp = tempfile.TemporaryDirectory()
    policy = OffloadPolicy("disk", dir=tmp.name, sub_group_size=args.sub_group)
    s_disk: DiskOptState = init_disk(opt, policy, p_disk, None, 0)

    systems = {
        "roofline (triad)": None,
        "fzero cpu (fused AdamW)": lambda: fzero.optim.apply_inplace(opt, grads, s_cpu, p_cpu),
        "fzero disk (sub-groups)": lambda: disk_update(opt, s_disk, grads, p_disk, policy, NoSegments()),
    }
    if args.deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            p_ds = torch.nn.Parameter(p_cpu["w"].clone())
            p_ds.grad = grads["w"].clone()
            ds = DeepSpeedCPUAdam([p_ds], lr=1e-4, weight_decay=0.01, adamw_mode=True)
            systems["DeepSpeedCPUAdam"] = ds.step
        except Exception as e:  # noqa: BLE001 - report why it could not run
            print(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}".splitlines()[0])
    triad = Triad(n)
    times: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(args.rounds):
        for name, fn in systems.items():
            if fn is None:
                times[name].append(28 * n / triad.bandwidth())  # the time a 28 B/element pass would take
                continue
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    roof = statistics.median(times["roofline (triad)"])
    rows = []
    print(f"\nAdamW step over {n:,} fp32 elements, {args.rounds} rounds, medians (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)\n")
    print("| system | median s | elements/s | vs roofline |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts[1:] if len(ts) > 2 else ts)  # the first round warms caches and files
        rows.append({"system": name, "median_s": med, "elements_per_s": n / med, "vs_roofline": roof / med})
        print(f"| {name} | {med:.4f} | {n / med / 1e6:,.0f} M | {roof / med:.0%} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"elements": n, "rows": rows}, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    main()
