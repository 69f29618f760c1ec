"""What a rank of a local mesh of several ranks pays for its own copies of the objects the modules hold.

On a ``local_mesh`` of several ranks (threads of one process) each rank's copy of a module takes copies of its own of
what public names hold (built-in containers and the standard library's collections with their entries, tensors, a
metric), made at the start of the step call, and rank 0's are written back into the user's objects once the call
succeeds (``fzero.layout.Writes(private=True)``, docs/architecture.md). This times one rank's share of that, side by
side with the ordinary copy, on an HF Llama (12 layers, 163 modules: its rotary embedding's ``original_inv_freq`` is a
public tensor) with a torchmetrics metric, a list in a dict and a tensor counter on its root, as training code has:

    .venv/bin/python benchmarks/local_mesh_copies.py               # about 5 s
    .venv/bin/python benchmarks/local_mesh_copies.py --no-metric   # without the metric

Systems, alternating call by call (``--rounds`` rounds after 5 warm-up calls each):

* ``shared``: ``clone_structure(model, writes=Writes())`` then ``Writes.note`` and ``Writes.keep`` (one rank alone);
* ``private``: the same with ``Writes(private=True)`` (a rank of several, rank 0's write-back included).

Reported: the median of each in ms, and their difference.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--no-metric", dest="metric", action="store_false", help="leave the metric out")
    args = p.parse_args(argv)
    import torch
    import torchmetrics
    from transformers import LlamaConfig, LlamaForCausalLM

    from fzero.layout import Writes, clone_structure

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=12,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.acc, model.hist, model.seen = (torchmetrics.classification.BinaryAccuracy() if args.metric else None), {"rows": []}, torch.zeros(())

    def once(private: bool) -> float:
        t = time.perf_counter()
        writes = Writes(private=private)
        clone = clone_structure(model, writes=writes)
        clone.hist["rows"].append(1)  # what a forward writes
        clone.seen += 1
        writes.note(model, clone)
        writes.keep()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"shared": [], "private": []}
    for i in range(args.rounds + 5):
        for name in times:
            dt = once(name == "private")
            if i >= 5:
                times[name].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"modules: {sum(1 for _ in model.modules())}, rounds: {args.rounds}")
    for k, v in med.items():
        print(f"{k:8s} {v:.3f} ms")
    print(f"private - shared: {med['private'] - med['shared']:+.3f} ms a rank and step call")


if __name__ == "__main__":
    main()
