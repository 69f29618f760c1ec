"""Reading a DeepSpeed config: load the JSON, refuse unknown keys and unsupported features, resolve ``"auto"``."""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import os
from typing import Any, Mapping

from fzero.config._auto import AUTO_RULES, resolve_autos
from fzero.config._mapping import to_settings
from fzero.config._schema import OPT_KEYS, SCHEDULES, TOP, UNSUPPORTED_OPTIMIZERS, Mapped, NoEffect, Spec, Unsupported
from fzero.config._settings import Settings
from fzero.config._values import API, UNSET, Ctx


def from_deepspeed(
    config: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int | None = None,
    learning_rate: Any = UNSET,
    betas: Any = UNSET,
    eps: Any = UNSET,
    weight_decay: Any = UNSET,
    batch_size: Any = UNSET,
    grad_accum: Any = UNSET,
    total_steps: Any = UNSET,
    warmup_steps: Any = UNSET,
    hidden_size: Any = UNSET,
    precision: Any = UNSET,
    clip_grad_norm: Any = UNSET,
    no_decay: Any = UNSET,
) -> Settings:
    """Read a DeepSpeed config (a JSON file path or a dict) into fzero ``Settings``.

    The keywords resolve ``"auto"`` values (see ``AUTO_RULES``): ``learning_rate``, ``betas``, ``eps``,
    ``weight_decay`` (optimizer), ``warmup_steps``, ``total_steps`` (scheduler), ``batch_size`` (per rank per
    micro-batch), ``grad_accum``, ``clip_grad_norm``, ``precision`` ("fp32", "bf16", "fp16"), ``hidden_size``
    (bucket sizes). ``no_decay``: a list of name substrings whose params get no weight decay
    (``["bias", "LayerNorm.weight"]``, the groups the HF Trainer makes for its own optimizer), mapped onto the
    optimizer as a mask (``fzero.optim.no_decay_names``). Not what the HF Trainer does with a config that has an
    ``"optimizer"`` block: it hands DeepSpeed one group of every trainable param, so biases and norms are decayed
    there; leave ``no_decay`` out to train as that run does. ``world_size`` checks ``train_batch_size = micro batch * accumulation * world size`` and
    derives the missing one. A keyword given for a value the config sets itself is an error (it would be
    ignored); ``world_size`` is always accepted.
    """
    given = {k: v for k, v in dict(
        learning_rate=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, batch_size=batch_size,
        grad_accum=grad_accum, total_steps=total_steps, warmup_steps=warmup_steps, hidden_size=hidden_size,
        precision=precision, clip_grad_norm=clip_grad_norm, no_decay=no_decay,
    ).items() if v is not UNSET}
    settings, ctx = read_config(config, given, world_size)
    unused = sorted(set(given) - ctx.used)
    if unused:
        raise ValueError(
            f"{API}: {', '.join(f'{k}=' for k in unused)} given, but the config has no \"auto\" that it resolves "
            f"(it sets those values itself, or does not use them). Drop the argument, or write \"auto\" in the config "
            f"where it should apply ({', '.join(p for p, (a, _, _) in AUTO_RULES.items() if a in unused) or 'batch sizes'})."
        )
    return settings


def read_config(config: Any, given: dict[str, Any], world_size: int | None) -> tuple[Settings, Ctx]:
    source, cfg = _load(config)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"{API}: world_size must be an int >= 1 (ranks in the data-parallel group), got {world_size!r}.")
    ctx = Ctx(given)
    if isinstance(cfg.get("zero_optimization"), bool):  # DeepSpeed's old form: true is stage 1
        on = cfg["zero_optimization"]
        cfg["zero_optimization"] = {"stage": int(on)}
        if on and "allgather_size" in cfg:
            cfg["zero_optimization"]["allgather_bucket_size"] = cfg["allgather_size"]
        ctx.notes.append(f"zero_optimization={json.dumps(on)}: DeepSpeed's old form of stage {int(on)}")
    elif "allgather_size" in cfg:
        ctx.notes.append(f"allgather_size={json.dumps(cfg['allgather_size'])}: accepted, no effect here: it belongs to "
                         f"the old boolean zero_optimization; the block form's bucket sizes apply.")
    cfg.pop("allgather_size", None)
    _check_block(cfg, TOP, "", ctx)
    _check_optimizer_keys(cfg)
    resolve_autos(cfg, ctx)
    return to_settings(cfg, ctx, source, world_size), ctx


def _load(config: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{API}: no DeepSpeed config file at {path!r}.") from None
        except IsADirectoryError:
            try:
                found = sorted(f for f in os.listdir(path) if f.endswith(".json"))[:5]
            except OSError:  # an unreadable directory: no suggestion
                found = []
            raise IsADirectoryError(
                f"{API}: {path!r} is a directory; pass the DeepSpeed JSON file itself (e.g. "
                f"{os.path.join(path, found[0] if found else 'ds_config.json')!r})"
                + (f"; JSON files there: {', '.join(found)}." if found else ".")
            ) from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{API}: {path!r} is not a text JSON file ({e.reason} at byte {e.start}).") from None
        except json.JSONDecodeError as e:
            hint = ""
            if path.endswith((".yaml", ".yml")):  # Accelerate's config (accelerate config writes YAML), not DeepSpeed's
                hint = (" A YAML file is Accelerate's config: read it with settings = fzero.config.from_accelerate(path) "
                        "and pass config=settings.")
            raise ValueError(f"{API}: {path!r} is not valid JSON ({e}).{hint}") from None
        source = path
    elif isinstance(config, Mapping):
        data, source = copy.deepcopy(dict(config)), "dict"
    else:
        raise TypeError(f"{API}: config must be a path to a DeepSpeed JSON file or a dict, got {type(config).__name__}.")
    if not isinstance(data, dict):
        raise ValueError(f"{API}: a DeepSpeed config is a JSON object at the top, got {type(data).__name__}.")
    return source, data


def _check_block(block: Any, schema: dict[str, Spec], prefix: str, ctx: Ctx) -> None:
    """Every key known; unsupported features refused; no-effect keys noted."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(block, dict):
        raise ValueError(f"{API}: {where} must be a JSON object, got {block!r}.")
    for key, value in block.items():
        path = prefix + key
        spec = schema.get(key)
        if spec is None:
            close = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known keys here: {', '.join(sorted(schema))}."
            raise ValueError(
                f"{API}: unknown key {path!r} in the DeepSpeed config.{hint} (fzero refuses what it does not know "
                f"instead of ignoring it.)"
            )
        if isinstance(spec, Unsupported):
            if value != "auto" and spec.when(value):
                raise NotImplementedError(
                    f"{API}: {path}={json.dumps(value)} asks for {spec.feature}, a DeepSpeed feature fzero does not have. "
                    f"{spec.fix or 'Remove it, or disable it (enabled: false).'}"
                )
            ctx.notes.append(f"{path}={json.dumps(value)}: accepted, no effect here: {spec.feature} is not in fzero, and it is off.")
        elif isinstance(spec, NoEffect):
            ctx.notes.append(f"{path}={json.dumps(value)}: accepted, no effect here: {spec.reason}.")
        elif isinstance(spec, Mapped) and spec.block is not None and value is not None:
            _check_block(value, spec.block, path + ".", ctx)


def _check_optimizer_keys(cfg: dict) -> None:
    for name, allowed in (("optimizer", ("type", "params", "legacy_fusion")), ("scheduler", ("type", "params"))):
        block = cfg.get(name)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ValueError(f"{API}: {name} must be a JSON object with \"type\" and \"params\", got {block!r}.")
        for key in block:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1)
                raise ValueError(f"{API}: unknown key '{name}.{key}'." + (f" Did you mean {close[0]!r}?" if close else f" Known: {', '.join(allowed)}."))
        if "type" not in block:
            raise ValueError(f'{API}: {name} has no "type"; e.g. "{name}": {{"type": "{"AdamW" if name == "optimizer" else "WarmupLR"}", "params": {{...}}}}.')
        params = block.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"{API}: {name}.params must be a JSON object, got {params!r}.")
        kind = block["type"]
        if name == "optimizer" and "max_grad_norm" in params:  # DeepSpeed's engine refuses it too
            raise ValueError(f"{API}: optimizer.params.max_grad_norm is not how DeepSpeed clips; use the top-level "
                             f"\"gradient_clipping\" (fzero's clip_grad_norm).")
        if name == "optimizer":
            keys = OPT_KEYS.get(str(kind).lower())
            if keys is None:
                feature = UNSUPPORTED_OPTIMIZERS.get(str(kind).lower())
                if feature is not None:
                    raise NotImplementedError(
                        f"{API}: optimizer.type={kind!r} is {feature}, which fzero does not implement. fzero.optim has "
                        f"Adam, AdamW, Lamb, SGD and Lion; e.g. \"type\": \"AdamW\"."
                    )
                known = ["Adam", "AdamW", "Lamb", "SGD", "Lion"]
                close = difflib.get_close_matches(str(kind), known, n=1, cutoff=0.5)
                raise ValueError(f"{API}: unknown optimizer.type {kind!r}." + (f" Did you mean {close[0]!r}?" if close else "") +
                                 f" fzero maps {', '.join(known)}.")
        else:
            fn = SCHEDULES.get(kind)
            if fn is None:
                close = difflib.get_close_matches(str(kind), list(SCHEDULES), n=1, cutoff=0.5)
                raise ValueError(f"{API}: unknown scheduler.type {kind!r}." + (f" Did you mean {close[0]!r}?" if close else "") +
                                 f" fzero maps {', '.join(SCHEDULES)}.")
            keys = tuple(k for k in inspect.signature(fn).parameters if k != "base_lr") + ("last_batch_iteration",)
        for key in params:
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
                raise ValueError(f"{API}: unknown key '{name}.params.{key}' for {name} {kind!r}." +
                                 (f" Did you mean {close[0]!r}?" if close else f" Known: {', '.join(keys)}."))
