"""What a step is given: the global batch split across the ranks of a local mesh, and a rank's batch
split into micro-batches for gradient accumulation (dim 0 of every tensor leaf; other leaves are shared)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from fzero.layout import _tree


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split every tensor of the global ``batch`` on dim 0 into n equal per-rank batches (other leaves are copied to all)."""
    return _split_dim0(batch, n, lambda path, size: (
        f"fzero.Step.__call__: under local_mesh({n}) the global batch is split on dim 0 across {n} ranks, but "
        f"batch leaf {path!r} has {size}, which does not divide by {n}. Pass a batch whose dim 0 "
        f"is a multiple of {n} (e.g. drop the last partial batch)."
    ))


def split_micro(batch: Any, k: int) -> list[Any]:
    """This rank's batch as k micro-batches, split on dim 0 (other leaves are given to every micro-batch)."""
    if k == 1:
        return [batch]
    return _split_dim0(batch, k, lambda path, size: (
        f"fzero.Step.__call__: grad_accum={k} splits each rank's batch into {k} micro-batches on dim 0, but "
        f"batch leaf {path!r} has {size} on this rank. Pass a per-rank batch whose dim 0 is a multiple of {k}."
    ))


def _split_dim0(batch: Any, k: int, message: Callable[[str, str], str]) -> list[Any]:
    paths, leaves, spec = _tree.flatten_with_paths(batch)
    parts: list[list[Any]] = [[] for _ in range(k)]
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] % k:
                size = "a 0-d tensor" if leaf.dim() == 0 else f"dim 0 of size {leaf.shape[0]}"
                raise ValueError(message(path or "<root>", size))
            chunks = leaf.chunk(k)
        else:
            chunks = [leaf] * k
        for i in range(k):
            parts[i].append(chunks[i])
    return [spec.unflatten(p) for p in parts]
