"""``fzero.compile``: check every setting up front, then compose the transforms."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from fzero import _rules
from fzero.zero import (
    DEFAULT_SUB_GROUP,
    CPUOffload,
    DiskOffload,
    offload as _offload,
    remat_units,
    shard_grads,
    shard_optimizer,
    shard_params,
)
from fzero.step import Precision, Step, check_details, train_step


class Default:
    """A keyword's default in ``compile``'s signature, told apart from the same value given: with a config, a
    keyword given wins even when it equals the default (``stages=0`` over a stage-3 config, ``precision="fp32"``
    over a bf16 one), as docs/migrating.md promises. Shown as the value itself in ``help(fzero.compile)``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Default) else x


def compile(  # noqa: A001 - the public name is the design's
    loss_fn: Callable[..., Any],
    *,
    optimizer: Any = None,
    stages: int = Default(0),
    mesh: Any = None,
    offload: str | CPUOffload | DiskOffload | None = Default(None),
    offload_params: bool = Default(False),
    offload_dir: str | None = Default(None),
    sub_group_size: int = Default(DEFAULT_SUB_GROUP),
    precision: str | Precision = Default("fp32"),
    grad_accum: int = Default(1),
    clip_grad_norm: float | None = Default(None),
    config: Any = None,
    **details: Any,
) -> Step:
    """Compose ``train_step`` with the shard transforms for ZeRO stage ``stages`` (0, 1, 2 or 3).

    ``precision``: "fp32", "bf16", "fp16" or a ``fzero.Precision``; ``grad_accum``: micro-batches per
    step; ``clip_grad_norm``: clip the global gradient norm (see ``train_step``). ``offload``: "cpu" or
    "disk"/"nvme" with ``offload_dir`` and ``sub_group_size`` (disk only: cpu offload updates whole shards), or
    a policy object (``fzero.CPUOffload(...)``, ``fzero.DiskOffload(dir, ...)``) carrying them; ``offload_params`` (stage 3) — see
    ``fzero.offload``. Details (keyword):
    ``unit_elements`` (stages 0-1), ``donate``, ``autodiff``, ``on_nonfinite`` (see ``train_step``); at stages 2-3
    ``units``, ``jit`` (each unit's forward through ``torch.compile``) and ``bucket_elements`` (units reduced
    together; see ``shard_grads``), at stage 3
    ``prefetch`` (see ``shard_params``); at every stage ``remat=True``, each unit's forward recomputed in backward
    (see ``fzero.remat_units``).

    ``config``: a DeepSpeed config (a JSON file path, a dict, or ``fzero.config.from_deepspeed(...)``'s
    settings); keywords given explicitly win over it, even when they equal the default (see ``fzero.config``).

    ``optimizer`` defaults to ``fzero.optim.adamw(1e-3)``. Settings not built yet raise an error that says
    so, never a silent fallback. Which stage accepts which setting is ``fzero/_rules.py``.
    """
    from fzero import optim

    _rules.check_stage(_value(stages), api="fzero.compile")
    if config is not None:  # a DeepSpeed config: its settings, and the keywords given here (not Default) win over them
        from fzero.config import merge_with_keywords

        return compile(loss_fn, **merge_with_keywords(config, compile, locals()))
    sub_group_given = not isinstance(sub_group_size, Default)
    stages, offload, offload_params, offload_dir, sub_group_size, precision, grad_accum, clip_grad_norm = map(
        _value, (stages, offload, offload_params, offload_dir, sub_group_size, precision, grad_accum, clip_grad_norm))
    if sub_group_given and offload is None:  # it sizes disk offload's updates; without offload it was ignored silently
        raise ValueError(
            f"fzero.compile: sub_group_size={sub_group_size!r} sizes the updates of the optimizer state offloaded to disk "
            f"(offload='disk', with offload_dir), but offload=None: each rank updates its shard of every unit whole, so "
            f"it would change nothing. Drop it, or offload to disk."
        )
    units = details.pop("units", None)
    jit = details.pop("jit", False)
    bucket = {"bucket_elements": details.pop("bucket_elements")} if "bucket_elements" in details else {}
    stage3 = {k: details.pop(k) for k in ("prefetch",) if k in details}
    recompute = details.pop("remat", False)
    if not isinstance(recompute, bool):
        raise TypeError(f"fzero.compile: remat must be True or False, got {recompute!r}.")
    _rules.check_settings(stages, [*(["units"] if units is not None else []), *stage3, *(["jit"] if jit else []), *bucket,
                                   *(["unit_elements"] if "unit_elements" in details else [])], api="fzero.compile")
    if offload is None:  # the stage rules of offload itself are fzero.offload's to check, below
        _rules.check_offload(stages, None, offload_params or offload_dir is not None, api="fzero.compile",
                             params_key="offload_params/offload_dir")
    check_details(details, api="fzero.compile", keywords=_KEYWORDS)
    step = train_step(
        loss_fn, optimizer if optimizer is not None else optim.adamw(1e-3), mesh=mesh, precision=precision,
        grad_accum=grad_accum, clip_grad_norm=clip_grad_norm, **details,
    )
    if stages >= 1:
        step = shard_optimizer(step)
    if stages >= 2:
        step = shard_grads(step, units=units, jit=jit, **bucket)
    if stages >= 3:
        step = shard_params(step, **stage3)
    if recompute:
        step = remat_units(step)
    if offload is not None:
        step = _offload(step, offload, params=offload_params, dir=offload_dir, sub_group_size=sub_group_size)
    return step


# compile's own keywords and the stage settings it takes out of ``details``: what a typo is compared with
_KEYWORDS = (*(name for name, p in inspect.signature(compile).parameters.items() if p.kind is p.KEYWORD_ONLY),
             "units", "prefetch", "remat", "jit", "bucket_elements")
