"""One rank of a torchrun job for tests/test_structure.py: which code calls torch.distributed's collectives.

Every collective entry point of ``torch.distributed`` is wrapped to record the first caller outside torch (its
file), while this rank runs fzero at stages 0-3 (init, steps, gather, evaluate), saves and loads a checkpoint and
writes safetensors weights. ``--plant`` adds one collective called from this file, so the test can show that a
caller outside the collectives module is found. Rank 0 writes ``{caller file: [entry points]}`` to ``--out``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/collectives_worker.py --out /tmp/c.json --dir /tmp/d
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

ENTRY_POINTS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "broadcast",
                "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier",
                "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv",
                "isend", "irecv", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single")
TORCH = os.path.dirname(torch.__file__)
_WRAPPER_CODE = None


def _caller() -> str:
    """The file of the first frame outside torch (DCP's own collectives are named after the file that called DCP,
    with a marker)."""
    frame, through_dcp = sys._getframe(2), False
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code is _WRAPPER_CODE):
        through_dcp |= "distributed/checkpoint" in frame.f_code.co_filename
        frame = frame.f_back
    where = "?" if frame is None else os.path.relpath(frame.f_code.co_filename, os.path.dirname(os.path.dirname(__file__)))
    return where + (" (through torch.distributed.checkpoint)" if through_dcp else "")


def _record(seen: dict) -> None:
    import torch.distributed.distributed_c10d as c10d

    for name in ENTRY_POINTS:
        for module in (dist, c10d):
            real = getattr(module, name, None)
            if real is None or getattr(real, "_recorded", False):
                continue

            def wrapper(*args, _real=real, _name=name, **kwargs):
                seen.setdefault(_caller(), set()).add(_name)
                return _real(*args, **kwargs)

            global _WRAPPER_CODE
            _WRAPPER_CODE = wrapper.__code__  # an entry point torch calls from inside another: the outer one's caller
            wrapper._recorded = True
            setattr(module, name, wrapper)


SEEN: dict[str, set] = {}  # caller -> entry points it called; recording starts before fzero binds any of them
_record(SEEN)

import fzero  # noqa: E402
from problems import PROBLEMS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", required=True, help="where rank 0's checkpoint and weights go (seen by every rank)")
    parser.add_argument("--plant", action="store_true", help="also call a collective from this file")
    args = parser.parse_args()
    mesh = fzero.dist_mesh()
    seen = SEEN
    prob = PROBLEMS["gpt"]()
    local = [{k: v.chunk(mesh.size)[mesh.rank] for k, v in b.items()} for b in prob.batches[:2]]
    for stages in (0, 1, 2, 3):
        step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=stages, mesh=mesh)
        state = step.init(fzero.params_of(prob.model))
        for b in local:
            state, _ = step(state, b)
        step.gather(state)
        step.evaluate(state, local[0])
        if stages == 3:
            fzero.checkpoint.save(os.path.join(args.dir, "ckpt"), state)
            fzero.checkpoint.load(os.path.join(args.dir, "ckpt"), like=step)
            fzero.checkpoint.save_weights(step, state, os.path.join(args.dir, "weights"))
    native = fzero.dist_mesh(collectives="native")  # torch's own all-gather and reduce-scatter, not the exchanges
    step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=native)
    state, _ = step(step.init(fzero.params_of(prob.model)), local[0])
    step.gather(state)
    if args.plant:
        dist.all_reduce(torch.zeros(1))
    if mesh.rank == 0:
        with open(args.out, "w") as f:
            json.dump({k: sorted(v) for k, v in seen.items()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
