"""fzero: DeepSpeed's ZeRO as pure transforms of a functional train step, on ``torch.func``.

Training state is a pytree; ``shard_optimizer``/``shard_grads``/``shard_params`` (and, next, ``offload``)
are pure functions from a step to a step, lowered to the collectives of a mesh.
"""

from fzero import checkpoint, memory, optim, testing
from fzero import config  # DeepSpeed config files: fzero.config.from_deepspeed
from fzero.dist._comm import Call, Counter, MeshTimeout
from fzero._compile import compile
from fzero.estimate._estimate import MemoryEstimate, estimate_memory
from fzero.dist._mesh import DistMesh, LocalMesh, count_collectives, dist_mesh, local_mesh
from fzero.step._buffers import buffers_of
from fzero.step._module import apply, params_of
from fzero.step._precision import DynamicLossScale, Precision, StaticLossScale
from fzero.autodiff._remat import remat
from fzero.zero._sharded import ReplicatedParams, ShardedParams, UnitParams
from fzero.step._state import RankStates, TrainState
from fzero.step._step import Step, train_step
from fzero.layout._units import units_of
from fzero.zero._transforms import offload, shard_grads, shard_optimizer, shard_params

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
