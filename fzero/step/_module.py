"""Functional use of an ordinary ``nn.Module``, which fzero never mutates: a run of it with other params (``apply``),
and its buffers as state. Its params (``params_of``) and the other entry points that take its tensors out or put them
back outside a step are in ``fzero.step._params``.

Buffers are state: what a forward writes (BatchNorm running stats, ``num_batches_tracked``, spectral-norm
vectors) is carried in ``TrainState.buffers`` and returned by the step; the user's module is never written.

A step hands ``loss_fn``'s forward a ``Buffers`` bank: ``fzero.apply`` runs the module with the bank's
tensors in place of the module's own persistent buffers (``module.state_dict()``'s buffers), so the
forward's in-place writes land in the bank, and the bank's values after the step become the new state's.
A buffer the state does not hold yet (the first step of a state made from ``params_of`` alone) is adopted
from the module, copied. Non-persistent buffers (rotary tables, causal masks: constants) stay the module's.

Under ``torch.func.grad`` a forward may write in place only into tensors of the transform's own level: a
captured tensor is refused ("mutate a captured Tensor"). ``lift`` makes the bank's tensors
such: ``anchor.new_empty(...).copy_(value)``, where ``anchor`` is a detached input of the transformed
function, gives a tensor of that level with the value's exact bits and no gradient bookkeeping (passing
buffers as differentiated inputs instead would cost a zero gradient per buffer and cannot carry integer
ones). The values come out of the transform as auxiliary outputs.

At the end, the checks of a module against the params a state holds at every ``fzero.apply`` (a state of another
model width, trainable params changed since ``step.init``); and the modules a step cannot run as a torchrun job of DDP
runs them (a ``torch.compile`` wrapper, sparse gradients, ``SyncBatchNorm`` on simulated ranks), refused by name. The
refusals made once, never at a later step (before an export: ``check_export_model``; a model FSDP shards), are in
``fzero.step._refusals``.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from fzero.layout import check_no_meta, compiled_in_place, compiled_wrapper, named_tensors, same_values, value_changes
from fzero.layout import pytrees as _tree
from fzero.mesh import current_context, with_context
from fzero.step._module_refusals import (calls_itself, check_no_compiled_submodules, check_no_grad_hooks, check_params_fit_module,
                                         check_trainable_set, compiled_in_place_error, own_forward_error, trains_under)
from fzero.step._refusals import _shared_buffer_message, check_not_fsdp
from fzero.step._stale import held_tensors, note_replaced
from fzero.step._context import (buffers_for_run, call_module, cast_floating, current_buffers, current_compute_dtype,
                                 module_for_thread, note_applied, per_tensor,
                                 take_rank0_buffers)


def apply(module: nn.Module, params: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``module`` with ``params`` in place of its own (``torch.func.functional_call``); the module is unchanged.

    ``params`` maps names as in ``params_of``; tied names are resolved by torch (``tie_weights=True``), and
    parameters not in ``params`` come from the module. Inside a step, persistent buffers come from the
    train state and what the forward writes into them goes back there (BatchNorm statistics); outside a
    step, buffers are the module's, unless ``params`` gives them (``step.state_dict(state, model)``): where a step has
    moved the state's buffers away from the module's (trained BatchNorm statistics), a ``params`` without them is
    refused by name rather than run on the statistics from before training. At stages 2 and 3 ``params`` is what
    ``loss_fn`` was given (``ReplicatedParams``/``ShardedParams``) and the model runs unit by unit.

    ``module`` may also be a bound method of a module, e.g. ``fzero.apply(lit.training_step, params, batch, i)``:
    that method runs instead of ``forward``, on the module (or the step's copy of it) holding ``params``, so what it
    calls of ``self`` (``self(x)``, ``self.model(x)``) runs with them (how ``fzero.lightning`` runs a
    ``LightningModule``'s ``training_step``).
    """
    method = None
    if isinstance(module, types.MethodType) and isinstance(module.__self__, nn.Module):
        module, method = module.__self__, module.__func__
    if not isinstance(module, nn.Module):
        raise TypeError(f"fzero.apply: expected an nn.Module (or a bound method of one) as the first argument, got "
                        f"{type(module).__name__}.")
    check_not_compiled(module, api="fzero.apply")
    if not torch.is_grad_enabled():  # step.evaluate, which no first step's check_module_features sees
        check_no_compiled_submodules(module, api="fzero.apply")
    note_applied(module)  # for the first step's checks of the loss and of the ranks' structure
    take_rank0_buffers(module)  # under dist_mesh: its non-persistent buffers start the call as rank 0's, as DDP's
    context = current_context()
    if context.applied is not None:  # the first forward of a step's checks: before it runs the model
        check_not_fsdp(module, api="fzero.Step")
    if context.stream is not None:  # a rank thread of a local_mesh of several ranks (fzero.mesh._rank)
        check_no_sync_batchnorm(module, api="fzero.apply")
        check_no_parametrize_cache(module, api="fzero.apply")
        if context.frozen is not None:  # before the forward: what its frozen params hold (FrozenWrites)
            context.frozen.note(module)
    dtype = current_compute_dtype()  # set by a step under a bf16/fp16 policy
    args, kwargs = cast_floating((args, kwargs), dtype)
    bank = current_buffers()
    # before the forward: a meta tensor it would read from the module is named here, not deep inside the model
    if isinstance(params, Mapping):  # else: the TypeError below
        paths = getattr(type(params), "frozen_paths", None)
        held = paths(params) if paths is not None else None  # stage 3 with frozen=: the step holds those, sharded
        check_no_meta(module, [*params, *held] if held else params, state_buffers=bank is not None, api="fzero.apply")
    if bank is None and isinstance(params, Mapping):  # outside a step: the module's own buffers are read
        check_buffers_current(module, params)
    run_module = getattr(type(params), "run_module", None)
    if context.trained is not None:  # a train step: a module run with its params is now behind the state (Trained)
        context.trained.ran(module, params, units=run_module is not None)
    if run_module is not None:  # stages 2-3 (fzero.zero's unit params): unit by unit as the forward reaches them
        forward = functools.partial(run_module, params, module, args, kwargs, method=method)  # its own per-rank skeleton
    else:
        forward = functools.partial(apply_dict, module, params, args, kwargs, method=method)
    if context.stale is None:
        return forward()
    # the first step's check of what loss_fn reads off the module next (fzero.step._stale): a value the forward replaced
    before = held_tensors(module)
    with with_context(stale=None):  # inside the forward, what the module holds is read as it is
        out = forward()
    entry = context.clones.get(id(module)) if context.clones is not None else None  # stages 0-1: its clone
    copy = entry[1] if entry is not None else params.skeleton(module)  # stages 2-3: its skeleton
    note_replaced(module, copy, context.stale, before=before, private=getattr(context.writes, "private", None))
    return out


def apply_dict(module: nn.Module, params: Any, args: tuple, kwargs: dict, *, method: Any = None) -> Any:
    """``fzero.apply`` with a params dict (stages 0-1, or outside a step), its arguments already cast: the module (this
    rank's clone of it, within a step) runs with ``params``, the step's buffers and, under a low-precision policy,
    its other tensors cast. ``method``: a function of the module's class to run instead of ``forward``."""
    bank = current_buffers()
    dtype = current_compute_dtype()
    if not isinstance(params, dict):
        raise TypeError(f"fzero.apply: params must be a dict of name -> tensor (as fzero.params_of returns), got {type(params).__name__}.")
    target = module_for_thread(module)  # a per-rank clone on a multi-rank local_mesh (see fzero.step._context)
    named = check_params_fit_module(target, params, api="fzero.apply")  # a state of another model width must not run
    if bank is not None:  # in a step: its params are the state's, whose trainable set must still be the module's
        check_trainable_set(named, params, module, api="fzero.apply")
        if torch.is_grad_enabled():  # a gradient step (evaluate runs under no_grad): hooks there would be lost
            check_no_grad_hooks(named, module, api="fzero.apply", step_params=params)
    handed: dict[str, torch.Tensor] = {}
    if bank is not None:  # in a step: the state's buffers, never the module's (see fzero.step._module)
        handed = bank.for_module(module, given=params)
        params = {**handed, **params}
    if dtype is not None:  # frozen params and persistent buffers meet the low-precision params in the compute dtype;
        # non-persistent buffers (rotary inv_freq, masks: constants) keep their own, as FSDP2 and DeepSpeed keep them.
        # What params gives is cast too: the step's own are in that dtype already (a no-op), and another model's
        # (a teacher's fp32 params and buffers, fzero.apply(teacher, {**tparams, **tbuffers}, x)) must meet the cast x
        extra = {n: t for n, t in (*named_tensors(target, "_parameters"), *named_tensors(target, "_buffers", persistent_only=True))
                 if n not in params}
        params = {**cast_floating(extra, dtype), **_in_dtype(params, dtype)}
    return call_module(target, params, args, kwargs, call=None if method is None else types.MethodType(method, target),
                       owned=handed)


def _in_dtype(tensors: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``cast_floating`` of a flat dict, without a pytree walk: the step's own params are in ``dtype`` already, and this
    runs at every ``fzero.apply`` of a step under a low-precision policy."""
    return {k: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype else t
            for k, t in tensors.items()}


# The user's modules a step has trained, each with weak references to the persistent buffers of the state that step
# returned (rank 0's), by name: outside a step ``fzero.apply`` reads the module's own buffers, which a step never
# writes, so a BatchNorm evaluated as ``fzero.apply(model, step.gather(state), x)`` ran on the statistics the module
# had before training (measured 7.4e-2 off PyTorch's eval output after 3 steps), silently.
_trained: "weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref]]" = weakref.WeakKeyDictionary()
_trained_lock = threading.Lock()


def note_trained_buffers(modules: Any, buffers: Mapping[str, torch.Tensor]) -> None:
    """After a step: ``modules`` (the user's modules its ``loss_fn`` ran through ``fzero.apply``) hold, in their own
    buffers, values the state (``buffers``, the new state's) may have moved on from."""
    for module in modules:
        held = {n: weakref.ref(buffers[n]) for n in persistent_buffers(module) if isinstance(buffers.get(n), torch.Tensor)}
        with _trained_lock:
            if held:
                _trained[module] = held
            else:
                _trained.pop(module, None)


# The user's modules a train step has run, each with its trainable parameters as they were when the step returned,
# by name: the tensor's id and version counter, and its first few values (``_first_values``). A step
# trains its state, never the module, so a module called directly afterwards (an evaluation, ``generate()``) runs on
# the values it had at ``step.init``: refused by the forward pre-hook below while its parameters are still those
# tensors, unchanged. Loading the trained values into it lifts it: ``load_state_dict`` in place moves each version,
# ``assign=True`` puts in new tensors, and what writes through ``.data`` (``p.data.copy_(t)``, ``p.data = t``,
# ``torch.nn.utils.vector_to_parameters``) or swaps the tensors (``load_state_dict`` under
# ``torch.__future__.set_swap_module_params_on_conversion(True)``) leaves id and version as they were but changes the
# values. No reference to a parameter is held, not even a weak one: ``torch.utils.swap_tensors`` refuses a tensor
# with a weak reference, and failed every such load (and ``model.to()`` in that mode) of a module a step had trained.
_untrained: "weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, int, torch.Tensor, int]]]" = weakref.WeakKeyDictionary()
_FIRST = 8  # the values of each parameter kept to tell a write through .data from none
# The same modules' trainable parameters that were meta tensors when the step returned, by name: their values were
# given to the state by ``step.init(..., donate=True)`` (or never existed: a model built under ``fzero.empty_params()``
# and made by ``materialize=``). A direct call would get torch's "Tensor on device meta is not on the expected device"
# deep in the first layer, naming neither fzero nor the fix; the pre-hook names both while they are still meta.
_meta_trained: "weakref.WeakKeyDictionary[nn.Module, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def _first_values(p: torch.Tensor) -> torch.Tensor:
    """The first ``_FIRST`` values of ``p``, copied (a few bytes beside each parameter, taken again only where its
    tensor or version moved since the step before, or a step found them written: a step costs no copy)."""
    with torch.no_grad():
        return _first_view(p.detach()).clone()


def _first_view(p: torch.Tensor) -> torch.Tensor:
    """The first ``_FIRST`` values of ``p`` (in memory order where it is contiguous, in one op: read every step for
    every trainable param, ``watch_module_writes``, at half the cost of a flatten and a slice), a view. Given detached:
    a remat'ed function's watch refuses an op on a tensor that requires grad and is none of its arguments."""
    return p.as_strided((min(_FIRST, p.numel()),), (1,)) if p.is_contiguous() else p.reshape(-1)[:_FIRST]


class Trained:
    """What one train step call moves behind its state, of the user's modules (rank 0's, or this process's), noted as
    the step runs and kept once it has returned (``Step._as_rank``): ``buffers``, the modules the step's buffer bank
    handed the state's buffers to (``note_trained_buffers``), and ``params``, the modules ``fzero.apply`` ran with the
    step's own params (``note_trained_params``): at stages 2-3 every module run with unit params; at stages 0-1 one
    given a dict holding a tensor of the params ``loss_fn`` was given (``give``, called by
    ``fzero.step._batch.LossFnInContext``), so a teacher run with its own params (``fzero.apply(teacher, {**tparams,
    **tbuffers}, x)``) is not taken for trained."""

    __slots__ = ("buffers", "params", "given", "_leaves", "watches")

    def __init__(self) -> None:
        self.buffers: list[nn.Module] = []
        self.params: list[nn.Module] = []
        self.watches: list[Any] = []  # the modules' trainable params against their record (``watch_module_writes``)
        self.given: Any = None  # what loss_fn was given (stages 0-1), set per call
        self._leaves: frozenset[int] | None = None

    def give(self, params: Any) -> None:
        self.given, self._leaves = params, None

    def handed(self, module: nn.Module) -> None:
        """The step's buffer bank handed ``module`` the state's buffers: the state now carries them."""
        if not any(m is module for m in self.buffers):
            self.buffers.append(module)

    def ran(self, module: nn.Module, params: Any, *, units: bool) -> None:
        """``fzero.apply`` ran ``module`` with ``params`` (unit params: ``units``); the first time in the call, its
        trainable params are held against what the step before left them as (``watch_module_writes``)."""
        if any(m is module for m in self.params):
            return
        if units or params is self.given or (isinstance(params, Mapping) and any(id(v) in self.leaves for v in params.values())):
            self.params.append(module)
            watch = watch_module_writes(module, params)
            if watch is not None:
                self.watches.append(watch)

    def check_writes(self) -> None:
        """Before the update: refuse a module whose trainable params were written since the step before
        (``watch_module_writes``), unless they now hold the state's values."""
        watches, self.watches = self.watches, []
        for watch in watches:
            watch.check()

    @property
    def leaves(self) -> frozenset[int]:
        """The ids of the tensors loss_fn was given, made on demand: most ``loss_fn``s pass that very dict on."""
        if self._leaves is None:
            self._leaves = frozenset(id(t) for t in _tree.tree_leaves(self.given)) if self.given is not None else frozenset()
        return self._leaves


# (kept here, not with the refusals made once: the between-steps watch runs them at every step, tests/test_structure.py)
class _ModuleWrites:
    """One module's trainable params at a step's first forward of it, against the record the step before left
    (``_untrained``): those of another size (found on the host), and whether each other one's first values moved (a
    write through ``.data``, ``p.data.clamp_(-c, c)``, ``torch.nn.init``), a tensor on the params' device that
    ``check`` reads once, before the update, so the step makes the host wait for the device once at most."""

    def __init__(self, module: nn.Module, params: Any, now: dict[str, torch.Tensor], moved: list[str],
                 names: list[str], firsts: torch.Tensor | None) -> None:
        self.module, self.params, self.now, self.moved, self.names, self.firsts = module, params, now, moved, names, firsts

    def check(self) -> None:
        written = list(self.moved)
        if self.firsts is not None:
            flags, at = self.firsts.tolist(), 0
            for n in self.names:
                k = min(_FIRST, self.now[n].numel())
                if any(flags[at:at + k]):
                    written.append(n)
                at += k
        if not written:
            return
        differ = [n for n in written if not _holds_state_values(self.now[n], n, self.params)]
        if differ:
            raise ValueError(_module_written_message(self.module, differ, self.now))
        with _trained_lock:  # the state's values, written into the module (a load through .data): the record takes them
            held = _untrained.get(self.module)
            if held is not None:
                for n in written:
                    p = self.now[n]
                    if n in held:
                        held[n] = (id(p), p._version, _first_values(p), p.data_ptr())


def watch_module_writes(module: nn.Module, params: Any) -> "_ModuleWrites | None":
    """A trainable param of ``module`` written on the module since the step before trained it (WGAN's weight clipping
    ``p.data.clamp_(-c, c)`` after a step, an EMA through ``.data``, ``torch.nn.init`` on a submodule, ``p.data = t``): a
    step trains its state and never reads the module's trainable params, so the write was lost, silently (3e-1 off
    PyTorch after 3 SGD steps). Found by the record the step before left (``_untrained``), by each param's first
    values (a new tensor of the same values writes nothing; a write that leaves the first values as they were is not
    seen), and refused
    before the update unless the module now holds the state's values (``model.load_state_dict(step.state_dict(state,
    model))`` between steps, to evaluate it). None where the module has no record or nothing to compare."""
    with _trained_lock:
        held = _untrained.get(module)
    if not held:
        return None
    now = dict(named_tensors(module, "_parameters"))
    moved, names, firsts, olds = [], [], [], []
    with torch.no_grad():  # views of the module's params, read without a graph
        for name, (_, _, first, _) in held.items():
            p = now.get(name)
            if p is None or p.is_meta or not p.requires_grad:  # gone, emptied (donate=True) or frozen: not a value
                continue
            # by value alone: a new tensor of the same values (model.double().float(), a load with assign=True of the
            # module's own) writes nothing, and a write through .data moves neither the tensor nor its version
            values = _first_view(p.detach())
            if values.shape != first.shape:
                moved.append(name)
                continue
            if values.dtype != first.dtype or values.device != first.device:
                values = values.to(first.device, first.dtype)
            names.append(name)
            firsts.append(values)
            olds.append(first)
    flags = None
    if firsts:  # one comparison for all: each param's first values, element by element (read in ``check``)
        with torch.no_grad(), torch._C._DisableFuncTorch():
            if len({t.device for t in firsts}) == 1:
                flags = value_changes(torch.cat(firsts), torch.cat(olds))
            else:
                flags = torch.cat([value_changes(a, b).cpu() for a, b in zip(firsts, olds)])
    if not moved and flags is None:
        return None
    return _ModuleWrites(module, params, now, moved, names, flags)


def _holds_state_values(p: torch.Tensor, name: str, params: Any) -> bool:
    """Whether the module's param ``p`` holds, in the state's dtype, what this rank's state holds of param ``name``:
    the whole param at stages 0-2, this rank's shard of it at stage 3 (each rank checks its own, and one that finds
    otherwise refuses for all)."""
    from fzero.step._context import _plain

    with torch.no_grad(), torch._C._DisableFuncTorch():
        if getattr(type(params), "run_module", None) is None:  # stages 0-1: a dict holding the state's tensors
            t = params.get(name) if isinstance(params, Mapping) else None
            if not isinstance(t, torch.Tensor):
                return False
            t = _plain(t).detach()
            return t.shape == p.shape and same_values(t, p.detach().to(t.device, t.dtype))
        slot = unit = None
        for u in params.layout.units:
            slot = next((s for s in u.slots if s.path == name), None)
            if slot is not None:
                unit = u
                break
        if slot is None or unit is None:
            return False
        wholes = getattr(params, "wholes", None)
        if wholes is not None:  # stage 2: the whole flat of the unit
            src, lo = _plain(wholes[unit.name]).detach(), 0
        else:  # stage 3: what this rank sends to the unit's gather, its share of the flat
            src = params.schedule.input_of(unit.name)
            lo = unit.shard_range(params.comm.rank, params.comm.size)[0]
        a, b = max(lo, slot.offset), min(lo + src.numel(), slot.offset + slot.numel)
        if a >= b:
            return True
        mine = p.detach().reshape(-1)[a - slot.offset:b - slot.offset].to(src.device, src.dtype)
        return same_values(src.reshape(-1)[a - lo:b - lo], mine)


def _module_written_message(module: nn.Module, names: list[str], now: dict[str, torch.Tensor]) -> str:
    few = ", ".join(f"{n!r} {tuple(now[n].shape)}" for n in names[:4]) + (" ..." if len(names) > 4 else "")
    return (
        f"fzero.Step: the trainable param(s) {few} of {type(module).__name__} were written on the module since the step "
        f"before (p.data.clamp_(...) or another write through .data, torch.nn.init, an in-place write under "
        f"torch.no_grad(), p.data = t), and they do not hold the state's values. A step trains its state and never "
        f"reads the module's trainable params, so the write would be ignored, silently (PyTorch's optimizer steps the "
        f"written values). Change the state instead: an element-wise edit of every param (WGAN's weight clipping) can be "
        f"made on the state's params in place, for t in state.params.values(): t.clamp_(-c, c) (fp32 params without "
        f"master weights or offload; on a local mesh, for each s in state.states); for another change, write the "
        f"trained values into the module first (model.load_state_dict(step.state_dict(state, model))), change it, "
        f"then state = step.init(fzero.params_of(model)) (the optimizer's moments start again). Loading the state's "
        f"own values into the module to evaluate it is not a change.")


def _few_names(names: list[str]) -> str:
    """The first four of ``names``, quoted, and how many more: what an error shows of a list of params or buffers."""
    return ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def note_trained_params(modules: Any) -> None:
    """After a train step: ``modules`` (the user's modules its ``loss_fn`` ran through ``fzero.apply``) hold trainable
    parameters the state has moved on from. Each gets ``_refuse_untrained_call`` as a forward pre-hook once (its
    clones in later steps carry it too, where it finds no record and returns at once)."""
    for module in modules:
        with _trained_lock:
            before = _untrained.get(module) or {}
        held, meta = {}, []
        for n, p in named_tensors(module, "_parameters"):  # named_parameters(), by one walk: this runs every step
            if p.requires_grad and p.is_meta:
                meta.append(n)
            elif p.requires_grad:
                pid, version, old = id(p), p._version, before.get(n)
                held[n] = (pid, version, old[2] if old is not None and old[0] == pid and old[1] == version else _first_values(p),
                           p.data_ptr())
        with _trained_lock:
            if held:
                _untrained[module] = held
            else:
                _untrained.pop(module, None)
            if meta:
                _meta_trained[module] = tuple(meta)
            else:
                _meta_trained.pop(module, None)
        if (held or meta) and not any(h is _refuse_untrained_call for h in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(_refuse_untrained_call)
        if held and not any(h is _refuse_untrained_state_dict for h in module._state_dict_pre_hooks.values()):
            module.register_state_dict_pre_hook(_refuse_untrained_state_dict)


def _still_meta(module: nn.Module) -> list[str]:
    """The trainable parameters of ``module`` that were meta tensors when a train step returned and still are (not
    loaded since, nor swapped for the call by ``fzero.apply`` or ``functional_call``); [] for a module no step trained."""
    with _trained_lock:
        names = _meta_trained.get(module)
    if not names:
        return []
    out = []
    for name in names:
        try:
            p = module.get_parameter(name)
        except AttributeError:
            continue
        if p is not None and p.is_meta:
            out.append(name)
    return out


def _still_untrained(module: nn.Module) -> bool:
    """Whether ``module``'s trainable parameters are still the tensors a train step left them as, unchanged: their
    values from ``step.init``, behind the state the step trained. False for a module no step trained."""
    with _trained_lock:
        held = _untrained.get(module)
    if not held:
        return False
    now = {}
    for name, (pid, version, *_) in held.items():
        try:
            p = module.get_parameter(name)
        except AttributeError:
            p = None
        if p is None or p.is_meta or id(p) != pid or p._version != version:  # replaced, or written in place
            return False
        now[name] = p
    for name, p in now.items():  # the same tensors, unwritten in place: a write through .data changed only the values
        first = held[name][2]
        with torch.no_grad():
            values = _first_view(p.detach())
        if values.shape != first.shape or not same_values(values, first.to(device=values.device, dtype=values.dtype)):
            return False
    return True


_LOAD_FIX = "model.load_state_dict(step.state_dict(state, model))"
_LIGHTNING = " Under fzero's Lightning strategy the step and state are trainer.strategy.step and trainer.strategy.state."


def _refuse_untrained_call(module: nn.Module, args: Any) -> None:
    """A forward pre-hook: refuse a direct call of a module a step has trained while its trainable parameters are
    still the tensors they were when that step returned, unchanged. ``fzero.apply`` outside a step and
    ``torch.func.functional_call`` swap other tensors in for the call, a step runs a copy of the module, and a module
    the trained values were loaded into holds other tensors, versions or values: each passes. The record stays (a
    call inside ``fzero.apply`` or ``functional_call`` sees the tensors swapped in, not the module's own). Under
    ``torch.compile``'s tracing it does nothing: a lock in the traced hook would break ``fullgraph=True``."""
    if torch.compiler.is_compiling():
        return
    still_meta = _still_meta(module)
    if still_meta:
        kind = type(module).__name__
        shown = _few_names(still_meta)
        raise RuntimeError(
            f"fzero: {kind} was called directly after a fzero.Step trained it, but its parameters {shown} are meta "
            f"tensors, shapes without values: step.init(..., donate=True) gave their memory to the state (or the model "
            f"was built under fzero.empty_params()), and a step trains its state, not the module. Put the trained "
            f"values in it first, model.load_state_dict(step.state_dict(state, model), assign=True) (assign=True: "
            f"torch's load into a meta tensor is a no-op), then call it as before; or run it with them, "
            f"fzero.apply(model, step.state_dict(state, model), x).{_LIGHTNING}"
        )
    if not _still_untrained(module):
        return
    kind = type(module).__name__
    raise RuntimeError(
        f"fzero: {kind} was called directly after a fzero.Step trained it, but a step trains its state, not the module: "
        f"its parameters still hold their values from step.init, so this forward would run the untrained model (an "
        f"evaluation, generate(), a sample in the loop). Put the trained values in it first, "
        f"{_LOAD_FIX}, then call it as before; or run it with them, "
        f"fzero.apply(model, step.state_dict(state, model), x). To run the values from step.init on purpose: "
        f"fzero.apply(model, fzero.params_of(model), x).{_LIGHTNING}"
    )


# Loaders that read ``module.state_dict()`` (keep_vars=False) for its names and shapes, then load into the module: a
# load (the trained values from a file, a second adapter), never a save, so a trained module's state_dict() there passes.
# (module, function) as the frame names them; the load itself writes the params, which lifts the refusal.
_LOADERS = frozenset({
    ("safetensors.torch", "load_model"),  # also accelerate's load_state / load_checkpoint_in_model of .safetensors
    ("accelerate.utils.modeling", "load_checkpoint_in_model"),
    ("peft.utils.save_and_load", "set_peft_model_state_dict"),  # PeftModel.load_adapter, from_pretrained, transformers' load_adapter
    ("peft.utils.save_and_load", "set_base_model_state_dict"),
})


def _loading() -> bool:
    """Whether a loader of ``_LOADERS`` is on the stack (read only where the refusal would otherwise be raised)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in _LOADERS:
            return True
        frame = frame.f_back
    return False


def _refuse_untrained_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """A state_dict pre-hook: refuse ``module.state_dict()`` (and a parent's, which reads it under ``prefix``) of a
    module a step has trained while its trainable parameters still hold their ``step.init`` values, as the forward
    pre-hook above refuses a call: what reads it to save or copy the weights (``torch.save(model.state_dict())``,
    ``save_pretrained``, Accelerate's ``save_model``, peft's adapter file, an EMA's ``load_state_dict(model.state_dict())``)
    would take the untrained model, silently. ``keep_vars=True`` (the tensors themselves, by reference: how fzero's own
    ``step.state_dict``, checkpoints and exports read a module's names) passes."""
    if keep_vars or torch.compiler.is_compiling() or not _still_untrained(module) or _loading():
        return
    kind = type(module).__name__
    where = f" (read as {prefix.rstrip('.')!r} of a module holding it)" if prefix else ""
    raise RuntimeError(
        f"fzero: {kind}.state_dict() was called{where} after a fzero.Step trained it, but a step trains its state, "
        f"not the module: its parameters still hold their values from step.init, so this would save or copy the "
        f"untrained model (torch.save(model.state_dict()), save_pretrained, an EMA's copy). Put the trained values in "
        f"it first, {_LOAD_FIX}, then save it as before; or take them from the state: step.state_dict(state, model) "
        f"(the same names), fzero.checkpoint.save_weights(step, state, out_dir, model=model) for safetensors files."
        f"{_LIGHTNING}"
    )


def check_buffers_current(module: nn.Module, params: Mapping[str, Any]) -> None:
    """``fzero.apply`` outside a step reads ``module``'s own persistent buffers for those ``params`` does not give. Where
    a step has trained this module and its state's buffers hold other values than the module's (BatchNorm statistics
    the forward moved), that would run the model on its buffers from before training, silently: refused, naming them."""
    with _trained_lock:
        held = _trained.get(module)
    if not held:
        return
    own = persistent_buffers(module)
    stale = []
    for name, ref in held.items():
        value, b = ref(), own.get(name)
        if value is None or b is None or name in params or b.is_meta:
            continue
        if value.shape != b.shape or not torch.equal(value.detach().to(b.device, b.dtype), b.detach()):
            stale.append(name)
    if stale:
        shown = _few_names(stale)
        raise ValueError(
            f"fzero.apply: outside a step {type(module).__name__} runs with its own buffers, and {shown} hold other "
            f"values than the train state's: a step carries persistent buffers in the state (state.buffers, e.g. the "
            f"BatchNorm statistics its forwards moved) and never writes them into the module, so step.gather(state) "
            f"(the params alone) would run on the module's buffers from before training. Pass the state's buffers with "
            f"the params: fzero.apply(model, step.state_dict(state, model), x) (params and buffers), or "
            f"{{**step.state_dict(state, model), **ema}} for an EMA's params; or load them into the module first, "
            f"model.load_state_dict(step.state_dict(state, model)). To run on the module's own buffers on purpose, "
            f"pass them: {{**params, **fzero.buffers_of(model)}}."
        )


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: buffer}`` of the buffers ``module.state_dict()`` holds (the module's own tensors)."""
    return dict(named_tensors(module, "_buffers", remove_duplicate=False, persistent_only=True))  # one walk, per step


# What a state's lineage last read of a module's persistent buffer (``fzero.step._state.Reader``): its version counter,
# by the tensor's identity, with its memory. A write to the buffer after that (in place, as ``fill_``, ``copy_`` or
# ``reset_running_stats`` do) is one the state would not see (``Buffers``). The identity, because a copy of the tensor
# (``deepcopy``, a pickled module) starts its version counter again: there a count is no evidence of a write.


def _mark(reader: Any, b: torch.Tensor, module: nn.Module, name: str) -> None:
    if reader is not None:
        reader.seen[id(b)] = (b._version, b.untyped_storage().data_ptr())
        reader.names[(id(module), name)] = b


def _written_since_read(reader: Any, b: torch.Tensor, module: nn.Module, name: str) -> bool:
    """Whether ``module``'s buffer ``name`` (now ``b``) was written since this state lineage last read it: ``b``
    written in place, or another tensor of other values put under the name on the same module (a buffer registered
    again). Another tensor of the same values is a copy, not a write (``model.to(device)``, ``model.double().float()``
    replace every buffer so). Another module (a copy of the model run with this state) has no record: it is read."""
    if reader is None:
        return False
    last = reader.names.get((id(module), name))
    if last is not None and last is not b:
        return last.shape != b.shape or not torch.equal(b.detach().to(last.device, last.dtype), last)
    mark = reader.seen.get(id(b))
    return mark is not None and mark[1] == b.untyped_storage().data_ptr() and mark[0] != b._version


class Buffers:
    """One rank's buffers during one step: ``values`` maps buffer names (relative to the module given to
    ``fzero.apply``) to the tensors the forward reads and writes.

    ``lift(t)`` makes a tensor the forward may write (a copy; under ``torch.func`` one of the transform's
    level). ``dtype``: the compute dtype of a bf16/fp16 policy, which floating buffers meet the params in;
    ``result()`` gives them back in their own dtype, and a buffer the forward left as it got it (a constant: a
    float64 table, a scale) as it was before the cast, not rounded through ``dtype``.
    """

    def __init__(self, values: dict[str, torch.Tensor], *, lift: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype | None = None, reader: Any = None) -> None:
        self._lift, self._dtype = lift, dtype
        self._reader = reader  # the state's ``Reader``: what it last read of the module's buffers (None: no record)
        self._given = values  # the state's values as the step got them (to tell an edit of the module's from a copy)
        self.dtypes = {k: v.dtype for k, v in values.items()}
        self._before: dict[str, torch.Tensor] = {}  # name -> the value before its cast to ``dtype``
        self.values = {k: self._live(v, k) for k, v in values.items()}
        self._users: dict[str, nn.Module] = {}  # buffer name -> the module this forward handed it to first
        self._noted: set[str] = set()  # names whose module is noted in the context's ``trained``

    def _live(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if self._dtype is None or not t.is_floating_point() or t.dtype == self._dtype:
            return self._lift(t)
        self._before[name] = t
        return self._lift(t.to(self._dtype))

    def for_module(self, module: nn.Module, *, given: Any = ()) -> dict[str, torch.Tensor]:
        """The bank's tensors for ``module``'s persistent buffers, adopting (copying) those it lacks. ``given``: names
        the caller passes values for itself (``fzero.apply(teacher, {**params, **buffers}, x)``), left out of the bank.

        The bank holds one model's buffers by name, so a second module whose buffer has a name the bank has handed
        to another module in this forward (a teacher, or a GAN's discriminator inside the generator's loss, built
        from the same code as the model) is refused: it would read and write the model's values (a BatchNorm
        running on the student's statistics, and writing its own into them), silently."""
        out = {}
        first_name: dict[int, str] = {}  # id(buffer) -> its first name: a buffer registered under several (tied)
        for name, b in persistent_buffers(module).items():
            if name in given:
                continue
            first = self._users.setdefault(name, module)
            if first is module and name not in self._noted:
                self._noted.add(name)
                trained = current_context().trained  # a train step's: it now carries this module's buffers
                if trained is not None:
                    trained.handed(module)
            if first is not module:
                raise ValueError(_shared_buffer_message(module, first, name))
            if name not in self.values:
                if b.is_meta:
                    raise ValueError(
                        f"fzero.apply: the buffer {name!r} of {type(module).__name__} is a meta tensor and the state holds "
                        f"no value for it. Pass its initial value to init: step.init(params, buffers={{{name!r}: ...}}), "
                        f"or fzero.buffers_of(model) of a materialized model."
                    )
                self.dtypes[name] = b.dtype
                self.values[name] = self._live(b.detach(), name)
                _mark(self._reader, b, module, name)
            elif not b.is_meta and _written_since_read(self._reader, b, module, name):
                self._check_unchanged(module, name, b)
            elif not b.is_meta:
                _mark(self._reader, b, module, name)
            tied = first_name.setdefault(id(b), name)
            if tied != name:
                self._tie(name, tied, module)
            out[name] = self.values[name]
        return buffers_for_run(out)  # under fzero.remat's recompute: copies of what the forward read

    def _tie(self, name: str, first: str, module: nn.Module) -> None:
        """``name`` is the module's buffer ``first`` under another name (peft's VeRA and RandLoRA share their random
        projections so across layers): one tensor, as in the module, so that the forward reads and writes one value
        under both names (``functional_call`` refuses two values for tied names). The state holds each name (as
        ``state_dict`` does), and the two must agree: a value set under one name alone would be lost silently."""
        if self.values[name] is self.values[first]:
            return
        a, b = self._given.get(name), self._given.get(first)
        if a is not None and b is not None and a is not b and not (a.shape == b.shape and torch.equal(a, b.to(a.device))):
            raise ValueError(
                f"fzero.apply: the buffers {first!r} and {name!r} of {type(module).__name__} are one tensor in the module "
                f"(tied), but the state holds different values for them, and a forward can read only one (a state "
                f"saved by an fzero that kept a copy per name holds such values). Set both names to the value to keep: "
                f"state = step.with_buffers(state, {{{first!r}: value, {name!r}: value}})."
            )
        self.values[name] = self.values[first]
        if first in self._before:
            self._before[name] = self._before[first]

    def _check_unchanged(self, module: nn.Module, name: str, b: torch.Tensor) -> None:
        """The module's buffer ``name`` was written since a step last read it. Unless it now holds the state's value
        (``model.load_state_dict(step.state_dict(state, model))`` writes that), the write would be ignored: the
        state carries the buffer, and the module's is not read again."""
        given = self._given.get(name)
        if given is not None and given.shape == b.shape and torch.equal(b.detach().to(given.device, given.dtype), given):
            _mark(self._reader, b, module, name)
            return
        raise ValueError(
            f"fzero.apply: the buffer {name!r} of {type(module).__name__} was changed on the module after the state "
            f"took it over, and would be ignored: the state carries persistent buffers (state.buffers, what the "
            f"forward writes, e.g. BatchNorm's statistics), and the module's are not read again. Set the new value in "
            f"the state instead: state = step.with_buffers(state, {{{name!r}: value}}); or undo the change on the module."
        )

    def adopt_replaced(self, module: nn.Module, bound: Mapping[str, torch.Tensor], owned: Mapping[str, torch.Tensor], *,
                       prefix: str = "") -> None:
        """Take over what the forward put in a buffer's slot in place of the tensor it was handed (``self.n = self.n +
        1``, where torch's module keeps the new tensor as the buffer): the state's value for that name (and the names
        tied to it) from here on. It was lost: the next step started from the old value, silently. ``module`` runs
        with ``bound`` (names relative to it); ``owned``: the bank's buffers handed to this call, by name in the
        step's module (``prefix`` + a name in ``module``)."""
        for name, handed in bound.items():
            full = prefix + name
            if full not in owned:
                continue
            path, _, key = name.rpartition(".")
            try:
                holder = module.get_submodule(path) if path else module
            except AttributeError:
                continue
            now = holder.__dict__.get("_buffers", {}).get(key)
            if now is None or now is handed or not isinstance(now, torch.Tensor):
                continue
            old = self.values.get(full)
            for k, v in list(self.values.items()):
                if v is old:
                    self.values[k] = now
                    self._before.pop(k, None)

    def result(self) -> dict[str, torch.Tensor]:
        """The values after the forward, each in its own dtype: a cast buffer the forward did not change keeps its
        value from before the cast (a copy), which the round trip through the compute dtype would round (pi in a
        float64 buffer became 3.140625 in the state and in ``step.state_dict`` after one bf16 step)."""
        return per_tensor(self.values, lambda k, v: _unless_unchanged(v, self._before.get(k), self.dtypes[k]))


def _unless_unchanged(value: torch.Tensor, before: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``value`` (the forward's, in the compute dtype) in ``dtype``; but each element the forward left as the cast
    of ``before`` (the buffer before its cast) keeps its value from before, which the round trip would round.

    Element by element and on the device, with no wait for it: BatchNorm's in-place update of its statistics does not
    bump the tensor's version counter, so whether a buffer was written can only be read off its values, and a
    ``torch.equal`` per buffer would make the host wait for the device at every buffer of every step. An element
    the forward wrote to exactly the cast of its old value keeps the old value, less than a rounding away."""
    back = value.to(dtype)
    if before is None or before.shape != value.shape:
        return back
    with torch.no_grad():
        before = before.to(value.device)
        return torch.where(value == before.to(value.dtype), before, back)


def lift_for(autodiff: str, anchor: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """How a step makes a bank tensor: under ``torch.func``, a copy at the level of ``anchor`` (a detached input
    of the transformed function); otherwise a plain copy."""
    if autodiff == "func" and anchor is not None:
        return lambda t: anchor.new_empty(t.shape, dtype=t.dtype).copy_(t)
    return lambda t: t.detach().clone()


def broadcast_buffers(comm, buffers: dict[str, torch.Tensor], *, copy: bool = False) -> dict[str, torch.Tensor]:
    """Rank 0's buffers on every rank, as DDP starts each forward (its default ``broadcast_buffers=True``).

    In place into the state's own tensors (a step owns the state it is given), or into copies with ``copy``.
    One collective per buffer, in name order, so every rank issues the same ones.
    """
    out = per_tensor(buffers, lambda k, v: v.clone()) if copy else dict(buffers)
    if comm.size > 1:
        for name in sorted(out):
            comm.broadcast(out[name], src=0, tag="buffers", label=name)
    return out


# -- modules a step cannot run as a torchrun job of DDP runs them ----------------------------------------------------

COMPILE_FIX = ("Pass the module it wraps (model._orig_mod, or the model before torch.compile) to fzero.params_of and "
               "fzero.apply; to compile, give fzero.compile(..., jit=True) at stages 2-3, which compiles each unit's forward.")


def check_not_compiled(module: nn.Module, *, api: str) -> None:
    """Refuse a ``torch.compile`` wrapper given as the model. Its parameters are named ``_orig_mod.*`` and its
    ``forward`` is the compiled call of the module it wraps, bound to that module: the step's copy of the model
    (``fzero.step._context``) would run the original with its own tensors, not the step's params (measured: every
    stage refused the loss as depending on the module's own parameters, which named no cause)."""
    if compiled_wrapper(module):
        raise TypeError(
            f"{api}: the module is a torch.compile wrapper (OptimizedModule of "
            f"{type(getattr(module, '_orig_mod', None)).__name__}): its parameters are named '_orig_mod.*' and its "
            f"compiled forward runs the wrapped module with that module's own tensors, so a step's params would not "
            f"reach it. {COMPILE_FIX}"
        )
    if compiled_in_place(module):
        raise compiled_in_place_error(api, "", module)
    own = module.__dict__.get("forward")
    if own is not None and calls_itself(own, module) and trains_under(module):
        raise own_forward_error(api, "", module)


def check_no_sync_batchnorm(module: nn.Module, *, api: str) -> None:
    """Refuse a ``SyncBatchNorm`` in training mode on a rank thread of a ``local_mesh`` of several ranks.

    Under torchrun it all-reduces the batch statistics over the process group in its forward, so every rank
    normalizes with the global batch's mean and variance. The ranks of a local mesh are threads of one process with
    no process group between them, and torch's ``SyncBatchNorm`` then falls back to ``BatchNorm`` on this rank's
    share alone: params and running statistics would differ from the torchrun job's (measured on a Conv-BN net,
    local_mesh(2), 4 AdamW steps at lr 1e-2: params 0.07 off the global-batch statistics), silently. In eval mode
    it reads its running statistics and syncs nothing, so it runs as under torchrun."""
    for path, m in module.named_modules():
        if isinstance(m, nn.SyncBatchNorm) and m.training:
            raise ValueError(
                f"{api}: the SyncBatchNorm {path or '<root>'!r} of {type(module).__name__} is in training mode on a rank "
                f"of a local_mesh of several ranks. Those ranks are threads of one process with no process group "
                f"between them, so it would normalize with this rank's share of the batch only, where under torchrun "
                f"it all-reduces the statistics of every rank's share: params and running statistics would differ "
                f"from the torchrun job's. Run it under torchrun with fzero.dist_mesh() (torch's SyncBatchNorm needs "
                f"CUDA tensors there), on local_mesh(1) or without a mesh (one rank: it is BatchNorm there), or "
                f"simulate the ranks with BatchNorm layers in its place (per-rank statistics, as DDP without "
                f"SyncBatchNorm). In eval mode (model.eval()) it syncs nothing and runs."
            )


class FrozenWrites:
    """One step call's record of the frozen params (``requires_grad=False``) that the rank threads of a ``local_mesh``
    of several ranks read from the user's modules, to refuse a forward that writes one.

    A step reads frozen params from the module at every step, and every rank's copy of the module shares them (copying
    them would cost a frozen base's whole size per rank per step). Under torchrun each process writes its own module,
    once a step; the threads of a local mesh all write the one tensor, so a write in the forward lands once per rank:
    MoCo's momentum update of its key encoder inside ``forward`` (``pk.data = pk.data * m + pq.data * (1 - m)``, or
    ``pk.mul_(m).add_(pq, alpha=1 - m)``) moved it twice a step on ``local_mesh(2)`` (measured: 1.4e-4 in the query
    encoder's params after 3 AdamW steps at stages 0-2, against DDP's once), silently.

    ``note`` records each frozen param's version counter and storage before the forward that reads it (the first
    record of a param is kept: every rank notes before its own forward runs, so the first precedes every write);
    ``check``, once every rank has returned, refuses the step call if one was written in place or given new data."""

    __slots__ = ("seen", "lock")

    def __init__(self) -> None:
        self.seen: dict[int, tuple[str, type, torch.Tensor, int, int]] = {}  # id(param) -> (name, module class, it, version, data_ptr)
        self.lock = threading.Lock()

    def note(self, module: nn.Module) -> None:
        with self.lock:
            for name, p in module.named_parameters():
                if not p.requires_grad and id(p) not in self.seen and not p.is_meta:
                    self.seen[id(p)] = (name, type(module), p, p._version, p.data_ptr())

    def check(self, ranks: int, *, api: str) -> None:
        written = [(name, cls) for name, cls, p, version, ptr in self.seen.values()
                   if p._version != version or p.data_ptr() != ptr]
        if not written:
            return
        names = [name for name, _ in written]
        raise ValueError(
            f"{api}: the forward wrote the frozen param(s) {names[:4]}{' ...' if len(names) > 4 else ''} of "
            f"{written[0][1].__name__} (requires_grad=False, read from the module at every step), on a local_mesh of "
            f"{ranks} ranks. Its ranks are threads of one process and share the module's frozen tensors, so each rank's "
            f"write landed on the one tensor: it now holds {ranks} writes from this step where each torchrun process "
            f"would hold one of its own (MoCo's momentum update of a key encoder in forward moves it {ranks} times a step "
            f"here). Update it in the loop between steps instead, from the trained values (full = step.gather(state); "
            f"under torch.no_grad(): pk.mul_(m).add_(full['enc_q.' + name], alpha=1 - m) for each frozen key param), or "
            f"keep it in a persistent buffer (register_buffer), which the train state carries per rank as DDP's "
            f"broadcast_buffers does; or run on local_mesh(1), without a mesh, or under torchrun with fzero.dist_mesh()."
        )


def check_no_parametrize_cache(module: nn.Module, *, api: str) -> None:
    """Refuse ``torch.nn.utils.parametrize.cached()`` around a parametrized model on a rank thread of a ``local_mesh`` of
    several ranks. torch keeps the cache in one dict of the process, keyed by the ``id`` of the module the
    parametrization was registered on, which every rank's copy of that module shares: each rank read the weight
    another rank computed from its own params (and the gradient went to that rank's graph), silently (weight_norm,
    orthogonal, spectral_norm: 10-200% off PyTorch after 4 AdamW steps at stages 0-3). Under torchrun each process
    has its own cache."""
    from torch.nn.utils import parametrize

    if not parametrize._cache_enabled:
        return
    for path, m in module.named_modules():
        if parametrize.is_parametrized(m):
            raise ValueError(
                f"{api}: torch.nn.utils.parametrize.cached() is on while {type(module).__name__} runs on a rank of a "
                f"local_mesh of several ranks, and {path or '<root>'!r} is parametrized. torch's cache is one dict of "
                f"the process, keyed by the module the parametrization was registered on, so the ranks (threads of one "
                f"process) would read each other's cached weights. Leave cached() out here (it only saves computing "
                f"the parametrization again; the results are the same), or run on local_mesh(1), without a mesh, or "
                f"under torchrun with fzero.dist_mesh(), where each process has its own cache."
            )
