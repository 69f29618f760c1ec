"""Block-sparse attention with DeepSpeed's sparsity layouts (its retired ``deepspeed.ops.sparse_attention``).

A layout is a frozen config that says, for a sequence cut into blocks of ``block`` tokens, which key blocks each query
block attends to: ``layout.blocks(num_blocks)`` is a bool tensor ``(heads or 1, num_blocks, num_blocks)``. The five
DeepSpeed users know, with DeepSpeed's rules and defaults:

- ``DenseLayout``: every block (for comparison);
- ``FixedLayout`` (Sparse Transformers, Child et al. 2019): local windows of ``num_local_blocks``, and in each window
  its last ``num_global_blocks`` as global columns (``horizontal_global_attention``: rows too); with
  ``different_layout_per_head``, head h takes the window's (h mod ``num_different_global_patterns``)-th group from
  the end;
- ``VariableLayout``: local windows of the sizes in ``local_window_blocks`` (the last size repeats), global blocks at
  ``global_block_indices`` (or ranges to ``global_block_end_indices``), and ``num_random_blocks`` random ones a row;
- ``BigBirdLayout`` (Zaheer et al. 2020): a sliding window of ``num_sliding_window_blocks``, the first
  ``num_global_blocks`` as global rows and columns, ``num_random_blocks`` random ones a row;
- ``BSLongformerLayout`` (block-sparse Longformer): a sliding window, and global rows and columns at the indices.

``attention="unidirectional"`` keeps each layout's blocks at or below the diagonal (DeepSpeed's rules, in the order it
applies them); the token-level causal mask inside a block is ``sparse_attention(..., causal=True)``'s. Random blocks
come from a generator seeded by ``seed`` (DeepSpeed drew them from Python's global ``random``), so every rank builds
the same layout. A sequence that is not a whole number of blocks is padded to one: the padding is masked out.

``sparse_attention(q, k, v, layout, causal=False, attn_mask=None)`` runs PyTorch's FlexAttention on CUDA (a
``BlockMask`` built from the layout, compiled to Triton kernels) and, elsewhere, a torch reference that computes only
the layout's blocks (FlexAttention has no backward on the CPU). Both equal dense attention with the same mask to
rounding. ``attn_mask`` is the model's own mask (a Hugging Face padding mask, DeepSpeed's ``key_padding_mask``), ANDed
with the layout: bool, broadcastable to ``(batch, heads, seq, seq)``, True where a query may attend, as SDPA takes it;
a query left with no key gives zeros, as SDPA does. A layout with ``different_layout_per_head`` and the default
``num_heads=1`` (as a DeepSpeed config block gives it: DeepSpeed takes the head count from the model) is made for the
heads of ``q``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

_ATTENTION = ("bidirectional", "unidirectional")


def _check(layout: Any, **minimum: int) -> None:
    """Refuse a layout's settings that would not make a layout: an attention kind other than DeepSpeed's two, and a
    count (``block`` and each ``minimum`` key: its least value) that is not an int at least that. Why here: a count
    of 0 or below made a ZeroDivisionError, an endless loop (a local window of 0 blocks) or, silently, another layout
    (a negative number of random blocks took all but that many; a negative global count took all but the last rows)."""
    name = type(layout).__name__
    attention = getattr(layout, "attention", "bidirectional")
    if attention not in _ATTENTION:
        raise ValueError(f"fzero.ops.{name}: attention={attention!r}; use 'bidirectional' or 'unidirectional'.")
    block = layout.block
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"fzero.ops.{name}: block={block!r}; it must be a positive int (tokens per block).")
    for field, low in {"num_heads": 1, **minimum}.items():
        value = getattr(layout, field)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            what = {"num_heads": "heads", "num_different_global_patterns": "global patterns"}.get(field, "blocks")
            raise ValueError(f"fzero.ops.{name}: {field}={value!r}; it must be an int >= {low} (a count of {what}).")
    for field in ("different_layout_per_head", "horizontal_global_attention"):
        value = getattr(layout, field, False)
        if not isinstance(value, bool):
            raise ValueError(f"fzero.ops.{name}: {field}={value!r}; it must be True or False.")


def _blocks_list(name: str, field: str, values: Any, *, low: int) -> tuple[int, ...]:
    """``values`` (a sequence of block counts or indices: DeepSpeed's config gives a list; a ``range``, a Hydra
    ``ListConfig`` or numpy ints are taken as DeepSpeed takes them, as they were before these checks) as a tuple of
    ints, each at least ``low``; anything else is refused by field name (an int for a list, a negative index)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"fzero.ops.{name}: {field}={values!r}; it must be a list of ints such as [{max(low, 0)}] "
                         f"(one entry per window or global block).")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low]
    if bad:
        raise ValueError(f"fzero.ops.{name}: {field}={list(values)} holds {bad[0]!r}; each entry must be an int >= {low}.")
    return tuple(int(v) for v in values)


def _need(name: str, what: str, count: int, num_blocks: int) -> None:
    if count > num_blocks:
        raise ValueError(f"fzero.ops.{name}: {what}={count} is more than the {num_blocks} blocks of this sequence; use a "
                         f"longer sequence or a smaller {what} (DeepSpeed refuses it too).")


def _random_blocks(layout: torch.Tensor, count: int, seed: int, *, causal_rows: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = layout.shape[0]
    for row in range(n):
        width = row + 1 if causal_rows else n
        cols = torch.randperm(width, generator=gen)[:count]
        layout[row, cols] = True


@dataclasses.dataclass(frozen=True)
class DenseLayout:
    block: int = 16
    num_heads: int = 1
    different_layout_per_head: bool = False  # accepted as DeepSpeed does: every head's layout is the same

    def __post_init__(self) -> None:
        _check(self)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        return torch.ones(1, num_blocks, num_blocks, dtype=torch.bool)


@dataclasses.dataclass(frozen=True)
class FixedLayout:
    block: int = 16
    num_heads: int = 1
    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1
    different_layout_per_head: bool = False

    def __post_init__(self) -> None:
        _check(self, num_local_blocks=1, num_global_blocks=1, num_different_global_patterns=1)
        if self.num_local_blocks % self.num_global_blocks:
            raise ValueError(f"fzero.ops.FixedLayout: num_local_blocks={self.num_local_blocks} is not a multiple of "
                             f"num_global_blocks={self.num_global_blocks}.")
        if self.horizontal_global_attention and self.attention != "bidirectional":
            raise ValueError(f"fzero.ops.FixedLayout: horizontal_global_attention needs attention='bidirectional', got "
                             f"attention={self.attention!r}.")
        if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
            raise ValueError(f"fzero.ops.FixedLayout: num_different_global_patterns={self.num_different_global_patterns} "
                             f"needs different_layout_per_head=True (one layout for all heads has one global pattern).")
        if self.num_different_global_patterns > self.num_local_blocks // self.num_global_blocks:
            raise ValueError(f"fzero.ops.FixedLayout: num_different_global_patterns={self.num_different_global_patterns} is "
                             f"more than num_local_blocks / num_global_blocks = {self.num_local_blocks // self.num_global_blocks}.")

    def blocks(self, num_blocks: int) -> torch.Tensor:
        heads = self.num_heads if self.different_layout_per_head else 1
        return torch.stack([self._head(h, num_blocks) for h in range(heads)])

    def _head(self, h: int, n: int) -> torch.Tensor:
        out = torch.zeros(n, n, dtype=torch.bool)
        uni = self.attention == "unidirectional"
        w, g = self.num_local_blocks, self.num_global_blocks
        for start in range(0, n, w):  # local windows (the last one may be short)
            end = min(start + w, n)
            out[start:end, start:end] = True
        if uni:
            out &= torch.ones(n, n, dtype=torch.bool).tril()
        first = w - (1 + h % self.num_different_global_patterns) * g  # the global group's place in its window

        def global_cols(c0: int, c1: int) -> None:
            out[0 if not uni else c0:, c0:c1] = True
            if self.horizontal_global_attention:
                out[c0:c1, :] = True

        whole = n - n % w
        for c in range(first, whole, w):
            global_cols(c, c + g)
        if whole < n:  # a short last window: its global group as near its place as fits
            c = min(whole + first, n - g)
            global_cols(c, c + g)
        return out


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    block: int = 16
    num_heads: int = 1
    num_random_blocks: int = 0
    local_window_blocks: tuple[int, ...] = (4,)
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: tuple[int, ...] | None = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    different_layout_per_head: bool = False  # each head its own random blocks
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self, num_random_blocks=0)
        windows = _blocks_list("VariableLayout", "local_window_blocks", self.local_window_blocks, low=1)
        if not windows:
            raise ValueError("fzero.ops.VariableLayout: local_window_blocks=[]; give at least one window size in blocks "
                             "(the last one repeats), e.g. [4].")
        object.__setattr__(self, "local_window_blocks", windows)
        starts, ends = _global_indices("VariableLayout", self.global_block_indices, self.global_block_end_indices)
        object.__setattr__(self, "global_block_indices", starts)
        object.__setattr__(self, "global_block_end_indices", ends)
        if self.horizontal_global_attention and self.attention != "bidirectional":
            raise ValueError(f"fzero.ops.VariableLayout: horizontal_global_attention needs attention='bidirectional', "
                             f"got attention={self.attention!r}.")

    def blocks(self, num_blocks: int) -> torch.Tensor:
        heads = self.num_heads if self.different_layout_per_head and self.num_random_blocks else 1
        return torch.stack([self._head(h, num_blocks) for h in range(heads)])

    def _head(self, h: int, num_blocks: int) -> torch.Tensor:
        n, uni = num_blocks, self.attention == "unidirectional"
        _need("VariableLayout", "num_random_blocks", self.num_random_blocks, n)
        out = torch.zeros(n, n, dtype=torch.bool)
        if self.num_random_blocks:
            _random_blocks(out, self.num_random_blocks, self.seed + h, causal_rows=False)  # as DeepSpeed: any column
        start, sizes = 0, list(self.local_window_blocks)
        while start < n:  # the windows' sizes in turn, then the last size again
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
            end = min(start + size, n)
            local = torch.ones(end - start, end - start, dtype=torch.bool)
            out[start:end, start:end] |= local.tril() if uni else local
            start += size
        for s, e in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            if self.horizontal_global_attention:
                out[s:e, :] = True
            out[0 if not uni else s:, s:e] = True
        return out


@dataclasses.dataclass(frozen=True)
class BigBirdLayout:
    block: int = 16
    num_heads: int = 1
    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    different_layout_per_head: bool = False  # each head its own random blocks
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self, num_random_blocks=0, num_sliding_window_blocks=0, num_global_blocks=0)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        heads = self.num_heads if self.different_layout_per_head and self.num_random_blocks else 1
        return torch.stack([self._head(h, num_blocks) for h in range(heads)])

    def _head(self, h: int, num_blocks: int) -> torch.Tensor:
        n, uni = num_blocks, self.attention == "unidirectional"
        for what in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
            _need("BigBirdLayout", what, getattr(self, what), n)
        out = torch.zeros(n, n, dtype=torch.bool)
        _random_blocks(out, self.num_random_blocks, self.seed + h, causal_rows=uni)
        _sliding(out, self.num_sliding_window_blocks)
        out[: self.num_global_blocks, :] = True
        out[:, : self.num_global_blocks] = True
        return out.tril() if uni else out


@dataclasses.dataclass(frozen=True)
class BSLongformerLayout:
    block: int = 16
    num_heads: int = 1
    num_sliding_window_blocks: int = 3
    global_block_indices: tuple[int, ...] = (0,)
    global_block_end_indices: tuple[int, ...] | None = None
    attention: str = "bidirectional"
    different_layout_per_head: bool = False  # accepted as DeepSpeed does: every head's layout is the same

    def __post_init__(self) -> None:
        _check(self, num_sliding_window_blocks=0)
        starts, ends = _global_indices("BSLongformerLayout", self.global_block_indices, self.global_block_end_indices)
        object.__setattr__(self, "global_block_indices", starts)
        object.__setattr__(self, "global_block_end_indices", ends)

    def blocks(self, num_blocks: int) -> torch.Tensor:
        n = num_blocks
        _need("BSLongformerLayout", "num_sliding_window_blocks", self.num_sliding_window_blocks, n)
        out = torch.zeros(n, n, dtype=torch.bool)
        _sliding(out, self.num_sliding_window_blocks)
        for s, e in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            out[s:e, :] = True
            out[:, s:e] = True
        return (out.tril() if self.attention == "unidirectional" else out)[None]


def _global_ranges(starts: tuple[int, ...], ends: tuple[int, ...] | None, n: int) -> list[tuple[int, int]]:
    """The global blocks' [start, end) ranges inside ``n`` blocks: single blocks at ``starts``, or up to ``ends``."""
    ends = ends if ends is not None else tuple(i + 1 for i in starts)
    return [(s, min(e, n)) for s, e in zip(starts, ends) if s < n]


def _global_indices(name: str, starts: Any, ends: Any) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    starts = _blocks_list(name, "global_block_indices", starts, low=0)  # a negative index made no global block, silently
    if ends is None:
        return starts, None
    ends = _blocks_list(name, "global_block_end_indices", ends, low=1)
    if len(ends) != len(starts) or any(e <= s for s, e in zip(starts, ends)):
        raise ValueError(f"fzero.ops.{name}: global_block_end_indices={list(ends)} must pair with global_block_indices="
                         f"{list(starts)}, each end after its start.")
    return starts, ends


def _sliding(out: torch.Tensor, window: int) -> None:
    n, half = out.shape[0], window // 2
    for row in range(n):
        out[row, max(0, row - half):min(row + half + 1, n)] = True


LAYOUTS = {"dense": DenseLayout, "fixed": FixedLayout, "variable": VariableLayout, "bigbird": BigBirdLayout,
           "bslongformer": BSLongformerLayout}


def from_deepspeed(block: dict[str, Any], *, num_heads: int = 1) -> Any:
    """A layout from DeepSpeed's ``"sparse_attention"`` config block (``mode`` and that mode's keys)."""
    settings = dict(block)
    mode = settings.pop("mode", "fixed")
    if mode not in LAYOUTS:
        raise ValueError(f"fzero.ops.sparse_attention: mode={mode!r}; DeepSpeed's modes are {', '.join(map(repr, LAYOUTS))}.")
    cls = LAYOUTS[mode]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"fzero.ops.sparse_attention: unknown keys {unknown} for mode {mode!r}; known: {sorted(known)}.")
    return cls(**{"num_heads": num_heads, **settings})


def _for_heads(layout: Any, heads: int) -> Any:
    """``layout`` for ``heads`` heads: a per-head layout left at the default ``num_heads=1`` (a DeepSpeed config block's,
    which has no head count: DeepSpeed's sparse attention takes it from the model) gets the model's head count, so that
    each head takes its own pattern instead of every head taking head 0's."""
    if (heads > 1 and getattr(layout, "different_layout_per_head", False) is True and getattr(layout, "num_heads", None) == 1
            and dataclasses.is_dataclass(layout)):
        return dataclasses.replace(layout, num_heads=heads)
    return layout


def _mask_4d(attn_mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The caller's mask checked and viewed as ``(batch or 1, heads or 1, seq, seq)`` (a view: broadcast, not copied)."""
    B, H, T = q.shape[:3]
    name = "fzero.ops.sparse_attention"
    if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
        raise ValueError(f"{name}: attn_mask must be a bool tensor, True where a query may attend (as SDPA takes it); got "
                         f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}. From an additive float mask: "
                         f"attn_mask > torch.finfo(attn_mask.dtype).min / 2; from a (batch, seq) padding mask: "
                         f"attention_mask[:, None, None, :].bool().")
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() <= 4 else None
    if m is None or m.shape[0] not in (1, B) or m.shape[1] not in (1, H) or m.shape[2] not in (1, T) or m.shape[3] not in (1, T):
        raise ValueError(f"{name}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (batch, heads, seq, seq) "
                         f"= {(B, H, T, T)}.")
    return m.to(q.device).expand(m.shape[0], m.shape[1], T, T)


def token_mask(layout: Any, seq_len: int, *, causal: bool = False, heads: int = 1) -> torch.Tensor:
    """The layout at token level for ``seq_len`` tokens: bool ``(heads or 1, seq_len, seq_len)``, True where a query
    attends a key (the dense mask the block-sparse computation equals)."""
    layout = _for_heads(layout, heads)
    nb = -(-seq_len // layout.block)
    blocks = layout.blocks(nb)
    mask = blocks.repeat_interleave(layout.block, 1).repeat_interleave(layout.block, 2)[:, :seq_len, :seq_len]
    if causal:
        mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return mask


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Any, *, causal: bool = False,
                     scale: float | None = None, impl: str = "auto", attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q, k, v`` (batch, heads, seq, head_dim) over the blocks of ``layout`` (see the module docstring).
    ``impl``: "flex" (CUDA: FlexAttention), "torch" (the block-sparse reference), or "auto" (flex on CUDA).
    ``attn_mask``: the model's mask (padding), bool and broadcastable to (batch, heads, seq, seq), True where a query
    may attend (as SDPA's); it is ANDed with the layout. A query with no key left gives zeros, as with SDPA.
    A hashable layout (the frozen configs here) is read once per sequence length and head count, its blocks kept: to
    change the pattern, make another layout (``dataclasses.replace``), not a change to an object already used."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        gqa = (q.dim() == 4 and k.dim() == 4 and k.shape[1] != q.shape[1] and k.shape[::2] == q.shape[::2])
        raise ValueError(f"fzero.ops.sparse_attention: q, k, v must be (batch, heads, seq, head_dim) alike; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
                         + (" For grouped-query attention repeat k and v to the query heads first (Hugging Face's "
                            "repeat_kv)." if gqa else ""))
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"fzero.ops.sparse_attention: q, k, v must share one floating dtype, as SDPA needs; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}. Cast them to one (k.to(q.dtype), v.to(q.dtype)).")
    if impl not in ("auto", "flex", "torch"):
        raise ValueError(f"fzero.ops.sparse_attention: impl={impl!r}; use 'auto', 'flex' or 'torch'.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"fzero.ops.sparse_attention: scale={scale!r}; pass a finite number (the scores' factor), or "
                         f"None for 1 / sqrt(head_dim).")
    if isinstance(layout, type) or not isinstance(getattr(layout, "block", None), int) or not callable(getattr(layout, "blocks", None)):
        raise TypeError(f"fzero.ops.sparse_attention: layout={layout!r}; pass a layout such as "
                        f"fzero.ops.FixedLayout(block=16) (an object with .block and .blocks(num_blocks)); from a DeepSpeed "
                        f"config's \"sparse_attention\" block, fzero.config.from_deepspeed(cfg).sparse_attention.")
    heads, seq = q.shape[1], q.shape[2]
    layout = _for_heads(layout, heads)
    mask = None if attn_mask is None else _mask_4d(attn_mask, q)
    nb = -(-seq // layout.block)
    frozen = _hashable(layout)
    blocks = _blocks(layout, heads, nb, frozen)  # on the host
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "flex" or (impl == "auto" and q.is_cuda):
        if frozen and mask is None:  # the block mask made once for the layout and length (the caller's mask is data)
            return _flex(q, k, v, None, layout.block, causal=causal, scale=scale, layout=layout)
        return _flex(q, k, v, blocks.to(q.device), layout.block, causal=causal, scale=scale, attn_mask=mask)
    return _reference(q, k, v, blocks.to(q.device), layout.block, causal=causal, scale=scale, attn_mask=mask)


def _hashable(layout: Any) -> bool:
    try:
        hash(layout)
    except TypeError:  # a layout that is not a frozen config: its blocks and mask are made for each call
        return False
    return True


def _checked_blocks(layout: Any, heads: int, nb: int) -> torch.Tensor:
    """``layout.blocks(nb)`` on the host, checked against the heads of q and for a whole diagonal.

    Why on the host: checked on the device, reading the result (``bool(...)``) waited for the GPU at every attention
    layer of every step, so the host could not run ahead of the kernels."""
    blocks = layout.blocks(nb)
    if blocks.shape[0] not in (1, heads):
        raise ValueError(f"fzero.ops.sparse_attention: the layout has {blocks.shape[0]} head layouts for {heads} heads "
                         f"(q's dim 1); make it with num_heads={heads}, or with different_layout_per_head=False (one "
                         f"layout for every head).")
    if not bool(blocks.diagonal(dim1=1, dim2=2).all()):
        raise ValueError(f"fzero.ops.sparse_attention: {type(layout).__name__} leaves out a diagonal block at "
                         f"{blocks.shape[1]} blocks, so some query would attend nothing. Use a layout that keeps the "
                         f"diagonal (every DeepSpeed layout does: a local or sliding window of at least one block).")
    return blocks


# A frozen layout's blocks at a length, made and checked once: a model calls sparse_attention in every layer of every
# step with the same layout, and making them (Python loops over the blocks) took 1.4 ms at 512 blocks, 22 ms at 2,048.
# Callers never write them (the reference reads them; the flex path copies them to the device).
_cached_blocks = functools.lru_cache(maxsize=32)(_checked_blocks)


def _blocks(layout: Any, heads: int, nb: int, frozen: bool) -> torch.Tensor:
    """The layout's checked blocks: from the cache for a frozen layout, except while ``torch.compile`` traces (a unit
    under ``jit=True``): Dynamo does not call an ``lru_cache``, it traces the function inside and warns that it did
    ("Dynamo detected a call to a functools.lru_cache-wrapped function"), an error where warnings are."""
    if frozen and not torch.compiler.is_compiling():
        with torch._C._DisableFuncTorch():  # made outside torch.func's transforms: the cache outlives their levels
            return _cached_blocks(layout, heads, nb)
    return _checked_blocks(layout, heads, nb)


def _reference(q, k, v, blocks, bs, *, causal, scale, attn_mask=None):
    """Only the layout's blocks: each query block against the key blocks of its row (padded to the longest row)."""
    B, H, T, D = q.shape
    nb = blocks.shape[1]
    pad = nb * bs - T
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    width = int(blocks.sum(-1).max())
    order = torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]  # (h, nb, width)
    valid = torch.gather(blocks, -1, order)
    order = order.expand(H, nb, width) if order.shape[0] == 1 else order
    valid = valid.expand(H, nb, width) if valid.shape[0] == 1 else valid
    heads = torch.arange(H, device=q.device)[:, None, None]
    kb, vb = k.view(B, H, nb, bs, D)[:, heads, order], v.view(B, H, nb, bs, v.shape[-1])[:, heads, order]  # (B, H, nb, width, bs, D)
    qb = q.view(B, H, nb, bs, D)
    scores = torch.einsum("bhnsd,bhnwtd->bhnswt", qb, kb) * scale
    key_pos = order[..., None] * bs + torch.arange(bs, device=q.device)  # (H, nb, width, bs)
    query_pos = torch.arange(nb * bs, device=q.device).view(nb, bs)
    allowed = valid[..., None] & (key_pos < T)  # (H, nb, width, bs)
    allowed = allowed[:, :, None].expand(H, nb, bs, width, bs)
    if causal:
        allowed = allowed & (key_pos[:, :, None] <= query_pos[None, :, :, None, None])
    if attn_mask is not None:  # the caller's (batch or 1, heads or 1, T, T) mask, at the layout's blocks
        m = F.pad(attn_mask, (0, pad, 0, pad), value=False) if pad else attn_mask
        m = m.view(m.shape[0], m.shape[1], nb, bs, nb, bs).permute(0, 1, 2, 4, 3, 5)  # (b, h, q block, k block, bs, bs)
        m = m.expand(m.shape[0], H, *m.shape[2:])
        rows = torch.arange(nb, device=q.device)[None, :, None]
        m = m[:, heads, rows, order].permute(0, 1, 2, 4, 3, 5)  # (b, H, nb, bs, width, bs)
        allowed = allowed[None] & m
    scores = scores.masked_fill(~allowed, float("-inf")).flatten(-2)
    if attn_mask is not None:  # a query with no key left: zeros, as SDPA gives (and no NaN in the backward)
        empty = ~allowed.flatten(-2).any(-1, keepdim=True)
        scores = scores.masked_fill(empty, 0.0)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if attn_mask is not None:
        probs = probs.masked_fill(empty, 0.0)
    probs = probs.view(B, H, nb, bs, width, bs)
    out = torch.einsum("bhnswt,bhnwtd->bhnsd", probs, vb)
    return out.reshape(B, H, nb * bs, v.shape[-1])[:, :, :T]


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(q, k, v, blocks, bs, *, causal, scale, layout=None, attn_mask=None):
    mask = (_block_mask(layout, q.shape[1], q.shape[2], causal, str(q.device)) if layout is not None
            else _make_block_mask(blocks, bs, q.shape[2], causal, q.device, attn_mask=attn_mask))
    return _compiled_flex()(q, k, v, block_mask=mask, scale=scale)


@functools.lru_cache(maxsize=32)
def _block_mask(layout: Any, heads: int, seq_len: int, causal: bool, device: str) -> Any:
    """The ``BlockMask`` of a (frozen, hashable) layout at a length, made once: a model's attention layers and its
    steps share it (made per call, its making was most of a sparse layer's time)."""
    nb = -(-seq_len // layout.block)
    blocks = _blocks(layout, heads, nb, True)
    return _make_block_mask(blocks.to(device), layout.block, seq_len, causal, torch.device(device))


@functools.cache
def _compiled_block_mask() -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _make_block_mask(blocks, bs, seq_len, causal, device, attn_mask=None):
    layout_heads = blocks.shape[0]
    mask_b = 1 if attn_mask is None else attn_mask.shape[0]
    mask_h = 1 if attn_mask is None else attn_mask.shape[1]

    def mask_mod(b, h, qi, ki):
        keep = blocks[h if layout_heads > 1 else 0, qi // bs, ki // bs]
        if attn_mask is not None:
            keep = keep & attn_mask[b if mask_b > 1 else 0, h if mask_h > 1 else 0, qi, ki]
        return keep & (ki <= qi) if causal else keep

    # compiled (torch's advice; its _compile=True flag is deprecated): the mask is made block by block; uncompiled,
    # create_block_mask evaluates mask_mod at every (query, key) pair at once: measured on an H200, 25.6 GB and 133 ms
    # at 32k tokens, where SDPA took 18 ms (compiled: 261 MiB)
    heads = max(layout_heads, mask_h)
    return _compiled_block_mask()(mask_mod, B=mask_b if mask_b > 1 else None, H=heads if heads > 1 else None, Q_LEN=seq_len,
                                  KV_LEN=seq_len, device=device)
