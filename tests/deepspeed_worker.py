"""One rank of a torchrun job for tests/test_deepspeed_checkpoint.py: resumes a DeepSpeed checkpoint at stage 3 under
``dist_mesh``, trains the fixture's last two batches (this rank's rows) and saves the gathered params (rank 0).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/deepspeed_worker.py --case stage3_world2 --out /tmp/p.pt
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
import deepspeed_fixtures as F  # noqa: E402
from problems import save_and_finish  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    model = F.model()
    step = fzero.compile(lambda p, b: F.loss_fn(lambda x: fzero.apply(model, p, x), b[0], b[1]), stages=3, mesh=mesh,
                         optimizer=fzero.optim.adamw(F.LR, b1=F.BETAS[0], b2=F.BETAS[1], eps=F.EPS, weight_decay=F.WD))
    state = fzero.checkpoint.from_deepspeed(os.path.join(os.path.dirname(__file__), "data", "deepspeed", args.case), like=step)
    for batch in F.batches(mesh.size, mesh.rank)[3:]:
        state, _ = step(state, batch)
    save_and_finish(mesh, step.gather(state), args.out)


if __name__ == "__main__":
    main()
