"""What a step is given: the global batch split across the ranks of a local mesh, and a rank's batch
split into micro-batches for gradient accumulation (dim 0 of every tensor leaf; other leaves are shared);
and ``loss_fn`` run on it with the batch named when it fails."""

from __future__ import annotations

import re
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


# Errors of plain Python and torch that loss_fn (the user's code, or the model it runs) raises on a batch it
# cannot take: re-raised with the batch named. Exact types only: subclasses (torch.OutOfMemoryError, fzero's own
# RanksDisagree) and the user's own exception types pass unchanged.
_PLAIN_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError)
_MATMUL = re.compile(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)")


class LossFnInContext:
    """``loss_fn``, whose plain errors on a batch say which batch: a raw "mat1 and mat2 shapes cannot be multiplied"
    from deep inside the model becomes the same exception type with the batch's leaves, shapes and dtypes and, where
    the message tells, what the model expected; the original stays as ``__cause__``, so no user error is hidden.
    Errors that already name fzero's API pass unchanged. ``split``: the batch was split (mesh ranks, micro-batches)."""

    __slots__ = ("fn", "split")

    def __init__(self, fn: Callable[..., Any], *, split: bool) -> None:
        self.fn = fn
        self.split = split

    def __call__(self, params: Any, batch: Any) -> Any:
        try:
            return self.fn(params, batch)
        except _PLAIN_ERRORS as e:
            if type(e) not in _PLAIN_ERRORS or str(e).startswith("fzero"):
                raise
            raise type(e)(loss_fn_failure(e, batch, split=self.split)) from e


def loss_fn_failure(error: BaseException, batch: Any, *, split: bool = False) -> str:
    """The message for ``error`` raised by ``loss_fn(params, batch)``: the original first, then the batch, then a hint."""
    original = repr(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    which = "this rank's share of the batch" if split else "the batch"
    lines = [f"fzero.Step: loss_fn(params, batch) raised {type(error).__name__}: {original}",
             f"  on {which}: {describe_batch(batch)}."]
    if batch is None:
        lines.append("  The batch is None: step(state, batch) hands it to loss_fn as it is; pass the batch loss_fn reads "
                     "(e.g. a dict of tensors from your loader).")
    match = _MATMUL.search(str(error))
    if match is not None:
        got, want = int(match.group(2)), int(match.group(3))
        leaves = [f"{(p or '<root>')!r} has shape {tuple(x.shape)}" for p, x in _tensor_leaves(batch) if x.dim() and x.shape[-1] == got]
        lines.append(f"  A matmul of the model (an nn.Linear?) expects {want} features in the last dim and got {got}"
                     + (f": batch leaf {', '.join(leaves[:3])}." if leaves else ".") + " Pass inputs of the size the model was built for.")
    elif isinstance(error, KeyError) and isinstance(batch, dict):
        lines.append(f"  The batch has keys {sorted(map(str, batch))[:8]}.")
    lines.append("  The error is in loss_fn or the model it runs; its own traceback is the cause above.")
    if isinstance(error, KeyError):  # KeyError shows its message as a repr: one line reads better
        return " ".join(line.strip() for line in lines)
    return "\n".join(lines)


def _tensor_leaves(batch: Any) -> list[tuple[str, torch.Tensor]]:
    if batch is None:
        return []
    paths, leaves, _ = _tree.flatten_with_paths(batch)
    return [(p, x) for p, x in zip(paths, leaves) if isinstance(x, torch.Tensor)]


def describe_batch(batch: Any, *, limit: int = 8) -> str:
    """``{x: float32 (8, 5), y: float32 (8, 2)}``: each leaf's path with its dtype and shape (or its type)."""
    if batch is None:
        return "None"
    try:
        paths, leaves, _ = _tree.flatten_with_paths(batch)
    except Exception:  # noqa: BLE001 - a batch optree cannot flatten is described by its type
        return f"a {type(batch).__name__}"
    parts = [f"{p or '<root>'}: " + (f"{str(x.dtype).replace('torch.', '')} {tuple(x.shape)}" if isinstance(x, torch.Tensor)
                                     else type(x).__name__) for p, x in zip(paths, leaves)]
    more = f", ... {len(parts) - limit} more" if len(parts) > limit else ""
    return "{" + ", ".join(parts[:limit]) + more + "}" if parts else f"a {type(batch).__name__} without tensors"
