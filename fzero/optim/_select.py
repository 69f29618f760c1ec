"""Parameter groups on flat leaves: which elements of each leaf an optimizer's group holds, decided once.

A group rule (``fzero.optim.masked``'s ``mask``, ``multi_transform``'s ``labels``) is written against the user's
params pytree: a pytree of bool/str leaves, or a function of that pytree. Under a train step the optimizer
sees none of it: it gets flat unit buffers (stage 0) or this rank's shards of them (stages 1-3), each a
concatenation of many parameters plus padding, and a parameter may be cut between two ranks. The current
``Segments`` bridges the two (``fzero.optim._base``): ``param_tree`` is the user's pytree (what the rule is
evaluated on) and ``param_ranges`` says which parameter each element range of a leaf belongs to.

So a rule is resolved to one group per *parameter* (``resolve``, once per params structure), then to element
ranges per leaf (``select``, once per layout and rank: cached on the ranges). Each group is handed its ranges
as 1-D views of the leaves (a whole leaf is passed as itself): no per-element mask or index tensor is stored,
nothing is copied to run a group, and in-place fused kernels write straight through the views into the
ZeRO buffers. Padding (elements of no parameter) goes with the group of the range before it in the leaf (or
after it): a unit of one group is then one whole leaf, exactly as without groups.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import optree
import torch

from fzero.layout import SHARD_ALIGN, pytrees as _tree
from fzero.optim._base import active_params, param_count, param_ranges, param_tree

NONE = -1  # "no group": masked's False, padding of a leaf that holds no parameter


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements ``start:stop`` of leaf ``leaf``: one contiguous run of one group. ``ranges``: its
    ``(start, stop, param)`` ranges relative to the piece (param -1: padding), as ``Segments.param_ranges`` gives."""

    leaf: int
    start: int
    stop: int
    whole: bool  # the piece is the whole leaf: it is passed as the leaf itself, shape and all
    ranges: tuple[tuple[int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Selection:
    """Per group, its pieces in leaf order; and per leaf, its runs ``(start, stop, group, index in that group's pieces)``."""

    pieces: tuple[tuple[Piece, ...], ...]
    runs: tuple[tuple[tuple[int, int, int, int], ...], ...]
    numels: tuple[int, ...]


# -- the rule, resolved on the user's params pytree -------------------------------------------------------------------


def resolve(api: str, what: str, value: Any, params: Any, *, check: Callable[[str, Any], Any],
            from_function: bool = False) -> list[Any]:
    """The value of ``value`` (a rule's pytree: given, or what its function returned) for each leaf of ``params``, in
    ``optree.tree_leaves`` order. The pytree must have the structure of ``params`` or of a prefix of it (a leaf of
    it then holds for the whole subtree); ``check(path, value)`` validates and returns each value."""
    paths, _, spec = _tree.flatten_with_paths(params)
    try:
        full = optree.tree_broadcast_prefix(value, params, namespace=_tree.NAMESPACE)
        leaves = spec.flatten_up_to(full)
    except (ValueError, TypeError):
        raise ValueError(_structure_error(api, what, value, params, from_function)) from None
    return [check(path, leaf) for path, leaf in zip(paths, leaves)]


def _structure_error(api: str, what: str, value: Any, params: Any, from_function: bool) -> str:
    mine = [tuple(p) for p in optree.tree_paths(value, namespace=_tree.NAMESPACE)]
    theirs = [tuple(p) for p in optree.tree_paths(params, namespace=_tree.NAMESPACE)]

    def covers(prefix: tuple, path: tuple) -> bool:
        return path[: len(prefix)] == prefix

    extra = [_dotted(p) for p in mine if not any(covers(p, t) for t in theirs)]
    missing = [_dotted(t) for t in theirs if not any(covers(p, t) for p in mine)]
    detail = []
    if missing:
        detail.append(f"params it does not cover (a None leaf covers none): {_few(missing)}")
    if extra:
        detail.append(f"paths that are not params: {_few(extra)}")
    source = f"the {what} function returned a pytree that" if from_function else f"{what}"
    example = ("{k: 'decay' if v.ndim > 1 else 'no_decay' for k, v in params.items()}" if what == "labels"
               else "{k: v.ndim > 1 for k, v in params.items()}")
    return (
        f"{api}: {source} does not have the structure of the params pytree (or of a prefix of it); "
        f"{'; '.join(detail) or 'the containers differ'}.\n  params: {_brief(optree.tree_structure(params, namespace=_tree.NAMESPACE))}\n"
        f"  {what}: {_brief(optree.tree_structure(value, namespace=_tree.NAMESPACE))}\n"
        f"Build it from the params (e.g. {example}) or pass a function of the params."
    )


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _few(items: Sequence[str], n: int = 4) -> str:
    return ", ".join(repr(x) for x in items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _brief(spec: Any, limit: int = 200) -> str:
    text = str(spec)
    return text if len(text) <= limit else text[:limit] + "...)"


class Resolver:
    """A rule resolved to a group index per parameter, per params structure (a train step evaluates the rule on the
    same stand-in pytree of meta tensors every step: that one is remembered by identity; a tree with real tensors is
    never held on to).

    A pytree rule is resolved once per structure. A function is called at every ``groups`` (every update), as optax
    calls it: one that reads state outside the params (a dict of groups a notebook edits, a flag a loop flips) may
    answer otherwise later. Its answer is compared with the last one for the structure (a flat dict of bools or strs
    by its items, no resolve: 20-30 us a step on GPT-2's 148 params), and a changed grouping is handed to ``accept``
    (old groups, new groups), which returns None to follow it or an error to raise (the optimizer state may hold
    what only the old grouping can read). Before, the first answer was kept for good, silently: a layer moved to a
    group with another learning rate trained on at its old one. fzero's own mask functions (``of_structure``) are
    called once per structure."""

    def __init__(self, api: str, what: str, rule: Any, to_group: Callable[[str, Any], int]) -> None:
        self.api, self.what, self.rule, self.to_group = api, what, rule, to_group
        self._lock = threading.Lock()
        self._last: tuple[Any, int] | None = None  # (the step's stand-in tree, its structure's number)
        self._numbers: dict[Any, int] = {}  # a structure (treespec, leaf shapes and dtypes) -> a small number
        self._by_structure: dict[int, tuple[Any, tuple[int, ...]]] = {}  # number -> (answer's snapshot or None, groups)

    def groups(self, params: Any, *, in_use: bool = False, store: bool = True,
               accept: Callable[[tuple[int, ...], tuple[int, ...]], str | None] | None = None,
               agree: Callable[[tuple[int, ...]], None] | None = None) -> tuple[int, ...]:
        """The group of each parameter of ``params``. ``in_use``: the groups this rule has been giving for the
        structure, without calling a function again (what a state was made with: ``recording_groups``). ``accept``:
        see the class docstring; None follows every change (a decay mask: no state depends on it). ``store=False``:
        a change is judged but not kept (a train step's check before it runs; its update judges it on the state).
        ``agree``: called with the function's answer whenever the function is called (``calls_each_time``), before
        ``accept`` judges it (a train step's update: the ranks compare their answers, ``Groups.selection``)."""
        key = self._key(params)
        found = self._by_structure.get(key)
        if found is not None and (in_use or not self.calls_each_time()):
            return found[1]
        value = self.rule(params) if callable(self.rule) else self.rule
        snapshot = _snapshot(value)
        if found is not None and snapshot is not None and found[0] == snapshot:
            if agree is not None and self.calls_each_time():
                agree(found[1])
            return found[1]
        groups = tuple(resolve(self.api, self.what, value, params, check=self.to_group, from_function=callable(self.rule)))
        if agree is not None and self.calls_each_time():
            agree(groups)
        if found is not None and groups != found[1] and accept is not None:
            error = accept(found[1], groups)
            if error is not None:
                raise ValueError(error)
        if store or found is None:
            with self._lock:
                self._by_structure[key] = (snapshot, groups)
        return groups

    def calls_each_time(self) -> bool:
        """Whether ``groups`` calls the rule at every call (a function of the user's; not a pytree, nor fzero's own
        ``of_structure`` functions): the same on every rank, so every rank makes ``agree``'s exchange alike."""
        return callable(self.rule) and not getattr(self.rule, OF_STRUCTURE, False)

    def _key(self, params: Any) -> int:
        """A number for the structure of ``params`` (hashing the structure costs microseconds: once per tree)."""
        last = self._last
        if last is not None and last[0] is params:
            return last[1]
        leaves, spec = optree.tree_flatten(params, namespace=_tree.NAMESPACE)
        structure = (spec, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves))
        with self._lock:
            key = self._numbers.setdefault(structure, len(self._numbers))
        if leaves and isinstance(leaves[0], torch.Tensor) and leaves[0].is_meta:
            self._last = (params, key)  # a train step's stand-in (no storage): safe to hold on to
        return key


OF_STRUCTURE = "_fzero_of_structure"  # on a mask function that reads the params' paths, shapes and dtypes alone


def of_structure(fn: Callable) -> Callable:
    """Mark ``fn`` (fzero's own mask functions: ``decay_mask``, ``no_decay_names``) as a function of the params'
    structure alone, so that it is called once per structure, not at every update (``decay_mask`` takes 0.2 ms on
    GPT-2's 148 params)."""
    setattr(fn, OF_STRUCTURE, True)
    return fn


def _snapshot(value: Any) -> Any:
    """A rule's answer as an immutable value to compare with the next answer (its structure and leaves), or None when
    a leaf is not a plain bool or str (it is resolved again at every call then). Not the answer itself: a function
    may return the same dict object, edited. A flat dict (the usual ``{k: ... for k in params}``) is read directly:
    optree takes 80 us to flatten one of GPT-2's 148 params, its items 10."""
    if type(value) is dict:
        items = tuple(value.items())
        if all(type(k) is str and (type(v) is str or type(v) is bool) for k, v in items):
            return items
    leaves, spec = optree.tree_flatten(value, namespace=_tree.NAMESPACE)
    if all(type(x) is str or type(x) is bool for x in leaves):
        return spec, tuple(leaves)
    return None


# -- element ranges per leaf -------------------------------------------------------------------------------------------


def select(tree: Any, groups_of_params: Sequence[int], n_groups: int, segments: Any) -> Selection:
    """The pieces of each group in the leaves of ``tree`` (see the module docstring); not cached."""
    leaves = optree.tree_leaves(tree)
    ranges = param_ranges(tree, segments)
    if len(ranges) != len(leaves):
        raise ValueError(f"fzero.optim: the current Segments gave ranges for {len(ranges)} leaves of a tree with {len(leaves)}.")
    pieces: list[list[Piece]] = [[] for _ in range(n_groups)]
    runs_of_leaves = []
    for j, (leaf, leaf_ranges) in enumerate(zip(leaves, ranges)):
        numel = leaf.numel()
        labelled = [(a, b, i, groups_of_params[i] if i >= 0 else None) for a, b, i in leaf_ranges if b > a]
        known = [g for _, _, _, g in labelled if g is not None]
        previous = known[0] if known else NONE  # padding before the first parameter: with the one after it
        runs: list[list[Any]] = []  # [start, stop, group, [ranges relative to the leaf]]
        covered = 0
        for a, b, i, g in labelled:
            if a > covered:  # a gap no range covers (a partial Segments): no group, passed through
                runs.append([covered, a, NONE, []])
            g = previous if g is None else g
            previous = g
            if runs and runs[-1][2] == g and runs[-1][1] == a:
                runs[-1][1] = b
                runs[-1][3].append((a, b, i))
            else:
                runs.append([a, b, g, [(a, b, i)]])
            covered = b
        if covered < numel:
            runs.append([covered, numel, NONE, []])
        leaf_runs = []
        for a, b, g, rel in runs:
            if g == NONE:
                leaf_runs.append((a, b, NONE, -1))
                continue
            for x, y, cut in _aligned(a, b, rel):
                leaf_runs.append((x, y, g, len(pieces[g])))
                pieces[g].append(Piece(j, x, y, x == 0 and y == numel, tuple((u - x, v - x, i) for u, v, i in cut)))
        runs_of_leaves.append(tuple(leaf_runs))
    return Selection(tuple(tuple(p) for p in pieces), tuple(runs_of_leaves), tuple(t.numel() for t in leaves))


def _aligned(a: int, b: int, rel: list) -> list[tuple[int, int, list]]:
    """Run ``a:b`` of one group (``rel``: its ``(start, stop, param)`` ranges in the leaf) as the pieces handed to the
    group's transform: the run itself, or, when it starts off a multiple of ``SHARD_ALIGN`` and goes past the next
    one ``c``, ``a:c`` and ``c:b``.

    Why: torch's fused CPU Adam kernel runs the last ``numel % 16`` elements of each tensor (32 in bf16/fp16) through
    a scalar loop that rounds differently from its vector loop (fzero/optim/_fused.py), so an element's bits depend on
    where its piece starts and ends. ZeRO shards and ``DiskOffload``'s sub-groups cut leaves on multiples of
    ``SHARD_ALIGN`` (64) elements from the unit's start, which falls inside such a run at an offset that is no multiple
    of 16 from the run's start: the pieces after the cut ended on other elements than the whole run did, and one
    element in a thousand came out one rounding apart (a BatchNorm CNN's group of conv weights under bf16, stage 2
    with ``DiskOffload(sub_group_size=64)`` against no offload: 1.9e-9). Cut at ``c`` in every layout, every later
    cut of the same run lands a multiple of 64 from ``c``, so each element sits at the same place in its piece
    whatever the stage, world size or sub-group size."""
    c = -(-a // SHARD_ALIGN) * SHARD_ALIGN
    if not a < c < b:
        return [(a, b, rel)]
    before = [(x, min(y, c), i) for x, y, i in rel if x < c]
    after = [(max(x, c), y, i) for x, y, i in rel if y > c]
    return [(a, c, before), (c, b, after)]


class Selections:
    """``select`` cached on what decides it: the groups of the parameters and each leaf's ranges and size (the same
    every step of a layout and rank; a few entries live at once, one per rank thread of a local mesh)."""

    def __init__(self) -> None:
        self._cache: dict[Any, Selection] = {}
        self._lock = threading.Lock()

    def get(self, tree: Any, groups_of_params: tuple[int, ...], n_groups: int, segments: Any) -> Selection:
        leaves = optree.tree_leaves(tree)
        ranges = param_ranges(tree, segments)
        key = (groups_of_params, tuple(t.numel() for t in leaves), tuple(tuple(r) for r in ranges))
        hit = self._cache.get(key)
        if hit is None:
            hit = select(tree, groups_of_params, n_groups, segments)
            with self._lock:
                if len(self._cache) >= 32:
                    self._cache.clear()
                self._cache[key] = hit
        return hit


# -- views ---------------------------------------------------------------------------------------------------------------


def view(t: torch.Tensor, piece: Piece, *, write: bool, api: str) -> torch.Tensor:
    """The elements of ``piece`` in ``t`` (a leaf of a tree shaped like the one selected): ``t`` itself when the piece
    is the whole leaf, else a 1-D view. ``write``: the result must alias ``t`` (an in-place step writes through it)."""
    if piece.whole:
        return t
    if t.is_contiguous():
        return t.view(-1)[piece.start : piece.stop]
    if write:
        raise ValueError(
            f"{api}: a parameter group holds elements {piece.start}:{piece.stop} of a non-contiguous leaf (shape "
            f"{tuple(t.shape)}); an in-place step cannot write through a copy. Give the optimizer contiguous leaves "
            f"(ZeRO's flat buffers are), or call opt.update and apply the updates."
        )
    return t.reshape(-1)[piece.start : piece.stop]


def views(leaves: Sequence[torch.Tensor], pieces: Sequence[Piece], *, write: bool, api: str) -> list[torch.Tensor]:
    return [view(leaves[p.leaf], p, write=write, api=api) for p in pieces]


def assemble(old: torch.Tensor, runs: Sequence[tuple[int, int, int, int]], new: Callable[[int, int], torch.Tensor | None]) -> torch.Tensor:
    """A new leaf shaped like ``old``: each run's elements from ``new(group, index)`` (a piece's new values), or from
    ``old`` where that gives None. A leaf that is one new whole piece is that tensor itself (no copy)."""
    parts, fresh = [], False
    for a, b, g, k in runs:
        t = new(g, k) if g != NONE else None
        if t is not None and a == 0 and b == old.numel() and len(runs) == 1:
            return t if t.shape == old.shape else t.reshape(old.shape)
        fresh = fresh or t is not None
        parts.append((t, a, b))
    if not fresh:
        return old
    dtype = next(t.dtype for t, _, _ in parts if t is not None)
    flat = old.reshape(-1)
    out = torch.cat([(t.reshape(-1) if t is not None else flat[a:b]).to(dtype) for t, a, b in parts])
    return out.reshape(old.shape)


# -- what a group's transform sees as its Segments ---------------------------------------------------------------------


class GroupSegments:
    """The ``Segments`` of one group's views (a list of 1-D pieces, or whole leaves): which parameter each of
    their elements belongs to, the parameters that take the step, the user's params pytree, and per-parameter
    sums of squares over ranks (for a layer-wise optimizer in a group: every rank sums the same P + 1 numbers,
    whatever pieces it holds, so the collective matches)."""

    def __init__(self, parent: Any, pieces: Sequence[Piece], tree: Any, api: str) -> None:
        self.parent, self.api = parent, api
        self.ranges = [list(p.ranges) for p in pieces]
        self.count = param_count(tree, parent)
        self._param_tree = param_tree(tree, parent)
        first = next(iter(optree.tree_leaves(tree)), None)
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")

    def param_count(self, tree: Any) -> int:
        return self.count

    def param_ranges(self, tree: Any) -> list[list[tuple[int, int, int]]]:
        n = len(optree.tree_leaves(tree))
        if n != len(self.ranges):
            raise TypeError(
                f"{self.api}: a transform in a parameter group asked which parameters a tree of {n} leaves holds; the "
                f"group's tree has {len(self.ranges)}. Call it on what the group passes it."
            )
        return self.ranges

    def active(self) -> torch.Tensor | None:
        return active_params(self.parent)

    def param_tree(self, tree: Any = None) -> Any:
        return self._param_tree

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce()(t)

    def _reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        fn = getattr(self.parent, "all_reduce", None)
        if not callable(fn):
            raise NotImplementedError(
                f"{self.api}: a transform in a parameter group needs per-parameter norms (a layer-wise optimizer such as "
                f"fzero.optim.lamb), but the installed Segments ({type(self.parent).__name__}) has no all_reduce(t) to sum "
                f"them over ranks. Give it one (fzero.optim.Segments), or use an element-wise optimizer in the group."
            )
        return fn

    def sumsq(self, tree: Any) -> Any:
        leaves, spec = optree.tree_flatten(tree)
        self.param_ranges(tree)
        reduce = self._reduce()
        device = leaves[0].device if leaves else self.device
        local = torch.zeros(self.count + 1, dtype=torch.float32, device=device)  # the last entry: padding
        index = []
        for t, ranges in zip(leaves, self.ranges):
            flat = t.reshape(-1)
            ids = [i if i >= 0 else self.count for _, _, i in ranges]
            if ranges:
                sums = torch.stack([_opmath(flat[a:b]).square().sum() for a, b, _ in ranges]).float()
                local.index_add_(0, torch.tensor(ids, device=device), sums)
            index.append(ids)
        total = reduce(local)
        return spec.unflatten([total[torch.tensor(ids, dtype=torch.int64, device=device)] for ids in index])

    def expand(self, per_segment: Any, like: Any) -> Any:
        values, like_leaves = optree.tree_leaves(per_segment), optree.tree_leaves(like)
        spec = optree.tree_structure(like)
        out = []
        for v, t, ranges in zip(values, like_leaves, self.ranges):
            lengths = torch.tensor([b - a for a, b, _ in ranges], dtype=torch.int64, device=v.device)
            out.append(torch.repeat_interleave(v, lengths, output_size=t.numel()).to(t.device).reshape(t.shape))
        return spec.unflatten(out)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
