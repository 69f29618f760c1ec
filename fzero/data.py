"""A byte-level text corpus that needs no download, and deterministic, resumable batches from it.

By default the corpus is the Python standard library's own ``.py`` sources on this machine (read in
sorted order, ``site-packages`` excluded, cut at ``max_bytes``), so every test and example has real
text to learn from offline. Tokens are bytes: vocabulary 256.

Batch ``k`` is a pure function of ``(seed, k)``: each step seeds its own ``torch.Generator``. A run can
therefore resume at any step, and every rank can draw the same global batch and take its own slice.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["VOCAB_SIZE", "load_corpus", "train_val_split", "batch_at", "batches"]

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8 * 2**20

# Third-party code is not "the standard library" and can be huge (torch alone is hundreds of MB).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def load_corpus(path: str | os.PathLike | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Bytes of a text corpus as a 1-D uint8 tensor of at most ``max_bytes`` elements.

    ``path=None`` reads the standard library's ``.py`` files (deterministic on a given Python install);
    otherwise ``path`` names any file, read as raw bytes.
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"load_corpus(max_bytes={max_bytes!r}): must be a positive int number of bytes, "
                         "e.g. max_bytes=8 * 2**20.")
    if path is None:
        raw = _stdlib_bytes(max_bytes)
    else:
        file = Path(path)
        if not file.is_file():
            what = "is a directory" if file.is_dir() else "does not exist"
            raise FileNotFoundError(f"load_corpus(path={str(path)!r}): {what}; pass the path of an existing "
                                    "text file, or path=None for the standard-library corpus.")
        with open(file, "rb") as f:
            raw = f.read(max_bytes)
    if not raw:
        raise ValueError(f"load_corpus(path={None if path is None else str(path)!r}): the corpus is empty; "
                         "pass a non-empty text file.")
    # bytearray, not bytes: torch.frombuffer warns on a read-only buffer.
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _stdlib_bytes(max_bytes: int) -> bytes:
    root = sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise FileNotFoundError(f"load_corpus(path=None): the standard library directory {root!r} is not on "
                                "disk (a zipped or embedded Python?); pass path= a text file instead.")
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes the walk order, so the corpus is the same on every run.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                chunk = f.read(max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return b"".join(chunks)
    return b"".join(chunks)


def train_val_split(data: torch.Tensor, *, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D corpus into (train, val): val is the last ``val_fraction`` of it, train the rest."""
    if data.dim() != 1:
        raise ValueError(f"train_val_split: data must be a 1-D tensor, got shape {tuple(data.shape)}.")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"train_val_split(val_fraction={val_fraction!r}): must be strictly between 0 and 1, "
                         "e.g. 0.05.")
    n_val = int(round(len(data) * val_fraction))
    if n_val < 1 or n_val >= len(data):
        raise ValueError(f"train_val_split(val_fraction={val_fraction!r}): a corpus of {len(data)} bytes "
                         f"gives {n_val} validation bytes, leaving one side empty; use a larger corpus "
                         "or another val_fraction.")
    return data[:-n_val], data[-n_val:]


def _check_batch_args(data: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int,
                      fn: str) -> None:
    if data.dim() != 1:
        raise ValueError(f"{fn}: data must be a 1-D tensor of token ids (see load_corpus), "
                         f"got shape {tuple(data.shape)}.")
    for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("seed", seed, 0),
                             ("start_step" if fn == "batches" else "step", step, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{fn}({name}={value!r}): must be an int >= {low}.")
    if len(data) < seq_len + 1:
        raise ValueError(f"{fn}(seq_len={seq_len}): data has {len(data)} tokens but one example needs "
                         f"seq_len + 1 = {seq_len + 1} (inputs plus the shifted target); use a larger "
                         "corpus (load_corpus(max_bytes=...)) or a smaller seq_len.")


def _step_generator(seed: int, step: int) -> torch.Generator:
    # Hash (seed, step) into a 63-bit seed: no two (seed, step) pairs share a stream, unlike seed + step.
    digest = hashlib.blake2b(f"fzero.data:{seed}:{step}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def _batch_at(data: torch.Tensor, step: int, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=_step_generator(seed, step))
    window = data[starts[:, None] + torch.arange(seq_len + 1)].long()  # (B, T+1)
    return {"x": window[:, :-1], "y": window[:, 1:]}


def batch_at(data: torch.Tensor, step: int, *, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Batch number ``step``: ``{"x": int64 (B, T), "y": int64 (B, T)}``, ``y`` is ``x`` shifted by one.

    Windows start at uniform random offsets drawn from a generator seeded by ``(seed, step)`` alone.
    """
    _check_batch_args(data, batch_size, seq_len, seed, step, "batch_at")
    return _batch_at(data, step, batch_size, seq_len, seed)


def batches(data: torch.Tensor, *, batch_size: int, seq_len: int, seed: int,
            start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Infinite iterator of ``batch_at(data, k, ...)`` for ``k = start_step, start_step + 1, ...``.

    Arguments are checked here, when it is called, not at the first ``next()``.
    """
    _check_batch_args(data, batch_size, seq_len, seed, start_step, "batches")
    return _batches(data, batch_size, seq_len, seed, start_step)


def _batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int,
             step: int) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield _batch_at(data, step, batch_size, seq_len, seed)
        step += 1
