"""A small decoder-only transformer (GPT) for fzero's tests, examples and benchmarks.

It is an ordinary ``nn.Module``: fzero never mutates it. Three things matter to the ZeRO transforms:

* ``blocks`` is an ``nn.ModuleList``; each block is one stage-3 unit by default.
* The LM head is tied to the token embedding: the logits are ``x @ tok_emb.weight.T``, so the head
  has no module and no parameter of its own and ``named_parameters()`` / ``state_dict()`` hold the
  weight once, under ``tok_emb.weight``. (``tie_embeddings=False`` gives a separate ``lm_head``.)
* There is no dropout and no bias by default. Dropout would make two runs differ; an attention *key*
  bias cannot change the loss (softmax is invariant to a constant per query), so it gets rounding noise
  as gradient, which Adam amplifies into O(lr) steps and breaks parity tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
import zlib

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "gpt_loss", "num_params"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. Reference sizes: :meth:`tiny`, :meth:`small`, :meth:`ref218m`."""

    vocab_size: int = 256  # bytes, as fzero.data produces
    seq_len: int = 128  # longest sequence; sets the size of the position embedding
    n_layer: int
    n_head: int
    d_model: int
    mlp_ratio: int = 4
    bias: bool = False  # biases in every Linear and LayerNorm
    tie_embeddings: bool = True  # LM head shares the token embedding's weight
    # block-sparse attention: a layout of fzero.ops (FixedLayout, BigBirdLayout, ...); None: dense causal attention
    sparse_attention: Any = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive int.")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "pick an n_head that divides d_model."
            )

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """2 layers, width 32, 2 heads, seq 16 (about 33k params): for unit tests."""
        return cls(**{"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, **overrides})

    @classmethod
    def small(cls, **overrides) -> GPTConfig:
        """4 layers, width 128, 4 heads, seq 128 (about 0.84M params): for examples on a laptop CPU."""
        return cls(**{"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128, **overrides})

    @classmethod
    def ref218m(cls, **overrides) -> GPTConfig:
        """The 218M reference workload of docs/benchmarks.md: 12 layers x 1024 wide, vocab 32768, seq 128.

        218M parameters counts the LM head separately from the token embedding (151M in the blocks,
        33.6M in each of the two 32768 x 1024 matrices), so this config unties them; tied, the same
        shape has 185M. Benchmarks against DDP/FSDP2/DeepSpeed must use the same untied model.
        """
        defaults = {"n_layer": 12, "n_head": 16, "d_model": 1024, "vocab_size": 32768,
                    "seq_len": 128, "tie_embeddings": False}
        return cls(**{**defaults, **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # fused: one GEMM
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.layout = cfg.sparse_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # (B, T, 3C) -> 3 x (B, n_head, T, head_dim)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        if self.layout is not None:  # causal within the layout's blocks (fzero.ops.sparse_attention)
            from fzero.ops import sparse_attention

            y = sparse_attention(q, k, v, self.layout, causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.up = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``scale``: the residual branches' weight (progressive layer drop: ``1 / keep_probability``)."""
        if scale == 1.0:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = x + self.attn(self.ln1(x)) * scale
        return x + self.mlp(self.ln2(x)) * scale


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx: int64 (B, T)) -> logits (B, T, vocab_size)``.

    Initialisation depends only on the global RNG (``torch.manual_seed``) and works on the meta device.
    Each parameter's initial value comes from its own generator (the model's seed and the parameter's
    name), so ``init_value`` can make any one of them alone: a model built on the meta device can be
    materialised one unit at a time by ``step.init(params, materialize=model.init_value)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT(cfg): expected a GPTConfig, got {type(cfg).__name__}; "
                            "e.g. GPT(GPTConfig.tiny()).")
        self.cfg = cfg
        # drawn first: the submodules' own default inits consume the global RNG on CPU but not on meta
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, 0.02) weights; residual-branch outputs scaled by 1/sqrt(2 n_layer) so the residual
        stream's variance does not grow with depth; zero biases; LayerNorm weight 1."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                p.copy_(self.init_value(name, p))

    def init_value(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The initial value of parameter ``name`` (as ``named_parameters`` names it), shaped like ``like``, on CPU."""
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        out = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        if isinstance(module, nn.LayerNorm):
            return out.fill_(1.0 if kind == "weight" else 0.0)
        if kind == "bias":
            return out.zero_()
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if module_name.endswith(("attn.proj", "mlp.down")) else 0.02
        gen = torch.Generator().manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
        return out.normal_(0.0, std, generator=gen)

    def forward(self, idx: torch.Tensor, layers: list[tuple[bool, float]] | None = None) -> torch.Tensor:
        """``layers``: progressive layer drop's draw for this step, ``(keep, p)`` per block
        (``fzero.models.ProgressiveLayerDrop.layers(step, n_layer)``): a dropped block is skipped, a kept one's branches
        are scaled by ``1 / p``. None: every block, unscaled (evaluation, or no layer drop)."""
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must be (batch, time) token ids, got shape {tuple(idx.shape)}.")
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"GPT.forward: sequence length {T} exceeds cfg.seq_len={self.cfg.seq_len}; "
                             "truncate the input or build the model with a larger seq_len.")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        if layers is None:
            for block in self.blocks:
                x = block(x)
        else:
            if len(layers) != len(self.blocks):
                raise ValueError(f"GPT.forward: layers has {len(layers)} entries for {len(self.blocks)} blocks; draw them "
                                 f"with ProgressiveLayerDrop.layers(step, cfg.n_layer).")
            for block, (keep, p) in zip(self.blocks, layers):
                if keep:
                    x = block(x, scale=1.0 / p)
        x = self.ln_f(x)
        if self.lm_head is None:
            return F.linear(x, self.tok_emb.weight)  # tied head: reads the embedding's own parameter
        return self.lm_head(x)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``logits`` (B, T, V), ``targets`` int64 (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_params(module: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameter elements (a tied weight counts once).

    ``exclude_embeddings`` drops ``nn.Embedding`` weights (the usual "non-embedding" count); a tied LM
    head is then dropped too, since it is the token embedding.
    """
    skip = set()
    if exclude_embeddings:
        skip = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in module.parameters() if id(p) not in skip)
