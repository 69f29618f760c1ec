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
    if any(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") == "auto" for k in ("fp16", "bf16")):
        keywords.setdefault("precision", precision)
        return path
    if isinstance(cfg, dict) and precision != "fp32" and precision not in cfg:
        return {**cfg, precision: {"enabled": True}}
    return path


def from_accelerate(config: str | os.PathLike | Mapping[str, Any], **keywords: Any) -> Settings:
    """Read an Accelerate config (a YAML path or a dict) with ``distributed_type: DEEPSPEED`` into fzero ``Settings``.
    ``keywords``: as ``from_deepspeed``'s (``learning_rate=`` and the rest resolve the DeepSpeed file's ``"auto"``);
    ``world_size`` defaults to the file's ``num_processes``, which Accelerate counts over every machine."""
    source = os.fspath(config) if isinstance(config, (str, os.PathLike)) else "dict"
    data = _load_yaml(source) if source != "dict" else dict(config)
    kind = data.get("distributed_type")
    if kind != "DEEPSPEED":
        raise ValueError(f"{API}: distributed_type is {kind!r}, not 'DEEPSPEED': this Accelerate config does not run ZeRO "
                         f"(for 'MULTI_GPU' / 'MULTI_CPU' DDP, fzero's stage 0 is the counterpart: compile(stages=0)).")
    section = dict(data.get("deepspeed_config") or {})
    notes = []
    for key, why in _NOTED.items():
        if key in section:
            notes.append(f"{key}={section.pop(key)!r}: accepted, no effect here: {why}")
    precision = _PRECISION.get(str(data.get("mixed_precision", "no")))
    if precision is None:
        raise ValueError(f"{API}: mixed_precision={data.get('mixed_precision')!r}; fzero reads 'no', 'fp16' or 'bf16'.")
    file = section.pop("deepspeed_config_file", None)
    if file is not None:
        if section:
            raise ValueError(f"{API}: deepspeed_config_file is given beside {sorted(section)}; Accelerate refuses both "
                             f"too. Put those settings in the JSON file.")
        path = file if os.path.isabs(file) or source == "dict" else os.path.join(os.path.dirname(source), file)
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
    world = int(data.get("num_processes", 1))  # Accelerate's num_processes counts every machine's (its total)
    keywords.setdefault("world_size", world)
    if file is not None:
        ds = _with_launcher_precision(ds, precision, keywords)
    settings = from_deepspeed(ds, **keywords)
    mapped = {"distributed_type", "deepspeed_config", "mixed_precision", "num_processes", "num_machines"}
    launcher = sorted(set(data) - mapped)
    if launcher:
        notes.append(f"{', '.join(launcher)}: accepted, no effect here: Accelerate's launcher and environment settings "
                     f"(accelerate launch is torchrun underneath; fzero.dist_mesh() runs under either)")
    return settings.replace(source=source, notes=settings.notes + tuple(notes))
