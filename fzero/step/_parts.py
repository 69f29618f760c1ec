"""The three parts of a step that the ZeRO transforms change, and their stage-0 forms.

A ``Step`` runs one rank program for every stage. What differs between the stages is held in three
typed parts, each a frozen dataclass; the program calls their methods and never asks which stage it is:

* ``params`` - where a rank keeps the params between steps, and what ``loss_fn`` sees during one:
  ``ParamsReplicated`` (every rank holds every unit; stages 0-2) or ``fzero.zero.ParamsSharded``
  (a shard of each unit, gathered while it runs; stage 3).
* ``grads`` - how the gradient is synchronised: ``GradsAllReduce`` after the backward (stage 0, DDP),
  ``fzero.zero.GradsReduceScatter`` after the backward (stage 1), ``fzero.zero.GradsInBackward`` per
  unit as soon as backward has produced it (stages 2-3; the units are modules).
* ``opt_state`` - where the optimizer state (and fp32 masters) live and what a rank updates:
  ``OptStateReplicated`` (all of it; stage 0) or ``fzero.zero.OptStateSharded`` (its shard, optionally
  offloaded to the host or to files; stages 1-3).

``train_step`` builds the stage-0 parts below; ``shard_optimizer``, ``shard_grads``, ``shard_params``
and ``offload`` (``fzero.zero``) each replace one or two of them and check what they need, so the
order of composition is checked by the types. The parts that need another part's answer ask it
(double dispatch: ``params.view`` asks ``grads.replicated_view``; ``opt_state.after_update`` asks
``params.gather_back``), so no part branches on another's type.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import torch

from fzero.mesh import GatherBucket, Pending
from fzero.layout import Layout
from fzero.step import _context as _usage
from fzero.step._pool import Pool, take
from fzero.step._protocols import GradsPart, OffloadPolicy, ParamsPart, StepView, UnitSettings


class View:
    """What one step's gradient is taken over, made by ``params.view``.

    ``inputs``: the differentiable tensors (per unit, or per param at stages 0-1, in layout order);
    ``build(xs)``: what ``loss_fn`` gets, from the transform's wrapped ``xs`` (None: the subclass's ``make`` makes it; a
    subclass whose ``build`` needs the view is handed it, never captures it: see ``make``); ``release()``: after each
    micro-batch's gradient (lets go of what the micro-batch gathered); ``collect(grads)``: the accumulated
    gradients of ``inputs`` as one gradient per unit (``collect``, default as they are), taking them out of the
    list it is given; ``finish(meta)``: after the last micro-batch, the state's new metadata.
    """

    def __init__(self, inputs: list[torch.Tensor], build: Callable[..., Any] | None, *,
                 releases: bool = False, collect: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> None:
        self.inputs = inputs
        self._build = build  # None: a subclass's ``make`` (a bound method kept here would be a reference cycle)
        self._releases = releases  # what build makes has a release() (the unit params of stages 2-3)
        self._collect = collect
        self.made: list[Any] = []

    def collect(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return grads if self._collect is None else self._collect(grads)

    def build(self, xs: list[torch.Tensor]) -> Any:
        self.made.append(self.make(xs))
        return self.made[-1]

    def make(self, xs: list[torch.Tensor]) -> Any:
        """What ``loss_fn`` gets from ``xs`` (``build`` keeps it for ``release``)."""
        if self._build is None:
            raise NotImplementedError(f"fzero internal error: {type(self).__name__} has neither a build function nor a make method.")
        return self._build(xs)

    def release(self) -> None:
        for params in self.made if self._releases else ():
            params.release()
        self.made.clear()

    def finish(self, meta: Any) -> Any:
        return meta

    def begin_micro(self, *, last: bool) -> None:
        """A micro-batch's gradient is about to be taken (``last``: the step's last)."""

    def grad_into(self, leaves: list[torch.Tensor]) -> bool:
        """Under plain autograd, whether the leaves' gradients go straight into the view's own buffers (True: it hooked
        them); here, no: they come back per input."""
        return False

    @property
    def accumulates(self) -> bool:
        """Whether the view accumulates the micro-batches' gradients itself (none are returned to add up)."""
        return False

    def for_update(self, state: Any) -> Any:
        """The state the update is to see (stage 3 hands it the masters in place of the shards it freed)."""
        return state

    def restore(self) -> None:
        """After the update, or on an error: the state's params whole again (stage 3: the shards the view freed)."""


class ParamView(View):
    """Stages 0-1: the gradient is taken with respect to each param, a view of its unit's buffer.

    Under plain autograd (``autodiff="autograd"``) a hook runs as soon as autograd has a param's gradient
    (``post_accumulate_grad_hook``): it adds it into the param's slot of its unit's flat gradient (made, zeroed,
    when the unit's first gradient arrives), notes the param as used, and drops it. A step then holds about one
    gradient, filled while the backward frees the activations, as a plain PyTorch step does; micro-batches
    accumulate into the same flat gradients. Under ``torch.func.grad`` the gradients come back per param and
    ``collect`` copies them into unit buffers one unit at a time.
    """

    def __init__(self, layout: Layout, flats: dict[str, torch.Tensor], *, start: Callable[[torch.Tensor], Any] | None = None,
                 pool: Pool | None = None, wrap: Callable[[Any], Any] | None = None) -> None:
        super().__init__(layout.param_views(flats), None)
        self.layout = layout
        self.wrap = wrap  # UnitSettings.wrap_params: what loss_fn receives, made of the params dict
        self.pool = pool  # where the flat gradients' buffers come from (fzero.step._pool)
        self.flats: list[torch.Tensor | None] | None = None  # per unit, made on its first gradient (in place mode)
        # In place mode, in the last micro-batch: ``start(flat)`` starts a complete unit's reduction (the grads part's
        # ``start``) while the backward goes on, the units in descending order, as backward completes them (a unit
        # waits for those after it, so every rank starts the same reductions in the same order whatever the timing).
        self._start = start
        self._last = True
        self._arrived: list[int] = []
        self._started: list[Any] = []
        self._next = -1  # the unit to start next (descending)

    def make(self, xs: list[torch.Tensor]) -> Any:
        params = self.layout.assemble(xs, None if self.flats is not None else _usage.record)
        return params if self.wrap is None else self.wrap(params)

    @property
    def accumulates(self) -> bool:
        """Whether the gradients are accumulated in place (a micro-batch's own are not returned)."""
        return self.flats is not None

    def begin_micro(self, *, last: bool) -> None:
        """A micro-batch's gradient is about to be taken; ``last``: the step's last (its reductions may start)."""
        self._last = last

    def grad_into(self, leaves: list[torch.Tensor]) -> bool:
        """Hook each leaf (an alias of ``inputs``) so that its gradient goes into its unit's flat gradient as
        soon as autograd has it; True: ``torch.autograd.backward`` is to be used."""
        if self.flats is None:
            self.flats = [None] * len(self.layout.units)
            self._written = [[False] * len(u.slots) for u in self.layout.units]
        self._arrived = [0] * len(self.layout.units)
        if self._last and self._start is not None:
            self._started = [None] * len(self.layout.units)
            self._next = len(self.layout.units) - 1
        k = 0
        for u, unit in enumerate(self.layout.units):
            usage = _usage.active(unit)
            used = usage.used[unit.name] if usage is not None else None
            for i, slot in enumerate(unit.slots):
                leaves[k].register_post_accumulate_grad_hook(self._hook(u, slot, i, used))
                k += 1
        return True

    def _hook(self, u: int, slot: Any, i: int, used: list[bool] | None) -> Callable[[torch.Tensor], None]:
        count = len(self.layout.units[u].slots)

        def into_flat(param: torch.Tensor) -> None:
            flat = self._flat(u, param)
            where = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
            grad = param.grad
            if grad is None:  # (a post-accumulate-grad hook runs once the param has its gradient)
                return
            if self._written[u][i]:  # a later micro-batch: accumulate
                where.add_(grad)
            else:  # the slot's first gradient of the step: the buffer was not zeroed (a memset of the whole gradient)
                where.copy_(grad)
                self._written[u][i] = True
            param.grad = None
            if used is not None:
                used[i] = True
            self._arrived[u] += 1
            if self._arrived[u] == count and self._started:
                self._start_ready()

        into_flat.fzero_step_hook = True  # type: ignore[attr-defined]  # fzero's own (check_no_grad_hooks)
        return into_flat

    def _start_ready(self, *, all_: bool = False) -> None:
        """Start the reductions of the complete units from the top down, stopping at the first incomplete one
        (``all_``: at the end of the backward, every unit, complete or not)."""
        units, flats, start = self.layout.units, self._unit_flats(), self._start
        if start is None:  # (only a view made with ``start`` starts reductions: ``_started`` is empty otherwise)
            return
        while self._next >= 0 and (all_ or self._arrived[self._next] == len(units[self._next].slots)):
            u = self._next
            flat = self._holes_zeroed(u)
            flat = flat if flat is not None else self._zeros(units[u])
            flats[u] = None  # the pending reduction holds it
            self._started[u] = start(flat)
            self._next -= 1

    def _unit_flats(self) -> list[torch.Tensor | None]:
        if self.flats is None:
            raise RuntimeError("fzero internal error: a unit's gradient arrived before grad_into set up its flat buffers.")
        return self.flats

    def _flat(self, u: int, like: torch.Tensor) -> torch.Tensor:
        flats = self._unit_flats()
        flat = flats[u]
        if flat is None:  # uninitialised: each slot's first gradient is copied in, the rest zeroed by _holes_zeroed
            flat = flats[u] = take(self.pool, self.layout.units[u].padded, dtype=like.dtype, device=like.device)
        return flat

    def _holes_zeroed(self, u: int) -> torch.Tensor | None:
        """Unit ``u``'s flat gradient with what no gradient was written to (padding, params without a gradient) zeroed."""
        flat = self._unit_flats()[u]
        if flat is None:
            return None
        unit, written = self.layout.units[u], self._written[u]
        end = 0
        for slot, w in sorted(zip(unit.slots, written), key=lambda sw: sw[0].offset):
            if w:
                if slot.offset > end:
                    flat[end:slot.offset].zero_()
                end = max(end, slot.offset + slot.numel)
        if end < unit.padded:
            flat[end:].zero_()
        return flat

    def collect(self, grads: list[torch.Tensor]) -> list[Any]:
        """One gradient per unit: a flat tensor, or (reductions started in backward) a ``Pending`` of the reduced one."""
        if self.flats is not None:
            grads.clear()
            if self._started:
                self._start_ready(all_=True)
                started, self._started = self._started, []
                self.flats = None
                return started
            flats = [self._holes_zeroed(u) for u in range(len(self.layout.units))]
            self.flats = None
            return [f if f is not None else self._zeros(u) for u, f in zip(self.layout.units, flats)]
        return self.layout.flatten_grads(list(grads))

    def _zeros(self, unit: Any) -> torch.Tensor:  # a unit none of whose params got a gradient
        return torch.zeros(unit.padded, dtype=self.inputs[0].dtype, device=self.inputs[0].device)


@dataclasses.dataclass(frozen=True)
class ParamsReplicated:
    """Every rank holds every unit's whole flat buffer (stages 0-2)."""

    sharded: ClassVar[bool] = False

    def hold(self, flat: torch.Tensor, lo: int, hi: int, *, copy: bool) -> torch.Tensor:
        """What a rank keeps of a packed unit at init (``copy``: the packed buffer is shared by another rank)."""
        return flat.clone() if copy else flat

    def view(self, grads: GradsPart, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, release: Any,
             pool: Pool | None = None, masters: dict[str, torch.Tensor] | None = None,
             settings: UnitSettings = UnitSettings(), homes: dict[str, torch.Tensor] | None = None) -> StepView:
        """``masters`` (fp32 masters beside the params) is for stage 3, which gathers from them; whole params need none."""
        return grads.replicated_view(comm, state, reduce_dtype=reduce_dtype, pool=pool, settings=settings, homes=homes)

    def eval_view(self, comm: Any, state: Any, *, release: Any, settings: UnitSettings = UnitSettings()) -> View:
        layout = state.meta.layout
        return View([], lambda xs: layout.unpack(state.params))

    def local(self, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """This rank's slice of every unit, as views (what a sharded optimizer updates)."""
        return {u.name: flats[u.name][slice(*u.shard_range(rank, layout.world_size))] for u in layout.units}

    def gather_back(self, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
                    pool: Pool | None = None) -> None:
        """After a sharded optimizer updated this rank's slice: every rank's slices back into the whole buffers.
        Every unit's all-gather is issued before the first is waited for, so the ranks meet once, not once per unit
        (and the exchanges of ``dist_mesh`` on gloo run side by side). ``bucket_elements`` (stage 2's
        ``shard_grads(bucket_elements=...)``): consecutive units of one dtype gathered in one all-gather until they
        hold that many elements (``GatherBucket``), each unit's buffer then filled from the bucket's. A bucket's
        buffer is memory beside the params, so one is in flight at a time: it is filled in before the next is
        issued (all of them at once would hold a second copy of the params)."""
        pending: list[Pending] = []
        group: list[Any] = []

        def flush() -> None:
            if len(group) == 1:
                lo, hi = group[0].shard_range(comm.rank, comm.size)
                pending.append(comm.all_gather_async(flats[group[0].name], flats[group[0].name][lo:hi], tag="params"))
            elif group:
                shards = [flats[u.name][slice(*u.shard_range(comm.rank, comm.size))] for u in group]
                for p in pending:  # the bucket before this one is filled in (and its buffers back in the pool) first
                    p.wait()
                bucket = GatherBucket(comm, shards, pool=pool, label="+".join(u.name for u in group))
                pending.extend(Pending(functools.partial(bucket.fill, at, flats[u.name]))
                               for at, u in zip(bucket.offsets, group))
            group.clear()

        for u in layout.units:
            if group and group[0].dtype != u.dtype:
                flush()
            group.append(u)
            if sum(g.padded for g in group) >= bucket_elements:
                flush()
        flush()
        for p in pending:
            p.wait()


@dataclasses.dataclass(frozen=True)
class GradsAllReduce:
    """The whole gradient, summed over ranks by one all-reduce per unit after the backward (stage 0, as DDP)."""

    in_backward: ClassVar[bool] = False
    whole: ClassVar[bool] = True  # every rank ends with the whole gradient (the norm is taken over its slice of it)

    @property
    def units(self) -> tuple[str, ...] | None:
        """Units by size (``unit_elements``), not by module: None (``fzero.zero.GradsInBackward`` names module units)."""
        return None

    def unit_of(self, api: str) -> Callable[[str], str] | None:
        """How params are grouped into units: None, by size (``unit_elements``)."""
        return None

    def replicated_view(self, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, pool: Pool | None = None,
                        settings: UnitSettings = UnitSettings(), homes: dict[str, torch.Tensor] | None = None) -> View:
        """``homes`` is for the views that reduce in backward (stages 2-3); stages 0-1 reduce after it.

        The gradient is taken per param (``Layout.param_views``: one gradient in memory, not 2.6) and
        flattened into unit buffers, one unit at a time, for the collectives; under plain autograd each unit's
        reduction starts as soon as backward has completed it (``ParamView``), as DDP's buckets do."""
        def start(flat: torch.Tensor) -> Any:
            return self.start(comm, flat, reduce_dtype=reduce_dtype or flat.dtype, compute=flat.dtype, pool=pool)

        return ParamView(state.meta.layout, state.params, start=start if comm.size > 1 else None, pool=pool,
                         wrap=settings.wrap_params)

    def sync(self, comm: Any, grad: torch.Tensor, *, reduce_dtype: torch.dtype, compute: torch.dtype, pool: Pool | None = None) -> torch.Tensor:
        return self.start(comm, grad, reduce_dtype=reduce_dtype, compute=compute, pool=pool).wait()

    def start(self, comm: Any, grad: torch.Tensor, *, reduce_dtype: torch.dtype, compute: torch.dtype, pool: Pool | None = None) -> Any:
        """The gradient's reduction started now, waited for later (a ``Pending``; ``sync`` waits at once); in place,
        so ``pool`` (where a reduce-scatter's output comes from) is not needed."""
        pending = comm.all_reduce_async(grad.to(reduce_dtype), tag="grads")
        return Pending(lambda: pending.wait().to(compute))


@dataclasses.dataclass(frozen=True)
class OnDevice:
    """No offload: the optimizer state and masters live on the params' device, and the optimizer runs there."""

    where: ClassVar[str] = "device"

    @property
    def params(self) -> bool:
        return False

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def init(self, optimizer: Any, owned: dict[str, torch.Tensor], master: dict[str, torch.Tensor] | None,
             flats: dict[str, torch.Tensor], rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
        from fzero.step._update import MasterState

        if master is not None:
            return MasterState(master, optimizer.init(master)), flats
        return optimizer.init(owned), flats

    def apply(self, optimizer: Any, grads: dict[str, torch.Tensor], opt_state: Any, params: dict[str, torch.Tensor],
              segments: Any) -> Any:
        from fzero.step._update import apply_update

        return apply_update(optimizer, grads, opt_state, params, segments)

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        return None

    def grad_homes(self, shards: dict[str, tuple[torch.Tensor, int, int]]) -> None:
        """None: the optimizer runs where the gradient is made."""
        return None

    def has_masters(self, opt_state: Any) -> bool:
        from fzero.step._update import MasterState

        return isinstance(opt_state, MasterState)

    def masters(self, opt_state: Any, layout: Layout) -> dict[str, torch.Tensor]:
        return opt_state.master


ON_DEVICE = OnDevice()


@dataclasses.dataclass(frozen=True)
class OptStateReplicated:
    """The optimizer state of every param on every rank; each rank updates all of it (stage 0). Where it lives is its
    ``offload`` policy's to say (``OnDevice`` here; ``fzero.offload`` sets another on a sharded state)."""

    offload: OffloadPolicy = ON_DEVICE
    sharded: ClassVar[bool] = False

    def owned(self, params: ParamsPart, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """What this rank's optimizer updates, as views of ``flats`` (``params``: the step's params part)."""
        return dict(flats)

    def hold_master(self, master: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The fp32 master of what this rank owns of a unit (elements ``lo:hi`` of its packed master)."""
        return self.offload.hold(master if not self.sharded else master[lo:hi])

    def init(self, optimizer: Any, params: ParamsPart, layout: Layout, flats: dict[str, torch.Tensor],
             master: dict[str, torch.Tensor] | None, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
        """The optimizer state at init; returns (opt_state, flats) (a policy may move ``flats``, e.g. into files)."""
        return self.offload.init(optimizer, self.owned(params, layout, flats, rank), master, flats, rank)

    def has_masters(self, opt_state: Any) -> bool:
        """Whether the state keeps fp32 master weights (a mixed-precision policy)."""
        return self.offload.has_masters(opt_state)

    def masters(self, opt_state: Any, layout: Layout) -> dict[str, torch.Tensor]:
        """This rank's fp32 masters, by unit."""
        return self.offload.masters(opt_state, layout)

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        """Called with each param shard when its use is over (a file-backed shard gives its pages back); None: nothing to do."""
        return self.offload.release(opt_state)

    def apply(self, optimizer: Any, grads: dict[str, torch.Tensor], opt_state: Any, params: dict[str, torch.Tensor],
              segments: Any) -> Any:
        return self.offload.apply(optimizer, grads, opt_state, params, segments)

    def after_update(self, params: ParamsPart, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
                     pool: Pool | None = None) -> None:
        """Every rank updated every param: nothing to bring back."""
