"""A byte-level text corpus that needs no download, and deterministic, resumable batches from it.

By default the corpus is the Python standard library's own ``.py`` sources on this machine (read in
sorted order, ``site-packages`` excluded, cut at ``max_bytes``), so every test and example has real
text to learn from offline. Tokens are bytes: vocabulary 256.

Batch ``k`` is a pure function of ``(seed, k)``: each step seeds its own ``torch.Generator``. A run can
therefore resume at any step, and every rank can draw the same global batch and take its own slice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import numbers
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["VOCAB_SIZE", "Curriculum", "load_corpus", "train_val_split", "batch_at", "batches"]

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


# -- curriculum learning ---------------------------------------------------------------------------------------------

SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete")


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """DeepSpeed's curriculum learning by sequence length (its ``"curriculum_learning"`` config block): training
    starts on short sequences and lengthens them on a schedule, a pure function of the step.

    ``difficulty(step)`` is the sequence length for the step that follows ``step`` optimizer steps (``state.step``),
    the value DeepSpeed's engine gives its model at that step; ``apply(batch, step)`` cuts every tensor of the batch
    to it along ``dim`` (tokens and their targets alike). Schedules, as DeepSpeed defines them:

    - ``fixed_linear`` / ``fixed_root``: ``min + (max - min) * (t / total_curriculum_step) ** (1 / root_degree)``
      at step ``t`` (counted from 1), floored, then down to a multiple of ``difficulty_step`` (at least the first
      multiple at or above ``min``), at most ``max``; linear is root degree 1;
    - ``fixed_discrete``: ``difficulty[i]`` up to step ``max_step[i]``, the last difficulty after the last max step;
      as in DeepSpeed, the first difficulty at or above ``max_difficulty`` holds from its step on.

    A frozen value: use it in a loop as ``step(state, curriculum.apply(batch, state.step_count))``, or read it from
    a DeepSpeed config (``fzero.config.from_deepspeed(...).curriculum``)."""

    min_difficulty: int
    max_difficulty: int
    schedule_type: str = "fixed_linear"
    total_curriculum_step: int | None = None
    difficulty_step: int = 1
    root_degree: float = 1.0
    difficulties: tuple[int, ...] = ()  # fixed_discrete: "difficulty"
    max_steps: tuple[int, ...] = ()  # fixed_discrete: "max_step"
    dim: int = 1  # the sequence dimension of the batch's tensors

    def __post_init__(self) -> None:
        api = "fzero.data.Curriculum"
        if self.schedule_type not in SCHEDULES:
            raise ValueError(f"{api}: schedule_type={self.schedule_type!r}; use one of {', '.join(map(repr, SCHEDULES))} "
                             f"(DeepSpeed's 'custom' schedule is a function of the step: call it yourself in the loop).")
        for name in ("min_difficulty", "max_difficulty", "difficulty_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{api}: {name}={value!r}; it must be a positive int (a sequence length, in tokens).")
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(f"{api}: min_difficulty={self.min_difficulty} is above max_difficulty={self.max_difficulty}.")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"{api}: dim={self.dim!r}; it must be an int >= 0, the sequence dimension counted from the "
                             f"front (1 for (batch, seq) tensors): counted from the back, a (batch,) label tensor's only "
                             f"dimension would be cut as if it were the sequence.")
        if self.schedule_type == "fixed_discrete":
            d = _positive_ints(api, "difficulties", self.difficulties, "sequence lengths, in tokens")
            m = _positive_ints(api, "max_steps", self.max_steps, "optimizer steps")
            if not d or len(d) != len(m) + 1:
                raise ValueError(f"{api}: fixed_discrete needs difficulties (one more than max_steps) and max_steps; got "
                                 f"{len(d)} difficulties and {len(m)} max_steps. The last difficulty holds after the last max step.")
            if any(b < a for a, b in zip(d, d[1:])) or any(b <= a for a, b in zip(m, m[1:])):
                raise ValueError(f"{api}: fixed_discrete needs non-decreasing difficulties {list(d)} and increasing max_steps "
                                 f"{list(m)}: a curriculum grows (DeepSpeed stops updating once the max is reached).")
            object.__setattr__(self, "difficulties", d)
            object.__setattr__(self, "max_steps", m)
        else:
            if (isinstance(self.total_curriculum_step, bool) or not isinstance(self.total_curriculum_step, int)
                    or self.total_curriculum_step < 1):
                raise ValueError(f"{api}: {self.schedule_type} needs total_curriculum_step, a positive int (the steps from "
                                 f"min to max difficulty); got {self.total_curriculum_step!r}.")
            if self.schedule_type == "fixed_root" and not (isinstance(self.root_degree, (int, float)) and not
                                                           isinstance(self.root_degree, bool) and self.root_degree > 0):
                raise ValueError(f"{api}: root_degree={self.root_degree!r}; it must be a positive number (2: square root).")

    def difficulty(self, step: int) -> int:
        """The sequence length after ``step`` optimizer steps (DeepSpeed's ``update_difficulty(global_steps + 1)``)."""
        try:
            t = int(step) + 1
        except (TypeError, ValueError):  # None, NaN, a batch passed for the step: named, not int()'s message
            raise TypeError(f"fzero.data.Curriculum: step={step!r}; pass the optimizer steps taken so far, an int "
                            f"(state.step_count).") from None
        if self.min_difficulty >= self.max_difficulty:  # DeepSpeed starts at the min and updates only below the max
            return self.min_difficulty
        if self.schedule_type == "fixed_discrete":
            for limit, value in zip(self.max_steps, self.difficulties):
                # DeepSpeed stops updating once a difficulty reaches max_difficulty: that one holds from then on
                if t <= limit or value >= self.max_difficulty:
                    return value
            return self.difficulties[-1]
        degree = 1.0 if self.schedule_type == "fixed_linear" else float(self.root_degree)
        span = self.max_difficulty - self.min_difficulty
        value = math.floor((float(t) / self.total_curriculum_step) ** (1.0 / degree) * span + self.min_difficulty)
        value -= value % self.difficulty_step
        first = -(-self.min_difficulty // self.difficulty_step) * self.difficulty_step
        return min(max(value, first), self.max_difficulty)

    def apply(self, batch: Any, step: int) -> Any:
        """``batch`` with each tensor of at least ``dim + 1`` dimensions cut to ``difficulty(step)`` along ``dim`` (a
        view); other leaves, and tensors already as short, are left as they are. Dicts, lists and tuples are walked."""
        length = self.difficulty(step)
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and self.dim == 1 and mask.shape[1] > length:
            left = (mask[:, 0] == 0) & mask.bool().any(1)  # a row that starts with padding and has tokens after it
            if bool(left.any()):
                raise ValueError(
                    f"fzero.data.Curriculum.apply: the batch is left-padded (attention_mask row "
                    f"{int(left.nonzero()[0])} starts with padding), and the curriculum keeps the first {length} "
                    f"positions, as DeepSpeed's does: a short row would keep only its padding. Pad on the right for "
                    f"training (tokenizer.padding_side = 'right').")

        def cut(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.narrow(self.dim, 0, length) if x.dim() > self.dim and x.shape[self.dim] > length else x
            if isinstance(x, dict):
                return {k: cut(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(cut(v) for v in x)
            return x

        return cut(batch)

    @classmethod
    def from_deepspeed(cls, block: dict[str, Any]) -> "Curriculum":
        """From DeepSpeed's ``"curriculum_learning"`` block (``curriculum_type`` "seqlen", ``min_difficulty``,
        ``max_difficulty``, ``schedule_type`` and its ``schedule_config``)."""
        api = "fzero.data.Curriculum.from_deepspeed"
        if not isinstance(block, dict):
            raise TypeError(f"{api}: block must be the \"curriculum_learning\" dict of a DeepSpeed config, got "
                            f"{type(block).__name__}.")
        kind = block.get("curriculum_type", "seqlen")
        if kind != "seqlen":
            raise NotImplementedError(f"{api}: curriculum_type={kind!r}: fzero's curriculum is by sequence length "
                                      f"('seqlen'); another metric needs your own difficulty function in the loop.")
        missing = [k for k in ("min_difficulty", "max_difficulty", "schedule_type") if k not in block]
        if missing:
            raise ValueError(f"{api}: the block lacks {missing}; DeepSpeed requires them too.")
        sc = dict(block.get("schedule_config") or {})
        kind = block["schedule_type"]
        need = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
                "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
                "fixed_discrete": ("difficulty", "max_step")}.get(kind, ())
        lacking = [k for k in need if k not in sc]
        if lacking:
            raise ValueError(f"{api}: schedule_type {kind!r} needs schedule_config keys {lacking}.")
        known = {"total_curriculum_step", "difficulty_step", "root_degree", "difficulty", "max_step"}
        unknown = sorted(set(sc) - known)
        if unknown:
            raise ValueError(f"{api}: unknown schedule_config keys {unknown}; known: {sorted(known)}.")
        return cls(min_difficulty=block["min_difficulty"], max_difficulty=block["max_difficulty"], schedule_type=kind,
                   total_curriculum_step=sc.get("total_curriculum_step"), difficulty_step=sc.get("difficulty_step", 1),
                   root_degree=sc.get("root_degree", 1.0), difficulties=sc.get("difficulty", ()),
                   max_steps=sc.get("max_step", ()))


def _positive_ints(api: str, name: str, values: Any, what: str) -> tuple[int, ...]:
    """``values`` (a sequence of ``what``: a list, or a ``range``, Hydra ``ListConfig`` or numpy ints, as before these
    checks) as a tuple of ints, each positive: a difficulty of 0 cut every batch to no tokens, and 8.5 failed deep in
    ``narrow``; an int for the list was a raw TypeError."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{api}: {name}={values!r}; it must be a list of {what}, one per stage of the schedule.")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1]
    if bad:
        raise ValueError(f"{api}: {name}={list(values)} holds {bad[0]!r}; each must be a positive int ({what}).")
    return tuple(int(v) for v in values)

