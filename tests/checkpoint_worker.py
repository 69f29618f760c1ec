"""A fresh process for tests/test_checkpoint.py: train a problem for a range of steps, loading and saving checkpoints.

    python tests/checkpoint_worker.py train --problem mlp --stages 3 --ranks 2 --first 5 --last 10 \
        --load /tmp/ck --out /tmp/out.pt                         # a local mesh of 2 ranks (0: no mesh)
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/checkpoint_worker.py train \
        --dist --problem mlp --stages 3 --first 0 --last 5 --save /tmp/ck
    python tests/checkpoint_worker.py crash --save /tmp/ck [--keep]   # saves a large-ish state until killed
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/checkpoint_worker.py dist-fault \
        --kind save0 --out /tmp/faults                           # checkpoint calls the ranks do not make together

``--weights DIR`` (train): the trained params as safetensors files (``save_weights``; ``--max-shard-size`` bytes).

``--out`` gets (rank 0) ``{"params": gathered params, "losses": [...]}``, written with torch.save and read back
with ``weights_only=True``.
"""

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import fzero  # noqa: E402
from fzero.step._state import RankStates  # noqa: E402
from problems import B1, B2, EPS, LR, PROBLEMS, WD  # noqa: E402


def make_step(problem, *, stages: int, mesh, precision: str = "fp32"):
    schedule = fzero.optim.warmup_cosine_decay_schedule(0.0, LR, 3, 20)  # a schedule: its count is state too
    opt = fzero.optim.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    return fzero.compile(problem.loss_fn, optimizer=opt, stages=stages, mesh=mesh, precision=precision,
                         **({"unit_elements": 512} if stages < 2 else {}))


def train(args) -> None:
    mesh = fzero.dist_mesh() if args.dist else (fzero.local_mesh(args.ranks) if args.ranks else None)
    prob = PROBLEMS[args.problem](steps=args.last)
    batches = prob.batches
    if args.dist:  # under dist_mesh each process passes its own share of the global batch
        batches = [{k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()} for b in batches]
    step = make_step(prob, stages=args.stages, mesh=mesh, precision=args.precision)
    state = fzero.checkpoint.load(args.load, like=step) if args.load else step.init(fzero.params_of(prob.model))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    losses = []
    for b in batches[args.first : args.last]:
        state, m = step(state, b)
        losses.append(m["loss"])
    if args.save:
        fzero.checkpoint.save(args.save, state, extra={"next_batch": args.last})
    if args.weights:  # a collective under dist_mesh: every rank gathers, rank 0 writes
        fzero.checkpoint.save_weights(step, state, args.weights, max_shard_size=args.max_shard_size)
    params = step.gather(state)
    if args.out and (not args.dist or mesh.rank == 0):
        torch.save({"params": params, "losses": losses}, args.out)
    if args.dist:
        torch.distributed.barrier()  # tear down together (see torchrun_worker.py)
        torch.distributed.destroy_process_group()


def crash_step():
    """The step (and params) of the state ``crash`` saves: ~50 MB of checkpoint at stage 1 on local_mesh(2)."""
    from fzero.models import MLP

    torch.manual_seed(0)
    model = MLP([1024, 2048, 1024])
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), optimizer=fzero.optim.adamw(1e-3), stages=1, mesh=fzero.local_mesh(2))
    return step, fzero.params_of(model)


def crash(args) -> None:
    """Save the same state at steps 1, 2, ... into one path (or, with --keep, into a keep=2 parent) until killed."""
    step, params = crash_step()
    state = step.init(params)
    for k in range(1, 10_000):
        state = RankStates(tuple(dataclasses.replace(s, step=torch.tensor(k)) for s in state.states))
        fzero.checkpoint.save(args.save, state, extra={"k": k}, keep=2 if args.keep else None)
        print(k, flush=True)


def dist_fault(args) -> None:
    """Under torchrun (2 ranks): a checkpoint call that the ranks do not make together (issue 32).

    - ``save0``: rank 0 saves, rank 1 goes on to ``step.gather`` (another fzero call).
    - ``save0-stall``: rank 0 saves, rank 1 stays in its own code (a sleep) past the mesh timeout.
    - ``loads``: every rank saves at step 2 and at step 4; rank 0 loads step 4, rank 1 step 2.
    - ``save-killed``: every rank saves at step 2 and at step 4 (keep=2); at step 4 rank 1's process ends (``os._exit``)
      as it starts writing its data file, inside torch.distributed.checkpoint.
    - ``extras``: every rank saves at step 2 with its own ``extra`` (its data position).

    Each rank writes ``<out>/rank<r>.json``: its pid, the error it raised (or null) and when; the error is re-raised.
    """
    import json
    import time

    def record(name: str, **fields) -> None:
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({**fields, "pid": os.getpid(), "time": time.time()}, f)

    mesh = fzero.dist_mesh() if args.timeout is None else fzero.dist_mesh(timeout=args.timeout)
    prob = PROBLEMS["mlp"](steps=4)
    batches = [{k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()} for b in prob.batches]
    step = make_step(prob, stages=args.stages, mesh=mesh)
    record(f"pid{mesh.rank}.json")
    error = None
    try:
        state = step.init(fzero.params_of(prob.model))
        for k, b in enumerate(batches, 1):
            state, _ = step(state, b)
            if args.kind == "save-killed" and k == 4 and mesh.rank == 1:
                from fzero.checkpoint import _dcp

                def killed(*a, **kw):
                    record("fault.json")
                    os._exit(1)

                _dcp._Writer.write_data = killed
            if args.kind in ("loads", "save-killed") and k in (2, 4):
                fzero.checkpoint.save(os.path.join(args.out, "ck"), state, keep=2)
            if args.kind == "extras" and k == 2:
                fzero.checkpoint.save(os.path.join(args.out, "ck"), state, extra={"pos": 10 * (mesh.rank + 1)})
        if args.kind == "loads":
            which = os.path.join(args.out, "ck", fzero.checkpoint.step_dir(4 if mesh.rank == 0 else 2))
            state = fzero.checkpoint.load(which, like=step)
        elif args.kind in ("save-killed", "extras"):
            pass
        elif mesh.rank == 0:
            record("fault.json")
            fzero.checkpoint.save(os.path.join(args.out, "ck"), state)
        elif args.kind == "save0-stall":
            time.sleep(600)
        step.gather(state)
    except BaseException as e:
        error = e
    record(f"rank{mesh.rank}.json", error=None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "crash", "dist-fault"])
    parser.add_argument("--kind", choices=["save0", "save0-stall", "loads", "save-killed", "extras"], help="dist-fault: which")
    parser.add_argument("--timeout", type=float, default=None, help="dist-fault: dist_mesh(timeout=...)")
    parser.add_argument("--problem", choices=sorted(PROBLEMS), default="mlp")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--dist", action="store_true")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--last", type=int, default=5)
    parser.add_argument("--load")
    parser.add_argument("--seed", type=int, default=None, help="train: torch.manual_seed before the first step")
    parser.add_argument("--save")
    parser.add_argument("--out")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--weights", help="a directory for fzero.checkpoint.save_weights (safetensors) after training")
    parser.add_argument("--max-shard-size", type=int, default=5 * 10**9)
    args = parser.parse_args()
    {"train": train, "crash": crash, "dist-fault": dist_fault}[args.mode](args)


if __name__ == "__main__":
    main()
