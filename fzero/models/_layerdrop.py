"""Progressive layer drop (Zhang & He 2020, "Accelerating Training of Transformer-Based Language Models with
Progressive Layer Dropping"), as DeepSpeed configures it: ``"progressive_layer_drop": {"enabled": true, "theta":
0.5, "gamma": 0.001}``.

Two pure functions of the step:

- the keep ratio ``theta(t) = (1 - theta_bar) * exp(-gamma * t) + theta_bar``, ``t`` the optimizer steps taken
  (DeepSpeed's ``ProgressiveLayerDrop.update_state(global_steps)``: 1 at the first step, falling to ``theta_bar``).
  DeepSpeed's engine calls ``update_state`` in ``step()`` before it counts that step, so its forward after ``t`` steps
  reads ``theta(t - 1)`` (1 for the first two steps): one step behind this, the paper's ``theta(t)``, a difference of
  at most ``gamma * (1 - theta_bar)`` (0.0005 with DeepSpeed's defaults);
- over depth, layer ``l`` of ``L`` (1-based) is kept with probability ``p_l = 1 - l / L * (1 - theta(t))``, the
  paper's rule; a kept layer's residual branches are scaled by ``1 / p_l`` (so their expected contribution does not
  change), a dropped layer is the identity. DeepSpeed's BERT example draws layer ``l`` with the previous layer's
  probability and scales by its own; this follows the paper, where both are ``p_l``.

Which layers run is drawn from a generator seeded by ``(seed, step)`` alone, so every rank of a job, and a resumed
run, draws the same layers with no communication: at stage 3 a dropped unit is not reduced (its forward never runs)
and, with ``prefetch=False``, not gathered either (the prefetch follows the last step's order of units, so it may
gather a unit this step drops); its params take no update that step, as plain PyTorch's optimizers skip a param
whose gradient is None.

fzero's GPT takes the draw as ``model(idx, pld.layers(step, cfg.n_layer))``; another model needs a forward that skips
a block when ``keep`` is false and scales its residual branches by ``1 / p`` otherwise (``tests/test_layerdrop.py``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch


@dataclasses.dataclass(frozen=True)
class ProgressiveLayerDrop:
    """``layers(step, num_layers)``: for each layer, ``(keep, p)``: whether it runs at the step after ``step``
    optimizer steps, and its keep probability (a kept layer's branches are scaled by ``1 / p``). ``theta``: the final
    keep ratio (DeepSpeed's default 0.5), ``gamma``: how fast it is approached (0.001), ``seed``: the draw's seed."""

    theta: float = 0.5
    gamma: float = 0.001
    seed: int = 0

    def __post_init__(self) -> None:
        api = "fzero.models.ProgressiveLayerDrop"
        if not (isinstance(self.theta, (int, float)) and 0.0 < self.theta <= 1.0):
            raise ValueError(f"{api}: theta={self.theta!r}; it is the keep ratio training ends near, in (0, 1] (DeepSpeed's default 0.5).")
        if not (isinstance(self.gamma, (int, float)) and self.gamma >= 0.0 and math.isfinite(self.gamma)):
            # inf: -inf * step 0 is NaN, every keep probability NaN, and every layer dropped, silently
            raise ValueError(f"{api}: gamma={self.gamma!r}; it must be a finite number >= 0 (DeepSpeed's default 0.001).")

    def theta_at(self, step: int) -> float:
        """The keep ratio after ``step`` optimizer steps."""
        return (1.0 - self.theta) * math.exp(-self.gamma * int(step)) + self.theta

    def keep_probabilities(self, step: int, num_layers: int) -> list[float]:
        drop = 1.0 - self.theta_at(step)
        return [1.0 - (layer + 1) / num_layers * drop for layer in range(num_layers)]

    def layers(self, step: int, num_layers: int) -> list[tuple[bool, float]]:
        probs = self.keep_probabilities(step, num_layers)
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{int(step)}".encode()))
        draws = torch.rand(num_layers, generator=gen, dtype=torch.float64).tolist()
        return [(u < p, p) for u, p in zip(draws, probs)]

    @classmethod
    def from_deepspeed(cls, block: dict, *, seed: int = 0) -> "ProgressiveLayerDrop":
        """From DeepSpeed's ``"progressive_layer_drop"`` block (``theta``, ``gamma``; ``enabled`` read by the caller)."""
        unknown = sorted(set(block) - {"enabled", "theta", "gamma"})
        if unknown:
            raise ValueError(f"fzero.models.ProgressiveLayerDrop.from_deepspeed: unknown keys {unknown}; known: enabled, theta, gamma.")
        return cls(theta=block.get("theta", 0.5), gamma=block.get("gamma", 0.001), seed=seed)
