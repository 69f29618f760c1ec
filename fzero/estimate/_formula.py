"""The ZeRO paper's per-rank model states, written once for the estimator and ``fzero.memory`` (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020).

With Ψ parameters, N ranks, P bytes per parameter, G per gradient and K optimizer bytes per parameter::

    stage 0: (P + G + K)Ψ      stage 1: (P + G)Ψ + KΨ/N      stage 2: PΨ + (G + K)Ψ/N      stage 3: (P + G + K)Ψ/N

Which stage shards what is ``fzero._rules.SHARDED_FROM``. fp32 Adam(W) is P = G = 4, K = 8 (m and v; no
master copy); the paper's mixed precision is P = G = 2, K = 12 (fp32 master, m, v).
"""

from __future__ import annotations

from typing import NamedTuple

from fzero import _rules


class ModelStates(NamedTuple):
    """Per-rank amounts (bytes, or elements with 1 byte each) of the three model states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def per_rank(num: float, *, stage: int, world_size: int, param_bytes: float = 1, grad_bytes: float = 1,
             optimizer_bytes: float = 1) -> ModelStates:
    """What one rank of ``world_size`` holds of ``num`` parameters at ZeRO ``stage`` (unchecked: see below)."""
    def share(what: str, nbytes: float) -> float:
        return num * nbytes / world_size if _rules.sharded(what, stage) else num * nbytes

    return ModelStates(share("params", param_bytes), share("grads", grad_bytes), share("optimizer", optimizer_bytes))


def zero_model_state_bytes(
    num_params: int, *, stage: int, world_size: int, param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8
) -> dict[str, float]:
    """Per-rank bytes of params, grads and optimizer state that ZeRO stage ``stage`` holds, and their total."""
    api = "fzero.memory.zero_model_state_bytes"
    _rules.check_stage(stage, api=api, stage_key="stage")
    if world_size < 1:
        raise ValueError(f"{api}: world_size must be >= 1 (ranks), got {world_size!r}.")
    states = per_rank(float(num_params), stage=stage, world_size=world_size, param_bytes=param_bytes,
                      grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    return {**states._asdict(), "total": states.total}
