"""What a Lightning run sets, as fzero's settings: the optimizer ``configure_optimizers`` returns, the Trainer's
precision, clipping and accumulation; and the settings that have no fzero counterpart, refused by name.

Nothing here imports Lightning at module level beyond what the strategy module already did.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fzero

# Trainer(precision=...) -> fzero's policy. bf16-true and 16-mixed keep fp32 master weights and optimizer states
# in fzero (Lightning's "-true" keeps the weights themselves in 16 bits); the module docstring of fzero.lightning
# says what differs from torch.autocast.
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16"}

# LightningModule hooks that run between backward and the optimizer step: an fzero step owns both, so there is no
# place to call them.
_BETWEEN_BACKWARD_AND_STEP = ("backward", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                              "configure_gradient_clipping")


def precision_of(plugin: Any) -> str:
    """fzero's precision for the Trainer's precision plugin (its ``precision`` string), or a named error."""
    value = getattr(plugin, "precision", None)
    if value in PRECISIONS and type(plugin).__module__.startswith("lightning.pytorch.plugins.precision"):
        return PRECISIONS[value]
    raise ValueError(
        f"FZeroStrategy: Trainer(precision={value!r}) (precision plugin {type(plugin).__name__}) has no fzero policy. "
        f"Use precision='32-true', 'bf16-mixed' (or 'bf16-true'), or '16-mixed'; fzero keeps fp32 master weights under "
        f"each, so '16-true' is '16-mixed' here and 64-bit or transformer-engine precision does not exist."
    )


def check_module(module: Any, trainer: Any) -> None:
    """Refuse, by name, what a LightningModule or the Trainer asks for that an fzero step cannot do."""
    from lightning.pytorch import Callback, LightningModule
    from lightning.pytorch.callbacks import BaseFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not module.automatic_optimization:
        raise ValueError(
            f"FZeroStrategy: {type(module).__name__}.automatic_optimization is False (manual optimization). An fzero step "
            f"owns the forward, the backward and the update, so manual_backward and optimizer.step() in training_step have "
            f"no place. Set automatic_optimization = True and return the loss from training_step, or write the loop with "
            f"fzero.compile directly (docs/migrating.md)."
        )
    for hook in _BETWEEN_BACKWARD_AND_STEP:
        if is_overridden(hook, module, parent=LightningModule):
            raise ValueError(
                f"FZeroStrategy: {type(module).__name__} overrides {hook}(), which Lightning runs between backward and the "
                f"optimizer step. An fzero step takes the gradient and updates in one call, so it would never run. Remove "
                f"it: clipping is Trainer(gradient_clip_val=...), the gradient norm is logged by the strategy as "
                f"'fzero/grad_norm', and gradient surgery is an fzero.optim transform."
            )
    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):  # as Lightning refuses it for DeepSpeed and FSDP
            raise TypeError(
                "FZeroStrategy: the StochasticWeightAveraging callback averages the LightningModule's own parameters, "
                "which fzero does not train (the step's state does), so its average would be of the initial weights and "
                "then be overwritten by the trained ones when fit ends. Remove the callback; average the states' params "
                "(trainer.strategy.step.gather(trainer.strategy.state)) in your own callback, or use DDP for SWA."
            )
        if isinstance(callback, BaseFinetuning):
            raise TypeError(
                f"FZeroStrategy: the {type(callback).__name__} callback freezes and unfreezes modules during fit; fzero's "
                f"state fixes which params train when fit starts (as DeepSpeed's engine fixes its optimizer's groups). Run "
                f"one Trainer.fit per phase, freezing before each (in __init__ or configure_model), and carry the weights "
                f"between them with load_state_dict."
            )
        if isinstance(callback, GradientAccumulationScheduler):
            raise TypeError(
                "FZeroStrategy: the GradientAccumulationScheduler callback changes accumulate_grad_batches during fit; an "
                "fzero step is compiled for one grad_accum. Use Trainer(accumulate_grad_batches=k) with a fixed k."
            )
        for hook in ("on_before_backward", "on_after_backward", "on_before_optimizer_step"):
            if is_overridden(hook, callback, parent=Callback):
                raise ValueError(
                    f"FZeroStrategy: the callback {type(callback).__name__} implements {hook}, which Lightning runs between "
                    f"backward and the optimizer step; an fzero step does both in one call, so it would never run. Remove "
                    f"the callback (the gradient norm is logged as 'fzero/grad_norm')."
                )
    algorithm = trainer.gradient_clip_algorithm
    if trainer.gradient_clip_val and str(getattr(algorithm, "value", algorithm)) not in ("norm", "None"):
        raise ValueError(
            f"FZeroStrategy: Trainer(gradient_clip_algorithm={str(getattr(algorithm, 'value', algorithm))!r}) clips each "
            f"gradient element; fzero clips the global norm only. Use gradient_clip_algorithm='norm' (the default)."
        )


def clip_of(trainer: Any) -> float | None:
    """``compile``'s ``clip_grad_norm`` from ``Trainer(gradient_clip_val=...)``: None or 0 is no clipping, as in Lightning.

    A negative value or NaN is refused here, by the Trainer's name: Lightning passes it on to ``clip_grad_norm_``, whose
    factor ``max_norm / norm`` is then negative and flips every gradient (gradient ascent, silently), and NaN makes every
    gradient NaN (torch 2.13). ``compile``'s own error would name a keyword the script never wrote."""
    value = trainer.gradient_clip_val
    if not value:
        return None
    if not float(value) > 0:
        raise ValueError(
            f"FZeroStrategy: Trainer(gradient_clip_val={value!r}) is not a norm to clip at: it must be > 0 (None or 0: no "
            f"clipping). Plain Lightning would multiply the gradients by max_norm / norm: a negative factor (gradient ascent) or NaN."
        )
    return float(value)


def check_clip_outside(optimizer: "Optimizer", clip: float | None, module: Any) -> None:
    """Refuse clipping when trainable params lie outside the optimizer's groups (an optimizer built on a head's params
    while the backbone keeps ``requires_grad=True``).

    Lightning clips ``clip_grad_norm_`` over the optimizer's params only (``Precision.main_params``), so their
    gradients count in no norm there. An fzero step clips the global norm of every param the state trains, and the
    state trains every param with ``requires_grad=True`` (those are updated by nothing, ``set_to_zero``): their
    gradients would enlarge the norm and shrink the update of the rest, silently (measured: 1.2% of the head's
    movement after 4 steps of a CNN at ``gradient_clip_val=0.05``). Freezing them trains the same numbers in Lightning
    and here; adding them to the optimizer trains them in both."""
    if clip is None or not optimizer.outside:
        return
    names = list(optimizer.outside)
    shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"FZeroStrategy: Trainer(gradient_clip_val={clip:g}) with trainable parameters that are in no param group of "
        f"{type(optimizer.torch).__name__}: {shown}. Lightning clips the norm of the optimizer's params only, and fzero "
        f"clips the norm of every trainable param, so their gradients would shrink the update of the others. Freeze "
        f"them in {type(module).__name__} (requires_grad_(False) in __init__ or configure_model: Lightning then trains "
        f"the same numbers), or put them in the optimizer."
    )


def _live(optimizer: torch.optim.Optimizer, index: int, key: str) -> Callable[[int], float]:
    """The schedule fzero evaluates at each step: the value the torch optimizer's group holds now.

    Lightning steps the torch lr scheduler (any of them, by step or epoch, ReduceLROnPlateau too) after each
    optimizer step, writing the next lr into ``optimizer.param_groups``; a torch optimizer reads it there at its
    next step, and so does this. ``param_groups`` is looked up each time: ``load_state_dict`` replaces its dicts.
    """

    def schedule(step: int) -> float:
        return float(optimizer.param_groups[index][key])

    return schedule


class Optimizer:
    """The fzero optimizer for a torch optimizer, and the check that the settings it was made from still hold."""

    def __init__(self, torch_optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
        self.torch = torch_optimizer
        names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        groups, labels = {}, {}
        self._fixed = []  # (group index, key, value) the fzero optimizer was built with
        for i, group in enumerate(torch_optimizer.param_groups):
            groups[f"group{i}"] = self._one(type(torch_optimizer), i, group)
            for p in group["params"]:
                if id(p) not in names:
                    if p.requires_grad:
                        raise ValueError(
                            f"FZeroStrategy: param group {i} of {type(torch_optimizer).__name__} holds a tensor of shape "
                            f"{tuple(p.shape)} that is not a parameter of {type(module).__name__}; fzero trains the module's "
                            f"parameters only. Build the optimizer from self.parameters() (or named groups of them)."
                        )
                    continue
                labels[names[id(p)]] = f"group{i}"
        left = [n for n in names.values() if n not in labels]
        self.outside = tuple(left)  # trainable, but in no group: Lightning neither updates nor clips them
        if left:  # trainable, but in no group: torch leaves them as they are
            groups["not_in_optimizer"] = fzero.optim.set_to_zero()
            labels.update({n: "not_in_optimizer" for n in left})
        if len(groups) == 1:
            self.fzero = groups["group0"]
        else:
            self.fzero = fzero.optim.multi_transform(groups, labels)

    def _one(self, kind: type, i: int, group: dict) -> Any:
        lr = _live(self.torch, i, "lr")
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"FZeroStrategy: {kind.__name__}({flag}=True) (param group {i}) does not exist in fzero.optim. "
                    f"Use {flag}=False."
                )
        if kind in (torch.optim.AdamW, torch.optim.Adam):
            b1, b2 = (float(b) for b in group["betas"])
            eps, wd = float(group["eps"]), float(group["weight_decay"])
            self._fixed += [(i, "betas", (b1, b2)), (i, "eps", eps), (i, "weight_decay", wd)]
            if kind is torch.optim.AdamW or group.get("decoupled_weight_decay"):  # Adam(decoupled_weight_decay=True) is AdamW
                return fzero.optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
            if wd:
                raise ValueError(
                    f"FZeroStrategy: torch.optim.Adam(weight_decay={wd}) (param group {i}) adds an L2 term to the gradient, "
                    f"which fzero.optim.adam does not. Use torch.optim.AdamW (decoupled decay) or weight_decay=0."
                )
            return fzero.optim.adam(lr, b1=b1, b2=b2, eps=eps)
        if kind is torch.optim.SGD:
            if group["dampening"]:
                raise ValueError(f"FZeroStrategy: torch.optim.SGD(dampening={group['dampening']}) (param group {i}) does not "
                                 f"exist in fzero.optim.sgd. Use dampening=0.")
            momentum, wd = float(group["momentum"]), float(group["weight_decay"])
            self._fixed += [(i, "momentum", momentum), (i, "weight_decay", wd), (i, "nesterov", bool(group["nesterov"]))]
            return fzero.optim.sgd(lr, momentum=momentum, nesterov=bool(group["nesterov"]), weight_decay=wd)
        raise ValueError(
            f"FZeroStrategy: configure_optimizers returned {kind.__module__}.{kind.__name__}, which fzero has no "
            f"counterpart for. Return torch.optim.AdamW, torch.optim.Adam or torch.optim.SGD (param groups and any lr "
            f"scheduler allowed); fzero.optim also has LAMB and Lion, usable with fzero.compile directly."
        )

    def check_unchanged(self) -> None:
        """Before a step: the group settings other than lr still are what the fzero optimizer was built with (a
        scheduler that cycles momentum, or code that edits them, would otherwise be ignored)."""
        for i, key, value in self._fixed:
            now = self.torch.param_groups[i][key]
            now = tuple(float(b) for b in now) if key == "betas" else type(value)(now)
            if now != value:
                raise ValueError(
                    f"FZeroStrategy: {type(self.torch).__name__}.param_groups[{i}][{key!r}] changed from {value} to {now} "
                    f"during fit (a scheduler with cycle_momentum=True, or code that sets it). fzero follows the lr only. "
                    f"Keep {key!r} fixed (e.g. OneCycleLR(..., cycle_momentum=False))."
                )
