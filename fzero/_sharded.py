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
* A unit's forward is one autograd Function, ``_UnitForward``: gather the unit's flat shard, run the
  unit with ``functional_call`` under no_grad, drop the gathered buffer; it saves only its inputs and
  shard. Its backward is a second Function, ``_UnitBackward``, whose forward re-gathers, recomputes the
  unit with grad, takes the vector-Jacobian product and reduce-scatters the parameter gradient into
  the shard gradient. Collectives run only in Function forwards: the pattern that works under
  ``torch.func`` (DESIGN.md §4), and under plain ``torch.autograd`` alike.
* Prefetch: the order in which units are gathered is recorded on a step and carried in the state; the
  next step issues the gather of the next unit asynchronously before it computes the current one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from fzero._autograd import AllGather, ReplicatedShardGrad
from fzero._context import cast_floating, current_compute_dtype
from fzero._layout import ROOT, Layout, Unit
from fzero.memory import note_gathered


class UnitParams(Mapping):
    """What ``loss_fn`` receives at stages 2 and 3: the params of each unit, made available unit by unit.

    ``fzero.apply(model, params, ...)`` runs the model on a skeleton whose units call ``run_unit`` at the
    moment the forward reaches them; the root unit's params come from ``views(root)`` at the top.
    """

    def __init__(self, inputs: dict[str, torch.Tensor], layout: Layout, comm: Any, *, reduce_dtype: torch.dtype | None = None) -> None:
        self.inputs = inputs  # the differentiable per-unit tensors (this rank's shards)
        self.layout = layout
        self.comm = comm
        self.reduce_dtype = reduce_dtype  # gradients are summed across ranks in this dtype (None: as they are)
        self.compute_dtype = current_compute_dtype()
        self.units = {u.name: u for u in layout.units}
        self._unit_of = {s.path: u for u in layout.units for s in u.slots}
        self._views: dict[str, dict[str, torch.Tensor]] = {}
        self._skeletons: dict[int, nn.Module] = {}

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
            self._views[unit.name] = self.layout.unit_views(unit, self._whole(unit))
        return self._views[unit.name]

    def _whole(self, unit: Unit) -> torch.Tensor:
        raise NotImplementedError

    def run_unit(self, inner: nn.Module, unit: Unit, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the views and skeletons at the end of the step: skeletons point back here (a cycle that
        would keep the root unit's gathered buffer alive until the garbage collector runs)."""
        self._views.clear()
        self._skeletons.clear()

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

    def __init__(self, inputs, layout, comm, wholes: dict[str, torch.Tensor], **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.wholes = wholes

    def _whole(self, unit):
        return ReplicatedShardGrad.apply(self.inputs[unit.name], self.wholes[unit.name], self.comm, self.reduce_dtype)

    def run_unit(self, inner, unit, args, kwargs):
        prefix = len(unit.name) + 1
        views = {path[prefix:]: v for path, v in self.views(unit).items()}
        return torch.func.functional_call(inner, views, args, kwargs, tie_weights=True, strict=False)


class ShardedParams(UnitParams):
    """Stage 3: this rank's shard of every unit; a unit exists whole only while it runs."""

    def __init__(self, inputs, layout, comm, schedule: "Schedule", **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.schedule = schedule

    def __getitem__(self, name: str) -> Any:
        raise TypeError(
            f"fzero (stage 3): params are sharded, so params[{name!r}] has no full tensor to give. Run the model with "
            f"fzero.apply(model, params, ...), which gathers each unit when it runs; use step.gather(state) for full params."
        )

    def _whole(self, unit):
        if unit.name != ROOT:
            raise RuntimeError(f"fzero (stage 3): unit {unit.name!r} is gathered only inside its own forward.")
        # The root unit is gathered once and stays gathered until backward is done with it (as FSDP2 keeps its root).
        return AllGather.apply(self.inputs[ROOT], self.comm, "params", "grads", self.reduce_dtype)

    def run_unit(self, inner, unit, args, kwargs):
        return _run_unit(inner, unit, self, args, kwargs)


def apply_units(module: nn.Module, params: UnitParams, args: tuple, kwargs: dict) -> Any:
    """``fzero.apply`` at stages 2 and 3: the skeleton, with the root unit's params, unit calls inside."""
    skel = params.skeleton(module)
    root = params.units.get(ROOT)
    views = params.views(root) if root is not None else {}
    return torch.func.functional_call(skel, views, args, kwargs, tie_weights=True, strict=False)


def _build_skeleton(module: nn.Module, params: UnitParams) -> nn.Module:
    api = f"fzero.apply (stage {3 if isinstance(params, ShardedParams) else 2})"
    memo: dict[int, Any] = {}
    dtype = params.compute_dtype  # under bf16/fp16, buffers and frozen params are cast copies for this step
    for p in module.parameters():
        if p.requires_grad:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=True)
        else:
            memo[id(p)] = nn.Parameter(cast_floating(p.detach(), dtype), requires_grad=False) if dtype is not None else p
    for b in module.buffers():
        memo[id(b)] = cast_floating(b, dtype)
    skel = copy.deepcopy(module, memo)
    trainable = {n for n, p in skel.named_parameters(remove_duplicate=False) if p.requires_grad}
    layout = params.layout
    for unit in layout.units:
        unknown = [s.path for s in unit.slots if s.path not in trainable]
        if unknown:
            raise ValueError(
                f"{api}: the params name {unknown[:3]} (unit {unit.name!r}), which {type(module).__name__} has no trainable "
                f"parameter for. Pass the params of this model, e.g. step.init(fzero.params_of(model))."
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


class _Call:
    """One invocation of one unit: what both Functions need to (re)run it."""

    def __init__(self, inner, unit, params, spec, leaves, tensor_pos):
        self.inner, self.unit, self.params = inner, unit, params
        self.spec, self.leaves, self.tensor_pos = spec, leaves, tensor_pos
        self.out_spec = None
        self.out_leaves = None
        self.pos = None  # this call's position in the step's gather order (forward)

    def gather(self, shard: torch.Tensor, phase: str) -> torch.Tensor:
        return self.params.schedule.gather(self, shard, phase)

    def run(self, full: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        prefix = len(self.unit.name) + 1
        views = {path[prefix:]: v for path, v in self.params.layout.unit_views(self.unit, full).items()}
        leaves = list(self.leaves)
        for pos, t in zip(self.tensor_pos, tensors):
            leaves[pos] = t
        args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        out = torch.func.functional_call(self.inner, views, args, kwargs, tie_weights=True, strict=False)
        out_leaves, self.out_spec = torch_pytree.tree_flatten(out)
        self.out_leaves = [_SLOT if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]


_SLOT = object()  # marks where a tensor goes back into a flattened pytree of a unit's inputs or outputs


def _run_unit(inner, unit, params, args, kwargs):
    leaves, spec = torch_pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    call = _Call(inner, unit, params, spec, [_SLOT if isinstance(x, torch.Tensor) else x for x in leaves], tensor_pos)
    rng = torch.get_rng_state()  # the recompute in backward replays the same random numbers (dropout)
    outs = _UnitForward.apply(params.inputs[unit.name], call, rng, *[leaves[i] for i in tensor_pos])
    out_leaves = list(call.out_leaves)
    it = iter(outs)
    out_leaves = [next(it) if x is _SLOT else x for x in out_leaves]
    return torch_pytree.tree_unflatten(out_leaves, call.out_spec)


class _UnitForward(torch.autograd.Function):
    @staticmethod
    def forward(shard, call, rng, *inputs):
        full = call.gather(shard, "forward")
        with torch.no_grad():
            outs = call.run(full, list(inputs))
        del full  # the gathered unit is dropped here, not kept for backward
        # a Function must not return one of its inputs as is
        return tuple(o.view_as(o) if any(o is x for x in inputs) else o for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, call, rng, *ins = inputs
        ctx.call = call
        ctx.save_for_backward(shard, rng, *ins)
        ctx.mark_non_differentiable(*[o for o in output if not o.is_floating_point()])

    @staticmethod
    def backward(ctx, *grad_outs):
        shard, rng, *ins = ctx.saved_tensors
        res = _UnitBackward.apply(shard, ctx.call, rng, len(ins), *ins, *grad_outs)
        grads_in = list(res[1:])
        return (res[0], None, None, *[grads_in.pop(0) if x.is_floating_point() else None for x in ins])


class _UnitBackward(torch.autograd.Function):
    @staticmethod
    def forward(shard, call, rng, n_in, *rest):
        ins, grad_outs = rest[:n_in], rest[n_in:]
        full = call.gather(shard, "backward").requires_grad_()
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in ins]
        with torch.enable_grad(), torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            outs = call.run(full, leaves)
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if o.requires_grad]
        wrt = [full] + [x for x in leaves if x.is_floating_point()]
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) if pairs else [None] * len(wrt)
        grads = [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]
        del outs, pairs, full
        grad_full = grads[0] if call.params.reduce_dtype is None else grads[0].to(call.params.reduce_dtype)
        grad_shard = call.params.comm.reduce_scatter(grad_full, tag="grads")
        grad_shard = grad_shard.to(shard.dtype)  # summed in the reduce dtype, kept in the params' dtype
        return (grad_shard, *[g.detach() for g in grads[1:]])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fzero (stage 3): double backward through a unit is not supported (a unit's backward is a recompute).")


class Schedule:
    """The gathers of one step on one rank, with prefetch.

    ``order`` is the sequence of units the previous step gathered (forward, then backward), carried in
    the state. While this step follows it, every gather starts the next one asynchronously, so it
    overlaps the current unit's compute; at most one prefetched unit is held at a time. The first
    departure from the order stops prefetch for the rest of the step (pending gathers are completed
    and dropped, on every rank alike), and the order this step really took goes into the new state.
    """

    def __init__(self, comm: Any, layout: Layout, shards: dict[str, torch.Tensor], order: tuple[str, ...], prefetch: bool,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.comm = comm
        self.release = release  # disk offload of params: give a shard's pages back once it is gathered
        self.units = {u.name: u for u in layout.units}
        self.shards = shards  # the state's own shard tensors (not the autograd-wrapped ones)
        self.order = order
        self.seen: list[str] = []
        self.pending: dict[int, tuple[str, Any]] = {}
        self.following = prefetch and bool(order)
        if self.following:
            self._issue(0)

    def _issue(self, pos: int) -> None:
        if pos < len(self.order):
            unit = self.units[self.order[pos]]
            out = note_gathered(torch.empty(unit.padded, dtype=unit.dtype))
            self.pending[pos] = (unit.name, self.comm.all_gather_async(out, self.shards[unit.name], tag="params"))

    def _drain(self) -> None:
        for _, handle in self.pending.values():
            handle.wait()
        self.pending.clear()

    def gather(self, call: "_Call", shard: torch.Tensor, phase: str) -> torch.Tensor:
        pos, name = len(self.seen), call.unit.name
        self.seen.append(name)
        ahead = self.pending.pop(pos, None)
        if self.following and ahead is not None and ahead[0] == name:
            full = ahead[1].wait()
        else:
            if self.following:  # off the recorded order: stop prefetching this step
                self.following = False
                if ahead is not None:
                    ahead[1].wait()
                self._drain()
            full = note_gathered(torch.empty(call.unit.padded, dtype=shard.dtype, device=shard.device))
            self.comm.all_gather(full, shard, tag="params")
        if self.release is not None:
            self.release(self.shards[name])
        if self.following:
            self._issue(pos + 1)
        return full

    def finish(self) -> tuple[str, ...]:
        """Complete what is still in flight; the order this step took."""
        self._drain()
        return tuple(self.seen)
