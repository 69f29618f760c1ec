"""One rank of a torchrun job on a process group of NCCL alone (tests/test_devices.py, GPU only), as
``dist.init_process_group("nccl")`` (or ``deepspeed.init_distributed()``) makes it before ``fzero.dist_mesh()``:

    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/nccl_worker.py --check flags
    python -m torch.distributed.run --standalone --nproc_per_node 1 tests/nccl_worker.py --check lamb

Why a child process, not the test's: a pytest worker that made an NCCL group keeps NCCL's threads and fzero's fault
board hooks to its exit (the GPU run of 2026-11-28 saw the gpu-marked set finish its tests and its process not exit).
``--check flags``: save's "did a rank fail?" flag and save_weights' verdict are reduced (host tensors, through the GPU).
``--check lamb``: ``offload="cpu"`` with LAMB (its per-parameter norms summed on the host) trains two steps bitwise as
on ``local_mesh(1)``. Exits 0 when the check holds.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from fzero.testing import assert_trees_equal  # noqa: E402


def flags() -> None:
    from fzero.checkpoint._collective import Ranks
    from fzero.checkpoint._weights import _agree
    from fzero.mesh import DistComm

    comm = DistComm(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, None, None, collectives="native")
    assert comm.stage == torch.device("cuda", torch.cuda.current_device()), comm.stage
    ranks = Ranks("x", False)
    ranks.comm = comm
    assert ranks.any(True, "what") is True and ranks.any(False, "what") is False
    _agree(None, comm, "x")  # no error: rank 0 wrote


def lamb() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).cuda()
    batches = [torch.randn(4, 8, device="cuda") for _ in range(2)]

    def loss_fn(p, x):
        return fzero.apply(model, p, x).square().mean()

    def run(mesh):
        step = fzero.compile(loss_fn, optimizer=fzero.optim.lamb(1e-2), stages=2, offload="cpu", mesh=mesh)
        state = step.init(fzero.params_of(model))
        for x in batches:
            state, _ = step(state, x)
        return step.gather(state)

    assert_trees_equal(run(fzero.dist_mesh()), run(fzero.local_mesh(1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", choices=("flags", "lamb"), required=True)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")  # NCCL alone: no gloo beside it
    try:
        {"flags": flags, "lamb": lamb}[args.check]()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
