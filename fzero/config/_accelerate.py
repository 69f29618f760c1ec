"""Accelerate's config file (``accelerate config`` writes it) as fzero settings: its DeepSpeed section.

An Accelerate user runs ZeRO through ``distributed_type: DEEPSPEED`` and a ``deepspeed_config`` section: either the
plugin's own fields (``zero_stage``, ``offload_optimizer_device``, ...) or ``deepspeed_config_file`` naming a
DeepSpeed JSON. ``from_accelerate`` turns the fields into the DeepSpeed keys they stand for (as Accelerate's
``DeepSpeedPlugin`` does) and reads them with ``from_deepspeed``; ``mixed_precision`` and the number of processes
come from the file's top level. The launcher's own settings (machines, addresses, ``dynamo_config``, ...) are
accepted and listed in ``Settings.notes``: ``accelerate launch`` is torchrun underneath, and ``fzero.dist_mesh()``
runs under either.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from fzero.config._read import from_deepspeed
from fzero.config._settings import Settings

API = "fzero.config.from_accelerate"

# the plugin's fields -> (the DeepSpeed key path they set, how the value maps)
_FIELDS = {
    "zero_stage": ("zero_optimization.stage", int),
    "offload_optimizer_device": ("zero_optimization.offload_optimizer.device", str),
    "offload_param_device": ("zero_optimization.offload_param.device", str),
    "offload_optimizer_nvme_path": ("zero_optimization.offload_optimizer.nvme_path", str),
    "offload_param_nvme_path": ("zero_optimization.offload_param.nvme_path", str),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", int),
    "gradient_clipping": ("gradient_clipping", float),
}
_NOTED = {
    "zero3_init_flag": "deepspeed.zero.Init's counterpart is a model built under fzero.empty_params() and "
                       "step.init(params, materialize=...) (docs/migrating.md, section 1)",
    "zero3_save_16bit_model": "fzero.checkpoint.consolidate / the safetensors export give the full weights",
    "deepspeed_multinode_launcher": "torchrun launches fzero's processes, on one node or several",
    "deepspeed_hostfile": "torchrun launches fzero's processes, on one node or several",
    "deepspeed_exclusion_filter": "torchrun launches fzero's processes, on one node or several",
    "deepspeed_inclusion_filter": "torchrun launches fzero's processes, on one node or several",
}
_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
# the top-level keys of Accelerate 1.15's config file (ClusterConfig's fields, and the old "fp16" / "dynamo_backend" its
# reader converts): accelerate launch refuses any other key ("had unknown keys"), so a typo such as mixed_precison
# must not be read as a launcher setting with no effect (it trained in fp32 here, where Accelerate would not start)
_TOP_KEYS = frozenset({
    "command_file", "commands", "compute_environment", "debug", "deepspeed_config", "distributed_type", "downcast_bf16",
    "dynamo_config", "enable_cpu_affinity", "fp8_config", "fsdp_config", "gpu_ids", "machine_rank", "main_process_ip",
    "main_process_port", "main_training_function", "megatron_lm_config", "mixed_precision", "mpirun_config",
    "num_machines", "num_processes", "parallelism_config", "rdzv_backend", "same_network", "tpu_env", "tpu_name",
    "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "tpu_zone", "use_cpu", "fp16", "dynamo_backend",
})


def _mixed_precision(data: Mapping[str, Any]) -> Any:
    """The file's mixed_precision as Accelerate's reader makes it (``BaseConfig.process_config``): an absent one is the
    old ``fp16: true`` ("fp16") if the file has it; a null one (or an absent one without it) is "no", as
    ``accelerate launch`` makes None (the old ``fp16`` key is read only where ``mixed_precision`` is absent)."""
    if "mixed_precision" not in data:
        return "fp16" if data.get("fp16") else "no"
    return "no" if data["mixed_precision"] is None else data["mixed_precision"]


def _field(key: str, value: Any) -> Any:
    """The plugin field ``key``'s ``value`` as the DeepSpeed config gets it ("auto" and None kept): Accelerate's
    launcher passes the fields as strings through the environment and the plugin casts them back, so a value that
    cast refuses (``gradient_clipping: none``) is refused here, by name, instead of a bare ``float()`` error."""
    if value == "auto" or value is None:
        return value
    cast = _FIELDS[key][1]
    try:
        if isinstance(value, bool) and cast is not str:  # float(True) is 1.0: a yes/no where a number belongs
            raise ValueError
        return cast(value)
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number", str: "a string"}[cast]
        hint = (" (0 leaves it to DeepSpeed's default, clipping at 1.0, as Accelerate does; to turn clipping off, set "
                "gradient_clipping: 0 in a deepspeed_config_file)") if key == "gradient_clipping" else ""
        raise ValueError(f"{API}: deepspeed_config.{key} must be {kind} or \"auto\", got {value!r}{hint}.") from None


def _load_yaml(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError:
        raise ImportError(f"{API} reads Accelerate's YAML config with PyYAML: pip install pyyaml") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{API}: no Accelerate config file at {path!r} (accelerate config writes "
                                f"~/.cache/huggingface/accelerate/default_config.yaml).") from None
    if not isinstance(data, dict):
        raise ValueError(f"{API}: {path!r} is not an Accelerate config (a YAML mapping at the top).")
    return data


def _with_launcher_precision(path: str, precision: str, keywords: dict[str, Any]) -> Any:
    """The DeepSpeed JSON as Accelerate's ``mixed_precision`` leaves it (``DeepSpeedPlugin.set_mixed_precision``): an
    ``"auto"`` precision is resolved by it (``precision=``), and a JSON without a block for that dtype gets
    ``{"enabled": true}`` (read as the JSON alone, it trained in fp32, silently). The path itself where neither."""
    import json

    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return path  # from_deepspeed names what is wrong with the file
    if isinstance(cfg, dict):
        _clipping_auto(cfg, keywords)
    if any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") == "auto" for k in ("fp16", "bf16")):
        keywords.setdefault("precision", precision)
        return path
    if isinstance(cfg, dict) and precision != "fp32" and precision not in cfg:
        return {**cfg, precision: {"enabled": True}}
    return path


def _clipping_auto(ds: Mapping[str, Any], keywords: dict[str, Any]) -> None:
    """A ``gradient_clipping: "auto"`` as Accelerate's ``prepare()`` fills it: 1.0, whatever max_norm the loop gives
    ``accelerator.clip_grad_norm_`` (which does not clip under DeepSpeed), unless ``clip_grad_norm=`` says otherwise."""
    if ds.get("gradient_clipping") == "auto":
        keywords.setdefault("clip_grad_norm", 1.0)


def _micro_batch(ds: dict[str, Any], keywords: dict[str, Any]) -> None:
    """The batch sizes DeepSpeedPlugin leaves to ``prepare()`` (``"auto"``, filled from the DataLoader's batch_size),
    resolved by ``batch_size=``; without it, refused where gradient accumulation makes them matter.

    At the end of an epoch whose micro-batches do not divide by gradient_accumulation_steps, Accelerate's
    ``accumulate()`` steps on the k micro-batches left, each weighted 1/gradient_accumulation_steps (DeepSpeed scales
    every micro-batch's loss so). An fzero step given those rows splits them into gradient_accumulation_steps
    micro-batches and trains them at full weight: a different update, silently (a 2x larger gradient for k = 1 of 2).
    With the micro batch size known, each step checks its rows and refuses that short batch by name."""
    if "batch_size" in keywords:
        ds["train_micro_batch_size_per_gpu"] = "auto"
        ds["train_batch_size"] = "auto"
        return
    gas = ds.get("gradient_accumulation_steps", 1)
    accum = keywords.get("grad_accum", 1) if gas == "auto" else gas
    if isinstance(accum, int) and not isinstance(accum, bool) and accum > 1:
        raise ValueError(
            f"{API}: gradient_accumulation_steps={accum} needs batch_size=, the per-process batch_size of the DataLoader "
            f"that Accelerate's prepare() reads into train_micro_batch_size_per_gpu (e.g. from_accelerate(path, "
            f"batch_size=8)); each step then checks that it gets batch_size x {accum} rows per rank. At the end of an "
            f"epoch Accelerate's accumulate() steps on the fewer than {accum} micro-batches left, each weighted 1/{accum}; "
            f"the same rows given to an fzero step would be split into {accum} micro-batches and trained at full weight. "
            f"Drop that short batch (DataLoader(..., drop_last=True) over batch_size x {accum} rows per rank)."
        )


def _deepspeed_file(file: str, source: str, notes: list[str]) -> str:
    """``deepspeed_config_file`` as Accelerate opens it: a relative path from the current directory.

    Why: ``accelerate launch`` passes the value as written (``ACCELERATE_DEEPSPEED_CONFIG_FILE``), and the processes'
    ``HfDeepSpeedConfig`` opens it from their working directory, not from the YAML's (``accelerate config`` keeps the YAML
    in ~/.cache/huggingface/accelerate). Read beside the YAML, a second file of that name there was taken in place of
    the one Accelerate trains with, silently. Where the working directory has no such file, the one beside the YAML is
    read, and a note says so."""
    if os.path.isabs(file) or source == "dict" or os.path.exists(file):
        return file
    beside = os.path.join(os.path.dirname(source), file)
    if os.path.exists(beside):
        notes.append(f"deepspeed_config_file={file!r}: not in the current directory ({os.getcwd()}), where Accelerate opens "
                     f"a relative path; read beside the config file instead ({beside})")
        return beside
    return file  # from_deepspeed names the missing file


def from_accelerate(config: str | os.PathLike | Mapping[str, Any], **keywords: Any) -> Settings:
    """Read an Accelerate config (a YAML path or a dict) with ``distributed_type: DEEPSPEED`` into fzero ``Settings``.
    ``keywords``: as ``from_deepspeed``'s (``learning_rate=`` and the rest resolve the DeepSpeed file's ``"auto"``);
    ``world_size`` defaults to the file's ``num_processes``, which Accelerate counts over every machine. With the
    plugin's fields, ``batch_size=`` is the DataLoader's per-process batch size (Accelerate's
    ``train_micro_batch_size_per_gpu``), required with ``gradient_accumulation_steps`` > 1 (``_micro_batch``)."""
    source = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "dict"
    data = _load_yaml(source) if source != "dict" else dict(config)
    kind = data.get("distributed_type")
    if kind != "DEEPSPEED":
        raise ValueError(f"{API}: distributed_type is {kind!r}, not 'DEEPSPEED': this Accelerate config does not run ZeRO "
                         f"(for 'MULTI_GPU' / 'MULTI_CPU' DDP, fzero's stage 0 is the counterpart: compile(stages=0)).")
    unknown_top = sorted(set(data) - _TOP_KEYS)
    if unknown_top:
        import difflib

        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, sorted(_TOP_KEYS), n=1))
                 else repr(k) for k in unknown_top]
        raise ValueError(f"{API}: unknown top-level keys in the Accelerate config: {', '.join(hints)}. accelerate launch "
                         f"refuses them too (\"had unknown keys\"); fix or remove them.")
    section = dict(data.get("deepspeed_config") or {})
    notes = []
    for key, why in _NOTED.items():
        if key in section:
            notes.append(f"{key}={section.pop(key)!r}: accepted, no effect here: {why}")
    mixed = _mixed_precision(data)
    precision = _PRECISION.get(str(mixed))
    if precision is None:
        raise ValueError(f"{API}: mixed_precision={mixed!r}; fzero reads 'no', 'fp16' or 'bf16'.")
    file = section.pop("deepspeed_config_file", None)
    if file is not None:
        if section:
            raise ValueError(f"{API}: deepspeed_config_file is given beside {sorted(section)}; Accelerate refuses both "
                             f"too. Put those settings in the JSON file.")
        path = _deepspeed_file(str(file), source, notes)
        ds: Any = path
    else:
        unknown = sorted(set(section) - set(_FIELDS))
        if unknown:
            raise ValueError(f"{API}: unknown deepspeed_config keys {unknown}; fzero reads {sorted({*_FIELDS, *_NOTED})} "
                             f"and deepspeed_config_file.")
        section.setdefault("zero_stage", 2)  # DeepSpeedPlugin's default when the file names none
        section = {key: _field(key, value) for key, value in section.items()}
        clip = section.get("gradient_clipping", "auto")
        if clip != "auto" and not clip:
            # DeepSpeedPlugin writes gradient_clipping only when it is truthy, so DeepSpeed clips at its default (a
            # null in the yaml: the launcher passes nothing, the plugin writes "auto", and Accelerate fills in 1.0)
            del section["gradient_clipping"]
            notes.append(f"gradient_clipping={clip!r}: Accelerate leaves a zero or null out of the DeepSpeed config, so "
                         f"DeepSpeed's default (1.0) clips, as here; remove the key and set gradient_clipping in a "
                         f"deepspeed_config_file to turn clipping off")
        ds = {}
        for key, value in section.items():
            path = _FIELDS[key][0]
            node = ds
            *parents, leaf = path.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        for which in ("offload_optimizer", "offload_param"):  # Accelerate writes "none" for no offload
            block = ds.get("zero_optimization", {}).get(which)
            if block is not None and block.get("device") == "none":
                del ds["zero_optimization"][which]
        if precision != "fp32":
            ds[precision] = {"enabled": True}
        _micro_batch(ds, keywords)
        _clipping_auto(ds, keywords)
    world = int(data.get("num_processes", 1))  # Accelerate's num_processes counts every machine's (its total)
    keywords.setdefault("world_size", world)
    if file is not None:
        ds = _with_launcher_precision(ds, precision, keywords)
    settings = from_deepspeed(ds, **keywords)
    mapped = {"distributed_type", "deepspeed_config", "mixed_precision", "num_processes", "num_machines", "fp16"}
    launcher = sorted(set(data) - mapped)
    if launcher:
        notes.append(f"{', '.join(launcher)}: accepted, no effect here: Accelerate's launcher and environment settings "
                     f"(accelerate launch is torchrun underneath; fzero.dist_mesh() runs under either)")
    return settings.replace(source=source, notes=settings.notes + tuple(notes))
