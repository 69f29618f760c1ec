"""What a step's rank context (``fzero.mesh.RankContext``) means for ``fzero.apply``: module clones, compute dtype,
buffers, usage.

``torch.func.functional_call`` swaps tensors into the module's attributes for the length of a forward, and a
forward may write into its module (Hugging Face installs its output-capturing hooks lazily, from inside the
forward). So within a step, on every rank (one process, a ``local_mesh`` rank thread, a torchrun process),
``fzero.apply`` runs a clone of the user's module: new module objects that share every parameter and buffer
tensor with the original and no mutable container (``fzero.layout._modules``). The clones copy a module at rest
and live for one step call; fzero never writes the user's module, not even for the length of a step, but what the
forward wrote in the clone's public attributes (a list appended to, a counter) is written into it when the step
succeeds (``fzero.layout.Writes``, noted in ``Step._as_rank``), as plain PyTorch keeps it.
Outside a step, ``fzero.apply`` is ``functional_call`` on the module itself.

## Usage (which params this rank's gradients used)

Which parameters a step used: torch.optim's ``p.grad is None``, recorded in the graph.

In PyTorch a parameter that takes no part in computing the loss keeps ``grad=None`` and the optimizer skips
it: no weight decay, no moment update, no step count (an unused head, an expert no token was routed to, a
layer LayerDrop skipped). fzero differentiates with respect to flat unit buffers, and ``torch.func.grad``
(like ``torch.autograd.grad(materialize_grads=True)``) hands back a zero gradient for whatever the loss did
not touch, so "unused" cannot be read off the gradient; and a used parameter may have an exactly zero
gradient (``p * 0``), which torch *does* update. So usage is taken from the graph itself.

Every unit buffer is cut into its parameters by one ``split`` (``Layout.unit_views``, given ``split`` below). While a step records
(``recording``), that split is ``_RecordedSplit``: a Function whose outputs are the same views, and whose
backward is the split's backward (one ``cat``, zeros where a view got no gradient), except that it asks
autograd not to materialise missing gradients (``set_materialize_grads(False)``), so the gradient of a view
nothing used arrives as ``None``, and it notes which views got one. A unit whose views were never made (a
stage-3 unit never called) or whose backward never ran has no parameter used. The record is kept per rank
and ORed over micro-batches; ``_update.finish`` ORs it over ranks in the step's metrics all-reduce (DDP's
``find_unused_parameters``: a parameter any rank used gets the averaged gradient; one no rank used keeps
``grad=None``) and the optimizer skips what is left unused (``fzero.optim`` and ``fzero.layout._layout``).

The Function is new-style (``forward`` without ctx, ``setup_context``), so it works under ``torch.func.grad``
and plain autograd alike. Its outputs are views of its input, as ``split``'s are: at stage 3
the graph keeps views of the gathered buffer, whose storage is freed and refilled around the backward.

Cost, where every param is used (measured, torch 2.13 CPU): the same forward views and the same one ``cat``
in backward as ``split``; the Python Function adds about 0.3 ms per unit call plus 10 us per param under
``torch.func.grad`` (functorch wraps a custom Function's outputs one by one), about a tenth of that under
plain autograd. For the 6-layer benchmark GPT that is 1-3 ms of a 0.4 s step, below the noise of
``benchmarks/unused_overhead.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator, cast

import torch
from torch import nn

from fzero.mesh import Function, current_context, with_context
from fzero.layout import Layout, Unit, clone_structure, split_sizes, walk


def module_for_thread(module: nn.Module) -> nn.Module:
    """Within a step, this step's (and this rank's) clone of ``module``, sharing all its tensors; else ``module``."""
    context = current_context()
    clones = context.clones
    if clones is None:
        return module
    entry = clones.get(id(module))
    if entry is None:  # one copy per module in a step call: a module run inside an earlier one's copy is that copy
        made = {i: copy for i, (_, copy) in clones.items()}
        clone = clone_structure(module, writes=context.writes, made=made)
        for i, copy in made.items():  # its submodules' copies, found by a later fzero.apply of one of them
            if i not in clones:
                clones[i] = (None, copy)
        entry = clones[id(module)] = (module, clone)  # a root: Step._as_rank notes its tree
    return entry[1]


@contextlib.contextmanager
def compute_dtype(dtype: "torch.dtype | None") -> Iterator[None]:
    """Within a step under a bf16/fp16 policy: the dtype ``fzero.apply`` casts floating inputs, buffers
    and frozen parameters to, so that they meet the low-precision params (as FSDP's MixedPrecisionPolicy
    casts forward inputs)."""
    with with_context(compute_dtype=dtype):
        yield


def current_compute_dtype() -> "torch.dtype | None":
    return current_context().compute_dtype


def current_writes() -> Any:
    """Within a step, the record of what this rank's copies of the user's modules changed in their public
    attributes (``fzero.layout.Writes``); else None."""
    return current_context().writes


@contextlib.contextmanager
def step_scope() -> Iterator[None]:
    """The length of one micro-batch's forward *and* backward: modules run by ``call_module`` keep the
    tensors they were given until it ends."""
    with contextlib.ExitStack() as stack, with_context(scope=stack):
        yield


def call_module(module: nn.Module, tensors: dict[str, torch.Tensor], args: Any, kwargs: Any, *, call: Any = None,
                owned: Mapping[str, torch.Tensor] | None = None, prefix: str = "", binding: Any = None) -> Any:
    """``torch.func.functional_call(module, tensors, args, kwargs)``, but within a step the module keeps
    ``tensors`` until the step's backward is done, not only until the forward returns.

    ``torch.utils.checkpoint`` (Hugging Face's ``gradient_checkpointing_enable()``) recomputes a block in
    backward by calling it again: with the tensors put back when the forward returned, the recompute
    would read the module's own stale weights (or a skeleton's meta tensors) and train silently wrong.
    The module is restored when the step's scope closes; the user's module is never left changed.
    ``call``: what to call instead of ``module`` while it holds ``tensors`` (its compiled forward, ``jit=True``).
    ``owned``: the step's buffers this call was handed (by name in the step's module; ``prefix`` + a name here), whose
    replacement by the forward the step's bank takes over (``Buffers.adopt_replaced``). ``binding``: a
    ``fzero.layout.Binding`` of ``module`` made since anything last changed it (the stage 2-3 skeleton's, made with it).
    """
    from fzero.layout import bound

    scope = current_context().scope
    run = module if call is None else call
    args = args if isinstance(args, tuple) else (args,)  # as functional_call takes a single argument
    kwargs = kwargs or {}
    tensors = tensors if type(tensors) is dict else dict(tensors)  # a dict of the caller's gets torch's write-back
    bank = current_buffers() if owned else None
    # the root's call covers the whole tree (a unit is a subtree the root's forward runs): one walk per forward
    unset = _unset_buffers(module) if not prefix and current_buffers() is not None and not current_context().replay else ()
    data = _data_ptrs(tensors)  # a trainable param's .data replaced by the forward (p.data = x) is refused after it
    if scope is None or not torch.is_grad_enabled():  # no graph, no recompute: restore at once
        with bound(module, tensors, binding):
            out = run(*args, **kwargs)
            refuse_replaced_data(data, prefix=prefix, where="is a view of the state's params for the step")
            _refuse_created(module, unset, prefix)
            if bank is not None:
                bank.adopt_replaced(module, tensors, owned, prefix=prefix)
            return out
    if current_context().replay:  # a remat recompute: see live_buffers
        with bound(module, tensors, binding):
            out = run(*args, **kwargs)
        scope.enter_context(bound(module, live_buffers(tensors), binding))
        return out
    scope.enter_context(bound(module, tensors, binding))
    out = run(*args, **kwargs)
    refuse_replaced_data(data, prefix=prefix, where="is a view of the state's params for the step")
    _refuse_created(module, unset, prefix)
    if bank is not None:
        bank.adopt_replaced(module, tensors, owned, prefix=prefix)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor a ``torch.func`` wrapper holds, or ``t``."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _data_ptrs(tensors: Mapping[str, Any]) -> list[tuple[str, torch.Tensor, int]]:
    """(name, tensor, where its memory starts) of each trainable tensor among those a module is handed for a call."""
    return [(name, t, _plain(t).data_ptr()) for name, t in tensors.items()
            if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_meta]


def refuse_replaced_data(data: list[tuple[str, torch.Tensor, int]], *, prefix: str, where: str) -> None:
    """Refuse a forward that replaced a trainable param's ``.data`` (``self.weight.data = w * 0.9``): the tensor it
    was handed (``data``, from ``_data_ptrs``) now holds other memory, so the write would reach neither the state nor
    the optimizer. Before: lost at every stage, silently (9.5e-2 off PyTorch after 3 SGD steps)."""
    from fzero.step._hints import DATA_WRITE

    for name, t, ptr in data:
        if _plain(t).data_ptr() != ptr:
            raise RuntimeError(DATA_WRITE.format(how=f"replaced the trainable param {prefix + name!r}", shape=tuple(t.shape),
                                                 where=where))


def _unset_buffers(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """The persistent buffer slots of ``module`` that hold None (``register_buffer(name, None)``): (name, holder, key)."""
    return [(prefix + key, sub, key) for prefix, sub in walk(module)
            for key, b in sub.__dict__["_buffers"].items() if b is None and key not in sub._non_persistent_buffers_set]


def _refuse_created(module: nn.Module, unset: Any, prefix: str) -> None:
    """Refuse a persistent buffer the forward created in a slot that held None (``register_buffer(name, None)``, then
    ``self.stat = x.mean(0)`` at the first call): it is not among the buffers the state carries, so every step started
    from None again and ``step.state_dict``/checkpoints left it out, where PyTorch keeps it (and its state_dict holds it):
    params 2e-2 off PyTorch after 4 AdamW steps, silently."""
    for name, sub, key in unset:
        now = sub.__dict__.get("_buffers", {}).get(key)
        if isinstance(now, torch.Tensor):
            sub._buffers[key] = None  # the module as it was; the state has no value for it
            raise ValueError(
                f"fzero.apply: the forward of {type(module).__name__} set the persistent buffer {prefix + name!r}, which "
                f"was registered as None, to a tensor ({tuple(now.shape)}, {now.dtype}). The state carries the buffers "
                f"the model has at step.init (state.buffers), so this one would start from None at every step and be "
                f"left out of step.state_dict and checkpoints, silently. Register it with its initial value before "
                f"step.init (module.register_buffer({key!r}, torch.zeros(...)), with a flag or a counter buffer in place of "
                f"the None test), or with persistent=False if it is not state to keep."
            )


def current_scope() -> "contextlib.ExitStack | None":
    """The scope that ``call_module`` keeps a module's tensors in: the step's, or a remat recompute's own."""
    return current_context().scope


@contextlib.contextmanager
def recompute_scope() -> Iterator[None]:
    """For fzero.remat's own recompute and the vector-Jacobian product it takes: a scope of its own, closed when
    that product is taken, so a module keeps the tensors the recompute bound (``call_module``; a stage-3 unit its
    gathered params) while the product runs, and no longer (a stage-3 unit's gathered buffer is not kept alive
    until the step ends). The product needs them where the recomputed function has a ``torch.utils.checkpoint`` of
    its own inside (timm's ``set_grad_checkpointing()`` in a unit of several blocks): that checkpoint calls its
    layers again during the product, which read meta tensors at stages 2-3 when the binding had already ended."""
    with contextlib.ExitStack() as stack, with_context(scope=stack):
        yield


@contextlib.contextmanager
def step_buffers(bank: Any) -> Iterator[None]:
    """Within a step's forward: the ``fzero.step._module.Buffers`` bank that ``fzero.apply`` runs modules with."""
    with with_context(buffers=bank):
        yield


def current_buffers() -> Any:
    return current_context().buffers


@contextlib.contextmanager
def watching_apply() -> Iterator[list]:
    """Within the block, the modules ``fzero.apply`` runs in this thread, each once, in the order first run: for the
    first forward's checks (``fzero.step._batch.LossFnInContext``), which name parameters and agree on structure."""
    modules: list = []
    with with_context(applied=modules):
        yield modules


def take_rank0_buffers(module: nn.Module) -> None:
    """Under ``dist_mesh`` of several processes, in a step call: rank 0's values of the non-persistent buffers of
    ``module`` and its submodules (a running average kept out of the ``state_dict``, a table filled from the rank's own
    RNG at init), written into this process's tensors in place before its first forward of the call, as DDP broadcasts
    every ``named_buffers()`` at construction and before each forward (``broadcast_buffers=True``), and as each rank of
    a ``local_mesh`` starts the call from a copy of the one module's. Each process kept its own before, so a
    rank-dependent buffer trained each rank on its own value. Once per module and call: a module run again, or
    inside an earlier one, keeps what this call's forwards wrote. ``sync_buffers`` gives every rank rank 0's again
    when the call succeeds (the persistent ones travel in the state, ``broadcast_buffers``)."""
    context = current_context()
    synced = context.synced
    if synced is None or id(module) in synced:
        return
    fresh = []
    for m in module.modules():
        if id(m) not in synced:
            synced[id(m)] = m
            fresh.append(m)
    sync_buffers(context.comm, fresh)


def sync_buffers(comm: Any, modules: list[nn.Module]) -> None:
    """Rank 0's values of ``modules``' own non-persistent buffers on every rank, in place: one broadcast per dtype and
    device (every rank walks the same modules in the same order, so issues the same ones). A buffer that views another
    of them (``head = cache[:4]``) gets its values with its base's; meta buffers hold none."""
    held: dict[int, torch.Tensor] = {}
    for m in modules:
        names = m._non_persistent_buffers_set
        for name, b in m._buffers.items():
            if name in names and isinstance(b, torch.Tensor) and not b.is_meta:
                held.setdefault(id(b), b)
    tensors = [t for t in held.values() if t._base is None or id(t._base) not in held]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad(), torch._C._DisableFuncTorch():  # plain tensors of the module, also under torch.func.grad
        for (dtype, device), ts in groups.items():
            flat = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()
            flat = comm.broadcast(flat, src=0, tag="buffers", label=f"non-persistent {dtype}")
            for t, v in zip(ts, flat.split([t.numel() for t in ts])):
                t.copy_(v.view(t.shape))


def note_applied(module: nn.Module) -> None:
    modules = current_context().applied
    if modules is not None and not any(m is module for m in modules):
        modules.append(module)


def cast_floating(tree: Any, dtype: "torch.dtype | None") -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (unchanged when ``dtype`` is None)."""
    if dtype is None:
        return tree
    import torch.utils._pytree as torch_pytree

    return torch_pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


# -- buffers under recompute ---------------------------------------------------------------------------
# fzero.remat runs a function twice: under no_grad in the forward, and again with grad in backward. What the
# function writes into the step's buffers (BatchNorm running statistics, spectral-norm vectors) must be written
# once, by the forward, as without remat; and the recompute must read the values the forward read. So while a
# remat forward runs, every buffer the step hands a module is noted with a copy of its value (``Snapshots``), and
# while its recompute runs, the module gets a fresh copy of that value instead: its writes go nowhere.


@contextlib.contextmanager
def as_in_forward(bank: Any, dtype: "torch.dtype | None") -> Iterator[None]:
    """A recompute in backward runs where the forward ran: with the step's buffer bank and compute dtype, which
    the step set only for the length of its forward (without them ``fzero.apply`` would run the module's own
    buffers, and write into them, and skip the low-precision casts)."""
    with with_context(buffers=bank, compute_dtype=dtype):
        yield


class Snapshots(dict):
    """``{id(live buffer): (live buffer, its value when the forward first handed it out)}``, for one remat call
    (the live tensor is kept so that its id stays its own); ``handed``: ``{id(copy): (copy, live buffer)}`` of the
    copies the recompute was handed (``buffers_for_run``), for ``live_buffers``."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@contextlib.contextmanager
def recording(snapshots: Snapshots) -> Iterator[None]:
    """A remat forward: note each buffer handed out (``buffers_for_run``) into ``snapshots``."""
    with with_context(snapshots=snapshots, replay=False):
        yield


@contextlib.contextmanager
def replaying(snapshots: Snapshots) -> Iterator[None]:
    """A remat recompute: hand out copies of the values in ``snapshots`` instead of the live buffers."""
    with with_context(snapshots=snapshots, replay=True):
        yield


def per_tensor(tensors: Mapping[str, torch.Tensor], fn: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: fn(name, t)}``, with ``fn`` called once per tensor (for its first name): names of one tensor (tied
    buffers, ``Buffers._tie``) stay one tensor in the result, as they are one in the module."""
    made: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in tensors.items():
        if id(t) not in made:
            made[id(t)] = fn(name, t)
        out[name] = made[id(t)]
    return out


def buffers_for_run(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's ``buffers`` as a module should run with them now (see the comment above)."""
    snapshots = current_context().snapshots
    if snapshots is None or not buffers:
        return buffers
    if current_context().replay:
        out = per_tensor(buffers, lambda k, v: snapshots[id(v)][1].clone() if id(v) in snapshots else v)
        for k, v in buffers.items():
            if out[k] is not v:
                snapshots.handed[id(out[k])] = (out[k], v)
        return out
    for v in buffers.values():
        if id(v) not in snapshots:
            snapshots[id(v)] = (v, v.detach().clone())
    return buffers


def live_buffers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each buffer copy a remat recompute was handed (``buffers_for_run``) replaced by the step's live
    buffer it copies: what a module holds while remat's product is taken (``recompute_scope``). A
    ``torch.utils.checkpoint`` inside the recomputed function calls its layers again then, and PyTorch's recompute
    writes the live buffers (a BatchNorm's running stats are updated once more, as in an eager step with that
    checkpoint); the recompute itself ran on the copies, so that it never writes them twice."""
    snapshots = current_context().snapshots
    if snapshots is None or not snapshots.handed:
        return tensors
    return {k: snapshots.handed[id(v)][1] if id(v) in snapshots.handed and snapshots.handed[id(v)][0] is v else v
            for k, v in tensors.items()}


# -- usage ---------------------------------------------------------------------------------------------------------


class Usage:
    """One rank's record of one step: per unit, which of its slots got a gradient (in some micro-batch)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.used: dict[str, list[bool]] = {u.name: [False] * len(u.slots) for u in layout.units}

    def flags(self) -> torch.Tensor:
        """float32 1-D, one entry per slot in layout order (``layout.paths``): 1.0 where used. Summed over ranks
        by the step's metrics all-reduce, an entry > 0 says some rank used the slot."""
        return torch.tensor([float(x) for u in self.layout.units for x in self.used[u.name]], dtype=torch.float32)

    def unused(self) -> list[str]:
        """The paths of the params no gradient of this step has reached so far on this rank, in layout order."""
        return [s.path for u in self.layout.units for s, used in zip(u.slots, self.used[u.name]) if not used]


@contextlib.contextmanager
def recording_usage(layout: Layout) -> Iterator[Usage]:
    """Record, in this thread, which params the gradients computed inside the block use."""
    with with_context(usage=Usage(layout)) as context:
        yield context.usage


def active(unit: Unit) -> Usage | None:
    """The record that gradients into ``unit`` should note, or None (not recording, or no gradient being built)."""
    usage = current_context().usage
    if usage is None or not torch.is_grad_enabled() or unit.name not in usage.used:
        return None
    return usage


def split(flat: torch.Tensor, unit: Unit, *, pool: Any = None) -> tuple[torch.Tensor, ...]:
    """``flat`` cut into ``unit``'s slots (and its padding, last), 1-D views; recorded while a step records
    (``pool``: where the backward's flat gradient is made, see ``join``)."""
    sizes = split_sizes(unit)
    usage = active(unit)
    if usage is None:
        return torch.split(flat, sizes)
    # the record itself, not its list, is the argument: torch.func rebuilds list arguments (a copy would be written)
    return _RecordedSplit.apply(flat, tuple(sizes), usage, unit.name, pool)


def join(grads: tuple[torch.Tensor | None, ...], sizes: tuple[int, ...], used: list[bool] | None,
         like: tuple[torch.dtype, torch.device], pool: Any = None) -> torch.Tensor:
    """The flat gradient of a split: ``grads`` (None where a piece got none: zeros) in one buffer, noting in
    ``used`` which pieces got one. ``sizes`` may be longer than ``grads`` (trailing pieces without a view: zeros).

    With a ``pool`` (plain autograd) the buffer is one of the step's and each gradient is copied into its place;
    without (``torch.func``, whose backward computes on its own wrapped tensors) it is one ``cat``."""
    present = next((g for g in grads if g is not None), None)
    if pool is not None:
        dtype, device = (present.dtype, present.device) if present is not None else like
        flat = pool.take(sum(sizes), dtype=dtype, device=device)
        if _chunk_cat_into(flat, grads, sizes, dtype):
            if used is not None:
                used[:min(len(grads), len(used))] = [True] * min(len(grads), len(used))
            return flat
        dests, srcs = [], []
        for i, piece in enumerate(flat.split_with_sizes(sizes)):
            g = grads[i] if i < len(grads) else None
            if g is None:
                piece.zero_()
            else:
                if used is not None and i < len(used):
                    used[i] = True
                dests.append(piece.view(g.shape))  # a transposed gradient is copied once, not made contiguous first
                srcs.append(g)
        if dests:  # one multi-tensor kernel on a GPU for the unit's pieces, not a launch per parameter
            torch._foreach_copy_(dests, srcs)
        return flat
    parts = []
    for i, n in enumerate(sizes):
        g = grads[i] if i < len(grads) else None
        if g is None:
            parts.append(present.new_zeros(n) if present is not None else torch.zeros(n, dtype=like[0], device=like[1]))
        else:
            if used is not None and i < len(used):  # the last piece may be the padding, which is no parameter
                used[i] = True
            parts.append(g.reshape(-1))
    return torch.cat(parts)


def _chunk_cat_into(flat: torch.Tensor, grads: tuple[torch.Tensor | None, ...], sizes: tuple[int, ...],
                    dtype: torch.dtype) -> bool:
    """The common case of ``join``, in one op: every piece with a view got a gradient of ``flat``'s dtype, none 0-d;
    ``torch._chunk_cat`` (FSDP2's copy-in for its reduce-scatter) flattens each into its place, and the pieces
    without a view (the padding) are zeroed. Why: the per-piece narrow, view and copy cost about 5 us of host time
    per parameter, paid for every unit in every backward; this is one call. False (nothing written): the general
    path, which also names a gradient of the wrong size, must do it. A 0-element gradient (a parameter of shape
    (0, 4)) goes that way too: ``_chunk_cat`` refuses empty tensors ("expects non-empty tensor", at stages 2-3)."""
    n = len(grads)
    if n == 0 or n > len(sizes):
        return False
    for g, size in zip(grads, sizes):
        if g is None or g.dim() == 0 or g.dtype != dtype or g.numel() != size or size == 0:
            return False
    filled = sum(sizes[:n])
    torch._chunk_cat(cast("tuple[torch.Tensor, ...]", grads), 0, 1, out=flat[:filled].view(1, filled))  # none is None
    if filled < flat.numel():
        flat[filled:].zero_()
    return True


def record(params: tuple[torch.Tensor, ...], unit: Unit) -> tuple[torch.Tensor, ...]:
    """``unit``'s params (one tensor per slot, stages 0-1 take the gradient with respect to them one by one),
    passed through ``_Recorded`` while a step records, so that which of them got a gradient is noted."""
    usage = active(unit)
    if usage is None:
        return params
    return _Recorded.apply(usage, unit.name, *params)


def noting(usage: Usage, unit: str, i: int):
    """A ``post_accumulate_grad_hook`` for slot ``i`` of ``unit``: its param got a gradient (plain autograd,
    where each param accumulates its own; see ``fzero.step._parts.ParamView``)."""
    used = usage.used[unit]

    def hook(_param: torch.Tensor) -> None:
        used[i] = True

    return hook


class _Recorded(Function):
    """The identity on a unit's params, whose backward notes which of them got a gradient (``usage.used[unit][i]``).
    Where the gradient is taken with respect to each param (stages 0-1), the record cannot come from a split's
    backward; this Function passes the gradients through untouched, so it adds no copy."""

    @staticmethod
    def forward(usage, unit, *params):
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        usage, unit = inputs[:2]
        ctx.used = usage.used[unit]
        ctx.set_materialize_grads(False)  # a param that got no gradient arrives as None

    @staticmethod
    def backward(ctx, *grads):
        for i, g in enumerate(grads):
            if g is not None:
                ctx.used[i] = True
        return (None, None, *grads)


class _RecordedSplit(Function):
    """``torch.split`` whose backward notes which outputs got a gradient (``usage.used[unit][i] = True``)."""

    @staticmethod
    def forward(flat, sizes, usage, unit, pool=None):
        return tuple(flat.split(list(sizes)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        flat, ctx.sizes, usage, unit, ctx.pool = inputs if len(inputs) == 5 else (*inputs, None)
        ctx.used = usage.used[unit]
        ctx.like = (flat.dtype, flat.device)
        ctx.set_materialize_grads(False)  # a view that got no gradient arrives as None

    @staticmethod
    def backward(ctx, *grads):
        return join(grads, ctx.sizes, ctx.used, ctx.like, ctx.pool), None, None, None, None
