"""Pytree plumbing shared by the rest of fzero.

``torch.func`` flattens with ``torch.utils._pytree`` while users and fzero itself use optree, so every
container type fzero defines is registered with both. optree requires a namespace for
custom nodes: ours is ``"fzero"``; pass ``namespace="fzero"`` to optree calls that must see inside a
``TrainState``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import optree
import torch
import torch.utils._pytree as torch_pytree

NAMESPACE = "fzero"


def register_dataclass(cls: type, *, leaves: tuple[str, ...], static: tuple[str, ...] = ()) -> type:
    """Register a frozen dataclass with optree and ``torch.utils._pytree``.

    ``leaves`` are the fields that hold tensors (children); ``static`` fields travel in the treespec.
    """

    def flatten(obj):
        return [getattr(obj, f) for f in leaves], tuple(getattr(obj, f) for f in static)

    def unflatten(aux, children):
        return cls(**dict(zip(leaves, children)), **dict(zip(static, aux)))

    optree.register_pytree_node(
        cls,
        lambda obj: (*flatten(obj), leaves),
        lambda aux, children: unflatten(aux, list(children)),
        namespace=NAMESPACE,
    )
    torch_pytree.register_pytree_node(
        cls,
        flatten,
        lambda children, aux: unflatten(aux, list(children)),
        serialized_type_name=f"fzero.{cls.__name__}",
        flatten_with_keys_fn=lambda obj: (
            [(torch_pytree.GetAttrKey(f), getattr(obj, f)) for f in leaves],
            tuple(getattr(obj, f) for f in static),
        ),
    )
    return cls


def flatten_with_paths(tree: Any, *, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[str], list[Any], Any]:
    """Flatten ``tree`` into (dotted paths, leaves, treespec); ``None`` counts as an empty subtree. ``is_leaf``: a
    node taken whole, as optree's."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, is_leaf=is_leaf, namespace=NAMESPACE)
    return [".".join(str(p) for p in path) for path in paths], leaves, spec


def insertion_order(tree: Any) -> list[str]:
    """The dotted paths of ``tree``'s leaves with dicts in insertion order (``flatten_with_paths`` sorts dict keys,
    as optree does). For ``fzero.params_of(model)`` that is the module's registration order, the order of its
    forward for most models, which is what groups params into units that backward finishes one after another."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, f"{prefix}.{key}" if prefix else str(key))
        elif type(node) in (list, tuple):
            for i, child in enumerate(node):
                walk(child, f"{prefix}.{i}" if prefix else str(i))
        else:  # a leaf, or a node type of its own: its leaves in optree's order
            paths, _, _ = flatten_with_paths(node)
            out.extend(prefix if p == "" else (f"{prefix}.{p}" if prefix else p) for p in paths)

    walk(tree, "")
    return out


def tree_map(fn: Callable, tree: Any, *rest: Any) -> Any:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: Any) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def _builtin_nodes() -> frozenset[type]:
    """The built-in containers whose torch.utils._pytree node is torch's own (what ``_walk`` rebuilds itself)."""
    own = {tuple: (torch_pytree._tuple_flatten, torch_pytree._tuple_unflatten),
           list: (torch_pytree._list_flatten, torch_pytree._list_unflatten),
           dict: (torch_pytree._dict_flatten, torch_pytree._dict_unflatten)}
    nodes = torch_pytree.SUPPORTED_NODES
    return frozenset(k for k, (f, u) in own.items() if k in nodes and (nodes[k].flatten_fn, nodes[k].unflatten_fn) == (f, u))


def tensors_and_rebuild(obj: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors inside ``obj`` and a function that rebuilds ``obj`` with replacements for them.

    Looks inside ``torch.utils._pytree`` nodes (tuples, dicts, Hugging Face ``ModelOutput``s) and, unlike a
    pytree flatten, inside dataclasses, which models return (a unit returning a ``@dataclass``): a tensor
    missed here would silently get no gradient through a stage-3 unit or a ``fzero.remat`` recompute.
    """
    found: list[torch.Tensor] = []
    rebuild = _walk(obj, found)
    return found, lambda tensors: rebuild(iter(tensors))


def _walk(obj: Any, found: list) -> Callable[[Any], Any]:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
        return lambda it: next(it)
    kind = type(obj)
    if (kind is tuple or kind is list or kind is dict) and kind in _BUILTIN_NODES:
        # the built-in nodes as torch.utils._pytree flattens and rebuilds them, without its node lookups (a stage-3 unit
        # call walks its arguments and its outputs: ``(args, kwargs)`` is three of these)
        if kind is dict:
            keys = list(obj)
            parts = [_walk(obj[k], found) for k in keys]
            return lambda it: dict(zip(keys, [p(it) for p in parts]))
        parts = [_walk(c, found) for c in obj]
        return lambda it: kind([p(it) for p in parts])
    node = None if torch_pytree.tree_is_leaf(obj) else torch_pytree.SUPPORTED_NODES[torch_pytree._get_node_type(obj)]
    if node is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        parts = [_walk(getattr(obj, n), found) for n in names]

        def rebuild_dc(it):
            clone = copy.copy(obj)
            for n, part in zip(names, parts):
                object.__setattr__(clone, n, part(it))
            return clone

        return rebuild_dc
    if node is not None:  # one level of a pytree node (tuple, dict, HF ModelOutput, ...), its children walked
        children, context = node.flatten_fn(obj)
        parts = [_walk(c, found) for c in children]
        return lambda it: node.unflatten_fn([p(it) for p in parts], context)
    if isinstance(obj, (dict, list)):  # a subclass no pytree knows (``class State(dict)``): a leaf to torch's pytree
        return _walk_container(obj, found)
    return lambda it: obj


def _walk_container(obj: dict | list, found: list) -> Callable[[Any], Any]:
    """A dict or list subclass that is no pytree node, walked as its base and rebuilt as a shallow copy of itself (its
    type and attributes) with the new items. Left a leaf, the tensors in it passed into a stage-3 unit without being
    its call's inputs: the unit's backward failed inside torch ("setStorage: ... out of bounds"), or under remat
    their gradient was lost (2.8e-2 off PyTorch after 2 SGD steps, silently)."""
    keys = list(obj) if isinstance(obj, dict) else range(len(obj))
    before = len(found)
    parts = [_walk(obj[k], found) for k in keys]
    if len(found) == before:  # no tensor in it: the object itself, as before (a forward may write into it)
        return lambda it: obj

    def rebuild_container(it):
        clone = copy.copy(obj)
        values = [p(it) for p in parts]
        if isinstance(clone, dict):
            for k, v in zip(keys, values):
                clone[k] = v
        else:
            clone[:] = values
        return clone

    return rebuild_container


_BUILTIN_NODES = _builtin_nodes()
