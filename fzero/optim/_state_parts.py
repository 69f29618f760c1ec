"""The param-shaped parts of an optimizer state (Adam's ``mu`` and ``nu``: the params' tree structure and leaf shapes),
for parameter groups (``fzero.optim._groups``): walking a group's state to them, rebuilding a state around them, which
moves between groups keep a param's state its own (``movable``), and groups sharing one tensor where their initial
states are alike (``share_states``). Kept apart from the groups' transforms so that each file stays short."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import optree
import torch

from fzero.optim._select import NONE


# -- walking a state: its param-shaped parts --------------------------------------------------------------------------


def param_shaped(node: Any, spec: Any, shapes: Sequence[torch.Size]) -> bool:
    """``node`` is shaped like the params (Adam's ``mu``): the params' tree structure and leaf shapes."""
    if isinstance(node, torch.Tensor):
        return spec.num_nodes == 1 and spec.num_leaves == 1 and node.shape == shapes[0]
    if not isinstance(node, (dict, list, tuple)):
        return False
    leaves, node_spec = optree.tree_flatten(node)
    return node_spec == spec and all(isinstance(t, torch.Tensor) and t.shape == s for t, s in zip(leaves, shapes))


def map_param_shaped(state: Any, spec: Any, shapes: Sequence[torch.Size], fn: Callable[[list], Any]) -> Any:
    """``state`` with each param-shaped part replaced by ``fn(its leaves)``; the rest as it is."""
    if param_shaped(state, spec, shapes):
        return fn(optree.tree_leaves(state))
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        return type(state)(*(map_param_shaped(x, spec, shapes, fn) for x in state))
    if isinstance(state, (tuple, list)):
        return type(state)(map_param_shaped(x, spec, shapes, fn) for x in state)
    if isinstance(state, dict):
        return {k: map_param_shaped(v, spec, shapes, fn) for k, v in state.items()}
    return state


def rebuild_state(old: Any, new: Any, spec: Any, shapes: Sequence[torch.Size], api: str, at_param: Callable[[Any, Any], Any]) -> Any:
    """The new state of a group: ``new`` (what its transform returned over views), with each param-shaped part of
    ``old`` replaced by ``at_param(old part, new part)``."""
    if param_shaped(old, spec, shapes):
        return at_param(old, new)
    if isinstance(old, (tuple, list, dict)) and type(new) is not type(old) or (
            isinstance(old, (tuple, list, dict)) and len(new) != len(old)):
        raise TypeError(
            f"{api}: a group's transform returned a state of another structure ({type(new).__name__} where its init made "
            f"{type(old).__name__}); an optax-style transform's update must keep its state's structure."
        )
    if isinstance(old, tuple) and hasattr(old, "_fields"):
        return type(old)(*(rebuild_state(o, n, spec, shapes, api, at_param) for o, n in zip(old, new)))
    if isinstance(old, (tuple, list)):
        return type(old)(rebuild_state(o, n, spec, shapes, api, at_param) for o, n in zip(old, new))
    if isinstance(old, dict):
        if set(old) != set(new):
            raise TypeError(f"{api}: a group's transform returned a state dict with keys {sorted(new)} where its init made {sorted(old)}.")
        return {k: rebuild_state(old[k], new[k], spec, shapes, api, at_param) for k in old}
    return new


# -- which moves between groups a rule function may make -------------------------------------------------------------


def per_param(state: Any) -> bool:
    """``state`` holds something per param (moments, momentum, per-param step counts): a tensor that is not a scalar."""
    return any(isinstance(x, torch.Tensor) and x.dim() > 0 for x in optree.tree_leaves(state))


class _Part(NamedTuple):
    """A param-shaped part of a group's state, by the identity of its tensors (groups sharing it hold the same ones)."""

    ids: tuple[int, ...]


def movable(a: int, b: int, states: Sequence[Any], spec: Any, shapes: Sequence[torch.Size]) -> bool:
    """A param can move from group ``a`` to group ``b`` (``NONE``: no group) and keep its optimizer state its own.

    Into a group that keeps nothing per param (``set_to_zero``, plain ``sgd``, ``masked``'s pass-through): the
    group's update reads no state of the param's. Between groups whose states are alike, the same structure (the
    same transform types), the same tensors for their param-shaped parts (``share_states`` gave them one ``mu`` and
    one ``nu``: the param's elements hold what its old group wrote) and equal scalars (step counts; every group
    counts every step): its new group reads the state the param's own updates made, as torch.optim keeps
    ``state[p]`` when a param changes ``param_groups`` (a layer moved to another learning rate). Anything else (SGD's
    momentum read as Adam's first moment; moments of zeros against the group's step count after ``set_to_zero``)
    is not the new transform's state for the param."""
    if b == NONE or not per_param(states[b]):
        return True
    if a == NONE:
        return False

    def marked(state: Any) -> tuple[list, Any]:
        return optree.tree_flatten(map_param_shaped(state, spec, shapes, lambda leaves: _Part(tuple(map(id, leaves)))),
                                   is_leaf=lambda x: isinstance(x, _Part))

    (xs, x_spec), (ys, y_spec) = marked(states[a]), marked(states[b])
    return x_spec == y_spec and all(_same_leaf(x, y) for x, y in zip(xs, ys))


def _same_leaf(x: Any, y: Any) -> bool:
    if x is y:
        return True
    if isinstance(x, _Part) or isinstance(y, _Part):
        return isinstance(x, _Part) and isinstance(y, _Part) and x.ids == y.ids
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape or x.dtype != y.dtype:
            return False
        return x.is_meta or y.is_meta or torch.equal(x, y.to(x.device))
    try:
        return bool(x == y)
    except Exception:  # a value without a truth value
        return False


# -- sharing param-shaped state between groups --------------------------------------------------------------------------


def share_states(states: list, spec: Any, shapes: Sequence[torch.Size]) -> list:
    """``states`` (one per group, each made on the whole tree) where the k-th param-shaped part of a group reuses the
    k-th of an earlier group when both have the same leaves (dtype, shape, device) and the same initial values.

    Why this is sound: a group reads and writes only its own elements of its state (its views), the groups'
    elements are disjoint, and equal initial values mean each element starts as its own group's init made it."""
    pool: list[Any] = []

    def same(a: Any, b: Any) -> bool:
        xs, ys = optree.tree_leaves(a), optree.tree_leaves(b)
        if any(x.dtype != y.dtype or x.device != y.device or x.shape != y.shape for x, y in zip(xs, ys)):
            return False
        return all(x.is_meta or torch.equal(x, y) for x, y in zip(xs, ys))

    def pick(leaves: list) -> Any:
        part = spec.unflatten(leaves)
        k = counter[0]
        counter[0] += 1
        if k < len(pool):
            return pool[k] if same(pool[k], part) else part
        pool.append(part)
        return part

    out = []
    for state in states:
        counter = [0]
        out.append(map_param_shaped(state, spec, shapes, pick))
    return out
