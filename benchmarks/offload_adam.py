"""The offloaded optimizer step's throughput against this machine's memory-bandwidth roofline.

    python benchmarks/offload_adam.py --rounds 5 --deepspeed      # 32 Mi elements (128 MiB a tensor)
    python benchmarks/offload_adam.py --elements 67108864 --no-compile --json-out adam.json

Everything below is measured in one run. Each round runs every bandwidth kernel and every system once, in
turn. Each number is the median over rounds 2..R, because round 1 warms the caches, the files and the
thread pool.

**The bandwidth.** The bandwidth comes from in-place kernels on preallocated fp32 arrays of ``--elements``
each. The arrays are far larger than the last-level cache, and every array is written once before any
timing, so first-touch page faults are not timed. torch runs ``--threads`` threads, by default one for each
core this process may use. The count is the bytes each kernel must move between DRAM and the cores: 4 per
element for each array read and 4 for each array written.

- ``mul_``: ``a *= s``. Reads a and writes a: 8 B/element.
- ``add_``: ``a += s*b``. Reads a and b, writes a: 12 B/element.
- ``addcmul_``: ``a += s*b*c``. Reads a, b and c, writes a: 16 B/element.
- ``fused SGD``: ``torch._fused_sgd_`` with momentum. Reads p, g and buf, writes p and buf: 20 B/element.
- ``AdamW-shaped``: the same 7 streams as AdamW with trivial arithmetic (``m = .9m + g``, ``v = .99v + g``,
  ``p += 1e-9 (m + v)``). This is one loop that ``torch.compile`` generates. It reads p, g, m and v and
  writes p, m and v: 28 B/element. Leave it out with ``--no-compile``, or when no C++ compiler is present.
- ``copy_``: ``a = b``, for reference only. It is counted as 12 B/element: read b, write a, plus the read
  of a's lines that an ordinary store causes (write-allocate). Its real traffic depends on whether the
  stores bypass the cache, so it never sets the bandwidth. The table shows its 8 B/element figure too.

The kernels that may set the bandwidth are all in place. So every line they write was read by the same
loop just before, and their traffic is exactly the count above: no write-allocate, no question about
non-temporal stores. The old STREAM triad (``torch.add(a, b, out=c)``) wrote into a third array. That
adds a write-allocate read of c that it did not count (16 real bytes against 12 counted), so it
understated the bandwidth, which is part of how AdamW came out at 150 % of it. The machine's bandwidth
is the best median GB/s of those kernels. The table names the winner.

**The roofline.** AdamW in fp32 reads p, g, m and v and writes p, m and v, all in place: 28 B/element.
So the roofline is bandwidth / 28 elements/s, and "vs roofline" is a system's elements/s over it.

**Systems.**

- ``fzero cpu``: ``fzero.optim.apply_inplace(adamw)`` on one flat buffer. This runs torch's fused CPU
  AdamW, the path ``offload="cpu"`` takes.
- ``fzero disk``: the ``offload="disk"`` update: m and v live in mapped files, updated in place in
  sub-groups while the kernel reads the next one ahead. After round 1 the files sit in the page cache, so
  this measures the cost of going through the files (page faults after each release), not the device.
  It is held to the same 28 B/element roofline.
- ``DeepSpeedCPUAdam`` (``--deepspeed``): DeepSpeed's AVX CPU Adam, built by DeepSpeed's JIT on first use.
- ``fzero cpu, cache-resident``: the same fused step over ``--cache-elements`` elements (4 arrays that fit
  in the last-level cache), called repeatedly to cover ``--elements``. DRAM is hardly touched, so this is
  the kernel's compute ceiling on these threads. If it is close to the DRAM run, the step is bound by
  arithmetic, not by memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

import fzero
from fzero.layout._layout import NoSegments
from fzero.zero._offload import disk_update, init_disk
from fzero.zero._policies import DiskOffload

ADAMW_BYTES = 28  # fp32: read p, g, m, v; write p, m, v


def _llc_bytes() -> int | None:
    """The last-level cache size of cpu0 from sysfs, or None when it cannot be read."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = None
    try:
        for idx in sorted(os.listdir(base)):
            if not idx.startswith("index"):
                continue
            with open(os.path.join(base, idx, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, idx, "size")) as f:
                s = f.read().strip()
            size = int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[s[-1]] if s[-1].isalpha() else int(s)
            if best is None or level > best[0]:
                best = (level, size)
    except (OSError, ValueError, KeyError):
        return None
    return best[1] if best else None


class Kernel:
    """An in-place kernel on preallocated arrays: ``fn`` runs it once, ``bytes_per_el`` is its DRAM traffic."""

    def __init__(self, name: str, fn, bytes_per_el: int, sets_bandwidth: bool = True, note: str = "") -> None:
        self.name, self.fn, self.bytes_per_el, self.sets_bandwidth, self.note = name, fn, bytes_per_el, sets_bandwidth, note


def bandwidth_kernels(n: int, compile_adamw_shaped: bool) -> list[Kernel]:
    """The kernels, on four arrays of n fp32 elements (512 MiB at the default n) allocated and written once."""
    a, b, c, d = (torch.rand(n) for _ in range(4))
    ks = [
        Kernel("mul_ (a *= s)", lambda: a.mul_(0.9999999), 8),
        Kernel("add_ (a += s*b)", lambda: a.add_(b, alpha=1e-9), 12),
        Kernel("addcmul_ (a += s*b*c)", lambda: a.addcmul_(b, c, value=1e-9), 16),
        Kernel("fused SGD, momentum (p, g, buf)", lambda: torch._fused_sgd_(
            [a], [b], [c], weight_decay=0.0, momentum=0.9, lr=1e-9, dampening=0.0, nesterov=False,
            maximize=False, is_first_step=False), 20),
        Kernel("copy_ (a = b)", lambda: a.copy_(b), 12, sets_bandwidth=False, note="8 B/el without write-allocate"),
    ]
    if compile_adamw_shaped:
        try:
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1  # no pool of compile workers left lingering in memory

            def adamw_shaped(p, g, m, v):  # 4 reads, 3 writes, in place, in one loop once compiled
                m.mul_(0.9).add_(g)
                v.mul_(0.99).add_(g)
                p.add_(m + v, alpha=1e-9)

            fn = torch.compile(adamw_shaped, fullgraph=True)
            t0 = time.perf_counter()
            fn(a, b, c, d)
            print(f"AdamW-shaped kernel compiled in {time.perf_counter() - t0:.0f} s")
            ks.append(Kernel("AdamW-shaped, compiled (p, g, m, v)", lambda: fn(a, b, c, d), ADAMW_BYTES))
        except Exception as e:  # noqa: BLE001 - report why it could not run, go on without it
            print(f"AdamW-shaped kernel unavailable: {type(e).__name__}: {e}".splitlines()[0])
    return ks


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 25,
                    help="fp32 elements per tensor; 128 MiB a tensor by default, 4x a 32 MiB last-level cache")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel-reps", type=int, default=3, help="calls of each bandwidth kernel per round (timed together)")
    ap.add_argument("--cache-elements", type=int, default=1 << 20,
                    help="elements per call of the cache-resident AdamW (4 arrays; 16 MiB by default)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads (default: the cores)")
    ap.add_argument("--sub-group", type=int, default=1 << 22)
    ap.add_argument("--deepspeed", action="store_true", help="also time DeepSpeedCPUAdam (JIT-builds its op)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd AdamW-shaped kernel")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    n = args.elements
    torch.set_num_threads(args.threads)
    llc = _llc_bytes()
    if llc is not None and 4 * n < 4 * llc:
        print(f"warning: a {4 * n / 2**20:.0f} MiB tensor is less than 4x the {llc / 2**20:.0f} MiB last-level "
              f"cache; the bandwidth kernels may partly run from cache")
    gen = torch.Generator().manual_seed(0)
    opt = fzero.optim.adamw(1e-4, weight_decay=0.01)

    p_cpu = {"w": torch.randn(n, generator=gen)}
    grads = {"w": torch.randn(n, generator=gen) * 1e-3}
    st = {"cpu": opt.init(p_cpu)}
    p_disk = {"w": p_cpu["w"].clone()}
    tmp = tempfile.TemporaryDirectory()
    policy = DiskOffload(tmp.name, sub_group_size=args.sub_group)
    st["disk"] = init_disk(opt, policy, p_disk, None, 0)
    k = min(args.cache_elements, n)
    calls = max(1, n // k)
    p_small = {"w": torch.randn(k, generator=gen)}
    g_small = {"w": torch.randn(k, generator=gen) * 1e-3}
    st["small"] = opt.init(p_small)

    def cpu_step():
        st["cpu"] = fzero.optim.apply_inplace(opt, grads, st["cpu"], p_cpu)

    def disk_step():
        st["disk"] = disk_update(opt, st["disk"], grads, p_disk, policy, NoSegments())

    def small_steps():
        for _ in range(calls):
            st["small"] = fzero.optim.apply_inplace(opt, g_small, st["small"], p_small)

    systems = {
        "fzero `offload=\"cpu\"` (torch fused AdamW)": (cpu_step, n),
        f"fzero `offload=\"disk\"` (sub-groups of {args.sub_group:,}, page cache warm)": (disk_step, n),
    }
    if args.deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            p_ds = torch.nn.Parameter(p_cpu["w"].clone())
            p_ds.grad = grads["w"].clone()
            ds = DeepSpeedCPUAdam([p_ds], lr=1e-4, weight_decay=0.01, adamw_mode=True)
            systems["DeepSpeedCPUAdam (JIT-built AVX op)"] = (ds.step, n)
        except Exception as e:  # noqa: BLE001 - report why it could not run
            print(f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {e}".splitlines()[0])
    systems[f"fzero cpu, cache-resident ({k:,} el x {calls} calls)"] = (small_steps, k * calls)
    kernels = bandwidth_kernels(n, compile_adamw_shaped=not args.no_compile)

    ktimes: dict[str, list[float]] = {kn.name: [] for kn in kernels}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for kn in kernels:
            t0 = time.perf_counter()
            for _ in range(args.kernel_reps):
                kn.fn()
            ktimes[kn.name].append((time.perf_counter() - t0) / args.kernel_reps)
        for name, (fn, _) in systems.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)

    def med(ts: list[float]) -> float:
        return statistics.median(ts[1:] if len(ts) > 2 else ts)  # round 1 warms caches, files, threads

    krows = []
    for kn in kernels:
        s = med(ktimes[kn.name])
        krows.append({"kernel": kn.name, "bytes_per_element": kn.bytes_per_el, "median_s": s,
                      "bytes_per_s": kn.bytes_per_el * n / s, "sets_bandwidth": False, "eligible": kn.sets_bandwidth,
                      "note": kn.note})
    best = max((r for r in krows if r["eligible"]), key=lambda r: r["bytes_per_s"])
    best["sets_bandwidth"] = True
    bw = best["bytes_per_s"]
    roof = bw / ADAMW_BYTES  # elements/s

    print(f"\n{n:,} fp32 elements per tensor ({4 * n / 2**20:.0f} MiB; last-level cache "
          f"{'unknown' if llc is None else f'{llc / 2**20:.0f} MiB'}), {args.rounds} rounds, medians of rounds "
          f"2-{args.rounds}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| bandwidth kernel (in place) | bytes/element counted | median s | GB/s |")
    print("|---|---|---|---|")
    for r in krows:
        extra = f" ({8 * n / r['median_s'] / 1e9:.1f} at 8 B/el)" if r["note"] else ""
        mark = " **sets the bandwidth**" if r["sets_bandwidth"] else ("" if r["eligible"] else " (reference only)")
        print(f"| {r['kernel']}{mark} | {r['bytes_per_element']} | {r['median_s']:.4f} | "
              f"{r['bytes_per_s'] / 1e9:.1f}{extra} |")

    print(f"\nAdamW step, {ADAMW_BYTES} B/element; roofline = {bw / 1e9:.1f} GB/s ({best['kernel']}) / "
          f"{ADAMW_BYTES} B = {roof / 1e6:,.0f} M elements/s\n")
    print("| system | median s | elements/s | GB/s at 28 B/el | vs roofline |")
    print("|---|---|---|---|---|")
    rows = [{"system": f"roofline: {best['kernel']} bandwidth / {ADAMW_BYTES} B", "median_s": n / roof,
             "elements_per_s": roof, "vs_roofline": 1.0}]
    for name, (_, count) in systems.items():
        s = med(times[name])
        rows.append({"system": name, "median_s": s, "elements_per_s": count / s, "vs_roofline": count / s / roof})
    for r in rows:
        print(f"| {r['system']} | {r['median_s']:.4f} | {r['elements_per_s'] / 1e6:,.0f} M | "
              f"{r['elements_per_s'] * ADAMW_BYTES / 1e9:.1f} | {r['vs_roofline']:.0%} |")
    out = {"elements": n, "threads": torch.get_num_threads(), "llc_bytes": llc, "bandwidth_bytes_per_s": bw,
           "bandwidth_kernel": best["kernel"], "roofline_elements_per_s": roof, "kernels": krows, "rows": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
