"""ZeRO-2, ``shard_grads``: each unit's gradient is reduce-scattered during backward, so no rank holds the
whole gradient.

It replaces the step's ``grads`` part with ``GradsInBackward``: the units are modules, and ``loss_fn``
sees ``ReplicatedParams`` (``fzero.zero._sharded``), whose unit views attach the reduce-scatter of each
unit's gradient when the forward reaches the unit; what the update receives is already this rank's
reduced shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from fzero.layout import DEFAULT_UNIT_ELEMENTS, by_container_child, by_prefixes
from fzero.mesh import pooled_reduce_scatter
from fzero.step import View, give, take, Step, as_step
from fzero.zero._sharded import ReplicatedParams
from fzero.zero._shard_optimizer import GradsReduceScatter


@dataclasses.dataclass(frozen=True)
class GradsInBackward(GradsReduceScatter):
    """Each unit's gradient reduce-scattered as soon as backward has produced it (stages 2-3).
    ``units``: module paths; None: each child of a ``ModuleList``/``Sequential``."""

    units: tuple[str, ...] | None = None
    jit: bool = False  # each unit's forward through torch.compile (fzero.zero._jit)
    bucket_elements: int = 0  # units reduced together until a bucket holds this many elements (0: each alone)
    in_backward = True

    def unit_of(self, api: str) -> Callable[[str], str] | None:
        return by_container_child if self.units is None else by_prefixes(self.units, api=api)

    def replicated_view(self, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, pool: Any = None) -> View:
        layout, flats = state.meta.layout, state.params
        names = [u.name for u in layout.units]
        inputs = [flats[u.name][slice(*u.shard_range(comm.rank, comm.size))] for u in layout.units]
        view = ShardGradView(inputs, lambda xs: ReplicatedParams(dict(zip(names, xs)), layout, comm, flats, reduce_dtype=reduce_dtype,
                                                                 jit=self.jit, sink=view if view.active else None, pool=pool), names,
                             comm=comm, pool=pool, bucket_elements=self.bucket_elements)
        return view

    def sync(self, comm: Any, grad: torch.Tensor, *, reduce_dtype: torch.dtype, compute: torch.dtype, pool: Any = None) -> torch.Tensor:
        return grad  # already this rank's reduced shard


class ShardGradView(View):
    """The view of stages 2-3 under plain autograd: each unit's reduce-scatter is started in backward and waited for
    while later units' backward runs, rather than in its own backward.

    ``ReplicatedShardGrad`` (stage 2) and ``_UnitGather`` (stage 3) hand this view each unit's whole gradient
    (``ready``) instead of returning it to autograd; what still comes through autograd (stage 3's root unit, a
    ``remat`` unit) is taken from the leaves' ``.grad``. With ``bucket_elements`` (``shard_grads``), units are reduced in
    buckets of at least that many elements: consecutive units' gradients are laid out rank chunk by rank chunk (every unit's chunk 0, then every
    unit's chunk 1, ...) so that one reduce-scatter gives each rank its shard of every unit, summed in the same
    rank order as one reduce-scatter per unit (FSDP2 lays out its reduce-scatter input the same way), and a
    model of many small units pays one collective's latency per bucket rather than per unit. At most
    ``IN_FLIGHT`` reductions are in flight: the oldest is waited for (and its shards added to the units'
    accumulated gradients) when another starts, the rest at the end of each micro-batch (``release``). So a rank waits for its peers once per micro-batch rather than once per unit, and the exchanges
    of ``dist_mesh`` on gloo, or NCCL's stream, move one unit while the next is differentiated. The cost: one unit's
    whole gradient more alive at a time. The shards are the same numbers the synchronous path gives (the same
    reduction, cast to the shard's dtype as autograd casts it, accumulated over micro-batches in order).
    Under ``torch.func.grad`` (``autodiff="func"``) ``grad_into`` is not called and the reductions stay synchronous.
    """

    IN_FLIGHT = 1

    def __init__(self, inputs: list[torch.Tensor], build: Callable, names: list[str], *, comm: Any = None, pool: Any = None,
                 bucket_elements: int = 0) -> None:
        super().__init__(inputs, build, releases=True)
        self.names = names
        self.bucket_elements = bucket_elements
        self.comm = comm
        self.pool = pool  # the step's buffers (fzero.step._pool)
        self.active = False  # grad_into was called: the reductions come here
        self._leaves: list[torch.Tensor] | tuple = ()
        self._bucket: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # units ready, not yet reduced
        self._pending: list[tuple[list[tuple[str, torch.Tensor]], Any]] = []
        self._micro: dict[str, torch.Tensor] = {}  # this micro-batch's shard gradients
        self._acc: dict[str, torch.Tensor] = {}  # the step's, summed over micro-batches

    def grad_into(self, leaves: list[torch.Tensor]) -> bool:
        self.active = True
        self._leaves = leaves  # a unit reduced synchronously (stage 3's root unit, a remat unit) fills its leaf's .grad
        return True  # plain autograd's backward

    @property
    def accumulates(self) -> bool:
        return self.active

    def ready(self, name: str, grad: torch.Tensor, like: torch.Tensor) -> None:
        """Unit ``name``'s whole flat gradient ``grad`` (backward is done with it; the view may reuse it). Its shard
        gradient goes where ``like`` (the unit's shard) is, in its dtype (as autograd would cast and move it: the
        host, where stage 3 offloads params)."""
        self._bucket.append((name, grad, like))
        if sum(g.numel() for _, g, _ in self._bucket) >= self.bucket_elements:
            self._start_bucket()

    def _start_bucket(self) -> None:
        bucket, self._bucket = self._bucket, []
        if not bucket:
            return
        n = self.comm.size
        if len(bucket) == 1:
            name, full, like = bucket[0]
        else:  # every unit's chunk r together, for r = 0 .. n-1: the reduce-scatter's chunk r is rank r's shards
            total = sum(g.numel() for _, g, _ in bucket)
            full = take(self.pool, total, dtype=bucket[0][1].dtype, device=bucket[0][1].device)
            at = 0
            for r in range(n):
                for _, g, _ in bucket:
                    c = g.numel() // n
                    full[at:at + c].copy_(g[r * c:(r + 1) * c])
                    at += c
            for _, g, _ in bucket:
                give(self.pool, g)
            name = "+".join(name for name, _, _ in bucket)
        pending = pooled_reduce_scatter(self.comm, full, pool=self.pool, tag="grads", label=name)
        self._pending.append(([(name, like) for name, _, like in bucket], pending))
        while len(self._pending) > self.IN_FLIGHT:
            self._settle()

    def _settle(self) -> None:
        units, pending = self._pending.pop(0)
        shards, at = pending.wait(), 0
        for name, like in units:
            shard = shards if len(units) == 1 else shards[at:at + like.numel()]
            at += like.numel()
            _add(self._micro, name, shard.to(like.device, like.dtype, non_blocking=like.is_cuda))

    def release(self) -> None:
        """The end of a micro-batch: wait for what is in flight, then add the micro-batch's gradients (a unit called
        twice has two, summed first, as autograd sums them) to those of the earlier ones, in that order."""
        self._start_bucket()
        while self._pending:
            self._settle()
        for name, leaf in zip(self.names, self._leaves):
            if leaf.grad is not None:
                _add(self._micro, name, leaf.grad)
                leaf.grad = None
        self._leaves = ()
        for name, g in self._micro.items():
            _add(self._acc, name, g)
        self._micro = {}
        super().release()

    def collect(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.active:
            return grads
        grads.clear()
        acc, self._acc = self._acc, {}
        return [acc[n] if n in acc else torch.zeros_like(x) for n, x in zip(self.names, self.inputs)]


def _add(into: dict[str, torch.Tensor], name: str, grad: torch.Tensor) -> None:
    acc = into.get(name)
    into[name] = grad if acc is None else acc.add_(grad)


def check_units(units: object, api: str) -> tuple[str, ...] | None:
    if units is None:
        return None
    if isinstance(units, str) or not isinstance(units, (tuple, list)) or not all(isinstance(u, str) for u in units):
        raise TypeError(f"{api}: units must be a tuple of module paths such as ('blocks.0', 'blocks.1'), got {units!r}.")
    by_prefixes(units, api=api)
    return tuple(units)


def shard_grads(step: Step, *, units: tuple[str, ...] | None = None, jit: bool = False, bucket_elements: int = 0) -> Step:
    """ZeRO-2: each unit's gradient is reduce-scattered during backward, so no rank holds the whole gradient.

    Units are modules (``units``: module paths, see ``fzero.units_of``; default each child of a
    ``ModuleList``/``Sequential``), and ``loss_fn`` must run the model through ``fzero.apply`` (or read
    ``params[name]``) so that each unit's reduction is attached when the forward reaches it. ``jit=True``: each
    unit's forward runs through ``torch.compile`` (regional compilation, ``fzero.zero._jit``), here and at stage 3.

    ``bucket_elements``: reduce consecutive units together until a bucket holds at least this many elements, one
    reduce-scatter per bucket (DeepSpeed's ``reduce_bucket_size``, in elements too; DDP's ``bucket_cap_mb``). It
    pays off for many small units (each collective has a fixed latency), and costs up to about two buckets of
    gradient memory beyond one unit's; the numbers are bitwise those of one reduce-scatter per unit. Default 0:
    each unit is reduced alone, as soon as backward has it (ZeRO-2's memory; ``fzero.estimate_memory`` assumes it).
    At stage 3 (``shard_params`` around this) the prefetched gathers are bucketed the same way (DeepSpeed's
    ``allgather_bucket_size``): one all-gather for the next units of the recorded order, each unit's buffer then
    filled from the bucket's: a bucket of gathered params is held beside the unit that runs, where prefetch held one
    unit.
    """
    step = as_step(step, "fzero.shard_grads")
    if step.grads.in_backward:
        raise ValueError(f"fzero.shard_grads: the step already reduces gradients in backward ({step.stage_name}); apply shard_grads once.")
    if step.unit_elements != DEFAULT_UNIT_ELEMENTS:
        raise ValueError(
            f"fzero.shard_grads: the step was built with unit_elements={step.unit_elements}, but from stage 2 on units are "
            f"modules, not sizes. Build the step without unit_elements and pass units=... (module paths) here."
        )
    if not isinstance(step.grads, GradsReduceScatter):
        raise ValueError(
            f"fzero.shard_grads: needs fzero.shard_optimizer inside it (gradient shards are only useful to a sharded "
            f"optimizer), but the step is {step.stage_name}. Write fzero.shard_grads(fzero.shard_optimizer(step, mesh))."
        )
    if not isinstance(jit, bool):
        raise TypeError(f"fzero.shard_grads: jit must be True or False, got {jit!r}.")
    if isinstance(bucket_elements, bool) or not isinstance(bucket_elements, int) or bucket_elements < 0:
        raise ValueError(f"fzero.shard_grads: bucket_elements must be an int >= 0 (elements per bucket of units reduced "
                         f"together; 0: each unit alone), got {bucket_elements!r}.")
    return dataclasses.replace(step, grads=GradsInBackward(check_units(units, "fzero.shard_grads"), jit=jit,
                                                           bucket_elements=bucket_elements))
