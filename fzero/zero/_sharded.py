"""Stages 2 and 3: run an ordinary ``nn.Module`` unit by unit.

``loss_fn`` receives a ``ReplicatedParams`` at stage 2 and a ``ShardedParams`` at stage 3, and
``fzero.apply(model, params, ...)`` runs the model as follows, without a hook on the user's module
(docs/architecture.md, "The user's module, hooks and recompute"). At stage 2 a unit's call only attaches the reduce-scatter of its gradient
(``ReplicatedParams``); at stage 3:

* A *skeleton* of the module is built for the step: a clone of the module tree (``fzero.layout._modules``), its
  trainable parameters replaced by meta tensors (no memory: ``fzero.zero._stand_in``), buffers and frozen parameters shared with the
  original. Each unit keeps its place, its class and its hooks in the skeleton, as a ``_UnitSkin`` whose
  call runs the unit through the step's params object.
* The root unit (parameters outside every unit) is all-gathered once, through the ``AllGather``
  Function whose backward reduce-scatters, and passed to ``functional_call`` on the skeleton. Like
  FSDP2's root module, it stays gathered until backward is done with it.
* A unit's call runs it once, with its graph, gathered just for it, through
  the step's ``Schedule`` of gathers with prefetch (``fzero.zero._unit``). ``remat=True`` instead
  recomputes each unit in backward through ``fzero.remat``.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from fzero.autodiff import check_unit_hooks, remat
from fzero.layout import Binding, clone_structure, named_tensors, ROOT, Layout, Unit
from fzero.step import (usage as _usage, Pool, buffers_for_run, call_module, cast_floating, check_trainable_set,
                        check_no_grad_hooks, current_buffers, has_grad_hooks, current_compute_dtype, current_writes)
from fzero.mesh import AllGather, ReplicatedShardGrad, current_context
from fzero.zero._stand_in import _sharded_frozen, _StandIn
from fzero.zero._unit import _WRITTEN_IN_UNIT, _changed_share, _data_written, _unwrapped, run_unit
from fzero.zero._jit import compiled


class UnitParams(Mapping):
    """What ``loss_fn`` receives at stages 2 and 3: the params of each unit, made available unit by unit.

    ``fzero.apply(model, params, ...)`` runs the model on a skeleton whose units call ``run_unit`` at the
    moment the forward reaches them; the root unit's params come from ``views(root)`` at the top.
    """

    def __init__(self, inputs: dict[str, torch.Tensor], layout: Layout, comm: Any, *, reduce_dtype: torch.dtype | None = None,
                 jit_cache: dict[Any, Any] | None = None, pool: Pool | None = None) -> None:
        self.inputs = inputs  # the differentiable per-unit tensors (this rank's shards)
        self.pool = pool  # plain autograd: where the units' flat gradients and reduced shards are made (fzero.step._pool)
        self.jit_cache = jit_cache  # jit: each unit class's compiled forward, the step's (fzero.zero._jit); None: eager
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # gradients are summed across ranks in this dtype (None: as they are)
        self.compute_dtype = current_compute_dtype()
        self.units = {u.name: u for u in layout.units}
        self._unit_of = {s.path: u for u in layout.units for s in u.slots}
        self._views: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}  # (unit, grad enabled) -> its views
        self._skeletons: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(module) -> (module, its skeleton)
        # id(module) -> the Binding of its skeleton made with it, for the skeleton's first call only (a second call of
        # the module in the step may meet what the first one's forward changed on it: it walks the skeleton again)
        self._fresh: dict[int, Binding] = {}
        self.writes = current_writes()  # what the skeletons' forwards write on them (fzero.layout.Writes)
        self.buffers: dict[str, torch.Tensor] = {}  # this step's buffers of the module being run (fzero.step._module)
        self._root_frozen: dict[str, torch.Tensor] | None = None  # stage 3, frozen=: gathered once a step (``root_frozen``)

    def run_module(self, module: nn.Module, args: tuple, kwargs: dict, *, method: Any = None) -> Any:
        """What ``fzero.apply(module, self, ...)`` does: the model unit by unit (``apply_units``). ``fzero.apply``
        asks the params object for this method rather than importing this module, so the step does not depend
        on the transforms that plug into it. ``method``: a function of the module's class to run instead of
        ``forward`` (``fzero.apply(module.method, ...)``)."""
        return apply_units(module, self, args, kwargs, method=method)

    def runner(self, inner: nn.Module, unit: Unit, *, forward_only: bool = False) -> Any:
        """What runs a unit's module, as its own class (``_UnitSkin``): itself, or (``jit``) its compiled forward.
        ``forward_only``: the unit was called as ``unit.forward(...)`` (``_UnitSkin.forward``), read by the caller when
        the unit's forward ran, so that a remat recompute, which runs after that call returned, runs it so too."""
        if forward_only and (self.jit_cache is None or _own_hooks(inner)):  # its forward, without its module's hooks,
            # as in PyTorch (under jit: eager where the module has hooks of its own, which the compiled call would run)
            run: Any = lambda: inner.forward  # noqa: E731  (read under its own class: the user's forward)
        elif self.jit_cache is not None:
            run = functools.partial(compiled, inner, unit.name, self.jit_cache)
        else:
            run = lambda: inner  # noqa: E731
        return functools.partial(_as_own_class, inner, run)

    def unit_buffers(self, unit: Unit, inner: nn.Module) -> dict[str, torch.Tensor]:
        """The step's buffers inside ``unit`` (its module ``inner``), by name relative to it. Under a remat forward or
        recompute (``buffers_for_run``) the module's non-persistent ones too, which the step's bank does not hold:
        a forward that writes one (a running average kept out of the state_dict) must write it once, and the
        recompute must read what the forward read, as stages 0-1's units do (before: at stages 2-3 the recompute
        read the written value and wrote it again, 3.6e-3 off PyTorch after one AdamW step, silently)."""
        prefix = unit.name + "."
        own = {k[len(prefix):]: v for k, v in self.buffers.items() if k.startswith(prefix)}
        if current_context().snapshots is not None:
            own = {**{k: v for k, v in named_tensors(inner, "_buffers") if k not in own}, **own}
        return buffers_for_run(own)

    def __iter__(self) -> Iterator[str]:
        return iter(self._unit_of)

    def __len__(self) -> int:
        return len(self._unit_of)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._unit_of:
            raise KeyError(name)
        return self.views(self._unit_of[name])[name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(units={list(self.units)}, rank={self.comm.rank}/{self.comm.size})"

    def views(self, unit: Unit) -> dict[str, torch.Tensor]:
        """``{path: tensor}`` of a whole unit, made once per step and grad mode (its autograd node is created here).

        Per grad mode: a ``loss_fn`` may run the model under ``torch.no_grad()`` first (``model.generate``, a teacher
        pass) and with its graph after; views made without a graph, reused by the second forward, gave it no gradient
        (stage 2: all zero; stage 3: the root unit's missing, grad_norm 1.39 where torch's is 2.26)."""
        key = (unit.name, torch.is_grad_enabled())
        if key not in self._views:
            split = functools.partial(_usage.split, pool=self.pool)
            self._views[key] = self.layout.unit_views(unit, self._whole(unit), split)
        return self._views[key]

    def _whole(self, unit: Unit) -> torch.Tensor:
        raise NotImplementedError

    def root_frozen(self) -> dict[str, torch.Tensor]:
        """Frozen params the step holds sharded and gathers for the root unit (stage 3 only)."""
        return {}

    def frozen_paths(self) -> list[str]:
        """The module's frozen params the step holds (sharded, stage 3) rather than reading them from the module."""
        return []

    def frozen_seen(self) -> dict:
        """Those params as ``step.init`` copied them (``StateMeta.frozen_seen``)."""
        return {}

    def run_unit(self, inner: nn.Module, unit: Unit, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the views and skeletons at the end of the step: skeletons point back here (a cycle that
        would keep the root unit's gathered buffer alive until the garbage collector runs). Stage 3's root
        unit buffer goes back to the step's pool (lent again only once nothing holds it)."""
        self._views.clear()
        try:
            # the root unit stays gathered for the step: a write into it by the forward (under torch.func; plain autograd
            # refuses it first) would be dropped with the buffer, as a unit's is (UnitCall.run)
            if any(t._version != v for t, v in getattr(self, "_root_versions", [])):
                raise RuntimeError(_WRITTEN_IN_UNIT.format(unit=ROOT, cls=""))
            for full, sent in getattr(self, "_root_sent", []):  # a write through .data, as a unit's (UnitCall.run)
                root_unit = next(u for u in self.layout.units if u.name == ROOT)
                changed = _changed_share(full, sent, self.comm.rank)
                if full.device.type != "cpu":
                    getattr(self, "schedule").data_checks.append((root_unit, changed))  # (stage 3's alone have roots)
                elif bool(changed):
                    raise RuntimeError(_data_written(root_unit))
            if self.writes is not None:  # carried to the next micro-batch's skeleton, and kept when the step succeeds
                seen: set[int] = set()
                for module, skel in self._skeletons.values():
                    self.writes.note(module, skel, seen=seen)  # may refuse a kept tensor by name: before the update, so the state stays whole
        finally:
            self._skeletons.clear()
            self._fresh.clear()
            roots: list[torch.Tensor] = getattr(self, "_roots", [])
            self._roots: list[torch.Tensor] = []
            self._root_versions: list[tuple[torch.Tensor, int]] = []
            self._root_sent: list[tuple[torch.Tensor, torch.Tensor]] = []
            self._root_frozen = None
            if self.pool is not None:
                for root in roots:
                    self.pool.give(root)

    def skeleton(self, module: nn.Module) -> nn.Module:
        entry = self._skeletons.get(id(module))
        if entry is None:
            skel, self._fresh[id(module)] = _build_skeleton(module, self)
            entry = self._skeletons[id(module)] = (module, skel)
        return entry[1]

    def fresh_binding(self, module: nn.Module) -> Binding | None:
        """The Binding of ``module``'s skeleton made when it was built, once (None after: ``bound`` walks it again)."""
        return self._fresh.pop(id(module), None)


class ReplicatedParams(UnitParams):
    """Stage 2: every rank holds whole params; a unit's gradient is reduce-scattered to the shard as soon
    as backward has finished the unit.

    Autograd runs ready nodes newest first, so the node that reduce-scatters a unit's gradient must be
    created when the forward reaches the unit, not before the forward: one created up front (as a
    per-unit view of all params would be) runs after the whole backward, and every unit's whole
    gradient would be alive at once (measured: 17 units held of 16, stage 2 no better than stage 1).
    So a unit's tap is made on first use: when ``fzero.apply`` calls the unit, or ``params[name]`` is read.
    """

    unit_stage = 2  # what fzero.remat names in its error when given these params

    def __init__(self, inputs, layout, comm, wholes: dict[str, torch.Tensor], *, sink: Any = None, remat: bool = False,
                 **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.wholes = wholes
        self.sink = sink  # under plain autograd: takes each unit's reduction while it is in flight (ShardGradView)
        self.remat = remat  # recompute each unit's forward in backward (UnitSettings.remat)

    def _whole(self, unit):
        return ReplicatedShardGrad.apply(self.inputs[unit.name], self.wholes[unit.name], self.comm, self.reduce_dtype,
                                         self.sink, unit.name)

    def run_unit(self, inner, unit, args, kwargs):
        prefix = len(unit.name) + 1
        views = {path[prefix:]: v for path, v in self.views(unit).items()}
        run = self.runner(inner, unit, forward_only=called_as_forward(inner))

        def unit_forward(views, /, *args, **kwargs):  # under remat: the step's buffers as remat hands them out
            return call_module(inner, {**self.unit_buffers(unit, inner), **views}, args, kwargs, call=run, owned=self.buffers,
                               prefix=unit.name + ".")

        if not (self.remat and torch.is_grad_enabled()):
            return unit_forward(views, *args, **kwargs)
        unit_forward.__qualname__ = f"unit {unit.name!r}"
        unit_forward.module = inner  # type: ignore[attr-defined]  # what fzero.remat may walk (_norm_hooks)
        check_unit_hooks(inner, unit.name)
        return remat(unit_forward)(views, *args, **kwargs)


class ShardedParams(UnitParams):
    """Stage 3: this rank's shard of every unit; a unit exists whole only while it runs (and while its
    backward runs). ``remat``: recompute each unit in backward instead of keeping its activations."""

    unit_stage = 3  # what fzero.remat names in its error when given these params

    def __init__(self, inputs, layout, comm, schedule: Any, *, remat: bool = False, sink: Any = None, **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.schedule = schedule
        self.remat = remat
        self.sink = sink  # under plain autograd: takes each unit's reduction while it is in flight (ShardGradView)

    def __getitem__(self, name: str) -> Any:
        """Refused: no param exists whole outside its unit's call. The message names what reads params in ``loss_fn``
        besides a forward, a gradient with respect to them (SAM's ascent step, PCGrad's and GradNorm's per-task
        gradients returned through a surrogate loss), which stage 3 cannot give (its params are gathered views whose
        gradient is this rank's reduce-scattered shard), and the stages that run it: only step.gather was named, a
        fix outside the step."""
        raise TypeError(
            f"fzero (stage 3): params are sharded, so params[{name!r}] has no full tensor to give. Run the model with "
            f"fzero.apply(model, params, ...), which gathers each unit when it runs; use step.gather(state) for full "
            f"params outside a step. A gradient with respect to the params inside loss_fn (torch.autograd.grad(loss, "
            f"[params[n] ...]): SAM's perturbation, PCGrad's or GradNorm's per-task gradients, a surrogate loss "
            f"sum((p * g.detach()).sum())) needs every param whole on each rank: train it with stages=2 (params "
            f"replicated, gradients and optimizer state sharded), where it runs as in plain PyTorch; stage 3 does not "
            f"run it, with any units."
        )

    def _whole(self, unit):
        if unit.name != ROOT:
            raise RuntimeError(f"fzero (stage 3): unit {unit.name!r} is gathered only inside its own forward.")
        # The root unit is gathered once and stays gathered until backward is done with it (as FSDP2 keeps its root).
        cast = self.schedule.cast(ROOT) if self.schedule.cast is not None else None  # its master, where its shard is freed
        shard, device = self.inputs[ROOT], self.schedule.device
        if shard.device != device:  # params offloaded to the host: gathered on the device, as every unit is (the copy
            shard = shard.to(device, non_blocking=True)  # is differentiable: the gradient goes back to the host shard)
            cast = cast.to(device, non_blocking=True) if cast is not None else None
        root = AllGather.apply(shard, self.comm, "params", "grads", self.reduce_dtype, self.pool, cast)
        self._roots = [*getattr(self, "_roots", []), root]  # one per grad mode the step's forwards ran in (``views``)
        plain = _unwrapped(root)
        self._root_versions = [*getattr(self, "_root_versions", []), (plain, plain._version)]
        # what this rank sent, to find a write through .data at release (UnitCall._refuse_data_writes)
        if self.schedule.check_data:
            sent = _unwrapped(cast if cast is not None else shard).detach()
            self._root_sent = [*getattr(self, "_root_sent", []), (plain, sent)]
        return root

    def run_unit(self, inner, unit, args, kwargs):
        return run_unit(inner, unit, self, args, kwargs)

    def root_frozen(self) -> dict[str, torch.Tensor]:
        """The frozen params outside every unit (``step.init(..., frozen=...)``), gathered once for the step, as the root
        unit: ``{path: view}``."""
        if self._root_frozen is None:
            bufs, self._root_frozen = self.schedule.gather_root_frozen()
            self._roots = [*getattr(self, "_roots", []), *bufs]  # back to the pool at ``release``
        return self._root_frozen

    def frozen_paths(self) -> list[str]:
        """The module's frozen params this step holds sharded (``fzero.apply``'s check of meta tensors passes them)."""
        return [s.path for g in self.layout.frozen for s in g.slots]

    def frozen_seen(self) -> dict:
        return self.schedule.frozen_seen


def apply_units(module: nn.Module, params: UnitParams, args: tuple, kwargs: dict, *, method: Any = None) -> Any:
    """``fzero.apply`` at stages 2 and 3: the skeleton, with the root unit's params, unit calls inside.

    Under ``torch.inference_mode()`` it runs as under ``torch.no_grad()``: the step's buffers (gathers, the prefetch in
    flight) live past the call, and an inference tensor may not be written outside inference mode (torch's raw
    "Inplace update to inference tensor outside InferenceMode" when the prefetched gather landed)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False), torch.no_grad():
            return apply_units(module, params, args, kwargs, method=method)
    skel = params.skeleton(module)
    root = params.units.get(ROOT)
    views = params.views(root) if root is not None else {}
    views = {**views, **params.root_frozen()}
    bank = current_buffers()
    if bank is not None:  # the state's buffers: every one to this call, each unit's again to the unit's call
        # A unit's buffers are whole on every rank (never sharded): the skeleton holds the state's values for them
        # between the unit's calls too, so that code outside the unit reading them (the root undoing a unit's
        # BatchNorm with its running_var, a residual VQ's codebooks read by decode) reads the state's, not the
        # module's own, which the state took over at init and which no step writes (stage 3 read those: 8% off).
        params.buffers = bank.for_module(module)
        views = {**params.buffers, **views}
    return call_module(skel, views, args, kwargs, call=None if method is None else types.MethodType(method, skel),
                       owned=params.buffers, binding=params.fresh_binding(module))


def _build_skeleton(module: nn.Module, params: UnitParams) -> tuple[nn.Module, Binding]:
    """The skeleton of ``module`` for this step (see the module docstring), checked against the state's layout, and its
    ``Binding``: the walk the checks read its params from, which its first call binds with."""
    api = f"fzero.apply (stage {3 if isinstance(params, ShardedParams) else 2})"
    dtype = params.compute_dtype  # under bf16/fp16, buffers and frozen params are cast copies for this step

    hooked = []  # the user's trainable params with gradient hooks, which the step's gradient would never run
    # where the params compute (a stand-in's ``device``): stage 3's gathers land there, stage 2's params are there
    schedule = getattr(params, "schedule", None)
    device = schedule.device if schedule is not None else next((t.device for t in params.inputs.values()), None)
    sharded = _sharded_frozen(module, params.layout, params.frozen_seen(), api) if params.layout.frozen else {}

    # no torch function or dispatch mode and no torch.func transform on: a meta tensor made here is a plain one, which
    # the stand-ins may share from one step to the next (``_meta_base``); under any of them each is made as it comes
    plain = (not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack()
             and torch._C._functorch.peek_interpreter_stack() is None)

    def skeleton_param(p):
        held = sharded.get(id(p))
        if held is not None:  # a frozen param the state holds sharded (frozen=): a stand-in, bound from its unit's gather
            meta = torch.empty(p.shape, dtype=held[2], device="meta")
            stand = torch.Tensor._make_subclass(_StandIn, meta, False)
            stand.__dict__.update(_fz_where=held[:2], _fz_device=device)
            return stand
        if p.requires_grad:  # a data-less stand-in; empty_like(device="meta") costs ~40 us a call, a step makes one per param
            if has_grad_hooks(p):
                hooked.append(p)
            # in the dtype the unit runs it in (a bf16/fp16 policy's): ``model.dtype`` (transformers: the first param's)
            # read outside the unit says what stages 0-2 say, not the module's fp32 (a mask built in fp32 at stage 3 only)
            low = dtype if dtype is not None and p.is_floating_point() else p.dtype
            meta = (p.detach() if p.is_meta and low == p.dtype else _meta_base(p.size(), p.stride(), low) if plain else
                    torch.empty_strided(p.size(), p.stride(), dtype=low, device="meta"))
            stand = torch.Tensor._make_subclass(_StandIn, meta, True)  # what nn.Parameter(meta) runs, minus its Python
            stand.__dict__["_fz_device"] = device
            return stand
        return nn.Parameter(cast_floating(p.detach(), dtype), requires_grad=False) if dtype is not None else p

    # persistent buffers in the compute dtype (the step's bank replaces them); non-persistent ones (rotary inv_freq,
    # masks: constants) keep their own dtype, as FSDP2 and DeepSpeed keep them
    persistent = {id(b) for _, b in named_tensors(module, "_buffers", persistent_only=True)} if dtype is not None else set()
    skel = clone_structure(module, param=skeleton_param, buffer=lambda b: cast_floating(b, dtype) if id(b) in persistent else b,
                           writes=params.writes)
    if hooked and torch.is_grad_enabled():  # a gradient step (evaluate runs under no_grad); named by one more walk
        check_no_grad_hooks(named_tensors(module, "_parameters", remove_duplicate=False), module, api=api)
    # the checks read every stand-in's metadata (requires_grad, shape): with torch functions of subclasses off, at C
    # speed (through _StandIn.__torch_function__ each read costs ~6 us, ~5 ms a step at GPT-2 124M's 148 params)
    with torch._C.DisableTorchFunctionSubclass():
        # named_parameters(remove_duplicate=False) for every check below, from the walk that binds the skeleton's first
        # call (its parameter slots, in walk order: named_tensors(skel, "_parameters", remove_duplicate=False))
        binding = Binding.of(skel)
        every = [(name, slot[3]) for name, slot in binding.slots.items() if slot[1] == "_parameters"]
        layout = params.layout
        # the checks below that read only the params' names, ties, requires_grad and shapes (and the layout) passed for
        # these at an earlier step: not run again (``_checked_before``); the structure's checks and the skins, every step
        key, known_ties = _checked_before(layout, api, every)
        checked = known_ties is not None
        tied_names: dict[str, list[str]] = known_ties if known_ties is not None else {}
        if not checked:
            # first: a requires_grad changed since init would otherwise be blamed on the params' names or on ties below,
            # and a param made trainable since would run as the meta stand-in above, whose memory torch's CPU kernels read
            # as values
            check_trainable_set(every, [s.path for unit in layout.units for s in unit.slots], module, api=api)
            shapes = {n: tuple(p.shape) for n, p in every if p.requires_grad}
            trainable = set(shapes)
            owned = _own_trainable(every, [unit.name + "." for unit in layout.units if unit.name != ROOT])
            tied_names = _tie_groups(every)
        by_name: dict[str, torch.Tensor] = {n: p for n, p in every if isinstance(p, _StandIn)}
        for unit in layout.units:
            unknown = [] if checked else [s.path for s in unit.slots if s.path not in trainable]
            if unknown:
                buffers = {n for n, _ in named_tensors(module, "_buffers", remove_duplicate=False)}
                held = [n for n in unknown if n in buffers]
                why = (f" {held[:3]} {'are buffers' if len(held) > 1 else 'is a buffer'} of it: a state dict "
                       f"(model.state_dict(), torch.load of a checkpoint) holds buffers beside the parameters, and a "
                       f"step trains parameters only; the step takes the module's buffers itself.") if held else ""
                raise ValueError(
                    f"{api}: the params name {unknown[:3]} (unit {unit.name!r}), which {type(module).__name__} has no trainable "
                    f"parameter for.{why} Pass the params of this model, e.g. step.init(fzero.params_of(model))."
                )
            for s in () if checked else unit.slots:  # a state of another model width must not run (functional_call would run it anyway)
                if shapes[s.path] != s.shape:
                    raise ValueError(
                        f"{api}: unit {unit.name!r} param {s.path!r} has shape {s.shape} in the state but {shapes[s.path]} in "
                        f"the model ({type(module).__name__}): the state was made from another model or another configuration "
                        f"of it. Make the state from this model's params (step.init(fzero.params_of(model))), or run the model "
                        f"it came from."
                    )
            if unit.name == ROOT:
                continue
            try:
                sub = skel.get_submodule(unit.name)
            except AttributeError:
                raise ValueError(f"{api}: unit {unit.name!r} is not a submodule of {type(module).__name__}; pass units=fzero.units_of(model).") from None
            if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):  # never called itself: its params would never be gathered
                raise ValueError(
                    f"{api}: unit {unit.name!r} of {type(module).__name__} is a {type(sub).__name__}, which a model never calls "
                    f"(it calls the modules inside it), so the unit's params would never be gathered and its layers would run "
                    f"on meta tensors. The default units are the children of the first ModuleList/Sequential in each "
                    f"parameter's path, and here that child is a container of layers itself. Pass "
                    f"units=fzero.units_of(model), which goes into nested containers, to fzero.compile or fzero.shard_params "
                    f"(or name the layers: units=fzero.units_of(model, module_types=...))."
                )
            missing = [] if checked else sorted(owned[unit.name + "."] - {s.path for s in unit.slots})
            if missing:
                raise ValueError(_tied_outside(api, unit.name, missing[0], every, layout))
            for s in unit.slots:  # the other way round: a unit's param that a module outside the unit holds too
                # named in the error of an op given this stand-in outside its unit's call (a DiT's final layer reading
                # transformer_blocks[0].norm1.emb)
                placeholder = by_name.get(s.path)
                if placeholder is not None:
                    placeholder.__dict__["_fz_where"] = (unit.name, s.path)
                names = tied_names.get(s.path)
                if names is not None and any(not n.startswith(unit.name + ".") for n in names):
                    # refused where that module uses it (a tie whose other holder never runs trains as it is): the
                    # stand-in's error names the tie and the fix (_StandIn)
                    by_name[s.path].__dict__["_fz_tied"] = _tied_outside(api, unit.name, s.path, every, layout)
            sub.__class__ = _skinned(_UnitSkin, type(sub))  # type: ignore[arg-type]  # (classes hash)  sub is the skeleton's own clone: the user's module keeps its class
            sub.__dict__["_fz"] = (unit, params)
            owner_path, _, last = unit.name.rpartition(".")[0].rpartition(".")
            if last == "layers" and params.jit_cache is None:  # a unit of layers[i], whose owner may be a TransformerEncoder
                owner = skel.get_submodule(owner_path) if owner_path else skel
                if (isinstance(owner, nn.TransformerEncoder) and type(owner).forward is nn.TransformerEncoder.forward
                        and not isinstance(owner, (_UnitSkin, _EncoderSkin))):  # torch's forward, not a subclass's own
                    owner.__class__ = _skinned(_EncoderSkin, type(owner))  # type: ignore[arg-type]
    if not checked:  # every check passed: kept for the next steps (a change of any of the key's parts makes a new key)
        _CHECKED[id(layout)] = (weakref.ref(layout, functools.partial(_forget_checked, id(layout))), key, tied_names)
    return skel, binding


# id(layout) -> (a weak reference to it, the key of the last params that passed the skeleton's checks against it, their
# ties by first name): see ``_checked_before``. An entry goes with its layout; its id is checked against the live one.
_CHECKED: dict[int, tuple[Any, Any, dict[str, list[str]]]] = {}


def _forget_checked(ident: int, _: Any) -> None:
    """A layout in ``_CHECKED`` is gone: its entry with it."""
    _CHECKED.pop(ident, None)


def _checked_before(layout: Layout, api: str, every: list[tuple[str, torch.Tensor]]) -> tuple[Any, dict[str, list[str]] | None]:
    """``(key, ties)``: ``key``, what the skeleton's checks of the params against the state's layout read (``_build_skeleton``:
    the trainable set, the shapes, the units' own params, the ties); ``ties`` (``_tie_groups(every)``) where the last
    params that passed those checks against ``layout`` had this very key, else None (they run). The key is every param's
    name, the index of the first name of its tensor (which names are tied), its ``requires_grad`` and its shape, in the
    walk's order: a module added or removed, a param frozen or unfrozen, replaced by one of another shape or tied
    otherwise since, changes it. The skeleton's params are new objects at each step (stand-ins, cast frozen copies), so
    the key holds no identity, only that pattern. Those checks cost ~0.4 ms a step at GPT-2 124M's 148 params, the key
    ~0.05 ms; the structure's own (a unit that is a container, the skins) run at every step."""
    first: dict[int, int] = {}
    key = (api, [(n, first.setdefault(id(p), i), p.requires_grad, p.shape) for i, (n, p) in enumerate(every)])
    hit = _CHECKED.get(id(layout))
    if hit is not None and hit[0]() is layout and hit[1] == key:
        return key, hit[2]
    return key, None


@functools.lru_cache(maxsize=4096)
def _meta_base(size: torch.Size, stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of this size, stride and dtype, made once: each stand-in is its own tensor object over it
    (``_make_subclass`` aliases it, as ``p.detach()`` does a meta param), which a meta tensor can share since it has no
    memory to write. ``torch.empty_strided(..., device="meta")`` costs ~2 us, paid per trainable param per step."""
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


def _tie_groups(every: list[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """For each trainable tensor held under more than one name, its first name -> all its names (in ``every``'s order,
    so the first is the name ``named_parameters`` gives it and a unit's slot has)."""
    names: dict[int, list[str]] = {}
    for name, p in every:
        if p.requires_grad:
            names.setdefault(id(p), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}


def _tied_outside(api: str, unit: str, path: str, every: list[tuple[str, torch.Tensor]], layout: Layout) -> str:
    """The error for ``unit`` using ``path``, a parameter tied to one outside it: the names it is tied to and every
    unit that holds one of them, since all of those must leave the units (a fix naming ``unit`` alone left its tied
    partner in a unit of its own, which failed next as a meta tensor read outside its unit's call)."""
    tensor = dict(every)[path]
    tied = [name for name, p in every if p is tensor and name != path and not name.startswith(unit + ".")]
    units = [u.name for u in layout.units if u.name != ROOT]

    def owner(name: str) -> str:
        return next((u for u in units if name.startswith(u + ".")), ROOT)

    # every unit in a tie that crosses units, this one's and any other's: a fix naming this tie's alone failed next
    # on the next tie (an encoder-decoder sharing each layer's attention: layer.0's named, then layer.1's)
    owners = [{owner(name) for name in names} for names in _tie_groups(every).values()]
    holders = {unit} | {owner(name) for name in tied} | {u for group in owners if len(group) > 1 for u in group}
    holders.discard(ROOT)
    return (f"{api}: unit {unit!r} uses parameter {path!r}, which is tied to {tied} outside the unit (one tensor). A "
            f"unit must own all its parameters: make the tied modules one unit (a module that holds them all), or leave "
            f"every module holding it in the root unit (units=... without {sorted(holders)}: every unit in a tie that "
            f"crosses units).")


def _own_trainable(every: list[tuple[str, torch.Tensor]], prefixes: list[str]) -> dict[str, set[str]]:
    """For each unit prefix, the trainable parameter paths under it as ``submodule.named_parameters()`` names them:
    each tensor at the first path the walk reaches it by under that prefix (a tied weight inside the unit is one
    parameter). One pass over ``every``, each path looked up by its own prefixes (a step builds a skeleton every
    step: a pass per unit made this quadratic in the model's depth)."""
    own: dict[str, set[str]] = {prefix: set() for prefix in prefixes}
    seen: dict[str, set[int]] = {prefix: set() for prefix in prefixes}
    for path, p in every:
        end = path.find(".")
        while end != -1:
            prefix = path[:end + 1]
            if prefix in own and id(p) not in seen[prefix]:
                seen[prefix].add(id(p))
                if p.requires_grad:
                    own[prefix].add(path)
            end = path.find(".", end + 1)
    return own


class _UnitSkin(nn.Module):
    """What a unit of the skeleton is between its calls: the unit's own module object (a clone), at its own path, of a
    subclass of its own class (``_skinned``), as FSDP2 gives ``fully_shard``'s modules a subclass of theirs. So the
    skeleton's ``named_modules()``/``named_children()`` show the user's tree, ``isinstance`` holds, and what walks the
    tree (Hugging Face installing its output-capturing hooks) reaches the unit and what is inside it.

    A call goes to ``run_unit`` (gathered, at stage 3); inside it the module runs as its own class
    (``_as_own_class``), hooks and any ``__call__`` of its class (Hugging Face's checkpointing layers) included.
    Between calls its trainable params are meta tensors: a read of one outside the unit's forward raises.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        unit, params = self.__dict__["_fz"]
        if self.__dict__.get("_fz_encoder_layer") and not torch._C._is_torch_function_enabled():
            with torch._C._EnableTorchFunction():  # a layer of an ``_EncoderSkin``, which turned them off: on again
                return params.run_unit(self, unit, args, kwargs)
        return params.run_unit(self, unit, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The unit's forward called directly, not through its module's call (Hugging Face's SqueezeBERT encoder runs
        ``layer.forward(...)``): the unit is gathered and run as when called, and, as in PyTorch, its module's own hooks
        do not run (``_as_own_class``). Before: the forward ran on the skeleton's meta stand-ins, refused at stages 2-3."""
        self.__dict__["_fz_forward_only"] = True
        try:
            return self(*args, **kwargs)
        finally:
            self.__dict__.pop("_fz_forward_only", None)

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        if isinstance(value, torch.Tensor) and value.is_meta:
            unit, params = self.__dict__["_fz"]
            path = f"{unit.name}.{name}"
            if isinstance(params, ReplicatedParams) and path in params.views(unit):
                return params.views(unit)[path]  # stage 2: whole params exist; no gather involved
            raise AttributeError(
                f"fzero.apply (stage 3): '{unit.name}.{name}' was read outside the forward of its unit {unit.name!r}; "
                f"a unit's parameters exist only while the unit runs. Move that use into the unit's forward, or "
                f"keep the module in the root unit (units=... without {unit.name!r})."
            ) from None
        return value


class _EncoderSkin(nn.Module):
    """An ``nn.TransformerEncoder`` of the skeleton whose layers are units. In eval mode, with a padding mask and no
    gradient needed, PyTorch runs its layers on a nested tensor (its fast path), whose padded positions come out as
    zeros, where the standard path computes them. It decides by its first layer's params, which here are stand-ins
    (``_StandIn``, a class with ``__torch_function__``) until that layer's unit runs: torch counted them as foreign
    tensors and took the standard path, so ``step.evaluate`` at stage 3 gave another loss than PyTorch's eval (and
    FSDP2's) wherever the padded positions count (a sum over the sequence). Its forward (torch's own: a subclass with
    a forward of its own is left alone) runs with subclasses' torch functions off, so the stand-ins read as the
    parameters they stand for in its decision; each layer's unit call turns them on again (``_UnitSkin.__call__``, for
    the layers this forward marks), so a layer runs, gathered, as any unit does. Where the caller turned them off
    itself, the forward and its layers run as it asked.

    Not under ``jit``: a compiled layer given the fast path's nested tensor aborts the process in torch (its
    NestedTensorImpl "doesn't support strides"); there the standard path runs, as under a ``torch.compile`` of the
    whole model, which PyTorch keeps off the fast path too."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self).__dict__["_fz_class"].forward
        if not torch._C._is_torch_function_enabled():  # the caller turned them off itself: its layers run so too
            return forward(self, *args, **kwargs)
        layers = [m for m in getattr(self, "layers") if isinstance(m, _UnitSkin)]
        for m in layers:  # on the skeleton's own objects (one per step and rank): these calls turn them on again
            m.__dict__["_fz_encoder_layer"] = True
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return forward(self, *args, **kwargs)
        finally:
            for m in layers:
                m.__dict__.pop("_fz_encoder_layer", None)


@functools.cache
def _skinned(skin: type, cls: type) -> type:
    """The ``skin`` subclass of ``cls`` (``_UnitSkin``, ``_RematUnit``, ``_EncoderSkin``), named as ``cls``
    (``str(type(m))`` unchanged: Hugging Face keys its output-capture registry on it), with ``cls`` as ``_fz_class``.
    One per pair, made once: a cache of types, no state."""
    return type(cls.__name__, (skin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                            "_fz_class": cls})


def _own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks of its own, which its call runs and a call of its ``forward`` does not."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def called_as_forward(module: nn.Module) -> bool:
    """Whether the unit ``module`` is being called as ``module.forward(...)`` (``_UnitSkin.forward``): read at the
    call, since a remat recompute runs after the call has returned."""
    return bool(module.__dict__.get("_fz_forward_only"))


def _as_own_class(module: nn.Module, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """``runner()(*args, **kwargs)`` with ``module`` of its own class again for the call: its hooks and its class's
    ``__call__`` run as in eager PyTorch, and ``torch.compile`` (``jit``, made on the first call) sees the class it
    would see there."""
    skin = type(module)
    module.__class__ = getattr(skin, "_fz_class")  # set by _skinned
    try:
        return runner()(*args, **kwargs)
    finally:
        module.__class__ = skin
