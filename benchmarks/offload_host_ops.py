"""The host memory of each operation of offload's update, alone (issue 27): bytes per element above its start.

    python benchmarks/offload_host_ops.py --elements 268435456      # 1 GiB per fp32 tensor (on a CUDA machine)

With ``offload="cpu"`` the step's update runs on the host (``CPUOffload.apply``, ``apply_update``): the gradient copied
into a page-locked buffer, torch's fused AdamW over the page-locked fp32 master, then the device's bf16 params copied
from the master. ``benchmarks/offload_rss.py --phases`` measured a 1.0B GPT holding 12 bytes per parameter more for the
length of ``apply_update`` on an H200, which the same code on the CPU does not; each row here is one of those
operations on N fp32 elements, its host peak (a 1 ms sampler of VmRSS) and what stays after it, per element. Every
row's arithmetic is 0: the buffers are made before. The CUDA rows run where CUDA is.
"""

import argparse
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload_rss import vm_rss as rss  # noqa: E402  (this directory's: the resident set, from /proc)


class Peak:
    def __init__(self) -> None:
        self.high = 0
        self.on = True
        self.rows: list[dict] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while self.on:
            self.high = max(self.high, rss())
            time.sleep(0.001)

    def measure(self, name: str, n: int, fn) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        time.sleep(0.05)
        base = rss()
        self.high = base
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        time.sleep(0.02)
        after = rss()
        self.rows.append({"op": name, "peak_b_per_elem": (self.high - base) / n, "after_b_per_elem": (after - base) / n})
        print(f"{name:58s} peak +{(self.high - base) / n:6.2f} B/elem, after +{(after - base) / n:6.2f} B/elem, "
              f"{(time.perf_counter() - t0) * 1e3:8.1f} ms", flush=True)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 28)
    args = ap.parse_args(argv)
    n = args.elements
    cuda = torch.cuda.is_available()
    from fzero.zero._policies import host_empty

    peak = Peak()
    like = torch.empty(n, dtype=torch.float32, device="meta")
    master = host_empty(like, pin=True)  # page-locked (registered) where CUDA is, as CPUOffload keeps it
    master.normal_()
    grad = host_empty(like, pin=True)
    grad.normal_()
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.tensor(1.0)
    print(f"N = {n:,} fp32 elements; cuda: {cuda}; master pinned: {master.is_pinned() if cuda else 'n/a'}", flush=True)

    def adamw(p, g):
        return lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999,
                                           weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)

    peak.measure("torch._fused_adamw_ on pinned master/grad (CPU kernel)", n, adamw(master, grad))
    plain_master, plain_grad = master.clone(), grad.clone()
    peak.measure("torch._fused_adamw_ on pageable master/grad", n, adamw(plain_master, plain_grad))
    del plain_master, plain_grad
    import fzero

    opt = fzero.optim.adamw(1e-4)
    state = opt.init({"u": master})
    peak.measure("fzero.optim.apply_inplace(adamw) on pinned master", n,
                 lambda: fzero.optim.apply_inplace(opt, {"u": grad}, state, {"u": master}))
    if cuda:
        p = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        peak.measure("bf16 cuda param .copy_(pinned fp32 master) (blocking)", n, lambda: p.copy_(master))
        peak.measure("bf16 cuda param .copy_(pinned fp32 master, non_blocking)", n, lambda: p.copy_(master, non_blocking=True))
        g_dev = torch.randn(n, device="cuda")
        peak.measure("pinned fp32 grad .copy_(cuda fp32 grad, non_blocking) + sync", n,
                     lambda: grad.copy_(g_dev, non_blocking=True))
        from fzero.step import MasterState, apply_update

        ms = MasterState({"u": master}, opt.init({"u": master}))
        peak.measure("fzero.step.apply_update(MasterState, cuda bf16 params)", n,
                     lambda: apply_update(opt, {"u": grad}, ms, {"u": p}, fzero.optim.WholeLeaves()))
    peak.on = False
    return peak.rows


if __name__ == "__main__":
    main(sys.argv[1:])
