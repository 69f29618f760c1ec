"""One rank of a torchrun job for tests/test_pretrained.py: a Hugging Face Llama built under ``fzero.empty_params()``
on every rank, its state streamed from a ``save_pretrained`` directory by ``step.init``, trained a few steps under
``dist_mesh``; rank 0 saves the params gathered after init and after training, and for every rank the elements its
reader returned and the elements its init moved in collectives (``fzero.count_collectives``).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/pretrained_worker.py --dir D --stages 3 --out R
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from zoo import llama  # noqa: E402

STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.count_collectives(fzero.dist_mesh())
    with fzero.empty_params():
        model = llama()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b["x"], labels=b["x"]).loss,
                         optimizer=fzero.optim.adamw(1e-2), stages=args.stages, mesh=mesh)
    source = fzero.checkpoint.pretrained(args.dir, model=model)
    read = []  # elements read_range returned on this rank
    real = source.read_range
    object.__setattr__(source, "read_range", lambda *a: read.append(real(*a).numel()) or real(*a))
    state = step.init(fzero.params_of(model, copy=False), materialize=source)
    moved = mesh.counter.elements(rank=mesh.rank, tag="init")
    numbers = [None] * mesh.size
    torch.distributed.all_gather_object(numbers, {"read": sum(read), "moved": moved,
                                                  "kept": sum(t.numel() for t in state.params.values())})
    first = step.gather(state)  # a collective at stage 3: every rank calls it
    for k in range(STEPS):  # the batches of tests/test_pretrained.py's _train, each rank taking its share
        batch = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(k))
        state, _ = step(state, {"x": batch.chunk(mesh.size)[mesh.rank]})
    last = step.gather(state)
    if mesh.rank == 0:
        torch.save({"first": first, "last": last, "ranks": numbers}, args.out)
    torch.distributed.barrier()  # tear down together (tests/launch.py)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
