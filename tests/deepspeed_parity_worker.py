"""One rank of a torchrun job for tests/test_deepspeed_parity.py: one DeepSpeed config file, run by DeepSpeed's own
engine and by ``fzero.compile(config=...)``, on tiny Hugging Face models with their default configs.

    DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/deepspeed_parity_worker.py --out /tmp/parity.pt

For every case in ``CASES`` each rank trains ``STEPS`` optimizer steps on its own rows of the same global batches,
first with ``deepspeed.initialize(model, model_parameters, config)`` (``engine(...)``, ``engine.backward``,
``engine.step`` per micro-batch, as a DeepSpeed script does), then with fzero from the same config on ``dist_mesh``.
Both start from the same weights and the same seed on each rank (so dropout draws alike). Rank 0 saves, per step,
both sides' fp32 params (DeepSpeed's masters, ``safe_get_full_fp32_param``; fzero's ``step.gather``), losses
(averaged over micro-batches and ranks), the lr each update used and the gradient norm before clipping.

DeepSpeed's shared-memory allreduce for CPU ranks is a C++ op that DeepSpeed compiles on first use (a minute on two
cores, and a compiler on the machine); it is marked unavailable here, so DeepSpeed's collectives go through
torch.distributed's gloo, as fzero's do. Nothing else of DeepSpeed is changed.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from problems import save_and_finish  # noqa: E402

STEPS = 4
SEQ, VOCAB = 8, 64
NO_DECAY = ("bias", "norm", "ln_")  # the HF scripts' no-decay names for these two models

_BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                                                      "total_num_steps": 8}},
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True},
    "steps_per_print": 10**9,
}


def _case(model: str, *, groups: bool = False, **changes) -> dict:
    config = copy.deepcopy(_BASE)
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    return {"model": model, "groups": groups, "config": config}


# name -> what differs from _BASE (Llama: no dropout in its default config; GPT-2: dropout 0.1 and tied head)
CASES = {
    "llama_stage3_bf16": _case("llama"),
    "gpt2_stage1_adam_l2_groups": _case(
        "gpt2", groups=True, zero_optimization={"stage": 1}, bf16=None, gradient_accumulation_steps=1, gradient_clipping=None,
        optimizer={"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01, "adam_w_mode": False, "torch_adam": True}},
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                                                  "warmup_type": "linear"}}),
    "cnn_stage3_buffers": _case(
        "cnn", bf16=None, gradient_clipping=0.5,
        scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2}}),
    "gpt2_stage2_bf16_clipped": _case(
        "gpt2", zero_optimization={"stage": 2}, gradient_clipping=0.05,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2}}),
}


def _cnn() -> torch.nn.Module:
    """Convolutions without biases before BatchNorms (whose statistics the steps write), and a linear head."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def build(kind: str, config: dict) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "cnn":
        model = _cnn()
    elif kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    if config.get("bf16", {}).get("enabled"):
        # DeepSpeed's bf16 engine casts the module and makes its fp32 masters from the casts; fzero makes them from the
        # values given (docs/migrating.md, "What maps"). Weights that bf16 holds exactly start both from the same masters.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    return model.train()


def batches(kind: str, config: dict, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """This rank's rows of each step's global batch: micro-batch m is rows [m * micro, (m + 1) * micro)."""
    micro, accum = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        if kind == "cnn":
            out.append({"x": torch.randn(world, accum * micro, 3, 6, 6, generator=gen)[rank],
                        "y": torch.randint(0, 5, (world, accum * micro), generator=gen)[rank]})
        else:
            out.append({"ids": torch.randint(0, VOCAB, (world, accum * micro, SEQ), generator=gen)[rank]})
    return out


def loss_of(kind: str, run, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss a script computes with ``run`` (the engine, or ``fzero.apply`` of the model) on ``batch``."""
    if kind == "cnn":
        return torch.nn.functional.cross_entropy(run(batch["x"]), batch["y"])
    return run(input_ids=batch["ids"], labels=batch["ids"]).loss


def _rows(batch: dict[str, torch.Tensor], a: int, b: int) -> dict[str, torch.Tensor]:
    return {k: v[a:b] for k, v in batch.items()}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not any(s in n for s in NO_DECAY)], "weight_decay": weight_decay},
            {"params": [p for n, p in named if any(s in n for s in NO_DECAY)], "weight_decay": 0.0}]


def run_deepspeed(case: dict, rows: list[dict[str, torch.Tensor]], seed: int) -> dict:
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import safe_get_full_fp32_param

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    config = case["config"]
    model = build(case["model"], config)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    wd = config["optimizer"]["params"].get("weight_decay", 0.0)
    params = param_groups(model, wd) if case["groups"] else model.parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config, dist_init_required=False)
    micro, accum = config["train_micro_batch_size_per_gpu"], config.get("gradient_accumulation_steps", 1)
    out: dict = {"params": [], "loss": [], "lr": [], "grad_norm": []}
    torch.manual_seed(seed)
    for x in rows:
        out["lr"].append(engine.get_lr()[0])  # what this step's update uses (the scheduler steps after it)
        total = torch.zeros(())
        for m in range(accum):
            loss = loss_of(case["model"], engine, _rows(x, m * micro, (m + 1) * micro))
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        out["loss"].append(float(total) / (accum * dist.get_world_size()))
        out["grad_norm"].append(float(engine.get_global_grad_norm()))
        out["params"].append({n: safe_get_full_fp32_param(p).detach().clone() if safe_get_full_fp32_param(p) is not None
                              else p.detach().float().clone() for n, p in zip(names, engine.module.parameters())})
    buffers = dict(engine.module.named_buffers())
    out["buffers"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items() if k in buffers}
    return out


def run_fzero(case: dict, rows: list[dict[str, torch.Tensor]], seed: int) -> dict:
    import fzero

    model = build(case["model"], case["config"])

    def loss_fn(params, batch):
        return loss_of(case["model"], lambda *a, **k: fzero.apply(model, params, *a, **k), batch)

    settings = fzero.config.from_deepspeed(case["config"], world_size=dist.get_world_size(),
                                           **({"no_decay": list(NO_DECAY)} if case["groups"] else {}))
    step = fzero.compile(loss_fn, config=settings, mesh=fzero.dist_mesh())
    state = step.init(fzero.params_of(model))
    out: dict = {"params": [], "loss": [], "lr": [], "grad_norm": []}
    torch.manual_seed(seed)
    for x in rows:
        state, metrics = step(state, x)
        out["params"].append(step.gather(state))
        for key in ("loss", "lr", "grad_norm"):
            out[key].append(float(metrics[key]))
    buffers = dict(model.named_buffers())
    out["buffers"] = {k: v for k, v in step.state_dict(state, model).items() if k in buffers}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    import fzero

    mesh = fzero.dist_mesh()
    results = {}
    for name in args.cases.split(","):
        case = CASES[name]
        rows = batches(case["model"], case["config"], mesh.rank, mesh.size)
        seed = 100 + mesh.rank
        results[name] = {"deepspeed": run_deepspeed(case, rows, seed), "fzero": run_fzero(case, rows, seed)}
    save_and_finish(mesh, results, args.out)


if __name__ == "__main__":
    main()
