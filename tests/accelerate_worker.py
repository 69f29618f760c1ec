"""An fzero training script as an Accelerate user runs it: ``accelerate launch --config_file cfg.yaml`` starts it (torchrun
underneath), and the settings come from the same Accelerate config (``fzero.config.from_accelerate``). Rank 0 saves
the params after each step and the settings it ran with.

    accelerate launch --config_file cfg.yaml tests/accelerate_worker.py --config cfg.yaml --out /tmp/acc.pt
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from problems import B1, B2, EPS, GLOBAL_BATCH, LR, WD, gpt_problem, save_and_finish  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    # the loader's per-process batch size: the global batch, shared by the ranks and the config's micro-batches
    accum = fzero.config.from_accelerate(args.config, batch_size=1).grad_accum
    settings = fzero.config.from_accelerate(args.config, batch_size=GLOBAL_BATCH // (mesh.size * accum))
    prob = gpt_problem(steps=3)
    step = fzero.compile(prob.loss_fn, config=settings, mesh=mesh,
                         optimizer=fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD))
    state = step.init(fzero.params_of(prob.model))
    history = []
    for b in prob.batches:
        state, _ = step(state, {k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()})
        history.append(step.gather(state))
    save_and_finish(mesh, {"history": history, "stage": step.stage, "grad_accum": step.grad_accum,
                           "clip": step.clip_grad_norm, "world": mesh.size}, args.out)


if __name__ == "__main__":
    main()
