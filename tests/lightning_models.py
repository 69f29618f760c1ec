"""LightningModules written for plain PyTorch (a tiny Hugging Face GPT-2 and a small CNN), their data, and the
reference they must equal: torch.optim on the gradient averaged over ranks, as DDP computes it. Shared by
tests/test_lightning.py and tests/lightning_worker.py (its torchrun worker)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2  # rows per rank and micro-batch
RANKS = 2


class LitGPT(pl.LightningModule):
    """A tiny random-init GPT-2 (no dropout: the comparisons are of params) trained on its own next tokens."""

    def __init__(self, lr: float = 1e-2, groups: bool = False, schedule: bool = False):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                                eos_token_id=0))
        self.lr, self.groups, self.schedule = lr, groups, schedule

    def forward(self, x):
        return self.model(input_ids=x, labels=x, use_cache=False).loss

    def training_step(self, batch, batch_idx):
        loss = self(batch["x"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch["x"]), sync_dist=True)

    def configure_optimizers(self):
        return configure(self, self.lr, self.groups, self.schedule)


class SyncedGPT(LitGPT):
    """LitGPT that also logs its loss with ``sync_dist=True`` from inside ``training_step``: an all-reduce of Lightning's
    own in the middle of the step's forward (at stage 3, between the units' gathers)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own_losses: list = []  # each process keeps what its training_step appended (Lightning 2.x's pattern)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("synced_loss", loss, sync_dist=True)
        self.own_losses.append(float(loss.detach()))
        return loss


class LitCNN(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, schedule: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 8, 3), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
        self.lr, self.schedule = lr, schedule

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return configure(self, self.lr, False, self.schedule)


def configure(module, lr, groups, schedule):
    """AdamW as a plain PyTorch user writes it: with ``groups``, biases and norms undecayed and the embeddings at a
    tenth of the lr; with ``schedule``, a per-step LambdaLR warm-up."""
    if groups:
        named = list(module.named_parameters())
        emb = [p for n, p in named if ".wte." in n or ".wpe." in n]
        flat = [p for n, p in named if p.dim() < 2 and not any(p is q for q in emb)]
        rest = [p for n, p in named if p.dim() >= 2 and not any(p is q for q in emb)]
        params = [{"params": rest, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0},
                  {"params": emb, "lr": lr / 10, "weight_decay": 0.0}]
    else:
        params = module.parameters()
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    if not schedule:
        return opt
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def gpt_batches(steps: int, micro: int = 1) -> list[dict]:
    """Global batches: step t, micro-batch m of rank r is rows [r*BATCH:(r+1)*BATCH] of entry t*micro+m."""
    gen = torch.Generator().manual_seed(1)
    return [{"x": torch.randint(0, 64, (RANKS * BATCH, 16), generator=gen)} for _ in range(steps * micro)]


def cnn_batches(steps: int, micro: int = 1) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    return [{"x": torch.randn(RANKS * BATCH, 1, 8, 8, generator=gen), "y": torch.randint(0, 10, (RANKS * BATCH,), generator=gen)}
            for _ in range(steps * micro)]


def rank_share(batch: dict, rank: int) -> dict:
    return {k: v[rank * BATCH:(rank + 1) * BATCH] for k, v in batch.items()}


def reference(module: pl.LightningModule, batches: list[dict], *, micro: int = 1, clip: float | None = None):
    """Plain PyTorch with DDP's semantics: each rank's loss over ``micro`` micro-batches divided by ``micro`` (as
    Lightning's accumulation does), the gradient averaged over the ranks, clipped by its global norm, torch's step, the
    lr scheduler stepped after it. Returns the final params and each param's largest gradient seen, elementwise."""
    out = module.configure_optimizers()
    opt, sched = (out["optimizer"], out["lr_scheduler"]["scheduler"]) if isinstance(out, dict) else (out, None)
    biggest = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    for t in range(len(batches) // micro):
        opt.zero_grad()
        for m in range(micro):
            for r in range(RANKS):
                (module.forward_loss(rank_share(batches[t * micro + m], r)) / (micro * RANKS)).backward()
        for n, p in module.named_parameters():
            biggest[n] = torch.maximum(biggest[n], p.grad.abs())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}, biggest


LitGPT.forward_loss = lambda self, b: self(b["x"])
LitCNN.forward_loss = lambda self, b: F.cross_entropy(self(b["x"]), b["y"])

MODELS = {"gpt2": (LitGPT, gpt_batches), "cnn": (LitCNN, cnn_batches)}
NAMES = ("fzero_stage_1", "fzero_stage_2", "fzero_stage_2_offload", "fzero_stage_3", "fzero_stage_3_offload")
