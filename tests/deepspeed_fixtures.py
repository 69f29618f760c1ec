"""Writes the DeepSpeed checkpoints that tests/test_deepspeed_checkpoint.py resumes from (needs DeepSpeed; run by hand).

Each case trains a small torch.nn model (not fzero's) with DeepSpeed's engine on its CPU accelerator over gloo, a
client ``torch.optim.AdamW``, for three steps; saves it with ``engine.save_checkpoint``; records DeepSpeed's own
view of every trained parameter (``deepspeed.utils.safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``
for ``exp_avg``, ``exp_avg_sq`` and ``step``) and its buffers; then trains two more steps and records the fp32
params after each, for the resumed run to follow. Rank 0 writes ``tests/data/deepspeed/<case>/`` (the checkpoint,
``expected.pt``) ::

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/deepspeed_fixtures.py --stage 3 --world 2 [--bf16] [--groups]

Cases written (DeepSpeed 0.19.8, torch 2.13 CPU): stages 1, 2 and 3 on 1 and 2 ranks in fp32; stages 1 and 3 on 2
ranks in bf16; stage 2 on 2 ranks with two parameter groups (decay and no decay); stage 3 on 2 ranks with a frozen
parameter (``--frozen``: ``0.weight``, given other values than the model's init before it is frozen, as a layer trained
and then frozen is); stage 2 on 1 rank in fp16 (``--fp16``) whose dynamic loss scale has overflowed (initial scale
2**FP16_SCALE_POWER: the first step lowers the hysteresis, the second halves the scale), with its scaler's state
after each step.
"""

import argparse
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.99), 1e-8, 0.01
FP16_SCALE_POWER, FP16_WINDOW = 18, 3  # the fp16 case's loss scale: initial 2**19, DeepSpeed's loss_scale_window
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "deepspeed")


def model(bf16: bool = False, frozen: bool = False) -> nn.Module:
    """Odd sizes, so that 2 ranks pad; a BatchNorm, so that there are buffers (a LayerNorm under bf16 and fp16, where
    DeepSpeed's engine casts the module but the BatchNorm's statistics stay fp32 and its forward fails). ``frozen``:
    ``0.weight`` does not train."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 12), nn.LayerNorm(12) if bf16 else nn.BatchNorm1d(12), nn.GELU(), nn.Linear(12, 5))
    m[0].weight.requires_grad_(not frozen)
    return m


def batches(world: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five global batches of 8 rows; this rank's share of each."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(5):
        x, y = torch.randn(8, 7, generator=g), torch.randn(8, 5, generator=g)
        out.append((x.chunk(world)[rank], y.chunk(world)[rank]))
    return out


def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((m(x).float() - y) ** 2).mean()


def case_name(stage: int, world: int, bf16: bool, groups: bool, frozen: bool = False, fp16: bool = False) -> str:
    return (f"stage{stage}_world{world}" + ("_bf16" if bf16 else "") + ("_fp16" if fp16 else "") + ("_groups" if groups else "")
            + ("_frozen" if frozen else ""))


def main() -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--groups", action="store_true", help="two param groups: no decay for biases and the norm")
    p.add_argument("--frozen", action="store_true", help="0.weight frozen, with other values than the model's init")
    p.add_argument("--fp16", action="store_true", help="fp16, a dynamic loss scale that overflows in the first steps")
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == args.world
    half = args.bf16 or args.fp16
    m = model(half, args.frozen)
    if args.frozen:
        with torch.no_grad():
            m[0].weight.mul_(-2.0)  # what a fresh model(frozen=True) does not hold: resumed, it must come from the checkpoint
    frozen = {n: p.detach().clone().float() for n, p in m.named_parameters() if not p.requires_grad}  # stage 3 partitions them
    if args.groups:
        no_decay = [p for n, p in m.named_parameters() if n.endswith("bias") or n.startswith("1.")]
        decay = [p for n, p in m.named_parameters() if not (n.endswith("bias") or n.startswith("1."))]
        params = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    else:
        params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    config = {"train_micro_batch_size_per_gpu": 8 // world, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": FP16_SCALE_POWER, "loss_scale_window": FP16_WINDOW,
                          "hysteresis": 2, "min_loss_scale": 1}
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=config, dist_init_required=False)
    data = batches(world, rank)

    def train(x, y):
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        loss = loss_fn(engine, x.to(dtype), y)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    def scaler():
        """DeepSpeed's dynamic loss scaler, as its checkpoint holds it (fp16 only)."""
        s = engine.optimizer.loss_scaler
        return {k: getattr(s, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")} if args.fp16 else None

    losses = [train(*b) for b in data[:3]]
    name = case_name(args.stage, world, args.bf16, args.groups, args.frozen, args.fp16)
    out = os.path.join(HERE, name)
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
    dist.barrier()
    engine.save_checkpoint(out)

    def full(kind: str) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's own full view of every parameter's ``kind``; None where its API cannot give it: with two
        parameter groups at stage 2, a rank that holds no element of a parameter raises "exp_avg not found in optimizer
        state fragment" while the other waits in the collective. There the resumed run's next steps, compared with
        DeepSpeed's, check the moments."""
        if kind != "fp32" and args.groups:
            return None
        return {n: (safe_get_full_fp32_param(p) if kind == "fp32" else safe_get_full_optimizer_state(p, kind)).detach().clone().float()
                for n, p in engine.module.named_parameters() if p.requires_grad}

    expected = {"fp32": full("fp32"), "exp_avg": full("exp_avg"), "exp_avg_sq": full("exp_avg_sq"),
                "buffers": {n: b.detach().clone() for n, b in engine.module.named_buffers()},
                "global_steps": engine.global_steps, "losses": losses, "after": [], "after_losses": [],
                "frozen": frozen,
                "scaler": scaler(), "after_scalers": []}
    step_state = next(iter(engine.optimizer.optimizer.state.values()))["step"]
    expected["step"] = int(step_state)
    for b in data[3:]:
        expected["after_losses"].append(train(*b))
        expected["after"].append(full("fp32"))
        expected["after_scalers"].append(scaler())
    if rank == 0:
        torch.save(expected, os.path.join(out, "expected.pt"))
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's own tools, copied in by save_checkpoint
            if os.path.exists(os.path.join(out, script)):
                os.remove(os.path.join(out, script))
    dist.barrier()


if __name__ == "__main__":
    main()
