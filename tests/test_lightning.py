"""fzero.lightning: a LightningModule written for plain PyTorch trains under Trainer(strategy="fzero_stage_*") as
under DDP (torch.optim.AdamW on the gradient averaged over ranks) and as under fzero's own step; Lightning's
accumulation, clipping, scheduler, logging and checkpoints carry over; what cannot map is refused by name.

The 2-process checks share one torchrun launch (tests/lightning_worker.py, about 15 s); the others run Lightning in
this process on one device."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

pl = pytest.importorskip("lightning.pytorch", reason="lightning is a test dependency: pip install -e '.[test]'")

from launch import torchrun
from lightning_models import (
    MODELS,
    NAMES,
    LitCNN,
    LitGPT,
    cnn_batches,
    gpt_batches,
    reference,
)

import fzero
import fzero.lightning

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Lightning 2.6's own code on torch 2.13: its _pytree helper calls a torch API that torch now deprecates; and a
# DataLoader without workers is what these tiny in-memory loaders want.
LIGHTNING_NOISE = [
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '(train|val|test|predict)_dataloader' does not have many workers"),
]
# on a machine with a GPU, the CPU tests' accelerator="cpu" makes Lightning say the GPU goes unused
pytestmark = pytest.mark.filterwarnings("ignore:GPU available but not used")


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    torchrun([os.path.join(HERE, "lightning_worker.py"), "--out", str(out)], timeout=300)
    return torch.load(out / "results.pt", weights_only=False)


def _close(got, want, compared=None, rtol=1e-4, atol=1e-5):
    """``got`` equals ``want`` within fp32 tolerance, on the elements ``compared`` marks (all of them by default)."""
    for n in want:
        keep = compared[n] if compared is not None else torch.ones_like(want[n], dtype=torch.bool)
        torch.testing.assert_close(got[n][keep], want[n][keep], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


def _with_gradient(biggest):
    # GPT-2's attention key bias (the middle third of c_attn.bias) adds one number to all the scores of a query,
    # which softmax cancels: its gradient is rounding noise (below 1e-6), and Adam divides noise by noise, so those
    # elements are not comparable. Every other element is.
    return {n: g >= 1e-6 for n, g in biggest.items()}


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_every_registered_name_trains_as_ddp_and_as_fzeros_own_step(dist_results, model):
    cls, make = MODELS[model]
    want, biggest = reference(cls(), make(3))
    compared = _with_gradient(biggest)
    left_out = sum(int((~keep).sum()) for keep in compared.values())
    assert left_out < 0.02 * sum(keep.numel() for keep in compared.values())  # a few: key biases, dead ReLU inputs
    init = {n: p.detach() for n, p in cls().named_parameters()}
    for name in NAMES:
        got = dist_results[model, name]
        assert any(not torch.equal(got[n], init[n]) for n in got), f"{name} did not train"
        _close(got, want, compared)
        _close(got, dist_results[model, name, "own"], rtol=1e-5, atol=1e-6)


@pytest.mark.torchrun
@pytest.mark.slow
def test_accumulate_grad_batches_gradient_clip_val_param_groups_and_scheduler_match_plain_pytorch(dist_results):
    lit = LitGPT(groups=True, schedule=True)
    want, biggest = reference(lit, gpt_batches(2, micro=2), micro=2, clip=0.05)
    # the clip is active: the unclipped run ends elsewhere
    unclipped, _ = reference(LitGPT(groups=True, schedule=True), gpt_batches(2, micro=2), micro=2)
    assert max(float((unclipped[n] - want[n]).abs().max()) for n in want) > 1e-3
    _close(dist_results["accumulate_clip"], want, _with_gradient(biggest))


@pytest.mark.torchrun
@pytest.mark.slow
def test_self_log_with_sync_dist_inside_training_step_at_stage_3(dist_results):
    """Lightning's own all-reduce in the middle of a stage-3 step (between the units' gathers, prefetch on): the
    training is unchanged (bitwise the run without it) and the logged value is the mean of the ranks' losses."""
    got, synced, losses = dist_results["synced"]
    want = dist_results["gpt2", "fzero_stage_3"]
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert losses[0] != losses[1] and synced == pytest.approx(sum(losses) / 2, rel=1e-6)
    # each process keeps what its own training_step appended to self: its own losses, the last one the one it logged
    appended = dist_results["appended"]
    assert [len(a) for a in appended] == [3, 3] and [a[-1] for a in appended] == pytest.approx(losses, rel=1e-6)


@pytest.mark.torchrun
@pytest.mark.slow
def test_resuming_from_a_model_checkpoint_continues_bitwise(dist_results):
    straight, resumed, files = dist_results["resume"]
    assert files == ["fzero", "lightning.ckpt"]  # fzero's sharded state beside Lightning's own file
    for n in straight:
        assert torch.equal(straight[n], resumed[n]), n
    assert any(not torch.equal(straight[n], p.detach()) for n, p in LitCNN().named_parameters())


# -- one process, in this one ----------------------------------------------------------------------------------------
@pytest.fixture
def one_process():
    """Lightning sets torchrun's variables in os.environ and starts a 1-process gloo group: both undone after."""
    saved = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _trainer(strategy="fzero_stage_2", **kwargs):
    settings = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "use_distributed_sampler": False, "num_sanity_val_steps": 0, "max_epochs": 1,
                    "log_every_n_steps": 1}
    return pl.Trainer(strategy=strategy, **{**settings, **kwargs})


def _loader(batches):
    from torch.utils.data import DataLoader

    return DataLoader(batches, batch_size=None)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_logged_metrics_arrive_in_callback_metrics_and_a_csv_logger(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    batches = gpt_batches(4)
    trainer = _trainer("fzero_stage_3", logger=CSVLogger(tmp_path), num_sanity_val_steps=1)
    lit = LitGPT()
    trainer.fit(lit, _loader(batches), _loader(batches[:2]))
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "fzero/grad_norm"} <= set(metrics)
    assert not metrics["train_loss"].requires_grad and torch.isfinite(metrics["val_loss"])
    # the validation loss is the trained module's on the validation batches (the params loaded at fit's end)
    with torch.no_grad():
        want = sum(float(lit(b["x"])) for b in batches[:2]) / 2
    assert float(metrics["val_loss"]) == pytest.approx(want, rel=1e-5)
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        header, *rows = f.read().splitlines()
    assert {"train_loss", "val_loss", "fzero/grad_norm", "step"} <= set(header.split(","))
    assert len([r for r in rows if r.split(",")[header.split(",").index("train_loss")]]) == 4


class _Manual(LitCNN):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _TwoOptimizers(LitCNN):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[:2].parameters()), torch.optim.AdamW(self.net[2:].parameters())]


class _RMSprop(LitCNN):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters())


class _AdamL2(LitCNN):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), weight_decay=1e-2)


class _AfterBackward(LitCNN):
    def on_after_backward(self):
        pass


class _ReturnsNone(LitCNN):
    def training_step(self, batch, batch_idx):
        return None


class _CyclesMomentum(LitCNN):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


class _FreezesMidFit(LitCNN):
    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 1:
            self.net[0].requires_grad_(False)


def _swa():
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    return [StochasticWeightAveraging(swa_lrs=1e-2)]


def _finetuning():
    from lightning.pytorch.callbacks import BaseFinetuning

    class Unfreezes(BaseFinetuning):  # as Lightning's docs write one
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.net[0])

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)

    return [Unfreezes()]


REFUSED = [
    (_Manual, {}, r"automatic_optimization is False \(manual optimization\).*Set automatic_optimization = True"),
    (_FreezesMidFit, {}, r"trainable parameters of _FreezesMidFit changed during fit \(frozen since: \['net.0.bias', "
                         r"'net.0.weight'\]\).*Freeze before Trainer.fit"),
    (LitCNN, {"callbacks": _swa}, r"StochasticWeightAveraging callback averages the LightningModule's own parameters"),
    (LitCNN, {"callbacks": _finetuning}, r"Unfreezes callback freezes and unfreezes modules during fit"),
    (_TwoOptimizers, {}, r"multiple optimizers is only supported with manual optimization"),  # Lightning's own
    (_RMSprop, {}, r"torch.optim.rmsprop.RMSprop, which fzero has no counterpart for.*Return torch.optim.AdamW"),
    (_AdamL2, {}, r"torch.optim.Adam\(weight_decay=0.01\).*Use torch.optim.AdamW"),
    (_AfterBackward, {}, r"overrides on_after_backward\(\).*Remove it"),
    (_ReturnsNone, {}, r"training_step returned None.*Return the loss"),
    (_CyclesMomentum, {}, r"param_groups\[0\]\['betas'\] changed.*cycle_momentum=False"),
    (LitCNN, {"gradient_clip_val": 1.0, "gradient_clip_algorithm": "value"}, r"gradient_clip_algorithm='value'.*Use gradient_clip_algorithm='norm'"),
    # plain Lightning flips the gradients (torch's clip factor max_norm / norm < 0); compile's error named clip_grad_norm
    (LitCNN, {"gradient_clip_val": -1.0}, r"^FZeroStrategy: Trainer\(gradient_clip_val=-1.0\) is not a norm to clip at: it "
                                          r"must be > 0 \(None or 0: no clipping\)"),
    (LitCNN, {"precision": "64-true"}, r"Trainer\(precision='64-true'\).*Use precision='32-true', 'bf16-mixed'"),
    (LitCNN, {"accumulate_grad_batches": 2}, r"accumulate_grad_batches=2\) but this optimizer step has 1 micro-batches.*multiple of 2"),
]


@pytest.mark.usefixtures("one_process")
@pytest.mark.parametrize("cls, settings, match", REFUSED, ids=[f"{c.__name__}-{'-'.join(s) or 'module'}" for c, s, _ in REFUSED])
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_what_cannot_map_is_refused_by_name(cls, settings, match):
    settings = {k: v() if callable(v) else v for k, v in settings.items()}  # callbacks: made fresh per test
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        _trainer(**settings).fit(cls(), _loader(cnn_batches(3)))


class _HeadOnly(LitCNN):
    """Fine-tuning as often written: the optimizer over the head alone, the backbone left with requires_grad=True."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[-1].parameters(), lr=1e-2)


class _HeadOnlyFrozen(_HeadOnly):
    def __init__(self):
        super().__init__()
        self.net[:-1].requires_grad_(False)


def _lightning_params(cls, strategy, **settings):
    saved = dict(os.environ)
    try:
        lit = cls()
        _trainer(strategy, **settings).fit(lit, _loader(cnn_batches(4)))
        return {n: p.detach().clone() for n, p in lit.named_parameters()}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_clipping_with_trainable_params_outside_the_optimizer_is_refused_and_the_fix_trains_as_lightning():
    """Lightning clips the norm of the optimizer's params only; an fzero step clips every trainable param's. A backbone
    left trainable outside the optimizer counted in fzero's norm and shrank the head's update, silently (4.9e-4 off
    Lightning's own strategy after 4 steps, 1.2% of the head's movement). Refused by name; the backbone frozen (the
    error's fix) trains the head as Lightning's own strategy trains the unfrozen module (without clipping the
    two agreed already: the backbone's update is zero either way)."""
    with pytest.raises(ValueError, match=r"gradient_clip_val=0.05\) with trainable parameters that are in no param group "
                                         r"of AdamW: 'net.0.weight', 'net.0.bias', 'net.2.weight', 'net.2.bias'.*Freeze them "
                                         r"in _HeadOnly \(requires_grad_\(False\)"):
        _trainer(gradient_clip_val=0.05).fit(_HeadOnly(), _loader(cnn_batches(4)))
    want = _lightning_params(_HeadOnly, "auto", gradient_clip_val=0.05)
    got = _lightning_params(_HeadOnlyFrozen, "fzero_stage_2", gradient_clip_val=0.05)
    moved = max(float((want[n] - p.detach()).abs().max()) for n, p in _HeadOnly().named_parameters())
    assert moved > 1e-2  # the clip acts: the head moved, by less than an unclipped AdamW's 4 x lr
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=n)


class _PaddedToItsOwnLength(LitCNN):
    """A collate that pads each batch to its own longest sequence: micro-batches of different widths."""

    def forward_loss(self, b):
        return F.cross_entropy(self(b["x"]), b["y"]) + 0 * b["pad"].sum()

    def training_step(self, batch, batch_idx):
        return self.forward_loss(batch)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_micro_batches_of_different_shapes_are_named_not_left_to_torch_cat():
    batches = [{**b, "pad": torch.zeros(b["x"].shape[0], 5 + i % 2)} for i, b in enumerate(cnn_batches(4))]
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) runs 2 micro-batches as one fzero step, whose batch "
                                         r"entries must have one shape; batch\['pad'\] has rows of shapes \[\(5,\), \(6,\)\].*"
                                         r"padding='max_length'"):
        _trainer(accumulate_grad_batches=2).fit(_PaddedToItsOwnLength(), _loader(batches))


class _StopsMidWindow(LitCNN):
    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 3 and self.current_epoch == 0:
            return -1  # Lightning: skip the rest of this epoch


class _StepsEverySecondBatch(LitCNN):
    """Lightning's docs: an optimizer_step that runs only the closure on some batches (forward and backward; the
    gradient is zeroed at the next batch's window start, so under DDP that batch trains nothing)."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % 2 == 0:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class _AdamDecoupled(LitCNN):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_windows_that_never_step_are_dropped_as_under_ddp_and_adam_decoupled_is_adamw():
    """on_train_batch_start returning -1 mid-window: Lightning zeroes the gradients at a window's first batch, so the
    unfinished window's micro-batches are dropped (they were kept into the next epoch, whose first step then had 3);
    so is a batch whose optimizer_step runs only the closure (the next step had 2 micro-batches for 1).
    torch.optim.Adam(decoupled_weight_decay=True) is AdamW's update (it was refused as an L2 term). Both equal plain
    PyTorch running the windows Lightning runs."""
    batches = cnn_batches(3, micro=2)  # 6 batches an epoch, windows of 2
    epoch0, epoch1 = batches[:2], batches  # epoch 0 stops at batch 3: its second window never steps
    runs = {_StopsMidWindow: (epoch0 + epoch1, 2, 2), _AdamDecoupled: (batches, 2, 1), _StepsEverySecondBatch: (batches[1::2], 1, 1)}
    for cls, (trained, micro, epochs) in runs.items():
        ref = cls()
        want, biggest = reference(ref, trained, micro=micro)
        lit = cls()
        _trainer(accumulate_grad_batches=micro, max_epochs=epochs).fit(lit, _loader(batches))
        _close(dict(lit.named_parameters()), want, _with_gradient(biggest))


class _DropoutCNN(LitCNN):
    """LitCNN with dropout before its head: every forward draws from torch's CPU generator."""

    def forward(self, x):
        return self.net[-1](F.dropout(self.net[:-1](x), 0.2, self.training))

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch["x"]), batch["y"]))


class _Augmented(torch.utils.data.Dataset):
    """Noise drawn from torch's generator in __getitem__: a random augmentation in the main process (num_workers=0)."""

    def __init__(self, batches):
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, i):
        return {**self.batches[i], "x": self.batches[i]["x"] + 0.1 * torch.randn_like(self.batches[i]["x"])}


def _fzero_warnings(cls, data, **settings):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runs = {}
        for name in ("ddp", "fzero_stage_2"):
            torch.manual_seed(0)
            lit = cls()
            _trainer(name, accumulate_grad_batches=2, **settings).fit(lit, *data)
            runs[name] = {n: p.detach() for n, p in lit.named_parameters()}
    messages = [str(w.message) for w in seen if str(w.message).startswith("FZeroStrategy")]
    return messages, max(float((runs["ddp"][n] - p).abs().max()) for n, p in runs["fzero_stage_2"].items())


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_what_runs_between_a_windows_batches_is_said_where_it_changes_the_numbers():
    """Under accumulate_grad_batches=k a window's forwards run together at its k-th batch, so what runs between its
    batches comes before them rather than between them as under DDP. Silent before: a Dataset that draws augmentations
    from torch's generator in the main process beside dropout (the dropout masks and the noise other draws: params 7e-2
    off DDP's after 4 steps of a BatchNorm CNN), and a validation mid-window (it saw BatchNorm statistics without the
    window's first micro-batch, and its DataLoader's seed draw came before that micro-batch's dropout). Each warns once,
    naming the fix; augmentation without dropout, or dropout alone, trains as DDP and warns nothing."""
    batches = cnn_batches(4, micro=2)
    said, off = _fzero_warnings(_DropoutCNN, (_loader(_Augmented(batches)),))
    assert len(said) == 1 and "torch's random generator was drawn between its batches" in said[0] and off > 1e-3
    assert "num_workers > 0" in said[0]
    for cls, data in ((LitCNN, (_loader(_Augmented(batches)),)), (_DropoutCNN, (_loader(batches),))):
        said, off = _fzero_warnings(cls, data)
        assert said == [] and off < 1e-5, (cls.__name__, said, off)
    said, off = _fzero_warnings(_DropoutCNN, (_loader(batches), _loader(batches[:2])), val_check_interval=3)
    assert any(m.startswith("FZeroStrategy: validation runs in the middle of an accumulation window "
                            "(Trainer(val_check_interval=3, accumulate_grad_batches=2): 1 micro-batch(es) kept)") for m in said)
    assert any("Make val_check_interval a multiple of accumulate_grad_batches" in m for m in said) and off > 1e-3
    said, off = _fzero_warnings(_DropoutCNN, (_loader(batches), _loader(batches[:2])), val_check_interval=4)
    assert said == [] and off < 1e-5


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the resumed run's: it is
def test_resuming_under_accumulation_with_a_step_checkpoint_goes_on_as_lightnings_own_strategy(tmp_path):
    """ModelCheckpoint(every_n_train_steps=2), accumulate_grad_batches=2, fit(ckpt_path=...): ModelCheckpoint does not
    keep the step it last saved at, so at the first batch after the restore (mid-window, global_step still 2) it saved
    again, and the strategy's refusal of kept micro-batches ended the resumed run (advising every_n_train_steps, which
    the script used). It goes on now to the params of Lightning's DDP strategy, without that save of the step it
    resumed from (DDP writes it, mid-window: a file more)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches = cnn_batches(2, micro=2)
    got = {}
    for name in ("ddp", "fzero_stage_2"):
        path = tmp_path / name
        _trainer(name, accumulate_grad_batches=2, max_steps=2, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=path, every_n_train_steps=2, save_top_k=-1)]).fit(LitCNN(), _loader(batches))
        lit = LitCNN()
        trainer = _trainer(name, accumulate_grad_batches=2, max_steps=6, max_epochs=-1, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=path, every_n_train_steps=2, save_top_k=-1)])
        trainer.fit(lit, _loader(batches), ckpt_path=path / "epoch=0-step=2.ckpt")
        got[name] = (dict(lit.named_parameters()), sorted(os.listdir(path)), trainer.global_step)
    # DDP's one more file is that save: step 2 again, from the middle of the resumed run's first window
    assert got["ddp"][1:] == (["epoch=0-step=2.ckpt", "epoch=1-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"], 6)
    assert got["fzero_stage_2"][1:] == (["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "epoch=2-step=6.ckpt"], 6)
    _close(got["fzero_stage_2"][0], got["ddp"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_disk_offload_under_lightning_trains_as_cpu_offload(tmp_path):
    """DeepSpeed's "deepspeed_stage_3_offload_nvme" as FZeroStrategy(stages=3, offload=DiskOffload(dir, params=True)):
    the optimizer state and param shards in files under the directory, the same params as host offload, bitwise."""
    batches = cnn_batches(3)
    host = LitCNN()
    _trainer("fzero_stage_3_offload").fit(host, _loader(batches))
    disk = LitCNN()
    trainer = _trainer(fzero.lightning.FZeroStrategy(stages=3, offload=fzero.DiskOffload(str(tmp_path), params=True)))
    trainer.fit(disk, _loader(batches))
    assert trainer.strategy.step.offload.where == "disk" and os.listdir(tmp_path)
    want = dict(host.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in disk.named_parameters())
    assert any(not torch.equal(p, q) for p, q in zip(LitCNN().parameters(), disk.parameters()))


def _frozen_gpt():
    """LitGPT with its blocks' MLPs and its embeddings frozen: the blocks' go with their units, the embeddings (tied
    wte/lm_head) with the root."""
    lit = LitGPT()
    for name, p in lit.named_parameters():
        p.requires_grad_(not (".mlp." in name or ".wte." in name or ".wpe." in name))
    return lit


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_shard_frozen_trains_as_the_module_s_frozen_params_and_gives_them_back(tmp_path):
    """FZeroStrategy(stages=3, shard_frozen=True): the same params, bitwise, as without it; the module's frozen params
    are the state's while it runs and its own again after fit (the same values, the tie kept); a checkpoint resumes
    into sharded frozen params and goes on as the straight run."""
    batches = gpt_batches(4)
    plain = _frozen_gpt()
    _trainer(fzero.lightning.FZeroStrategy(stages=3), max_epochs=2).fit(plain, _loader(batches))
    lit = _frozen_gpt()
    before = {n: p.detach().clone() for n, p in lit.named_parameters() if not p.requires_grad}
    seen = []
    lit.on_train_epoch_start = lambda: seen.append(lit.model.transformer.h[0].mlp.c_fc.weight.is_meta)
    trainer = _trainer(fzero.lightning.FZeroStrategy(stages=3, shard_frozen=True), max_epochs=1)
    trainer.fit(lit, _loader(batches))
    assert seen == [True] and trainer.strategy.state.frozen  # emptied while it ran, held by the state
    after = dict(lit.named_parameters())
    assert all(torch.equal(after[n], before[n]) and not after[n].requires_grad for n in before)
    assert lit.model.lm_head.weight is lit.model.transformer.wte.weight
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = _frozen_gpt()
    _trainer(fzero.lightning.FZeroStrategy(stages=3, shard_frozen=True), max_epochs=2).fit(
        resumed, _loader(batches), ckpt_path=tmp_path / "ckpt")
    want = dict(plain.named_parameters())
    assert all(torch.equal(p, want[n]) for n, p in resumed.named_parameters())
    with pytest.raises(ValueError, match=r"FZeroStrategy: shard_frozen=True shards the frozen params at stage 3, but stages=2"):
        fzero.lightning.FZeroStrategy(stages=2, shard_frozen=True)


def test_compile_keywords_that_lightning_sets_are_refused():
    with pytest.raises(TypeError, match=r"grad_accum= is set by Lightning here.*Trainer\(accumulate_grad_batches=...\)"):
        fzero.lightning.FZeroStrategy(stages=3, grad_accum=2)
    with pytest.raises(TypeError, match=r"optimizer= is set by Lightning.*configure_optimizers"):
        fzero.lightning.FZeroStrategy(optimizer=fzero.optim.adamw(1e-3))


def test_the_strategy_names_are_registered_and_import_fzero_does_not_need_lightning():
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("fzero", *NAMES):
        assert StrategyRegistry[name]["strategy"] is fzero.lightning.FZeroStrategy
    assert StrategyRegistry["fzero_stage_3_offload"]["init_params"] == {"stages": 3, "offload": "cpu", "offload_params": True}
    code = "import sys, fzero; fzero.compile; fzero.optim; assert not any(m.startswith('lightning') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_process_group_backend_follows_the_accelerator_not_whether_cuda_exists():
    """A CPU run on a GPU machine gets plain gloo, as under DDP; a CUDA run NCCL beside gloo; the user's choice stands."""
    cpu, gpu = [torch.device("cpu")], [torch.device("cuda", 0)]
    assert fzero.lightning.FZeroStrategy(parallel_devices=cpu)._get_process_group_backend() == "gloo"
    assert fzero.lightning.FZeroStrategy(parallel_devices=gpu)._get_process_group_backend() == "cpu:gloo,cuda:nccl"
    mine = fzero.lightning.FZeroStrategy(parallel_devices=cpu, process_group_backend="cpu:gloo")
    assert mine._get_process_group_backend() == "cpu:gloo"


_MEAN_UNDER_A_MIXED_BACKEND = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
import fzero.lightning

def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("cpu:gloo", rank=rank, world_size=2)  # named per device, as "cpu:gloo,cuda:nccl" is
    strategy = fzero.lightning.FZeroStrategy(parallel_devices=[torch.device("cpu")] * 2)
    f = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="mean")
    n = strategy.reduce(torch.tensor(3 * (rank + 1)), reduce_op="mean")  # Lightning's int batch-size count
    s = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    assert (float(f), n.dtype, int(n), float(s)) == (1.5, torch.int64, 4, 3.0), (f, n, s)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1],), nprocs=2)
"""


def test_sync_dist_means_reduce_under_a_backend_named_per_device(tmp_path):
    """Under "cpu:gloo,cuda:nccl" Lightning asked gloo for ReduceOp.AVG on its integer batch-size count at the end of a
    validation epoch, which fails in place ("result type Float can't be cast to the desired output type Long"; seen
    running examples/train_lightning.py on 2 processes on a GPU machine). A mean of a host tensor is a sum divided by
    the ranks, as Lightning does under plain gloo (integers truncated, as there)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = tmp_path / "mean.py"
    script.write_text(_MEAN_UNDER_A_MIXED_BACKEND)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script), port], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_the_deepspeed_seed_lightning_script_runs_with_fzero_stage_3_offload():
    """docs/migrating.md section 3's LitLM and Trainer, with "deepspeed_stage_3_offload" renamed."""
    import lightning as L
    from transformers import GPT2Config, GPT2LMHeadModel

    from fzero.data import batch_at, load_corpus

    class LitLM(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["x"], labels=batch["x"]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                       bos_token_id=0, eos_token_id=0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = load_corpus(max_bytes=1 << 16)
    loader = _loader([batch_at(data, k, batch_size=2, seq_len=64, seed=0) for k in range(4)])
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="fzero_stage_3_offload", precision="bf16-mixed",
                        accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitLM(model), train_dataloaders=loader)
    step = trainer.strategy.step
    assert (step.stage, step.offload.where, step.offload.params, step.grad_accum, step.clip_grad_norm) == (3, "cpu", True, 2, 1.0)
    assert step.precision.compute == torch.bfloat16 and trainer.global_step == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 masters, loaded back into the module
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.torchrun
@pytest.mark.slow
def test_the_lightning_example_runs_and_resumes(tmp_path):
    script = os.path.join(ROOT, "examples", "train_lightning.py")
    common = ["--batches-per-epoch", "4", "--out", str(tmp_path)]
    first = torchrun([script, "--max-steps", "2", *common], timeout=240)
    assert "fzero_stage_3_offload: 2 optimizer steps" in first.stdout, first.stdout[-2000:] + first.stderr[-3000:]
    again = torchrun([script, "--max-steps", "4", "--resume", *common], timeout=240)
    assert "fzero_stage_3_offload: 4 optimizer steps" in again.stdout, again.stdout[-2000:] + again.stderr[-3000:]
    assert "Restored all states" in again.stdout + again.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (its CPU twins are the tests above)")
@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.parametrize("strategy", ["fzero_stage_2", "fzero_stage_3_offload"])
def test_on_a_gpu_the_strategy_trains_as_plain_pytorch_on_that_gpu(strategy):
    """accelerator="gpu": the module, the state and the step live on the GPU (the offloaded state in host memory),
    and the params equal plain PyTorch's AdamW on the same GPU within fp32 tolerance."""
    batches = cnn_batches(3)
    ref = LitCNN().cuda()
    want, biggest = reference(ref, [{k: v.cuda() for k, v in b.items()} for b in batches])
    lit = LitCNN()
    trainer = _trainer(strategy, accelerator="gpu")
    trainer.fit(lit, _loader(batches))  # Lightning moves each batch to the GPU
    # Lightning's teardown moves the module back to the CPU when fit ends (as for DDP): the training ran on the GPU
    assert trainer.strategy.step.mesh is None and trainer.strategy.root_device.type == "cuda"
    _close({n: p.detach().cuda() for n, p in lit.named_parameters()}, want, _with_gradient(biggest))


class _WithMetric(LitCNN):
    """Accuracy logged as Lightning's docs log it: a torchmetrics Metric object, updated by a call."""

    def __init__(self):
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

    def training_step(self, batch, batch_idx):
        logits = self(batch["x"])
        self.train_acc(logits, batch["y"])
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, batch["y"])


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.parametrize("strategy", ["fzero_stage_1", "fzero_stage_3"])
def test_a_torchmetrics_metric_logs_what_it_logs_without_fzero(strategy):
    """A Metric wraps its update and compute at init, bound to itself; the step's clone of the module shared those
    wrappers, so the metric was updated on the original and computed on the clone (a running value logged as the
    batch's, wrong epoch values). Such a module is shared, not cloned: the values equal Lightning's own strategy's."""
    pytest.importorskip("torchmetrics")
    from lightning.pytorch import Callback

    class Record(Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(float(trainer.callback_metrics["train_acc_step"]))

    batches = cnn_batches(6)
    got = {}
    for name in ("auto", strategy):
        record = Record()
        trainer = _trainer(name, max_epochs=2, callbacks=[record])
        trainer.fit(_WithMetric(), _loader(batches))
        got[name] = (record.steps, float(trainer.callback_metrics["train_acc_epoch"]))
    assert got[strategy] == got["auto"]


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_validate_with_a_checkpoint_path_after_fit_loads_the_weights(tmp_path):
    """trainer.validate(ckpt_path=...) builds a step without the run's optimizer: the checkpoint's weights load into it
    (its optimizer state was refused, as from another optimizer, with an error naming neither Lightning nor a fix)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    batches = gpt_batches(4)
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = _trainer("fzero_stage_3", callbacks=[saver], enable_checkpointing=True)
    lit = LitGPT()
    trainer.fit(lit, _loader(batches), _loader(batches[:2]))
    now = trainer.validate(lit, _loader(batches[:2]))  # the trained weights, loaded into the module when fit ended
    from_file = trainer.validate(lit, _loader(batches[:2]), ckpt_path=saver.last_model_path)
    assert from_file == now


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")
def test_validate_with_a_checkpoint_path_loads_its_weights_into_the_module_as_lightnings_own_strategy(tmp_path):
    """Lightning's own strategies load the checkpoint of trainer.validate/test/predict(ckpt_path=...) into the
    LightningModule; here it went into the step's state only, and the module kept the weights it had, so the module
    and a later call without ckpt_path used those, silently (a BatchNorm CNN's predictions after test(ckpt_path="best")
    were 1.46 off DDP's, from the last epoch's weights). The module now holds the checkpoint's weights after the call."""
    batches = gpt_batches(2)
    got = {}
    for name in ("auto", "fzero_stage_3"):
        lit = LitGPT()
        trainer = _trainer(name)
        trainer.fit(lit, _loader(batches))
        trainer.save_checkpoint(tmp_path / name)
        saved = {n: p.detach().clone() for n, p in lit.named_parameters()}
        _trainer(name).fit(lit, _loader(batches))  # trains on from there: the module moves away from the checkpoint
        assert not torch.equal(lit.model.transformer.h[0].mlp.c_fc.weight, saved["model.transformer.h.0.mlp.c_fc.weight"])
        trainer = _trainer(name)
        from_file = trainer.validate(lit, _loader(batches), ckpt_path=tmp_path / name)
        got[name] = (from_file, {n: p.detach().clone() for n, p in lit.named_parameters()}, trainer.validate(lit, _loader(batches)))
        _close(got[name][1], saved, rtol=0, atol=0)
    (fz,), (auto,), (after,) = got["fzero_stage_3"][0], got["auto"][0], got["fzero_stage_3"][2]
    assert fz["val_loss"] == pytest.approx(auto["val_loss"], rel=1e-5) and after == fz  # the next call: the same weights


class _WithIds(LitCNN):
    """Batches as default_collate makes them from a dataset with a string column: the rows' ids as a list of str."""

    def __init__(self):
        super().__init__()
        self.seen: list = []

    def training_step(self, batch, batch_idx):
        self.seen.append(list(batch["id"]))
        return super().training_step(batch, batch_idx)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_string_columns_with_accumulate_grad_batches_train_as_lightnings_own_strategy():
    """default_collate makes a string field (ids, texts) a list of one str per row, which differs between the
    micro-batches; joining them was refused ("a batch entry without rows (str) differs"), so no such module could use
    accumulate_grad_batches. The lists are rows: each micro-batch's training_step sees its own ids, and the params
    equal Lightning's default strategy's."""
    batches = [{**b, "id": [f"row{4 * i + r}" for r in range(len(b["y"]))]} for i, b in enumerate(cnn_batches(2, micro=2))]
    got = {}
    for name in ("auto", "fzero_stage_3"):
        lit = _WithIds()
        _trainer(name, accumulate_grad_batches=2).fit(lit, _loader(batches))
        got[name] = (dict(lit.named_parameters()), lit.seen)
    assert got["fzero_stage_3"][1] == got["auto"][1] == [b["id"] for b in batches]
    _close(got["fzero_stage_3"][0], got["auto"][0], rtol=1e-5, atol=1e-6)


class _LitDetector(pl.LightningModule):
    """A detector's shape of training_step: a list of images of their own sizes and a list of target dicts of their own
    box counts (torchvision's ``collate_fn=lambda s: tuple(zip(*s))``), or (``detr``) DETR's ``pixel_values`` of B
    rows beside a ``labels`` list of one dict per image; one loss per image, averaged."""

    def __init__(self, detr=False):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.box = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Linear(4, 4)
        self.detr, self.seen = detr, []

    def training_step(self, batch, batch_idx):
        images, targets = (list(batch["pixel_values"]), batch["labels"]) if self.detr else batch
        self.seen.append([(tuple(img.shape), t["labels"].tolist()) for img, t in zip(images, targets)])
        losses = []
        for img, t in zip(images, targets):
            features = self.conv(img[None]).relu().mean((2, 3))[0]
            losses.append((self.box(features) - t["boxes"]).square().sum() + 0.01 * features.sum())
        return torch.stack(losses).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _detection_batches(steps, *, detr=False, boxes=(2, 0, 1, 3)):
    """Micro-batches of 2 images; image i's labels all hold i, its box count is ``boxes[i % 4]``."""
    gen, out = torch.Generator().manual_seed(1), []
    for b in range(steps):
        ids = (2 * b, 2 * b + 1)
        size = (lambda i: (6, 6)) if detr else (lambda i: (5 + i % 3, 4 + 2 * i % 5))
        images = [torch.randn(3, *size(i), generator=gen) for i in ids]
        targets = [{"boxes": torch.rand(boxes[i % 4], 4, generator=gen), "labels": torch.full((boxes[i % 4],), i)}
                   for i in ids]
        out.append({"pixel_values": torch.stack(images), "labels": targets} if detr else (images, targets))
    return out


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.parametrize("detr", [False, True], ids=["torchvision", "detr"])
def test_detection_batches_with_accumulate_grad_batches_train_as_lightnings_own_strategy(detr):
    """The strategy joins the kept micro-batches into one step that grad_accum splits back: it joined every tensor on
    dim 0, so a detection batch (images of their own sizes, targets of their own box counts) was refused ("needs them
    alike ... rows ([0, 1, 2, 3] here)", its channels and box counts read as rows). The lists are joined image by image,
    as the step splits them (fzero.step.batch_rows): each training_step sees its own images with their own targets, and
    the params are Lightning's default strategy's."""
    batches = _detection_batches(4, detr=detr)
    got = {}
    for name in ("auto", "fzero_stage_3"):
        lit = _LitDetector(detr)
        _trainer(name, accumulate_grad_batches=2).fit(lit, _loader(batches))
        got[name] = (dict(lit.named_parameters()), lit.seen)
    assert got["fzero_stage_3"][1] == got["auto"][1]
    assert [[labels[:1] for _, labels in part] for part in got["auto"][1]] == [[[0], []], [[2], [3]], [[4], []], [[6], [7]]]
    _close(got["fzero_stage_3"][0], got["auto"][0], rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
def test_a_joined_detection_batch_whose_box_counts_equal_its_rows_trains_as_lightnings_own_strategy():
    """DETR's pixel_values of 2 rows per micro-batch beside images of 4 boxes each: each micro-batch reads as 2 images,
    and joined every tensor has 4 on dim 0. The step read such a batch on dim 0 (each image's boxes split between the
    micro-batches), so the strategy refused it; the step now reads a list of one dict per row as the rows wherever
    counting it gives the tensors' count (fzero.step.batch_rows), so it trains as Lightning's default strategy."""
    batches = _detection_batches(2, detr=True, boxes=(4, 4, 4, 4))
    got = {}
    for name in ("auto", "fzero_stage_3"):
        lit = _LitDetector(detr=True)
        _trainer(name, accumulate_grad_batches=2).fit(lit, _loader(batches))
        got[name] = (dict(lit.named_parameters()), lit.seen)
    assert got["fzero_stage_3"][1] == got["auto"][1]
    assert [[labels[:1] for _, labels in part] for part in got["auto"][1]] == [[[0], [1]], [[2], [3]]]
    _close(got["fzero_stage_3"][0], got["auto"][0], rtol=1e-6, atol=1e-7)


class _CollectsOutputs(LitCNN):
    """Lightning 2.x's pattern for epoch-end work: the steps append to lists on ``self``, the epoch-end hooks read
    and clear them (Lightning removed ``training_epoch_end(outputs)`` for this)."""

    def __init__(self):
        super().__init__()
        self.training_step_outputs, self.validation_step_outputs = [], []
        self.epoch_means, self.val_means, self.steps_seen = [], [], 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.training_step_outputs.append(loss)
        self.steps_seen += 1
        return loss

    def validation_step(self, batch, batch_idx):
        loss = F.cross_entropy(self(batch["x"]), batch["y"])
        self.validation_step_outputs.append(loss)
        return loss

    def on_train_epoch_end(self):
        self.epoch_means.append(float(torch.stack(self.training_step_outputs).mean().detach()))
        self.training_step_outputs.clear()

    def on_validation_epoch_end(self):
        self.val_means.append(float(torch.stack(self.validation_step_outputs).mean()))
        self.validation_step_outputs.clear()


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.parametrize("accumulate", [1, 2])
def test_what_the_steps_append_to_self_reaches_the_epoch_end_hooks_as_under_lightnings_own_strategy(accumulate):
    """The strategy runs training_step and validation_step on the step's copy of the module: the lists they appended
    to were the copy's, so on_train_epoch_end found nothing (0 outputs where Lightning's own strategy has 4)."""
    batches = cnn_batches(4)
    got = {}
    for name in ("auto", "fzero_stage_3"):
        lit = _CollectsOutputs()
        _trainer(name, accumulate_grad_batches=accumulate, max_epochs=2).fit(lit, _loader(batches), _loader(batches[:2]))
        got[name] = lit
    auto, ours = got["auto"], got["fzero_stage_3"]
    assert ours.steps_seen == auto.steps_seen == 8
    assert len(ours.epoch_means) == len(auto.epoch_means) == 2 and len(ours.val_means) == len(auto.val_means) == 2
    assert ours.epoch_means == pytest.approx(auto.epoch_means, rel=1e-5)
    assert ours.val_means == pytest.approx(auto.val_means, rel=1e-5)
    assert ours.training_step_outputs == [] and ours.validation_step_outputs == []


class _InterruptAt(pl.Callback):
    """Ctrl-C after batch ``n``, as a notebook user stops a fit: Lightning shuts down gracefully and raises SystemExit."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.n:
            raise KeyboardInterrupt


@pytest.mark.usefixtures("one_process")
@LIGHTNING_NOISE[0]
@LIGHTNING_NOISE[1]
@pytest.mark.parametrize("strategy", ["fzero_stage_2", "fzero_stage_3"])
def test_a_fit_stopped_by_ctrl_c_then_fit_again_continues_as_under_lightnings_own_strategy(strategy):
    """Lightning's own strategies train the module in place, so after a fit stopped by Ctrl-C (or an error) the module
    holds the values trained so far and a second fit continues from them. Before, fzero's module kept its values from
    setup and the second fit restarted from them, without a word: 7.7e-2 off Lightning's own strategy after 3 + 3 steps
    of a CNN. Now the trained values go into the module when such a fit ends (on one process)."""
    import signal

    batches = cnn_batches(6)
    out = {}
    for name in ("auto", strategy):
        lit = LitCNN()
        try:
            _trainer(name, callbacks=[_InterruptAt(2)]).fit(lit, _loader(batches))
        except SystemExit:  # Lightning's answer to Ctrl-C, which a notebook's kernel catches
            pass
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT from then on
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        lit(batches[0]["x"])  # the module holds trained values: a direct call is not refused
        _trainer(name).fit(lit, _loader(batches[3:]))
        out[name] = {k: v.detach().clone() for k, v in lit.state_dict().items()}
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    for k, want in out["auto"].items():
        torch.testing.assert_close(out[strategy][k], want, rtol=1e-5, atol=1e-6, msg=k)
