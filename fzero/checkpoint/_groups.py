"""Parameter groups in a checkpoint: which ``multi_transform`` label each param had when it was saved.

Why: under ``fzero.optim.multi_transform`` every group's state is kept for every param, but only a param's own
group ever updates its elements (``fzero.optim._groups``). A param that moves to another group between save and
load (a layer moved from SGD-momentum to AdamW) would start in its new group with whatever that group's state
holds for it: zeros against a step count of thousands, or another transform's tensors where the groups share
one (SGD's momentum read as Adam's first moment). Measured at commit 759f906: the moved layer's first AdamW update
was about 14x the learning rate, without a word. So ``save`` records the labels in ``fzero.json`` and ``load``
refuses labels that differ where a moved param's state cannot follow (the judgement a labels function's move between
steps gets, ``fzero.optim.refused_labels``), naming each such param and both labels; a layer moved between two
``adamw`` groups of other learning rates loads and keeps its one Adam state, as torch.optim keeps ``state[p]``.

The labels are those of the step the state came from (``Step.init`` and every step call remember which step made
a state): its optimizer's ``init`` runs on meta tensors of the state's layout, as a step would, and each
``multi_transform`` in it reports its labels. A state no step is known for (one just loaded and saved again
without a step) records none, and a checkpoint without labels loads as before.
"""

from __future__ import annotations

from typing import Any

from fzero.checkpoint._dcp import CheckpointError
from fzero.step import TrainState, group_labels, keeps_groups_shared, moved_params

MOVED_FIX = (
    "Load it with the labels it was saved with. To move params to another group, start the optimizer state afresh "
    "from the saved params: new_step.init(old_step.gather(fzero.checkpoint.load(path, like=old_step))) (every "
    "group's state starts over)."
)


def step_of(state: TrainState) -> Any:
    """The step that made ``state`` (by ``Step.init`` or a step call), or None."""
    from fzero.step import made_by

    return made_by(state)


def labels(state: TrainState, step: Any) -> list[dict[str, Any]] | None:
    """``[{"api", "labels": {param path: label}}]`` for each ``multi_transform`` of ``step``'s optimizer, in init
    order (see the module docstring); None when ``step`` is None (unknown)."""
    return group_labels(state, step)


def groups_share_state(state: TrainState, step: Any) -> bool | None:
    """What ``fzero.json`` records as ``groups_share_state``: whether the saved state's parameter groups shared their
    tensors wherever ``step``'s optimizer shares them (a state in memory, not copied leaf by leaf; False under
    ``offload='disk'``, each group's tensors in their own files, which diverge as each group writes its own
    elements); None when no step is known for the state."""
    return None if step is None else keeps_groups_shared(state, step)


def check_labels(saved: list[dict[str, Any]] | None, mine: list[dict[str, Any]] | None, *, path: str, step: int, api: str,
                 shared: bool = False) -> None:
    """Raise a ``CheckpointError`` naming the params whose group differs between the checkpoint and the step where
    their optimizer state cannot follow the move (``fzero.step.moved_params``, as a labels function's move between
    steps is judged: a layer moved between two ``adamw`` groups keeps its one Adam state and loads). ``shared``: the
    checkpoint was saved from a state whose groups shared their tensors and the step keeps them shared (in memory, not
    ``offload='disk'``): only then does a moved param's entry in its new group hold what its own updates made."""
    if saved is None or mine is None:
        return  # saved without labels, or the step is not known: nothing to compare
    if not any(e["api"] == "fzero.optim.masked" for e in saved):  # saved before masked's masks were recorded
        mine = [e for e in mine if e["api"] != "fzero.optim.masked"]
    if len(saved) != len(mine):
        raise CheckpointError(
            f"{api}: the checkpoint {path} (step {step}) was saved with {len(saved)} multi_transform parameter grouping(s) "
            f"in its optimizer, this step's optimizer has {len(mine)}. {MOVED_FIX}"
        )
    found = moved_params(saved, mine, shared=shared)  # the one judgement of a move (a labels function's, a re-compile's)
    if found is None:
        return
    k, moved = found
    which = "" if len(saved) == 1 else f" (the {_nth(k)} multi_transform)"
    shown = "; ".join(moved[:8]) + (f"; and {len(moved) - 8} more" if len(moved) > 8 else "")
    raise CheckpointError(
        f"{api}: params changed group since the checkpoint {path} (step {step}) was saved{which}: {shown}. A "
        f"moved param's optimizer state in its new group is not that transform's state for it (it was never "
        f"updated there, or it belongs to the transform it left), so its next updates would be wrong. {MOVED_FIX}"
    )


def _nth(k: int) -> str:
    return {0: "1st", 1: "2nd", 2: "3rd"}.get(k, f"{k + 1}th")
