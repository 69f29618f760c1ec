"""Parameter groups, optax-style: ``masked(inner, mask)`` and ``multi_transform({label: transform}, labels)``.

```python
opt = fzero.optim.multi_transform(
    {"decay": fzero.optim.adamw(3e-4, weight_decay=0.1), "no_decay": fzero.optim.adamw(3e-4, weight_decay=0.0)},
    lambda params: {k: "decay" if v.ndim > 1 else "no_decay" for k, v in params.items()},
)
opt = fzero.optim.adamw(3e-4, weight_decay=0.1, mask=fzero.optim.decay_mask)   # the usual rule, one Adam state
```

``mask``/``labels`` are written against the user's params pytree: a pytree of its structure (or a prefix of it)
with bool/str leaves, or a function of the params pytree returning one. The function is called on the params
(meta tensors of each parameter's shape under a train step, the same at every stage: decide from paths, shapes
and dtypes, never values) at every step, as optax calls it at every update: a function that reads outside state
(a dict of groups a notebook edits) may regroup params between steps. A move is followed where the param's state
stays its own (between groups of one transform type, whose state is shared, as torch.optim keeps ``state[p]`` when
a param changes ``param_groups``; into a group that keeps nothing per param) and refused by name, before the step
writes anything, elsewhere (``movable``). Under a train step the optimizer sees flat unit buffers or this rank's
shards of them; ``fzero.optim._select`` turns the rule into element ranges of those leaves, once per layout and
rank, and each group's transform runs on 1-D views of its ranges (a leaf wholly in one group is passed as itself), with
a ``Segments`` that keeps per-parameter step counts, skipped parameters and layer-wise norms right.

State. Each group's transform is initialised on the *whole* tree, so its param-shaped state (Adam's moments)
is a ``{unit: tensor}`` of the params' own sizes: what a checkpoint saves per parameter and reshards to another
stage or world size (``fzero.checkpoint``); a state packed to the group's elements would be a different size
on every rank and world size. Only a group's own elements of that state are ever read or written. So that K
groups do not hold K copies, ``multi_transform`` lets groups share one tensor where their states have the same
param-shaped parts with the same initial values (``adamw`` with two learning rates holds one ``mu`` and one
``nu``): their elements are disjoint, and each group writes only its own. ``adamw(mask=...)`` keeps one Adam
state and masks only the decay.

Elements of no group (``masked``'s False; padding of a leaf holding no parameter) pass through: their update is
the incoming one, as optax's ``masked`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import optree
import torch

from fzero.layout import pytrees as _tree
from fzero.optim._base import GradientTransformation, _is_transform
from fzero.optim._base import WholeLeaves, current_segments, param_tree, use_segments
from fzero.optim._select import NONE, GroupSegments, Resolver, Selections, assemble, views
from fzero.optim._state_parts import map_param_shaped, movable, per_param, rebuild_state, share_states


class MaskedState(NamedTuple):
    """inner: the inner transform's state, made by its ``init`` on the whole params tree (see the module docstring)."""

    inner: Any


class MultiTransformState(NamedTuple):
    """inner: ``{label: that transform's state}``, each made by its ``init`` on the whole params tree; groups with
    equal param-shaped state share its tensors (see the module docstring)."""

    inner: dict[str, Any]


# -- the engine: a rule, its groups' transforms, run on views -------------------------------------------------------


class Groups:
    """Runs ``transforms[g]`` on the elements of group ``g`` of the leaves it is given (see the module docstring)."""

    def __init__(self, api: str, what: str, rule: Any, to_group: Callable[[str, Any], int], n_groups: int, *,
                 names: tuple[str, ...] | None = None) -> None:
        self.api, self.what, self.n, self.names = api, what, n_groups, names  # names: multi_transform's labels, in group order
        self.resolver = Resolver(api, what, rule, to_group)
        self.selections = Selections()
        # (from, to) group pairs a param may move along when a rule function answers otherwise (``movable``), learnt from
        # the groups' states at init; None: every move is followed (a rule no state depends on: adamw's decay mask)
        self.moves: frozenset[tuple[int, int]] | None = None
        self.stateless: frozenset[int] = frozenset()  # groups that keep nothing per param (NONE among them)
        self._agreed: weakref.WeakSet = weakref.WeakSet()  # disk offload's updates whose answers were compared (``comm_to_agree``)

    def describe(self, group: int) -> str:
        """A group's name in errors: its label (``multi_transform``), or what ``masked`` does there."""
        if self.names is not None:
            return self.names[group]
        return "passed through" if group == NONE else "masked"

    def learn_moves(self, states: Sequence[Any], tree: Any) -> None:
        """Which moves between groups keep each param's optimizer state its own (``movable``), from the states ``init``
        made for the groups on ``tree``."""
        leaves, spec = optree.tree_flatten(tree)
        shapes = [t.shape for t in leaves]
        ids = [*range(self.n), NONE]
        self.moves = frozenset((a, b) for a in ids for b in ids if a != b and movable(a, b, states, spec, shapes))
        self.stateless = frozenset(b for b in ids if b == NONE or not per_param(states[b]))

    def accept(self, params: Any, states: Sequence[Any] | None = None, tree: Any = None, *,
               shared: bool = True) -> Callable[[tuple[int, ...], tuple[int, ...]], str | None]:
        """What the resolver does when the rule function's groups change: None (follow) when every moved param can
        move (``movable``), else the error naming the others. Judged on ``states`` (the groups' states given to this
        update, shaped like ``tree``) where given: only they say whether two groups still share a param's state (a
        copy of the state made leaf by leaf would not); else on ``self.moves`` (what ``init`` made), which a train
        step checks before it runs, and, when ``shared`` is False (a state kept in files, each group's tensors in
        their own), on ``self.stateless`` alone."""

        def decide(was: tuple[int, ...], now: tuple[int, ...]) -> str | None:
            refused = self.refused(was, now, states, tree, shared=shared)
            return self._moved_error(params, refused) if refused else None

        return decide

    def refused(self, was: Sequence[int], now: Sequence[int], states: Sequence[Any] | None = None, tree: Any = None, *,
                shared: bool = True) -> list[tuple[int, int, int]]:
        """``(param index, from group, to group)`` of each param that moved from ``was`` to ``now`` where its optimizer
        state cannot follow (``movable``): the one judgement of a move, whether a rule function answered otherwise
        between steps (``accept``) or a state was given to a step, or loaded from a checkpoint, whose rule put a param
        in another group than the step that made the state (``refused_labels``). ``states``, ``tree`` and ``shared``:
        see ``accept``."""
        if self.moves is None and self.names is None and self.api != "fzero.optim.masked":
            return []  # a decay mask: no state depends on it
        if states is not None:
            leaves, spec = optree.tree_flatten(tree)
            shapes = [t.shape for t in leaves]
            pairs = {(a, b) for a, b in zip(was, now) if a != b}
            moves = {(a, b) for a, b in pairs if movable(a, b, states, spec, shapes)}
        elif shared:
            moves = set(self.moves or ())
        else:
            moves = {(a, b) for a, b in self.moves or () if b in self.stateless}
        return [(i, a, b) for i, (a, b) in enumerate(zip(was, now)) if a != b and (a, b) not in moves]

    def group_of(self, label: str) -> int:
        """The group a label recorded by ``recording_groups`` names (``describe``'s inverse)."""
        if self.names is not None:
            return self.names.index(label)
        return NONE if label == "passed through" else 0

    def _moved_error(self, params: Any, refused: list[tuple[int, int, int]]) -> str:
        paths = _tree.flatten_with_paths(params)[0]
        moved = [f"{paths[i]!r} from {self.describe(a)!r} to {self.describe(b)!r}" for i, a, b in refused]
        shown = "; ".join(moved[:8]) + (f"; and {len(moved) - 8} more" if len(moved) > 8 else "")
        what = self.what
        return (
            f"{self.api}: the {what} function now puts params in other groups than it did for this optimizer's state: "
            f"{shown}. fzero calls it at every step, as optax calls it at every update, and follows a move where the "
            f"param's optimizer state stays its own (between groups of the same transform type, whose state is shared, "
            f"as torch.optim keeps a param's state when it changes param_groups; or into a group that keeps no state "
            f"per param); not these: the param's state in its new group is not that transform's state for it (it was "
            f"never updated there, or it belongs to the transform it left), so its next updates would be wrong. The "
            f"params were not updated. To regroup, build the optimizer again with the new {what}, compile a step with it "
            f"and start its state from the params: new_step.init(step.gather(state)) (every group's state starts "
            f"over); to train params held by set_to_zero() from some step on (gradual unfreezing), keep them in their "
            f"trained group and detach what they compute while frozen (docs/migrating.md, \"A backbone frozen for N "
            f"steps\"). Or put the {what} function back as it was."
        )

    def check(self, tree: Any, states: Sequence[Any]) -> None:
        """Resolve the rule now where the user's params pytree is known for sure (under a train step's Segments), so
        a wrong mask fails at ``step.init``. Under ``WholeLeaves`` ``init`` may see a stand-in tree (the memory
        estimator's), and the rule is checked at the first update instead. Called after ``learn_moves``."""
        segments = current_segments()
        if not isinstance(segments, WholeLeaves):
            params = param_tree(tree, segments)
            seen = _seen.get()
            # recording (a checkpoint, a state given to another step): the groups the state was made with
            groups = self.resolver.groups(params, in_use=seen is not None, accept=self.accept(params, states, tree))
            found = _found.get()
            if found is not None and not any(g is self for g in found):
                found.append(self)
            if seen is not None and self.names is not None:
                paths = _tree.flatten_with_paths(params)[0]
                seen.append({"api": self.api, "labels": {p: self.names[g] for p, g in zip(paths, groups)}, "grouping": self})

    def probe(self, params: Any, *, shared: bool = True) -> None:
        """Call the rule function on ``params`` (the step's stand-in tree) and refuse now a change that the state could
        not follow (nothing is kept: the update judges a move on the state it is given and follows it there). A train
        step does this before it runs (``fzero.step._state.probe_groupings``), so that the refusal leaves the state
        whole."""
        self.resolver.groups(params, store=False, accept=self.accept(params, shared=shared))

    def record(self, tree: Any, names: dict[int, str]) -> None:
        """Report each param's group as ``names[group]`` to ``recording_groups`` (``masked`` over a transform with
        param-shaped state: its mask is a grouping too, whose change would read zeros as that state)."""
        segments = current_segments()
        seen = _seen.get()
        if seen is not None and not isinstance(segments, WholeLeaves):
            params = param_tree(tree, segments)
            paths = _tree.flatten_with_paths(params)[0]
            groups = self.resolver.groups(params, in_use=True)
            seen.append({"api": self.api, "labels": {p: names[g] for p, g in zip(paths, groups)}, "grouping": self})

    def selection(self, tree: Any, states: Sequence[Any]) -> tuple[Any, Any]:
        segments = current_segments()
        params = param_tree(tree, segments)
        groups = self.resolver.groups(params, accept=self.accept(params, states, tree),
                                      agree=self.across_ranks(params, tree, self.comm_to_agree(segments)))
        return self.selections.get(tree, groups, self.n, segments), segments

    def comm_to_agree(self, segments: Any) -> Any:
        """The comm the ranks compare this update's answers over (``across_ranks``): the update's; under disk offload,
        whose update runs sub-group by sub-group (each rank as many, its shards being of one size), its parent's at
        the first sub-group only (``_agreed``), the answer being one for the update. None: nothing to compare."""
        parent = getattr(segments, "parent", None)
        if parent is None:
            return getattr(segments, "comm", None)
        if parent in self._agreed:
            return None
        self._agreed.add(parent)
        return getattr(parent, "comm", None)

    def across_ranks(self, params: Any, tree: Any, comm: Any) -> Callable[[tuple[int, ...]], None] | None:
        """Under a train step of several ranks (``comm``: ``comm_to_agree``'s, None elsewhere), what checks that every rank's rule function put each param in the same group: one all-reduce of
        each param's group and its square (the ranks agree on a param where n * sum(g**2) == sum(g)**2), at every
        update that calls the function. Why: each rank (each torchrun process, each local_mesh rank thread) calls it
        itself, and a function that reads rank-dependent state (``torch.distributed.get_rank()``, ``RANK``, a thread's
        name, a random draw from the rank's own stream) gave each rank its own groups: each updated the same param with
        another transform, the ranks' replicas drifting apart at stage 0 (6.0e-3 after 3 AdamW steps on
        local_mesh(2)) and each shard of a param updated by another group at stages 1-3 (6.0e-3 at stage 1), silently,
        or was refused as a change over time that nothing made. Each rank raises the same error, before the update
        writes anything."""
        if comm is None or getattr(comm, "size", 1) <= 1 or not optree.tree_leaves(params):
            return None

        def agree(groups: tuple[int, ...]) -> None:
            leaves = optree.tree_leaves(tree)
            device = leaves[0].device if leaves and isinstance(leaves[0], torch.Tensor) else torch.device("cpu")
            mine = torch.tensor(groups, dtype=torch.int64)
            both = torch.cat([mine, mine * mine]).to(device)
            comm.all_reduce(both, tag="optimizer")
            sums, squares = both.cpu().view(2, -1).tolist()
            differ = [i for i, (a, b) in enumerate(zip(sums, squares)) if a * a != comm.size * b]
            if differ:
                raise ValueError(self._ranks_differ_error(params, groups, differ, comm.rank))

        return agree

    def _ranks_differ_error(self, params: Any, groups: tuple[int, ...], differ: list[int], rank: int) -> str:
        paths = _tree.flatten_with_paths(params)[0]
        shown = ", ".join(f"{paths[i]!r} (here {self.describe(groups[i])!r})" for i in differ[:8])
        more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
        rule = self.resolver.rule
        name = getattr(rule, "__qualname__", None) or type(rule).__name__
        return (
            f"{self.api}: the {self.what} function {name} put params in other groups on rank {rank} than on another "
            f"rank: {shown}{more}. Every rank calls it, as each torchrun process calls it, and each updates its params "
            f"(or its shard of them) by its own answer: answers that differ between ranks would update one param with "
            f"different transforms, the ranks' copies differing, silently. The function reads something that differs "
            f"between ranks (torch.distributed.get_rank(), an environment variable such as RANK or LOCAL_RANK, a "
            f"random draw, a file on one node's disk): decide the groups from the params' paths, shapes and dtypes, "
            f"or from state that is the same on every rank (draw on rank 0 and broadcast it before the step). The "
            f"params were not updated."
        )

    def update(self, transforms: Sequence[GradientTransformation], updates: Any, states: Sequence[Any], params: Any) -> tuple[Any, list]:
        """Pure: the new updates (each group's on its elements, the incoming ones elsewhere) and the new states."""
        sel, segments = self.selection(updates, states)
        u_leaves, spec = optree.tree_flatten(updates)
        p_leaves = optree.tree_leaves(params) if params is not None else None
        shapes = [t.shape for t in u_leaves]
        outs, pending = [], _Pending()
        new_states = []
        for g, (t, state) in enumerate(zip(transforms, states)):
            pieces = sel.pieces[g]
            u = views(u_leaves, pieces, write=False, api=self.api)
            p = views(p_leaves, pieces, write=False, api=self.api) if p_leaves is not None else None
            s = map_param_shaped(state, spec, shapes, lambda leaves: views(leaves, pieces, write=False, api=self.api))
            with use_segments(GroupSegments(segments, pieces, updates, self.api)):
                out, new = t.update(u, s, p)
            outs.append(self._pieces_of(out, len(pieces), "updates"))
            new_states.append(rebuild_state(state, new, spec, shapes, self.api, lambda old, new, g=g: pending.add(old, g, self._pieces_of(new, len(pieces), "state"))))
        leaves = [assemble(u_leaves[j], sel.runs[j], lambda g, k: outs[g][k]) for j in range(len(u_leaves))]
        built = pending.build(sel)  # second pass: the old param-shaped leaves replaced by the assembled ones
        new_states = [map_param_shaped(s, spec, shapes, lambda old: spec.unflatten([built.get(id(x), x) for x in old]))
                      for s in new_states]
        return spec.unflatten(leaves), new_states

    def fused(self, transforms: Sequence[GradientTransformation], grads: Any, states: Sequence[Any], params: Any) -> list:
        """In place: each group's step written through views of the params (and of the param-shaped state)."""
        sel, segments = self.selection(params, states)
        p_leaves, spec = optree.tree_flatten(params)
        g_leaves = optree.tree_leaves(grads)
        shapes = [t.shape for t in p_leaves]
        new_states = []
        for g, (t, state) in enumerate(zip(transforms, states)):
            pieces = sel.pieces[g]
            gv = views(g_leaves, pieces, write=False, api=self.api)
            pv = views(p_leaves, pieces, write=True, api=self.api)
            s = map_param_shaped(state, spec, shapes, lambda leaves: views(leaves, pieces, write=True, api=self.api))
            with use_segments(GroupSegments(segments, pieces, params, self.api)):
                if getattr(t, "fused", None) is not None:
                    new = t.fused(gv, s, pv)
                else:
                    out, new = t.update(gv, s, pv)
                    for target, u in zip(pv, self._pieces_of(out, len(pieces), "updates")):
                        target.add_(u)
            new_states.append(rebuild_state(state, new, spec, shapes, self.api,
                                       lambda old, new, pieces=pieces: _write_back(old, self._pieces_of(new, len(pieces), "state"), pieces, self.api)))
        for j, runs in enumerate(sel.runs):  # elements of no group: the incoming update (optax's masked)
            for a, b, group, _ in runs:
                if group == NONE and a == 0 and b == p_leaves[j].numel():
                    p_leaves[j].add_(g_leaves[j].reshape(p_leaves[j].shape))
                elif group == NONE:
                    p_leaves[j].view(-1)[a:b].add_(g_leaves[j].reshape(-1)[a:b])
        return new_states

    def _pieces_of(self, tree: Any, n: int, what: str) -> list[torch.Tensor]:
        if not isinstance(tree, list) or len(tree) != n:
            raise TypeError(
                f"{self.api}: a group's transform returned {what} as {type(tree).__name__}"
                f"{f' of {len(tree)}' if isinstance(tree, (list, tuple)) else ''}; it was given a list of {n} tensors and "
                f"must return {what} of the same structure (an optax-style transform maps the tree it is given)."
            )
        return tree


class _Pending:
    """New param-shaped state leaves of a pure update, built once per old leaf from every group's pieces (groups that
    share a tensor then share its replacement too)."""

    def __init__(self) -> None:
        self.leaves: dict[int, tuple[torch.Tensor, int, dict[int, list]]] = {}

    def add(self, old: Any, group: int, pieces: list) -> Any:
        leaves = optree.tree_leaves(old)
        for j, leaf in enumerate(leaves):
            self.leaves.setdefault(id(leaf), (leaf, j, {}))[2][group] = pieces
        return old  # replaced by ``build``'s leaves in a second pass

    def build(self, sel: Any) -> dict[int, torch.Tensor]:
        return {key: assemble(leaf, sel.runs[j], lambda g, k, by=by_group: by[g][k] if g in by else None)
                for key, (leaf, j, by_group) in self.leaves.items()}


def _write_back(old: Any, new: list, pieces: Sequence[Any], api: str) -> Any:
    """In place: each new piece copied into its view of ``old`` unless the transform already wrote through the view."""
    from fzero.optim._select import view

    leaves = optree.tree_leaves(old)
    for piece, value in zip(pieces, new):
        target = view(leaves[piece.leaf], piece, write=True, api=api)
        if value is target or (value.data_ptr() == target.data_ptr() and value.shape == target.shape
                               and value.stride() == target.stride()):
            continue
        target.copy_(value.reshape(target.shape))
    return old


# -- the public transforms ------------------------------------------------------------------------------------------------


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply ``inner`` to the params that ``mask`` selects; the others' updates pass through unchanged (optax's ``masked``).

    ``mask``: a pytree of bools with the structure of the params (or a prefix of it: a leaf then holds for its
    whole subtree), True where ``inner`` applies; or a function of the params pytree returning one, decided from
    paths, shapes and dtypes (under a train step it is called on meta tensors of each parameter's shape, at every
    step: a mask that changes is followed where ``inner`` keeps no state per param, and refused where a param let
    in would start from its zeros).
    Works at every ZeRO stage, with offload and with checkpoints: see ``fzero.optim._groups``.

    State: ``MaskedState(inner)``, ``inner``'s state over the whole tree. Typical use, in a chain::

        chain(scale_by_adam(), masked(add_decayed_weights(0.1), fzero.optim.decay_mask), scale_by_learning_rate(1e-3))

    (which is what ``adamw(..., mask=fzero.optim.decay_mask)`` is, with its fused step).
    """
    api = "fzero.optim.masked"
    if not _is_transform(inner):
        raise TypeError(
            f"{api}: inner must be a GradientTransformation such as fzero.optim.add_decayed_weights(0.1), got "
            f"{type(inner).__name__}."
        )
    groups = Groups(api, "mask", _checked_rule(api, "mask", mask), _mask_group(api, "the inner transform applies"), 1)
    return masked_by(groups, inner)


def decay_groups(api: str, mask: Any) -> Groups:
    """The rule of a decay ``mask`` (True: decayed) for an optimizer's ``mask=`` argument, errors naming ``api``."""
    return Groups(api, "mask", _checked_rule(api, "mask", mask), _mask_group(api, "the param is decayed"), 1)


def masked_by(groups: Groups, inner: GradientTransformation) -> GradientTransformation:
    """``masked`` with its rule already made (``adamw(mask=...)`` shares it with its fused step)."""

    def init(params: Any) -> MaskedState:
        state = inner.init(params)
        if groups.api == "fzero.optim.masked":  # (adamw's decay mask: no state depends on it)
            groups.learn_moves([state], params)
        groups.check(params, [state])
        if groups.api == "fzero.optim.masked" and per_param(state):
            groups.record(params, {0: "masked", NONE: "passed through"})  # a param let in later would start from zeros
        return MaskedState(state)

    def update(updates: Any, state: MaskedState, params: Any = None) -> tuple[Any, MaskedState]:
        _check_state(groups.api, state, MaskedState)
        updates, (new,) = groups.update([inner], updates, [state.inner], params)
        return updates, MaskedState(new)

    def fused(grads: Any, state: MaskedState, params: Any) -> MaskedState:
        _check_state(groups.api, state, MaskedState)
        (new,) = groups.fused([inner], grads, [state.inner], params)
        return MaskedState(new)

    return GradientTransformation(init, update, fused, getattr(inner, "learning_rate", None))


class GroupRates:
    """The ``learning_rate`` of a ``multi_transform`` whose groups' rates differ (layer-wise lr decay): there is no one
    rate to report (called as a schedule it gives NaN, the ``lr`` metric), but the step checks each group's
    (``group_rates``: label -> float, schedule or None) before the update, as it checks a single schedule, so that a
    group's schedule that turns NaN, inf or negative is refused by name instead of writing NaN into that group's params."""

    def __init__(self, group_rates: dict[str, Any]) -> None:
        self.group_rates = group_rates

    def __call__(self, step: int) -> float:
        return math.nan

    def __repr__(self) -> str:
        return f"GroupRates({self.group_rates!r})"


def multi_transform(transforms: dict[str, GradientTransformation], labels: Any) -> GradientTransformation:
    """Each group of params gets its own transform: ``transforms[label]`` for the params labelled ``label``
    (optax's ``multi_transform``; torch.optim's param groups).

    ``labels``: a pytree of str with the structure of the params (or a prefix of it), each a key of
    ``transforms``; or a function of the params pytree returning one (called on meta tensors of each parameter's
    shape under a train step: decide from paths, shapes and dtypes; called at every step, and a param it moves
    between groups is followed or refused, see the module docstring). Every param needs a label that names a
    transform; a transform that no param is labelled with is allowed (its state is kept, and never used).
    Works at every ZeRO stage, with offload and with checkpoints: see ``fzero.optim._groups``. To freeze a
    group use ``fzero.optim.set_to_zero()``; to leave its gradient as the update, ``fzero.optim.identity()``.

    State: ``MultiTransformState({label: state})``; groups whose param-shaped state is alike share its tensors,
    so ``{"a": adamw(1e-3), "b": adamw(1e-4)}`` holds one Adam state, as torch's two param groups do. The
    ``learning_rate`` (the ``lr`` metric) is the groups' common one, or a ``GroupRates`` when they differ (the metric is
    NaN, and the step checks each group's schedule).
    """
    api = "fzero.optim.multi_transform"
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError(
            f"{api}: transforms must be a non-empty dict of label -> GradientTransformation, e.g. "
            f"{{'decay': fzero.optim.adamw(1e-3), 'no_decay': fzero.optim.adamw(1e-3, weight_decay=0.0)}}; got "
            f"{type(transforms).__name__} {transforms!r}."[:400]
        )
    for label, t in transforms.items():
        if not isinstance(label, str):
            raise TypeError(f"{api}: every label (key of transforms) must be a str, got {type(label).__name__} {label!r}.")
        if not _is_transform(t):
            raise TypeError(
                f"{api}: transforms[{label!r}] must be a GradientTransformation, got {type(t).__name__} {t!r}. To freeze "
                f"that group use fzero.optim.set_to_zero(); to pass its gradient through, fzero.optim.identity()."
            )
    names = tuple(transforms)
    inners = [transforms[n] for n in names]
    groups = Groups(api, "labels", _checked_rule(api, "labels", labels), _label_group(api, names), len(names), names=names)
    rates = [getattr(t, "learning_rate", None) for t in inners]
    rate = rates[0] if all(r is not None and (r is rates[0] or r == rates[0]) for r in rates) else GroupRates(dict(zip(names, rates)))

    def init(params: Any) -> MultiTransformState:
        leaves, spec = optree.tree_flatten(params)
        states = share_states([t.init(params) for t in inners], spec, [t.shape for t in leaves])
        groups.learn_moves(states, params)
        groups.check(params, states)
        return MultiTransformState(dict(zip(names, states)))

    def states_of(state: Any) -> list:
        _check_state(api, state, MultiTransformState)
        if not isinstance(state.inner, dict) or set(state.inner) != set(names):
            raise ValueError(
                f"{api}: the state holds groups {sorted(state.inner) if isinstance(state.inner, dict) else state.inner!r}, "
                f"this optimizer has {sorted(names)}. Make the state with this optimizer's init (or step.init)."
            )
        return [state.inner[n] for n in names]

    def update(updates: Any, state: MultiTransformState, params: Any = None) -> tuple[Any, MultiTransformState]:
        updates, new = groups.update(inners, updates, states_of(state), params)
        return updates, MultiTransformState(dict(zip(names, new)))

    def fused(grads: Any, state: MultiTransformState, params: Any) -> MultiTransformState:
        return MultiTransformState(dict(zip(names, groups.fused(inners, grads, states_of(state), params))))

    return GradientTransformation(init, update, fused, rate)


# -- which group each param is in, for checkpoints ------------------------------------------------------------------

_seen: contextvars.ContextVar[list | None] = contextvars.ContextVar("fzero_param_groups_seen", default=None)


@contextlib.contextmanager
def recording_groups() -> Iterator[list[dict[str, Any]]]:
    """Collect, for each ``multi_transform`` (and ``masked`` over a transform with param-shaped state) whose ``init``
    runs inside (under a train step's Segments), in init order,
    ``{"api": ..., "labels": {param path: label}, "grouping": its Groups}`` (the grouping judges a move:
    ``refused_labels``; ``for_file`` leaves it out). Why: the optimizer state of a param in a group is that group's
    transform's; a checkpoint records the labels so that a load with other labels (a layer moved from SGD to AdamW)
    is refused instead of reading one transform's state as another's (``fzero.checkpoint``)."""
    seen: list[dict[str, Any]] = []
    token = _seen.set(seen)
    try:
        yield seen
    finally:
        _seen.reset(token)


def refused_labels(was: dict[str, str], now: dict[str, str], grouping: Any, *, shared: bool = True) -> tuple[list[str], list[str]]:
    """The params whose label differs between ``was`` (the labels a state was made with: by the step that made it, or
    in a checkpoint) and ``now`` (``grouping``'s, this step's), each as "'path' from 'old' to 'new'": those whose
    optimizer state cannot follow the move, and all that moved. Judged by ``Groups.refused``, as a rule function that
    answers otherwise between steps is: a layer moved between two ``adamw`` groups keeps its one Adam state (torch.optim
    keeps ``state[p]`` when a param changes ``param_groups``), SGD's momentum is not AdamW's state. ``shared``: the
    state keeps the tensors its groups share (False: a state in files, each group's tensors in their own)."""
    paths = sorted(set(was) & set(now))
    moved = [p for p in paths if was[p] != now[p]]
    if not moved:
        return [], []
    a = [grouping.group_of(was[p]) for p in moved]
    b = [grouping.group_of(now[p]) for p in moved]
    refused = {moved[i] for i, _, _ in grouping.refused(a, b, shared=shared)}
    say = [f"{p!r} from {was[p]!r} to {now[p]!r}" for p in moved]
    return [x for p, x in zip(moved, say) if p in refused], say


def for_file(seen: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """``recording_groups``'s entries without the groupings themselves (what a checkpoint writes to its JSON)."""
    return None if seen is None else [{k: v for k, v in e.items() if k != "grouping"} for e in seen]


# -- the rule functions a train step calls before it runs -----------------------------------------------------------

_found: contextvars.ContextVar[list | None] = contextvars.ContextVar("fzero_param_groupings", default=None)


@contextlib.contextmanager
def finding_groupings() -> Iterator[list[Any]]:
    """Collect each parameter grouping (``masked``, ``multi_transform``, ``adamw(mask=...)``) whose ``init`` runs inside
    under a train step's Segments. Why: a step calls their rule functions before it runs (``probe_groupings``), so
    that a grouping that moved a param where its state cannot follow is refused before the update writes the state
    in place, and the state is left as it was."""
    found: list[Any] = []
    token = _found.set(found)
    try:
        yield found
    finally:
        _found.reset(token)


def probe_groupings(groupings: Sequence[Any], params: Any, *, shared: bool = True) -> None:
    """Call each grouping's rule function on ``params`` (the step's stand-in pytree of meta tensors) and refuse a
    change that the state could not follow (``Groups.probe``; ``shared``: the state keeps the tensors its groups
    share, as it does in memory); groupings whose rule is not a function (or is fzero's own) cost nothing."""
    for g in groupings:
        g.probe(params, shared=shared)


# -- checks ------------------------------------------------------------------------------------------------------------


def _checked_rule(api: str, what: str, rule: Any) -> Any:
    if rule is None:
        example = "fzero.optim.decay_mask" if what == "mask" else "lambda params: {k: 'a' if v.ndim > 1 else 'b' for k, v in params.items()}"
        raise TypeError(f"{api}: {what} is required: a pytree like the params, or a function of the params (e.g. {example}); got None.")
    if isinstance(rule, GradientTransformation):
        raise TypeError(f"{api}: {what} is a GradientTransformation; pass the transform first and the {what} second.")
    return rule


def _mask_group(api: str, meaning: str) -> Callable[[str, Any], int]:
    def to_group(path: str, value: Any) -> int:
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool:
            value = bool(value)
        if not isinstance(value, bool):
            raise TypeError(
                f"{api}: mask must hold a bool for every param (True: {meaning}); the param "
                f"{path or '<root>'!r} has {type(value).__name__} {_short(value)}. E.g. mask = {{k: v.ndim > 1 for k, v in params.items()}}."
            )
        return 0 if value else NONE

    return to_group


def _label_group(api: str, names: tuple[str, ...]) -> Callable[[str, Any], int]:
    def to_group(path: str, value: Any) -> int:
        if not isinstance(value, str):
            raise TypeError(
                f"{api}: labels must hold a str for every param (a key of transforms: {list(names)}); the param "
                f"{path or '<root>'!r} has {type(value).__name__} {_short(value)}."
            )
        if value not in names:
            raise ValueError(
                f"{api}: the param {path or '<root>'!r} is labelled {value!r}, which names no transform; transforms has "
                f"{list(names)}. Add transforms[{value!r}], or label the param with one of those."
            )
        return names.index(value)

    return to_group


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 60 else text[:60] + "..."


def _check_state(api: str, state: Any, kind: type) -> None:
    if not isinstance(state, kind):
        raise TypeError(
            f"{api}: state must be the {kind.__name__} this optimizer's init returned, got {type(state).__name__}. Make it "
            f"with opt.init(params) (or step.init(params) in a train step)."
        )
