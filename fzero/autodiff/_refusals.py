"""What ``fzero.remat``'s forward refuses, and how it says so.

``remat`` runs a function without a graph and recomputes it in backward (``fzero.autodiff._remat``). That is exact
only if the function's gradient flows through its arguments and outputs alone, and the recompute computes what the
forward computed. The forward watches for the ways a function breaks that, each refused before any update, with its
cause and fix: a tensor it reads that requires grad but is not an argument (``_CAPTURED``), a tensor it makes from
its arguments that outlives it other than through its outputs (``_ESCAPED``), an argument that is not a tensor and
that it changes (``_CHANGED_ARGUMENT``), a tensor argument it writes in place (``_WRITTEN_INPUT``), and, under
``torch.func``, a unit with forward hooks (``_HOOKED_UNDER_FUNC``).
"""

from __future__ import annotations

import gc
import time
import types
import weakref
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.overrides import TorchFunctionMode

_CAPTURED = """fzero.remat: {name} read a tensor that requires grad but is not one of its arguments ({what}, in {op}).
remat differentiates only with respect to the arguments of the function it wraps: the gradient of a tensor
the function closes over (a closure cell, a global, a module's own parameter) would be lost, and under
torch.func.grad it would silently be zero. Pass every differentiable tensor as an argument:

    wrong:  fzero.remat(lambda x: fzero.apply(block, params, x))(x)
    right:  fzero.remat(lambda params, x: fzero.apply(block, params, x))(params, x)
    right:  fzero.remat(lambda p, x: torch.func.functional_call(block, p, (x,)))(dict(block.named_parameters()), x)

(or detach the tensor inside the function if its gradient is really not wanted)."""

_ESCAPED = """fzero.remat: {name} made {n} tensor(s) from its differentiable arguments that outlive its forward other than
through what it returns ({what}): a forward hook that stores a module's output (Hugging Face's output_router_logits,
output_hidden_states, output_attentions), or an attribute the forward sets (self.aux = h). remat runs the forward
without a graph and recomputes it in backward, so a loss that uses such a tensor would get no gradient through it:
silently wrong training, so the step stops here. Fix: return the tensor from the unit instead; or train without
remat (compile(..., remat=False)) and, to save activations, use the model's own non-reentrant checkpointing, which
keeps such a tensor's graph (torch.utils.checkpoint(..., use_reentrant=False); Hugging Face:
model.gradient_checkpointing_enable()); or turn the capture off (output_router_logits=False and the like); or
detach it where it is stored if its gradient is not wanted."""

class _NoCapturedGrad(TorchFunctionMode):
    """Raises when ``fn`` makes a tensor out of a tensor that requires grad but is not an argument.

    Under ``no_grad`` what ``fn`` computes has ``requires_grad=False``, except views: a view of a tensor that
    requires grad reads ``True`` (a spectral norm's ``weight.H``, a ``flatten``). So a tensor that requires grad is
    an argument (plain autograd passes the caller's tensors through), a view ``fn`` made of one (noted as it is
    made: ``_base`` would name the buffer an argument is itself a view of), or captured; under ``torch.func`` the
    arguments arrive unwrapped (``requires_grad=False``) and a captured transformed tensor still reads ``True``.
    Reads of metadata (shape, dtype, ...) return no tensor and pass.
    """

    _EXEMPT = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__})

    def __init__(self, call: Any, inputs, differentiable=None) -> None:
        super().__init__()
        self.call = call
        self.ok = {id(x) for x in inputs}
        self.derived: list[torch.Tensor] = []  # views of arguments, held so that their ids stay theirs
        # What fn computes from its differentiable arguments (by id, each with a weak reference that tells a live
        # tensor from a later one at the same address): with grad, each would carry a gradient. One of them still
        # alive when fn has returned, other than what it returned, left fn another way (see ``escaped``).
        diff = differentiable if differentiable is not None else [True] * len(inputs)
        self.tainted: dict[int, weakref.ref] = {id(x): weakref.ref(x) for x, d in zip(inputs, diff) if d}
        self.inputs = {id(x) for x in inputs}

    def _is_tainted(self, t: torch.Tensor) -> bool:
        ref = self.tainted.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in self._EXEMPT and _has_tensor(out):
            tainted = False
            written = set()  # the op's own tensor arguments: an output that is one of them was written in place
            for t in _tensor_args(args, kwargs):
                if t.requires_grad and id(t) not in self.ok:
                    what = f"shape {tuple(t.shape)}, {t.dtype}"
                    raise RuntimeError(_CAPTURED.format(name=self.call.name, what=what, op=torch.overrides.resolve_name(func) or func))
                tainted = tainted or self._is_tainted(t)
                written.add(id(t))
            for o in (out,) if isinstance(out, torch.Tensor) else out:
                if not isinstance(o, torch.Tensor):
                    continue
                if o.requires_grad and id(o) not in self.ok:  # a view of an argument
                    self.ok.add(id(o))
                    self.derived.append(o)
                # an in-place op (or out=) returns a tensor it was given, such as a buffer written under no_grad (a
                # spectral norm's power iteration): not a new value of fn's
                if tainted and id(o) not in written and id(o) not in self.inputs:
                    self.tainted[id(o)] = weakref.ref(o)
        return out

    def escaped(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """What fn computed from its differentiable arguments and is still alive now that it has returned, other
        than its outputs and what shares their memory (a view returned keeps its base), and the views of its
        arguments this mode holds: a tensor that left through a forward hook's capture or an attribute
        (``self.side = h``). Under remat it was made without a graph, so a loss that uses it gets no gradient
        through it, silently."""
        kept = {id(t) for t in (*outs, *self.derived)}
        memory = {_storage(o) for o in outs}
        out = []
        for ref in self.tainted.values():
            t = ref()
            if t is not None and id(t) not in kept and id(t) not in self.inputs and _storage(t) not in memory:
                out.append(t)
        return out


# Waits (seconds) before an escape found is believed: a frame another thread read for a moment (a sampling profiler's
# sys._current_frames) keeps what the forward's finished calls held until that thread lets go of it
_SETTLE = (0.001, 0.004, 0.016)


def _escaped(watch: "_NoCapturedGrad", outs: list[torch.Tensor], cache_made: set[int]) -> list[torch.Tensor]:
    """``watch.escaped(outs)`` less the parametrize cache's own tensors (``cache_made``) and what only frames hold.

    A tensor held by nothing but frame objects left no way for a loss to read it: a finished call's frame keeps its
    locals while something holds the frame (a traceback stored on an exception; a sampling profiler thread reading the
    main thread's stack, as Sentry's and other continuous profilers do). That was refused as an escape, at random,
    with a cause that was not the user's. What such a thread holds through a container (a call's argument tuple) is
    gone once it lets go: so an escape is looked for again after short waits before it is refused. The waits are
    paid only where something was found; a step that keeps nothing pays nothing.
    """
    found = _escaped_now(watch, outs, cache_made)
    for wait in _SETTLE:
        if not found:
            return found
        del found[:]  # not kept alive by this list while the other thread lets go
        time.sleep(wait)
        found = _escaped_now(watch, outs, cache_made)
    return found


def _escaped_now(watch: "_NoCapturedGrad", outs: list[torch.Tensor], cache_made: set[int]) -> list[torch.Tensor]:
    seen = watch.escaped(outs)
    found: list[torch.Tensor] = []
    for t in seen:
        if id(t) in cache_made:
            continue
        holders = [r for r in gc.get_referrers(t) if r is not seen and r is not found]
        if holders and all(isinstance(r, types.FrameType) for r in holders):
            continue  # only frames hold it: no loss can read it
        found.append(t)
    del seen[:]
    return found


def _held_where(t: torch.Tensor) -> str:
    """Where an escaped tensor is held, when a module attribute holds it (for the error only): " held as
    ClassName.attr" (a Hugging Face recurrent state kept on the module, RecurrentGemma's rg_lru.recurrent_states)."""
    import gc

    for holder in gc.get_referrers(t):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, torch.nn.Module) and getattr(owner, "__dict__", None) is holder:
                name = next((k for k, v in holder.items() if v is t), "?")
                return f" held as {type(owner).__name__}.{name}"
    return ""


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (functorch wrappers): only itself
        return -id(t)


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):  # torch.cat, torch.stack, ...
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _has_tensor(out) -> bool:
    return isinstance(out, torch.Tensor) or (isinstance(out, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in out))


# -- arguments the forward changes ---------------------------------------------------------------------------
# The recompute calls fn with the same Python objects its forward got. Tensors are saved and checked by autograd
# (an in-place change after the forward is refused when backward unpacks them; one during it, by
# _check_inputs_unwritten) and the step's buffers are snapshotted (above); any
# other object that fn changes (a Hugging Face Cache appended to by every attention layer) would be changed a
# second time by the recompute, and backward would differentiate another computation than the forward ran.
# The objects among fn's arguments are described before and after the forward, a few levels into their
# attributes and containers (tensor identity, shape and version; container lengths); a difference raises.

_CHANGED_ARGUMENT = """fzero.remat: {name} changed an argument that is not a tensor during its forward: {detail}.
The recompute in backward runs {name} again with the same object, which would change it a second time (a key/value
cache appended to twice makes backward differentiate attention over twice the keys: silently wrong gradients), so
the step stops here, before any update. Fix: {fix}"""
_FIX_CACHE = ("turn the model's cache off for training, as Hugging Face's own gradient checkpointing does: "
              "pass use_cache=False to the model's forward, or build the model from a config with use_cache=False "
              "(setting model.config.use_cache afterwards is not enough for an encoder-decoder such as T5, whose decoder "
              "keeps a copy of the config).")
_FIX_OTHER = "pass a fresh object on each call or one that the function does not change, or do not remat this function."
_DEPTH = 4


def _describe(x: Any, depth: int, seen: set[int]) -> Any:
    """A comparable description of what ``x`` holds (tensors by identity, shape and version counter)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", id(x), tuple(x.shape), x._version)
    if x is None or isinstance(x, (bool, int, float, str, bytes, torch.dtype, torch.device)) or depth == 0 or id(x) in seen:
        return ("leaf", x if isinstance(x, (bool, int, float, str, bytes)) or x is None else id(x))
    if isinstance(x, torch.nn.Module) or callable(x) and not hasattr(x, "__dict__"):
        return ("object", id(x))
    seen = seen | {id(x)}
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_describe(v, depth - 1, seen) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((repr(k), _describe(v, depth - 1, seen)) for k, v in x.items()))
    attrs = getattr(x, "__dict__", None)
    if attrs is None:
        return ("leaf", id(x))
    return ("object", id(x), tuple((k, _describe(v, depth - 1, seen)) for k, v in attrs.items()))


def _where(path: Any) -> str:
    """``args[1]``/``kwargs['past_key_values']`` from a pytree key path into ``(args, kwargs)``."""
    text = torch_pytree.keystr(path)  # "[0][1]" or "[1]['past_key_values']"
    return ("args" if text.startswith("[0]") else "kwargs") + text[3:]


def _holds_state(x: Any) -> bool:
    return hasattr(x, "__dict__") and not isinstance(x, (torch.Tensor, torch.nn.Module, type)) and not callable(x)


def _check_unchanged(call: Any, before: list[tuple[str, Any, Any]]) -> None:
    for where, x, description in before:
        if _describe(x, _DEPTH, set()) != description:
            kind = type(x).__name__
            cache = "cache" in kind.lower() or any("Cache" in c.__name__ for c in type(x).__mro__)
            detail = (f"a {type(x).__module__}.{kind} passed as {where}" +
                      (" (a key/value cache: the model runs with use_cache=True)" if cache else ""))
            raise RuntimeError(_CHANGED_ARGUMENT.format(name=call.name, detail=detail,
                                                        fix=_FIX_CACHE if cache else _FIX_OTHER))


_WRITTEN_INPUT = """fzero.remat: {name} wrote its tensor argument {where} ({shape} {dtype}) in place during its forward
(x.add_(...), x += ..., x[...] = ...). remat saves its arguments and recomputes the forward from them in backward, so the
recompute would start from the written values, not from what the forward was given, and differentiate another computation
(the write applied twice: silently wrong gradients; or torch's raw "a leaf Variable that requires grad is being used in
an in-place operation" in backward), so the step stops here, before any update. Fix: write out of place (x = x + s), or
clone the argument before writing it (x = x.clone()), or do not remat this function (compile(..., remat=False))."""


def _check_inputs_unwritten(call: Any, inputs: tuple, versions: list[int]) -> None:
    """Refuse a forward that wrote one of its tensor arguments in place (its version counter moved): autograd checks
    the saved inputs only from the moment they are saved, after the forward, so the recompute would read the written
    values unnoticed."""
    for i, (x, v) in enumerate(zip(inputs, versions)):
        if x._version != v:
            tree = torch_pytree.tree_unflatten(call.leaves, call.spec)
            paths = [path for path, _ in torch_pytree.tree_flatten_with_path(tree)[0]]
            raise RuntimeError(_WRITTEN_INPUT.format(name=call.name, where=_where(paths[call.tensor_pos[i]]),
                                                     shape=tuple(x.shape), dtype=x.dtype))


_HOOKED_UNDER_FUNC = """fzero (remat=True, autodiff='func'): unit {name!r} ({kind}) has forward hooks ({hooks}). Under remat a unit's
forward runs inside remat's Function, so a forward hook there sees the unit's output as computed without a graph;
under plain autograd that is the very tensor the step differentiates, but under torch.func the Function's output is
a new tensor, and what the hook keeps (an auxiliary loss on a unit's output, a captured hidden state) carries no
gradient: the loss's gradient through it would be dropped silently (measured: 6e-4 off PyTorch in one SGD step).
Fix: use the default autodiff ('autograd'), or compile(..., remat=False), or register the hook on a module outside the
unit (on a layer inside it, remat refuses what the hook keeps by name)."""


def check_unit_hooks(module: torch.nn.Module, name: str) -> None:
    """Refuse forward hooks on a unit run through remat under ``torch.func`` (see ``_HOOKED_UNDER_FUNC``). Under plain
    autograd, or with pre-hooks only, nothing to refuse."""
    if torch._C._functorch.peek_interpreter_stack() is None:  # plain autograd: the hook keeps the differentiated tensor
        return
    from torch.nn.modules import module as _module

    hooks = [h for h in (*module._forward_hooks.values(), *_module._global_forward_hooks.values()) if not _keeps_nothing(h)]
    if hooks:
        what = ", ".join(getattr(h, "__qualname__", type(h).__name__) for h in hooks[:3])
        raise RuntimeError(_HOOKED_UNDER_FUNC.format(name=name, kind=type(module).__name__, hooks=what))


def _keeps_nothing(hook: Any) -> bool:
    """A hook of torch's ``ModuleTracker`` (``torch.utils.flop_counter.FlopCounterMode`` puts one on every module): it
    notes which module runs and keeps no tensor that a loss could use."""
    from torch.utils.module_tracker import ModuleTracker

    return isinstance(getattr(hook, "__self__", None), ModuleTracker)
