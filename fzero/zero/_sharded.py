"""Stages 2 and 3: run an ordinary ``nn.Module`` unit by unit.

``loss_fn`` receives a ``ReplicatedParams`` at stage 2 and a ``ShardedParams`` at stage 3, and
``fzero.apply(model, params, ...)`` runs the model as follows, without a hook on the user's module
(DESIGN.md §3). At stage 2 a unit's call only attaches the reduce-scatter of its gradient
(``ReplicatedParams``); at stage 3:

* A *skeleton* of the module is built for the step: the same module objects' structure, its trainable
  parameters replaced by meta tensors (no memory), buffers and frozen parameters shared with the
  original. Each unit submodule of the skeleton is swapped for a ``_UnitCall``.
* The root unit (parameters outside every unit) is all-gathered once, through the ``AllGather``
  Function whose backward reduce-scatters, and passed to ``functional_call`` on the skeleton. Like
  FSDP2's root module, it stays gathered until backward is done with it.
* A unit's call runs it once, with its graph, gathered just for it (``fzero.zero._gathered``), through
  the step's ``Schedule`` of gathers with prefetch (``fzero.zero._schedule``). ``remat=True`` instead
  recomputes each unit in backward through ``fzero.remat``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch import nn

from fzero.layout._clone import clone_structure
from fzero.step import _usage
from fzero.step._pool import Pool
from fzero.dist._autograd import AllGather, ReplicatedShardGrad
from fzero.step._context import call_module, cast_floating, current_buffers, current_compute_dtype
from fzero.layout._layout import ROOT, Layout, Unit
from fzero.zero._gathered import run_unit
from fzero.zero._jit import compiled


class UnitParams(Mapping):
    """What ``loss_fn`` receives at stages 2 and 3: the params of each unit, made available unit by unit.

    ``fzero.apply(model, params, ...)`` runs the model on a skeleton whose units call ``run_unit`` at the
    moment the forward reaches them; the root unit's params come from ``views(root)`` at the top.
    """

    def __init__(self, inputs: dict[str, torch.Tensor], layout: Layout, comm: Any, *, reduce_dtype: torch.dtype | None = None,
                 jit: bool = False, pool: Pool | None = None) -> None:
        self.inputs = inputs  # the differentiable per-unit tensors (this rank's shards)
        self.pool = pool  # plain autograd: where the units' flat gradients and reduced shards are made (fzero.step._pool)
        self.jit = jit  # each unit's forward through torch.compile (fzero.zero._jit)
        self._compiled: dict[int, Any] = {}
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # gradients are summed across ranks in this dtype (None: as they are)
        self.compute_dtype = current_compute_dtype()
        self.units = {u.name: u for u in layout.units}
        self._unit_of = {s.path: u for u in layout.units for s in u.slots}
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        self._skeletons: dict[int, nn.Module] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # this step's buffers of the module being run (fzero.step._buffers)

    def run_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """What ``fzero.apply(module, self, ...)`` does: the model unit by unit (``apply_units``). ``fzero.apply``
        asks the params object for this method rather than importing this module, so the step does not depend
        on the transforms that plug into it."""
        return apply_units(module, self, args, kwargs)

    def runner(self, inner: nn.Module, unit: Unit) -> Any:
        """What runs a unit's module: itself, or (``jit``) its compiled forward."""
        return compiled(inner, unit.name, self._compiled) if self.jit else inner

    def unit_buffers(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The step's buffers inside ``unit``, by name relative to it."""
        prefix = unit.name + "."
        return {k[len(prefix):]: v for k, v in self.buffers.items() if k.startswith(prefix)}

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
        """``{path: tensor}`` of a whole unit, made once per step (its autograd node is created here)."""
        if unit.name not in self._views:
            split = functools.partial(_usage.split, pool=self.pool)
            self._views[unit.name] = self.layout.unit_views(unit, self._whole(unit), split)
        return self._views[unit.name]

    def _whole(self, unit: Unit) -> torch.Tensor:
        raise NotImplementedError

    def run_unit(self, inner: nn.Module, unit: Unit, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the views and skeletons at the end of the step: skeletons point back here (a cycle that
        would keep the root unit's gathered buffer alive until the garbage collector runs). Stage 3's root
        unit buffer goes back to the step's pool (lent again only once nothing holds it)."""
        self._views.clear()
        self._skeletons.clear()
        self._compiled.clear()
        root, self._root = getattr(self, "_root", None), None
        if root is not None and self.pool is not None:
            self.pool.give(root)

    def skeleton(self, module: nn.Module) -> nn.Module:
        skel = self._skeletons.get(id(module))
        if skel is None:
            skel = self._skeletons[id(module)] = _build_skeleton(module, self)
        return skel


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

    def __init__(self, inputs, layout, comm, wholes: dict[str, torch.Tensor], *, sink: Any = None, **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.wholes = wholes
        self.sink = sink  # under plain autograd: takes each unit's reduction while it is in flight (ShardGradView)

    def _whole(self, unit):
        return ReplicatedShardGrad.apply(self.inputs[unit.name], self.wholes[unit.name], self.comm, self.reduce_dtype,
                                         self.sink, unit.name)

    def run_unit(self, inner, unit, args, kwargs):
        prefix = len(unit.name) + 1
        views = {path[prefix:]: v for path, v in self.views(unit).items()}
        return call_module(inner, {**self.unit_buffers(unit), **views}, args, kwargs, call=self.runner(inner, unit))


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
        raise TypeError(
            f"fzero (stage 3): params are sharded, so params[{name!r}] has no full tensor to give. Run the model with "
            f"fzero.apply(model, params, ...), which gathers each unit when it runs; use step.gather(state) for full params."
        )

    def _whole(self, unit):
        if unit.name != ROOT:
            raise RuntimeError(f"fzero (stage 3): unit {unit.name!r} is gathered only inside its own forward.")
        # The root unit is gathered once and stays gathered until backward is done with it (as FSDP2 keeps its root).
        self._root = AllGather.apply(self.inputs[ROOT], self.comm, "params", "grads", self.reduce_dtype, self.pool)
        return self._root

    def run_unit(self, inner, unit, args, kwargs):
        return run_unit(inner, unit, self, args, kwargs)


def apply_units(module: nn.Module, params: UnitParams, args: tuple, kwargs: dict) -> Any:
    """``fzero.apply`` at stages 2 and 3: the skeleton, with the root unit's params, unit calls inside."""
    skel = params.skeleton(module)
    root = params.units.get(ROOT)
    views = params.views(root) if root is not None else {}
    bank = current_buffers()
    if bank is not None:  # the state's buffers: the root's go to this call, each unit's to the unit's call
        params.buffers = bank.for_module(module)
        units = [u + "." for u in params.units if u != ROOT]
        views = {**{k: v for k, v in params.buffers.items() if not k.startswith(tuple(units))}, **views}
    return call_module(skel, views, args, kwargs)


def _build_skeleton(module: nn.Module, params: UnitParams) -> nn.Module:
    api = f"fzero.apply (stage {3 if isinstance(params, ShardedParams) else 2})"
    dtype = params.compute_dtype  # under bf16/fp16, buffers and frozen params are cast copies for this step

    def skeleton_param(p):
        if p.requires_grad:
            return nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=True)
        return nn.Parameter(cast_floating(p.detach(), dtype), requires_grad=False) if dtype is not None else p

    skel = clone_structure(module, param=skeleton_param, buffer=lambda b: cast_floating(b, dtype))
    shapes = {n: tuple(p.shape) for n, p in skel.named_parameters(remove_duplicate=False) if p.requires_grad}
    trainable = set(shapes)
    layout = params.layout
    for unit in layout.units:
        unknown = [s.path for s in unit.slots if s.path not in trainable]
        if unknown:
            raise ValueError(
                f"{api}: the params name {unknown[:3]} (unit {unit.name!r}), which {type(module).__name__} has no trainable "
                f"parameter for. Pass the params of this model, e.g. step.init(fzero.params_of(model))."
            )
        for s in unit.slots:  # a state of another model width must not run (functional_call would run it anyway)
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
        own = {f"{unit.name}.{n}" for n, p in sub.named_parameters() if p.requires_grad}
        missing = sorted(own - {s.path for s in unit.slots})
        if missing:
            raise ValueError(
                f"{api}: unit {unit.name!r} uses parameter {missing[0]!r}, which is shared with (tied to) a parameter "
                f"outside the unit. A unit must own all its parameters: make the tied modules one unit, or leave them "
                f"in the root unit (units=... without {unit.name!r})."
            )
        parent_path, _, child = unit.name.rpartition(".")
        parent = skel.get_submodule(parent_path)
        parent._modules[child] = _UnitCall(sub, unit, params)
    return skel


class _UnitCall(nn.Module):
    """Stands in the skeleton where a unit was: each call is one gathered, recomputed Function."""

    def __init__(self, inner: nn.Module, unit: Unit, params: UnitParams) -> None:
        super().__init__()
        # not registered as a child: functional_call on the skeleton must not see the unit's meta params
        self.__dict__["_fz"] = (inner, unit, params)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner, unit, params = self.__dict__["_fz"]
        return params.run_unit(inner, unit, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner, unit, params = self.__dict__["_fz"]
            value = getattr(inner, name)
            if isinstance(value, torch.Tensor) and value.is_meta:
                path = f"{unit.name}.{name}"
                if isinstance(params, ReplicatedParams) and path in params.views(unit):
                    return params.views(unit)[path]  # stage 2: whole params exist; no gather involved
                raise AttributeError(
                    f"fzero.apply (stage 3): '{unit.name}.{name}' was read outside the forward of its unit {unit.name!r}; "
                    f"a unit's parameters exist only while the unit runs. Move that use into the unit's forward, or "
                    f"keep the module in the root unit (units=... without {unit.name!r})."
                ) from None
            return value
