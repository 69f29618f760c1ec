"""A checked DeepSpeed config mapped to ``Settings``: stage, precision, batch sizes, clipping, offload, hints."""

from __future__ import annotations

import json
import math
import types
from typing import Any

import torch

from fzero.config._optimizer import build_optimizer
from fzero.config._settings import Settings
from fzero.config._values import API, UNSET, Ctx, as_bool, as_float, as_int, dtype_name
from fzero.step import MAX_LOSS_SCALE, DynamicLossScale, Precision, StaticLossScale
from fzero import _rules


def to_settings(cfg: dict, ctx: Ctx, source: str, world_size: int | None) -> Settings:
    zero = cfg.get("zero_optimization") or {}
    stages = as_int("zero_optimization.stage", zero.get("stage", 0))
    _rules.check_stage(stages, api=API, stage_key="zero_optimization.stage")
    precision = _precision(cfg, ctx, stages)
    grad_accum, micro, total = _batch(cfg, ctx, world_size)
    clip = _clip(cfg, ctx)
    offload = _offload(zero, stages, ctx)
    unit_elements, prefetch = _hints(zero, stages, ctx)
    opt, description, lr = build_optimizer(cfg, ctx)
    curriculum = _curriculum(cfg)
    layer_drop = _layer_drop(cfg)
    sparse = _sparse_attention(cfg)
    steps_per_print = cfg.get("steps_per_print")
    if steps_per_print is not None:
        steps_per_print = as_int("steps_per_print", steps_per_print, low=1)
    return Settings(
        source=source, stages=stages, optimizer=opt, optimizer_description=description, learning_rate=lr,
        precision=precision, grad_accum=grad_accum, clip_grad_norm=clip, **offload, world_size=world_size,
        micro_batch_size=micro, train_batch_size=total, steps_per_print=steps_per_print,
        wall_clock_breakdown=as_bool("wall_clock_breakdown", cfg.get("wall_clock_breakdown", False)),
        unit_elements=unit_elements, prefetch=prefetch, curriculum=curriculum, progressive_layer_drop=layer_drop, sparse_attention=sparse, notes=tuple(ctx.notes), resolved=tuple(ctx.resolved),
        config=types.MappingProxyType(cfg),
    )


def _curriculum(cfg: dict) -> Any:
    """The "curriculum_learning" block as a ``fzero.data.Curriculum`` (None when absent or disabled)."""
    from fzero.data import Curriculum

    block = cfg.get("curriculum_learning")
    if not block or not as_bool("curriculum_learning.enabled", block.get("enabled", False)):
        return None
    try:
        return Curriculum.from_deepspeed({k: v for k, v in block.items() if k != "enabled"})
    except (ValueError, NotImplementedError) as e:  # the reader's name, the config key, and the reason
        raise type(e)(f"{API}: curriculum_learning: {str(e).split(': ', 1)[1]}") from e


def _sparse_attention(cfg: dict) -> Any:
    """The "sparse_attention" block as a layout of ``fzero.ops`` (``FixedLayout``, ``BigBirdLayout``, ...), or None."""
    block = cfg.get("sparse_attention")
    if block is None:  # absent. An empty block is DeepSpeed's default mode ("fixed") with that mode's defaults
        return None
    if not isinstance(block, dict):
        raise ValueError(f"{API}: sparse_attention must be a JSON object with a \"mode\", got {json.dumps(block)}.")
    from fzero.ops._sparse import from_deepspeed as layout_from_deepspeed

    try:
        return layout_from_deepspeed(block)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{API}: sparse_attention: {str(e).split(': ', 1)[-1]}") from e


def _layer_drop(cfg: dict) -> Any:
    """The "progressive_layer_drop" block as a ``fzero.models.ProgressiveLayerDrop`` (None when absent or disabled)."""
    from fzero.models import ProgressiveLayerDrop

    block = cfg.get("progressive_layer_drop")
    if not block or not as_bool("progressive_layer_drop.enabled", block.get("enabled", False)):
        return None
    theta = as_float("progressive_layer_drop.theta", block.get("theta", 0.5))
    gamma = as_float("progressive_layer_drop.gamma", block.get("gamma", 0.001))
    try:
        return ProgressiveLayerDrop(theta=theta, gamma=gamma)
    except ValueError as e:
        raise ValueError(f"{API}: progressive_layer_drop: {str(e).split(': ', 1)[1]}") from e


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}


def _precision(cfg: dict, ctx: Ctx, stages: int) -> Precision:
    fp16 = cfg.get("fp16") or {}
    bf16 = cfg.get("bf16") or cfg.get("bfloat16") or {}
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ValueError(f'{API}: both "bf16" and its old name "bfloat16" are given; keep "bf16".')
    fp16_on = as_bool("fp16.enabled", fp16.get("enabled", False))
    bf16_on = as_bool("bf16.enabled", bf16.get("enabled", False))
    if fp16_on and bf16_on:
        raise ValueError(f"{API}: fp16.enabled and bf16.enabled are both true; pick one (DeepSpeed refuses both too).")
    reduce = None
    comm = cfg.get("communication_data_type")
    if comm is not None:
        if comm not in _DTYPES:
            raise ValueError(f"{API}: communication_data_type must be one of \"fp32\", \"fp16\", \"bf16\", got {json.dumps(comm)}.")
        reduce = _DTYPES[comm]
    if fp16_on:
        scale = as_float("fp16.loss_scale", fp16.get("loss_scale", 0))
        power = as_int("fp16.initial_scale_power", fp16.get("initial_scale_power", 16))
        top = int(math.log2(MAX_LOSS_SCALE))
        for key, bad in (("loss_scale", scale > MAX_LOSS_SCALE), ("initial_scale_power", power > top)):
            if bad:  # as a float32 scale it is inf: every step would overflow and be skipped, forever
                raise ValueError(
                    f"{API}: fp16.{key}={json.dumps(fp16[key])} makes a loss scale above 2**{top}, the largest finite "
                    f"float32 power of two: held as a float32 it is inf, and every step would be skipped as an overflow. "
                    f"Write a value <= {top if key == 'initial_scale_power' else f'2**{top}'} (DeepSpeed's default "
                    f"initial_scale_power is 16)."
                )
        if scale > 0:
            loss_scale: Any = StaticLossScale(scale)
        else:
            hysteresis = as_int("fp16.hysteresis", fp16.get("hysteresis", 2), low=1)
            if stages == 0 and hysteresis != 1:
                # DeepSpeed's stage-0 fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) halve the scale at every
                # overflow; only ZeRO's optimizers (stages 1-3) read hysteresis
                ctx.notes.append(f"fp16.hysteresis={hysteresis}: DeepSpeed's fp16 optimizer at stage 0 has none (every "
                                 f"overflow halves the scale), and so has this step; stages 1-3 use it")
                hysteresis = 1
            loss_scale = DynamicLossScale(
                initial=2.0 ** power,
                window=as_int("fp16.loss_scale_window", fp16.get("loss_scale_window", 1000), low=1),
                hysteresis=hysteresis,
                min_scale=as_float("fp16.min_loss_scale", fp16.get("min_loss_scale", 1)),
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
            f"compute dtype ({dtype_name(prec.compute)}) is not in fzero. Drop it."
        )
    return prec


def _batch(cfg: dict, ctx: Ctx, world: int | None) -> tuple[int, int | None, int | None]:
    """(grad_accum, micro batch per rank, train batch), by DeepSpeed's rule train = micro * accum * world."""
    keys = {"train_batch_size": None, "train_micro_batch_size_per_gpu": "batch_size", "gradient_accumulation_steps": "grad_accum"}
    vals: dict[str, int | None] = {}
    autos = set()
    for key, arg in keys.items():
        raw = cfg.get(key)
        vals[key] = None
        if raw == "auto":
            autos.add(key)
            got = ctx.arg(arg) if arg else UNSET
            if got is not UNSET:
                vals[key] = as_int(f"{key} (from {arg}=)", got, low=1)
                ctx.resolved.append((key, vals[key], f"{arg}="))
        elif raw is not None:
            vals[key] = as_int(key, raw, low=1)
    train, micro, accum = vals.values()
    if (train is not None or "train_batch_size" in autos) and world is None:
        raise ValueError(
            f"{API}: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, so "
            f"it needs the world size: pass world_size= (fzero.compile passes its mesh's size)."
        )
    derived = []
    if train is None and "train_batch_size" in autos:
        # "auto" is the product of the other two: each must be in the config (a number, or an "auto" resolved by an
        # argument). An absent key is refused rather than taken as 1: the HF Trainer fills train_batch_size with its
        # own accumulation, which this config would then silently drop.
        absent = [key for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if key not in cfg]
        if absent:
            raise ValueError(
                f'{API}: train_batch_size "auto" is train_micro_batch_size_per_gpu x gradient_accumulation_steps x world '
                f"size, but the config has no {' and no '.join(absent)}. Write "
                + " and ".join(f'"{key}": {"1" if key.startswith("gradient") else "<samples per rank>"} (or "auto" with '
                               f"{keys[key]}=)" for key in absent)
                + ", or give train_batch_size as a number."
            )
        if micro is not None and accum is not None:
            train = micro * accum * world
            derived.append(("train_batch_size", train))
    elif train is not None and (micro is None or accum is None):
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
    missing = [f"{key}: pass {keys[key]}=" if keys[key] else f"{key}: follows from the other two (micro batch x "
               f"accumulation x world size) once they resolve" for key in sorted(autos) if still[key] is None]
    if missing:
        raise ValueError(f'{API}: "auto" values that no argument resolves:\n  ' + "\n  ".join(missing))
    for key in autos:
        cfg[key] = still[key]
    return accum or 1, micro, train


def _clip(cfg: dict, ctx: Ctx) -> float | None:
    if "gradient_clipping" not in cfg:
        ctx.notes.append("gradient_clipping not given: clip_grad_norm=1.0, DeepSpeed 0.19's default (write 0 for none)")
        return 1.0
    value = as_float("gradient_clipping", cfg["gradient_clipping"])
    return None if value == 0 else value


def _offload(zero: dict, stages: int, ctx: Ctx) -> dict[str, Any]:
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
    given = {setting: f"zero_optimization.{key}" for setting, key, device in
             (("offload", "offload_optimizer", where), ("offload_params", "offload_param", pwhere)) if device != "none"}
    _rules.check_settings(stages, given, api=API, stage_key="zero_optimization.stage")
    out: dict[str, Any] = {"offload": None, "offload_params": False, "offload_dir": None, "sub_group_size": None}
    if pwhere != "none":
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
        out["sub_group_size"] = as_int("zero_optimization.sub_group_size", zero["sub_group_size"], low=1)
        if where == "cpu":
            ctx.notes.append(f"zero_optimization.sub_group_size={json.dumps(zero['sub_group_size'])}: accepted, no effect here: "
                             f"fzero's cpu offload updates each shard whole; sub-groups size the nvme offload's updates.")
    for name, block in (("offload_optimizer", opt), ("offload_param", par)):
        if "pin_memory" in block:
            as_bool(f"zero_optimization.{name}.pin_memory", block["pin_memory"])
            ctx.notes.append(f"zero_optimization.{name}.pin_memory={json.dumps(block['pin_memory'])}: accepted, no effect "
                             f"here: fzero pins its host buffers whenever CUDA is available.")
    if "cpu_offload_use_pin_memory" in zero:
        ctx.notes.append("zero_optimization.cpu_offload_use_pin_memory: accepted, no effect here: fzero pins its host "
                         "buffers whenever CUDA is available.")
    return out


def _hints(zero: dict, stages: int, ctx: Ctx) -> tuple[int | None, bool | None]:
    """Bucket sizes -> unit_elements (for stages 0-1, where the flat buffers are the buckets); the prefetch size
    and overlap_comm -> prefetch (for stage 3). Both are kept whatever the stage: a keyword may change it."""
    buckets = {k: as_int(f"zero_optimization.{k}", zero[k], low=1) for k in ("reduce_bucket_size", "allgather_bucket_size") if k in zero}
    # one flat buffer is both the reduction bucket and (stage 1) the all-gather bucket: the smaller bounds both
    unit_elements = min(buckets.values()) if buckets else None
    if buckets and not _rules.accepts("unit_elements", stages):
        ctx.notes.append(f"zero_optimization.{'/'.join(buckets)}: not carried over at stage {stages} (units are modules "
                         f"there; units=). fzero.compile(..., bucket_elements=n) reduces consecutive units together; a "
                         f"config's value is not taken as n because DeepSpeed's default (5e8) would hold the whole "
                         f"gradient. At stages 0-1 it would set unit_elements={unit_elements}.")
    size_key = next((k for k in ("stage3_prefetch_bucket_size", "prefetch_bucket_size") if k in zero), None)
    size = None if size_key is None else as_int(f"zero_optimization.{size_key}", zero[size_key])
    overlap = None if zero.get("overlap_comm") is None else as_bool("zero_optimization.overlap_comm", zero["overlap_comm"])
    prefetch = None
    if size is not None or overlap is not None:
        prefetch = size != 0 and overlap is not False  # either one switches prefetching off, as in DeepSpeed
        if not _rules.accepts("prefetch", stages):
            given = ", ".join(f"{k}={json.dumps(v)}" for k, v in ((size_key, size), ("overlap_comm", overlap)) if v is not None)
            ctx.notes.append(f"zero_optimization.{given}: no effect at stage {stages}: it sets fzero's prefetch, at stage 3 "
                             f"(stages 0-2 run their collectives in order).")
    return unit_elements, prefetch
