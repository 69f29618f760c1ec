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

from typing import Any, Callable

import torch
from torch import nn


class UnitCompileError(RuntimeError):
    """torch.compile failed on a unit: names the unit and keeps the compiler's error as the cause."""


def compiled(inner: nn.Module, unit: str, cache: dict[int, Callable]) -> Callable[..., Any]:
    """``inner`` compiled (one wrapper per module object in ``cache``, which the step's params object holds), whose
    calls turn a compiler failure into ``UnitCompileError`` naming ``unit``; errors of the model itself pass as they are."""
    fn = cache.get(id(inner))
    if fn is None:
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
        fn = cache[id(inner)] = _named(torch.compile(inner), unit, type(inner).__name__)
    return fn


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
