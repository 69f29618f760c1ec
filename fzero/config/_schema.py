"""The schema of a DeepSpeed config for ``fzero.config``: every key fzero knows, and what it does with it.

Each key maps to a ``Spec``: mapped onto an fzero setting (``Mapped``, with a sub-block to check), accepted
with no effect here and the reason (``NoEffect``), or refused by name when in use (``Unsupported``). The
tables are data; ``_read.py`` walks them.
"""

from __future__ import annotations

from typing import Any, Callable

from fzero import optim



class Spec:
    pass


class Mapped(Spec):
    def __init__(self, block: dict[str, Spec] | None = None) -> None:
        self.block = block  # a sub-block whose keys are checked too


class NoEffect(Spec):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class Unsupported(Spec):
    def __init__(self, feature: str, when: Callable[[Any], bool] | None = None, fix: str = "") -> None:
        self.feature, self.when, self.fix = feature, when or _in_use, fix


def _in_use(v: Any) -> bool:
    if isinstance(v, dict):
        return bool(v.get("enabled", True)) if v else False
    return bool(v)


M = Mapped()
_LOGGING = "a DeepSpeed logging/monitoring setting; a fzero step returns its metrics and logs nothing itself"
_PERSIST = ("fzero gathers by unit, not by parameter size: parameters outside every unit (the root unit) stay gathered "
            "for the step; choose units with units=fzero.units_of(model, min_elements=...)")
_CKPT = "a DeepSpeed checkpoint setting; fzero.checkpoint saves resharding checkpoints and consolidates full weights"
_DISKBUF = "fzero's disk offload keeps two sub-groups in RAM (the one updated and the one read ahead)"
_NONE = "a DeepSpeed implementation detail with no counterpart in fzero"

_OFFLOAD_OPTIMIZER = {
    "device": M, "nvme_path": M, "pin_memory": M,
    "buffer_count": NoEffect(_DISKBUF), "pipeline_read": NoEffect(_DISKBUF), "pipeline_write": NoEffect(_DISKBUF),
    "fast_init": NoEffect(_NONE),
    "cpuadam_cores_perc": NoEffect("fzero's host optimizer runs on torch's intra-op threads"),
    "ratio": Unsupported("partial optimizer offload (ratio < 1, DeepSpeed's Twin-Flow)", lambda v: v != 1, "Set ratio to 1.0."),
    "super_offload": Unsupported("SuperOffload", fix="Set super_offload to false."),
}
_OFFLOAD_PARAM = {
    "device": M, "nvme_path": M, "pin_memory": M,
    "buffer_count": NoEffect(_DISKBUF), "buffer_size": NoEffect(_DISKBUF),
    "max_in_cpu": NoEffect("fzero keeps offloaded param shards on the host, all of them"),
}
_ZERO: dict[str, Spec] = {
    "stage": M, "offload_optimizer": Mapped(_OFFLOAD_OPTIMIZER), "offload_param": Mapped(_OFFLOAD_PARAM),
    "cpu_offload": M, "cpu_offload_param": M, "cpu_offload_use_pin_memory": M,
    "reduce_bucket_size": M, "allgather_bucket_size": M, "stage3_prefetch_bucket_size": M, "prefetch_bucket_size": M,
    "overlap_comm": M, "sub_group_size": M,
    "contiguous_gradients": NoEffect("fzero's gradients are always contiguous flat buffers, one per unit"),
    "reduce_scatter": NoEffect("fzero always reduce-scatters gradients at stages 1-3 (all-reduces at stage 0)"),
    "allgather_partitions": NoEffect("fzero all-gathers each unit's shards in one collective"),
    "stage3_param_persistence_threshold": NoEffect(_PERSIST), "param_persistence_threshold": NoEffect(_PERSIST),
    "model_persistence_threshold": NoEffect(_PERSIST),
    "stage3_max_live_parameters": NoEffect("fzero holds at most the unit that runs and the one prefetched"),
    "max_live_parameters": NoEffect("fzero holds at most the unit that runs and the one prefetched"),
    "stage3_max_reuse_distance": NoEffect("fzero gathers each unit again for its backward; none is kept for reuse"),
    "max_reuse_distance": NoEffect("fzero gathers each unit again for its backward; none is kept for reuse"),
    "stage3_gather_16bit_weights_on_model_save": NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "gather_16bit_weights_on_model_save": NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "stage3_gather_fp16_weights_on_model_save": NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "elastic_checkpoint": NoEffect(_CKPT), "load_from_fp32_weights": NoEffect(_CKPT),
    "pipeline_loading_checkpoint": NoEffect(_CKPT),
    "ignore_unused_parameters": NoEffect("a parameter no rank used skips its update in fzero, as DDP with find_unused_parameters leaves its grad None"),
    "round_robin_gradients": NoEffect(_NONE), "use_multi_rank_bucket_allreduce": NoEffect(_NONE),
    "legacy_stage1": NoEffect(_NONE), "memory_efficient_linear": NoEffect(_NONE),
    "override_module_apply": NoEffect(_NONE), "log_trace_cache_warnings": NoEffect(_NONE),
    "enable_sanity_checks": NoEffect(_NONE), "compute_grad_norm": NoEffect("fzero always computes the gradient norm (a metric)"),
    "parameter_alignment": NoEffect("fzero aligns every shard to 64 elements"),
    "stage3_use_all_reduce_for_fetch_params": NoEffect(_NONE), "use_all_reduce_for_fetch_params": NoEffect(_NONE),
    "stage3_allgather_sequential": NoEffect(_NONE), "allgather_sequential": NoEffect(_NONE),
    "stage3_module_granularity_threshold": NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, ...)"),
    "module_granularity_threshold": NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, ...)"),
    "leaf_module": NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, module_types=...)"),
    "save_muon_momentum_buffer_in_memory": NoEffect(_NONE),
    "zero_hpz_partition_size": Unsupported("ZeRO++ hierarchical partitioning (hpZ)", lambda v: v not in (0, 1), "Set it to 1."),
    "zero_quantized_weights": Unsupported("ZeRO++ quantized weights (qwZ)", fix="Set it to false."),
    "zero_quantized_nontrainable_weights": Unsupported("ZeRO++ quantized weights (qwZ)", fix="Set it to false."),
    "zero_quantized_gradients": Unsupported("ZeRO++ quantized gradients (qgZ)", fix="Set it to false."),
    "zenflow": Unsupported("ZenFlow", lambda v: v is not None, "Remove the zenflow block."),
    "mics_shard_size": Unsupported("MiCS sharding", lambda v: v not in (-1, None), "Remove the key."),
    "mics_hierarchical_params_gather": Unsupported("MiCS sharding", fix="Remove the key."),
    "zeropp_loco_param": Unsupported("LoCo-ZeRO++", lambda v: v is not None, "Remove the key."),
}
_FP16 = {
    "enabled": M, "loss_scale": M, "initial_scale_power": M, "loss_scale_window": M, "hysteresis": M, "min_loss_scale": M,
    "auto_cast": NoEffect("fzero.apply casts floating inputs to the compute dtype in any case"),
    "consecutive_hysteresis": Unsupported("consecutive_hysteresis (restoring hysteresis after every good step)",
                                           fix="Set it to false: fzero restores hysteresis when the scale grows, as DeepSpeed's default."),
    "fp16_master_weights_and_grads": Unsupported("fp16 master weights", fix="Set it to false (fzero keeps fp32 masters)."),
}
_BF16 = {
    "enabled": M,
    "immediate_grad_update": NoEffect(_NONE),
    "check_grad_overflow": NoEffect("a non-finite gradient norm stops fzero with an error (on_nonfinite='skip' skips it)"),
    "bf16_master_weights_and_grads": Unsupported("bf16 master weights and gradients", fix="Set it to false (fzero keeps fp32 masters)."),
    "bf16_optimizer_states": Unsupported("bf16 optimizer states", fix="Set it to false."),
}
_DATA_TYPES = {"grad_accum_dtype": M}
# DeepSpeed's (legacy) curriculum learning block: fzero.data.Curriculum, in Settings.curriculum
_CURRICULUM = {
    "enabled": M, "curriculum_type": M, "min_difficulty": M, "max_difficulty": M, "schedule_type": M,
    "schedule_config": Mapped({"total_curriculum_step": M, "difficulty_step": M, "root_degree": M, "difficulty": M,
                               "max_step": M}),
}
TOP: dict[str, Spec] = {
    "train_batch_size": M, "train_micro_batch_size_per_gpu": M, "gradient_accumulation_steps": M, "gradient_clipping": M,
    "optimizer": M, "scheduler": M, "fp16": Mapped(_FP16), "bf16": Mapped(_BF16), "bfloat16": Mapped(_BF16),
    "zero_optimization": Mapped(_ZERO), "steps_per_print": M, "wall_clock_breakdown": M, "communication_data_type": M,
    "data_types": Mapped(_DATA_TYPES),
    "prescale_gradients": NoEffect("fzero sums gradients in the reduce dtype (communication_data_type), then divides"),
    "gradient_predivide_factor": NoEffect("fzero sums gradients in the reduce dtype (communication_data_type), then divides"),
    "gradient_allreduce_op": Unsupported("summed (not averaged) gradients", lambda v: v != "mean", 'Use "mean".'),
    "zero_allow_untested_optimizer": NoEffect("fzero's ZeRO stages run every fzero.optim optimizer"),
    "zero_force_ds_cpu_optimizer": NoEffect("fzero's offload runs the config's optimizer on the host"),
    "memory_breakdown": NoEffect("fzero.memory.LiveBytes and fzero.estimate_memory report memory"),
    "dump_state": NoEffect(_LOGGING), "log_level": NoEffect(_LOGGING), "timers": NoEffect(_LOGGING),
    "flops_profiler": NoEffect(_LOGGING), "tensorboard": NoEffect(_LOGGING), "wandb": NoEffect(_LOGGING),
    "csv_monitor": NoEffect(_LOGGING), "comet": NoEffect(_LOGGING), "comms_logger": NoEffect(_LOGGING),
    "checkpoint": NoEffect(_CKPT), "datastates": NoEffect(_CKPT),
    "dataloader_drop_last": NoEffect("fzero builds no data loader"),
    "disable_allgather": NoEffect(_NONE), "disable_python_gc": NoEffect(_NONE),
    "activation_checkpointing": NoEffect("DeepSpeed applies it where the model calls deepspeed.checkpointing; "
                                          "in fzero, compile(remat=True) recomputes each unit, or wrap blocks with "
                                          "fzero.remat in loss_fn"),
    "aio": NoEffect("DeepSpeed's async-I/O tuning; fzero's disk offload reads ahead with its own thread"),
    "pipeline": NoEffect("read only for a deepspeed.pipe.PipelineModule; fzero has no pipeline parallelism"),
    "seq_parallel_communication_data_type": NoEffect("fzero has no sequence parallelism"),
    "use_data_before_expert_parallelism": NoEffect("fzero has no expert parallelism"),
    "sequence_parallel_size": Unsupported("sequence parallelism (Ulysses)", lambda v: v not in (None, 1), "Set it to 1."),
    "tensor_parallel": Unsupported("tensor parallelism (AutoTP)",
                                    lambda v: isinstance(v, dict) and v.get("autotp_size", 1) not in (0, 1), "Set autotp_size to 1."),
    "expert_parallel": Unsupported("expert parallelism (MoE)"),
    "hybrid_engine": Unsupported("the hybrid (RLHF) engine"),
    "data_efficiency": Unsupported("data efficiency (curriculum learning, random-LTD)"),
    "autotuning": Unsupported("autotuning"),
    "compile": Unsupported("DeepSpeed's compiler integration (deepcompile)"),
    "torch_autocast": Unsupported("torch autocast with fp32 params", fix="Use fp16 or bf16, which fzero maps to a Precision policy."),
    "weight_quantization": Unsupported("weight quantization"),
    # removed from DeepSpeed 0.19, still found in older configs: fine when disabled
    "amp": Unsupported("NVIDIA Apex AMP", fix="Use fp16 or bf16."),
    "elasticity": Unsupported("elastic training"),
    "sparse_attention": Mapped(),  # a layout of fzero.ops in Settings.sparse_attention; its keys checked by mode
    "curriculum_learning": Mapped(_CURRICULUM),
    "progressive_layer_drop": Mapped({"enabled": M, "theta": M, "gamma": M}),
    "eigenvalue": Unsupported("eigenvalue-based quantization (MoQ)"),
    "quantize_training": Unsupported("quantized training (MoQ)"),
    "compression_training": Unsupported("the compression library"),
    "sparse_gradients": Unsupported("sparse gradients", fix="Set it to false."),
    "nebula": Unsupported("Nebula checkpointing"),
    "graph_harvesting": Unsupported("graph harvesting", fix="Set it to false."),
}

# optimizers: DeepSpeed's type names (lowercased) -> fzero builder; params each accepts
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "adam_w_mode", "torch_adam",
              "fp32_optimizer_states", "foreach", "set_grad_none", "fused", "capturable", "differentiable", "maximize")
OPT_KEYS = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "eps_inside_sqrt", "max_coeff", "min_coeff"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable", "fused"),
    "lion": ("lr", "betas", "weight_decay", "set_grad_none"),
}
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam (OneBitAdam, DeepSpeed's communication-compressed Adam)",
    "zerooneadam": "0/1 Adam (ZeroOneAdam, DeepSpeed's communication-compressed Adam)",
    "onebitlamb": "1-bit LAMB (OneBitLamb, DeepSpeed's communication-compressed LAMB)",
    "adagrad": "Adagrad", "muadam": "MuAdam (mup)", "muadamw": "MuAdamW (mup)", "musgd": "MuSGD (mup)", "muon": "Muon",
    **{name.lower(): f"torch.optim.{name}" for name in ("RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
                                                         "LBFGS", "SparseAdam", "Adafactor")},
}
SCHEDULES = {
    "WarmupLR": optim.warmup_lr, "WarmupDecayLR": optim.warmup_decay_lr, "WarmupCosineLR": optim.warmup_cosine_lr,
    "OneCycle": optim.one_cycle, "LRRangeTest": optim.lr_range_test,
}


