"""The ZeRO transforms and what they plug into a step: sharded units, gathers, offload.

Each transform is a pure function from a ``Step`` to a ``Step`` that replaces typed parts of it
(``fzero.step._parts``) and checks that what it needs is inside it, so the order of composition is
checked rather than a convention:

    s = fzero.train_step(loss_fn, opt)    # stage 0: ParamsReplicated, GradsAllReduce, OptStateReplicated
    s = fzero.shard_optimizer(s, mesh)    # ZeRO-1: GradsReduceScatter, OptStateSharded
    s = fzero.shard_grads(s)              # ZeRO-2: GradsInBackward (units are modules)
    s = fzero.shard_params(s)             # ZeRO-3: ParamsSharded
    s = fzero.offload(s, "cpu")           # OptStateSharded(offload=CPUOffload())
"""

from fzero.zero._offloading import offload
from fzero.zero._policies import CPUOffload, DiskOffload
from fzero.zero._stages import (GradsInBackward, GradsReduceScatter, OptStateSharded, ParamsSharded, remat_units, shard_grads,
                                shard_optimizer, shard_params)

__all__ = ["CPUOffload", "DiskOffload", "GradsInBackward", "GradsReduceScatter", "OptStateSharded", "ParamsSharded", "offload", "remat_units", "shard_grads",
           "shard_optimizer", "shard_params"]

# What other packages use of this one (they import it from here, never from a private module):
from fzero.zero._offload import DiskOptState
from fzero.zero._policies import CPUOffload, DEFAULT_SUB_GROUP, DiskOffload, KINDS
from fzero.zero._stages import check_units
