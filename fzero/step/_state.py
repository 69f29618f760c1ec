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

import dataclasses
import weakref
from typing import Any

import torch

from fzero.layout import _tree
from fzero.layout._layout import Layout


@dataclasses.dataclass(frozen=True)
class StateMeta:
    """Static facts about a state: checked against the step that receives it."""

    layout: Layout
    stage: int
    world_size: int
    rank: int
    gather_order: tuple[str, ...] = ()  # stage 3: the units the last step gathered, in order (for prefetch)
    device: torch.device = torch.device("cpu")  # where the params compute (param shards offloaded to the host come here to be gathered)


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
        every rank, as the forward left them; adopted from the module at the first step (see ``fzero.step._buffers``).
    """

    params: Any
    opt_state: Any
    step: torch.Tensor
    loss_scale: Any = None
    meta: StateMeta | None = None
    buffers: dict = dataclasses.field(default_factory=dict)

    @property
    def step_count(self) -> int:
        return int(self.step)


_tree.register_dataclass(TrainState, leaves=("params", "opt_state", "step", "loss_scale", "buffers"), static=("meta",))


@dataclasses.dataclass(frozen=True, eq=False)
class RankStates:
    """The states of the n ranks of a ``local_mesh(n)``, rank order. ``states[r]`` is rank r's."""

    states: tuple[TrainState, ...]

    def __getitem__(self, rank: int) -> TrainState:
        return self.states[rank]

    def __len__(self) -> int:
        return len(self.states)

    @property
    def step_count(self) -> int:
        return self.states[0].step_count


_tree.register_dataclass(RankStates, leaves=("states",))

# States whose buffers a step has reused in place (see Step's ``donate``). A weak set keyed by identity:
# it holds no state alive and needs no field that tree_map would have to carry.
_donated: "weakref.WeakSet[Any]" = weakref.WeakSet()


def mark_donated(state: Any) -> None:
    _donated.add(state)
    if isinstance(state, RankStates):
        for s in state.states:
            _donated.add(s)


def is_donated(state: Any) -> bool:
    return state in _donated
