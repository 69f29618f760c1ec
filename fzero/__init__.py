"""fzero: DeepSpeed's ZeRO as pure transforms of a functional train step, on ``torch.func``.

Training state is a pytree; ``shard_optimizer``/``shard_grads``/``shard_params``/``offload`` are pure
functions from a step to a step, lowered to the collectives of a mesh. ``compile`` composes them.

The names below are the public API (the transforms, ``compile``, the step and its state, plus the policy and mesh
types users pass around; docs/architecture.md). The subpackages users reach as attributes (``fzero.optim``,
``fzero.checkpoint``, ``fzero.config``, ``fzero.estimate``, ``fzero.memory``, ``fzero.models``, ``fzero.data``, ``fzero.testing``) are imported on
first use, so ``import fzero`` does not pay for torch.distributed.checkpoint or the config reader.
"""

import importlib
import warnings
from typing import Any

from fzero._compile import compile
from fzero.autodiff import remat
from fzero.mesh import (
    Comm,
    CommWrapper,
    MeshTimeout,
    RankFailed,
    RankStopped,
    DistMesh,
    LocalMesh,
    count_collectives,
    dist_mesh,
    local_mesh,
    wrap_comm,
)
from fzero.estimate import MemoryEstimate, estimate_memory
from fzero.layout import empty_params, units_of
from fzero.step import (
    buffers_of,
    apply,
    free_frozen,
    frozen_of,
    params_of,
    DynamicLossScale,
    Precision,
    StaticLossScale,
    TrainState,
    Step,
    train_step,
    ZeroGradientWarning,
)
from fzero.zero import CPUOffload, DiskOffload, offload, remat_units, shard_grads, shard_optimizer, shard_params

__version__ = "0.1.0"

# imported on first use; "lightning" (with Lightning itself) is not in __all__, so that `import *` never needs it
_SUBMODULES = ("checkpoint", "config", "data", "estimate", "lightning", "memory", "models", "ops", "optim", "testing")

# Internals that fzero used to export: still reachable as fzero.<name>, with a DeprecationWarning that says
# where the object lives and what users reach it through.
_INTERNAL = {
    "Call": ("fzero.mesh._comm", "a collective as recorded in fzero.count_collectives(mesh).counter.calls"),
    "Counter": ("fzero.mesh._comm", "get a mesh's counter as fzero.count_collectives(mesh).counter"),
    "RankStates": ("fzero.step._state", "the state of a step on fzero.local_mesh(n); state[r] is rank r's TrainState"),
    "ReplicatedParams": ("fzero.zero._sharded", "the params fzero.apply receives inside a step; step.gather(state) gives the full params"),
    "ShardedParams": ("fzero.zero._sharded", "the params fzero.apply receives inside a step; step.gather(state) gives the full params"),
    "UnitParams": ("fzero.zero._sharded", "the params fzero.apply receives inside a step; step.gather(state) gives the full params"),
}

__all__ = [
    "CPUOffload",
    "Comm",
    "CommWrapper",
    "DiskOffload",
    "DistMesh",
    "DynamicLossScale",
    "LocalMesh",
    "MemoryEstimate",
    "MeshTimeout",
    "Precision",
    "RankFailed",
    "RankStopped",
    "StaticLossScale",
    "Step",
    "TrainState",
    "ZeroGradientWarning",
    "apply",
    "buffers_of",
    "checkpoint",
    "compile",
    "config",
    "count_collectives",
    "data",
    "dist_mesh",
    "empty_params",
    "estimate",
    "estimate_memory",
    "local_mesh",
    "memory",
    "models",
    "offload",
    "ops",
    "optim",
    "params_of",
    "free_frozen",
    "frozen_of",
    "remat",
    "remat_units",
    "shard_grads",
    "shard_optimizer",
    "shard_params",
    "testing",
    "train_step",
    "units_of",
    "wrap_comm",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fzero.{name}")  # also binds it here, so this runs once per name
    if name in _INTERNAL:
        module, use = _INTERNAL[name]
        warnings.warn(
            f"fzero.{name} is internal and no longer exported from fzero ({use}). "
            f"If you need the class itself, import it from {module}: `from {module} import {name}`.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
