"""Weights in: ``step.init`` reads a Hugging Face checkpoint directory one unit at a time.

```python
with fzero.empty_params():                        # parameters on meta, buffers real
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("ckpt_dir"))
state = step.init(fzero.params_of(model, copy=False), materialize=fzero.checkpoint.pretrained("ckpt_dir", model=model))
```

Why: ``from_pretrained`` builds the whole model on one process before a ZeRO step could shard it, which is
what ``deepspeed.zero.Init`` exists to avoid. ``step.init`` packs one unit at a time and calls ``materialize``
for each of its meta params, so a reader that opens the file holding that one tensor (``safe_open`` maps the
file; ``get_tensor`` reads only that tensor's bytes) keeps a rank's memory at its state plus about one unit.
Under ``fzero.dist_mesh()`` with a reader on every rank, each rank reads only the part of a unit it keeps (its
shard at stage 3: ``read_range`` reads the rows holding it), in parallel and with nothing sent between ranks; a
unit with a param made by ``missing=`` (random values) is made on rank 0 and broadcast, as ``step.init`` does for
made params.

Everything that can be wrong is found when ``pretrained`` is called, from the files' headers alone, before a
byte of weights is read; each is an error naming the key:

- keys the model has that the checkpoint lacks, and keys the checkpoint has that the model lacks, except the
  ones ``from_pretrained`` ignores too: a tied weight stored once (``save_pretrained`` writes one name of a
  tied group; any one of its names is taken), and the model class's ``_keys_to_ignore_on_load_unexpected`` /
  ``_keys_to_ignore_on_load_missing`` patterns (the latter for buffers only: a param needs a value);
- a shape that differs from the model's (both shapes named);
- the ``base_model_prefix`` as ``from_pretrained`` handles it: a base model's checkpoint (``h.0...``) loads
  into a model with a head (``transformer.h.0...``), and the reverse;
- a model whose params are real (``step.init`` makes only meta params: the checkpoint would not be read) or
  whose non-persistent buffers are meta (built under ``torch.device("meta")``; no checkpoint holds them).

Params the checkpoint lacks on purpose (a new head over a pretrained body) are made by ``missing="init"`` (the
model's own initializer, as ``from_pretrained`` runs it: ``_init_weights`` of the param's module and of every module
above it, the model's last) or a ``missing=`` function, and listed in ``Pretrained.initialized``; without
``missing=`` they are an error. Keys the model lacks on purpose (a base checkpoint's pooler or LM head under a
classification model) are left out with ``unexpected="ignore"``, as ``from_pretrained`` leaves them, and listed in
``Pretrained.ignored``. Frozen params are the module's: give them values before ``pretrained`` (a real frozen param
is read from the module by every forward).

A stored dtype other than the param's (bf16 files, an fp32 model) is cast to the param's dtype, as
``from_pretrained`` casts to the model's; ``Pretrained.casts`` lists each key cast. Persistent buffers the
checkpoint holds are given to ``step.init`` as the state's buffers (``init_buffers``).

Checkpoints in another layout than the model's, as transformers 5 converts them while loading (``_Conversions``):
``save_pretrained`` writes a mixture-of-experts model's experts one module per expert
(``block_sparse_moe.experts.3.w1.weight``) where the model holds them fused (``mlp.experts.gate_up_proj``), and
older checkpoints carry renamed keys (``LayerNorm.gamma``). The model's own conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``) is applied with transformers' own renaming and
conversion operations: a renamed key is read under its stored name, and a converted param is made, when its unit
is packed, from the stored tensors that make it (one layer's experts), converted as ``from_pretrained`` converts
them. Shapes are checked from the headers, through the same conversion run on meta tensors.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
import re
from typing import Any

import torch
from torch import nn

from fzero.checkpoint._files import deepspeed_names, fzero_names
from fzero.checkpoint._initializers import initializer as _initializer
from fzero.checkpoint._safetensors import INDEX, WEIGHTS
from fzero.layout import META_BUFFER_FIX

API = "fzero.checkpoint.pretrained"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _safe_open() -> Any:
    """``safetensors.safe_open``, imported on first use: fzero needs it only to read weights in."""
    try:
        return importlib.import_module("safetensors").safe_open
    except ImportError:
        raise ImportError(f"{API} reads safetensors files with the safetensors package: pip install safetensors") from None


def _open(file: str) -> Any:
    """``safe_open`` of one weight file; a file it cannot read (a truncated or interrupted copy, another format under
    the name, a directory) is named with the fix, not safetensors' bare "incomplete metadata, file not fully covered"."""
    safe_open = _safe_open()
    try:
        return safe_open(file, framework="pt", device="cpu")
    except OSError as e:  # permissions, a directory under the file's name: what the OS said, with the file
        raise OSError(f"{API}: cannot open {file!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError: named with the file, and what to do
        raise ValueError(
            f"{API}: cannot read {file!r} as safetensors ({type(e).__name__}: {str(e).splitlines()[0][:200]}); the file "
            f"is truncated or corrupted (a copy or download that did not finish?). Copy it again from the source, or "
            f"write it again with save_pretrained."
        ) from None


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """A ``materialize=`` for ``step.init``: ``pretrained(path, meta)`` is that param's value read from its file.

    ``files``: checkpoint key -> file; ``keys``: model name -> checkpoint key (params, under the name
    ``fzero.params_of`` gives them, and persistent buffers); ``casts``: checkpoint key -> (stored dtype, dtype it is
    cast to); ``device``: where values are made."""

    directory: str
    files: dict[str, str]
    keys: dict[str, str]
    buffer_names: tuple[str, ...]
    casts: dict[str, tuple[torch.dtype, torch.dtype]]
    device: torch.device
    initialized: tuple[str, ...] = ()  # params the checkpoint lacks, made by ``missing`` (see ``pretrained``)
    missing: Any = None
    conversions: Any = None  # ``_Conversions``: keys that transformers renames or converts at load time
    ignored: tuple[str, ...] = ()  # checkpoint keys the model lacks, left out (``unexpected="ignore"``)

    def __call__(self, path: str, meta: torch.Tensor) -> torch.Tensor:
        if path in self.initialized:
            value = self.missing(path, meta)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(meta.shape):
                raise ValueError(f"{API}: missing=... made {type(value).__name__} "
                                 f"{tuple(getattr(value, 'shape', ()))} for {path!r}, whose shape is {tuple(meta.shape)}.")
            return value.to(device=self.device, dtype=meta.dtype, copy=True)
        key = self.keys.get(path)
        if key is None or path in self.buffer_names:
            raise ValueError(
                f"{API}: step.init asked for params[{path!r}], which the model given to pretrained(..., model=) does not "
                f"have as a parameter. Pass that model's params: step.init(fzero.params_of(model, copy=False), ...)."
            )
        return self._read(key, meta.dtype)

    def reads(self, path: str) -> bool:
        """Whether params[``path``] is read from the files (the same values on every rank), not made by ``missing``:
        under ``dist_mesh`` each rank then reads the part it keeps itself (``read_range``)."""
        return path in self.keys and path not in self.initialized and path not in self.buffer_names

    def read_range(self, path: str, meta: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of params[``path``] flattened, in the param's dtype, reading only the rows of the
        stored tensor that hold them (safetensors' ``get_slice``): a rank's shard of a unit costs about its share
        of the file, not the file. A converted param (fused experts) is made whole first, as its conversion needs."""
        if not self.reads(path):
            return self(path, meta).reshape(-1)[start:stop].clone()
        key = self.keys[path]
        if self.conversions is not None and key in self.conversions.produced:
            return self._read(key, meta.dtype).reshape(-1)[start:stop].clone()
        key = self.conversions.stored_key(key) if self.conversions is not None else key
        with _open(os.path.join(self.directory, self.files[key])) as f:
            stored = f.get_slice(key)
            shape = tuple(stored.get_shape())
            row = 1
            for d in shape[1:]:
                row *= d
            if not shape or row == 0:
                part = f.get_tensor(key).reshape(-1)[start:stop]
            else:  # the rows that hold start:stop, then the elements within them
                first, last = start // row, -(-stop // row)
                part = stored[first:last].reshape(-1)[start - first * row : stop - first * row]
        return part.to(device=self.device, dtype=meta.dtype, copy=True)

    def init_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers the checkpoint holds, for the state (``step.init`` takes them when not given
        ``buffers=``); each in the dtype of the model's buffer."""
        return {name: self._read(self.keys[name], self.casts.get(self.keys[name], (None, None))[1]) for name in self.buffer_names}

    def _read(self, key: str, dtype: torch.dtype | None) -> torch.Tensor:
        if self.conversions is not None and key in self.conversions.produced:
            stored = self.conversions.produce(key, self._stored)
        else:
            stored = self._stored(self.conversions.stored_key(key) if self.conversions is not None else key)
        # a copy made by torch (counted by fzero.memory.LiveBytes), in the param's dtype; safetensors' own read
        # (one tensor) is let go here
        return stored.to(device=self.device, dtype=dtype or stored.dtype, copy=True)

    def _stored(self, key: str) -> torch.Tensor:
        """The tensor stored under checkpoint key ``key``."""
        with _open(os.path.join(self.directory, self.files[key])) as f:
            return f.get_tensor(key)


def pretrained(path: str | os.PathLike, *, model: nn.Module, device: str | torch.device = "cpu", missing: Any = None,
               unexpected: str = "error") -> Pretrained:
    """Stream a Hugging Face checkpoint directory (``model.safetensors``, or shards and
    ``model.safetensors.index.json``, as ``save_pretrained`` writes them) into ``step.init``, one tensor at a time.

    ``model``: the model built under ``fzero.empty_params()`` whose params go to ``step.init``; the checkpoint's
    keys, shapes and ties are checked against it here. ``device``: where the values are made (the device the
    state will live on). See the module docstring for what is checked and how dtypes are handled.

    ``missing``: what makes the params the checkpoint lacks (a new head on a pretrained body, as
    ``AutoModelForSequenceClassification.from_pretrained`` of a base model): ``"init"``, the model's own
    initializer (``from_pretrained``'s: a Hugging Face model's ``_init_weights`` on that module, else the module's
    ``reset_parameters``), or any ``(path, meta) -> tensor``. They are listed in ``Pretrained.initialized``. Without
    it a missing param is an error that names it: nothing is made up silently.

    ``unexpected``: what to do with keys the checkpoint has and the model lacks: ``"error"`` (names them), or
    ``"ignore"``, as ``from_pretrained`` does (it warns): a base checkpoint's pooler or LM head under a classification
    model (roberta-base into ``RobertaForSequenceClassification``). The ones left out are listed in ``Pretrained.ignored``.
    """
    if unexpected not in ("error", "ignore"):
        raise ValueError(f"{API}: unexpected={unexpected!r}; pass 'error' (the default: name them) or 'ignore' (leave them "
                         f"out, as from_pretrained does).")
    if not isinstance(model, nn.Module):
        raise TypeError(f"{API}: model must be the nn.Module (built under fzero.empty_params()) whose params step.init makes, got {type(model).__name__}.")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{API}: path must be the directory save_pretrained wrote (a str or os.PathLike), got "
                        f"{type(path).__name__}; the model goes in model=.")
    _check_model(model)
    device = _device(device)
    directory = os.fspath(path)
    files = _files(directory)
    stored = _headers(directory, files)
    groups, buffers = _model_names(model)
    conversions = _Conversions.of(model, stored, {n for g in groups for n in g} | set(buffers))
    shapes = conversions.virtual(stored) if conversions is not None else stored  # the checkpoint as the model names it
    ckpt_to_model = _prefix_map(model, shapes, {n for g in groups for n in g} | set(buffers))
    have = {ckpt_to_model[k]: k for k in shapes}
    keys: dict[str, str] = {}
    missing_keys: list[str] = []
    for group in groups:  # a tied group is loaded from whichever of its names the checkpoint holds
        key = next((have[n] for n in group if n in have), None)
        if key is None:
            missing_keys.append(group[0])
        else:
            keys[group[0]] = key
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    for name in buffers:
        if name in have:
            keys[name] = have[name]
        elif buffers[name].is_meta or not any(p.search(name) for p in ignore_missing):
            missing_keys.append(name)  # from_pretrained keeps a buffer's initial value only where the class says so
    known = set(model.state_dict(keep_vars=True))  # frozen params too: _check_model names them
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    extra = [k for k in shapes if ckpt_to_model[k] not in known and not any(p.search(k) for p in ignore_unexpected)]
    ignored, extra = (tuple(extra), []) if unexpected == "ignore" else ((), extra)
    make = _initializer(model, missing)
    initialized = tuple(n for n in missing_keys if n not in buffers) if make is not None else ()
    lacking = [n for n in missing_keys if n not in initialized]
    if lacking or extra:
        raise ValueError(
            f"{API}: the checkpoint in {directory!r} does not fit {type(model).__name__}: "
            + (f"the model has {len(lacking)} key(s) the checkpoint lacks: {_few(lacking)}" if lacking else "")
            + ("; " if lacking and extra else "")
            + (f"the checkpoint has {len(extra)} key(s) the model lacks: {_few(extra)}" if extra else "")
            + ". If it was saved from another model or configuration, build the model from the checkpoint's own config "
              "(AutoConfig.from_pretrained(dir)), or rename the keys"
            + ("; for params that are new on purpose (a new head), pass missing='init' to initialize them as "
               "from_pretrained does" if any(n not in buffers for n in lacking) else "")
            + ("; for a checkpoint of a model with more (a base model's pooler or LM head under a classification "
               "head), pass unexpected='ignore' to leave those out, as from_pretrained does" if extra else "")
            + "."
        )
    tensors = dict(model.state_dict(keep_vars=True))
    casts = {}
    unsized = {k for k, (_, shape, _) in conversions.produced.items() if shape is None} if conversions is not None else set()
    for name, key in keys.items():
        shape, dtype = shapes[key]
        t = tensors[name]
        if key in unsized:  # converted by an operation that needs values: step.init checks the shape it makes
            continue
        if tuple(t.shape) != shape:
            made = "" if conversions is None or key not in conversions.produced else (
                f" (made from {len(conversions.sources[conversions.produced[key][0]])} stored tensors such as "
                f"{conversions.sources[conversions.produced[key][0]][0][0]!r}, converted as transformers converts them)")
            raise ValueError(
                f"{API}: {key!r}{made} has shape {shape} in the checkpoint in {directory!r} but {tuple(t.shape)} in "
                f"{type(model).__name__} ({name!r}): the checkpoint was saved from another configuration. Build the model "
                f"from the checkpoint's config (AutoConfig.from_pretrained(dir))."
            )
        if dtype != t.dtype:
            casts[key] = (dtype, t.dtype)
    return Pretrained(directory=directory, files=files, keys=keys, buffer_names=tuple(n for n in buffers if n in keys),
                      casts=casts, device=device, initialized=initialized, missing=make, conversions=conversions,
                      ignored=ignored)


class _Conversions:
    """The checkpoint keys that transformers renames or converts while loading ``model`` (see the module docstring),
    done with transformers' own mapping and operations. ``renamed``: model-side key -> stored key; ``produced``:
    model-side key -> (group, shape, dtype), made by converting the stored tensors of its group."""

    def __init__(self, model: nn.Module, converters: dict[str, Any], sources: dict[str, list[tuple[str, str]]],
                 renamed: dict[str, str], consumed: set[str]) -> None:
        self.model = model
        self.converters = converters  # group (its first target key) -> the converter (a template, copied per use)
        self.sources = sources  # group -> [(stored key, source pattern)], in transformers' order
        self.renamed = renamed
        self.consumed = consumed  # stored keys that are renamed or converted (not read under their own name)
        self.produced: dict[str, tuple[str, tuple[int, ...] | None, torch.dtype | None]] = {}
        self._made: dict[str, torch.Tensor] = {}  # produced tensors of a group not asked for yet (siblings: q of qkv)

    @classmethod
    def of(cls, model: nn.Module, stored: dict[str, Any], known: set[str]) -> "_Conversions | None":
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
        except ImportError:  # no transformers, or one without load-time conversions (before 5): keys are as stored
            return None
        if not isinstance(model, PreTrainedModel):
            return None
        mapping = get_model_conversion_mapping(model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = (getattr(model, "base_model_prefix", "") or "") + "."

        def knows(key: str) -> bool:
            return key in known or prefix + key in known or (key.startswith(prefix) and key[len(prefix):] in known)

        renamed, sources, templates, consumed = {}, {}, {}, set()
        for key in sorted(stored, key=dot_natural_key):
            if knows(key):
                continue  # stored as the model names it
            target, pattern = rename_source_key(key, renamings, converters)
            if target == key or not knows(target):
                continue  # not the model's (an unexpected key, named as such)
            consumed.add(key)
            if pattern is None:
                renamed[target] = key
            else:
                templates.setdefault(target, by_pattern[pattern])
                sources.setdefault(target, []).append((key, pattern))
        if not consumed:
            return None
        out = cls(model, templates, sources, renamed, consumed)
        for group in sources:  # the converted tensors' names and shapes, from the headers: the conversion on meta tensors
            try:
                made = out._convert(group, lambda k: torch.empty(stored[k][0], dtype=stored[k][1], device="meta"))
            except Exception:  # noqa: BLE001 - an operation that needs values: shapes are checked when it runs
                out.produced[group] = (group, None, None)
                continue
            for name, t in made.items():
                out.produced[name] = (group, tuple(t.shape), t.dtype)
        return out

    def virtual(self, stored: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's keys, shapes and dtypes as the model names them: renamed keys under their new name,
        converted ones replaced by what they make."""
        out = {k: v for k, v in stored.items() if k not in self.consumed}
        out.update({k: stored[s] for k, s in self.renamed.items()})
        out.update({k: (shape if shape is not None else (), dtype) for k, (_, shape, dtype) in self.produced.items()})
        return out

    def stored_key(self, key: str) -> str:
        return self.renamed.get(key, key)

    def produce(self, key: str, read: Any) -> torch.Tensor:
        """The converted tensor ``key``: converted with its group's stored tensors (each read by ``read``) on the
        first ask; a group's other outputs wait until they are asked for."""
        if key not in self._made:
            self._made.update(self._convert(self.produced[key][0], read))
        if key not in self._made:
            raise ValueError(f"{API}: converting the checkpoint's tensors for {key!r} (as transformers converts them "
                             f"while loading) made {sorted(self._made)[:5]}, not {key!r}.")
        return self._made.pop(key)

    def _convert(self, group: str, read: Any) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(self.converters[group])
        for key, pattern in self.sources[group]:
            converter.add_tensor(group, key, pattern, read(key))
        try:
            made = converter.convert(group, model=self.model, config=getattr(self.model, "config", None))
        except Exception as e:  # noqa: BLE001 - transformers' own error, named with what it was converting
            keys = [k for k, _ in self.sources[group]]
            raise ValueError(
                f"{API}: converting the checkpoint's {len(keys)} tensors {_few(keys)} into {group!r}, as transformers "
                f"converts them while loading, failed ({type(e).__name__}: {e}). A tensor of that group missing from the "
                f"checkpoint (one expert of a layer?), or one of another shape; from_pretrained refuses it too."
            ) from e
        return {k: v for k, v in made.items()}


def _files(directory: str) -> dict[str, str]:
    """checkpoint key -> file name: from the index of a sharded checkpoint, else from the one file's header."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{API}: {directory!r} is not a directory; pass the directory save_pretrained wrote.")
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:  # half-written (an interrupted copy), empty, not text
            raise ValueError(f"{API}: {index!r} is not readable JSON ({type(e).__name__}: {e}); the index is truncated or "
                             f"corrupted. Copy it again from the source, or write the checkpoint again with save_pretrained.") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"{API}: {index!r} has no weight_map of checkpoint key -> file name; it is not an index "
                             f"save_pretrained wrote.")
        absent = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(directory, v))})
        if absent:
            raise FileNotFoundError(f"{API}: {index!r} names files that are not in {directory!r}: {_few(absent)}; copy the whole directory.")
        return dict(weight_map)
    if os.path.exists(os.path.join(directory, WEIGHTS)):
        with _open(os.path.join(directory, WEIGHTS)) as f:
            return {k: WEIGHTS for k in f.keys()}
    held = sorted(os.listdir(directory))
    raise FileNotFoundError(
        f"{API}: {directory!r} holds neither {WEIGHTS} nor {INDEX} (it holds {_few(held)}). " + _other_format(held)
    )


def _device(device: Any) -> torch.device:
    """``device`` as a torch.device that can hold the values, checked before any file is read: "gpu" was torch's list of
    device types from the end of ``pretrained``, and "cuda" without a GPU its bare assert in the middle of ``step.init``."""
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{API}: device={device!r} is not a torch device ({e}); pass 'cpu' or 'cuda' (the device the "
                         f"state will live on).") from None
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{API}: device={device!r}, but torch sees no CUDA device here (torch.cuda.is_available() is "
                         f"False); pass device='cpu', or run where the GPU is.")
    return out


def _other_format(held: list[str]) -> str:
    """What to do with a directory of another format than Hugging Face's safetensors, from its file names: a DeepSpeed
    checkpoint and an fzero checkpoint have readers of their own; a ``.bin`` needs converting."""
    # fzero's first: a run directory of step_* checkpoints may also hold a `latest` file of the user's own
    if fzero_names(held):
        return ("It is an fzero checkpoint: resume it with fzero.checkpoint.load(dir, step), or write Hugging Face's files "
                "from it with fzero.checkpoint.consolidate(dir, out_dir, format='safetensors').")
    if deepspeed_names(held):
        return ("It is a DeepSpeed checkpoint (engine.save_checkpoint): resume it with fzero.checkpoint.from_deepspeed(dir, "
                "step), or export its weights with DeepSpeed's zero_to_fp32.py.")
    return "Only safetensors checkpoints are read; convert a pytorch_model.bin with save_pretrained(dir, safe_serialization=True)."


def _headers(directory: str, files: dict[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """checkpoint key -> (shape, dtype), from the headers alone (no tensor is read)."""
    out = {}
    by_file: dict[str, list[str]] = {}
    for key, file in files.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with _open(os.path.join(directory, file)) as f:
            stored = set(f.keys())
            for key in keys:
                if key not in stored:
                    raise ValueError(f"{API}: the index says {key!r} is in {file!r}, which does not hold it; the checkpoint is incomplete.")
                s = f.get_slice(key)
                out[key] = (tuple(s.get_shape()), _DTYPES.get(s.get_dtype(), s.get_dtype()))
    return out


def _model_names(model: nn.Module) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """The trained params as tie groups (``fzero.params_of``'s name first, then its aliases, in ``state_dict``
    order), and the persistent buffers by name."""
    params = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    groups: dict[int, list[str]] = {}
    buffers = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in params:
            groups.setdefault(id(t), [params[id(t)]])
            if name != params[id(t)]:
                groups[id(t)].append(name)
        elif not isinstance(t, nn.Parameter):
            buffers[name] = t
    return list(groups.values()), buffers


def _prefix_map(model: nn.Module, shapes: dict[str, Any], known: set[str]) -> dict[str, str]:
    """checkpoint key -> model name, with ``from_pretrained``'s handling of ``base_model_prefix``: a base model's
    keys get the prefix when the model has a head, and a head model's keys lose it when the model is the base."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    p = prefix + "."
    if prefix:
        model_has = any(n.startswith(p) for n in known)
        ckpt_has = any(k.startswith(p) for k in shapes)
        if model_has and not ckpt_has:
            return {k: p + k for k in shapes}
        if ckpt_has and not model_has:
            return {k: k[len(p):] if k.startswith(p) else k for k in shapes}
    return {k: k for k in shapes}


def _check_model(model: nn.Module) -> None:
    """What ``step.init`` cannot fix: params it would not make (real ones, frozen meta ones), meta constants."""
    real = [n for n, p in model.named_parameters() if not p.is_meta and p.requires_grad]  # frozen ones: read from the module
    if real:
        raise ValueError(
            f"{API}: {type(model).__name__}'s params {_few(real)} are real tensors, and step.init makes only meta params, "
            f"so their values would not come from the checkpoint. Build the model under `with fzero.empty_params():`."
        )
    frozen = [n for n, p in model.named_parameters() if p.is_meta and not p.requires_grad]
    if frozen:
        raise ValueError(
            f"{API}: {type(model).__name__}'s frozen params {_few(frozen)} are meta tensors; step.init makes only the params "
            f"it trains (fzero.params_of leaves frozen ones out), and a forward reads frozen ones from the module. Give "
            f"them their values first: model.load_state_dict({{name: tensor, ...}}, strict=False, assign=True) with the "
            f"checkpoint's tensors (safetensors' safe_open(...).get_tensor(name)); or set requires_grad=True, and they train."
        )
    meta = [f"{path}.{n}" if path else n for path, sub in model.named_modules() for n, b in sub._buffers.items()
            if b is not None and b.is_meta and n in sub._non_persistent_buffers_set]
    if meta:
        raise ValueError(f"{API}: {type(model).__name__}'s non-persistent buffers {_few(meta)} are meta tensors, and no checkpoint holds them. {META_BUFFER_FIX}.")


def _patterns(model: nn.Module, attribute: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or ())]


def _few(names: list[str]) -> str:
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"
