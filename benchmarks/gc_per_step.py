"""What a step leaves to Python's cyclic garbage collector, and what the collector's passes cost the host.

An object in a reference cycle is freed only when the collector runs, with everything it reaches; each pass walks
the tracked objects. Run on the GPT of ``benchmarks/host_overhead.py`` (GPT-2 124M's structure, widths of 8, one
thread), plus a model with frozen layers (bytes still allocated after each step, the collector off):

    .venv/bin/python benchmarks/gc_per_step.py                                  # about 30 s
    .venv/bin/python benchmarks/gc_per_step.py --fzero /path/to/other/checkout  # the same, another fzero
    .venv/bin/python benchmarks/gc_per_step.py --growth [--fzero ...]  # what many steps leave: jit, the pool's loans

Reported per system (plain PyTorch, fzero stages 0-3): objects only the collector could free, per step; the
collector's passes per step (generations 0/1/2, collector on); the step time's median and mean with the collector
on (its passes show in the mean) and off.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fzero", default=None, help="import fzero from this checkout instead")
    args = p.parse_args(argv)
    if args.fzero:
        sys.path.insert(0, args.fzero)
    import torch

    import fzero
    from fzero.memory import LiveBytes

    print("fzero from", fzero.__file__)
    from host_overhead import build_systems  # the same model and systems (this directory is on sys.path)

    systems = build_systems(stages=(0, 1, 2, 3))
    bf16 = fzero.Precision(compute=torch.bfloat16, reduce=torch.float32)

    print(f"{'system':10s} {'garbage/step':>12s} {'passes/step g0/g1/g2':>22s} {'median on':>10s} {'mean on':>8s} "
          f"{'median off':>10s} {'mean off':>9s}  (ms)")
    for name, run in systems.items():
        for _ in range(3):
            run()
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        run()
        garbage = gc.collect()
        gc.garbage.clear()
        gc.set_debug(0)
        times = {}
        for mode in ("on", "off"):
            (gc.enable if mode == "on" else gc.disable)()
            before = [s["collections"] for s in gc.get_stats()]
            ts = []
            for _ in range(args.steps):
                t = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t)
            if mode == "on":
                passes = [s["collections"] - b for s, b in zip(gc.get_stats(), before)]
            times[mode] = (statistics.median(ts) * 1e3, statistics.fmean(ts) * 1e3)
        gc.enable()
        per = "/".join(f"{n / args.steps:.2f}" for n in passes)
        print(f"{name:10s} {garbage:12d} {per:>22s} {times['on'][0]:10.2f} {times['on'][1]:8.2f} {times['off'][0]:10.2f} "
              f"{times['off'][1]:9.2f}")

    # frozen layers under bf16: what stays allocated after each step with the collector off
    class Adapted(torch.nn.Module):
        def __init__(self, width=512, layers=8):
            super().__init__()
            self.base = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(layers)])
            self.adapter = torch.nn.ModuleList([torch.nn.Linear(width, 8, bias=False) for _ in range(layers)])
            self.base.requires_grad_(False)

        def forward(self, x):
            for base, adapter in zip(self.base, self.adapter):
                x = torch.tanh(base(x) + adapter(x).sum(-1, keepdim=True))
            return x.square().mean()

    adapted = Adapted()
    frozen = sum(p.numel() * 2 for p in adapted.base.parameters())
    print(f"\nfrozen layers, {frozen / 2**20:.1f} MiB in bf16: live bytes peak (MiB) over 5 steps, collector off")
    for stage in (0, 1, 2, 3):
        counters = {}
        mesh = dataclasses.replace(fzero.local_mesh(1), rank_context=lambda r: counters.setdefault(r, LiveBytes()))
        step = fzero.compile(lambda params, x: fzero.apply(adapted, params, x), optimizer=fzero.optim.adamw(1e-3),
                             stages=stage, mesh=mesh, precision=bf16)
        state = step.init(fzero.params_of(adapted))
        x = torch.randn(4, 512)
        peaks = []
        gc.disable()
        for _ in range(5):
            state, _ = step(state, x)
            peaks.append(counters[0].peak / 2**20)
        gc.enable()
        print(f"  stage {stage}: " + ", ".join(f"{p:.2f}" for p in peaks))


def growth(argv=None) -> None:
    """``--growth``: what stays behind per step over many steps, on a 4-block GPT: host bytes (tracemalloc) over two
    windows of 100 steps with ``jit=True`` (stage 3), and the pool's loans after 20 steps under remat, gradient
    accumulation and multi-unit buckets."""
    import gc as _gc
    import tracemalloc
    import warnings

    import torch

    import fzero
    from fzero.models import GPT, GPTConfig

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, d_model=16, n_head=2, seq_len=8, vocab_size=32, bias=True))
    tokens = torch.randint(0, 32, (4, 9))
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def loss_fn(params, b):
        return torch.nn.functional.cross_entropy(fzero.apply(model, params, b["x"]).flatten(0, 1).float(), b["y"].flatten())

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(1), jit=True)
    state = step.init(fzero.params_of(model))
    for _ in range(5):
        state, _ = step(state, batch)
    tracemalloc.start()
    sizes = []
    for _ in range(3):
        _gc.collect()
        sizes.append(tracemalloc.get_traced_memory()[0])
        for _ in range(100):
            state, _ = step(state, batch)
    tracemalloc.stop()
    print(f"jit=True, stage 3, 4 units: host bytes grown over steps 5-105: {sizes[1] - sizes[0]}, over steps 105-205: "
          f"{sizes[2] - sizes[1]}")
    for settings in ({"stages": 3, "remat": True}, {"stages": 2, "grad_accum": 2},
                     {"stages": 2, "grad_accum": 2, "bucket_elements": 5000, "mesh": 2}):
        settings = dict(settings)
        step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), mesh=fzero.local_mesh(settings.pop("mesh", 1)),
                             **settings)
        state = step.init(fzero.params_of(model))
        for _ in range(20):
            state, _ = step(state, batch)
        loans = getattr(step.pool, "loans", None)
        loans = len(step.pool._lent) if loans is None else loans  # (a checkout from before Pool.loans)
        print(f"pool loans left after 20 steps, {settings}: {loans}")


if __name__ == "__main__":
    if "--growth" in sys.argv:
        sys.argv.remove("--growth")
        if "--fzero" in sys.argv:
            sys.path.insert(0, sys.argv[sys.argv.index("--fzero") + 1])
        growth()
        sys.exit()
    main()
