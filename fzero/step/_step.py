"""The pure train step: ``Step.init(params) -> state`` and ``Step(state, batch) -> (state, metrics)``.

One rank program serves every stage and every mesh: compute the loss and the gradient with
``torch.func.grad`` over the flat unit buffers, synchronise the gradient (all-reduce at stage 0,
reduce-scatter at stages 1-2), update this rank's slice of the params with the optimizer, and
all-gather the params back (stages 1-2). The ZeRO transforms in ``_zero.py`` only change ``stage``.

Donation: a step reuses the buffers of the state it is given (as ``jax.jit(..., donate_argnums=0)``),
because ZeRO exists to save memory and a pure copy would double the optimizer state for a moment.
The state passed in is marked spent, and passing it again raises an error instead of reading buffers
that have moved on. ``donate=False`` copies the state first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree
import torch
from torch import nn

from fzero.layout import _tree
from fzero.dist._comm import Rendezvous, ThreadComm
from fzero.step._buffers import Buffers, broadcast_buffers
from fzero.step._context import compute_dtype, simulated_rank, step_buffers
from fzero.layout._layout import DEFAULT_UNIT_ELEMENTS, Layout, Slot, build_layout
from fzero.zero._sharded import ReplicatedParams, Schedule, ShardedParams, UnitParams
from fzero.layout._units import by_container_child, by_prefixes, check_units_exist
from fzero.dist._mesh import AGREE_FIX, DistMesh, LocalMesh, Mesh, program_fields
from fzero.step._precision import Precision, init_loss_scale, policy
from fzero.step._state import RankStates, StateMeta, TrainState, is_donated, mark_donated
from fzero.zero._offload import DiskOptState, OffloadPolicy, gather_master, init_disk
from fzero.step._update import MasterState, current_lr, finish, owned
from fzero.step._batch import split_batch, split_micro
from fzero.autodiff._gradient import gradient, split_loss
from fzero.layout._segments import LayoutSegments
from fzero.step._usage import recording
from fzero.optim._segments import use_segments

STAGE_NAMES = {0: "stage 0 (replicated, like DDP)", 1: "stage 1 (ZeRO-1)", 2: "stage 2 (ZeRO-2)", 3: "stage 3 (ZeRO-3)"}


@dataclasses.dataclass(frozen=True)
class Step:
    """A pure training step. Build it with ``fzero.train_step`` and the shard transforms, or ``fzero.compile``."""

    loss_fn: Callable[..., Any]
    optimizer: Any  # fzero.optim.GradientTransformation
    mesh: Mesh | None = None
    stage: int = 0
    unit_elements: int = DEFAULT_UNIT_ELEMENTS
    donate: bool = True
    units: tuple[str, ...] | None = None  # stages 2-3: unit module paths; None = children of ModuleList/Sequential
    prefetch: bool = True  # stage 3: gather the next unit while the current one computes
    remat: bool = False  # stage 3: recompute each unit in backward (gathering it again) instead of keeping activations
    autodiff: str = "func"  # "func": torch.func.grad; "autograd": plain torch.autograd.grad
    precision: Precision = Precision()  # fp32 unless a policy says otherwise
    grad_accum: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None  # clip the global gradient norm to this
    on_nonfinite: str = "error"  # an inf/NaN gradient norm without a loss scale: "error" or "skip" the step
    offload: OffloadPolicy | None = None  # optimizer state (and masters) on the host or in files

    @property
    def world_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    # -- init --------------------------------------------------------------------------------------
    def init(self, params: Any, *, buffers: dict[str, torch.Tensor] | None = None,
             materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> TrainState | RankStates:
        """The initial state for ``params`` (a pytree of tensors, e.g. ``fzero.params_of(model)``; copied, never aliased).

        ``materialize(path, meta_tensor) -> tensor``: params may be meta tensors (a model built under
        ``torch.device("meta")``), each made by this function when its unit is packed, so that a model
        too large for memory is never whole: only one unit and each rank's share exist at a time (as
        FSDP's ``param_init_fn`` or DeepSpeed's ``zero.Init``). ``path`` is the leaf's path, the
        ``named_parameters`` name for a dict from ``params_of``. Under ``dist_mesh`` ranks other than 0
        may pass meta params without it: rank 0's values are broadcast to them.

        ``buffers``: the module's persistent buffers (``fzero.buffers_of(model)``; copied), part of the state
        from the start. Without it the first step adopts them from the module it runs (see ``fzero.step._buffers``).
        """
        buffers = _checked_buffers(buffers)
        if materialize is not None and not callable(materialize):
            raise TypeError(f"fzero.Step.init: materialize must be a function (path, meta_tensor) -> tensor, got {materialize!r}.")
        n = self.world_size
        unit_of = None
        if self.stage >= 2:  # units by module: each one's gradient is reduced (stage 2) or gathered (3) as it runs
            unit_of = by_container_child if self.units is None else by_prefixes(self.units, api="fzero.Step.init")
        prec = self.precision
        low = None if prec.compute == torch.float32 else prec.compute
        layout = build_layout(params, world_size=n, unit_elements=self.unit_elements, unit_of=unit_of, dtype=low, api="fzero.Step.init")
        if self.units is not None:  # a typo would otherwise silently leave its params in the root unit
            check_units_exist(self.units, layout.paths, api="fzero.Step.init")
        leaves = _tree.tree_leaves(params)
        dist = isinstance(self.mesh, DistMesh)
        ranks = list(range(n)) if isinstance(self.mesh, LocalMesh) else [self.mesh.rank if dist else 0]
        receives = dist and ranks[0] != 0  # its values come from rank 0's broadcast
        if materialize is None and not receives and any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves):
            where = f"rank {ranks[0]} of dist_mesh" if dist else ("a local_mesh" if n > 1 else "a single rank")
            raise ValueError(
                "fzero.Step.init: params hold meta tensors (shapes without values) on " + where + ", and no materialize= "
                "makes them. Pass materialize=fn(path, meta_tensor) -> initial value (e.g. model.init_value), or real "
                "params; only ranks other than 0 under fzero.dist_mesh() may pass meta params alone (rank 0's values "
                "are broadcast to them, as FSDP's sync_module_states)."
            )
        make = None if receives else materialize
        # Unit by unit: pack, broadcast rank 0's values (as DDP does), keep what each rank holds, drop the
        # whole buffer; at stage 3 the params are never whole all at once (only shards and one unit).
        comm = self.mesh.comm() if dist else None
        if comm is not None:  # once, before any collective could pair unrelated buffers of one padded size
            fields = program_fields(layout, stage=self.stage, precision=prec, grad_accum=self.grad_accum)
            comm.agree(fields, api="fzero.Step.init", fix=AGREE_FIX)
        flats: dict[int, dict[str, torch.Tensor]] = {r: {} for r in ranks}
        masters: dict[int, dict[str, torch.Tensor]] | None = {r: {} for r in ranks} if prec.has_master else None
        for unit in layout.units:
            values = leaves
            if make is not None:  # this unit's meta leaves made once, for both packings below
                values = list(leaves)
                for j, slot in zip(layout.leaf_indices(unit), unit.slots):
                    if values[j].is_meta:
                        values[j] = _materialized(make, slot, values[j])
            flat = layout.pack_unit(unit, values)  # in the compute dtype
            master = layout.pack_unit(unit, values, dtype=torch.float32) if prec.has_master else None  # from fp32 values
            for t in (flat, master):
                if comm is not None and t is not None:
                    comm.broadcast(t, src=0, tag="init")
            for i, r in enumerate(ranks):
                lo, hi = unit.shard_range(r, n)
                flats[r][unit.name] = flat[lo:hi].clone() if self.stage == 3 else (flat.clone() if i else flat)
                if masters is not None:  # the optimizer updates fp32 masters of what this rank owns
                    masters[r][unit.name] = (master if self.stage == 0 else master[lo:hi]).clone()
            del flat, master, values
        states = [dataclasses.replace(self._init_rank(layout, flats.pop(r), masters and masters.pop(r), r),
                                      buffers={k: v.clone() for k, v in buffers.items()}) for r in ranks]
        return RankStates(tuple(states)) if isinstance(self.mesh, LocalMesh) else states[0]

    def _init_rank(self, layout: Layout, flats: dict[str, torch.Tensor], master: dict | None, rank: int) -> TrainState:
        """``flats``: this rank's shards at stage 3, whole units otherwise; ``master``: the fp32 copy of what it owns."""
        # the optimizer's per-parameter state (Adam's skip counts) is sized by the layout's params, not its buffers
        with use_segments(LayoutSegments(layout, stage=self.stage, rank=rank, comm=None)):
            if self.offload is not None and self.offload.where == "disk":
                opt_state: Any = init_disk(self.optimizer, self.offload, owned(layout, flats, self.stage, rank), master, rank)
                if self.offload.params:  # stage 3: the shards become files, mapped (see _offload.py)
                    flats = {name: opt_state.store.map(f"param/{name}", t) for name, t in flats.items()}
            elif master is not None:
                opt_state = MasterState(master, self.optimizer.init(master))
            else:
                opt_state = self.optimizer.init(owned(layout, flats, self.stage, rank))
        meta = StateMeta(layout=layout, stage=self.stage, world_size=layout.world_size, rank=rank)
        return TrainState(
            params=flats, opt_state=opt_state, step=torch.zeros((), dtype=torch.int64),
            loss_scale=init_loss_scale(self.precision.loss_scale), meta=meta,
        )

    # -- step --------------------------------------------------------------------------------------
    def __call__(self, state: TrainState | RankStates, batch: Any) -> tuple[TrainState | RankStates, dict[str, Any]]:
        """One optimizer step. Returns the new state and metrics: loss (mean over ranks), grad_norm, lr, step."""
        self._check_state(state)
        if not self.donate:
            state = _tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
        if isinstance(self.mesh, LocalMesh):
            batches = split_batch(batch, self.mesh.size)
            results = self.mesh.run(self._rank_step, [(s, b) for s, b in zip(state.states, batches)])
            new_state: Any = RankStates(tuple(r[0] for r in results))
            metrics = results[0][1]
        else:
            comm = self.mesh.comm() if isinstance(self.mesh, DistMesh) else ThreadComm(0, Rendezvous(1, 1.0), None)
            new_state, metrics = self._rank_step(comm, state, batch)
        mark_donated(state)
        return new_state, metrics

    def _rank_step(self, comm, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        return self._as_rank(comm, self._rank_program, state, batch)

    def _as_rank(self, comm, program: Callable, *args: Any) -> Any:
        if isinstance(self.mesh, LocalMesh) and comm.size > 1:
            # The states of a local mesh come from one init, unless assembled by hand (or loaded): check
            # that the ranks hold one layout, as Step.init does once under dist_mesh. A description, not a
            # counted collective.
            state = args[0]
            api = "fzero.Step.evaluate" if program == self._eval_program else "fzero.Step.__call__"
            fields = program_fields(state.meta.layout, stage=state.meta.stage, precision=self.precision, grad_accum=self.grad_accum)
            comm.agree(fields, api=api, fix=AGREE_FIX)
            with simulated_rank(comm.rank):
                return program(comm, *args)
        return program(comm, *args)

    # -- evaluate ----------------------------------------------------------------------------------
    def evaluate(self, state: TrainState | RankStates, batch: Any) -> dict[str, Any]:
        """``loss_fn`` on ``batch`` with the state's params, without a gradient or an update: metrics "loss"
        (mean over ranks) and "aux" (this rank's, when loss_fn returns one).

        The state is only read (not donated). At stage 3 each unit is gathered when it runs, as in a
        step, so the full params never exist at once, unlike ``gather`` followed by a plain forward.
        Under ``dist_mesh`` it is a collective: every rank calls it, each with its own batch.
        """
        self._check_state(state, api="fzero.Step.evaluate")
        if isinstance(self.mesh, LocalMesh):
            batches = split_batch(batch, self.mesh.size)
            return self.mesh.run(lambda comm, s, b: self._as_rank(comm, self._eval_program, s, b),
                                 [(s, b) for s, b in zip(state.states, batches)])[0]
        comm = self.mesh.comm() if isinstance(self.mesh, DistMesh) else ThreadComm(0, Rendezvous(1, 1.0), None)
        return self._as_rank(comm, self._eval_program, state, batch)

    def _eval_program(self, comm, state: TrainState, batch: Any) -> dict[str, Any]:
        layout, prec = state.meta.layout, self.precision
        low = None if prec.compute == torch.float32 else prec.compute
        # the state's buffers as the step would broadcast them; what the forward writes is dropped
        bank = Buffers(broadcast_buffers(comm, state.buffers, copy=True), lift=lambda t: t.clone(), dtype=low)
        with torch.no_grad(), compute_dtype(low), step_buffers(bank):
            if self.stage == 3:
                release = state.opt_state.store.release if isinstance(state.opt_state, DiskOptState) else None
                schedule = Schedule(comm, layout, state.params, state.meta.gather_order, self.prefetch, release=release)
                params: Any = ShardedParams(dict(state.params), layout, comm, schedule)
            else:  # every rank holds whole params
                params = layout.unpack(state.params)
            loss, aux = split_loss(self.loss_fn(params, batch))
        if self.stage == 3:
            schedule.finish()  # the order a step records is not changed by an evaluation
            params.release()
            for t in state.params.values() if release is not None else ():  # the root unit's shard too
                release(t)
        metrics: dict[str, Any] = {"loss": float(comm.all_reduce(loss.detach().float().reshape(1), tag="metrics")[0]) / comm.size}
        if aux is not None:
            metrics["aux"] = aux
        return metrics

    def _rank_program(self, comm, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        layout, n, prec = state.meta.layout, comm.size, self.precision
        reduce_dtype = None if prec.reduce_dtype == prec.compute else prec.reduce_dtype
        flats = state.params
        units = layout.units
        ranges = [u.shard_range(comm.rank, n) for u in units]
        names = [u.name for u in units]

        # disk offload of params: a mapped shard's pages go back to its file after each use
        release = state.opt_state.store.release if isinstance(state.opt_state, DiskOptState) else None
        if self.stage == 2:
            inputs = [flats[u.name][lo:hi] for u, (lo, hi) in zip(units, ranges)]

            def build(xs):
                return ReplicatedParams(dict(zip(names, xs)), layout, comm, flats, reduce_dtype=reduce_dtype)
        elif self.stage == 3:
            inputs = [flats[u.name] for u in units]  # the shards themselves
            schedule = Schedule(comm, layout, flats, state.meta.gather_order, self.prefetch, release=release)

            def build(xs):
                return ShardedParams(dict(zip(names, xs)), layout, comm, schedule, remat=self.remat, reduce_dtype=reduce_dtype)
        else:
            inputs = [flats[u.name] for u in units]

            def build(xs):
                return layout.unpack(dict(zip(names, xs)))

        made: list[Any] = []  # what loss_fn was given, to release after the gradient

        def as_params(xs):
            made.append(build(xs))
            return made[-1]

        scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
        acc: list[torch.Tensor] | None = None
        losses, aux = [], None
        low = None if prec.compute == torch.float32 else prec.compute
        buffers = broadcast_buffers(comm, state.buffers)
        with compute_dtype(low), recording(layout) as usage:  # which params the gradients use (torch's grad=None)
            for micro in split_micro(batch, self.grad_accum):
                grads, loss, aux, buffers = gradient(self.loss_fn, as_params, inputs, micro, scale, self.autodiff, buffers, low)
                for params in made:
                    if isinstance(params, UnitParams):
                        params.release()
                made.clear()
                # accumulate over micro-batches: whole gradients at stages 0-1, shards at stages 2-3
                acc = grads if acc is None else [a.add_(g) for a, g in zip(acc, grads)]
                losses.append(loss)
        meta = state.meta
        if self.stage == 3:
            meta = dataclasses.replace(meta, gather_order=schedule.finish())
        loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        new_state, metrics = finish(self, comm, state, acc, loss, scale, meta, aux, usage)
        new_state = dataclasses.replace(new_state, buffers=buffers)
        if release is not None:  # e.g. the root unit's shard, or every shard of a skipped step
            for t in new_state.params.values():
                release(t)
        return new_state, metrics

    # -- gather ------------------------------------------------------------------------------------
    def gather(self, state: TrainState | RankStates) -> Any:
        """Full params as a fresh pytree with the structure ``init`` was given (e.g. a dict like ``params_of``)."""
        self._check_state(state, api="fzero.Step.gather")
        rank_state = state.states[0] if isinstance(state, RankStates) else state
        layout = rank_state.meta.layout
        on_disk = isinstance(rank_state.opt_state, DiskOptState)
        has_master = isinstance(rank_state.opt_state, MasterState) or on_disk and rank_state.opt_state.master
        # with fp32 masters, they are the params to give

        def source(s: TrainState) -> dict[str, torch.Tensor]:
            if not has_master:
                return s.params
            return gather_master(s.opt_state, [u.name for u in layout.units]) if on_disk else s.opt_state.master

        flats = source(rank_state)
        if self.stage == 3 or (has_master and self.stage >= 1):  # every rank holds a shard
            if isinstance(state, RankStates):  # all the shards are in this process
                flats = {u.name: torch.cat([source(s)[u.name] for s in state.states]) for u in layout.units}
            elif isinstance(self.mesh, DistMesh):  # a collective: under dist_mesh every rank must call gather
                comm = self.mesh.comm()
                flats = {u.name: comm.all_gather(torch.empty(u.padded, dtype=flats[u.name].dtype), flats[u.name], tag="gather") for u in layout.units}
        out = optree.tree_map(lambda t: t.detach().clone(), layout.unpack(flats))
        if on_disk:  # mapped param shards read for this: their pages go back to the files
            for s in state.states if isinstance(state, RankStates) else (state,):
                for t in s.params.values():
                    s.opt_state.store.release(t)
        return out

    def state_dict(self, state: TrainState | RankStates, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Params and buffers as ``model.state_dict()`` names them, for ``model.load_state_dict(sd, strict=True)``.

        Params are gathered as by ``gather`` (a collective under ``dist_mesh``), buffers are rank 0's. Given
        ``model`` (the module the params came from), the dict has exactly its ``state_dict`` keys in its
        order: tied parameters under every name, and what the state does not hold (frozen parameters,
        buffers a step has not adopted yet) from the model itself.
        """
        params = self.gather(state)
        if not isinstance(params, dict):
            raise TypeError(f"fzero.Step.state_dict: the params pytree is a {type(params).__name__}; a state dict needs "
                            f"params by name, as fzero.params_of(model) gives them.")
        first = state.states[0] if isinstance(state, RankStates) else state
        own = {**params, **{k: v.detach().clone() for k, v in first.buffers.items()}}
        if model is None:
            return own
        if not isinstance(model, nn.Module):
            raise TypeError(f"fzero.Step.state_dict: model must be the nn.Module the params came from, got {type(model).__name__}.")
        alias = {}  # id of a parameter -> the name it has in the state (tied parameters are held once)
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in own:
                alias[id(p)] = name
        out = {}
        for name, t in model.state_dict(keep_vars=True).items():
            key = name if name in own else alias.get(id(t))
            out[name] = own[key] if key is not None else t.detach().clone()
        unknown = sorted(set(own) - set(out))
        if unknown:
            raise ValueError(f"fzero.Step.state_dict: the state holds {unknown[:3]}, which {type(model).__name__}.state_dict() "
                             f"does not name; pass the model the state was made from.")
        return out

    # -- checks ------------------------------------------------------------------------------------
    def _check_state(self, state: Any, *, api: str = "fzero.Step.__call__") -> None:
        if is_donated(state):
            raise ValueError(
                f"{api}: this state was already passed to a step, which reused its buffers (donation). Use the "
                f"state that step returned: `state, metrics = step(state, batch)`; build steps with donate=False to keep old states."
            )
        local = isinstance(self.mesh, LocalMesh)
        expected = f"RankStates of {self.mesh.size} ranks (from this step's init)" if local else "TrainState (from this step's init)"
        if local and not isinstance(state, RankStates) or not local and not isinstance(state, TrainState):
            raise TypeError(f"{api}: expected a {expected}, got {type(state).__name__}. {_REINIT_HINT}")
        states = state.states if local else (state,)
        if local and len(states) != self.mesh.size:
            raise ValueError(f"{api}: state holds {len(states)} ranks but the step's local_mesh has {self.mesh.size}. {_REINIT_HINT}")
        for s in states:
            meta = s.meta
            if meta is not None and meta.layout.units[0].dtype != self.precision.compute:
                raise ValueError(
                    f"{api}: state holds {meta.layout.units[0].dtype} params but this step computes in "
                    f"{self.precision.compute}. {_REINIT_HINT}"
                )
            if meta is None or meta.stage != self.stage or meta.world_size != self.world_size:
                made = "unknown" if meta is None else f"{STAGE_NAMES[meta.stage]} on {meta.world_size} rank(s)"
                raise ValueError(
                    f"{api}: state was made for {made}, but this step is {STAGE_NAMES[self.stage]} on "
                    f"{self.world_size} rank(s). {_REINIT_HINT}"
                )


def _checked_buffers(buffers: Any) -> dict[str, torch.Tensor]:
    if buffers is None:
        return {}
    if not isinstance(buffers, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in buffers.items()):
        raise TypeError(
            f"fzero.Step.init: buffers must be a dict of buffer name -> tensor, as fzero.buffers_of(model) returns; got "
            f"{type(buffers).__name__}."
        )
    meta = sorted(k for k, v in buffers.items() if v.is_meta)
    if meta:
        raise ValueError(f"fzero.Step.init: buffers {meta[:3]} are meta tensors; pass their values (fzero.buffers_of of a materialized model).")
    return buffers


_REINIT_HINT = "Make the state with this step's init(params); to move a state between steps: new_step.init(old_step.gather(old_state))."


def _materialized(materialize: Callable, slot: Slot, meta: torch.Tensor) -> torch.Tensor:
    """``materialize(path, meta)``, checked: Step.init's streaming init of a meta-device model."""
    value = materialize(slot.path, meta)
    if not isinstance(value, torch.Tensor) or value.shape != meta.shape or value.device.type != "cpu" or value.is_meta:
        got = f"a {type(value).__name__}" if not isinstance(value, torch.Tensor) else f"shape {tuple(value.shape)} on {value.device}"
        raise ValueError(
            f"fzero.Step.init: materialize({slot.path!r}, ...) returned {got}; it must return the parameter's initial "
            f"value, a CPU tensor of shape {tuple(meta.shape)}."
        )
    return value


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    mesh: Mesh | None = None,
    precision: str | Precision = "fp32",
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    **details: Any,
) -> Step:
    """Stage 0: a pure ``(state, batch) -> (state, metrics)`` step; gradients are all-reduced on a mesh (DDP).

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``. ``precision``: "fp32", "bf16",
    "fp16" (dynamic loss scale) or a ``fzero.Precision``. ``grad_accum=k``: each call splits the batch
    into k micro-batches on dim 0 and makes one update, equal to one k-times-larger batch.
    ``clip_grad_norm=c``: scale the gradient by min(1, c / (global norm + 1e-6)), as
    ``torch.nn.utils.clip_grad_norm_``. Details: ``unit_elements`` (size of the flat buffers that
    collectives move, default 16 Mi elements), ``donate`` (default True), ``autodiff`` ("func" or
    "autograd") and ``on_nonfinite`` ("error" or "skip": what an inf/NaN gradient norm does when there
    is no fp16 loss scale to back off).
    """
    if not callable(loss_fn):
        raise TypeError(f"fzero.train_step: loss_fn must be callable as loss_fn(params, batch), got {type(loss_fn).__name__}.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"fzero.train_step: optimizer must be an (init, update) GradientTransformation such as fzero.optim.adamw(1e-3), "
            f"got {type(optimizer).__name__}. (torch.optim optimizers are stateful objects and are not accepted.)"
        )
    if mesh is not None and not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.train_step: mesh must be fzero.local_mesh(n), fzero.dist_mesh() or None, got {mesh!r}.")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"fzero.train_step: grad_accum must be an int >= 1 (micro-batches per step), got {grad_accum!r}.")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0):
        raise ValueError(f"fzero.train_step: clip_grad_norm must be a number > 0 or None, got {clip_grad_norm!r}.")
    step = Step(
        loss_fn, optimizer, mesh, precision=policy(precision, api="fzero.train_step"), grad_accum=grad_accum,
        clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm),
    )
    return dataclasses.replace(step, **check_details(details, api="fzero.train_step"))


_DETAILS = {"unit_elements": int, "donate": bool, "autodiff": ("func", "autograd"), "on_nonfinite": ("error", "skip")}


def check_details(details: dict[str, Any], *, api: str) -> dict[str, Any]:
    import difflib

    for key, value in details.items():
        if key not in _DETAILS:
            close = difflib.get_close_matches(key, list(_DETAILS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{api}: unknown setting {key!r}.{hint} Settings: {', '.join(sorted(_DETAILS))}.")
        kind = _DETAILS[key]
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"{api}: {key} must be one of {kind}, got {value!r}.")
        elif not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise ValueError(f"{api}: {key} must be {'a positive int' if kind is int else 'True or False'}, got {value!r}.")
    return details
