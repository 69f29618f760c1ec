"""Small training problems shared by the parity, memory, communication and torchrun tests.

Each problem is a model, a pure ``loss_fn(params, batch)`` and a deterministic list of global batches.
Models have no parameter whose gradient is zero in exact arithmetic (no attention key bias,
whose gradient is rounding noise), so Adam parity holds on every parameter.
"""

from __future__ import annotations

import contextlib
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


def save_and_finish(mesh, obj: Any, path: str) -> None:
    """The end of a torchrun worker: rank 0 saves ``obj`` to ``path``, then every rank tears down together (a rank
    that destroys its gloo group while another is still in, or just past, the last collective can abort in C++)."""
    if mesh.rank == 0:
        torch.save(obj, path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def mlp_problem(*, steps: int = 5, sizes=(16, 32, 32, 4), batch: int = GLOBAL_BATCH) -> Problem:
    torch.manual_seed(0)
    model = MLP(list(sizes))
    gen = torch.Generator().manual_seed(1)
    batches = [
        {"x": torch.randn(batch, sizes[0], generator=gen), "y": torch.randn(batch, sizes[-1], generator=gen)} for _ in range(steps)
    ]

    def loss_fn(params, b):
        # .float(): under bf16/fp16 the prediction is low precision and the target fp32; torch before 2.13 has
        # no backward for mse_loss of mixed dtypes (pytorch/pytorch#36553). The same arithmetic as 2.13's promotion.
        return torch.nn.functional.mse_loss(fzero.apply(model, params, b["x"]).float(), b["y"])

    return Problem(model, loss_fn, batches)


_CORPUS: list[torch.Tensor] = []


def gpt_problem(*, steps: int = 5, batch: int = GLOBAL_BATCH, cfg: GPTConfig | None = None) -> Problem:
    """The repo's GPT (``GPTConfig.tiny()`` unless ``cfg`` says otherwise) on bytes of the stdlib's sources."""
    torch.manual_seed(0)
    cfg = cfg or GPTConfig.tiny()
    model = GPT(cfg)
    if not _CORPUS:
        _CORPUS.append(load_corpus(max_bytes=1 << 20))
    batches = [batch_at(_CORPUS[0], k, batch_size=batch, seq_len=cfg.seq_len, seed=0) for k in range(steps)]

    def loss_fn(params, b):
        return gpt_loss(fzero.apply(model, params, b["x"]), b["y"])

    return Problem(model, loss_fn, batches)


class _Block(torch.nn.Module):
    """A unit that takes keyword inputs, has a buffer and a frozen layer, and returns a dict with a tuple."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.frozen = torch.nn.Linear(d, d, bias=False).requires_grad_(False)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, d))

    def forward(self, x, *, scale=1.0, mask=None):
        h = torch.tanh(self.lin(x) + self.shift) * scale + 0.1 * self.frozen(x)
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"out": x + h, "extra": (h.mean(), mask)}


class _Encoder(torch.nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Block(d) for _ in range(n)])  # units nested inside another module


class AnyModel(torch.nn.Module):
    """Exercises what stage 3 must support on a module written by others: a tied embedding/head, buffers,
    frozen parameters (in units and in the root), keyword inputs, dict/tuple outputs, nested units, and
    one unit called twice in a forward."""

    def __init__(self, vocab: int = 32, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.enc = _Encoder(d, n)
        self.shared = torch.nn.ModuleList([_Block(d)])
        self.norm = torch.nn.LayerNorm(d)
        self.norm.bias.requires_grad_(False)  # a frozen parameter in the root unit
        self.register_buffer("pos", torch.randn(8, d) * 0.1)

    def forward(self, idx, *, mask=None):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for layer in self.enc.layers:
            x = layer(x, scale=0.5, mask=mask)["out"]
        y = self.shared[0](x)["out"]
        y = self.shared[0](y, scale=2.0)["out"]  # the same unit, twice
        logits = self.norm(y) @ self.emb.weight.T  # head tied to the embedding
        return {"logits": logits, "hidden": (x, y)}


def any_problem(*, steps: int = 5, batch: int = GLOBAL_BATCH) -> Problem:
    torch.manual_seed(0)
    model = AnyModel()
    gen = torch.Generator().manual_seed(2)
    batches = [
        {"idx": torch.randint(0, 32, (batch, 8), generator=gen), "y": torch.randint(0, 32, (batch, 8), generator=gen),
         "mask": torch.rand(batch, 8, generator=gen) > 0.2}
        for _ in range(steps)
    ]

    def loss_fn(params, b):
        out = fzero.apply(model, params, b["idx"], mask=b["mask"].float())
        ce = torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), b["y"].flatten())
        return ce + 0.01 * out["hidden"][1].pow(2).mean()

    return Problem(model, loss_fn, batches)


def dropout_problem(*, steps: int = 5, batch: int = GLOBAL_BATCH) -> Problem:
    """``mlp_problem`` with dropout on its output: each rank draws from its own torch stream every step."""
    prob = mlp_problem(steps=steps, batch=batch)

    def loss_fn(params, b):
        out = torch.nn.functional.dropout(fzero.apply(prob.model, params, b["x"]), 0.5, training=True)
        return torch.nn.functional.mse_loss(out, b["y"])

    return Problem(prob.model, loss_fn, prob.batches)


class _RunningShift(torch.nn.Module):
    """A block with a non-persistent buffer the forward writes in place from its batch (a running mean kept out of
    the ``state_dict``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("avg", torch.zeros(d), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.avg.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return torch.tanh(self.fc(x - self.avg))


class RankBufferNet(torch.nn.Module):
    """Non-persistent buffers that differ by rank: ``noise``, filled from the process's RNG at init (seeded by
    ``rank``), and each block's ``avg``, written by the forward from the rank's share of the batch."""

    def __init__(self, d: int = 8, n: int = 2, *, rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([_RunningShift(d) for _ in range(n)])
        self.out = torch.nn.Linear(d, 2)
        self.register_buffer("noise", torch.randn(d, generator=torch.Generator().manual_seed(100 + rank)), persistent=False)

    def forward(self, x):
        x = x + self.noise
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def rank_buffer_problem(*, steps: int = 3, batch: int = GLOBAL_BATCH, rank: int = 0) -> Problem:
    """``RankBufferNet`` as rank ``rank`` builds it. DDP starts every replica from rank 0's buffers, non-persistent
    ones included, so each rank must train as if it had built rank 0's."""
    model = RankBufferNet(rank=rank)
    gen = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(batch, 8, generator=gen) + 1, "y": torch.randn(batch, 2, generator=gen)} for _ in range(steps)]

    def loss_fn(params, b):
        return torch.nn.functional.mse_loss(fzero.apply(model, params, b["x"]), b["y"])

    return Problem(model, loss_fn, batches)


PROBLEMS = {"dropout": dropout_problem, "mlp": mlp_problem, "gpt": gpt_problem, "any": any_problem,
            "rank_buffers": rank_buffer_problem}


class SkippyBlocks(torch.nn.Module):
    """Blocks of which a forward runs the first ``depth`` (a keyword that is not a tensor): the order of the stage-3
    gathers changes from one step to the next, which prefetch must notice."""

    def __init__(self, width: int, n: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(n)])

    def forward(self, x, *, depth):
        for block in self.blocks[:depth]:
            x = torch.tanh(block(x))
        return x


def check_every_step(got, metrics, expected, ref_losses, *, ranks: int) -> None:
    """fzero's params and losses against the reference's, step by step: bitwise on one rank (the same kernels on the
    same numbers), at fp32 tolerance on several (a full-batch mean becomes a mean of per-rank means)."""
    from fzero.testing import assert_trees_close, assert_trees_equal

    assert len(got) == len(expected)
    for k, (g, e) in enumerate(zip(got, expected)):
        if ranks == 1:
            assert_trees_equal(g, e)
        else:
            assert_trees_close(g, e, rtol=1e-5, atol=1e-6)
        assert abs(metrics[k]["loss"] - ref_losses[k]) <= 1e-5 * abs(ref_losses[k])


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


def gathered_per_rank(ranks: int = 2) -> tuple[Any, dict[int, Any]]:
    """A ``local_mesh(ranks)`` whose rank r counts its gathered stage-3 buffers (``fzero.memory.GatheredBytes``) in the
    returned dict's entry r."""
    from fzero.memory import GatheredBytes

    peaks: dict[int, Any] = {}

    @contextlib.contextmanager
    def per_rank(rank):
        with GatheredBytes() as g:
            peaks[rank] = g
            yield

    return dataclasses.replace(fzero.local_mesh(ranks), rank_context=per_rank), peaks


def fzero_run(problem: Problem, *, stages: int, mesh, unit_elements: int = 2048, meta_params: bool = False,
              shard_frozen: bool = False, **settings):
    """fzero with the same hyper-parameters. Params after each step, and the metrics of each step.

    ``meta_params``: pass shapes only (meta tensors) to ``init``, as ranks other than 0 may under dist_mesh.
    ``shard_frozen``: freeze the model's matrices first and shard them (stage 3, ``init(..., frozen=...)``), the
    module's own copies emptied (``fzero.free_frozen``)."""
    opt = fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    step = fzero.compile(problem.loss_fn, optimizer=opt, stages=stages, mesh=mesh,
                         **({"unit_elements": unit_elements} if stages < 2 else {}), **settings)
    if shard_frozen:
        for p in problem.model.parameters():
            p.requires_grad_(p.dim() < 2)
    params = fzero.params_of(problem.model)
    state = step.init({k: v.to("meta") for k, v in params.items()} if meta_params else params,
                      frozen=fzero.frozen_of(problem.model) if shard_frozen else None)
    if shard_frozen:
        fzero.free_frozen(problem.model, state)
    history, metrics = [], []
    for b in problem.batches:
        state, m = step(state, b)
        history.append(step.gather(state))
        metrics.append(m)
    return history, metrics
