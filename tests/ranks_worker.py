"""Problems of tests/test_ranks.py, and one rank of its torchrun jobs.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ranks_worker.py \
        --case dropout --stages 3 --out /tmp/run.pt

``dropout``: trains the dropout MLP for a few steps from one seed and saves what rank 0 sees.
``widths``: rank 0 builds a model of hidden width 8, rank 1 of width 16; ``Step.init`` must refuse, and
each rank saves the message it raised.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from problems import B1, B2, EPS, LR, WD, Problem  # noqa: E402

SEED = 1234  # the seed every "process" sets before training: dropout masks come from it


class _Block(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(fan_in, fan_out)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(nn.functional.gelu(self.lin(x)))


class DropoutMLP(nn.Module):
    """Dropout inside the units (the blocks), so that a stage-3 unit's forward draws random numbers."""

    def __init__(self, width: int = 32, p: float = 0.25) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(8, width, p), _Block(width, width, p)])
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dropout_problem(*, width: int = 32, steps: int = 4, batch: int = 8) -> Problem:
    """An MLP with a dropout layer in each of its two blocks (the units at stages 2-3)."""
    torch.manual_seed(0)
    model = DropoutMLP(width)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(batch, 8, generator=gen), "y": torch.randn(batch, 4, generator=gen)} for _ in range(steps)]

    def loss_fn(params, b):
        return nn.functional.mse_loss(fzero.apply(model, params, b["x"]), b["y"])

    return Problem(model, loss_fn, batches)


def train(problem: Problem, *, stages: int, mesh, **settings) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """AdamW steps from ``SEED``: the gathered params after each step, and the losses."""
    opt = fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    step = fzero.compile(problem.loss_fn, optimizer=opt, stages=stages, mesh=mesh,
                         **({"unit_elements": 1024} if stages < 2 else {}), **settings)
    state = step.init(fzero.params_of(problem.model))
    torch.manual_seed(SEED)
    history, losses = [], []
    for b in problem.batches:
        state, m = step(state, b)
        history.append(step.gather(state))
        losses.append(m["loss"])
    return history, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("dropout", "widths"), required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    if args.case == "dropout":
        prob = dropout_problem()
        # under dist_mesh each process passes its own share of the global batch
        local = [{k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()} for b in prob.batches]
        history, losses = train(Problem(prob.model, prob.loss_fn, local), stages=args.stages, mesh=mesh)
        if mesh.rank == 0:
            torch.save({"history": history, "losses": losses, "rng": torch.get_rng_state()}, args.out)
    else:
        prob = dropout_problem(width=8 if mesh.rank == 0 else 16)
        step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.sgd(0.1), stages=args.stages, mesh=mesh)
        try:
            step.init(fzero.params_of(prob.model))
            message = None
        except RuntimeError as e:
            message = f"{type(e).__name__}: {e}"
        torch.save({"message": message}, f"{args.out}.{mesh.rank}")
    torch.distributed.barrier()  # tear down together (see torchrun_worker.py)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
