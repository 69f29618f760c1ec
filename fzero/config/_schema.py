"""The schema of a DeepSpeed config for ``fzero.config``: every key fzero knows, and what it does with it.

Each key maps to a ``_Spec``: mapped onto an fzero setting (``_Mapped``, with a sub-block to check), accepted
with no effect here and the reason (``_NoEffect``), or refused by name when in use (``_Unsupported``). Split
from ``fzero/config.py`` to keep the reader short; the tables are data.
"""

from __future__ import annotations

from typing import Any, Callable

from fzero import optim



class _Spec:
    pass


class _Mapped(_Spec):
    def __init__(self, block: dict[str, _Spec] | None = None) -> None:
        self.block = block  # a sub-block whose keys are checked too


class _NoEffect(_Spec):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Unsupported(_Spec):
    def __init__(self, feature: str, when: Callable[[Any], bool] | None = None, fix: str = "") -> None:
        self.feature, self.when, self.fix = feature, when or _in_use, fix


def _in_use(v: Any) -> bool:
    if isinstance(v, dict):
        return bool(v.get("enabled", True)) if v else False
    return bool(v)


M = _Mapped()
_LOGGING = "a DeepSpeed logging/monitoring setting; a fzero step returns its metrics and logs nothing itself"
_PERSIST = ("fzero gathers by unit, not by parameter size: parameters outside every unit (the root unit) stay gathered "
            "for the step; choose units with units=fzero.units_of(model, min_elements=...)")
_CKPT = "a DeepSpeed checkpoint setting; fzero.checkpoint saves resharding checkpoints and consolidates full weights"
_DISKBUF = "fzero's disk offload keeps two sub-groups in RAM (the one updated and the one read ahead)"
_NONE = "a DeepSpeed implementation detail with no counterpart in fzero"

_OFFLOAD_OPTIMIZER = {
    "device": M, "nvme_path": M, "pin_memory": M,
    "buffer_count": _NoEffect(_DISKBUF), "pipeline_read": _NoEffect(_DISKBUF), "pipeline_write": _NoEffect(_DISKBUF),
    "fast_init": _NoEffect(_NONE),
    "cpuadam_cores_perc": _NoEffect("fzero's host optimizer runs on torch's intra-op threads"),
    "ratio": _Unsupported("partial optimizer offload (ratio < 1, DeepSpeed's Twin-Flow)", lambda v: v != 1, "Set ratio to 1.0."),
    "super_offload": _Unsupported("SuperOffload", fix="Set super_offload to false."),
}
_OFFLOAD_PARAM = {
    "device": M, "nvme_path": M, "pin_memory": M,
    "buffer_count": _NoEffect(_DISKBUF), "buffer_size": _NoEffect(_DISKBUF),
    "max_in_cpu": _NoEffect("fzero keeps offloaded param shards on the host, all of them"),
}
_ZERO: dict[str, _Spec] = {
    "stage": M, "offload_optimizer": _Mapped(_OFFLOAD_OPTIMIZER), "offload_param": _Mapped(_OFFLOAD_PARAM),
    "cpu_offload": M, "cpu_offload_param": M, "cpu_offload_use_pin_memory": M,
    "reduce_bucket_size": M, "allgather_bucket_size": M, "stage3_prefetch_bucket_size": M, "prefetch_bucket_size": M,
    "overlap_comm": M, "sub_group_size": M,
    "contiguous_gradients": _NoEffect("fzero's gradients are always contiguous flat buffers, one per unit"),
    "reduce_scatter": _NoEffect("fzero always reduce-scatters gradients at stages 1-3 (all-reduces at stage 0)"),
    "allgather_partitions": _NoEffect("fzero all-gathers each unit's shards in one collective"),
    "stage3_param_persistence_threshold": _NoEffect(_PERSIST), "param_persistence_threshold": _NoEffect(_PERSIST),
    "model_persistence_threshold": _NoEffect(_PERSIST),
    "stage3_max_live_parameters": _NoEffect("fzero holds at most the unit that runs and the one prefetched"),
    "max_live_parameters": _NoEffect("fzero holds at most the unit that runs and the one prefetched"),
    "stage3_max_reuse_distance": _NoEffect("fzero gathers each unit again for its backward; none is kept for reuse"),
    "max_reuse_distance": _NoEffect("fzero gathers each unit again for its backward; none is kept for reuse"),
    "stage3_gather_16bit_weights_on_model_save": _NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "gather_16bit_weights_on_model_save": _NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "stage3_gather_fp16_weights_on_model_save": _NoEffect("step.gather(state) and fzero.checkpoint.consolidate give full weights"),
    "elastic_checkpoint": _NoEffect(_CKPT), "load_from_fp32_weights": _NoEffect(_CKPT),
    "pipeline_loading_checkpoint": _NoEffect(_CKPT),
    "ignore_unused_parameters": _NoEffect("unused parameters get zero gradients in fzero"),
    "round_robin_gradients": _NoEffect(_NONE), "use_multi_rank_bucket_allreduce": _NoEffect(_NONE),
    "legacy_stage1": _NoEffect(_NONE), "memory_efficient_linear": _NoEffect(_NONE),
    "override_module_apply": _NoEffect(_NONE), "log_trace_cache_warnings": _NoEffect(_NONE),
    "enable_sanity_checks": _NoEffect(_NONE), "compute_grad_norm": _NoEffect("fzero always computes the gradient norm (a metric)"),
    "parameter_alignment": _NoEffect("fzero aligns every shard to 64 elements"),
    "stage3_use_all_reduce_for_fetch_params": _NoEffect(_NONE), "use_all_reduce_for_fetch_params": _NoEffect(_NONE),
    "stage3_allgather_sequential": _NoEffect(_NONE), "allgather_sequential": _NoEffect(_NONE),
    "stage3_module_granularity_threshold": _NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, ...)"),
    "module_granularity_threshold": _NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, ...)"),
    "leaf_module": _NoEffect("fzero's units are modules you choose: units=fzero.units_of(model, module_types=...)"),
    "save_muon_momentum_buffer_in_memory": _NoEffect(_NONE),
    "zero_hpz_partition_size": _Unsupported("ZeRO++ hierarchical partitioning (hpZ)", lambda v: v not in (0, 1), "Set it to 1."),
    "zero_quantized_weights": _Unsupported("ZeRO++ quantized weights (qwZ)", fix="Set it to false."),
    "zero_quantized_nontrainable_weights": _Unsupported("ZeRO++ quantized weights (qwZ)", fix="Set it to false."),
    "zero_quantized_gradients": _Unsupported("ZeRO++ quantized gradients (qgZ)", fix="Set it to false."),
    "zenflow": _Unsupported("ZenFlow", lambda v: v is not None, "Remove the zenflow block."),
    "mics_shard_size": _Unsupported("MiCS sharding", lambda v: v not in (-1, None), "Remove the key."),
    "mics_hierarchical_params_gather": _Unsupported("MiCS sharding", fix="Remove the key."),
    "zeropp_loco_param": _Unsupported("LoCo-ZeRO++", lambda v: v is not None, "Remove the key."),
}
_FP16 = {
    "enabled": M, "loss_scale": M, "initial_scale_power": M, "loss_scale_window": M, "hysteresis": M, "min_loss_scale": M,
    "auto_cast": _NoEffect("fzero.apply casts floating inputs to the compute dtype in any case"),
    "consecutive_hysteresis": _Unsupported("consecutive_hysteresis (restoring hysteresis after every good step)",
                                           fix="Set it to false: fzero restores hysteresis when the scale grows, as DeepSpeed's default."),
    "fp16_master_weights_and_grads": _Unsupported("fp16 master weights", fix="Set it to false (fzero keeps fp32 masters)."),
}
_BF16 = {
    "enabled": M,
    "immediate_grad_update": _NoEffect(_NONE),
    "check_grad_overflow": _NoEffect("a non-finite gradient norm stops fzero with an error (on_nonfinite='skip' skips it)"),
    "bf16_master_weights_and_grads": _Unsupported("bf16 master weights and gradients", fix="Set it to false (fzero keeps fp32 masters)."),
    "bf16_optimizer_states": _Unsupported("bf16 optimizer states", fix="Set it to false."),
}
_DATA_TYPES = {"grad_accum_dtype": M}
_TOP: dict[str, _Spec] = {
    "train_batch_size": M, "train_micro_batch_size_per_gpu": M, "gradient_accumulation_steps": M, "gradient_clipping": M,
    "optimizer": M, "scheduler": M, "fp16": _Mapped(_FP16), "bf16": _Mapped(_BF16), "bfloat16": _Mapped(_BF16),
    "zero_optimization": _Mapped(_ZERO), "steps_per_print": M, "wall_clock_breakdown": M, "communication_data_type": M,
    "data_types": _Mapped(_DATA_TYPES),
    "prescale_gradients": _NoEffect("fzero sums gradients in the reduce dtype (communication_data_type), then divides"),
    "gradient_predivide_factor": _NoEffect("fzero sums gradients in the reduce dtype (communication_data_type), then divides"),
    "gradient_allreduce_op": _Unsupported("summed (not averaged) gradients", lambda v: v != "mean", 'Use "mean".'),
    "zero_allow_untested_optimizer": _NoEffect("fzero's ZeRO stages run every fzero.optim optimizer"),
    "zero_force_ds_cpu_optimizer": _NoEffect("fzero's offload runs the config's optimizer on the host"),
    "memory_breakdown": _NoEffect("fzero.memory.LiveBytes and fzero.estimate_memory report memory"),
    "dump_state": _NoEffect(_LOGGING), "log_level": _NoEffect(_LOGGING), "timers": _NoEffect(_LOGGING),
    "flops_profiler": _NoEffect(_LOGGING), "tensorboard": _NoEffect(_LOGGING), "wandb": _NoEffect(_LOGGING),
    "csv_monitor": _NoEffect(_LOGGING), "comet": _NoEffect(_LOGGING), "comms_logger": _NoEffect(_LOGGING),
    "checkpoint": _NoEffect(_CKPT), "datastates": _NoEffect(_CKPT),
    "dataloader_drop_last": _NoEffect("fzero builds no data loader"),
    "disable_allgather": _NoEffect(_NONE), "disable_python_gc": _NoEffect(_NONE),
    "activation_checkpointing": _NoEffect("DeepSpeed applies it where the model calls deepspeed.checkpointing; "
                                          "in fzero, wrap blocks with fzero.remat in loss_fn"),
    "aio": _NoEffect("DeepSpeed's async-I/O tuning; fzero's disk offload reads ahead with its own thread"),
    "pipeline": _NoEffect("read only for a deepspeed.pipe.PipelineModule; fzero has no pipeline parallelism"),
    "seq_parallel_communication_data_type": _NoEffect("fzero has no sequence parallelism"),
    "use_data_before_expert_parallelism": _NoEffect("fzero has no expert parallelism"),
    "sequence_parallel_size": _Unsupported("sequence parallelism (Ulysses)", lambda v: v not in (None, 1), "Set it to 1."),
    "tensor_parallel": _Unsupported("tensor parallelism (AutoTP)",
                                    lambda v: isinstance(v, dict) and v.get("autotp_size", 1) not in (0, 1), "Set autotp_size to 1."),
    "expert_parallel": _Unsupported("expert parallelism (MoE)"),
    "hybrid_engine": _Unsupported("the hybrid (RLHF) engine"),
    "data_efficiency": _Unsupported("data efficiency (curriculum learning, random-LTD)"),
    "autotuning": _Unsupported("autotuning"),
    "compile": _Unsupported("DeepSpeed's compiler integration (deepcompile)"),
    "torch_autocast": _Unsupported("torch autocast with fp32 params", fix="Use fp16 or bf16, which fzero maps to a Precision policy."),
    "weight_quantization": _Unsupported("weight quantization"),
    # removed from DeepSpeed 0.19, still found in older configs: fine when disabled
    "amp": _Unsupported("NVIDIA Apex AMP", fix="Use fp16 or bf16."),
    "elasticity": _Unsupported("elastic training"),
    "sparse_attention": _Unsupported("sparse attention"),
    "curriculum_learning": _Unsupported("curriculum learning"),
    "progressive_layer_drop": _Unsupported("progressive layer dropping"),
    "eigenvalue": _Unsupported("eigenvalue-based quantization (MoQ)"),
    "quantize_training": _Unsupported("quantized training (MoQ)"),
    "compression_training": _Unsupported("the compression library"),
    "sparse_gradients": _Unsupported("sparse gradients", fix="Set it to false."),
    "nebula": _Unsupported("Nebula checkpointing"),
    "graph_harvesting": _Unsupported("graph harvesting", fix="Set it to false."),
}

# optimizers: DeepSpeed's type names (lowercased) -> fzero builder; params each accepts
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "adam_w_mode", "torch_adam",
              "fp32_optimizer_states", "foreach", "set_grad_none", "fused", "capturable", "differentiable", "maximize")
_OPT_KEYS = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "lamb": ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "eps_inside_sqrt", "max_coeff", "min_coeff"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize", "foreach", "differentiable", "fused"),
    "lion": ("lr", "betas", "weight_decay", "set_grad_none"),
}
_UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam (OneBitAdam, DeepSpeed's communication-compressed Adam)",
    "zerooneadam": "0/1 Adam (ZeroOneAdam, DeepSpeed's communication-compressed Adam)",
    "onebitlamb": "1-bit LAMB (OneBitLamb, DeepSpeed's communication-compressed LAMB)",
    "adagrad": "Adagrad", "muadam": "MuAdam (mup)", "muadamw": "MuAdamW (mup)", "musgd": "MuSGD (mup)", "muon": "Muon",
    **{name.lower(): f"torch.optim.{name}" for name in ("RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop",
                                                         "LBFGS", "SparseAdam", "Adafactor")},
}
_SCHEDULES = {
    "WarmupLR": optim.warmup_lr, "WarmupDecayLR": optim.warmup_decay_lr, "WarmupCosineLR": optim.warmup_cosine_lr,
    "OneCycle": optim.one_cycle, "LRRangeTest": optim.lr_range_test,
}


