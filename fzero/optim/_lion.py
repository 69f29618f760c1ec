"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the sign of an interpolated momentum.

Per element, with ``lr`` the learning rate::

    c  = b1 * m + (1 - b1) * g
    p -= lr * (sign(c) + weight_decay * p)
    m  = b2 * m + (1 - b2) * g

Everything is element-wise, so it gives the same bits however the params are cut into leaves: separate
tensors, one flat ZeRO buffer, or shards of it (tests/test_optim_contract.py checks it bitwise, weight decay
included). That holds for torch's element-wise CPU ops, whose tails round as their vector loops do; it is the
fused Adam kernel's own scalar tail that does not (see ``fzero.optim._fused``). The momentum terms are still
written as plain ``mul``/``add``, one rounding each, so that no backend is tempted to fuse them differently.

DeepSpeed's Lion (``FusedLion``/``DeepSpeedCPULion``) computes the same thing except at ``c == 0`` exactly: it
moves the parameter by ``lr`` (CUDA: ``c > 0 ? -lr : lr``; CPU: ``-copysign(lr, c)``) where ``sign(0) = 0``
here, as in the paper and optax, leaves it. It also folds the decay in as ``p * (1 - lr * wd)``: equal in exact
arithmetic, not in the last bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fzero.optim._groups import decay_groups, masked_by
from fzero.optim._base import GradientTransformation, LearningRate, chain, check_float, check_learning_rate
from fzero.optim._transforms import add_decayed_weights, scale_by_learning_rate

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class ScaleByLionState(NamedTuple):
    """mu: like params (same shapes, dtypes, devices): the momentum ``m``, zeros before the first step."""

    mu: Any


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign(b1 * m + (1 - b1) * g)`` (not yet scaled by -lr), and its momentum update."""
    api = "fzero.optim.scale_by_lion"
    b1 = check_float(api, "b1", b1, low=0.0, high=1.0, hint=" Typical: b1=0.9.")
    b2 = check_float(api, "b2", b2, low=0.0, high=1.0, hint=" Typical: b2=0.99.")

    def init(params: Any) -> ScaleByLionState:
        return ScaleByLionState(optree.tree_map(lambda p: torch.zeros_like(p, memory_format=torch.contiguous_format), params))

    def update(updates: Any, state: ScaleByLionState, params: Any = None) -> tuple[Any, ScaleByLionState]:
        del params

        def step(m: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mf = m.float() if m.dtype in _LOW_PRECISION else m  # bf16/fp16 momentum combined in fp32
            gf = g.to(mf.dtype)
            direction = torch.sign(mf * b1 + gf * (1 - b1)).to(g.dtype)
            return direction, (mf * b2 + gf * (1 - b2)).to(m.dtype)

        pairs = optree.tree_map(step, state.mu, updates)
        spec = optree.tree_structure(state.mu)
        leaves = spec.flatten_up_to(pairs)
        directions = spec.unflatten([d for d, _ in leaves])
        return directions, ScaleByLionState(spec.unflatten([m for _, m in leaves]))

    return GradientTransformation(init, update)


def lion(
    learning_rate: LearningRate, *, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0, mask: Any = None
) -> GradientTransformation:
    """Lion: ``p -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * p)``, then ``m = b2 * m + (1 - b2) * g``.

    Use a learning rate 3-10x smaller than AdamW's and a weight decay 3-10x larger (the paper's advice).
    ``mask``: which params are decayed, as ``adamw``'s (e.g. ``fzero.optim.decay_mask``); None: all of them.
    State: ``(ScaleByLionState(mu), decay_state, lr_state)``, as in ``adamw``. No fused step:
    ``apply_inplace`` runs the pure update, then ``p.add_(u)``.
    """
    api = "fzero.optim.lion"
    learning_rate = check_learning_rate(api, learning_rate)
    b1 = check_float(api, "b1", b1, low=0.0, high=1.0, hint=" Typical: b1=0.9.")
    b2 = check_float(api, "b2", b2, low=0.0, high=1.0, hint=" Typical: b2=0.99.")
    weight_decay = check_float(api, "weight_decay", weight_decay, low=0.0, hint=" Typical: 0.1 (3-10x AdamW's); 0.0 for none.")
    decay = add_decayed_weights(weight_decay)
    if mask is not None:
        decay = masked_by(decay_groups(api, mask), decay)
    return chain(scale_by_lion(b1, b2), decay, scale_by_learning_rate(learning_rate))
