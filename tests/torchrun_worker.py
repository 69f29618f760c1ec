"""One rank of a torchrun job for tests/test_torchrun.py: runs a problem and saves what rank 0 sees.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/torchrun_worker.py \
        --problem gpt --stages 2 --out /tmp/run.pt
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/torchrun_worker.py --jobs /tmp/jobs.json

``--jobs``: a JSON list of such argument lists, run one after the other in one launch, each with its own mesh
(``dist_mesh`` over the one process group) and its own output file. Why: a launch costs about 5 s of this 2-core
machine's time (three interpreters importing torch), several times the run of a small problem.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from problems import PROBLEMS, fzero_run  # noqa: E402


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", choices=sorted(PROBLEMS), required=True)
    parser.add_argument("--stages", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--offload", choices=("cpu", "disk"), default=None)
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--offload-params", action="store_true")
    parser.add_argument("--meta-init", action="store_true", help="ranks other than 0 pass meta params to init")
    parser.add_argument("--collectives", choices=("auto", "native", "p2p"), default="auto")
    parser.add_argument("--bucket-elements", type=int, default=0)
    parser.add_argument("--autodiff", choices=("autograd", "func"), default=None)
    parser.add_argument("--shard-frozen", action="store_true", help="freeze the matrices and shard them (init's frozen=)")
    parser.add_argument("--rank-seeded", action="store_true",
                        help="build the problem as this rank (its rank argument); every rank saves its module's buffers")
    return parser


def main() -> None:
    if sys.argv[1:2] == ["--jobs"]:
        with open(sys.argv[2]) as f:
            jobs = json.load(f)
    else:
        jobs = [sys.argv[1:]]
    for i, job in enumerate(jobs):
        try:
            run(parser().parse_args(job))
        except BaseException as e:  # which job failed, in its traceback (the tests' error shows a launch's stderr)
            if hasattr(e, "add_note"):
                e.add_note(f"torchrun_worker.py: job {i + 1} of {len(jobs)} failed: {' '.join(job)}")
            raise
        torch.distributed.barrier()  # the ranks start each job together
    # every rank tears down together: a rank that destroys its gloo group while the other is still in (or just
    # past) the last collective can abort in C++ ("terminate called without an active exception") under load
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    mesh = fzero.count_collectives(fzero.dist_mesh(collectives=args.collectives))
    prob = PROBLEMS[args.problem](**({"rank": mesh.rank} if args.rank_seeded else {}))
    # under dist_mesh each process passes its own share of the global batch
    local = [{k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()} for b in prob.batches]
    prob = type(prob)(prob.model, prob.loss_fn, local)
    extra = {"offload": args.offload, "offload_dir": args.offload_dir, "offload_params": args.offload_params} if args.offload else {}
    if args.bucket_elements:
        extra["bucket_elements"] = args.bucket_elements
    if args.autodiff:
        extra["autodiff"] = args.autodiff
    history, metrics = fzero_run(prob, stages=args.stages, mesh=mesh, meta_params=args.meta_init and mesh.rank != 0,
                                 shard_frozen=args.shard_frozen, **extra)
    calls = [(c.op, c.tag, c.numel) for c in mesh.counter.calls if c.rank == mesh.rank]
    if args.rank_seeded:
        torch.save({k: v.clone() for k, v in prob.model.named_buffers()}, f"{args.out}.buffers{mesh.rank}")
    if mesh.rank == 0:
        gathers = [c.label for c in mesh.counter.calls if c.rank == mesh.rank and c.op == "all_gather"]
        torch.save({"history": history, "metrics": metrics, "calls": calls, "gathers": gathers, "world": mesh.size}, args.out)


if __name__ == "__main__":
    main()
