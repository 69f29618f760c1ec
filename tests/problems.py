"""Small training problems shared by the parity, memory, communication and torchrun tests.

Each problem is a model, a pure ``loss_fn(params, batch)`` and a deterministic list of global batches.
Models have no parameter whose gradient is zero in exact arithmetic (no attention key bias; DESIGN.md
§4), so Adam parity holds on every parameter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

import fzero
from fzero.data import batch_at, load_corpus
from fzero.models import GPT, MLP, GPTConfig, gpt_loss

GLOBAL_BATCH = 8  # divides by 1, 2 and 4 ranks
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01


@dataclasses.dataclass(frozen=True)
class Problem:
    model: torch.nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batches: list[dict[str, torch.Tensor]]


def mlp_problem(*, steps: int = 5, sizes=(16, 32, 32, 4), batch: int = GLOBAL_BATCH) -> Problem:
    torch.manual_seed(0)
    model = MLP(list(sizes))
    gen = torch.Generator().manual_seed(1)
    batches = [
        {"x": torch.randn(batch, sizes[0], generator=gen), "y": torch.randn(batch, sizes[-1], generator=gen)} for _ in range(steps)
    ]

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(fzero.apply(model, params, b["x"]), b["y"])

    return Problem(model, loss_fn, batches)


_CORPUS: list[torch.Tensor] = []


def gpt_problem(*, steps: int = 5, batch: int = GLOBAL_BATCH) -> Problem:
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    if not _CORPUS:
        _CORPUS.append(load_corpus(max_bytes=1 << 20))
    batches = [batch_at(_CORPUS[0], k, batch_size=batch, seq_len=cfg.seq_len, seed=0) for k in range(steps)]

    def loss_fn(params, b):
        return gpt_loss(fzero.apply(model, params, b["x"]), b["y"])

    return Problem(model, loss_fn, batches)


PROBLEMS = {"mlp": mlp_problem, "gpt": gpt_problem}


def reference_run(problem: Problem, *, fused: bool) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Unsharded reference: plain torch.optim.AdamW on the full batch. Params after each step, and losses."""
    params = {k: v.clone().requires_grad_() for k, v in fzero.params_of(problem.model).items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=fused)
    history, losses = [], []
    for b in problem.batches:
        opt.zero_grad(set_to_none=True)
        loss = problem.loss_fn(params, b)
        loss.backward()
        opt.step()
        history.append({k: v.detach().clone() for k, v in params.items()})
        losses.append(loss.item())
    return history, losses


def fzero_run(problem: Problem, *, stages: int, mesh, unit_elements: int = 2048):
    """fzero with the same hyper-parameters. Params after each step, and the metrics of each step."""
    opt = fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    step = fzero.compile(problem.loss_fn, optimizer=opt, stages=stages, mesh=mesh, unit_elements=unit_elements)
    state = step.init(fzero.params_of(problem.model))
    history, metrics = [], []
    for b in problem.batches:
        state, m = step(state, b)
        history.append(step.gather(state))
        metrics.append(m)
    return history, metrics
