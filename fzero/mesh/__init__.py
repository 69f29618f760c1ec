"""Meshes, collectives, and each rank's context with its randomness."""

# What other packages use of this one (they import it from here, never from a private module):
from fzero.mesh._comm import AllGather, bucketed_reduce_scatter, GatherBucket, ReplicatedShardGrad, Comm, CommWrapper, events, Function, MeshTimeout, Pending, pooled_reduce_scatter, profiled, RanksDisagree, Rendezvous, ThreadComm
from fzero.mesh._dist_comm import DistComm, host_stage
from fzero.mesh._faults import process_alive, RankFailed, RankStopped
from fzero.mesh._mesh import (
    AGREE_FIX,
    count_collectives,
    dist_mesh,
    DistMesh,
    fault_board,
    local_mesh,
    LocalMesh,
    Mesh,
    program_fields,
    wrap_comm,
)
from fzero.mesh._rank import backward_context, current_context, RankContext, with_context
from fzero.mesh._waiting import failure_elsewhere
from fzero.mesh import _rank as rng  # the per-rank RNG streams, as a namespace
from fzero.mesh import _hooks as hooks
