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
* A unit runs once per step, with its graph (``_run_unit``): ``_UnitGather`` gathers it into a buffer and
  hands the module its params as views of that buffer; after the forward the buffer's storage is freed
  while the graph keeps the views. ``_RefillBeforeBackward`` on the unit's outputs refills the storage in
  place (``_Refill``) when the gradient reaches them, and ``_UnitGather``'s backward (``_UnitReduce``)
  reduce-scatters the unit's gradient and frees the storage again. Collectives run only in Function
  forwards: the pattern that works under ``torch.func`` (DESIGN.md §4) and plain ``torch.autograd`` alike.
  ``remat=True`` instead recomputes each unit in backward through ``fzero.remat``.
* Prefetch (``Schedule``): the order in which units are gathered is recorded on a step and carried in the
  state; the next step issues the gather of the next unit asynchronously before it computes the current
  one, in forward and in backward (where it gathers straight into the freed buffer it will refill).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from fzero.layout import _tree
from fzero.step import _usage
from fzero.layout._clone import clone_structure
from fzero.dist._autograd import AllGather, ReplicatedShardGrad
from fzero.step._context import call_module, cast_floating, current_buffers, current_compute_dtype
from fzero.layout._layout import ROOT, Layout, Unit
from fzero.memory import note_gathered, note_resized


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
        self.buffers: dict[str, torch.Tensor] = {}  # this step's buffers of the module being run (fzero.step._buffers)

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
        return call_module(inner, {**self.unit_buffers(unit), **views}, args, kwargs)


class ShardedParams(UnitParams):
    """Stage 3: this rank's shard of every unit; a unit exists whole only while it runs (and while its
    backward runs). ``remat``: recompute each unit in backward instead of keeping its activations."""

    def __init__(self, inputs, layout, comm, schedule: "Schedule", *, remat: bool = False, **kw) -> None:
        super().__init__(inputs, layout, comm, **kw)
        self.schedule = schedule
        self.remat = remat

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
    """One invocation of one unit at stage 3, and its gathered buffer.

    ``full`` is the buffer the unit was gathered into for its forward. The forward's graph keeps views of
    it (a linear layer saves its weight), so the buffer object lives as long as the graph; what is freed
    between the forward and the backward is its *storage* (``resize_(0)``), refilled in place just before
    the unit's backward needs it and freed again once the unit's gradient is reduce-scattered.
    """

    def __init__(self, inner: nn.Module, unit: Unit, params: "ShardedParams") -> None:
        self.inner, self.unit, self.params = inner, unit, params
        self.full: torch.Tensor | None = None
        # the call keeps its graph (grad enabled, no remat): its buffer waits, freed, for its backward. Decided
        # before the gather Function runs: inside a Function's forward grad mode is always off.
        self.keeps_graph = False
        self.refilled = False  # set when backward refills the buffer: checked before the gradient leaves the unit
        self.tensors: dict[str, torch.Tensor] = {}  # what the unit's module ran with: views of ``full``, its buffers
        self._bound: Any = None

    @property
    def schedule(self) -> "Schedule":
        return self.params.schedule

    def run(self, views: tuple[torch.Tensor, ...], args: tuple, kwargs: dict, *, keep: bool = False) -> Any:
        """The unit's forward on ``views`` (its params, in slot order); ``keep``: hold its tensors for ``bind`` in its backward."""
        prefix = len(self.unit.name) + 1
        self.tensors = {s.path[prefix:]: v for s, v in zip(self.unit.slots, views)}
        self.tensors.update(self.params.unit_buffers(self.unit))
        self.bind()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.unbind()
            if not keep:
                self.tensors = {}

    def done(self) -> None:
        """The unit's backward is over (or will not come): let go of its views. They lead to the autograd
        graph, whose nodes hold this call: a cycle through C++ objects that Python's collector cannot break,
        which would keep the step's state (and a disk-offloaded state's files) alive."""
        self.unbind()
        self.tensors = {}

    def bind(self) -> None:
        """The unit's module holds its gathered params (and its buffers of the step) while the unit is gathered:
        for its forward, and again for its backward, where ``torch.utils.checkpoint`` (HF's gradient
        checkpointing) calls it once more. Otherwise it holds meta tensors, so that a read outside the unit
        gets the error of ``_UnitCall.__getattr__``, never a view of a freed buffer."""
        if self._bound is None and self.tensors:
            self._bound = _reparametrize_module(self.inner, self.tensors, tie_weights=True, strict=False)
            self._bound.__enter__()

    def unbind(self) -> None:
        if self._bound is not None:
            bound, self._bound = self._bound, None
            bound.__exit__(None, None, None)

    def free(self) -> None:
        """Give the gathered buffer's memory back; the graph's views of it stay, pointing at nothing until refilled."""
        if self.full is not None and self.full.untyped_storage().nbytes():
            self.full.untyped_storage().resize_(0)
            note_resized(self.full)

    def unalloc(self) -> bool:
        return self.full is not None and self.full.untyped_storage().nbytes() == 0

    def alloc(self) -> torch.Tensor:
        """The buffer with its memory back (contents undefined until a gather fills it)."""
        full = self.full
        if not full.untyped_storage().nbytes():
            full.untyped_storage().resize_(full.numel() * full.element_size())
            note_resized(full)
        return full


def _run_unit(inner: nn.Module, unit: Unit, params: "ShardedParams", args: tuple, kwargs: dict) -> Any:
    """One unit call at stage 3: gather, run once with its graph, free; the backward refills (see ``_Call``).

    With ``remat`` (``shard_params(..., remat=True)``) the unit is instead run through ``fzero.remat``: no
    graph is kept, and the recompute in backward gathers the unit again.
    """
    call = _Call(inner, unit, params)
    shard = params.inputs[unit.name]
    if params.remat and torch.is_grad_enabled():
        from fzero.autodiff._remat import remat

        def unit_forward(shard, args, kwargs):  # gathers again when remat recomputes it
            return call.run(_UnitGather.apply(shard, call, False, _usage.active(unit)), args, kwargs)

        unit_forward.__qualname__ = f"unit {unit.name!r}"
        return remat(unit_forward)(shard, args, kwargs)
    call.keeps_graph = torch.is_grad_enabled()
    views = _UnitGather.apply(shard, call, True, _usage.active(unit))
    out = call.run(views, args, kwargs, keep=torch.is_grad_enabled())
    if not torch.is_grad_enabled():  # no graph: nothing will read the buffer again
        out = _unalias(out, call.full)
        call.free()
        return out
    if not call.params.schedule.kept(call):
        call.free()
    return _before_backward(out, call)


def _unalias(out: Any, full: torch.Tensor) -> Any:
    """``out`` with any tensor that shares the gathered buffer's memory copied (the buffer is about to be freed)."""
    ptr = full.untyped_storage().data_ptr()
    return torch_pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr else t, out
    )


def _before_backward(out: Any, call: _Call) -> Any:
    """``out`` with its differentiable tensors passed through ``_RefillBeforeBackward``: the unit's backward
    cannot start before the gradient of every output that reaches the loss has arrived there, so that is
    where the buffer is refilled (as FSDP's pre-backward hook on a module's outputs).

    Pytrees, dataclasses (a unit may return one) and Hugging Face ``ModelOutput``s are searched; a tensor
    that leaves the unit another way (stored on a module, captured by a hook on a submodule inside the
    unit) and is the only path of a gradient into the unit is not seen (see the module docstring).
    """
    found, rebuild = _tree.tensors_and_rebuild(out)
    wanted = [i for i, t in enumerate(found) if t.requires_grad]
    if not wanted:
        return out
    copy = not torch._C._functorch.is_functorch_wrapped_tensor(found[wanted[0]])  # plain autograd (see the Function)
    passed = _RefillBeforeBackward.apply(call, copy, *[found[i] for i in wanted])
    for i, t in zip(wanted, passed):
        found[i] = t
    return rebuild(found)


class _UnitGather(torch.autograd.Function):
    """Forward: gather the unit into a buffer (kept as ``call.full`` when ``free_after``) and return its params,
    shaped views of that buffer in slot order. Backward: the params' gradients in one flat gradient
    (``fzero.step._usage.join``, noting which params got one in ``usage``), reduce-scattered by ``_UnitReduce``.

    One Function does what a gather, a ``split`` and a view per param would: under ``torch.func`` every
    custom Function and every op on a wrapped tensor costs a layer of Python, paid per unit per step.
    """

    @staticmethod
    def forward(shard, call, free_after, usage):
        full = call.schedule.gather(call, shard.detach())  # values only: the gradient is this Function's
        if free_after:
            call.full = full
        return tuple(full.narrow(0, s.offset, s.numel).view(s.shape) for s in call.unit.slots)

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, call, ctx.free_after, usage = inputs
        ctx.call = call
        unit = call.unit
        ctx.sizes = tuple(s.numel for s in unit.slots) + ((unit.padded - unit.numel,) if unit.padded > unit.numel else ())
        ctx.used = usage.used[unit.name] if usage is not None else None
        ctx.like = (shard.dtype, shard.device)
        ctx.set_materialize_grads(False)  # a param that got no gradient arrives as None

    @staticmethod
    def backward(ctx, *grads):
        flat = _usage.join(grads, ctx.sizes, ctx.used, ctx.like)
        return _UnitReduce.apply(flat, ctx.call, ctx.free_after), None, None, None


class _UnitReduce(torch.autograd.Function):
    """Forward: reduce-scatter the unit's gradient into the shard's, and free the gathered buffer again."""

    @staticmethod
    def forward(grad_full, call, free_after):
        if free_after and not call.refilled:
            raise RuntimeError(_NOT_REFILLED.format(unit=call.unit.name))
        params = call.params
        grad = grad_full if params.reduce_dtype is None else grad_full.to(params.reduce_dtype)
        grad_shard = params.comm.reduce_scatter(grad, tag="grads", label=call.unit.name).to(params.inputs[call.unit.name].dtype)
        if free_after:
            call.done()
            call.free()
            call.refilled = False
        return grad_shard.view_as(grad_shard) if grad_shard is grad_full else grad_shard

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("fzero (stage 3): double backward through a unit's gradient reduction is not supported.")


class _RefillBeforeBackward(torch.autograd.Function):
    """Forward: the unit's outputs. Backward: refill the unit's buffer (``_Refill``), gradients unchanged.

    ``copy``: under plain autograd the outputs are copies, not views: a view made by a custom Function cannot
    be modified in place there, and models do that to a block's output (``h = block(h); h.add_(x)``). Under
    ``torch.func`` such a view can be, so no copy is made.
    """

    @staticmethod
    def forward(call, copy, *outs):
        return tuple(o.clone() if copy else o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *_Refill.apply(ctx.call, *grads))


class _Refill(torch.autograd.Function):
    """Forward: gather the unit into its own (freed) buffer again; returns the gradients unchanged.

    The refill is a collective, so it runs in a Function's forward (DESIGN.md §4). It writes the same
    values the forward read, under ``_unsafe_preserve_version_counter``: autograd's check of the views it
    saved must not see a modification.
    """

    @staticmethod
    def forward(call, *grads):
        call.schedule.refill(call)
        call.refilled = True
        call.bind()
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fzero (stage 3): double backward through a unit is not supported.")


_NOT_REFILLED = """fzero (stage 3): unit {unit!r} computed its parameter gradient, but its gathered parameters were never
brought back for its backward: the gradient reached the inside of the unit without passing through the
unit's return value (a tensor made inside the unit that left it another way, e.g. stored on a module or
captured by a hook on a submodule of the unit). Return such tensors from the unit's forward, put the hook
on the unit itself, or keep that module out of the units (units=... without {unit!r})."""


class Schedule:
    """The gathers of one step on one rank, with prefetch, forward and backward.

    ``order`` is the sequence of units the previous step gathered (forward, then backward), carried in
    the state. While this step follows it, every gather starts the next one asynchronously, so it
    overlaps the current unit's compute; at most one prefetched unit is held at a time. A prefetch for
    a backward refill goes straight into the freed buffer of the call it will refill (the latest call of
    that unit still waiting for its backward). The first departure from the order stops prefetch for
    the rest of the step (pending gathers are completed and dropped, on every rank alike), and the order
    this step really took goes into the new state.
    """

    def __init__(self, comm: Any, layout: Layout, shards: dict[str, torch.Tensor], order: tuple[str, ...], prefetch: bool,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.comm = comm
        self.release = release  # disk offload of params: give a shard's pages back once it is gathered
        self.units = {u.name: u for u in layout.units}
        self.shards = shards  # the state's own shard tensors (not the autograd-wrapped ones)
        self.order = order
        self.seen: list[str] = []
        self.waiting: dict[str, list[_Call]] = {}  # calls whose buffer is freed until their backward, by unit
        self.calls: list[_Call] = []  # every call that keeps its graph this step: each is let go at finish
        self.pending: dict[int, tuple[str, Any, _Call | None]] = {}
        self.following = prefetch and bool(order)
        if self.following:
            self._issue(0)

    def _issue(self, pos: int, current: _Call | None = None) -> None:
        if pos >= len(self.order):
            return
        name = self.order[pos]
        unit = self.units[name]
        if current is not None and current.unit.name == name and current.keeps_graph:
            # the unit's backward comes right after its forward (the last unit, at the turn): its buffer is
            # kept rather than freed and gathered again, as FSDP keeps its last layer
            self.pending[pos] = (name, None, current)
            return
        waiting = self.waiting.get(name)
        target = waiting[-1] if waiting and waiting[-1].unalloc() else None
        if target is not None:  # a backward refill: into the buffer the graph already points at
            out = target.alloc()
            with _same_version(out):
                handle = self.comm.all_gather_async(out, self.shards[name], tag="params", label=name)
        else:
            out = note_gathered(torch.empty(unit.padded, dtype=unit.dtype))
            handle = self.comm.all_gather_async(out, self.shards[name], tag="params", label=name)
        self.pending[pos] = (name, handle, target)

    def _stop_following(self, ahead) -> None:
        """Off the recorded order: complete what is in flight (every rank alike), drop it, prefetch no more."""
        self.following = False
        self._drain([ahead] if ahead is not None else [])

    def _drain(self, extra: list) -> None:
        for _, handle, target in extra + list(self.pending.values()):
            if handle is None:  # a kept buffer (see ``_issue``): free it as every other
                target.free()
                continue
            if target is None:
                handle.wait()
                continue
            with _same_version(target.full):
                handle.wait()
            target.free()
        self.pending.clear()

    def _next(self, name: str):
        pos = len(self.seen)
        self.seen.append(name)
        ahead = self.pending.pop(pos, None)
        return pos, ahead

    def gather(self, call: _Call, shard: torch.Tensor) -> torch.Tensor:
        """A unit's buffer for its forward (or a remat recompute): prefetched, or gathered now."""
        name = call.unit.name
        pos, ahead = self._next(name)
        if self.following and ahead is not None and ahead[0] == name and ahead[2] is None:
            full = ahead[1].wait()
        else:
            if self.following:
                self._stop_following(ahead)
            full = note_gathered(torch.empty(call.unit.padded, dtype=shard.dtype, device=shard.device))
            self.comm.all_gather(full, shard, tag="params", label=name)
        self._after(name, pos, call)
        if call.keeps_graph:
            self.waiting.setdefault(name, []).append(call)
            self.calls.append(call)
        return full

    def refill(self, call: _Call) -> None:
        """Gather ``call``'s unit back into its freed buffer, just before its backward."""
        name = call.unit.name
        pos, ahead = self._next(name)
        calls = self.waiting.get(name, [])
        if call in calls:
            calls.remove(call)
        full = call.full
        if self.following and ahead is not None and ahead[1] is None and ahead[2] is call and not call.unalloc():
            pass  # kept since its forward (see ``_issue``)
        elif self.following and ahead is not None and ahead[0] == name and ahead[2] in (call, None):
            with _same_version(full), torch.no_grad():
                got = ahead[1].wait()
                if ahead[2] is None:  # gathered ahead while the forward still used this buffer: copy it in
                    call.alloc().copy_(got)
            del got, ahead  # the pending gather holds its buffer: drop it before the next one is issued
        else:
            if self.following:
                self._stop_following(ahead)
            out = call.alloc()
            with _same_version(out):
                self.comm.all_gather(out, self.shards[name], tag="params", label=name)
        self._after(name, pos)

    def _after(self, name: str, pos: int, current: _Call | None = None) -> None:
        if self.release is not None:
            self.release(self.shards[name])
        if self.following:
            self._issue(pos + 1, current)

    def kept(self, call: _Call) -> bool:
        """Whether ``call``'s buffer stays gathered after its forward, for its backward next (see ``_issue``)."""
        return any(handle is None and target is call for _, handle, target in self.pending.values())

    def finish(self) -> tuple[str, ...]:
        """Complete what is still in flight and free every buffer; the order this step took."""
        self._drain([])
        for c in self.calls:  # those whose backward never came, or came without reaching their params
            c.done()
            c.free()
        self.calls.clear()
        self.waiting.clear()
        return tuple(self.seen)


def _same_version(buffer: torch.Tensor):
    """Writes into a unit's buffer that restore the values its forward read: autograd's saved views of it
    must not count them as modifications (FSDP refills its unsharded params the same way)."""
    return torch.autograd._unsafe_preserve_version_counter(buffer)
