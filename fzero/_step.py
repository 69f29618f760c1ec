"""The pure train step: ``Step.init(params) -> state`` and ``Step(state, batch) -> (state, metrics)``.

One rank program serves every stage and every mesh: compute the loss and the gradient with
``torch.func.grad`` over the flat unit buffers, synchronise the gradient (all-reduce at stage 0,
reduce-scatter at stages 1-2), update this rank's slice of the params with the optimizer, and
all-gather the params back (stages 1-2). The ZeRO transforms in ``_zero.py`` only change ``stage``.

Donation: a step reuses the buffers of the state it is given (as ``jax.jit(..., donate_argnums=0)``),
because ZeRO exists to save memory and a pure copy would double the optimizer state for a moment.
The state passed in is marked spent, and passing it again raises an error instead of reading buffers
that have moved on. ``donate=False`` copies the state first.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import optree
import torch

from fzero import _tree
from fzero._comm import Rendezvous, ThreadComm
from fzero._context import simulated_rank
from fzero._layout import DEFAULT_UNIT_ELEMENTS, Layout, build_layout
from fzero._sharded import ReplicatedParams, Schedule, ShardedParams, UnitParams
from fzero._units import by_container_child, by_prefixes
from fzero._mesh import DistMesh, LocalMesh, Mesh
from fzero._state import RankStates, StateMeta, TrainState, is_donated, mark_donated

STAGE_NAMES = {0: "stage 0 (replicated, like DDP)", 1: "stage 1 (ZeRO-1)", 2: "stage 2 (ZeRO-2)", 3: "stage 3 (ZeRO-3)"}


@dataclasses.dataclass(frozen=True)
class Step:
    """A pure training step. Build it with ``fzero.train_step`` and the shard transforms, or ``fzero.compile``."""

    loss_fn: Callable[..., Any]
    optimizer: Any  # fzero.optim.GradientTransformation
    mesh: Mesh | None = None
    stage: int = 0
    unit_elements: int = DEFAULT_UNIT_ELEMENTS
    donate: bool = True
    units: tuple[str, ...] | None = None  # stages 2-3: unit module paths; None = children of ModuleList/Sequential
    prefetch: bool = True  # stage 3: gather the next unit while the current one computes
    autodiff: str = "func"  # "func": torch.func.grad; "autograd": plain torch.autograd.grad

    @property
    def world_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    # -- init --------------------------------------------------------------------------------------
    def init(self, params: Any) -> TrainState | RankStates:
        """The initial state for ``params`` (a pytree of tensors, e.g. ``fzero.params_of(model)``; copied, never aliased)."""
        n = self.world_size
        unit_of = None
        if self.stage >= 2:  # units by module: each one's gradient is reduced (stage 2) or gathered (3) as it runs
            unit_of = by_container_child if self.units is None else by_prefixes(self.units, api="fzero.Step.init")
        layout = build_layout(params, world_size=n, unit_elements=self.unit_elements, unit_of=unit_of, api="fzero.Step.init")
        flats = layout.pack(_tree.tree_leaves(params))
        if isinstance(self.mesh, LocalMesh):
            return RankStates(tuple(self._init_rank(layout, _copy(flats) if r else flats, r) for r in range(n)))
        if isinstance(self.mesh, DistMesh):
            comm = self.mesh.comm()
            for flat in flats.values():  # every rank starts from rank 0's params, as DDP does
                comm.broadcast(flat, src=0, tag="init")
            return self._init_rank(layout, flats, self.mesh.rank)
        return self._init_rank(layout, flats, 0)

    def _init_rank(self, layout: Layout, flats: dict[str, torch.Tensor], rank: int) -> TrainState:
        if self.stage == 3:  # keep only this rank's shard of every unit
            flats = {u.name: flats[u.name][slice(*u.shard_range(rank, layout.world_size))].clone() for u in layout.units}
        opt_state = self.optimizer.init(_owned(layout, flats, self.stage, rank))
        meta = StateMeta(layout=layout, stage=self.stage, world_size=layout.world_size, rank=rank)
        return TrainState(params=flats, opt_state=opt_state, step=torch.zeros((), dtype=torch.int64), meta=meta)

    # -- step --------------------------------------------------------------------------------------
    def __call__(self, state: TrainState | RankStates, batch: Any) -> tuple[TrainState | RankStates, dict[str, Any]]:
        """One optimizer step. Returns the new state and metrics: loss (mean over ranks), grad_norm, lr, step."""
        self._check_state(state)
        if not self.donate:
            state = _tree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
        if isinstance(self.mesh, LocalMesh):
            batches = split_batch(batch, self.mesh.size)
            results = self.mesh.run(self._rank_step, [(s, b) for s, b in zip(state.states, batches)])
            new_state: Any = RankStates(tuple(r[0] for r in results))
            metrics = results[0][1]
        else:
            comm = self.mesh.comm() if isinstance(self.mesh, DistMesh) else ThreadComm(0, Rendezvous(1, 1.0), None)
            new_state, metrics = self._rank_step(comm, state, batch)
        mark_donated(state)
        return new_state, metrics

    def _rank_step(self, comm, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if isinstance(self.mesh, LocalMesh) and comm.size > 1:
            with simulated_rank(comm.rank):
                return self._rank_program(comm, state, batch)
        return self._rank_program(comm, state, batch)

    def _rank_program(self, comm, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        layout, n = state.meta.layout, comm.size
        flats = state.params
        units = layout.units
        ranges = [u.shard_range(comm.rank, n) for u in units]
        names = [u.name for u in units]

        if self.stage == 2:
            inputs = [flats[u.name][lo:hi] for u, (lo, hi) in zip(units, ranges)]

            def build(xs):
                return ReplicatedParams(dict(zip(names, xs)), layout, comm, flats)
        elif self.stage == 3:
            inputs = [flats[u.name] for u in units]  # the shards themselves
            schedule = Schedule(comm, layout, flats, state.meta.gather_order, self.prefetch)

            def build(xs):
                return ShardedParams(dict(zip(names, xs)), layout, comm, schedule)
        else:
            inputs = [flats[u.name] for u in units]

            def build(xs):
                return layout.unpack(dict(zip(names, xs)))

        made: list[Any] = []  # what loss_fn was given, to release after the gradient

        def as_params(xs):
            made.append(build(xs))
            return made[-1]

        aux_box: dict[str, Any] = {}

        def objective(xs):
            loss, aux = _split_loss(self.loss_fn(as_params(xs), batch))
            # torch.func.grad unwraps only tensors out of aux: pass those, keep the rest aside.
            leaves, aux_box["spec"] = optree.tree_flatten(aux)
            aux_box["leaves"] = leaves
            return loss, (loss, [x for x in leaves if isinstance(x, torch.Tensor)])

        grads, (loss, aux_tensors) = _differentiate(objective, inputs, self.autodiff)
        for params in made:
            if isinstance(params, UnitParams):
                params.release()
        meta = state.meta
        if self.stage == 3:
            meta = dataclasses.replace(meta, gather_order=schedule.finish())
        tensors = iter(aux_tensors)
        aux_leaves = [next(tensors) if isinstance(x, torch.Tensor) else x for x in aux_box["leaves"]]
        aux = aux_box["spec"].unflatten(aux_leaves)

        # Gradient sync. Every path sums over ranks in rank order, then divides by N: the same numbers
        # at every stage, so stages 1-3 equal stage 0 bitwise (with shards aligned, see SHARD_ALIGN).
        owned_grads = []
        for i, (u, (lo, hi)) in enumerate(zip(units, ranges)):
            g = grads[i]
            grads[i] = None  # drop the whole gradient as soon as its shard exists (stage 1)
            if self.stage == 0:
                g = comm.all_reduce(g, tag="grads")
            elif self.stage == 1:
                g = comm.reduce_scatter(g, tag="grads")
            # stages 2 and 3: already this rank's reduced shard (reduce-scattered during backward)
            owned_grads.append(g.div_(n))

        # Global grad norm from this rank's slice of every unit, summed over ranks (the grouping of the
        # sum follows the units: size buckets at stages 0-1, modules at 2-3, so the last bits may differ).
        slices = [g[lo:hi] for g, (lo, hi) in zip(owned_grads, ranges)] if self.stage == 0 else owned_grads
        sumsq = torch.stack([s.pow(2).sum() for s in slices]).sum()
        reduced = comm.all_reduce(torch.stack([loss.detach().to(sumsq.dtype), sumsq]), tag="metrics")

        from fzero.optim import apply_inplace

        owned_params = _owned(layout, flats, self.stage, comm.rank)
        grad_tree = {u.name: g for u, g in zip(units, owned_grads)}
        lr = current_lr(self.optimizer, int(state.step))
        opt_state = apply_inplace(self.optimizer, grad_tree, state.opt_state, owned_params)
        del grad_tree, owned_grads, slices
        if self.stage in (1, 2):
            for u, (lo, hi) in zip(units, ranges):
                comm.all_gather(flats[u.name], flats[u.name][lo:hi], tag="params")

        metrics = {
            "loss": float(reduced[0]) / n,
            "grad_norm": math.sqrt(float(reduced[1])),
            "lr": lr,
            "step": int(state.step) + 1,
        }
        if aux is not None:
            metrics["aux"] = aux
        new_state = dataclasses.replace(state, params=dict(flats), opt_state=opt_state, step=state.step + 1, meta=meta)
        return new_state, metrics

    # -- gather ------------------------------------------------------------------------------------
    def gather(self, state: TrainState | RankStates) -> Any:
        """Full params as a fresh pytree with the structure ``init`` was given (e.g. a dict like ``params_of``)."""
        self._check_state(state, api="fzero.Step.gather")
        rank_state = state.states[0] if isinstance(state, RankStates) else state
        layout = rank_state.meta.layout
        flats = rank_state.params
        if self.stage == 3:
            if isinstance(state, RankStates):  # every rank's shard is in this process
                flats = {u.name: torch.cat([s.params[u.name] for s in state.states]) for u in layout.units}
            else:  # a collective: under dist_mesh every rank must call gather
                comm = self.mesh.comm() if isinstance(self.mesh, DistMesh) else None
                flats = {
                    u.name: comm.all_gather(torch.empty(u.padded, dtype=u.dtype), s, tag="gather") if comm else s
                    for u, s in ((u, flats[u.name]) for u in layout.units)
                }
        return optree.tree_map(lambda t: t.detach().clone(), layout.unpack(flats))

    # -- checks ------------------------------------------------------------------------------------
    def _check_state(self, state: Any, *, api: str = "fzero.Step.__call__") -> None:
        if is_donated(state):
            raise ValueError(
                f"{api}: this state was already passed to a step, which reused its buffers (donation). Use the "
                f"state that step returned: `state, metrics = step(state, batch)`; build steps with donate=False to keep old states."
            )
        local = isinstance(self.mesh, LocalMesh)
        expected = f"RankStates of {self.mesh.size} ranks (from this step's init)" if local else "TrainState (from this step's init)"
        if local and not isinstance(state, RankStates) or not local and not isinstance(state, TrainState):
            raise TypeError(f"{api}: expected a {expected}, got {type(state).__name__}. {_REINIT_HINT}")
        states = state.states if local else (state,)
        if local and len(states) != self.mesh.size:
            raise ValueError(f"{api}: state holds {len(states)} ranks but the step's local_mesh has {self.mesh.size}. {_REINIT_HINT}")
        for s in states:
            meta = s.meta
            if meta is None or meta.stage != self.stage or meta.world_size != self.world_size:
                made = "unknown" if meta is None else f"{STAGE_NAMES[meta.stage]} on {meta.world_size} rank(s)"
                raise ValueError(
                    f"{api}: state was made for {made}, but this step is {STAGE_NAMES[self.stage]} on "
                    f"{self.world_size} rank(s). {_REINIT_HINT}"
                )


_REINIT_HINT = "Make the state with this step's init(params); to move a state between steps: new_step.init(old_step.gather(old_state))."


def current_lr(optimizer: Any, step: int) -> float:
    """The learning rate ``optimizer`` applies at ``step`` (its ``learning_rate``: a float or a schedule); NaN if it has none."""
    lr = getattr(optimizer, "learning_rate", None)
    if lr is None:
        return math.nan
    return float(lr(step)) if callable(lr) else float(lr)


def _differentiate(objective: Callable, inputs: list[torch.Tensor], autodiff: str):
    """Gradient of ``objective``'s loss with respect to ``inputs``, and its aux, by torch.func or plain autograd."""
    if autodiff == "func":
        return torch.func.grad(objective, has_aux=True)(inputs)
    leaves = [x.detach().requires_grad_() for x in inputs]  # aliases of the state's buffers, as leaves
    with torch.enable_grad():
        loss, aux = objective(leaves)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    return list(grads), optree.tree_map(lambda t: t.detach(), aux)


def _owned(layout: Layout, flats: dict[str, torch.Tensor], stage: int, rank: int) -> dict[str, torch.Tensor]:
    """What this rank's optimizer updates: whole unit buffers at stage 0, views of its shard at stages 1-2,
    the shards themselves at stage 3 (where ``flats`` holds only shards)."""
    if stage in (0, 3):
        return dict(flats)
    return {u.name: flats[u.name][slice(*u.shard_range(rank, layout.world_size))] for u in layout.units}


def _copy(flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in flats.items()}


def _split_loss(out: Any) -> tuple[torch.Tensor, Any]:
    loss, aux = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"fzero.train_step: loss_fn must return a scalar tensor or a (loss, aux) pair; got {type(out).__name__}. "
            f"Return e.g. F.cross_entropy(logits, y), or (loss, {{'acc': acc}})."
        )
    if loss.dim() != 0 or not loss.is_floating_point():
        raise ValueError(
            f"fzero.train_step: loss_fn must return a 0-d floating-point loss; got a {loss.dtype} tensor of shape "
            f"{tuple(loss.shape)}. Reduce it to a scalar, e.g. loss.mean()."
        )
    return loss, aux


def split_batch(batch: Any, n: int) -> list[Any]:
    """Split every tensor of the global ``batch`` on dim 0 into n equal per-rank batches (other leaves are copied to all)."""
    paths, leaves, spec = _tree.flatten_with_paths(batch)
    per_rank: list[list[Any]] = [[] for _ in range(n)]
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0 or leaf.shape[0] % n:
                size = "a 0-d tensor" if leaf.dim() == 0 else f"dim 0 of size {leaf.shape[0]}"
                raise ValueError(
                    f"fzero.Step.__call__: under local_mesh({n}) the global batch is split on dim 0 across {n} ranks, but "
                    f"batch leaf {path or '<root>'!r} has {size}, which does not divide by {n}. Pass a batch whose dim 0 "
                    f"is a multiple of {n} (e.g. drop the last partial batch)."
                )
            chunks = leaf.chunk(n)
        else:
            chunks = [leaf] * n
        for r in range(n):
            per_rank[r].append(chunks[r])
    return [spec.unflatten(leaves_r) for leaves_r in per_rank]


def train_step(loss_fn: Callable[..., Any], optimizer: Any, *, mesh: Mesh | None = None, **details: Any) -> Step:
    """Stage 0: a pure ``(state, batch) -> (state, metrics)`` step; gradients are all-reduced on a mesh (DDP).

    ``loss_fn(params, batch)`` returns a scalar loss or ``(loss, aux)``. Details: ``unit_elements`` (size of
    the flat buffers that collectives move, default 16 Mi elements) and ``donate`` (default True).
    """
    if not callable(loss_fn):
        raise TypeError(f"fzero.train_step: loss_fn must be callable as loss_fn(params, batch), got {type(loss_fn).__name__}.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"fzero.train_step: optimizer must be an (init, update) GradientTransformation such as fzero.optim.adamw(1e-3), "
            f"got {type(optimizer).__name__}. (torch.optim optimizers are stateful objects and are not accepted.)"
        )
    if mesh is not None and not isinstance(mesh, (LocalMesh, DistMesh)):
        raise TypeError(f"fzero.train_step: mesh must be fzero.local_mesh(n), fzero.dist_mesh() or None, got {mesh!r}.")
    return dataclasses.replace(Step(loss_fn, optimizer, mesh), **check_details(details, api="fzero.train_step"))


_DETAILS = {"unit_elements": int, "donate": bool, "autodiff": ("func", "autograd")}


def check_details(details: dict[str, Any], *, api: str) -> dict[str, Any]:
    import difflib

    for key, value in details.items():
        if key not in _DETAILS:
            close = difflib.get_close_matches(key, list(_DETAILS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{api}: unknown setting {key!r}.{hint} Settings: {', '.join(sorted(_DETAILS))}.")
        kind = _DETAILS[key]
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"{api}: {key} must be one of {kind}, got {value!r}.")
        elif not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 1)):
            raise ValueError(f"{api}: {key} must be {'a positive int' if kind is int else 'True or False'}, got {value!r}.")
    return details
