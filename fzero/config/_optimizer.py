"""A DeepSpeed optimizer and scheduler block as a ``fzero.optim`` transform with its schedule.

Parameter groups. A DeepSpeed config cannot hold them: DeepSpeed takes them from the ``model_parameters`` given to
``deepspeed.initialize``, where the Hugging Face scripts put a "no decay" group of the params whose names contain
``"bias"`` or ``"LayerNorm.weight"``. The reader maps that one form, given as the ``no_decay`` argument (a list of
name substrings): the optimizer's ``weight_decay`` then applies only to the other params
(``fzero.optim.no_decay_names``). Any other grouping (per-group learning rates, betas) has no place in the
config; build it with ``fzero.optim.multi_transform`` and pass ``optimizer=`` to ``fzero.compile``.
"""

from __future__ import annotations

import json
from typing import Any

from fzero import optim
from fzero.config._schema import SCHEDULES
from fzero.config._values import API, UNSET, Ctx, as_bool, as_float, as_int


def build_optimizer(cfg: dict, ctx: Ctx) -> tuple[Any, str | None, Any]:
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
    lr = as_float(f"{path}.lr", p.get("lr", 1e-3))
    schedule, momentum, sched_desc = _schedule(sched, lr, kind, ctx) if sched is not None else (lr, None, None)
    if sched is not None and "lr" in p and sched["type"] != "WarmupCosineLR" and not (sched["type"] == "WarmupLR" and "warmup_max_lr" not in (sched.get("params") or {})):
        ctx.notes.append(f"optimizer.params.lr={p['lr']}: replaced by the {sched['type']} schedule, as in DeepSpeed.")
    # DeepSpeed's defaults for every type it builds here, Lion included: FusedLion and DeepSpeedCPULion take
    # betas=(0.9, 0.999), not the Lion paper's (0.9, 0.99) that fzero.optim.lion defaults to
    betas = p.get("betas", [0.9, 0.999])
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
        raise ValueError(f"{API}: {path}.betas must be a pair like [0.9, 0.999], got {json.dumps(betas)}.")
    b1, b2 = (as_float(f"{path}.betas[{i}]", b) for i, b in enumerate(betas))
    for key, ok in (("amsgrad", False), ("maximize", False), ("bias_correction", True), ("eps_inside_sqrt", False)):
        if key in p and as_bool(f"{path}.{key}", p[key]) != ok:
            raise NotImplementedError(f"{API}: {path}.{key}={json.dumps(p[key])} is not in fzero's {kind}. Set it to {json.dumps(ok)}.")
    for key in ("foreach", "set_grad_none", "fused", "capturable", "differentiable", "fp32_optimizer_states"):
        if key in p:
            ctx.notes.append(f"{path}.{key}={json.dumps(p[key])}: accepted, no effect here: a torch/DeepSpeed kernel choice.")
    lr_text = sched_desc or f"{lr:g}"
    no_decay = _no_decay(ctx)
    if kind in ("adam", "adamw"):
        if momentum is not None:
            b1, b2 = momentum, 0.99  # DeepSpeed's OneCycle sets betas = (cycled momentum, 0.99)
            ctx.notes.append("scheduler OneCycle: Adam's b1 follows the cycled momentum and b2 is 0.99, as DeepSpeed sets them.")
        torch_adam = as_bool(f"{path}.torch_adam", p.get("torch_adam", False))
        decoupled = kind == "adamw" or as_bool(f"{path}.adam_w_mode", p.get("adam_w_mode", True))
        # torch.optim.AdamW's default decay is 0.01; DeepSpeed's FusedAdam/CPUAdam and torch's Adam default to 0
        wd = as_float(f"{path}.weight_decay", p.get("weight_decay", 0.01 if torch_adam and decoupled else 0.0))
        eps = as_float(f"{path}.eps", p.get("eps", 1e-8))
        impl = ("torch.optim.AdamW" if decoupled else "torch.optim.Adam") if torch_adam else f"FusedAdam(adam_w_mode={decoupled})"
        b1_text = "cycled momentum" if callable(b1) else f"{b1:g}"
        mask, mask_text = _mask(no_decay, wd, f"{path}.weight_decay", ctx)
        if decoupled:
            opt = optim.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd, mask=mask)
            desc = f"fzero.optim.adamw(lr={lr_text}, b1={b1_text}, b2={b2:g}, eps={eps:g}, weight_decay={wd:g}{mask_text})"
        else:  # Adam with L2 decay: the decay is added to the gradient, as torch.optim.Adam(weight_decay=...)
            opt = optim.adam(schedule, b1=b1, b2=b2, eps=eps)
            desc = f"fzero.optim.adam(lr={lr_text}, b1={b1_text}, b2={b2:g}, eps={eps:g})"
            if wd:
                decay, decay_text = _decay(wd, mask, mask_text)
                opt = optim.chain(decay, opt)
                desc = f"fzero.optim.chain({decay_text}, {desc})"
        return opt, f"{desc}  [DeepSpeed {block['type']}: {impl}]", schedule
    if momentum is not None:
        raise NotImplementedError(
            f"{API}: OneCycle cycles the first beta of {block['type']}, and fzero's {kind} takes a fixed b1. Set "
            f"scheduler.params.cycle_momentum to false."
        )
    wd = as_float(f"{path}.weight_decay", p.get("weight_decay", 0.0))
    if kind == "lamb" and no_decay is not None and wd:
        raise NotImplementedError(
            f"{API}: no_decay={no_decay!r} asks for a no-decay parameter group, but fzero's lamb (DeepSpeed's FusedLamb) "
            f"adds the weight decay inside each parameter's trust ratio, where it cannot be masked. Drop no_decay (every "
            f"param is decayed, as FusedLamb with one group), set {path}.weight_decay to 0, or use AdamW."
        )
    mask, mask_text = _mask(no_decay, wd, f"{path}.weight_decay", ctx)
    if kind == "lamb":
        eps = as_float(f"{path}.eps", p.get("eps", 1e-8))  # FusedLamb's default (fzero.optim.lamb's own is 1e-6)
        max_coeff, min_coeff = as_float(f"{path}.max_coeff", p.get("max_coeff", 10.0)), as_float(f"{path}.min_coeff", p.get("min_coeff", 0.01))
        opt = optim.lamb(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd, max_coeff=max_coeff, min_coeff=min_coeff)
        desc = (f"fzero.optim.lamb(lr={lr_text}, b1={b1:g}, b2={b2:g}, eps={eps:g}, weight_decay={wd:g}, "
                f"max_coeff={max_coeff:g}, min_coeff={min_coeff:g})  [DeepSpeed Lamb: FusedLamb]")
    elif kind == "lion":
        opt = optim.lion(schedule, b1=b1, b2=b2, weight_decay=wd, mask=mask)
        # not silent: an element whose b1 * m + (1 - b1) * g is exactly 0 (an embedding row no token of the step used, a
        # position past the sequence length) stays put here, and DeepSpeed's kernels move it by the whole lr each step
        ctx.notes.append(
            "optimizer Lion: where b1 * m + (1 - b1) * g is exactly 0 (a param with zero gradient and momentum: embedding "
            "rows of tokens or positions no batch used yet), fzero's lion takes sign(0) = 0 and leaves the param (as the "
            "Lion paper and optax do); DeepSpeed's FusedLion/DeepSpeedCPULion move it by lr every step (CUDA: +lr, CPU: "
            "-lr). Everything else steps as DeepSpeed's Lion does."
        )
        desc = f"fzero.optim.lion(lr={lr_text}, b1={b1:g}, b2={b2:g}, weight_decay={wd:g}{mask_text})  [DeepSpeed Lion: FusedLion]"
    else:  # sgd
        if as_float(f"{path}.dampening", p.get("dampening", 0)) != 0:
            raise NotImplementedError(f"{API}: {path}.dampening={p['dampening']} is not in fzero's sgd. Set it to 0.")
        mom = as_float(f"{path}.momentum", p.get("momentum", 0.0))
        nesterov = as_bool(f"{path}.nesterov", p.get("nesterov", False))
        if mask is None:
            opt = optim.sgd(schedule, momentum=mom, nesterov=nesterov, weight_decay=wd)
            desc = f"fzero.optim.sgd(lr={lr_text}, momentum={mom:g}, nesterov={nesterov}, weight_decay={wd:g})  [torch.optim.SGD]"
        else:  # torch SGD's d = g + wd * p, on the decayed params only, before the momentum
            decay, decay_text = _decay(wd, mask, mask_text)
            opt = optim.chain(decay, optim.sgd(schedule, momentum=mom, nesterov=nesterov))
            desc = (f"fzero.optim.chain({decay_text}, fzero.optim.sgd(lr={lr_text}, momentum={mom:g}, nesterov={nesterov}))"
                    f"  [torch.optim.SGD]")
    return opt, desc, schedule


def _no_decay(ctx: Ctx) -> list[str] | None:
    """The ``no_decay`` argument: the name substrings of the params that take no weight decay, or None."""
    value = ctx.arg("no_decay")
    if value is UNSET or value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(n, str) and n for n in value):
        raise TypeError(
            f"{API}: no_decay must be a list of parameter-name substrings whose params take no weight decay, as the "
            f"Hugging Face scripts write it (e.g. no_decay=['bias', 'LayerNorm.weight']); got {value!r}. For another rule, "
            f"pass fzero.compile(optimizer=fzero.optim.adamw(..., mask=fzero.optim.decay_mask)) instead."
        )
    return list(value)


def _mask(no_decay: list[str] | None, wd: float, wd_key: str, ctx: Ctx) -> tuple[Any, str]:
    """The decay mask of ``no_decay`` and its text for the description; (None, "") without one or with no decay."""
    if no_decay is None:
        return None, ""
    if not wd:
        ctx.notes.append(f"no_decay={no_decay!r}: no effect: {wd_key} is 0, so no param is decayed anyway.")
        return None, ""
    return optim.no_decay_names(no_decay), f", mask=fzero.optim.no_decay_names({no_decay!r})"


def _decay(wd: float, mask: Any, mask_text: str) -> tuple[Any, str]:
    """L2 decay added to the gradient, on the decayed params only when there is a mask."""
    if mask is None:
        return optim.add_decayed_weights(wd), f"add_decayed_weights({wd:g})"
    return optim.masked(optim.add_decayed_weights(wd), mask), f"masked(add_decayed_weights({wd:g}){mask_text})"


def _schedule(sched: dict, lr: float, kind: str, ctx: Ctx) -> tuple[Any, Any, str]:
    """The schedule (lr per step), OneCycle's momentum schedule (or None), and a description."""
    name, p = sched["type"], dict(sched.get("params") or {})
    last = p.pop("last_batch_iteration", -1)
    if last != -1:
        raise NotImplementedError(
            f"{API}: scheduler.params.last_batch_iteration={last}: resuming a schedule mid-way by this key is not in "
            f"fzero; a schedule reads the step count from the TrainState (restore the state from a checkpoint). Set it to -1."
        )
    kwargs = {k: (as_int(f"scheduler.params.{k}", v) if isinstance(v, float) and k.endswith(("steps", "_size", "count")) else v)
              for k, v in p.items()}
    if name == "WarmupCosineLR":
        kwargs["base_lr"] = lr  # DeepSpeed scales the optimizer's lr
    if name == "WarmupLR" and "warmup_max_lr" not in kwargs:
        kwargs["warmup_max_lr"] = lr  # DeepSpeed 0.19: warm up to the optimizer's lr
        ctx.notes.append(f"scheduler WarmupLR: warmup_max_lr not given, the optimizer's lr {lr:g} (DeepSpeed 0.19's rule)")
    try:
        schedule = SCHEDULES[name](**kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{API}: scheduler {name}: {e}") from None
    momentum = getattr(schedule, "momentum", None)
    if momentum is not None and kind == "sgd":
        ctx.notes.append("scheduler OneCycle: cycle_momentum has no effect with SGD, as in DeepSpeed (no betas to cycle).")
        momentum = None
    text = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return schedule, momentum, f"{SCHEDULES[name].__name__}({text})"
