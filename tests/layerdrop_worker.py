"""One rank of a torchrun job for tests/test_layerdrop.py: a GPT with progressive layer drop at stage 3 under
``dist_mesh``; every rank draws which blocks run from (seed, step) alone. Rank 0 saves the params after each step.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/layerdrop_worker.py --out /tmp/pld.pt
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from fzero.models import ProgressiveLayerDrop, gpt_loss  # noqa: E402
from problems import B1, B2, EPS, LR, WD, gpt_problem, save_and_finish  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    pld = ProgressiveLayerDrop(theta=0.3, gamma=1.0, seed=1)
    prob = gpt_problem(steps=5)
    n, box = prob.model.cfg.n_layer, {"k": 0}

    def loss_fn(params, b):
        return gpt_loss(fzero.apply(prob.model, params, b["x"], pld.layers(box["k"], n)), b["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD), stages=3, mesh=mesh)
    state = step.init(fzero.params_of(prob.model))
    history = []
    for k, b in enumerate(prob.batches):
        box["k"] = k
        state, _ = step(state, {key: v.chunk(mesh.size)[mesh.rank] for key, v in b.items()})
        history.append(step.gather(state))
    save_and_finish(mesh, history, args.out)


if __name__ == "__main__":
    main()
