"""One rank of a torchrun job for tests/test_dist_faults.py: trains a small MLP while rank 1 misbehaves.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/faults_worker.py \
        --fault raise --stages 3 --out /tmp/faults

Faults (all on rank 1; rank 0 trains as it should):

- ``none``: nobody misbehaves (the control).
- ``raise``: rank 1's loss_fn raises a ValueError at step ``--at``.
- ``kill``: rank 1 SIGKILLs itself inside its loss_fn at step ``--at``.
- ``stall``: rank 1 sleeps inside its loss_fn at step ``--at``, far past the mesh timeout (``--timeout``).
- ``stages``: rank 1 compiles one ZeRO stage lower than rank 0.
- ``width``: rank 1's model is 64 wide, rank 0's 8 wide.
- ``precision``: rank 1 trains in bf16, rank 0 in fp32.
- ``features``: rank 1's batch at step ``--at`` has 12 features instead of 16.
- ``evaluate``: rank 1 calls ``step.evaluate`` before step ``--at``, which the others do not.
- ``fewer``: rank 1 makes one step fewer than rank 0, then ends its program without waiting for the others.
- ``activation``: rank 1's model has Tanh where rank 0's has GELU (the same parameters).
- ``empty``: rank 1's batch at step ``--at`` has 0 rows.

Each rank writes ``<out>/rank<r>.json``: the error it raised (``"Type: message"``, or null) and when
(``time.time()``), then re-raises it, so that the job fails as a user's would. Rank 1 writes ``<out>/fault.json``
with the time it misbehaved, just before it does.
"""

import argparse
import dataclasses
import json
import os
import signal
import sys
import time

import torch

import fzero
from fzero.models import MLP

STEPS = 6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=("none", "raise", "kill", "stall", "stages", "width", "precision", "features", "evaluate",
                                            "fewer", "collectives", "activation", "empty"),
                        required=True)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--at", type=int, default=3, help="the step (1-based) at which rank 1 misbehaves")
    parser.add_argument("--timeout", type=float, default=None, help="dist_mesh(timeout=...)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    mesh = fzero.dist_mesh() if args.timeout is None else fzero.dist_mesh(timeout=args.timeout)
    odd = mesh.rank == 1
    if odd and args.fault == "collectives":  # gloo's own collectives on rank 1, exchanges on rank 0
        mesh = dataclasses.replace(mesh, collectives="native")
    width = 64 if odd and args.fault == "width" else 8
    stages = args.stages - 1 if odd and args.fault == "stages" else args.stages
    precision = "bf16" if odd and args.fault == "precision" else "fp32"
    torch.manual_seed(0)
    model = MLP([16, width, width, 4], activation=torch.nn.Tanh if odd and args.fault == "activation" else torch.nn.GELU)
    calls = [0]

    def loss_fn(params, batch):
        calls[0] += 1
        if odd and calls[0] == args.at:
            if args.fault in ("raise", "kill", "stall"):
                _record(args.out, "fault.json", fault=args.fault)
            if args.fault == "raise":
                raise ValueError("rank 1 broke its loss on purpose")
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fault == "stall":
                time.sleep(600)
        return torch.nn.functional.mse_loss(fzero.apply(model, params, batch["x"]).float(), batch["y"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=mesh, precision=precision,
                         **({"unit_elements": 64} if stages < 2 else {}))
    gen = torch.Generator().manual_seed(1 + mesh.rank)
    error = None
    try:
        state = step.init(fzero.params_of(model))
        for k in range(1, STEPS + (0 if odd and args.fault == "fewer" else 1)):
            features = 12 if odd and args.fault == "features" and k == args.at else 16
            if features != 16:
                _record(args.out, "fault.json", fault=args.fault)
            batch = {"x": torch.randn(4, features, generator=gen), "y": torch.randn(4, 4, generator=gen)}
            if odd and args.fault == "empty" and k == args.at:
                _record(args.out, "fault.json", fault=args.fault)
                batch = {"x": batch["x"][:0], "y": batch["y"][:0]}
            if odd and args.fault == "evaluate" and k == args.at:
                step.evaluate(state, batch)
            state, _ = step(state, batch)
        step.gather(state)
    except BaseException as e:
        error = e
    _record(args.out, f"rank{mesh.rank}.json", error=None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if not (odd and args.fault == "fewer"):  # a rank that ends early does not meet the others at a barrier
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _record(folder: str, name: str, **fields) -> None:
    with open(os.path.join(folder, name), "w") as f:
        json.dump({**fields, "time": time.time()}, f)


if __name__ == "__main__":
    sys.exit(main())
