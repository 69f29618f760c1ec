"""``fzero.train_step``: a stage-0 ``Step`` made from a loss function and an optimizer, with its settings checked.

The shard transforms (``fzero.zero``) and ``fzero.compile`` start from it; ``as_step`` is the first check each
transform makes of what it is given, and ``check_details`` the check of the step's keyword-only settings, shared
with ``fzero.compile``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fzero.mesh import DistMesh, LocalMesh, Mesh
from fzero.step._step import Step
from fzero.step._update import Precision, policy


def as_step(step: object, api: str) -> Step:
    """``step``, checked to be a ``Step`` (the first check of every transform)."""
    if not isinstance(step, Step):
        raise TypeError(f"{api}: expected a Step from fzero.train_step(loss_fn, optimizer), got {type(step).__name__}.")
    return step


def train_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    mesh: Mesh | None = None,
    precision: str | Precision = "fp32",
    grad_accum: int = 1,
    clip_grad_norm: float | None = None,
    **details: Any,
) -> Step:
    """Stage 0: a pure ``(state, batch) -> (state, metrics)`` step; gradients are all-reduced on a mesh (DDP).

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``. ``precision``: "fp32", "bf16",
    "fp16" (dynamic loss scale) or a ``fzero.Precision``. ``grad_accum=k``: each call splits the batch
    into k micro-batches on dim 0 and makes one update with the mean of their gradients, as DeepSpeed and a DDP loop
    with ``loss / k`` do: for a ``loss_fn`` that averages over its rows (the usual mean), that is one k-times-larger
    batch; for a summed loss it is 1/k of the large batch's, and a loss averaged over valid tokens
    (``ignore_index``) is a mean of the micro-batches' means (docs/migrating.md shows the Hugging Face Trainer's mean over
    the step's tokens, ``num_items_in_batch``). The step's metrics: "loss" (the mean over ranks and
    micro-batches), and "aux" as rank 0's last micro-batch returned it.
    ``clip_grad_norm=c``: scale the gradient by min(1, c / (global norm + 1e-6)), as
    ``torch.nn.utils.clip_grad_norm_``. Details: ``unit_elements`` (size of the flat buffers that
    collectives move, default 12.5 MiB of fp32), ``donate`` (default True), ``autodiff`` ("autograd", the
    default, or "func": ``torch.func.grad``, which holds about twice the gradient memory), ``on_nonfinite`` ("error" or "skip": what an inf/NaN gradient norm does when there
    is no fp16 loss scale to back off) and ``micro_batch_size`` (rows per rank per micro-batch, as a DeepSpeed config's
    ``train_micro_batch_size_per_gpu`` sets it: each call then refuses a batch of other than
    ``micro_batch_size * grad_accum`` rows per rank).
    """
    if not callable(loss_fn):
        raise TypeError(f"fzero.train_step: loss_fn must be callable as loss_fn(params, batch), got {type(loss_fn).__name__}.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"fzero.train_step: optimizer must be an (init, update) GradientTransformation such as fzero.optim.adamw(1e-3), "
            f"got {type(optimizer).__name__}. (torch.optim optimizers are stateful objects and are not accepted.)"
        )
    if mesh is not None and not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.train_step: mesh must be fzero.local_mesh(n), fzero.dist_mesh() or None, got {mesh!r}.")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"fzero.train_step: grad_accum must be an int >= 1 (micro-batches per step), got {grad_accum!r}.")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or not clip_grad_norm > 0):
        raise ValueError(f"fzero.train_step: clip_grad_norm must be a number > 0 or None, got {clip_grad_norm!r}. None is no "
                         f"clipping (what DeepSpeed's gradient_clipping: 0 and Lightning's gradient_clip_val=0 mean).")
    step = Step(
        loss_fn, optimizer, mesh, precision=policy(precision, api="fzero.train_step"), grad_accum=grad_accum,
        clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm),
    )
    return dataclasses.replace(step, **check_details(details, api="fzero.train_step", keywords=_TRAIN_STEP_KEYWORDS))


_TRAIN_STEP_KEYWORDS = ("mesh", "precision", "grad_accum", "clip_grad_norm")


_DETAILS: dict[str, Any] = {"unit_elements": int, "micro_batch_size": int, "donate": bool, "autodiff": ("func", "autograd"), "on_nonfinite": ("error", "skip")}


def check_details(details: dict[str, Any], *, api: str, keywords: tuple[str, ...] = ()) -> dict[str, Any]:
    """``details`` checked against the step's settings; an unknown one names the closest of them and of ``keywords``
    (the caller's own keyword names: a typo of ``grad_accum`` lands in ``**details`` too)."""
    import difflib

    for key, value in details.items():
        if key not in _DETAILS:
            known = sorted({*_DETAILS, *keywords})
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{api}: unknown setting {key!r}.{hint} Settings: {', '.join(known)}.")
        kind = _DETAILS[key]
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"{api}: {key} must be one of {kind}, got {value!r}.")
        elif not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise ValueError(f"{api}: {key} must be {'a positive int' if kind is int else 'True or False'}, got {value!r}.")
    return details
