"""The three ZeRO stages as transforms of a step, and the parts each plugs in (``fzero.step._parts``).

- ZeRO-1, ``shard_optimizer``: each rank keeps and updates only its 1/N shard of the optimizer state. The
  gradient is reduce-scattered after the backward (``GradsReduceScatter``) instead of all-reduced, and the
  optimizer state is sharded (``OptStateSharded``); each rank updates its slice of the params, which are then
  all-gathered back (``ParamsReplicated.gather_back``): the same 2Ψ·(N-1)/N elements per step as an all-reduce.
  ``OptStateSharded.offload`` is set by ``fzero.offload`` (ZeRO-Offload / ZeRO-Infinity).
- ZeRO-2, ``shard_grads``: each unit's gradient is reduce-scattered during backward, so no rank holds the whole
  gradient. The step's ``grads`` part becomes ``GradsInBackward``: the units are modules, and ``loss_fn`` sees
  ``ReplicatedParams`` (``fzero.zero._sharded``), whose unit views attach the reduce-scatter of each unit's
  gradient when the forward reaches the unit (``ShardGradView``); what the update receives is already this
  rank's reduced shard.
- ZeRO-3, ``shard_params``: each rank holds only its 1/N shard of the params; a unit is gathered just before it
  runs and freed after (``fzero.zero._unit``), its gradient reduce-scattered in backward. The step's ``params``
  part becomes ``ParamsSharded``; it needs ``GradsInBackward`` (a sharded param's gradient can only be reduced
  unit by unit) and a sharded optimizer state.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, ClassVar

import torch

from fzero.layout import DEFAULT_UNIT_ELEMENTS, Layout, by_container_child, by_prefixes
from fzero.mesh import DistMesh, LocalMesh, Mesh, Pending, bucketed_reduce_scatter, pooled_reduce_scatter
from fzero.step import GradsAllReduce, GradsPart, OptStateReplicated, ParamsPart, Pool, Step, UnitSettings, View, as_step, forget
from fzero.zero._remat_params import RematParams
from fzero.zero._sharded import ReplicatedParams, ShardedParams
from fzero.zero._unit import Schedule, check_data_writes


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

    sharded: ClassVar[bool] = True

    def owned(self, params: ParamsPart, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        return params.local(layout, flats, rank)

    def after_update(self, params: ParamsPart, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
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


@dataclasses.dataclass(frozen=True)
class GradsInBackward(GradsReduceScatter):
    """Each unit's gradient reduce-scattered as soon as backward has produced it (stages 2-3).
    ``units``: module paths; None: each child of a ``ModuleList``/``Sequential``."""

    units: tuple[str, ...] | None = None
    in_backward = True

    def unit_of(self, api: str) -> Callable[[str], str] | None:
        return by_container_child if self.units is None else by_prefixes(self.units, api=api)

    def replicated_view(self, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, pool: Any = None,
                        settings: UnitSettings = UnitSettings(), homes: dict[str, torch.Tensor] | None = None) -> View:
        layout, flats = state.meta.layout, state.params
        names = [u.name for u in layout.units]
        inputs = [flats[u.name][slice(*u.shard_range(comm.rank, comm.size))] for u in layout.units]
        return ShardGradView(inputs, lambda xs, sink: ReplicatedParams(dict(zip(names, xs)), layout, comm, flats, reduce_dtype=reduce_dtype,
                                                                       jit_cache=settings.compiled if settings.jit else None, sink=sink, pool=pool,
                                                                       remat=settings.remat),
                             names, comm=comm, pool=pool, bucket_elements=settings.bucket_elements, homes=homes)

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

    ``homes`` (``CPUOffload.grad_homes``: the optimizer runs on the host, the params are on a GPU): each unit's shard
    gradient goes to its host buffer as soon as its reduction is waited for, so the device holds a unit or two of
    gradient, not the whole (ZeRO-Offload's device memory: the params alone). The values are the ones the device path
    keeps: rounded to the shard's dtype, and summed over micro-batches in that dtype (``_to_home``). One order differs:
    a unit that gets two gradients in one micro-batch (a layer called twice) adds each into the sum as it comes, where
    the device path adds the micro-batch's two first, so with ``grad_accum`` > 1 their last bits may differ.
    """

    IN_FLIGHT = 1

    def __init__(self, inputs: list[torch.Tensor], build: Callable, names: list[str], *, comm: Any = None, pool: Any = None,
                 bucket_elements: int = 0, homes: dict[str, torch.Tensor] | None = None) -> None:
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
        self.homes = homes
        self._copying: torch.device | None = None  # a device whose copies into the homes may be in flight

    def make(self, xs: list[torch.Tensor]) -> Any:
        """``build(xs, sink)``: the unit params, handing their units' reductions to this view once ``grad_into`` made it
        active. The view is an argument, not captured by ``build`` where the view is made: a closure over the view,
        kept by the view, would be a reference cycle, holding the step's views and buffers until the cyclic collector."""
        if self._build is None:
            raise NotImplementedError(f"fzero internal error: {type(self).__name__} was made without a build function.")
        return self._build(xs, self if self.active else None)

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
        name = "+".join(name for name, _, _ in bucket)
        pending = bucketed_reduce_scatter(self.comm, [g for _, g, _ in bucket], pool=self.pool, label=name)
        self._pending.append(([(name, like) for name, _, like in bucket], pending))
        while len(self._pending) > self.IN_FLIGHT:
            self._settle()

    def _settle(self) -> None:
        units, pending = self._pending.pop(0)
        shards, at = pending.wait(), 0
        if len(units) > 1:  # a bucket's shards are views of one buffer, kept by the units' gradients: never given back
            forget(self.pool, shards)
        for name, like in units:
            shard = shards if len(units) == 1 else shards[at:at + like.numel()]
            at += like.numel()
            if self.homes is not None:
                self._to_home(self.homes, name, shard, like.dtype)
                continue
            _add(self._micro, name, shard.to(like.device, like.dtype, non_blocking=like.is_cuda), self.pool)

    def _to_home(self, homes: dict[str, torch.Tensor], name: str, grad: torch.Tensor, dtype: torch.dtype) -> None:
        """Unit ``name``'s gradient ``grad`` (a reduced shard, or a leaf's ``.grad``) into its host buffer, as the device
        path would keep it: rounded to ``dtype`` (the shard's, as autograd casts a leaf's gradient) and, after the
        first, added in ``dtype`` where ``grad`` is. The first of the step is an asynchronous copy down (into page-locked
        memory, ordered on the stream; ``collect`` waits before the host reads it); a later one (``grad_accum``, a unit
        called twice) brings the sum so far up, adds there and copies it back down, each ordered on the stream, so the
        backward never waits for the host (as DeepSpeed's offload accumulates on the host through the device)."""
        home = homes[name]
        low = grad.to(dtype)
        if name in self._acc:
            up = home.to(grad.device, non_blocking=True)  # after the copy down before it: one stream
            low = (up if dtype == home.dtype else up.to(dtype)).add_(low)  # exactly what a sum kept in ``dtype`` holds
        home.copy_(low, non_blocking=True)
        self._acc[name] = home
        if home.device != grad.device:
            self._copying = grad.device
        del low
        if self.pool is not None:  # the shard is done with (the pool takes back only what it lent, and only on the host)
            self.pool.give(grad)

    def release(self) -> None:
        """The end of a micro-batch: wait for what is in flight, then add the micro-batch's gradients (a unit called
        twice has two, summed first, as autograd sums them) to those of the earlier ones, in that order."""
        self._start_bucket()
        while self._pending:
            self._settle()
        for name, leaf in zip(self.names, self._leaves):
            if leaf.grad is not None:
                if self.homes is not None:
                    self._to_home(self.homes, name, leaf.grad, leaf.dtype)
                else:
                    _add(self._micro, name, leaf.grad, self.pool)
                leaf.grad = None
        self._leaves = ()
        for name, g in self._micro.items():
            _add(self._acc, name, g, self.pool)
        self._micro = {}
        super().release()

    def collect(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.active:
            return grads
        grads.clear()
        acc, self._acc = self._acc, {}
        if self.homes is not None:
            if self._copying is not None:  # the host reads the homes next
                torch.cuda.current_stream(self._copying).synchronize()
                self._copying = None
            return [acc[n] if n in acc else self.homes[n].zero_() for n in self.names]
        return [acc[n] if n in acc else torch.zeros_like(x) for n, x in zip(self.names, self.inputs)]


def _add(into: dict[str, torch.Tensor], name: str, grad: torch.Tensor, pool: Pool | None) -> None:
    """``grad`` into ``into[name]``: kept as it is where the name has none yet, else added and given back to ``pool``
    (a buffer of the pool's, a reduced shard or at one rank the unit's whole gradient, that nothing reads after the
    sum: ``give`` takes only what the pool lent, and lends it again only once nothing else holds it). Without the
    give, each micro-batch after the first left a buffer on loan that never came back: under ``grad_accum`` the
    pool's record of loans grew every step."""
    acc = into.get(name)
    if acc is None:
        into[name] = grad
        return
    into[name] = acc.add_(grad)
    if pool is not None:
        pool.give(grad)


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
    return dataclasses.replace(step, grads=GradsInBackward(check_units(units, "fzero.shard_grads")),
                               unit_settings=dataclasses.replace(step.unit_settings, jit=jit, bucket_elements=bucket_elements,
                                                                   compiled={} if jit else None))


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


class _CastMark(tuple):
    """(a weak reference to the master, the shard's version, the master's). A tensor's attributes are pickled with it
    (``torch.save`` of a state), and a weak reference cannot be (that failed, naming neither the state nor a fix): a
    pickled mark becomes None, so the loaded shard is compared with its master, as any state made another way is."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return (_no_mark, ())


def _no_mark() -> None:
    return None


def _mark_cast(shard: torch.Tensor, master: torch.Tensor) -> None:
    setattr(shard, _CAST_MARK, _CastMark((weakref.ref(master), shard._version, master._version)))


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
    """Each rank holds a shard of each unit; a unit is whole only while it runs (stage 3). How its units run (prefetch,
    remat, jit, buckets) is the step's ``unit_settings``."""

    sharded: ClassVar[bool] = True

    def hold(self, flat: torch.Tensor, lo: int, hi: int, *, copy: bool) -> torch.Tensor:
        return flat[lo:hi].clone()

    def local(self, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        return dict(flats)  # the shards themselves

    def view(self, grads: GradsPart, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, release: Any, pool: Any = None,
             masters: dict[str, torch.Tensor] | None = None, settings: UnitSettings = UnitSettings(),
             homes: dict[str, torch.Tensor] | None = None) -> View:
        """``masters``: this rank's fp32 masters where they live beside the shards (no offload): the step then gathers
        from them and frees the compute-dtype shards while it runs (``CastFromMasters``)."""
        casts = None
        if masters is not None:
            casts = CastFromMasters(state.params, masters)
            casts.free()
        try:
            return self._view(grads, comm, state, reduce_dtype, release, pool, casts, settings, homes)
        except BaseException:
            if casts is not None:  # the state stays whole when the step cannot start
                casts.restore()
            raise

    def _view(self, grads: GradsPart, comm: Any, state: Any, reduce_dtype: torch.dtype | None, release: Any, pool: Any,
              casts: CastFromMasters | None, settings: UnitSettings, homes: dict[str, torch.Tensor] | None = None) -> View:
        layout, flats = state.meta.layout, state.params
        names = [u.name for u in layout.units]
        schedule = Schedule(comm, layout, flats, state.meta.gather_order, settings.prefetch, release=release, device=state.meta.device,
                            pool=pool, bucket_elements=settings.bucket_elements,
                            cast=functools.partial(casts.cast, comm=comm) if casts is not None else None, frozen=state.frozen,
                            frozen_seen=state.meta.frozen_seen, check_data=check_data_writes(flats))
        return _GatheredView(
            [flats[n] for n in names],
            lambda xs, sink: ShardedParams(dict(zip(names, xs)), layout, comm, schedule, remat=settings.remat, reduce_dtype=reduce_dtype,
                                           jit_cache=settings.compiled if settings.jit else None, sink=sink, pool=pool),
            schedule, names, casts=casts, comm=comm, pool=pool, bucket_elements=settings.bucket_elements, homes=homes,
        )

    def eval_view(self, comm: Any, state: Any, *, release: Any, settings: UnitSettings = UnitSettings()) -> View:
        layout = state.meta.layout
        schedule = Schedule(comm, layout, state.params, state.meta.gather_order, settings.prefetch, release=release, device=state.meta.device,
                            frozen=state.frozen, frozen_seen=state.meta.frozen_seen)
        return _GatheredView([], lambda xs, sink: ShardedParams(dict(state.params), layout, comm, schedule,
                                                                jit_cache=settings.compiled if settings.jit else None), schedule)

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
    return dataclasses.replace(step, grads=grads, params=ParamsSharded(),
                               unit_settings=dataclasses.replace(step.unit_settings, prefetch=prefetch, remat=remat))


def remat_units(step: Step) -> Step:
    """Recompute each unit's forward in backward instead of keeping its activations, at any stage
    (``compile(..., remat=True)``): less activation memory, one more forward per unit.

    At stage 3 a unit is gathered again for its recompute (``shard_params(remat=True)`` is the same). At stage 2 each
    unit runs through ``fzero.remat`` with its whole params. At stages 0-1, where the flat buffers are cut by size,
    the units recomputed are the model's module units (``fzero.units_of(model)``: each block of a ``ModuleList``),
    found when ``fzero.apply`` first runs the model (``RematParams``). Buffer writes (BatchNorm statistics) happen once
    per step; hooks inside a unit fire again in its recompute, as under ``torch.utils.checkpoint``; a unit that
    changes a non-tensor argument (a Hugging Face KV cache under ``use_cache=True``) raises before any update.
    """
    step = as_step(step, "fzero.remat_units")
    return dataclasses.replace(step, unit_settings=dataclasses.replace(step.unit_settings, remat=True, wrap_params=RematParams))
