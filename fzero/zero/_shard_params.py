"""ZeRO-3, ``shard_params``: each rank holds only its 1/N shard of the params; a unit is gathered just before
it runs and freed after (``fzero.zero._sharded``), its gradient reduce-scattered in backward.

It replaces the step's ``params`` part with ``ParamsSharded``; it needs ``GradsInBackward`` (a sharded
param's gradient can only be reduced unit by unit) and a sharded optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch

from fzero.layout import Layout
from fzero.step import View, Step, as_step
from fzero.zero._schedule import Schedule
from fzero.zero._sharded import ShardedParams
from fzero.zero._shard_grads import GradsInBackward, ShardGradView, check_units


class CastFromMasters:
    """Stage 3 with fp32 masters beside the params (no offload): for the length of a step, each unit's gathers read
    its master cast to the compute dtype (as FSDP2 casts its fp32 shards at the all-gather), and the state's
    compute-dtype shard gives its memory back: 2 bytes per owned parameter under bf16/fp16, the one full-size
    buffer stage 3 held beyond FSDP2's fp32 params + grads + Adam state.

    ``free`` (at the start of a step) frees only shards that are exactly their master cast (what every update leaves,
    ``p.copy_(master)``), so the forward reads the same numbers as before; a shard that differs (a state whose params
    were replaced between steps, or fp64 values cast once) stays and is gathered from. ``for_update`` gives the update
    the masters in place of the freed shards, so that it writes no shard while the step's gradients are alive; ``restore``
    (once the update is over, or on an error) gives each freed shard its memory back, filled from its master.
    """

    def __init__(self, shards: dict[str, torch.Tensor], masters: dict[str, torch.Tensor]) -> None:
        self.shards, self.masters = shards, masters
        self.freed: dict[str, int] = {}  # unit -> bytes its shard held

    def free(self) -> None:
        names = [n for n, shard in self.shards.items() if _castable(shard, self.masters.get(n))]
        known = {n for n in names if _still_cast(self.shards[n], self.masters[n])}
        compare = [n for n in names if n not in known]
        same = []
        if compare:  # one flag per unit, read together: on a GPU one wait for the device per step, not one per unit
            same = torch.stack([_bits(self.masters[n].to(self.shards[n].dtype)).eq(_bits(self.shards[n])).all()
                                for n in compare]).tolist()
        for name, ok in [*zip(compare, same), *((n, True) for n in known)]:
            if ok:
                self.freed[name] = self.shards[name].untyped_storage().nbytes()
                self.shards[name].untyped_storage().resize_(0)

    def cast(self, name: str, comm: Any = None) -> torch.Tensor | None:
        """What a gather of unit ``name`` sends: its master in the compute dtype (a new tensor); None: the shard. On a
        one-rank mesh whose gather is a copy (``gather_casts_at_one_rank``), the master itself: the copy rounds it to
        the compute dtype as ``.to`` would, in one kernel and without a unit-sized temporary."""
        if name not in self.freed:
            return None
        master = self.masters[name]
        if comm is not None and comm.size == 1 and comm.gather_casts_at_one_rank:
            return master
        return master.to(self.shards[name].dtype)

    def for_update(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: self.masters[k] if k in self.freed else v for k, v in params.items()}

    def restore(self) -> None:
        freed, self.freed = self.freed, {}
        with torch.no_grad():
            for name, nbytes in freed.items():
                shard, master = self.shards[name], self.masters[name]
                shard.untyped_storage().resize_(nbytes)
                shard.copy_(master)
                _mark_cast(shard, master)


# What ``restore`` leaves on a shard: its master and both tensors' version counters right after the shard was filled
# from it. While neither tensor has been written since (in place, through the tensor: autograd's version counter
# counts each such write) and the shard still belongs to that master, the shard is known to be its master cast, and
# the next step frees it without comparing them: a comparison is a cast and a read of every element, and reading its
# answer is a wait for the device before the step can start (seen on an H100: the host's start of each step, with
# the GPU idle meanwhile). A state made or changed any other way is compared, as before.
_CAST_MARK = "_fzero_cast_of"


def _mark_cast(shard: torch.Tensor, master: torch.Tensor) -> None:
    setattr(shard, _CAST_MARK, (weakref.ref(master), shard._version, master._version))


def _still_cast(shard: torch.Tensor, master: torch.Tensor) -> bool:
    mark = getattr(shard, _CAST_MARK, None)
    return mark is not None and mark[0]() is master and mark[1] == shard._version and mark[2] == master._version


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits, to compare bit for bit (-0.0 is not 0.0, a NaN equals the same NaN); bf16/fp16 are 2 bytes."""
    return t.view(torch.int16) if t.element_size() == 2 else t


def _castable(shard: torch.Tensor, master: torch.Tensor | None) -> bool:
    """Whether ``shard`` can be gathered from ``master`` and freed meanwhile: a master of its shape on its device, and a
    shard that is the whole of a storage that can be freed and given memory again (not a view, not a mapped file)."""
    if master is None or master.device != shard.device or master.shape != shard.shape or shard.numel() == 0:
        return False
    storage = shard.untyped_storage()
    return (shard._base is None and shard.storage_offset() == 0 and shard.is_contiguous() and storage.resizable()
            and storage.nbytes() == shard.numel() * shard.element_size())


class _GatheredView(ShardGradView):
    """A step's view at stage 3: its ``Schedule`` records the order of the gathers, for the next step's prefetch;
    under plain autograd it takes the units' reductions while they are in flight (``ShardGradView``). ``casts``
    (``CastFromMasters``): the compute-dtype shards freed for the step, gathered from their masters."""

    def __init__(self, inputs, build, schedule: Schedule, names: list[str] | None = None, *, casts: CastFromMasters | None = None,
                 **kw: Any) -> None:
        super().__init__(inputs, build, names or [], **kw)
        self.schedule = schedule
        self.casts = casts

    def finish(self, meta: Any) -> Any:
        return dataclasses.replace(meta, gather_order=self.schedule.finish())

    def for_update(self, state: Any) -> Any:
        """The backward is over. With masters the update makes an fp32 copy of the gradient beside them, so it is a peak
        of the step: the pool's idle buffers (the units gathered in backward) go back to the allocator first, and the
        next step's first units take new ones (a few unit-sized allocations per step, against holding them here)."""
        if self.casts is None:
            return state
        if self.pool is not None:
            self.pool.clear()
        return dataclasses.replace(state, params=self.casts.for_update(state.params))

    def restore(self) -> None:
        if self.casts is not None:
            self.casts.restore()


@dataclasses.dataclass(frozen=True)
class ParamsSharded:
    """Each rank holds a shard of each unit; a unit is whole only while it runs (stage 3).
    ``prefetch``: gather the next unit while the current one computes; ``remat``: recompute each unit in backward."""

    prefetch: bool = True
    remat: bool = False
    sharded = True

    def hold(self, flat: torch.Tensor, lo: int, hi: int, *, copy: bool) -> torch.Tensor:
        return flat[lo:hi].clone()

    def local(self, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        return dict(flats)  # the shards themselves

    def view(self, grads: Any, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, release: Any, pool: Any = None,
             masters: dict[str, torch.Tensor] | None = None) -> View:
        """``masters``: this rank's fp32 masters where they live beside the shards (no offload): the step then gathers
        from them and frees the compute-dtype shards while it runs (``CastFromMasters``)."""
        casts = None
        if masters is not None:
            casts = CastFromMasters(state.params, masters)
            casts.free()
        try:
            return self._view(grads, comm, state, reduce_dtype, release, pool, casts)
        except BaseException:
            if casts is not None:  # the state stays whole when the step cannot start
                casts.restore()
            raise

    def _view(self, grads: Any, comm: Any, state: Any, reduce_dtype: torch.dtype | None, release: Any, pool: Any,
              casts: CastFromMasters | None) -> View:
        layout, flats = state.meta.layout, state.params
        names = [u.name for u in layout.units]
        schedule = Schedule(comm, layout, flats, state.meta.gather_order, self.prefetch, release=release, device=state.meta.device,
                            pool=pool, bucket_elements=grads.bucket_elements,
                            cast=functools.partial(casts.cast, comm=comm) if casts is not None else None)
        view = _GatheredView(
            [flats[n] for n in names],
            lambda xs: ShardedParams(dict(zip(names, xs)), layout, comm, schedule, remat=self.remat, reduce_dtype=reduce_dtype,
                                     jit=grads.jit, sink=view if view.active else None, pool=pool),
            schedule, names, casts=casts, comm=comm, pool=pool, bucket_elements=grads.bucket_elements,
        )
        return view

    def eval_view(self, comm: Any, state: Any, *, release: Any) -> View:
        layout = state.meta.layout
        schedule = Schedule(comm, layout, state.params, state.meta.gather_order, self.prefetch, release=release, device=state.meta.device)
        return _GatheredView([], lambda xs: ShardedParams(dict(state.params), layout, comm, schedule), schedule)

    def gather_back(self, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
                    pool: Any = None) -> None:
        """Each rank updated its own shard, which is all it holds: nothing to bring back."""


def shard_params(step: Step, *, units: tuple[str, ...] | None = None, prefetch: bool = True, remat: bool = False) -> Step:
    """ZeRO-3: each rank holds only its 1/N shard of the params; each unit is gathered just before it runs.

    Each unit's forward runs once, with its graph, as in plain PyTorch; its gathered params are freed
    after the forward and gathered again just before its backward, then its gradient is reduce-scattered.
    ``units``: module paths (see ``fzero.units_of``); default, each child of a ``ModuleList``/``Sequential``.
    ``prefetch``: gather the next unit while the current one computes, in forward and in backward (order
    recorded on the first step). ``remat=True``: recompute each unit in backward (``fzero.remat``, which
    gathers it again) instead of keeping its activations: less memory, one more forward per unit. Buffer writes
    (BatchNorm statistics) still happen once per step; a unit that changes a non-tensor argument (a Hugging Face
    KV cache under ``use_cache=True``) raises before any update, naming the fix (``use_cache=False``); hooks
    inside a unit fire again in its recompute, as under ``torch.utils.checkpoint``.
    """
    step = as_step(step, "fzero.shard_params")
    if step.params.sharded:
        raise ValueError("fzero.shard_params: the step already shards its params (stage 3); apply shard_params once.")
    if not isinstance(step.grads, GradsInBackward):
        raise ValueError(
            f"fzero.shard_params: needs fzero.shard_grads inside it (sharded params need sharded gradients and optimizer "
            f"state), but the step is {step.stage_name}. Write fzero.shard_params(fzero.shard_grads(fzero.shard_optimizer(step, mesh)))."
        )
    grads = step.grads if units is None else dataclasses.replace(step.grads, units=check_units(units, "fzero.shard_params"))
    if not isinstance(prefetch, bool):
        raise TypeError(f"fzero.shard_params: prefetch must be True or False, got {prefetch!r}.")
    if not isinstance(remat, bool):
        raise TypeError(f"fzero.shard_params: remat must be True or False, got {remat!r}.")
    return dataclasses.replace(step, grads=grads, params=ParamsSharded(prefetch=prefetch, remat=remat))
