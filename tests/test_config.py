"""DeepSpeed config files as fzero settings (``fzero.config.from_deepspeed``) and ``fzero.compile(config=...)``.

The configs in tests/configs/ have the shapes DeepSpeed's documentation and the Hugging Face / Lightning guides
publish: the HF ZeRO-2 (fp16, AdamW, WarmupDecayLR, "auto" everywhere) and ZeRO-3 (CPU offload of optimizer and
params) templates, DeepSpeed's getting-started config (old boolean ``zero_optimization``), a DeepSpeed ZeRO-3
offload config without "auto", and Lightning's OneBitAdam + WarmupLR example. Where DeepSpeed is installed,
its own config parser and scheduler classes read the same configs and must agree.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import fzero
import fzero.optim as fo
from fzero.config import Settings, from_deepspeed
from problems import mlp_problem

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
HF_ZERO2 = os.path.join(CONFIGS, "hf_zero2_fp16_auto.json")
HF_ZERO3 = os.path.join(CONFIGS, "hf_zero3_offload_auto.json")
DS_START = os.path.join(CONFIGS, "ds_getting_started.json")
DS_ZERO3 = os.path.join(CONFIGS, "ds_zero3_offload.json")
ONEBIT = os.path.join(CONFIGS, "lightning_onebitadam_warmuplr.json")
HF_ARGS = dict(learning_rate=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=10, total_steps=100,
               clip_grad_norm=1.0, batch_size=4, grad_accum=2)


def load(path):
    with open(path) as f:
        return json.load(f)


# -- the published shapes ------------------------------------------------------------------------------------------


def test_hf_zero2_auto_needs_its_arguments_and_names_them():
    with pytest.raises(ValueError, match=r'"auto" values that no argument resolves') as err:
        from_deepspeed(HF_ZERO2, world_size=2)
    text = str(err.value)
    for key, arg in (("fp16.enabled", "precision"), ("optimizer.params.lr", "learning_rate"), ("optimizer.params.betas", "betas"),
                     ("scheduler.params.warmup_num_steps", "warmup_steps"), ("scheduler.params.total_num_steps", "total_steps"),
                     ("gradient_clipping", "clip_grad_norm")):
        assert f"{key}: pass {arg}=" in text
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu: pass batch_size="):
        from_deepspeed(HF_ZERO2, world_size=2, precision="fp16", **{k: v for k, v in HF_ARGS.items() if k != "batch_size"})


def test_hf_zero2_fp16_adamw_warmup_decay():
    s = from_deepspeed(HF_ZERO2, world_size=2, precision="fp16", **HF_ARGS)
    assert s.stages == 2 and s.grad_accum == 2 and s.clip_grad_norm == 1.0
    assert (s.micro_batch_size, s.train_batch_size, s.batch_per_rank) == (4, 16, 8)
    assert s.precision == fzero.Precision(compute=torch.float16, loss_scale=fzero.DynamicLossScale(2.0**16, 1000, 2, 1.0))
    assert s.optimizer_description.startswith("fzero.optim.adamw(lr=warmup_decay_lr(")
    assert "b2=0.95" in s.optimizer_description and "weight_decay=0.1" in s.optimizer_description
    expected = fo.warmup_decay_lr(warmup_min_lr=0.0, warmup_max_lr=3e-4, warmup_num_steps=10, total_num_steps=100)
    assert [s.learning_rate(k) for k in range(120)] == [expected(k) for k in range(120)]
    assert s.optimizer.learning_rate is s.learning_rate
    # knobs: bucket sizes are a stage 0-1 hint, overlap_comm a stage-3 one; both noted at stage 2, kept for a keyword
    assert (s.unit_elements, s.prefetch) == (200_000_000, True)
    assert "unit_elements" not in s.compile_kwargs() and s.compile_kwargs(stages=1)["unit_elements"] == 200_000_000
    notes = "\n".join(s.notes)
    for key in ("contiguous_gradients", "reduce_scatter", "allgather_partitions", "overlap_comm", "reduce_bucket_size"):
        assert f"zero_optimization.{key}" in notes
    assert dict((p, v) for p, v, _ in s.resolved)["scheduler.params.warmup_min_lr"] == 0.0
    assert s.config["optimizer"]["params"]["betas"] == [0.9, 0.95] and s.config["train_batch_size"] == 16
    text = str(s)  # printable: the settings, what "auto" became, what had no effect
    for part in ("stages                2", "fp16 (fp32 master weights: True", '"auto" resolved:',
                 "optimizer.params.lr = 0.0003  (learning_rate=)", "train_batch_size 16 = 4 per rank x 2 micro-batches x 2 ranks",
                 "zero_optimization.contiguous_gradients=true: accepted, no effect here"):
        assert part in text, part


def test_hf_zero3_cpu_offload_of_optimizer_and_params():
    s = from_deepspeed(HF_ZERO3, world_size=2, precision="bf16", hidden_size=64,
                       **{k: v for k, v in HF_ARGS.items() if k != "total_steps"})
    assert (s.stages, s.offload, s.offload_params, s.offload_dir, s.sub_group_size) == (3, "cpu", True, None, 10**9)
    assert s.precision == fzero.Precision(compute=torch.bfloat16)
    assert s.prefetch is True  # stage3_prefetch_bucket_size "auto" = 0.9 * 64**2 > 0, overlap_comm true
    assert s.config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert s.config["zero_optimization"]["stage3_param_persistence_threshold"] == 640
    assert s.config["fp16"]["enabled"] is False and s.config["bf16"]["enabled"] is True
    kwargs = s.compile_kwargs()
    assert {k: kwargs[k] for k in ("stages", "offload", "offload_params", "sub_group_size", "prefetch")} == {
        "stages": 3, "offload": "cpu", "offload_params": True, "sub_group_size": 10**9, "prefetch": True}
    assert [s.learning_rate(k) for k in (0, 1, 11, 50)] == [0.0, 0.0, 3e-4, 3e-4]  # WarmupLR's log warmup, then flat
    notes = "\n".join(s.notes)
    for key in ("stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
                "stage3_param_persistence_threshold", "offload_param.pin_memory"):
        assert key in notes, key


def test_zero_infinity_nvme_offload_of_optimizer_and_params(tmp_path):
    s = from_deepspeed(with_(zero_optimization__stage=3, zero_optimization__offload_param={"device": "nvme", "nvme_path": str(tmp_path)},
                             zero_optimization__offload_optimizer={"device": "nvme"}))
    assert (s.stages, s.offload, s.offload_params, s.offload_dir) == (3, "nvme", True, str(tmp_path))


def test_onebitadam_with_warmuplr_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"optimizer.type='OneBitAdam' is 1-bit Adam .*fzero does not implement.*AdamW"):
        from_deepspeed(ONEBIT, world_size=2)
    cfg = load(ONEBIT)  # the same file with Adam: the rest of it maps (old cpu_offload key included)
    cfg["optimizer"]["type"] = "Adam"
    del cfg["optimizer"]["params"]["cuda_aware"]
    s = from_deepspeed(cfg)
    assert (s.stages, s.offload, s.offload_params) == (2, "cpu", False)
    assert s.learning_rate(101) == 3e-5


def test_deepspeed_getting_started_config():
    s = from_deepspeed(DS_START, world_size=2)
    assert s.stages == 1  # "zero_optimization": true is DeepSpeed's old form of stage 1
    assert (s.micro_batch_size, s.grad_accum, s.train_batch_size) == (4, 1, 8)
    assert s.clip_grad_norm == 1.0 and any("DeepSpeed 0.19's default" in n for n in s.notes)
    assert s.precision.compute == torch.float16 and isinstance(s.precision.loss_scale, fzero.DynamicLossScale)
    # "Adam" is decoupled in DeepSpeed (adam_w_mode defaults to true), FusedAdam's weight decay defaults to 0
    assert s.optimizer_description.startswith("fzero.optim.adamw(lr=0.00015, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0)")


# -- refusing what fzero does not know or have ---------------------------------------------------------------------

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}


def with_(**changes):
    cfg = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        *parents, key = path.split("__")
        block = cfg
        for p in parents:
            block = block.setdefault(p, {})
        block[key] = value
    return cfg


@pytest.mark.parametrize("cfg, match", [
    (with_(gradient_clipings=1.0), r"unknown key 'gradient_clipings'.*Did you mean 'gradient_clipping'\?"),
    (with_(zero_optimization__stage3_prefetch_bucket_sizes=10), r"'zero_optimization.stage3_prefetch_bucket_sizes'.*Did you mean 'stage3_prefetch_bucket_size'"),
    (with_(zero_optimization__offload_optimizer={"device": "cpu", "pin_memmory": True}), r"'zero_optimization.offload_optimizer.pin_memmory'.*'pin_memory'"),
    (with_(fp16={"enabled": True, "initial_scale_pow": 8}), r"'fp16.initial_scale_pow'.*Did you mean 'initial_scale_power'"),
    (with_(optimizer__params={"lr": 1e-3, "weight_decays": 0.1}), r"'optimizer.params.weight_decays'.*Did you mean 'weight_decay'"),
    (with_(optimizer__type="AdamWW"), r"unknown optimizer.type 'AdamWW'. Did you mean 'AdamW'"),
    (with_(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}}), r"'scheduler.params.warmup_num_step'.*'warmup_num_steps'"),
    (with_(scheduler={"type": "WarmupDecay", "params": {}}), r"unknown scheduler.type 'WarmupDecay'. Did you mean 'WarmupDecayLR'"),
    (with_(optimizer__params={"lr": 1e-3, "max_grad_norm": 1.0}), r"max_grad_norm is not how DeepSpeed clips.*gradient_clipping"),
    (with_(gradient_clipping=float("inf")), r"gradient_clipping must be a finite number >= 0, got Infinity\."),
    (with_(train_batch_size=10), r"train_batch_size.*needs the world size: pass world_size="),
    (with_(zero_optimization__stage="auto"), r"zero_optimization.stage: nothing resolves it in fzero; write a value"),
    (with_(fp16={"enabled": True}, bf16={"enabled": True}), r"fp16.enabled and bf16.enabled are both true"),
    (with_(zero_optimization__offload_optimizer={"device": "nvme"}), r"device is \"nvme\" but nvme_path is missing"),
    (with_(zero_optimization__offload_param={"device": "cpu"}, zero_optimization__offload_optimizer={"device": "cpu"}),
     r"zero_optimization.offload_param needs zero_optimization.stage=3.*but zero_optimization.stage=2"),
])
def test_config_errors_name_the_key_and_the_fix(cfg, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed(cfg)


@pytest.mark.parametrize("cfg, match", [
    (with_(zero_optimization__zero_quantized_gradients=True), r"ZeRO\+\+ quantized gradients \(qgZ\)"),
    (with_(zero_optimization__zero_hpz_partition_size=8), r"ZeRO\+\+ hierarchical partitioning"),
    (with_(sequence_parallel_size=2), r"sequence parallelism"),
    (with_(optimizer__type="Adagrad"), r"'Adagrad' is Adagrad, which fzero does not implement"),
    (with_(optimizer__type="RMSprop"), r"torch.optim.RMSprop, which fzero does not implement"),
    (with_(optimizer__params={"amsgrad": True}), r"amsgrad=true is not in fzero's adamw"),
    (with_(fp16={"enabled": True, "consecutive_hysteresis": True}), r"consecutive_hysteresis"),
    (with_(zero_optimization__stage=3, zero_optimization__offload_param={"device": "cpu"}), r"offload_param without offload_optimizer"),
    (with_(zero_optimization__stage=3, zero_optimization__offload_param={"device": "cpu"},
           zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}), r"offload_param to 'cpu'.*'nvme'.*same device"),
    (with_(zero_optimization__stage=3, zero_optimization__offload_param={"device": "nvme", "nvme_path": "/a"},
           zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}), r"nvme_path=\"/a\" differs"),
    (with_(optimizer={"type": "Lamb", "params": {}}, scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}),
     r"OneCycle cycles the first beta of Lamb.*cycle_momentum to false"),
    (with_(scheduler={"type": "WarmupLR", "params": {"last_batch_iteration": 5}}), r"last_batch_iteration=5: resuming"),
    (with_(amp={"enabled": True}), r"NVIDIA Apex AMP"),
])
def test_unsupported_features_are_refused_by_name(cfg, match):
    with pytest.raises(NotImplementedError, match=match):
        from_deepspeed(cfg)


def test_disabled_features_and_no_effect_keys_are_accepted_and_noted():
    s = from_deepspeed(with_(amp={"enabled": False}, zero_optimization__zero_quantized_gradients=False,
                             tensorboard={"enabled": True, "output_path": "logs/"}, activation_checkpointing={"partition_activations": True}))
    notes = "\n".join(s.notes)
    assert 'amp={"enabled": false}: accepted, no effect here: NVIDIA Apex AMP is not in fzero, and it is off' in notes
    assert "tensorboard=" in notes and "activation_checkpointing=" in notes and "fzero.remat" in notes


def test_arguments_that_resolve_nothing_are_refused():
    with pytest.raises(ValueError, match=r"learning_rate= given, but the config has no \"auto\" that it resolves"):
        from_deepspeed(BASE, learning_rate=1e-3)


def test_batch_sizes_follow_deepspeeds_rule():
    s = from_deepspeed(with_(train_batch_size=32, gradient_accumulation_steps=4), world_size=4)
    assert (s.micro_batch_size, s.grad_accum, s.train_batch_size) == (2, 4, 32)
    s = from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert s.grad_accum == 4  # derived
    with pytest.raises(ValueError, match=r"train_batch_size=30 must equal train_micro_batch_size_per_gpu \(2\) x "
                                         r"gradient_accumulation_steps \(4\) x world size \(4\) = 32"):
        from_deepspeed(with_(train_batch_size=30, gradient_accumulation_steps=4), world_size=4)


# -- DeepSpeed's semantics of the optimizer block ------------------------------------------------------------------


def one_update(opt, p, g):
    state = opt.init({"w": p})
    updates, _ = opt.update({"w": g}, state, {"w": p})
    return fo.apply_updates({"w": p}, updates)["w"]


@pytest.mark.parametrize("params, torch_opt", [
    ({"lr": 0.1, "weight_decay": 0.5, "torch_adam": True}, lambda w: torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)),
    ({"lr": 0.1, "torch_adam": True}, lambda w: torch.optim.AdamW([w], lr=0.1)),  # torch's AdamW decay default, 0.01
    ({"lr": 0.1, "weight_decay": 0.5, "adam_w_mode": False, "torch_adam": True}, lambda w: torch.optim.Adam([w], lr=0.1, weight_decay=0.5)),
    ({"lr": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}, lambda w: torch.optim.AdamW([w], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.0)),
])
def test_adam_block_is_the_torch_optimizer_deepspeed_builds(params, torch_opt):
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    ours = one_update(from_deepspeed({"optimizer": {"type": "Adam", "params": params}}).optimizer, p, g)
    w = p.clone().requires_grad_()
    ref = torch_opt(w)
    w.grad = g.clone()
    ref.step()
    torch.testing.assert_close(ours, w.detach(), rtol=1e-6, atol=1e-7)


def test_sgd_lamb_lion_blocks():
    s = from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}})
    assert "sgd(lr=0.1, momentum=0.9, nesterov=True" in s.optimizer_description
    s = from_deepspeed({"optimizer": {"type": "Lamb", "params": {"lr": 0.01}}})
    assert "eps=1e-08" in s.optimizer_description  # FusedLamb's default, not fzero.optim.lamb's 1e-6
    s = from_deepspeed({"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.1}}})
    assert "lion(lr=0.0001, b1=0.9, b2=0.999, weight_decay=0.1)" in s.optimizer_description  # FusedLion's default betas


def test_lion_block_without_betas_steps_as_deepspeeds_lion():
    """DeepSpeed builds FusedLion (DeepSpeedCPULion with offload) with its default betas (0.9, 0.999), not the Lion
    paper's (0.9, 0.99): b2 decides the momentum from the second step on, so compare several steps."""
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) + 0.3 * k for k in range(6)]
    ref, m = p0.clone(), torch.zeros_like(p0)
    for g in grads:  # DeepSpeed's Lion: p -= lr * sign(b1 * m + (1 - b1) * g), then m = b2 * m + (1 - b2) * g
        ref -= 1e-3 * torch.sign(0.9 * m + (1 - 0.9) * g)
        m = 0.999 * m + (1 - 0.999) * g
    opt = from_deepspeed({"optimizer": {"type": "Lion", "params": {"lr": 1e-3}}}).optimizer
    params = {"w": p0.clone()}
    state = opt.init(params)
    for g in grads:
        state = fo.apply_inplace(opt, {"w": g}, state, params)
    torch.testing.assert_close(params["w"], ref, rtol=0, atol=0)
    try:  # and that is what DeepSpeed defaults to, where it is installed
        import inspect
        from deepspeed.ops.lion.cpu_lion import DeepSpeedCPULion
        from deepspeed.ops.lion.fused_lion import FusedLion
    except ImportError:
        return
    for cls in (FusedLion, DeepSpeedCPULion):
        assert inspect.signature(cls.__init__).parameters["betas"].default == (0.9, 0.999)


# -- schedules: against DeepSpeed's own classes, given the same config block ----------------------------------------

SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "warmup_type": "linear"},
    "WarmupLR_no_max": {"warmup_min_lr": 0.001, "warmup_num_steps": 6},  # DeepSpeed 0.19 warms up to the optimizer's lr
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5, "total_num_steps": 30},
    "WarmupCosineLR": {"total_num_steps": 30, "warmup_num_steps": 4, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01},
    "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 6, "decay_lr_rate": 0.1,
                 "decay_step_size": 4, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 5, "lr_range_test_step_rate": 2.0},
}
OPT_LR = 0.02


def schedule_config(case):
    return {"optimizer": {"type": "Adam", "params": {"lr": OPT_LR}},
            "scheduler": {"type": case.split("_")[0], "params": dict(SCHEDULES[case])}}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_schedule_equals_deepspeeds_scheduler_from_the_same_block(case):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    cfg = schedule_config(case)
    s = from_deepspeed(cfg)
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([param], lr=OPT_LR)
    sched = getattr(lr_schedules, cfg["scheduler"]["type"])(opt, **cfg["scheduler"]["params"])
    momentum = getattr(s.learning_rate, "momentum", None)
    for k in range(40):
        group = opt.param_groups[0]  # what DeepSpeed's k-th optimizer step reads
        assert s.learning_rate(k) == group["lr"], (case, k)
        if momentum is not None:
            assert (momentum(k), 0.99) == tuple(group["betas"]), (case, k)  # and b2 = 0.99, as fzero's adamw gets
        sched.step()
    if momentum is not None:
        assert "b1=cycled momentum, b2=0.99" in s.optimizer_description


def test_schedules_by_formula():  # always runs, with or without DeepSpeed
    s = from_deepspeed(schedule_config("WarmupLR_no_max"))
    assert s.learning_rate(1) == 0.001 and s.learning_rate(7) == OPT_LR
    s = from_deepspeed(schedule_config("WarmupCosineLR"))
    assert s.learning_rate(0) == 0.0 and s.learning_rate(30) == pytest.approx(OPT_LR * 0.01)
    s = from_deepspeed(schedule_config("WarmupDecayLR"))
    assert s.learning_rate(6) == 0.01 and s.learning_rate(31) == 0.0


@pytest.mark.parametrize("path, args", [(HF_ZERO2, dict(HF_ARGS, precision="fp16")), (DS_START, {}), (DS_ZERO3, {}),
                                        (HF_ZERO3, dict(HF_ARGS, precision="bf16", hidden_size=64, total_steps=None))])
def test_deepspeeds_parser_reads_the_same_settings(monkeypatch, path, args):
    pytest.importorskip("deepspeed")
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    world = 2
    s = from_deepspeed(path, world_size=world, **{k: v for k, v in args.items() if v is not None})
    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(comm, "get_world_size", lambda *a, **k: world)
    ds = DeepSpeedConfig(json.loads(json.dumps(dict(s.config))))  # the config with "auto" resolved
    assert ds.world_size == world
    assert (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (s.micro_batch_size, s.grad_accum)
    assert ds.train_batch_size == s.micro_batch_size * s.grad_accum * world
    assert ds.zero_optimization_stage == s.stages
    assert (ds.gradient_clipping or None) == s.clip_grad_norm
    zero = ds.zero_config
    assert (zero.offload_optimizer.device if zero.offload_optimizer else "none") == (s.offload or "none")
    assert (zero.offload_param is not None and zero.offload_param.device != "none") == s.offload_params
    fp16 = ds.float16_config
    assert fp16.enabled == (s.precision.compute == torch.float16)
    assert ds.bfloat16_config.enabled == (s.precision.compute == torch.bfloat16)
    if fp16.enabled:
        ls = s.precision.loss_scale
        assert (2.0 ** fp16.initial_scale_power, fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (
            ls.initial, ls.window, ls.hysteresis, ls.min_scale)


# -- fzero.compile(config=...) ---------------------------------------------------------------------------------------


def train(step, prob):
    state = step.init(fzero.params_of(prob.model))
    losses = []
    for b in prob.batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    return step.gather(state), losses


@pytest.mark.parametrize("name", ["getting_started", "hf_zero2", "zero3_offload"])
def test_compile_with_a_config_equals_the_same_settings_as_keywords(name):
    mesh = fzero.local_mesh(2)
    if name == "getting_started":  # stage 1 (old boolean form), fp16, DeepSpeed's Adam = AdamW with decay 0
        prob = mlp_problem(steps=3, batch=8)
        step = fzero.compile(prob.loss_fn, config=DS_START, mesh=mesh)
        ref = fzero.compile(prob.loss_fn, optimizer=fo.adamw(1.5e-4, weight_decay=0.0), stages=1, precision="fp16",
                            clip_grad_norm=1.0, mesh=mesh)
    elif name == "hf_zero2":  # "auto" resolved through compile's own keywords and the resolve keywords
        prob = mlp_problem(steps=3, batch=2 * 4 * 2)
        step = fzero.compile(prob.loss_fn, config=HF_ZERO2, mesh=mesh, precision="bf16", grad_accum=2, clip_grad_norm=0.5,
                             learning_rate=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=1,
                             total_steps=10, batch_size=4)
        sched = fo.warmup_decay_lr(warmup_min_lr=0.0, warmup_max_lr=1e-2, warmup_num_steps=1, total_num_steps=10)
        ref = fzero.compile(prob.loss_fn, optimizer=fo.adamw(sched, b2=0.95, weight_decay=0.1), stages=2, precision="bf16",
                            grad_accum=2, clip_grad_norm=0.5, mesh=mesh)
    else:  # ZeRO-3, bf16, optimizer and params offloaded to the host, WarmupCosineLR, 4 micro-batches
        prob = mlp_problem(steps=3, batch=4 * 4 * 2)
        step = fzero.compile(prob.loss_fn, config=DS_ZERO3, mesh=mesh)
        sched = fo.warmup_cosine_lr(base_lr=1e-3, total_num_steps=20, warmup_num_steps=3, warmup_type="linear")
        ref = fzero.compile(prob.loss_fn, optimizer=fo.adamw(sched, b2=0.95, weight_decay=0.1), stages=3, precision="bf16",
                            grad_accum=4, clip_grad_norm=1.0, offload="cpu", offload_params=True, sub_group_size=10**9,
                            prefetch=True, mesh=mesh)
    assert (step.stage, step.precision, step.grad_accum, step.clip_grad_norm, step.offload) == (
        ref.stage, ref.precision, ref.grad_accum, ref.clip_grad_norm, ref.offload)
    (params, losses), (ref_params, ref_losses) = train(step, prob), train(ref, prob)
    assert losses == ref_losses
    torch.testing.assert_close(params, ref_params, rtol=0, atol=0)
    initial = fzero.params_of(prob.model)
    assert all(not torch.equal(params[k], initial[k]) for k in initial)  # it trained


def test_compile_keywords_win_over_the_config():
    prob = mlp_problem(steps=1)
    mesh = fzero.local_mesh(2)
    sgd = fo.sgd(0.1)
    step = fzero.compile(prob.loss_fn, config=DS_START, mesh=mesh, stages=3, optimizer=sgd, precision="bf16", clip_grad_norm=2.0)
    assert (step.stage, step.optimizer, step.precision.compute, step.clip_grad_norm) == (3, sgd, torch.bfloat16, 2.0)
    s = from_deepspeed(DS_ZERO3, world_size=2)
    step = fzero.compile(prob.loss_fn, config=s, mesh=mesh, stages=1)  # Settings too; the stage-0-1 hint then applies
    assert (step.stage, step.unit_elements, step.offload.where, step.offload.params) == (1, 10**7, "cpu", False)
    with pytest.raises(ValueError, match=r"checked for world_size=2, but the mesh has 4 ranks"):
        fzero.compile(prob.loss_fn, config=s, mesh=fzero.local_mesh(4))
    with pytest.raises(ValueError, match=r"total_steps= given, but the config has no \"auto\""):
        fzero.compile(prob.loss_fn, config=DS_START, mesh=mesh, total_steps=10)


def test_an_optimizer_keyword_does_not_drop_the_configs_scheduler():
    """fzero's schedule lives in the optimizer, so optimizer= would drop a config's "scheduler" block without a word
    (it trained at the given optimizer's constant lr); DeepSpeed applies the config's scheduler to a client optimizer.
    Refused, unless the given optimizer scales by the config's own schedule."""
    prob = mlp_problem(steps=4)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_max_lr": 0.01, "warmup_num_steps": 3}}}
    with pytest.raises(ValueError, match=r"optimizer= replaces the config's optimizer, and with it the schedule of its "
                                         r"\"scheduler\" block \(WarmupDecayLR\).*settings\.learning_rate"):
        fzero.compile(prob.loss_fn, config=config, optimizer=fo.adamw(0.01, mask=fo.decay_mask))
    settings = from_deepspeed(config)
    with pytest.raises(ValueError, match=r"the schedule of its \"scheduler\" block"):
        fzero.compile(prob.loss_fn, config=settings, optimizer=fo.sgd(0.1))
    # the way that keeps it: the optimizer built on settings.learning_rate, with those settings
    step = fzero.compile(prob.loss_fn, config=settings, optimizer=fo.adamw(settings.learning_rate, mask=fo.decay_mask))
    state = step.init(fzero.params_of(prob.model))
    lrs = []
    for b in prob.batches:
        state, metrics = step(state, b)
        lrs.append(metrics["lr"])
    assert lrs == [settings.learning_rate(k) for k in range(4)] and lrs[0] == 0.0 and lrs[3] == 0.01
    # groups at other learning rates on the same schedule (DeepSpeed's scheduler moves every client group): one group on
    # settings.learning_rate, the others on schedules of the user's own
    with pytest.raises(ValueError, match=r"for groups at other learning rates, a multi_transform"):
        fzero.compile(prob.loss_fn, config=settings, optimizer=fo.multi_transform(
            {"a": fo.adamw(0.01), "b": fo.adamw(0.001)}, lambda params: {k: "a" if v.ndim > 1 else "b" for k, v in params.items()}))
    tenth = lambda t: 0.1 * settings.learning_rate(t)  # noqa: E731
    # a group at a constant rate beside the scheduled one: DeepSpeed's scheduler would set its lr too (refused, named)
    for other in (fo.adamw(0.001), fo.multi_transform({"c": fo.adamw(tenth), "d": fo.sgd(0.1)}, lambda params: "d")):
        with pytest.raises(ValueError, match=r"groups \['b.*'\] run at a constant learning rate"):
            fzero.compile(prob.loss_fn, config=settings, optimizer=fo.multi_transform(
                {"a": fo.adamw(settings.learning_rate), "b": other},
                lambda params: {k: "a" if v.ndim > 1 else "b" for k, v in params.items()}))
    frozen = fo.multi_transform({"a": fo.adamw(settings.learning_rate), "b": fo.set_to_zero()},
                                lambda params: {k: "a" if v.ndim > 1 else "b" for k, v in params.items()})
    fzero.compile(prob.loss_fn, config=settings, optimizer=frozen)  # nothing to schedule in a frozen group
    groups = fo.multi_transform({"a": fo.adamw(settings.learning_rate), "b": fo.adamw(tenth)},
                                lambda params: {k: "a" if v.ndim > 1 else "b" for k, v in params.items()})
    step = fzero.compile(prob.loss_fn, config=settings, optimizer=groups)
    model = prob.model
    ref = {k: v.detach().clone().requires_grad_(True) for k, v in fzero.params_of(model).items()}
    torch_opt = torch.optim.AdamW([{"params": [v for v in ref.values() if v.ndim > 1]},
                                   {"params": [v for v in ref.values() if v.ndim == 1]}], lr=0.0, weight_decay=0.01)
    state = step.init(fzero.params_of(model))
    for k, b in enumerate(prob.batches):
        state, _ = step(state, b)
        torch_opt.param_groups[0]["lr"], torch_opt.param_groups[1]["lr"] = settings.learning_rate(k), tenth(k)
        torch_opt.zero_grad()
        prob.loss_fn(ref, b).backward()
        torch_opt.step()
    got = step.gather(state)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v.detach(), rtol=1e-5, atol=1e-6)
    # a config without a scheduler: the keyword wins, as every keyword does
    no_schedule = {k: v for k, v in config.items() if k != "scheduler"}
    assert fzero.compile(prob.loss_fn, config=no_schedule, optimizer=fo.sgd(0.1)).optimizer.learning_rate == 0.1


def test_settings_are_frozen_and_replaceable():
    s = from_deepspeed(DS_START, world_size=2)
    with pytest.raises(AttributeError):
        s.stages = 2
    assert isinstance(s, Settings) and s.replace(stages=2).compile_kwargs()["stages"] == 2
    assert math.isclose(s.learning_rate, 1.5e-4)


def test_fp16_hysteresis_is_deepspeeds_per_stage():
    """DeepSpeed's stage-0 fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) have no hysteresis: every overflow
    halves the scale; ZeRO's (stages 1-3) read fp16.hysteresis. The same config gives each stage its DeepSpeed rule."""
    fp16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2}
    at0 = from_deepspeed({"fp16": fp16})
    at1 = from_deepspeed({"fp16": fp16, "zero_optimization": {"stage": 1}})
    assert (at0.precision.loss_scale.hysteresis, at1.precision.loss_scale.hysteresis) == (1, 2)
    assert any(n.startswith("fp16.hysteresis=2") and "stage 0" in n for n in at0.notes)


def test_an_auto_warmup_of_zero_steps_is_one_as_the_hf_trainer_fills_it():
    """The HF Trainer's default warmup_steps=0 fills "warmup_num_steps": "auto" with max(1, 0) = 1
    (transformers' trainer_config_finalize); it was passed through as 0 and refused by the schedule."""
    s = from_deepspeed(HF_ZERO2, world_size=2, precision="fp16", **{**HF_ARGS, "warmup_steps": 0})
    assert dict((p, v) for p, v, _ in s.resolved)["scheduler.params.warmup_num_steps"] == 1
    expected = fo.warmup_decay_lr(warmup_min_lr=0.0, warmup_max_lr=3e-4, warmup_num_steps=1, total_num_steps=100)
    assert [s.learning_rate(k) for k in range(5)] == [expected(k) for k in range(5)]


def test_a_lion_block_notes_where_it_steps_otherwise_than_deepspeeds_lion():
    """DeepSpeed's Lion kernels move a param whose interpolated momentum is exactly 0 (an embedding row no batch used)
    by lr every step; fzero's lion leaves it (sign(0) = 0). Measured 1e-2 apart on GPT-2's unused position rows after
    one step at lr 1e-2 (a helper's DeepSpeed parity sweep): the reader says so rather than train otherwise silently."""
    s = from_deepspeed({"optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
    assert any(n.startswith("optimizer Lion: ") and "sign(0) = 0" in n and "DeepSpeedCPULion" in n for n in s.notes)
    adamw = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    assert not any(n.startswith("optimizer Lion") for n in adamw.notes)
