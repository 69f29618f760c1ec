"""The types of a step's parts (``fzero.step._parts``): what each kind of part offers the rank program, as Protocols
that mypy checks the parts against (``[tool.mypy]`` in pyproject.toml), and the step's ``UnitSettings``.

Apart from the parts themselves so that each stays short; nothing here runs during a step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

import torch

from fzero.layout import Layout

if TYPE_CHECKING:
    from fzero.step._pool import Pool


class StepView(Protocol):
    """What one step's gradient is taken over, as the rank program uses it (``fzero.step._parts.View`` and its
    subclasses): ``inputs``, the differentiable tensors; ``build(xs)``, what ``loss_fn`` gets; ``release()`` after each
    micro-batch; ``collect(grads)``, one gradient per unit; ``finish(meta)``, the state's new metadata."""

    inputs: list[torch.Tensor]

    def build(self, xs: list[torch.Tensor]) -> Any: ...
    def release(self) -> None: ...
    def collect(self, grads: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def finish(self, meta: Any) -> Any: ...
    def begin_micro(self, *, last: bool) -> None: ...
    def grad_into(self, leaves: list[torch.Tensor]) -> bool: ...
    @property
    def accumulates(self) -> bool: ...
    def for_update(self, state: Any) -> Any: ...
    def restore(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class UnitSettings:
    """How a step runs its units: settings of the step (``Step.unit_settings``), set by the transforms that make units
    modules (``shard_grads``, ``shard_params``) and handed to the parts that run them.

    ``jit``: each unit's forward through ``torch.compile`` (stages 2-3). ``bucket_elements``: units reduced together
    (and, at stage 3, gathered; at stage 2, gathered back after the update) until a bucket holds this many elements;
    0: each unit alone. ``prefetch``: stage 3 gathers the next unit while one runs. ``remat``: each unit's forward
    is recomputed in backward, at every stage (stage 3 gathers the unit again for it). ``wrap_params``: what
    ``loss_fn`` receives at stages 0-1 (the params dict) is passed through it: ``fzero.zero``'s ``remat`` wraps
    it so that ``fzero.apply`` recomputes each module unit (at stages 2-3 the unit params do it themselves).
    ``compiled``: where ``jit`` keeps each unit class's compiled forward across the step's calls."""

    jit: bool = False
    bucket_elements: int = 0
    prefetch: bool = True
    remat: bool = False
    wrap_params: Callable[[Any], Any] | None = None
    # under ``jit``: each unit class's compiled forward, made once for the step's life (``fzero.zero._jit``); made by
    # ``shard_grads(jit=True)``, one per step built that way, never a default shared between steps
    compiled: dict[Any, Callable[..., Any]] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.jit and self.compiled is None:  # settings made with jit=True get a cache of their own
            object.__setattr__(self, "compiled", {})


class ParamsPart(Protocol):
    """Where a rank keeps the params between steps, and what ``loss_fn`` sees during one (``ParamsReplicated``,
    ``fzero.zero.ParamsSharded``)."""

    @property
    def sharded(self) -> bool:
        """Whether a rank holds only a shard of each unit (stage 3)."""
        ...

    def hold(self, flat: torch.Tensor, lo: int, hi: int, *, copy: bool) -> torch.Tensor:
        """What a rank keeps of a packed unit at init (``copy``: the packed buffer is shared by another rank)."""
        ...

    def local(self, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """This rank's slice of every unit, as views (what a sharded optimizer updates)."""
        ...

    def view(self, grads: GradsPart, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, release: Any,
             pool: Pool | None = None, masters: dict[str, torch.Tensor] | None = None,
             settings: UnitSettings = UnitSettings(), homes: dict[str, torch.Tensor] | None = None) -> StepView:
        """What the gradient of a micro-batch is taken over, and what ``loss_fn`` receives. ``homes``: where each unit's
        gradient shard goes as backward makes it (``OffloadPolicy.grad_homes``), for the views that reduce in backward."""
        ...

    def eval_view(self, comm: Any, state: Any, *, release: Any, settings: UnitSettings = UnitSettings()) -> StepView:
        """What ``loss_fn`` receives in an evaluation (no gradient)."""
        ...

    def gather_back(self, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *, bucket_elements: int = 0,
                    pool: Pool | None = None) -> None:
        """After a sharded optimizer updated this rank's slice: what the params need back (stages 1-2: every rank's
        slices; stage 3: nothing)."""
        ...


class GradsPart(Protocol):
    """How the gradient is synchronised (``GradsAllReduce``, ``fzero.zero.GradsReduceScatter``,
    ``fzero.zero.GradsInBackward``)."""

    @property
    def units(self) -> tuple[str, ...] | None:
        """The module units (stages 2-3), or None: units by size."""
        ...

    @property
    def in_backward(self) -> bool:
        """Whether each unit is reduced during the backward (stages 2-3)."""
        ...

    @property
    def whole(self) -> bool:
        """Whether every rank ends with the whole gradient."""
        ...

    def unit_of(self, api: str) -> Callable[[str], str] | None:
        """How params are grouped into units: None, by size."""
        ...

    def replicated_view(self, comm: Any, state: Any, *, reduce_dtype: torch.dtype | None, pool: Pool | None = None,
                        settings: UnitSettings = UnitSettings(), homes: dict[str, torch.Tensor] | None = None) -> StepView:
        """The view of whole params (stages 0-2) that the gradient is taken over."""
        ...

    def sync(self, comm: Any, grad: torch.Tensor, *, reduce_dtype: torch.dtype, compute: torch.dtype,
             pool: Pool | None = None) -> torch.Tensor:
        """A unit's gradient synchronised now (what this rank keeps of it)."""
        ...


class OptStatePart(Protocol):
    """Where the optimizer state and masters live and what a rank updates (``OptStateReplicated``,
    ``fzero.zero.OptStateSharded``, each with an ``OffloadPolicy``)."""

    @property
    def sharded(self) -> bool:
        ...

    @property
    def offload(self) -> OffloadPolicy:
        ...

    def owned(self, params: ParamsPart, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        ...

    def hold_master(self, master: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        ...

    def init(self, optimizer: Any, params: ParamsPart, layout: Layout, flats: dict[str, torch.Tensor],
             master: dict[str, torch.Tensor] | None, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
        ...

    def has_masters(self, opt_state: Any) -> bool:
        ...

    def masters(self, opt_state: Any, layout: Layout) -> dict[str, torch.Tensor]:
        ...

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        ...

    def apply(self, optimizer: Any, grads: dict[str, torch.Tensor], opt_state: Any, params: dict[str, torch.Tensor],
              segments: Any) -> Any:
        ...

    def after_update(self, params: ParamsPart, comm: Any, flats: dict[str, torch.Tensor], layout: Layout, *,
                     bucket_elements: int = 0, pool: Pool | None = None) -> None:
        ...


class OffloadPolicy(Protocol):
    """Where an optimizer state and its fp32 masters live, and where the optimizer runs on them: ``OnDevice``, or
    ``fzero.CPUOffload`` / ``fzero.DiskOffload`` (``fzero.offload``). The ``opt_state`` part hands its policy the
    four things that differ by place, and nothing branches on a place name."""

    where: ClassVar[str]  # "device", "cpu" or "disk"

    @property
    def params(self) -> bool:
        """Whether stage 3's param shards live there too."""
        ...

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """A master copy of ``t`` where the state lives (always a new tensor)."""
        ...

    def init(self, optimizer: Any, owned: dict[str, torch.Tensor], master: dict[str, torch.Tensor] | None,
             flats: dict[str, torch.Tensor], rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
        """The optimizer state of what this rank owns, and the params' flats (moved, where the params go too)."""
        ...

    def apply(self, optimizer: Any, grads: dict[str, torch.Tensor], opt_state: Any, params: dict[str, torch.Tensor],
              segments: Any) -> Any:
        """One optimizer step on ``params`` (this rank's, in place), returning the new optimizer state."""
        ...

    def release(self, opt_state: Any) -> Callable[[torch.Tensor], None] | None:
        """Called with each param shard when its use is over (a file-backed shard gives its pages back); None: nothing."""
        ...

    def grad_homes(self, shards: dict[str, tuple[torch.Tensor, int, int]]) -> dict[str, torch.Tensor] | None:
        """Where each unit's gradient shard goes as backward makes it, by unit, given (the state's flat of the unit,
        the rank's range in it); None: it stays where it is made."""
        ...

    def has_masters(self, opt_state: Any) -> bool:
        """Whether the state keeps fp32 master weights (a mixed-precision policy)."""
        ...

    def masters(self, opt_state: Any, layout: Layout) -> dict[str, torch.Tensor]:
        """This rank's fp32 masters, by unit."""
        ...
