"""The pure train step: ``Step.init(params) -> state`` and ``Step(state, batch) -> (state, metrics)``.

One rank program (``fzero.step._step``) serves every stage and every mesh: the loss and the gradient
with ``torch.func.grad`` over the flat unit buffers, then synchronise, update and bring the params back.
What differs between the ZeRO stages is in the step's three typed parts, ``params``, ``grads`` and
``opt_state`` (``fzero.step._parts``), which the transforms of ``fzero.zero`` replace.

Donation: a step reuses the buffers of the state it is given (as ``jax.jit(..., donate_argnums=0)``),
because ZeRO exists to save memory and a pure copy would double the optimizer state for a moment.
The state passed in is marked spent, and passing it again raises an error instead of reading buffers
that have moved on. ``donate=False`` copies the state first.

## The rank program (``rank_program``, ``eval_program``, at the end of this module)

One rank's program for a step and for an evaluation: the same for every stage.

A step: the ``params`` part makes the view that the gradient is taken over (``fzero.step._parts``), the
gradient is taken per micro-batch and accumulated (whole gradients, or shards where the ``grads`` part
reduces them in backward), and ``fzero.step._update.finish`` synchronises, checks, clips and updates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable

import optree
import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from fzero._rules import STAGE_NAMES
from fzero.layout import pytrees as _tree, DEFAULT_UNIT_ELEMENTS, Writes
from fzero.mesh import Rendezvous, ThreadComm, AGREE_FIX, with_context, current_context, DistMesh, LocalMesh, Mesh, program_fields
from fzero.step._batch import LossFnInContext, check_rows, gradient, keep_rank0_generators, split_batch, split_loss, split_micro
from fzero.step._hints import PARAM_WRITE_FIX, UNIT_OUTSIDE_ITS_CALL
from fzero.step._context import compute_dtype, recording_usage, step_buffers, sync_buffers
from fzero.step._init import init_state
from fzero.optim import ScheduleValues
from fzero.step._module import Buffers, FrozenWrites, Trained, broadcast_buffers, note_trained_buffers, note_trained_params
from fzero.step._params import module_device, replace_params
from fzero.step._refusals import check_export_model, check_params_hold_masters
from fzero.step._parts import GradsAllReduce, OnDevice, OptStateReplicated, ParamsReplicated
from fzero.step._protocols import GradsPart, OptStatePart, ParamsPart, UnitSettings
from fzero.step._pool import Pool
from fzero.step._state import (RankStates, TrainState, check_state_matches, claimed, is_busy, is_donated, is_verified, mark_donated,
                               mark_verified, probe_groupings, meta_of, share_marks, whole_frozen)
from fzero.step._update import MasterState, Precision, finish, loss_seed


@dataclasses.dataclass(frozen=True)
class Step:
    """A pure training step. Build it with ``fzero.train_step`` and the shard transforms, or ``fzero.compile``."""

    loss_fn: Callable[..., Any]
    optimizer: Any  # fzero.optim.GradientTransformation
    mesh: Mesh | None = None
    # the three parts the ZeRO transforms replace (fzero.step._parts): the stage is what they add up to
    params: ParamsPart = ParamsReplicated()  # where a rank keeps the params, what loss_fn sees
    grads: GradsPart = GradsAllReduce()  # how the gradient is synchronised
    opt_state: OptStatePart = OptStateReplicated()  # where the optimizer state and masters live, what a rank updates
    unit_elements: int = DEFAULT_UNIT_ELEMENTS
    # how units run (jit, buckets, prefetch, remat): the step's, set by shard_grads and shard_params
    unit_settings: UnitSettings = UnitSettings()
    donate: bool = True
    # "autograd": plain torch.autograd (the default); "func": torch.func.grad, which differentiates with
    # create_graph=True and so keeps the backward's intermediate gradients until it returns (measured on a 38M GPT:
    # 2.2x a gradient per step against 1.06x, and 10-14% slower); it also refuses torch.utils.checkpoint
    autodiff: str = "autograd"
    precision: Precision = Precision()  # fp32 unless a policy says otherwise
    grad_accum: int = 1  # micro-batches per optimizer step
    clip_grad_norm: float | None = None  # clip the global gradient norm to this
    on_nonfinite: str = "error"  # an inf/NaN gradient norm without a loss scale: "error" or "skip" the step
    # rows per rank per micro-batch (DeepSpeed's train_micro_batch_size_per_gpu), from a config: each call then
    # checks that its batch has micro_batch_size * grad_accum rows per rank; None: any number of rows
    micro_batch_size: int | None = None

    @property
    def world_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def stage(self) -> int:
        """The ZeRO stage the parts add up to: 3 sharded params, 2 gradients reduced in backward, 1 a sharded
        optimizer state, 0 none of these (recorded in the state, so that a state meets only its own kind of step)."""
        return 3 if self.params.sharded else 2 if self.grads.in_backward else 1 if self.opt_state.sharded else 0

    @property
    def stage_name(self) -> str:
        return STAGE_NAMES[self.stage]

    @property
    def offload(self) -> Any:
        """Where the optimizer state is offloaded: a ``CPUOffload`` or ``DiskOffload`` policy, or None (on the device)."""
        policy = self.opt_state.offload
        return None if isinstance(policy, OnDevice) else policy

    # -- init --------------------------------------------------------------------------------------
    def init(self, params: Any, *, buffers: dict[str, torch.Tensor] | None = None,
             materialize: Callable[[str, torch.Tensor], torch.Tensor] | None = None, donate: bool = False,
             frozen: dict[str, torch.Tensor] | None = None) -> TrainState | RankStates:
        """The initial state for ``params`` (a pytree of tensors, e.g. ``fzero.params_of(model)``; copied, never aliased).

        ``materialize(path, meta_tensor) -> tensor``: params may be meta tensors (a model built under
        ``fzero.empty_params()``), each made by this function when its unit is packed, so that a model
        too large for memory is never whole: only one unit and each rank's share exist at a time (as
        FSDP's ``param_init_fn`` or DeepSpeed's ``zero.Init``). ``path`` is the leaf's path, the
        ``named_parameters`` name for a dict from ``params_of``. Under ``dist_mesh`` ranks other than 0
        may pass meta params without it: rank 0's values are broadcast to them.
        ``materialize=fzero.checkpoint.pretrained(dir, model=model)`` reads them from a Hugging Face checkpoint.

        ``buffers``: the module's persistent buffers (``fzero.buffers_of(model)``; copied), part of the state
        from the start. Without it the first step adopts them from the module it runs (see ``fzero.step._module``).

        ``donate=True``: the memory of ``params`` is freed as each unit is packed (``resize_(0)``), so that a model
        built whole is not held beside its state: with ``fzero.params_of(model, copy=False)`` the module's own
        parameters go, and set-up peaks near the state instead of the module plus the state. The module's
        parameters keep their shapes but lose their values; it runs through ``fzero.apply`` with the state's params
        (``step.gather`` gives them back whole). Buffers are not donated.

        ``frozen``: at stage 3, the module's frozen parameters (``fzero.frozen_of(model)``; copied), sharded across
        the ranks as the trained ones are, as DeepSpeed ZeRO-3 and FSDP2 shard them: each unit's frozen params are
        gathered with the unit and freed after it. Without it they are read from the module, whole on every rank. The
        module's own copies are then no longer read: ``fzero.free_frozen(model)`` gives their memory back.
        """
        state = init_state(self, params, buffers=buffers, materialize=materialize, donate=donate, frozen=frozen)
        mark_verified(state, self)  # made by this step: nothing to compare at its first call
        return state

    # -- step --------------------------------------------------------------------------------------
    def __call__(self, state: TrainState | RankStates, batch: Any) -> tuple[TrainState | RankStates, dict[str, Any]]:
        """One optimizer step. Returns the new state and metrics: loss (mean over ranks), grad_norm, lr, step.

        The gradient is taken whatever the caller's grad mode, as ``torch.func.grad`` ignores a ``torch.no_grad()``
        around it: under ``no_grad`` stages 0-1 updated no param (their gradient hooks read the caller's mode and
        recorded every param as unused) while stages 2-3 trained, and under ``inference_mode`` every stage did nothing
        or raised torch's error on an inference tensor."""
        self._check_state(state)
        self._check_rows(batch)
        probe_groupings(self, state)  # a labels/mask function's new answer: followed, or refused before the state is spent
        hold = claimed(state, refuse=lambda: self._check_state(state)) if self.donate else contextlib.nullcontext()
        with hold, torch.inference_mode(False), torch.enable_grad(), _own_parametrize_cache():
            return self._call(state, batch)

    def _call(self, state: TrainState | RankStates, batch: Any) -> tuple[TrainState | RankStates, dict[str, Any]]:
        if not self.donate:
            state = _copied(state)
        if isinstance(self.mesh, LocalMesh) and isinstance(state, RankStates):  # (_check_state: a local mesh's state)
            generators: list = []  # a torch.Generator in the batch: each rank draws from its own copy
            batches = split_batch(batch, self.mesh.size, grad_accum=self.grad_accum, generators=generators,
                                  held=self.mesh.carry.held)
            results = self._on_ranks(rank_program, state, batches, schedules=ScheduleValues())
            keep_rank0_generators(generators, self.mesh.carry.held)
            new_state: Any = RankStates(tuple(r[0] for r in results))
            metrics = results[0][1]
        elif isinstance(state, TrainState):
            new_state, metrics = self._on_ranks(rank_program, state, batch, schedules=ScheduleValues())[0]
        else:
            raise TypeError(f"fzero.Step.__call__: expected the state of this step, got {type(state).__name__}.")
        mark_donated(state)
        mark_verified(new_state, self)
        return new_state, metrics

    def _on_ranks(self, program: Callable, state: TrainState | RankStates, batch: Any, *,
                  schedules: ScheduleValues | None = None) -> list[Any]:
        """``program`` on every rank of this process (a local mesh's, each with its own state and ``batch[rank]``; else
        this process's one), its results in rank order; then rank 0's writes on the user's modules are kept (see
        ``_as_rank``), in this thread, once every rank has returned. ``schedules``: the values the optimizer's
        schedules take in this step, one call each for every rank and every place that reads them
        (``fzero.optim._base.ScheduleValues``)."""
        synced: dict[int, nn.Module] | None = None
        held = None  # the random streams the modules hold: where each rank's copy ended (fzero.layout.HeldStreams)
        if isinstance(state, RankStates) and isinstance(self.mesh, LocalMesh):
            # several ranks in this process: each writes its own copies of what the modules hold (Writes), so that
            # none writes an object another reads, as each torchrun process has its own; rank 0's are kept, and each
            # rank's copy of a random stream goes on from its own state at the next call (HeldStreams)
            n = len(state.states)
            held = self.mesh.carry.held if n > 1 else None
            writes = [Writes(private=n > 1, start=None if held is None else functools.partial(held.start, rank=r, n=n))
                      for r in range(n)]
            # and none writes a frozen param they all share: refused once every rank has returned (FrozenWrites)
            frozen = FrozenWrites() if len(state.states) > 1 else None
            results = self.mesh.run(lambda comm, s, b: self._as_rank(comm, program, s, b, writes=writes[comm.rank],
                                                                     schedules=schedules, frozen=frozen),
                                    list(zip(state.states, batch)))
            if frozen is not None:
                frozen.check(len(state.states), api="fzero.Step.evaluate" if program is eval_program else "fzero.Step.__call__")
        else:
            api = "fzero.Step.evaluate" if program is eval_program else "fzero.Step.__call__"
            comm = self.mesh.comm(api=api) if isinstance(self.mesh, DistMesh) else ThreadComm(0, Rendezvous(1, 1.0), None)
            writes = [Writes()]
            synced = {} if isinstance(self.mesh, DistMesh) and comm.size > 1 else None  # (take_rank0_buffers)
            results = [self._as_rank(comm, program, state, batch, writes=writes[0], schedules=schedules, synced=synced)]
        if held is not None:
            held.keep(writes)
        else:
            writes[0].keep()
        if synced:  # every process ends the call holding rank 0's non-persistent buffers, as a local mesh's module does
            sync_buffers(comm, list(synced.values()))
        return results

    def _check_rows(self, batch: Any) -> None:
        """An empty batch, and rows other than the config's batch sizes say (``micro_batch_size``), refused by name."""
        n = self.world_size if isinstance(self.mesh, LocalMesh) else 1
        where = (f"the global batch of local_mesh({n})" if n > 1 else
                 f"rank {self.mesh.rank}'s batch" if isinstance(self.mesh, DistMesh) else "the batch")
        expected = None if self.micro_batch_size is None else self.micro_batch_size * self.grad_accum * n
        setting = (f"micro_batch_size={self.micro_batch_size} (a DeepSpeed config's train_micro_batch_size_per_gpu) x "
                   f"grad_accum={self.grad_accum} (gradient_accumulation_steps)" + (f" x {n} ranks" if n > 1 else ""))
        short = ("" if self.grad_accum == 1 else
                 f" If it is the short last batch of an epoch, drop it (DataLoader(..., drop_last=True)): a step here "
                 f"would split its rows into {self.grad_accum} micro-batches at full weight (under Accelerate, "
                 f"accumulate() steps on the fewer than {self.grad_accum} micro-batches left, each weighted "
                 f"1/{self.grad_accum}).")
        check_rows(batch, where=where, expected=expected, setting=setting, short=short)

    def _as_rank(self, comm, program: Callable, *args: Any, writes: Writes, schedules: ScheduleValues | None = None,
                 frozen: FrozenWrites | None = None, synced: dict[int, nn.Module] | None = None) -> Any:
        """``program`` as this rank, in its context. ``writes``: where the rank's copies of the user's modules note what
        its forward wrote on them (``fzero.layout.Writes``), for the caller to keep once the call has succeeded: in
        this process's calling thread, after every rank of a local mesh has returned (its rank 0's writes; a torchrun
        process keeps its own), so that no rank reads the user's modules while they are written. ``synced``: under
        ``dist_mesh`` of several processes, where ``fzero.apply`` notes the modules whose non-persistent buffers it took
        from rank 0 (``take_rank0_buffers``)."""
        api = "fzero.Step.evaluate" if program is eval_program else "fzero.Step.__call__"
        if isinstance(self.mesh, LocalMesh) and comm.size > 1:
            # The states of a local mesh come from one init, unless assembled by hand (or loaded): check
            # that the ranks hold one layout, as Step.init does once under dist_mesh. A description, not a
            # counted collective.
            state = args[0]
            fields = program_fields(state.meta.layout, stage=state.meta.stage, precision=self.precision, grad_accum=self.grad_accum)
            comm.agree(fields, api=api, fix=AGREE_FIX)
        # this rank's context (fzero.mesh's RankContext), made here once: fzero.apply runs clones of the user's modules (never
        # writing the user's own, fzero.step._context), and under dist_mesh the first forward agrees on the model
        clones: dict[int, tuple[nn.Module | None, nn.Module]] = {}  # (the module, or None for a root's submodule, its copy)
        trained = Trained() if program is rank_program else None  # the user's modules this step moves behind its state
        with with_context(comm=comm if isinstance(self.mesh, DistMesh) else None, api=api, clones=clones, writes=writes,
                          schedules=schedules, trained=trained, frozen=frozen, synced=synced):  # (schedules: what fzero.optim.scheduled reads, one value per schedule)
            out = program(self._in_context, comm, *args)
        # what the forward wrote in the modules' public attributes is the user's (fzero.layout, "What a forward writes on
        # its module"); every rank notes it (and so drops it from its copies: Writes.note), the caller keeps rank 0's
        seen: set[int] = set()  # a submodule's copy may be in two roots' trees: noted once
        for module, clone in clones.values():
            if module is not None:
                writes.note(module, clone, seen=seen)
        if trained is not None and (comm.rank == 0 or not isinstance(self.mesh, LocalMesh)):
            # the modules' buffers are now the state's to carry (fzero.apply outside a step then names those whose values
            # the state moved on from: fzero.step._module._trained), and their params are behind the state
            note_trained_buffers(trained.buffers, out[0].buffers)
            note_trained_params(trained.params)
        return out

    @functools.cached_property
    def pool(self) -> Pool:
        """The host buffers this step lends itself across units and calls (gradients, reduced shards): memory, never
        values (``fzero.step._pool``). A cache of this step object, as ``_in_context`` is, not a field: it
        describes no setting, and a step rebuilt by a transform starts an empty one."""
        return Pool()

    @functools.cached_property
    def _in_context(self) -> "Step":
        """This step with its ``loss_fn`` wrapped to name the batch when it fails (``LossFnInContext``): what the rank
        programs run. Made once per step object (a cache, not a field), so it is also the identity that warns once."""
        split = isinstance(self.mesh, LocalMesh) or self.grad_accum > 1
        in_context = dataclasses.replace(self, loss_fn=LossFnInContext(self.loss_fn, split=split, units=self.stage >= 2))
        in_context.__dict__["pool"] = self.pool  # one pool per step the user holds (its cache, as this one)
        return in_context

    # -- evaluate ----------------------------------------------------------------------------------
    def evaluate(self, state: TrainState | RankStates, batch: Any) -> dict[str, Any]:
        """``loss_fn`` on ``batch`` with the state's params, without a gradient or an update: metrics "loss"
        (mean over ranks) and "aux" (this rank's, when loss_fn returns one). On a ``local_mesh(n)`` the batch is split
        over the ranks and "aux" is rank 0's, of the first 1/n of the rows only: "aux_per_rank" is every rank's aux in
        rank order, that is in the batch's row order (a detector's detections of every image are
        ``[d for aux in metrics["aux_per_rank"] for d in aux]``); under ``dist_mesh`` each process has its own batch
        and its own "aux", and no "aux_per_rank". The module runs in the mode it is in:
        call ``model.eval()`` first for dropout off and BatchNorm's running statistics, as before a plain evaluation
        (the buffers the forward writes are dropped either way).

        The state is only read (not donated). At stage 3 each unit is gathered when it runs, as in a
        step, so the full params never exist at once, unlike ``gather`` followed by a plain forward.
        Under ``dist_mesh`` it is a collective: every rank calls it, each with its own batch.
        """
        self._check_state(state, api="fzero.Step.evaluate")
        with _own_parametrize_cache():
            if isinstance(self.mesh, LocalMesh) and isinstance(state, RankStates):
                generators: list = []
                results = self._on_ranks(eval_program, state, split_batch(batch, self.mesh.size, api="fzero.Step.evaluate",
                                                                          generators=generators, held=self.mesh.carry.held))
                keep_rank0_generators(generators, self.mesh.carry.held)
                metrics = results[0]
                if "aux" in metrics:  # rank 0's is of its share of the rows only: every rank's, for all of them
                    metrics["aux_per_rank"] = [r.get("aux") for r in results]
            else:
                metrics = self._on_ranks(eval_program, state, batch)[0]
        return metrics

    # -- gather ------------------------------------------------------------------------------------
    def gather(self, state: TrainState | RankStates) -> Any:
        """Full params as a fresh pytree with the structure ``init`` was given (e.g. a dict like ``params_of``), on
        the device the state keeps them: the host where the params or their fp32 masters are offloaded (as
        DeepSpeed consolidates offloaded weights; a full copy on the GPU may be what does not fit). Under a policy
        with fp32 masters (``precision="bf16"``/``"fp16"``) they are the masters, in fp32 whatever dtype the model's
        params had (a bf16 model's too), as DeepSpeed's ``safe_get_full_fp32_param`` and ``zero_to_fp32`` give them;
        ``model.load_state_dict`` casts them into the module's dtypes."""
        self._check_state(state, api="fzero.Step.gather")
        rank_state = state.states[0] if isinstance(state, RankStates) else state
        layout = meta_of(rank_state).layout
        has_master = self.opt_state.has_masters(rank_state.opt_state)  # with fp32 masters, they are the params to give

        def source(s: TrainState) -> dict[str, torch.Tensor]:
            return self.opt_state.masters(s.opt_state, layout) if has_master else s.params

        flats = source(rank_state)
        if self.params.sharded or (has_master and self.opt_state.sharded):  # every rank holds a shard
            if isinstance(state, RankStates):  # all the shards are in this process
                flats = {u.name: torch.cat([source(s)[u.name] for s in state.states]) for u in layout.units}
            elif isinstance(self.mesh, DistMesh):  # a collective: under dist_mesh every rank must call gather
                comm = self.mesh.comm(api="fzero.Step.gather")
                flats = {u.name: comm.all_gather(torch.empty(u.padded, dtype=flats[u.name].dtype, device=flats[u.name].device), flats[u.name], tag="gather") for u in layout.units}
        out = optree.tree_map(lambda t: t.detach().clone(), layout.unpack(flats))
        for s in state.states if isinstance(state, RankStates) else (state,):
            release = self.opt_state.release(s.opt_state)
            if release is not None:  # mapped param shards: pages back to the files
                for t in s.params.values():
                    release(t)
        return out

    def gather_frozen(self, state: TrainState | RankStates) -> dict[str, torch.Tensor]:
        """The frozen params the state holds sharded (``init(..., frozen=...)``), whole, as ``{name: tensor}``, each in its
        own dtype, the values ``init`` was given (the forward reads them cast to a precision policy's compute dtype);
        ``{}`` when it holds none. A collective under ``dist_mesh``, as ``gather``. ``restore_frozen`` puts them back
        into a module ``fzero.free_frozen`` emptied."""
        self._check_state(state, api="fzero.Step.gather_frozen")
        return whole_frozen(state, self.mesh.comm(api="fzero.Step.gather_frozen") if isinstance(self.mesh, DistMesh) else None)

    def restore_frozen(self, state: TrainState | RankStates, model: nn.Module) -> list[str]:
        """Put the frozen params ``state`` holds sharded back into ``model``, in place of the meta tensors
        ``fzero.free_frozen`` left, and return their names: each a parameter again (frozen, every name of a tied one
        the same object, as before). Then ``model`` runs and exports as a plain module (``load_state_dict(
        step.state_dict(state, model))`` for the trained params, ``save_pretrained``, ``merge_and_unload``). A collective
        under ``dist_mesh``, as ``gather``."""
        values = self.gather_frozen(state)
        held = list(values)
        if not isinstance(model, nn.Module):
            raise TypeError(f"fzero.Step.restore_frozen: model must be the nn.Module the state was made from, got "
                            f"{type(model).__name__}.")
        named = dict(model.named_parameters(remove_duplicate=False))
        wrong = [n for n, v in values.items() if n not in named or tuple(named[n].shape) != tuple(v.shape) or named[n].requires_grad]
        if wrong:
            raise ValueError(f"fzero.Step.restore_frozen: the state holds the frozen params {wrong[:4]}, which "
                             f"{type(model).__name__} does not have frozen with those shapes: pass the model the state was "
                             f"made from.")
        # a copy the module still holds as init read it is the state's value already: left as it is, so that no other
        # state made from this module (a second init, another step sharing the module) reads it as a write
        first = state.states[0] if isinstance(state, RankStates) else state
        seen = meta_of(first).frozen_seen
        values = {n: v for n, v in values.items()
                  if named[n].is_meta or seen.get(n) != (named[n]._version, named[n].data_ptr())}
        # on the module's device: the state keeps its shards on the host under offload_params (as load_into does)
        device = module_device(model)
        replace_params(model, {n: v.to(device) if device is not None else v for n, v in values.items()})
        # the module's copies are the state's values now: not a write the state would miss (``StateMeta.frozen_seen``)
        named = dict(model.named_parameters(remove_duplicate=False))
        for s in state.states if isinstance(state, RankStates) else (state,):
            meta_of(s).frozen_seen.update({n: (named[n]._version, named[n].data_ptr()) for n in values})
        return list(held)

    def with_buffers(self, state: TrainState | RankStates, buffers: dict[str, Any]) -> TrainState | RankStates:
        """A new state whose persistent buffers ``buffers`` (name -> value, as ``model.state_dict()`` names them) replace
        the state's, on every rank this process holds: how a buffer is set between steps (BatchNorm's statistics reset,
        a registered mask changed). Once a state holds a buffer, the module's own is not read again (a write to it is
        refused at the next step). Each value is copied, in the dtype and onto the device of the buffer it replaces.

        The new state shares everything else with ``state`` (the params, the optimizer state and, with disk offload, its
        files), as views of one state: once a step has reused the buffers of either, both are spent, and passing the
        other to a step, ``evaluate``, ``gather`` or ``checkpoint.save`` raises (a step updates those buffers in place)."""
        api = "fzero.Step.with_buffers"
        self._check_state(state, api=api)
        if not isinstance(buffers, dict):
            raise TypeError(f"{api}: buffers must be a dict of name -> tensor, got {type(buffers).__name__}.")
        out = []
        for s in state.states if isinstance(state, RankStates) else (state,):
            unknown = sorted(n for n in buffers if n not in s.buffers)
            if unknown:
                raise ValueError(
                    f"{api}: the state holds no buffer {unknown[:3]}; it holds {sorted(s.buffers)[:6]}"
                    f"{' ...' if len(s.buffers) > 6 else ''}. A state takes the module's persistent buffers at its first "
                    f"step (or from step.init(params, buffers=fzero.buffers_of(model))); before that, set them on the module."
                )
            new = dict(s.buffers)
            for name, value in buffers.items():
                old, value = s.buffers[name], torch.as_tensor(value)
                if value.is_meta:  # copying it was torch's bare "Cannot copy out of meta tensor; no data!"
                    raise ValueError(f"{api}: the value for buffer {name!r} is a meta tensor (a shape without data, as "
                                     f"fzero.empty_params() or torch.device('meta') builds a model); pass a tensor with values.")
                if value.shape != old.shape:
                    raise ValueError(f"{api}: buffer {name!r} has shape {tuple(old.shape)} in the state; the new value "
                                     f"has {tuple(value.shape)}.")
                new[name] = value.detach().to(old.device, old.dtype, copy=True)
            out.append(dataclasses.replace(s, buffers=new))
        result = RankStates(tuple(out)) if isinstance(state, RankStates) else out[0]
        share_marks(result, state)  # the same params and optimizer state: one step spends both
        return result

    def state_dict(self, state: TrainState | RankStates, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Params and buffers as ``model.state_dict()`` names them, for ``model.load_state_dict(sd, strict=True)``.

        Params are gathered as by ``gather`` (a collective under ``dist_mesh``; the fp32 masters under bf16/fp16,
        whatever dtype the model's params had), buffers are rank 0's, each in its own dtype. Given
        ``model`` (the module the params came from), the dict has exactly its ``state_dict`` keys in its
        order: tied parameters under every name, and what the state does not hold (frozen parameters,
        buffers a step has not adopted yet) from the model itself. Frozen parameters the state holds sharded
        (``init(..., frozen=...)``) come from the state, in their own dtypes (into a module ``fzero.free_frozen``
        emptied, ``restore_frozen`` first: loaded into its meta parameters they would be dropped).
        """
        self._check_state(state, api="fzero.Step.state_dict")
        params = self.gather(state)
        if not isinstance(params, dict):
            raise TypeError(f"fzero.Step.state_dict: the params pytree is a {type(params).__name__}; a state dict needs "
                            f"params by name, as fzero.params_of(model) gives them.")
        first = state.states[0] if isinstance(state, RankStates) else state
        own = {**params, **{k: v.detach().clone() for k, v in first.buffers.items()}, **self.gather_frozen(state)}
        if model is None:
            return own
        if not isinstance(model, nn.Module):
            raise TypeError(f"fzero.Step.state_dict: model must be the nn.Module the params came from, got {type(model).__name__}.")
        check_export_model(model, own, api="fzero.Step.state_dict")
        alias = {}  # id of a parameter -> the name it has in the state (tied parameters are held once)
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in own:
                alias[id(p)] = name
        out = {}
        for name, t in model.state_dict(keep_vars=True).items():
            key = name if name in own else alias.get(id(t))
            out[name] = own[key] if key is not None else t.detach().clone()
            # another width: load_state_dict would fail late. Params only: a buffer's shape is the forward's to change
            # (a per-channel FakeQuantize resizes its scale and zero_point at its first call, and loads them back so)
            if key is not None and key in params and tuple(out[name].shape) != tuple(t.shape):
                raise ValueError(f"fzero.Step.state_dict: {name!r} has shape {tuple(out[name].shape)} in the state but "
                                 f"{tuple(t.shape)} in {type(model).__name__}: the model is another configuration than the "
                                 f"one the state was made from. Pass that model.")
        unknown = sorted(set(own) - set(out))
        if unknown:
            raise ValueError(f"fzero.Step.state_dict: the state holds {unknown[:3]}, which {type(model).__name__}.state_dict() "
                             f"does not name; pass the model the state was made from.")
        return out

    # -- checks ------------------------------------------------------------------------------------
    def _check_state(self, state: Any, *, api: str = "fzero.Step.__call__") -> None:
        if is_busy(state) and not is_donated(state):
            raise ValueError(
                f"{api}: a step is running on this state now, in another thread, and updating its buffers in place "
                f"(one state passed to two steps at once: threads sharing a state, or a step called in a loss_fn that "
                f"each rank thread of a local_mesh runs). Give each thread its own state (step.init), or wait for the "
                f"step and use the state it returns."
            )
        if is_donated(state):
            raise ValueError(
                f"{api}: this state was already passed to a step, which reused its buffers (donation), or a state sharing "
                f"its buffers was (step.with_buffers' result and the state it was given are one). Use the state that step "
                f"returned: `state, metrics = step(state, batch)`; build steps with donate=False to keep old states. A "
                f"step that raised (or was interrupted) while it updated the state in place returned none: resume from a "
                f"checkpoint."
            )
        local = isinstance(self.mesh, LocalMesh)
        expected = f"RankStates of {self.world_size} ranks (from this step's init)" if local else "TrainState (from this step's init)"
        if local and not isinstance(state, RankStates) or not local and not isinstance(state, TrainState):
            raise TypeError(f"{api}: expected a {expected}, got {type(state).__name__}. {_REINIT_HINT}")
        states = state.states if isinstance(state, RankStates) else (state,)
        if local and len(states) != self.world_size:
            raise ValueError(f"{api}: state holds {len(states)} ranks but the step's local_mesh has {self.world_size}. {_REINIT_HINT}")
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
        for s in states:  # the rest (optimizer state, unit buffers) once per state this step did not make itself
            if not is_verified(s, self):
                check_state_matches(self, s, api=api)
                mark_verified(s, self)


def _copied(state: Any) -> Any:
    """``state`` with every tensor cloned, one clone per tensor: a tensor held twice (``multi_transform``'s groups share
    one Adam state, ``fzero.optim._state_parts.share_states``) is held twice by the copy too. Why: cloned leaf by leaf, each
    group got a moments tensor of its own, K copies where the step holds one, and a param its labels function then
    moved between two such groups (followed as torch.optim keeps ``state[p]``) would read the copy its new group
    never updated; the groups' update refuses that move, but only once the step has run this far."""
    clones: dict[int, torch.Tensor] = {}

    def clone(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in clones:
            clones[id(t)] = t.clone()
        return clones[id(t)]

    return _tree.tree_map(clone, state)


_REINIT_HINT = "Make the state with this step's init(params); to move a state between steps: new_step.init(old_step.gather(old_state))."


def rank_program(step: Any, comm: Any, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    prec = step.precision
    reduce_dtype = None if prec.reduce_dtype == prec.compute else prec.reduce_dtype
    # disk offload of params: a mapped shard's pages go back to its file after each use
    release = step.opt_state.release(state.opt_state)
    # under torch.func the backward's buffers are the transform's: a pool lends only to plain autograd's
    pool = step.pool if step.autodiff == "autograd" else None
    view = step.params.view(step.grads, comm, state, reduce_dtype=reduce_dtype, release=release, pool=pool,
                            masters=_masters_beside_params(step, state), settings=step.unit_settings,
                            homes=_grad_homes(step, comm, state))
    try:
        new_state, metrics = _step(step, comm, state, batch, view, release)
    finally:  # after the update (whose gradients are gone by now), or on an error: the params whole again
        view.restore()
    return dataclasses.replace(new_state, params=dict(state.params)), metrics


def _grad_homes(step: Any, comm: Any, state: TrainState) -> dict[str, torch.Tensor] | None:
    """Where each unit's gradient shard goes as backward makes it (the offload policy's ``grad_homes``): for stages 2-3
    under plain autograd, whose views take each unit's reduction in backward; None elsewhere."""
    if not step.grads.in_backward or step.autodiff != "autograd":
        return None
    units = meta_of(state).layout.units
    if step.params.sharded:  # the rank's shard is the state's flat itself
        shards = {u.name: (state.params[u.name], 0, state.params[u.name].numel()) for u in units}
    else:
        shards = {u.name: (state.params[u.name], *u.shard_range(comm.rank, comm.size)) for u in units}
    return step.opt_state.offload.grad_homes(shards)


def _masters_beside_params(step: Any, state: TrainState) -> dict[str, torch.Tensor] | None:
    """This rank's fp32 masters where they live beside its params (no offload), for a stage-3 view to gather from."""
    if step.offload is not None or not step.opt_state.has_masters(state.opt_state):
        return None
    return step.opt_state.masters(state.opt_state, meta_of(state).layout)


def _step(step: Any, comm: Any, state: TrainState, batch: Any, view: Any, release: Any) -> tuple[TrainState, dict[str, Any]]:
    prec = step.precision
    scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
    seed = loss_seed(scale, step.grad_accum, scaled=state.loss_scale is not None)  # fp16: scale / k, as DeepSpeed
    acc: list[torch.Tensor] | None = None
    losses, aux = [], None
    low = None if prec.compute == torch.float32 else prec.compute
    buffers = broadcast_buffers(comm, state.buffers)
    written = _refuse_lost_writes(step, comm, state, view)
    with compute_dtype(low), recording_usage(meta_of(state).layout) as usage:  # which params the gradients use (torch's grad=None)
        micros = split_micro(batch, step.grad_accum)
        for k, micro in enumerate(micros):
            view.begin_micro(last=k == len(micros) - 1)
            grads, loss, aux, buffers = gradient(step.loss_fn, view.build, view.inputs, micro, seed, step.autodiff, buffers, low,
                                                 into=view.grad_into, on_written=written, reader=meta_of(state).reader)
            view.release()
            # accumulate over micro-batches: whole gradients, or this rank's shards where reduced in backward
            # (or nothing to do: the view accumulated them in place)
            acc = grads if acc is None or view.accumulates else [a.add_(g) for a, g in zip(acc, grads)]
            del grads
            losses.append(loss)
    trained = current_context().trained
    if trained is not None:  # a module's trainable params written since the step before (_module.watch_module_writes)
        trained.check_writes()
    if not step.params.sharded and step.opt_state.has_masters(state.opt_state):  # stages 0-2 with fp32 masters
        _check_params_hold_masters(step, comm, state)
    acc = view.collect(acc)  # one gradient per unit (stages 0-1 flatten the per-param ones, freeing each as it goes)
    meta = view.finish(state.meta)
    loss = losses[0] if len(losses) == 1 else torch.stack([x.float() for x in losses]).mean()  # (a bf16 mean rounds)
    new_state, metrics = finish(step, comm, view.for_update(state), acc, loss, scale, meta, aux, usage, pool=step.pool,
                                spend=lambda: mark_donated(state))
    new_state = dataclasses.replace(new_state, buffers=buffers)
    if release is not None:  # e.g. the root unit's shard, or every shard of a skipped step
        for t in state.params.values():
            release(t)
    return new_state, metrics


@contextlib.contextmanager
def _own_parametrize_cache():
    """Inside ``torch.nn.utils.parametrize.cached()``, a step (or an evaluation) runs with a cache of its own, empty at
    its start, and the caller's is put back after it: as if the caller had entered ``cached()`` around this one call.
    Before, one ``cached()`` around several steps handed the second step the weights the first computed from the params
    before its update (2.9e-2 off PyTorch after a few AdamW steps at stages 0 and 3, silently; PyTorch's own loop
    refuses the second backward through the first graph), and entries of modules the step never runs (a frozen
    teacher's weight, cached for the iteration) are none of the step's. Outside ``cached()`` nothing is cached and
    nothing changes."""
    from torch.nn.utils import parametrize

    if not parametrize._cache_enabled:
        yield
        return
    saved = parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache = saved


# The states whose params were compared with their masters once (``_check_params_hold_masters``), by their first flat,
# held weakly: a write through ``.data`` is the forward's code, so a state's first step shows it.
_MASTERS_CHECKED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_MASTERS_LOCK = threading.Lock()  # the ranks of a local mesh are threads, each with its own state


def _check_params_hold_masters(step: Any, comm: Any, state: TrainState) -> None:
    """At the first step of a state's masters, before the update: refuse a forward that wrote its params through
    ``.data`` where the masters would overwrite the write (``fzero.step._refusals.check_params_hold_masters``)."""
    key = next(iter(state.params.values()), None)  # updated in place from step to step, as the masters are
    with _MASTERS_LOCK:
        if key is None or key in _MASTERS_CHECKED:
            return
    layout = meta_of(state).layout
    mapped = getattr(step.opt_state.offload, "mapped_masters", None)  # DiskOffload: its files, a sub-group at a time
    masters, chunk, release = (mapped(state.opt_state, layout) if mapped is not None
                               else (step.opt_state.masters(state.opt_state, layout), 0, None))
    check_params_hold_masters(state.params, masters, layout, rank=comm.rank, size=comm.size, sharded=step.opt_state.sharded,
                              chunk=chunk, release=release)
    with _MASTERS_LOCK:
        _MASTERS_CHECKED[key] = True


def _refuse_lost_writes(step: Any, comm: Any, state: TrainState, view: Any) -> Callable[[list[int]], list[str]]:
    """What the step does when the forward writes a param in place (``nn.Embedding(max_norm=...)`` renormalizes the
    rows it looks up; a model may edit a weight under ``torch.no_grad()``), given the indices of the inputs written:
    where the write lands in the train state itself and nothing else holds the value (one rank, stages 0-1, no master
    copies, nothing offloaded), as in plain PyTorch, it returns the names of the params written (for a backward that
    fails on the write to name them); elsewhere it refuses the write, naming the params and why the write would be
    lost, or would make the ranks' copies differ, silently."""
    if comm.size > 1:
        why = (f"each of the {comm.size} ranks would write its own copy from its own share of the batch, so the copies "
               f"would differ (plain DDP lets its replicas drift apart the same way) or be overwritten by the rank that "
               f"owns them")
    elif isinstance(state.opt_state, MasterState):
        why = ("the params are low-precision copies of fp32 masters, and the update starts from the masters, which "
               "never see the write")
    elif step.offload is not None:
        why = "the optimizer state is offloaded, and the update writes the params back from its own copy"
    elif step.stage >= 2:
        why = "at stages 2-3 each unit's params are made for its call and dropped after it"
    else:
        why = None

    def refuse(written: list[int]) -> list[str]:
        # a unit's params are views of one buffer and share its version counter: the unit is what can be named
        units = meta_of(state).layout.units
        per_slot = [u for u in units for _ in u.slots]
        owner = per_slot if len(per_slot) == len(view.inputs) else list(units)  # the inputs: per param, or per unit
        hit = list(dict.fromkeys(owner[i] for i in written if i < len(owner)))
        params = [s.path for u in hit for s in u.slots]
        if why is None:
            return params
        raise ValueError(
            f"fzero.Step: the forward wrote a param in place, one of {params[:6]}{' ...' if len(params) > 6 else ''} "
            f"(nn.Embedding(max_norm=...) renormalizes the rows it looks up in place; so does a model that edits a "
            f"weight under torch.no_grad()). Here the write would not be kept as plain PyTorch keeps it: {why}. "
            + PARAM_WRITE_FIX
        )

    return refuse


def eval_program(step: Any, comm: Any, state: TrainState, batch: Any) -> dict[str, Any]:
    prec = step.precision
    low = None if prec.compute == torch.float32 else prec.compute
    release = step.opt_state.release(state.opt_state)
    view = step.params.eval_view(comm, state, release=release, settings=step.unit_settings)
    # the state's buffers as the step would broadcast them; what the forward writes is dropped
    bank = Buffers(broadcast_buffers(comm, state.buffers, copy=True), lift=lambda t: t.clone(), dtype=low,
                   reader=meta_of(state).reader)
    with torch.no_grad(), compute_dtype(low), step_buffers(bank):
        loss, aux = split_loss(step.loss_fn(view.build([]), batch), api="fzero.Step.evaluate")
    if isinstance(loss, torch.Tensor) and loss.is_meta:  # torch would say only that .item() cannot read a meta tensor
        view.release()
        view.finish(state.meta)
        raise ValueError(f"fzero.Step.evaluate: loss_fn returned a meta tensor (a shape without a value).\n{UNIT_OUTSIDE_ITS_CALL}")
    view.release()
    view.finish(state.meta)  # the order a step records is not changed by an evaluation
    for t in state.params.values() if release is not None else ():  # the root unit's shard too
        release(t)
    metrics: dict[str, Any] = {"loss": float(comm.all_reduce(loss.detach().float().reshape(1), tag="metrics")[0]) / comm.size}
    if aux is not None:
        metrics["aux"] = aux
    return metrics
