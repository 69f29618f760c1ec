"""chex-style assertions for tensor pytrees, built on ``torch.testing.assert_close``.

chex itself only half works on torch tensors (not bf16, not ``requires_grad``) and pulls in JAX
as a dependency, so fzero carries the few assertions its tests and its users' tests need. Every failure
names the pytree path of the first leaf that differs.
"""

from __future__ import annotations

from typing import Any

import torch

from fzero.layout import pytrees as _tree


def _pairs(actual: Any, expected: Any, api: str):
    pa, la, sa = _tree.flatten_with_paths(actual)
    pe, le, se = _tree.flatten_with_paths(expected)
    if sa != se:
        raise AssertionError(f"{api}: tree structures differ:\n  actual:   {sa}\n  expected: {se}")
    return zip(pa, la, le)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Every leaf bitwise equal: same dtype, shape and bits (NaNs in the same places count as equal)."""
    for path, a, e in _pairs(actual, expected, "assert_trees_equal"):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            if a.dtype != e.dtype or a.shape != e.shape:
                raise AssertionError(f"assert_trees_equal: leaf {path!r}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}")
            if not torch.equal(_bits(a), _bits(e)):
                diff = (a.detach().double() - e.detach().double()).abs()
                raise AssertionError(
                    f"assert_trees_equal: leaf {path!r} differs in {int((diff != 0).sum())} of {a.numel()} elements "
                    f"(max abs difference {diff.max().item():.3g})"
                )
        elif a != e:
            raise AssertionError(f"assert_trees_equal: leaf {path!r}: {a!r} != {e!r}")


def assert_trees_close(actual: Any, expected: Any, *, rtol: float | None = None, atol: float | None = None) -> None:
    """Every leaf close by ``torch.testing.assert_close`` (its dtype-based defaults unless given)."""
    for path, a, e in _pairs(actual, expected, "assert_trees_close"):
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
        except AssertionError as err:
            raise AssertionError(f"assert_trees_close: leaf {path!r}: {err}") from None


def assert_trees_finite(tree: Any) -> None:
    for path, leaf in zip(*_tree.flatten_with_paths(tree)[:2]):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
            raise AssertionError(f"assert_trees_finite: leaf {path!r} has {int((~torch.isfinite(leaf)).sum())} non-finite values")
