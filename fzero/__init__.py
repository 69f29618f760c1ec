"""fzero: DeepSpeed's ZeRO as pure transforms of a functional train step, on ``torch.func``.

Training state is a pytree; ``shard_optimizer``/``shard_grads``/``shard_params`` (and, next, ``offload``)
are pure functions from a step to a step, lowered to the collectives of a mesh.
"""

from fzero import checkpoint, memory, optim, testing
from fzero import config  # DeepSpeed config files: fzero.config.from_deepspeed
from fzero._comm import Call, Counter, MeshTimeout
from fzero._compile import compile
from fzero._estimate import MemoryEstimate, estimate_memory
from fzero._mesh import DistMesh, LocalMesh, count_collectives, dist_mesh, local_mesh
from fzero._buffers import buffers_of
from fzero._module import apply, params_of
from fzero._precision import DynamicLossScale, Precision, StaticLossScale
from fzero._remat import remat
from fzero._sharded import ReplicatedParams, ShardedParams, UnitParams
from fzero._state import RankStates, TrainState
from fzero._step import Step, train_step
from fzero._units import units_of
from fzero._zero import offload, shard_grads, shard_optimizer, shard_params

__version__ = "0.1.0"

__all__ = [
    "Call",
    "Counter",
    "DistMesh",
    "DynamicLossScale",
    "LocalMesh",
    "MemoryEstimate",
    "MeshTimeout",
    "Precision",
    "RankStates",
    "ReplicatedParams",
    "ShardedParams",
    "StaticLossScale",
    "UnitParams",
    "Step",
    "TrainState",
    "apply",
    "buffers_of",
    "checkpoint",
    "compile",
    "config",
    "count_collectives",
    "dist_mesh",
    "estimate_memory",
    "local_mesh",
    "memory",
    "offload",
    "optim",
    "params_of",
    "remat",
    "shard_grads",
    "shard_optimizer",
    "shard_params",
    "testing",
    "train_step",
    "units_of",
]
