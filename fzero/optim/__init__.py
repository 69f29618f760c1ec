"""Optimizers as pure (init, update) pairs, optax-style, with in-place fused steps for ZeRO's flat buffers.

```python
opt = fzero.optim.adamw(3e-4, weight_decay=0.1)
state = opt.init(params)
updates, state = opt.update(grads, state, params)      # pure
params = fzero.optim.apply_updates(params, updates)
state = fzero.optim.apply_inplace(opt, grads, state, params)   # or: the whole step in place (fused kernel)
```

Parameter groups (torch.optim's param groups) are optax's ``masked`` and ``multi_transform``, decided on the params
pytree and working on ZeRO's flat shards: ``adamw(3e-4, weight_decay=0.1, mask=fzero.optim.decay_mask)`` decays
no biases, norms or positional tables; ``multi_transform({"a": adamw(1e-3), "b": adamw(1e-4)}, labels)`` gives
each group its own optimizer.

A transform of your own gets those flat buffers, at stages 1-3 only this rank's shard of each: element-wise
arithmetic works unchanged, a reduction over the updates does not (it sees one rank's share). ``global_norm`` and
``clip_by_global_norm`` (optax's) add the ranks' shares.
"""

from fzero.optim._alias import adam, adamw, sgd
from fzero.optim._base import (
    EmptyState,
    GradientTransformation,
    LearningRate,
    Schedule,
    apply_inplace,
    apply_updates,
    chain,
    identity,
)
from fzero.optim._decay import decay_mask, no_decay_names
from fzero.optim._groups import MaskedState, MultiTransformState, masked, multi_transform
from fzero.optim._lamb import ScaleByLambState, lamb, scale_by_lamb
from fzero.optim._lion import ScaleByLionState, lion, scale_by_lion
from fzero.optim._schedules import (
    OneCycleSchedule,
    constant_schedule,
    cosine_decay_schedule,
    linear_schedule,
    lr_range_test,
    one_cycle,
    warmup_cosine_decay_schedule,
    warmup_cosine_lr,
    warmup_decay_lr,
    warmup_lr,
)
from fzero.optim._base import Segments, WholeLeaves, current_segments, use_segments
from fzero.optim._transforms import (
    ScaleByAdamState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    clip_by_global_norm,
    global_norm,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    set_to_zero,
    trace,
)

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "LearningRate",
    "MaskedState",
    "MultiTransformState",
    "OneCycleSchedule",
    "ScaleByAdamState",
    "ScaleByLambState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "Schedule",
    "Segments",
    "TraceState",
    "WholeLeaves",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_inplace",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "current_segments",
    "decay_mask",
    "global_norm",
    "identity",
    "lamb",
    "linear_schedule",
    "lion",
    "masked",
    "multi_transform",
    "no_decay_names",
    "lr_range_test",
    "one_cycle",
    "scale",
    "scale_by_adam",
    "scale_by_lamb",
    "scale_by_learning_rate",
    "scale_by_lion",
    "set_to_zero",
    "sgd",
    "trace",
    "use_segments",
    "warmup_cosine_decay_schedule",
    "warmup_cosine_lr",
    "warmup_decay_lr",
    "warmup_lr",
]

# What other packages use of this one (they import it from here, never from a private module):
from fzero.optim._groups import finding_groupings, for_file, probe_groupings, recording_groups, refused_labels  # fzero.step, fzero.checkpoint
from fzero.optim._base import use_segments
from fzero.optim._base import ScheduleValues, scheduled  # fzero.step: one value per schedule a step (RankContext.schedules)


# optax names with no function of that name here: what does the same in fzero. An optax user reaching for one gets
# the way instead of a bare AttributeError.
_SCHEDULE = ("any function of the step count is a schedule: fzero.optim.adamw(lambda step: ...) (fzero.optim has "
             "constant, linear, cosine_decay, warmup_cosine_decay and DeepSpeed's warmup_lr, warmup_decay_lr, "
             "warmup_cosine_lr, one_cycle, lr_range_test)")
_OTHER_OPTIMIZER = ("fzero.optim has adamw, adam, sgd, lamb and lion; another optimizer is a GradientTransformation "
                    "(init, update) of your own, built with fzero.optim.chain")
_OPTAX = {
    "MultiSteps": "gradient accumulation is the step's: fzero.compile(..., grad_accum=k)",
    "apply_if_finite": "skipping a step whose gradients are not finite is the step's: fzero.compile(..., "
                       "on_nonfinite='skip') (metrics['skipped'] says which)",
    "inject_hyperparams": "a learning rate the loop changes is a schedule that reads it: "
                          "fzero.optim.adamw(lambda step: lr['now'])",
    "clip": "clip by the global norm instead: fzero.compile(..., clip_grad_norm=c) or fzero.optim.clip_by_global_norm(c)",
    "adaptive_grad_clip": _OTHER_OPTIMIZER,
    "zero_nans": "fzero.compile(..., on_nonfinite='skip') skips a step whose gradients hold NaN or inf",
    **{name: _SCHEDULE for name in ("exponential_decay", "piecewise_constant_schedule", "join_schedules",
                                    "polynomial_schedule", "cosine_onecycle_schedule", "linear_onecycle_schedule",
                                    "piecewise_interpolate_schedule", "warmup_exponential_decay_schedule",
                                    "sgdr_schedule")},
    **{name: _OTHER_OPTIMIZER for name in ("adafactor", "adagrad", "adamax", "adamaxw", "adabelief", "amsgrad",
                                           "nadam", "nadamw", "radam", "rmsprop", "lars", "novograd", "yogi",
                                           "fromage", "sm3", "noisy_sgd", "sign_sgd", "polyak_sgd", "lbfgs")},
}


def __getattr__(name: str) -> object:
    if name in _OPTAX:
        raise AttributeError(f"module 'fzero.optim' has no attribute {name!r} (optax's {name}): {_OPTAX[name]}.")
    raise AttributeError(f"module 'fzero.optim' has no attribute {name!r}")
