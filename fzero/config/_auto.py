"""``"auto"`` in a DeepSpeed config (the Hugging Face integrations' placeholder), resolved as the HF Trainer fills it."""

from __future__ import annotations

from typing import Any, Callable

from fzero.config._schema import TOP, M, NoEffect, Unsupported
from fzero.config._values import API, UNSET, Ctx, dtype_name
from fzero.step import policy


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
    "scheduler.params.warmup_num_steps": ("warmup_steps", lambda v: max(1, int(v)), "max(1, warmup steps)"),
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
    return dtype_name(prec.compute)


def resolve_autos(cfg: dict, ctx: Ctx) -> None:
    """Replace every mapped "auto" (batch sizes aside: ``_batch`` resolves them) from the arguments; one error for all that can't be."""
    missing = []

    def walk(block: dict, schema: dict | None, prefix: str) -> None:
        for key, value in block.items():
            path = prefix + key
            spec = M if schema is None else schema.get(key)
            if isinstance(spec, (NoEffect, Unsupported)):
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
                if raw is UNSET:
                    example = "'bf16'" if path.startswith("bf") else _EXAMPLES[arg]
                    missing.append(f"{path}: pass {arg}= (e.g. {arg}={example}; as the HF Trainer: {how})")
                    continue
                block[key] = fn(raw)
                ctx.resolved.append((path, block[key], f"{arg}=" if arg else how))

    walk(cfg, TOP, "")
    if missing:
        raise ValueError(f'{API}: "auto" values that no argument resolves:\n  ' + "\n  ".join(missing))
