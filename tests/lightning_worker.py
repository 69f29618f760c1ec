"""torchrun worker for tests/test_lightning.py: trains the LightningModules of tests/lightning_models.py under each
registered fzero strategy on 2 processes, and saves what the test compares.

    torchrun --standalone --nproc_per_node 2 tests/lightning_worker.py --out DIR

Writes DIR/results.pt (rank 0): the trained params of every (model, strategy name), fzero's own step on the same
per-rank batches, the accumulation + clipping run, and the resume runs.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_models import (
    MODELS,
    NAMES,
    LitCNN,
    LitGPT,
    SyncedGPT,
    cnn_batches,
    gpt_batches,
    rank_share,
)
from torch.utils.data import DataLoader

import fzero
import fzero.lightning


def loader(batches, rank):
    return DataLoader([rank_share(b, rank) for b in batches], batch_size=None)  # this rank's share, in order


def trainer(strategy, **kwargs):
    settings = {"accelerator": "cpu", "devices": 2, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "use_distributed_sampler": False, "num_sanity_val_steps": 0, "max_epochs": 1}
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def fzero_own(cls, batches, stages, rank, **compile_kwargs):
    """The same training with fzero.compile directly: the loss the module's forward_loss computes."""
    lit = cls()
    opt = fzero.optim.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.01)
    step = fzero.compile(lambda p, b: fzero.apply(lit.forward_loss, p, b), optimizer=opt, stages=stages,
                         mesh=fzero.dist_mesh(), **compile_kwargs)
    state = step.init(fzero.params_of(lit))
    for b in batches:
        state, _ = step(state, rank_share(b, rank))
    return step.gather(state)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    rank = int(os.environ["RANK"])
    results = {}

    # every registered name, both models, 3 steps; and fzero's own step on the same batches
    compile_of = {"fzero_stage_1": {"stages": 1}, "fzero_stage_2": {"stages": 2},
                  "fzero_stage_2_offload": {"stages": 2, "offload": "cpu"}, "fzero_stage_3": {"stages": 3},
                  "fzero_stage_3_offload": {"stages": 3, "offload": "cpu", "offload_params": True}}
    for model, (cls, make) in MODELS.items():
        batches = make(3)
        for name in NAMES:
            lit = cls()
            trainer(name).fit(lit, loader(batches, rank))
            results[model, name] = params(lit)
            results[model, name, "own"] = fzero_own(cls, batches, **compile_of[name], rank=rank)

    # accumulation (2 micro-batches a step), clipping, param groups and a per-step LambdaLR, at stage 2
    lit = LitGPT(groups=True, schedule=True)
    trainer("fzero_stage_2", accumulate_grad_batches=2, gradient_clip_val=0.05).fit(lit, loader(gpt_batches(2, micro=2), rank))
    results["accumulate_clip"] = params(lit)

    # resume: 4 steps straight, against 2 + a ModelCheckpoint's checkpoint + 2 more (stage 3, offload, a schedule)
    batches = cnn_batches(2)  # an epoch of 2 steps
    straight = LitCNN(schedule=True)
    trainer("fzero_stage_3_offload", max_epochs=2).fit(straight, loader(batches, rank))
    ckdir = os.path.join(out, "ckpt")
    first = LitCNN(schedule=True)
    saver = ModelCheckpoint(dirpath=ckdir, save_top_k=-1)
    trainer("fzero_stage_3_offload", max_epochs=1, enable_checkpointing=True, callbacks=[saver]).fit(first, loader(batches, rank))
    resumed = LitCNN(schedule=True)
    again = ModelCheckpoint(dirpath=ckdir, save_top_k=-1)  # Lightning asks for the callbacks that made the checkpoint
    trainer("fzero_stage_3_offload", max_epochs=2, enable_checkpointing=True, callbacks=[again]).fit(
        resumed, loader(batches, rank), ckpt_path=saver.best_model_path)
    results["resume"] = (params(straight), params(resumed), sorted(os.listdir(saver.best_model_path)))

    # self.log(sync_dist=True) inside training_step at stage 3: Lightning's all-reduce between fzero's gathers
    synced = SyncedGPT()
    run = trainer("fzero_stage_3")
    run.fit(synced, loader(gpt_batches(3), rank))
    losses = [None] * 2
    torch.distributed.all_gather_object(losses, float(run.callback_metrics["train_loss"]))  # each rank's last loss
    appended = [None] * 2
    torch.distributed.all_gather_object(appended, synced.own_losses)  # what each rank's training_step appended to self
    results["synced"] = (params(synced), float(run.callback_metrics["synced_loss"]), losses)
    results["appended"] = appended

    if rank == 0:
        torch.save(results, os.path.join(out, "results.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
