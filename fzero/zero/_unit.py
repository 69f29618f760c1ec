"""Stage 3: the life of a unit, in one place.

``UnitCall`` is one invocation of one unit and its gathered buffer: gather (through the step's ``Schedule``),
run once with its graph, free; refill before its backward, reduce its gradient after. ``Schedule`` is the
gathers of one step on one rank, with prefetch in forward and in backward.

``run_unit`` is what a unit of the stage-3 skeleton does when the forward reaches it (``fzero.zero._sharded``).
``_UnitGather`` gathers the unit and hands its module the params as views of the gathered buffer; after the
forward the buffer's storage is freed while the graph keeps the views. ``_RefillBeforeBackward`` on the unit's
outputs refills the storage in place (``_Refill``) when the gradient reaches them, and ``_UnitGather``'s backward has
``UnitCall.reduce`` reduce-scatter the unit's gradient (through ``_UnitReduce``) and free the storage again. Under ``torch.func.grad``
every collective runs in a Function's forward (the transform refuses one in a backward); under plain autograd
(the default) the unit's reduction is started from its backward, and travels while the next unit's backward runs
(``sink``, ``fzero.zero._stages.ShardGradView``). Where the gradient does not come through the unit's return
value (a hook's capture, a unit of frozen params alone), the unit is refilled or freed from ``fzero.zero._unit_hooks``.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from fzero.autodiff import check_unit_hooks, remat
from fzero.layout import (Binding, bound, frozen_key, frozen_regions, frozen_views, Layout, ROOT, Unit, pytrees as _tree,
                          split_sizes, walk)
from fzero.mesh import current_context, events as _events, Function, GatherBucket, Pending, profiled
from fzero.step import (DATA_WRITE, PARAM_WRITE_FIX, current_buffers, current_scope, live_buffers, Pool, alloc_memory, can_move, forget, free_memory, give, move_into,
                         take, usage as _usage)
from fzero.zero._unit_hooks import _after_backward, _refill_on_escape, _refill_on_escape_pre, write_back


class UnitCall:
    """One invocation of one unit at stage 3, and its gathered buffer: its gather (``Schedule.gather``), run, free,
    refill and the reduction of its gradient (``reduce``).

    ``full`` is the buffer the unit was gathered into for its forward. The forward's graph keeps views of
    it (a linear layer saves its weight), so the buffer object lives as long as the graph; what is freed
    between the forward and the backward is its *storage* (``resize_(0)``), refilled in place just before
    the unit's backward needs it and freed again once the unit's gradient is reduce-scattered.
    """

    def __init__(self, inner: nn.Module, unit: Unit, params: Any) -> None:
        self.inner, self.unit, self.params = inner, unit, params
        self.full: torch.Tensor | None = None
        self.remat_full: torch.Tensor | None = None  # a remat call's gathered buffer, until its forward is checked
        # the call keeps its graph (grad enabled, no remat): its buffer waits, freed, for its backward. Decided
        # before the gather Function runs: inside a Function's forward grad mode is always off.
        self.keeps_graph = False
        self.refilled = False  # set when backward refills the buffer: checked before the gradient leaves the unit
        self.reduced = False  # its gradient is reduced: the backward is over, nothing refills it again
        self.tensors: dict[str, torch.Tensor] = {}  # what the unit's module ran with: views of ``full``, its buffers
        self.frozen: dict[str, torch.Tensor] = {}  # its sharded frozen params (``frozen=``): views of ``full``'s tail
        self.hooks: Any = None  # a unit of frozen params alone: the hook on its inputs that ends its backward
        self._bound: Any = None
        self._binding: Binding | None = None  # where the unit's module keeps each tensor: found once per call
        # called as ``inner.forward(...)``: read now, since a remat recompute runs this call again after it returned
        self.forward_only = bool(inner.__dict__.get("_fz_forward_only"))

    @property
    def schedule(self) -> "Schedule":
        return self.params.schedule

    def run(self, views: tuple[torch.Tensor, ...], args: tuple, kwargs: dict, *, keep: bool = False) -> Any:
        """The unit's forward on ``views`` (its params, in slot order); ``keep``: hold its tensors for ``bind`` in its backward."""
        prefix = len(self.unit.name) + 1
        self.tensors = {s.path[prefix:]: v for s, v in zip(self.unit.slots, views)}
        self.tensors.update(self.frozen)
        self.tensors.update(self.params.unit_buffers(self.unit, self.inner))
        self.bind()
        watches = self._watch_hooks(views)
        # a write into any param of the unit (every view of its buffer shares one version counter) shows here
        probe = views[0] if views else next(iter(self.frozen.values()), None)
        probe = _unwrapped(probe) if probe is not None else None
        version = probe._version if probe is not None else 0
        ptrs = [_unwrapped(v).data_ptr() for v in views]  # a param's .data replaced by the forward shows here
        try:
            out = self.params.runner(self.inner, self.unit, forward_only=self.forward_only)(*args, **kwargs)
            if probe is not None and probe._version != version:
                raise RuntimeError(_WRITTEN_IN_UNIT.format(unit=self.unit.name, cls=f" ({type(self.inner).__name__})"))
            self._refuse_data_writes(views, ptrs)
            bank = current_buffers()
            if bank is not None and self.params.buffers and not current_context().replay:  # a buffer the forward replaced
                bank.adopt_replaced(self.inner, self.tensors, self.params.buffers, prefix=self.unit.name + ".")
            return out
        finally:
            for handle in watches:
                handle.remove()
            self.unbind()
            if not keep:  # the frozen views too: they hold the whole buffer (a remat call's is never freed into the pool)
                self.tensors = {}
                self.frozen = {}

    def _refuse_data_writes(self, views: tuple[torch.Tensor, ...], ptrs: list[int]) -> None:
        """Refuse a forward that wrote the unit's params through ``.data``, which no version counter sees: a param whose
        ``.data`` it replaced (``self.weight.data = w``: the view now holds other memory), or this rank's share of the
        gathered buffer no longer holding, bit for bit, what the rank sent to the gather (``self.weight.data.mul_(0.9)``,
        a WGAN critic's ``p.data.clamp_(-c, c)`` in its forward). The buffer is dropped after the call and refilled
        for the backward from the shards, so the write was lost (9.5e-2 off PyTorch after 3 SGD steps), silently. Every
        rank runs the forward on the whole unit, so a write anywhere in it shows in some rank's share. On a GPU the
        comparison is waited for once, at the end of the step (``Schedule.finish``). Params offloaded to the host
        (``offload_params=True``) are compared too, each shard copied up a second time for it: once, at the state's
        first step (before: not compared, and the write was lost there, silently). So is every stage-3 unit under disk
        offload (``offload="disk"``, with or without ``params=True``: the shard in RAM or in its mapped file, read once
        more and its pages given back), where the comparison was skipped and the write lost (9.5e-2 off PyTorch after 3
        SGD steps), silently."""
        for s, v, ptr in zip(self.unit.slots, views, ptrs):
            if _unwrapped(v).data_ptr() != ptr:
                raise RuntimeError(DATA_WRITE.format(how=f"replaced the trainable param {s.path!r}", shape=s.shape,
                                                     where=_DATA_WHERE))
        schedule, full = self.schedule, self.full
        if full is None:  # a remat call's: checked in its forward (and again in the recompute), then let go
            full, self.remat_full = self.remat_full, None
        if full is None or not views or not schedule.check_data:
            return
        changed = _changed_share(full.narrow(0, 0, self.unit.padded), schedule.input_of(self.unit.name), schedule.comm.rank)
        if schedule.release is not None:  # disk offload: the shard read again gives its pages back (no-op in RAM)
            schedule.release(schedule.shards[self.unit.name])
        if full.device.type == "cpu":
            if bool(changed):
                raise RuntimeError(_data_written(self.unit))
        else:
            schedule.data_checks.append((self.unit, changed))

    def _watch_hooks(self, views: tuple[torch.Tensor, ...]) -> list:
        """For a call that keeps its graph, under plain autograd: a forward hook (and a forward pre-hook) put first on
        each module of the unit that has forward hooks (forward pre-hooks), the unit's own only under ``jit``, whose
        compiled forward is keyed by the hooks inside, for the call's length, so that what those hooks are handed (the
        module's output, and its inputs) refills the unit before its backward (``_refill_on_escape``). A hook's capture
        leaves the unit beside its return value: Hugging Face's output capture (``output_hidden_states``, and the hidden
        state Llava's ``vision_feature_layer`` picks; the first hidden state is a layer's input), whose layer's return
        value may reach nothing in the loss, so ``_RefillBeforeBackward`` never ran and the backward read the freed
        buffer (torch's bare "setStorage: ... out of bounds for storage of size 0"). Only tensors made during the call
        are watched (autograd nodes numbered from its start): an input made before the unit (its own arguments) leads
        to nothing of the unit, and a refill there would gather it for nothing. A unit of frozen params alone
        (``frozen=``) has no ``views`` but is refilled as the others are."""
        if not self.keeps_graph or not torch.is_grad_enabled() or not (views or self.frozen):
            return []
        if torch._C._functorch.peek_interpreter_stack() is not None or (
                views and torch._C._functorch.is_functorch_wrapped_tensor(views[0])):  # torch.func: no collective in a backward
            return []
        modules = [self.inner] if self.params.jit_cache is not None else _each_module(self.inner)
        handles: list = []
        for m in modules:
            if m._forward_hooks or m._forward_pre_hooks:
                if not handles:
                    start = torch._C._autograd._get_sequence_nr()
                    post = functools.partial(_refill_on_escape, self, start)
                    pre = functools.partial(_refill_on_escape_pre, self, start)
                if m._forward_hooks:
                    handles.append(m.register_forward_hook(post, prepend=True, with_kwargs=True))
                if m._forward_pre_hooks:
                    handles.append(m.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        return handles

    def refill_once(self) -> None:
        """Gather the unit back into its freed buffer for its backward, unless that is done (or over)."""
        if self.refilled or self.reduced:
            return
        self.schedule.refill(self)
        self.refilled = True
        self.bind()

    def done(self) -> None:
        """The unit's backward is over (or will not come): let go of its views. They lead to the autograd
        graph, whose nodes hold this call: a cycle through C++ objects that Python's collector cannot break,
        which would keep the step's state (and a disk-offloaded state's files) alive."""
        self.unbind()
        self.tensors = {}
        self.frozen = {}

    def bind(self) -> None:
        """The unit's module holds its gathered params (and its buffers of the step) while the unit is gathered:
        for its forward, and again for its backward, where ``torch.utils.checkpoint`` (HF's gradient
        checkpointing) calls it once more. Otherwise it holds meta tensors, so that a read outside the unit
        gets the error of ``_UnitSkin.__getattr__`` (``fzero.zero._sharded``), never a view of a freed buffer."""
        if self._bound is None and self.tensors:
            if self._binding is None or not self._binding.current():
                self._binding = Binding.of(self.inner)
            self._bound = bound(self.inner, self.tensors, self._binding)
            self._bound.__enter__()

    def unbind(self) -> None:
        if self._bound is not None:
            bound, self._bound = self._bound, None
            bound.__exit__(None, None, None)

    def free(self) -> None:
        """Give the gathered buffer's memory back (to the step's pool, on the host); the graph's views of it stay,
        pointing at nothing until refilled."""
        if self.full is not None and self.full.untyped_storage().nbytes():
            free_memory(self.schedule.pool, self.full)
            _events.resized(self.full)

    def reduce(self, grad_full: torch.Tensor, *, free_after: bool, sink: Any = None) -> torch.Tensor | None:
        """Reduce-scatter the unit's gradient into its shard's, and free the gathered buffer again. ``sink``: start
        the reduction and hand it there (``ShardGradView.ready``, which may bucket it with the next units'),
        returning None; else wait for it and return the shard."""
        if free_after and not self.refilled:
            raise RuntimeError(_NOT_REFILLED.format(unit=self.unit.name))
        params = self.params
        grad = grad_full if params.reduce_dtype is None else grad_full.to(params.reduce_dtype)
        if grad is not grad_full:  # the compute-dtype gradient (a pool buffer, ``_usage.join``) is done with: to the pool
            give(params.pool, grad_full)
            del grad_full
        shard = params.inputs[self.unit.name]  # its gradient goes where it is (to the host, params offloaded there)
        if sink is not None:  # the sink starts its reduction (alone or in a bucket with the next units')
            grad_shard = None
        else:
            grad_shard = params.comm.reduce_scatter(grad, tag="grads", label=self.unit.name).to(
                shard.device, shard.dtype, non_blocking=shard.is_cuda)
        if free_after:
            self.done()
            self.free()
            self.refilled = False
            self.reduced = True
        if sink is not None:
            sink.ready(self.unit.name, grad, shard.detach())
        return grad_shard

    def unalloc(self) -> bool:
        """Whether the buffer's memory is freed. A 0-element buffer (a unit whose params are all empty, shape (0, 4))
        holds none to free, so it is never freed: read as freed, the turn's kept buffer was refilled from a gather
        never issued ("'NoneType' object has no attribute 'wait'", local_mesh(2))."""
        full = self.full
        return full is not None and full.numel() > 0 and full.untyped_storage().nbytes() == 0

    def alloc(self) -> torch.Tensor:
        """The buffer with its memory back (contents undefined until a gather fills it)."""
        full = self.full
        if full is None:
            raise RuntimeError("fzero internal error: a unit call's buffer was refilled before it was gathered.")
        if not full.untyped_storage().nbytes():
            alloc_memory(self.schedule.pool, full)
            _events.resized(full)
        return full


def _each_module(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())``: each module of the tree once, in its order, by one ``walk`` (torch's nested
    generators cost a unit call's host time: this runs at every unit call that keeps its graph)."""
    seen: set[int] = set()
    out: list[nn.Module] = []
    for _, m in walk(module):
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


class Schedule:
    """The gathers of one step on one rank, with prefetch, forward and backward.

    ``order`` is the sequence of units the previous step gathered (forward, then backward), carried in
    the state. While this step follows it, every gather starts the next one asynchronously, so it
    overlaps the current unit's compute; at most one prefetched unit is held at a time. A prefetch for
    a backward refill goes straight into the freed buffer of the call it will refill (the latest call of
    that unit still waiting for its backward). The first departure from the order stops prefetch for
    the rest of the step (pending gathers are completed and dropped, on every rank alike), and the order
    this step really took goes into the new state.

    ``bucket_elements`` (``shard_grads(bucket_elements=...)``): a prefetch takes the next gathers of the order
    together, until they hold at least that many elements, in one all-gather (``GatherBucket``), so a model of many
    small units pays one collective's latency per bucket rather than per unit. Each unit's buffer is then filled
    from the bucket's, the same values its own gather would give.
    """

    def __init__(self, comm: Any, layout: Layout, shards: dict[str, torch.Tensor], order: tuple[str, ...], prefetch: bool,
                 release: Callable[[torch.Tensor], None] | None = None, device: torch.device = torch.device("cpu"),
                 pool: Pool | None = None, bucket_elements: int = 0, cast: Callable[[str], torch.Tensor | None] | None = None,
                 frozen: dict[str, torch.Tensor] | None = None, frozen_seen: dict | None = None, check_data: bool = False) -> None:
        self.comm = comm
        # ``step.init(..., frozen=...)``: this rank's shards of the frozen params (the state's ``frozen``), and their
        # groups by unit name (one per dtype): gathered into the tail of their unit's buffer (``fzero.layout.frozen_regions``)
        self.frozen = frozen or {}
        self.frozen_seen = frozen_seen or {}  # the module's frozen params as init copied them (``StateMeta.frozen_seen``)
        self.groups = {g.name: layout.frozen_groups(g.name) for g in layout.frozen}
        self.dtypes = {g.name: tuple(layout.frozen_dtype(x) for x in self.groups[g.name]) for g in layout.frozen}  # gathered in
        self.sizes = {u.name: layout.gathered(u) for u in layout.units}  # elements of a unit's gathered buffer
        # stage 3 with fp32 masters beside the shards: what a unit's gather sends, its master cast to the compute dtype
        # (``fzero.zero._stages.CastFromMasters``; None for a unit whose shard is kept)
        self.cast = cast
        self.bucket_elements = bucket_elements
        self.pool = pool  # where gathered buffers' memory comes from and goes back to (fzero.step._pool)
        self.device = device  # where units are gathered; a shard held elsewhere (on the host) is copied here first
        self.release = release  # disk offload of params: give a shard's pages back once it is gathered
        self.units = {u.name: u for u in layout.units}
        self.shards = shards  # the state's own shard tensors (not the autograd-wrapped ones)
        self.order = order
        self.seen: list[str] = []
        self.waiting: dict[str, list[UnitCall]] = {}  # calls whose buffer is freed until their backward, by unit
        self.calls: list[UnitCall] = []  # every call that keeps its graph this step: each is let go at finish
        self.pending: dict[int, tuple[str, Any, UnitCall | None]] = {}
        self.data_checks: list[tuple[Unit, torch.Tensor]] = []  # on a GPU: whether a forward wrote a unit through .data
        self.check_data = check_data  # whether to look for such writes (``check_data_writes``: a state's first step)
        # one rank: a gather is a copy (or a cast) of the shard, with nothing to overlap; prefetched, it would only
        # hold a second unit beside the one that runs
        self.following = prefetch and bool(order) and comm.size > 1
        if self.following:
            self._issue(0)

    def _issue(self, pos: int, current: UnitCall | None = None) -> None:
        if pos >= len(self.order) or pos in self.pending:  # (already issued with a bucket)
            return
        name = self.order[pos]
        if current is not None and current.unit.name == name and current.keeps_graph:
            # the unit's backward comes right after its forward (the last unit, at the turn): its buffer is
            # kept rather than freed and gathered again, as FSDP keeps its last layer
            self.pending[pos] = (name, None, current)
            return
        span = self._bucket_span(pos)
        if len(span) > 1:
            self._issue_bucket(span)
            return
        unit = self.units[name]
        target = self._target(name)
        if target is not None:  # a backward refill: into the buffer the graph already points at
            out = target.alloc()
            with _same_version(out):
                handle = self._gather_async(out, name)
        else:
            out = self._fresh(unit)
            handle = self._gather_async(out, name)
        self.pending[pos] = (name, handle, target)

    def _gather_async(self, out: torch.Tensor, name: str) -> Any:
        """Start the gather of unit ``name`` into ``out``: its params, and (``frozen=``) its frozen params into the tail."""
        groups = self.groups.get(name)
        if groups is None:
            return self.comm.all_gather_async(out, self.input_of(name), tag="params", label=name)
        unit = self.units[name]
        handles = [self.comm.all_gather_async(out.narrow(0, 0, unit.padded), self.input_of(name), tag="params", label=name)]
        for region, group, dtype in zip(self.frozen_regions(out, name), groups, self.dtypes[name]):
            handles.append(self.comm.all_gather_async(region, self._frozen_input(group, dtype), tag="params",
                                                      label=name + ":frozen"))
        return Pending(lambda: ([h.wait() for h in handles], out)[1])

    def _gather_now(self, out: torch.Tensor, name: str) -> None:
        """Gather unit ``name`` into ``out`` now (see ``_gather_async``)."""
        groups = self.groups.get(name)
        if groups is None:
            self.comm.all_gather(out, self.input_of(name), tag="params", label=name)
            return
        self.comm.all_gather(out.narrow(0, 0, self.units[name].padded), self.input_of(name), tag="params", label=name)
        for region, group, dtype in zip(self.frozen_regions(out, name), groups, self.dtypes[name]):
            self.comm.all_gather(region, self._frozen_input(group, dtype), tag="params", label=name + ":frozen")

    def frozen_regions(self, full: torch.Tensor, name: str) -> list[torch.Tensor]:
        """The frozen groups' regions in unit ``name``'s gathered buffer ``full``."""
        return frozen_regions(full, self.units[name], self.groups[name], self.dtypes[name])

    def _frozen_input(self, group: Unit, dtype: torch.dtype) -> torch.Tensor:
        """What this rank sends to the gather of a frozen group: its shard, here, in ``dtype`` (an fp32 base under a bf16
        policy is cast as it is gathered, as FSDP2 casts its fp32 shards)."""
        shard = self.frozen[frozen_key(group)]
        return shard.to(self.device, dtype, non_blocking=True) if shard.dtype != dtype else self._here(shard)

    def gather_root_frozen(self) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The frozen params outside every unit (``frozen=``), gathered once for the step as the root unit is: the
        buffers (the caller's to give back to the pool) and ``{path: view}``."""
        bufs: list[torch.Tensor] = []
        views: dict[str, torch.Tensor] = {}
        for group, dtype in zip(self.groups.get(ROOT, ()), self.dtypes.get(ROOT, ())):
            # in a Function's forward, as every other gather: under torch.func a buffer made in the transform is a
            # wrapped tensor, which a collective cannot write ("Cannot access data pointer of Tensor that doesn't have
            # storage")
            buf = _GatherFrozen.apply(self.frozen[frozen_key(group)], self, group, dtype)
            bufs.append(buf)
            views.update(frozen_views(buf, group))
        return bufs, views

    def _target(self, name: str) -> "UnitCall | None":
        """The call whose freed buffer a gather of ``name`` refills (its latest call still waiting for its backward),
        or None: a fresh buffer.

        Always a fresh one under torch.distributed: its async collectives bump their output's version counter when
        the work completes, on the backend's thread, outside any ``_same_version``; into the buffer the graph's views
        point at, that is "a view ... modified inplace" in backward. The refill then moves (or copies) it in."""
        waiting = self.waiting.get(name)
        target = waiting[-1] if waiting and waiting[-1].unalloc() else None
        return target if target is not None and getattr(self.comm, "async_writes_keep_version", False) else None

    def _bucket_span(self, pos: int) -> list[int]:
        """The positions of the order gathered together from ``pos``: consecutive gathers of distinct units of one
        dtype, until they hold ``bucket_elements``. A bucket ends before the turn (a unit gathered twice in a row,
        whose buffer ``_issue`` keeps instead)."""
        span = [pos]
        if not self.bucket_elements:
            return span
        first = self.units[self.order[pos]]
        total = self.sizes[first.name]  # the gathered buffer, frozen tail included (a unit of frozen params alone: padded 0)
        kind = self._frozen_kind(first.name)
        while total < self.bucket_elements and span[-1] + 1 < len(self.order):
            nxt = span[-1] + 1
            name = self.order[nxt]
            unit = self.units[name]
            if name in {self.order[p] for p in span} or unit.dtype != first.dtype or self._frozen_kind(name) != kind:
                break
            span.append(nxt)
            total += self.sizes[name]
        return span

    def _issue_bucket(self, span: list[int]) -> None:
        """One all-gather for the units at positions ``span`` (``GatherBucket``); each unit's buffer is filled from it
        when the unit's gather is waited for."""
        names = [self.order[p] for p in span]
        bucket = GatherBucket(self.comm, [self.input_of(n) for n in names], pool=self.pool, label="+".join(names),
                              mark=_events.gathered)
        # the units' frozen params (``frozen=``): one more bucket per frozen group, beside the first (the span's units
        # have groups of the same dtypes: ``_bucket_span``)
        frozen = [GatherBucket(self.comm, [self._frozen_input(self.groups[n][k], self.dtypes[n][k]) for n in names], pool=self.pool,
                               label="+".join(names) + ":frozen", mark=_events.gathered)
                  for k in range(len(self.dtypes.get(names[0], ())))]
        for i, (p, name, at) in enumerate(zip(span, names, bucket.offsets)):
            unit, target = self.units[name], self._target(name)
            # the unit's buffer gets its memory when its part is filled in, not now: then the bucket and its units'
            # buffers are not all held while the gather runs
            dest = target.alloc if target is not None else functools.partial(self._fresh, unit)
            tails = [(b, b.offsets[i]) for b in frozen]
            regions = functools.partial(self.frozen_regions, name=name) if frozen else None
            self.pending[p] = (name, Pending(functools.partial(_fill, bucket, at, dest, unit, tails, regions)), target)

    def _frozen_kind(self, name: str) -> tuple[torch.dtype, ...]:
        """What a bucket's units must share of their frozen params: the dtypes they are gathered in (none: ())."""
        return self.dtypes.get(name, ())

    def _fresh(self, unit: Unit) -> torch.Tensor:
        """A fresh buffer to gather ``unit`` into, from the step's pool (counted as gathered memory)."""
        return _events.gathered(take(self.pool, self.sizes[unit.name], dtype=unit.dtype, device=self.device))

    def input_of(self, name: str) -> torch.Tensor:
        """What this rank sends to a gather of unit ``name``: its shard on the gather's device, or its master cast."""
        cast = self.cast(name) if self.cast is not None else None
        return cast if cast is not None else self._here(self.shards[name])

    def _here(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard on the gather's device: itself, or (params offloaded to the host) an asynchronous copy up."""
        return shard if shard.device == self.device else shard.to(self.device, non_blocking=True)

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

    def gather(self, call: UnitCall, shard: torch.Tensor) -> torch.Tensor:
        """A unit's buffer for its forward (or a remat recompute): prefetched, or gathered now."""
        name = call.unit.name
        pos, ahead = self._next(name)
        if self.following and ahead is not None and ahead[0] == name and ahead[2] is None:
            full = ahead[1].wait()
        elif self.following and ahead is not None and ahead[0] == name:
            # a unit called again in the forward (a block applied twice, layers shared across depth): the order does
            # not tell this gather from a backward refill, so it went into the freed buffer of the unit's call that
            # waits for its backward (or kept the buffer of the call just run). The values are this call's too: copied
            # into a buffer of its own, and the prefetch goes on (it stopped here, for the rest of every step)
            target = ahead[2]
            full = _events.gathered(take(self.pool, self.sizes[name], dtype=shard.dtype, device=self.device))
            with _same_version(target.full), torch.no_grad():
                if ahead[1] is not None:
                    ahead[1].wait()
                full.copy_(target.full)
            del ahead  # (the pending gather holds its buffer)
            target.free()
        else:
            if self.following:
                self._stop_following(ahead)
            full = _events.gathered(take(self.pool, self.sizes[name], dtype=shard.dtype, device=self.device))
            self._gather_now(full, name)
        self._after(name, pos, call)
        if call.keeps_graph:
            self.waiting.setdefault(name, []).append(call)
            self.calls.append(call)
        return full

    def refill(self, call: UnitCall) -> None:
        """Gather ``call``'s unit back into its freed buffer, just before its backward."""
        name = call.unit.name
        pos, ahead = self._next(name)
        calls = self.waiting.get(name, [])
        if call in calls:
            calls.remove(call)
        full = call.full
        if full is None:
            raise RuntimeError(f"fzero internal error: unit {name!r} is refilled for its backward but was never gathered.")
        if self.following and ahead is not None and ahead[1] is None and ahead[2] is call and not call.unalloc():
            pass  # kept since its forward (see ``_issue``)
        elif self.following and ahead is not None and ahead[0] == name and ahead[2] in (call, None):
            with _same_version(full), torch.no_grad():
                got = ahead[1].wait()
                if ahead[2] is None and call.unalloc() and can_move(self.pool, got):  # gathered ahead: its memory
                    move_into(full, got)  # becomes the freed buffer's, no copy
                    _events.resized(got)
                    _events.resized(full)
                elif ahead[2] is None:  # gathered ahead while the forward still used this buffer: copy it in
                    call.alloc().copy_(got)
            del got, ahead  # the pending gather holds its buffer: drop it before the next one is issued
        else:
            if self.following:
                self._stop_following(ahead)
            out = call.alloc()
            with _same_version(out):
                self._gather_now(out, name)
        self._after(name, pos)

    def _after(self, name: str, pos: int, current: UnitCall | None = None) -> None:
        if self.release is not None:
            self.release(self.shards[name])
        if self.following:
            self._issue(pos + 1, current)

    def kept(self, call: UnitCall) -> bool:
        """Whether ``call``'s buffer stays gathered after its forward, for its backward next (see ``_issue``)."""
        return any(handle is None and target is call for _, handle, target in self.pending.values())

    def finish(self) -> tuple[str, ...]:
        """Complete what is still in flight and free every buffer; the order this step took."""
        checks, self.data_checks = self.data_checks, []
        written = None
        if checks and bool(torch.stack([c for _, c in checks]).any()):  # (UnitCall._refuse_data_writes), one wait
            written = next(u for u, c in checks if bool(c))
        self._drain([])
        for c in self.calls:  # those whose backward never came, or came without reaching their params
            c.done()
            c.free()
            if c.hooks is not None:  # off the inputs' graph, which would hold the call (and with it the step) otherwise
                c.hooks.remove()
                c.hooks = None
        self.calls.clear()
        self.waiting.clear()
        if written is not None:  # refused once every buffer is given back, before the update
            raise RuntimeError(_data_written(written))
        if self.check_data:  # every forward of the step ran and none wrote: the state's later steps are not compared
            data_writes_checked(self.shards)
        return tuple(self.seen)


class _GatherFrozen(Function):
    """Forward: a frozen group of the root gathered (``Schedule.gather_root_frozen``), with no gradient."""

    @staticmethod
    def forward(shard, schedule, group, dtype):
        buf = _events.gathered(take(schedule.pool, group.padded, dtype=dtype, device=schedule.device))
        schedule.comm.all_gather(buf, schedule._frozen_input(group, dtype), tag="params", label=ROOT + ":frozen")
        return buf

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


def _same_version(buffer: torch.Tensor):
    """Writes into a unit's buffer that restore the values its forward read: autograd's saved views of it
    must not count them as modifications (FSDP refills its unsharded params the same way)."""
    return torch.autograd._unsafe_preserve_version_counter(buffer)


def _fill(bucket: GatherBucket, at: int, dest: Callable[[], torch.Tensor], unit: Unit, tails: list,
          regions: Callable[[torch.Tensor], list[torch.Tensor]] | None) -> torch.Tensor:
    """One unit's share of a ``GatherBucket`` (what ``Schedule.pending`` holds where a unit's own gather would be):
    its buffer, given its memory now, filled from the bucket; ``tails``: (the bucket of a frozen group, the unit's place
    in it) for each of the unit's frozen groups, filled into ``regions(full)``, the buffer's tail."""
    full = dest()
    if regions is None:
        return bucket.fill(at, full)
    bucket.fill(at, full.narrow(0, 0, unit.padded))
    for (fbucket, fat), region in zip(tails, regions(full)):
        fbucket.fill(fat, region)
    return full


# a write into a unit's gathered buffer by the unit's own forward (under plain autograd torch refuses it first: "Output 0
# of _UnitGather is a view and ... has been modified inplace"; torch.func lets it through)
_WRITTEN_IN_UNIT = (
    "fzero.apply (stage 3): the forward of unit {unit!r}{cls} wrote one of its params in place "
    "(nn.Embedding(max_norm=...) renormalizes the rows it looks up in place; so does a weight clamped under "
    "torch.no_grad()). At stage 3 a unit's params are gathered into a buffer for its call (the root unit's: for the "
    "step) and dropped after it, so the write would never reach the train state (before: lost silently under autodiff='func', 3.35 off PyTorch "
    "after one step). " + PARAM_WRITE_FIX
)


_DATA_WHERE = "is a view of the unit's buffer, gathered for its call and dropped after it (stage 3)"
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# The states whose forward was compared for writes through ``.data`` (``UnitCall._refuse_data_writes``), by their first
# shard, held weakly: a state's first step only. Such a write is the forward's code, so the first step shows it; at every
# step the comparison would read each unit's share twice more and hold a cast of it (with fp32 masters) beside the
# activations, memory the estimate does not count (``tests/test_estimate.py``).
_DATA_CHECKED: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
_DATA_LOCK = threading.Lock()  # the ranks of a local mesh are threads, each with its own state


def check_data_writes(shards: dict[str, torch.Tensor]) -> bool:
    """Whether this step's forward is to be compared for writes through ``.data``: the state whose shards these are has
    not had a step whose forward passed the comparison (``data_writes_checked``). A step that failed, or was refused,
    leaves the state unmarked: marked at its start, a loop that skips a failing batch went on with the write lost."""
    key = next(iter(shards.values()), None)
    if key is None:
        return False
    with _DATA_LOCK:
        return key not in _DATA_CHECKED


def data_writes_checked(shards: dict[str, torch.Tensor]) -> None:
    """A step's forwards of the state whose shards these are passed the comparison (``Schedule.finish``)."""
    key = next(iter(shards.values()), None)
    if key is not None:
        with _DATA_LOCK:
            _DATA_CHECKED[key] = True


def _changed_share(full: torch.Tensor, sent: torch.Tensor, rank: int) -> torch.Tensor:
    """Whether this rank's share of the gathered ``full`` differs, bit for bit (a NaN is equal to itself), from
    ``sent``, what the rank sent to the gather: a 0-d bool tensor on ``full``'s device, not waited for."""
    n = sent.numel()
    share = full.narrow(0, rank * n, n)
    sent = sent.to(share.device, share.dtype, non_blocking=True)
    ints = _INTS[share.element_size()]
    return torch.ne(share.view(ints), sent.view(ints)).any()


def _data_written(unit: Unit) -> str:
    return DATA_WRITE.format(how=f"of unit {unit.name!r} wrote its params", shape=f"{unit.numel} elements in all",
                             where=_DATA_WHERE)


def run_unit(inner: nn.Module, unit: Unit, params: Any, args: tuple, kwargs: dict) -> Any:
    """One unit call at stage 3: gather, run once with its graph, free; the backward refills (see ``UnitCall``).

    With ``remat`` (``shard_params(..., remat=True)``) the unit is instead run through ``fzero.remat``: no
    graph is kept, and the recompute in backward gathers the unit again.
    """
    with profiled(lambda: f"fzero.unit:{unit.name}"):  # a trace shows each unit's gather and forward
        return _run_unit(inner, unit, params, args, kwargs)


def _run_unit(inner: nn.Module, unit: Unit, params: Any, args: tuple, kwargs: dict) -> Any:
    call = UnitCall(inner, unit, params)
    shard = params.inputs[unit.name]
    if params.remat and torch.is_grad_enabled() and (unit.slots or _any_requires_grad((args, kwargs))):
        def unit_forward(shard, /, *args, **kwargs):  # gathers again when remat recomputes it
            views = _UnitGather.apply(shard, call, False, _usage.active(unit))
            scope = current_scope()
            if not torch.is_grad_enabled() or scope is None:
                return call.run(views, args, kwargs)
            # the recompute: the unit keeps its params until remat's product is taken (recompute_scope), for a
            # torch.utils.checkpoint inside the unit, which calls its layers again then
            out = call.run(views, args, kwargs, keep=True)
            call.tensors = live_buffers(call.tensors)
            call.bind()
            scope.callback(call.done)
            return out

        unit_forward.__qualname__ = f"unit {unit.name!r}"
        unit_forward.module = inner  # type: ignore[attr-defined]  # what fzero.remat may walk (_norm_hooks)
        check_unit_hooks(inner, unit.name)
        return remat(unit_forward)(shard, *args, **kwargs)
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
        return _recomputed(call, shard, args, kwargs)
    call.keeps_graph = torch.is_grad_enabled()
    views = _UnitGather.apply(shard, call, True, _usage.active(unit))
    passed: list = []
    if not unit.slots and call.keeps_graph:  # frozen params alone: no gradient of its own says its backward is over
        (args, kwargs), passed = _after_backward((args, kwargs), call)
    given = {id(t): (t, t._version) for t in _tree.tensors_and_rebuild((args, kwargs))[0]} if call.keeps_graph else {}
    out = call.run(views, args, kwargs, keep=torch.is_grad_enabled())
    if passed:  # a unit of frozen params alone under torch.func (``_after_backward``)
        write_back(passed)
        out = _as_passed(out, passed, given)
    if not torch.is_grad_enabled() and call.full is not None:  # no graph: nothing will read the buffer again
        out = _unalias(out, call.full)
        call.free()
        return out
    if not call.params.schedule.kept(call):
        call.free()
    return _before_backward(out, call, given)


def _recomputed(call: UnitCall, shard: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """A unit called inside a backward with grad enabled: a ``torch.utils.checkpoint(..., use_reentrant=False)`` in the
    model around the unit's call, recomputing it (``x = checkpoint(block, x)``, timm's and many models' own
    checkpointing). What this call saves goes to the nodes of the forward's graph, which read it after the call
    returns; so its buffer is not freed (nor lent again by the pool): it lives as long as the saved views of it, as a
    remat recompute's does. Before, the call freed it like a forward's, and where the checkpointed function went on
    after the unit (a dropout), its backward read the freed params (torch's "setStorage ... out of bounds")."""
    from torch.utils._python_dispatch import _disable_current_modes

    # the gather (and the prefetch it starts) is fzero's, not the checkpointed function's: run outside the dispatch modes
    # a selective checkpoint (context_fn=create_selective_checkpoint_contexts) matches the recompute's ops with, which
    # saw no such op in the forward (the forward's gather ran before the region, prefetched)
    with _disable_current_modes():
        views = _UnitGather.apply(shard, call, False, _usage.active(call.unit))
    return call.run(views, args, kwargs)


def _as_passed(out: Any, passed: list, given: dict[int, tuple[torch.Tensor, int]]) -> Any:
    """``out`` with each output that is an input of a frozen unit under ``torch.func`` (``passed``: the caller's tensor,
    the view of it the unit got, that view's version before the call; see ``_after_backward``), or a view of one, left
    unwritten, made the caller's tensor again (or that view of it), as ``_before_backward`` returns an unwritten argument
    of any other unit: the unit got a view made by a Function, a tensor of its own under torch.func, so a write into it
    after the call (``h = tower(h); h.mul_(2)`` where the tower skips itself) reached the caller's memory but not its
    graph (silently wrong gradients). The caller's tensor is added to ``given``, so that it is returned as it is."""
    if not passed:
        return out
    found, rebuild = _tree.tensors_and_rebuild(out)
    for i, t in enumerate(found):
        for tensor, view, version in passed:
            if view._version != version:
                continue
            if t is view:
                found[i] = tensor
            elif t._is_view() and _storage_ptr(t) == _storage_ptr(view):
                found[i] = tensor.as_strided(t.size(), t.stride(), t.storage_offset())
            else:
                continue
            given[id(tensor)] = (tensor, tensor._version)
            break
    return rebuild(found)


def _unwritten_argument(t: torch.Tensor, given: dict[int, tuple[torch.Tensor, int]]) -> bool:
    """Whether ``t`` is one of the unit's tensor arguments (``given``), or a view of one (``x.transpose(1, 2)``), that
    the unit did not write in place (a write through a view moves its base's version too)."""
    arg = given.get(id(t))
    if arg is not None:
        return arg[0] is t and t._version == arg[1]
    if not given or not t._is_view():
        return False
    ptr = _storage_ptr(t)
    return any(a._version == version and _storage_ptr(a) == ptr for a, version in given.values())


def _any_requires_grad(inputs: Any) -> bool:
    """Whether a gradient can flow through a unit called on ``inputs``, besides its trainable params. Where nothing
    can (a frozen block fed by frozen embeddings, under ``remat=True``), remat has no graph to spare and nothing to
    recompute, and its watch (a torch function mode) would keep torch's fast paths from what the unit runs: a frozen
    ``nn.TransformerEncoder`` in eval mode hands its layers a nested tensor, which only the fast path takes."""
    return any(t.requires_grad for t in _tree.tensors_and_rebuild(inputs)[0])


def _unalias(out: Any, full: torch.Tensor) -> Any:
    """``out`` with any tensor that shares the gathered buffer's memory copied (the buffer is about to be freed).
    Searched as ``_before_backward`` searches (dataclasses and ``ModelOutput``s too): a dataclass holding a view of a
    param was handed back over the freed buffer, and reading it crashed the process."""
    ptr = _storage_ptr(full)
    found, rebuild = _tree.tensors_and_rebuild(out)
    if not any(_storage_ptr(t) == ptr for t in found):
        return out
    return rebuild([t.clone() if _storage_ptr(t) == ptr else t for t in found])


def _storage_ptr(t: torch.Tensor) -> int:
    """Where ``t``'s memory is; under ``torch.func`` (a unit run under ``torch.no_grad()`` inside the transform) the
    tensor a wrapper holds ("Cannot access storage of TensorWrapper")."""
    return _unwrapped(t).untyped_storage().data_ptr()


def _before_backward(out: Any, call: UnitCall, given: dict[int, tuple[torch.Tensor, int]] | None = None) -> Any:
    """``out`` with its differentiable tensors passed through ``_RefillBeforeBackward``: the unit's backward
    cannot start before the gradient of every output that reaches the loss has arrived there, so that is
    where the buffer is refilled (as FSDP's pre-backward hook on a module's outputs).

    Pytrees, dataclasses (a unit may return one) and Hugging Face ``ModelOutput``s are searched; a tensor
    that leaves the unit another way (stored on a module, captured by a hook on a submodule inside the
    unit) and is the only path of a gradient into the unit is not seen (see the module docstring).

    ``given``: the unit's tensor arguments and their versions before the call. An output that is one of them, or a view
    of one, unwritten (a block that skips itself: ``return x``), is returned as it is: no gradient through it reaches
    the unit's params, and a copy would break the alias the caller may rely on (``h = block(h); h.mul_(2)`` writes the
    ``h`` it still holds as its residual, in PyTorch).
    """
    found, rebuild = _tree.tensors_and_rebuild(out)
    given = given or {}
    wanted = [i for i, t in enumerate(found) if t.requires_grad and not _unwritten_argument(t, given)]
    if not wanted:
        return out
    # an output that is a view of another (``return h, h[:, 0]``, a pooler's first token) is made again on that one's
    # copy: copied apart, a write into one (``h.mul_(2)``) would no longer show in the other, silently
    bases, views = _aliases([found[i] for i in wanted])
    passed = _RefillBeforeBackward.apply(call, *[found[wanted[j]] for j in bases])
    for j, t in zip(bases, passed):
        found[wanted[j]] = t
    for j, (b, size, stride, offset) in views.items():
        found[wanted[j]] = found[wanted[b]].as_strided(size, stride, offset)
    return rebuild(found)


def _aliases(outs: list[torch.Tensor]) -> tuple[list[int], dict[int, tuple[int, Any, Any, int]]]:
    """The outputs to copy (their positions), and each other output that is a view of one of them: position ->
    (that one's position, its size, stride and offset from that one's start). A view's base is an output of the same
    memory, contiguous (so its copy keeps its strides), whose elements hold the view's; the largest such."""
    meta = [_unwrapped(t) for t in outs]
    ptrs = [_storage_ptr(t) for t in meta]
    if len(set(ptrs)) == len(ptrs):  # the usual case: no two outputs share memory
        return list(range(len(outs))), {}
    views: dict[int, tuple[int, Any, Any, int]] = {}
    for i, t in enumerate(meta):
        lo = t.storage_offset()
        hi = lo + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0) + 1 if t.numel() else lo
        holders = [b for b, m in enumerate(meta) if b != i and ptrs[b] == ptrs[i] and m.is_contiguous()
                   and m.storage_offset() <= lo and hi <= m.storage_offset() + m.numel()
                   and (m.numel() > t.numel() or m.numel() == t.numel() and b < i)  # (one returned twice: the first)
                   and all(st >= 0 for st in t.stride())]
        if holders:
            b = max(holders, key=lambda k: meta[k].numel())
            views[i] = (b, t.shape, t.stride(), int(lo - meta[b].storage_offset()))
    return [i for i in range(len(outs)) if i not in views], views


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor a ``torch.func`` wrapper holds (its metadata is the wrapper's), or ``t``."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


class _UnitGather(Function):
    """Forward: gather the unit into a buffer (kept as ``call.full`` when ``free_after``) and return its params,
    shaped views of that buffer in slot order. Backward: the params' gradients in one flat gradient
    (``fzero.step._context.join``, noting which params got one in ``usage``), reduce-scattered by ``_UnitReduce``.

    One Function does what a gather, a ``split`` and a view per param would: under ``torch.func`` every
    custom Function and every op on a wrapped tensor costs a layer of Python, paid per unit per step.
    """

    @staticmethod
    def forward(shard, call, free_after, usage):
        full = call.schedule.gather(call, shard.detach())  # values only: the gradient is this Function's
        if free_after:
            call.full = full
        else:  # a remat call's buffer is not freed into the pool: it goes with the views its recompute saved
            forget(call.schedule.pool, full)
            call.remat_full = full  # for the forward's check of a write through .data, dropped after it (run)
        groups = call.schedule.groups.get(call.unit.name)
        if groups is not None:  # ``frozen=``: the unit's frozen params, views of the buffer's tail (no gradient)
            prefix = len(call.unit.name) + 1
            for region, group in zip(call.schedule.frozen_regions(full, call.unit.name), groups):
                call.frozen.update({k[prefix:]: v for k, v in frozen_views(region, group).items()})
            full = full.narrow(0, 0, call.unit.padded)
        # one split into every slot (and the padding), then a view each: half the dispatcher calls of narrow + view
        pieces = full.split_with_sizes(split_sizes(call.unit))
        return tuple(piece.view(s.shape) for piece, s in zip(pieces, call.unit.slots))

    @staticmethod
    def setup_context(ctx, inputs, output):
        shard, call, ctx.free_after, usage = inputs
        ctx.call = call
        ctx.sizes = tuple(split_sizes(call.unit))
        ctx.used = usage.used[call.unit.name] if usage is not None else None
        ctx.like = (shard.dtype, shard.device)
        ctx.set_materialize_grads(False)  # a param that got no gradient arrives as None

    @staticmethod
    def backward(ctx, *grads):
        if not ctx.free_after:  # a remat recompute's product: every use of the params is behind it (a
            # torch.utils.checkpoint inside the unit has called its layers again), so the unit lets go of them now, as
            # reduce() does at free_after; held until the product ends, the buffer lived beside the gradient's join
            ctx.call.done()
        flat = _usage.join(grads, ctx.sizes, ctx.used, ctx.like, pool=ctx.call.params.pool)
        if ctx.call.params.sink is not None:  # plain autograd: the reduction in flight while the next unit's backward runs
            ctx.call.reduce(flat, free_after=ctx.free_after, sink=ctx.call.params.sink)
            return None, None, None, None
        return _UnitReduce.apply(flat, ctx.call, ctx.free_after), None, None, None


class _UnitReduce(Function):
    """Forward: reduce-scatter the unit's gradient into the shard's, and free the gathered buffer again."""

    @staticmethod
    def forward(grad_full, call, free_after):
        grad_shard = call.reduce(grad_full, free_after=free_after)
        return grad_shard.view_as(grad_shard) if grad_shard is grad_full else grad_shard

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(DOUBLE_BACKWARD)


class _RefillBeforeBackward(Function):
    """Forward: the unit's outputs. Backward: refill the unit's buffer (``_Refill``), gradients unchanged.

    The outputs are copies, not views: models write a block's output in place (``h = block(h); h.add_(x)``). Under
    plain autograd a view made by a custom Function cannot be written in place. Under ``torch.func`` it can, but the
    write went into the tensor the unit's last layer saved for its backward (a tanh, a sigmoid, a softmax saves its
    output), and autograd's check of saved tensors did not see it (the view's version counter is not the saved
    tensor's): the backward silently used the written values, where PyTorch raises "modified by an inplace operation".
    On a copy the write leaves the unit's saved tensors as they were, as under plain autograd.
    """

    @staticmethod
    def forward(call, *outs):
        return tuple(o.clone() for o in outs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.call = inputs[0]
        # an output that reaches nothing in the loss gets None, not zeros: a zero gradient sent into the unit would
        # give the params behind that output a zero gradient where torch gives them none (grad=None, which AdamW skips)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        if not torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active():
            # plain autograd without a graph of the backward (no create_graph): ``_Refill`` would record nothing and
            # only run its forward, so that runs here, without a Function's apply (~20 us of host time per unit)
            ctx.call.refill_once()
            return (None, *grads)
        return (None, *_Refill.apply(ctx.call, *grads))


class _Refill(Function):
    """Forward: gather the unit into its own (freed) buffer again; returns the gradients unchanged.

    The refill is a collective, so it runs in a Function's forward (``torch.func.grad`` refuses a collective in a
    backward). It writes the same
    values the forward read, under ``_unsafe_preserve_version_counter``: autograd's check of the views it
    saved must not see a modification.
    """

    @staticmethod
    def forward(call, *grads):
        call.refill_once()  # (a hook's capture may have refilled it already: ``_refill_on_escape``)
        return tuple(None if g is None else g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)


# a gradient penalty reaches the units' Functions a second time: said with its cause and the settings that run it
DOUBLE_BACKWARD = """fzero (stage 3): double backward through a unit is not supported: a gradient of a gradient
(torch.autograd.grad(..., create_graph=True) in loss_fn or the model, as a gradient penalty, WGAN-GP or R1 takes
it) would differentiate the unit's gather, refill and reduce-scatter, which have no backward of their own. Train
it with stages=2 (each rank holds the params whole), or at stage 3 with units=() (every param in the root unit,
gathered once for the whole step), where it runs as in plain PyTorch."""


_NOT_REFILLED = """fzero (stage 3): unit {unit!r} computed its parameter gradient, but its gathered parameters were never
brought back for its backward: the gradient reached the inside of the unit without passing through the
unit's return value (a tensor made inside the unit that left it another way, e.g. stored on a module or
captured by a hook on a submodule of the unit). Return such tensors from the unit's forward, put the hook
on the unit itself, or keep that module out of the units (units=... without {unit!r})."""
