"""``fzero.compile(config=...)``: the config's settings under the keywords given to ``compile``."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from fzero.config._read import read_config
from fzero.config._settings import Settings
from fzero.config._values import dtype_name

_RESOLVE_ONLY = ("learning_rate", "betas", "eps", "weight_decay", "batch_size", "total_steps", "warmup_steps", "hidden_size")


def merge_with_keywords(config: Any, compile_fn: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """``fzero.compile``'s keywords with the config's settings filled in: what ``compile(config=...)`` runs.

    ``arguments``: compile's own arguments (``locals()``). A keyword given (not compile's ``Default``, even when it
    equals the default value) wins over the config; it also resolves a matching ``"auto"`` (``precision``, ``grad_accum``,
    ``clip_grad_norm``). The ``from_deepspeed`` resolve keywords (``learning_rate``, ``total_steps``, ...) may be
    passed to compile too. ``config`` may be a path, a dict, or ``Settings`` from ``from_deepspeed``.
    """
    params = inspect.signature(compile_fn).parameters
    details = dict(arguments.get("details") or {})
    explicit = {k: arguments[k] for k, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "config" and k in arguments
                and not _is_default(arguments[k], p.default)}
    mesh = arguments.get("mesh")
    world = 1 if mesh is None else getattr(mesh, "size", None)
    resolve = {k: details.pop(k) for k in _RESOLVE_ONLY if k in details}
    if isinstance(config, Settings):
        if resolve:
            raise TypeError(f"fzero.compile: {', '.join(resolve)} resolve \"auto\" in a config file or dict; these Settings "
                            f"are already resolved. Pass them to fzero.config.from_deepspeed instead.")
        settings = config
    else:
        overriding = {k: explicit[k] for k in ("precision", "grad_accum", "clip_grad_norm") if k in explicit}
        settings, ctx = read_config(config, {**resolve, **overriding}, world)
        unused = sorted(set(resolve) - ctx.used)
        if unused:
            raise ValueError(f"fzero.compile: {', '.join(f'{k}=' for k in unused)} given, but the config has no \"auto\" "
                             f"that it resolves. Drop it.")
        _check_no_loop_blocks(settings)
    if settings.world_size is not None and world is not None and settings.world_size != world:
        raise ValueError(f"fzero.compile: the config's settings were checked for world_size={settings.world_size}, but the "
                         f"mesh has {world} ranks. Read the config again with world_size={world}.")
    _check_given_optimizer_keeps_the_schedule(explicit.get("optimizer"), settings)
    named = explicit.get("precision")
    if isinstance(named, str) and named in ("fp32", "bf16", "fp16") and named == dtype_name(settings.precision.compute):
        del explicit["precision"]  # the same dtype: keep the config's policy (its loss scale, its reduce dtype)
    stages = explicit.get("stages", settings.stages)
    out = settings.compile_kwargs(stages)
    if "offload" in out and "offload_params" not in params:
        raise NotImplementedError("fzero.compile: the config offloads (zero_optimization.offload_optimizer), and this "
                                  "fzero.compile has no offload settings yet.")
    if "offload" in explicit and explicit["offload"] is None:  # offload=None given: none of the config's offload
        for key in ("offload", "offload_params", "offload_dir", "sub_group_size"):
            out.pop(key, None)
    out.update(explicit)  # the keywords given win
    out.update(details)
    out["mesh"] = mesh
    return out


def _check_no_loop_blocks(settings: Settings) -> None:
    """Refuse a config file or dict given to ``compile`` that enables a block only the training loop can apply.

    Why: DeepSpeed's engine applies ``curriculum_learning`` and ``progressive_layer_drop`` itself, passing
    ``curriculum_seqlen`` and ``pld_theta`` to the model's forward at each step. An fzero step cannot cut the batch or
    choose the layers: ``from_deepspeed`` gives them as ``settings.curriculum`` and ``settings.progressive_layer_drop``
    for the loop, but ``compile(config=path)`` never hands the settings back, so the run trained on full sequences and
    every layer without a word. ``config=settings`` (read first) is taken as it is: the loop has them in hand."""
    blocks = []
    if settings.curriculum is not None:
        blocks.append("curriculum_learning: cut each batch in the loop, step(state, settings.curriculum.apply(batch, "
                      "state.step_count)) (DeepSpeed's engine passes curriculum_seqlen to the model)")
    if settings.progressive_layer_drop is not None:
        blocks.append("progressive_layer_drop: pass the step's draw to the model in loss_fn, "
                      "settings.progressive_layer_drop.layers(step, n_layers) (DeepSpeed's engine passes pld_theta)")
    if blocks:
        raise ValueError(
            "fzero.compile: the config enables blocks that the training loop applies, not the step, so compile(config="
            "...) alone would train without them: " + "; ".join(blocks) + ". Read the config first, settings = "
            "fzero.config.from_deepspeed(config, world_size=...), pass config=settings to compile and use them as said, "
            "or set the block's \"enabled\" to false (docs/migrating.md, \"Curriculum learning\", \"Progressive layer drop\")."
        )


def _check_given_optimizer_keeps_the_schedule(optimizer: Any, settings: Settings) -> None:
    """``optimizer=`` replaces the config's optimizer, and fzero's schedule lives inside the optimizer: a config's
    ``"scheduler"`` block would be dropped without a word. DeepSpeed applies the config's scheduler to a client
    optimizer, so refuse, unless the given optimizer scales by the config's own schedule (``settings.learning_rate``)."""
    sched = (settings.config or {}).get("scheduler")
    rate = getattr(optimizer, "learning_rate", None)
    # a multi_transform's groups (GroupRates): kept when one of them runs on the schedule itself and none at a constant
    # rate (DeepSpeed's scheduler sets every client group's lr, so a constant group would drop it for that group); the
    # others' schedules are the user's own (often a multiple of it: lambda t: 0.1 * settings.learning_rate(t)); a group
    # with no rate (set_to_zero, identity) has nothing to schedule
    groups = _group_rates(rate) or {}
    constant = sorted(label for label, r in groups.items() if r is not None and not callable(r))
    grouped = any(r is settings.learning_rate for r in groups.values())  # a group on the config's schedule
    if optimizer is None or not sched or rate is settings.learning_rate or (grouped and not constant):
        return
    kind = sched.get("type") if isinstance(sched, dict) else None
    if grouped:  # and some constant: refused by name
        raise ValueError(
            f"fzero.compile: optimizer= is a multi_transform whose groups {constant} run at a constant learning rate "
            f"beside a group on the config's \"scheduler\" block ({kind}): DeepSpeed's scheduler sets the lr of every "
            f"param group of a client optimizer, so here that schedule would be dropped for them without a word. Give "
            f"them a schedule too: the config's (settings.learning_rate) or one of your own, such as "
            f"fzero.optim.adamw(lambda t: 0.1 * settings.learning_rate(t)); fzero.optim.set_to_zero() freezes a group."
        )
    raise ValueError(
        f"fzero.compile: optimizer= replaces the config's optimizer, and with it the schedule of its \"scheduler\" block "
        f"({kind}): an fzero optimizer holds its own learning rate, so that schedule would not run (DeepSpeed applies "
        f"the config's scheduler to a client optimizer). To keep it, build your optimizer on the config's schedule: "
        f"settings = fzero.config.from_deepspeed(config, world_size=...), then fzero.compile(loss_fn, config=settings, "
        f"optimizer=fzero.optim.adamw(settings.learning_rate, ...)) (for a no-decay group with the config's optimizer: "
        f"from_deepspeed(..., no_decay=[...]) and no optimizer=; for groups at other learning rates, a multi_transform "
        f"with one group on settings.learning_rate and the others on schedules of your own, such as "
        f"fzero.optim.adamw(lambda t: 0.1 * settings.learning_rate(t))). To train without it, remove the \"scheduler\" "
        f"block from the config."
    )


def _group_rates(rate: Any) -> dict[str, Any] | None:
    """A multi_transform's rates by group (``GroupRates.group_rates``), nested ones flattened (``outer/inner``); None
    when ``rate`` is not a ``GroupRates``."""
    groups = getattr(rate, "group_rates", None)
    if not isinstance(groups, dict):
        return None
    out: dict[str, Any] = {}
    for label, r in groups.items():
        inner = _group_rates(r)
        out.update({f"{label}/{k}": v for k, v in inner.items()} if inner is not None else {label: r})
    return out


def _is_default(value: Any, default: Any) -> bool:
    """Whether compile's keyword was left out: its value is the signature's ``Default`` object itself (or, for a
    keyword without one such as ``optimizer=None``, the default value)."""
    if type(default).__name__ == "Default":
        return value is default
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # noqa: BLE001 - tensors and other values without a plain ==
        return False
