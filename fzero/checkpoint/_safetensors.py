"""A streaming writer of Hugging Face's weight files: ``model.safetensors``, or ``model-0000k-of-0000N.safetensors``
shards and ``model.safetensors.index.json``, written one tensor at a time.

Why our own writer and not ``safetensors.torch.save_file``: that one needs every tensor of a file in memory at
once, so exporting a ZeRO-3 model would gather it whole. The format is simple (an 8-byte little-endian header
length, a JSON header giving each tensor's dtype, shape and byte range, then the bytes in that order), and the
header depends only on names, shapes and dtypes, which are known before any tensor is gathered. So the header is
written first and each tensor's bytes are appended as its unit arrives: memory holds one unit, not the model.
``safetensors`` itself is not needed to write (the tests read the files back with it and with ``from_pretrained``).

Shards follow ``save_pretrained``'s rule: tensors in order, a new file when the next one would pass
``max_shard_size`` (a tensor larger than that gets a file of its own); ``index.json`` maps every name to its
file and records ``total_size``. Files are written as ``.<name>.partial`` and renamed when all are complete; then
the weight files of an earlier export in the same directory that are not part of this one are removed (so
``from_pretrained`` cannot mix them), and nothing else there is touched (a ``config.json`` beside them stays).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Any

import torch

from fzero.checkpoint._dcp import CheckpointError

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclasses.dataclass(frozen=True)
class Item:
    """One tensor of the output: its name, shape and dtype in the file."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def out_dtype(dtype: Any, *, api: str) -> torch.dtype:
    """The torch dtype for ``dtype="fp32"|"bf16"|"fp16"`` (floating tensors are converted to it, others kept)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"{api}: dtype must be one of {sorted(DTYPES)} (the dtype of the floating tensors written), got {dtype!r}.")
    return DTYPES[dtype]


def parse_size(size: Any, *, api: str) -> int:
    """``max_shard_size`` in bytes: an int, or a string as ``save_pretrained`` takes ("5GB", "500MB", "2GiB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = _SIZE.match(size) if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{api}: max_shard_size must be a positive number of bytes or a string such as '5GB' or '500MB', got {size!r}.")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper() if m.group(2) else None])


def shards(items: list[Item], max_bytes: int) -> list[list[Item]]:
    """``items`` in order into files of at most ``max_bytes`` of data each (one larger tensor: a file of its own)."""
    out: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if out[-1] and size + item.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item.nbytes
    return out


def file_names(count: int) -> list[str]:
    return [WEIGHTS] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]


def header(items: list[Item]) -> bytes:
    """The length-prefixed JSON header of a file holding ``items`` in order, padded to 8 bytes as safetensors does."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        meta[item.name] = {"dtype": _CODES[item.dtype], "shape": list(item.shape), "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def check_in_range(name: str, source: torch.Tensor, written: torch.Tensor, *, api: str) -> None:
    """Refuse a tensor whose values the output dtype cannot hold: ``dtype="fp16"`` of fp32 or bf16 values past 65504.

    Why: the cast makes them inf without a word (as ``model.half()`` does), and the exported model then computes inf
    and NaN wherever it reads them. Only finite values that became inf are refused; an inf or NaN the state already
    held is written as it is."""
    if not written.is_floating_point() or written.dtype == source.dtype or not written.numel():
        return
    inf = torch.isinf(written)
    if not bool(inf.any()):  # the usual case: one pass over what is written, none over the source
        return
    lost = inf & torch.isfinite(source.detach().reshape(-1).to(device="cpu"))
    if not bool(lost.any()):
        return
    largest = float(source.detach().abs().max())
    raise CheckpointError(
        f"{api}: {name} holds {int(lost.sum())} value(s) too large for {str(written.dtype).removeprefix('torch.')} "
        f"(largest magnitude {largest:.6g}; the dtype's largest finite is {torch.finfo(written.dtype).max:.6g}): written "
        f"in it, they would be inf. Export with dtype=\"bf16\" (fp32's range) or dtype=\"fp32\"."
    )


class Writer:
    """Writes ``items`` (in order, one ``put`` each) into ``directory`` as safetensors files; ``close()`` publishes them.

    Used as a context manager: on an exception the partial files are removed and the directory is left as it was.
    """

    def __init__(self, directory: str, items: list[Item], *, max_shard_size: int, api: str) -> None:
        if sys.byteorder != "little":
            raise CheckpointError(f"{api}: safetensors files are little-endian; writing them on a big-endian machine is not supported.")
        for item in items:
            if item.dtype not in _CODES:
                raise CheckpointError(f"{api}: {item.name} has dtype {item.dtype}, which safetensors cannot store.")
        seen: set[str] = set()
        for item in items:
            if item.name in seen:
                raise CheckpointError(f"{api}: two tensors are named {item.name!r}; a safetensors file needs distinct names.")
            seen.add(item.name)
        self.directory, self.api = directory, api
        self.files = shards(items, max_shard_size)
        self.names = file_names(len(self.files))
        self.partials = [os.path.join(directory, f".{n}.partial") for n in self.names]
        self.todo = [(k, item) for k, f in enumerate(self.files) for item in f]
        self.next, self.current, self.handle = 0, -1, None
        self.total = sum(item.nbytes for item in items)

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if error is not None:
            self.abort()

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor`` as ``name``: it must be the next item, with that shape (converted to the item's dtype)."""
        if self.next >= len(self.todo) or self.todo[self.next][1].name != name:
            expected = self.todo[self.next][1].name if self.next < len(self.todo) else "nothing more"
            raise CheckpointError(f"{self.api}: internal error: {name} written where {expected} was due; please report it.")
        k, item = self.todo[self.next]
        if tuple(tensor.shape) != item.shape:
            raise CheckpointError(f"{self.api}: {name} has shape {list(tensor.shape)}, but {list(item.shape)} was expected.")
        if k != self.current:
            self._open(k)
        data = tensor.detach().to(device="cpu", dtype=item.dtype).contiguous().reshape(-1)
        check_in_range(name, tensor, data, api=self.api)
        self.handle.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        self.next += 1

    def _open(self, k: int) -> None:
        self._close_handle()
        self.handle = open(self.partials[k], "wb")
        self.current = k
        self.handle.write(header(self.files[k]))

    def _close_handle(self) -> None:
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())
            self.handle.close()
            self.handle = None

    def close(self) -> list[str]:
        """Finish the files, rename them into place, write the index (sharded), remove an earlier export's leftovers."""
        if self.next != len(self.todo):
            raise CheckpointError(f"{self.api}: internal error: {len(self.todo) - self.next} tensors were never written; please report it.")
        for k in range(len(self.files)):
            if k > self.current:  # a file of empty tensors only: nothing was put into it
                self._open(k)
        self._close_handle()
        for partial, name in zip(self.partials, self.names):
            os.replace(partial, os.path.join(self.directory, name))
        if len(self.names) > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {item.name: name for name, f in zip(self.names, self.files) for item in f}}
            tmp = os.path.join(self.directory, f".{INDEX}.partial")
            with open(tmp, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.directory, INDEX))
        keep = set(self.names) | ({INDEX} if len(self.names) > 1 else set())
        for e in os.listdir(self.directory):
            if e not in keep and (e in (WEIGHTS, INDEX) or SHARD_NAME.match(e)):
                os.remove(os.path.join(self.directory, e))
        return [os.path.join(self.directory, n) for n in self.names]

    def abort(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None
        for partial in self.partials:
            if os.path.exists(partial):
                os.remove(partial)
