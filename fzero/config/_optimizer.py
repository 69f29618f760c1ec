"""A DeepSpeed optimizer and scheduler block as a ``fzero.optim`` transform with its schedule."""

from __future__ import annotations

import json
from typing import Any

from fzero import optim
from fzero.config._schema import SCHEDULES
from fzero.config._values import API, Ctx, as_bool, as_float, as_int


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
    betas = p.get("betas", [0.9, 0.99] if kind == "lion" else [0.9, 0.999])
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
    wd = as_float(f"{path}.weight_decay", p.get("weight_decay", 0.0))
    if kind == "lamb":
        eps = as_float(f"{path}.eps", p.get("eps", 1e-8))  # FusedLamb's default (fzero.optim.lamb's own is 1e-6)
        max_coeff, min_coeff = as_float(f"{path}.max_coeff", p.get("max_coeff", 10.0)), as_float(f"{path}.min_coeff", p.get("min_coeff", 0.01))
        opt = optim.lamb(schedule, b1=b1, b2=b2, eps=eps, weight_decay=wd, max_coeff=max_coeff, min_coeff=min_coeff)
        desc = (f"fzero.optim.lamb(lr={lr_text}, b1={b1:g}, b2={b2:g}, eps={eps:g}, weight_decay={wd:g}, "
                f"max_coeff={max_coeff:g}, min_coeff={min_coeff:g})  [DeepSpeed Lamb: FusedLamb]")
    elif kind == "lion":
        opt = optim.lion(schedule, b1=b1, b2=b2, weight_decay=wd)
        desc = f"fzero.optim.lion(lr={lr_text}, b1={b1:g}, b2={b2:g}, weight_decay={wd:g})  [DeepSpeed Lion: FusedLion]"
    else:  # sgd
        if as_float(f"{path}.dampening", p.get("dampening", 0)) != 0:
            raise NotImplementedError(f"{API}: {path}.dampening={p['dampening']} is not in fzero's sgd. Set it to 0.")
        mom = as_float(f"{path}.momentum", p.get("momentum", 0.0))
        nesterov = as_bool(f"{path}.nesterov", p.get("nesterov", False))
        opt = optim.sgd(schedule, momentum=mom, nesterov=nesterov, weight_decay=wd)
        desc = f"fzero.optim.sgd(lr={lr_text}, momentum={mom:g}, nesterov={nesterov}, weight_decay={wd:g})  [torch.optim.SGD]"
    return opt, desc, schedule


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
