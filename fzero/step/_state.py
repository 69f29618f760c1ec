"""The training state: a pure pytree of what one rank holds.

A ``TrainState`` is what *one rank* owns: its params (whole flat unit buffers at stages 0-2), its
optimizer-state shard, the step count, and slots for the loss scale and RNG that later policies fill.
How the leaves are laid out (units, padding, which rank, which stage) is static metadata in
``meta``: it travels in the treespec, so ``tree_map`` keeps it, and a step can check that a state was
made for it before it touches a tensor.

Under ``local_mesh(n)`` one process simulates n ranks, so ``Step.init`` returns ``RankStates``: the n
per-rank states side by side, a pytree node too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

import optree
import torch

from fzero.layout import pytrees as _tree, frozen_key, Layout


@dataclasses.dataclass(frozen=True)
class StateMeta:
    """Static facts about a state: checked against the step that receives it."""

    layout: Layout
    stage: int
    world_size: int
    rank: int
    gather_order: tuple[str, ...] = ()  # stage 3: the units the last step gathered, in order (for prefetch)
    device: torch.device = torch.device("cpu")  # where the params compute (param shards offloaded to the host come here to be gathered)
    # this state's lineage as a reader of the module's persistent buffers: made by init, one per rank, kept by the steps
    # that follow (``dataclasses.replace``), so that another state's read never hides a write from this one. Not compared.
    reader: "Reader" = dataclasses.field(default_factory=lambda: Reader(), compare=False, repr=False)
    # ``init(..., frozen=...)``: each frozen param's (version counter, data pointer) when init copied it, so that a value
    # written into the module's param since (``load_state_dict`` after init) is refused, not silently left unseen
    frozen_seen: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)


class Reader:
    """What one state lineage last read of a module's persistent buffers: by the buffer tensor's ``id``, its version
    counter and memory then (``fzero.step._module.Buffers``). Kept here, not on the module's tensors: a record on the
    tensor is one for every state, and a second state's read (adopting a value written on the module since) hid the
    write from the first, which then trained on without it, silently.

    ``names``: (``id`` of the module given to ``fzero.apply``, buffer name) -> the tensor last read under that name, so
    that a buffer replaced on the module by another tensor of other values (``register_buffer`` again, as
    ``torch.nn.utils.prune`` does with ``weight_mask`` when it prunes a pruned module again) counts as written, and one
    of the same values (``model.to(device)``) does not. Before, the new tensor had no record, was taken as read, and the
    state's old value trained on, silently."""

    __slots__ = ("names", "seen")

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int]] = {}
        self.names: dict[tuple[int, str], torch.Tensor] = {}

    def __reduce__(self) -> tuple:
        """A copy (``deepcopy``, a pickled state) reads afresh: the ids it holds name this process's tensors of now."""
        return (Reader, ())


class Marks:
    """What the steps have recorded about one state object: whether a step has reused its buffers (``donated``:
    see Step's ``donate``), and the step that made it or checked it against itself (``made_by``), so that a step
    compares a state it did not make once. A field of the state, made fresh for every new state object (never
    copied by ``dataclasses.replace`` or a tree map), in place of registries keyed by the state's identity."""

    __slots__ = ("donated", "made_by", "busy")

    def __init__(self) -> None:
        self.donated = False
        self.made_by: Any = None
        self.busy = False  # a donating step is running on the state now (``claimed``)

    def __reduce__(self) -> tuple:
        """A pickled state (``torch.save(state, f)``, ``copy.deepcopy``) starts with fresh marks, as a new state object
        does: ``made_by`` is a step of this process, whose ``loss_fn``, optimizer and module are not the state's to carry
        (pickling them failed on any closure, deep in pickle, naming neither the state nor a fix), and the copy is
        checked against the step it is given, once. A state whose buffers a step has reused (or is updating now) is
        refused: its tensors hold that step's values, which the pickle would keep as the state's, silently."""
        if self.donated or self.busy:
            raise ValueError(
                "fzero: pickling a TrainState/RankStates (torch.save, pickle, copy.deepcopy) that was already passed to "
                "a step, which reused its buffers (or is updating them now, in another thread): its tensors hold that "
                "step's values, not its own. Save the state the step returned (`state, metrics = step(state, batch)`), "
                "or build the step with donate=False to keep old states."
            )
        return (Marks, ())


@dataclasses.dataclass(frozen=True, eq=False)
class TrainState:
    """One rank's training state. Immutable; a step returns a new one.

    Fields:
      params: dict unit name -> flat fp32 buffer (whole at stages 0-2), padded to a multiple of N.
      opt_state: the optimizer's state over this rank's shard of every unit.
      step: int64 0-d tensor, optimizer steps taken.
      loss_scale: the fp16 policy's dynamic loss scale (``LossScaleState``); None under fp32 and bf16.
      meta: static layout facts (not a leaf).
      buffers: dict buffer name -> tensor: the module's persistent buffers (BatchNorm statistics, ...), whole on
        every rank, as the forward left them; adopted from the module at the first step (see ``fzero.step._module``).
      frozen: dict unit name -> this rank's shard of the unit's frozen params (stage 3, ``step.init(..., frozen=...)``;
        ``meta.layout.frozen`` says which): read by the forward, never updated, not saved by a checkpoint (they are
        the model's, as a pretrained base under an adapter).
    """

    params: Any
    opt_state: Any
    step: torch.Tensor
    loss_scale: Any = None
    meta: StateMeta | None = None
    buffers: dict = dataclasses.field(default_factory=dict)
    frozen: dict = dataclasses.field(default_factory=dict)
    marks: Marks = dataclasses.field(init=False, default_factory=Marks, repr=False)  # not a leaf: see Marks

    @property
    def step_count(self) -> int:
        return int(self.step)


_tree.register_dataclass(TrainState, leaves=("params", "opt_state", "step", "loss_scale", "buffers", "frozen"), static=("meta",))


@dataclasses.dataclass(frozen=True, eq=False)
class RankStates:
    """The states of the n ranks of a ``local_mesh(n)``, rank order. ``states[r]`` is rank r's."""

    states: tuple[TrainState, ...]
    marks: Marks = dataclasses.field(init=False, default_factory=Marks, repr=False)  # not a leaf: see Marks

    def __getitem__(self, rank: int) -> TrainState:
        return self.states[rank]

    def __len__(self) -> int:
        return len(self.states)

    @property
    def step_count(self) -> int:
        return self.states[0].step_count


_tree.register_dataclass(RankStates, leaves=("states",))

def meta_of(state: TrainState) -> StateMeta:
    """``state.meta``: every state a step made or loaded has one; a ``TrainState`` built by hand may not."""
    if state.meta is None:
        raise ValueError("fzero: this TrainState has no meta (it was built by hand, not by Step.init or a step); make it "
                         "with step.init(params).")
    return state.meta


def mark_donated(state: TrainState | RankStates) -> None:
    """A step has reused ``state``'s buffers (and, for a local mesh's states, each rank's)."""
    state.marks.donated = True
    for s in state.states if isinstance(state, RankStates) else ():
        s.marks.donated = True


def share_marks(new: TrainState | RankStates, old: TrainState | RankStates) -> None:
    """``new`` holds ``old``'s buffers (params, optimizer state, disk offload's files: ``Step.with_buffers``), so it takes
    ``old``'s marks, on every rank: a step that reuses the buffers of either marks both spent, and the other is then
    refused by name instead of read with the values that step wrote into them."""
    object.__setattr__(new, "marks", old.marks)
    if isinstance(new, RankStates) and isinstance(old, RankStates):
        for n, o in zip(new.states, old.states):
            object.__setattr__(n, "marks", o.marks)


def is_donated(state: Any) -> bool:
    marks = getattr(state, "marks", None)
    if isinstance(state, RankStates) and any(is_donated(s) for s in state.states):
        return True  # a rank's update began in place (a step that raised part-way marks the ranks it reached)
    return isinstance(marks, Marks) and marks.donated


def _all_marks(state: Any) -> list[Marks]:
    marks = [getattr(state, "marks", None)] + [s.marks for s in (state.states if isinstance(state, RankStates) else ())]
    return [m for m in marks if isinstance(m, Marks)]


def is_busy(state: Any) -> bool:
    """A step that reuses ``state``'s buffers is running on it now (in another thread): its values are being
    written in place."""
    return any(m.busy for m in _all_marks(state))


_CLAIMS = threading.Lock()


@contextlib.contextmanager
def claimed(state: Any, *, refuse: Any) -> Iterator[None]:
    """Hold ``state`` for a step that will reuse its buffers: a second step given the same state meanwhile (another
    thread: two threads sharing one state, a step called from a ``loss_fn`` that each rank thread of a ``local_mesh``
    runs) is refused instead of running beside it, each updating the one set of buffers in place (both accepted, both
    results were one lr off, silently). Checked and taken under one lock; ``refuse()`` raises the error for a state
    spent or held meanwhile."""
    marks = _all_marks(state)
    with _CLAIMS:
        if any(m.donated or m.busy for m in marks):
            refuse()
        for m in marks:
            m.busy = True
    try:
        yield
    finally:
        for m in marks:
            m.busy = False


# -- a state against the step it enters ----------------------------------------------------------------------------
# The stage, mesh size and compute dtype are checked on every call (``Step._check_state``). What follows compares the
# rest, once per state a step has not made itself: the unit buffers against the state's layout, and the optimizer
# state against what this step's optimizer makes for the same params (its ``init`` run on meta tensors: shapes
# only, no memory). A state of another optimizer would otherwise run (AdamW's moments read by Lion) or fail deep
# inside the update with an AttributeError.

STATE_FIX = ("A state enters only a step with the optimizer, precision and offload it was made with. To switch, start "
             "afresh from its params: new_step.init(old_step.gather(state)) (the optimizer state starts over).")

# The optimizer a state type belongs to, for the first line of the error.
_FAMILIES = {"ScaleByAdamState": "Adam's/AdamW's", "ScaleByLionState": "Lion's", "ScaleByLambState": "Lamb's",
             "TraceState": "SGD-with-momentum's"}
_PLUMBING = ("EmptyState", "ScaleByScheduleState", "MasterState")  # in every optimizer's state: names no family


def check_state_matches(step: Any, state: TrainState, *, api: str) -> None:
    """Raise a ``ValueError`` naming the first difference between what the rank state ``state`` holds and what
    ``step`` would make for the same params: the unit buffers (names and sizes, against ``state.meta.layout``),
    and the optimizer state (where it lives, its structure, the shapes and dtypes of its tensors).

    ``step.stage``, mesh size and compute dtype are assumed checked already (``Step._check_state``). Reusable by
    ``fzero.checkpoint.load`` for a loaded state: ``check_state_matches(step, rank_state, api="fzero.checkpoint.load")``.
    """
    meta = meta_of(state)
    layout = meta.layout
    _check_units(step, state, api)
    opt = state.opt_state
    disk = getattr(step.offload, "where", None) == "disk"
    in_files = hasattr(opt, "store") and hasattr(opt, "small")  # fzero.zero._offload.DiskOptState
    if disk != in_files:
        place = {True: "in files (offload='disk')", False: "in memory"}
        raise ValueError(f"{api}: the state keeps its optimizer state {place[in_files]}, but this step keeps it "
                         f"{place[disk]}. {STATE_FIX}")
    from fzero.layout import LayoutSegments
    from fzero.optim import use_segments

    metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.params.items()}
    owned = step.opt_state.owned(step.params, layout, metas, meta.rank)
    master = step.precision.has_master
    if master:
        owned = {k: torch.empty(v.shape, dtype=torch.float32, device="meta") for k, v in owned.items()}
    with use_segments(LayoutSegments(layout, sharded=step.opt_state.sharded, rank=meta.rank, comm=None)):
        if disk:  # one unit's state, with the param-shaped leaves (in the files) left out, as DiskOptState.small
            if bool(opt.master) != master:
                raise ValueError(f"{api}: the state {'keeps' if opt.master else 'has no'} fp32 master weights but this "
                                 f"step's precision {'keeps' if master else 'has no'} master weights. {STATE_FIX}")
            first = next(iter(owned.values()), None)
            made: Any = step.optimizer.init({"g": first}) if first is not None else None
            expected: Any = optree.tree_map_with_path(lambda p, x: None if p and p[-1] == "g" else x, made, none_is_leaf=True)
            actual, shapes = opt.small, False
        else:
            from fzero.step._update import MasterState

            inner = step.optimizer.init(owned)
            expected = MasterState(owned, inner) if master else inner
            actual, shapes = opt, True
    difference = tree_difference(actual, expected, "opt_state", shapes=shapes)
    if difference is None:
        _check_groups(step, state, api, kept=disk or keeps_shared(actual, expected))
        return
    was, wants = optimizer_family(actual), optimizer_family(expected)
    head = (f"the state's optimizer state is {was} but this step's optimizer is {wants}" if was != wants else
            f"the state's optimizer state does not match this step's optimizer ({wants})")
    raise ValueError(f"{api}: {head}: {difference}. {STATE_FIX}")


def keeps_groups_shared(state: TrainState, step: Any) -> bool:
    """Whether ``state`` (a rank state in memory, of ``step``) shares its param-shaped optimizer state between groups
    wherever ``step``'s optimizer does (``keeps_shared``, against its ``init`` on meta tensors of the state's layout);
    False under disk offload (each group's tensors in files of their own) or when ``step`` is None. What a checkpoint
    records as ``groups_share_state``: only then does a group's saved entry for a param that moves to it hold what the
    param's own updates wrote."""
    if step is None or not shares_group_state(step):
        return False
    from fzero.layout import LayoutSegments
    from fzero.optim import use_segments
    from fzero.step._update import MasterState

    meta = meta_of(state)
    metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.params.items()}
    owned = step.opt_state.owned(step.params, meta.layout, metas, meta.rank)
    master = step.precision.has_master
    if master:
        owned = {k: torch.empty(v.shape, dtype=torch.float32, device="meta") for k, v in owned.items()}
    with use_segments(LayoutSegments(meta.layout, sharded=step.opt_state.sharded, rank=meta.rank, comm=None)):
        inner = step.optimizer.init(owned)
    return keeps_shared(state.opt_state, MasterState(owned, inner) if master else inner)


def group_labels(state: TrainState, step: Any) -> list[dict[str, Any]] | None:
    """``[{"api", "labels": {param path: label}}]`` for each ``multi_transform`` of ``step``'s optimizer, in init
    order, as that optimizer's ``init`` reports them on meta tensors of ``state``'s layout (as a step would run it);
    None when ``step`` is None (unknown). What ``fzero.checkpoint.save`` records and ``_check_groups`` compares."""
    if step is None:
        return None
    from fzero.layout import LayoutSegments
    from fzero.optim import recording_groups, use_segments

    meta = meta_of(state)
    metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.params.items()}
    owned = step.opt_state.owned(step.params, meta.layout, metas, meta.rank)
    if step.precision.has_master:
        owned = {k: torch.empty(v.shape, dtype=torch.float32, device="meta") for k, v in owned.items()}
    with recording_groups() as seen, use_segments(LayoutSegments(meta.layout, sharded=step.opt_state.sharded, rank=meta.rank, comm=None)):
        step.optimizer.init(owned)
    return seen


# (id(optimizer), id(layout)) -> (optimizer, layout, its groupings, the stand-in params tree): ``probe_groupings``
_GROUPINGS: dict[tuple[int, int], tuple[Any, Any, list, Any]] = {}


def probe_groupings(step: Any, state: TrainState | RankStates) -> None:
    """Call the rule functions of ``step``'s parameter groupings (``multi_transform``'s labels, ``masked``'s mask,
    ``adamw(mask=...)``) on the params' stand-in tree before the step runs, and follow or refuse what they now answer
    (``fzero.optim._groups.Groups.probe``).

    Why: optax calls a labels function at every update, so one that reads outside state (a notebook's dict of
    groups, a flag for gradual unfreezing) may regroup params between steps; fzero called it once and kept that
    answer for good, silently (a layer moved from a group at lr 1e-4 to one at 1e-2 trained on at 1e-4: 2.0e-2 off
    torch.optim after 2 more AdamW steps). Here, before the state is given to the update that writes it in place,
    so that a refused move leaves the state whole. The groupings are found once per optimizer and layout (an ``init`` on meta
    tensors); a step then costs the rule functions' calls (a dict of 148 labels: about 25 us)."""
    first = state.states[0] if isinstance(state, RankStates) else state
    meta = getattr(first, "meta", None)
    if meta is None:
        return
    optimizer, layout = step.optimizer, meta.layout
    hit = _GROUPINGS.get((id(optimizer), id(layout)))
    if hit is None or hit[0] is not optimizer or hit[1] is not layout:
        from fzero.layout import LayoutSegments
        from fzero.optim import finding_groupings, use_segments

        metas = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in first.params.items()}
        owned = step.opt_state.owned(step.params, layout, metas, meta.rank)
        segments = LayoutSegments(layout, sharded=step.opt_state.sharded, rank=meta.rank, comm=None)
        with finding_groupings() as found, use_segments(segments):
            optimizer.init(owned)
        if len(_GROUPINGS) >= 16:  # a few steps and layouts live at a time
            _GROUPINGS.clear()
        hit = _GROUPINGS[(id(optimizer), id(layout))] = (optimizer, layout, found, segments.param_tree())
    if hit[2]:  # (a step without parameter groups runs no function of fzero.optim's here)
        from fzero.optim import probe_groupings as probe

        # a state in files (offload='disk') holds each group's tensors in their own, shared or not in memory
        probe(hit[2], hit[3], shared=shares_group_state(step))


GROUPS_FIX = ("To move params to another group, start the optimizer state afresh from the params: "
              "new_step.init(old_step.gather(state)) (every group's state starts over); to change a group's learning "
              "rate, keep the labels and give that group's transform a schedule that reads a value the loop sets "
              "(optimizer=...adamw(lambda step: lr[\"head\"])); to train params held by set_to_zero() from now on (gradual "
              "unfreezing), keep them in their trained group and detach what they compute while frozen, as "
              "docs/migrating.md shows for a backbone frozen for N steps.")


def moved_params(was: list[dict[str, Any]], now: list[dict[str, Any]], *, shared: bool = True) -> tuple[int, list[str]] | None:
    """The first grouping (by index) whose labels moved a param between ``was`` and ``now`` where its optimizer state
    cannot follow, and each such param as "'path' from 'old' to 'new'"; ``(-1, [])`` when the number of groupings
    differs; None when every move (if any) can be followed. A move is judged as a labels function's move between
    steps is (``fzero.optim.refused_labels``: a layer moved between two ``adamw`` groups keeps its one Adam state, as
    torch.optim keeps ``state[p]``); ``now``'s entries carry their grouping (``recording_groups``), and one without it
    (a grouping not known) refuses every move. ``shared``: see ``probe_groupings``."""
    from fzero.optim import refused_labels

    if len(was) != len(now):
        return -1, []
    for k, (a, b) in enumerate(zip(was, now)):
        grouping = b.get("grouping")
        if grouping is not None:
            refused, _ = refused_labels(a["labels"], b["labels"], grouping, shared=shared)
        else:
            refused = [f"{p!r} from {a['labels'][p]!r} to {b['labels'][p]!r}" for p in sorted(set(a["labels"]) & set(b["labels"]))
                       if a["labels"][p] != b["labels"][p]]
        if refused:
            return k, refused
    return None


def shares_group_state(step: Any) -> bool:
    """Whether ``step``'s optimizer state keeps the tensors its groups share (False: ``offload='disk'``, each group's
    tensors in their own files), as ``probe_groupings`` judges a move."""
    return getattr(step.opt_state.offload, "where", None) != "disk"


def keeps_shared(actual: Any, expected: Any) -> bool:
    """Whether every tensor ``expected`` (the step's ``init`` on meta tensors) holds at two places of its tree (the
    param-shaped state that ``multi_transform``'s groups share) is one tensor at those places of ``actual`` (the
    state given) too. Why: a move between such groups is followed on the promise that the param's elements of its
    new group's state are what its own updates wrote; a state copied leaf by leaf and trained on holds each group's
    tensor apart, the new group's elements stale (7.2e-3 off torch.optim after 2 steps where it was followed)."""
    xs, ys = optree.tree_leaves(expected), optree.tree_leaves(actual)
    if len(xs) != len(ys):
        return False
    first: dict[int, Any] = {}
    for x, y in zip(xs, ys):
        if isinstance(x, torch.Tensor) and first.setdefault(id(x), y) is not y:
            return False
    return True


def _check_groups(step: Any, state: TrainState, api: str, *, kept: bool = True) -> None:
    """A state made by another step whose ``multi_transform`` (or ``masked`` over a stateful transform) put a param in
    another group is refused where the param's optimizer state cannot follow the move, and followed where it can (a
    layer moved between two ``adamw`` groups of other learning rates: one Adam state), as a labels function that
    answers otherwise between steps is (``moved_params``).

    Why: every group's state is kept for every param, but only a param's own group updates its elements
    (``fzero.optim._groups``), so a param that moved would start in its new group from what that group holds for it:
    another transform's tensors (SGD's momentum read as Adam's first moment, a second moment of zeros) or zeros against
    the step count. The structures match, so ``check_state_matches`` saw nothing: measured, a layer moved from
    SGD-momentum to AdamW(1e-3) in a notebook (the step compiled again with new labels, the old state given to it) moved
    by 5.6 in one step. ``fzero.checkpoint.load`` refuses the same move from a checkpoint."""
    before = made_by(state)
    if before is None or before is step:
        return
    was, now = group_labels(state, before), group_labels(state, step)
    if not was and not now:
        return
    # (a move between groups that share their state is followed only where the state given shares it too: ``kept``)
    found = moved_params(was or [], now or [], shared=kept and shares_group_state(step) and shares_group_state(before))
    if found is None:
        return
    k, moved = found
    if k < 0:
        raise ValueError(f"{api}: the state was made by a step whose optimizer has {len(was or [])} parameter grouping(s) "
                         f"(multi_transform, or masked over a stateful transform), this step's has {len(now or [])}. {GROUPS_FIX}")
    which = "" if len(now or []) == 1 else f" (grouping number {k + 1}, {(now or [])[k]['api']})"
    shown = "; ".join(moved[:8]) + (f"; and {len(moved) - 8} more" if len(moved) > 8 else "")
    raise ValueError(
        f"{api}: params changed group since the step that made this state{which}: {shown}. A moved param's optimizer "
        f"state in its new group is not that transform's state for it (it was never updated there, or it belongs to "
        f"the transform it left), so its next updates would be wrong. {GROUPS_FIX}"
    )


def _check_units(step: Any, state: TrainState, api: str) -> None:
    """The state's unit buffers are those of its layout, each of the size a rank of this step holds."""
    meta = meta_of(state)
    layout = meta.layout
    names = [u.name for u in layout.units]
    params = state.params if isinstance(state.params, dict) else {}
    missing = [n for n in names if n not in params]
    extra = [n for n in params if n not in names]
    if missing or extra:
        raise ValueError(f"{api}: the state's params hold units {sorted(params)[:5]}, but its layout has units "
                         f"{names[:5]} (missing: {missing[:3]}, unknown: {extra[:3]}): the state was assembled by hand "
                         f"or edited. {STATE_FIX}")
    for u in layout.units:
        lo, hi = u.shard_range(meta.rank, layout.world_size)
        want = hi - lo if step.params.sharded else u.padded
        got = params[u.name]
        if not isinstance(got, torch.Tensor) or got.dim() != 1 or got.numel() != want:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"{api}: unit {u.name!r} of the state holds {shape}, but a rank of this step holds a flat "
                             f"buffer of {want} elements for it ({', '.join(s.path for s in u.slots[:3])}"
                             f"{', ...' if len(u.slots) > 3 else ''}). {STATE_FIX}")


def tree_difference(actual: Any, expected: Any, path: str = "opt_state", *, shapes: bool = True,
                    _keyed: bool = False) -> str | None:
    """The first place where the pytree ``actual`` (a state's) differs from ``expected`` (what the step makes), in
    words, or None: a node of another type or length, other dict keys, or (``shapes``) a param-shaped tensor (a
    dict entry: moments, momentum, masters, by unit) of another shape or dtype. Reusable for any two optimizer
    states (``expected`` may hold meta tensors).

    Tensors held directly by a state type (Adam's ``count`` and per-param ``skipped``) are compared as present or
    not only: what they count is the optimizer's to check, and its update says so in its own words."""
    if isinstance(actual, torch.Tensor) or isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)):
            return f"{path} is {describe(actual)} in the state but {describe(expected)} in the step"
        if shapes and _keyed and (actual.shape != expected.shape or actual.dtype != expected.dtype):
            return f"{path} is {describe(actual)} in the state but {describe(expected)} in the step"
        return None
    if type(actual) is not type(expected):
        return f"{path} is {describe(actual)} in the state but {describe(expected)} in the step"
    if isinstance(expected, (tuple, list)):
        if len(actual) != len(expected):
            return f"{path} is {describe(actual)} in the state but {describe(expected)} in the step"
        fields = getattr(expected, "_fields", None)
        optional = getattr(type(expected), "_field_defaults", {})
        for i, (a, e) in enumerate(zip(actual, expected)):
            if a is None and fields and optional.get(fields[i], 0) is None:  # a field the state type lets be None
                continue  # (e.g. Adam's per-param skip counts in a state built by hand: its update says what that means)
            found = tree_difference(a, e, f"{path}.{fields[i]}" if fields else f"{path}[{i}]", shapes=shapes)
            if found is not None:
                return found
        return None
    if isinstance(expected, dict):
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            return (f"{path} has keys {sorted(map(str, actual))[:5]} in the state but {sorted(map(str, expected))[:5]} in "
                    f"the step")
        for k in expected:
            found = tree_difference(actual[k], expected[k], f"{path}[{k!r}]", shapes=shapes, _keyed=True)
            if found is not None:
                return found
        return None
    if optree.tree_structure(actual, none_is_leaf=True) != optree.tree_structure(expected, none_is_leaf=True):
        return f"{path} is {describe(actual)} in the state but {describe(expected)} in the step"
    return None


def describe(x: Any) -> str:
    """A node of a state in a few words: ``ScaleByAdamState(count, mu, nu, skipped)``, ``a float32 tensor of shape (8,)``."""
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    fields = getattr(x, "_fields", None)
    if isinstance(x, tuple) and fields is not None:
        return f"{type(x).__name__}({', '.join(fields)})"
    if isinstance(x, (tuple, list)):
        kinds = [type(c).__name__ if getattr(c, "_fields", None) is not None else describe(c) if c is None else
                 type(c).__name__ for c in x]
        return f"a {type(x).__name__} of {len(x)} ({', '.join(kinds)})"
    if isinstance(x, dict):
        return f"a dict of {len(x)} entries"
    return "None" if x is None else f"a {type(x).__name__}"


def optimizer_family(tree: Any) -> str:
    """Whose state ``tree`` is, from its first named state type: "Adam's/AdamW's (count, mu, nu, skipped)",
    "Lion's (mu)", or "stateless (plain SGD's)" when it holds only plumbing (empty states, schedule counts)."""
    fields = getattr(tree, "_fields", None)
    if isinstance(tree, tuple) and fields is not None and type(tree).__name__ not in _PLUMBING:
        name = type(tree).__name__
        return f"{_FAMILIES.get(name, name)} ({', '.join(fields)})"
    for child in tree if isinstance(tree, (tuple, list)) else ():  # per-unit dicts hold tensors: not looked into
        found = optimizer_family(child)
        if found != _STATELESS:
            return found
    return _STATELESS


_STATELESS = "stateless (plain SGD's)"


# A state's optimizer state and buffers are checked against a step (``check_state_matches``) unless that step made
# it or checked it already: ``Marks.made_by``. A step's new states are marked by the step itself.
def mark_verified(state: TrainState | RankStates, step: Any) -> None:
    for s in state.states if isinstance(state, RankStates) else (state,):
        s.marks.made_by = step


def is_verified(state: TrainState, step: Any) -> bool:
    return state.marks.made_by is step


def made_by(state: TrainState) -> Any:
    """The step that made ``state`` (by ``Step.init`` or a step call) or checked it, or None."""
    return state.marks.made_by


def whole_frozen(state: TrainState | RankStates, comm: Any = None, *, host: bool = False) -> dict[str, torch.Tensor]:
    """The frozen params ``state`` holds sharded (``init(..., frozen=...)``), whole, ``{name: tensor}`` in their own
    dtypes, gathered one group at a time: from the ranks of a local mesh in this process, or over ``comm`` (every rank
    calls it, under ``dist_mesh``). ``host``: each group moved to the host as soon as it is whole, so that the device
    holds one group at a time (a checkpoint's save)."""
    first = state.states[0] if isinstance(state, RankStates) else state
    layout = meta_of(first).layout
    out: dict[str, torch.Tensor] = {}
    for group in layout.frozen:
        key = frozen_key(group)
        if isinstance(state, RankStates):  # all the shards are in this process
            flat = torch.cat([s.frozen[key] for s in state.states])
        elif layout.world_size == 1:
            flat = first.frozen[key]
        elif comm is not None:
            mine = first.frozen[key]
            flat = comm.all_gather(torch.empty(group.padded, dtype=mine.dtype, device=mine.device), mine, tag="gather")
        else:
            raise ValueError("fzero: the frozen params of this state are sharded over the processes of a dist_mesh; gather "
                             "them with the step that made it (step.gather_frozen(state), on every rank).")
        if host:
            flat = flat.cpu()
        out.update({s.path: flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in group.slots})
        del flat
    return out
