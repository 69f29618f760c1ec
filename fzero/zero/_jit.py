"""``jit=True``: each unit's compute compiled with ``torch.compile`` (regional compilation, as torchtitan compiles
each transformer block), at stages 2-3 where units are modules.

Only the unit's own forward is compiled: fzero's gathers, frees, refills and reductions stay outside it, in the
custom Functions around the unit, so a compiled unit is sharded, prefetched and reduced exactly as an eager one.
The unit's params reach the compiled forward as the module's attributes (rebound to the gathered views for the
call); torch.compile lifts them as graph inputs, so one compiled graph serves every block of the same code
(measured: the first block compiles in about 30 s on this 2-core CPU through inductor's C++ backend, the next
blocks reuse it). A block whose inner modules carry other hooks gets graphs of its own (``_inner_hooks``).

Dropout draws from torch's generator as in eager (inductor's ``fallback_random``), so a jit step equals an eager one
within rounding and every rank draws its own stream. ``step.evaluate`` runs compiled units at stage 3 and the whole
model eagerly at stage 2 (whose evaluation has no units). Refused by name where torch.compile would run a unit
eagerly without a word: under ``torch.func``, a dispatch mode, ``fzero.remat``'s watch, an RNN in the unit, a
Hugging Face cache handed to each layer (``use_cache=True``), a ``forward`` set on a unit's module itself, and a class's
units past torch.compile's recompile limit (more param shapes and modes than it keeps graphs for).
"""

from __future__ import annotations

import re
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn


class UnitCompileError(RuntimeError):
    """torch.compile failed on a unit: names the unit and keeps the compiler's error as the cause."""


def compiled(inner: nn.Module, unit: str, cache: dict[Any, Callable]) -> Callable[..., Any]:
    """What to call for a unit's forward under ``jit``: ``inner`` itself, its hooks eager, with its class's forward
    compiled (``cache``: the step's, one compiled forward per class, and per set of hooks inside the unit
    (``_inner_hooks``), for the step's life). A compiler failure becomes
    ``UnitCompileError`` naming ``unit``; errors of the model itself pass as they are.

    Why the class's forward, compiled once, and not ``torch.compile(inner)``: each step runs a new skeleton, so
    compiling its module would call ``torch.compile`` once per unit per step, and torch keeps every backend a
    ``torch.compile`` call makes (``torch._dynamo.eval_frame.cached_backends``) until ``torch._dynamo.reset()``: about
    0.6 KB of host memory per unit per step, without end. ``torch.compile(inner)`` runs the module's hooks eagerly and
    compiles the frame of its forward; so does this (the same frame, so the same graphs and the same cache of them),
    by calling the module with its ``forward`` the compiled one for the call. A forward that torch itself defines (an
    ``nn.Sequential`` block as a unit) is compiled through a function of fzero's that calls it (``_inline``): torch.compile
    does not start tracing at a ``torch.nn`` frame, and ``torch.compile(module)`` does the same for such a module."""
    _refuse_silent_eager(unit)
    cls = type(inner)
    hooks = _inner_hooks(inner)
    key = (cls, hooks)
    fn = cache.get(key)
    if fn is None:
        _refuse_uncompiled_modules(inner, unit, cls)  # once per compiled forward: a class's modules are its own
        forward = cls.forward
        inline = getattr(forward, "__module__", "").startswith("torch.")
        frame = _inline(forward) if inline else forward
        if hooks or inline:  # a code object of its own: torch keeps compiled graphs per code object (with no guard on
            # inner hooks), and counts its recompile limit per code object: one _inline for every torch class would
            # share one budget of graphs among nn.Sequential, nn.TransformerEncoderLayer, ...
            frame = _own_code(frame, f"hooks{len(cache)}")
        else:  # the same for a forward that several classes share (_class_frame)
            frame = _class_frame(cls, frame)
        # fallback_random: dropout draws from torch's generator, as eager does, not inductor's own (whose masks differ:
        # 1.3e-2 off the eager step after one step); the ranks' streams stay fzero's
        fn = cache[key] = torch.compile(frame, options={"fallback_random": True})

    def call(*args: Any, **kwargs: Any) -> Any:
        _refuse_hf_cache(unit, args, kwargs)
        d = inner.__dict__
        had, before = "forward" in d, d.get("forward")
        if had and not (isinstance(before, types.MethodType) and before.__func__ is fn):
            # a forward set on the instance (module.forward = ..., as accelerate's hooks or a user skipping a layer set
            # it): eager runs it, and the class's compiled forward bound over it would train another function, silently
            raise UnitCompileError(
                f"fzero (jit=True): unit {unit!r} ({cls.__name__}) has a forward set on the module itself "
                f"(module.forward = {getattr(before, '__qualname__', type(before).__name__)}), which jit=True compiles "
                f"from its class, {cls.__name__}.forward, and would run instead. Build the step without jit=True, move "
                f"the change into a subclass's forward, or keep that module out of the units."
            )
        d["forward"] = types.MethodType(fn, inner)  # nn.Module.__call__ calls self.forward: hooks eager, forward compiled
        config = torch._dynamo.config
        strict = config.fail_on_recompile_limit_hit
        config.fail_on_recompile_limit_hit = True  # past torch's limit of graphs per forward: an error, not eager (below)
        try:
            return inner(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            found = re.search(r"Limit type: (\w+)", str(e.__cause__ or ""))
            limit = found.group(1) if found else "recompile_limit"
            raise UnitCompileError(
                f"fzero (jit=True): unit {unit!r} ({cls.__name__}) needs another compiled graph of {cls.__name__}.forward, "
                f"past torch.compile's limit of {getattr(config, limit, '?')} (torch._dynamo.config.{limit}). A graph is "
                f"made for each param shape, train/eval mode and gradient mode the units of {cls.__name__} run with "
                f"(step.evaluate is a mode of its own), and the graphs of earlier steps in this process count too (steps "
                f"built for other model widths, say). Past the limit torch would run the unit eagerly, without a word. "
                f"Raise the limit before the first step (torch._dynamo.config.{limit} = 64), call torch._dynamo.reset() "
                f"between steps of other widths, or build the step without jit=True."
            ) from e
        finally:
            config.fail_on_recompile_limit_hit = strict
            if had:
                d["forward"] = before
            else:
                del d["forward"]

    return _named(call, unit, cls.__name__)


def _inner_hooks(inner: nn.Module) -> tuple:
    """The hooks of the modules inside a unit, by path and identity. Why in the key of the compiled forward: the
    unit's own hooks run eagerly around it, but those of the modules inside are traced into its graph, and torch does
    not guard on them (``skip_nnmodule_hook_guards``): one graph for the class, traced on a block without a hook, ran
    for a block with one, and the hook never ran (found: 1.5e-3 off eager after two steps). Blocks without inner hooks,
    the common case, still share one graph."""
    out = []
    for path, m in inner.named_modules():
        if not path:
            continue
        d = m.__dict__
        for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = d.get(kind)
            if hooks:
                out.append((path, kind, tuple(id(h) for h in hooks.values())))
    # torch's global module hooks (nn.modules.module.register_module_forward_hook, ..._full_backward_hook) run for
    # every module inside the unit too, traced into its graph with no guard either: one registered (or removed) after
    # the first step never ran inside the compiled units (found: 9.9e-3 off eager in the loss of the step after)
    from torch.nn.modules import module as torch_module

    # (so a global hook registered anew for each step, a ModuleTracker entered per step, compiles the units anew:
    # register it once)
    for kind in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"):
        hooks = getattr(torch_module, kind, None)
        if hooks:
            out.append(("", kind, tuple(id(h) for h in hooks.values())))
    return tuple(out)


def _own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` as a function with a code object of its own (renamed ``<name>_<tag>``): torch.compile's graphs and their
    guards are kept on the code object, so a unit whose inner hooks differ gets graphs of its own rather than another
    unit's."""
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    out = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


# each unit class's forward with a code object of the class's own, for the process: (the class's forward, its copy)
_CLASS_FRAMES: weakref.WeakKeyDictionary[type, tuple[Callable[..., Any], Callable[..., Any]]] = weakref.WeakKeyDictionary()


def _class_frame(cls: type, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` (``cls.forward``) with a code object that is ``cls``'s alone, made once per class for the process, so
    that a later step's units reuse the graphs an earlier step compiled, as with the class's own code.

    Why: torch.compile counts its recompile limit (8 graphs) per code object, and one code object can be the forward
    of many classes. transformers 5 wraps the forward of every layer class (``GradientCheckpointingLayer``) in one
    function, ``forward_with_checkpointing``, so all its layer classes in a process drew on one budget: a Whisper
    encoder's units were refused as past the limit after the units of a few other Hugging Face models had compiled
    (found by a sweep of the test zoo in one process; each model alone compiled)."""
    kept = _CLASS_FRAMES.get(cls)
    if kept is not None and kept[0] is forward:
        return kept[1]
    own = _own_code(forward, re.sub(r"\W", "_", cls.__name__))
    _CLASS_FRAMES[cls] = (forward, own)
    return own


def _refuse_uncompiled_modules(inner: nn.Module, unit: str, cls: type) -> None:
    """torch.compile runs an RNN, LSTM or GRU eagerly (a graph break, no error): refuse a unit holding one."""
    rnn = next((type(m).__name__ for m in inner.modules() if isinstance(m, nn.RNNBase)), None)
    if rnn is not None:
        raise UnitCompileError(
            f"fzero (jit=True): unit {unit!r} ({cls.__name__}) holds an {rnn}, which torch.compile does not compile (it "
            f"runs it eagerly, silently). Build the step without jit=True, or keep that module out of the units."
        )


def _refuse_hf_cache(unit: str, args: tuple, kwargs: dict) -> None:
    """A Hugging Face cache object handed to a unit (``use_cache=True``, transformers' default even in training):
    torch.compile guards on each layer's entry of it, so it compiles once per layer and, past its recompile limit
    (8), runs the other layers eagerly with only a log line."""
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind.__module__.startswith("transformers") and kind.__name__.endswith("Cache"):
            raise UnitCompileError(
                f"fzero (jit=True): unit {unit!r} is given a Hugging Face {kind.__name__} (use_cache=True, the default): "
                f"torch.compile would compile it once per layer and run the layers past its recompile limit eagerly. "
                f"Run it with use_cache=False (model(..., use_cache=False), or build the model from a config with "
                f"use_cache=False: setting model.config.use_cache afterwards is not enough for an encoder-decoder such as "
                f"T5, whose decoder keeps a copy of the config; transformers turns the cache on by default, in eval mode "
                f"too, so step.evaluate needs it as well)."
            )


def _inline(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A frame torch.compile traces, around a forward of torch's own (which it would not start at)."""

    def unit_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return unit_forward


def _refuse_silent_eager(unit: str) -> None:
    """Where torch.compile would not compile the unit and run it eagerly without a word, refuse instead."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch._C._functorch.peek_interpreter_stack() is not None:  # inside torch.func.grad: the same silent eager
        raise UnitCompileError(
            f"fzero (jit=True): unit {unit!r} runs inside torch.func.grad (autodiff='func'), where torch.compile does "
            f"not compile the unit's frame and would silently run it eagerly. Build the step with "
            f"autodiff='autograd' (plain torch.autograd, which torch.compile supports)."
        )
    from fzero.autodiff import under_remat

    if under_remat():  # fzero.remat's recompute watch: torch.compile falls back to eager under it, silently
        raise UnitCompileError(
            f"fzero (jit=True): unit {unit!r} runs under fzero.remat (remat=True), where torch.compile does not compile "
            f"the unit (it falls back to eager, silently). Use one of them: remat=True to save memory, or jit=True for "
            f"speed (HF's gradient_checkpointing_enable() composes with torch.compile)."
        )
    mode = _get_current_dispatch_mode()
    if mode is not None:  # torch.compile would skip the frame and run the unit eagerly, silently
        raise UnitCompileError(
            f"fzero (jit=True): unit {unit!r} runs under a TorchDispatchMode ({type(mode).__name__}), and torch.compile "
            f"does not compile under one: the unit would silently run eagerly. local_mesh(n) with n > 1 draws each "
            f"rank's random numbers through such a mode, and fzero.memory.LiveBytes counts through one. Use jit=True "
            f"with one rank (no mesh, local_mesh(1)) or under torchrun (fzero.dist_mesh()), outside such modes."
        )


def _named(module: Callable, unit: str, kind: str) -> Callable[..., Any]:
    from torch._dynamo import exc as dynamo_exc

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return module(*args, **kwargs)
        except (dynamo_exc.BackendCompilerFailed, dynamo_exc.Unsupported, dynamo_exc.TorchRuntimeError, dynamo_exc.InternalTorchDynamoError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UnitCompileError(
                f"fzero (jit=True): torch.compile failed on unit {unit!r} ({kind}): {type(e).__name__}: {first}\n"
                f"Run without jit=True, or keep that module out of the units (units=... without {unit!r}), or compile "
                f"it yourself; the compiler's full error is the cause below."
            ) from e

    return call
