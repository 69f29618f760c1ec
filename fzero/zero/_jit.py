"""``jit=True``: each unit's compute compiled with ``torch.compile`` (regional compilation, as torchtitan compiles
each transformer block), at stages 2-3 where units are modules.

Only the unit's own forward is compiled: fzero's gathers, frees, refills and reductions stay outside it, in the
custom Functions around the unit, so a compiled unit is sharded, prefetched and reduced exactly as an eager one.
The unit's params reach the compiled forward as the module's attributes (rebound to the gathered views for the
call); torch.compile lifts them as graph inputs, so one compiled graph serves every block of the same code
(measured: the first block compiles in about 30 s on this 2-core CPU through inductor's C++ backend, the next
blocks reuse it).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn


class UnitCompileError(RuntimeError):
    """torch.compile failed on a unit: names the unit and keeps the compiler's error as the cause."""


def compiled(inner: nn.Module, unit: str, cache: dict[type, Callable]) -> Callable[..., Any]:
    """What to call for a unit's forward under ``jit``: ``inner`` itself, its hooks eager, with its class's forward
    compiled (``cache``: the step's, one compiled forward per class for the step's life). A compiler failure becomes
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
    fn = cache.get(cls)
    if fn is None:
        forward = cls.forward
        fn = cache[cls] = torch.compile(_inline(forward) if getattr(forward, "__module__", "").startswith("torch.") else forward)

    def call(*args: Any, **kwargs: Any) -> Any:
        d = inner.__dict__
        had, before = "forward" in d, d.get("forward")
        d["forward"] = types.MethodType(fn, inner)  # nn.Module.__call__ calls self.forward: hooks eager, forward compiled
        try:
            return inner(*args, **kwargs)
        finally:
            if had:
                d["forward"] = before
            else:
                del d["forward"]

    return _named(call, unit, cls.__name__)


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
