"""A Lightning script written for DeepSpeed, run on fzero: only the strategy's name changes.

A tiny random-init Hugging Face GPT-2 learns bytes of the Python standard library's sources. The LightningModule is
plain PyTorch (``training_step`` returns the loss, ``configure_optimizers`` returns ``torch.optim.AdamW`` with a
warm-up ``LambdaLR``); ``Trainer(strategy="fzero_stage_3_offload")`` stands where
``strategy="deepspeed_stage_3_offload"`` stood. Two processes on the CPU, ZeRO-3 with the optimizer and the params
offloaded, bf16, two micro-batches per step, clipping at 1.0, a checkpoint at the end of each epoch:

    torchrun --standalone --nproc_per_node 2 examples/train_lightning.py --max-steps 40

Lightning can start the processes itself (it runs this script once more per extra device):

    python examples/train_lightning.py --devices 2 --max-steps 40

Resume from the last checkpoint (a directory: fzero's sharded state and Lightning's loops, callbacks and scheduler):

    torchrun --standalone --nproc_per_node 2 examples/train_lightning.py --max-steps 80 --resume

Any registered name works: ``--strategy fzero_stage_1`` ... ``fzero_stage_3_offload``. Rank 0 prints the training and
validation losses as Lightning logs them.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

import fzero.lightning  # noqa: F401 - registers "fzero_stage_1" ... "fzero_stage_3_offload" with Lightning
from fzero.data import batch_at, load_corpus, train_val_split


class LitLM(pl.LightningModule):
    """As the Lightning docs write a causal LM for DeepSpeed: nothing in it knows about fzero."""

    def __init__(self, lr: float = 3e-3, warmup: int = 10):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                                bos_token_id=0, eos_token_id=0))

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["x"], labels=batch["x"], use_cache=False).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["x"], labels=batch["x"], use_cache=False).loss
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]  # biases and norms, as HF's run_clm does
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.hparams.lr, betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.hparams.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def loaders(rank: int, world: int, batch_size: int, batches: int):
    """This rank's share of each global batch (the same global batches on any number of processes)."""
    train, val = train_val_split(load_corpus(max_bytes=1 << 20))

    def share(data, n, seed):
        return [{k: v.chunk(world)[rank] for k, v in batch_at(data, k, batch_size=batch_size * world, seq_len=64,
                                                              seed=seed).items()} for k in range(n)]

    return (DataLoader(share(train, batches, 0), batch_size=None),
            DataLoader(share(val, 2, 1), batch_size=None))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="fzero_stage_3_offload")
    ap.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--batches-per-epoch", type=int, default=20, help="micro-batches per epoch (a multiple of --accumulate)")
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank and micro-batch")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--out", default="lightning_out", help="checkpoints and the CSV log go here")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = ap.parse_args()

    torch.manual_seed(0)
    module = LitLM()
    saver = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=True)
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", devices=args.devices, precision=args.precision,
                         accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0, max_steps=args.max_steps,
                         callbacks=[saver], logger=CSVLogger(args.out), log_every_n_steps=1,
                         use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False)
    train, val = loaders(trainer.global_rank, trainer.world_size, args.batch_size, args.batches_per_epoch)
    trainer.fit(module, train, val, ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"{args.strategy}: {trainer.global_step} optimizer steps, {metrics}; checkpoint {saver.last_model_path}")


if __name__ == "__main__":
    main()
