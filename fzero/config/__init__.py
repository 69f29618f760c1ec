"""DeepSpeed config files as typed fzero settings.

```python
settings = fzero.config.from_deepspeed("ds_config.json", learning_rate=3e-4, total_steps=10_000, world_size=2)
print(settings)                                   # every setting, where it came from, what was resolved or ignored
step = fzero.compile(loss_fn, config=settings, mesh=mesh)
step = fzero.compile(loss_fn, config="ds_config.json", mesh=mesh, stages=3)   # keywords given win over the file
```

``from_deepspeed`` reads the file (or dict) a DeepSpeed user already has and returns a frozen ``Settings``:
the ZeRO stage, the optimizer built as a ``fzero.optim`` transform with its schedule, the ``Precision``
policy, gradient accumulation and clipping, offload, the batch sizes checked against the world size, and the
ZeRO tuning knobs mapped to fzero's hints where they mean something here. Nothing is dropped silently:

* a key fzero does not know is an error that names it and the closest known key;
* a known DeepSpeed feature fzero does not have (1-bit Adam, ZeRO++, pipeline parallelism, ...) is a
  ``NotImplementedError`` that names the feature;
* a known key that has no effect here is accepted and listed in ``Settings.notes`` with the reason;
* ``"auto"`` (the Hugging Face integrations' placeholder) is resolved from the arguments given, as the HF
  Trainer fills it (``AUTO_RULES``); an ``"auto"`` that nothing resolves is an error naming the key and the
  argument to pass. What was resolved is in ``Settings.resolved`` and ``Settings.config``.

Defaults are DeepSpeed 0.19's where the config leaves a value out: gradients are clipped at 1.0, ``Adam`` means
decoupled weight decay (``adam_w_mode``), ``Lamb``'s eps is 1e-8, ``WarmupLR`` warms up to the optimizer's lr.

With ``fzero.compile(loss_fn, config=..., **keywords)`` the keywords win over the config. A keyword counts
as given when its value differs from ``compile``'s default (``compile`` cannot tell ``stages=0`` from no
``stages``): to go back to a default, edit the config or pass ``from_deepspeed(...).replace(stages=0)``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import json
import math
import os
import types
from typing import Any, Callable, Mapping

import torch

from fzero import optim
from fzero.config._schema import (  # noqa: F401 - the tables the reader walks
    M,
    _Mapped,
    _NoEffect,
    _OPT_KEYS,
    _SCHEDULES,
    _Spec,
    _TOP,
    _UNSUPPORTED_OPTIMIZERS,
    _Unsupported,
)
from fzero.step._precision import DynamicLossScale, Precision, StaticLossScale, policy

__all__ = ["AUTO_RULES", "Settings", "from_deepspeed"]

API = "fzero.config.from_deepspeed"
_UNSET: Any = object()


# -- the result --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """fzero settings read from a DeepSpeed config. ``print(settings)`` shows them with their sources.

    ``compile_kwargs()`` gives the keyword arguments of ``fzero.compile`` (without ``mesh``); the fields not in
    it (batch sizes, ``steps_per_print``, ``wall_clock_breakdown``) are for the training loop.
    """

    source: str  # the file, or "dict"
    stages: int = 0
    optimizer: Any = dataclasses.field(default=None, repr=False)  # fzero.optim GradientTransformation, or None
    optimizer_description: str | None = None
    learning_rate: Any = dataclasses.field(default=None, repr=False)  # float or schedule the optimizer scales by
    precision: Precision = Precision()
    grad_accum: int = 1
    clip_grad_norm: float | None = None
    offload: str | None = None  # "cpu" or "nvme"
    offload_params: bool = False
    offload_dir: str | None = None
    sub_group_size: int | None = None  # None: fzero's default
    world_size: int | None = None
    micro_batch_size: int | None = None  # per rank, per micro-batch: DeepSpeed's train_micro_batch_size_per_gpu
    train_batch_size: int | None = None  # per optimizer step, all ranks: micro_batch_size * grad_accum * world_size
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    unit_elements: int | None = None  # hint for stages 0-1: elements per flat bucket (from the bucket sizes)
    prefetch: bool | None = None  # hint for stage 3: gather the next unit ahead (from prefetch size / overlap_comm)
    notes: tuple[str, ...] = ()  # keys accepted with no effect here, and why; DeepSpeed defaults applied
    resolved: tuple[tuple[str, Any, str], ...] = ()  # ("optimizer.params.lr", 3e-4, "learning_rate=") for each "auto"
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)  # the config, "auto" resolved

    def replace(self, **changes: Any) -> "Settings":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @property
    def batch_per_rank(self) -> int | None:
        """Samples one rank passes to one ``step(state, batch)`` call: ``micro_batch_size * grad_accum``."""
        return None if self.micro_batch_size is None else self.micro_batch_size * self.grad_accum

    def compile_kwargs(self, stages: int | None = None) -> dict[str, Any]:
        """Keyword arguments for ``fzero.compile`` at ``stages`` (default: the config's). What is stage-bound goes
        only where it applies: ``unit_elements`` at stages 0-1, ``prefetch`` and ``offload_params`` at stage 3."""
        stages = self.stages if stages is None else stages
        out: dict[str, Any] = {"stages": stages, "precision": self.precision, "grad_accum": self.grad_accum,
                               "clip_grad_norm": self.clip_grad_norm}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        if self.offload is not None:  # param shards exist at stage 3 only: below it, only the optimizer is offloaded
            out.update(offload=self.offload, offload_params=self.offload_params and stages == 3)
            if self.offload_dir is not None:
                out["offload_dir"] = self.offload_dir
            if self.sub_group_size is not None:
                out["sub_group_size"] = self.sub_group_size
        if self.unit_elements is not None and stages <= 1:
            out["unit_elements"] = self.unit_elements
        if self.prefetch is not None and stages == 3:
            out["prefetch"] = self.prefetch
        return out

    def __str__(self) -> str:
        p = self.precision
        prec = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[p.compute]
        if p.compute != torch.float32:
            prec += f" (fp32 master weights: {p.has_master}; gradients summed in {_dtype_name(p.reduce_dtype)}"
            ls = p.loss_scale
            if isinstance(ls, DynamicLossScale):
                prec += (f"; dynamic loss scale from {ls.initial:g}, window {ls.window}, hysteresis {ls.hysteresis}, "
                         f"min {ls.min_scale:g}")
            elif isinstance(ls, StaticLossScale):
                prec += f"; static loss scale {ls.scale:g}"
            prec += ")"
        rows = [
            ("stages", f"{self.stages}"),
            ("optimizer", self.optimizer_description or "none in the config (fzero.compile's optimizer= or its default)"),
            ("precision", prec),
            ("grad_accum", f"{self.grad_accum}"),
            ("clip_grad_norm", f"{self.clip_grad_norm}"),
        ]
        if self.offload is not None:
            where = self.offload + (f" in {self.offload_dir}" if self.offload_dir else "")
            rows.append(("offload", f"{where}; params too: {self.offload_params}; sub_group_size: "
                                    f"{self.sub_group_size or 'fzero default'}"))
        else:
            rows.append(("offload", "none"))
        if self.micro_batch_size is not None:
            world = "?" if self.world_size is None else self.world_size
            total = "" if self.train_batch_size is None else f"train_batch_size {self.train_batch_size} = "
            rows.append(("batch", f"{total}{self.micro_batch_size} per rank x {self.grad_accum} micro-batches x "
                                  f"{world} ranks; pass {self.batch_per_rank} samples per rank to each step call"))
        hints = [f"unit_elements={self.unit_elements} (stages 0-1)"] if self.unit_elements is not None else []
        hints += [f"prefetch={self.prefetch} (stage 3)"] if self.prefetch is not None else []
        rows.append(("hints", ", ".join(hints) or "none"))
        rows.append(("steps_per_print", f"{self.steps_per_print} (the loop's to honour: a step returns its metrics)"))
        rows.append(("wall_clock_breakdown", f"{self.wall_clock_breakdown} (the loop's to time: fzero keeps no timers)"))
        lines = [f"fzero settings from the DeepSpeed config {self.source}"]
        lines += [f"  {k:21s} {v}" for k, v in rows]
        if self.resolved:
            lines.append('  "auto" resolved:')
            lines += [f"    {path} = {value!r}  ({how})" for path, value, how in self.resolved]
        if self.notes:
            lines.append("  notes:")
            lines += [f"    {n}" for n in self.notes]
        return "\n".join(lines)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


# -- "auto" ------------------------------------------------------------------------------------------------------


def _lr(v: Any) -> float:
    return v


def _hidden2(v: int) -> int:
    return v * v


AUTO_RULES: dict[str, tuple[str | None, Callable[[Any], Any], str]] = {
    # config path: (argument of from_deepspeed, value from the argument, how the HF Trainer fills it)
    "optimizer.params.lr": ("learning_rate", _lr, "learning_rate"),
    "optimizer.params.betas": ("betas", lambda v: [float(b) for b in v], "(adam_beta1, adam_beta2)"),
    "optimizer.params.eps": ("eps", float, "adam_epsilon"),
    "optimizer.params.weight_decay": ("weight_decay", float, "weight_decay"),
    "scheduler.params.warmup_min_lr": (None, lambda _: 0.0, "0, as the HF Trainer fills it"),
    "scheduler.params.warmup_max_lr": ("learning_rate", _lr, "learning_rate"),
    "scheduler.params.cycle_max_lr": ("learning_rate", _lr, "learning_rate"),
    "scheduler.params.warmup_num_steps": ("warmup_steps", int, "warmup steps"),
    "scheduler.params.total_num_steps": ("total_steps", int, "optimizer steps of the run"),
    "gradient_clipping": ("clip_grad_norm", lambda v: 0.0 if v is None else float(v), "max_grad_norm"),
    "fp16.enabled": ("precision", lambda v: _precision_name(v) == "fp16", "precision == 'fp16'"),
    "bf16.enabled": ("precision", lambda v: _precision_name(v) == "bf16", "precision == 'bf16'"),
    "bfloat16.enabled": ("precision", lambda v: _precision_name(v) == "bf16", "precision == 'bf16'"),
    "zero_optimization.reduce_bucket_size": ("hidden_size", _hidden2, "hidden_size ** 2"),
    "zero_optimization.allgather_bucket_size": ("hidden_size", _hidden2, "hidden_size ** 2"),
    "zero_optimization.stage3_prefetch_bucket_size": ("hidden_size", lambda v: int(0.9 * v * v), "0.9 * hidden_size ** 2"),
    "zero_optimization.stage3_param_persistence_threshold": ("hidden_size", lambda v: 10 * v, "10 * hidden_size"),
}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_EXAMPLES = {"learning_rate": "3e-4", "betas": "(0.9, 0.999)", "eps": "1e-8", "weight_decay": "0.01", "warmup_steps": "100",
             "total_steps": "10_000", "clip_grad_norm": "1.0", "precision": "'fp16'", "hidden_size": "1024",
             "batch_size": "8", "grad_accum": "1", "world_size": "2"}


def _precision_name(p: Any) -> str:
    prec = policy(p, api=API)
    return _dtype_name(prec.compute)


# -- reading -----------------------------------------------------------------------------------------------------


class _Ctx:
    """What a parse collects: the resolve arguments, which were used, notes, resolutions."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.args = args
        self.used: set[str] = set()
        self.notes: list[str] = []
        self.resolved: list[tuple[str, Any, str]] = []

    def arg(self, name: str) -> Any:
        if name in self.args:
            self.used.add(name)
            return self.args[name]
        return _UNSET


def from_deepspeed(
    config: str | os.PathLike | Mapping[str, Any],
    *,
    world_size: int | None = None,
    learning_rate: Any = _UNSET,
    betas: Any = _UNSET,
    eps: Any = _UNSET,
    weight_decay: Any = _UNSET,
    batch_size: Any = _UNSET,
    grad_accum: Any = _UNSET,
    total_steps: Any = _UNSET,
    warmup_steps: Any = _UNSET,
    hidden_size: Any = _UNSET,
    precision: Any = _UNSET,
    clip_grad_norm: Any = _UNSET,
) -> Settings:
    """Read a DeepSpeed config (a JSON file path or a dict) into fzero ``Settings``.

    The keywords resolve ``"auto"`` values (see ``AUTO_RULES``): ``learning_rate``, ``betas``, ``eps``,
    ``weight_decay`` (optimizer), ``warmup_steps``, ``total_steps`` (scheduler), ``batch_size`` (per rank per
    micro-batch), ``grad_accum``, ``clip_grad_norm``, ``precision`` ("fp32", "bf16", "fp16"), ``hidden_size``
    (bucket sizes). ``world_size`` checks ``train_batch_size = micro batch * accumulation * world size`` and
    derives the missing one. A keyword given for a value the config sets itself is an error (it would be
    ignored); ``world_size`` is always accepted.
    """
    given = {k: v for k, v in dict(
        learning_rate=learning_rate, betas=betas, eps=eps, weight_decay=weight_decay, batch_size=batch_size,
        grad_accum=grad_accum, total_steps=total_steps, warmup_steps=warmup_steps, hidden_size=hidden_size,
        precision=precision, clip_grad_norm=clip_grad_norm,
    ).items() if v is not _UNSET}
    settings, ctx = _read(config, given, world_size)
    unused = sorted(set(given) - ctx.used)
    if unused:
        raise ValueError(
            f"{API}: {', '.join(f'{k}=' for k in unused)} given, but the config has no \"auto\" that it resolves "
            f"(it sets those values itself, or does not use them). Drop the argument, or write \"auto\" in the config "
            f"where it should apply ({', '.join(p for p, (a, _, _) in AUTO_RULES.items() if a in unused) or 'batch sizes'})."
        )
    return settings


def _read(config: Any, given: dict[str, Any], world_size: int | None) -> tuple[Settings, _Ctx]:
    source, cfg = _load(config)
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1):
        raise ValueError(f"{API}: world_size must be an int >= 1 (ranks in the data-parallel group), got {world_size!r}.")
    ctx = _Ctx(given)
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
    _check_block(cfg, _TOP, "", ctx)
    _check_optimizer_keys(cfg)
    _resolve_autos(cfg, ctx)
    return _parse(cfg, ctx, source, world_size), ctx


def _load(config: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{API}: no DeepSpeed config file at {path!r}.") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{API}: {path!r} is not valid JSON ({e}).") from None
        source = path
    elif isinstance(config, Mapping):
        data, source = copy.deepcopy(dict(config)), "dict"
    else:
        raise TypeError(f"{API}: config must be a path to a DeepSpeed JSON file or a dict, got {type(config).__name__}.")
    if not isinstance(data, dict):
        raise ValueError(f"{API}: a DeepSpeed config is a JSON object at the top, got {type(data).__name__}.")
    return source, data


def _check_block(block: Any, schema: dict[str, _Spec], prefix: str, ctx: _Ctx) -> None:
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
        if isinstance(spec, _Unsupported):
            if value != "auto" and spec.when(value):
                raise NotImplementedError(
                    f"{API}: {path}={json.dumps(value)} asks for {spec.feature}, a DeepSpeed feature fzero does not have. "
                    f"{spec.fix or 'Remove it, or disable it (enabled: false).'}"
                )
            ctx.notes.append(f"{path}={json.dumps(value)}: accepted, no effect here: {spec.feature} is not in fzero, and it is off.")
        elif isinstance(spec, _NoEffect):
            ctx.notes.append(f"{path}={json.dumps(value)}: accepted, no effect here: {spec.reason}.")
        elif isinstance(spec, _Mapped) and spec.block is not None and value is not None:
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
            keys = _OPT_KEYS.get(str(kind).lower())
            if keys is None:
                feature = _UNSUPPORTED_OPTIMIZERS.get(str(kind).lower())
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
            fn = _SCHEDULES.get(kind)
            if fn is None:
                close = difflib.get_close_matches(str(kind), list(_SCHEDULES), n=1, cutoff=0.5)
                raise ValueError(f"{API}: unknown scheduler.type {kind!r}." + (f" Did you mean {close[0]!r}?" if close else "") +
                                 f" fzero maps {', '.join(_SCHEDULES)}.")
            keys = tuple(k for k in inspect.signature(fn).parameters if k != "base_lr") + ("last_batch_iteration",)
        for key in params:
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
                raise ValueError(f"{API}: unknown key '{name}.params.{key}' for {name} {kind!r}." +
                                 (f" Did you mean {close[0]!r}?" if close else f" Known: {', '.join(keys)}."))


def _resolve_autos(cfg: dict, ctx: _Ctx) -> None:
    """Replace every mapped "auto" (batch sizes aside: ``_batch`` resolves them) from the arguments; one error for all that can't be."""
    missing = []

    def walk(block: dict, schema: dict | None, prefix: str) -> None:
        for key, value in block.items():
            path = prefix + key
            spec = M if schema is None else schema.get(key)
            if isinstance(spec, (_NoEffect, _Unsupported)):
                rule = AUTO_RULES.get(path)
                if value == "auto" and rule is not None and rule[0] in ctx.args:  # no effect, but print it resolved
                    block[key] = rule[1](ctx.arg(rule[0]))
                    ctx.resolved.append((path, block[key], f"{rule[0]}="))
                continue  # "auto" there changes nothing
            if isinstance(value, dict):
                walk(value, spec.block, path + ".")  # None: every key inside is mapped (optimizer/scheduler params)
            elif value == "auto" and path not in _BATCH_KEYS:
                rule = AUTO_RULES.get(path)
                if rule is None:
                    missing.append(f"{path}: nothing resolves it in fzero; write a value")
                    continue
                arg, fn, how = rule
                raw = None if arg is None else ctx.arg(arg)
                if raw is _UNSET:
                    example = "'bf16'" if path.startswith("bf") else _EXAMPLES[arg]
                    missing.append(f"{path}: pass {arg}= (e.g. {arg}={example}; as the HF Trainer: {how})")
                    continue
                block[key] = fn(raw)
                ctx.resolved.append((path, block[key], f"{arg}=" if arg else how))

    walk(cfg, _TOP, "")
    if missing:
        raise ValueError(f'{API}: "auto" values that no argument resolves:\n  ' + "\n  ".join(missing))


# -- typed values ------------------------------------------------------------------------------------------------


def _int(path: str, value: Any, *, low: int = 0) -> int:
    if isinstance(value, float) and value.is_integer():  # JSON numbers such as 5e8
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{API}: {path} must be an integer >= {low}, got {json.dumps(value)}.")
    return value


def _float(path: str, value: Any, *, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError(f"{API}: {path} must be a number >= {low:g}, got {json.dumps(value)}.")
    return float(value)


def _bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{API}: {path} must be true or false, got {json.dumps(value)}.")
    return value


# -- the mapping -------------------------------------------------------------------------------------------------


def _parse(cfg: dict, ctx: _Ctx, source: str, world_size: int | None) -> Settings:
    zero = cfg.get("zero_optimization") or {}
    stages = _int("zero_optimization.stage", zero.get("stage", 0))
    if stages > 3:
        raise ValueError(f"{API}: zero_optimization.stage must be 0, 1, 2 or 3, got {stages}.")
    precision = _precision(cfg, ctx)
    grad_accum, micro, total = _batch(cfg, ctx, world_size)
    clip = _clip(cfg, ctx)
    offload = _offload(zero, stages, ctx)
    unit_elements, prefetch = _hints(zero, stages, ctx)
    opt, description, lr = _optimizer(cfg, ctx)
    steps_per_print = cfg.get("steps_per_print")
    if steps_per_print is not None:
        steps_per_print = _int("steps_per_print", steps_per_print, low=1)
    return Settings(
        source=source, stages=stages, optimizer=opt, optimizer_description=description, learning_rate=lr,
        precision=precision, grad_accum=grad_accum, clip_grad_norm=clip, **offload, world_size=world_size,
        micro_batch_size=micro, train_batch_size=total, steps_per_print=steps_per_print,
        wall_clock_breakdown=_bool("wall_clock_breakdown", cfg.get("wall_clock_breakdown", False)),
        unit_elements=unit_elements, prefetch=prefetch, notes=tuple(ctx.notes), resolved=tuple(ctx.resolved),
        config=types.MappingProxyType(cfg),
    )


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}


def _precision(cfg: dict, ctx: _Ctx) -> Precision:
    fp16 = cfg.get("fp16") or {}
    bf16 = cfg.get("bf16") or cfg.get("bfloat16") or {}
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ValueError(f'{API}: both "bf16" and its old name "bfloat16" are given; keep "bf16".')
    fp16_on = _bool("fp16.enabled", fp16.get("enabled", False))
    bf16_on = _bool("bf16.enabled", bf16.get("enabled", False))
    if fp16_on and bf16_on:
        raise ValueError(f"{API}: fp16.enabled and bf16.enabled are both true; pick one (DeepSpeed refuses both too).")
    reduce = None
    comm = cfg.get("communication_data_type")
    if comm is not None:
        if comm not in _DTYPES:
            raise ValueError(f"{API}: communication_data_type must be one of \"fp32\", \"fp16\", \"bf16\", got {json.dumps(comm)}.")
        reduce = _DTYPES[comm]
    if fp16_on:
        scale = _float("fp16.loss_scale", fp16.get("loss_scale", 0))
        if scale > 0:
            loss_scale: Any = StaticLossScale(scale)
        else:
            loss_scale = DynamicLossScale(
                initial=2.0 ** _int("fp16.initial_scale_power", fp16.get("initial_scale_power", 16)),
                window=_int("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000), low=1),
                hysteresis=_int("fp16.hysteresis", fp16.get("hysteresis", 2), low=1),
                min_scale=_float("fp16.min_loss_scale", fp16.get("min_loss_scale", 1)),
            )
        prec = Precision(compute=torch.float16, reduce=reduce, loss_scale=loss_scale)
    elif bf16_on:
        prec = Precision(compute=torch.bfloat16, reduce=reduce)
    else:
        if reduce not in (None, torch.float32):
            raise NotImplementedError(f"{API}: communication_data_type={json.dumps(comm)} with fp32 training (gradients "
                                      f"summed in lower precision than computed) is not in fzero. Drop it, or enable bf16/fp16.")
        prec = Precision()
    accum = (cfg.get("data_types") or {}).get("grad_accum_dtype")
    if accum is not None and _DTYPES.get(accum) != prec.compute:
        raise NotImplementedError(
            f"{API}: data_types.grad_accum_dtype={json.dumps(accum)}: accumulating gradients in another dtype than the "
            f"compute dtype ({_dtype_name(prec.compute)}) is not in fzero. Drop it."
        )
    return prec


def _batch(cfg: dict, ctx: _Ctx, world: int | None) -> tuple[int, int | None, int | None]:
    """(grad_accum, micro batch per rank, train batch), by DeepSpeed's rule train = micro * accum * world."""
    keys = {"train_batch_size": None, "train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "grad_accum"}
    vals: dict[str, int | None] = {}
    autos = set()
    for key, arg in keys.items():
        raw = cfg.get(key)
        vals[key] = None
        if raw == "auto":
            autos.add(key)
            got = ctx.arg(arg) if arg else _UNSET
            if got is not _UNSET:
                vals[key] = _int(f"{key} (from {arg}=)", got, low=1)
                ctx.resolved.append((key, vals[key], f"{arg}="))
        elif raw is not None:
            vals[key] = _int(key, raw, low=1)
    train, micro, accum = vals.values()
    if (train is not None or "train_batch_size" in autos) and world is None:
        raise ValueError(
            f"{API}: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, so "
            f"it needs the world size: pass world_size= (fzero.compile passes its mesh's size)."
        )
    derived = []
    if train is None:
        if "train_batch_size" in autos and micro is not None:
            train = micro * (accum or 1) * world
            derived.append(("train_batch_size", train))
    elif micro is None or accum is None:
        rest = train // (world * (accum or micro or 1))
        if micro is None and accum is None:
            micro, accum = rest, 1
        elif micro is None:
            micro = rest
        else:
            accum = rest
        derived += [("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)]
    if train is not None and (micro < 1 or accum < 1 or micro * accum * world != train):
        raise ValueError(
            f"{API}: train_batch_size={train} must equal train_micro_batch_size_per_gpu ({micro}) x "
            f"gradient_accumulation_steps ({accum}) x world size ({world}) = {micro * accum * world}; fix one of them "
            f"(two of the three are enough: DeepSpeed's rule derives the third)."
        )
    for key, value in derived:
        if key in autos:
            ctx.resolved.append((key, value, "train_batch_size = micro x accumulation x world size"))
        elif cfg.get(key) is None:
            ctx.notes.append(f"{key} = {value}: derived by DeepSpeed's rule, train_batch_size = micro batch x accumulation x world size")
    still = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum}
    missing = [f"{key}: pass {keys[key] or 'batch_size'}=" for key in sorted(autos) if still[key] is None]
    if missing:
        raise ValueError(f'{API}: "auto" values that no argument resolves:\n  ' + "\n  ".join(missing))
    for key in autos:
        cfg[key] = still[key]
    return accum or 1, micro, train


def _clip(cfg: dict, ctx: _Ctx) -> float | None:
    if "gradient_clipping" not in cfg:
        ctx.notes.append("gradient_clipping not given: clip_grad_norm=1.0, DeepSpeed 0.19's default (write 0 for none)")
        return 1.0
    value = _float("gradient_clipping", cfg["gradient_clipping"])
    return None if value == 0 else value


def _offload(zero: dict, stages: int, ctx: _Ctx) -> dict[str, Any]:
    opt = dict(zero.get("offload_optimizer") or {})
    par = dict(zero.get("offload_param") or {})
    if zero.get("cpu_offload"):  # the old spelling of offload_optimizer: {device: cpu}
        opt.setdefault("device", "cpu")
    if zero.get("cpu_offload_param"):
        par.setdefault("device", "cpu")
    devices = ("none", "cpu", "nvme")
    for name, block in (("offload_optimizer", opt), ("offload_param", par)):
        if block.get("device", "none") not in devices:
            raise ValueError(f"{API}: zero_optimization.{name}.device must be one of {devices}, got {json.dumps(block.get('device'))}.")
    where, pwhere = opt.get("device", "none"), par.get("device", "none")
    out: dict[str, Any] = {"offload": None, "offload_params": False, "offload_dir": None, "sub_group_size": None}
    if pwhere != "none":
        if stages != 3:
            raise ValueError(f"{API}: zero_optimization.offload_param needs stage 3 (param shards exist only there), "
                             f"but stage is {stages}; drop offload_param or use stage 3.")
        if where == "none":
            raise NotImplementedError(f"{API}: offload_param without offload_optimizer (params on the host, optimizer on "
                                      f"the device) is not in fzero. Add \"offload_optimizer\": {{\"device\": \"{pwhere}\"}}.")
        if pwhere != where:
            raise NotImplementedError(
                f"{API}: offload_param to {pwhere!r} with offload_optimizer to {where!r}: fzero offloads param shards to "
                f"where the optimizer state goes. Give both the same device."
            )
        ppath, opath = par.get("nvme_path"), opt.get("nvme_path")
        if pwhere == "nvme" and ppath is not None and opath is not None and str(ppath) != str(opath):
            raise NotImplementedError(
                f"{API}: offload_param.nvme_path={json.dumps(ppath)} differs from offload_optimizer.nvme_path="
                f"{json.dumps(opath)}; fzero keeps a rank's param and optimizer files in one directory. Give both the same path."
            )
    if where == "none":
        if "sub_group_size" in zero:
            ctx.notes.append(f"zero_optimization.sub_group_size={json.dumps(zero['sub_group_size'])}: accepted, no effect here: it sizes offloaded optimizer updates, and nothing is offloaded.")
        return out
    if stages == 0:
        raise ValueError(f"{API}: zero_optimization.offload_optimizer needs stage 1, 2 or 3 (each rank offloads its shard "
                         f"of the optimizer state), but stage is 0.")
    out["offload"], out["offload_params"] = where, pwhere != "none"
    if where == "nvme":
        if not opt.get("nvme_path") and par.get("nvme_path"):  # the param block's path serves both
            opt = {**opt, "nvme_path": par["nvme_path"]}
        if not opt.get("nvme_path"):
            raise ValueError(f"{API}: zero_optimization.offload_optimizer.device is \"nvme\" but nvme_path is missing: "
                             f"name a directory on the fast disk, e.g. \"nvme_path\": \"/local_nvme\".")
        out["offload_dir"] = str(opt["nvme_path"])
    elif "nvme_path" in opt:
        ctx.notes.append("zero_optimization.offload_optimizer.nvme_path: accepted, no effect here: the device is cpu.")
    if "sub_group_size" in zero:
        out["sub_group_size"] = _int("zero_optimization.sub_group_size", zero["sub_group_size"], low=1)
    for name, block in (("offload_optimizer", opt), ("offload_param", par)):
        if "pin_memory" in block:
            _bool(f"zero_optimization.{name}.pin_memory", block["pin_memory"])
            ctx.notes.append(f"zero_optimization.{name}.pin_memory={json.dumps(block['pin_memory'])}: accepted, no effect "
                             f"here: fzero pins its host buffers whenever CUDA is available.")
    if "cpu_offload_use_pin_memory" in zero:
        ctx.notes.append("zero_optimization.cpu_offload_use_pin_memory: accepted, no effect here: fzero pins its host "
                         "buffers whenever CUDA is available.")
    return out


def _hints(zero: dict, stages: int, ctx: _Ctx) -> tuple[int | None, bool | None]:
    """Bucket sizes -> unit_elements (for stages 0-1, where the flat buffers are the buckets); the prefetch size
    and overlap_comm -> prefetch (for stage 3). Both are kept whatever the stage: a keyword may change it."""
    buckets = {k: _int(f"zero_optimization.{k}", zero[k], low=1) for k in ("reduce_bucket_size", "allgather_bucket_size") if k in zero}
    # one flat buffer is both the reduction bucket and (stage 1) the all-gather bucket: the smaller bounds both
    unit_elements = min(buckets.values()) if buckets else None
    if buckets and stages >= 2:
        ctx.notes.append(f"zero_optimization.{'/'.join(buckets)}: no effect at stage {stages} (units are modules there; "
                         f"units=); at stages 0-1 it would set unit_elements={unit_elements}.")
    size_key = next((k for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size") if k in zero), None)
    size = None if size_key is None else _int(f"zero_optimization.{size_key}", zero[size_key])
    overlap = None if zero.get("overlap_comm") is None else _bool("zero_optimization.overlap_comm", zero["overlap_comm"])
    prefetch = None
    if size is not None or overlap is not None:
        prefetch = size != 0 and overlap is not False  # either one switches prefetching off, as in DeepSpeed
        if stages != 3:
            given = ", ".join(f"{k}={json.dumps(v)}" for k, v in ((size_key, size), ("overlap_comm", overlap)) if v is not None)
            ctx.notes.append(f"zero_optimization.{given}: no effect at stage {stages}: it sets fzero's prefetch, at stage 3 "
                             f"(stages 0-2 run their collectives in order).")
    return unit_elements, prefetch


# -- optimizer and schedule --------------------------------------------------------------------------------------


def _optimizer(cfg: dict, ctx: _Ctx) -> tuple[Any, str | None, Any]:
    block, sched = cfg.get("optimizer"), cfg.get("scheduler")
    if block is None:
        if sched is not None:
            raise ValueError(
                f"{API}: the config has a scheduler but no optimizer block; fzero puts the schedule into the optimizer it "
                f"builds. Add e.g. \"optimizer\": {{\"type\": \"AdamW\", \"params\": {{\"lr\": 3e-4}}}}."
            )
        return None, None, None
    kind, p = block["type"].lower(), dict(block.get("params") or {})
    path = "optimizer.params"
    lr = _float(f"{path}.lr", p.get("lr", 1e-3))
    schedule, momentum, sched_desc = _schedule(sched, lr, kind, ctx) if sched is not None else (lr, None, None)
    if sched is not None and "lr" in p and sched["type"] != "WarmupCosineLR" and not (sched["type"] == "WarmupLR" and "warmup_max_lr" not in (sched.get("params") or {})):
        ctx.notes.append(f"optimizer.params.lr={p['lr']}: replaced by the {sched['type']} schedule, as in DeepSpeed.")
    betas = p.get("betas", [0.9, 0.99] if kind == "lion" else [0.9, 0.999])
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"{API}: {path}.betas must be a pair like [0.9, 0.999], got {json.dumps(betas)}.")
    b1, b2 = (_float(f"{path}.betas[{i}]", b) for i, b in enumerate(betas))
    for key, ok in (("amsgrad", False), ("maximize", False), ("bias_correction", True), ("eps_inside_sqrt", False)):
        if key in p and _bool(f"{path}.{key}", p[key]) != ok:
            raise NotImplementedError(f"{API}: {path}.{key}={json.dumps(p[key])} is not in fzero's {kind}. Set it to {json.dumps(ok)}.")
    for key in ("foreach", "set_grad_none", "fused", "capturable", "differentiable", "fp32_optimizer_states"):
        if key in p:
            ctx.notes.append(f"{path}.{key}={json.dumps(p[key])}: accepted, no effect here: a torch/DeepSpeed kernel choice.")
    lr_text = sched_desc or f"{lr:g}"
    if kind in ("adam", "adamw"):
        if momentum is not None:
            b1, b2 = momentum, 0.99  # DeepSpeed's OneCycle sets betas = (cycled momentum, 0.99)
            ctx.notes.append("scheduler OneCycle: Adam's b1 follows the cycled momentum and b2 is 0.99, as DeepSpeed sets them.")
        torch_adam = _bool(f"{path}.torch_adam", p.get("torch_adam", False))
        decoupled = kind == "adamw" or _bool(f"{path}.adam_w_mode", p.get("adam_w_mode", True))
        # torch.optim.AdamW's default decay is 0.01; DeepSpeed's FusedAdam/CPUAdam and torch's Adam default to 0
        wd = _float(f"{path}.weight_decay", p.get("weight_decay", 0.01 if torch_adam and decoupled else 0.0))
        eps = _float(f"{path}.eps", p.get("eps", 1e-8))
        impl = ("torch.optim.AdamW" if decoupled else "torch.optim.Adam") if torch_adam else f"FusedAdam(adam_w_mode={decoupled})"
        b1_text = "cycled momentum" if callable(b1) else f"{b1:g}"
        if decoupled:
            opt = optim.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd)
            desc = f"fzero.optim.adamw(lr={lr_text}, b1={b1_text}, b2={b2:g}, eps={eps:g}, weight_decay={wd:g})"
        else:  # Adam with L2 decay: the decay is added to the gradient, as torch.optim.Adam(weight_decay=...)
            opt = optim.adam(schedule, b1=b1, b2=b2, eps=eps)
            desc = f"fzero.optim.adam(lr={lr_text}, b1={b1_text}, b2={b2:g}, eps={eps:g})"
            if wd:
                opt = optim.chain(optim.add_decayed_weights(wd), opt)
                desc = f"fzero.optim.chain(add_decayed_weights({wd:g}), {desc})"
        return opt, f"{desc}  [DeepSpeed {block['type']}: {impl}]", schedule
    if momentum is not None:
        raise NotImplementedError(
            f"{API}: OneCycle cycles the first beta of {block['type']}, and fzero's {kind} takes a fixed b1. Set "
            f"scheduler.params.cycle_momentum to false."
        )
    wd = _float(f"{path}.weight_decay", p.get("weight_decay", 0.0))
    if kind == "lamb":
        eps = _float(f"{path}.eps", p.get("eps", 1e-8))  # FusedLamb's default (fzero.optim.lamb's own is 1e-6)
        max_coeff, min_coeff = _float(f"{path}.max_coeff", p.get("max_coeff", 10.0)), _float(f"{path}.min_coeff", p.get("min_coeff", 0.01))
        opt = optim.lamb(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd, max_coeff=max_coeff, min_coeff=min_coeff)
        desc = (f"fzero.optim.lamb(lr={lr_text}, b1={b1:g}, b2={b2:g}, eps={eps:g}, weight_decay={wd:g}, "
                f"max_coeff={max_coeff:g}, min_coeff={min_coeff:g})  [DeepSpeed Lamb: FusedLamb]")
    elif kind == "lion":
        opt = optim.lion(schedule, b1=b1, b2=b2, weight_decay=wd)
        desc = f"fzero.optim.lion(lr={lr_text}, b1={b1:g}, b2={b2:g}, weight_decay={wd:g})  [DeepSpeed Lion: FusedLion]"
    else:  # sgd
        if _float(f"{path}.dampening", p.get("dampening", 0)) != 0:
            raise NotImplementedError(f"{API}: {path}.dampening={p['dampening']} is not in fzero's sgd. Set it to 0.")
        mom = _float(f"{path}.momentum", p.get("momentum", 0.0))
        nesterov = _bool(f"{path}.nesterov", p.get("nesterov", False))
        opt = optim.sgd(schedule, momentum=mom, nesterov=nesterov, weight_decay=wd)
        desc = f"fzero.optim.sgd(lr={lr_text}, momentum={mom:g}, nesterov={nesterov}, weight_decay={wd:g})  [torch.optim.SGD]"
    return opt, desc, schedule


def _schedule(sched: dict, lr: float, kind: str, ctx: _Ctx) -> tuple[Any, Any, str]:
    """The schedule (lr per step), OneCycle's momentum schedule (or None), and a description."""
    name, p = sched["type"], dict(sched.get("params") or {})
    last = p.pop("last_batch_iteration", -1)
    if last != -1:
        raise NotImplementedError(
            f"{API}: scheduler.params.last_batch_iteration={last}: resuming a schedule mid-way by this key is not in "
            f"fzero; a schedule reads the step count from the TrainState (restore the state from a checkpoint). Set it to -1."
        )
    kwargs = {k: (_int(f"scheduler.params.{k}", v) if isinstance(v, float) and k.endswith(("steps", "_size", "count")) else v)
              for k, v in p.items()}
    if name == "WarmupCosineLR":
        kwargs["base_lr"] = lr  # DeepSpeed scales the optimizer's lr
    if name == "WarmupLR" and "warmup_max_lr" not in kwargs:
        kwargs["warmup_max_lr"] = lr  # DeepSpeed 0.19: warm up to the optimizer's lr
        ctx.notes.append(f"scheduler WarmupLR: warmup_max_lr not given, the optimizer's lr {lr:g} (DeepSpeed 0.19's rule)")
    try:
        schedule = _SCHEDULES[name](**kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{API}: scheduler {name}: {e}") from None
    momentum = getattr(schedule, "momentum", None)
    if momentum is not None and kind == "sgd":
        ctx.notes.append("scheduler OneCycle: cycle_momentum has no effect with SGD, as in DeepSpeed (no betas to cycle).")
        momentum = None
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return schedule, momentum, f"{_SCHEDULES[name].__name__}({text})"


# -- fzero.compile(config=...) -------------------------------------------------------------------------------------

_RESOLVE_ONLY = ("learning_rate", "betas", "eps", "weight_decay", "batch_size", "total_steps", "warmup_steps", "hidden_size")


def merge_with_keywords(config: Any, compile_fn: Callable, arguments: dict[str, Any]) -> dict[str, Any]:
    """``fzero.compile``'s keywords with the config's settings filled in: what ``compile(config=...)`` runs.

    ``arguments``: compile's own arguments (``locals()``). A keyword whose value differs from compile's default
    wins over the config; it also resolves a matching ``"auto"`` (``precision``, ``grad_accum``,
    ``clip_grad_norm``). The ``from_deepspeed`` resolve keywords (``learning_rate``, ``total_steps``, ...) may be
    passed to compile too. ``config`` may be a path, a dict, or ``Settings`` from ``from_deepspeed``.
    """
    params = inspect.signature(compile_fn).parameters
    details = dict(arguments.get("details") or {})
    explicit = {k: arguments[k] for k, p in params.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and k != "config" and k in arguments
                and not _same(arguments[k], p.default)}
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
        settings, ctx = _read(config, {**resolve, **overriding}, world)
        unused = sorted(set(resolve) - ctx.used)
        if unused:
            raise ValueError(f"fzero.compile: {', '.join(f'{k}=' for k in unused)} given, but the config has no \"auto\" "
                             f"that it resolves. Drop it.")
    if settings.world_size is not None and world is not None and settings.world_size != world:
        raise ValueError(f"fzero.compile: the config's settings were checked for world_size={settings.world_size}, but the "
                         f"mesh has {world} ranks. Read the config again with world_size={world}.")
    named = explicit.get("precision")
    if isinstance(named, str) and named in ("fp32", "bf16", "fp16") and named == _dtype_name(settings.precision.compute):
        del explicit["precision"]  # the same dtype: keep the config's policy (its loss scale, its reduce dtype)
    stages = explicit.get("stages", settings.stages)
    out = settings.compile_kwargs(stages)
    if "offload" in out and "offload_params" not in params:
        raise NotImplementedError("fzero.compile: the config offloads (zero_optimization.offload_optimizer), and this "
                                  "fzero.compile has no offload settings yet.")
    out.update(explicit)  # the keywords given win
    out.update(details)
    out["mesh"] = mesh
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # noqa: BLE001 - tensors and other values without a plain ==
        return False
