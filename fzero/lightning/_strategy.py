"""``FZeroStrategy``: Lightning's automatic optimization run by one fzero step per optimizer step.

How Lightning's calls land (``lightning/pytorch/loops/optimization/automatic.py``):

- ``optimizer_step(optimizer, closure)`` runs the closure, nothing else: the torch optimizer is never stepped.
- The closure calls ``training_step(batch, batch_idx)`` here. A micro-batch before the accumulation boundary is kept;
  at the boundary the kept ones and this one run as one ``step(state, batch)`` with ``grad_accum`` micro-batches, whose
  ``loss_fn`` calls the module's own ``training_step`` through ``fzero.apply(module.training_step, params, ...)``.
- ``backward`` returns the loss it is given: the step already took the gradient and updated.
- ``validation_step``, ``test_step`` and ``predict_step`` run as ``step.evaluate``: the module's method with the
  state's params (at stage 3 gathered unit by unit), without a gradient.
"""

from __future__ import annotations

import collections
import os
import warnings
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import fzero
from fzero.lightning._translate import Optimizer, check_clip_outside, check_module, clip_of, precision_of
from fzero.step import batch_rows, per_row_items, record_list, rows_listed, trainable_changes

# Keywords of fzero.compile that a Lightning run sets elsewhere: where to set them instead.
_SET_BY_LIGHTNING = {
    "optimizer": "return the optimizer from LightningModule.configure_optimizers",
    "precision": "Trainer(precision=...)",
    "grad_accum": "Trainer(accumulate_grad_batches=...)",
    "clip_grad_norm": "Trainer(gradient_clip_val=...)",
    "mesh": "Trainer(devices=..., num_nodes=...): the strategy runs on the processes Lightning starts",
    "config": "FZeroStrategy's own keywords (stages=, offload=, ...) and the Trainer's settings",
}

_LIGHTNING_FILE = "lightning.ckpt"  # Lightning's own part of a checkpoint: loops, callbacks, epoch, lr schedulers
_FZERO_DIR = "fzero"  # the sharded training state, fzero.checkpoint's format


class _Call(NamedTuple):
    """One call of a LightningModule method that ``loss_fn`` runs: its name and the arguments after the batch."""

    method: str
    args: tuple
    kwargs: dict


class FZeroStrategy(DDPStrategy):
    """Train a LightningModule with fzero's ZeRO stage ``stages`` on the processes Lightning runs.

    ``stages``, ``offload``, ``offload_params`` and any other keyword (``units``, ``bucket_elements``, ``prefetch``,
    ``remat``, ``jit``, ``autodiff``, ...) are ``fzero.compile``'s; the optimizer, precision, accumulation and
    clipping come from the LightningModule and the Trainer. ``process_group_backend``, ``timeout`` and
    ``start_method`` are Lightning's DDP ones (by default ``"gloo"`` when the Trainer's accelerator is the CPU, and
    ``"cpu:gloo,cuda:nccl"`` when it is CUDA, so that offloaded state can reduce on the host).

    The LightningModule's own parameters are not trained while ``fit`` runs: its methods see the state's params only
    inside ``training_step``, ``validation_step``, ``test_step`` and ``predict_step``. When ``fit`` ends, the trained
    params and buffers are loaded into it (also when it ends in an exception or Ctrl-C, on one process, so that a second
    ``fit`` continues from them as under Lightning's own strategies; under torchrun a warning says how), and when ``validate``/``test``/``predict(ckpt_path=...)`` ends, the
    checkpoint's (``load_trained=False``: left as they were, e.g. for a stage-3 model too large to gather;
    ``strategy.state`` and ``strategy.step`` hold the result).

    ``shard_frozen=True`` (``stages=3``): the module's frozen parameters (a LoRA adapter's base) are sharded across the
    ranks too, as DeepSpeed's stage 3 shards them (``step.init(..., frozen=...)``), and the module's own copies emptied
    while the strategy runs (``fzero.free_frozen``); they go back into it at teardown (``step.restore_frozen``).
    """

    strategy_name = "fzero"

    def __init__(self, stages: int = 2, *, offload: Any = None, offload_params: bool = False, load_trained: bool = True,
                 shard_frozen: bool = False,
                 accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision_plugin: Any = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = timedelta(minutes=30), start_method: str = "popen", **compile_kwargs: Any) -> None:
        for key, where in _SET_BY_LIGHTNING.items():
            if key in compile_kwargs:
                raise TypeError(f"FZeroStrategy: {key}= is set by Lightning here, not by the strategy: {where}.")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self.compile_kwargs = dict(stages=stages, offload=offload, offload_params=offload_params, **compile_kwargs)
        self.load_trained = load_trained
        if not isinstance(shard_frozen, bool):
            raise TypeError(f"FZeroStrategy: shard_frozen must be True or False, got {shard_frozen!r}.")
        if shard_frozen and stages != 3:
            raise ValueError(f"FZeroStrategy: shard_frozen=True shards the frozen params at stage 3, but stages={stages!r}, "
                             f"where every rank holds the params whole. Pass stages=3, or leave shard_frozen out.")
        self.shard_frozen = shard_frozen
        self._emptied = False  # the module's frozen params are the state's now (``fzero.free_frozen``)
        self._failed = False  # an exception ended the run (``on_exception``): teardown does no collective
        self._fitting = False  # the last setup was fit's: the state trains, and the module is behind it
        self.step: fzero.Step | None = None
        self._trainable: tuple[str, ...] = ()  # the params the state trains, by name (set by setup when fitting)
        self.state: Any = None
        self._optimizer: Optimizer | None = None
        self._kept: list[tuple[Any, int]] = []  # micro-batches before the accumulation boundary
        self._calls: collections.deque[_Call] = collections.deque()
        self._at_boundary = False
        self._rng_after: torch.Tensor | None = None  # torch's CPU generator after this window's last kept micro-batch
        self._drawn_between = False  # drawn between this window's micro-batches (``training_step``)
        self._warned: set[str] = set()  # the once-per-fit warnings given
        self._from_checkpoint = False  # validate/test/predict(ckpt_path=...) loaded weights into the state

    # -- set-up ----------------------------------------------------------------------------------------------------
    def _get_process_group_backend(self) -> str:
        """The user's backend, or one for the Trainer's accelerator: gloo for the CPU; for CUDA, NCCL beside gloo, which
        reduces what offload keeps on the host. Chosen by the accelerator, not by whether CUDA exists: a CPU run on a
        GPU machine gets plain gloo, as under DDP."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "cpu:gloo,cuda:nccl" if self.root_device.type == "cuda" else "gloo"

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce (``self.log(..., sync_dist=True)``), with a mean of a host tensor taken as a sum divided by
        the ranks, as Lightning does under plain gloo. Why: under a mixed backend (``"cpu:gloo,cuda:nccl"``) Lightning
        asks gloo for ``ReduceOp.AVG``, which divides in place and fails on the integer batch-size count Lightning
        syncs at the end of an epoch ("result type Float can't be cast to the desired output type Long")."""
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not (mean and distributed and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        total = super().reduce(tensor, group=group, reduce_op="sum")
        world = torch.distributed.get_world_size(group)
        return total.div_(world) if torch.is_floating_point(total) else total.copy_(total / world)

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        self.model_to_device()  # no DDP wrapper and no precision conversion: the step's policy casts
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._fitting = False  # set once this setup has made the state a failure would load (not an older one)
        kwargs = dict(self.compile_kwargs, precision=precision_of(self.precision_plugin))
        if fitting:
            check_module(module, trainer)
            self.setup_optimizers(trainer)  # Lightning refuses several optimizers under automatic optimization
            self._optimizer = Optimizer(self.optimizers[0], module)
            clip = clip_of(trainer)
            check_clip_outside(self._optimizer, clip, module)
            kwargs.update(optimizer=self._optimizer.fzero, grad_accum=trainer.accumulate_grad_batches, clip_grad_norm=clip)
        mesh = fzero.dist_mesh() if self.world_size > 1 else None  # over the process group Lightning set up
        self.step = fzero.compile(self._loss_fn, mesh=mesh, **kwargs)
        self._warned = set()
        params = fzero.params_of(module, copy=False)
        self._trainable = tuple(params)  # what the state trains: fixed for the fit (``_check_trainable``)
        frozen = (fzero.frozen_of(module) or None) if self.shard_frozen else None
        self.state = self.step.init(params, buffers=fzero.buffers_of(module), frozen=frozen)
        if frozen is not None:
            fzero.free_frozen(module, self.state)
            self._emptied = True
        self._fitting = fitting
        self.setup_precision_plugin()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the state to load into exists after setup

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning calls optimizer_step at the boundary; training_step keeps the micro-batches before it

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # -- training --------------------------------------------------------------------------------------------------
    def _loss_fn(self, params: Any, batch: Any) -> Any:
        """The step's loss function: the next queued LightningModule method, run with ``params``."""
        call = self._calls.popleft()
        out = fzero.apply(getattr(self.lightning_module, call.method), params, batch, *call.args, **call.kwargs)
        if call.method != "training_step":  # evaluate: no loss to take; the method's output comes back as aux
            return torch.zeros((), device=self.root_device), out
        return _training_loss(out, type(self.lightning_module).__name__)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        self._at_boundary = True  # the closure's training_step runs the step
        try:
            out = closure()
        finally:
            self._at_boundary = False
        # the fzero step was this optimizer's step: torch's lr schedulers look for this mark of a stepped optimizer
        # (set by the step() they wrap) and warn that they step before it without it
        optimizer._opt_called = True
        return out

    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise TypeError("FZeroStrategy: training_step(batch, batch_idx) takes no other arguments here (a "
                            "dataloader_iter training_step is not supported); iterate the batches in the DataLoader.")
        k = self.lightning_module.trainer.accumulate_grad_batches
        if batch_idx % k == 0:
            self._drawn_between = False
            if self._kept:
                # micro-batches of a window that never reached its step (on_train_batch_start returned -1, ending the
                # epoch mid-window): Lightning zeroes the gradients at a window's first batch, so under DDP they are
                # dropped too
                self._kept = []
        elif self._kept and not self._drawn_between and self._rng_after is not None:
            # torch's CPU generator drawn since the last kept micro-batch (a dataset's random augmentation in the main
            # process, the DataLoader seed of a validation run): under DDP after that micro-batch's forward, here before
            # it (see _warn_rng_order)
            self._drawn_between = not torch.equal(torch.get_rng_state(), self._rng_after)
        self._kept.append((batch, batch_idx))
        if not self._at_boundary:  # accumulating: the step runs at the boundary, with every kept micro-batch
            self._rng_after = torch.get_rng_state()
            return torch.tensor(float("nan"))  # a placeholder; Lightning only passes it on to on_train_batch_end
        kept, self._kept = self._kept, []
        if len(kept) != k:
            raise ValueError(
                f"FZeroStrategy: Trainer(accumulate_grad_batches={k}) but this optimizer step has {len(kept)} micro-batches "
                f"(the epoch has {self.lightning_module.trainer.num_training_batches} batches, not a multiple of {k}); an "
                f"fzero step is compiled for {k}. Make the batches per epoch a multiple of {k} (limit_train_batches, or "
                f"drop_last=True with a dataset size to match)."
            )
        self._optimizer.check_unchanged()
        self._check_trainable()
        self._calls.extend(_Call("training_step", (i,), {}) for _, i in kept)
        before = torch.get_rng_state() if self._drawn_between and "rng" not in self._warned else None
        self.state, metrics = self.step(self.state, _join([b for b, _ in kept], k))
        self._calls.clear()
        if before is not None and not torch.equal(before, torch.get_rng_state()):
            self._warn_rng_order(k)
        self.lightning_module.log("fzero/grad_norm", float(metrics["grad_norm"]), on_step=True, on_epoch=False,
                                  batch_size=1)
        loss = torch.tensor(float(metrics["loss"]))  # the mean over ranks and micro-batches
        aux = metrics.get("aux")
        return {"loss": loss, **aux} if aux else loss

    def _check_trainable(self) -> None:
        """The LightningModule's trainable params are still those fit started with (a hook that freezes or unfreezes
        a module mid-fit): said in Lightning's terms, before ``fzero.apply`` would say it in fzero's."""
        module = self.lightning_module
        frozen, new = trainable_changes(list(module.named_parameters(remove_duplicate=False)), set(self._trainable))
        if not frozen and not new:
            return
        frozen, new = sorted(frozen), sorted(new)
        raise ValueError(
            f"FZeroStrategy: the trainable parameters of {type(module).__name__} changed during fit ("
            + "; ".join(x for x in (f"frozen since: {frozen[:4]}" if frozen else "", f"trainable now: {new[:4]}" if new else "") if x)
            + "). The strategy's fzero state fixes which params train when fit starts, as DeepSpeed's engine fixes its "
              "optimizer's groups. Freeze before Trainer.fit (in __init__ or configure_model), or run one fit per phase "
              "and carry the weights between them (load_state_dict)."
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def _warn_rng_order(self, k: int) -> None:
        """torch's CPU generator was drawn between a window's micro-batches and by their forwards (dropout): under DDP
        each forward runs at its own batch, so those draws interleave; here the forwards run together at the k-th
        batch, after the draws between them, and every draw after the first forward's is another number than DDP's."""
        self._warn_once("rng", (
            f"FZeroStrategy: with Trainer(accumulate_grad_batches={k}) a window's micro-batches run their forwards together "
            f"at its last batch, and torch's random generator was drawn between its batches (a Dataset or collate_fn that "
            f"draws random augmentations in the main process, num_workers=0; or a validation run) as well as by "
            f"training_step (dropout). Under DDP those draws interleave with the forwards; here they come first, so the "
            f"dropout masks and augmentations are other draws than DDP's (same distributions: the run no longer equals "
            f"DDP's step by step). Draw augmentations in DataLoader workers (num_workers > 0, which have generators of "
            f"their own) or from a torch.Generator the dataset owns, and keep val_check_interval a multiple of "
            f"accumulate_grad_batches."))

    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        if self._kept and trainer.state.fn == TrainerFn.FITTING:
            k = trainer.accumulate_grad_batches
            self._warn_once("validation", (
                f"FZeroStrategy: validation runs in the middle of an accumulation window (Trainer(val_check_interval="
                f"{trainer.val_check_interval!r}, accumulate_grad_batches={k}): {len(self._kept)} micro-batch(es) kept). "
                f"Their forwards run at the window's last batch, after this validation, where under DDP they ran before "
                f"it: what they write (BatchNorm running statistics, attributes on self) is not there yet for validation, "
                f"and the validation's draw from torch's generator (its DataLoader's seed) comes before their dropout, so "
                f"the validation metrics (and, with dropout, the training) differ from DDP's. Make val_check_interval a "
                f"multiple of accumulate_grad_batches."))
        super().on_validation_start()

    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self.lightning_module.trainer
        if trainer.global_step:  # resumed by fit(ckpt_path=...)
            # ModelCheckpoint does not keep the step it last saved at in its state, so after a resume its
            # every_n_train_steps test passes again at the first batch, while global_step is still the restored one:
            # under accumulation that batch is mid-window, and the save (of the very step the run resumed from) would
            # meet save_checkpoint's refusal of kept micro-batches. DDP rewrites the file there; it holds that step.
            for callback in trainer.checkpoint_callbacks:
                if getattr(callback, "_last_global_step_saved", trainer.global_step) < trainer.global_step:
                    callback._last_global_step_saved = trainer.global_step

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # the fzero step took the gradient and updated already

    # -- evaluation ------------------------------------------------------------------------------------------------
    def _evaluate(self, method: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        self._calls.append(_Call(method, args, kwargs))
        try:
            return self.step.evaluate(self.state, batch).get("aux")
        finally:
            self._calls.clear()

    def validation_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", batch, *args, **kwargs)

    def test_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", batch, *args, **kwargs)

    def predict_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("predict_step", batch, *args, **kwargs)

    def on_train_end(self) -> None:
        if self.load_trained:  # a collective under torchrun: every rank is here
            module = self.lightning_module
            self._restore_frozen()
            module.load_state_dict(self.step.state_dict(self.state, module))

    def _trained_after_failure(self, module: Any) -> None:
        """A fit that ended in an exception (Ctrl-C in a notebook, which Lightning turns into a graceful stop; an error
        in a step): the values the steps trained so far go into the module, as Lightning's own strategies leave them
        there, so that a second ``fit`` continues from them. Before, the module kept its values from setup and a second
        fit restarted from them, without a word. On one process only: under torchrun the gather may meet another rank's
        step (the exception may be this rank's alone), so the module is left as it was and a warning says how to load."""
        fix = ("module.load_state_dict(trainer.strategy.step.state_dict(trainer.strategy.state, module))"
               + (" on every rank" if self.world_size > 1 else ""))
        if self.world_size > 1:
            warnings.warn(f"FZeroStrategy: fit ended in an exception, and the module still holds its values from before "
                          f"fit (the steps train trainer.strategy.state, and loading it is a collective this rank cannot "
                          f"start alone here). A second fit would start from those; put the trained values in first: {fix}.",
                          RuntimeWarning, stacklevel=3)
            return
        try:
            self._restore_frozen()
            module.load_state_dict(self.step.state_dict(self.state, module))
        except Exception as e:  # a state spent by a step interrupted in its in-place update: nothing whole to load
            warnings.warn(f"FZeroStrategy: fit ended in an exception, and the trained values could not be loaded into "
                          f"the module ({type(e).__name__}: {e}); it holds its values from before fit, and a second fit "
                          f"would start from those. Resume from a checkpoint.", RuntimeWarning, stacklevel=3)

    def _restore_frozen(self) -> None:
        """The frozen params ``shard_frozen`` took from the module, back into it (a collective under torchrun)."""
        if self._emptied:
            self.step.restore_frozen(self.state, self.lightning_module)
            self._emptied = False

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self._failed = True  # teardown follows on this process alone: see there

    def teardown(self) -> None:
        # step and state stay for the caller (trainer.strategy.state); the next setup makes new ones
        self._kept, self._calls = [], collections.deque()
        failed, self._failed = self._failed, False
        from_checkpoint, self._from_checkpoint = self._from_checkpoint, False
        module = self.lightning_module
        fitted, self._fitting = self._fitting, False
        if module is not None and failed and fitted and self.load_trained:
            self._trained_after_failure(module)
        if module is not None and self._emptied and failed and self.world_size > 1:
            # an exception may be this rank's alone: restore_frozen's gather would meet the other ranks' step
            # collectives (a gloo abort, or "ranks disagree", in place of the error); the module stays emptied
            # (its frozen params are meta), and Lightning's teardown, which moves the module to the CPU, cannot copy it
            self._emptied = False
            warnings.warn("FZeroStrategy: the run failed, and the module's frozen params (shard_frozen=True) were left "
                          "emptied (meta tensors): their values are in trainer.strategy.state, and "
                          "trainer.strategy.step.restore_frozen(trainer.strategy.state, module) on every rank puts them back.",
                          RuntimeWarning, stacklevel=2)
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = module
            return
        if module is not None:
            self._restore_frozen()  # after validate/test/predict too: the user's module is whole again
            if from_checkpoint and self.load_trained and not failed:
                # trainer.validate/test/predict(ckpt_path=...): the checkpoint's weights into the module, as Lightning's
                # own strategies load them there, so that the module and a later call without ckpt_path use them (a
                # collective under torchrun, as at the end of fit)
                module.load_state_dict(self.step.state_dict(self.state, module))
        super().teardown()

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the params are in the fzero checkpoint beside Lightning's file, not gathered here

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """``filepath`` becomes a directory: ``fzero/`` (the sharded state, ``fzero.checkpoint.save``) and
        ``lightning.ckpt`` (Lightning's loops, callbacks, epoch, lr schedulers, hyperparameters)."""
        if storage_options is not None:
            raise TypeError("FZeroStrategy: Trainer.save_checkpoint(storage_options=...) is not supported: the state is "
                            "written by fzero.checkpoint, not by a CheckpointIO plugin.")
        if self._kept:
            raise RuntimeError(
                f"FZeroStrategy: a checkpoint was asked for with {len(self._kept)} micro-batches kept for the next step "
                f"(accumulate_grad_batches={self.lightning_module.trainer.accumulate_grad_batches}); they would be lost. "
                f"Save at an optimizer step: ModelCheckpoint(every_n_train_steps=...) or at the end of an epoch; a save "
                f"after validation (ModelCheckpoint(monitor=...)) needs a val_check_interval that is a multiple of "
                f"accumulate_grad_batches, and ModelCheckpoint(train_time_interval=...) saves at any batch."
            )
        path = str(self.broadcast(str(filepath)))  # rank 0's name: every rank writes into one checkpoint
        if self.is_global_zero:
            os.makedirs(path, exist_ok=True)
        self.barrier("FZeroStrategy.save_checkpoint")
        # with the module's frozen params, as DeepSpeed's strategy saves the whole module
        fzero.checkpoint.save(os.path.join(path, _FZERO_DIR), self.state, model=self.lightning_module)
        if self.is_global_zero:
            own = {k: v for k, v in checkpoint.items() if k != "state_dict"}
            self.checkpoint_io.save_checkpoint(own, os.path.join(path, _LIGHTNING_FILE))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(checkpoint_path)
        if not os.path.isfile(os.path.join(path, _LIGHTNING_FILE)):
            raise FileNotFoundError(
                f"FZeroStrategy: {path!r} is not a checkpoint that FZeroStrategy wrote (a directory holding "
                f"{_LIGHTNING_FILE} and {_FZERO_DIR}/). Pass the path ModelCheckpoint or trainer.save_checkpoint gave."
            )
        checkpoint = self.checkpoint_io.load_checkpoint(os.path.join(path, _LIGHTNING_FILE), weights_only=weights_only)
        # outside fit (trainer.validate/test/predict with ckpt_path=) the step has no optimizer: the weights only
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        # shard_frozen: into the state setup made, whose frozen params stay sharded (a state like=step makes reads them
        # from the module)
        like = self.state if self._emptied else self.step
        self.state = fzero.checkpoint.load(os.path.join(path, _FZERO_DIR), like=like, model=self.lightning_module,
                                           optimizer=fitting)
        self._from_checkpoint = not fitting  # loaded into the module at teardown (fit: at its end, on_train_end)
        return {**checkpoint, "state_dict": {}}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the state into the step

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)  # a directory: removed recursively

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        names = {
            "fzero": ("fzero, ZeRO stage 2", {"stages": 2}),
            "fzero_stage_1": ("fzero ZeRO stage 1", {"stages": 1}),
            "fzero_stage_2": ("fzero ZeRO stage 2", {"stages": 2}),
            "fzero_stage_2_offload": ("fzero ZeRO stage 2 and CPU offload", {"stages": 2, "offload": "cpu"}),
            "fzero_stage_3": ("fzero ZeRO stage 3", {"stages": 3}),
            "fzero_stage_3_offload": ("fzero ZeRO stage 3 and CPU offload of the optimizer and the params",
                                      {"stages": 3, "offload": "cpu", "offload_params": True}),
        }
        for name, (description, kwargs) in names.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **kwargs)


def _training_loss(out: Any, owner: str) -> Any:
    """The loss (and the other outputs, detached) of what ``training_step`` returned, as ``loss_fn`` returns them."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        rest = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.items() if k != "loss"}
        return (out["loss"], rest) if rest else out["loss"]
    if out is None:
        raise ValueError(
            f"FZeroStrategy: {owner}.training_step returned None, which Lightning takes as 'skip this batch'. An fzero step "
            f"has no skipped batch (every rank runs the same collectives). Return the loss, or filter the batches in the "
            f"DataLoader."
        )
    raise TypeError(f"FZeroStrategy: {owner}.training_step must return the loss tensor or a dict with 'loss', as "
                    f"Lightning's automatic optimization asks; got {type(out).__name__}.")


def _path_of(batch: Any, i: int, is_leaf: Any = None) -> str:
    """How a user writes the ``i``-th leaf of ``batch``: ``["input_ids"]``, ``[0]``."""
    return pytree.keystr(pytree.tree_flatten_with_path(batch, is_leaf=is_leaf)[0][i][0])


def _join(batches: list[Any], k: int) -> Any:
    """k micro-batches as one batch that ``grad_accum=k`` splits back into them: tensors joined on dim 0. A detection
    batch's lists of one record per row (images of their own sizes, target dicts: ``fzero.step.record_list``) are
    joined as lists, image by image, where the step reads them as rows (``fzero.step.batch_rows``: where reading every
    tensor's dim 0 as rows disagrees); each tensor's dim 0 joined would make one image of two images' channels."""
    if k == 1:
        return batches[0]
    records = any(batch_rows(b)[1] for b in batches)
    listed = record_list if records else (lambda x: False)
    rows = {len(x) if listed(x) else x.shape[0] for b in batches for x in pytree.tree_leaves(b, is_leaf=listed)
            if listed(x) or (isinstance(x, torch.Tensor) and x.dim() > 0)}
    # default_collate's list of the rows' strings (ids, texts) is rows too, joined as the tensors are: the step splits
    # it back into the micro-batches' own (fzero.step._batch), where as separate leaves it differed between them
    row = next(iter(rows)) if len(rows) == 1 else None
    per_row = lambda x: listed(x) or per_row_items(x, row)  # noqa: E731
    flat = [pytree.tree_flatten(b, is_leaf=per_row) for b in batches]
    spec = flat[0][1]
    if any(s != spec for _, s in flat) or len(rows) > 1:
        counted = (" (a list of one image or one target dict per row counted by its length, as the step counts a "
                   "detection batch's rows)") if records else ""
        raise ValueError(
            f"FZeroStrategy: Trainer(accumulate_grad_batches={k}) runs {k} micro-batches as one fzero step, which needs "
            f"them alike: the same structure and rows ({sorted(rows)} here{counted}). Use DataLoader(drop_last=True) "
            f"so that every batch has batch_size rows."
        )
    joined = []
    for i, leaves in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = leaves[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            shapes = sorted({tuple(x.shape[1:]) for x in leaves})
            if len(shapes) > 1:  # torch.cat would say only "Sizes of tensors must match except in dimension 0"
                raise ValueError(
                    f"FZeroStrategy: Trainer(accumulate_grad_batches={k}) runs {k} micro-batches as one fzero step, whose "
                    f"batch entries must have one shape; batch{_path_of(batches[0], i, per_row)} has rows of shapes {shapes} "
                    f"across them (a collate that pads each batch to its own longest sequence?). Pad to a fixed "
                    f"length in the collate function (e.g. a tokenizer's padding='max_length'), or use "
                    f"accumulate_grad_batches=1."
                )
            joined.append(torch.cat(leaves))
        elif per_row(first):
            joined.append(type(first)(item for items in leaves for item in items))
        elif all(x is first or (not isinstance(x, torch.Tensor) and x == first) for x in leaves):
            joined.append(first)
        else:
            raise ValueError(
                f"FZeroStrategy: Trainer(accumulate_grad_batches={k}) joins {k} micro-batches into one fzero step, but a "
                f"batch entry without rows ({type(first).__name__}) differs between them. Give every entry the batch's "
                f"rows on dim 0."
            )
    out = pytree.tree_unflatten(joined, spec)
    if records:
        _check_joined(out, k, row)
    return out


def _check_joined(joined: Any, k: int, row: int | None) -> None:
    """The step reads the joined batch's rows as its micro-batches' images were joined, one record per row
    (``fzero.step.batch_rows``), so that ``grad_accum`` splits it back into them: a joined detection batch whose every
    tensor has one dim 0 (DETR's ``pixel_values`` of k*n rows beside labels of k*n boxes per image) would be split on
    dim 0, each image's boxes between the micro-batches."""
    rows, as_records = batch_rows(joined)
    if as_records and {n for _, n in rows} == {k * row if row is not None else None}:
        return
    raise ValueError(
        f"FZeroStrategy: Trainer(accumulate_grad_batches={k}) joins {k} micro-batches of {row} images, image by image "
        f"(lists of one image or one target dict per row, counted by their length), into one "
        f"fzero step, which splits it back on the rows it reads; joined, it reads otherwise ({rows_listed(rows, limit=4)}), so the "
        f"micro-batches would not come back as training_step was given them: a detection batch's lists are its rows "
        f"only where its tensors' dim 0 disagree, and here every tensor has one (each image's box count equals the "
        f"joined rows, {k * row if row is not None else '?'}). Use accumulate_grad_batches=1 with batches of "
        f"accumulate_grad_batches times the images, or another batch_size."
    )

