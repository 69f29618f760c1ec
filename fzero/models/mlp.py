"""A plain multilayer perceptron, the smallest model the parity and memory tests run on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """``Linear(sizes[0], sizes[1]), act, ..., Linear(sizes[-2], sizes[-1])`` in ``self.layers``.

    ``activation`` is a zero-argument factory such as ``nn.GELU`` (default) or ``nn.Tanh``; there is
    none after the last Linear. Weights use PyTorch's default init, so they depend only on the global
    RNG (``torch.manual_seed``).
    """

    def __init__(self, sizes: Sequence[int], *, bias: bool = True,
                 activation: Callable[[], nn.Module] = nn.GELU) -> None:
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2:
            raise ValueError(f"MLP(sizes={sizes!r}): need at least an input and an output size, "
                             "e.g. MLP([8, 32, 4]).")
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(f"MLP(sizes={sizes!r}): sizes must be positive ints; offending: {bad!r}.")
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            if i:
                layers.append(activation())
            layers.append(nn.Linear(fan_in, fan_out, bias=bias))
        self.sizes = tuple(sizes)
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)
