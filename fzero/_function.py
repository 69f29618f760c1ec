"""``Function``: ``torch.autograd.Function`` whose ``apply`` does not re-read its forward's signature each call.

torch's ``Function.apply``, for a Function with a ``setup_context`` (the form ``torch.func`` needs), binds the call's
arguments with ``inspect.signature(cls.forward).bind(...)`` and ``apply_defaults()`` on every call, to fill in the
forward's default arguments: tens of microseconds of Python per call. fzero applies several Functions per unit per
step (gather, refill, reduce, the recording of which params got a gradient), and on one GPU that host time showed
up as idle GPU time between a step's kernels.

A subclass of this one keeps a signature on its forward (``__signature__``, which ``inspect.signature`` returns as
it is), made once with the class. Its ``bind`` answers at once when the call needs no binding (no keyword
arguments, and every positional parameter given, so no default to fill in) and binds as ``inspect`` does otherwise,
so ``apply`` gets the same arguments either way.
"""

from __future__ import annotations

import inspect

import torch

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Bound:
    """What torch reads of a ``BoundArguments``: ``apply_defaults()``, ``args`` and (torch 2.13) ``kwargs``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple) -> None:
        self.args = args
        self.kwargs: dict = {}  # no keyword-only parameter (``_Signature``): nothing to put here

    def apply_defaults(self) -> None:  # every positional parameter was given: no default to apply
        pass


class _Signature(inspect.Signature):
    __slots__ = ("_positional", "_varargs", "_fast")

    def __init__(self, sig: inspect.Signature) -> None:
        super().__init__(list(sig.parameters.values()), return_annotation=sig.return_annotation)
        kinds = [p.kind for p in sig.parameters.values()]
        self._positional = sum(k in _POSITIONAL for k in kinds)
        self._varargs = inspect.Parameter.VAR_POSITIONAL in kinds
        # a keyword-only parameter would get its default in BoundArguments.kwargs: such a forward always binds
        self._fast = not any(k in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD) for k in kinds)

    def bind(self, *args, **kwargs):
        if self._fast and not kwargs and (len(args) == self._positional or (self._varargs and len(args) >= self._positional)):
            return _Bound(args)
        return super().bind(*args, **kwargs)


class Function(torch.autograd.Function):
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        func = getattr(forward, "__func__", forward)  # a staticmethod's function
        if func is not None and not hasattr(func, "__signature__"):
            func.__signature__ = _Signature(inspect.signature(func))
