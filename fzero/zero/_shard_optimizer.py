"""ZeRO-1, ``shard_optimizer``: each rank keeps and updates only its 1/N shard of the optimizer state.

It replaces two parts of the step (``fzero.step._parts``): the gradient is reduce-scattered after the
backward (``GradsReduceScatter``) instead of all-reduced, and the optimizer state is sharded
(``OptStateSharded``); each rank updates its slice of the params, which are then all-gathered back
(``ParamsReplicated.gather_back``): the same 2Ψ·(N-1)/N elements per step as an all-reduce.
``OptStateSharded.offload`` is set by ``fzero.offload`` (ZeRO-Offload / ZeRO-Infinity).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fzero.mesh import Pending, DistMesh, LocalMesh, Mesh, pooled_reduce_scatter

from fzero.layout import Layout
from fzero.step import GradsAllReduce, OptStateReplicated, Pool, Step, as_step
from fzero.zero._policies import OffloadPolicy


@dataclasses.dataclass(frozen=True)
class GradsReduceScatter(GradsAllReduce):
    """The gradient reduce-scattered after the backward: each rank ends with its reduced shard (stage 1).
    ``loss_fn`` sees whole params, as at stage 0."""

    whole = False

    def start(self, comm: Any, grad: torch.Tensor, *, reduce_dtype: torch.dtype, compute: torch.dtype, pool: Pool | None = None) -> Any:
        # the shard in a buffer of ``pool``; the whole gradient goes back to it once reduced
        pending = pooled_reduce_scatter(comm, grad.to(reduce_dtype), pool=pool, tag="grads")
        return Pending(lambda: pending.wait().to(compute))


@dataclasses.dataclass(frozen=True)
class OptStateSharded(OptStateReplicated):
    """This rank's shard of the optimizer state and masters, on the device, the host or in files (``offload``)."""

    offload: OffloadPolicy | None = None
    sharded = True

    def owned(self, params: Any, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        return params.local(layout, flats, rank)

    # Where the state lives is the offload policy's to say (``fzero.zero._policies``); without one, on the device.
    def hold_master(self, master: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return master[lo:hi].clone() if self.offload is None else self.offload.hold(master[lo:hi])

    def init(self, optimizer: Any, params: Any, layout: Layout, flats: dict[str, torch.Tensor], master: dict | None, rank: int):
        if self.offload is None:
            return super().init(optimizer, params, layout, flats, master, rank)
        return self.offload.init(optimizer, self.owned(params, layout, flats, rank), master, flats, rank)

    def has_masters(self, opt_state: Any) -> bool:
        held = None if self.offload is None else self.offload.has_masters(opt_state)
        return super().has_masters(opt_state) if held is None else held

    def masters(self, opt_state: Any, layout: Layout) -> dict[str, torch.Tensor]:
        held = None if self.offload is None else self.offload.masters(opt_state, layout)
        return super().masters(opt_state, layout) if held is None else held

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        return None if self.offload is None else self.offload.release(opt_state)

    def apply(self, optimizer: Any, grads: dict, opt_state: Any, params: dict, segments: Any) -> Any:
        if self.offload is None:
            return super().apply(optimizer, grads, opt_state, params, segments)
        return self.offload.apply(optimizer, grads, opt_state, params, segments)

    def after_update(self, params: Any, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
                     pool: Pool | None = None) -> None:
        params.gather_back(comm, flats, layout, bucket_elements=bucket_elements, pool=pool)


def shard_optimizer(step: Step, mesh: Mesh | None = None) -> Step:
    """ZeRO-1: each rank keeps and updates only its 1/N shard of the optimizer state.

    Gradients are reduce-scattered (not all-reduced), each rank updates its shard of the params, and the
    params are all-gathered back: the same 2Ψ·(N-1)/N elements per step as an all-reduce.
    ``mesh`` may be omitted when the step already has one; if both are given they must agree.
    """
    step = as_step(step, "fzero.shard_optimizer")
    if step.opt_state.sharded:
        raise ValueError(f"fzero.shard_optimizer: the step is already {step.stage_name}; apply shard_optimizer once, to a stage-0 step from fzero.train_step.")
    if mesh is not None and not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.shard_optimizer: mesh must be fzero.local_mesh(n) or fzero.dist_mesh(), got {mesh!r}.")
    if mesh is not None and step.mesh is not None and mesh != step.mesh:
        raise ValueError(f"fzero.shard_optimizer: the step already runs on {step.mesh!r} and mesh={mesh!r} differs. Pass one mesh, once.")
    return dataclasses.replace(step, mesh=mesh if mesh is not None else step.mesh, grads=GradsReduceScatter(), opt_state=OptStateSharded())
