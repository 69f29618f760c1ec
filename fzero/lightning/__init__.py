"""Lightning (``lightning.pytorch``, 2.2 or newer) on fzero: a strategy, and the names DeepSpeed's have.

```python
import lightning as L
import fzero.lightning   # registers "fzero_stage_1" ... "fzero_stage_3_offload" in Lightning's StrategyRegistry

trainer = L.Trainer(strategy="fzero_stage_3_offload", accelerator="cpu", devices=2, precision="bf16-mixed",
                    accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=1000)
trainer.fit(lit_module, train_dataloaders=loader)          # a LightningModule written for plain PyTorch
# or: L.Trainer(strategy=fzero.lightning.FZeroStrategy(stages=3, offload="cpu", units=...), ...)
```

| Lightning | fzero |
|---|---|
| ``"fzero_stage_1"``, ``"fzero_stage_2"``, ``"fzero_stage_3"`` (``"fzero"``: stage 2, as ``"deepspeed"``) | ``compile(stages=1/2/3)`` |
| ``"fzero_stage_2_offload"`` / ``"fzero_stage_3_offload"`` | ``offload="cpu"`` / and ``offload_params=True`` |
| ``configure_optimizers``: ``torch.optim.AdamW``, ``Adam`` (no L2), ``SGD``, param groups | ``fzero.optim.adamw``/``adam``/``sgd``, one per group in ``multi_transform`` |
| any lr scheduler (``"step"`` or ``"epoch"`` interval, ``ReduceLROnPlateau``) | the step reads each group's lr from the torch optimizer, where Lightning's scheduler step writes it |
| ``accumulate_grad_batches=k`` | ``grad_accum=k``: the k micro-batches run as one step, at the k-th |
| ``gradient_clip_val=c`` (``"norm"``) | ``clip_grad_norm=c`` |
| ``precision="32-true"``, ``"bf16-mixed"``/``"bf16-true"``, ``"16-mixed"`` | ``precision="fp32"``, ``"bf16"``, ``"fp16"`` |
| ``ModelCheckpoint``, ``trainer.save_checkpoint(path)``, ``fit(ckpt_path=path)`` | ``path/`` holds ``fzero/`` (``fzero.checkpoint``) and ``lightning.ckpt`` |

**Precision is a policy, not autocast.** Under ``"bf16-mixed"`` (and ``"16-mixed"``) torch.autocast keeps the weights
in fp32 and runs each op in the dtype autocast chooses for it: matmuls and convolutions in 16 bits, softmax, norms,
losses and reductions in fp32. fzero's policy instead casts the params, the buffers and the floating-point inputs (a
float target included) to the 16-bit dtype and runs the whole ``training_step`` in it, keeping fp32 master weights and
optimizer states; the gradient is reduced in the policy's reduce dtype, and ``"16-mixed"`` has fzero's dynamic loss
scale with DeepSpeed's defaults, as Lightning's DeepSpeed strategy sets them (2**16, growth after 1000 clean steps,
hysteresis 2, minimum 1), not torch's GradScaler's (growth after 2000, no hysteresis). ``"bf16-true"`` is the same
policy: Lightning would keep the weights themselves in bf16, fzero keeps fp32 masters. Cast inside ``training_step``
(``logits.float()``) where fp32 matters.

**What differs from DDP.** The LightningModule's own parameters stay as they were while ``fit`` runs (its methods
see the state's params inside ``training_step``/``validation_step``/``test_step``/``predict_step``; a callback that
reads ``pl_module.parameters()`` mid-fit sees the initial ones); the trained ones are loaded into it when ``fit``
ends. ``training_step``'s return value is the loss of the whole step, the mean over ranks and micro-batches; with
``accumulate_grad_batches=k`` the first k-1 micro-batches return NaN (their forward runs at the k-th) and what they
``self.log`` is logged at the k-th; so a validation mid-window (``val_check_interval`` not a multiple of k) sees buffers
without them, and draws from torch's generator between the batches (augmentations in the main process) come before
their dropout, not between (each warned once). The gradient norm is logged as ``"fzero/grad_norm"``. A checkpoint is a
directory; ``fzero.checkpoint.consolidate(path + "/fzero", "model.pt", model=lit_module)`` makes one state dict of it.
What ``training_step``/``validation_step`` write on ``self`` (Lightning 2.x's ``self.training_step_outputs.append(loss)``
read in ``on_train_epoch_end``, a counter ``self.n += 1``) is kept as under DDP: the step runs on a copy of the module,
and the public attributes the copy changed are written into the module when the step succeeds (lists in place; a
tensor detached, its backward having run). Names with a leading underscore stay the copy's (they are Lightning's and
the libraries' own state), and with several ranks in one process, rank 0's writes are kept.

Refused, each with an error that names the setting and the fix: manual optimization, more than one optimizer, an
optimizer other than AdamW/Adam/SGD (and ``amsgrad``, ``maximize``, Adam's L2 ``weight_decay``, SGD's
``dampening``), other precisions, ``gradient_clip_algorithm="value"``, the hooks that run between backward and the
optimizer step (``backward``, ``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``,
``configure_gradient_clipping``, in the module or a callback), ``GradientAccumulationScheduler``, a ``training_step``
that returns None, an epoch whose batches are not a multiple of ``accumulate_grad_batches``, and a scheduler that
changes betas, momentum, eps or weight decay.
"""

from lightning.pytorch.strategies import StrategyRegistry

from fzero.lightning._strategy import FZeroStrategy

FZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["FZeroStrategy"]
