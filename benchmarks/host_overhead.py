"""The host's time per step: fzero against a plain step on a model whose compute is negligible.

On a GPU a step is bound by whichever is slower, the device's kernels or the host that launches them. At GPT-2
124M on an H100, fzero's kernels took as long as plain PyTorch's while its host took longer, so the GPU waited
(docs/benchmarks.md, "GPU runs ... 2026-11-26"). This measures the host side alone, on the CPU: a GPT with GPT-2
124M's structure (12 blocks, 148 parameters) but widths of 8, a batch of 1 x 4 tokens, one thread, so each step
is almost all Python and dispatch.

    .venv/bin/python benchmarks/host_overhead.py                          # about 20 s
    .venv/bin/python benchmarks/host_overhead.py --fzero /path/to/other/checkout   # the same, another fzero

Systems, in one process, alternating step by step (``--rounds`` rounds after 3 warm-up steps each):

* ``plain``: the module under ``torch.autocast("cpu", bf16)``, ``loss.backward()``, ``AdamW(fused=True)``;
* ``fzero-s0``, ``fzero-s3``: ``fzero.compile(stages=0 | 3, mesh=local_mesh(1), precision=Precision(bf16, fp32))``.

Reported: each system's median step time, and stage 3's over plain's (ratio and difference), by the medians and by
the fastest steps (steadier on a machine shared with other work).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--fzero", default=None, help="import fzero from this checkout instead (before/after comparisons)")
    return p.parse_args(argv)


def build_systems(*, layers: int = 12, stages: tuple[int, ...] = (0, 3)) -> dict:
    """``{name: run}``: one step of each system per call (``plain``, ``fzero-s<stage>``), on the model described above.
    Shared with ``benchmarks/gc_per_step.py``."""
    import torch

    import fzero
    from fzero.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, d_model=8, n_head=2, seq_len=4, vocab_size=16, bias=True))
    tokens = torch.randint(0, 16, (1, 5))
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}

    def lm(logits, y):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    own = copy.deepcopy(model)
    opt = torch.optim.AdamW(own.parameters(), lr=1e-3, fused=True)

    def plain():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = own(batch["x"])
        loss = lm(logits, batch["y"])
        loss.backward()
        opt.step()
        return float(loss.detach())

    systems = {"plain": plain}
    for stage in stages:
        step = fzero.compile(lambda params, b: lm(fzero.apply(model, params, b["x"]), b["y"]),
                             optimizer=fzero.optim.adamw(1e-3, weight_decay=0.01), stages=stage, mesh=fzero.local_mesh(1),
                             precision=fzero.Precision(compute=torch.bfloat16, reduce=torch.float32))
        box = {"state": step.init(fzero.params_of(model))}

        def run(step=step, box=box):
            box["state"], metrics = step(box["state"], batch)
            return metrics["loss"]

        systems[f"fzero-s{stage}"] = run
    return systems


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.fzero:
        sys.path.insert(0, args.fzero)
    import fzero

    systems = build_systems(layers=args.layers)
    for run in systems.values():
        for _ in range(3):
            run()
    times: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(args.rounds):
        for name, run in systems.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"fzero from {fzero.__file__}")
    for k, v in med.items():
        print(f"{k:10s} {v:7.2f} ms/step")
    print(f"fzero-s3 / plain {med['fzero-s3'] / med['plain']:.2f}x, {med['fzero-s3'] - med['plain']:+.2f} ms")
    # on a machine other processes share, a step is slowed by whatever else runs during it: the fastest of the rounds
    # is the least disturbed, a steadier figure there than the median (both are printed; the median is returned)
    low = {k: min(v) * 1e3 for k, v in times.items()}
    print(f"fastest: plain {low['plain']:.2f} ms, fzero-s3 {low['fzero-s3']:.2f} ms, fzero-s3 / plain "
          f"{low['fzero-s3'] / low['plain']:.2f}x, {low['fzero-s3'] - low['plain']:+.2f} ms")
    return med


if __name__ == "__main__":
    main()
