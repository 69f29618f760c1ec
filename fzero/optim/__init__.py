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
    "constant_schedule",
    "cosine_decay_schedule",
    "current_segments",
    "decay_mask",
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
from fzero.optim._groups import recording_groups
from fzero.optim._base import use_segments
from fzero.optim._base import ScheduleValues, scheduled  # fzero.step: one value per schedule a step (RankContext.schedules)
