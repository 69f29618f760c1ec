"""Which parameters a step used: torch.optim's ``p.grad is None``, recorded in the graph.

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
``grad=None``) and the optimizer skips what is left unused (``fzero.optim`` and ``fzero.layout._segments``).

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
import threading
from typing import Any, Iterator

import torch

from fzero._function import Function
from fzero.layout import Layout, Unit, split_sizes

_local = threading.local()  # a local mesh runs its ranks as threads: one record per rank thread


class Usage:
    """One rank's record of one step: per unit, which of its slots got a gradient (in some micro-batch)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.used: dict[str, list[bool]] = {u.name: [False] * len(u.slots) for u in layout.units}

    def flags(self) -> torch.Tensor:
        """float32 1-D, one entry per slot in layout order (``layout.paths``): 1.0 where used. Summed over ranks
        by the step's metrics all-reduce, an entry > 0 says some rank used the slot."""
        return torch.tensor([float(x) for u in self.layout.units for x in self.used[u.name]], dtype=torch.float32)


@contextlib.contextmanager
def recording(layout: Layout) -> Iterator[Usage]:
    """Record, in this thread, which params the gradients computed inside the block use."""
    previous = getattr(_local, "usage", None)
    _local.usage = usage = Usage(layout)
    try:
        yield usage
    finally:
        _local.usage = previous


def active(unit: Unit) -> Usage | None:
    """The record that gradients into ``unit`` should note, or None (not recording, or no gradient being built)."""
    usage = getattr(_local, "usage", None)
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
        offset = 0
        dests, srcs = [], []
        for i, n in enumerate(sizes):
            g = grads[i] if i < len(grads) else None
            piece = flat.narrow(0, offset, n)
            if g is None:
                piece.zero_()
            else:
                if used is not None and i < len(used):
                    used[i] = True
                dests.append(piece.view(g.shape))  # a transposed gradient is copied once, not made contiguous first
                srcs.append(g)
            offset += n
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
